// Instantiates the bf16 sm80 GEMM with the per-column affine epilogue (eval mode).
#include "sm80_gemm_configs.hpp"

namespace epifuse::sm80 {
EPIFUSE_SM80_INSTANTIATE_AFFINE(Bf16)
}  // namespace epifuse::sm80
