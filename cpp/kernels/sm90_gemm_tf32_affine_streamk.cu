// Instantiates the tf32 Hopper GEMM with the per-column affine epilogue, stream-K scheduled.
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_AFFINE(Tf32WideSK)
}  // namespace epifuse::sm90
