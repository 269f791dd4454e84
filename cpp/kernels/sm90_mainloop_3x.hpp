// A Hopper mainloop for fp32 GEMMs at fp32 accuracy on the tensor cores ("3x").
//
// Why not one 16-bit or TF32 wgmma pass: those keep 11 of fp32's 24 significant bits (relative
// error ~2^-11 per operand). Splitting each operand v = hi + lo into two such parts and summing
//     lo_a*hi_b + hi_a*lo_b + hi_a*hi_b      (lo*lo, ~2^-22 relative, dropped)
// recovers ~22 bits per product. The parts are FP16 (split_fp16.cu, each operand row scaled by a
// power of two into FP16's range; the epilogue scales the product back), which Hopper multiplies
// at twice the TF32 rate; the loop below also runs TF32 parts (the layout and the order of the
// wgmmas are the same), which is where it started: FP16 parts measured 1.7x faster at problem
// 39's and 84's shapes with a smaller error (experiments/fp16x3_split.cu).
//
// But Hopper's wgmma also aligns each k-group of products to the largest exponent and truncates
// while it accumulates; one tensor-core accumulator carried over all of K collects that bias
// (measured on an H100 with TF32 parts, M = 1024, N = K = 8192: 8.4e-5 relative error for the
// three products through one accumulator, against 1.6e-6 for cuBLAS's FFMA SGEMM). So, as
// CUTLASS's FP8 mainloop does for FP8 (GmmaFP8Accumulation, `mma_promotion_interval`), the
// tensor-core accumulator restarts every `promotion_interval` K-tiles and is added into an fp32
// register accumulator with round-to-nearest FADDs ("promotion").
//
// Operand layout (split_fp16.cu writes it): each operand row of K values is stored as 2*Kp parts,
// Kp = K rounded up to the K-tile's k, in 128-byte blocks (the 128B-swizzle width): the hi parts
// of 32 consecutive k (FP16; TF32: 16), then their lo parts. A K-tile thus holds hi and lo of the
// same k: wgmma k-blocks 0-1 are hi, 2-3 are lo. CUTLASS sees an ordinary GEMM with K' = 2*Kp;
// only the order of the wgmmas below differs, so TMA, the pipeline, the schedulers (persistent
// and stream-K) and the epilogues are CUTLASS's own.
//
// The two consumer warpgroups of the cooperative kernel promote half an interval apart: while one
// drains its wgmmas and adds, the other keeps the tensor cores busy.
//
// Registers: a thread holds the fp32 accumulator and the tensor-core accumulator, so the tile is
// 128x128 (2 x 64 per thread); 128x256 (2 x 128) would not fit in the consumers' 232 registers.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cute/tensor.hpp"

namespace epifuse::sm90 {

// Dispatch tag of the mainloop below; everything else is CUTLASS's TMA warp-specialized policy.
template <int Stages_, class ClusterShape_, class KernelSchedule_>
struct MainloopSm90TmaGmmaWarpSpecialized3x
    : cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<Stages_, ClusterShape_, KernelSchedule_> {};

// Default promotion interval in K-tiles (a runtime argument, EPIFUSE_3X_PROMOTION). With FP16
// parts, measured on an H200 (max |error| / max |result| against float64, as a ratio to cuBLAS
// SGEMM's; M = N = 1024 unless said, x ~ U[0, 1); experiments/fp16x3_split.cu):
//   every K-tile (32 k):  K = 64: 0.40, 128: 0.34, 256: 0.29, 1024: 0.19, 8192: 0.60;
//                         problem 39's shape 0.20, 2.33 ms; problem 84's 0.17, 0.557 ms
//   every 2 (64 k):       K = 64: 0.89, 128: 0.77, 256: 0.50, 1024: 0.22, 8192: 0.48;
//                         problem 39's 0.15, 2.60 ms; problem 84's 0.12, 0.549 ms
// Every K-tile keeps the small-K error well below SGEMM's at no cost in time. (With TF32 parts,
// whose K-tile is 16 k, promoting every 16 k was needed from K = 32 up: measured on an H100.)
constexpr uint32_t kDefaultPromotionInterval = 1;

}  // namespace epifuse::sm90

