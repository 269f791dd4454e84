// The library's debug switches: the environment variables that force a path the GEMM heuristics
// would not take, so that tests can cover it on any machine and benchmarks can measure it against
// the default. Nothing else in cpp/ reads the environment; every reader goes through
// debug_switches(), which reads all seven once, at its first call (a thread-safe static), so a
// process sets them before its first GEMM (experiments/gemm_precision.py runs a child per setting).
//
// Unset, every switch leaves the default path. A value other than the ones named below (e.g.
// EPIFUSE_FORCE_SM80=yes, EPIFUSE_NARROW_SMALL_M=off) is the same as unset.
#pragma once

#include <cstdint>

namespace epifuse {

struct DebugSwitches {
  // EPIFUSE_FORCE_SM80=1: Hopper runs the sm80 kernels (CUTLASS 2.x, cp.async + mma.sync) instead
  // of the TMA + wgmma ones, for every mode (gemm_plan.cu, choose_kind). Exists to test the
  // sm80 kernels on a Hopper machine (tests/test_ops.py, scripts/sanitize.sh) and to measure them
  // there (experiments/gemm_precision.py). Only "1" turns it on.
  bool force_sm80 = false;

  // EPIFUSE_3X_PROMOTION=n, 1 <= n <= 1024: the Hopper 3x mainloop adds its tensor-core
  // accumulator into the fp32 registers every n K-tiles instead of the build's default
  // (sm90::kDefaultPromotionInterval, sm90_mainloop_3x.hpp, which says what each interval
  // measured); read through sm90::split3x_promotion_interval (gemm_run.cu). Exists to measure
  // accuracy against speed (experiments/gemm_precision.py --promotion). 0: unset, or not a number in 1..1024.
  uint32_t split3x_promotion_interval = 0;

  // EPIFUSE_NARROW_SMALL_M=0: Hopper problems with a narrow output (few wide tiles for the SMs)
  // keep the wide tiles with stream-K instead of the transposed 128x64 SmallM tiles
  // (gemm_plan.cu, narrow_output). Exists to measure the two against each other
  // (experiments/README.md, "Narrow outputs"). Only "0" turns the SmallM rule off.
  bool narrow_small_m = true;

  // EPIFUSE_TF32_K_MAJOR_COPIES=0: cuBLAS's TF32 products on MN-major operands (the backward's dX,
  // dW) multiply the operands as they are, without the K-major copies that pay on Hopper
  // (cublas_k_major_copies.cu). Exists to measure the copies (experiments/README.md, "K-major copies for
  // cuBLAS TF32"). Only "0" turns the copies off.
  bool tf32_k_major_copies = true;

  // EPIFUSE_FP16_PRODUCT=0: the backward's fp16 products under autocast run on cuBLAS's fp32
  // product followed by fp16_overflow_ instead of the Hopper GEMM that applies the overflow in its
  // epilogue (fp16_product_plan.cu). Exists to measure the Hopper kernel against that pair. Only
  // "0" turns the Hopper kernel off.
  bool fp16_product = true;

  // EPIFUSE_SPLIT_WIDE_TILES=0: the 3x split of a row-contiguous operand (a transposed view: the
  // backward's W^T, dZ^T, X^T) takes the general 32 x 64 tiles of single elements instead of the
  // 64 x 64 tiles of 16-byte vectors (split_fp16.cu). Exists to measure the two against each
  // other. Only "0" turns the wide tiles off.
  bool split_wide_tiles = true;

  // EPIFUSE_STEP_OPERANDS=0: the forwards of a training step make their weight's operands (3x
  // split, 16-bit cast) each for itself, instead of sharing one per weight version across the
  // step's forwards (cpp/ops/weight_split_cache.h). Exists to measure the sharing
  // (benchmarks.small_batch). Only "0" turns the sharing off.
  bool step_operands = true;

  // The switches as the process environment sets them now.
  static DebugSwitches from_environment();
};

// The switches, read from the environment once (at the first call; thread-safe).
const DebugSwitches& debug_switches();

}  // namespace epifuse
