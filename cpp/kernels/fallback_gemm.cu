// The portable GEMM path: CUTLASS 2.x SIMT kernels (FFMA, exact fp32 products) for every problem
// the Hopper tensor-core kernels cannot take: IEEE fp32 precision, rows that are not 16-byte
// aligned for TMA, or a GPU that is not sm_90. Any M, N, K and leading dimension (alignment 1).
// The epilogue stores z = x . W^T; the head's per-column work then runs as separate passes
// (column_stats.cu, column_affine.cu), so both epilogues share this one GEMM.
#include "cutlass/bfloat16.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm.h"
#include "cutlass/half.h"

#include <climits>
#include <stdexcept>
#include <string>

#include "cuda_utils.cuh"
#include "fallback.hpp"

namespace epifuse::fallback {
namespace {

// fp32 uses the sm80 multistage (cp.async) mainloop; 16-bit elements at alignment 1 are too small
// for cp.async, so they take the sm50 double-buffered mainloop.
template <class T>
struct SimtArch {
  using Tag = cutlass::arch::Sm50;
  static constexpr int kStages = 2;
};
template <>
struct SimtArch<float> {
  using Tag = cutlass::arch::Sm80;
  static constexpr int kStages = 3;
};

template <class T>
using SimtGemm = cutlass::gemm::device::Gemm<
    T, cutlass::layout::RowMajor,     // x [M, K]
    T, cutlass::layout::ColumnMajor,  // w [N, K] viewed as K x N column-major
    T, cutlass::layout::RowMajor,     // z [M, N]
    float, cutlass::arch::OpClassSimt, typename SimtArch<T>::Tag,
    cutlass::gemm::GemmShape<128, 128, 8>, cutlass::gemm::GemmShape<32, 64, 8>,
    cutlass::gemm::GemmShape<1, 1, 1>,
    cutlass::epilogue::thread::LinearCombination<T, 1, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, SimtArch<T>::kStages,
    /*AlignmentA=*/1, /*AlignmentB=*/1>;

template <class T>
void run_simt(const GemmProblem& p, cudaStream_t stream) {
  // CUTLASS 2.x's GemmCoord holds int extents: a larger one would be truncated, not refused.
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    throw std::runtime_error("epifuse: GEMM extents beyond 2^31 - 1 are not supported (M=" +
                             std::to_string(p.M) + ", N=" + std::to_string(p.N) + ", K=" +
                             std::to_string(p.K) + ")");
  using Gemm = SimtGemm<T>;
  typename Gemm::Arguments args(
      {int(p.M), int(p.N), int(p.K)},
      {static_cast<const T*>(p.x), p.ldx}, {static_cast<const T*>(p.w), p.ldw},
      {static_cast<T*>(p.out), p.ldo}, {static_cast<T*>(p.out), p.ldo}, {1.f, 0.f});
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status == cutlass::Status::kSuccess) status = gemm.initialize(args, nullptr, stream);
  if (status == cutlass::Status::kSuccess) status = gemm(stream);
  if (status != cutlass::Status::kSuccess)
    throw std::runtime_error(std::string("epifuse: SIMT GEMM failed: ") +
                             cutlassGetStatusString(status) + " (" +
                             cudaGetErrorString(cudaGetLastError()) + ")");
}

}  // namespace

void gemm(const GemmProblem& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return run_simt<float>(p, stream);
    case DType::kFloat16: return run_simt<cutlass::half_t>(p, stream);
    case DType::kBFloat16: return run_simt<cutlass::bfloat16_t>(p, stream);
  }
}

}  // namespace epifuse::fallback
