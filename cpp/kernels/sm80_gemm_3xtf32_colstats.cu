// Instantiates the 3xtf32 sm80 GEMM with the column-statistics epilogue (training mode).
#include "sm80_gemm_configs.hpp"

namespace epifuse::sm80 {
EPIFUSE_SM80_INSTANTIATE_COLUMN_STATS(Fast3xTf32)
}  // namespace epifuse::sm80
