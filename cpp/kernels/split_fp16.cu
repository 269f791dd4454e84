// The operand pre-pass of the Hopper 3x GEMM (sm90_mainloop_3x.hpp): fp32 at fp32 accuracy on
// the FP16 tensor cores. FP16 keeps TF32's 11 significant bits at twice TF32's wgmma rate, but not
// fp32's exponent range, so each operand row (its K extent) is scaled by a power of two that puts
// its largest |v| in [2^14, 2^15): hi = fp16(v * 2^-e) and lo = fp16(v * 2^-e - hi) then hold
// v's leading 22 bits for every value down to 2^-18 of its row's largest (below that lo is
// subnormal and keeps fewer, down to nothing at 2^-40: such a value is off by at most 2^-40 of the
// row's largest, 2^-16 of the 2^-24 that SGEMM's rounding costs a sum holding the largest's product). The GEMM's epilogue multiplies
// the product back by 2^(e_x[m] + e_w[n]), exactly. Against the TF32 split it replaced (same
// mainloop, TF32 k-blocks): the GEMM 1.7x faster at problem 39's and 84's shapes, the error 0.6-0.8x
// its (0.15-0.6x SGEMM's), the split half its bytes (experiments/fp16x3_split.cu).
//
// Two paths:
//  - rows along K, 16-byte aligned, K <= 8192 (the forward's x and weight): one block per row,
//    the row held in registers between its maximum and its split: one read, one write;
//  - any other strides (the backward's transposed views) or K: tiles through shared memory, so
//    that reads along whichever extent is contiguous and writes along K are coalesced; a first
//    pass takes the rows' maxima (atomicMax on the bits of non-negative floats; for a row-
//    contiguous source straight from global memory), the second splits. A row-contiguous source
//    (a transposed view: dX's W^T, dW's dZ^T and X^T) with 16-byte rows of 4 takes 64 x 64 tiles
//    moved in 16-byte vectors both ways; anything else 32 x 64 tiles of single elements.
//
// NaN and +-Inf keep hi = v (FP16's NaN / Inf), lo = 0, leave the row's scale to its finite
// values, and flag the row: the GEMM then recomputes such rows of x in IEEE fp32 (the cross terms
// Inf * 0 would be NaN), see nonfinite_rows.cu. Flagging here saves that pass a read of x.
#include <algorithm>

#include "cuda_utils.cuh"
#include "debug_switches.hpp"
#include "split_fp16.hpp"

namespace epifuse {
namespace {

constexpr int kBlock = 64;           // halves per layout block: 32 hi, then 32 lo
constexpr int kBlockK = kBlock / 2;  // k per layout block
constexpr int kRowThreads = 256;     // the row path's block
constexpr int kTile = 32;            // the tiled path: rows x k per block
constexpr int kRowsPerPass = 8;

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The exponent e of a row whose largest finite |v| is m: m * 2^-e in [2^14, 2^15); 0 for a row of
// zeros.
__device__ __forceinline__ int row_exponent(float m) { return m > 0.f ? ilogbf(m) - 14 : 0; }

// v's hi and lo parts at exponent e; a NaN or Inf stays itself in hi.
__device__ __forceinline__ void split_value(float v, int e, __half& hi, __half& lo) {
  if (!isfinite(v)) {
    hi = __float2half_rn(v);
    lo = __float2half_rn(0.f);
    return;
  }
  const float a = ldexpf(v, -e);  // exact: a power of two
  hi = __float2half_rn(a);
  lo = __float2half_rn(a - __half2float(hi));  // a - hi is exact in fp32
}

__device__ __forceinline__ float finite_abs(float v) { return isfinite(v) ? fabsf(v) : 0.f; }

// ---- rows along K, in registers --------------------------------------------------------------
// kVecs float4 per thread: rows of up to kVecs * 4 * kRowThreads values.
template <int kVecs>
__global__ void __launch_bounds__(kRowThreads)
split_fp16_rows_kernel(const float* __restrict__ src, int64_t cols, int64_t ld_row,
                  __half* __restrict__ parts, int64_t ld, float* __restrict__ exponents,
                  int* __restrict__ nonfinite_rows) {
  const int64_t row = blockIdx.x;
  const float4* s = reinterpret_cast<const float4*>(src + row * ld_row);
  float4 v[kVecs];
  float m = 0.f;
  bool finite = true;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t k = (int64_t(i) * kRowThreads + threadIdx.x) * 4;
    v[i] = k < cols ? s[k / 4] : make_float4(0.f, 0.f, 0.f, 0.f);
    m = fmaxf(m, fmaxf(fmaxf(finite_abs(v[i].x), finite_abs(v[i].y)),
                       fmaxf(finite_abs(v[i].z), finite_abs(v[i].w))));
    finite = finite && isfinite(v[i].x) && isfinite(v[i].y) && isfinite(v[i].z) && isfinite(v[i].w);
  }
  __shared__ float warp_max[kRowThreads / 32];
  __shared__ int any_nonfinite;
  if (threadIdx.x == 0) any_nonfinite = 0;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (!finite) any_nonfinite = 1;  // every writer stores 1
  m = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  const int e = row_exponent(m);
  __half* d = parts + row * ld;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t k = (int64_t(i) * kRowThreads + threadIdx.x) * 4;
    if (k >= ld / 2) break;  // the padded K
    __align__(8) __half hi[4], lo[4];
    split_value(v[i].x, e, hi[0], lo[0]);
    split_value(v[i].y, e, hi[1], lo[1]);
    split_value(v[i].z, e, hi[2], lo[2]);
    split_value(v[i].w, e, hi[3], lo[3]);
    __half* out = d + (k / kBlockK) * kBlock + k % kBlockK;
    *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(hi);
    *reinterpret_cast<uint2*>(out + kBlockK) = *reinterpret_cast<const uint2*>(lo);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    exponents[row] = float(e);
    if (nonfinite_rows != nullptr) nonfinite_rows[row] = any_nonfinite;
  }
}

