// Folding the autocast cast of the activation into the GEMM (x fp32 -> bf16, then z = x . W^T):
// today that is a separate cast kernel (~91 us at 16384x4096 on an H200) and then a bf16 TMA +
// wgmma GEMM (~700 us). Here a Hopper GEMM loads A as fp32 by TMA, converts it to bf16 in
// registers and runs wgmma with A from registers ("RS": CUTLASS 4.2's mixed-input mainloop,
// MainloopSm90TmaGmmaRmemAWarpSpecializedMixedInput, DirectConvert mode). It is timed against
// the plain bf16 GEMM (SS mainloop: both operands from shared memory) on A already cast,
// and against "cast, then plain GEMM". Both are D[M,N] = A[M,K] . B[N,K]^T, fp32 accumulation,
// bf16 D, linear combination epilogue (alpha 1, beta 0, no C), persistent warp-specialized
// cooperative kernel, 128x256x64 tile, 2x1x1 cluster. Standalone (CUDA runtime + CUTLASS headers):
//
//   CL=/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/cutlass_library/source
//   /usr/local/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DNDEBUG \
//        --expt-relaxed-constexpr -I$CL/include -I$CL/tools/util/include \
//        benchmarks/kernels/converted_operand_gemm.cu -o /tmp/converted_operand_gemm
//   /tmp/converted_operand_gemm [M N K]        (default 16384 4096 4096)
//
// (-DNDEBUG is required: without it ptxas serializes wgmma.) Prints a correctness table and the
// best of 20 CUDA-event timings (3 warm-ups, a 256 MiB memset flushes L2 before each timed call).
// Result on an H200: BENCHMARKS.md, "Folding x's fp32 -> bf16 cast into the GEMM" (the converted
// kernel ran 1.34x slower than the cast plus the plain GEMM; its outputs were exact).
//
// The fp32 A's TMA type. The mixed-input collective sets ConvertF32toTF32A for `float` A, so its
// TMA descriptor has type CU_TENSOR_MAP_DATA_TYPE_TFLOAT32, and TMA then rounds each fp32 to tf32
// on its way to shared memory (what Triton's `round_f32_to_tf32` descriptors rely on: round to
// nearest even at 10 mantissa bits; cuda.h does not say). The registers then round tf32 -> bf16
// again: a double rounding. Where the tf32 value lands on a bf16 tie that the fp32 was not on
// (the three bits below bf16's last are 011 and tf32 rounds up, or 100 over nonzero bits that
// tf32 drops), the tie goes to even and may land one bf16 ulp away from the direct cast: about 1
// in 16 random fp32 values (simulated over random mantissas), whether TMA rounds to nearest even,
// ties away or truncates, so A would differ from torch's x.to(torch.bfloat16) in ~6% of elements.
// To avoid it, A is passed as RawF32 (fp32 bits in a type that is not `float`): the collective then
// gives TMA a UINT32 descriptor (bits copied unchanged) and converts RawF32 -> bf16 in registers
// with the NumericConverter below (cvt.rn.bf16.f32, what the cast kernel does). "converted" is that
// kernel; "converted_tf32" is the collective as it comes (tuple<float>), kept to measure the
// double rounding: the correctness table compares both against references whose A went through
// a direct cast and through fp32 -> tf32 (RNE, RNA or truncation) -> bf16, so which one matches
// bit for bit tells what TMA did.
//
// Costs the converted kernel carries (compiled with the command above, CUTLASS 4.2, nvcc 13.0):
// its stage is 64 KiB (32 KiB fp32 A + 32 KiB B), so it gets 3 stages where the plain GEMM gets 4;
// with 2x1 clusters only B is multicast, so each CTA pulls 1.5x the plain GEMM's bytes from L2 per
// k-tile ("converted_2x2"/"plain_bf16_2x2" multicast A too); and each consumer thread adds 16
// LDS.64 + 16 F2FP.BF16.F32.PACK_AB per 64-wide k-tile (ptxas pairs the element-wise converts)
// between its wgmmas. All GEMMs here: 168 registers at launch (setmaxnreg rebalances), no spills.
//
// "producer_conv" (p): the consumers run the plain SS bf16 mainloop unchanged; the conversion
// moves to the producer warpgroup (mostly idle in the plain kernel). Producer warp 0 TMAs fp32 A
// (UINT32 descriptor) into fp32 staging slots and B into the bf16 stages; producer warp 3 (the
// kernel's MainloopAux warp, enabled through kernel::detail::HasAuxiliaryLoad) converts each
// staged tile to bf16 (cvt.rn) straight into the SS stage layout, fences the async proxy and
// arrives on the stage's full barrier, which thus waits for B's bytes and 2 arrivals. Smem:
// 3 bf16 stages (48 KiB each) + 2 fp32 staging slots (32 KiB each) + the epilogue's 16 KiB, where
// the plain GEMM has 4 stages. A custom CollectiveMma below; EPIFUSE_PC_STAGES / EPIFUSE_PC_SLOTS
// override the stage and slot counts. It runs once first under a 2 s guard (aborts on a hang).
//
// "producer_conv_w<W>" (pW, W = EPIFUSE_PC_WARPS, default 3; -DEPIFUSE_PC_WARPS=1 leaves it out):
// the same collective with the conversion spread over W producer warps. The stock cooperative
// kernel runs load_auxiliary() on warp 3 only, and its warps 1 (dynamic-scheduler CLC queries) and
// 2 (epilogue C load) are idle here (static scheduler, no C), so this variant runs a copy of the
// kernel's operator() (epifuse_pc::MultiConverterKernel, derived from the stock GemmUniversal)
// whose producer warps 4-W .. 3 all call load_auxiliary(); warp 0 is unchanged. Warp 4-W+i
// converts row band i (8-row swizzle atoms i*16/W .. (i+1)*16/W: 8/8 for W = 2, 5/5/6 for W = 3)
// of each k-tile; each converter lane fences the async proxy, and lane 0 of each converter warp
// arrives once on the staging slot's empty barrier (initialized to W arrivals) and once on the
// stage's full barrier (1 + W arrivals: warp 0's arrive_and_expect_tx for B and one per converter
// warp, plus B's bytes). Same stages, slots and smem as "producer_conv"; also run once first under
// the 2 s guard, and checked bit for bit against the plain GEMM. H200, best of 20 (3 stages + 2
// slots): W = 1 1.08-1.11 ms, W = 2 0.896 ms, W = 3 0.900-0.915 ms, all 0 outputs differing;
// plain 0.69-0.70, cast + plain 0.79-0.81. With 2 stages + 3 slots: W = 1 1.216, W = 3 1.146 ms.
// ptxas (producer warps at setmaxnreg 40): W = 1 12 B, W = 2 24 B, W = 3 8 B of spills, a few LDL
// of loop-invariant addresses per k-tile (L1 hits), none inside the LDS/STS conversion batches.
// Nsight Compute on W = 3 (H200, --clock-control none): L1/shared 79.7% busy, L2 50.2%, DRAM 23.5%,
// warps stalled on L1TEX scoreboards 11.9 of 19.9 cycles per instruction: shared memory (the fp32
// staging tile's TMA write and its conversion, ~1.5x the plain GEMM's bytes) is the limit, not L2.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <thread>
#include <type_traits>
#include <unistd.h>

#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"
#include "standalone.cuh"

using namespace cute;

// fp32 bits that the mixed-input collective does not recognise as `float` (see the header).
struct alignas(4) RawF32 { float v; };

namespace cutlass {
// The collective converts A element by element (NumericArrayConverter<bf16, A, 1>, whose generic
// form calls this): round to nearest even, cvt.rn.bf16.f32.
template <>
struct NumericConverter<bfloat16_t, RawF32, FloatRoundStyle::round_to_nearest> {
  using result_type = bfloat16_t;
  using source_type = RawF32;
  static FloatRoundStyle const round_style = FloatRoundStyle::round_to_nearest;
  CUTLASS_HOST_DEVICE static result_type convert(source_type const& s) { return bfloat16_t(s.v); }
  CUTLASS_HOST_DEVICE result_type operator()(source_type const& s) const { return convert(s); }
};
}  // namespace cutlass

template <class T> struct Operand { using type = T; };
template <class T> struct Operand<cute::tuple<T>> { using type = T; };

// ElementAIn: cutlass::bfloat16_t (plain, SS mainloop) or cute::tuple<RawF32 | float> (A is the
// transformed operand of the mixed-input RS mainloop: a bare float would make the builder transform
// the narrower B instead and run the MMA in tf32). TileShape is a parameter so that the builders'
// types stay dependent until instantiation (nvcc 13.0's host pass fails on them at namespace scope;
// cpp/kernels/sm90_fp16_product.cu says more).
template <class ElementAIn, class TileShape_ = Shape<_128, _256, _64>,
          class ClusterShape_ = Shape<_2, _1, _1>>
