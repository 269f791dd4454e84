// Instantiates the fp16 Hopper GEMM with the column-statistics epilogue (training mode).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_COLUMN_STATS(Fp16Tall)
}  // namespace epifuse::sm90
