// The fp16 product's plan and launch (Fp16ProductPlan, kernels.h): the backward's dX / dW under
// fp16 autocast run on the Hopper GEMM whose epilogue applies fp16's overflow
// (sm90_fp16_product.cu) where the build, the device and TMA's alignment allow it; otherwise the
// op layer runs cuBLAS's fp32 product, then fp16_overflow_ over it.
#include <stdexcept>

#include "cuda_utils.cuh"
#include "debug_switches.hpp"

namespace epifuse {

// EPIFUSE_FP16_PRODUCT=0 (DebugSwitches::fp16_product) keeps the fp16 products on cuBLAS +
// fp16_overflow_ (to measure the Hopper kernel against them).
Fp16ProductPlan plan_fp16_product(const Fp16Product& p, int device, int cc_major, int cc_minor) {
  Fp16ProductPlan plan;
  plan.device = device;
#if EPIFUSE_HAVE_SM90
  if (cc_major == 9 && cc_minor == 0 && debug_switches().fp16_product && is_aligned16(p.a) &&
      is_aligned16(p.b) && is_aligned16(p.out)) {
    plan.sm_count = sm_count(device);
    plan.hopper = sm90::fp16_product_can_implement(p, device, plan.sm_count);
    if (plan.hopper) plan.workspace_bytes = sm90::fp16_product_workspace_bytes(p, device, plan.sm_count);
  }
#else
  (void)p, (void)cc_major, (void)cc_minor;
#endif
  return plan;
}

void run_fp16_product(const Fp16ProductPlan& plan, const Fp16Product& p, void* workspace,
                      cudaStream_t stream) {
#if EPIFUSE_HAVE_SM90
  if (plan.hopper) {
    sm90::run_fp16_product(p, workspace, plan.device, plan.sm_count, stream);
    return;
  }
#endif
  (void)p, (void)workspace, (void)stream;
  throw std::logic_error("epifuse: run_fp16_product without a Hopper plan");
}

}  // namespace epifuse
