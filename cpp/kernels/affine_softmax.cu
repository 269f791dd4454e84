// out = softmax(a[n] * in + c[n]) along each row of an [M, N] matrix (a, c optional).
//
// Bandwidth-bound: the row is read once into registers and written once.
//  - Narrow rows (N <= 1024 fp32): 4..32 lanes of a warp per row, several rows per 256-thread block.
//  - Wide rows: 64..1024 threads per row (2..32 warps), each thread holding up to 32 elements;
//    the row max and sum cross warps through shared memory. Covers N <= 32768.
//  - Wider rows: a looped block-per-row kernel (online max/sum, then a second read to write).
// Accesses are 16-byte vectors when the rows are 16-byte aligned; otherwise element-wise.
// All arithmetic is fp32; the output is in the input dtype. Works in place (in == out).
#include <cfloat>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kMaxElemsPerThread = 32;
constexpr int kNarrowBlock = 256;

// Reductions across the kWidth lanes (a power of two <= 32) that share a row.
template <int kWidth>
__device__ __forceinline__ float lanes_max(float v) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}
template <int kWidth>
__device__ __forceinline__ float lanes_sum(float v) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// exp for the softmax numerators. 16-bit outputs cannot see the difference between expf and the
// hardware exp2 (a few fp32 ulp), so they take the cheaper one: at 2 bytes per element the pass
// would otherwise be bound by expf's instruction count rather than by memory bandwidth.
template <class T>
__device__ __forceinline__ float softmax_exp(float x) {
  if constexpr (sizeof(T) == 2) {
    return exp2f(x * 1.4426950408889634f);
  } else {
    return expf(x);
  }
}

// Combines one value per warp across the kWarpsPerRow warps of a row (no-op for one warp).
// `scratch` holds kWarpsPerRow floats per row of the block.
template <int kWarpsPerRow, bool kIsMax>
__device__ __forceinline__ float row_combine(float v, float* scratch, int row_in_block, int warp_in_row) {
  if constexpr (kWarpsPerRow == 1) {
    return v;
  } else {
    float* slots = scratch + row_in_block * kWarpsPerRow;
    if ((threadIdx.x & 31) == 0) slots[warp_in_row] = v;
    __syncthreads();
    float r = slots[0];
#pragma unroll
    for (int w = 1; w < kWarpsPerRow; ++w) r = kIsMax ? fmaxf(r, slots[w]) : r + slots[w];
    return r;
  }
}

