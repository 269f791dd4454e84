// Per-column sum and sum of squares of a stored [M, N] matrix, in fp64. Only the portable GEMM path
// needs it: the Hopper GEMM gathers these statistics in its epilogue instead.
// A block owns 32 adjacent columns (one coalesced 32-element segment per row) and strides over the
// rows with 32 row groups; the fixed reduction order keeps results deterministic.
#include "cuda_utils.cuh"
#include "fallback.hpp"

namespace epifuse::fallback {
namespace {

constexpr int kCols = 32;
constexpr int kRowGroups = 32;

template <class T>
__global__ void __launch_bounds__(kCols * kRowGroups)
column_stats_kernel(int64_t M, int64_t N, const T* __restrict__ z, int64_t ld,
                    double* __restrict__ colsum, double* __restrict__ colsumsq) {
  __shared__ double part_sum[kRowGroups][kCols + 1];
  __shared__ double part_sq[kRowGroups][kCols + 1];
  const int lane = threadIdx.x % kCols;
  const int group = threadIdx.x / kCols;
  const int64_t col = int64_t(blockIdx.x) * kCols + lane;
  double s = 0.0, q = 0.0;
  if (col < N) {
    for (int64_t row = group; row < M; row += kRowGroups) {
      const double v = to_float(z[row * ld + col]);
      s += v;
      q += v * v;
    }
  }
  part_sum[group][lane] = s;
  part_sq[group][lane] = q;
  __syncthreads();
  if (group == 0 && col < N) {
    for (int g = 1; g < kRowGroups; ++g) {
      s += part_sum[g][lane];
      q += part_sq[g][lane];
    }
    colsum[col] = s;
    colsumsq[col] = q;
  }
}

}  // namespace

void column_stats(DType dtype, int64_t M, int64_t N, const void* z, int64_t ld, double* colsum,
                  double* colsumsq, cudaStream_t stream) {
  if (N == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = unsigned((N + kCols - 1) / kCols);
    column_stats_kernel<T><<<blocks, kCols * kRowGroups, 0, stream>>>(
        M, N, static_cast<const T*>(z), ld, colsum, colsumsq);
  });
  check_launch("column_stats");
}

}  // namespace epifuse::fallback
