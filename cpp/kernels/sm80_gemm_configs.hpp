// The sm80 GEMM configurations epifuse compiles, one line each. Which one a problem runs is decided
// in gemm_dispatch.cu (the only place with shape heuristics).
//
// Tile choice: 128x128 CTA tiles of four 64x64 warps, the shape CUTLASS's profiler ranks first for
// large fp32 / 16-bit GEMMs on A100; three cp.async stages of a 32 fp32 (or 64 16-bit) K-slice, i.e.
// 96 KiB of shared memory, which also fits the 99 KiB per-CTA limit of sm_86 / sm_89 parts.
// One schedule (stream-K) for all shapes: CUTLASS's stream-K swizzle runs data-parallel tiles when
// they fill the GPU and splits K over the remainder when they do not.
#pragma once

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"

#include "sm80_gemm.cuh"

namespace epifuse::sm80 {

using cutlass::gemm::GemmShape;

using Tf32 = TileConfig<float, GemmShape<128, 128, 32>, GemmShape<64, 64, 32>, GemmShape<16, 8, 8>,
                        3, cutlass::arch::OpMultiplyAdd>;
using Fast3xTf32 = TileConfig<float, GemmShape<128, 128, 32>, GemmShape<64, 64, 32>,
                              GemmShape<16, 8, 8>, 3, cutlass::arch::OpMultiplyAddFastF32>;
using Bf16 = TileConfig<cutlass::bfloat16_t, GemmShape<128, 128, 64>, GemmShape<64, 64, 64>,
                        GemmShape<16, 8, 16>, 3, cutlass::arch::OpMultiplyAdd>;
using Fp16 = TileConfig<cutlass::half_t, GemmShape<128, 128, 64>, GemmShape<64, 64, 64>,
                        GemmShape<16, 8, 16>, 3, cutlass::arch::OpMultiplyAdd>;

// Instantiated in sm80_gemm_<mode>_<epilogue>.cu.
#define EPIFUSE_SM80_EXTERN(Config)                                                           \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&);                  \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, \
                                          cudaStream_t);                                      \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&);            \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,  \
                                                void*, cudaStream_t);

EPIFUSE_SM80_EXTERN(Tf32)
EPIFUSE_SM80_EXTERN(Fast3xTf32)
EPIFUSE_SM80_EXTERN(Bf16)
EPIFUSE_SM80_EXTERN(Fp16)
#undef EPIFUSE_SM80_EXTERN

}  // namespace epifuse::sm80
