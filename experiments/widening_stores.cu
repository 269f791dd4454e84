// Store width of the widening passes (benchmarks behind kStoreVec, cpp/kernels/cuda_utils.cuh, and
// experiments/README.md, "widening_stores.cu"): the affine pass from a 16-bit z to an fp32 output
// (16384x4096, problem 39 under autocast) in several thread layouts, against fills, copies and the
// fp32 -> bf16 cast of the same bytes. Standalone (CUDA runtime only, no torch, no CUTLASS):
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
//        experiments/widening_stores.cu -o build/experiments/widening_stores
//   build/experiments/widening_stores
//
// Prints the best of 20 CUDA-event timings per kernel and the bytes moved per second.
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>

template <class T, int N = 16 / sizeof(T)> struct alignas(16) Vec { T v[N]; };
struct alignas(8) B4 { __nv_bfloat16 v[4]; };
struct alignas(16) B8 { __nv_bfloat16 v[8]; };
__device__ __forceinline__ float tf(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int kUnroll, bool kStream>
__global__ void __launch_bounds__(256) band(int64_t M, int64_t N, const __nv_bfloat16* in, float* out,
    const float* __restrict__ a, const float* __restrict__ c, int64_t rows_per_block) {
  const int64_t col0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (col0 >= N) return;
  float av[8], cv[8];
  for (int j = 0; j < 8; ++j) { av[j] = __ldg(a + col0 + j); cv[j] = __ldg(c + col0 + j); }
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block, r1 = min(M, r0 + rows_per_block);
  int64_t r = r0;
  for (; r + kUnroll <= r1; r += kUnroll) {
    Vec<__nv_bfloat16> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int4* p = reinterpret_cast<const int4*>(in + (r + u) * N + col0);
      int4 t = kStream ? __ldcs(p) : *p;
      v[u] = *reinterpret_cast<Vec<__nv_bfloat16>*>(&t);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float4 o0, o1;
      o0.x = av[0] * tf(v[u].v[0]) + cv[0]; o0.y = av[1] * tf(v[u].v[1]) + cv[1];
      o0.z = av[2] * tf(v[u].v[2]) + cv[2]; o0.w = av[3] * tf(v[u].v[3]) + cv[3];
      o1.x = av[4] * tf(v[u].v[4]) + cv[4]; o1.y = av[5] * tf(v[u].v[5]) + cv[5];
      o1.z = av[6] * tf(v[u].v[6]) + cv[6]; o1.w = av[7] * tf(v[u].v[7]) + cv[7];
      float4* q = reinterpret_cast<float4*>(out + (r + u) * N + col0);
      if (kStream) { __stcs(q, o0); __stcs(q + 1, o1); } else { q[0] = o0; q[1] = o1; }
    }
  }
  for (; r < r1; ++r) { /* tail unused in this bench (M divisible) */ }
}

// Linear: grid-stride over 16-byte input vectors of the whole (contiguous) matrix; a, c from smem.
template <int kUnroll, bool kStream>
__global__ void __launch_bounds__(256) linear(int64_t M, int64_t N, const __nv_bfloat16* in, float* out,
    const float* __restrict__ a, const float* __restrict__ c) {
  extern __shared__ float s[];
  float* sa = s; float* sc = s + N;
  for (int i = threadIdx.x; i < N; i += blockDim.x) { sa[i] = a[i]; sc[i] = c[i]; }
  __syncthreads();
  const int64_t vecs = M * N / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < vecs; i += kUnroll * stride) {
    int4 t[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) { const int4* p = reinterpret_cast<const int4*>(in) + i + u * stride; t[u] = kStream ? __ldcs(p) : *p; }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t e = (i + u * stride) * 8; const int col = int(e % N);
      const Vec<__nv_bfloat16> v = *reinterpret_cast<Vec<__nv_bfloat16>*>(&t[u]);
      float4 o0, o1;
      o0.x = sa[col+0] * tf(v.v[0]) + sc[col+0]; o0.y = sa[col+1] * tf(v.v[1]) + sc[col+1];
      o0.z = sa[col+2] * tf(v.v[2]) + sc[col+2]; o0.w = sa[col+3] * tf(v.v[3]) + sc[col+3];
      o1.x = sa[col+4] * tf(v.v[4]) + sc[col+4]; o1.y = sa[col+5] * tf(v.v[5]) + sc[col+5];
      o1.z = sa[col+6] * tf(v.v[6]) + sc[col+6]; o1.w = sa[col+7] * tf(v.v[7]) + sc[col+7];
      float4* q = reinterpret_cast<float4*>(out + e);
      if (kStream) { __stcs(q, o0); __stcs(q + 1, o1); } else { q[0] = o0; q[1] = o1; }
    }
  }
  for (; i < vecs; i += stride) { }
}

