// The 3xTF32 split of a weight, kept while the weight does not change.
//
// The Hopper 3xTF32 GEMM multiplies operands split into TF32 hi/lo parts (split_tf32.cu). Splitting
// the weight costs a read of it and a write of twice its size on every call; for a weight that stays
// the same between calls (inference) the split can be made once. A weight that changes between calls
// (training: the optimizer updates it in place every step) gains nothing from a cache and would pin
// twice its size in memory, so a split is kept only after two calls in a row see the same version:
//   - the key is the view (storage, offset, sizes, strides): W and the backward's W^T are two keys;
//   - the value is valid while the storage is alive and its version counter (shared by every view
//     of it, bumped by every in-place write) is unchanged.
// Under CUDA graph capture nothing is cached or returned: a captured GEMM splits inside the graph,
// so its replays see the weight as it is then.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include "epifuse/kernels.h"

namespace epifuse {

// The split of p's weight (p.w, viewed through `w`) if it is worth keeping: a defined float32 tensor
// of split_weight_floats(p) elements; undefined otherwise (the GEMM then splits into its workspace).
at::Tensor cached_weight_split(const at::Tensor& w, const GemmProblem& p, cudaStream_t stream);

}  // namespace epifuse
