// out = softmax(act(a[n] * in + c[n])) along each row of an [M, N] matrix (a, c and the activation
// optional: activation.cuh).
//
// Bandwidth-bound: every element is read once and written once, and a row's max and sum must be
// known before its first output, so what limits the pass is how many rows each SM has in flight.
// Three kernels, picked by row width (launch() below; kVec = elements per 16 bytes):
//  - rows_in_registers, N <= 128 kVec (512 fp32): 4..32 lanes per row, one to four 16-byte vectors
//    per thread, several rows per block: many small independent rows per SM.
//  - rows_staged, N <= 8192 kVec: one row per block (32..1024 threads), persistent over rows; the
//    next row is copied into shared memory with cp.async while the current one is reduced, so the
//    loads of one row overlap the reductions and stores of the previous one. Rows up to 4096 kVec
//    also keep their values in registers; wider ones are re-read from shared memory in each pass.
//  - rows_looped, wider rows: online max/sum over the row, then a second read to write.
// Accesses are 16-byte vectors when the rows are 16-byte aligned; otherwise element-wise (register
// kernel up to 32 elements per thread, then the looped kernel).
// All arithmetic is fp32; the output is in the input dtype, or fp32 from a 16-bit input (autocast:
// the kernels are templated on the input T and output O; the vector width is T's 16 bytes, stored
// as one or two 16-byte vectors of O). Works in place (in == out, same dtype).
#include <algorithm>
#include <cfloat>

#include "activation.cuh"
#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kMaxElemsPerThread = 32;  // element-wise path: values one thread keeps in registers
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

// exp for the softmax numerators (T: the output type). 16-bit outputs cannot see the difference between expf and the
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
// `slots` holds kWarpsPerRow floats for this row; the caller alternates between two sets of slots
// on consecutive uses, so a fast warp's next write cannot overtake a slow warp's read.
template <int kWarpsPerRow, bool kIsMax>
__device__ __forceinline__ float row_combine(float v, float* slots, int warp_in_row) {
  if constexpr (kWarpsPerRow == 1) {
    return v;
  } else {
    if ((threadIdx.x & 31) == 0) slots[warp_in_row] = v;
    __syncthreads();
    float r = slots[0];
#pragma unroll
    for (int w = 1; w < kWarpsPerRow; ++w) r = kIsMax ? fmaxf(r, slots[w]) : r + slots[w];
    return r;
  }
}

// kVec consecutive elements starting at column col0, converted to fp32, with the affine and the
// activation applied.
// Vectorized rows have 16-byte aligned a and c (launch() checks), read as float4.
template <class T, int kVec>
__device__ __forceinline__ void load_affine(const T* src, int64_t col0, const float* __restrict__ a,
                                            const float* __restrict__ c, Activation act,
                                            float* v) {
  if constexpr (kVec > 1) {
    const Vec16<T> raw = *reinterpret_cast<const Vec16<T>*>(src);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = to_float(raw.v[j]);
    if (a != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const float4 av = __ldg(reinterpret_cast<const float4*>(a + col0 + j));
        const float4 cv = __ldg(reinterpret_cast<const float4*>(c + col0 + j));
        v[j] = av.x * v[j] + cv.x;
        v[j + 1] = av.y * v[j + 1] + cv.y;
        v[j + 2] = av.z * v[j + 2] + cv.z;
        v[j + 3] = av.w * v[j + 3] + cv.w;
      }
    }
  } else {
    v[0] = to_float(*src);
    if (a != nullptr) v[0] = __ldg(a + col0) * v[0] + __ldg(c + col0);
  }
  if (act.kind != ActivationKind::kNone) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = activate(act, v[j]);
  }
}

template <class T, int kVec>
__device__ __forceinline__ void store_scaled(T* dst, const float* e, float inv_sum) {
  if constexpr (kVec > 1) {
    Vec<T, kVec> res;
#pragma unroll
    for (int j = 0; j < kVec; ++j) res.v[j] = from_float<T>(e[j] * inv_sum);
    *reinterpret_cast<Vec<T, kVec>*>(dst) = res;
  } else {
    *dst = from_float<T>(e[0] * inv_sum);
  }
}

