// The backward's passes of a head (python/epifuse/fold.py's backward section has the math):
//
//   softmax_grad_rowdot     sum_n grad[m, n] * out[m, n] per row: the softmax backward's row term
//   head_grad_sums          float64 [S1 (N), S3 (N), M]: column sums of dv and dv * z
//   head_grad_coefficients  dz's per-column coefficients A, B, C and the [N] parameter gradients
//   head_grad_z             dz = A * dv + B * z + C, in z's dtype
//
// dv is the gradient at the activation's input: grad through the softmax (out, rowdot) and the
// activation's derivative at h = a * z + c (a, c: the forward's fold). The backward's GEMMs are
// backward_matmul (gemm.cpp).
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "dispatch.h"
#include "op_args.h"
#include "ops.h"

namespace epifuse::ops {
namespace {

// The [M, N] operands of the backward passes, checked (one shape, dtype and device; out and rowdot
// both or neither) and with unit column stride (a copy otherwise: an expanded gradient, e.g. of
// y.sum(), has stride 0). Its pointers are bound for any device; only CUDA launches with them.
struct PreparedGrad {
  GradOperands o;
  Tensor g, out, rowdot, z, a, c;  // keep the (possibly copied) operands alive
};

// The activation of a head's backward and the forward's fold it recomputes h = a * z + c from.
void prepare_activation(PreparedGrad& p, const Tensor& z, const OptTensor& a, const OptTensor& c,
                        c10::string_view activation, double negative_slope, const char* op) {
  p.o.act = activation_from_name(activation, negative_slope, op);
  if (p.o.act.kind == ActivationKind::kNone) return;
  EPIFUSE_CHECK(a.has_value() && c.has_value(), "epifuse::", op, ": activation '",
                std::string(activation), "' needs a and c (the forward's fold)");
  p.a = column_vector(*a, p.o.N, op, "a", z);
  p.c = column_vector(*c, p.o.N, op, "c", z);
  p.o.a = p.a.data_ptr<float>();
  p.o.c = p.c.data_ptr<float>();
}

// z_name: how the op calls z (softmax_grad_rowdot's stands-in is its `out`).
PreparedGrad prepare_grad(const Tensor& grad, const OptTensor& out, const OptTensor& rowdot,
                          const Tensor& z, const char* op, const char* z_name = "z") {
  EPIFUSE_CHECK(z.dim() == 2, "epifuse::", op, ": expected z to be 2-D [M, N], got ", z.dim(), "-D");
  PreparedGrad p;
  p.o.z_dtype = to_dtype(z, op);
  // grad and out share one dtype: z's, or float32 over a 16-bit z (a head's fp32 output under
  // autocast).
  const at::ScalarType g_dtype =
      grad.scalar_type() == at::kFloat && z.element_size() == 2 ? at::kFloat : z.scalar_type();
  auto check_like_z = [&](const Tensor& t, const char* name) {
    check_device(t, op, name, z);
    EPIFUSE_CHECK(t.scalar_type() == g_dtype, "epifuse::", op, ": expected ", name,
                  " to have dtype ", g_dtype, " like ", g_dtype == z.scalar_type() ? z_name : "grad",
                  ", got ", t.scalar_type());
    EPIFUSE_CHECK(t.sizes() == z.sizes(), "epifuse::", op, ": expected ", name, " of shape ",
                  z.sizes(), " like ", z_name, ", got ", t.sizes());
  };
  check_like_z(grad, "grad");
  p.o.dtype = to_dtype(grad, op);
  EPIFUSE_CHECK(out.has_value() == rowdot.has_value(), "epifuse::", op,
                ": pass both out and rowdot (softmax heads), or neither");
  p.o.M = z.size(0);
  p.o.N = z.size(1);
  if (out) {
    check_like_z(*out, "out");
    p.rowdot = column_vector(*rowdot, p.o.M, op, "rowdot", z);
  }
  if (!z.is_cuda()) return p;  // the reference reads the tensors as they are
  p.g = rows_with_unit_stride(grad);
  p.z = rows_with_unit_stride(z);
  p.o.g = p.g.data_ptr();
  p.o.ld_g = p.g.stride(0);
  p.o.z = p.z.data_ptr();
  p.o.ld_z = p.z.stride(0);
  if (out) {
    p.out = rows_with_unit_stride(*out);
    p.o.out = p.out.data_ptr();
    p.o.ld_out = p.out.stride(0);
    p.o.rowdot = p.rowdot.data_ptr<float>();
  }
  return p;
}

// A parameter's gradient: its dtype and shape; an absent parameter gets an empty float32 tensor.
Tensor param_grad(const OptTensor& param, const Tensor& gamma) {
  return param ? new_cuda(param->sizes(), param->options())
               : new_cuda({0}, gamma.options().dtype(at::kFloat));
}

void* data_or_null(const OptTensor& param, const Tensor& grad) {
  return param ? grad.data_ptr() : nullptr;
}

}  // namespace

Tensor softmax_grad_rowdot(const Tensor& grad, const Tensor& out) {
  const char* op = "softmax_grad_rowdot";
  EPIFUSE_CHECK(out.dim() == 2, "epifuse::", op, ": expected out to be 2-D [M, N], got ", out.dim(),
                "-D");
  // The kernel reads out as grad's type: prepare_grad's fp32-grad-over-16-bit-z rule does not
  // hold here, where out stands as z (an fp32 grad over a bf16 out would be read past its end).
  EPIFUSE_CHECK(grad.scalar_type() == out.scalar_type(), "epifuse::", op,
                ": expected grad to have dtype ", out.scalar_type(), " like out, got ",
                grad.scalar_type());
  // prepare_grad takes (out, rowdot) together; rowdot is this op's output, so out stands as z.
  PreparedGrad p = prepare_grad(grad, std::nullopt, std::nullopt, out, op, "out");
  if (!out.is_cuda()) return EPIFUSE_REFERENCE(softmax_grad_rowdot)(grad, out);
  const auto guard = guard_for(out, op, "out");
  Tensor rowdot = new_cuda({out.size(0)}, out.options().dtype(at::kFloat));
  p.o.out = p.o.z;
  p.o.ld_out = p.o.ld_z;
  ::epifuse::softmax_grad_rowdot(p.o, rowdot.data_ptr<float>(), current_stream());
  return rowdot;
}

Tensor head_grad_sums(const Tensor& grad, const OptTensor& out, const OptTensor& rowdot,
                      const Tensor& z, const OptTensor& a, const OptTensor& c,
                      c10::string_view activation, double negative_slope) {
  const char* op = "head_grad_sums";
  PreparedGrad p = prepare_grad(grad, out, rowdot, z, op);
  prepare_activation(p, z, a, c, activation, negative_slope, op);
  if (!z.is_cuda()) {
    return EPIFUSE_REFERENCE(head_grad_sums)(grad, out, rowdot, z, a, c, activation,
                                             negative_slope);
  }
  const auto guard = guard_for(z, op, "z");
  if (p.o.N == 0) return at::full({1}, double(p.o.M), z.options().dtype(at::kDouble));
  Tensor sums = new_cuda({2 * p.o.N + 1}, z.options().dtype(at::kDouble));
  const size_t scratch_bytes = head_grad_sums_scratch_bytes(p.o);
  Tensor scratch;
  if (scratch_bytes > 0) scratch = new_cuda({int64_t(scratch_bytes)}, z.options().dtype(at::kByte));
  ::epifuse::head_grad_sums(p.o, sums.data_ptr<double>(),
                            scratch_bytes > 0 ? scratch.data_ptr() : nullptr, current_stream());
  return sums;
}

Tensor6 head_grad_coefficients(const Tensor& sums, const OptTensor& global_sums,
                               const OptTensor& colsum, const OptTensor& colsumsq,
                               const Tensor& moments, const OptTensor& bias, const Tensor& gamma,
                               const Tensor& beta, const OptTensor& pre_scale,
                               const OptTensor& post_scale, bool training, double eps) {
  const char* op = "head_grad_coefficients";
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
  }
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(head_grad_coefficients)(sums, global_sums, colsum, colsumsq, moments,
                                                     bias, gamma, beta, pre_scale, post_scale,
                                                     training, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  if (training) {
    p.colsum = colsum->data_ptr<double>();
    p.colsumsq = colsumsq->data_ptr<double>();
  }
  p.training = training;
  p.sums = sums.data_ptr<double>();
  p.global_sums = global_sums ? global_sums->data_ptr<double>() : nullptr;
  p.moments = moments.data_ptr<double>();
  Tensor coef = new_cuda({3, N}, gamma.options().dtype(at::kFloat));
  Tensor g_bias = param_grad(bias, gamma), g_pre = param_grad(pre_scale, gamma);
  Tensor g_post = param_grad(post_scale, gamma);
  Tensor g_gamma = new_cuda(gamma.sizes(), gamma.options());
  Tensor g_beta = new_cuda(beta.sizes(), beta.options());
  p.coef = coef.data_ptr<float>();
  p.grad_bias = data_or_null(bias, g_bias);
  p.grad_gamma = g_gamma.data_ptr();
  p.grad_beta = g_beta.data_ptr();
  p.grad_pre = data_or_null(pre_scale, g_pre);
  p.grad_post = data_or_null(post_scale, g_post);
  const size_t scratch_bytes = head_grad_coefficients_scratch_bytes(p.params);
  Tensor scratch;
  if (scratch_bytes > 0) scratch = new_cuda({int64_t(scratch_bytes)}, gamma.options().dtype(at::kByte));
  ::epifuse::head_grad_coefficients(p, scratch_bytes > 0 ? scratch.data_ptr() : nullptr,
                                    current_stream());
  return {coef, g_bias, g_gamma, g_beta, g_pre, g_post};
}

Tensor head_grad_z(const Tensor& grad, const OptTensor& out, const OptTensor& rowdot,
                   const Tensor& z, const Tensor& coef, const OptTensor& a, const OptTensor& c,
                   c10::string_view activation, double negative_slope) {
  const char* op = "head_grad_z";
  PreparedGrad p = prepare_grad(grad, out, rowdot, z, op);
  prepare_activation(p, z, a, c, activation, negative_slope, op);
  check_device(coef, op, "coef", z);
  EPIFUSE_CHECK(coef.scalar_type() == at::kFloat && coef.dim() == 2 && coef.size(0) == 3 &&
                    coef.size(1) == p.o.N,
                "epifuse::", op, ": expected coef to be a float32 [3, ", p.o.N, "] tensor, got ",
                coef.scalar_type(), " ", coef.sizes());
  if (!z.is_cuda()) {
    return EPIFUSE_REFERENCE(head_grad_z)(grad, out, rowdot, z, coef, a, c, activation,
                                          negative_slope);
  }
  const auto guard = guard_for(z, op, "z");
  const Tensor coef_c = coef.contiguous();
  Tensor dz = new_cuda(z.sizes(), z.options().memory_format(at::MemoryFormat::Contiguous));
  ::epifuse::head_grad_z(p.o, coef_c.data_ptr<float>(), dz.data_ptr(),
                         std::max<int64_t>(p.o.N, 1), current_stream());
  return dz;
}

namespace {

std::vector<std::string> schemas() {
  const std::string activation = head_schema_kwargs({"activation", "negative_slope"});
  return {
      "softmax_grad_rowdot(Tensor grad, Tensor out) -> Tensor",
      "head_grad_sums(Tensor grad, Tensor? out, Tensor? rowdot, Tensor z, Tensor? a=None, "
      "Tensor? c=None, " + activation + ") -> Tensor",
      // (coef [3, N] float32 = A, B, C of dz; the gradients of bias, gamma, beta, pre_scale,
      // post_scale in their dtype and shape, an absent parameter's empty).
      "head_grad_coefficients(Tensor sums, Tensor? global_sums, Tensor? colsum, Tensor? colsumsq, "
      "Tensor moments, Tensor? bias, Tensor gamma, Tensor beta, Tensor? pre_scale, "
      "Tensor? post_scale, " + head_schema_kwargs({"training", "eps"}) +
          ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      "head_grad_z(Tensor grad, Tensor? out, Tensor? rowdot, Tensor z, Tensor coef, "
      "Tensor? a=None, Tensor? c=None, " + activation + ") -> Tensor",
  };
}

void impls(torch::Library& m) {
  m.impl("softmax_grad_rowdot", &softmax_grad_rowdot);
  m.impl("head_grad_sums", &head_grad_sums);
  m.impl("head_grad_coefficients", &head_grad_coefficients);
  m.impl("head_grad_z", &head_grad_z);
}

}  // namespace
}  // namespace epifuse::ops

EPIFUSE_REGISTER_OPS(epifuse::ops::schemas, epifuse::ops::impls)
