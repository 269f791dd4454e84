// The GEMM runner (gemm_runner.h says what it does).
#include "gemm_runner.h"

#include <ATen/Context.h>

#include <algorithm>
#include <tuple>

#include "op_args.h"
#include "weight_split_cache.h"

namespace epifuse {
namespace {

void bind_operands(PreparedGemm& g) {
  GemmProblem& p = g.problem;
  p.x = g.x.data_ptr();
  p.ldx = g.x.stride(0);
  p.x_col_stride = g.x.stride(1);
  p.w = g.w.data_ptr();
  p.ldw = g.w.stride(0);
  p.w_col_stride = g.w.stride(1);
}

// The operand copies a plan reads (GemmPlan::copies): row-major, in a fresh allocation.
void copy_operands(PreparedGemm& g, const GemmPlan& plan) {
  if (!plan.copies.x && !plan.copies.w) return;
  if (plan.copies.x) g.x = g.x.clone(at::MemoryFormat::Contiguous);
  if (plan.copies.w) g.w = g.w.clone(at::MemoryFormat::Contiguous);
  bind_operands(g);
}

// Sets whether cuBLAS may run fp32 GEMMs in TF32 for one scope, whatever the global setting
// (torch.backends.cuda.matmul / set_float32_matmul_precision), and restores it after.
class CublasTf32Scope {
 public:
  explicit CublasTf32Scope(bool allow) : saved_(at::globalContext().allowTF32CuBLAS()) {
    if (allow != saved_) at::globalContext().setAllowTF32CuBLAS(allow);
  }
  ~CublasTf32Scope() {
    if (at::globalContext().allowTF32CuBLAS() != saved_) at::globalContext().setAllowTF32CuBLAS(saved_);
  }
  CublasTf32Scope(const CublasTf32Scope&) = delete;
  CublasTf32Scope& operator=(const CublasTf32Scope&) = delete;

 private:
  bool saved_;
};

}  // namespace

PreparedGemm prepare_gemm(const at::Tensor& x, const at::Tensor& w, const std::string& precision,
                          Epilogue epilogue, WeightSplit w_split, const char* op) {
  const DType dtype = to_dtype(x, op);
  PreparedGemm g;
  g.epilogue = epilogue;
  g.w_split = w_split;
  g.device = x.get_device();
  std::tie(g.cc_major, g.cc_minor) = compute_capability(g.device);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  g.out = new_cuda({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
  GemmProblem& p = g.problem;
  p.M = M;
  p.N = N;
  p.K = K;
  p.out = g.out.data_ptr();
  p.ldo = std::max<int64_t>(N, 1);
  p.dtype = dtype;
  p.math = math_mode(precision, dtype, op);
  g.x = x;
  g.w = w;
  bind_operands(g);
  return g;
}

GemmPlan plan_gemm(const PreparedGemm& g, const EpilogueOperands& ops) {
  return gemm_plan(g.problem, g.epilogue, ops, g.device, g.cc_major, g.cc_minor);
}

void cublas_product(const PreparedGemm& g) {
  const CublasTf32Scope scope(g.problem.math == MathMode::kTF32);
  at::mm_out(const_cast<at::Tensor&>(g.out), g.x, g.w.t());
}

// The dispatcher (cpp/kernels) decides; when its plan is cuBLAS's SGEMM (IEEE fp32, forced or
// chosen), it runs here with TF32 off whatever the global flag says (a forced 'ieee' under
// set_float32_matmul_precision('high') used to take a CUTLASS SIMT GEMM, 1.2x slower than SGEMM),
// then the epilogue as one more pass.
void run_gemm(PreparedGemm& g, const GemmPlan& plan, const EpilogueOperands& ops) {
  const Epilogue e = g.epilogue;
  copy_operands(g, plan);
  if (plan.host_sgemm) {
    g.problem.math = MathMode::kIEEE;
    cublas_product(g);
    epilogue_pass(g.problem, e, ops, current_stream());
    return;
  }
  at::Tensor w_split;  // kept alive until the GEMM is enqueued
  if (plan.splits_operands && g.w_split == WeightSplit::kMayKeep) {
    w_split = cached_weight_split(g.w, g.problem, current_stream());
    g.problem.w_split = w_split.defined() ? w_split.data_ptr() : nullptr;
  }
  const size_t bytes = gemm_workspace_bytes(plan, g.problem);
  at::Tensor workspace;
  if (bytes > 0) workspace = new_cuda({int64_t(bytes)}, g.x.options().dtype(at::kByte));
  gemm_run(plan, g.problem, ops, bytes > 0 ? workspace.data_ptr() : nullptr, current_stream());
}

void run_gemm(PreparedGemm& g, const EpilogueOperands& ops) { run_gemm(g, plan_gemm(g, ops), ops); }

at::Tensor k_major_copy(const at::Tensor& v) {
  const bool column_major = v.stride(0) == 1 && v.stride(1) >= v.size(0);
  if (!column_major || v.size(0) == 0 || v.size(1) == 0) return v.contiguous();
  at::Tensor out = new_cuda(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  transpose(v.data_ptr(), v.stride(1), out.data_ptr(), v.size(1), v.size(0), v.size(1),
            to_dtype(v, "backward_matmul"), current_stream());
  return out;
}

}  // namespace epifuse
