// Per-column sum and sum of squares of a stored [M, N] matrix, in fp64: the training statistics of
// the portable GEMM path (IEEE fp32, unaligned rows), which stores z and then sums it.
//
// A block owns a band of 32 adjacent columns and strides over all the rows, so each column is
// reduced by one block in a fixed order: results are deterministic. 1024-thread blocks while the
// bands fit one per SM, 512 beyond (two per SM, one wave). Within the block:
//  - vector kernel (rows 16-byte aligned, N a multiple of the vector): each thread loads 16 bytes
//    (4 fp32 or 8 16-bit values) of a row, 4 rows at a time so that 4 loads are in flight before
//    the first use. The 32 columns of a band are 128 bytes (fp32) or 64 bytes (16-bit) of a row, so
//    every load instruction of a warp moves 512 bytes in whole sectors; the scalar kernel moved
//    64-128 bytes per instruction and reached half the copy bandwidth on 16-bit z.
//  - scalar kernel (anything else): one element per thread and row.
// Each thread accumulates in fp64; lanes holding the same columns are summed with shuffles, then
// the warps through shared memory, always in the same order.
#include "cuda_utils.cuh"
#include "fallback.hpp"

namespace epifuse::fallback {
namespace {

constexpr int kCols = 32;  // columns per block
constexpr int kRowsInFlight = 4;

// Sums of the warps' partials for the block's 32 columns, in warp order; thread `col` of warp 0
// writes the result.
template <int kWarps>
__device__ void finish_band(double (*part_sum)[kCols], double (*part_sq)[kCols], int64_t col0,
                            int64_t N, double* __restrict__ colsum, double* __restrict__ colsumsq) {
  __syncthreads();
  if (threadIdx.x < kCols) {
    const int c = threadIdx.x;
    double s = 0.0, q = 0.0;
    for (int w = 0; w < kWarps; ++w) {
      s += part_sum[w][c];
      q += part_sq[w][c];
    }
    if (col0 + c < N) {
      colsum[col0 + c] = s;
      colsumsq[col0 + c] = q;
    }
  }
}

template <class T, int kThreads>
__global__ void __launch_bounds__(kThreads)
column_stats_vec_kernel(int64_t M, int64_t N, const T* __restrict__ z, int64_t ld,
                        double* __restrict__ colsum, double* __restrict__ colsumsq) {
  using V = Vec16<T>;
  constexpr int kVec = V::kSize;              // elements per 16-byte load
  constexpr int kLanesPerRow = kCols / kVec;  // 8 (fp32) or 4 (16-bit) threads cover a band row
  constexpr int kRowGroups = kThreads / kLanesPerRow;
  constexpr int kWarps = kThreads / 32;
  __shared__ double part_sum[kWarps][kCols];
  __shared__ double part_sq[kWarps][kCols];

  const int lane = threadIdx.x % 32;
  const int sub = threadIdx.x % kLanesPerRow;  // which vector of the band row
  const int group = threadIdx.x / kLanesPerRow;
  const int64_t col0 = int64_t(blockIdx.x) * kCols;
  const int64_t col = col0 + int64_t(sub) * kVec;
  double s[kVec] = {}, q[kVec] = {};
  if (col < N) {  // N is a multiple of kVec, so a vector is either wholly inside or outside
    const T* base = z + col;
    int64_t row = group;
    for (; row + (kRowsInFlight - 1) * kRowGroups < M; row += kRowsInFlight * kRowGroups) {
      V v[kRowsInFlight];
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r)
        v[r] = *reinterpret_cast<const V*>(base + (row + r * kRowGroups) * ld);
#pragma unroll
      for (int r = 0; r < kRowsInFlight; ++r)
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const double x = to_float(v[r].v[e]);
          s[e] += x;
          q[e] = fma(x, x, q[e]);
        }
    }
    for (; row < M; row += kRowGroups) {
      const V v = *reinterpret_cast<const V*>(base + row * ld);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const double x = to_float(v.v[e]);
        s[e] += x;
        q[e] = fma(x, x, q[e]);
      }
    }
  }
  // Lanes sub, sub + kLanesPerRow, ... of a warp hold the same columns (different rows).
#pragma unroll
  for (int offset = kLanesPerRow; offset < 32; offset *= 2)
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      s[e] += __shfl_xor_sync(0xffffffffu, s[e], offset);
      q[e] += __shfl_xor_sync(0xffffffffu, q[e], offset);
    }
  if (lane < kLanesPerRow) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      part_sum[warp][lane * kVec + e] = s[e];
      part_sq[warp][lane * kVec + e] = q[e];
    }
  }
  finish_band<kWarps>(part_sum, part_sq, col0, N, colsum, colsumsq);
}

template <class T, int kThreads>
__global__ void __launch_bounds__(kThreads)
column_stats_scalar_kernel(int64_t M, int64_t N, const T* __restrict__ z, int64_t ld,
                           double* __restrict__ colsum, double* __restrict__ colsumsq) {
  constexpr int kWarps = kThreads / 32;
  __shared__ double part_sum[kWarps][kCols];
  __shared__ double part_sq[kWarps][kCols];
  const int lane = threadIdx.x % 32;  // one column per lane, one row per warp
  const int warp = threadIdx.x / 32;
  const int64_t col0 = int64_t(blockIdx.x) * kCols;
  const int64_t col = col0 + lane;
  double s = 0.0, q = 0.0;
  if (col < N) {
    for (int64_t row = warp; row < M; row += kWarps) {
      const double v = to_float(z[row * ld + col]);
      s += v;
      q = fma(v, v, q);
    }
  }
  part_sum[warp][lane] = s;
  part_sq[warp][lane] = q;
  finish_band<kWarps>(part_sum, part_sq, col0, N, colsum, colsumsq);
}

template <class T, int kThreads>
void launch(bool vec, unsigned blocks, int64_t M, int64_t N, const T* z, int64_t ld,
            double* colsum, double* colsumsq, cudaStream_t stream) {
  if (vec) {
    column_stats_vec_kernel<T, kThreads><<<blocks, kThreads, 0, stream>>>(M, N, z, ld, colsum, colsumsq);
  } else {
    column_stats_scalar_kernel<T, kThreads><<<blocks, kThreads, 0, stream>>>(M, N, z, ld, colsum, colsumsq);
  }
}

}  // namespace

void column_stats(DType dtype, int64_t M, int64_t N, const void* z, int64_t ld, double* colsum,
                  double* colsumsq, cudaStream_t stream) {
  if (N == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = Vec16<T>::kSize;
    const unsigned blocks = unsigned((N + kCols - 1) / kCols);
    const T* zt = static_cast<const T*>(z);
    const bool vec = is_aligned16(z) && ld % kVec == 0 && N % kVec == 0;
    // Up to one band per SM, 1024 threads keep enough loads in flight per SM; with more bands,
    // 512-thread blocks let all of them (two per SM) run in one wave instead of two.
    if (blocks > unsigned(sm_count(current_device()))) {
      launch<T, 512>(vec, blocks, M, N, zt, ld, colsum, colsumsq, stream);
    } else {
      launch<T, 1024>(vec, blocks, M, N, zt, ld, colsum, colsumsq, stream);
    }
  });
  check_launch("column_stats");
}

}  // namespace epifuse::fallback
