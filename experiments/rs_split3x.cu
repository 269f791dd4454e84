// The 3x GEMM with its large operand split in registers: can the split copy of A go?
//
// The library's 3x GEMM (sm90_mainloop_3x.hpp) reads both operands split ahead into FP16 hi/lo
// parts (split_fp16.cu): a read and a write of each operand before the GEMM, and the split's
// memory while it runs. docs/performance.md ("The 3x split inside the mainloop") budgets
// the alternatives per K-tile: converting both operands in shared memory exceeds the SM's
// shared-memory bandwidth, converting one operand in registers fits. This is that mainloop:
//   - A stays fp32 in global memory; TMA loads 128 x 32 fp32 tiles, and the tile's 128 row
//     exponents (from a read-only pass over A's rows, the split's own e = ilogb(max |v|) - 14) come
//     with each stage by a bulk copy on the same barrier;
//   - each consumer thread loads its wgmma A fragment from shared memory in fp32, scales it by
//     2^-e of its row and splits it into FP16 hi and lo fragments (registers), exactly as
//     split_fp16 does;
//   - B is split ahead as now (the library's split and layout), read by wgmma from shared memory;
//   - the products and their order are the library's (lo_a*hi_b, hi_a*lo_b, hi_a*hi_b per k-block,
//     promoted into fp32 every K-tile), so the result must equal the library GEMM's bit for bit.
// Measured: the GEMM against the library's on split operands (W's split kept) and against its
// split of A plus that GEMM, at problem 84's forward (z^T = W . x^T: A = W, 8192 x 8192) and
// problem 39's (A = x, 16384 x 4096), with the error against float64 (cuBLAS DGEMM).
// Each K-tile's products are issued, then the next K-tile's A is split into the other set of
// fragments while they run; promotion every K-tile (the library's default) or every 2 (the second
// warpgroup a K-tile behind, as in the library), a template argument. Cluster 1x1 (the library's
// kernels use 2x1 with B multicast; the library GEMM is also timed on 1x1 clusters).
//
// Measured (H200): bit-identical to the library GEMM at both shapes and both intervals, but
// slower: problem 84's shape 0.653 ms (210 TFLOP/s) + 0.073 ms of exponents against the library's
// 0.529 + 0.134 ms split; problem 39's 3.205 + 0.075 against 2.214 + 0.135. Every 2 K-tiles: 186
// and 168 TFLOP/s. The first version (ldexpf, single-element loads, no overlap): 63 TFLOP/s.
// docs/performance.md has the table and what it leaves. The truncated-hi split (TruncatedHi,
// half the conversions) is compiled and not yet run: it tests whether the conversions are what
// the GEMM pays for.
//
//   CL=<site-packages>/cutlass_library/source NV=<site-packages>/nvidia/cu13
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG \
//        --expt-relaxed-constexpr -I$CL/include -I$CL/tools/util/include -Icpp/include \
//        -Icpp/kernels -I$NV/include -L$NV/lib experiments/rs_split3x.cu \
//        -l:libcublas.so.13 -o build/experiments/rs_split3x
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "library_3x.cuh"
#include "standalone.cuh"

