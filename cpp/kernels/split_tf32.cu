// The operand pre-pass of the Hopper 3xTF32 GEMM (sm90_mainloop_3xtf32.hpp): every fp32 value v
// becomes hi = tf32(v) and lo = tf32(v - hi) (round to nearest; v - hi is exact in fp32), written in
// the mainloop's K-tile layout: per row, blocks of 32 floats holding the 16 hi parts of 16
// consecutive k, then their 16 lo parts; K is zero-padded to a multiple of 16.
//
// The source may be any strided 2-D view: K-contiguous (x, the weight for the forward) or
// row-contiguous (a transposed view, as the backward's dX = dZ.W and dW = dZ^T.X need, since TF32
// wgmma reads K-major operands only). A 32x32 tile goes through shared memory so that both the
// reads (along whichever extent is contiguous) and the writes (along K) are coalesced.
//
// NaN and +-Inf keep hi = v, lo = 0, and their row is flagged: the GEMM then recomputes such rows of
// x in IEEE fp32 (the cross terms Inf * 0 would be NaN), see nonfinite_rows.cu. Flagging here saves
// that pass a read of x.
#include <algorithm>

#include "cuda_utils.cuh"
#include "split_tf32.hpp"

namespace epifuse {
namespace {

constexpr int kTile = 32;  // rows x k per block
constexpr int kRowsPerPass = 8;

__device__ __forceinline__ float round_to_tf32(float v) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(v));
  return __uint_as_float(bits);
}

__global__ void __launch_bounds__(kTile * kRowsPerPass)
split_tf32_kernel(const float* __restrict__ src, int64_t rows, int64_t cols, int64_t ld_row,
                  int64_t ld_col, float* __restrict__ dst, int64_t dst_ld,
                  int* __restrict__ nonfinite_rows) {
  __shared__ float tile[kTile][kTile + 1];  // [row][k], +1: no bank conflicts either way
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, k0 = int64_t(blockIdx.x) * kTile;
  if (ld_col == 1 || ld_row != 1) {  // lanes along k
    for (int r = ty; r < kTile; r += kRowsPerPass) {
      const int64_t row = r0 + r, k = k0 + tx;
      tile[r][tx] = (row < rows && k < cols) ? src[row * ld_row + k * ld_col] : 0.f;
    }
  } else {  // row-contiguous source (a transposed view): lanes along rows
    for (int kk = ty; kk < kTile; kk += kRowsPerPass) {
      const int64_t row = r0 + tx, k = k0 + kk;
      tile[tx][kk] = (row < rows && k < cols) ? src[row + k * ld_col] : 0.f;
    }
  }
  __syncthreads();
  // Lane tx handles k = k0 + tx: block j = tx / 16 of 16 k, position i = tx % 16 within it.
  const int j = tx / 16, i = tx % 16;
  const int64_t padded_cols = dst_ld / 2;
  if (k0 + tx >= padded_cols) return;
  for (int r = ty; r < kTile; r += kRowsPerPass) {
    const int64_t row = r0 + r;
    if (row >= rows) break;
    const float v = tile[r][tx];
    float hi = v, lo = 0.f;
    if (isfinite(v)) {
      hi = round_to_tf32(v);
      lo = round_to_tf32(v - hi);
    } else if (nonfinite_rows != nullptr) {
      nonfinite_rows[row] = 1;  // every writer stores 1
    }
    float* out = dst + row * dst_ld + (k0 / 16 + j) * 32;
    out[i] = hi;
    out[16 + i] = lo;
  }
}

}  // namespace

int64_t split_tf32_ld(int64_t cols) { return 2 * ((cols + 15) / 16 * 16); }

size_t split_tf32_bytes(int64_t rows, int64_t cols) {
  return (sizeof(float) * size_t(rows) * size_t(split_tf32_ld(cols)) + 255) / 256 * 256;
}

void split_tf32(const float* src, int64_t rows, int64_t cols, int64_t ld_row, int64_t ld_col,
                float* dst, int* nonfinite_rows, cudaStream_t stream) {
  if (nonfinite_rows != nullptr && rows > 0)
    cudaMemsetAsync(nonfinite_rows, 0, sizeof(int) * size_t(rows), stream);
  if (rows == 0 || cols == 0) return;
  const int64_t padded = split_tf32_ld(cols) / 2, dst_ld = split_tf32_ld(cols);
  // Rows go on grid.y, at most 65535 tiles a launch: a taller operand (a batch of over 2^21 rows)
  // is split in bands of rows, one launch each.
  constexpr int64_t kBandRows = int64_t(65535) * kTile;
  for (int64_t r = 0; r < rows; r += kBandRows) {
    const int64_t band = std::min(kBandRows, rows - r);
    const dim3 grid(unsigned((padded + kTile - 1) / kTile), unsigned((band + kTile - 1) / kTile));
    split_tf32_kernel<<<grid, dim3(kTile, kRowsPerPass), 0, stream>>>(
        src + r * ld_row, band, cols, ld_row, ld_col, dst + r * dst_ld, dst_ld,
        nonfinite_rows != nullptr ? nonfinite_rows + r : nullptr);
    check_launch("split_tf32");
  }
}

}  // namespace epifuse
