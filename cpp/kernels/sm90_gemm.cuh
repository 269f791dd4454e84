// One Hopper GEMM (TMA + wgmma, warp-specialized cooperative, persistent) with an epilogue tree:
//   D[m, n] = EVT(acc[m, n]),  acc = x[M, K] . w[N, K]^T in fp32.
// x is row-major (K-major) and w is the nn.Linear weight as stored ([N, K], K-major), which is what
// TF32 wgmma requires and what lets us skip transpose copies. Built with CUTLASS's CollectiveBuilder
// (see CUTLASS example 49); the tile configurations are rows of generate_kernels.py.
#pragma once

#include <array>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"

#include "epifuse/kernels.h"
#include "epilogues.hpp"
#include "sm90_mainloop_3x.hpp"
#include "tile_partials.hpp"

namespace epifuse::sm90 {

using namespace cute;

// Scheduler: cutlass::gemm::PersistentScheduler (data-parallel over output tiles) or
// cutlass::gemm::StreamKScheduler (splits the K loop across CTAs when there are too few tiles to
// fill the GPU; CUTLASS's heuristic falls back to data-parallel when they do).
// Transposed: the kernel computes z^T = w . x^T, i.e. D'[n, m] stored column-major, which is z
// row-major. A small batch would fill a 128-row tile with 128 - M rows of padding (8x the useful
// TF32 math at M = 16, more than the time it takes to stream w); transposed, the batch is the
// tile's N extent (padded to 64) and the weight's rows fill M (gemm_plan.cu, small_batch).
// Split3x: fp32 operands in the split_fp16 layout (row-scaled FP16 hi/lo parts), multiplied at
// fp32 accuracy by the 3x mainloop (sm90_mainloop_3x.hpp); the problem's K is then the split
// width 2 * Kp, and the epilogue reads the accumulator scaled back by the rows' exponents.
template <class ElementIn_, class TileShape_, class ClusterShape_, class Scheduler_,
          bool kTransposed_ = false, bool kSplit3x_ = false>
struct TileConfig {
  using ElementIn = ElementIn_;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using Scheduler = Scheduler_;
  static constexpr bool kTransposed = kTransposed_;
  static constexpr bool kSplit3x = kSplit3x_;
  static_assert(!kSplit3x || std::is_same_v<ElementIn, float>, "the 3x GEMM splits fp32 operands");
  // What the mainloop reads (the split's FP16 parts, or the operands themselves), and the leaf
  // through which the epilogue reads the product.
  using ElementOperand = std::conditional_t<kSplit3x, cutlass::half_t, ElementIn>;
  using Acc = std::conditional_t<kSplit3x, evt::ScaledAccFetch<TileShape>,
                                 cutlass::epilogue::fusion::Sm90AccFetch>;
};

// The 3x mainloop with the types CUTLASS's builder chose for the same FP16 GEMM (TMA copies,
// swizzled shared-memory layouts, wgmma atoms, stage count); only the consumer's MMA loop differs.
template <class Built, class ClusterShape>
using Split3xMainloop = cutlass::gemm::collective::CollectiveMma<
    MainloopSm90TmaGmmaWarpSpecialized3x<Built::DispatchPolicy::Stages, ClusterShape,
                                             cutlass::gemm::KernelTmaWarpSpecializedCooperative>,
    typename Built::TileShape, typename Built::ElementA, typename Built::StrideA,
    typename Built::ElementB, typename Built::StrideB, typename Built::TiledMma,
    typename Built::GmemTiledCopyA, typename Built::SmemLayoutAtomA, typename Built::SmemCopyAtomA,
    typename Built::TransformA, typename Built::GmemTiledCopyB, typename Built::SmemLayoutAtomB,
    typename Built::SmemCopyAtomB, typename Built::TransformB>;

// Promotion interval of the 3x mainloop in K-tiles (of 32 k): kDefaultPromotionInterval, or
// EPIFUSE_3X_PROMOTION (>= 1) to measure others (debug_switches.cu reads it once).
uint32_t split3x_promotion_interval();

// GemmUniversalAdapter::initialize() raises the kernel's dynamic shared-memory limit with
// cudaFuncSetAttribute on every call: ~7 us of host time per GEMM on the H100 machine, where a
// training step in 16 bits is partly host-bound. The attribute belongs to the kernel on one device,
// so it is set once per device (the caller made `device` current).
template <class Kernel>
cutlass::Status allow_shared_storage(int device) {
  constexpr int kSmem = int(Kernel::SharedStorageSize);
  if constexpr (kSmem < (48 << 10)) {
    return cutlass::Status::kSuccess;
  } else {
    static std::array<bool, 128> done{};  // benign race: every writer stores true
    const bool cached = device >= 0 && device < int(done.size());
    if (cached && done[device]) return cutlass::Status::kSuccess;
    if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the caller reports the failure
      return cutlass::Status::kErrorInternal;
    }
    if (cached) done[device] = true;
    return cutlass::Status::kSuccess;
  }
}

