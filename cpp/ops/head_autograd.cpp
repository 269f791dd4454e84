// The autograd and autocast kernels of the head's ops (head.cpp), in C++: a Python autograd
// wrapper (torch.library.register_autograd) cost ~0.3 ms of host time per training step on the
// H100 machine, more than a step of problem 84 in bf16 spends on everything but its GEMMs.
//
//   Autograd      fused_head: one node (FusedHead) whose backward calls fused_head_backward, or
//                 under autocast runs its steps itself so that it can free the 16-bit casts of x
//                 and W after their last GEMM (a step's peak memory then stays at eager's);
//                 fused_head_backward: once differentiable (FusedHeadBackward raises on a second).
//   AutocastCUDA  fused_head: the GEMMs' dtype and the output dtype eager's modules would give.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "dispatch.h"
#include "head.h"
#include "weight_split_cache.h"

namespace epifuse {

using namespace ops;  // NOLINT: the head's types and sequence (ops.h, head.h)

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd functions' arguments, which their backwards return one gradient (or none) for.
constexpr int kForwardArgs = 10;   // FusedHead: fused_head's 9 tensors, the HeadConfig
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
                               const Tensor& running_var, const OptTensor& num_batches_tracked,
                               const HeadConfig& cfg) {
    Tensor out, z, colsum, colsumsq, moments, a, c, x_gemm, w_gemm;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      // The GEMM's operands (autocast: 16-bit casts; the weight's kept while it is unchanged),
      // cast once here so that the backward reuses them.
      x_gemm = gemm_input(x, cfg);
      w_gemm = gemm_weight(weight, cfg);
      std::tie(out, z, colsum, colsumsq, moments, a, c) = EPIFUSE_OP(fused_head).call(
          x_gemm, w_gemm, bias, gamma, beta, scale, running_mean, running_var,
          num_batches_tracked EPIFUSE_HEAD_ARGS);
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

  // grads by reference: it is the engine's own list (CppNode moves the incoming gradients into it
  // and holds no other reference), so the usual backward below can free the output's gradient.
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    variable_list result(kForwardArgs);
    // The step's forwards are over: the weight operands they shared go (weight_split_cache.h), so
    // that the backward's peak holds none of them.
    release_step_operands();
    if (!grads[0].defined()) return result;
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
    Tensor6 all;
    if (!at::GradMode::is_enabled()) {
      // The usual backward (no create_graph): the one sequence, given the last references to the
      // output's gradient and the casts, each freed after its last use (head_backward): the
      // output's gradient once dz exists (the projection MLP's fp32 step, whose 4096 x 4096
      // heads' gradients are 64 MiB each, peaked 64 MiB lower), and under autocast the weight's
      // 16-bit cast after dX, before dW's fp32 result is allocated (problem 84: 128 MiB of bf16
      // weight beside 256 MiB of fp32 dW). A call of the op would hold them until it returned.
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      all = head_backward(std::move(grads[0]), std::move(x_gemm), std::move(w_gemm), opt(s.bias),
                          s.gamma, s.beta, s.scale, s.z, opt(s.out), opt(s.colsum),
                          opt(s.colsumsq), s.moments, needs, opt(s.a), opt(s.c), cfg);
    } else {  // create_graph: through the op, whose autograd kernel records FusedHeadBackward
      all = EPIFUSE_OP(fused_head_backward).call(
          grads[0], opt(x_gemm), opt(w_gemm), opt(s.bias), s.gamma, s.beta, s.scale, s.z,
          opt(s.out), opt(s.colsum), opt(s.colsumsq), s.moments, needs, opt(s.a),
          opt(s.c) EPIFUSE_HEAD_ARGS);
    }
    const Tensor* grads_out[6] = {&std::get<0>(all), &std::get<1>(all), &std::get<2>(all),
                                  &std::get<3>(all), &std::get<4>(all), &std::get<5>(all)};
    for (int i = 0; i < 6; ++i) {
      if (needs[i]) result[i] = *grads_out[i];
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
    auto r = call_below_autograd(EPIFUSE_OP(fused_head_backward), grad, x, weight, bias, gamma, beta,
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
                            const Tensor& running_mean, const Tensor& running_var,
                            const OptTensor& num_batches_tracked EPIFUSE_HEAD_PARAMS) {
  const HeadConfig cfg EPIFUSE_HEAD_CONFIG_FROM_PARAMS;
  if (!cfg.for_backward) {  // no autograd node: nothing is kept
    const bool records = at::GradMode::is_enabled() &&
                         (x.requires_grad() || weight.requires_grad() ||
                          (bias && bias->requires_grad()) || gamma.requires_grad() ||
                          beta.requires_grad() || scale.requires_grad());
    TORCH_CHECK(!records, "epifuse::fused_head: for_backward=False, but an input requires grad "
                "under grad mode (call it with for_backward=True, or under torch.no_grad())");
    return call_below_autograd(EPIFUSE_OP(fused_head), x, weight, bias, gamma, beta, scale,
                               running_mean, running_var, num_batches_tracked EPIFUSE_HEAD_ARGS);
  }
  const variable_list r = FusedHead::apply(x, weight, bias, gamma, beta, scale, running_mean,
                                           running_var, num_batches_tracked, cfg);
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
                            const Tensor& running_mean, const Tensor& running_var,
                            const OptTensor& num_batches_tracked EPIFUSE_HEAD_PARAMS) {
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
  return EPIFUSE_OP(fused_head).call(x, weight, bias, gamma, beta, scale, running_mean,
                                     running_var, num_batches_tracked EPIFUSE_HEAD_ARGS);
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
    return call_below_autograd(EPIFUSE_OP(fused_head_backward), grad, x, weight, bias, gamma, beta,
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

TORCH_LIBRARY_IMPL(epifuse, AutocastCUDA, m) {
  m.impl("fused_head", &epifuse::fused_head_autocast);
}

TORCH_LIBRARY_IMPL(epifuse, Autograd, m) {
  m.impl("fused_head", &epifuse::fused_head_autograd);
  m.impl("fused_head_backward", &epifuse::fused_head_backward_autograd);
}
