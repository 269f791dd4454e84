// The softmax backward's row term (head_grad.cuh lists the passes): rowdot[m] = sum_n g * out, one
// pass over g and out, so that dv = out * (g - rowdot[m]) is known element by element afterwards.
#include <type_traits>

#include "cuda_utils.cuh"
#include "head_grad.cuh"

namespace epifuse {
namespace {

using head_grad::dispatch_grad;
using head_grad::load_floats;

// ---- row term of the softmax backward ----------------------------------------------------------
// kLanes threads per row (32..256, by row length), 256-thread blocks; a row's lanes reduce by
// shuffles, then its warps through shared memory in warp order.
constexpr int kRowdotThreads = 256;

template <class T, int kVec, int kLanes>
__global__ void __launch_bounds__(kRowdotThreads)
softmax_grad_rowdot_kernel(GradOperands o, float* __restrict__ rowdot) {
  constexpr int kRows = kRowdotThreads / kLanes;
  constexpr int kWarpsPerRow = kLanes / 32;
  __shared__ float part[kRowdotThreads / 32];
  const int lane = threadIdx.x % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kRows + threadIdx.x / kLanes;
  float acc = 0.f;
  if (row < o.M) {
    const T* g = static_cast<const T*>(o.g) + row * o.ld_g;
    const T* out = static_cast<const T*>(o.out) + row * o.ld_out;
    for (int64_t col = int64_t(lane) * kVec; col < o.N; col += int64_t(kLanes) * kVec) {
      float gv[kVec], ov[kVec];
      load_floats<T, kVec>(g + col, gv);
      load_floats<T, kVec>(out + col, ov);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc = fmaf(gv[j], ov[j], acc);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if constexpr (kWarpsPerRow == 1) {
    if (lane == 0 && row < o.M) rowdot[row] = acc;
  } else {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) part[warp] = acc;
    __syncthreads();
    if (lane == 0 && row < o.M) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerRow; ++w) s += part[warp + w];
      rowdot[row] = s;
    }
  }
}

template <class T, int kVec>
void launch_rowdot(const GradOperands& o, float* rowdot, cudaStream_t stream) {
  const int64_t vecs = (o.N + kVec - 1) / kVec;  // kVec > 1 implies N % kVec == 0
  auto run = [&](auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    const int64_t blocks = (o.M + kRowdotThreads / kLanes - 1) / (kRowdotThreads / kLanes);
    softmax_grad_rowdot_kernel<T, kVec, kLanes>
        <<<unsigned(blocks), kRowdotThreads, 0, stream>>>(o, rowdot);
  };
  // About 4..16 loads per lane and tensor: enough in flight without idling lanes on short rows.
  if (vecs <= 128) {
    run(std::integral_constant<int, 32>{});
  } else if (vecs <= 512) {
    run(std::integral_constant<int, 64>{});
  } else if (vecs <= 2048) {
    run(std::integral_constant<int, 128>{});
  } else {
    run(std::integral_constant<int, 256>{});
  }
}

}  // namespace

void softmax_grad_rowdot(const GradOperands& o, float* rowdot, cudaStream_t stream) {
  if (o.M == 0) return;
  dispatch_grad(o, true, [&](auto g_tag, auto, auto width, auto) {
    launch_rowdot<decltype(g_tag), decltype(width)::value>(o, rowdot, stream);
  });
  check_launch("softmax_grad_rowdot");
}

}  // namespace epifuse
