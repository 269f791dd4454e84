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
// everything but its GEMMs. The fake kernels are registered from Python
// (python/epifuse/fused_head.py). The synchronized-statistics hooks (the cross-rank reductions)
// have C++ CUDA kernels (synced_hooks.cpp: pack_moments -> all_gather -> merge_fold,
// normalized_grad_sums -> all_reduce; functional collectives called through the dispatcher, no
// Python between the GEMM and the apply pass) and Python CPU kernels (fused_head.py) over the same
// per-pass ops.
//
// fused_head is functional: it leaves the running statistics alone (the caller updates them from
// the returned moments with update_running_stats, without folding again), so torch.compile and
// opcheck see an op without mutation.
//
// An eval call for no backward (for_backward=False: no_grad, inference) runs the layer as one GEMM
// with the fold and the activation in its epilogue (gemm_affine, then the softmax pass; a 16-bit
// GEMM feeding an fp32 output without a softmax: the GEMM, then the widening affine pass) and
// returns the output alone: z, the column sums, the moments and the fold come back empty.
//
// The fold a forward applied (a, c) is returned and kept for the backward where an activation's
// derivative reads it: folding again from the moments cost the backward an op call per head.
//
// Under autocast the autograd runs the backward's steps itself (the same per-pass ops, in the
// same order) so that it can free the 16-bit casts of x and W after their last GEMM: a step's
// peak memory then stays at or below eager's.
//
// Settings (precision, training, ...) are keyword-only with defaults in both schemas, parsed once
// into a HeadConfig (head_config.h, the one table of them); the composites and the autograd pass
// that struct around.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

#include "head_config.h"
#include "op_args.h"
#include "op_handles.h"
#include "weight_split_cache.h"

namespace epifuse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Needs = std::array<bool, 6>;  // x, weight, bias, gamma, beta, scale

// The per-pass ops, looked up once (op_handles.h).
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
EPIFUSE_OP(affine_softmax, "affine_softmax",
           Tensor(const Tensor&, const OptTensor&, const OptTensor&, c10::string_view, double,
                  OptDType))
EPIFUSE_OP(affine, "affine",
           Tensor(const Tensor&, const Tensor&, const Tensor&, c10::string_view, double, OptDType))
EPIFUSE_OP(affine_softmax_inplace, "affine_softmax_",
           void(const Tensor&, const OptTensor&, const OptTensor&, c10::string_view, double))
EPIFUSE_OP(gemm_affine, "gemm_affine",
           Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::string_view,
                  c10::string_view, double))
EPIFUSE_OP(softmax_grad_rowdot, "softmax_grad_rowdot", Tensor(const Tensor&, const Tensor&))
EPIFUSE_OP(head_grad_sums, "head_grad_sums",
           Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&,
                  const OptTensor&, const OptTensor&, c10::string_view, double))
EPIFUSE_OP(synced_grad_sums, "synced_grad_sums",
           Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                  const OptTensor&, double, c10::string_view))
EPIFUSE_OP(head_grad_coefficients, "head_grad_coefficients",
           Tensor6(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                   const Tensor&, const OptTensor&, const Tensor&, const Tensor&, const OptTensor&,
                   const OptTensor&, bool, double))
EPIFUSE_OP(head_grad_z, "head_grad_z",
           Tensor(const Tensor&, const OptTensor&, const OptTensor&, const Tensor&, const Tensor&,
                  const OptTensor&, const OptTensor&, c10::string_view, double))
EPIFUSE_OP(backward_matmul, "backward_matmul",
           Tensor(const Tensor&, const Tensor&, c10::string_view, OptDType))
EPIFUSE_OP(fused_head_op, "fused_head",
           Tensor7(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const Tensor&,
                   const Tensor&, const Tensor&, const Tensor& EPIFUSE_HEAD_PARAM_TYPES))
EPIFUSE_OP(fused_head_backward_op, "fused_head_backward",
           Tensor6(const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                   const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                   const OptTensor&, const OptTensor&, const Tensor&, Needs, const OptTensor&,
                   const OptTensor& EPIFUSE_HEAD_PARAM_TYPES))
#undef EPIFUSE_OP