struct Bf16OutGemm {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using ElementA = typename Operand<ElementAIn>::type;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  static constexpr int kAlignA = 16 / sizeof(ElementA);  // TMA: 16-byte aligned rows
  static constexpr int kAlignB = 8, kAlignD = 8;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignD,  // no C operand (beta = 0)
      ElementD, cutlass::layout::RowMajor, kAlignD,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementAIn, cutlass::layout::RowMajor, kAlignA,     // A [M, K], K-major
      ElementB, cutlass::layout::ColumnMajor, kAlignB,    // B given as [N, K] row-major: K-major
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;
};

using Converted = Bf16OutGemm<cute::tuple<RawF32>>;    // (a): UINT32 TMA, direct fp32 -> bf16
using ConvertedTf32 = Bf16OutGemm<cute::tuple<float>>; // (a'): TFLOAT32 TMA, then tf32 -> bf16
using Plain = Bf16OutGemm<cutlass::bfloat16_t>;       // (b)
// Extra pair with 2x2 clusters. A in fp32 doubles A's bytes per k-tile (32 KiB of A + 32 KiB of
// B per 128x256x64 stage against 16 + 32 KiB): 3 pipeline stages instead of 4, and with 2x1
// clusters (B multicast, A not) 1.5x the L2 -> SM traffic of the plain GEMM. 2x2 clusters
// multicast A as well, bringing the converted kernel's L2 traffic back to the plain 2x1 one's.
using Converted2x2 = Bf16OutGemm<cute::tuple<RawF32>, Shape<_128, _256, _64>, Shape<_2, _2, _1>>;
using Plain2x2 = Bf16OutGemm<cutlass::bfloat16_t, Shape<_128, _256, _64>, Shape<_2, _2, _1>>;

// What the TMA descriptor of A is built from (the header says why it matters).
static_assert(std::is_same_v<Converted::CollectiveMainloop::TmaElementA, uint32_t>,
              "A must be copied bit for bit");
static_assert(std::is_same_v<ConvertedTf32::CollectiveMainloop::TmaElementA, cutlass::tfloat32_t>);
static_assert(std::is_same_v<Converted::CollectiveMainloop::TiledMma::ValTypeA, cutlass::bfloat16_t>,
              "bf16 wgmma");

// ---- (p) producer-converted: the fp32 -> bf16 cast done by the producer warpgroup -------------
//
// The consumers' mainloop is the plain SS one (both wgmma operands bf16 from shared memory); A is
// converted on the producer side. Producer warpgroup roles in CUTLASS's cooperative kernel (no C
// operand, static persistent scheduler): warp 0 calls collective.load(), warp 3 calls
// collective.load_auxiliary() when kernel::detail::HasAuxiliaryLoad<DispatchPolicy> is true, warps
// 1 and 2 idle. Here:
//   warp 0 (one elected lane): per k-tile, TMA of the fp32 A tile (UINT32 descriptor: bits copied
//     unchanged) into a staging slot (its own TMA pipeline: staging_full with expect-tx 32 KiB,
//     staging_empty released by the converter), then producer_acquire of the mainloop stage and TMA
//     of B (multicast over the 2x1 cluster as usual) into that stage.
//   warp 3 (all 32 lanes): per k-tile, waits for the staging slot to land and for the mainloop
//     stage to be empty (the same empty barrier warp 0 waits on), reads the fp32 tile, rounds to
//     bf16 (cvt.rn, __floats2bfloat162_rn as the cast kernel), writes it into the bf16 A stage in
//     the SS layout (SmemLayoutA, 128B swizzle), releases the staging slot, fence.proxy.async
//     (each lane), __syncwarp, and one lane arrives on the stage's full barrier.
//   The mainloop full barrier expects 2 arrivals (warp 0's arrive_and_expect_tx(B bytes) and the
//   converter's arrive) plus B's transaction bytes; consumers and their release are the SS ones.
namespace cutlass::gemm::collective {
template <int Stages_, int StagingSlots_, class ClusterShape_, int ConvWarps_ = 1>
struct MainloopSm90TmaGmmaProducerConvertA {
  constexpr static int Stages = Stages_;
  constexpr static int StagingSlots = StagingSlots_;
  constexpr static int ConvWarps = ConvWarps_;  // converter warps: producer warps 4-W .. 3
  using ClusterShape = ClusterShape_;
  using ArchTag = arch::Sm90;
  using Schedule = KernelTmaWarpSpecializedCooperative;
};
}  // namespace cutlass::gemm::collective

namespace cutlass::gemm::kernel::detail {
// Makes the cooperative kernel run load_auxiliary() in producer warp 3 (the converter).
template <int S, int L, class C, int W>
struct HasAuxiliaryLoad<cutlass::gemm::collective::MainloopSm90TmaGmmaProducerConvertA<S, L, C, W>>
    : cute::true_type {};
}  // namespace cutlass::gemm::kernel::detail