// kThreadsPerRow threads own one row (4..32 lanes of a warp, or 2..32 whole warps); each thread
// holds kElems elements in kElems / kVec vectors,
// vector i of thread t covering columns (i * kThreadsPerRow + t) * kVec + [0, kVec).
template <class T, class O, int kVec, int kElems, int kThreadsPerRow, int kBlock>
__global__ void __launch_bounds__(kBlock)
rows_in_registers(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
                  const float* __restrict__ a, const float* __restrict__ c, Activation act) {
  static_assert(kBlock % kThreadsPerRow == 0, "a block holds whole rows");
  constexpr int kRowsPerBlock = kBlock / kThreadsPerRow;
  constexpr int kWarpsPerRow = kThreadsPerRow >= 32 ? kThreadsPerRow / 32 : 1;
  constexpr int kLanes = kThreadsPerRow >= 32 ? 32 : kThreadsPerRow;  // shuffle width
  constexpr int kVecsPerThread = kElems / kVec;

  __shared__ float slots[2][kRowsPerBlock * kWarpsPerRow];

  const int row_in_block = threadIdx.x / kThreadsPerRow;
  const int t = threadIdx.x % kThreadsPerRow;
  const int warp_in_row = t / 32;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + row_in_block;
  const bool row_valid = row < M;  // invalid rows still take part in __syncthreads
  const T* src = in + (row_valid ? row : 0) * ld_in;

  float vals[kElems];
  float thread_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t col0 = (int64_t(i) * kThreadsPerRow + t) * kVec;
    float* v = vals + i * kVec;
    if (row_valid && col0 < N) {  // kVec > 1 implies N % kVec == 0
      load_affine<T, kVec>(src + col0, col0, a, c, act, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) thread_max = fmaxf(thread_max, v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = -INFINITY;
    }
  }
  float* row_slots = slots[0] + row_in_block * kWarpsPerRow;
  const float row_max = row_combine<kWarpsPerRow, true>(lanes_max<kLanes>(thread_max), row_slots,
                                                        warp_in_row);

  // Columns past N hold -inf and contribute exp(-inf) = 0. No per-element test on purpose: the
  // compiler turned one into a branch around every exp, which cost 3-12% of the bandwidth (H200).
  // A row of -inf (row_max = -inf) gives NaN in every column, padding or not, as torch does.
  float thread_sum = 0.f;
#pragma unroll
  for (int k = 0; k < kElems; ++k) {
    vals[k] = softmax_exp<O>(vals[k] - row_max);
    thread_sum += vals[k];
  }
  row_slots = slots[1] + row_in_block * kWarpsPerRow;
  const float row_sum = row_combine<kWarpsPerRow, false>(lanes_sum<kLanes>(thread_sum), row_slots,
                                                         warp_in_row);
  const float inv_sum = 1.f / row_sum;

  if (!row_valid) return;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t col0 = (int64_t(i) * kThreadsPerRow + t) * kVec;
    if (col0 < N) store_scaled<O, kVec>(out + row * ld_out + col0, vals + i * kVec, inv_sum);
  }
}