// Problem 39's scale multiplies BatchNorm's input, problem 84's its output: (pre_scale, post_scale).
// A head without a scale (has_scale false) passes neither: its `scale` is a stand-in that nothing
// reads, so the fold multiplies by nothing and the backward skips a one-element scale's gradient
// (a sum over every column: scratch, a memset and a last-block reduction per backward).
std::pair<OptTensor, OptTensor> scales(const Tensor& scale, const HeadConfig& cfg) {
  if (!cfg.has_scale) return {std::nullopt, std::nullopt};
  if (cfg.scale_before_bn) return {scale, std::nullopt};
  return {std::nullopt, scale};
}

// x or W as the GEMMs read them: cast to cfg.gemm_dtype (autocast), or as they are.
Tensor gemm_operand(const Tensor& t, const HeadConfig& cfg) {
  if (!cfg.gemm_dtype || t.scalar_type() == *cfg.gemm_dtype) return t;
  return to_gemm_dtype(t, *cfg.gemm_dtype);
}

// The weight as the GEMMs read it: under autocast its 16-bit cast, kept while the weight is
// unchanged (an eval model casts it once, as the 3x split is kept).
Tensor gemm_weight(const Tensor& w, const HeadConfig& cfg) {
  if (!cfg.gemm_dtype || w.scalar_type() == *cfg.gemm_dtype) return w;
  return kept_weight_cast(w, *cfg.gemm_dtype);
}

// fold.moments_vector(running_mean, running_var, 0): what eval mode normalized with.
Tensor running_moments(const Tensor& running_mean, const Tensor& running_var) {
  const auto f64 = running_mean.options().dtype(at::kDouble);
  return at::cat({running_mean.to(at::kDouble), running_var.to(at::kDouble), at::zeros({1}, f64)});
}

// ---- the composites (CPU and CUDA) ---------------------------------------------------------------

// An eval head's forward that no backward will read (for_backward=False: inference, torch.no_grad
// under autocast): bn_fold_eval -> gemm_affine, the layer as one GEMM
// with the fold and the activation in its epilogue (-> the softmax pass: in place, or into the
// output dtype autocast asks for). Without a softmax but with a wider output dtype than the GEMM's,
// the GEMM writes z and the widening pass applies the fold and activation. Nothing is kept for a
// backward, so z, the column sums, the moments and the fold come back empty. x and weight are the
// GEMM's operands (cast already under autocast).
Tensor7 eval_head_without_backward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                   const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   const HeadConfig& cfg) {
  const auto [pre, post] = scales(scale, cfg);
  const auto [a, c] =
      bn_fold_eval().call(bias, gamma, beta, pre, post, running_mean, running_var, cfg.eps);
  const bool recast = cfg.out_dtype && *cfg.out_dtype != x.scalar_type();
  Tensor y;
  if (recast && !cfg.softmax) {
    // An output wider than the GEMM's (fp32 from a 16-bit GEMM under autocast, e.g. problem 39):
    // the fold and activation go into the pass that widens it, so that z is what gets rounded to
    // 16 bits, as in eager (which applies BatchNorm to the 16-bit z in fp32). Rounding the
    // epilogue's output instead measured ~1.1x eager's error against float64 (problem 39, H100).
    const Tensor z = backward_matmul().call(x, weight.t(), cfg.precision, std::nullopt);
    y = affine().call(z, a, c, cfg.activation, cfg.negative_slope, cfg.out_dtype);
  } else {
    // Before a softmax the activation belongs to the softmax pass.
    y = gemm_affine().call(x, weight, a, c, cfg.precision, cfg.softmax ? "" : cfg.activation,
                           cfg.negative_slope);
  }
  if (cfg.softmax && recast) {
    y = affine_softmax().call(y, std::nullopt, std::nullopt, cfg.activation, cfg.negative_slope,
                              cfg.out_dtype);
  } else if (cfg.softmax) {
    affine_softmax_inplace().call(y, std::nullopt, std::nullopt, cfg.activation,
                                  cfg.negative_slope);
  }
  const auto empty = [&](at::ScalarType dtype) { return at::empty({0}, y.options().dtype(dtype)); };
  return {y,
          empty(x.scalar_type()),
          empty(at::kDouble),
          empty(at::kDouble),
          empty(at::kDouble),
          empty(at::kFloat),
          empty(at::kFloat)};
}