// kThreadsPerRow threads own one row (4..32 lanes of a warp, or 2..32 whole warps); each thread
// holds kElems elements in kElems / kVec vectors,
// vector i of thread t covering columns (i * kThreadsPerRow + t) * kVec + [0, kVec).
template <class T, int kVec, int kElems, int kThreadsPerRow>
__global__ void __launch_bounds__(kThreadsPerRow > kNarrowBlock ? kThreadsPerRow : kNarrowBlock)
affine_softmax_rows(int64_t M, int64_t N, const T* in, int64_t ld_in, T* out, int64_t ld_out,
                    const float* __restrict__ a, const float* __restrict__ c) {
  constexpr int kBlock = kThreadsPerRow > kNarrowBlock ? kThreadsPerRow : kNarrowBlock;
  constexpr int kRowsPerBlock = kBlock / kThreadsPerRow;
  constexpr int kWarpsPerRow = kThreadsPerRow >= 32 ? kThreadsPerRow / 32 : 1;
  constexpr int kLanes = kThreadsPerRow >= 32 ? 32 : kThreadsPerRow;  // shuffle width
  constexpr int kVecsPerThread = kElems / kVec;
  using V = Vec16<T>;
  static_assert(kVec == 1 || kVec == V::kSize, "vector width is 1 or 16 bytes");

  __shared__ float scratch_max[kRowsPerBlock * kWarpsPerRow];
  __shared__ float scratch_sum[kRowsPerBlock * kWarpsPerRow];

  const int row_in_block = threadIdx.x / kThreadsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  const int warp_in_row = t / 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + row_in_block;
  const bool row_valid = row < M;  // invalid rows still take part in __syncthreads

  float vals[kElems];
  float thread_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t col0 = (int64_t(i) * kThreadsPerRow + t) * kVec;
    T raw[kVec];
    const bool valid = row_valid && col0 < N;  // kVec > 1 implies N % kVec == 0
    if (valid) {
      if constexpr (kVec > 1) {
        *reinterpret_cast<V*>(raw) = *reinterpret_cast<const V*>(in + row * ld_in + col0);
      } else {
        raw[0] = in[row * ld_in + col0];
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float v = -INFINITY;
      if (valid) {
        v = to_float(raw[j]);
        if (a != nullptr) v = __ldg(a + col0 + j) * v + __ldg(c + col0 + j);
        thread_max = fmaxf(thread_max, v);
      }
      vals[i * kVec + j] = v;
    }
  }
  const float row_max =
      row_combine<kWarpsPerRow, true>(lanes_max<kLanes>(thread_max), scratch_max, row_in_block, warp_in_row);

  float thread_sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t col0 = (int64_t(i) * kThreadsPerRow + t) * kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // Columns past N hold -inf; exclude them explicitly so an all -inf row yields NaN like torch.
      const float e = (col0 < N) ? softmax_exp<T>(vals[i * kVec + j] - row_max) : 0.f;
      vals[i * kVec + j] = e;
      thread_sum += e;
    }
  }
  const float row_sum =
      row_combine<kWarpsPerRow, false>(lanes_sum<kLanes>(thread_sum), scratch_sum, row_in_block, warp_in_row);
  const float inv_sum = 1.f / row_sum;

  if (!row_valid) return;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t col0 = (int64_t(i) * kThreadsPerRow + t) * kVec;
    if (col0 >= N) continue;
    T res[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) res[j] = from_float<T>(vals[i * kVec + j] * inv_sum);
    if constexpr (kVec > 1) {
      *reinterpret_cast<V*>(out + row * ld_out + col0) = *reinterpret_cast<V*>(res);
    } else {
      out[row * ld_out + col0] = res[0];
    }
  }
}

// Online (max, sum) pair: sum is relative to max.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum x, MaxSum y) {
  const float m = fmaxf(x.m, y.m);
  if (m == -INFINITY) return {m, x.s + y.s};  // both empty (or all -inf): avoid inf - inf
  return {m, x.s * expf(x.m - m) + y.s * expf(y.m - m)};
}

// Rows too wide for registers: one block per row, reading the row twice.
template <class T, int kVec>
__global__ void __launch_bounds__(1024)
affine_softmax_rows_looped(int64_t M, int64_t N, const T* in, int64_t ld_in, T* out,
                           int64_t ld_out, const float* __restrict__ a,
                           const float* __restrict__ c) {
  using V = Vec16<T>;
  __shared__ MaxSum warp_parts[32];
  const int64_t row = blockIdx.x;
  const T* src = in + row * ld_in;
  T* dst = out + row * ld_out;
  auto load = [&](int64_t col0, float (&v)[kVec]) {
    T raw[kVec];
    if constexpr (kVec > 1) {
      *reinterpret_cast<V*>(raw) = *reinterpret_cast<const V*>(src + col0);
    } else {
      raw[0] = src[col0];
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      v[j] = to_float(raw[j]);
      if (a != nullptr) v[j] = __ldg(a + col0 + j) * v[j] + __ldg(c + col0 + j);
    }
  };

  MaxSum acc{-INFINITY, 0.f};
  for (int64_t col0 = int64_t(threadIdx.x) * kVec; col0 < N; col0 += int64_t(blockDim.x) * kVec) {
    float v[kVec];
    load(col0, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc = merge(acc, MaxSum{v[j], 1.f});
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, off), __shfl_xor_sync(0xffffffffu, acc.s, off)};
    acc = merge(acc, other);
  }
  if ((threadIdx.x & 31) == 0) warp_parts[threadIdx.x / 32] = acc;
  __syncthreads();
  MaxSum total = warp_parts[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) total = merge(total, warp_parts[w]);
  const float inv_sum = 1.f / total.s;

  for (int64_t col0 = int64_t(threadIdx.x) * kVec; col0 < N; col0 += int64_t(blockDim.x) * kVec) {
    float v[kVec];
    load(col0, v);
    T res[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) res[j] = from_float<T>(softmax_exp<T>(v[j] - total.m) * inv_sum);
    if constexpr (kVec > 1) {
      *reinterpret_cast<V*>(dst + col0) = *reinterpret_cast<V*>(res);
    } else {
      dst[col0] = res[0];
    }
  }
}

