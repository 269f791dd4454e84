// epifuse::fused_head and epifuse::fused_head_backward: the head as one op per direction.
//
//   fused_head           gemm_colstats -> fold (batch: bn_fold_batch; synchronized: the
//                        synced_batch_fold hook; eval: bn_fold_eval) -> affine_softmax / affine
//   fused_head_backward  softmax_grad_rowdot (softmax heads) -> head_grad_sums
//                        (-> the synced_grad_sums hook when synchronized) -> head_grad_coefficients
//                        -> head_grad_z -> backward_matmul (dX, dW)
//
// Both are composites of the per-pass ops, written once against the dispatcher: the CUDA kernels
// and the float64 CPU kernels (python/epifuse/ops.py) run under the same sequence. Their autograd
// lives here too, in C++: a Python autograd wrapper (torch.library.register_autograd) cost ~0.3 ms of
// host time per training step on the H100 machine, more than a step of problem 84 in bf16 spends on
// everything but its GEMMs. The fake kernels and the synchronized-statistics hooks (the cross-rank
// reductions, torch.distributed) are registered from Python (python/epifuse/fused_head.py).
//
// fused_head is functional: it leaves the running statistics alone (the caller updates them from
// the returned column sums), so torch.compile and opcheck see an op without mutation.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace epifuse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Needs = std::array<bool, 6>;  // x, weight, bias, gamma, beta, scale

template <class Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The per-pass ops, looked up once (the hooks lazily: Python registers them after this library loads).
#define EPIFUSE_OP(handle, name, ...)                    \
  const auto& handle() {                                 \
    static const auto h = op<__VA_ARGS__>("epifuse::" name); \
    return h;                                            \
  }
EPIFUSE_OP(gemm_colstats, "gemm_colstats", Tensor3(const Tensor&, const Tensor&, c10::string_view))
EPIFUSE_OP(bn_fold_eval, "bn_fold_eval",
           std::tuple<Tensor, Tensor>(const OptTensor&, const Tensor&, const Tensor&,
                                      const OptTensor&, const OptTensor&, const Tensor&,
                                      const Tensor&, double))
EPIFUSE_OP(bn_fold_batch, "bn_fold_batch",
           Tensor3(const Tensor&, const Tensor&, int64_t, const OptTensor&, const Tensor&,
                   const Tensor&, const OptTensor&, const OptTensor&, double))
EPIFUSE_OP(synced_batch_fold, "synced_batch_fold",
           Tensor3(const Tensor&, const Tensor&, int64_t, const OptTensor&, const Tensor&,
                   const Tensor&, const OptTensor&, const OptTensor&, double, c10::string_view))
EPIFUSE_OP(affine_softmax, "affine_softmax", Tensor(const Tensor&, const OptTensor&, const OptTensor&))
EPIFUSE_OP(affine, "affine", Tensor(const Tensor&, const Tensor&, const Tensor&))
EPIFUSE_OP(softmax_grad_rowdot, "softmax_grad_rowdot", Tensor(const Tensor&, const Tensor&))
EPIFUSE_OP(head_grad_sums, "head_grad_sums",
           Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&))
EPIFUSE_OP(synced_grad_sums, "synced_grad_sums",
           Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                  const OptTensor&, double, c10::string_view))
EPIFUSE_OP(head_grad_coefficients, "head_grad_coefficients",
           Tensor6(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                   const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&,
                   const OptTensor&, bool, double))
EPIFUSE_OP(head_grad_z, "head_grad_z",
           Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&))
EPIFUSE_OP(backward_matmul, "backward_matmul", Tensor(const Tensor&, const Tensor&, c10::string_view))
EPIFUSE_OP(fused_head_op, "fused_head",
           Tensor5(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                   const Tensor&, const Tensor&, const Tensor&, c10::string_view, bool, bool, bool,
                   double, c10::string_view))
EPIFUSE_OP(fused_head_backward_op, "fused_head_backward",
           Tensor6(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                   const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                   const OptTensor&, const OptTensor&, const Tensor&, c10::string_view, bool, bool,
                   bool, double, c10::string_view, Needs))
#undef EPIFUSE_OP

