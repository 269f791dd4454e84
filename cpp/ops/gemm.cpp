// The GEMM ops: a head's product with its epilogue (the fold applied, or the column statistics
// gathered), the backward's plain products, and the autocast cast of a GEMM operand.
//
//   gemm_affine      y = act(a[n] * (x . W^T) + c[n])     an eval head's whole layer, one GEMM
//   gemm_colstats    z = x . W^T, float64 column sums and sums of squares of z (training)
//   backward_matmul  a . b in the forward's precision (dX, dW); fp32 out from 16-bit operands
//   gemm_operand     t.to(dtype) as a new tensor (autocast's bf16 / fp16 casts of x and W)
#include <torch/library.h>

#include <optional>
#include <string>

#include "dispatch.h"
#include "gemm_runner.h"
#include "op_args.h"
#include "ops.h"

namespace epifuse::ops {

Tensor gemm_affine(const Tensor& x, const Tensor& weight, const Tensor& a, const Tensor& c,
                   c10::string_view precision, c10::string_view activation,
                   double negative_slope) {
  const char* op = "gemm_affine";
  const Activation act = activation_from_name(activation, negative_slope, op);
  check_gemm_operands(x, weight, std::string(precision), op);
  const Tensor a32 = column_vector(a, weight.size(0), op, "a", x);
  const Tensor c32 = column_vector(c, weight.size(0), op, "c", x);
  if (!x.is_cuda()) {
    return EPIFUSE_REFERENCE(gemm_affine)(x, weight, a, c, precision, activation, negative_slope);
  }
  const auto guard = guard_for(x, op, "x");
  PreparedGemm g = prepare_gemm(x, weight, std::string(precision), Epilogue::kAffine,
                                WeightSplit::kMayKeep, op);
  EpilogueOperands ops;
  ops.a = a32.data_ptr<float>();
  ops.c = c32.data_ptr<float>();
  ops.act = act;
  run_gemm(g, ops);
  return g.out;
}

Tensor3 gemm_colstats(const Tensor& x, const Tensor& weight, c10::string_view precision) {
  const char* op = "gemm_colstats";
  check_gemm_operands(x, weight, std::string(precision), op);
  if (!x.is_cuda()) return EPIFUSE_REFERENCE(gemm_colstats)(x, weight, precision);
  const auto guard = guard_for(x, op, "x");
  PreparedGemm g = prepare_gemm(x, weight, std::string(precision), Epilogue::kColumnStats,
                                WeightSplit::kMayKeep, op);
  auto stats_options = g.x.options().dtype(at::kDouble);
  Tensor colsum = new_cuda({g.problem.N}, stats_options);
  Tensor colsumsq = new_cuda({g.problem.N}, stats_options);
  EpilogueOperands ops;
  ops.colsum = colsum.data_ptr<double>();
  ops.colsumsq = colsumsq.data_ptr<double>();
  run_gemm(g, ops);
  return {g.out, colsum, colsumsq};
}

namespace {

// A 16-bit product written in fp32 by the GEMM itself (a head's dW under autocast, in the fp32
// parameters' dtype; dX of an fp32 x): no 16-bit result, no cast pass. From fp16 operands it
// overflows where the fp16 product would (fp16_overflow.cu), so GradScaler sees eager's infs: in
// the epilogue of our Hopper GEMM (sm90_fp16_product.cu), or cuBLAS's product and a pass.
Tensor fp32_product_of_16_bit(const Tensor& a, const Tensor& b) {
  const bool fp16 = a.scalar_type() == at::kHalf;
  const bool b_row_major = b.stride(1) == 1 || b.size(1) == 1;
  if (fp16 && b_row_major && a.size(0) > 0 && b.size(1) > 0 && a.size(1) > 0) {
    Tensor product = new_cuda({a.size(0), b.size(1)}, a.options().dtype(at::kFloat));
    const Fp16Product p{a.size(0), b.size(1), a.size(1), a.data_ptr(), a.stride(0), a.stride(1),
                        b.data_ptr(), b.stride(0), product.data_ptr<float>(), product.stride(0)};
    const auto [major, minor] = compute_capability(a.get_device());
    const Fp16ProductPlan plan = plan_fp16_product(p, a.get_device(), major, minor);
    if (plan.hopper) {  // the overflow applied in the GEMM's own epilogue
      const Tensor workspace =
          new_cuda({int64_t(plan.workspace_bytes)}, a.options().dtype(at::kByte));
      run_fp16_product(plan, p, plan.workspace_bytes ? workspace.data_ptr() : nullptr,
                       current_stream());
      return product;
    }
  }
  Tensor product = at::mm(a, b, at::kFloat);
  if (fp16) fp16_overflow_(product.data_ptr<float>(), product.numel(), current_stream());
  return product;
}

// An fp32 product a . b = a . (b^T)^T: the GEMM of the forward with b^T as its weight, a view (no
// copy). Only the Hopper 3x plan runs here (its split reads any strides); everything else is
// cuBLAS, which takes the transposed views as they are, except that in TF32 the dispatcher may ask
// for K-major copies of MN-major operands (cublas_tf32_k_major_copies says when and what it
// measured). Our own TF32 kernel needs K-major operands too: with such copies (then
// Tensor::contiguous), problem 84's TF32 training step took 2.31 ms against 1.60 ms with cuBLAS's
// (H100).
Tensor fp32_product(const Tensor& a, const Tensor& b, const std::string& precision) {
  const char* op = "backward_matmul";
  PreparedGemm g =
      prepare_gemm(a, b.t(), precision, Epilogue::kAffine, WeightSplit::kNeverKeep, op);
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
  const Tensor w = g.w, out = g.out;
  const int64_t rows = w.size(0), chunk = copies.w_chunk > 0 ? copies.w_chunk : rows;
  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int64_t n = std::min(chunk, rows - c0);
    g.w = Tensor();  // the previous chunk's copy freed first: its block serves the next
    g.w = k_major_copy(n == rows ? w : w.narrow(0, c0, n));
    g.out = n == rows ? out : out.narrow(1, c0, n);
    cublas_product(g);
  }
  return out;
}

}  // namespace

