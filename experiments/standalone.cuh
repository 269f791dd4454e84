// What the standalone GEMM measurements in experiments/ share (each is one nvcc translation
// unit with no torch): the CUDA error check, a deterministic fill and the timer.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

// cuBLAS status check (for the files that include cublas_v2.h).
#define CB(x)                                                                \
  do {                                                                       \
    cublasStatus_t s_ = (x);                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                       \
      fprintf(stderr, "%s:%d: %s: status %d\n", __FILE__, __LINE__, #x, s_); \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

#ifdef CUBLAS_V2_H_
// A cuBLAS handle that runs on stream s (the experiments' reference GEMMs).
inline cublasHandle_t cublas_on(cudaStream_t s) {
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s));
  return h;
}

// The same in pedantic math mode: IEEE SGEMM and DGEMM, the references an error is measured against.
inline cublasHandle_t reference_cublas_on(cudaStream_t s) {
  cublasHandle_t h = cublas_on(s);
  CB(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  return h;
}
#endif

// A CUTLASS device GEMM (GemmUniversalAdapter) run once: exits with a message where its workspace
// is over ws_bytes or CUTLASS refuses the arguments.
template <class Adapter, class Arguments>
void run_or_exit(Arguments& args, void* ws, size_t ws_bytes, cudaStream_t s) {
  Adapter gemm;
  using Status = decltype(gemm.run(s));
  const char* failed = Adapter::get_workspace_size(args) > ws_bytes           ? "workspace"
                       : gemm.can_implement(args) != Status::kSuccess         ? "can_implement"
                       : gemm.initialize(args, ws, s) != Status::kSuccess     ? "initialize"
                       : gemm.run(s) != Status::kSuccess                      ? "run"
                                                                              : nullptr;
  if (failed != nullptr) {
    fprintf(stderr, "CUTLASS GEMM: %s failed\n", failed);
    exit(1);
  }
}

// A hash of (i, seed) as a float in [-1, 1) with 23 random bits: exact in fp32 (and in tf32 / bf16
// after their rounding), the same on every run.
__device__ __forceinline__ float uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return float(uint32_t(x) >> 8) * 0x1p-23f - 1.0f;
}

// n elements of T on the device (exits on failure).
template <class T>
T* device_buffer(size_t n) {
  T* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

__global__ void fill_f32(int64_t n, float* p, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uniform(i, seed);
}

// ms of one f() on stream s between two CUDA events.
template <class F>
float event_ms(cudaStream_t s, F&& f) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0, s));
  f();
  CK(cudaEventRecord(e1, s));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms;
}

// Best of 20 CUDA-event timings of f() on stream s after 3 warm-ups, with flush_bytes of `flush`
// overwritten before each timed call (outside the events) so that no operand stays in L2.
template <class F>
float best_ms(cudaStream_t s, void* flush, size_t flush_bytes, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  float best = 1e30f;
  for (int i = 0; i < 20; ++i) {
    CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s));
    best = std::min(best, event_ms(s, f));
  }
  return best;
}

// Mean ms of f() on stream s over about `seconds` of calls back to back, after as many untimed
// ones: the time at the clock sustained load settles to. A card at its power cap runs slower there
// than in best_ms's calls, each of which starts on a card that rested during the flush.
template <class F>
float sustained_ms(cudaStream_t s, F&& f, float seconds = 1.f) {
  f();
  const float one = event_ms(s, f);
  const int n = std::max(4, int(seconds * 1e3f / std::max(one, 1e-3f)));
  auto calls = [&] {
    for (int i = 0; i < n; ++i) f();
  };
  calls();
  return event_ms(s, calls) / n;
}

// p[i] = uniform(i, seed) * mul + add.
__global__ void fill_scaled(int64_t n, float* p, uint64_t seed, float mul, float add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uniform(i, seed) * mul + add;
}

__global__ void widen(int64_t n, const float* a, double* b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    b[i] = a[i];
}

// out[0] = max |c - r|, out[1] = max |r| (non-negative doubles order as their bits)
__global__ void max_err(int64_t n, const float* c, const double* r, unsigned long long* out) {
  double e = 0, m = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    e = fmax(e, fabs(double(c[i]) - r[i]));
    m = fmax(m, fabs(r[i]));
  }
  atomicMax(out, __double_as_longlong(e));
  atomicMax(out + 1, __double_as_longlong(m));
}

__global__ void count_diff(int64_t n, const float* a, const float* b, unsigned long long* out) {
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    c += __float_as_uint(a[i]) != __float_as_uint(b[i]);
  atomicAdd(out, c);
}

// max |c - r| / max |r| over n values (r the float64 reference).
static double max_error_ratio(const float* c, const double* r, int64_t n, cudaStream_t s) {
  unsigned long long* d;
  CK(cudaMallocAsync(&d, 16, s));
  CK(cudaMemsetAsync(d, 0, 16, s));
  max_err<<<1024, 256, 0, s>>>(n, c, r, d);
  unsigned long long h[2];
  CK(cudaMemcpyAsync(h, d, 16, cudaMemcpyDeviceToHost, s));
  CK(cudaFreeAsync(d, s));
  CK(cudaStreamSynchronize(s));
  double v[2];
  memcpy(v, h, 16);
  return v[0] / v[1];
}

// How many of n floats differ in their bits between a and b.
static unsigned long long differing_bits(const float* a, const float* b, int64_t n, cudaStream_t s) {
  unsigned long long* d;
  CK(cudaMallocAsync(&d, 8, s));
  CK(cudaMemsetAsync(d, 0, 8, s));
  count_diff<<<1024, 256, 0, s>>>(n, a, b, d);
  unsigned long long h = 0;
  CK(cudaMemcpyAsync(&h, d, 8, cudaMemcpyDeviceToHost, s));
  CK(cudaFreeAsync(d, s));
  CK(cudaStreamSynchronize(s));
  return h;
}