// Problem 39's scale multiplies BatchNorm's input, problem 84's its output: (pre_scale, post_scale).
std::pair<OptTensor, OptTensor> scales(const Tensor& scale, bool scale_before_bn) {
  if (scale_before_bn) return {scale, std::nullopt};
  return {std::nullopt, scale};
}

// fold.moments_vector(running_mean, running_var, 0): what eval mode normalized with.
Tensor running_moments(const Tensor& running_mean, const Tensor& running_var) {
  const auto f64 = running_mean.options().dtype(at::kDouble);
  return at::cat({running_mean.to(at::kDouble), running_var.to(at::kDouble), at::zeros({1}, f64)});
}

// ---- the composites (CPU and CUDA) ---------------------------------------------------------------

Tensor5 fused_head(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& gamma,
                   const Tensor& beta, const Tensor& scale, const Tensor& running_mean,
                   const Tensor& running_var, c10::string_view precision, bool training,
                   bool scale_before_bn, bool softmax, double eps, c10::string_view group_name) {
  const auto [pre, post] = scales(scale, scale_before_bn);
  auto [z, colsum, colsumsq] = gemm_colstats().call(x, weight, precision);
  Tensor a, c, moments;
  if (!training) {
    std::tie(a, c) = bn_fold_eval().call(bias, gamma, beta, pre, post, running_mean, running_var, eps);
    moments = running_moments(running_mean, running_var);
  } else if (!group_name.empty()) {  // statistics over every rank of the group
    std::tie(a, c, moments) = synced_batch_fold().call(colsum, colsumsq, x.size(0), bias, gamma,
                                                       beta, pre, post, eps, group_name);
  } else {
    std::tie(a, c, moments) =
        bn_fold_batch().call(colsum, colsumsq, x.size(0), bias, gamma, beta, pre, post, eps);
  }
  Tensor out = softmax ? affine_softmax().call(z, a, c) : affine().call(z, a, c);
  return {out, z, colsum, colsumsq, moments};
}

// dX and dW are computed only where needs asks (else empty tensors); the [N] parameter gradients
// always (one kernel computes them all).
Tensor6 fused_head_backward(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                            const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                            const Tensor& scale, const Tensor& z, const OptTensor& out,
                            const OptTensor& colsum, const OptTensor& colsumsq,
                            const Tensor& moments, c10::string_view precision, bool training,
                            bool scale_before_bn, bool softmax, double eps,
                            c10::string_view group_name, Needs needs) {
  TORCH_CHECK(!softmax || out.has_value(), "epifuse::fused_head_backward: a softmax head needs out");
  TORCH_CHECK(!needs[0] || weight.has_value(), "epifuse::fused_head_backward: dX needs weight");
  TORCH_CHECK(!needs[1] || x.has_value(), "epifuse::fused_head_backward: dW needs x");
  const auto [pre, post] = scales(scale, scale_before_bn);
  const OptTensor rowdot = softmax ? OptTensor(softmax_grad_rowdot().call(grad, *out)) : std::nullopt;
  const OptTensor softmax_out = softmax ? out : std::nullopt;
  const Tensor sums = head_grad_sums().call(grad, softmax_out, rowdot, z);
  // du (hence dz, d bias and a scale before BatchNorm) needs the batch terms of every rank:
  // nn.SyncBatchNorm's condition, so ranks on the reference path issue the same all_reduce.
  const bool need_du = needs[0] || needs[1] || needs[2] || (scale_before_bn && needs[5]);
  OptTensor global_sums;
  if (training && !group_name.empty() && need_du) {
    global_sums = synced_grad_sums().call(sums, moments, bias, gamma, pre, post, eps, group_name);
  }
  auto [coef, g_bias, g_gamma, g_beta, g_pre, g_post] = head_grad_coefficients().call(
      sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta, pre, post, training, eps);
  Tensor grad_x = at::empty({0}, grad.options()), grad_w = at::empty({0}, grad.options());
  if (needs[0] || needs[1]) {
    const Tensor dz = head_grad_z().call(grad, softmax_out, rowdot, z, coef);
    if (needs[0]) grad_x = backward_matmul().call(dz, *weight, precision);
    if (needs[1]) grad_w = backward_matmul().call(dz.t(), *x, precision);
  }
  return {grad_x, grad_w, g_bias, g_gamma, g_beta, scale_before_bn ? g_pre : g_post};
}

