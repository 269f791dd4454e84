// The GEMM plan: chooses the kernel sequence for a GEMM + epilogue problem (gemm_plan -> GemmPlan,
// kernels.h) and sizes its workspace. With cublas_k_major_copies.cu (the operand copies before
// cuBLAS's TF32 products), the only place with shape heuristics: the kind of plan (choose_kind),
// then one kernel choice per architecture (sm90_kernel: tile shape and tile scheduler;
// sm80_kernel).
//
//   Hopper (sm_90), 3xTF32 math (fp32 accuracy), 16-byte aligned output rows: the operands split
//                    into row-scaled FP16 hi/lo parts (split_fp16.cu; the weight's split may come
//                    cached), then the same GEMMs with the 3x mainloop (sm90_mainloop_3x.hpp) on
//                    FP16 wgmma, 128x128 tiles, the epilogue reading the product scaled back.
//   Hopper (sm_90), TF32 or 16-bit math, 16-byte aligned rows (K, N, leading dimensions and base
//   pointers):       one CUTLASS sm90 GEMM (TMA + wgmma) with the epilogue fused (epilogues.hpp);
//                    eval as z = x . w^T, training as z^T = w . x^T (per-column statistics become
//                    per-row reductions of the tile); stream-K when the output tiles cannot fill the
//                    SMs; batches of <= 384 rows transposed with narrow tiles (small_batch).
//   sm_80 and later otherwise (A100, Ada, or Hopper when EPIFUSE_FORCE_SM80=1), same alignment:
//                    one CUTLASS 2.x GEMM (cp.async + mma.sync) with the
//                    epilogue fused (sm80_epilogues.hpp); its stream-K schedule sizes itself.
//   IEEE fp32, and the 3x mode with few rows (the GEMM is bound by reading the weight, and the split
//   would read it once more): cuBLAS's SGEMM, run by the op layer (GemmPlan::host_sgemm), then
//                    the epilogue as a separate pass.
//   Anything else (ragged alignment, or IEEE without the op layer): the portable SIMT GEMM writing
//                    z, then the epilogue as a separate pass (column_stats.cu / column_affine.cu).
//
// gemm_plan makes every one of these decisions, once per GEMM, into a GemmPlan; the workspace query
// (here) and the launch (gemm_run.cu) only read it. The kernels it picks from are the rows of the
// generated sm90_gemm_kernels.hpp / sm80_gemm_kernels.hpp (generate_kernels.py). The debug switches
// that force other paths are read through debug_switches.hpp.
#include <algorithm>
#include <climits>
#include <stdexcept>

#include "cuda_utils.cuh"
#include "debug_switches.hpp"
#include "gemm_can_implement.hpp"
#include "operand_chunks.hpp"
#include "sm80_gemm_kernels.hpp"
#include "split_fp16.hpp"
#if EPIFUSE_HAVE_SM90
#include "sm90_gemm_kernels.hpp"
#endif