namespace cutlass::gemm::collective {
using namespace cute;

template <int Stages, class ClusterShape, class KernelSchedule, class TileShape_, class ElementA_,
          class StrideA_, class ElementB_, class StrideB_, class TiledMma_, class GmemTiledCopyA_,
          class SmemLayoutAtomA_, class SmemCopyAtomA_, class TransformA_, class GmemTiledCopyB_,
          class SmemLayoutAtomB_, class SmemCopyAtomB_, class TransformB_>
struct CollectiveMma<
    epifuse::sm90::MainloopSm90TmaGmmaWarpSpecialized3x<Stages, ClusterShape, KernelSchedule>,
    TileShape_, ElementA_, StrideA_, ElementB_, StrideB_, TiledMma_, GmemTiledCopyA_,
    SmemLayoutAtomA_, SmemCopyAtomA_, TransformA_, GmemTiledCopyB_, SmemLayoutAtomB_,
    SmemCopyAtomB_, TransformB_> {
  using DispatchPolicy =
      epifuse::sm90::MainloopSm90TmaGmmaWarpSpecialized3x<Stages, ClusterShape, KernelSchedule>;
  using TileShape = TileShape_;
  using ElementA = ElementA_;
  using StrideA = StrideA_;
  using ElementB = ElementB_;
  using StrideB = StrideB_;
  using TiledMma = TiledMma_;
  using ElementAccumulator = typename TiledMma::ValTypeC;
  using GmemTiledCopyA = GmemTiledCopyA_;
  using GmemTiledCopyB = GmemTiledCopyB_;
  using SmemLayoutAtomA = SmemLayoutAtomA_;
  using SmemLayoutAtomB = SmemLayoutAtomB_;
  using SmemCopyAtomA = SmemCopyAtomA_;
  using SmemCopyAtomB = SmemCopyAtomB_;
  using TransformA = TransformA_;
  using TransformB = TransformB_;
  using ArchTag = typename DispatchPolicy::ArchTag;

  using CtaShape_MNK = decltype(shape_div(TileShape{}, ClusterShape{}));
  using MainloopPipeline = cutlass::PipelineTmaAsync<DispatchPolicy::Stages>;
  using PipelineState = cutlass::PipelineState<DispatchPolicy::Stages>;
  using PipelineParams = typename MainloopPipeline::Params;

  static constexpr int NumProducerThreadEvents = 1;

  using SmemLayoutA = decltype(tile_to_shape(
      SmemLayoutAtomA{},
      make_shape(shape<0>(TileShape{}), shape<2>(TileShape{}), Int<DispatchPolicy::Stages>{}),
      Step<_1, _2, _3>{}));  // K-major (TF32 wgmma reads K-major operands only)
  using SmemLayoutB = decltype(tile_to_shape(
      SmemLayoutAtomB{},
      make_shape(shape<1>(TileShape{}), shape<2>(TileShape{}), Int<DispatchPolicy::Stages>{}),
      Step<_1, _2, _3>{}));

  // The split layout: one K-tile of 128 bytes = hi and lo of its k (16 TF32 or 32 FP16 k), each 2
  // wgmma k-blocks (of 8 k for TF32, 16 k for FP16).
  static constexpr int kKBlocksPerTile = size<2>(TileShape{}) / TiledMma{}.template tile_size_mnk<2>();
  static_assert(size<2>(TileShape{}) * sizeof_bits<typename TiledMma::ValTypeA>::value == 128 * 8 &&
                    kKBlocksPerTile == 4,
                "3x mainloop: K-tile of 128 bytes = its hi parts, then their lo parts (split_fp16.cu)");
  static_assert((cute::is_same_v<typename TiledMma::ValTypeA, tfloat32_t> ||
                 cute::is_same_v<typename TiledMma::ValTypeA, half_t>) &&
                    cute::is_same_v<typename TiledMma::ValTypeA, typename TiledMma::ValTypeB>,
                "3x mainloop: TF32 or FP16 wgmma on both operands");
  static_assert(DispatchPolicy::Stages >= 2, "3x mainloop: at least 2 stages");
  static_assert(cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value &&
                    cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeB>::value,
                "3x mainloop: A and B from shared memory");
  static_assert(cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD> ||
                    cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>,
                "3x mainloop: TMA loads");
  static_assert(cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD> ||
                    cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>,
                "3x mainloop: TMA loads");

  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, _0> {
      cute::array_aligned<typename TiledMma::ValTypeA, cute::cosize_v<SmemLayoutA>> smem_A;
      cute::array_aligned<typename TiledMma::ValTypeB, cute::cosize_v<SmemLayoutB>> smem_B;
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  struct Arguments {
    ElementA const* ptr_A;
    StrideA dA;
    ElementB const* ptr_B;
    StrideB dB;
    uint32_t promotion_interval = epifuse::sm90::kDefaultPromotionInterval;  // in K-tiles
  };

  struct Params {
    using TMA_A = decltype(make_tma_copy_A_sm90(
        GmemTiledCopyA{},
        make_tensor(static_cast<ElementA const*>(nullptr), repeat_like(StrideA{}, int32_t(0)), StrideA{}),
        SmemLayoutA{}(_, _, 0), TileShape{}, ClusterShape{}));
    using TMA_B = decltype(make_tma_copy_B_sm90(
        GmemTiledCopyB{},
        make_tensor(static_cast<ElementB const*>(nullptr), repeat_like(StrideB{}, int32_t(0)), StrideB{}),
        SmemLayoutB{}(_, _, 0), TileShape{}, ClusterShape{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    uint32_t tma_transaction_bytes = TmaTransactionBytes;
    uint32_t promotion_interval = epifuse::sm90::kDefaultPromotionInterval;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  Arguments const& args, void* workspace) {
    (void)workspace;
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Tensor tensor_a = make_tensor(args.ptr_A, make_layout(make_shape(M, K, L), args.dA));
    Tensor tensor_b = make_tensor(args.ptr_B, make_layout(make_shape(N, K, L), args.dB));
    auto tma_load_a = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, Int<0>{}),
                                           TileShape{}, ClusterShape{});
    auto tma_load_b = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_b, SmemLayoutB{}(_, _, Int<0>{}),
                                           TileShape{}, ClusterShape{});
    return {tma_load_a, tma_load_b, TmaTransactionBytes, args.promotion_interval};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    constexpr int kAlign = 128 / cutlass::sizeof_bits<ElementA>::value;
    bool ok = cutlass::detail::check_alignment<kAlign>(cute::make_shape(M, K, L), StrideA{}) &&
              cutlass::detail::check_alignment<kAlign>(cute::make_shape(N, K, L), StrideB{});
    ok = ok && K % size<2>(TileShape{}) == 0;  // whole hi/lo blocks (split_fp16 pads K)
    ok = ok && args.promotion_interval >= 1;
    if (!ok) CUTLASS_TRACE_HOST("  CAN IMPLEMENT: 3x operands not in the split layout.\n");
    return ok;
  }

  static constexpr int K_PIPE_MAX = DispatchPolicy::Stages;
  static constexpr int K_PIPE_MMAS = 1;
  static constexpr uint32_t TmaTransactionBytesMK = cutlass::bits_to_bytes(
      size<0>(SmemLayoutA{}) * size<1>(SmemLayoutA{}) * static_cast<uint32_t>(sizeof_bits<ElementA>::value));
  static constexpr uint32_t TmaTransactionBytesNK = cutlass::bits_to_bytes(
      size<0>(SmemLayoutB{}) * size<1>(SmemLayoutB{}) * static_cast<uint32_t>(sizeof_bits<ElementB>::value));
  static constexpr uint32_t TmaTransactionBytes = TmaTransactionBytesMK + TmaTransactionBytesNK;

  CUTLASS_DEVICE
  static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b.get_tma_descriptor());
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA_mkl = params.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mB_nkl = params.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  // Producer: CUTLASS's TMA load loop, unchanged (the split layout is an ordinary K-major operand).
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster,
                           TensorStorage& shared_tensors) {
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape());
    uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x,
                                    block_rank_in_cluster / cluster_shape_x};
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto block_tma_a = params.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_local_block_id.x);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(gA_mkl(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB_nkl(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);

    uint16_t mcast_mask_a = 0;
    uint16_t mcast_mask_b = 0;
    if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShape>{};
      for (int n = 0; n < size<1>(block_layout); ++n)
        mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
    }
    if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShape>{};
      for (int m = 0; m < size<0>(block_layout); ++m)
        mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int write_stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, *k_tile_iter),
           tAsA(_, _, _, write_stage));
      copy(params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter),
           tBsB(_, _, _, write_stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) pipeline.producer_tail(smem_pipe_write);
  }

  // Consumer: per K-tile, the three products of its 16 k into the tensor-core accumulator `partial`
  // (small terms first, so the largest term is added last), then every promotion_interval K-tiles
  // `partial` is added into `accum` and restarts.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& params) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    static_assert(cute::is_void_v<SmemCopyAtomA> && cute::is_void_v<SmemCopyAtomB>,
                  "SM90 GMMA mainloops cannot have a non-void copy atom for smem sourced instructions.");
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});

    constexpr int MmaWarpGroups = size(TiledMma{}) / NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<NumThreadsPerWarpGroup>{});
    const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)
    CUTE_STATIC_ASSERT_V(size<1>(tCrA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));

    Tensor partial = make_fragment_like(accum);  // the tensor-core accumulator
    clear(accum);

    // Promotion bookkeeping, uniform across a warpgroup. The second warpgroup starts half an
    // interval in, so the two never drain the tensor cores at the same time.
    const int interval = int(params.promotion_interval);
    int since_promotion = (warp_group_idx % 2) * (interval / 2);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;

    auto issue_products = [&](int stage) {
      constexpr int kHalf = kKBlocksPerTile / 2;  // k-blocks [0, kHalf): hi, [kHalf, 2*kHalf): lo
      warpgroup_fence_operand(partial);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kHalf; ++j) {  // lo_a * hi_b
        cute::gemm(tiled_mma, tCrA(_, _, kHalf + j, stage), tCrB(_, _, j, stage), partial);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kHalf; ++j)  // hi_a * lo_b
        cute::gemm(tiled_mma, tCrA(_, _, j, stage), tCrB(_, _, kHalf + j, stage), partial);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kHalf; ++j)  // hi_a * hi_b
        cute::gemm(tiled_mma, tCrA(_, _, j, stage), tCrB(_, _, j, stage), partial);
      warpgroup_commit_batch();
    };
    auto promote = [&] {
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += partial(i);
      warpgroup_fence_operand(accum);
      since_promotion = 0;
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    };

    PipelineState smem_pipe_release = smem_pipe_read;
    // Prologue: the first K-tile, left in flight.
    if (k_tile_count > 0) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      issue_products(smem_pipe_read.index());
      ++smem_pipe_read;
      if (++since_promotion == interval) promote();
    }
    warpgroup_fence_operand(partial);

    CUTLASS_PRAGMA_NO_UNROLL
    for (int k_tile = 1; k_tile < k_tile_count; ++k_tile) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      issue_products(smem_pipe_read.index());
      // At most this K-tile's wgmmas in flight: the previous stage has been read.
      warpgroup_wait<K_PIPE_MMAS>();
      warpgroup_fence_operand(partial);
      if (++since_promotion == interval) promote();
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }
    if (since_promotion > 0) promote();  // the residue (also drains every wgmma)
    warpgroup_fence_operand(accum);
  }

  // Releases the stage(s) still held after mma(): the prologue's K-tile (mma() released the rest).
  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release,
                               int k_tile_count) {
    const int prologue_mma_count = k_tile_count < K_PIPE_MMAS ? k_tile_count : int(K_PIPE_MMAS);
    smem_pipe_release.advance(k_tile_count - prologue_mma_count);
    warpgroup_wait<0>();
    for (int count = 0; count < prologue_mma_count; ++count) {
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    }
  }
};

}  // namespace cutlass::gemm::collective
