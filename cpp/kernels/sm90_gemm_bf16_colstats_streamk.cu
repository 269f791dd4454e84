// Instantiates the bf16 Hopper GEMM for training, transposed and stream-K (grids of fewer tiles than
// SMs), with the column-statistics epilogue (ColumnStatisticsTransposed in epilogues.hpp).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Bf16WideTransposedSK)
}  // namespace epifuse::sm90
