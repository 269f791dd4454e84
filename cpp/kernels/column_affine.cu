// z[m, n] = a[n] * z[m, n] + c[n] in place: the training-mode epilogue of a head without softmax,
// applied once the batch statistics (and so a, c) are known. One read and one write per element,
// 16-byte vectors when the rows allow it.
#include <algorithm>

#include "cuda_utils.cuh"
#include "fallback.hpp"

namespace epifuse {
namespace {

template <class T, int kVec>
__global__ void column_affine_kernel(int64_t M, int64_t N, T* z, int64_t ld,
                                     const float* __restrict__ a, const float* __restrict__ c) {
  using V = Vec16<T>;
  const int64_t vecs_per_row = N / kVec;
  const int64_t total = M * vecs_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs_per_row;
    const int64_t col0 = (i - row * vecs_per_row) * kVec;
    T* p = z + row * ld + col0;
    T v[kVec];
    if constexpr (kVec > 1) {
      *reinterpret_cast<V*>(v) = *reinterpret_cast<const V*>(p);
    } else {
      v[0] = *p;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      v[j] = from_float<T>(__ldg(a + col0 + j) * to_float(v[j]) + __ldg(c + col0 + j));
    if constexpr (kVec > 1) {
      *reinterpret_cast<V*>(p) = *reinterpret_cast<V*>(v);
    } else {
      *p = v[0];
    }
  }
}

template <class T, int kVec>
void launch(int64_t M, int64_t N, T* z, int64_t ld, const float* a, const float* c,
            cudaStream_t stream) {
  constexpr int kBlock = 256;
  const int64_t total = M * (N / kVec);
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const int64_t blocks = std::min<int64_t>((total + kBlock - 1) / kBlock, int64_t(sms) * 16);
  column_affine_kernel<T, kVec><<<dim3(unsigned(blocks)), kBlock, 0, stream>>>(M, N, z, ld, a, c);
}

__global__ void identity_affine_kernel(int64_t N, float* a, float* c) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N;
       n += int64_t(gridDim.x) * blockDim.x) {
    a[n] = 1.f;
    c[n] = 0.f;
  }
}

}  // namespace

void fallback::identity_affine(int64_t N, float* a, float* c, cudaStream_t stream) {
  if (N == 0) return;
  const int64_t blocks = std::min<int64_t>((N + 255) / 256, 1024);
  identity_affine_kernel<<<unsigned(blocks), 256, 0, stream>>>(N, a, c);
  check_launch("identity_affine");
}

void column_affine(DType dtype, int64_t M, int64_t N, void* z, int64_t ld, const float* a,
                   const float* c, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = Vec16<T>::kSize;
    T* data = static_cast<T*>(z);
    if (N % kVec == 0 && ld % kVec == 0 && is_aligned16(z)) {
      launch<T, kVec>(M, N, data, ld, a, c, stream);
    } else {
      launch<T, 1>(M, N, data, ld, a, c, stream);
    }
  });
  check_launch("column_affine");
}

}  // namespace epifuse
