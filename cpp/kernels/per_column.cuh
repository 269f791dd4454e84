// One thread per column: the launch shape and parameter loads of the synchronized-statistics
// kernels (synced_moments.cu, synced_grad_sums.cu). Their per-column work is a few fp64 operations:
// latency-bound, so spread over as many blocks as the columns need.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_utils.cuh"

namespace epifuse {

constexpr int kColumnThreads = 256;

// The grid-stride loop over the columns of this thread.
#define EPIFUSE_FOR_EACH_COLUMN(n, N)                                                 \
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < (N);          \
       n += int64_t(gridDim.x) * blockDim.x)

// Thread 0 of block 0: the one that writes a row's count (also when N == 0).
__device__ __forceinline__ bool first_thread() { return blockIdx.x == 0 && threadIdx.x == 0; }

// A column's optional parameters in fp64, as the fold reads them (absent: bias 0, scales 1).
struct ColumnScales {
  double bias, pre, post;
};

template <class P>
__device__ __forceinline__ ColumnScales column_scales(const FoldProblem& f, int64_t n) {
  return {load_or<P>(f.bias, f.N, n, 0.0), load_or<P>(f.pre_scale, f.pre_scale_numel, n, 1.0),
          load_or<P>(f.post_scale, f.post_scale_numel, n, 1.0)};
}

// Launches over f.N columns (at least one block, whose first thread writes the count):
// launch(tag, blocks) with tag a value of the parameters' element type, then checks the launch.
template <class Launch>
void launch_per_column(const FoldProblem& f, const char* what, Launch&& launch) {
  const int64_t blocks = std::max<int64_t>((f.N + kColumnThreads - 1) / kColumnThreads, 1);
  dispatch_dtype(f.param_dtype,
                 [&](auto tag) { launch(tag, unsigned(std::min<int64_t>(blocks, 65535))); });
  check_launch(what);
}

}  // namespace epifuse