namespace epifuse {
namespace {

using dispatch::output_aligned;
using dispatch::unit_stride_copies;
using dispatch::vector_aligned;

// The math a kernel row is keyed by: 16-bit inputs multiply natively whatever p.math says.
MathMode kernel_math(const GemmProblem& p) {
  return p.dtype == DType::kFloat32 ? p.math : MathMode::kNative;
}

// ---- the kind of plan ---------------------------------------------------------------------------

// Where the 3x GEMM (MathMode::k3xTF32) gives way to cuBLAS's SGEMM (both fp32-accurate); the measurements behind the
// three thresholds are in experiments/README.md, "Kernel selection":
//  - below kSplitMinRows rows the GEMM is bound by reading the weight, which the split makes a
//    second pass over; SGEMM reads it once.
//  - at small K, the 3x GEMM's error is not clearly below SGEMM's (it drops lo*lo, ~2^-22 per product,
//    while SGEMM's own error grows with K); kSplitMinK keeps a margin.
//  - below kSplitMinMacs multiply-adds the split, the row flags and the repair pass (three more
//    launches) cost more host time than SGEMM's whole run.
constexpr int64_t kSplitMinRows = 64;
constexpr int64_t kSplitMinK = 64;
constexpr double kSplitMinMacs = double(1 << 30);

bool split_pays(const GemmProblem& p) {
  return p.M >= kSplitMinRows && p.K >= kSplitMinK &&
         double(p.M) * double(p.N) * double(p.K) >= kSplitMinMacs;
}

// The kind of plan. Every kind but kEmpty and the split reads x and w through the copies
// unit_stride_copies asks for, so the alignment is that of the copies. EPIFUSE_FORCE_SM80=1
// (DebugSwitches::force_sm80) takes the sm80 kernels on Hopper too.
GemmKernelKind choose_kind(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops,
                           int cc_major, int cc_minor) {
  if (p.M == 0 || p.N == 0) return GemmKernelKind::kEmpty;
  if (cc_major < 8 || p.K == 0) return GemmKernelKind::kPortable;
  if (p.dtype == DType::kFloat32 &&
      (p.math == MathMode::kIEEE || (p.math == MathMode::k3xTF32 && !split_pays(p))))
    return GemmKernelKind::kHostSgemm;
  const bool wgmma =
      EPIFUSE_HAVE_SM90 && cc_major == 9 && cc_minor == 0 && !debug_switches().force_sm80;
  // The split copies the operands into an aligned layout, so only the output side must be aligned.
  if (wgmma && p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32 &&
      output_aligned(p, e, ops) && split_fp16_ld(p.K) <= INT_MAX)
    return GemmKernelKind::kSm90Split3x;
  if (!vector_aligned(p, e, ops, unit_stride_copies(p))) return GemmKernelKind::kPortable;
  // fp32 3xTF32 here runs the sm80 kernel: no wgmma, or a split too wide for int32 extents.
  if (p.dtype == DType::kFloat32 && p.math == MathMode::k3xTF32) return GemmKernelKind::kSm80;
  return wgmma ? GemmKernelKind::kSm90 : GemmKernelKind::kSm80;
}

// ---- Hopper: tile shape and tile scheduler ------------------------------------------------------
#if EPIFUSE_HAVE_SM90

// Stream-K pays for its partial-tile fix-up only when data-parallel tiles cannot fill the GPU:
// e.g. problem 84 at M <= 512 has at most 128 tiles of 128x256 for 132 SMs. The output is
// rows x cols (z, or z^T for a transposed kernel), cut into tile_m x tile_n tiles.
bool prefer_stream_k(int64_t rows, int64_t cols, int64_t tile_m, int64_t tile_n, int sms) {
  return ((rows + tile_m - 1) / tile_m) * ((cols + tile_n - 1) / tile_n) < sms;
}

// Batches of at most this many rows run the transposed GEMM (Schedule::kSmallM). Below 128 rows the
// 128x256 tile is mostly padding (8x the useful TF32 math at M = 16); up to a few hundred rows its
// 128 tiles or fewer leave stream-K to split the K loop into many partial tiles, where the
// transposed 128x64 tiles are more, smaller units. 384: where the two met on an H200 (experiments/README.md,
// "Kernel selection").
constexpr int64_t kSmallBatchRows = 384;

bool small_batch(const GemmProblem& p) { return p.M <= kSmallBatchRows; }

// Narrow outputs: where the wide tiles (128x256 over z or z^T) cover only a fraction of the SMs (a
// projection's 256-column last layer at a batch of 4096: 32 tiles), stream-K cuts every tile's K
// loop several ways and fixes the partial tiles up; the transposed 128x64 tiles of SmallM are four
// times as many whole tiles. Measured on an H200 (experiments/README.md, "Kernel selection"): at 32 wide
// tiles SmallM is 27-37% faster in bf16 and TF32; at 64 it is 9-17% faster in bf16 but 12-40%
// slower in TF32, so 16-bit problems switch at half the SMs and fp32 ones at a quarter.
// EPIFUSE_NARROW_SMALL_M=0 (DebugSwitches::narrow_small_m) keeps stream-K there (to measure the two).
bool narrow_output(const GemmProblem& p, int64_t wide_tiles, int sms) {
  const int64_t divisor = p.dtype == DType::kFloat32 ? 4 : 2;
  return debug_switches().narrow_small_m && divisor * wide_tiles <= sms;
}

// The row of the generated table with these keys (-1: none, a hole in generate_kernels.py's table).
int find_sm90_kernel(DType dtype, MathMode math, Epilogue e, sm90::Schedule schedule) {
  for (int i = 0; i < sm90::kKernelCount; ++i) {
    const sm90::KernelInfo& k = sm90::kKernels[i];
    if (k.dtype == dtype && k.math == math && k.epilogue == e && k.schedule == schedule) return i;
  }
  return -1;
}

// The Hopper kernel of a problem (for the split plan: of the split problem, same M and N):
//   small batches, narrow outputs: the transposed 128x64 tiles (both epilogues);
//   eval:          the wide tiles over z;
//   training:      the wide tiles over z^T (sm90_gemm_configs.hpp says why);
// each with stream-K when its tiles are fewer than the SMs.
int sm90_kernel(const GemmProblem& p, Epilogue e, int sms) {
  using sm90::Schedule;
  auto find = [&](Schedule s) { return find_sm90_kernel(p.dtype, kernel_math(p), e, s); };
  int kernel = -1;
  if (small_batch(p)) {
    kernel = find(Schedule::kSmallM);
  } else {
    // The wide tiles cover z (eval) or z^T (training): rows x cols of the kernel's output.
    const bool eval = e == Epilogue::kAffine;
    const int wide = find(eval ? Schedule::kWide : Schedule::kWideTransposed);
    if (wide < 0) throw std::logic_error("epifuse: no Hopper kernel for this mode and epilogue");
    const int64_t rows = eval ? p.M : p.N, cols = eval ? p.N : p.M;
    const int64_t tile_m = sm90::kKernels[wide].tile_m, tile_n = sm90::kKernels[wide].tile_n;
    const int64_t wide_tiles = ((rows + tile_m - 1) / tile_m) * ((cols + tile_n - 1) / tile_n);
    if (narrow_output(p, wide_tiles, sms)) {
      kernel = find(Schedule::kSmallM);
    } else if (prefer_stream_k(rows, cols, tile_m, tile_n, sms)) {
      kernel = find(eval ? Schedule::kWideSK : Schedule::kWideTransposedSK);
    } else {
      kernel = wide;
    }
  }
  if (kernel < 0) throw std::logic_error("epifuse: no Hopper kernel for this mode and epilogue");
  return kernel;
}

template <class Config, class Tag>
size_t sm90_workspace_bytes(const GemmProblem& p, int device, int sms) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    return sm90::affine_workspace_bytes<Config>(p, device, sms);
  } else {
    return sm90::column_stats_workspace_bytes<Config>(p, device, sms);
  }
}

