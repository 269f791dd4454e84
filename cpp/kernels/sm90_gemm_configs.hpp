// The Hopper GEMM configurations epifuse compiles, one line each. Which one a problem runs is
// decided in gemm_dispatch.cu (the only place with shape heuristics).
//
// Tile choice:
//  - Affine epilogue (eval): 128x256 tiles, the widest that two consumer warpgroups hold in
//    registers (128 fp32 accumulators per thread); measured 0.33 ms (414 TFLOP/s) for TF32 on
//    problem 84's 1024x8192x8192 on an H200.
//  - Column-statistics epilogue (training): 256x64 tiles. Only grids that do not fill the GPU run
//    it (stream-K); larger ones store z with the affine kernel and sum it in a separate pass,
//    which measured faster (gemm_dispatch.cu, stats_as_separate_pass). Each thread keeps an fp64 running sum
//    and sum of squares for every column it touches (tileN/4 of them, 4 registers each) next to
//    its accumulators; 128x128 tiles would need 64 + 128 registers and spill them to local memory
//    (measured: the GEMM ran at half speed), 256x64 needs 64 + 64.
//  - K-tile: 128 bytes of K per stage (32 fp32 or 64 16-bit elements), the 128B-swizzle width.
//  - Clusters: wide tiles pair CTAs along M (2x1) to multicast each w tile; tall-narrow tiles
//    pair them along N (1x2) to multicast each x tile, which they would otherwise re-read N/64 times.
//  - Stream-K variants for problems with fewer output tiles than SMs (small M): the K loop is
//    split across CTAs so the whole GPU streams the weight.
//  - SmallM (batches of M <= 384 rows, gemm_dispatch.cu): the transposed GEMM z^T = w . x^T with
//    128x64 tiles, so the weight's rows fill the wgmma tile and the batch pads to a multiple of 64
//    columns instead of 128 rows; stream-K, since few of these tiles may not fill the GPU.
//  - Measured alternatives (H200, problem 84 and 39 shapes, TF32 and bf16, one standalone binary
//    timing each configuration with this affine epilogue):
//    1x2 and 1x1 clusters, 256x128 tiles, ping-pong 128x128 and 64x256 tiles, raster order and
//    swizzle 1-8 all came within 2% of, or below, the configurations here; cuBLAS ran within 2-5%.
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cute/tensor.hpp"

#include "sm90_gemm.cuh"

namespace epifuse::sm90 {

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using Cluster2x1 = Shape<_2, _1, _1>;
using Cluster1x2 = Shape<_1, _2, _1>;

// <dtype><Wide|Tall>: data-parallel persistent; ...SK: stream-K for grids of fewer tiles than SMs.
using Tf32Wide = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, PersistentScheduler>;
using Tf32WideSK = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, StreamKScheduler>;
using Tf32Tall = TileConfig<float, Shape<_256, _64, _32>, Cluster1x2, PersistentScheduler>;
using Tf32TallSK = TileConfig<float, Shape<_256, _64, _32>, Cluster1x2, StreamKScheduler>;
using Bf16Wide = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Bf16WideSK = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Bf16Tall = TileConfig<cutlass::bfloat16_t, Shape<_256, _64, _64>, Cluster1x2, PersistentScheduler>;
using Bf16TallSK = TileConfig<cutlass::bfloat16_t, Shape<_256, _64, _64>, Cluster1x2, StreamKScheduler>;
using Fp16Wide = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Fp16WideSK = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Fp16Tall = TileConfig<cutlass::half_t, Shape<_256, _64, _64>, Cluster1x2, PersistentScheduler>;
using Fp16TallSK = TileConfig<cutlass::half_t, Shape<_256, _64, _64>, Cluster1x2, StreamKScheduler>;
using Cluster1x1 = Shape<_1, _1, _1>;
constexpr bool kTransposed = true;
using Tf32SmallM = TileConfig<float, Shape<_128, _64, _32>, Cluster1x1, StreamKScheduler, kTransposed>;
using Bf16SmallM = TileConfig<cutlass::bfloat16_t, Shape<_128, _64, _64>, Cluster1x1, StreamKScheduler, kTransposed>;
using Fp16SmallM = TileConfig<cutlass::half_t, Shape<_128, _64, _64>, Cluster1x1, StreamKScheduler, kTransposed>;

// Instantiated in sm90_gemm_<dtype>_<epilogue>.cu.
#define EPIFUSE_SM90_EXTERN_AFFINE(Config)                                                        \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&, int, int);                 \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                          int, cudaStream_t);
#define EPIFUSE_SM90_EXTERN(Config)                                                               \
  EPIFUSE_SM90_EXTERN_AFFINE(Config)                                                              \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int, int);           \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,      \
                                                void*, int, int, cudaStream_t);

EPIFUSE_SM90_EXTERN(Tf32Wide)
EPIFUSE_SM90_EXTERN(Tf32WideSK)
EPIFUSE_SM90_EXTERN(Tf32Tall)
EPIFUSE_SM90_EXTERN(Tf32TallSK)
EPIFUSE_SM90_EXTERN(Bf16Wide)
EPIFUSE_SM90_EXTERN(Bf16WideSK)
EPIFUSE_SM90_EXTERN(Bf16Tall)
EPIFUSE_SM90_EXTERN(Bf16TallSK)
EPIFUSE_SM90_EXTERN(Fp16Wide)
EPIFUSE_SM90_EXTERN(Fp16WideSK)
EPIFUSE_SM90_EXTERN(Fp16Tall)
EPIFUSE_SM90_EXTERN(Fp16TallSK)
EPIFUSE_SM90_EXTERN_AFFINE(Tf32SmallM)
EPIFUSE_SM90_EXTERN_AFFINE(Bf16SmallM)
EPIFUSE_SM90_EXTERN_AFFINE(Fp16SmallM)
#undef EPIFUSE_SM90_EXTERN
#undef EPIFUSE_SM90_EXTERN_AFFINE

}  // namespace epifuse::sm90
