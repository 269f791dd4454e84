// epifuse::fused_head and epifuse::fused_head_backward: a head as one op per direction, and the one
// place the passes are chained. python/epifuse/head.py decides fused or reference and calls
// fused_head once per forward; everything after that decision is here.
//
//   fused_head           gemm_colstats -> fold -> affine_softmax / affine, the running statistics
//                        updated in training (when num_batches_tracked is given):
//                          batch                    bn_fold_train (fold, moments and update in one
//                                                   kernel); for no backward the pass runs in
//                                                   place over z
//                          synchronized             synced_batch_fold -> update_running_stats
//                          eval                     bn_fold_eval
//                          eval, no backward        bn_fold_eval -> gemm_affine (the fold and the
//                                                   activation in the GEMM's epilogue) [-> softmax]
//   fused_head_backward  softmax_grad_rowdot (softmax heads) -> head_grad_sums (-> synced_grad_sums
//                        when synchronized) -> head_grad_coefficients -> head_grad_z ->
//                        backward_matmul (dX, dW)
//
// Both are composites of the per-pass ops, called through the dispatcher, so the CUDA kernels and
// the float64 CPU references run under the same sequence. Their autograd and autocast kernels are
// in head_autograd.cpp; the fake kernels in python/epifuse/_ops/head.py.
//
// A call for no backward (for_backward=False: no_grad, inference) returns the output alone: z, the
// column sums, the moments and the fold come back empty. The fold a forward applied (a, c) is
// returned for the backward where an activation's derivative reads it.
//
// Settings (precision, training, ...) are keyword-only with defaults in both schemas, parsed once
// into a HeadConfig (head_config.h, the one table of them).
#include "head.h"

#include <torch/library.h>

#include <string>
#include <tuple>

#include "dispatch.h"
#include "op_args.h"
#include "weight_split_cache.h"

