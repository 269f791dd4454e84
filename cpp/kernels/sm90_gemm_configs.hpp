// The building blocks of the Hopper GEMM configurations and the schedules the dispatcher chooses
// from. The configurations themselves (which mode, epilogue and schedule get compiled) are rows of
// generate_kernels.py, which writes sm90_gemm_kernels.hpp and the sm90_gemm_*.cu instantiations at
// build time; which one a problem runs is decided in gemm_plan.cu (the only place with shape
// heuristics). The measurements behind these choices: experiments/README.md, "Kernel selection".
//
// Tile choice:
//  - 128x256 tiles ("Wide"), the widest that two consumer warpgroups hold in registers (128 fp32
//    accumulators per thread); they run TF32 at the rate of cuBLAS.
//  - Training (column statistics) runs the same tiles transposed, z^T = w . x^T ("WideTransposed"):
//    the statistics are then per-row reductions of the tile, 8 fp64 registers per thread. The
//    untransposed form keeps fp64 sums for every column a thread touches (64 columns of a 256-wide
//    tile), which forced 256x64 tiles that ran at 70% of this rate; storing z with the affine kernel
//    and summing it in a separate pass cost one more read of z.
//  - K-tile: 128 bytes of K per stage (32 fp32 or 64 16-bit elements), the 128B-swizzle width.
//  - Clusters: 2x1, pairing CTAs along M to multicast the operand tile they share.
//  - Stream-K variants ("...SK") for problems with fewer output tiles than SMs (small M): the K
//    loop is split across CTAs so the whole GPU streams the weight.
//  - SmallM (batches of M <= 384 rows, gemm_plan.cu): the transposed GEMM z^T = w . x^T with
//    128x64 tiles, so the weight's rows fill the wgmma tile and the batch pads to a multiple of 64
//    columns instead of 128 rows; stream-K, since few of these tiles may not fill the GPU.
//  - Split3x (fp32 at fp32 accuracy on FP16 wgmma, sm90_mainloop_3x.hpp, operands in the
//    split_fp16 layout): 128x128 wide tiles, since each consumer thread holds the fp32 accumulator
//    and the tensor-core accumulator (64 + 64 registers; the 128x256 tile would need 256). The
//    K-tile of 64 halves is 32 k of hi parts and their 32 lo parts.
//  - Other clusters, tiles, schedules, raster orders and swizzles measured within 2% or below.
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cute/tensor.hpp"

#include "sm90_gemm.cuh"

namespace epifuse::sm90 {

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using Cluster2x1 = Shape<_2, _1, _1>;
using Cluster1x1 = Shape<_1, _1, _1>;
constexpr bool kTransposed = true;   // z^T = w . x^T (D' stored column-major, which is z itself)
constexpr bool kSplit3x = true;      // operands in the split_fp16 layout, the 3x mainloop

// The schedules of one mode (TileConfig aliases <Mode><Schedule>, e.g. Tf32WideSK):
enum class Schedule {
  kWide,              // 128x256 tiles (3x: 128x128) over z, data-parallel persistent
  kWideSK,            // the same, stream-K: grids of fewer tiles than SMs
  kWideTransposed,    // the wide tiles over z^T (the training epilogue's reductions per tile row)
  kWideTransposedSK,  // the same, stream-K
  kSmallM,            // 128x64 tiles over z^T, stream-K: batches of M <= 384 rows
};

// A row of the generated kernel table (sm90_gemm_kernels.hpp): what the dispatcher plans with.
struct KernelInfo {
  DType dtype;
  MathMode math;
  Epilogue epilogue;
  Schedule schedule;
  int tile_m, tile_n;  // the CTA tile over the kernel's output (z, or z^T when transposed)
  const char* name;
};

// The epilogue as a type, so that a configuration is only ever paired with an epilogue it is
// instantiated for.
template <Epilogue E>
using EpilogueTag = std::integral_constant<Epilogue, E>;

// Instantiated in the generated sm90_gemm_<mode>_<epilogue>[_streamk|_small_m].cu.
#define EPIFUSE_SM90_EXTERN_AFFINE(Config)                                                        \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&, int, int);                 \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                          int, cudaStream_t);
#define EPIFUSE_SM90_EXTERN_COLUMN_STATS(Config)                                                  \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int, int);           \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,      \
                                                void*, int, int, cudaStream_t);

}  // namespace epifuse::sm90