namespace epifuse_pc {
// The kernel builds CollectiveMainloop::MainloopPipeline from shared_storage.pipelines.mainloop:
// this one is PipelineTmaAsync plus the staging barriers, initialized in the same place.
template <int Stages_, int Slots_, int ConvWarps_ = 1>
class ProducerConvertPipeline : public cutlass::PipelineTmaAsync<Stages_> {
 public:
  using Base = cutlass::PipelineTmaAsync<Stages_>;
  using Params = typename Base::Params;
  using ThreadCategory = typename Base::ThreadCategory;
  static constexpr int Slots = Slots_;
  struct SharedStorage {
    typename Base::SharedStorage base;
    alignas(8) uint64_t staging_full[Slots];   // 1 arrival (expect-tx) + the A staging bytes
    alignas(8) uint64_t staging_empty[Slots];  // ConvWarps arrivals (one per converter warp)
  };
  template <class ClusterShape>
  CUTLASS_DEVICE ProducerConvertPipeline(SharedStorage& s, Params p, ClusterShape cs)
      : Base(s.base, p, cs), storage_(&s) {
    if (cutlass::canonical_warp_idx_sync() == p.initializing_warp && cute::elect_one_sync()) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Slots; ++i) {
        cutlass::arch::ClusterBarrier::init(&s.staging_full[i], 1);
        cutlass::arch::ClusterBarrier::init(&s.staging_empty[i], ConvWarps_);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  CUTLASS_DEVICE uint64_t* staging_full(int i) const { return &storage_->staging_full[i]; }
  CUTLASS_DEVICE uint64_t* staging_empty(int i) const { return &storage_->staging_empty[i]; }
  CUTLASS_DEVICE uint64_t* stage_full(int i) const {
    return reinterpret_cast<uint64_t*>(&storage_->base.full_barrier_[i]);
  }
  CUTLASS_DEVICE uint64_t* stage_empty(int i) const {
    return reinterpret_cast<uint64_t*>(&storage_->base.empty_barrier_[i]);
  }

 private:
  SharedStorage* storage_;
};
}  // namespace epifuse_pc

namespace cutlass::gemm::collective {
template <int Stages, int StagingSlots, class ClusterShape, int ConvWarps, class TileShape_, class StrideA_,
          class StrideB_, class TiledMma_, class GmemTiledCopyA_, class SmemLayoutAtomA_,
          class SmemCopyAtomA_, class TransformA_, class GmemTiledCopyB_, class SmemLayoutAtomB_,
          class SmemCopyAtomB_, class TransformB_>
struct CollectiveMma<MainloopSm90TmaGmmaProducerConvertA<Stages, StagingSlots, ClusterShape, ConvWarps>,
                     TileShape_, float, StrideA_, cutlass::bfloat16_t, StrideB_, TiledMma_,
                     GmemTiledCopyA_, SmemLayoutAtomA_, SmemCopyAtomA_, TransformA_,
                     GmemTiledCopyB_, SmemLayoutAtomB_, SmemCopyAtomB_, TransformB_> {
  using DispatchPolicy = MainloopSm90TmaGmmaProducerConvertA<Stages, StagingSlots, ClusterShape, ConvWarps>;
  using TileShape = TileShape_;
  using ElementA = float;  // fp32 in global memory; bf16 in the wgmma stages
  using StrideA = StrideA_;
  using ElementB = cutlass::bfloat16_t;
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

  using MainloopPipeline = epifuse_pc::ProducerConvertPipeline<Stages, StagingSlots, ConvWarps>;
  using PipelineState = cutlass::PipelineState<Stages>;
  using StagingState = cutlass::PipelineState<StagingSlots>;
  using PipelineParams = typename MainloopPipeline::Params;

  // Arrivals on each stage's full barrier: warp 0's arrive_and_expect_tx (B) + one per converter
  // warp (the kernel passes this as the pipeline's num_producers).
  static constexpr int NumProducerThreadEvents = 1 + ConvWarps;
  static_assert(ConvWarps >= 1 && ConvWarps <= 3, "converter warps are producer warps 4-W .. 3");

  static constexpr int BLK_M = size<0>(TileShape{});
  static constexpr int BLK_K = size<2>(TileShape{});

  static_assert(::cutlass::gemm::detail::is_k_major<StrideA>(), "A must be K-major");
  static_assert(::cutlass::gemm::detail::is_k_major<StrideB>(), "B must be K-major");
  static_assert(size<1>(ClusterShape{}) == 1, "A is not multicast: the staging pipeline is CTA-local");
  static_assert(cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD>, "A: plain TMA (no multicast)");
  static_assert(cute::is_same_v<typename TiledMma::ValTypeA, cutlass::bfloat16_t> &&
                cute::is_same_v<typename TiledMma::ValTypeB, cutlass::bfloat16_t>, "bf16 wgmma");
  static_assert(BLK_K % 8 == 0 && (BLK_M * (BLK_K / 8)) % 32 == 0, "converter item mapping");

  // The consumers' stages, exactly as the SS mainloop's.
  using SmemLayoutA = decltype(tile_to_shape(
      SmemLayoutAtomA{}, make_shape(shape<0>(TileShape{}), shape<2>(TileShape{}), Int<Stages>{}),
      Step<_1, _2, _3>{}));
  using SmemLayoutB = decltype(tile_to_shape(
      SmemLayoutAtomB{}, make_shape(shape<1>(TileShape{}), shape<2>(TileShape{}), Int<Stages>{}),
      Step<_1, _2, _3>{}));
  // fp32 staging for A (raw bits as uint32_t), 128B-swizzled K-major (8 x 32 fp32 atoms).
  using SmemLayoutAtomAStg = GMMA::Layout_K_SW128_Atom<uint32_t>;
  using SmemLayoutAStg = decltype(tile_to_shape(
      SmemLayoutAtomAStg{},
      make_shape(shape<0>(TileShape{}), shape<2>(TileShape{}), Int<StagingSlots>{}),
      Step<_1, _2, _3>{}));

  static_assert(Stages >= 2 && StagingSlots >= 1);
  static_assert(cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value &&
                cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeB>::value,
                "both wgmma operands from smem");

  using InternalElementA = uint32_t;  // TMA copies the fp32 bits unchanged (no tf32 rounding)
  using InternalElementB = uint_bit_t<sizeof_bits_v<ElementB>>;
  using TmaElementA = InternalElementA;

  struct SharedStorage {
    struct TensorStorage : cute::aligned_struct<128, _0> {
      cute::array_aligned<typename TiledMma::ValTypeA, cute::cosize_v<SmemLayoutA>> smem_A;
      cute::array_aligned<typename TiledMma::ValTypeB, cute::cosize_v<SmemLayoutB>> smem_B;
      cute::array_aligned<uint32_t, cute::cosize_v<SmemLayoutAStg>, 1024> smem_A32;
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
    uint32_t mma_promotion_interval = 4;
  };

  struct Params {
    using TMA_A = decltype(make_tma_copy_A_sm90(
        GmemTiledCopyA{},
        make_tensor(static_cast<InternalElementA const*>(nullptr), repeat_like(StrideA{}, int32_t(0)), StrideA{}),
        SmemLayoutAStg{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{}));
    using TMA_B = decltype(make_tma_copy_B_sm90(
        GmemTiledCopyB{},
        make_tensor(static_cast<InternalElementB const*>(nullptr), repeat_like(StrideB{}, int32_t(0)), StrideB{}),
        SmemLayoutB{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{}));
    TMA_A tma_load_a;
    TMA_B tma_load_b;
    uint32_t tma_transaction_bytes = TmaTransactionBytesNK;  // what the mainloop full barrier expects
    uint32_t tma_transaction_bytes_mk = TmaTransactionBytesMK;  // per staging slot
    uint32_t tma_transaction_bytes_nk = TmaTransactionBytesNK;
  };

  static constexpr uint32_t TmaTransactionBytesMK =
      cutlass::bits_to_bytes(size<0>(SmemLayoutAStg{}) * size<1>(SmemLayoutAStg{}) * 32u);
  static constexpr uint32_t TmaTransactionBytesNK = cutlass::bits_to_bytes(
      size<0>(SmemLayoutB{}) * size<1>(SmemLayoutB{}) * static_cast<uint32_t>(sizeof_bits<ElementB>::value));
  static constexpr uint32_t TmaTransactionBytes = TmaTransactionBytesNK;
  static constexpr int K_PIPE_MAX = Stages;
  static constexpr int K_PIPE_MMAS = 1;

  // Staging-pipeline positions: each of the two producer warps keeps its own copy (the kernel only
  // carries the mainloop pipeline's state); both advance by the same k-tile counts.
  StagingState stg_write_{0, 1, 0};  // producer start: slots initially empty
  StagingState stg_read_{0, 0, 0};

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    (void)workspace;
    auto problem_shape_MNKL = append<4>(problem_shape, 1);
    auto [M, N, K, L] = problem_shape_MNKL;
    auto ptr_A = reinterpret_cast<InternalElementA const*>(args.ptr_A);
    auto ptr_B = reinterpret_cast<InternalElementB const*>(args.ptr_B);
    Tensor tensor_a = make_tensor(ptr_A, make_layout(make_shape(M, K, L), args.dA));
    Tensor tensor_b = make_tensor(ptr_B, make_layout(make_shape(N, K, L), args.dB));
    typename Params::TMA_A tma_load_a = make_tma_copy_A_sm90(
        GmemTiledCopyA{}, tensor_a, SmemLayoutAStg{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{});
    typename Params::TMA_B tma_load_b = make_tma_copy_B_sm90(
        GmemTiledCopyB{}, tensor_b, SmemLayoutB{}(_, _, cute::Int<0>{}), TileShape{}, ClusterShape{});
    return {tma_load_a, tma_load_b, TmaTransactionBytesNK, TmaTransactionBytesMK, TmaTransactionBytesNK};
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, [[maybe_unused]] Arguments const& args) {
    constexpr int tma_alignment_bits = 128;
    auto problem_shape_MNKL = append<4>(problem_shape, 1);
    auto [M, N, K, L] = problem_shape_MNKL;
    bool ok = cutlass::detail::check_alignment<tma_alignment_bits / 32>(cute::make_shape(M, K, L), StrideA{});
    ok = ok && cutlass::detail::check_alignment<tma_alignment_bits / cutlass::sizeof_bits<ElementB>::value>(
                   cute::make_shape(N, K, L), StrideB{});
    return ok;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& mainloop_params) {
    cute::prefetch_tma_descriptor(mainloop_params.tma_load_a.get_tma_descriptor());
    cute::prefetch_tma_descriptor(mainloop_params.tma_load_b.get_tma_descriptor());
  }

  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& mainloop_params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA_mkl = mainloop_params.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mB_nkl = mainloop_params.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BLK_M,BLK_K,m,k,l)
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BLK_N,BLK_K,n,k,l)
    return cute::make_tuple(gA_mkl, gB_nkl);
  }

  // Producer warp 0: TMA of fp32 A into the staging slots and of B into the mainloop stages.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& mainloop_params, MainloopPipeline pipeline,
                           PipelineState smem_pipe_write, cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    int lane_predicate = cute::elect_one_sync();
    if (lane_predicate) {
      Tensor sA32 = make_tensor(make_smem_ptr(shared_tensors.smem_A32.data()), SmemLayoutAStg{});  // (BLK_M,BLK_K,SLOT)
      Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});        // (BLK_N,BLK_K,PIPE)
      constexpr uint32_t cluster_shape_x = get<0>(typename DispatchPolicy::ClusterShape());
      uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
      Tensor gA_mkl = get<0>(load_inputs);
      Tensor gB_nkl = get<1>(load_inputs);
      auto block_tma_a = mainloop_params.tma_load_a.get_slice(cluster_local_block_id.y);
      auto block_tma_b = mainloop_params.tma_load_b.get_slice(cluster_local_block_id.x);
      auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
      Tensor gA = gA_mkl(_, _, m_coord, _, l_coord);
      Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);
      Tensor tAgA = block_tma_a.partition_S(gA);   // (TMA,TMA_M,TMA_K,k)
      Tensor tAsA = block_tma_a.partition_D(sA32); // (TMA,TMA_M,TMA_K,SLOT)
      Tensor tBgB = block_tma_b.partition_S(gB);
      Tensor tBsB = block_tma_b.partition_D(sB);
      uint16_t mcast_mask_b = 0;
      if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
        auto block_layout = Layout<typename DispatchPolicy::ClusterShape>{};
        for (int m = 0; m < size<0>(block_layout); ++m) {
          mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
        }
      }
      StagingState stg = stg_write_;
      CUTLASS_PRAGMA_NO_UNROLL
      for (int kt = k_tile_count; kt > 0; --kt) {
        // fp32 A -> staging slot (once the converter has read what was there)
        cutlass::arch::ClusterBarrier::wait(pipeline.staging_empty(stg.index()), stg.phase());
        uint64_t* stg_full = pipeline.staging_full(stg.index());
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(stg_full, TmaTransactionBytesMK);
        copy(mainloop_params.tma_load_a.with(*stg_full, 0), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stg.index()));
        ++stg;
        // B -> the mainloop stage (once the consumers of both CTAs released it)
        pipeline.producer_acquire(smem_pipe_write);
        using BarrierType = typename MainloopPipeline::ProducerBarrierType;
        BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
        copy(mainloop_params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, *k_tile_iter),
             tBsB(_, _, _, smem_pipe_write.index()));
        ++k_tile_iter;
        ++smem_pipe_write;
      }
    }
    __syncwarp();
    stg_write_.advance(k_tile_count);  // every lane, whichever one was elected
  }

  // Producer warp 3 (all 32 lanes): staging fp32 -> bf16 stage in the SS layout.
  //
  // Item = 8 consecutive k of one row: two 16 B fp32 reads, four cvt.rn.bf16x2.f32, one 16 B bf16
  // write. Lanes 8q..8q+7 take 8 consecutive rows at the same k chunk, so with the 128B swizzles
  // (16 B chunk index ^= row % 8) each quarter-warp's 16 B accesses hit 8 distinct bank groups,
  // reads and writes alike. Addresses are shared-window byte addresses with the swizzle applied to
  // the address bits as TMA, wgmma and cute's swizzle_ptr do (bits [4,7) ^= bits [7,10)):
  //   bf16 stage  (SmemLayoutA, Layout_K_SW128 atoms of 8 x 64, 16 atoms down M):
  //     stage * BLK_M*BLK_K*2 + row * 128 + k * 2
  //   fp32 staging (8 x 32 atoms, 16 down M, then 2 along K):
  //     slot * BLK_M*BLK_K*4 + (k / 32) * BLK_M*128 + row * 128 + (k % 32) * 4
  // Offsets that are multiples of 1024 B commute with the swizzle, so each lane swizzles four
  // base addresses once and adds the rest as immediates. Loads and stores are volatile PTX
  // (ld/st.shared.v4), software-pipelined by one batch (2 items) within the 40 registers that the
  // producer warpgroup keeps after setmaxnreg.
  static CUTLASS_DEVICE uint32_t swz128(uint32_t a) { return a ^ ((a >> 3) & 0x70u); }
  static CUTLASS_DEVICE uint4 lds128(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
  }
  static CUTLASS_DEVICE void sts128(uint32_t a, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  }
  static CUTLASS_DEVICE uint32_t cvt2(uint32_t a, uint32_t b) {  // {lo: a, hi: b} as bf16x2, RNE
    __nv_bfloat162 h = __floats2bfloat162_rn(__uint_as_float(a), __uint_as_float(b));
    return reinterpret_cast<uint32_t&>(h);
  }
  static CUTLASS_DEVICE uint4 cvt8(uint4 lo, uint4 hi) {
    return make_uint4(cvt2(lo.x, lo.y), cvt2(lo.z, lo.w), cvt2(hi.x, hi.y), cvt2(hi.z, hi.w));
  }

  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& mainloop_params, MainloopPipeline pipeline,
                                     PipelineState smem_pipe_write, cute::tuple<TensorA, TensorB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, uint32_t block_rank_in_cluster,
                                     TensorStorage& shared_tensors) {
    static_assert(BLK_K == 64 && BLK_M % 8 == 0, "converter written for 64-wide k-tiles (two 32-col fp32 atoms)");
    static_assert(cute::is_same_v<SmemLayoutAtomA, GMMA::Layout_K_SW128_Atom<cutlass::bfloat16_t>>,
                  "bf16 A stage assumed to be K-major SW128");
    static_assert(cute::cosize_v<SmemLayoutA> == BLK_M * BLK_K * Stages &&
                  cute::cosize_v<SmemLayoutAStg> == BLK_M * BLK_K * StagingSlots, "dense stages");
    constexpr uint32_t kStage16 = BLK_M * BLK_K * 2, kSlot32 = BLK_M * BLK_K * 4, kKAtom32 = BLK_M * 128;
    // This warp's band: 8-row swizzle atoms [a0, a1) of the BLK_M / 8, split as evenly as W allows
    // (W = 3 over 16 atoms: 5 / 5 / 6). Warp w of the producer warpgroup (w = 4-W .. 3) has band
    // w - (4-W). One batch = one atom: 2 items (k chunks q and q+4) per lane.
    constexpr int kAtoms = BLK_M / 8;
    constexpr int kMaxBatches = (kAtoms + ConvWarps - 1) / ConvWarps;
    constexpr int kMinBatches = kAtoms / ConvWarps;  // batches b < kMinBatches exist in every band
    constexpr bool kEvenBands = kAtoms % ConvWarps == 0;
    const int band = ConvWarps == 1 ? 0 : cutlass::canonical_warp_idx_sync() % NumWarpsPerWarpGroup - (4 - ConvWarps);
    const int a0 = band * kAtoms / ConvWarps, a1 = (band + 1) * kAtoms / ConvWarps;
    const int nb = a1 - a0;  // kMaxBatches or kMaxBatches - 1
    const int lane = thread_idx % 32, r = lane & 7, q = lane >> 3;
    const uint32_t base32 =
        cute::cast_smem_ptr_to_uint(shared_tensors.smem_A32.data()) + a0 * 1024 + r * 128 + q * 32;
    const uint32_t base16 =
        cute::cast_smem_ptr_to_uint(shared_tensors.smem_A.data()) + a0 * 1024 + r * 128 + q * 16;
    const uint32_t p_lo = swz128(base32), p_hi = swz128(base32 + 16);  // k = 8q..8q+3, 8q+4..8q+7
    const uint32_t o_0 = swz128(base16), o_1 = swz128(base16 + 64);     // k = 8q.., 8q+32..
    StagingState stg = stg_read_;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kt = k_tile_count; kt > 0; --kt) {
      const int slot = stg.index(), stage = smem_pipe_write.index();
      cutlass::arch::ClusterBarrier::wait(pipeline.staging_full(slot), stg.phase());
      cutlass::arch::ClusterBarrier::wait(pipeline.stage_empty(stage), smem_pipe_write.phase());
      const uint32_t lo = p_lo + slot * kSlot32, hi = p_hi + slot * kSlot32;
      const uint32_t w0 = o_0 + stage * kStage16, w1 = o_1 + stage * kStage16;
      uint4 a_lo = lds128(lo), a_hi = lds128(hi);
      uint4 b_lo = lds128(lo + kKAtom32), b_hi = lds128(hi + kKAtom32);
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kMaxBatches; ++b) {
        if (kEvenBands || b < kMinBatches || b < nb) {
          const uint4 oa = cvt8(a_lo, a_hi), ob = cvt8(b_lo, b_hi);
          if (b + 1 < kMaxBatches && (kEvenBands || b + 1 < kMinBatches || b + 1 < nb)) {
            const uint32_t n = (b + 1) * 1024;
            a_lo = lds128(lo + n); a_hi = lds128(hi + n);
            b_lo = lds128(lo + kKAtom32 + n); b_hi = lds128(hi + kKAtom32 + n);
          }
          sts128(w0 + b * 1024, oa);
          sts128(w1 + b * 1024, ob);
        }
      }
      cutlass::arch::fence_view_async_shared();  // this lane's generic writes -> visible to wgmma
      __syncwarp();
      if (lane == 0) {  // one arrival per converter warp on each (counts: W and 1 + W)
        cutlass::arch::ClusterBarrier::arrive(pipeline.staging_empty(slot));  // staging band read
        cutlass::arch::ClusterBarrier::arrive(pipeline.stage_full(stage));    // bf16 A band written
      }
      ++stg;
      ++smem_pipe_write;
    }
    stg_read_.advance(k_tile_count);
  }

  CUTLASS_DEVICE void load_tail(MainloopPipeline pipeline, PipelineState smem_pipe_write) {
    int lane_predicate = cute::elect_one_sync();
    if (lane_predicate) {
      pipeline.producer_tail(smem_pipe_write);
    }
  }

  // Consumers: the SS mainloop's mma(), unchanged.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& mainloop_params) {
    static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
    static_assert(cute::is_void_v<SmemCopyAtomA> && cute::is_void_v<SmemCopyAtomB>);
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    constexpr int MmaWarpGroups = size(TiledMma{}) / NumThreadsPerWarpGroup;
    Layout warp_group_thread_layout = make_layout(Int<MmaWarpGroups>{}, Int<NumThreadsPerWarpGroup>{});
    int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsA = thread_mma.partition_A(sA);
    Tensor tCsB = thread_mma.partition_B(sB);
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(accum));
    CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<2>(accum));
    CUTE_STATIC_ASSERT_V(size<2>(tCsA) == size<2>(tCsB));
    CUTE_STATIC_ASSERT_V(size<3>(tCsA) == size<3>(tCsB));

    PipelineState smem_pipe_release = smem_pipe_read;
    int prologue_mma_count = min(K_PIPE_MMAS, k_tile_count);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(accum);
    {
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, read_stage), tCrB(_, _, k_block, read_stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      ++smem_pipe_read;
    }
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_UNROLL
    for (int k_tile_prologue = prologue_mma_count - 1; k_tile_prologue > 0; --k_tile_prologue) {
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, read_stage), tCrB(_, _, _, read_stage), accum);
      warpgroup_commit_batch();
      ++smem_pipe_read;
    }
    warpgroup_fence_operand(accum);
    k_tile_count -= prologue_mma_count;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      int read_stage = smem_pipe_read.index();
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      cute::gemm(tiled_mma, tCrA(_, _, _, read_stage), tCrB(_, _, _, read_stage), accum);
      warpgroup_commit_batch();
      warpgroup_wait<K_PIPE_MMAS>();
      warpgroup_fence_operand(accum);
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_read;
      ++smem_pipe_release;
    }
    warpgroup_fence_operand(accum);
  }

  CUTLASS_DEVICE void mma_tail(MainloopPipeline pipeline, PipelineState smem_pipe_release, int k_tile_count) {
    int prologue_mma_count = min(K_PIPE_MMAS, k_tile_count);
    k_tile_count -= prologue_mma_count;
    smem_pipe_release.advance(k_tile_count);
    warpgroup_wait<0>();
    for (int count = 0; count < prologue_mma_count; ++count) {
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
    }
  }
};
}  // namespace cutlass::gemm::collective