Tensor7 fused_head_impl(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                        const Tensor& running_mean, const Tensor& running_var,
                        const HeadConfig& cfg) {
  if (!cfg.training && !cfg.for_backward) {
    return eval_head_without_backward(gemm_operand(x, cfg), gemm_weight(weight, cfg), bias, gamma,
                                      beta, scale, running_mean, running_var, cfg);
  }
  const auto [pre, post] = scales(scale, cfg);
  // Under autocast the autograd kernel hands over x and W already cast (and keeps them for the
  // backward); a direct call casts here.
  auto [z, colsum, colsumsq] =
      gemm_colstats().call(gemm_operand(x, cfg), gemm_weight(weight, cfg), cfg.precision);
  Tensor a, c, moments;
  if (!cfg.training) {
    std::tie(a, c) =
        bn_fold_eval().call(bias, gamma, beta, pre, post, running_mean, running_var, cfg.eps);
    moments = running_moments(running_mean, running_var);
  } else if (!cfg.group_name.empty()) {  // statistics over every rank of the group
    std::tie(a, c, moments) = synced_batch_fold().call(colsum, colsumsq, x.size(0), bias, gamma,
                                                       beta, pre, post, cfg.eps, cfg.group_name);
  } else {
    std::tie(a, c, moments) =
        bn_fold_batch().call(colsum, colsumsq, x.size(0), bias, gamma, beta, pre, post, cfg.eps);
  }
  Tensor out = cfg.softmax ? affine_softmax().call(z, a, c, cfg.activation, cfg.negative_slope,
                                                   cfg.out_dtype)
                           : affine().call(z, a, c, cfg.activation, cfg.negative_slope,
                                           cfg.out_dtype);
  return {out, z, colsum, colsumsq, moments, a, c};
}

// The op's kernel (CPU and CUDA): the settings parsed into a HeadConfig, once.
Tensor7 fused_head(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& gamma,
                   const Tensor& beta, const Tensor& scale, const Tensor& running_mean,
                   const Tensor& running_var EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  return fused_head_impl(x, weight, bias, gamma, beta, scale, running_mean, running_var, cfg);
}

// The backward up to dz = d loss / d z: the [N] parameter gradients (one kernel computes them all)
// and dz itself where dX or dW is needed (else undefined).
struct HeadGradZ {
  Tensor dz, bias, gamma, beta, scale;
};