// GemmUniversalAdapter::initialize() without its per-call cudaFuncSetAttribute (see
// allow_shared_storage), then the adapter's static launch: what every Hopper GEMM here runs through.
template <class Kernel>
cutlass::Status launch_kernel(const typename Kernel::Arguments& args, void* workspace, int device,
                              cudaStream_t stream) {
  cutlass::Status status = Kernel::initialize_workspace(args, workspace, stream);
  if (status == cutlass::Status::kSuccess) status = allow_shared_storage<Kernel>(device);
  if (status != cutlass::Status::kSuccess) return status;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, workspace);
  return cutlass::gemm::device::GemmUniversalAdapter<Kernel>::run(params, stream);
}

// Fusion is an EVT from epilogues.hpp, instantiated for Config's tile shape and output type.
template <class Config, class Fusion_>
struct GemmKernel {
  using ElementIn = typename Config::ElementIn;
  using ElementOperand = typename Config::ElementOperand;
  using ElementD = ElementIn;  // the GEMM output keeps the input dtype
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using Fusion = Fusion_;
  using LayoutD = std::conditional_t<Config::kTransposed, cutlass::layout::ColumnMajor,
                                     cutlass::layout::RowMajor>;

  static constexpr int kAlignIn = 16 / sizeof(ElementOperand);  // TMA: 16-byte aligned rows
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignD,                          // no C operand
      ElementD, LayoutD, kAlignD,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementOperand, cutlass::layout::RowMajor, kAlignIn,     // x: [M, K], K-major (transposed: w)
      ElementOperand, cutlass::layout::ColumnMajor, kAlignIn,  // w: [N, K], K-major (transposed: x)
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using CollectiveMainloop =
      std::conditional_t<Config::kSplit3x, Split3xMainloop<BuiltMainloop, ClusterShape>,
                         BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      typename Config::Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Arguments = typename Gemm::Arguments;

  static Arguments make_arguments(const GemmProblem& p, typename Fusion::Arguments fusion_args,
                                  int device, int sm_count) {
    Arguments args = operand_arguments(p, fusion_args, device, sm_count);
    if constexpr (Config::kSplit3x) args.mainloop.promotion_interval = split3x_promotion_interval();
    return args;
  }

  static Arguments operand_arguments(const GemmProblem& p, typename Fusion::Arguments fusion_args,
                                   int device, int sm_count) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideC = typename Kernel::StrideC;
    using StrideD = typename Kernel::StrideD;
    const auto* x = static_cast<const ElementOperand*>(p.x);
    const auto* w = static_cast<const ElementOperand*>(p.w);
    auto* out = static_cast<ElementD*>(p.out);
    cutlass::KernelHardwareInfo hw_info{device, sm_count};
    if constexpr (Config::kTransposed) {
      // A = w [N, K], B = x [M, K], D' [N, M] column-major with leading dimension ldo: z itself.
      StrideA stride_w = make_stride(p.ldw, Int<1>{}, int64_t(0));
      StrideB stride_x = make_stride(p.ldx, Int<1>{}, int64_t(0));
      StrideD stride_out = make_stride(Int<1>{}, p.ldo, int64_t(0));
      return Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                       {int(p.N), int(p.M), int(p.K), 1},
                       {w, stride_w, x, stride_x},
                       {fusion_args, nullptr, StrideC{}, out, stride_out},
                       hw_info};
    } else {
      StrideA stride_x = make_stride(p.ldx, Int<1>{}, int64_t(0));
      StrideB stride_w = make_stride(p.ldw, Int<1>{}, int64_t(0));
      StrideD stride_out = make_stride(p.ldo, Int<1>{}, int64_t(0));
      return Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                       {int(p.M), int(p.N), int(p.K), 1},
                       {x, stride_x, w, stride_w},
                       {fusion_args, nullptr, StrideC{}, out, stride_out},
                       hw_info};
    }
  }

  static size_t workspace_bytes(const GemmProblem& p, int device, int sm_count) {
    // The workspace (column-reduction partials and tile counters, stream-K partial accumulators)
    // depends on the shape and the GPU, not on the pointers.
    return Gemm::get_workspace_size(make_arguments(p, {}, device, sm_count));
  }

  static void run(const GemmProblem& p, typename Fusion::Arguments fusion_args, void* workspace,
                  int device, int sm_count, cudaStream_t stream) {
    Arguments args = make_arguments(p, fusion_args, device, sm_count);
    cutlass::Status status = Gemm::can_implement(args);
    if (status != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("epifuse: CUTLASS cannot implement this GEMM: ") +
                               cutlassGetStatusString(status));
    status = launch_kernel<Kernel>(args, workspace, device, stream);
    if (status != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("epifuse: CUTLASS GEMM launch failed: ") +
                               cutlassGetStatusString(status) + " (" +
                               cudaGetErrorString(cudaGetLastError()) + ")");
  }
};

// The eval epilogue of a configuration: per column of z, i.e. per row of a transposed kernel's tile.
template <class Config>
using AffineKernel = GemmKernel<
    Config, std::conditional_t<
                Config::kTransposed,
                evt::PerColumnAffineTransposed<typename Config::TileShape, typename Config::ElementIn,
                                               typename Config::Acc>,
                evt::PerColumnAffine<typename Config::TileShape, typename Config::ElementIn,
                                     typename Config::Acc>>>;