namespace epifuse::ops {
namespace {

// fold.moments_vector(running_mean, running_var, 0): what eval mode normalized with.
Tensor running_moments(const Tensor& running_mean, const Tensor& running_var) {
  const auto f64 = running_mean.options().dtype(at::kDouble);
  return at::cat({running_mean.to(at::kDouble), running_var.to(at::kDouble), at::zeros({1}, f64)});
}

Tensor7 output_alone(const Tensor& out, at::ScalarType z_dtype) {
  const auto empty = [&](at::ScalarType dtype) { return at::empty({0}, out.options().dtype(dtype)); };
  return {out,
          empty(z_dtype),
          empty(at::kDouble),
          empty(at::kDouble),
          empty(at::kDouble),
          empty(at::kFloat),
          empty(at::kFloat)};
}

// An eval head's forward that no backward will read: bn_fold_eval -> gemm_affine, the layer as one
// GEMM with the fold and the activation in its epilogue (-> the softmax pass: in place, or into the
// output dtype autocast asks for). Without a softmax but with a wider output dtype than the GEMM's,
// the GEMM writes z and the widening pass applies the fold and activation. x and weight are the
// GEMM's operands (cast already under autocast).
Tensor7 eval_head_without_backward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                   const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                                   const Tensor& running_mean, const Tensor& running_var,
                                   const HeadConfig& cfg) {
  const auto [pre, post] = scales(scale, cfg);
  const auto [a, c] = EPIFUSE_OP(bn_fold_eval).call(bias, gamma, beta, pre, post, running_mean,
                                                    running_var, cfg.eps);
  const bool recast = cfg.out_dtype && *cfg.out_dtype != x.scalar_type();
  Tensor y;
  if (recast && !cfg.softmax) {
    // An output wider than the GEMM's (fp32 from a 16-bit GEMM under autocast, e.g. problem 39):
    // the fold and activation go into the pass that widens it, so that z is what gets rounded to
    // 16 bits, as in eager (which applies BatchNorm to the 16-bit z in fp32). Rounding the
    // epilogue's output instead measured ~1.1x eager's error against float64 (problem 39, H100).
    const Tensor z = EPIFUSE_OP(backward_matmul).call(x, weight.t(), cfg.precision, std::nullopt);
    y = EPIFUSE_OP(affine).call(z, a, c, cfg.activation, cfg.negative_slope, cfg.out_dtype);
  } else {
    // Before a softmax the activation belongs to the softmax pass.
    y = EPIFUSE_OP(gemm_affine).call(x, weight, a, c, cfg.precision,
                                     cfg.softmax ? "" : cfg.activation, cfg.negative_slope);
  }
  if (cfg.softmax && recast) {
    y = EPIFUSE_OP(affine_softmax).call(y, std::nullopt, std::nullopt, cfg.activation,
                                        cfg.negative_slope, cfg.out_dtype);
  } else if (cfg.softmax) {
    EPIFUSE_OP(affine_softmax_).call(y, std::nullopt, std::nullopt, cfg.activation,
                                     cfg.negative_slope);
  }
  return output_alone(y, x.scalar_type());
}

// The training fold, with the running statistics updated where asked (num_batches_tracked given):
// (a, c, moments). Without synchronization bn_fold_train folds, writes the moments and updates in
// one kernel; synchronized, the merged statistics are known only after the collective, and the
// update follows the fold.
Tensor3 training_fold(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                      const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                      const OptTensor& pre, const OptTensor& post, const Tensor& running_mean,
                      const Tensor& running_var, const OptTensor& num_batches_tracked,
                      const HeadConfig& cfg) {
  const bool synced = !cfg.group_name.empty();
  if (num_batches_tracked && !synced) {
    return EPIFUSE_OP(bn_fold_train).call(colsum, colsumsq, count, bias, gamma, beta, pre, post,
                                          running_mean, running_var, *num_batches_tracked,
                                          cfg.momentum, cfg.eps);
  }
  // Statistics over every rank of the group, or this batch's.
  const Tensor3 fold =
      synced ? EPIFUSE_OP(synced_batch_fold).call(colsum, colsumsq, count, bias, gamma, beta, pre,
                                                  post, cfg.eps, cfg.group_name)
             : EPIFUSE_OP(bn_fold_batch).call(colsum, colsumsq, count, bias, gamma, beta, pre,
                                              post, cfg.eps);
  if (num_batches_tracked) {
    // From the moments the fold used (all ranks' merged ones, whose count stays on the device).
    EPIFUSE_OP(update_running_stats).call(std::get<2>(fold), running_mean, running_var,
                                          *num_batches_tracked, cfg.momentum);
  }
  return fold;
}

}  // namespace

void check_output_settings(const Tensor& x, const HeadConfig& cfg, const char* op) {
  activation_from_name(cfg.activation, cfg.negative_slope, op);
  const at::ScalarType z_dtype = cfg.gemm_dtype.value_or(x.scalar_type());
  const at::ScalarType out = cfg.out_dtype.value_or(z_dtype);
  EPIFUSE_CHECK(out == z_dtype || (out == at::kFloat && c10::elementSize(z_dtype) == 2),
                "epifuse::", op, ": out_dtype must be the GEMM's dtype (", z_dtype,
                ") or float32 for a 16-bit GEMM, got ", out);
}

KeepPolicy keep_policy(const HeadConfig& cfg) {
  return cfg.for_backward ? KeepPolicy::kStep : KeepPolicy::kRepeated;
}

Tensor gemm_input(const Tensor& x, const HeadConfig& cfg) {
  if (!cfg.gemm_dtype || x.scalar_type() == *cfg.gemm_dtype) return x;
  return to_gemm_dtype(x, *cfg.gemm_dtype);
}

Tensor gemm_weight(const Tensor& w, const HeadConfig& cfg) {
  if (!cfg.gemm_dtype || w.scalar_type() == *cfg.gemm_dtype) return w;
  const WeightOperandsKept keep(keep_policy(cfg));
  return kept_weight_cast(w, *cfg.gemm_dtype);
}

std::pair<OptTensor, OptTensor> scales(const Tensor& scale, const HeadConfig& cfg) {
  if (!cfg.has_scale) return {std::nullopt, std::nullopt};
  if (cfg.scale_before_bn) return {scale, std::nullopt};
  return {std::nullopt, scale};
}

