// An fp32 product of fp16 operands, overflowing where the fp16 product would: every value whose
// magnitude rounds past fp16's largest (|v| >= 65520, halfway above 65504) becomes +-inf, the value
// an fp16 result would hold there. Under autocast with fp16 the weight's gradient is written in fp32
// by the GEMM itself (no fp16 result and no cast pass, half the memory of the two), and this pass
// keeps GradScaler's view of it: an inf exactly where eager's fp16 dW, widened to the parameter's
// fp32, has one, so the same steps are skipped. Every other value keeps its fp32 precision (closer
// to the exact product than the fp16 rounding). NaN stays NaN. In place, one read of the tensor and
// a write only where it overflows.
#include <algorithm>
#include <cstdint>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kThreads = 256;
constexpr float kFp16Overflow = 65520.0f;  // the smallest magnitude fp16 rounds to inf

__device__ __forceinline__ bool overflows(float v) { return fabsf(v) >= kFp16Overflow; }

// v as an fp16 result would hold it, where it overflows: inf of v's sign.
__device__ __forceinline__ float saturated(float v) {
  return overflows(v) ? copysignf(__int_as_float(0x7f800000), v) : v;
}

// 16-byte accesses over the body (vectors of 4: none unless p is 16-byte aligned), scalar ones
// over the rest.
__global__ void __launch_bounds__(kThreads)
fp16_overflow_kernel(float* __restrict__ p, int64_t n, int64_t vectors) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  auto* p4 = reinterpret_cast<float4*>(p);
  for (int64_t i = first; i < vectors; i += stride) {
    const float4 v = p4[i];
    if (overflows(v.x) || overflows(v.y) || overflows(v.z) || overflows(v.w)) {
      p4[i] = make_float4(saturated(v.x), saturated(v.y), saturated(v.z), saturated(v.w));
    }
  }
  for (int64_t i = 4 * vectors + first; i < n; i += stride) {
    if (overflows(p[i])) p[i] = saturated(p[i]);
  }
}

}  // namespace

void fp16_overflow_(float* p, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t vectors = reinterpret_cast<uintptr_t>(p) % 16 == 0 ? n / 4 : 0;
  const int64_t sms = std::max(sm_count(current_device()), 1);
  const int64_t blocks =
      std::min<int64_t>((std::max(vectors, n - 4 * vectors) + kThreads - 1) / kThreads, 8 * sms);
  fp16_overflow_kernel<<<unsigned(std::max<int64_t>(blocks, 1)), kThreads, 0, stream>>>(p, n,
                                                                                       vectors);
  check_launch("fp16_overflow_");
}

}  // namespace epifuse