namespace rs3x {

using namespace cute;
using cutlass::half_t;

template <int Stages_>
struct Policy : cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<
                    Stages_, Shape<_1, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedCooperative> {};

// A: fp32 [M, K] row-major (K-major), split in registers; B: the library's split [N, 2 * Kp].
// Interval: K-tiles per promotion (the library's default, 1, or 2); the second warpgroup promotes
// half an interval after the first, as the library's do. TruncatedHi: hi = a with its low 13
// significand bits cleared (exact in FP16 for |a| >= 2^-14, as 2^-29 of the row's largest), so
// that lo = a - hi needs no conversion of hi back to fp32: two conversions a pair instead of four.
// Not split_fp16's split (it rounds hi to nearest), so not bit-identical to the library's GEMM;
// lo still holds the remainder's leading 11 bits (22 in all). Finite values only (a NaN whose
// payload is in the cleared bits would become an Inf; such rows are recomputed anyway).
template <int Stages, int Interval, bool TruncatedHi = false>
struct Mainloop {
  using DispatchPolicy = Policy<Stages>;
  using ClusterShape = Shape<_1, _1, _1>;
  using TileShape = Shape<_128, _128, _64>;   // K counted in B's halves: 32 hi, then their 32 lo
  using TileShapeA = Shape<_128, _128, _32>;  // the same 32 k of A in fp32
  using ElementA = float;
  using ElementB = half_t;
  using StrideA = cute::Stride<int64_t, _1, int64_t>;
  using StrideB = cute::Stride<int64_t, _1, int64_t>;
  using TiledMma = decltype(make_tiled_mma(
      GMMA::rs_op_selector<half_t, half_t, float, TileShape, GMMA::Major::K, GMMA::Major::K>(),
      Layout<Shape<_2, _1, _1>>{}));
  using ElementAccumulator = float;
  using ArchTag = cutlass::arch::Sm90;
  using GmemTiledCopyA = SM90_TMA_LOAD;
  using GmemTiledCopyB = SM90_TMA_LOAD;
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                             make_shape(_128{}, _32{}, Int<Stages>{})));
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<half_t>{},
                                             make_shape(_128{}, _64{}, Int<Stages>{})));
  using MainloopPipeline = cutlass::PipelineTmaAsync<Stages>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using PipelineParams = typename MainloopPipeline::Params;
  static constexpr int NumProducerThreadEvents = 1;
  static constexpr int kRows = 128;
  static constexpr int kKBlocks = 2;  // wgmma k-blocks (16 k) per K-tile of A; B has 2 hi + 2 lo

  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, _0> {
      cute::array_aligned<float, cute::cosize_v<SmemLayoutA>> smem_A;
      cute::array_aligned<half_t, cute::cosize_v<SmemLayoutB>> smem_B;
      cute::array_aligned<float, kRows * Stages> smem_E;  // each stage's A-row exponents
    } tensors;
    using PipelineStorage = typename MainloopPipeline::SharedStorage;
    PipelineStorage pipeline;
  };
  using TensorStorage = typename SharedStorage::TensorStorage;
  using PipelineStorage = typename SharedStorage::PipelineStorage;

  struct Arguments {
    float const* ptr_A;
    StrideA dA;
    half_t const* ptr_B;
    StrideB dB;
    float const* exponents_A;  // one per row of A, rows rounded up to 128
  };

  using TMA_A = decltype(make_tma_copy_A_sm90(
      GmemTiledCopyA{},
      make_tensor(static_cast<float const*>(nullptr), repeat_like(StrideA{}, int32_t(0)), StrideA{}),
      SmemLayoutA{}(_, _, 0), TileShapeA{}, ClusterShape{}));
  using TMA_B = decltype(make_tma_copy_B_sm90(
      GmemTiledCopyB{},
      make_tensor(static_cast<half_t const*>(nullptr), repeat_like(StrideB{}, int32_t(0)), StrideB{}),
      SmemLayoutB{}(_, _, 0), TileShape{}, ClusterShape{}));

  static constexpr uint32_t kExponentBytes = kRows * sizeof(float);
  static constexpr uint32_t TmaTransactionBytes =
      kRows * 32 * sizeof(float) + kRows * 64 * sizeof(half_t) + kExponentBytes;

  struct Params {
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    float const* exponents_A;
    uint32_t tma_transaction_bytes = TmaTransactionBytes;
  };

  // problem_shape's K is B's: the split width 2 * Kp; A has Kp fp32 columns.
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape,
                                                  Arguments const& args, void*) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Tensor tensor_a = make_tensor(args.ptr_A, make_layout(make_shape(M, K / 2, L), args.dA));
    Tensor tensor_b = make_tensor(args.ptr_B, make_layout(make_shape(N, K, L), args.dB));
    auto tma_a = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor_a, SmemLayoutA{}(_, _, Int<0>{}),
                                      TileShapeA{}, ClusterShape{});
    auto tma_b = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_b, SmemLayoutB{}(_, _, Int<0>{}),
                                      TileShape{}, ClusterShape{});
    return {tma_a, tma_b, args.exponents_A, TmaTransactionBytes};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    return K % 64 == 0 && args.exponents_A != nullptr &&
           cutlass::detail::check_alignment<4>(cute::make_shape(M, K / 2, L), StrideA{}) &&
           cutlass::detail::check_alignment<8>(cute::make_shape(N, K, L), StrideB{});
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_b.get_tma_descriptor());
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL,
                                Params const& params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA_mkl = params.tma_load_a.get_tma_tensor(make_shape(M, K / 2, L));
    Tensor mB_nkl = params.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor gA_mkl = local_tile(mA_mkl, TileShapeA{}, make_coord(_, _, _), Step<_1, X, _1>{});
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  // Producer: the library's TMA loop, plus the tile's A-row exponents by a bulk copy (on the same
  // barrier, counted in its transaction bytes) into the stage's exponent slot.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int, uint32_t, TensorStorage& shared_tensors) {
    if (!cute::elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    auto block_tma_a = params.tma_load_a.get_slice(0);
    auto block_tma_b = params.tma_load_b.get_slice(0);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor tAgA = block_tma_a.partition_S(get<0>(load_inputs)(_, _, m_coord, _, l_coord));
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(get<1>(load_inputs)(_, _, n_coord, _, l_coord));
    Tensor tBsB = block_tma_b.partition_D(sB);
    float const* exponents = params.exponents_A + int64_t(m_coord) * kRows;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(*tma_barrier), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_load_b.with(*tma_barrier), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
      SM90_BULK_COPY_G2S::copy(exponents, reinterpret_cast<uint64_t*>(tma_barrier),
                               shared_tensors.smem_E.data() + stage * kRows, kExponentBytes);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    if (cute::elect_one_sync()) pipeline.producer_tail(smem_pipe_write);
  }

  // Consumer: per K-tile, A's fragment loaded in fp32 and split into hi and lo fragments, the
  // three products into the tensor-core accumulator `partial` (lo_a*hi_b, hi_a*lo_b, hi_a*hi_b,
  // as the library orders them), drained and added into `accum` (promotion every K-tile).
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const&) {
    Tensor sA_ = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sA = as_position_independent_swizzle_tensor(sA_);  // (128, 32, PIPE) fp32
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    float const* sE = shared_tensors.smem_E.data();

    constexpr int MmaWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);

    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    auto wg_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));

    Tensor tCsA = thr_mma.partition_A(sA);                       // (MMA, MMA_M, MMA_K, PIPE) fp32
    Tensor tCcA = thr_mma.partition_A(make_identity_tensor(make_shape(_128{}, _32{})));
    Tensor tCrA_hi = thr_mma.partition_fragment_A(sA(_, _, Int<0>{}));  // (MMA, MMA_M, MMA_K)
    Tensor tCrA_lo = make_fragment_like(tCrA_hi);
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, 4, PIPE)
    CUTE_STATIC_ASSERT_V(size<2>(tCrA_hi) == Int<kKBlocks>{});
    CUTE_STATIC_ASSERT_V(size<2>(tCrB) == Int<2 * kKBlocks>{});
    CUTE_STATIC_ASSERT_V(size<1>(tCrA_hi) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCrB) == size<2>(accum));

    Tensor partial = make_fragment_like(accum);
    clear(accum);
    // Two sets of A's hi / lo fragments: the next K-tile is split into one while the wgmmas of
    // the current one read the other.
    Tensor hi_0 = tCrA_hi, lo_0 = tCrA_lo;
    Tensor hi_1 = make_fragment_like(tCrA_hi), lo_1 = make_fragment_like(tCrA_hi);

    // A's fragment of one stage, split as split_fp16 splits: a = v * 2^-e (one multiply by a
    // power of two, which rounds as ldexpf does; a row of tiny values, e < -126, scales in two
    // exact steps), hi = fp16(a), lo = fp16(a - hi). Finite values only: a row holding a NaN or
    // Inf is flagged by the exponent pass and recomputed in fp32 (nonfinite_rows.cu), as the
    // library's are. Element pairs (k, k+1) are adjacent in the fp32 tile: one 8-byte load each.
    auto split_a = [&](int stage, auto& hi, auto& lo) {
      Tensor src = tCsA(_, _, _, stage);
      auto hi2 = recast<uint32_t>(hi);
      auto lo2 = recast<uint32_t>(lo);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(src); i += 2) {
        const float2 v = *reinterpret_cast<float2 const*>(&src(i));
        const int e = int(sE[stage * kRows + get<0>(tCcA(i))]);
        const float pre = e < -126 ? 0x1p64f : 1.f;
        const float s = __int_as_float((127 - (e < -126 ? e + 64 : e)) << 23);
        const float a0 = v.x * pre * s, a1 = v.y * pre * s;
        float2 hf;
        __half2 h;
        if constexpr (TruncatedHi) {
          hf = make_float2(__uint_as_float(__float_as_uint(a0) & 0xFFFFE000u),
                           __uint_as_float(__float_as_uint(a1) & 0xFFFFE000u));
          h = __floats2half2_rn(hf.x, hf.y);
        } else {
          h = __floats2half2_rn(a0, a1);
          hf = __half22float2(h);
        }
        const __half2 l = __floats2half2_rn(a0 - hf.x, a1 - hf.y);
        hi2(i / 2) = reinterpret_cast<uint32_t const&>(h);
        lo2(i / 2) = reinterpret_cast<uint32_t const&>(l);
      }
    };
    bool restart = true;  // the next products start the tensor-core accumulator at zero
    auto issue_products = [&](int stage, auto& hi, auto& lo) {
      warpgroup_fence_operand(hi);
      warpgroup_fence_operand(lo);
      warpgroup_fence_operand(partial);
      warpgroup_arrive();
      tiled_mma.accumulate_ = restart ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
      restart = false;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kKBlocks; ++j) {  // lo_a * hi_b
        cute::gemm(tiled_mma, lo(_, _, j), tCrB(_, _, j, stage), partial);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kKBlocks; ++j)  // hi_a * lo_b
        cute::gemm(tiled_mma, hi(_, _, j), tCrB(_, _, kKBlocks + j, stage), partial);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kKBlocks; ++j)  // hi_a * hi_b
        cute::gemm(tiled_mma, hi(_, _, j), tCrB(_, _, j, stage), partial);
      warpgroup_commit_batch();
    };
    auto promote = [&] {
      warpgroup_wait<0>();
      warpgroup_fence_operand(partial);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += partial(i);
      warpgroup_fence_operand(accum);
      restart = true;
    };

    // One K-tile: its products (from the split held in hi / lo) issued; then, once the previous
    // K-tile's products are done (its stage and its fragments free), that stage released and the
    // next K-tile's stage waited for and split into next_hi / next_lo while this K-tile's
    // products run; every Interval K-tiles, the promotion.
    PipelineState smem_pipe_release = smem_pipe_read;
    int k_tile = 0;
    int since_promotion = (warp_group_idx % 2) * (Interval / 2);
    auto step = [&](auto& hi, auto& lo, auto& next_hi, auto& next_lo) {
      issue_products(smem_pipe_read.index(), hi, lo);
      warpgroup_wait<1>();
      warpgroup_fence_operand(next_hi);
      warpgroup_fence_operand(next_lo);
      if (k_tile > 0) {
        pipeline.consumer_release(smem_pipe_release);
        ++smem_pipe_release;
      }
      ++smem_pipe_read;
      if (k_tile + 1 < k_tile_count) {
        pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
        split_a(smem_pipe_read.index(), next_hi, next_lo);
      }
      if (++since_promotion == Interval) {
        promote();
        since_promotion = 0;
      }
      ++k_tile;
    };
    if (k_tile_count > 0) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      split_a(smem_pipe_read.index(), hi_0, lo_0);
    }
    CUTLASS_PRAGMA_NO_UNROLL
    while (k_tile < k_tile_count) {
      step(hi_0, lo_0, hi_1, lo_1);
      if (k_tile < k_tile_count) step(hi_1, lo_1, hi_0, lo_0);
    }
    if (since_promotion > 0) promote();  // the residue (also drains every wgmma)
    warpgroup_wait<0>();
    if (k_tile_count > 0) pipeline.consumer_release(smem_pipe_release);
    warpgroup_fence_operand(accum);
  }

  // mma() released every stage it read.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};