Tensor7 fused_head_forward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                           const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                           const Tensor& running_mean, const Tensor& running_var,
                           const OptTensor& num_batches_tracked, const HeadConfig& cfg) {
  // The weight's 3x split (and 16-bit cast): kept while unchanged where no backward follows (eval
  // and no_grad forwards see the same weight again), shared by a training step's forwards until
  // its backward starts (weight_split_cache.h).
  const WeightOperandsKept keep(keep_policy(cfg));
  // The settings only the last pass reads, checked before any pass runs: a refused call must not
  // have updated the running statistics already.
  check_output_settings(x, cfg, "fused_head");
  // Under autocast the autograd kernel hands over x and W already cast (and keeps them for the
  // backward); a direct call casts here.
  const Tensor x_gemm = gemm_input(x, cfg), w_gemm = gemm_weight(weight, cfg);
  if (!cfg.training && !cfg.for_backward) {
    return eval_head_without_backward(x_gemm, w_gemm, bias, gamma, beta, scale, running_mean,
                                      running_var, cfg);
  }
  const auto [pre, post] = scales(scale, cfg);
  auto [z, colsum, colsumsq] = EPIFUSE_OP(gemm_colstats).call(x_gemm, w_gemm, cfg.precision);
  Tensor a, c, moments;
  if (cfg.training) {
    std::tie(a, c, moments) = training_fold(colsum, colsumsq, x.size(0), bias, gamma, beta, pre,
                                            post, running_mean, running_var, num_batches_tracked,
                                            cfg);
  } else {
    std::tie(a, c) = EPIFUSE_OP(bn_fold_eval).call(bias, gamma, beta, pre, post, running_mean,
                                                   running_var, cfg.eps);
    moments = running_moments(running_mean, running_var);
  }
  if (!cfg.for_backward && (!cfg.out_dtype || *cfg.out_dtype == z.scalar_type())) {
    // Nothing kept for a backward: the pass overwrites z, which becomes the output.
    if (cfg.softmax) {
      EPIFUSE_OP(affine_softmax_).call(z, a, c, cfg.activation, cfg.negative_slope);
    } else {
      EPIFUSE_OP(affine_).call(z, a, c, cfg.activation, cfg.negative_slope);
    }
    return output_alone(z, z.scalar_type());
  }
  Tensor out = cfg.softmax ? EPIFUSE_OP(affine_softmax)
                                 .call(z, a, c, cfg.activation, cfg.negative_slope, cfg.out_dtype)
                           : EPIFUSE_OP(affine).call(z, a, c, cfg.activation, cfg.negative_slope,
                                                     cfg.out_dtype);
  if (!cfg.for_backward) return output_alone(out, z.scalar_type());
  return {out, z, colsum, colsumsq, moments, a, c};
}

// The op's kernel (CPU and CUDA): the settings parsed into a HeadConfig, once.
Tensor7 fused_head(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& gamma,
                   const Tensor& beta, const Tensor& scale, const Tensor& running_mean,
                   const Tensor& running_var,
                   const OptTensor& num_batches_tracked EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  return fused_head_forward(x, weight, bias, gamma, beta, scale, running_mean, running_var,
                            num_batches_tracked, cfg);
}