HeadGradZ head_backward_to_dz(const Tensor& grad, const OptTensor& bias, const Tensor& gamma,
                              const Tensor& beta, const Tensor& scale, const Tensor& z,
                              const OptTensor& out, const OptTensor& colsum,
                              const OptTensor& colsumsq, const Tensor& moments, Needs needs,
                              const OptTensor& fold_a, const OptTensor& fold_c,
                              const HeadConfig& cfg) {
  const bool softmax = cfg.softmax, scale_before_bn = cfg.scale_before_bn;
  TORCH_CHECK(!softmax || out.has_value(), "epifuse::fused_head_backward: a softmax head needs out");
  const auto [pre, post] = scales(scale, cfg);
  const OptTensor rowdot = softmax ? OptTensor(softmax_grad_rowdot().call(grad, *out)) : std::nullopt;
  const OptTensor softmax_out = softmax ? out : std::nullopt;
  // An activation's derivative at h = a * z + c: the fold the forward applied (fused_head's a and
  // c, which the autograd keeps), or, where a caller has not got it, the fold again from the
  // statistics the forward normalized with (moments: batch, merged or running).
  OptTensor a, c;
  if (!cfg.activation.empty() && fold_a && fold_c) {
    a = fold_a, c = fold_c;
  } else if (!cfg.activation.empty()) {  // bn_fold_eval reads the float64 moments as they are
    const int64_t n = gamma.size(0);
    const auto stat = [&](int64_t i) { return moments.slice(0, i * n, (i + 1) * n); };
    std::tie(a, c) = bn_fold_eval().call(bias, gamma, beta, pre, post, stat(0), stat(1), cfg.eps);
  }
  const Tensor sums = head_grad_sums().call(grad, softmax_out, rowdot, z, a, c, cfg.activation,
                                            cfg.negative_slope);
  // du (hence dz, d bias and a scale before BatchNorm) needs the batch terms of every rank:
  // nn.SyncBatchNorm's condition, so ranks on the reference path issue the same all_reduce.
  const bool need_du =
      needs[0] || needs[1] || needs[2] || (cfg.has_scale && scale_before_bn && needs[5]);
  OptTensor global_sums;
  if (cfg.training && !cfg.group_name.empty() && need_du) {
    global_sums = synced_grad_sums().call(sums, moments, bias, gamma, pre, post, cfg.eps,
                                          cfg.group_name);
  }
  auto [coef, g_bias, g_gamma, g_beta, g_pre, g_post] =
      head_grad_coefficients().call(sums, global_sums, colsum, colsumsq, moments, bias, gamma,
                                    beta, pre, post, cfg.training, cfg.eps);
  // Without a scale (has_scale false) nothing read it: its gradient is zero where asked for.
  const Tensor g_scale = !cfg.has_scale ? Tensor() : scale_before_bn ? g_pre : g_post;
  HeadGradZ r{Tensor(), g_bias, g_gamma, g_beta, g_scale};
  // dz in z's dtype: the GEMM's, so dX and dW run in it too (under autocast, as eager's).
  if (needs[0] || needs[1]) {
    r.dz = head_grad_z().call(grad, softmax_out, rowdot, z, coef, a, c, cfg.activation,
                              cfg.negative_slope);
  }
  return r;
}

// The backward's GEMMs from dz. An fp32 result from 16-bit operands (dW in the fp32 parameters'
// dtype, dX in an fp32 x's: grad_x_dtype) is written in fp32 by the GEMM itself, no 16-bit result
// and no cast pass; from fp16 with inf wherever the fp16 product would overflow (bf16 has fp32's
// range), so that GradScaler skips the same steps as eager's. Any other dX comes back in z's dtype.
OptDType fp32_from_16_bit(const Tensor& dz, at::ScalarType want) {
  return want == at::kFloat && dz.element_size() == 2 ? OptDType(at::kFloat) : std::nullopt;
}

Tensor backward_dx(const Tensor& dz, const Tensor& weight, const HeadConfig& cfg) {
  return backward_matmul().call(dz, weight, cfg.precision,
                                fp32_from_16_bit(dz, cfg.grad_x_dtype.value_or(dz.scalar_type())));
}

Tensor backward_dw(const Tensor& dz, const Tensor& x, at::ScalarType param_dtype,
                   const HeadConfig& cfg) {
  const Tensor grad_w =
      backward_matmul().call(dz.t(), x, cfg.precision, fp32_from_16_bit(dz, param_dtype));
  return grad_w.scalar_type() == param_dtype ? grad_w : grad_w.to(param_dtype);
}

// The scale's gradient as the backward returns it: computed (has_scale), or, for a head without a
// scale, whose stand-in nothing read, zeros where one is asked for and else an empty tensor.
Tensor scale_gradient(const HeadGradZ& r, const Tensor& scale, bool needed) {
  if (r.scale.defined()) return r.scale;
  return needed ? at::zeros_like(scale) : at::empty({0}, scale.options());
}

// dX and dW are computed only where needs asks (else empty tensors); the [N] parameter gradients
// always (the scale's: see scale_gradient).
Tensor6 fused_head_backward_impl(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                                 const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                                 const Tensor& scale, const Tensor& z, const OptTensor& out,
                                 const OptTensor& colsum, const OptTensor& colsumsq,
                                 const Tensor& moments, Needs needs, const OptTensor& a,
                                 const OptTensor& c, const HeadConfig& cfg) {
  TORCH_CHECK(!needs[0] || weight.has_value(), "epifuse::fused_head_backward: dX needs weight");
  TORCH_CHECK(!needs[1] || x.has_value(), "epifuse::fused_head_backward: dW needs x");
  const HeadGradZ r = head_backward_to_dz(grad, bias, gamma, beta, scale, z, out, colsum,
                                          colsumsq, moments, needs, a, c, cfg);
  const auto none = [&] { return at::empty({0}, grad.options()); };
  const Tensor grad_x = needs[0] ? backward_dx(r.dz, *weight, cfg) : none();
  const Tensor grad_w = needs[1] ? backward_dw(r.dz, *x, gamma.scalar_type(), cfg) : none();
  return {grad_x, grad_w, r.bias, r.gamma, r.beta, scale_gradient(r, scale, needs[5])};
}

