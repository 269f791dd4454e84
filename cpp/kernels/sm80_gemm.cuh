// One Ampere-class GEMM (CUTLASS 2.x API: cp.async multistage mainloop, mma.sync tensor cores,
// stream-K threadblock schedule) with an epilogue visitor tree:
//   D[m, n] = EVT(acc[m, n]),  acc = x[M, K] . w[N, K]^T in fp32.
// Runs on sm_80 and later (A100, A10/L4/L40, RTX 30xx/40xx, and Hopper when forced or for the
// 3xTF32 mode, which has no wgmma form). x is row-major; w, the nn.Linear weight [N, K], is read as
// a column-major K x N operand, so neither needs a copy. Modelled on CUTLASS example 47
// (ampere_gemm_universal_streamk_broadcast); the configurations are rows of generate_kernels.py.
#pragma once

#include <stdexcept>
#include <string>

#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/default_gemm_universal_with_visitor.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle_streamk.h"

#include "epifuse/kernels.h"
#include "sm80_epilogues.hpp"

namespace epifuse::sm80 {

// Math: cutlass::arch::OpMultiplyAdd (one tensor-core pass: TF32 for fp32 inputs, native for
// 16-bit) or cutlass::arch::OpMultiplyAddFastF32 (3xTF32: a = a_big + a_small split, three passes
// big*big + big*small + small*big, fp32-class accuracy; CUTLASS example 27).
template <class ElementIn_, class ThreadblockShape_, class WarpShape_, class InstructionShape_,
          int kStages_, class MathOperator_>
struct TileConfig {
  using ElementIn = ElementIn_;
  using ThreadblockShape = ThreadblockShape_;
  using WarpShape = WarpShape_;
  using InstructionShape = InstructionShape_;
  static constexpr int kStages = kStages_;
  using MathOperator = MathOperator_;
};

// TreeOf<ThreadMap, ElementD> is an EVT from sm80_epilogues.hpp.
template <class Config, template <class, class> class TreeOf>
struct GemmKernel {
  using ElementIn = typename Config::ElementIn;
  using ElementD = ElementIn;  // the GEMM output keeps the input dtype
  static constexpr int kAlignIn = 16 / sizeof(ElementIn);  // cp.async: 16-byte rows
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kEpilogueStages = 1;

  using ThreadMap = cutlass::epilogue::threadblock::OutputTileThreadLayout<
      typename Config::ThreadblockShape, typename Config::WarpShape, ElementD, kAlignD,
      kEpilogueStages>;
  using Tree = TreeOf<ThreadMap, ElementD>;

  using Kernel = typename cutlass::gemm::kernel::DefaultGemmWithVisitor<
      ElementIn, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, kAlignIn,     // x
      ElementIn, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, kAlignIn,  // w
      ElementD, cutlass::layout::RowMajor, kAlignD,
      float, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      typename Config::ThreadblockShape, typename Config::WarpShape,
      typename Config::InstructionShape, Tree,
      cutlass::gemm::threadblock::ThreadblockSwizzleStreamK, Config::kStages,
      typename Config::MathOperator, kEpilogueStages>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;

  // The stream-K schedule splits K across CTAs only when whole tiles cannot fill the GPU
  // (CUTLASS's heuristic; avail_sms = -1: all of them).
  static Arguments make_arguments(const GemmProblem& p, typename Tree::Arguments tree_args) {
    return Arguments(cutlass::gemm::GemmUniversalMode::kGemm,
                     {int(p.M), int(p.N), int(p.K)}, /*batch_count=*/1, tree_args,
                     static_cast<const ElementIn*>(p.x), static_cast<const ElementIn*>(p.w),
                     nullptr, nullptr,       // C, D: the tree reads and stores its own operands
                     0, 0, 0, 0,             // batch strides
                     p.ldx, p.ldw, 0, 0,     // leading dimensions of x, w (C, D unused)
                     /*avail_sms=*/-1);
  }

  static size_t workspace_bytes(const GemmProblem& p) {
    // Stream-K partial accumulators and tile flags: a function of the shape and the GPU.
    return Gemm::get_workspace_size(make_arguments(p, {}));
  }

  static void run(const GemmProblem& p, typename Tree::Arguments tree_args, void* workspace,
                  cudaStream_t stream) {
    Arguments args = make_arguments(p, tree_args);
    Gemm gemm;
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("epifuse: CUTLASS cannot implement this sm80 GEMM: ") +
                               cutlassGetStatusString(status));
    status = gemm.initialize(args, workspace, stream);
    if (status == cutlass::Status::kSuccess) status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("epifuse: CUTLASS sm80 GEMM launch failed: ") +
                               cutlassGetStatusString(status) + " (" +
                               cudaGetErrorString(cudaGetLastError()) + ")");
  }
};

// Entry points, explicitly instantiated once per configuration in the sm80_gemm_*.cu translation
// units (generated with their `extern template` declarations in sm80_gemm_kernels.hpp by
// generate_kernels.py).
template <class Config>
size_t affine_workspace_bytes(const GemmProblem& p) {
  return GemmKernel<Config, evt::PerColumnAffine>::workspace_bytes(p);
}

template <class Config>
void run_affine(const GemmProblem& p, const EpilogueOperands& ops, void* workspace,
                cudaStream_t stream) {
  using K = GemmKernel<Config, evt::PerColumnAffine>;
  auto* out = static_cast<typename K::ElementD*>(p.out);
  K::run(p, evt::per_column_affine_args<typename K::Tree>(ops.a, ops.c, out, p.ldo, int(p.N)),
         workspace, stream);
}

template <class Config>
size_t column_stats_workspace_bytes(const GemmProblem& p) {
  return GemmKernel<Config, evt::ColumnStatistics>::workspace_bytes(p);
}

template <class Config>
void run_column_stats(const GemmProblem& p, const EpilogueOperands& ops, void* workspace,
                      cudaStream_t stream) {
  using K = GemmKernel<Config, evt::ColumnStatistics>;
  // The tree adds each CTA's partial sums atomically: start from zero.
  cudaMemsetAsync(ops.colsum, 0, sizeof(double) * p.N, stream);
  cudaMemsetAsync(ops.colsumsq, 0, sizeof(double) * p.N, stream);
  auto* out = static_cast<typename K::ElementD*>(p.out);
  K::run(p,
         evt::column_statistics_args<typename K::Tree>(ops.colsum, ops.colsumsq, out, p.ldo,
                                                       int(p.N)),
         workspace, stream);
}

#define EPIFUSE_SM80_INSTANTIATE_AFFINE(Config)                                          \
  template size_t affine_workspace_bytes<Config>(const GemmProblem&);                    \
  template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*,   \
                                   cudaStream_t);

#define EPIFUSE_SM80_INSTANTIATE_COLUMN_STATS(Config)                                    \
  template size_t column_stats_workspace_bytes<Config>(const GemmProblem&);              \
  template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,    \
                                         void*, cudaStream_t);

}  // namespace epifuse::sm80
