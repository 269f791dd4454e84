// Instantiates the bf16 sm80 GEMM with the column-statistics epilogue (training mode).
#include "sm80_gemm_configs.hpp"

namespace epifuse::sm80 {
EPIFUSE_SM80_INSTANTIATE_COLUMN_STATS(Bf16)
}  // namespace epifuse::sm80