// ---- any strides, tiled ------------------------------------------------------------------------
// tile[r][k] <- src over the block's 32 rows x kWidth k (zero outside), lanes along the
// contiguous extent.
template <int kWidth>
__device__ __forceinline__ void load_tile(float (&tile)[kTile][kWidth + 1], const float* src,
                                          int64_t rows, int64_t cols, int64_t ld_row,
                                          int64_t ld_col, int64_t r0, int64_t k0) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  if (ld_col == 1 || ld_row != 1) {  // lanes along k
    for (int r = ty; r < kTile; r += kRowsPerPass) {
#pragma unroll
      for (int h = 0; h < kWidth; h += 32) {
        const int64_t row = r0 + r, k = k0 + h + tx;
        tile[r][h + tx] = (row < rows && k < cols) ? src[row * ld_row + k * ld_col] : 0.f;
      }
    }
  } else {  // row-contiguous source (a transposed view): lanes along rows
    for (int kk = ty; kk < kWidth; kk += kRowsPerPass) {
      const int64_t row = r0 + tx, k = k0 + kk;
      tile[tx][kk] = (row < rows && k < cols) ? src[row + k * ld_col] : 0.f;
    }
  }
}

// row_max[r] = max(row_max[r], bits of the largest finite |v| of the tile's part of row r).
__global__ void __launch_bounds__(kTile * kRowsPerPass)
split_fp16_row_max_kernel(const float* __restrict__ src, int64_t rows, int64_t cols, int64_t ld_row,
               int64_t ld_col, unsigned* __restrict__ row_max) {
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts either way
  const int64_t r0 = int64_t(blockIdx.y) * kTile, k0 = int64_t(blockIdx.x) * kTile;
  load_tile<kTile>(tile, src, rows, cols, ld_row, ld_col, r0, k0);
  __syncthreads();
  if (threadIdx.y != 0 || r0 + threadIdx.x >= rows) return;
  float m = 0.f;
#pragma unroll 8
  for (int k = 0; k < kTile; ++k) m = fmaxf(m, finite_abs(tile[threadIdx.x][k]));
  if (m > 0.f) atomicMax(row_max + r0 + threadIdx.x, __float_as_uint(m));  // m >= 0: bits order
}

// The same maxima for a row-contiguous source (a transposed view: ld_row == 1), straight from
// global memory: thread r of a block reads row r over a chunk of kMaxChunk k, the warp's reads of
// one k coalesced, one atomic per row and chunk. (The tiled kernel above, 4 values a thread through
// shared memory, made problem 39's x^T split 0.474 ms in all; with this one 0.395.)
constexpr int kMaxThreads = 256;
constexpr int kMaxChunk = 64;

