// Instantiates the tf32 Hopper GEMM for training: transposed (z^T = w . x^T, 128x256 tiles), with the
// column-statistics epilogue (ColumnStatisticsTransposed in epilogues.hpp).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Tf32WideTransposed)
}  // namespace epifuse::sm90