// fp32 -> bf16 cast: each thread 8 floats (two 16-byte loads) -> one 16-byte store.
template <int kUnroll, bool kStream>
__global__ void __launch_bounds__(256) cast(int64_t n, const float* in, __nv_bfloat16* out) {
  const int64_t vecs = n / 8, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < vecs; i += kUnroll * stride) {
    float4 t[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float4* p = reinterpret_cast<const float4*>(in) + 2 * (i + u * stride);
      t[u][0] = kStream ? __ldcs(p) : p[0]; t[u][1] = kStream ? __ldcs(p + 1) : p[1];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      __nv_bfloat162 h[4] = {__floats2bfloat162_rn(t[u][0].x, t[u][0].y), __floats2bfloat162_rn(t[u][0].z, t[u][0].w),
                             __floats2bfloat162_rn(t[u][1].x, t[u][1].y), __floats2bfloat162_rn(t[u][1].z, t[u][1].w)};
      int4* q = reinterpret_cast<int4*>(out) + i + u * stride;
      if (kStream) __stcs(q, *reinterpret_cast<int4*>(h)); else *q = *reinterpret_cast<int4*>(h);
    }
  }
}

// band geometry as column_affine.cu, kVec = 4: 8-byte loads, one float4 store.
template <int kUnroll>
__global__ void __launch_bounds__(256) band4(int64_t M, int64_t N, const __nv_bfloat16* in, float* out,
    const float* __restrict__ a, const float* __restrict__ c, int64_t rows_per_block) {
  const int64_t col0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (col0 >= N) return;
  const float4 av = __ldg(reinterpret_cast<const float4*>(a + col0));
  const float4 cv = __ldg(reinterpret_cast<const float4*>(c + col0));
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block, r1 = min(M, r0 + rows_per_block);
  for (int64_t r = r0; r + kUnroll <= r1; r += kUnroll) {
    B4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = *reinterpret_cast<const B4*>(in + (r + u) * N + col0);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float4 o = make_float4(av.x * tf(v[u].v[0]) + cv.x, av.y * tf(v[u].v[1]) + cv.y,
                             av.z * tf(v[u].v[2]) + cv.z, av.w * tf(v[u].v[3]) + cv.w);
      *reinterpret_cast<float4*>(out + (r + u) * N + col0) = o;
    }
  }
}

// kVec 8 with the warp's two stores each contiguous: thread t of a warp owns columns
// [base + 4t, base + 4t + 4) and [base + 128 + 4t, ...): two 8-byte loads, two float4 stores.
template <int kUnroll>
__global__ void __launch_bounds__(256) band8split(int64_t M, int64_t N, const __nv_bfloat16* in, float* out,
    const float* __restrict__ a, const float* __restrict__ c, int64_t rows_per_block) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t base = (int64_t(blockIdx.x) * (blockDim.x / 32) + warp) * 256;
  if (base >= N) return;
  const int64_t cA = base + 4 * lane, cB = base + 128 + 4 * lane;
  const float4 aA = __ldg(reinterpret_cast<const float4*>(a + cA)), cAv = __ldg(reinterpret_cast<const float4*>(c + cA));
  const float4 aB = __ldg(reinterpret_cast<const float4*>(a + cB)), cBv = __ldg(reinterpret_cast<const float4*>(c + cB));
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block, r1 = min(M, r0 + rows_per_block);
  for (int64_t r = r0; r + kUnroll <= r1; r += kUnroll) {
    B4 vA[kUnroll], vB[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      vA[u] = *reinterpret_cast<const B4*>(in + (r + u) * N + cA);
      vB[u] = *reinterpret_cast<const B4*>(in + (r + u) * N + cB);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      *reinterpret_cast<float4*>(out + (r + u) * N + cA) = make_float4(aA.x * tf(vA[u].v[0]) + cAv.x, aA.y * tf(vA[u].v[1]) + cAv.y, aA.z * tf(vA[u].v[2]) + cAv.z, aA.w * tf(vA[u].v[3]) + cAv.w);
      *reinterpret_cast<float4*>(out + (r + u) * N + cB) = make_float4(aB.x * tf(vB[u].v[0]) + cBv.x, aB.y * tf(vB[u].v[1]) + cBv.y, aB.z * tf(vB[u].v[2]) + cBv.z, aB.w * tf(vB[u].v[3]) + cBv.w);
    }
  }
}