__global__ void __launch_bounds__(kMaxThreads)
split_fp16_column_max_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                             int64_t ld_col, unsigned* __restrict__ row_max) {
  const int64_t row = int64_t(blockIdx.x) * kMaxThreads + threadIdx.x;
  if (row >= rows) return;
  const int64_t k0 = int64_t(blockIdx.y) * kMaxChunk, k1 = std::min(cols, k0 + kMaxChunk);
  const float* p = src + row + k0 * ld_col;
  float m = 0.f;
#pragma unroll 8
  for (int64_t k = k0; k < k1; ++k, p += ld_col) m = fmaxf(m, finite_abs(__ldg(p)));
  if (m > 0.f) atomicMax(row_max + row, __float_as_uint(m));  // m >= 0: bits order
}

// The split of a tile of 32 rows x 64 k (two layout blocks): lane tx splits k = 2tx, 2tx + 1 and
// stores each part as a half2, so a warp writes a row's 256 bytes whole (32 x 32 tiles of 2-byte
// stores: problem 39's x^T split 0.395 ms in all; these 0.327, against 0.132 for its row-major x).
constexpr int kSplitTileK = 2 * kBlockK;

__global__ void __launch_bounds__(kTile * kRowsPerPass)
split_fp16_tiles_kernel(const float* __restrict__ src, int64_t rows, int64_t cols, int64_t ld_row,
                        int64_t ld_col, const unsigned* __restrict__ row_max,
                        __half* __restrict__ parts, int64_t ld, float* __restrict__ exponents,
                        int* __restrict__ nonfinite_rows) {
  __shared__ float tile[kTile][kSplitTileK + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, k0 = int64_t(blockIdx.x) * kSplitTileK;
  load_tile<kSplitTileK>(tile, src, rows, cols, ld_row, ld_col, r0, k0);
  __syncthreads();
  const int kk = 2 * tx;
  const int64_t k = k0 + kk;
  if (k >= ld / 2) return;  // past the padded K (a multiple of 32: pairs never straddle it)
  for (int r = ty; r < kTile; r += kRowsPerPass) {
    const int64_t row = r0 + r;
    if (row >= rows) break;
    const int e = row_exponent(__uint_as_float(row_max[row]));
    const float v0 = tile[r][kk], v1 = tile[r][kk + 1];
    __half hi0, lo0, hi1, lo1;
    split_value(v0, e, hi0, lo0);
    split_value(v1, e, hi1, lo1);
    if (!(isfinite(v0) && isfinite(v1)) && nonfinite_rows != nullptr)
      nonfinite_rows[row] = 1;  // every writer: 1
    __half* out = parts + row * ld + (k / kBlockK) * kBlock + k % kBlockK;
    *reinterpret_cast<__half2*>(out) = __halves2half2(hi0, hi1);
    *reinterpret_cast<__half2*>(out + kBlockK) = __halves2half2(lo0, lo1);
    if (k0 == 0 && tx == 0) exponents[row] = float(e);
  }
}

// The split of a row-contiguous source (src[r, k] = src[r + k * ld_col]) in tiles of 64 rows x
// 64 k: thread (lane, q) loads the float4 of rows 4 lane .. 4 lane + 3 at k = q, q + 16, ..., so
// 16 lanes read 256 contiguous bytes; after the transpose through shared memory thread (j, r)
// splits k = 8j .. 8j + 7 of rows r and r + 32 and stores 16 bytes of hi parts and 16 of lo parts,
// a row's piece of a layout block written whole by four lanes. Four 16-byte loads and four
// 16-byte stores a thread, where the 32 x 64 tiles (above) take 8 single loads and 8 4-byte
// stores: with those, problem 39's X^T split (16384 x 4096 fp32, its maxima pass included) took
// 0.327 ms against 0.132 for its row-major X.
constexpr int kWideTile = 64;
constexpr int kWideThreads = 256;
constexpr int kWideStride = kWideTile + 1;  // a row of the tile: +1, 2-way bank conflicts at most

__global__ void __launch_bounds__(kWideThreads)
split_fp16_tiles_wide_kernel(const float* __restrict__ src, int64_t rows, int64_t cols,
                             int64_t ld_col, const unsigned* __restrict__ row_max,
                             __half* __restrict__ parts, int64_t ld, float* __restrict__ exponents,
                             int* __restrict__ nonfinite_rows) {
  __shared__ float tile[kWideTile * kWideStride];  // [row][k]
  __shared__ int exps[kWideTile];
  const int t = threadIdx.x;
  const int64_t r0 = int64_t(blockIdx.y) * kWideTile, k0 = int64_t(blockIdx.x) * kWideTile;
  {
    const int lane = t % 16, q = t / 16;
    const int64_t row = r0 + 4 * lane;  // rows % 4 == 0: all four rows or none
    float4 v[kWideTile / 16];
#pragma unroll
    for (int i = 0; i < kWideTile / 16; ++i) {
      const int64_t k = k0 + q + 16 * i;
      v[i] = (row < rows && k < cols)
                 ? __ldg(reinterpret_cast<const float4*>(src + row + k * ld_col))
                 : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < kWideTile / 16; ++i) {
      float* col = tile + (4 * lane) * kWideStride + q + 16 * i;
      col[0] = v[i].x, col[kWideStride] = v[i].y;
      col[2 * kWideStride] = v[i].z, col[3 * kWideStride] = v[i].w;
    }
  }
  if (t < kWideTile && r0 + t < rows) {
    const int e = row_exponent(__uint_as_float(row_max[r0 + t]));
    exps[t] = e;
    if (k0 == 0) exponents[r0 + t] = float(e);
  }
  __syncthreads();
  const int j = t % 8;
  const int64_t k = k0 + 8 * j;
  if (k >= ld / 2) return;  // past the padded K (a multiple of 32: groups of 8 never straddle it)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = t / 8 + 32 * half;
    const int64_t row = r0 + r;
    if (row >= rows) break;
    const int e = exps[r];
    const float* p = tile + r * kWideStride + 8 * j;
    __align__(16) __half hi[8], lo[8];
    bool finite = true;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      split_value(p[i], e, hi[i], lo[i]);
      finite = finite && isfinite(p[i]);
    }
    if (!finite && nonfinite_rows != nullptr) nonfinite_rows[row] = 1;  // every writer: 1
    __half* out = parts + row * ld + (k / kBlockK) * kBlock + k % kBlockK;
    *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(hi);
    *reinterpret_cast<uint4*>(out + kBlockK) = *reinterpret_cast<const uint4*>(lo);
  }
}

