// The autograd and autocast kernels of fused_linear (linear.cpp), in C++ as the head's are
// (head_autograd.cpp says why: a Python autograd wrapper's host time).
//
//   Autograd      one node (FusedLinear) whose backward runs linear_backward; once
//                 differentiable (FusedLinearBackward raises on a second differentiation)
//   AutocastCUDA  the GEMM in the autocast dtype, the output in the dtype eager's modules give
//                 (nn.Linear's: the autocast dtype; fp32 after a softmax, one of autocast's fp32
//                 ops)
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "dispatch.h"
#include "head.h"
#include "linear.h"
#include "weight_split_cache.h"

namespace epifuse {

using namespace ops;  // NOLINT: the Linear's types and sequence (ops.h, linear.h)

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd functions' arguments, which their backwards return one gradient (or none) for.
constexpr int kForwardArgs = 4;   // FusedLinear: x, weight, bias, the HeadConfig
constexpr int kBackwardArgs = 8;  // FusedLinearBackward: 5 tensors, needs, param dtype, config

}  // namespace

// Runs the backward as a function of its own so that a second differentiation (create_graph=True,
// then backward through the gradients) raises instead of silently giving no gradient.
struct FusedLinearBackward : torch::autograd::Function<FusedLinearBackward> {
  // The saved tensors as optionals: Function::apply reads the autograd metadata of every
  // (defined) tensor argument, and an unsaved one is undefined.
  static variable_list forward(AutogradContext*, const Tensor& grad, const OptTensor& x,
                               const OptTensor& weight, const OptTensor& out, const OptTensor& h,
                               LinearNeeds needs, at::ScalarType param_dtype,
                               const HeadConfig& cfg) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const auto r = linear_backward(grad, x.value_or(Tensor()), weight.value_or(Tensor()),
                                   out.value_or(Tensor()), h.value_or(Tensor()), needs,
                                   param_dtype, cfg);
    // Function::apply takes defined outputs only: an empty tensor for a gradient not asked for.
    const auto or_empty = [&](const Tensor& t) { return t.defined() ? t : at::empty({0}, grad.options()); };
    return {or_empty(r[0]), or_empty(r[1]), or_empty(r[2])};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "epifuse::fused_linear: trying to differentiate twice; its fused backward is once "
                "differentiable (double backward is not supported)");
    return variable_list(kBackwardArgs);
  }
};

// Named outside the anonymous namespace: grad_fn.name() shows "...CppNode<epifuse::FusedLinear>".
struct FusedLinear : torch::autograd::Function<FusedLinear> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const HeadConfig& cfg) {
    Tensor out, h, x_gemm, w_gemm;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      // The GEMM's operands (autocast: 16-bit casts; the weight's kept for the step), cast once
      // here so that the backward reuses them.
      const WeightOperandsKept keep(keep_policy(cfg));
      x_gemm = gemm_input(x, cfg);
      w_gemm = gemm_weight(weight, cfg);
      // Through the dispatcher (not fused_linear_forward itself), so that tracing (FakeTensor,
      // torch.compile) reaches the fake kernel.
      std::tie(out, h) = EPIFUSE_OP(fused_linear).call(
          x_gemm, w_gemm, bias, cfg.precision, cfg.softmax, cfg.activation, cfg.negative_slope,
          cfg.gemm_dtype, cfg.out_dtype, cfg.for_backward);
    }
    ctx->mark_non_differentiable({h});
    ctx->set_materialize_grads(false);
    // dX needs W, dW needs x (as eager's mm keeps them); out for a softmax's or an activation's
    // derivative, h (non-empty) where the activation's derivative reads its input.
    const bool keep_x = weight.requires_grad(), keep_w = x.requires_grad();
    ctx->save_for_backward({keep_x ? x_gemm : Tensor(), keep_w ? w_gemm : Tensor(),
                            cfg.softmax || !cfg.activation.empty() ? out : Tensor(),
                            keeps_pre_activation(cfg) ? h : Tensor()});
    save_head_config(ctx, cfg);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["param_dtype"] = weight.scalar_type();
    return {out, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    variable_list result(kForwardArgs);
    // The step's forwards are over: the weight operands they shared go (weight_split_cache.h).
    release_step_operands();
    if (!grads[0].defined()) return result;
    const variable_list saved = ctx->get_saved_variables();
    HeadConfig cfg = load_head_config(ctx);
    cfg.grad_x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    const auto param_dtype = ctx->saved_data["param_dtype"].toScalarType();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const LinearNeeds needs{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                            has_bias && ctx->needs_input_grad(2)};
    std::array<Tensor, 3> r;
    if (at::GradMode::is_enabled()) {  // create_graph: a node that refuses a second backward
      const auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; };
      const variable_list g =
          FusedLinearBackward::apply(grads[0], opt(saved[0]), opt(saved[1]), opt(saved[2]),
                                     opt(saved[3]), needs, param_dtype, cfg);
      r = {g[0], g[1], g[2]};
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      r = linear_backward(grads[0], saved[0], saved[1], saved[2], saved[3], needs, param_dtype,
                          cfg);
    }
    for (int i = 0; i < 3; ++i) {
      if (needs[i]) result[i] = r[i];
    }
    // dX in x's dtype where the backward could not write it so (the GEMM 16-bit, x float64).
    if (result[0].defined() && result[0].scalar_type() != *cfg.grad_x_dtype) {
      result[0] = result[0].to(*cfg.grad_x_dtype);
    }
    return result;
  }
};

