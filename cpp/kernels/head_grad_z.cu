// The head backward's dz pass (head_grad.cuh lists the passes): dz[m, n] = A[n] * dv + B[n] * z +
// C[n] in z's dtype, one pass over g, out and z with the coefficients of head_grad_coefficients.
#include <algorithm>
#include <type_traits>

#include "cuda_utils.cuh"
#include "head_grad.cuh"

namespace epifuse {
namespace {

using head_grad::ActivationGrad;
using head_grad::dispatch_grad;
using head_grad::load_dv_z;
using head_grad::RowVec;

// ---- dz ---------------------------------------------------------------------------------------
// column_affine.cu's layout: a thread owns one vector of columns (its A, B, C loaded once) and
// streams a band of rows, kZRows of them loaded (as raw vectors) before any is used: with 16-bit
// operands a thread's 8 columns and their coefficients take most of its registers (~3 blocks an
// SM), and one row at a time kept ~24 KiB of loads in flight per SM. Four rows: 4096 x 4096 bf16
// 42 -> 39 us (H200); the activation's per-element switch was the rest (dispatch_activation:
// 23 us). The softmax form (which also reads out and the row term) keeps one row.
constexpr int kZThreads = 256;
template <int kVec, bool kSoftmax>
constexpr int kZRows = kVec > 1 && !kSoftmax ? 4 : 1;

template <class Z, int kVec>
__device__ __forceinline__ void store_dz(Z* dst, const float (&A)[kVec], const float (&B)[kVec],
                                         const float (&C)[kVec], const float (&dv)[kVec],
                                         const float (&z)[kVec]) {
  if constexpr (kVec > 1) {
    Vec<Z, kVec> v;
#pragma unroll
    for (int j = 0; j < kVec; ++j) v.v[j] = from_float<Z>(fmaf(A[j], dv[j], fmaf(B[j], z[j], C[j])));
    *reinterpret_cast<Vec<Z, kVec>*>(dst) = v;
  } else {
    *dst = from_float<Z>(fmaf(A[0], dv[0], fmaf(B[0], z[0], C[0])));
  }
}

template <class G, class Z, int kVec, bool kSoftmax>
__global__ void __launch_bounds__(kZThreads)
head_grad_z_kernel(GradOperands o, const float* __restrict__ coef, Z* __restrict__ dz,
                   int64_t ld_dz, int64_t rows_per_block) {
  constexpr int kRows = kZRows<kVec, kSoftmax>;
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (col >= o.N) return;  // kVec > 1 implies N % kVec == 0
  float A[kVec], B[kVec], C[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    A[j] = __ldg(coef + col + j);
    B[j] = __ldg(coef + o.N + col + j);
    C[j] = __ldg(coef + 2 * o.N + col + j);
  }
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_block;
  const int64_t r1 = std::min<int64_t>(o.M, r0 + rows_per_block);
  dispatch_activation(o.act.kind, [&](auto kind) {
    const ActivationGrad<kVec, decltype(kind)::value> act_grad(o, col);
    int64_t row = r0;
    if constexpr (kRows > 1) {
      const G* g = static_cast<const G*>(o.g) + col;
      const Z* zp = static_cast<const Z*>(o.z) + col;
      for (; row + kRows <= r1; row += kRows) {
        RowVec<G, kVec> gv[kRows];
        RowVec<Z, kVec> zv[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          gv[i].load(g + (row + i) * o.ld_g);
          zv[i].load(zp + (row + i) * o.ld_z);
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          float dv[kVec], z[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            z[j] = zv[i][j];
            dv[j] = act_grad(gv[i][j], z[j], j);
          }
          store_dz<Z, kVec>(dz + (row + i) * ld_dz + col, A, B, C, dv, z);
        }
      }
    }
    for (; row < r1; ++row) {
      float dv[kVec], z[kVec];
      load_dv_z<G, Z, kVec, kSoftmax>(o, row, col, dv, z);
#pragma unroll
      for (int j = 0; j < kVec; ++j) dv[j] = act_grad(dv[j], z[j], j);
      store_dz<Z, kVec>(dz + row * ld_dz + col, A, B, C, dv, z);
    }
  });
}

template <class G, class Z, int kVec, bool kSoftmax>
void launch_z(const GradOperands& o, const float* coef, Z* dz, int64_t ld_dz, cudaStream_t stream) {
  constexpr int kRows = kZRows<kVec, kSoftmax>;
  const int64_t vecs = o.N / kVec;
  const int64_t col_blocks = (vecs + kZThreads - 1) / kZThreads;
  // One wave of the blocks that fit (the registers decide how many), bands of at least kRows rows
  // (at least 4).
  static const int per_sm = [] {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, head_grad_z_kernel<G, Z, kVec, kSoftmax>,
                                                  kZThreads, 0);
    return std::max(n, 1);
  }();
  const int64_t sms = std::max(sm_count(current_device()), 1);
  const int64_t want = std::max<int64_t>(1, sms * per_sm / col_blocks);
  const int64_t min_rows = std::max(kRows, 4);
  const int64_t bands = std::min<int64_t>({want, (o.M + min_rows - 1) / min_rows, 65535});
  const int64_t rows_per_block = (o.M + bands - 1) / bands;
  const dim3 grid(unsigned(col_blocks), unsigned((o.M + rows_per_block - 1) / rows_per_block));
  head_grad_z_kernel<G, Z, kVec, kSoftmax><<<grid, kZThreads, 0, stream>>>(o, coef, dz, ld_dz,
                                                                           rows_per_block);
}

}  // namespace

void head_grad_z(const GradOperands& o, const float* coef, void* dz, int64_t ld_dz,
                 cudaStream_t stream) {
  if (o.M == 0 || o.N == 0) return;
  dispatch_grad(o, is_aligned16(dz), [&](auto g_tag, auto z_tag, auto width, auto softmax) {
    using G = decltype(g_tag);
    using Z = decltype(z_tag);
    constexpr int kVec = decltype(width)::value;
    if (kVec > 1 && ld_dz % kVec != 0) {
      launch_z<G, Z, 1, decltype(softmax)::value>(o, coef, static_cast<Z*>(dz), ld_dz, stream);
    } else {
      launch_z<G, Z, kVec, decltype(softmax)::value>(o, coef, static_cast<Z*>(dz), ld_dz, stream);
    }
  });
  check_launch("head_grad_z");
}

}  // namespace epifuse
