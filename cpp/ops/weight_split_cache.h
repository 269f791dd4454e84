// Operands made from a weight (its 3x split, its 16-bit cast under autocast), kept while the
// weight does not change.
//
// The Hopper 3x GEMM multiplies operands split into FP16 hi/lo parts (split_fp16.cu), and a head
// under autocast multiplies a 16-bit cast of the weight. Making either costs a read of the weight and
// a write of the operand on every call; for a weight that stays the same between calls (inference)
// it can be made once. A weight that changes between calls (training: the optimizer updates it in
// place every step) gains nothing from a cache and would pin the operand in memory (twice the
// weight's bytes for a split, half of them for a cast), so an operand is kept only after two calls in a row
// see the same version:
//   - the key is the view (storage, offset, sizes, strides) and the kind of operand: W's split and
//     its bf16 cast are two keys;
//   - the value is valid while the storage is alive and its version counter (shared by every view
//     of it made through autograd, bumped by every in-place write) is unchanged.
// Only a layer's weight as the caller passed it is looked up here. A view made inside an op, below
// autograd's ADInplaceOrView key, gets a version counter of its own that no write to its base bumps:
// the backward's products (W^T for dX, x^T for dW) are such views, and keeping their splits
// returned stale gradients after the first optimizer step; they never keep (gemm_runner.h,
// WeightSplit).
// Streams: an operand is made on the caller's stream; a caller on another stream waits for it (an
// event recorded after it was made) and the allocator is told that stream uses it (record_stream),
// so neither a read before it is written nor a reuse of its memory while that stream reads it.
// Under CUDA graph capture nothing is cached or returned: a captured GEMM makes its operand inside
// the graph, so its replays see the weight as it is then.
// An inference tensor (torch.inference_mode) has no version counter: its operands are never kept.
// Only a forward that feeds no backward keeps (eval, torch.no_grad: fused_head opens a
// WeightOperandsKept scope for it): a training step's weight changes every step, and a weight that
// does not (frozen layers, linear probing) would hold its operand beside the step's own memory, so
// training keeps nothing and stays at eager's resident memory (problem 84's split: 256 MiB).
// A write the version counter does not see (through `weight.data`, or from outside PyTorch) leaves
// a kept operand stale, as it would leave any version-keyed cache: write a weight in place through
// the parameter itself (under torch.no_grad(), as optimizers and load_state_dict do), which bumps
// its version.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "epifuse/kernels.h"

namespace epifuse {

// Whether calls on this thread may keep operands: true by default (a direct op call); a scope sets
// it for the calls inside it and restores it after.
class WeightOperandsKept {
 public:
  explicit WeightOperandsKept(bool allowed);
  ~WeightOperandsKept();
  WeightOperandsKept(const WeightOperandsKept&) = delete;
  WeightOperandsKept& operator=(const WeightOperandsKept&) = delete;
  static bool allowed();

 private:
  bool saved_;
};

// The split of p's weight (p.w, viewed through `w`) if it is worth keeping: a defined uint8 tensor
// of split_weight_bytes(p) bytes; undefined otherwise (the GEMM then splits into its workspace).
at::Tensor cached_weight_split(const at::Tensor& w, const GemmProblem& p, cudaStream_t stream);

// w.to(dtype), kept while w is unchanged (CUDA tensors; elsewhere, and under capture, a plain cast).
at::Tensor kept_weight_cast(const at::Tensor& w, at::ScalarType dtype);

}  // namespace epifuse
