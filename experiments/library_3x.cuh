// What the standalone experiments that run the library's own 3x GEMM and split share (one nvcc
// translation unit each, no torch): the library's sources they compile in, the promotion
// interval the library reads through sm90::split3x_promotion_interval() (which gemm_run.cu
// defines from a debug switch in the library and an experiment sets directly here), and a split
// GEMM on the library's 3x mainloop with the operand layouts an experiment picks.
#pragma once

#include "debug_switches.cu"  // split_fp16.cu reads EPIFUSE_SPLIT_WIDE_TILES
#include "sm90_gemm.cuh"
#include "split_fp16.cu"
#include "standalone.cuh"

namespace epifuse::sm90 {
uint32_t g_promotion_interval = 1;  // K-tiles per promotion of the library GEMMs run next
uint32_t split3x_promotion_interval() { return g_promotion_interval; }
}  // namespace epifuse::sm90

// D [M, N] (fp32, row-major) = A . B on split operands: ElementIn = half_t (FP16 parts) or float
// (TF32 parts), the library's 3x mainloop, 128 x 128 tiles of TileK on 2 x 1 clusters, persistent.
// A is [M, Ks] K-major in the split layout (Ks its row width in elements); LayoutB ColumnMajor is
// B as [N, Ks] K-major (the layout of every 3x product the library runs), RowMajor is B as
// [Ks, N] MN-major (ldb its row stride), which FP16 wgmma also reads from shared memory.
template <class ElementIn, class TileK, class Fusion, class LayoutB = cutlass::layout::ColumnMajor>
struct SplitGemm {
  using TileShape = cute::Shape<cute::_128, cute::_128, TileK>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 4, float, cutlass::layout::RowMajor, 4,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;
  using Built = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, cutlass::layout::RowMajor,
      16 / sizeof(ElementIn), ElementIn, LayoutB, 16 / sizeof(ElementIn), float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = epifuse::sm90::Split3xMainloop<Built, ClusterShape>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epi, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr bool kBMnMajor = std::is_same_v<LayoutB, cutlass::layout::RowMajor>;

  // ldb: B's row stride, by default Ks (K-major) or N (MN-major).
  static void run(const ElementIn* a, const ElementIn* b, float* d, int M, int N, int Ks,
                  typename Fusion::Arguments fa, void* ws, size_t ws_bytes, cudaStream_t s,
                  int64_t ldb = 0) {
    using cute::Int;
    using cute::make_stride;
    typename Kernel::StrideB stride_b;
    if constexpr (kBMnMajor) {
      stride_b = make_stride(Int<1>{}, ldb > 0 ? ldb : int64_t(N), int64_t(0));
    } else {
      stride_b = make_stride(ldb > 0 ? ldb : int64_t(Ks), Int<1>{}, int64_t(0));
    }
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, Ks, 1},
        {a, make_stride(int64_t(Ks), Int<1>{}, int64_t(0)), b, stride_b,
         epifuse::sm90::g_promotion_interval},
        {fa, nullptr, {}, d, make_stride(int64_t(N), Int<1>{}, int64_t(0))},
        cutlass::KernelHardwareInfo{0, 132}};
    int dev;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetAttribute(&args.hw_info.sm_count, cudaDevAttrMultiProcessorCount, dev));
    run_or_exit<Gemm>(args, ws, ws_bytes, s);
  }
};
