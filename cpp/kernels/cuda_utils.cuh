// Small helpers shared by the hand-written (non-CUTLASS) kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <stdexcept>
#include <string>

#include "epifuse/kernels.h"

namespace epifuse {

// Throws with the kernel's name when a launch failed (bad configuration, no kernel image for this
// GPU, ...). Asynchronous faults surface at the next synchronizing call, as with any CUDA op.
inline void check_launch(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("epifuse: ") + what + " launch failed: " +
                             cudaGetErrorString(err));
}

// Element conversions to and from the fp32 the kernels compute in.
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Parameter and statistics vectors (model dtype) read and written in the fp64 of the per-column math.
__device__ __forceinline__ double load_param(const double* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double load_param(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ double load_param(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ __forceinline__ double load_param(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store_param(double* p, int64_t i, double v) { p[i] = v; }
__device__ __forceinline__ void store_param(float* p, int64_t i, double v) { p[i] = float(v); }
__device__ __forceinline__ void store_param(__half* p, int64_t i, double v) { p[i] = __double2half(v); }
__device__ __forceinline__ void store_param(__nv_bfloat16* p, int64_t i, double v) {
  p[i] = __float2bfloat16_rn(float(v));
}

// Element n of an optional per-column parameter of `numel` 1 (broadcast) or N; fallback when absent.
// fold.batch_moments for one column: the mean and biased variance of z from its fp64 sums over
// `rows` rows. The square is rounded on its own (__dmul_rn: not contracted into an FMA with the
// subtraction), as the CPU rounds it, so a one-row or constant column's variance is exactly 0 on
// both. Rounding below zero is clamped; NaN passes (fmax would turn it into 0): a NaN or Inf in
// the batch poisons the statistics, as in PyTorch.
struct ColumnMoments {
  double mean, var;
};
__device__ __forceinline__ ColumnMoments column_moments(double sum, double sumsq, double rows) {
  const double mean = sum / rows;
  const double var = sumsq / rows - __dmul_rn(mean, mean);
  return {mean, var < 0.0 ? 0.0 : var};
}

template <class P>
__device__ __forceinline__ double load_or(const void* p, int64_t numel, int64_t n, double fallback) {
  if (p == nullptr) return fallback;
  return load_param(static_cast<const P*>(p), numel == 1 ? 0 : n);
}

// Calls fn with a value of the CUDA element type of `dtype` (only its type matters).
template <class Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); return;
    case DType::kFloat16: fn(__half{}); return;
    case DType::kBFloat16: fn(__nv_bfloat16{}); return;
  }
  throw std::runtime_error("epifuse: unknown dtype");
}

// kN consecutive elements of T, aligned to their size up to 16 bytes: the unit of the row passes'
// global memory accesses. Vec16<T> is one 16-byte access; a pass whose input and output types
// differ (a 16-bit z read, an fp32 output written under autocast) moves a vector of each type with
// the same number of elements: 8 or 16 bytes of one, 16 or 32 of the other.
template <class T, int kN = int(16 / sizeof(T))>
struct alignas(kN * sizeof(T) < 16 ? kN * sizeof(T) : 16) Vec {
  static_assert(kN * sizeof(T) % 16 == 0 || 16 % (kN * sizeof(T)) == 0,
                "whole 16-byte accesses, or one access of a power-of-two size below 16 bytes");
  static constexpr int kSize = kN;
  T v[kN];
};
template <class T>
using Vec16 = Vec<T>;

// Elements per 16 bytes of the narrower of two types: the vector width of a pass that reads both
// (each thread's reads of the wider type are then several 16-byte loads, which cost nothing extra).
template <class A, class B>
constexpr int kNarrowVec = Vec16<A>::kSize > Vec16<B>::kSize ? Vec16<A>::kSize : Vec16<B>::kSize;

// Elements per 16 bytes of the output: the vector width of a pass that writes Out, so that each
// thread stores one whole 16-byte vector and a warp's store instruction writes 512 contiguous
// bytes, four whole 128-byte lines. Two 16-byte stores per thread (8 bf16 read, 8 floats written)
// make each store instruction write half of every line it touches: the widening pass then ran at
// 2.3-2.6 TB/s on an H200 against 3.8-4.2 with one store per thread; lane pairs that swap halves
// so that each instruction writes whole 32-byte sectors but still half lines were slower again
// (experiments/README.md, "widening_stores.cu"). Reads show no such loss.
template <class In, class Out>
constexpr int kStoreVec = Vec16<Out>::kSize;

// Calls fn(In{}, Out{}) for the pairs the row passes take: one dtype throughout, or a 16-bit input
// with an fp32 output (autocast: z in the GEMM's 16-bit dtype, the head's output in fp32).
template <class Fn>
void dispatch_in_out(DType in, DType out, Fn&& fn) {
  if (in == out) return dispatch_dtype(in, [&](auto tag) { fn(tag, tag); });
  if (out == DType::kFloat32 && in != DType::kFloat32)
    return dispatch_dtype(in, [&](auto tag) { fn(tag, float{}); });
  throw std::runtime_error("epifuse: unsupported input/output dtype pair");
}

inline bool is_aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
inline bool is_aligned(const void* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

inline int current_device() {
  int device = 0;
  cudaGetDevice(&device);
  return device;
}

// Number of SMs of a device, queried once per device (launch sizing runs on every op call).
inline int sm_count(int device) {
  static std::array<int, 128> cache{};  // benign race: every writer stores the same value
  if (device < 0 || device >= int(cache.size())) return 0;
  if (cache[device] == 0) {
    int count = 0;
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    cache[device] = count;
  }
  return cache[device];
}

}  // namespace epifuse
