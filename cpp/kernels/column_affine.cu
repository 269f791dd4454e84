// out[m, n] = act(a[n] * in[m, n] + c[n]), in place (in == out) or into a new tensor: the
// training-mode epilogue of a head without softmax (with its activation, activation.cuh), applied
// once the batch statistics (and so a, c) are known (out of place when the backward keeps z). One
// read and one write per element, vectors when the rows allow it. The output may be wider than the
// input (a 16-bit z written as the fp32 output of a head under autocast): a thread then stores 16
// bytes of the output and reads 8 of the input (kStoreVec, cuda_utils.cuh, says why).
// Each thread owns one vector of columns for a band of rows: it loads its kVec (a, c) pairs once
// and then streams the band with kUnroll loads in flight, so the pass is bound by DRAM bandwidth
// rather than by per-element parameter loads or index arithmetic.
#include <algorithm>

#include "activation.cuh"
#include "cuda_utils.cuh"
#include "fallback.hpp"

namespace epifuse {
namespace {

constexpr int kUnroll = 4;

template <class T, class O, int kVec>
__global__ void __launch_bounds__(256)
column_affine_kernel(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
                     const float* __restrict__ a, const float* __restrict__ c, Activation act,
                     int64_t rows_per_block) {
  const int64_t col0 = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (col0 >= N) return;  // kVec > 1 implies N % kVec == 0
  float av[kVec], cv[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {  // a, c null: the identity (the activation alone)
    av[j] = a != nullptr ? __ldg(a + col0 + j) : 1.f;
    cv[j] = c != nullptr ? __ldg(c + col0 + j) : 0.f;
  }
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = std::min<int64_t>(M, r0 + rows_per_block);
  const T* src = in + col0;
  O* dst = out + col0;
  auto load = [&](int64_t r, Vec<T, kVec>& v) { v = *reinterpret_cast<const Vec<T, kVec>*>(src + r * ld_in); };
  // The activation's kind a compile-time constant in the row loop (activation.cuh,
  // dispatch_activation): one branch per thread, not per element.
  dispatch_activation(act.kind, [&](auto kind) {
    const Activation k{decltype(kind)::value, act.negative_slope};
    auto apply_store = [&](int64_t r, const Vec<T, kVec>& v) {
      Vec<O, kVec> o;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        o.v[j] = from_float<O>(activate(k, av[j] * to_float(v.v[j]) + cv[j]));
      }
      *reinterpret_cast<Vec<O, kVec>*>(dst + r * ld_out) = o;
    };
    int64_t r = r0;
    for (; r + kUnroll <= r1; r += kUnroll) {
      Vec<T, kVec> v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load(r + u, v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) apply_store(r + u, v[u]);
    }
    for (; r < r1; ++r) {
      Vec<T, kVec> v;
      load(r, v);
      apply_store(r, v);
    }
  });
}

// One element: unaligned rows.
template <class T, class O>
__global__ void __launch_bounds__(256)
column_affine_kernel_1(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
                       const float* __restrict__ a, const float* __restrict__ c,
                       Activation act, int64_t rows_per_block) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= N) return;
  const float av = a != nullptr ? __ldg(a + col) : 1.f, cv = c != nullptr ? __ldg(c + col) : 0.f;
  auto f = [&](float v) { return activate(act, av * v + cv); };
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = std::min<int64_t>(M, r0 + rows_per_block);
  int64_t r = r0;
  for (; r + kUnroll <= r1; r += kUnroll) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = in[(r + u) * ld_in + col];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) out[(r + u) * ld_out + col] = from_float<O>(f(to_float(v[u])));
  }
  for (; r < r1; ++r) out[r * ld_out + col] = from_float<O>(f(to_float(in[r * ld_in + col])));
}

template <class T, class O, int kVec>
void launch(int64_t M, int64_t N, const T* in, int64_t ld_in, O* out, int64_t ld_out,
            const float* a, const float* c, Activation act, cudaStream_t stream) {
  const int64_t vecs = N / kVec;
  const int threads = int(std::min<int64_t>(256, (vecs + 31) / 32 * 32));
  const int64_t col_blocks = (vecs + threads - 1) / threads;
  // About 2048 resident threads per SM, in bands of at least kUnroll rows.
  const int64_t sms = std::max(sm_count(current_device()), 1);
  const int64_t want = std::max<int64_t>(1, sms * (2048 / threads) / col_blocks);
  const int64_t bands = std::min<int64_t>({want, (M + kUnroll - 1) / kUnroll, 65535});
  const int64_t rows_per_block = (M + bands - 1) / bands;
  const dim3 grid(unsigned(col_blocks), unsigned((M + rows_per_block - 1) / rows_per_block));
  if constexpr (kVec == 1) {
    column_affine_kernel_1<T, O><<<grid, threads, 0, stream>>>(M, N, in, ld_in, out, ld_out, a, c,
                                                               act, rows_per_block);
  } else {
    column_affine_kernel<T, O, kVec><<<grid, threads, 0, stream>>>(M, N, in, ld_in, out, ld_out, a,
                                                                   c, act, rows_per_block);
  }
}

}  // namespace

void column_affine_into(DType in_dtype, int64_t M, int64_t N, const void* in, int64_t ld_in,
                        DType out_dtype, void* out, int64_t ld_out, const float* a, const float* c,
                        Activation act, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  dispatch_in_out(in_dtype, out_dtype, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using O = decltype(out_tag);
    constexpr int kVec = kStoreVec<T, O>;
    const T* src = static_cast<const T*>(in);
    O* dst = static_cast<O*>(out);
    if (N % kVec == 0 && ld_in % kVec == 0 && ld_out % kVec == 0 &&
        is_aligned(in, sizeof(Vec<T, kVec>)) && is_aligned16(out)) {
      launch<T, O, kVec>(M, N, src, ld_in, dst, ld_out, a, c, act, stream);
    } else {
      launch<T, O, 1>(M, N, src, ld_in, dst, ld_out, a, c, act, stream);
    }
  });
  check_launch("column_affine");
}

void column_affine(DType dtype, int64_t M, int64_t N, void* z, int64_t ld, const float* a,
                   const float* c, Activation act, cudaStream_t stream) {
  column_affine_into(dtype, M, N, z, ld, dtype, z, ld, a, c, act, stream);
}

}  // namespace epifuse
