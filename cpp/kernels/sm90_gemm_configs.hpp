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
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"
#include "cute/tensor.hpp"

#include "sm90_gemm.cuh"

namespace epifuse::sm90 {

using Tf32Wide = TileConfig<float, Shape<_128, _256, _32>, Shape<_2, _1, _1>>;
using Tf32Square = TileConfig<float, Shape<_128, _128, _32>, Shape<_2, _1, _1>>;
using Bf16Wide = TileConfig<cutlass::bfloat16_t, Shape<_128, _256, _64>, Shape<_2, _1, _1>>;
using Bf16Square = TileConfig<cutlass::bfloat16_t, Shape<_128, _128, _64>, Shape<_2, _1, _1>>;
using Fp16Wide = TileConfig<cutlass::half_t, Shape<_128, _256, _64>, Shape<_2, _1, _1>>;
using Fp16Square = TileConfig<cutlass::half_t, Shape<_128, _128, _64>, Shape<_2, _1, _1>>;

// Instantiated in sm90_gemm_<dtype>_<epilogue>.cu.
#define EPIFUSE_SM90_EXTERN(Config)                                                               \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&, int);                 \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, int, \
                                          int, cudaStream_t);                                     \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&, int);           \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,      \
                                                void*, int, int, cudaStream_t);

EPIFUSE_SM90_EXTERN(Tf32Wide)
EPIFUSE_SM90_EXTERN(Tf32Square)
EPIFUSE_SM90_EXTERN(Bf16Wide)
EPIFUSE_SM90_EXTERN(Bf16Square)
EPIFUSE_SM90_EXTERN(Fp16Wide)
EPIFUSE_SM90_EXTERN(Fp16Square)
#undef EPIFUSE_SM90_EXTERN

}  // namespace epifuse::sm90