__global__ void fill(int64_t n4, float4* out) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = make_float4(1.f, 2.f, 3.f, 4.f);
}
// Plain widening copy, grid-stride: kElems = 4 elements a thread (one 16-byte store) or 8 (two
// adjacent 16-byte stores, each store instruction half-filling the warp's sectors).
template <int kElems, int kUnroll>
__global__ void __launch_bounds__(256) widen(int64_t n, const __nv_bfloat16* in, float* out) {
  using In = std::conditional_t<kElems == 4, B4, B8>;
  const int64_t vecs = n / kElems, stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + (kUnroll - 1) * stride < vecs; i += kUnroll * stride) {
    In v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = reinterpret_cast<const In*>(in)[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float4* q = reinterpret_cast<float4*>(out + (i + u * stride) * kElems);
#pragma unroll
      for (int h = 0; h < kElems / 4; ++h)
        q[h] = make_float4(tf(v[u].v[4 * h]), tf(v[u].v[4 * h + 1]), tf(v[u].v[4 * h + 2]),
                           tf(v[u].v[4 * h + 3]));
    }
  }
}

template <class F> float timeit(F f, int reps = 20) {
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  f(); f(); cudaDeviceSynchronize();
  float best = 1e9;
  for (int r = 0; r < reps; ++r) { cudaEventRecord(e0); f(); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms); }
  return best * 1000.f;
}

