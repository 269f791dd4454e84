// Building blocks of the portable (non-TMA) GEMM path; see fallback_gemm.cu and column_stats.cu.
#pragma once

#include "epifuse/kernels.h"

namespace epifuse::fallback {

// z = x . W^T into p.out (p.dtype), FFMA with fp32 accumulation, any shape and alignment.
void gemm(const GemmProblem& p, cudaStream_t stream);

// colsum[n] = sum_m z[m, n], colsumsq[n] = sum_m z[m, n]^2 in fp64, deterministic.
void column_stats(DType dtype, int64_t M, int64_t N, const void* z, int64_t ld, double* colsum,
                  double* colsumsq, cudaStream_t stream);

}  // namespace epifuse::fallback
