// The building blocks of the sm80 GEMM configurations. The configurations themselves (which mode
// and epilogue get compiled) are rows of generate_kernels.py, which writes sm80_gemm_kernels.hpp
// and the sm80_gemm_*.cu instantiations at build time; which one a problem runs is decided in
// gemm_plan.cu (the only place with shape heuristics).
//
// Tile choice: 128x128 CTA tiles of four 64x64 warps, the shape CUTLASS's profiler ranks first for
// large fp32 / 16-bit GEMMs on A100; three cp.async stages of a 32 fp32 (or 64 16-bit) K-slice, i.e.
// 96 KiB of shared memory, which also fits the 99 KiB per-CTA limit of sm_86 / sm_89 parts.
// One schedule (stream-K) for all shapes: CUTLASS's stream-K swizzle runs data-parallel tiles when
// they fill the GPU and splits K over the remainder when they do not.
#pragma once

#include <type_traits>

#include "cutlass/bfloat16.h"
#include "cutlass/half.h"

#include "sm80_gemm.cuh"

namespace epifuse::sm80 {

using cutlass::gemm::GemmShape;

// A row of the generated kernel table (sm80_gemm_kernels.hpp): what the dispatcher plans with.
struct KernelInfo {
  DType dtype;
  MathMode math;
  Epilogue epilogue;
  const char* name;
};

// The epilogue as a type, so that a configuration is only ever paired with an epilogue it is
// instantiated for.
template <Epilogue E>
using EpilogueTag = std::integral_constant<Epilogue, E>;

// Instantiated in the generated sm80_gemm_<mode>_<epilogue>.cu.
#define EPIFUSE_SM80_EXTERN_AFFINE(Config)                                                    \
  extern template size_t affine_workspace_bytes<Config>(const GemmProblem&);                  \
  extern template void run_affine<Config>(const GemmProblem&, const EpilogueOperands&, void*, \
                                          cudaStream_t);
#define EPIFUSE_SM80_EXTERN_COLUMN_STATS(Config)                                              \
  extern template size_t column_stats_workspace_bytes<Config>(const GemmProblem&);            \
  extern template void run_column_stats<Config>(const GemmProblem&, const EpilogueOperands&,  \
                                                void*, cudaStream_t);

}  // namespace epifuse::sm80