// ---- (p, W > 1): the cooperative kernel with W converter warps -----------------------------
//
// CUTLASS's cooperative kernel gives each producer warp a fixed role: warp 0 mainloop load, warp 1
// the dynamic scheduler's CLC queries (idle with the static PersistentScheduler used here), warp 2
// the epilogue's C load (idle here: no C operand, is_producer_load_needed() is false), warp 3
// load_auxiliary(). Warps 1 and 2 therefore return at once, and only warp 3 can convert. This kernel
// is that kernel's operator() (CUTLASS 4.2, sm90_gemm_tma_warpspecialized_cooperative.hpp),
// specialised to the static persistent scheduler and no epilogue load, with the producer warpgroup
// reassigned: warp 0 mainloop load (TMA of fp32 A and B, as before), warps 4-W .. 3 each call
// load_auxiliary(), which converts the warp's band of rows of every k-tile. Everything else
// (setmaxnreg 40 / 232, barriers, consumers, epilogue) is the stock kernel's. It derives from the
// stock GemmUniversal so that the device adapter, Params, SharedStorage, grid shape and all
// host-side methods are the stock ones; only the device entry (operator()) is replaced.
namespace epifuse_pc {
template <class Base>
struct MultiConverterKernel : Base {
  using typename Base::Params;
  using typename Base::SharedStorage;
  using typename Base::CollectiveMainloop;
  using typename Base::CollectiveEpilogue;
  using typename Base::TileScheduler;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using typename Base::ClusterShape;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::StrideC;
  using typename Base::StrideD;
  using TileSchedulerPipeline = typename Base::TileSchedulerPipeline;
  using TileSchedulerPipelineState = typename Base::TileSchedulerPipelineState;
  using TileSchedulerThrottlePipeline = typename Base::TileSchedulerThrottlePipeline;
  using TileSchedulerThrottlePipelineState = typename Base::TileSchedulerThrottlePipelineState;
  static constexpr int ConvWarps = CollectiveMainloop::DispatchPolicy::ConvWarps;
  static constexpr int FirstConvWarp = 4 - ConvWarps;
  static_assert(ConvWarps >= 1 && ConvWarps <= 3);
  static_assert(!Base::IsSchedDynamicPersistent, "written for the static persistent scheduler");
  static_assert(Base::NumProducerThreads == 1 + ConvWarps, "full barrier: warp 0 + one per converter warp");