// ---- rows_staged ---------------------------------------------------------------------------------

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// One row per block of kThreads; block b handles rows b, b + gridDim.x, ... Each thread copies
// kVecs 16-byte chunks of a row into shared memory (chunk i at column (i * kThreads + t) * kVec)
// and later reads back only those chunks, so the staging needs cp.async.wait_group and no barrier;
// kStages - 1 rows are in flight while one is reduced. kInRegisters: the row's values stay in
// registers between the passes (kVecs * kVec floats); otherwise each pass re-reads shared memory,
// which lets a row use up to all of it.
template <class T, class O, int kThreads, int kVecs, int kStages, bool kInRegisters>
__global__ void __launch_bounds__(kThreads)
rows_staged(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
            const float* __restrict__ a, const float* __restrict__ c, Activation act) {
  constexpr int kVec = Vec16<T>::kSize;
  constexpr int kWarps = kThreads / 32;
  constexpr int kCached = kInRegisters ? kVecs * kVec : 1;
  extern __shared__ uint4 staged[];  // [kStages][kVecs][kThreads] 16-byte chunks
  __shared__ float slots[2][kWarps];
  const int t = threadIdx.x;
  const int warp = t / 32;
  const int64_t step = gridDim.x;

  auto chunk = [&](int stage, int i) -> uint4* { return &staged[(stage * kVecs + i) * kThreads + t]; };
  auto col_of = [&](int i) { return int64_t(i * kThreads + t) * kVec; };
  auto stage_row = [&](int64_t row, int stage) {
    if (row < M) {
      const T* src = in + row * ld_in;
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
        if (col_of(i) < N) cp_async_16(chunk(stage, i), src + col_of(i));
    }
    cp_async_commit();  // an empty group past the last row keeps the group count uniform
  };
  auto values = [&](int stage, int i, float* v) {
    load_affine<T, kVec>(reinterpret_cast<const T*>(chunk(stage, i)), col_of(i), a, c, act, v);
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) stage_row(blockIdx.x + s * step, s);
  int stage = 0;
  for (int64_t row = blockIdx.x; row < M; row += step) {  // uniform across the block
    // Refill the stage the previous row used: this thread has consumed its chunks of it.
    stage_row(row + (kStages - 1) * step, (stage + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();  // this row's chunks (copied by this thread) have landed

    float cache[kCached];
    float thread_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (col_of(i) >= N) continue;
      float v[kVec];
      values(stage, i, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        thread_max = fmaxf(thread_max, v[j]);
        if constexpr (kInRegisters) cache[i * kVec + j] = v[j];
      }
    }
    const float row_max = row_combine<kWarps, true>(lanes_max<32>(thread_max), slots[0], warp);

    float thread_sum = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (col_of(i) >= N) continue;
      float v[kVec];
      if constexpr (kInRegisters) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = cache[i * kVec + j];
      } else {
        values(stage, i, v);
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float e = softmax_exp<O>(v[j] - row_max);
        thread_sum += e;
        if constexpr (kInRegisters) cache[i * kVec + j] = e;
      }
    }
    const float row_sum = row_combine<kWarps, false>(lanes_sum<32>(thread_sum), slots[1], warp);
    const float inv_sum = 1.f / row_sum;

    O* dst = out + row * ld_out;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      if (col_of(i) >= N) continue;
      float e[kVec];
      if constexpr (kInRegisters) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) e[j] = cache[i * kVec + j];
      } else {
        values(stage, i, e);
#pragma unroll
        for (int j = 0; j < kVec; ++j) e[j] = softmax_exp<O>(e[j] - row_max);
      }
      store_scaled<O, kVec>(dst + col_of(i), e, inv_sum);
    }
    // The two row_combine calls above reuse slots[0] / slots[1] on the next row; the barrier in the
    // sum's combine orders every warp's read of slots[0] before any warp's next write of it, and the
    // next row's max barrier does the same for slots[1].
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();
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

