// Instantiates the 3xTF32 Hopper GEMM (fp32 accuracy, sm90_mainloop_3xtf32.hpp) with the per-column affine epilogue (eval mode).
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_AFFINE(Split3xTf32Wide)
}  // namespace epifuse::sm90
