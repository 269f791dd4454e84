// Instantiates the 3xTF32 Hopper GEMM (fp32 accuracy, sm90_mainloop_3xtf32.hpp) for training: transposed (z^T = w . x^T, 128x128 tiles), with the
// column-statistics epilogue (ColumnStatisticsTransposed in epilogues.hpp).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Split3xTf32WideTransposed)
}  // namespace epifuse::sm90