  CUTLASS_DEVICE
  void operator()(Params const& params, char* smem_buf) {
    using namespace cute;
    using X = Underscore;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(Base::NumMMAThreads == 256);
    constexpr uint32_t NumMMAThreads = Base::NumMMAThreads;
    constexpr uint32_t NumLoadWarpGroups = Base::NumLoadWarpGroups;
    constexpr uint32_t NumMmaWarpGroups = Base::NumMmaWarpGroups;
    enum class WarpGroupRole { Producer = 0, Consumer0 = 1, Consumer1 = 2 };

    SharedStorage& shared_storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    int thread_idx = int(threadIdx.x);
    int lane_idx = cutlass::canonical_lane_idx();
    int warp_idx = cutlass::canonical_warp_idx_sync();
    int warp_idx_in_warp_group = warp_idx % cutlass::NumWarpsPerWarpGroup;
    int warp_group_thread_idx = thread_idx % cutlass::NumThreadsPerWarpGroup;
    int mma_thread_idx = thread_idx % NumMMAThreads;
    auto warp_group_role = WarpGroupRole(cutlass::canonical_warp_group_idx());
    int lane_predicate = cute::elect_one_sync();
    uint32_t block_rank_in_cluster = cute::block_rank_in_cluster();
    const bool is_mainloop_warp = warp_group_role == WarpGroupRole::Producer && warp_idx_in_warp_group == 0;
    const bool is_converter_warp =
        warp_group_role == WarpGroupRole::Producer && warp_idx_in_warp_group >= FirstConvWarp;

    if ((warp_idx == 0) && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    CollectiveEpilogue collective_epilogue(params.epilogue, shared_storage.tensors.epilogue);
    if (collective_epilogue.is_producer_load_needed()) {
      __trap();  // no warp loads C in this kernel (beta = 0, no C operand)
    }
    typename TileSchedulerPipeline::Params scheduler_pipeline_params;
    typename TileSchedulerThrottlePipeline::Params scheduler_throttle_pipeline_params;
    TileSchedulerPipeline scheduler_pipeline(shared_storage.scheduler.pipeline(), scheduler_pipeline_params);
    TileSchedulerPipelineState scheduler_pipe_consumer_state;
    TileSchedulerThrottlePipeline scheduler_throttle_pipeline(shared_storage.scheduler.throttle_pipeline(),
                                                              scheduler_throttle_pipeline_params);
    (void)scheduler_throttle_pipeline;

    // Mainloop pipeline: producers are warp 0 (arrive_and_expect_tx for B) and the converter warps
    // (one arrival each): full barriers expect NumProducerThreads = 1 + W arrivals.
    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    typename MainloopPipeline::Params mainloop_pipeline_params;
    if (is_mainloop_warp || is_converter_warp) {
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (warp_group_role == WarpGroupRole::Consumer0 || warp_group_role == WarpGroupRole::Consumer1) {
      mainloop_pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    mainloop_pipeline_params.is_leader = warp_group_thread_idx == 0;
    mainloop_pipeline_params.num_consumers = NumMMAThreads;
    mainloop_pipeline_params.num_producers = Base::NumProducerThreads;
    mainloop_pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(shared_storage.pipelines.mainloop, mainloop_pipeline_params, ClusterShape{});

    // Epilogue load pipeline: constructed (the consumers' store() takes it) but never produced into.
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    typename EpiLoadPipeline::Params epi_load_pipeline_params;
    if (warp_group_role == WarpGroupRole::Consumer0 || warp_group_role == WarpGroupRole::Consumer1) {
      epi_load_pipeline_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    }
    epi_load_pipeline_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_pipeline_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_pipeline_params.consumer_arv_count = NumMMAThreads;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes) {
      epi_load_pipeline_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    }
    EpiLoadPipeline epi_load_pipeline(shared_storage.pipelines.epi_load, epi_load_pipeline_params);

    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    typename EpiStorePipeline::Params epi_store_pipeline_params;
    epi_store_pipeline_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_pipeline_params);

    typename CollectiveMainloop::PipelineState mainloop_pipe_consumer_state;
    typename CollectiveEpilogue::LoadPipelineState epi_load_pipe_consumer_state;
    auto mainloop_pipe_producer_state = cutlass::make_producer_start_state<MainloopPipeline>();
    auto epi_store_pipe_producer_state = cutlass::make_producer_start_state<EpiStorePipeline>();

    auto cluster_wait_fn = []() {
      if constexpr (size(ClusterShape{}) > 1) {
        cute::cluster_arrive_relaxed();
        return []() { cute::cluster_wait(); };
      } else {
        __syncthreads();
        return []() {};
      }
    }();

    auto problem_shape_MNKL = append<4>(params.problem_shape, Int<1>{});
    TiledMma tiled_mma;
    auto blk_shape = TileShape{};
    TileScheduler scheduler{params.scheduler};
    typename TileScheduler::WorkTileInfo work_tile_info;
    CollectiveMainloop collective_mainloop;
    auto load_inputs = collective_mainloop.load_init(problem_shape_MNKL, params.mainloop);
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);

    cluster_wait_fn();

    if (warp_group_role == WarpGroupRole::Producer) {
      work_tile_info = scheduler.initial_work_tile_info(ClusterShape{});
      cutlass::arch::warpgroup_reg_dealloc<Base::LoadRegisterRequirement>();

      // One work-tile loop per role (as in the stock kernel), so that neither role's loop carries the
      // other's live state within the 40 registers.
      auto producer_loop = [&](auto&& per_tile) {
        cutlass::arch::wait_on_dependent_grids();
        while (work_tile_info.is_valid()) {
          if (!TileScheduler::valid_warpgroup_in_work_tile(work_tile_info)) {
            auto [next_work_tile_info, increment_pipe] = scheduler.fetch_next_work(work_tile_info);
            work_tile_info = next_work_tile_info;
            continue;
          }
          auto m_coord = idx2crd(work_tile_info.M_idx, shape<2>(gA_mkl));
          auto n_coord = idx2crd(work_tile_info.N_idx, shape<2>(gB_nkl));
          auto l_coord = idx2crd(work_tile_info.L_idx, shape<4>(gB_nkl));
          auto blk_coord = make_coord(m_coord, n_coord, _, l_coord);
          auto work_k_tile_count = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
          auto work_k_tile_start = TileScheduler::get_work_k_tile_start(work_tile_info);
          auto k_tile_iter = cute::make_coord_iterator(idx2crd(work_k_tile_start, shape<3>(gA_mkl)), shape<3>(gA_mkl));
          per_tile(blk_coord, k_tile_iter, work_k_tile_count);
          mainloop_pipe_producer_state.advance(work_k_tile_count);
          auto [next_work_tile_info, increment_pipe] =
              scheduler.fetch_next_work(work_tile_info, scheduler_pipeline, scheduler_pipe_consumer_state);
          work_tile_info = next_work_tile_info;
        }
      };
      if (is_mainloop_warp) {
        producer_loop([&](auto const& blk_coord, auto k_tile_iter, int work_k_tile_count) {
          collective_mainloop.load(params.mainloop, mainloop_pipeline, mainloop_pipe_producer_state, load_inputs,
                                   blk_coord, k_tile_iter, work_k_tile_count, lane_idx, block_rank_in_cluster,
                                   shared_storage.tensors.mainloop);
        });
        // Waits until the consumers of both CTAs released every stage (their remote arrivals).
        collective_mainloop.load_tail(mainloop_pipeline, mainloop_pipe_producer_state);
      } else if (is_converter_warp) {
        producer_loop([&](auto const& blk_coord, auto k_tile_iter, int work_k_tile_count) {
          collective_mainloop.load_auxiliary(params.mainloop, mainloop_pipeline, mainloop_pipe_producer_state,
                                             load_inputs, blk_coord, k_tile_iter, work_k_tile_count, lane_idx,
                                             block_rank_in_cluster, shared_storage.tensors.mainloop);
        });
      }
    } else if (warp_group_role == WarpGroupRole::Consumer0 || warp_group_role == WarpGroupRole::Consumer1) {
      work_tile_info = scheduler.initial_work_tile_info(ClusterShape{});
      cutlass::arch::warpgroup_reg_alloc<Base::MmaRegisterRequirement>();
      CollectiveEpilogue collective_epilogue(params.epilogue, shared_storage.tensors.epilogue);
      bool do_store_tail = false;
      while (work_tile_info.is_valid()) {
        auto m_coord = idx2crd(work_tile_info.M_idx, shape<2>(gA_mkl));
        auto n_coord = idx2crd(work_tile_info.N_idx, shape<2>(gB_nkl));
        auto l_coord = idx2crd(work_tile_info.L_idx, shape<4>(gB_nkl));
        auto blk_coord = make_coord(m_coord, n_coord, _, l_coord);
        auto work_k_tile_count = TileScheduler::get_work_k_tile_count(work_tile_info, problem_shape_MNKL, blk_shape);
        auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
        if (TileScheduler::valid_warpgroup_in_work_tile(work_tile_info)) {
          collective_mainloop.mma(mainloop_pipeline, mainloop_pipe_consumer_state, accumulators, work_k_tile_count,
                                  mma_thread_idx, shared_storage.tensors.mainloop, params.mainloop);
          collective_mainloop.mma_tail(mainloop_pipeline, mainloop_pipe_consumer_state, work_k_tile_count);
          mainloop_pipe_consumer_state.advance(work_k_tile_count);
        }
        int consumer_warp_group_idx = cutlass::canonical_warp_group_idx() - NumLoadWarpGroups;
        TileScheduler::fixup(params.scheduler, work_tile_info, accumulators, NumMmaWarpGroups, consumer_warp_group_idx);
        if (TileScheduler::compute_epilogue(work_tile_info, params.scheduler)) {
          auto [epi_load_pipe_consumer_state_next, epi_store_pipe_producer_state_next] = collective_epilogue.store(
              epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline, epi_store_pipe_producer_state,
              problem_shape_MNKL, blk_shape, blk_coord, accumulators, tiled_mma, mma_thread_idx,
              shared_storage.tensors.epilogue, work_tile_info.reduction_subtile_idx());
          epi_load_pipe_consumer_state = epi_load_pipe_consumer_state_next;
          epi_store_pipe_producer_state = epi_store_pipe_producer_state_next;
          do_store_tail = true;
        }
        auto [next_work_tile_info, increment_pipe] =
            scheduler.fetch_next_work(work_tile_info, scheduler_pipeline, scheduler_pipe_consumer_state);
        work_tile_info = next_work_tile_info;
      }
      if (do_store_tail) {
        collective_epilogue.store_tail(epi_load_pipeline, epi_load_pipe_consumer_state, epi_store_pipeline,
                                       epi_store_pipe_producer_state);
      }
    }
#endif
  }
};
}  // namespace epifuse_pc