template <int kVecs>
void launch_rows(const float* src, int64_t rows, int64_t cols, int64_t ld_row, __half* parts,
                 int64_t ld, float* exponents, int* nonfinite_rows, cudaStream_t stream) {
  split_fp16_rows_kernel<kVecs><<<unsigned(rows), kRowThreads, 0, stream>>>(
      src, cols, ld_row, parts, ld, exponents, nonfinite_rows);
  check_launch("split_fp16 (rows)");
}

}  // namespace

int64_t split_fp16_ld(int64_t cols) { return 2 * ((cols + kBlockK - 1) / kBlockK * kBlockK); }

size_t split_fp16_bytes(int64_t rows, int64_t cols) {
  return align256(sizeof(__half) * size_t(rows) * size_t(split_fp16_ld(cols))) +
         2 * align256(sizeof(float) * size_t(rows));
}

size_t split_fp16_row_bytes(int64_t cols) {
  return sizeof(__half) * size_t(split_fp16_ld(cols)) + sizeof(float) + sizeof(unsigned);
}

const float* split_fp16_exponents(const void* split, int64_t rows, int64_t cols) {
  return reinterpret_cast<const float*>(
      static_cast<const char*>(split) +
      align256(sizeof(__half) * size_t(rows) * size_t(split_fp16_ld(cols))));
}