// Rows too wide for the other kernels: one block per row, reading the row twice.
template <class T, class O, int kVec>
__global__ void __launch_bounds__(1024)
rows_looped(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
            const float* __restrict__ a, const float* __restrict__ c, Activation act) {
  __shared__ MaxSum warp_parts[32];
  const int64_t row = blockIdx.x;
  const T* src = in + row * ld_in;
  O* dst = out + row * ld_out;

  MaxSum acc{-INFINITY, 0.f};
  for (int64_t col0 = int64_t(threadIdx.x) * kVec; col0 < N; col0 += int64_t(blockDim.x) * kVec) {
    float v[kVec];
    load_affine<T, kVec>(src + col0, col0, a, c, act, v);
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
    load_affine<T, kVec>(src + col0, col0, a, c, act, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = softmax_exp<O>(v[j] - total.m);
    store_scaled<O, kVec>(dst + col0, v, inv_sum);
  }
}

struct RowsArgs {
  int64_t M, N;
  const void* in;
  int64_t ld_in;
  void* out;
  int64_t ld_out;
  const float* a;
  const float* c;
  Activation act;
  cudaStream_t stream;
};

// kBlock: threads per block (default: 256, or one row if wider).
template <class T, class O, int kVec, int kElems, int kThreadsPerRow,
          int kBlock = (kThreadsPerRow > kNarrowBlock ? kThreadsPerRow : kNarrowBlock)>
void launch_in_registers(const RowsArgs& r) {
  constexpr int kRowsPerBlock = kBlock / kThreadsPerRow;
  const int64_t blocks = (r.M + kRowsPerBlock - 1) / kRowsPerBlock;
  rows_in_registers<T, O, kVec, kElems, kThreadsPerRow, kBlock><<<dim3(unsigned(blocks)), kBlock, 0, r.stream>>>(
      r.M, r.N, static_cast<const T*>(r.in), r.ld_in, static_cast<O*>(r.out), r.ld_out, r.a, r.c, r.act);
}

template <class T, class O, int kVec>
void launch_looped(const RowsArgs& r) {
  rows_looped<T, O, kVec><<<dim3(unsigned(r.M)), 1024, 0, r.stream>>>(
      r.M, r.N, static_cast<const T*>(r.in), r.ld_in, static_cast<O*>(r.out), r.ld_out, r.a, r.c, r.act);
}

// Shared memory of a rows_staged launch: kStages rows of kVecs 16-byte chunks per thread.
template <int kThreads, int kVecs, int kStages>
constexpr size_t staged_bytes() {
  return size_t(kStages) * kVecs * kThreads * 16;
}

// Launches rows_staged on a persistent grid (as many blocks as fit on the GPU at once, at most one
// per row). Returns false when the configuration does not fit this GPU's shared memory.
template <class T, class O, int kThreads, int kVecs, int kStages, bool kInRegisters>
bool launch_staged(const RowsArgs& r) {
  constexpr size_t kSmem = staged_bytes<kThreads, kVecs, kStages>();
  auto kernel = rows_staged<T, O, kThreads, kVecs, kStages, kInRegisters>;
  // Blocks per SM, per device: queried once (the attribute above 48 KiB must be set per device).
  static std::array<int, 128> per_sm_cache{};  // 0: not yet queried, -1: does not fit
  const int device = current_device();
  if (device < 0 || device >= int(per_sm_cache.size())) return false;
  int& per_sm = per_sm_cache[device];
  if (per_sm == 0) {
    int fits = 0;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)) ==
            cudaSuccess &&
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, kernel, kThreads, kSmem) == cudaSuccess &&
        fits > 0) {
      per_sm = fits;
    } else {
      cudaGetLastError();  // a refused attribute is not an error of this op: take another kernel
      per_sm = -1;
    }
  }
  if (per_sm < 0) return false;
  const int64_t blocks = std::min<int64_t>(r.M, int64_t(per_sm) * std::max(sm_count(device), 1));
  kernel<<<dim3(unsigned(blocks)), kThreads, kSmem, r.stream>>>(
      r.M, r.N, static_cast<const T*>(r.in), r.ld_in, static_cast<O*>(r.out), r.ld_out, r.a, r.c, r.act);
  return true;
}