using Tree = epifuse::evt::PerColumnAffine<Shape<_128, _128, _64>, float,
                                           epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>;

template <int Interval, bool TruncatedHi = false>
struct Gemm {
  using Main = Mainloop<5, Interval, TruncatedHi>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Shape<_128, _128, _64>, Shape<_1, _1, _1>,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, 4, float, cutlass::layout::RowMajor, 4,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Tree>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi,
                                                      cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // d[M, N] = a[M, K] . b^T with b split ([N, Ks], Ks = split_fp16_ld(K)), e_a / e_b the rows'
  // exponents.
  static void run(const float* a, const void* b_split, const float* e_a, const float* e_b,
                  float* d, int M, int N, int Ks, void* ws, size_t ws_bytes, int sms,
                  cudaStream_t s) {
    const auto acc = epifuse::evt::acc_args<epifuse::evt::ScaledAccFetch<Shape<_128, _128, _64>>>(e_a, e_b);
    typename Adapter::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, Ks, 1},
        {a, make_stride(int64_t(Ks / 2), Int<1>{}, int64_t(0)),
         static_cast<const cutlass::half_t*>(b_split), make_stride(int64_t(Ks), Int<1>{}, int64_t(0)),
         e_a},
        {epifuse::evt::per_column_affine_args<Tree>(nullptr, nullptr, epifuse::Activation{}, acc),
         nullptr, {}, d, make_stride(int64_t(N), Int<1>{}, int64_t(0))},
        cutlass::KernelHardwareInfo{0, sms}};
    run_or_exit<Adapter>(args, ws, ws_bytes, s);
  }
};

}  // namespace rs3x

