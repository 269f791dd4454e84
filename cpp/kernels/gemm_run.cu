// The GEMM launch: runs the kernel sequence a GemmPlan (gemm_plan.cu) chose, after CUTLASS's
// can_implement check that the launch is the problem the plan was made for; it decides nothing
// itself. Also the pieces of the sequence the op layer runs on its own: the epilogue as a separate
// pass (after cuBLAS's SGEMM) and the weight's FP16 split made ahead of time (kernels.h).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_utils.cuh"
#include "debug_switches.hpp"
#include "fallback.hpp"
#include "gemm_can_implement.hpp"
#include "nonfinite_rows.hpp"
#include "operand_chunks.hpp"
#include "sm80_gemm_kernels.hpp"
#include "split_fp16.hpp"
#if EPIFUSE_HAVE_SM90
#include "sm90_gemm_kernels.hpp"
#endif

namespace epifuse {

#if EPIFUSE_HAVE_SM90
// Declared in sm90_gemm.cuh: the 3x mainloop's runtime argument, EPIFUSE_3X_PROMOTION
// (DebugSwitches::split3x_promotion_interval) or the build's default.
uint32_t sm90::split3x_promotion_interval() {
  const uint32_t n = debug_switches().split3x_promotion_interval;
  return n != 0 ? n : sm90::kDefaultPromotionInterval;
}
#endif

namespace {

#if EPIFUSE_HAVE_SM90
template <class Config, class Tag>
void sm90_run(const GemmProblem& p, const EpilogueOperands& ops, void* workspace, int device,
              int sms, cudaStream_t stream) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    sm90::run_affine<Config>(p, ops, workspace, device, sms, stream);
  } else {
    sm90::run_column_stats<Config>(p, ops, workspace, device, sms, stream);
  }
}
#endif

template <class Config, class Tag>
void sm80_run(const GemmProblem& p, const EpilogueOperands& ops, void* workspace,
              cudaStream_t stream) {
  if constexpr (Tag::value == Epilogue::kAffine) {
    sm80::run_affine<Config>(p, ops, workspace, stream);
  } else {
    sm80::run_column_stats<Config>(p, ops, workspace, stream);
  }
}

// CUTLASS's can_implement for a plan: the launch is the planned problem (its operand copies bound in)
// and the planned epilogue vectors.
void can_implement(const GemmPlan& plan, const GemmProblem& p, const EpilogueOperands& ops) {
  bool ok = p.M == plan.M && p.N == plan.N && p.K == plan.K && p.dtype == plan.dtype &&
            p.math == plan.math;
  if (ok && plan.kind == GemmKernelKind::kSm90Split3x) {
    ok = dispatch::output_aligned(p, plan.epilogue, ops);
  } else if (ok && (plan.kind == GemmKernelKind::kSm90 || plan.kind == GemmKernelKind::kSm80)) {
    ok = dispatch::vector_aligned(p, plan.epilogue, ops, KMajorCopies{});
  }
  if (!ok)
    throw std::invalid_argument(std::string("epifuse: gemm_run given a problem its plan (") +
                                plan.kernel_name + ") was not made for");
}

}  // namespace

size_t split_weight_bytes(const GemmProblem& p) { return split_fp16_bytes(p.N, p.K); }

void split_weight(const GemmProblem& p, void* dst, cudaStream_t stream) {
  split_fp16(static_cast<const float*>(p.w), p.N, p.K, p.ldw, p.w_col_stride, dst, nullptr, stream);
}

void epilogue_pass(const GemmProblem& p, Epilogue e, const EpilogueOperands& ops, cudaStream_t stream) {
  if (e == Epilogue::kAffine) {
    column_affine(p.dtype, p.M, p.N, p.out, p.ldo, ops.a, ops.c, ops.act, stream);
  } else {
    fallback::column_stats(p.dtype, p.M, p.N, p.out, p.ldo, ops.colsum, ops.colsumsq, stream);
  }
}