Tensor6 fused_head_backward(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                            const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                            const Tensor& scale, const Tensor& z, const OptTensor& out,
                            const OptTensor& colsum, const OptTensor& colsumsq,
                            const Tensor& moments, Needs needs, const OptTensor& a,
                            const OptTensor& c EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  return fused_head_backward_impl(grad, x, weight, bias, gamma, beta, scale, z, out, colsum,
                                  colsumsq, moments, needs, a, c, cfg);
}

// ---- autograd --------------------------------------------------------------------------------

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd functions' arguments, which their backwards return one gradient (or none) for.
constexpr int kForwardArgs = 9;    // FusedHead: fused_head's 8 tensors, the HeadConfig
constexpr int kBackwardArgs = 16;  // FusedHeadBackward: 12 tensors, needs, a, c, the HeadConfig

// What the autograd keeps for the backward, by name: x and W only where the other one needs a
// gradient (dX needs W, dW needs x, as eager's mm keeps them), out for softmax heads, colsum and
// colsumsq in training, the fold (a, c) where an activation's derivative reads it (two [N] vectors
// that spare the backward a fold of its own); undefined where not kept.
#define EPIFUSE_SAVED_TENSORS(X)                                                                  \
  X(x) X(weight) X(bias) X(gamma) X(beta) X(scale) X(z) X(out) X(colsum) X(colsumsq) X(moments) \
  X(a) X(c)

struct SavedTensors {
#define EPIFUSE_SAVED_MEMBER_(name) Tensor name;
  EPIFUSE_SAVED_TENSORS(EPIFUSE_SAVED_MEMBER_)
#undef EPIFUSE_SAVED_MEMBER_

  // save_for_backward's list, and back from get_saved_variables' (the same order).
  variable_list list() const {
#define EPIFUSE_SAVED_ITEM_(name) name,
    return {EPIFUSE_SAVED_TENSORS(EPIFUSE_SAVED_ITEM_)};
#undef EPIFUSE_SAVED_ITEM_
  }
  static SavedTensors from_list(const variable_list& saved) {
    SavedTensors s;
    size_t i = 0;
#define EPIFUSE_SAVED_READ_(name) s.name = saved.at(i++);
    EPIFUSE_SAVED_TENSORS(EPIFUSE_SAVED_READ_)
#undef EPIFUSE_SAVED_READ_
    return s;
  }
};

OptTensor opt(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

}  // namespace

// saved_data keys of the GEMM operands' 16-bit casts (autocast), which FusedHead's backward frees.
constexpr const char* kXCast = "x_cast";
constexpr const char* kWeightCast = "weight_cast";

