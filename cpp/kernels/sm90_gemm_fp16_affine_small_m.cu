// Instantiates the fp16 Hopper GEMM for batches of at most 64 rows (transposed, stream-K) with the
// per-column affine epilogue.
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_AFFINE(Fp16SmallM)
}  // namespace epifuse::sm90
