// The GEMMs' 16-bit operands under autocast: an fp32 tensor's elements rounded to bf16 or fp16,
// as Tensor::to rounds them (to nearest even; fp16 overflows to inf, NaN stays NaN).
//
// Why not Tensor::to: a head under autocast casts x and its weight on every training step (the
// weight changes, so its cast is not kept), and aten::to's path (dispatch, _to_copy, empty_strided,
// copy_, a TensorIterator) cost 12-24 us of host time per cast on the H200 machines against ~5 for
// an allocation and this one launch; the projection MLP's bf16 step makes four such casts and its
// forward is host-bound. The kernel itself moves the same bytes as PyTorch's.
#include <algorithm>
#include <type_traits>

#include "cuda_utils.cuh"

namespace epifuse {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // 8 floats read (two 16-byte loads), 8 16-bit values written (one store)

template <class T>
__global__ void __launch_bounds__(kThreads)
narrowing_cast_kernel(const float* __restrict__ src, T* __restrict__ dst, int64_t n, bool vec) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t vecs = vec ? n / kVec : 0;
  for (int64_t v = first; v < vecs; v += stride) {
    const float4 lo = reinterpret_cast<const float4*>(src)[2 * v];
    const float4 hi = reinterpret_cast<const float4*>(src)[2 * v + 1];
    Vec16<T> out;
    out.v[0] = from_float<T>(lo.x), out.v[1] = from_float<T>(lo.y);
    out.v[2] = from_float<T>(lo.z), out.v[3] = from_float<T>(lo.w);
    out.v[4] = from_float<T>(hi.x), out.v[5] = from_float<T>(hi.y);
    out.v[6] = from_float<T>(hi.z), out.v[7] = from_float<T>(hi.w);
    reinterpret_cast<Vec16<T>*>(dst)[v] = out;
  }
  // The tail past the last whole vector, or every element of misaligned operands.
  for (int64_t i = vecs * kVec + first; i < n; i += stride) dst[i] = from_float<T>(src[i]);
}

}  // namespace

void narrowing_cast(const float* src, void* dst, int64_t n, DType dst_dtype, cudaStream_t stream) {
  if (n == 0) return;
  if (dst_dtype == DType::kFloat32) throw std::runtime_error("narrowing_cast: fp32 is not narrower");
  const bool vec = is_aligned16(src) && is_aligned16(dst);
  const int64_t work = vec ? std::max<int64_t>(n / kVec, 1) : n;
  // One wave of full blocks (2048 threads an SM), a grid-stride loop over the rest.
  const int64_t wave = int64_t(std::max(sm_count(current_device()), 1)) * (2048 / kThreads);
  const unsigned blocks = unsigned(std::min<int64_t>((work + kThreads - 1) / kThreads, wave));
  dispatch_dtype(dst_dtype, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      narrowing_cast_kernel<T><<<blocks, kThreads, 0, stream>>>(src, static_cast<T*>(dst), n, vec);
    }
  });
  check_launch("narrowing_cast");
}

}  // namespace epifuse