template <class T, int kVec, int kElems, int kThreadsPerRow>
void launch_rows(int64_t M, int64_t N, const T* in, int64_t ld_in, T* out, int64_t ld_out,
                 const float* a, const float* c, cudaStream_t stream) {
  constexpr int kBlock = kThreadsPerRow > kNarrowBlock ? kThreadsPerRow : kNarrowBlock;
  constexpr int kRowsPerBlock = kBlock / kThreadsPerRow;
  const int64_t blocks = (M + kRowsPerBlock - 1) / kRowsPerBlock;
  affine_softmax_rows<T, kVec, kElems, kThreadsPerRow>
      <<<dim3(unsigned(blocks)), kBlock, 0, stream>>>(M, N, in, ld_in, out, ld_out, a, c);
}

// Picks the smallest register-resident configuration that holds the row.
template <class T, int kVec>
void launch(int64_t M, int64_t N, const T* in, int64_t ld_in, T* out, int64_t ld_out,
            const float* a, const float* c, cudaStream_t stream) {
  constexpr int E = kMaxElemsPerThread;
  // Short rows: a group of 4..32 lanes per row, one vector per lane, so no lane idles.
  if (N <= 4 * kVec) return launch_rows<T, kVec, kVec, 4>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 8 * kVec) return launch_rows<T, kVec, kVec, 8>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 16 * kVec) return launch_rows<T, kVec, kVec, 16>(M, N, in, ld_in, out, ld_out, a, c, stream);
  // One warp per row: the row fits in 32 threads x kElems.
  if (N <= 32 * kVec) return launch_rows<T, kVec, kVec, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if constexpr (2 * kVec <= E)
    if (N <= 32 * 2 * kVec) return launch_rows<T, kVec, 2 * kVec, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if constexpr (4 * kVec <= E)
    if (N <= 32 * 4 * kVec) return launch_rows<T, kVec, 4 * kVec, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if constexpr (8 * kVec <= E)
    if (N <= 32 * 8 * kVec) return launch_rows<T, kVec, 8 * kVec, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if constexpr (16 * kVec <= E)
    if (N <= 32 * 16 * kVec) return launch_rows<T, kVec, 16 * kVec, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 32 * E) return launch_rows<T, kVec, E, 32>(M, N, in, ld_in, out, ld_out, a, c, stream);
  // Several warps per row, E elements per thread.
  if (N <= 64 * E) return launch_rows<T, kVec, E, 64>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 128 * E) return launch_rows<T, kVec, E, 128>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 256 * E) return launch_rows<T, kVec, E, 256>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 512 * E) return launch_rows<T, kVec, E, 512>(M, N, in, ld_in, out, ld_out, a, c, stream);
  if (N <= 1024 * E) return launch_rows<T, kVec, E, 1024>(M, N, in, ld_in, out, ld_out, a, c, stream);
  affine_softmax_rows_looped<T, kVec><<<dim3(unsigned(M)), 1024, 0, stream>>>(M, N, in, ld_in, out,
                                                                            ld_out, a, c);
}

}  // namespace

void affine_softmax(DType dtype, int64_t M, int64_t N, const void* in, int64_t ld_in, void* out,
                    int64_t ld_out, const float* a, const float* c, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = Vec16<T>::kSize;
    const T* src = static_cast<const T*>(in);
    T* dst = static_cast<T*>(out);
    const bool vectorizable = N % kVec == 0 && ld_in % kVec == 0 && ld_out % kVec == 0 &&
                              is_aligned16(in) && is_aligned16(out);
    if (vectorizable) {
      launch<T, kVec>(M, N, src, ld_in, dst, ld_out, a, c, stream);
    } else {
      launch<T, 1>(M, N, src, ld_in, dst, ld_out, a, c, stream);
    }
  });
  check_launch("affine_softmax");
}

}  // namespace epifuse