int main() {
  const int64_t M = 16384, N = 4096;
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  __nv_bfloat16 *z, *xb;
  float *out, *a, *c, *x;
  cudaMalloc(&z, M * N * 2); cudaMalloc(&out, M * N * 4); cudaMalloc(&a, N * 4); cudaMalloc(&c, N * 4);
  cudaMalloc(&x, M * N * 4); cudaMalloc(&xb, M * N * 2);
  cudaMemset(z, 0, M * N * 2); cudaMemset(a, 0, N * 4); cudaMemset(c, 0, N * 4); cudaMemset(x, 0, M * N * 4);
  const double affine_bytes = M * N * 6.0, cast_bytes = M * N * 6.0, bytes = M * N * 6.0;
  auto report = [&](const char* name, float us, double bytes) { printf("%-34s %8.1f us  %6.2f TB/s\n", name, us, bytes / us * 1e-6); };
  // band variants (the current launch geometry: about 2048 resident threads per SM)
  auto band_launch = [&](auto kern, int threads_per_sm) {
    const int64_t vecs = N / 8; const int threads = 256; const int64_t col_blocks = (vecs + threads - 1) / threads;
    const int64_t want = std::max<int64_t>(1, sms * (threads_per_sm / threads) / col_blocks);
    const int64_t bands = std::min<int64_t>(want, M / 4); const int64_t rpb = (M + bands - 1) / bands;
    dim3 grid(col_blocks, (M + rpb - 1) / rpb);
    return [=] { kern<<<grid, threads>>>(M, N, z, out, a, c, rpb); };
  };
  report("band u4 (current)", timeit(band_launch(band<4, false>, 2048)), affine_bytes);
  report("band u4 stream", timeit(band_launch(band<4, true>, 2048)), affine_bytes);
  report("band u8", timeit(band_launch(band<8, false>, 2048)), affine_bytes);
  report("band u8 stream", timeit(band_launch(band<8, true>, 2048)), affine_bytes);
  report("band u4 x2 bands", timeit(band_launch(band<4, false>, 4096)), affine_bytes);
  report("band u2 x2 bands", timeit(band_launch(band<2, false>, 4096)), affine_bytes);
  report("band u4 x4 bands", timeit(band_launch(band<4, false>, 8192)), affine_bytes);
  for (int bps : {4, 8, 16}) {
    const size_t smem = 2 * N * 4;
    cudaFuncSetAttribute(linear<4, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    cudaFuncSetAttribute(linear<4, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    cudaFuncSetAttribute(linear<2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    char nm[64];
    snprintf(nm, 64, "linear u4 %d blk/SM", bps); report(nm, timeit([&] { linear<4, false><<<sms * bps, 256, smem>>>(M, N, z, out, a, c); }), affine_bytes);
    snprintf(nm, 64, "linear u4 stream %d blk/SM", bps); report(nm, timeit([&] { linear<4, true><<<sms * bps, 256, smem>>>(M, N, z, out, a, c); }), affine_bytes);
    snprintf(nm, 64, "linear u2 %d blk/SM", bps); report(nm, timeit([&] { linear<2, false><<<sms * bps, 256, smem>>>(M, N, z, out, a, c); }), affine_bytes);
  }
  report("memcpy D2D 402MB (read+write)", timeit([&] { cudaMemcpyAsync(out, x, M * N * 3, cudaMemcpyDeviceToDevice); }), M * N * 6.0);
  for (int bps : {4, 8, 16, 32}) {
    char nm[64];
    snprintf(nm, 64, "cast u2 %d blk/SM", bps); report(nm, timeit([&] { cast<2, false><<<sms * bps, 256>>>(M * N, x, xb); }), cast_bytes);
    snprintf(nm, 64, "cast u4 %d blk/SM", bps); report(nm, timeit([&] { cast<4, false><<<sms * bps, 256>>>(M * N, x, xb); }), cast_bytes);
    snprintf(nm, 64, "cast u4 stream %d blk/SM", bps); report(nm, timeit([&] { cast<4, true><<<sms * bps, 256>>>(M * N, x, xb); }), cast_bytes);
  }
    report("fill fp32 268MB (write only)", timeit([&] { fill<<<sms * 8, 256>>>(M * N / 4, reinterpret_cast<float4*>(out)); }), M * N * 4.0);
  report("cudaMemset 268MB", timeit([&] { cudaMemsetAsync(out, 0, M * N * 4); }), M * N * 4.0);
  for (int bps : {8, 16, 32}) {
    char nm[64];
    snprintf(nm, 64, "widen4 u4 %d blk/SM", bps); report(nm, timeit([&] { widen<4, 4><<<sms * bps, 256>>>(M * N, z, out); }), bytes);
    snprintf(nm, 64, "widen8 u4 %d blk/SM", bps); report(nm, timeit([&] { widen<8, 4><<<sms * bps, 256>>>(M * N, z, out); }), bytes);
  }
  for (int tps : {2048, 4096, 8192}) {
    for (int kind = 0; kind < 2; ++kind) {
      const int threads = 256; const int64_t cols_per_block = kind == 0 ? threads * 4 : threads * 8;
      const int64_t col_blocks = N / cols_per_block;
      const int64_t want = std::max<int64_t>(1, sms * (tps / threads) / col_blocks);
      const int64_t bands = std::min<int64_t>(want, M / 4); const int64_t rpb = (M + bands - 1) / bands;
      dim3 grid(col_blocks, (M + rpb - 1) / rpb);
      char nm[64];
      for (int u : {2, 4}) {
        snprintf(nm, 64, "%s u%d %d thr/SM", kind == 0 ? "band4" : "band8split", u, tps);
        float us;
        if (kind == 0) us = timeit([&] { if (u == 2) band4<2><<<grid, threads>>>(M, N, z, out, a, c, rpb); else band4<4><<<grid, threads>>>(M, N, z, out, a, c, rpb); });
        else us = timeit([&] { if (u == 2) band8split<2><<<grid, threads>>>(M, N, z, out, a, c, rpb); else band8split<4><<<grid, threads>>>(M, N, z, out, a, c, rpb); });
        report(nm, us, bytes);
      }
    }
  }
  printf("error: %s\n", cudaGetErrorString(cudaGetLastError()));
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
