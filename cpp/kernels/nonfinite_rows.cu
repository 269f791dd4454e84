// Exact IEEE results for the rows of x that hold a NaN or an Inf, after a split (3x) GEMM.
//
// The 3x GEMM splits every fp32 operand into big + small parts (Hopper: row-scaled FP16, sm80:
// TF32; small = v - big) and sums three products: a cross term Inf * 0 (+-Inf's big part times a
// weight value whose small part is exactly 0) is NaN, so a row of x holding +-Inf comes out NaN
// where IEEE math gives +-Inf. No choice of split avoids it inside the tensor cores; instead this pass finds
// such rows and recomputes them with FFMA, then re-applies the affine epilogue. A finite batch costs
// one read of x (a few percent of the 3x GEMM's time). The column statistics of a column that
// meets such a row are not repaired: they are non-finite either way, and so is everything the fold
// derives from them, as in PyTorch.
#include <algorithm>

#include "activation.cuh"
#include "cuda_utils.cuh"
#include "nonfinite_rows.hpp"

namespace epifuse {
namespace {

constexpr int kThreads = 256;

// out[m, :] = act((a *) x[m, :] . w^T (+ c)) in FFMA, one block per row.
__device__ void recompute_row(const GemmProblem& p, const float* __restrict__ a,
                              const float* __restrict__ c, Activation act, int64_t m) {
  const auto* row = static_cast<const float*>(p.x) + m * p.ldx;
  const auto* w = static_cast<const float*>(p.w);
  auto* out = static_cast<float*>(p.out);
  for (int64_t n = threadIdx.x; n < p.N; n += kThreads) {
    const float* wn = w + n * p.ldw;
    float acc = 0.f;
    for (int64_t k = 0; k < p.K; ++k) acc = fmaf(row[k * p.x_col_stride], wn[k * p.w_col_stride], acc);
    out[m * p.ldo + n] = activate(act, a != nullptr ? a[n] * acc + c[n] : acc);
  }
}

// With the split's row flags: each block reads the flags of kThreads rows at once and, in the
// common finite case, leaves (one flag per block made problem 39's 16384 rows cost 25 us).
__global__ void __launch_bounds__(kThreads)
recompute_flagged_rows_kernel(GemmProblem p, const float* __restrict__ a,
                              const float* __restrict__ c, Activation act,
                              const int* __restrict__ row_flags) {
  for (int64_t first = int64_t(blockIdx.x) * kThreads; first < p.M;
       first += int64_t(gridDim.x) * kThreads) {
    const int64_t mine = first + threadIdx.x;
    if (!__syncthreads_or(mine < p.M && row_flags[mine] != 0)) continue;
    for (int64_t m = first; m < first + kThreads && m < p.M; ++m)
      if (row_flags[m] != 0) recompute_row(p, a, c, act, m);  // uniform across the block
  }
}

// Without flags: each block scans its rows of x itself.
__global__ void __launch_bounds__(kThreads)
recompute_nonfinite_rows_kernel(GemmProblem p, const float* __restrict__ a,
                                const float* __restrict__ c, Activation act) {
  for (int64_t m = blockIdx.x; m < p.M; m += gridDim.x) {
    const float* row = static_cast<const float*>(p.x) + m * p.ldx;
    bool nonfinite = false;
    for (int64_t k = threadIdx.x; k < p.K; k += kThreads)
      nonfinite |= !isfinite(row[k * p.x_col_stride]);
    if (__syncthreads_or(nonfinite)) recompute_row(p, a, c, act, m);
  }
}

}  // namespace

void recompute_nonfinite_rows(const GemmProblem& p, const float* a, const float* c, Activation act,
                              const int* row_flags, cudaStream_t stream) {
  if (p.M == 0 || p.N == 0 || p.K == 0 || p.dtype != DType::kFloat32) return;
  if (row_flags != nullptr) {
    const int64_t blocks = std::min<int64_t>((p.M + kThreads - 1) / kThreads, 65535);
    recompute_flagged_rows_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p, a, c, act,
                                                                           row_flags);
  } else {
    const int64_t blocks = std::min<int64_t>(p.M, 65535);
    recompute_nonfinite_rows_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p, a, c, act);
  }
  check_launch("recompute_nonfinite_rows");
}

}  // namespace epifuse