// ---- autograd --------------------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int kForwardArgs = 14;   // fused_head's arguments
constexpr int kBackwardArgs = 19;  // fused_head_backward's

}  // namespace

// Named outside the anonymous namespace: grad_fn.name() shows "...CppNode<epifuse::FusedHead>".
struct FusedHead : torch::autograd::Function<FusedHead> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                               const Tensor& scale, const Tensor& running_mean,
                               const Tensor& running_var, c10::string_view precision,
                               bool training, bool scale_before_bn, bool softmax, double eps,
                               c10::string_view group_name) {
    Tensor out, z, colsum, colsumsq, moments;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, z, colsum, colsumsq, moments) = fused_head_op().call(
          x, weight, bias, gamma, beta, scale, running_mean, running_var, precision, training,
          scale_before_bn, softmax, eps, group_name);
    }
    ctx->mark_non_differentiable({z, colsum, colsumsq, moments});
    ctx->set_materialize_grads(false);
    // dX needs W, dW needs x (kept only then, as eager's mm does); z and out are the [M, N]
    // tensors kept.
    ctx->save_for_backward({weight.requires_grad() ? x : Tensor(),
                            x.requires_grad() ? weight : Tensor(), bias.value_or(Tensor()), gamma,
                            beta, scale, z, softmax ? out : Tensor(),
                            training ? colsum : Tensor(), training ? colsumsq : Tensor(), moments});
    ctx->saved_data["precision"] = std::string(precision);
    ctx->saved_data["group_name"] = std::string(group_name);
    ctx->saved_data["training"] = training;
    ctx->saved_data["scale_before_bn"] = scale_before_bn;
    ctx->saved_data["softmax"] = softmax;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return {out, z, colsum, colsumsq, moments};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kForwardArgs);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return result;
    const variable_list s = ctx->get_saved_variables();
    auto opt = [](const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; };
    // Edges exist for the tensor arguments only: an absent bias has none.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto needs_arg = [&](int arg) {
      const int edge = arg < 2 || has_bias ? arg : arg - 1;
      return ctx->needs_input_grad(edge);
    };
    const Needs needs{needs_arg(0), needs_arg(1), has_bias && needs_arg(2), needs_arg(3),
                      needs_arg(4), needs_arg(5)};
    const std::string precision = ctx->saved_data["precision"].toStringRef();
    const std::string group_name = ctx->saved_data["group_name"].toStringRef();
    auto grads_in = fused_head_backward_op().call(
        grad, opt(s[0]), opt(s[1]), opt(s[2]), s[3], s[4], s[5], s[6], opt(s[7]), opt(s[8]),
        opt(s[9]), s[10], precision, ctx->saved_data["training"].toBool(),
        ctx->saved_data["scale_before_bn"].toBool(), ctx->saved_data["softmax"].toBool(),
        ctx->saved_data["eps"].toDouble(), group_name, needs);
    const std::array<Tensor, 6> all{std::get<0>(grads_in), std::get<1>(grads_in),
                                    std::get<2>(grads_in), std::get<3>(grads_in),
                                    std::get<4>(grads_in), std::get<5>(grads_in)};
    for (int i = 0; i < 6; ++i) {
      if (needs[i]) result[i] = all[i];
    }
    return result;
  }
};

// The backward is once differentiable: its own backward (reached only through create_graph=True
// and a second differentiation) raises, as Python's @once_differentiable does.
struct FusedHeadBackward : torch::autograd::Function<FusedHeadBackward> {
  static variable_list forward(AutogradContext*, const Tensor& grad, const OptTensor& x,
                               const OptTensor& weight, const OptTensor& bias, const Tensor& gamma,
                               const Tensor& beta, const Tensor& scale, const Tensor& z,
                               const OptTensor& out, const OptTensor& colsum,
                               const OptTensor& colsumsq, const Tensor& moments,
                               c10::string_view precision, bool training, bool scale_before_bn,
                               bool softmax, double eps, c10::string_view group_name, Needs needs) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto r = fused_head_backward_op().call(grad, x, weight, bias, gamma, beta, scale, z, out,
                                           colsum, colsumsq, moments, precision, training,
                                           scale_before_bn, softmax, eps, group_name, needs);
    return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r),
            std::get<5>(r)};
  }

  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "epifuse::fused_head: trying to differentiate twice; its fused backward is once "
                "differentiable (double backward is not supported)");
    return variable_list(kBackwardArgs);
  }
};