HeadGradZ head_backward_to_dz(const Tensor& grad, const OptTensor& bias, const Tensor& gamma,
                              const Tensor& beta, const Tensor& scale, const Tensor& z,
                              const OptTensor& out, const OptTensor& colsum,
                              const OptTensor& colsumsq, const Tensor& moments, Needs needs,
                              const OptTensor& fold_a, const OptTensor& fold_c,
                              const HeadConfig& cfg) {
  const bool softmax = cfg.softmax, scale_before_bn = cfg.scale_before_bn;
  TORCH_CHECK(!softmax || out.has_value(), "epifuse::fused_head_backward: a softmax head needs out");
  const auto [pre, post] = scales(scale, cfg);
  const OptTensor rowdot =
      softmax ? OptTensor(EPIFUSE_OP(softmax_grad_rowdot).call(grad, *out)) : std::nullopt;
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
    std::tie(a, c) =
        EPIFUSE_OP(bn_fold_eval).call(bias, gamma, beta, pre, post, stat(0), stat(1), cfg.eps);
  }
  const Tensor sums = EPIFUSE_OP(head_grad_sums)
                          .call(grad, softmax_out, rowdot, z, a, c, cfg.activation,
                                cfg.negative_slope);
  // du (hence dz, d bias and a scale before BatchNorm) needs the batch terms of every rank:
  // nn.SyncBatchNorm's condition, so ranks on the reference path issue the same all_reduce.
  const bool need_du =
      needs[0] || needs[1] || needs[2] || (cfg.has_scale && scale_before_bn && needs[5]);
  OptTensor global_sums;
  if (cfg.training && !cfg.group_name.empty() && need_du) {
    global_sums = EPIFUSE_OP(synced_grad_sums)
                      .call(sums, moments, bias, gamma, pre, post, cfg.eps, cfg.group_name);
  }
  auto [coef, g_bias, g_gamma, g_beta, g_pre, g_post] =
      EPIFUSE_OP(head_grad_coefficients)
          .call(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta, pre, post,
                cfg.training, cfg.eps);
  // Without a scale (has_scale false) nothing read it: its gradient is zero where asked for.
  const Tensor g_scale = !cfg.has_scale ? Tensor() : scale_before_bn ? g_pre : g_post;
  HeadGradZ r{Tensor(), g_bias, g_gamma, g_beta, g_scale};
  // dz in z's dtype: the GEMM's, so dX and dW run in it too (under autocast, as eager's).
  if (needs[0] || needs[1]) {
    r.dz = EPIFUSE_OP(head_grad_z)
               .call(grad, softmax_out, rowdot, z, coef, a, c, cfg.activation, cfg.negative_slope);
  }
  return r;
}

namespace {

// An fp32 result from 16-bit operands (dW in the fp32 parameters' dtype, dX in an fp32 x's:
// grad_x_dtype) is written in fp32 by the GEMM itself, no 16-bit result and no cast pass; from
// fp16 with inf wherever the fp16 product would overflow (bf16 has fp32's range), so that
// GradScaler skips the same steps as eager's. Any other dX comes back in z's dtype.
OptDType fp32_from_16_bit(const Tensor& dz, at::ScalarType want) {
  return want == at::kFloat && dz.element_size() == 2 ? OptDType(at::kFloat) : std::nullopt;
}

}  // namespace

Tensor backward_dx(const Tensor& dz, const Tensor& weight, const HeadConfig& cfg) {
  return EPIFUSE_OP(backward_matmul)
      .call(dz, weight, cfg.precision,
            fp32_from_16_bit(dz, cfg.grad_x_dtype.value_or(dz.scalar_type())));
}

Tensor backward_dw(const Tensor& dz, const Tensor& x, at::ScalarType param_dtype,
                   const HeadConfig& cfg) {
  const Tensor grad_w = EPIFUSE_OP(backward_matmul)
                            .call(dz.t(), x, cfg.precision, fp32_from_16_bit(dz, param_dtype));
  return grad_w.scalar_type() == param_dtype ? grad_w : grad_w.to(param_dtype);
}

Tensor scale_gradient(const HeadGradZ& r, const Tensor& scale, bool needed) {
  if (r.scale.defined()) return r.scale;
  return needed ? at::zeros_like(scale) : at::empty({0}, scale.options());
}

