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
// Two policies, by what the forward feeds (fused_head opens a WeightOperandsKept scope):
//   - kRepeated, a forward that feeds no backward (eval, torch.no_grad): kept from the second call
//     in a row that sees the same version, until the weight changes (an eval model splits or
//     casts its weights once);
//   - kStep, a forward that feeds a backward (training): shared by the step's forwards, kept from
//     the first call that sees a version until the first backward of any head starts
//     (release_step_operands). A step that runs two views through a head (SSL heads: each view a
//     call) splits or casts each weight once instead of once per view, as eager's autocast casts
//     it once per region. The backward frees them so that a step's peak, which is in its backward
//     (the weights' gradients), stays at eager's: a step's forwards hold one operand per weight
//     (a split: the weight's bytes; a cast: half of them) beside their activations, below the
//     gradients the backward then allocates. The backward's own products never keep (below). A
//     training forward never followed by a backward leaves its operands kept until the weight
//     changes or a backward runs: one per weight, at most kMaxEntries.
// EPIFUSE_STEP_OPERANDS=0 turns kStep into "keep nothing" (the behaviour before the sharing).
// A write the version counter does not see (through `weight.data`, or from outside PyTorch) leaves
// a kept operand stale, as it would leave any version-keyed cache: write a weight in place through
// the parameter itself (under torch.no_grad(), as optimizers and load_state_dict do), which bumps
// its version.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "epifuse/kernels.h"

namespace epifuse {

// When calls on this thread keep operands: kRepeated by default (a direct op call); a scope sets
// it for the calls inside it and restores it after.
enum class KeepPolicy { kRepeated, kStep };

class WeightOperandsKept {
 public:
  explicit WeightOperandsKept(KeepPolicy policy);
  ~WeightOperandsKept();
  WeightOperandsKept(const WeightOperandsKept&) = delete;
  WeightOperandsKept& operator=(const WeightOperandsKept&) = delete;
  static KeepPolicy policy();

 private:
  KeepPolicy saved_;
};

// Drops the operands kept for a step's forwards (kStep); a backward calls it as it starts.
void release_step_operands();

// The split of p's weight (p.w, viewed through `w`) if it is worth keeping: a defined uint8 tensor
// of split_weight_bytes(p) bytes; undefined otherwise (the GEMM then splits into its workspace).
at::Tensor cached_weight_split(const at::Tensor& w, const GemmProblem& p, cudaStream_t stream);

// w.to(dtype), kept while w is unchanged (CUDA tensors; elsewhere, and under capture, a plain cast).
at::Tensor kept_weight_cast(const at::Tensor& w, at::ScalarType dtype);

}  // namespace epifuse