namespace {

Tensor2 fused_linear_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                              c10::string_view precision, bool softmax,
                              c10::string_view activation, double negative_slope,
                              OptDType gemm_dtype, OptDType out_dtype, bool for_backward) {
  const HeadConfig cfg = linear_config(precision, softmax, activation, negative_slope, gemm_dtype,
                                       out_dtype, for_backward);
  if (!for_backward) {  // no autograd node: nothing is kept
    const bool records = at::GradMode::is_enabled() &&
                         (x.requires_grad() || weight.requires_grad() ||
                          (bias && bias->requires_grad()));
    TORCH_CHECK(!records, "epifuse::fused_linear: for_backward=False, but an input requires grad "
                "under grad mode (call it with for_backward=True, or under torch.no_grad())");
    return call_below_autograd(EPIFUSE_OP(fused_linear), x, weight, bias, precision, softmax,
                               activation, negative_slope, gemm_dtype, out_dtype, for_backward);
  }
  const variable_list r = FusedLinear::apply(x, weight, bias, cfg);
  return {r[0], r[1]};
}

// AutocastCUDA: the GEMM in the autocast dtype (x and W cast by the autograd kernel, which keeps
// the casts for the backward), the output in nn.Linear's dtype under the same autocast (the
// autocast dtype; float32 after a softmax). Read at call time, so nested and disabled regions are
// followed; inputs autocast would not cast (float64) pass through.
Tensor2 fused_linear_autocast(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                              c10::string_view precision, bool softmax,
                              c10::string_view activation, double negative_slope,
                              OptDType gemm_dtype, OptDType out_dtype, bool for_backward) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  if (!gemm_dtype && at::autocast::is_autocast_eligible(x, c10::DeviceType::CUDA) &&
      at::autocast::is_autocast_eligible(weight, c10::DeviceType::CUDA)) {
    const at::ScalarType d = at::autocast::get_autocast_dtype(at::kCUDA);
    gemm_dtype = d;
    if (!out_dtype) out_dtype = softmax ? at::kFloat : d;
  }
  return EPIFUSE_OP(fused_linear).call(x, weight, bias, precision, softmax, activation,
                                       negative_slope, gemm_dtype, out_dtype, for_backward);
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY_IMPL(epifuse, AutocastCUDA, m) {
  m.impl("fused_linear", &epifuse::fused_linear_autocast);
}

TORCH_LIBRARY_IMPL(epifuse, Autograd, m) {
  m.impl("fused_linear", &epifuse::fused_linear_autograd);
}
