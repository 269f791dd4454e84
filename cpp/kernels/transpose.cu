// A transposing copy through shared memory: reads and writes both coalesced, so it runs near copy
// bandwidth, where a strided copy (Tensor::contiguous of a transposed view) reads one element per
// 32-byte sector. The backward's TF32 GEMMs use it to hand cuBLAS K-major operands
// (cublas_k_major_copies.cu).
#include <algorithm>
#include <climits>
#include <stdexcept>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kTile = 32;     // a tile of 32 x 32 elements
constexpr int kTileRows = 8;  // a block of 32 x 8 threads, 4 elements each

template <class T>
__global__ void __launch_bounds__(kTile * kTileRows)
transpose_tiles_kernel(const T* __restrict__ src, int64_t ld_src, T* __restrict__ dst,
                       int64_t ld_dst, int64_t rows, int64_t cols) {
  __shared__ T tile[kTile][kTile + 1];  // +1: the column reads hit 32 different banks
  const int64_t c0 = int64_t(blockIdx.x) * kTile;  // dst columns = src rows
  for (int64_t r0 = int64_t(blockIdx.y) * kTile; r0 < rows; r0 += int64_t(gridDim.y) * kTile) {
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (c < cols && r < rows) tile[j][threadIdx.x] = src[c * ld_src + r];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t r = r0 + j, c = c0 + threadIdx.x;
      if (r < rows && c < cols) dst[r * ld_dst + c] = tile[threadIdx.x][j];
    }
    __syncthreads();
  }
}

}  // namespace

void transpose(const void* src, int64_t ld_src, void* dst, int64_t ld_dst, int64_t rows,
               int64_t cols, DType dtype, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  if (col_tiles > INT_MAX) throw std::runtime_error("epifuse::transpose: too many columns");
  const int64_t row_tiles = std::min<int64_t>((rows + kTile - 1) / kTile, 65535);
  const dim3 grid{unsigned(col_tiles), unsigned(row_tiles)};
  const dim3 block{kTile, kTileRows};
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    transpose_tiles_kernel<T><<<grid, block, 0, stream>>>(static_cast<const T*>(src), ld_src,
                                                          static_cast<T*>(dst), ld_dst, rows, cols);
  });
  check_launch("transpose");
}

}  // namespace epifuse
