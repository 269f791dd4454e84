// What the standalone GEMM measurements in experiments/ share (each is one nvcc translation
// unit with no torch): the CUDA error check, a deterministic fill and the timer.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

// A hash of (i, seed) as a float in [-1, 1) with 23 random bits: exact in fp32 (and in tf32 / bf16
// after their rounding), the same on every run.
__device__ __forceinline__ float uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return float(uint32_t(x) >> 8) * 0x1p-23f - 1.0f;
}

__global__ void fill_f32(int64_t n, float* p, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    p[i] = uniform(i, seed);
}

// Best of 20 CUDA-event timings of f() on stream s after 3 warm-ups, with flush_bytes of `flush`
// overwritten before each timed call (outside the events) so that no operand stays in L2.
template <class F>
float best_ms(cudaStream_t s, void* flush, size_t flush_bytes, F&& f) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) f();
  float best = 1e30f;
  for (int i = 0; i < 20; ++i) {
    CK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s));
    CK(cudaEventRecord(e0, s));
    f();
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return best;
}
