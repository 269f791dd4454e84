// The Hopper GEMM configurations epifuse compiles, one line each. Which one a problem runs is
// decided in gemm_dispatch.cu (the only place with shape heuristics).
//
// Tile choice:
//  - 128x256 tiles, the widest that two consumer warpgroups hold in registers (128 fp32
//    accumulators per thread); measured 0.33 ms (414 TFLOP/s) for TF32 on problem 84's
//    1024x8192x8192 on an H200, the rate of cuBLAS.
//  - Training (column statistics) runs the same tiles transposed, z^T = w . x^T ("WideTransposed"):
//    the statistics are then per-row reductions of the tile, 8 fp64 registers per thread. The
//    untransposed form keeps fp64 sums for every column a thread touches (64 columns of a 256-wide
//    tile), which forced 256x64 tiles that ran at 70% of this rate (30-50% at M = 16384); storing z
//    with the affine kernel and summing it in a separate pass cost one more read of z. Measured on an
//    H200 (training forward, us, that separate pass / transposed): problem 84 TF32 373 / 353,
//    bf16 205 / 193; problem 39 TF32 1591-1613 / 1473-1550, bf16 825 / 773.
//  - K-tile: 128 bytes of K per stage (32 fp32 or 64 16-bit elements), the 128B-swizzle width.
//  - Clusters: 2x1, pairing CTAs along M to multicast the operand tile they share.
//  - Stream-K variants for problems with fewer output tiles than SMs (small M): the K loop is
//    split across CTAs so the whole GPU streams the weight.
//  - SmallM (batches of M <= 384 rows, gemm_dispatch.cu): the transposed GEMM z^T = w . x^T with
//    128x64 tiles, so the weight's rows fill the wgmma tile and the batch pads to a multiple of 64
//    columns instead of 128 rows; stream-K, since few of these tiles may not fill the GPU.
//  - Measured alternatives (H200, problem 84 and 39 shapes, TF32 and bf16, one standalone binary
//    timing each configuration with the affine epilogue):
//    1x2 and 1x1 clusters, 256x128 tiles, ping-pong 128x128 and 64x256 tiles, raster order and
//    swizzle 1-8 all came within 2% of, or below, the configurations here; cuBLAS ran within 2-5%.
//  - Open lead (H100, one benchmark run, GEMM alone at problem 39's 16384x4096x4096): Tf32Wide with
//    the affine epilogue 1.550 ms, Tf32WideTransposed with the statistics epilogue 1.461 ms, cuBLAS
//    1.367-1.551 ms; bf16 0.721 / 0.710 / 0.691-0.693 ms. When M >> N the transposed tiling is
//    ahead, so eval at such shapes may want a WideTransposed affine configuration: measure first.
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cute/tensor.hpp"

#include "sm90_gemm.cuh"

namespace epifuse::sm90 {

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using Cluster2x1 = Shape<_2, _1, _1>;

// <dtype>Wide: data-parallel persistent; ...SK: stream-K for grids of fewer tiles than SMs;
// ...Transposed: z^T = w . x^T (D' stored column-major, which is z itself).
constexpr bool kTransposed = true;
using Cluster1x1 = Shape<_1, _1, _1>;
using Tf32Wide = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, PersistentScheduler>;
using Tf32WideSK = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, StreamKScheduler>;
using Tf32WideTransposed = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, PersistentScheduler, kTransposed>;
using Tf32WideTransposedSK = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, StreamKScheduler, kTransposed>;
using Tf32SmallM = TileConfig<float, Shape<_128, _64, _32>, Cluster1x1, StreamKScheduler, kTransposed>;
using Bf16Wide = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Bf16WideSK = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Bf16WideTransposed = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler, kTransposed>;
using Bf16WideTransposedSK = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler, kTransposed>;
using Bf16SmallM = TileConfig<cutlass::bfloat16_t, Shape<_128, _64, _64>, Cluster1x1, StreamKScheduler, kTransposed>;
using Fp16Wide = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Fp16WideSK = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Fp16WideTransposed = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler, kTransposed>;
using Fp16WideTransposedSK = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler, kTransposed>;
using Fp16SmallM = TileConfig<cutlass::half_t, Shape<_128, _64, _64>, Cluster1x1, StreamKScheduler, kTransposed>;

// Split3xTf32...: fp32 at fp32 accuracy on TF32 wgmma (sm90_mainloop_3xtf32.hpp), operands in the
// split_tf32 layout. 128x128 tiles: each consumer thread holds the fp32 accumulator and the
// tensor-core accumulator (64 + 64 registers); the 128x256 tile of the TF32 kernel would need 256.
// The K-tile of 32 floats is 16 k of hi parts and their 16 lo parts.
constexpr bool kSplit3xTf32 = true;
using Split3xTf32Wide = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, PersistentScheduler, !kTransposed, kSplit3xTf32>;
using Split3xTf32WideSK = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, StreamKScheduler, !kTransposed, kSplit3xTf32>;
using Split3xTf32WideTransposed = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, PersistentScheduler, kTransposed, kSplit3xTf32>;
using Split3xTf32WideTransposedSK = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, StreamKScheduler, kTransposed, kSplit3xTf32>;
using Split3xTf32SmallM = TileConfig<float, Shape<_128, _64, _32>, Cluster1x1, StreamKScheduler, kTransposed, kSplit3xTf32>;

// Instantiated in sm90_gemm_<dtype>_<epilogue>.cu.
#define EPIFUSE_SM90_EXTERN_AFFINE(Config)                                                        \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&, int, int);                 \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                          int, cudaStream_t);
#define EPIFUSE_SM90_EXTERN_COLUMN_STATS(Config)                                                  \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int, int);           \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,      \
                                                void*, int, int, cudaStream_t);
#define EPIFUSE_SM90_EXTERN(Config)                                                               \
  EPIFUSE_SM90_EXTERN_AFFINE(Config)                                                              \
  EPIFUSE_SM90_EXTERN_COLUMN_STATS(Config)

EPIFUSE_SM90_EXTERN_AFFINE(Tf32Wide)
EPIFUSE_SM90_EXTERN_AFFINE(Tf32WideSK)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Tf32WideTransposed)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Tf32WideTransposedSK)
EPIFUSE_SM90_EXTERN(Tf32SmallM)
EPIFUSE_SM90_EXTERN_AFFINE(Bf16Wide)
EPIFUSE_SM90_EXTERN_AFFINE(Bf16WideSK)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Bf16WideTransposed)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Bf16WideTransposedSK)
EPIFUSE_SM90_EXTERN(Bf16SmallM)
EPIFUSE_SM90_EXTERN_AFFINE(Fp16Wide)
EPIFUSE_SM90_EXTERN_AFFINE(Fp16WideSK)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Fp16WideTransposed)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Fp16WideTransposedSK)
EPIFUSE_SM90_EXTERN(Fp16SmallM)
EPIFUSE_SM90_EXTERN_AFFINE(Split3xTf32Wide)
EPIFUSE_SM90_EXTERN_AFFINE(Split3xTf32WideSK)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Split3xTf32WideTransposed)
EPIFUSE_SM90_EXTERN_COLUMN_STATS(Split3xTf32WideTransposedSK)
EPIFUSE_SM90_EXTERN(Split3xTf32SmallM)
#undef EPIFUSE_SM90_EXTERN
#undef EPIFUSE_SM90_EXTERN_COLUMN_STATS
#undef EPIFUSE_SM90_EXTERN_AFFINE

}  // namespace epifuse::sm90
