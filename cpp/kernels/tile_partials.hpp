// Column statistics left by a GEMM epilogue as one partial sum per output tile.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace epifuse {

// colsum[n] = sum_t partial_sum[t * stride + n], colsumsq likewise, for n < N and t < tiles:
// the partials of `tiles` tiles, each a column of `stride` >= N fp64 values. Deterministic: every
// column is added in the same fixed order on every call.
void sum_tile_partials(int64_t N, int64_t tiles, int64_t stride, const double* partial_sum,
                       const double* partial_sumsq, double* colsum, double* colsumsq,
                       cudaStream_t stream);

}  // namespace epifuse