// The library's 3x GEMM on split operands (Wide: 128 x 128, cluster 2x1, persistent).
using LibraryConfig =
    epifuse::sm90::TileConfig<float, cute::Shape<cute::_128, cute::_128, cute::_64>,
                              cute::Shape<cute::_2, cute::_1, cute::_1>,
                              cutlass::gemm::PersistentScheduler, false, true>;

// The same on one-CTA clusters (no multicast of B), as the register-split kernel runs.
using LibraryConfig1x1 =
    epifuse::sm90::TileConfig<float, cute::Shape<cute::_128, cute::_128, cute::_64>,
                              cute::Shape<cute::_1, cute::_1, cute::_1>,
                              cutlass::gemm::PersistentScheduler, false, true>;

// e[r] = ilogb(max_k |a[r, k]| over finite values) - 14 (0 for a row of zeros): split_fp16's row
// exponent, one block per row, the row read once.
__global__ void row_exponents(const float* __restrict__ a, int64_t cols, float* __restrict__ e) {
  const float* row = a + int64_t(blockIdx.x) * cols;
  float m = 0.f;
  for (int64_t k = threadIdx.x * 4; k < cols; k += blockDim.x * 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + k);
    for (float x : {v.x, v.y, v.z, v.w}) m = fmaxf(m, isfinite(x) ? fabsf(x) : 0.f);
  }
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  __shared__ float warp_max[32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, warp_max[w]);
    e[blockIdx.x] = m > 0.f ? float(ilogbf(m) - 14) : 0.f;
  }
}