Tensor6 head_backward(Tensor grad, Tensor x, Tensor weight, const OptTensor& bias,
                      const Tensor& gamma, const Tensor& beta, const Tensor& scale, const Tensor& z,
                      const OptTensor& out, const OptTensor& colsum, const OptTensor& colsumsq,
                      const Tensor& moments, Needs needs, const OptTensor& a, const OptTensor& c,
                      const HeadConfig& cfg) {
  const HeadGradZ r = head_backward_to_dz(grad, bias, gamma, beta, scale, z, out, colsum,
                                          colsumsq, moments, needs, a, c, cfg);
  const auto empty_options = grad.options();  // of the gradients not asked for
  grad.reset();  // the output's gradient, once dz exists
  const auto none = [&] { return at::empty({0}, empty_options); };
  const Tensor grad_x = needs[0] ? backward_dx(r.dz, weight, cfg) : none();
  weight.reset();  // under autocast its 16-bit cast, before dW's result is allocated
  const Tensor grad_w = needs[1] ? backward_dw(r.dz, x, gamma.scalar_type(), cfg) : none();
  return {grad_x, grad_w, r.bias, r.gamma, r.beta, scale_gradient(r, scale, needs[5])};
}

// The op's kernel: its settings parsed, then the one sequence (head_backward).
Tensor6 fused_head_backward(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                            const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                            const Tensor& scale, const Tensor& z, const OptTensor& out,
                            const OptTensor& colsum, const OptTensor& colsumsq,
                            const Tensor& moments, Needs needs, const OptTensor& a,
                            const OptTensor& c EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  TORCH_CHECK(!needs[0] || weight.has_value(), "epifuse::fused_head_backward: dX needs weight");
  TORCH_CHECK(!needs[1] || x.has_value(), "epifuse::fused_head_backward: dW needs x");
  return head_backward(grad, x.value_or(Tensor()), weight.value_or(Tensor()), bias, gamma, beta,
                       scale, z, out, colsum, colsumsq, moments, needs, a, c, cfg);
}

namespace {

void define(torch::Library& m) {
  // Tensors positional, settings keyword-only with defaults (head_config.h: every HeadConfig
  // field, e.g. "*, str precision='3xtf32', bool training=True, ...").
  // (out, z, colsum, colsumsq, moments, a, c): the head's output; the GEMM output z and moments
  // (the statistics u was normalized with, fold.moments_vector) for the backward; this batch's
  // column sums; the fold the output was computed with (float32 [N]: out = act(a * z + c)), which
  // the backward reads for an activation's derivative. A call with for_backward=False returns the
  // last six empty. In training, the running statistics are updated in place when
  // num_batches_tracked is given (None: BatchNorm's track_running_stats=False, or frozen
  // statistics; the running tensors are then not read). group_name non-empty: batch statistics
  // over that process group's ranks.
  m.def(("fused_head(Tensor x, Tensor weight, Tensor? bias, Tensor gamma, Tensor beta, "
         "Tensor scale, Tensor(a!) running_mean, Tensor(b!) running_var, "
         "Tensor(c!)? num_batches_tracked, " +
         head_schema_kwargs() + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str());
  // (grad_x, grad_weight, grad_bias, grad_gamma, grad_beta, grad_scale); needs: which of
  // x, weight, bias, gamma, beta, scale want a gradient (grad_x / grad_weight are empty otherwise;
  // a head without a scale returns its gradient as zeros if needed, else empty). a, c: fused_head's
  // fold, which an activation's derivative reads (absent: folded again from moments).
  m.def(("fused_head_backward(Tensor grad, Tensor? x, Tensor? weight, Tensor? bias, "
         "Tensor gamma, Tensor beta, Tensor scale, Tensor z, Tensor? out, "
         "Tensor? colsum, Tensor? colsumsq, Tensor moments, bool[6] needs, "
         "Tensor? a=None, Tensor? c=None, " +
         head_schema_kwargs() + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
            .c_str());
}

void impls(torch::Library& m) {
  m.impl("fused_head", &fused_head);
  m.impl("fused_head_backward", &fused_head_backward);
}

}  // namespace
}  // namespace epifuse::ops

TORCH_LIBRARY_FRAGMENT(epifuse, m) { epifuse::ops::define(m); }
TORCH_LIBRARY_IMPL(epifuse, CPU, m) { epifuse::ops::impls(m); }
TORCH_LIBRARY_IMPL(epifuse, CUDA, m) { epifuse::ops::impls(m); }