#ifndef EPIFUSE_PC_STAGES
#define EPIFUSE_PC_STAGES 3  // bf16 mainloop stages (48 KiB each)
#endif
#ifndef EPIFUSE_PC_SLOTS
#define EPIFUSE_PC_SLOTS 2   // fp32 A staging slots (32 KiB each)
#endif
// Converter warps of the multi-converter variant ("producer_conv_w<W>", run next to the W = 1
// "producer_conv"): 2 (warps 2, 3) or 3 (warps 1, 2, 3); 1 builds only the single-warp variant.
#ifndef EPIFUSE_PC_WARPS
#define EPIFUSE_PC_WARPS 3
#endif
static_assert(EPIFUSE_PC_WARPS >= 1 && EPIFUSE_PC_WARPS <= 3, "EPIFUSE_PC_WARPS: 1, 2 or 3");
template <int kStages_ = EPIFUSE_PC_STAGES, int kSlots_ = EPIFUSE_PC_SLOTS, int kWarps_ = 1,
          class TileShape_ = Shape<_128, _256, _64>, class ClusterShape_ = Shape<_2, _1, _1>>
struct ProducerConvGemm {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using ElementA = float;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = cutlass::bfloat16_t;
  using PlainCfg = Bf16OutGemm<cutlass::bfloat16_t, TileShape, ClusterShape>;
  using Ref = typename PlainCfg::CollectiveMainloop;  // the plain SS mainloop: atoms, TiledMma, TMA ops
  using CollectiveEpilogue = typename PlainCfg::CollectiveEpilogue;
  using CollectiveMainloop = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::collective::MainloopSm90TmaGmmaProducerConvertA<kStages_, kSlots_, ClusterShape, kWarps_>,
      TileShape, float, typename Ref::StrideA, cutlass::bfloat16_t, typename Ref::StrideB,
      typename Ref::TiledMma, typename Ref::GmemTiledCopyA, typename Ref::SmemLayoutAtomA, void,
      cute::identity, typename Ref::GmemTiledCopyB, typename Ref::SmemLayoutAtomB, void, cute::identity>;
  using StockKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                           CollectiveEpilogue,
                                                           cutlass::gemm::PersistentScheduler>;
  // W = 1: CUTLASS's cooperative kernel as it comes (converter = its MainloopAux warp 3);
  // W > 1: the same kernel with the producer warpgroup reassigned (epifuse_pc::MultiConverterKernel).
  using Kernel = std::conditional_t<kWarps_ == 1, StockKernel, epifuse_pc::MultiConverterKernel<StockKernel>>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kStages = kStages_;
  static constexpr int kSlots = kSlots_;
  static constexpr int kWarps = kWarps_;  static_assert(Kernel::SharedStorageSize <= 232448, "over the 227 KiB of shared memory per block");
};
using ProducerConv = ProducerConvGemm<>;  // (p): 1 converter warp (warp 3), stock kernel
#if EPIFUSE_PC_WARPS > 1
using ProducerConvMulti = ProducerConvGemm<EPIFUSE_PC_STAGES, EPIFUSE_PC_SLOTS, EPIFUSE_PC_WARPS>;  // (pW)
#endif