__global__ void scale_rows(int64_t rows, int64_t cols, float* a) {  // row r times 2^(r % 13 - 6)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x)
    a[i] = ldexpf(a[i], int((i / cols) % 13) - 6);
}

int main() {
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h = cublas_on(s);
  int dev, sms;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const size_t flush_bytes = size_t(256) << 20, ws_bytes = size_t(64) << 20;
  void *flush, *ws;
  CK(cudaMalloc(&flush, flush_bytes));
  CK(cudaMalloc(&ws, ws_bytes));
  struct Shape3 { const char* label; int M, N, K; };
  for (const Shape3 sh : {Shape3{"p84 z^T = W . x^T", 8192, 1024, 8192},
                          Shape3{"p39 z = x . W^T", 16384, 4096, 4096}}) {
    const int M = sh.M, N = sh.N, K = sh.K;
    const int Ks = int(epifuse::split_fp16_ld(K));
    float *a, *b, *d_lib, *d_rs, *e_a;
    double *ad, *bd, *rd;
    void *a_split, *b_split;
    CK(cudaMalloc(&a, sizeof(float) * size_t(M) * K));
    CK(cudaMalloc(&b, sizeof(float) * size_t(N) * K));
    CK(cudaMalloc(&d_lib, sizeof(float) * size_t(M) * N));
    CK(cudaMalloc(&d_rs, sizeof(float) * size_t(M) * N));
    CK(cudaMalloc(&e_a, sizeof(float) * size_t((M + 127) / 128 * 128)));
    CK(cudaMalloc(&ad, sizeof(double) * size_t(M) * K));
    CK(cudaMalloc(&bd, sizeof(double) * size_t(N) * K));
    CK(cudaMalloc(&rd, sizeof(double) * size_t(M) * N));
    CK(cudaMalloc(&a_split, epifuse::split_fp16_bytes(M, K)));
    CK(cudaMalloc(&b_split, epifuse::split_fp16_bytes(N, K)));
    CK(cudaMemsetAsync(e_a, 0, sizeof(float) * size_t((M + 127) / 128 * 128), s));
    // A ~ U[-1, 1) / sqrt(K), its rows scaled over 2^-6..2^6 (each row's own exponent at work),
    // B ~ U[0, 1).
    fill_scaled<<<1024, 256, 0, s>>>(int64_t(M) * K, a, 21, 1.f / std::sqrt(float(K)), 0.f);
    scale_rows<<<1024, 256, 0, s>>>(M, K, a);
    fill_scaled<<<1024, 256, 0, s>>>(int64_t(N) * K, b, 22, 0.5f, 0.5f);
    widen<<<1024, 256, 0, s>>>(int64_t(M) * K, a, ad);
    widen<<<1024, 256, 0, s>>>(int64_t(N) * K, b, bd);
    const double one = 1, zero = 0;
    CB(cublasDgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, bd, K, ad, K, &zero, rd, N));

    auto split_a = [&] { epifuse::split_fp16(a, M, K, K, 1, a_split, nullptr, s); };
    auto split_b = [&] { epifuse::split_fp16(b, N, K, K, 1, b_split, nullptr, s); };
    auto exponents_a = [&] { row_exponents<<<M, 256, 0, s>>>(a, K, e_a); };
    epifuse::GemmProblem p;
    p.M = M, p.N = N, p.K = Ks, p.x = a_split, p.ldx = Ks, p.w = b_split, p.ldw = Ks;
    p.out = d_lib, p.ldo = N, p.math = epifuse::MathMode::k3xTF32;
    p.x_exponents = epifuse::split_fp16_exponents(a_split, M, K);
    p.w_exponents = epifuse::split_fp16_exponents(b_split, N, K);
    auto lib_gemm = [&] { epifuse::sm90::run_affine<LibraryConfig>(p, {}, ws, dev, sms, s); };
    auto lib_gemm_1x1 = [&] {
      epifuse::sm90::run_affine<LibraryConfig1x1>(p, {}, ws, dev, sms, s);
    };
    const double flop = 2.0 * M * N * K;
    split_a(); split_b(); exponents_a();
    const double e_lib_1 = (lib_gemm(), max_error_ratio(d_lib, rd, int64_t(M) * N, s));
    const float t_split = best_ms(s, flush, flush_bytes, split_a);
    const float t_exp = best_ms(s, flush, flush_bytes, exponents_a);
    printf("%s (M=%d N=%d K=%d): ms: library split of A %.3f, A's exponents %.3f; max err / max "
           "|ref| of the library GEMM (promotion every K-tile) %.2e\n", sh.label, M, N, K, t_split,
           t_exp, e_lib_1);
    auto compare = [&](int interval, const char* split, auto rs_gemm) {
      epifuse::sm90::g_promotion_interval = uint32_t(interval);
      lib_gemm(); rs_gemm();
      const unsigned long long differ = differing_bits(d_lib, d_rs, int64_t(M) * N, s);
      const double e_rs = max_error_ratio(d_rs, rd, int64_t(M) * N, s);
      const float t_lib = best_ms(s, flush, flush_bytes, lib_gemm);
      const float t_rs = best_ms(s, flush, flush_bytes, rs_gemm);
      printf("  promotion every %d K-tile(s): library GEMM %.3f ms (%.0f TFLOP/s), register-split "
             "GEMM (%s) %.3f ms (%.0f TFLOP/s, max err %.2e); outputs differing in bits: %llu of "
             "%lld\n", interval, t_lib, flop / t_lib * 1e-9, split, t_rs, flop / t_rs * 1e-9, e_rs,
             differ, (long long)M * N);
    };
    compare(1, "hi rounded", [&] {
      rs3x::Gemm<1>::run(a, b_split, e_a, p.w_exponents, d_rs, M, N, Ks, ws, ws_bytes, sms, s);
    });
    compare(2, "hi rounded", [&] {
      rs3x::Gemm<2>::run(a, b_split, e_a, p.w_exponents, d_rs, M, N, Ks, ws, ws_bytes, sms, s);
    });
    compare(1, "hi truncated", [&] {
      rs3x::Gemm<1, true>::run(a, b_split, e_a, p.w_exponents, d_rs, M, N, Ks, ws, ws_bytes, sms,
                               s);
    });
    epifuse::sm90::g_promotion_interval = 1;
    const float t_lib_1x1 = best_ms(s, flush, flush_bytes, lib_gemm_1x1);
    printf("  the library GEMM on 1x1 clusters: %.3f ms (%.0f TFLOP/s)\n", t_lib_1x1,
           flop / t_lib_1x1 * 1e-9);
    for (void* ptr : {(void*)a, (void*)b, (void*)d_lib, (void*)d_rs, (void*)e_a, (void*)ad,
                      (void*)bd, (void*)rd, a_split, b_split})
      CK(cudaFree(ptr));
  }
  return 0;
}
