// Instantiates the 3xTF32 Hopper GEMM (fp32 accuracy, sm90_mainloop_3xtf32.hpp) for training, transposed and stream-K (grids of fewer tiles than
// SMs), with the column-statistics epilogue (ColumnStatisticsTransposed in epilogues.hpp).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Split3xTf32WideTransposedSK)
}  // namespace epifuse::sm90
