// Instantiates the 3xTF32 Hopper GEMM (fp32 accuracy, sm90_mainloop_3xtf32.hpp) for small batches (transposed, stream-K; see small_batch in
// gemm_dispatch.cu) with the per-column affine epilogue.
#include "sm90_gemm_configs.hpp"

namespace epifuse::sm90 {
EPIFUSE_SM90_INSTANTIATE_AFFINE(Split3xTf32SmallM)
}  // namespace epifuse::sm90