// One GEMM, initialized once (initialize() sets the smem attribute; timed calls only launch).
template <class Cfg>
struct Runner {
  typename Cfg::Gemm gemm;
  void* workspace = nullptr;
  bool ok = false;
  const char* name;
  explicit Runner(const char* n) : name(n) {}

  void init(const void* A, const void* B, void* D, int M, int N, int K, int device, int sms) {
    using Kn = typename Cfg::Kernel;
    auto sa = cutlass::make_cute_packed_stride(typename Kn::StrideA{}, make_shape(M, K, 1));
    auto sb = cutlass::make_cute_packed_stride(typename Kn::StrideB{}, make_shape(N, K, 1));
    auto sd = cutlass::make_cute_packed_stride(typename Kn::StrideD{}, make_shape(M, N, 1));
    typename Cfg::Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<typename Cfg::ElementA const*>(A), sa,
         static_cast<typename Cfg::ElementB const*>(B), sb},
        {{}, nullptr, typename Kn::StrideC{}, static_cast<typename Cfg::ElementD*>(D), sd},
        cutlass::KernelHardwareInfo{device, sms}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    cutlass::Status st = Cfg::Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess) {
      printf("%-15s cannot run: can_implement: %s\n", name, cutlassGetStatusString(st));
      return;
    }
    const size_t ws = Cfg::Gemm::get_workspace_size(args);
    if (ws) CK(cudaMalloc(&workspace, ws));
    st = gemm.initialize(args, workspace);
    if (st != cutlass::Status::kSuccess) {
      printf("%-15s cannot run: initialize: %s (%s)\n", name, cutlassGetStatusString(st),
             cudaGetErrorString(cudaGetLastError()));
      return;
    }
    ok = true;
    printf("%-15s tile %dx%dx%d, cluster %dx%dx%d, cooperative persistent, %d stages, %d B smem\n",
           name, int(size<0>(typename Cfg::TileShape{})), int(size<1>(typename Cfg::TileShape{})),
           int(size<2>(typename Cfg::TileShape{})), int(size<0>(typename Cfg::ClusterShape{})),
           int(size<1>(typename Cfg::ClusterShape{})), int(size<2>(typename Cfg::ClusterShape{})),
           Cfg::kStages, int(Cfg::Kernel::SharedStorageSize));
  }
  void run(cudaStream_t s) {
    cutlass::Status st = gemm.run(s);
    if (st != cutlass::Status::kSuccess) {
      fprintf(stderr, "%s: run failed: %s (%s)\n", name, cutlassGetStatusString(st),
              cudaGetErrorString(cudaGetLastError()));
      exit(1);
    }
  }
};

// ---- fills, casts, checks -------------------------------------------------------------------

__global__ void fill_bf16(int64_t n, __nv_bfloat16* p, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16_rn(uniform(i, seed));
}

// How the fp32 is rounded to tf32 before the bf16 rounding: not at all (the real cast), or as the
// TMA's TFLOAT32 type might (round to nearest even / ties away / truncation at 10 mantissa bits).
enum Pre { kDirect, kTf32Rne, kTf32Rna, kTf32Rz };
template <int kPre>
__device__ __forceinline__ float pre_round(float x) {
  if constexpr (kPre == kDirect) {
    return x;
  } else {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return x;  // inf, nan
    if constexpr (kPre == kTf32Rne) u += 0xfffu + ((u >> 13) & 1u);
    if constexpr (kPre == kTf32Rna) u += 0x1000u;
    return __uint_as_float(u & 0xffffe000u);
  }
}
__device__ __forceinline__ uint4 cast8(float4 a, float4 b) {
  __nv_bfloat162 h[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                         __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
  uint4 o;
  memcpy(&o, h, sizeof(o));
  return o;
}
// (c): fp32 -> bf16, 8 elements (two 16-byte loads, one 16-byte store) per thread and step, two
// steps in flight. n8 = elements / 8.
template <int kPre>
__global__ void __launch_bounds__(256) cast_bf16(int64_t n8, const float4* __restrict__ in,
                                                 uint4* __restrict__ out) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  auto pr = [](float4 v) {
    return make_float4(pre_round<kPre>(v.x), pre_round<kPre>(v.y), pre_round<kPre>(v.z), pre_round<kPre>(v.w));
  };
  for (; i + stride < n8; i += 2 * stride) {
    const float4 a0 = in[2 * i], a1 = in[2 * i + 1];
    const float4 b0 = in[2 * (i + stride)], b1 = in[2 * (i + stride) + 1];
    out[i] = cast8(pr(a0), pr(a1));
    out[i + stride] = cast8(pr(b0), pr(b1));
  }
  for (; i < n8; i += stride) out[i] = cast8(pr(in[2 * i]), pr(in[2 * i + 1]));
}

// Over all elements: max |d - ref|, max |ref| (as float bits: non-negative floats order as ints)
// and the number of elements whose bits differ.
__global__ void compare(int64_t n, const __nv_bfloat16* d, const __nv_bfloat16* ref, unsigned* stats,
                        unsigned long long* ndiff) {
  float md = 0.f, mr = 0.f;
  unsigned long long c = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float a = __bfloat162float(d[i]), b = __bfloat162float(ref[i]);
    md = fmaxf(md, fabsf(a - b));
    mr = fmaxf(mr, fabsf(b));
    c += __bfloat16_as_ushort(d[i]) != __bfloat16_as_ushort(ref[i]);
  }
  for (int o = 16; o; o >>= 1) {
    md = fmaxf(md, __shfl_xor_sync(~0u, md, o));
    mr = fmaxf(mr, __shfl_xor_sync(~0u, mr, o));
    c += __shfl_xor_sync(~0u, c, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(stats, __float_as_uint(md));
    atomicMax(stats + 1, __float_as_uint(mr));
    atomicAdd(ndiff, c);
  }
}

// The plain GEMM itself against an fp64 dot product at sampled (m, n): max |D - exact| / max |exact|.
__global__ void sample_check(int samples, int M, int N, int K, const __nv_bfloat16* A, const __nv_bfloat16* B,
                             const __nv_bfloat16* D, float* out) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= samples) return;
  const int m = int((uniform(s, 11) * 0.5f + 0.5f) * M) % M, n = int((uniform(s, 12) * 0.5f + 0.5f) * N) % N;
  double acc = 0;
  for (int k = 0; k < K; ++k)
    acc += double(__bfloat162float(A[int64_t(m) * K + k])) * double(__bfloat162float(B[int64_t(n) * K + k]));
  out[2 * s] = float(fabs(double(__bfloat162float(D[int64_t(m) * N + n])) - acc));
  out[2 * s + 1] = float(fabs(acc));
}

