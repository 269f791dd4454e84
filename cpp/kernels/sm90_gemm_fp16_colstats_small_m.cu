// Instantiates the fp16 Hopper GEMM for small batches (transposed, stream-K; see small_batch in
// gemm_dispatch.cu) with the column-statistics epilogue (ColumnStatisticsTransposed).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Fp16SmallM)
}  // namespace epifuse::sm90