void split_fp16(const float* src, int64_t rows, int64_t cols, int64_t ld_row, int64_t ld_col,
                void* split, int* nonfinite_rows, cudaStream_t stream) {
  if (rows == 0) return;
  const int64_t ld = split_fp16_ld(cols);
  auto* parts = static_cast<__half*>(split);
  auto* exponents = const_cast<float*>(split_fp16_exponents(split, rows, cols));
  auto* row_max = reinterpret_cast<unsigned*>(reinterpret_cast<char*>(exponents) +
                                              align256(sizeof(float) * size_t(rows)));
  const bool rows_along_k = ld_col == 1 && ld_row % 4 == 0 && cols % 4 == 0 &&
                            reinterpret_cast<uintptr_t>(src) % 16 == 0 && rows <= INT32_MAX;
  if (rows_along_k && cols <= 8 * 4 * kRowThreads) {
    if (cols <= 4 * kRowThreads) {
      launch_rows<1>(src, rows, cols, ld_row, parts, ld, exponents, nonfinite_rows, stream);
    } else if (cols <= 2 * 4 * kRowThreads) {
      launch_rows<2>(src, rows, cols, ld_row, parts, ld, exponents, nonfinite_rows, stream);
    } else if (cols <= 4 * 4 * kRowThreads) {
      launch_rows<4>(src, rows, cols, ld_row, parts, ld, exponents, nonfinite_rows, stream);
    } else {
      launch_rows<8>(src, rows, cols, ld_row, parts, ld, exponents, nonfinite_rows, stream);
    }
    return;
  }
  if (nonfinite_rows != nullptr) cudaMemsetAsync(nonfinite_rows, 0, sizeof(int) * size_t(rows), stream);
  cudaMemsetAsync(row_max, 0, sizeof(unsigned) * size_t(rows), stream);
  // Rows go on grid.y, at most 65535 tiles a launch: a taller operand (a batch of over 2^21 rows)
  // is split in bands of rows, one launch each.
  constexpr int64_t kBandRows = int64_t(65535) * kTile;
  const unsigned k_tiles = unsigned(ld / 2 / kTile);
  const bool rows_contiguous = ld_row == 1 && ld_col != 1;
  if (rows_contiguous) {
    const int64_t chunks = (cols + kMaxChunk - 1) / kMaxChunk;
    for (int64_t r = 0; r < rows; r += kBandRows) {  // chunks on grid.y: at most 65535 a launch
      for (int64_t c = 0; c < chunks; c += 65535) {
        const int64_t band = std::min(kBandRows, rows - r), n = std::min<int64_t>(65535, chunks - c);
        const dim3 grid(unsigned((band + kMaxThreads - 1) / kMaxThreads), unsigned(n));
        split_fp16_column_max_kernel<<<grid, kMaxThreads, 0, stream>>>(
            src + r + c * kMaxChunk * ld_col, band, std::min(cols - c * kMaxChunk, n * kMaxChunk),
            ld_col, row_max + r);
        check_launch("split_fp16 (column maxima)");
      }
    }
  }
  // A row-contiguous source in 16-byte vectors of 4 rows: the 64 x 64 tiles
  // (EPIFUSE_SPLIT_WIDE_TILES=0: the 32 x 64 ones, to measure them against each other).
  const bool wide = rows_contiguous && rows % 4 == 0 && ld_col % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(src) % 16 == 0 && debug_switches().split_wide_tiles;
  if (wide) {
    constexpr int64_t kWideBandRows = int64_t(65535) * kWideTile;
    const unsigned k_wide_tiles = unsigned((ld / 2 + kWideTile - 1) / kWideTile);
    for (int64_t r = 0; r < rows; r += kWideBandRows) {
      const int64_t band = std::min(kWideBandRows, rows - r);
      const unsigned row_tiles = unsigned((band + kWideTile - 1) / kWideTile);
      split_fp16_tiles_wide_kernel<<<dim3(k_wide_tiles, row_tiles), kWideThreads, 0, stream>>>(
          src + r, band, cols, ld_col, row_max + r, parts + r * ld, ld, exponents + r,
          nonfinite_rows != nullptr ? nonfinite_rows + r : nullptr);
      check_launch("split_fp16 (wide tiles)");
    }
    return;
  }
  for (int pass = rows_contiguous ? 1 : 0; pass < 2; ++pass) {
    for (int64_t r = 0; r < rows; r += kBandRows) {
      const int64_t band = std::min(kBandRows, rows - r);
      const unsigned row_tiles = unsigned((band + kTile - 1) / kTile);
      const dim3 block(kTile, kRowsPerPass);
      if (pass == 0) {
        split_fp16_row_max_kernel<<<dim3(k_tiles, row_tiles), block, 0, stream>>>(
            src + r * ld_row, band, cols, ld_row, ld_col, row_max + r);
        check_launch("split_fp16 (row maxima)");
      } else {
        const unsigned split_tiles = unsigned((ld / 2 + kSplitTileK - 1) / kSplitTileK);
        split_fp16_tiles_kernel<<<dim3(split_tiles, row_tiles), block, 0, stream>>>(
            src + r * ld_row, band, cols, ld_row, ld_col, row_max + r, parts + r * ld, ld,
            exponents + r, nonfinite_rows != nullptr ? nonfinite_rows + r : nullptr);
        check_launch("split_fp16 (tiles)");
      }
    }
  }
}

}  // namespace epifuse