Tensor backward_matmul(const Tensor& a, const Tensor& b, c10::string_view precision,
                       OptDType out_dtype) {
  const char* op = "backward_matmul";
  EPIFUSE_CHECK(a.dim() == 2 && b.dim() == 2, "epifuse::", op, ": expected 2-D a and b, got ",
                a.dim(), "-D and ", b.dim(), "-D");
  check_device(b, op, "b", a);
  EPIFUSE_CHECK(a.scalar_type() == b.scalar_type(),
                "mat1 and mat2 must have the same dtype, but got ", a.scalar_type(), " and ",
                b.scalar_type());
  EPIFUSE_CHECK(a.size(1) == b.size(0), "mat1 and mat2 shapes cannot be multiplied (", a.size(0),
                "x", a.size(1), " and ", b.size(0), "x", b.size(1), ")");
  math_mode(std::string(precision), to_dtype(a, op), op);
  const bool widening = out_dtype && *out_dtype != a.scalar_type();
  EPIFUSE_CHECK(!widening || (*out_dtype == at::kFloat && a.element_size() == 2), "epifuse::", op,
                ": out_dtype must be a's dtype (", a.scalar_type(),
                ") or float32 for 16-bit a and b, got ", out_dtype.value_or(a.scalar_type()));
  if (!a.is_cuda()) return EPIFUSE_REFERENCE(backward_matmul)(a, b, precision, out_dtype);
  const auto guard = guard_for(a, op, "a");
  if (widening) return fp32_product_of_16_bit(a, b);
  if (a.element_size() == 2) {
    // 16-bit operands: cuBLAS, as at::mm runs it. Nothing to plan (only fp32 products have a 3x
    // split or K-major copies), so no prepare_gemm, whose view of b^T cublas_product would
    // transpose back: two view ops of host time per product, four a backward.
    Tensor out = new_cuda({a.size(0), b.size(1)},
                          a.options().memory_format(at::MemoryFormat::Contiguous));
    at::mm_out(out, a, b);
    return out;
  }
  return fp32_product(a, b, std::string(precision));
}

// The op over to_gemm_dtype (op_args.h): always a new tensor, as the schema says.
Tensor gemm_operand(const Tensor& t, at::ScalarType dtype) {
  if (!t.is_cuda()) return EPIFUSE_REFERENCE(gemm_operand)(t, dtype);
  return t.scalar_type() == dtype ? t.clone() : to_gemm_dtype(t, dtype);
}

namespace {

std::vector<std::string> schemas() {
  const std::string activation = head_schema_kwargs({"activation", "negative_slope"});
  return {
      "gemm_affine(Tensor x, Tensor weight, Tensor a, Tensor c, str precision, " + activation +
          ") -> Tensor",
      "gemm_colstats(Tensor x, Tensor weight, str precision) -> (Tensor, Tensor, Tensor)",
      // out_dtype: a's (None) or float32 for 16-bit a and b (written by the GEMM; from fp16
      // operands, inf where the fp16 product would overflow).
      "backward_matmul(Tensor a, Tensor b, str precision, *, ScalarType? out_dtype=None) -> Tensor",
      // A GEMM operand in the GEMMs' dtype, as the heads under autocast cast x and W (a copy, also
      // when t has it already): fp32 to bf16 / fp16 rounded as Tensor.to rounds.
      "gemm_operand(Tensor t, ScalarType dtype) -> Tensor",
  };
}

void impls(torch::Library& m) {
  m.impl("gemm_affine", &gemm_affine);
  m.impl("gemm_colstats", &gemm_colstats);
  m.impl("backward_matmul", &backward_matmul);
  m.impl("gemm_operand", &gemm_operand);
}

}  // namespace
}  // namespace epifuse::ops

EPIFUSE_REGISTER_OPS(epifuse::ops::schemas, epifuse::ops::impls)