#endif  // EPIFUSE_HAVE_SM90

// ---- sm80: one kernel per mode and epilogue -----------------------------------------------------

// The sm80 kernel of a problem: one per mode and epilogue (its stream-K schedule sizes itself).
int sm80_kernel(const GemmProblem& p, Epilogue e) {
  for (int i = 0; i < sm80::kKernelCount; ++i) {
    const sm80::KernelInfo& k = sm80::kKernels[i];
    if (k.dtype == p.dtype && k.math == kernel_math(p) && k.epilogue == e) return i;
  }
  throw std::logic_error("epifuse: no sm80 kernel for this mode and epilogue");
}

template <class Config, class Tag>
size_t sm80_workspace_bytes(const GemmProblem& p) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    return sm80::affine_workspace_bytes<Config>(p);
  } else {
    return sm80::column_stats_workspace_bytes<Config>(p);
  }
}

}  // namespace

// ---- the plan -----------------------------------------------------------------------------------

GemmPlan gemm_plan(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, int device,
                   int cc_major, int cc_minor) {
  GemmPlan plan;
  plan.M = p.M;
  plan.N = p.N;
  plan.K = p.K;
  plan.dtype = p.dtype;
  plan.math = p.math;
  plan.epilogue = e;
  plan.device = device;
  plan.kind = choose_kind(p, e, ops, cc_major, cc_minor);
  plan.host_sgemm = plan.kind == GemmKernelKind::kHostSgemm;
  plan.splits_operands = plan.kind == GemmKernelKind::kSm90Split3x;
  if (plan.kind != GemmKernelKind::kEmpty && !plan.splits_operands)
    plan.copies = unit_stride_copies(p);
  // The kernels' workspaces depend on the shape and the GPU, not on the operands' pointers or row
  // strides, so the operand copies leave them as they are.
#if EPIFUSE_HAVE_SM90
  if (plan.kind == GemmKernelKind::kSm90 || plan.splits_operands) {
    using dispatch::copy_chunk_rows;
    using dispatch::split_problem;
    plan.sm_count = sm_count(device);
    auto kernel_and_workspace = [&](const GemmProblem& gp, int& kernel) {
      kernel = sm90_kernel(gp, e, plan.sm_count);
      size_t bytes = 0;
      sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
        bytes = sm90_workspace_bytes<decltype(cfg), decltype(tag)>(gp, device, plan.sm_count);
      });
      return bytes;
    };
    if (!plan.splits_operands) {
      plan.workspace_bytes = kernel_and_workspace(p, plan.kernel);
    } else {
      // x's split in chunks of its rows (affine epilogue only), w's in chunks of its rows unless
      // the caller gives w's split; one GEMM per pair of chunks (kernel_and_workspace plans the
      // full chunk; the GEMM workspace covers the narrower last chunks on the same kernel too).
      // The budgets count the fp32 rows a chunk splits (operand_chunks.hpp says why).
      const size_t fp32_row_bytes = sizeof(float) * size_t(std::max<int64_t>(p.K, 1));
      plan.x_chunk = e == Epilogue::kAffine
                         ? copy_chunk_rows(p.M, fp32_row_bytes, dispatch::kXCopyChunkBytes)
                         : p.M;
      plan.w_chunk = copy_chunk_rows(p.N, fp32_row_bytes, dispatch::kWCopyChunkBytes);
      if (e == Epilogue::kAffine)
        dispatch::refine_split_chunks(p.M, p.N, fp32_row_bytes, plan.x_chunk, plan.w_chunk);
      const size_t x_bytes = split_fp16_bytes(plan.x_chunk, p.K) + dispatch::row_flag_bytes(p);
      auto chunks_workspace = [&](int64_t n_chunk, int& kernel) {
        GemmProblem c = p;
        c.M = plan.x_chunk;
        c.N = n_chunk;
        size_t bytes = kernel_and_workspace(split_problem(c, nullptr, nullptr), kernel);
        // The ragged last chunks' (the full chunk's is `bytes` already).
        for (const int64_t m : {plan.x_chunk, p.M % plan.x_chunk}) {
          for (const int64_t n : {n_chunk, p.N % n_chunk}) {
            if (m == 0 || n == 0 || (m == plan.x_chunk && n == n_chunk)) continue;
            c.M = m;
            c.N = n;
            sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
              bytes = std::max(bytes, sm90_workspace_bytes<decltype(cfg), decltype(tag)>(
                                          split_problem(c, nullptr, nullptr), device,
                                          plan.sm_count));
            });
          }
        }
        return bytes;
      };
      plan.workspace_bytes_given_split = x_bytes + chunks_workspace(p.N, plan.kernel);
      plan.weight_split_bytes = split_fp16_bytes(plan.w_chunk, p.K);
      plan.workspace_bytes =
          x_bytes + plan.weight_split_bytes + chunks_workspace(plan.w_chunk, plan.chunk_kernel);
    }
    plan.kernel_name = sm90::kKernels[plan.kernel].name;
    return plan;
  }
#endif
  if (plan.kind == GemmKernelKind::kSm80) {
    plan.kernel = sm80_kernel(p, e);
    plan.kernel_name = sm80::kKernels[plan.kernel].name;
    sm80::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
      plan.workspace_bytes = sm80_workspace_bytes<decltype(cfg), decltype(tag)>(p);
    });
  }
  return plan;
}

size_t gemm_workspace_bytes(const GemmPlan& plan, const GemmProblem& p) {
  return plan.splits_operands && p.w_split != nullptr ? plan.workspace_bytes_given_split
                                                      : plan.workspace_bytes;
}

}  // namespace epifuse
