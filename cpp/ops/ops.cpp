// torch.ops.epifuse.*: the op schemas and their CUDA implementations.
//
// This is the only C++ that sees torch. Each op validates its arguments the way PyTorch's own ops
// do (same exception types, messages naming the problem; the checks the op files share are in
// op_args.h), allocates outputs and workspaces from the caching allocator, and calls the torch-free
// launchers of epifuse/kernels.h on the current stream. No op synchronizes with the host, so every
// op can be captured in a CUDA graph.
//
// CPU kernels and fake (meta) kernels are registered from Python (python/epifuse/ops.py), where the
// reference math lives.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <optional>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include "epifuse/kernels.h"
#include "head_config.h"
#include "op_args.h"
#include "weight_split_cache.h"

namespace epifuse {
namespace {

// A per-column fp32 vector of length n, contiguous (a copy only if the caller passed a view).
at::Tensor column_vector(const at::Tensor& v, int64_t n, const char* op, const char* name,
                         const at::Tensor& ref) {
  check_cuda(v, op, name, ref);
  EPIFUSE_CHECK(v.scalar_type() == at::kFloat, "epifuse::", op, ": expected ", name,
              " to be float32, got ", v.scalar_type());
  EPIFUSE_CHECK(v.dim() == 1 && v.size(0) == n, "epifuse::", op, ": expected ", name,
              " of shape [", n, "], got ", v.sizes());
  return v.contiguous();
}

// The fp32 GEMM precisions the ops take, the one place that names them: python/epifuse/precision.py
// reads them through epifuse::precision_names (in this order) and documents them.
constexpr std::pair<const char*, MathMode> kPrecisions[] = {
    {"ieee", MathMode::kIEEE}, {"3xtf32", MathMode::k3xTF32}, {"tf32", MathMode::kTF32}};

std::vector<std::string> precision_names() {
  std::vector<std::string> names;
  for (const auto& entry : kPrecisions) names.emplace_back(entry.first);
  return names;
}

// "'ieee', '3xtf32' or 'tf32'", or with `last` as the last choice.
std::string quoted_precisions(const char* last = nullptr) {
  std::string out;
  const size_t n = std::size(kPrecisions);
  for (size_t i = 0; i < n; ++i) {
    out += i == 0 ? "" : (i + 1 == n && last == nullptr ? " or " : ", ");
    out = out + "'" + kPrecisions[i].first + "'";
  }
  return last != nullptr ? out + " or " + last : out;
}

MathMode math_mode(const std::string& precision, DType dtype, const char* op) {
  const auto* known = std::find_if(std::begin(kPrecisions), std::end(kPrecisions),
                                   [&](const auto& entry) { return precision == entry.first; });
  EPIFUSE_CHECK_VALUE(known != std::end(kPrecisions) || precision.empty(), "epifuse::", op,
                      ": precision must be ", quoted_precisions("'' (16-bit inputs)"), ", got '",
                      precision, "'");
  if (dtype != DType::kFloat32) return MathMode::kNative;
  EPIFUSE_CHECK_VALUE(!precision.empty(), "epifuse::", op, ": float32 inputs need precision ",
                      quoted_precisions());
  return known->second;
}

// Row-major with unit column stride: what the kernels take without a copy.
at::Tensor rows_with_unit_stride(const at::Tensor& t) {
  const bool ok = t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(t.size(1), 1);
  return ok ? t : t.contiguous();
}

// Whether a product's 3x split of w may be kept while w's version is unchanged
// (weight_split_cache.h). Every caller says which, no default: kMayKeep only for a layer's weight as
// the op's caller passed it. The backward's products pass kNeverKeep: their w is W^T or x^T, a view
// made here below autograd's ADInplaceOrView (so with a version counter of its own, which no write
// to the weight bumps: a kept split of it went stale after the first optimizer step), of an
// activation or of a weight that changes every step (a kept split would only pin its bytes again).
enum class WeightSplit { kMayKeep, kNeverKeep };

struct PreparedGemm {
  GemmProblem problem;
  Epilogue epilogue = Epilogue::kAffine;
  int device = 0, cc_major = 0, cc_minor = 0;
  at::Tensor x, w, out;  // keep the (possibly copied) operands alive
  WeightSplit w_split = WeightSplit::kNeverKeep;
};

void bind_operands(PreparedGemm& g) {
  GemmProblem& p = g.problem;
  p.x = g.x.data_ptr();
  p.ldx = g.x.stride(0);
  p.x_col_stride = g.x.stride(1);
  p.w = g.w.data_ptr();
  p.ldw = g.w.stride(0);
  p.w_col_stride = g.w.stride(1);
}

GemmPlan plan_gemm(const PreparedGemm& g, const EpilogueOperands& ops) {
  return gemm_plan(g.problem, g.epilogue, ops, g.device, g.cc_major, g.cc_minor);
}

// The operand copies a plan reads (GemmPlan::copies): row-major, in a fresh allocation.
void copy_operands(PreparedGemm& g, const GemmPlan& plan) {
  if (!plan.copies.x && !plan.copies.w) return;
  if (plan.copies.x) g.x = g.x.clone(at::MemoryFormat::Contiguous);
  if (plan.copies.w) g.w = g.w.clone(at::MemoryFormat::Contiguous);
  bind_operands(g);
}

// x [M, K] . w [N, K]^T -> out [M, N] (dtype of x) in `precision`, the operands bound as the
// caller passed them (views included); the plan says which to copy (run_gemm).
PreparedGemm prepare_gemm(const at::Tensor& x_in, const at::Tensor& w_in, const std::string& precision,
                          Epilogue epilogue, WeightSplit w_split, const char* op) {
  EPIFUSE_CHECK(x_in.dim() == 2, "epifuse::", op, ": expected x to be 2-D [M, K], got ",
              x_in.dim(), "-D");
  EPIFUSE_CHECK(w_in.dim() == 2, "epifuse::", op, ": expected weight to be 2-D [N, K], got ",
              w_in.dim(), "-D");
  check_cuda(x_in, op, "x", x_in);
  check_cuda(w_in, op, "weight", x_in);
  EPIFUSE_CHECK(x_in.scalar_type() == w_in.scalar_type(),
              "mat1 and mat2 must have the same dtype, but got ", x_in.scalar_type(), " and ",
              w_in.scalar_type());
  EPIFUSE_CHECK(x_in.size(1) == w_in.size(1), "mat1 and mat2 shapes cannot be multiplied (",
              x_in.size(0), "x", x_in.size(1), " and ", w_in.size(1), "x", w_in.size(0), ")");
  const DType dtype = to_dtype(x_in, op);
  PreparedGemm g;
  g.epilogue = epilogue;
  g.w_split = w_split;
  g.device = x_in.get_device();
  std::tie(g.cc_major, g.cc_minor) = compute_capability(g.device);
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  g.out = new_cuda({M, N}, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  GemmProblem& p = g.problem;
  p.M = M;
  p.N = N;
  p.K = K;
  p.out = g.out.data_ptr();
  p.ldo = std::max<int64_t>(N, 1);
  p.dtype = dtype;
  p.math = math_mode(precision, dtype, op);
  g.x = x_in;
  g.w = w_in;
  bind_operands(g);
  return g;
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

// out = x . w^T on cuBLAS (at::mm) in the problem's math: IEEE fp32 (FFMA SGEMM), TF32, or the
// 16-bit tensor-core GEMM, independent of the global TF32 flag.
void cublas_product(const PreparedGemm& g) {
  const CublasTf32Scope scope(g.problem.math == MathMode::kTF32);
  at::mm_out(const_cast<at::Tensor&>(g.out), g.x, g.w.t());
}

// The dispatcher (gemm_dispatch.cu) decides; when its plan is cuBLAS's SGEMM (IEEE fp32, forced
// or chosen), it runs here with TF32 off whatever the global flag says (a forced 'ieee' under
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

// ---- activations ---------------------------------------------------------------------------

// HeadConfig's activation names, the one place that spells them (python/epifuse/fold.py's
// ACTIVATIONS lists the same, in this order; tests check they agree).
constexpr std::pair<const char*, ActivationKind> kActivations[] = {
    {"", ActivationKind::kNone},          {"relu", ActivationKind::kReLU},
    {"leaky_relu", ActivationKind::kLeakyReLU}, {"gelu", ActivationKind::kGELU},
    {"gelu_tanh", ActivationKind::kGELUTanh},   {"silu", ActivationKind::kSiLU}};

Activation activation_from_name(c10::string_view name, double negative_slope, const char* op) {
  for (const auto& entry : kActivations) {
    if (name == entry.first) return Activation{entry.second, float(negative_slope)};
  }
  EPIFUSE_CHECK_VALUE(false, "epifuse::", op, ": unknown activation '", std::string(name),
                      "' (expected '', 'relu', 'leaky_relu', 'gelu', 'gelu_tanh' or 'silu')");
  return {};
}

// y = act(a[n] * (x . W^T) + c[n]): an eval head's whole layer, the activation in the epilogue.
at::Tensor gemm_affine_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& a,
                            const at::Tensor& c, c10::string_view precision,
                            c10::string_view activation, double negative_slope) {
  const char* op = "gemm_affine";
  const Activation act = activation_from_name(activation, negative_slope, op);
  const auto guard = guard_for(x, op, "x");
  PreparedGemm g = prepare_gemm(x, weight, std::string(precision), Epilogue::kAffine,
                                WeightSplit::kMayKeep, op);
  const at::Tensor a32 = column_vector(a, g.problem.N, op, "a", x);
  const at::Tensor c32 = column_vector(c, g.problem.N, op, "c", x);
  EpilogueOperands ops;
  ops.a = a32.data_ptr<float>();
  ops.c = c32.data_ptr<float>();
  ops.act = act;
  run_gemm(g, ops);
  return g.out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_colstats_cuda(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  c10::string_view precision) {
  const char* op = "gemm_colstats";
  const auto guard = guard_for(x, op, "x");
  PreparedGemm g = prepare_gemm(x, weight, std::string(precision), Epilogue::kColumnStats,
                                WeightSplit::kMayKeep, op);
  auto stats_options = g.x.options().dtype(at::kDouble);
  at::Tensor colsum = new_cuda({g.problem.N}, stats_options);
  at::Tensor colsumsq = new_cuda({g.problem.N}, stats_options);
  EpilogueOperands ops;
  ops.colsum = colsum.data_ptr<double>();
  ops.colsumsq = colsumsq.data_ptr<double>();
  run_gemm(g, ops);
  return {g.out, colsum, colsumsq};
}

// ---- fold ----------------------------------------------------------------------------------

// also_fp64: float64 is accepted too (bn_fold_eval, folding the moments a backward kept).
// gamma: the tensor whose dtype and length t must have (ref_name: running_mean in
// update_running_stats).
void check_running(const at::Tensor& t, const char* name, const at::Tensor& gamma, const char* op,
                   bool also_fp64 = false, const char* ref_name = "gamma") {
  check_cuda(t, op, name, gamma);
  EPIFUSE_CHECK(t.scalar_type() == gamma.scalar_type() ||
                    (also_fp64 && t.scalar_type() == at::kDouble),
                "epifuse::", op, ": expected ", name, " to have dtype ", gamma.scalar_type(),
                " like ", ref_name, also_fp64 ? " (or float64)" : "", ", got ", t.scalar_type());
  EPIFUSE_CHECK(t.is_contiguous() && t.dim() == 1 && t.size(0) == gamma.size(0), "epifuse::", op,
              ": expected ", name, " to be a contiguous [", gamma.size(0), "] tensor, got ",
              t.sizes());
}

// The running-statistics update's settings (bn_fold_train, update_running_stats).
void check_counter_and_momentum(const at::Tensor& num_batches_tracked,
                                std::optional<double> momentum, const at::Tensor& ref,
                                const char* op) {
  check_cuda(num_batches_tracked, op, "num_batches_tracked", ref);
  EPIFUSE_CHECK(num_batches_tracked.scalar_type() == at::kLong && num_batches_tracked.numel() == 1,
              "epifuse::", op, ": expected num_batches_tracked to be a one-element int64 tensor");
  if (momentum) {
    EPIFUSE_CHECK_VALUE(*momentum >= 0 && *momentum <= 1, "epifuse::", op,
                      ": momentum must be in [0, 1] or None, got ", *momentum);
  }
}

std::tuple<at::Tensor, at::Tensor> bn_fold_train_cuda(
    const at::Tensor& colsum, const at::Tensor& colsumsq, int64_t count,
    const std::optional<at::Tensor>& bias, const at::Tensor& gamma, const at::Tensor& beta,
    const std::optional<at::Tensor>& pre_scale, const std::optional<at::Tensor>& post_scale,
    const at::Tensor& running_mean, const at::Tensor& running_var,
    const at::Tensor& num_batches_tracked, std::optional<double> momentum, double eps) {
  const char* op = "bn_fold_train";
  const auto guard = guard_for(gamma, op, "gamma");
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  EPIFUSE_CHECK_VALUE(count > 1, "Expected more than 1 value per channel when training, got ", count,
                    " rows");
  for (const at::Tensor* s : {&colsum, &colsumsq}) {
    check_cuda(*s, op, "colsum/colsumsq", gamma);
    EPIFUSE_CHECK(s->scalar_type() == at::kDouble && s->is_contiguous() && s->dim() == 1 &&
                    s->size(0) == f.N,
                "epifuse::", op, ": expected colsum and colsumsq to be contiguous float64 [", f.N,
                "] tensors, got ", s->scalar_type(), " ", s->sizes());
  }
  check_running(running_mean, "running_mean", gamma, op);
  check_running(running_var, "running_var", gamma, op);
  check_counter_and_momentum(num_batches_tracked, momentum, gamma, op);
  auto outputs = fold_outputs(gamma, f);
  bn_fold_train(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
                running_mean.data_ptr(), running_var.data_ptr(),
                num_batches_tracked.data_ptr<int64_t>(), momentum ? *momentum : -1.0,
                current_stream());
  return outputs;
}

std::tuple<at::Tensor, at::Tensor> bn_fold_eval_cuda(
    const std::optional<at::Tensor>& bias, const at::Tensor& gamma, const at::Tensor& beta,
    const std::optional<at::Tensor>& pre_scale, const std::optional<at::Tensor>& post_scale,
    const at::Tensor& running_mean, const at::Tensor& running_var, double eps) {
  const char* op = "bn_fold_eval";
  const auto guard = guard_for(gamma, op, "gamma");
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_running(running_mean, "running_mean", gamma, op, /*also_fp64=*/true);
  check_running(running_var, "running_var", gamma, op, /*also_fp64=*/true);
  EPIFUSE_CHECK(running_mean.scalar_type() == running_var.scalar_type(), "epifuse::", op,
                ": expected running_mean and running_var of one dtype, got ",
                running_mean.scalar_type(), " and ", running_var.scalar_type());
  auto outputs = fold_outputs(gamma, f);
  bn_fold_eval(f, running_mean.data_ptr(), running_var.data_ptr(),
               running_mean.scalar_type() == at::kDouble, current_stream());
  return outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bn_fold_batch_cuda(
    const at::Tensor& colsum, const at::Tensor& colsumsq, int64_t count,
    const std::optional<at::Tensor>& bias, const at::Tensor& gamma, const at::Tensor& beta,
    const std::optional<at::Tensor>& pre_scale, const std::optional<at::Tensor>& post_scale,
    double eps) {
  const char* op = "bn_fold_batch";
  const auto guard = guard_for(gamma, op, "gamma");
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  EPIFUSE_CHECK_VALUE(count > 1, "Expected more than 1 value per channel when training, got ", count,
                    " rows");
  check_sums(colsum, "colsum", f.N, gamma, op);
  check_sums(colsumsq, "colsumsq", f.N, gamma, op);
  auto [a, c] = fold_outputs(gamma, f);
  at::Tensor moments = new_cuda({2 * f.N + 1}, gamma.options().dtype(at::kDouble));
  bn_fold_batch(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
                moments.data_ptr<double>(), current_stream());
  return {a, c, moments};
}

// The running statistics (in place) from the moments a training fold returned: bn_fold_batch's, or
// the synchronized fold's merged ones, whose count (moments[2N]) stays on the device.
void update_running_stats_cuda(const at::Tensor& moments, const at::Tensor& running_mean,
                               const at::Tensor& running_var, const at::Tensor& num_batches_tracked,
                               std::optional<double> momentum) {
  const char* op = "update_running_stats";
  const auto guard = guard_for(running_mean, op, "running_mean");
  const DType dtype = to_dtype(running_mean, op);
  EPIFUSE_CHECK(running_mean.is_contiguous() && running_mean.dim() == 1, "epifuse::", op,
                ": expected running_mean to be a contiguous 1-D tensor, got ", running_mean.sizes());
  const int64_t n = running_mean.size(0);
  check_running(running_var, "running_var", running_mean, op, false, "running_mean");
  check_sums(moments, "moments", 2 * n + 1, running_mean, op);
  check_counter_and_momentum(num_batches_tracked, momentum, running_mean, op);
  update_running_stats(n, dtype, moments.data_ptr<double>(), running_mean.data_ptr(),
                       running_var.data_ptr(), num_batches_tracked.data_ptr<int64_t>(),
                       momentum ? *momentum : -1.0, current_stream());
}

// ---- row passes ----------------------------------------------------------------------------

struct AffinePair {
  at::Tensor a, c;  // both undefined = identity
};

AffinePair optional_affine(const at::Tensor& z, const std::optional<at::Tensor>& a,
                           const std::optional<at::Tensor>& c, const char* op) {
  EPIFUSE_CHECK(a.has_value() == c.has_value(), "epifuse::", op,
              ": pass both a and c, or neither (no affine)");
  if (!a) return {};
  return {column_vector(*a, z.size(1), op, "a", z), column_vector(*c, z.size(1), op, "c", z)};
}

void check_matrix(const at::Tensor& z, const char* op) {
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected a 2-D tensor, got ", z.dim(), "-D");
  check_cuda(z, op, "z", z);
  to_dtype(z, op);
}

// The output dtype of an out-of-place row pass over z: out_dtype (z's dtype, or float32 from a
// 16-bit z: a head's fp32 output under autocast), z's when None.
at::ScalarType pass_out_dtype(const at::Tensor& z, std::optional<at::ScalarType> out_dtype,
                              const char* op) {
  const at::ScalarType out = out_dtype.value_or(z.scalar_type());
  EPIFUSE_CHECK(out == z.scalar_type() || (out == at::kFloat && z.element_size() == 2),
                "epifuse::", op, ": out_dtype must be z's dtype (", z.scalar_type(),
                ") or float32 for a 16-bit z, got ", out);
  return out;
}

const float* floats_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

void softmax_into(const at::Tensor& src, const at::Tensor& dst, const AffinePair& ac,
                  Activation act) {
  affine_softmax(to_dtype(src, "affine_softmax"), src.size(0), src.size(1), src.data_ptr(),
                 src.stride(0), to_dtype(dst, "affine_softmax"), dst.data_ptr(), dst.stride(0),
                 floats_or_null(ac.a), floats_or_null(ac.c), act, current_stream());
}

at::Tensor affine_softmax_cuda(const at::Tensor& z, const std::optional<at::Tensor>& a,
                               const std::optional<at::Tensor>& c, c10::string_view activation,
                               double negative_slope, std::optional<at::ScalarType> out_dtype) {
  const char* op = "affine_softmax";
  check_matrix(z, op);
  const auto guard = guard_for(z, op, "z");
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  const at::ScalarType dtype = pass_out_dtype(z, out_dtype, op);
  const at::Tensor src = rows_with_unit_stride(z);
  at::Tensor out = new_cuda(z.sizes(), z.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
  softmax_into(src, out, ac, act);
  return out;
}

void affine_softmax_inplace_cuda(const at::Tensor& z, const std::optional<at::Tensor>& a,
                                 const std::optional<at::Tensor>& c, c10::string_view activation,
                                 double negative_slope) {
  const char* op = "affine_softmax_";
  check_matrix(z, op);
  const auto guard = guard_for(z, op, "z");
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  check_written_apart(z, a, op, "z", "a");
  check_written_apart(z, c, op, "z", "c");
  if (z.numel() == 0) return;
  if (z.stride(1) == 1 && z.stride(0) >= z.size(1)) {
    softmax_into(z, z, ac, act);
  } else {  // strided view: compute densely, then write back through the view
    at::Tensor dense = z.contiguous();
    softmax_into(dense, dense, ac, act);
    z.copy_(dense);
  }
}

// a, c absent: the activation alone (a head whose GEMM epilogue applied the affine).
void affine_inplace_cuda(const at::Tensor& z, const std::optional<at::Tensor>& a,
                         const std::optional<at::Tensor>& c, c10::string_view activation,
                         double negative_slope) {
  const char* op = "affine_";
  check_matrix(z, op);
  const auto guard = guard_for(z, op, "z");
  const Activation act = activation_from_name(activation, negative_slope, op);
  const AffinePair ac = optional_affine(z, a, c, op);
  check_written_apart(z, a, op, "z", "a");
  check_written_apart(z, c, op, "z", "c");
  if (z.numel() == 0) return;
  auto in_place = [&](const at::Tensor& t) {
    column_affine_into(to_dtype(t, op), t.size(0), t.size(1), t.data_ptr(), t.stride(0),
                       to_dtype(t, op), t.data_ptr(), t.stride(0), floats_or_null(ac.a),
                       floats_or_null(ac.c), act, current_stream());
  };
  if (z.stride(1) == 1 && z.stride(0) >= z.size(1)) {
    in_place(z);
  } else {
    at::Tensor dense = z.contiguous();
    in_place(dense);
    z.copy_(dense);
  }
}

at::Tensor affine_cuda(const at::Tensor& z, const at::Tensor& a, const at::Tensor& c,
                       c10::string_view activation, double negative_slope,
                       std::optional<at::ScalarType> out_dtype) {
  const char* op = "affine";
  check_matrix(z, op);
  const auto guard = guard_for(z, op, "z");
  const Activation act = activation_from_name(activation, negative_slope, op);
  const at::Tensor a32 = column_vector(a, z.size(1), op, "a", z);
  const at::Tensor c32 = column_vector(c, z.size(1), op, "c", z);
  const at::ScalarType dtype = pass_out_dtype(z, out_dtype, op);
  const at::Tensor src = rows_with_unit_stride(z);
  at::Tensor out = new_cuda(z.sizes(), z.options().dtype(dtype).memory_format(at::MemoryFormat::Contiguous));
  column_affine_into(to_dtype(z, op), src.size(0), src.size(1), src.data_ptr(), src.stride(0),
                     to_dtype(out, op), out.data_ptr(), std::max<int64_t>(out.size(1), 1),
                     a32.data_ptr<float>(), c32.data_ptr<float>(), act, current_stream());
  return out;
}

// ---- backward ------------------------------------------------------------------------------

// The [M, N] operands of the backward passes, checked (one shape, dtype and device; out and rowdot
// both or neither) and with unit column stride (a copy otherwise: an expanded gradient, e.g. of
// y.sum(), has stride 0).
struct PreparedGrad {
  GradOperands o;
  at::Tensor g, out, rowdot, z, a, c;  // keep the (possibly copied) operands alive
};

// The activation of a head's backward and the forward's fold it recomputes h = a * z + c from.
void prepare_activation(PreparedGrad& p, const at::Tensor& z, const std::optional<at::Tensor>& a,
                        const std::optional<at::Tensor>& c, c10::string_view activation,
                        double negative_slope, const char* op) {
  p.o.act = activation_from_name(activation, negative_slope, op);
  if (p.o.act.kind == ActivationKind::kNone) return;
  EPIFUSE_CHECK(a.has_value() && c.has_value(), "epifuse::", op, ": activation '",
                std::string(activation), "' needs a and c (the forward's fold)");
  p.a = column_vector(*a, p.o.N, op, "a", z);
  p.c = column_vector(*c, p.o.N, op, "c", z);
  p.o.a = p.a.data_ptr<float>();
  p.o.c = p.c.data_ptr<float>();
}

PreparedGrad prepare_grad(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                          const std::optional<at::Tensor>& rowdot, const at::Tensor& z,
                          const char* op) {
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected z to be 2-D [M, N], got ", z.dim(), "-D");
  check_cuda(z, op, "z", z);
  PreparedGrad p;
  p.o.z_dtype = to_dtype(z, op);
  // grad and out share one dtype: z's, or float32 over a 16-bit z (a head's fp32 output under
  // autocast).
  const at::ScalarType g_dtype =
      grad.scalar_type() == at::kFloat && z.element_size() == 2 ? at::kFloat : z.scalar_type();
  auto check_like_z = [&](const at::Tensor& t, const char* name) {
    check_cuda(t, op, name, z);
    EPIFUSE_CHECK(t.scalar_type() == g_dtype, "epifuse::", op, ": expected ", name,
                  " to have dtype ", g_dtype, g_dtype == z.scalar_type() ? " like z" : " like grad",
                  ", got ", t.scalar_type());
    EPIFUSE_CHECK(t.sizes() == z.sizes(), "epifuse::", op, ": expected ", name, " of shape ",
                  z.sizes(), " like z, got ", t.sizes());
  };
  check_like_z(grad, "grad");
  p.o.dtype = to_dtype(grad, op);
  EPIFUSE_CHECK(out.has_value() == rowdot.has_value(), "epifuse::", op,
                ": pass both out and rowdot (softmax heads), or neither");
  p.o.M = z.size(0);
  p.o.N = z.size(1);
  p.g = rows_with_unit_stride(grad);
  p.z = rows_with_unit_stride(z);
  p.o.g = p.g.data_ptr();
  p.o.ld_g = p.g.stride(0);
  p.o.z = p.z.data_ptr();
  p.o.ld_z = p.z.stride(0);
  if (out) {
    check_like_z(*out, "out");
    p.rowdot = column_vector(*rowdot, p.o.M, op, "rowdot", z);
    p.out = rows_with_unit_stride(*out);
    p.o.out = p.out.data_ptr();
    p.o.ld_out = p.out.stride(0);
    p.o.rowdot = p.rowdot.data_ptr<float>();
  }
  return p;
}

at::Tensor softmax_grad_rowdot_cuda(const at::Tensor& grad, const at::Tensor& out) {
  const char* op = "softmax_grad_rowdot";
  EPIFUSE_CHECK(out.dim() == 2, "epifuse::", op, ": expected out to be 2-D [M, N], got ", out.dim(),
                "-D");
  const auto guard = guard_for(out, op, "out");
  // The kernel reads out as grad's type: prepare_grad's fp32-grad-over-16-bit-z rule does not
  // hold here, where out stands as z (an fp32 grad over a bf16 out would be read past its end).
  EPIFUSE_CHECK(grad.scalar_type() == out.scalar_type(), "epifuse::", op,
                ": expected grad to have dtype ", out.scalar_type(), " like out, got ",
                grad.scalar_type());
  at::Tensor rowdot = new_cuda({out.size(0)}, out.options().dtype(at::kFloat));
  // prepare_grad takes (out, rowdot) together; rowdot is this op's output, so out stands as z.
  PreparedGrad p = prepare_grad(grad, std::nullopt, std::nullopt, out, op);
  p.o.out = p.o.z;
  p.o.ld_out = p.o.ld_z;
  softmax_grad_rowdot(p.o, rowdot.data_ptr<float>(), current_stream());
  return rowdot;
}

at::Tensor head_grad_sums_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                               const std::optional<at::Tensor>& rowdot, const at::Tensor& z,
                               const std::optional<at::Tensor>& a,
                               const std::optional<at::Tensor>& c, c10::string_view activation,
                               double negative_slope) {
  const char* op = "head_grad_sums";
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected z to be 2-D [M, N], got ", z.dim(), "-D");
  const auto guard = guard_for(z, op, "z");
  PreparedGrad p = prepare_grad(grad, out, rowdot, z, op);
  prepare_activation(p, z, a, c, activation, negative_slope, op);
  if (p.o.N == 0) return at::full({1}, double(p.o.M), z.options().dtype(at::kDouble));
  at::Tensor sums = new_cuda({2 * p.o.N + 1}, z.options().dtype(at::kDouble));
  const size_t scratch_bytes = head_grad_sums_scratch_bytes(p.o);
  at::Tensor scratch;
  if (scratch_bytes > 0) scratch = new_cuda({int64_t(scratch_bytes)}, z.options().dtype(at::kByte));
  head_grad_sums(p.o, sums.data_ptr<double>(), scratch_bytes > 0 ? scratch.data_ptr() : nullptr,
                 current_stream());
  return sums;
}

// A parameter's gradient: its dtype and shape; an absent parameter gets an empty float32 tensor.
at::Tensor param_grad(const std::optional<at::Tensor>& param, const at::Tensor& gamma) {
  return param ? new_cuda(param->sizes(), param->options())
               : new_cuda({0}, gamma.options().dtype(at::kFloat));
}

void* data_or_null(const std::optional<at::Tensor>& param, const at::Tensor& grad) {
  return param ? grad.data_ptr() : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
head_grad_coefficients_cuda(const at::Tensor& sums, const std::optional<at::Tensor>& global_sums,
                            const std::optional<at::Tensor>& colsum,
                            const std::optional<at::Tensor>& colsumsq, const at::Tensor& moments,
                            const std::optional<at::Tensor>& bias, const at::Tensor& gamma,
                            const at::Tensor& beta, const std::optional<at::Tensor>& pre_scale,
                            const std::optional<at::Tensor>& post_scale, bool training,
                            double eps) {
  const char* op = "head_grad_coefficients";
  const auto guard = guard_for(gamma, op, "gamma");
  GradCoefficientProblem p;
  p.params = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  const int64_t N = p.params.N;
  check_sums(sums, "sums", 2 * N + 1, gamma, op);
  check_sums(moments, "moments", 2 * N + 1, gamma, op);
  if (global_sums) check_sums(*global_sums, "global_sums", 2 * N + 1, gamma, op);
  EPIFUSE_CHECK(!training || (colsum && colsumsq), "epifuse::", op,
                ": training-mode coefficients need colsum and colsumsq");
  if (training) {
    check_sums(*colsum, "colsum", N, gamma, op);
    check_sums(*colsumsq, "colsumsq", N, gamma, op);
    p.colsum = colsum->data_ptr<double>();
    p.colsumsq = colsumsq->data_ptr<double>();
  }
  p.training = training;
  p.sums = sums.data_ptr<double>();
  p.global_sums = global_sums ? global_sums->data_ptr<double>() : nullptr;
  p.moments = moments.data_ptr<double>();
  at::Tensor coef = new_cuda({3, N}, gamma.options().dtype(at::kFloat));
  at::Tensor g_bias = param_grad(bias, gamma), g_pre = param_grad(pre_scale, gamma);
  at::Tensor g_post = param_grad(post_scale, gamma);
  at::Tensor g_gamma = new_cuda(gamma.sizes(), gamma.options());
  at::Tensor g_beta = new_cuda(beta.sizes(), beta.options());
  p.coef = coef.data_ptr<float>();
  p.grad_bias = data_or_null(bias, g_bias);
  p.grad_gamma = g_gamma.data_ptr();
  p.grad_beta = g_beta.data_ptr();
  p.grad_pre = data_or_null(pre_scale, g_pre);
  p.grad_post = data_or_null(post_scale, g_post);
  const size_t scratch_bytes = head_grad_coefficients_scratch_bytes(p.params);
  at::Tensor scratch;
  if (scratch_bytes > 0) scratch = new_cuda({int64_t(scratch_bytes)}, gamma.options().dtype(at::kByte));
  head_grad_coefficients(p, scratch_bytes > 0 ? scratch.data_ptr() : nullptr, current_stream());
  return {coef, g_bias, g_gamma, g_beta, g_pre, g_post};
}

at::Tensor head_grad_z_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& out,
                            const std::optional<at::Tensor>& rowdot, const at::Tensor& z,
                            const at::Tensor& coef, const std::optional<at::Tensor>& a,
                            const std::optional<at::Tensor>& c, c10::string_view activation,
                            double negative_slope) {
  const char* op = "head_grad_z";
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected z to be 2-D [M, N], got ", z.dim(), "-D");
  const auto guard = guard_for(z, op, "z");
  PreparedGrad p = prepare_grad(grad, out, rowdot, z, op);
  prepare_activation(p, z, a, c, activation, negative_slope, op);
  check_cuda(coef, op, "coef", z);
  EPIFUSE_CHECK(coef.scalar_type() == at::kFloat && coef.dim() == 2 && coef.size(0) == 3 &&
                    coef.size(1) == p.o.N,
                "epifuse::", op, ": expected coef to be a float32 [3, ", p.o.N, "] tensor, got ",
                coef.scalar_type(), " ", coef.sizes());
  const at::Tensor coef_c = coef.contiguous();
  at::Tensor dz = new_cuda(z.sizes(), z.options().memory_format(at::MemoryFormat::Contiguous));
  head_grad_z(p.o, coef_c.data_ptr<float>(), dz.data_ptr(), std::max<int64_t>(p.o.N, 1),
              current_stream());
  return dz;
}

// A row-major copy of a 2-D operand [R, C] (K-major for a GEMM operand of rows x K): our tiled
// transpose for column-major views (the transposed views of the backward), Tensor::contiguous
// for anything else.
at::Tensor k_major_copy(const at::Tensor& v) {
  const bool column_major = v.stride(0) == 1 && v.stride(1) >= v.size(0);
  if (!column_major || v.size(0) == 0 || v.size(1) == 0) return v.contiguous();
  at::Tensor out = new_cuda(v.sizes(), v.options().memory_format(at::MemoryFormat::Contiguous));
  transpose(v.data_ptr(), v.stride(1), out.data_ptr(), v.size(1), v.size(0), v.size(1),
            to_dtype(v, "backward_matmul"), current_stream());
  return out;
}

at::Tensor backward_matmul_cuda(const at::Tensor& a, const at::Tensor& b,
                                c10::string_view precision, std::optional<at::ScalarType> out_dtype) {
  const char* op = "backward_matmul";
  const auto guard = guard_for(a, op, "a");
  EPIFUSE_CHECK(a.dim() == 2 && b.dim() == 2, "epifuse::", op, ": expected 2-D a and b, got ",
                a.dim(), "-D and ", b.dim(), "-D");
  check_cuda(b, op, "b", a);
  EPIFUSE_CHECK(a.scalar_type() == b.scalar_type(),
                "mat1 and mat2 must have the same dtype, but got ", a.scalar_type(), " and ",
                b.scalar_type());
  EPIFUSE_CHECK(a.size(1) == b.size(0), "mat1 and mat2 shapes cannot be multiplied (", a.size(0),
                "x", a.size(1), " and ", b.size(0), "x", b.size(1), ")");
  // Both branches below take only what prepare_gemm takes: a kernel dtype and a known precision
  // (the out_dtype branch never reaches prepare_gemm's own check).
  math_mode(std::string(precision), to_dtype(a, op), op);
  if (out_dtype && *out_dtype != a.scalar_type()) {
    // A 16-bit product written in fp32 by the GEMM itself (a head's dW under autocast, in the fp32
    // parameters' dtype; dX of an fp32 x): no 16-bit result, no cast pass. From fp16 operands it
    // overflows where the fp16 product would (fp16_overflow.cu), so GradScaler sees eager's infs:
    // in the epilogue of our Hopper GEMM (sm90_fp16_product.cu), or cuBLAS's product and a pass.
    EPIFUSE_CHECK(*out_dtype == at::kFloat && a.element_size() == 2, "epifuse::", op,
                  ": out_dtype must be a's dtype (", a.scalar_type(),
                  ") or float32 for 16-bit a and b, got ", *out_dtype);
    const bool fp16 = a.scalar_type() == at::kHalf;
    const bool b_row_major = b.stride(1) == 1 || b.size(1) == 1;
    if (fp16 && b_row_major && a.size(0) > 0 && b.size(1) > 0 && a.size(1) > 0) {
      at::Tensor product = new_cuda({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
      const Fp16Product p{a.size(0), b.size(1), a.size(1), a.data_ptr(), a.stride(0), a.stride(1),
                          b.data_ptr(), b.stride(0), product.data_ptr<float>(), product.stride(0)};
      const auto [major, minor] = compute_capability(a.get_device());
      const Fp16ProductPlan plan = plan_fp16_product(p, a.get_device(), major, minor);
      if (plan.hopper) {  // the overflow applied in the GEMM's own epilogue
        const at::Tensor workspace =
            new_cuda({int64_t(plan.workspace_bytes)}, a.options().dtype(at::kByte));
        run_fp16_product(plan, p, plan.workspace_bytes ? workspace.data_ptr() : nullptr,
                         current_stream());
        return product;
      }
    }
    at::Tensor product = at::mm(a, b, at::kFloat);
    if (fp16) fp16_overflow_(product.data_ptr<float>(), product.numel(), current_stream());
    return product;
  }
  if (a.element_size() == 2) {
    // 16-bit operands: cuBLAS, as at::mm runs it. Nothing to plan (only fp32 products have a 3x
    // split or K-major copies), so no prepare_gemm, whose view of b^T cublas_product would
    // transpose back: two view ops of host time per product, four a backward.
    at::Tensor out = new_cuda({a.size(0), b.size(1)},
                              a.options().memory_format(at::MemoryFormat::Contiguous));
    at::mm_out(out, a, b);
    return out;
  }
  // a . b = a . (b^T)^T: the GEMM of the forward with b^T as its weight, a view (no copy).
  // Only the Hopper 3x plan runs here (its split reads any strides); everything else is cuBLAS,
  // which takes the transposed views as they are, except that in TF32 the dispatcher may ask for
  // K-major copies of MN-major operands (cublas_tf32_k_major_copies says when and what it measured).
  // Our own TF32 kernel needs K-major operands too: with such copies (then Tensor::contiguous),
  // problem 84's TF32 training step took 2.31 ms against 1.60 ms with cuBLAS's (H100).
  PreparedGemm g = prepare_gemm(a, b.t(), std::string(precision), Epilogue::kAffine,
                                WeightSplit::kNeverKeep, op);
  const EpilogueOperands plain;  // a = c = null: the plain product
  const GemmPlan plan = plan_gemm(g, plain);
  if (plan.splits_operands) {
    run_gemm(g, plan, plain);
    return g.out;
  }
  const KMajorCopies copies = cublas_tf32_k_major_copies(g.problem, g.cc_major, g.cc_minor);
  if (copies.x) g.x = k_major_copy(g.x);
  if (!copies.w) {
    cublas_product(g);
    return g.out;
  }
  // w's copy chunk by chunk (its rows are the output's columns): one chunk's copy at a time; one
  // chunk (w_chunk 0) takes w and the output whole, no views.
  const at::Tensor w = g.w, out = g.out;
  const int64_t rows = w.size(0), chunk = copies.w_chunk > 0 ? copies.w_chunk : rows;
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t n = std::min(chunk, rows - c0);
    g.w = at::Tensor();  // the previous chunk's copy freed first: its block serves the next
    g.w = k_major_copy(n == rows ? w : w.narrow(0, c0, n));
    g.out = n == rows ? out : out.narrow(1, c0, n);
    cublas_product(g);
  }
  return out;
}

// The op over to_gemm_dtype (op_args.h): always a new tensor, as the schema says.
at::Tensor gemm_operand_cuda(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t.clone() : to_gemm_dtype(t, dtype);
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY(epifuse, m) {
  // The head's settings are keyword-only with defaults, as in fused_head (head_config.h names
  // them): "*, float? momentum=0.1, float eps=1e-05" and the like.
  using epifuse::head_schema_kwargs;
  m.def(("gemm_affine(Tensor x, Tensor weight, Tensor a, Tensor c, str precision, " +
         head_schema_kwargs({"activation", "negative_slope"}) + ") -> Tensor")
            .c_str());
  m.def("gemm_colstats(Tensor x, Tensor weight, str precision) -> (Tensor, Tensor, Tensor)");
  m.def((std::string("bn_fold_train(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, "
                     "Tensor gamma, Tensor beta, Tensor? pre_scale, Tensor? post_scale, "
                     "Tensor(a!) running_mean, Tensor(b!) running_var, "
                     "Tensor(c!) num_batches_tracked, ") +
         head_schema_kwargs({"momentum", "eps"}) + ") -> (Tensor, Tensor)")
            .c_str());
  m.def((std::string("bn_fold_eval(Tensor? bias, Tensor gamma, Tensor beta, Tensor? pre_scale, "
                     "Tensor? post_scale, Tensor running_mean, Tensor running_var, ") +
         head_schema_kwargs({"eps"}) + ") -> (Tensor, Tensor)")
            .c_str());
  // out_dtype: the output's dtype, z's (None) or float32 from a 16-bit z (autocast).
  // The row passes: the affine, the activation and (affine_softmax) the row softmax.
  const std::string activation = head_schema_kwargs({"activation", "negative_slope"});
  const std::string activation_out =
      head_schema_kwargs({"activation", "negative_slope", "out_dtype"});
  m.def(("affine_softmax(Tensor z, Tensor? a, Tensor? c, " + activation_out + ") -> Tensor")
            .c_str());
  m.def(("affine_softmax_(Tensor(a!) z, Tensor? a, Tensor? c, " + activation + ") -> ()").c_str());
  m.def(("affine_(Tensor(a!) z, Tensor? a, Tensor? c, " + activation + ") -> ()").c_str());
  m.def(("affine(Tensor z, Tensor a, Tensor c, " + activation_out + ") -> Tensor").c_str());
  m.def((std::string("bn_fold_batch(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, "
                     "Tensor gamma, Tensor beta, Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"eps"}) + ") -> (Tensor, Tensor, Tensor)")
            .c_str());
  // moments: [mean (N), biased variance (N), count], float64, as bn_fold_batch returns them.
  m.def((std::string("update_running_stats(Tensor moments, Tensor(a!) running_mean, "
                     "Tensor(b!) running_var, Tensor(c!) num_batches_tracked, ") +
         head_schema_kwargs({"momentum"}) + ") -> ()")
            .c_str());
  // Backward of a head (python/epifuse/fold.py, "backward").
  m.def("softmax_grad_rowdot(Tensor grad, Tensor out) -> Tensor");
  m.def(("head_grad_sums(Tensor grad, Tensor? out, Tensor? rowdot, Tensor z, Tensor? a=None, "
         "Tensor? c=None, " + activation + ") -> Tensor").c_str());
  m.def((std::string("head_grad_coefficients(Tensor sums, Tensor? global_sums, Tensor? colsum, "
                     "Tensor? colsumsq, Tensor moments, Tensor? bias, Tensor gamma, Tensor beta, "
                     "Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"training", "eps"}) +
         ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str());
  m.def(("head_grad_z(Tensor grad, Tensor? out, Tensor? rowdot, Tensor z, Tensor coef, "
         "Tensor? a=None, Tensor? c=None, " + activation + ") -> Tensor").c_str());
  // out_dtype: a's (None) or float32 for 16-bit a and b (written by the GEMM; from fp16 operands,
  // inf where the fp16 product would overflow).
  m.def("backward_matmul(Tensor a, Tensor b, str precision, *, ScalarType? out_dtype=None) -> Tensor");
  // A GEMM operand in the GEMMs' dtype, as the heads under autocast cast x and W (a copy, also
  // when t has it already): fp32 to bf16 / fp16 rounded as Tensor.to rounds (narrowing_cast.cu).
  m.def("gemm_operand(Tensor t, ScalarType dtype) -> Tensor");
  // Build information (no tensors, so one kernel for every backend): the GPU architectures the
  // kernels were compiled for, e.g. "80,90a", and whether they run on compute capability major.minor.
  m.def("built_archs() -> str", []() { return std::string(epifuse::built_archs()); });
  m.def("supports_device(int major, int minor) -> bool",
        [](int64_t major, int64_t minor) { return epifuse::supports_device(int(major), int(minor)); });
  // The fp32 GEMM precisions the ops take: "ieee", "3xtf32", "tf32" (python/epifuse/precision.py).
  m.def("precision_names() -> str[]", []() { return epifuse::precision_names(); });
}

TORCH_LIBRARY_IMPL(epifuse, CUDA, m) {
  m.impl("gemm_affine", &epifuse::gemm_affine_cuda);
  m.impl("gemm_colstats", &epifuse::gemm_colstats_cuda);
  m.impl("bn_fold_train", &epifuse::bn_fold_train_cuda);
  m.impl("bn_fold_eval", &epifuse::bn_fold_eval_cuda);
  m.impl("affine_softmax", &epifuse::affine_softmax_cuda);
  m.impl("affine_softmax_", &epifuse::affine_softmax_inplace_cuda);
  m.impl("affine_", &epifuse::affine_inplace_cuda);
  m.impl("affine", &epifuse::affine_cuda);
  m.impl("bn_fold_batch", &epifuse::bn_fold_batch_cuda);
  m.impl("update_running_stats", &epifuse::update_running_stats_cuda);
  m.impl("softmax_grad_rowdot", &epifuse::softmax_grad_rowdot_cuda);
  m.impl("head_grad_sums", &epifuse::head_grad_sums_cuda);
  m.impl("head_grad_coefficients", &epifuse::head_grad_coefficients_cuda);
  m.impl("head_grad_z", &epifuse::head_grad_z_cuda);
  m.impl("backward_matmul", &epifuse::backward_matmul_cuda);
  m.impl("gemm_operand", &epifuse::gemm_operand_cuda);
}