namespace {

Tensor5 fused_head_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                            const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                            const Tensor& running_mean, const Tensor& running_var,
                            c10::string_view precision, bool training, bool scale_before_bn,
                            bool softmax, double eps, c10::string_view group_name) {
  const variable_list r =
      FusedHead::apply(x, weight, bias, gamma, beta, scale, running_mean, running_var, precision,
                       training, scale_before_bn, softmax, eps, group_name);
  return {r[0], r[1], r[2], r[3], r[4]};
}

Tensor6 fused_head_backward_autograd(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                                     const OptTensor& bias, const Tensor& gamma,
                                     const Tensor& beta, const Tensor& scale, const Tensor& z,
                                     const OptTensor& out, const OptTensor& colsum,
                                     const OptTensor& colsumsq, const Tensor& moments,
                                     c10::string_view precision, bool training,
                                     bool scale_before_bn, bool softmax, double eps,
                                     c10::string_view group_name, Needs needs) {
  const variable_list r = FusedHeadBackward::apply(
      grad, x, weight, bias, gamma, beta, scale, z, out, colsum, colsumsq, moments, precision,
      training, scale_before_bn, softmax, eps, group_name, needs);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY_FRAGMENT(epifuse, m) {
  // (out, z, colsum, colsumsq, moments): the head's output; the GEMM output z and moments (the
  // statistics u was normalized with, fold.moments_vector) for the backward; this batch's column
  // sums for the caller's running-statistics update. group_name non-empty: batch statistics over
  // that process group's ranks.
  m.def(
      "fused_head(Tensor x, Tensor weight, Tensor? bias, Tensor gamma, Tensor beta, Tensor scale, "
      "Tensor running_mean, Tensor running_var, str precision, bool training, "
      "bool scale_before_bn, bool softmax, float eps, str group_name) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (grad_x, grad_weight, grad_bias, grad_gamma, grad_beta, grad_scale); needs: which of
  // x, weight, bias, gamma, beta, scale want a gradient (grad_x / grad_weight are empty otherwise).
  m.def(
      "fused_head_backward(Tensor grad, Tensor? x, Tensor? weight, Tensor? bias, Tensor gamma, "
      "Tensor beta, Tensor scale, Tensor z, Tensor? out, Tensor? colsum, Tensor? colsumsq, "
      "Tensor moments, str precision, bool training, bool scale_before_bn, bool softmax, "
      "float eps, str group_name, bool[6] needs) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // Synchronized-statistics hooks (kernels in python/epifuse/fused_head.py, torch.distributed):
  // the fold from batch statistics merged over the group's ranks -> (a, c, moments), and the
  // backward's [G1(N), G2(N), M] sums all-reduced over them.
  m.def(
      "synced_batch_fold(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, Tensor gamma, "
      "Tensor beta, Tensor? pre_scale, Tensor? post_scale, float eps, str group_name) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "synced_grad_sums(Tensor sums, Tensor moments, Tensor? bias, Tensor gamma, "
      "Tensor? pre_scale, Tensor? post_scale, float eps, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(epifuse, CPU, m) {
  m.impl("fused_head", &epifuse::fused_head);
  m.impl("fused_head_backward", &epifuse::fused_head_backward);
}

TORCH_LIBRARY_IMPL(epifuse, CUDA, m) {
  m.impl("fused_head", &epifuse::fused_head);
  m.impl("fused_head_backward", &epifuse::fused_head_backward);
}

TORCH_LIBRARY_IMPL(epifuse, Autograd, m) {
  m.impl("fused_head", &epifuse::fused_head_autograd);
  m.impl("fused_head_backward", &epifuse::fused_head_backward_autograd);
}