// Named outside the anonymous namespace: grad_fn.name() shows "...CppNode<epifuse::FusedHead>".
struct FusedHead : torch::autograd::Function<FusedHead> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight,
                               const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                               const Tensor& scale, const Tensor& running_mean,
                               const Tensor& running_var, const HeadConfig& cfg) {
    Tensor out, z, colsum, colsumsq, moments, a, c, x_gemm, w_gemm;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      // The GEMM's operands (autocast: 16-bit casts; the weight's kept while it is unchanged),
      // cast once here so that the backward reuses them.
      x_gemm = gemm_operand(x, cfg);
      w_gemm = gemm_weight(weight, cfg);
      std::tie(out, z, colsum, colsumsq, moments, a, c) = fused_head_op().call(
          x_gemm, w_gemm, bias, gamma, beta, scale, running_mean, running_var EPIFUSE_HEAD_ARGS);
    }
    ctx->mark_non_differentiable({z, colsum, colsumsq, moments, a, c});
    ctx->set_materialize_grads(false);
    // z and out are the [M, N] tensors kept. Under autocast the GEMM's operands are 16-bit casts
    // made above, which only this backward reads: they are kept in saved_data, from which the
    // backward takes them so that each is freed after its last GEMM (backward says why).
    SavedTensors saved;
    const bool keep_x = weight.requires_grad(), keep_w = x.requires_grad();
    const bool x_cast = !x_gemm.is_same(x), w_cast = !w_gemm.is_same(weight);
    saved.x = keep_x && !x_cast ? x_gemm : Tensor();
    saved.weight = keep_w && !w_cast ? w_gemm : Tensor();
    if (keep_x && x_cast) ctx->saved_data[kXCast] = x_gemm;
    if (keep_w && w_cast) ctx->saved_data[kWeightCast] = w_gemm;
    saved.bias = bias.value_or(Tensor());
    saved.gamma = gamma;
    saved.beta = beta;
    saved.scale = scale;
    saved.z = z;
    saved.out = cfg.softmax ? out : Tensor();
    saved.colsum = cfg.training ? colsum : Tensor();
    saved.colsumsq = cfg.training ? colsumsq : Tensor();
    saved.moments = moments;
    saved.a = cfg.activation.empty() ? Tensor() : a;
    saved.c = cfg.activation.empty() ? Tensor() : c;
    ctx->save_for_backward(saved.list());
    save_head_config(ctx, cfg);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["x_dtype"] = x.scalar_type();
    return {out, z, colsum, colsumsq, moments, a, c};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(kForwardArgs);
    const Tensor& grad = grads[0];
    if (!grad.defined()) return result;
    const SavedTensors s = SavedTensors::from_list(ctx->get_saved_variables());
    HeadConfig cfg = load_head_config(ctx);
    const auto x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    cfg.grad_x_dtype = x_dtype;  // an fp32 x's gradient written in fp32 by the dX GEMM
    // Edges exist for the tensor arguments only: an absent bias has none.
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    auto needs_arg = [&](int arg) {
      const int edge = arg < 2 || has_bias ? arg : arg - 1;
      return ctx->needs_input_grad(edge);
    };
    const Needs needs{needs_arg(0), needs_arg(1), has_bias && needs_arg(2), needs_arg(3),
                      needs_arg(4), needs_arg(5)};
    Tensor x_gemm = s.x, w_gemm = s.weight;
    const bool casts = ctx->saved_data.count(kXCast) + ctx->saved_data.count(kWeightCast) > 0;
    if (casts) {
      // Taken out of saved_data unless the graph is kept for another backward, so that these
      // locals are the casts' last references.
      const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
      auto take = [&](const char* key, Tensor& t) {
        if (ctx->saved_data.count(key) == 0) return;
        t = ctx->saved_data.at(key).toTensor();
        if (!keep_graph) ctx->saved_data.erase(key);
      };
      take(kXCast, x_gemm);
      take(kWeightCast, w_gemm);
    }
    std::array<Tensor, 6> all;
    if (casts && !at::GradMode::is_enabled()) {
      // The usual backward under autocast, in steps, each 16-bit cast dropped after its last GEMM:
      // the weight's before dW's fp32 result is allocated (problem 84: 128 MiB of bf16 weight
      // beside 256 MiB of fp32 dW), as eager's autograd frees its saved cast once its mm's backward
      // has run. The one op call below would keep both casts until it returned.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      HeadGradZ r = head_backward_to_dz(grad, opt(s.bias), s.gamma, s.beta, s.scale, s.z,
                                        opt(s.out), opt(s.colsum), opt(s.colsumsq), s.moments,
                                        needs, opt(s.a), opt(s.c), cfg);
      if (needs[0]) all[0] = backward_dx(r.dz, w_gemm, cfg);
      w_gemm.reset();
      if (needs[1]) all[1] = backward_dw(r.dz, x_gemm, s.gamma.scalar_type(), cfg);
      all[2] = r.bias, all[3] = r.gamma, all[4] = r.beta;
      all[5] = scale_gradient(r, s.scale, needs[5]);
    } else {
      auto grads_in = fused_head_backward_op().call(
          grad, opt(x_gemm), opt(w_gemm), opt(s.bias), s.gamma, s.beta, s.scale, s.z,
          opt(s.out), opt(s.colsum), opt(s.colsumsq), s.moments, needs, opt(s.a),
          opt(s.c) EPIFUSE_HEAD_ARGS);
      all = {std::get<0>(grads_in), std::get<1>(grads_in), std::get<2>(grads_in),
             std::get<3>(grads_in), std::get<4>(grads_in), std::get<5>(grads_in)};
    }
    for (int i = 0; i < 6; ++i) {
      if (needs[i]) result[i] = all[i];
    }
    // dX in x's dtype where the backward could not write it so (x float64, the GEMM 16-bit).
    if (result[0].defined() && result[0].scalar_type() != x_dtype) result[0] = result[0].to(x_dtype);
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
                               const OptTensor& colsumsq, const Tensor& moments, Needs needs,
                               const OptTensor& a, const OptTensor& c, const HeadConfig& cfg) {
    auto r = call_below_autograd(fused_head_backward_op(), grad, x, weight, bias, gamma, beta,
                                 scale, z, out, colsum, colsumsq, moments, needs, a,
                                 c EPIFUSE_HEAD_ARGS);
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

Tensor7 fused_head_autograd(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                            const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                            const Tensor& running_mean,
                            const Tensor& running_var EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  if (!cfg.for_backward) {  // no autograd node: nothing is kept
    const bool records = at::GradMode::is_enabled() &&
                         (x.requires_grad() || weight.requires_grad() ||
                          (bias && bias->requires_grad()) || gamma.requires_grad() ||
                          beta.requires_grad() || scale.requires_grad());
    TORCH_CHECK(!records, "epifuse::fused_head: for_backward=False, but an input requires grad "
                "under grad mode (call it with for_backward=True, or under torch.no_grad())");
    return call_below_autograd(fused_head_op(), x, weight, bias, gamma, beta, scale, running_mean,
                               running_var EPIFUSE_HEAD_ARGS);
  }
  const variable_list r =
      FusedHead::apply(x, weight, bias, gamma, beta, scale, running_mean, running_var, cfg);
  return {r[0], r[1], r[2], r[3], r[4], r[5], r[6]};
}

// AutocastCUDA: the head under torch.autocast("cuda", dtype=d). The GEMMs run in d (x and W cast
// by the autograd kernel, which keeps the casts for the backward), the statistics, fold and passes
// in fp32, and the output has the dtype the unfused modules give under the same autocast:
// nn.Linear returns d, BatchNorm keeps its input's dtype, an fp32 scale tensor promotes
// (scale * y), softmax is one of autocast's fp32 ops. Read at call time, so nested and disabled
// regions are followed (torch.library.register_autocast fixes one dtype when registered).
// Inputs autocast would not cast (float64, or already cast) pass through unchanged.
Tensor7 fused_head_autocast(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                            const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                            const Tensor& running_mean,
                            const Tensor& running_var EPIFUSE_HEAD_PARAMS) {
  HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  if (!cfg.gemm_dtype && at::autocast::is_autocast_eligible(x, c10::DeviceType::CUDA) &&
      at::autocast::is_autocast_eligible(weight, c10::DeviceType::CUDA)) {
    const at::ScalarType d = at::autocast::get_autocast_dtype(at::kCUDA);
    cfg.gemm_dtype = d;
    if (!cfg.out_dtype) {
      cfg.out_dtype = cfg.softmax     ? at::kFloat
                      : cfg.has_scale ? at::promote_types(d, scale.scalar_type())
                                      : d;
    }
  }
  return fused_head_op().call(x, weight, bias, gamma, beta, scale, running_mean,
                              running_var EPIFUSE_HEAD_ARGS);
}

Tensor6 fused_head_backward_autograd(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                                     const OptTensor& bias, const Tensor& gamma,
                                     const Tensor& beta, const Tensor& scale, const Tensor& z,
                                     const OptTensor& out, const OptTensor& colsum,
                                     const OptTensor& colsumsq, const Tensor& moments,
                                     Needs needs, const OptTensor& a,
                                     const OptTensor& c EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  if (!at::GradMode::is_enabled()) {
    // The usual backward (no create_graph): nothing will differentiate the result, so no node
    // is recorded; skipping Function::apply's bookkeeping saves host time on every step.
    return call_below_autograd(fused_head_backward_op(), grad, x, weight, bias, gamma, beta,
                               scale, z, out, colsum, colsumsq, moments, needs, a,
                               c EPIFUSE_HEAD_ARGS);
  }
  const variable_list r = FusedHeadBackward::apply(grad, x, weight, bias, gamma, beta, scale, z,
                                                   out, colsum, colsumsq, moments, needs, a, c,
                                                   cfg);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY_FRAGMENT(epifuse, m) {
  using epifuse::head_schema_kwargs;
  // Tensors positional, settings keyword-only with defaults (head_config.h: every HeadConfig
  // field, e.g. "*, str precision='3xtf32', bool training=True, ...").
  // (out, z, colsum, colsumsq, moments, a, c): the head's output; the GEMM output z and moments
  // (the statistics u was normalized with, fold.moments_vector) for the backward and the caller's
  // running-statistics update; this batch's column sums; the fold the output was computed with
  // (float32 [N]: out = act(a * z + c)), which the backward reads for an activation's derivative.
  // An eval call with for_backward=False returns the last six empty. group_name non-empty: batch
  // statistics over that process group's ranks.
  m.def((std::string("fused_head(Tensor x, Tensor weight, Tensor? bias, Tensor gamma, Tensor beta, "
                     "Tensor scale, Tensor running_mean, Tensor running_var, ") +
         head_schema_kwargs() + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str());
  // (grad_x, grad_weight, grad_bias, grad_gamma, grad_beta, grad_scale); needs: which of
  // x, weight, bias, gamma, beta, scale want a gradient (grad_x / grad_weight are empty otherwise;
  // a head without a scale returns its gradient as zeros if needed, else empty). a, c: fused_head's
  // fold, which an activation's derivative reads (absent: folded again from moments).
  m.def((std::string("fused_head_backward(Tensor grad, Tensor? x, Tensor? weight, Tensor? bias, "
                     "Tensor gamma, Tensor beta, Tensor scale, Tensor z, Tensor? out, "
                     "Tensor? colsum, Tensor? colsumsq, Tensor moments, bool[6] needs, "
                     "Tensor? a=None, Tensor? c=None, ") +
         head_schema_kwargs() + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str());
  // Synchronized-statistics hooks (CUDA kernels: synced_hooks.cpp; CPU kernels:
  // python/epifuse/fused_head.py): the fold from batch statistics merged over the group's ranks
  // -> (a, c, moments), and the backward's [G1(N), G2(N), M] sums all-reduced over them.
  // group_name must name a group.
  m.def((std::string("synced_batch_fold(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, "
                     "Tensor gamma, Tensor beta, Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"eps", "group_name"}) + ") -> (Tensor, Tensor, Tensor)")
            .c_str());
  m.def((std::string("synced_grad_sums(Tensor sums, Tensor moments, Tensor? bias, Tensor gamma, "
                     "Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"eps", "group_name"}) + ") -> Tensor")
            .c_str());
}

TORCH_LIBRARY_IMPL(epifuse, CPU, m) {
  m.impl("fused_head", &epifuse::fused_head);
  m.impl("fused_head_backward", &epifuse::fused_head_backward);
}

TORCH_LIBRARY_IMPL(epifuse, CUDA, m) {
  m.impl("fused_head", &epifuse::fused_head);
  m.impl("fused_head_backward", &epifuse::fused_head_backward);
}

TORCH_LIBRARY_IMPL(epifuse, AutocastCUDA, m) {
  m.impl("fused_head", &epifuse::fused_head_autocast);
}

TORCH_LIBRARY_IMPL(epifuse, Autograd, m) {
  m.impl("fused_head", &epifuse::fused_head_autograd);
  m.impl("fused_head_backward", &epifuse::fused_head_backward_autograd);
}