void gemm_run(const GemmPlan& plan, const GemmProblem& p, const EpilogueOperands& ops,
              void* workspace, cudaStream_t stream) {
  can_implement(plan, p, ops);
  const Epilogue e = plan.epilogue;
  switch (plan.kind) {
    case GemmKernelKind::kEmpty:
      if (e == Epilogue::kColumnStats && p.N > 0) {  // no rows: the sums are zero
        cudaMemsetAsync(ops.colsum, 0, sizeof(double) * p.N, stream);
        cudaMemsetAsync(ops.colsumsq, 0, sizeof(double) * p.N, stream);
      }
      return;
    case GemmKernelKind::kPortable:
    case GemmKernelKind::kHostSgemm:  // no host library here: SIMT
      if (p.K == 0) {  // an empty sum: z = 0 (and x, w may have no storage for a kernel to read)
        const size_t elt = p.dtype == DType::kFloat32 ? 4 : 2;
        cudaMemset2DAsync(p.out, p.ldo * elt, 0, p.N * elt, p.M, stream);
      } else {
        fallback::gemm(p, stream);
      }
      epilogue_pass(p, e, ops, stream);
      return;
#if EPIFUSE_HAVE_SM90
    case GemmKernelKind::kSm90Split3x: {
      using dispatch::column_chunk;
      using dispatch::split_problem;
      // For each chunk of x's rows: its split, then the GEMMs on the split operands, on w's split
      // as given (one GEMM) or on w split here chunk by chunk (a w of one chunk is split once).
      // Each split reuses its buffer: launches on one stream run in order. The GEMM's own
      // workspace follows the splits (operand_chunks.hpp, split_problem: the layout).
      char* base = static_cast<char*>(workspace);
      void* x_split = base;
      base += split_fp16_bytes(plan.x_chunk, p.K);
      auto* row_flags = reinterpret_cast<int*>(base);
      base += dispatch::row_flag_bytes(p);
      void* w_split = nullptr;
      if (p.w_split == nullptr) {
        w_split = base;
        base += plan.weight_split_bytes;
      }
      auto run = [&](int kernel, const GemmProblem& sp, const EpilogueOperands& o) {
        sm90::with_kernel(kernel, [&](auto cfg, auto tag) {
          sm90_run<decltype(cfg), decltype(tag)>(sp, o, base, plan.device, plan.sm_count, stream);
        });
      };
      bool w_split_made = false;
      for (int64_t r0 = 0; r0 < p.M; r0 += plan.x_chunk) {
        const GemmProblem rows = dispatch::row_chunk(p, r0, std::min(plan.x_chunk, p.M - r0));
        split_fp16(static_cast<const float*>(rows.x), rows.M, p.K, p.ldx, p.x_col_stride, x_split,
                   row_flags + r0, stream);
        if (p.w_split != nullptr) {
          run(plan.kernel, split_problem(rows, x_split, p.w_split), ops);
          continue;
        }
        for (int64_t c0 = 0; c0 < p.N; c0 += plan.w_chunk) {
          const GemmProblem chunk = column_chunk(rows, c0, std::min(plan.w_chunk, p.N - c0));
          if (!w_split_made || plan.w_chunk < p.N) split_weight(chunk, w_split, stream);
          w_split_made = true;
          run(plan.chunk_kernel, split_problem(chunk, x_split, w_split), column_chunk(ops, c0));
        }
      }
      // The split turns the +-Inf of a row of x into NaN; IEEE math for those rows (the affine
      // epilogue's activation included).
      const bool affine = e == Epilogue::kAffine;
      recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr,
                               affine ? ops.act : Activation{}, row_flags, stream);
      return;
    }
    case GemmKernelKind::kSm90:
      sm90::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
        sm90_run<decltype(cfg), decltype(tag)>(p, ops, workspace, plan.device, plan.sm_count,
                                               stream);
      });
      return;
#endif
    case GemmKernelKind::kSm80:
      sm80::with_kernel(plan.kernel, [&](auto cfg, auto tag) {
        sm80_run<decltype(cfg), decltype(tag)>(p, ops, workspace, stream);
      });
      // 3xTF32 turns the +-Inf of a row of x into NaN (big/small split); IEEE math for those rows.
      if (sm80::kKernels[plan.kernel].math == MathMode::k3xTF32) {
        const bool affine = e == Epilogue::kAffine;
        recompute_nonfinite_rows(p, affine ? ops.a : nullptr, affine ? ops.c : nullptr,
                                 Activation{}, nullptr, stream);
      }
      // CUTLASS 2.x compute nodes take no runtime arguments: the sm80 tree stores the affine, and
      // the activation is one more pass over the output.
      if (e == Epilogue::kAffine && ops.act.kind != ActivationKind::kNone) {
        column_affine(p.dtype, p.M, p.N, p.out, p.ldo, nullptr, nullptr, ops.act, stream);
      }
      return;
    default:
      throw std::logic_error("epifuse: this build has no kernels for the plan");
  }
}

}  // namespace epifuse