// The training epilogue. Only transposed configurations carry it: their per-column statistics are
// per-row reductions of the tile, which cost a few registers (epilogues.hpp).
template <class Config>
using ColumnStatsKernel = GemmKernel<
    Config, evt::ColumnStatisticsTransposed<typename Config::TileShape, typename Config::ElementIn,
                                            typename Config::Acc>>;

// The Acc leaf's arguments of a problem: the exponents of the kernel's A rows and B rows (x's and
// w's, swapped in a transposed kernel), for split operands.
template <class Config>
typename Config::Acc::Arguments acc_args(const GemmProblem& p) {
  return Config::kTransposed ? evt::acc_args<typename Config::Acc>(p.w_exponents, p.x_exponents)
                             : evt::acc_args<typename Config::Acc>(p.x_exponents, p.w_exponents);
}

// Entry points, explicitly instantiated once per configuration in the sm90_gemm_*.cu translation
// units (generated with their `extern template` declarations in sm90_gemm_kernels.hpp by
// generate_kernels.py, so the dispatcher never instantiates a kernel itself).
template <class Config>
size_t affine_workspace_bytes(const GemmProblem& p, int device, int sm_count) {
  return AffineKernel<Config>::workspace_bytes(p, device, sm_count);
}

template <class Config>
void run_affine(const GemmProblem& p, const EpilogueOperands& ops, void* workspace, int device,
                int sm_count, cudaStream_t stream) {
  using K = AffineKernel<Config>;
  K::run(p, evt::per_column_affine_args<typename K::Fusion>(ops.a, ops.c, ops.act, acc_args<Config>(p)),
         workspace, device, sm_count, stream);
}

// Training: the epilogue leaves one fp64 partial per column of z (a row of the transposed kernel's
// tile) and batch tile, in two buffers at the start of the workspace (the GEMM's own workspace follows
// them, so running the kernel needs no second CUTLASS workspace query); sum_tile_partials then adds
// them into colsum / colsumsq. A final reduction inside the GEMM (CUTLASS's FinalReduction: the last
// CTA of each column block adds the other CTAs' partials once a tile counter says they are done)
// measured 20% slower for problem 39 (16384x4096x4096 bf16, 64 partials per column, H200: 845 us
// against 707 us here, where the affine kernel alone takes 690-710 us).
template <class Config>
struct TilePartials {
  static_assert(Config::kTransposed, "column statistics run on the transposed GEMM");
  static constexpr int64_t kTileRows = decltype(size<0>(typename Config::TileShape{}))::value;
  static constexpr int64_t kTileCols = decltype(size<1>(typename Config::TileShape{}))::value;
  // Rows of z^T (columns of z) rounded up to the tile: the stride between two tiles' partials.
  static int64_t stride(const GemmProblem& p) { return (p.N + kTileRows - 1) / kTileRows * kTileRows; }
  static int64_t tiles(const GemmProblem& p) { return (p.M + kTileCols - 1) / kTileCols; }
  static size_t bytes(const GemmProblem& p) { return align(sizeof(double) * stride(p) * tiles(p)); }
  static size_t align(size_t n) { return (n + 255) / 256 * 256; }
};

template <class Config>
size_t column_stats_workspace_bytes(const GemmProblem& p, int device, int sm_count) {
  using Partials = TilePartials<Config>;
  return 2 * Partials::bytes(p) + ColumnStatsKernel<Config>::workspace_bytes(p, device, sm_count);
}

template <class Config>
void run_column_stats(const GemmProblem& p, const EpilogueOperands& ops, void* workspace, int device,
                      int sm_count, cudaStream_t stream) {
  using K = ColumnStatsKernel<Config>;
  using Partials = TilePartials<Config>;
  // Workspace layout: [partial sums][partial sums of squares][the GEMM's own workspace], each part
  // starting on a 256-byte boundary (Partials::bytes rounds up).
  char* base = static_cast<char*>(workspace);
  double* psum = reinterpret_cast<double*>(base);
  double* psumsq = reinterpret_cast<double*>(base + Partials::bytes(p));
  void* gemm_workspace = base + 2 * Partials::bytes(p);
  K::run(p, evt::column_statistics_args<typename K::Fusion>(psum, psumsq, acc_args<Config>(p)),
         gemm_workspace, device, sm_count, stream);
  sum_tile_partials(p.N, Partials::tiles(p), Partials::stride(p), psum, psumsq, ops.colsum,
                    ops.colsumsq, stream);
}

#define EPIFUSE_SM90_INSTANTIATE_AFFINE(Config)                                                  \
  template size_t affine_workspace_bytes<Config>(const GemmProblem&, int, int);                  \
  template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, int, \
                                   cudaStream_t);

#define EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Config)                                            \
  template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int, int);            \
  template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                         int, cudaStream_t);

}  // namespace epifuse::sm90
