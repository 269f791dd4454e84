// Adds the per-tile partial column statistics that the Hopper training GEMM's epilogue leaves (see
// run_column_stats in sm90_gemm.cuh for why the GEMM does not add them itself).
#include "cuda_utils.cuh"
#include "tile_partials.hpp"

namespace epifuse {
namespace {

constexpr int kColumns = 32;  // columns per block: one warp's coalesced row of partials
constexpr int kSlices = 8;    // threads per column, each summing every kSlices-th tile

// Thread (slice, lane) adds tiles slice, slice + kSlices, ... of column blockIdx.x * 32 + lane; the
// slices are then added in slice order: a fixed order, whatever the launch.
__global__ void __launch_bounds__(kColumns * kSlices)
sum_tile_partials_kernel(int64_t N, int64_t tiles, int64_t stride, const double* __restrict__ psum,
                         const double* __restrict__ psumsq, double* colsum, double* colsumsq) {
  __shared__ double part[2][kSlices][kColumns];
  const int lane = threadIdx.x % kColumns;
  const int slice = threadIdx.x / kColumns;
  const int64_t n = int64_t(blockIdx.x) * kColumns + lane;
  double s = 0.0, s2 = 0.0;
  if (n < N) {
#pragma unroll 4
    for (int64_t t = slice; t < tiles; t += kSlices) {
      s += psum[t * stride + n];
      s2 += psumsq[t * stride + n];
    }
  }
  part[0][slice][lane] = s;
  part[1][slice][lane] = s2;
  __syncthreads();
  if (slice == 0 && n < N) {
#pragma unroll
    for (int i = 1; i < kSlices; ++i) {
      s += part[0][i][lane];
      s2 += part[1][i][lane];
    }
    colsum[n] = s;
    colsumsq[n] = s2;
  }
}

}  // namespace

void sum_tile_partials(int64_t N, int64_t tiles, int64_t stride, const double* partial_sum,
                       const double* partial_sumsq, double* colsum, double* colsumsq,
                       cudaStream_t stream) {
  if (N == 0) return;
  const int64_t blocks = (N + kColumns - 1) / kColumns;
  sum_tile_partials_kernel<<<unsigned(blocks), kColumns * kSlices, 0, stream>>>(
      N, tiles, stride, partial_sum, partial_sumsq, colsum, colsumsq);
  check_launch("sum_tile_partials");
}

}  // namespace epifuse
