// Instantiates the fp16 Hopper GEMM with the per-column affine epilogue, stream-K scheduled.
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_AFFINE(Fp16WideSK)
}  // namespace epifuse::sm90