// 16-byte vectors (kVec elements). Each width takes the fastest of ~90 candidate kernels measured
// on an H200 (64 MiB per input, inputs rotated; % of the 4.25 TB/s copy bandwidth):
//  - up to 128 vectors: one warp (or 4..16 lanes) per row holding 1, 2 or 4 vectors per thread, in
//    64..256-thread blocks (85-90% for rows of up to 2 KiB, fp32 and bf16 alike);
//  - wider: one row per block on a persistent grid, the next rows staged with cp.async (78-84%);
//    narrow blocks with more vectors per thread and deeper staging won up to 512 vectors, and fp32
//    and 16-bit rows of the same bytes prefer different shapes at 256 vectors.
template <class T, class O>
void launch_vectorized(const RowsArgs& r) {
  constexpr int kVec = Vec16<T>::kSize;
  constexpr bool k16Bit = sizeof(T) == 2;
  const int64_t vecs = r.N / kVec;
  if (vecs <= 4) return launch_in_registers<T, O, kVec, kVec, 4>(r);
  if (vecs <= 8) return launch_in_registers<T, O, kVec, kVec, 8>(r);
  if (vecs <= 16) return launch_in_registers<T, O, kVec, kVec, 16>(r);
  if (vecs <= 32) return launch_in_registers<T, O, kVec, kVec, 32, 128>(r);
  if (vecs <= 64) return launch_in_registers<T, O, kVec, 2 * kVec, 32, 128>(r);
  if (vecs <= 128) return launch_in_registers<T, O, kVec, 4 * kVec, 32, 64>(r);
  // One row per block; <threads, vectors per thread in registers, rows in flight>.
  if (vecs <= 256 && (k16Bit ? launch_staged<T, O, 128, 2, 4, true>(r)
                             : launch_staged<T, O, 32, 8, 2, true>(r))) return;
  if (vecs <= 512 && launch_staged<T, O, 128, 4, 2, true>(r)) return;
  // 1024 vectors (problem 84's 8192 columns): 512x2 was 3% faster for bf16 on 4096 cold rows, but
  // 256x4 is 10% faster on the head's own pass (1024 rows, in place, with the affine, z in L2).
  if (vecs <= 1024 && launch_staged<T, O, 256, 4, 2, true>(r)) return;
  if (vecs <= 2048 && launch_staged<T, O, 512, 4, 2, true>(r)) return;
  if (vecs <= 4096 && launch_staged<T, O, 1024, 4, 2, true>(r)) return;
  // Rows of up to 128 KiB live in shared memory alone (one stage: no overlap between rows).
  if (vecs <= 8192 && launch_staged<T, O, 1024, 8, 1, false>(r)) return;
  launch_looped<T, O, kVec>(r);
}

// Element-wise (rows or vectors not 16-byte aligned).
template <class T, class O>
void launch_elementwise(const RowsArgs& r) {
  constexpr int E = kMaxElemsPerThread;
  const int64_t N = r.N;
  if (N <= 4) return launch_in_registers<T, O, 1, 1, 4>(r);
  if (N <= 8) return launch_in_registers<T, O, 1, 1, 8>(r);
  if (N <= 16) return launch_in_registers<T, O, 1, 1, 16>(r);
  if (N <= 32) return launch_in_registers<T, O, 1, 1, 32>(r);
  if (N <= 64) return launch_in_registers<T, O, 1, 2, 32>(r);
  if (N <= 128) return launch_in_registers<T, O, 1, 2, 64>(r);
  if (N <= 256) return launch_in_registers<T, O, 1, 2, 128>(r);
  if (N <= 512) return launch_in_registers<T, O, 1, 2, 256>(r);
  if (N <= 1024) return launch_in_registers<T, O, 1, 4, 256>(r);
  if (N <= 2048) return launch_in_registers<T, O, 1, 8, 256>(r);
  if (N <= 4096) return launch_in_registers<T, O, 1, 16, 256>(r);
  if (N <= 256 * E) return launch_in_registers<T, O, 1, E, 256>(r);
  if (N <= 512 * E) return launch_in_registers<T, O, 1, E, 512>(r);
  if (N <= 1024 * E) return launch_in_registers<T, O, 1, E, 1024>(r);
  launch_looped<T, O, 1>(r);
}

}  // namespace

void affine_softmax(DType in_dtype, int64_t M, int64_t N, const void* in, int64_t ld_in,
                    DType out_dtype, void* out, int64_t ld_out, const float* a, const float* c,
                    Activation act, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  const RowsArgs r{M, N, in, ld_in, out, ld_out, a, c, act, stream};
  dispatch_in_out(in_dtype, out_dtype, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using O = decltype(out_tag);
    constexpr int kVec = Vec16<T>::kSize;
    const bool affine_aligned = a == nullptr || (is_aligned16(a) && is_aligned16(c));
    const bool vectorizable = N % kVec == 0 && ld_in % kVec == 0 && ld_out % kVec == 0 &&
                              is_aligned16(in) && is_aligned16(out) && affine_aligned;
    if (vectorizable) {
      launch_vectorized<T, O>(r);
    } else {
      launch_elementwise<T, O>(r);
    }
  });
  check_launch("affine_softmax");
}

}  // namespace epifuse