int main(int argc, char** argv) {
  int M = 16384, N = 4096, K = 4096;
  if (argc == 4) { M = atoi(argv[1]); N = atoi(argv[2]); K = atoi(argv[3]); }
  else if (argc != 1) { fprintf(stderr, "usage: %s [M N K]\n", argv[0]); return 2; }
  if (M <= 0 || N <= 0 || K <= 0 || K % 8 || N % 8) {
    fprintf(stderr, "need positive M, N, K with K and N multiples of 8 (16-byte TMA rows)\n");
    return 2;
  }
  int device, sms;
  CK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  sms = prop.multiProcessorCount;
  printf("%s, %d SMs; D[%d,%d] = A[%d,%d] . B[%d,%d]^T\n", prop.name, sms, M, N, M, K, N, K);
  if (prop.major != 9) { fprintf(stderr, "needs an sm_90 (Hopper) GPU\n"); return 1; }

  const int64_t nA = int64_t(M) * K, nB = int64_t(N) * K, nD = int64_t(M) * N;
  const size_t flush_bytes = size_t(256) << 20;
  float* A32; __nv_bfloat16 *A16, *B, *Dconv, *Dtf32, *Dref, *Dconv22, *Dplain22; void* flush;
  CK(cudaMalloc(&A32, nA * 4)); CK(cudaMalloc(&A16, nA * 2)); CK(cudaMalloc(&B, nB * 2));
  CK(cudaMalloc(&Dconv, nD * 2)); CK(cudaMalloc(&Dtf32, nD * 2)); CK(cudaMalloc(&Dref, nD * 2));
  CK(cudaMalloc(&Dconv22, nD * 2)); CK(cudaMalloc(&Dplain22, nD * 2));
  __nv_bfloat16 *Dpc, *Dpcw;
  CK(cudaMalloc(&Dpc, nD * 2));
  CK(cudaMalloc(&Dpcw, nD * 2));
  CK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  fill_f32<<<sms * 8, 256, 0, s>>>(nA, A32, 1);
  fill_bf16<<<sms * 8, 256, 0, s>>>(nB, B, 2);
  CK(cudaGetLastError());

  const int cast_blocks = sms * 8;
  auto cast = [&](auto pre) {
    cast_bf16<decltype(pre)::value><<<cast_blocks, 256, 0, s>>>(nA / 8, reinterpret_cast<const float4*>(A32),
                                                                 reinterpret_cast<uint4*>(A16));
  };
  using Direct = std::integral_constant<int, kDirect>;

  Runner<Converted> conv("converted");
  Runner<ConvertedTf32> conv_tf32("converted_tf32");
  Runner<Plain> plain("plain_bf16");
  Runner<Converted2x2> conv22("converted_2x2");
  Runner<Plain2x2> plain22("plain_bf16_2x2");
  conv.init(A32, B, Dconv, M, N, K, device, sms);
  conv_tf32.init(A32, B, Dtf32, M, N, K, device, sms);
  plain.init(A16, B, Dref, M, N, K, device, sms);
  conv22.init(A32, B, Dconv22, M, N, K, device, sms);
  plain22.init(A16, B, Dplain22, M, N, K, device, sms);
  // (p) and (pW) are hand-synchronized: each runs once, alone, first, and the program gives up
  // (without waiting on the GPU) if it has not finished within 2 s, rather than hang.
  auto guarded_first_run = [&](auto& r) {
    CK(cudaStreamSynchronize(s));
    cudaEvent_t done;
    CK(cudaEventCreate(&done));
    r.run(s);
    CK(cudaEventRecord(done, s));
    const auto t0 = std::chrono::steady_clock::now();
    cudaError_t q;
    while ((q = cudaEventQuery(done)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(2)) {
        fprintf(stderr, "%s did not finish within 2 s (hang?): aborting\n", r.name);
        fflush(stdout); fflush(stderr);
        _exit(3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    CK(q);
    CK(cudaEventDestroy(done));
    printf("%s: first run finished\n", r.name);
  };
  Runner<ProducerConv> pconv("producer_conv");
  pconv.init(A32, B, Dpc, M, N, K, device, sms);
  if (pconv.ok) {
    printf("producer_conv: W=%d converter warp (3), %d fp32 A staging slots of %d B, stock cooperative kernel\n",
           ProducerConv::kWarps, ProducerConv::kSlots, int(ProducerConv::CollectiveMainloop::TmaTransactionBytesMK));
    guarded_first_run(pconv);
  }
#if EPIFUSE_PC_WARPS > 1
  char pcw_name[32];
  snprintf(pcw_name, sizeof(pcw_name), "producer_conv_w%d", EPIFUSE_PC_WARPS);
  Runner<ProducerConvMulti> pconvw(pcw_name);
  pconvw.init(A32, B, Dpcw, M, N, K, device, sms);
  if (pconvw.ok) {
    printf("%s: W=%d converter warps (%s), %d fp32 A staging slots of %d B, full barrier %d arrivals "
           "+ B bytes, staging empty %d arrivals\n",
           pconvw.name, ProducerConvMulti::kWarps, ProducerConvMulti::kWarps == 3 ? "1, 2, 3: 5/5/6 row atoms" : "2, 3",
           ProducerConvMulti::kSlots, int(ProducerConvMulti::CollectiveMainloop::TmaTransactionBytesMK),
           ProducerConvMulti::CollectiveMainloop::NumProducerThreadEvents, ProducerConvMulti::kWarps);
    guarded_first_run(pconvw);
  }
#endif
  if (!plain.ok) { fprintf(stderr, "the plain bf16 GEMM (the reference) cannot run\n"); return 1; }

  // ---- correctness: each converted GEMM against the plain GEMM on A rounded four ways ----
  if (conv.ok) conv.run(s);
  if (conv_tf32.ok) conv_tf32.run(s);
  if (conv22.ok) conv22.run(s);
  unsigned* stats; unsigned long long* ndiff; float* samp;
  const int kSamples = 256;
  CK(cudaMalloc(&stats, 8)); CK(cudaMalloc(&ndiff, 8)); CK(cudaMalloc(&samp, kSamples * 8));
  auto cmp = [&](const __nv_bfloat16* d, const char* name, const char* ref) {
    CK(cudaMemsetAsync(stats, 0, 8, s)); CK(cudaMemsetAsync(ndiff, 0, 8, s));
    compare<<<sms * 8, 256, 0, s>>>(nD, d, Dref, stats, ndiff);
    unsigned h[2]; unsigned long long c;
    CK(cudaMemcpyAsync(h, stats, 8, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(&c, ndiff, 8, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    float md, mr; memcpy(&md, &h[0], 4); memcpy(&mr, &h[1], 4);
    printf("  %-15s vs plain on A %-26s max|diff|/max|ref| %.3e, %llu differ (%.4f%%)\n", name, ref,
           mr > 0 ? md / mr : md, c, 100.0 * c / nD);
  };
  printf("\ncorrectness over all %lld elements of D (converted, producer_conv and the 2x2 kernels should match\n"
         "the direct cast exactly: same bf16 A, same wgmma order; a tf32 row that converted_tf32\n"
         "matches exactly says what its TMA did to A)\n", (long long)nD);
  const char* pre_names[] = {"cast directly (torch)", "rounded to tf32 RNE first", "rounded to tf32 RNA first",
                             "truncated to tf32 first"};
  for (int p = 0; p < 4; ++p) {
    if (p == 0) cast(Direct{});
    if (p == 1) cast(std::integral_constant<int, kTf32Rne>{});
    if (p == 2) cast(std::integral_constant<int, kTf32Rna>{});
    if (p == 3) cast(std::integral_constant<int, kTf32Rz>{});
    CK(cudaGetLastError());
    plain.run(s);
    if (p == 0) {  // the reference itself, at sampled points, against fp64
      sample_check<<<(kSamples + 127) / 128, 128, 0, s>>>(kSamples, M, N, K, A16, B, Dref, samp);
      float h[2 * kSamples];
      CK(cudaMemcpyAsync(h, samp, sizeof(h), cudaMemcpyDeviceToHost, s));
      CK(cudaStreamSynchronize(s));
      float me = 0, mx = 0;
      for (int i = 0; i < kSamples; ++i) { me = std::max(me, h[2 * i]); mx = std::max(mx, h[2 * i + 1]); }
      printf("  plain_bf16 vs fp64 at %d samples: max|err|/max|exact| %.3e (%s; bf16 output rounding ~4e-3)\n",
             kSamples, mx > 0 ? me / mx : me, mx > 0 && me / mx < 1e-2 ? "ok" : "WRONG");
      if (conv.ok) cmp(Dconv, conv.name, pre_names[p]);
      if (conv22.ok) cmp(Dconv22, conv22.name, pre_names[p]);
      if (plain22.ok) { plain22.run(s); cmp(Dplain22, plain22.name, pre_names[p]); }
      if (pconv.ok) cmp(Dpc, pconv.name, pre_names[p]);
#if EPIFUSE_PC_WARPS > 1
      if (pconvw.ok) cmp(Dpcw, pconvw.name, pre_names[p]);
#endif
    }
    if (conv_tf32.ok) cmp(Dtf32, conv_tf32.name, pre_names[p]);
  }
  cast(Direct{});  // A16 back to the real cast
  CK(cudaStreamSynchronize(s));

  // ---- timing ----
  const double flop = 2.0 * M * N * K;
  printf("\ntiming: best of 20 after 3 warm-ups, L2 flushed before each (ms, TFLOP/s)\n");
  const float t_cast = best_ms(s, flush, flush_bytes, [&] { cast(Direct{}); });
  printf("  (c)   cast fp32->bf16       %8.4f ms  %7.1f GB/s (%lld B read + written)\n", t_cast,
         nA * 6.0 / t_cast * 1e-6, (long long)(nA * 6));
  const float t_plain = best_ms(s, flush, flush_bytes, [&] { plain.run(s); });
  printf("  (b)   plain_bf16 GEMM       %8.4f ms  %7.1f TFLOP/s\n", t_plain, flop / t_plain * 1e-9);
  const float t_both = best_ms(s, flush, flush_bytes, [&] { cast(Direct{}); plain.run(s); });
  printf("  (c+b) cast, then plain      %8.4f ms  %7.1f TFLOP/s\n", t_both, flop / t_both * 1e-9);
  auto time_gemm = [&](auto& r, const char* tag) {
    if (!r.ok) return;
    const float t = best_ms(s, flush, flush_bytes, [&] { r.run(s); });
    printf("  %-5s %-21s %8.4f ms  %7.1f TFLOP/s  (%.3fx plain, %.3fx cast+plain)\n", tag, r.name, t,
           flop / t * 1e-9, t / t_plain, t / t_both);
  };
  time_gemm(conv, "(a)");
  time_gemm(conv_tf32, "(a')");
  time_gemm(plain22, "(b22)");
  time_gemm(conv22, "(a22)");
  time_gemm(pconv, "(p)");
#if EPIFUSE_PC_WARPS > 1
  time_gemm(pconvw, "(pW)");
#endif
  CK(cudaDeviceSynchronize());
  return 0;
}
