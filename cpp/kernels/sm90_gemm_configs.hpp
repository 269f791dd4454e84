// The Hopper GEMM configurations epifuse compiles, one line each. Which one a problem runs is
// decided in gemm_dispatch.cu (the only place with shape heuristics).
//
// Tile choice:
//  - Affine epilogue (eval): 128x256 tiles, the widest that two consumer warpgroups hold in
//    registers (128 fp32 accumulators per thread); measured 0.33 ms (414 TFLOP/s) for TF32 on
//    problem 84's 1024x8192x8192 on an H200.
//  - Column-statistics epilogue (training): 128x128 tiles. Each thread keeps one fp64 running sum
//    and one fp64 sum of squares per column it touches (tileN/4 columns), so 128x256 would need
//    256 more registers per thread; 128x128 needs 128, next to 64 accumulators.
//  - K-tile: 128 bytes of K per stage (32 fp32 or 64 16-bit elements), the 128B-swizzle width.
//  - Cluster 2x1: CTA pairs along M share each w tile through TMA multicast.
//  - Stream-K variants for problems with fewer output tiles than SMs (small M): the K loop is
//    split across CTAs so the whole GPU streams the weight.
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cute/tensor.hpp"

#include "sm90_gemm.cuh"

namespace epifuse::sm90 {

using cutlass::gemm::PersistentScheduler;
using cutlass::gemm::StreamKScheduler;
using Cluster2x1 = Shape<_2, _1, _1>;

// <dtype><Wide|Square>: data-parallel persistent; ...SK: stream-K for grids of fewer tiles than SMs.
using Tf32Wide = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, PersistentScheduler>;
using Tf32WideSK = TileConfig<float, Shape<_128, _256, _32>, Cluster2x1, StreamKScheduler>;
using Tf32Square = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, PersistentScheduler>;
using Tf32SquareSK = TileConfig<float, Shape<_128, _128, _32>, Cluster2x1, StreamKScheduler>;
using Bf16Wide = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Bf16WideSK = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Bf16Square = TileConfig<cutlass::bfloat16_t, Shape<_128, _128, _64>, Cluster2x1, PersistentScheduler>;
using Bf16SquareSK = TileConfig<cutlass::bfloat16_t, Shape<_128, _128, _64>, Cluster2x1, StreamKScheduler>;
using Fp16Wide = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, PersistentScheduler>;
using Fp16WideSK = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Cluster2x1, StreamKScheduler>;
using Fp16Square = TileConfig<cutlass::half_t, Shape<_128, _128, _64>, Cluster2x1, PersistentScheduler>;
using Fp16SquareSK = TileConfig<cutlass::half_t, Shape<_128, _128, _64>, Cluster2x1, StreamKScheduler>;

// Instantiated in sm90_gemm_<dtype>_<epilogue>.cu.
#define EPIFUSE_SM90_EXTERN(Config)                                                               \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&, int, int);                 \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                          int, cudaStream_t);                                     \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int, int);           \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,      \
                                                void*, int, int, cudaStream_t);

EPIFUSE_SM90_EXTERN(Tf32Wide)
EPIFUSE_SM90_EXTERN(Tf32WideSK)
EPIFUSE_SM90_EXTERN(Tf32Square)
EPIFUSE_SM90_EXTERN(Tf32SquareSK)
EPIFUSE_SM90_EXTERN(Bf16Wide)
EPIFUSE_SM90_EXTERN(Bf16WideSK)
EPIFUSE_SM90_EXTERN(Bf16Square)
EPIFUSE_SM90_EXTERN(Bf16SquareSK)
EPIFUSE_SM90_EXTERN(Fp16Wide)
EPIFUSE_SM90_EXTERN(Fp16WideSK)
EPIFUSE_SM90_EXTERN(Fp16Square)
EPIFUSE_SM90_EXTERN(Fp16SquareSK)
#undef EPIFUSE_SM90_EXTERN

}  // namespace epifuse::sm90
