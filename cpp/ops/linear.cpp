// epifuse::fused_linear: a plain Linear layer [-> activation] [-> row softmax] as one op, so that
// the layers of a head that no BatchNorm follows (Barlow Twins' last Linear, SimCLR's projector)
// run on the same GEMM as the fused blocks: at fp32 default precision the 3x split GEMM, fp32's
// accuracy at tensor-core speed, instead of cuBLAS's SGEMM.
//
//   forward   gemm_affine with a = 1, c = bias: the bias and the activation in the GEMM's epilogue,
//             one GEMM; where the backward needs the activation's input (GELU, SiLU; any
//             activation before a softmax) or the output is wider than the GEMM, the GEMM writes
//             h = x . W^T + bias and affine / affine_softmax applies the rest
//   backward  the softmax's and the activation's derivatives (ATen's own backward kernels, as
//             eager runs them), d bias as column sums, then dX and dW with backward_matmul in the
//             forward's precision (the head's backward_dx / backward_dw)
//
// Training and eval are the same math. The autograd and autocast kernels are in
// linear_autograd.cpp, the fake kernel in python/epifuse/_ops/linear.py.
#include "linear.h"

#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>

#include "dispatch.h"
#include "head.h"
#include "op_args.h"

namespace epifuse::ops {
namespace {

constexpr const char* kOp = "fused_linear";

// The per-column (a, c) = (ones, zeros) of a Linear without a bias, float32 [n] on like's device,
// made once per device and width: a fill kernel and an allocation less per call. Made afresh (not
// kept) while a CUDA graph is being captured, where the fill would only run at replay.
std::pair<Tensor, Tensor> unit_columns(int64_t n, const Tensor& like) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t>, std::pair<Tensor, Tensor>> kept;
  const auto options = like.options().dtype(at::kFloat);
  const auto make = [&] { return std::make_pair(at::ones({n}, options), at::zeros({n}, options)); };
  if (like.is_cuda()) {
    const auto guard = guard_for(like, kOp, "x");
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(current_stream(), &status) != cudaSuccess ||
        status != cudaStreamCaptureStatusNone) {
      return make();
    }
  }
  const std::tuple<int, int, int64_t> key{int(like.device().type()), like.get_device(), n};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = kept.find(key);
  if (it == kept.end()) it = kept.emplace(key, make()).first;
  return it->second;
}

// The activations whose derivative the backward reads from their output (ReLU's mask, a
// non-negative LeakyReLU slope's sign), as eager's backward does: the output is kept anyway.
bool derivative_from_output(const HeadConfig& cfg) {
  return cfg.activation.empty() || cfg.activation == "relu" ||
         (cfg.activation == "leaky_relu" && cfg.negative_slope >= 0);
}

}  // namespace

bool keeps_pre_activation(const HeadConfig& cfg) {
  return cfg.for_backward && !cfg.activation.empty() &&
         (cfg.softmax || !derivative_from_output(cfg));
}

namespace {

// The gradient through the activation: ATen's backward of it, at its input h (or its output y
// where derivative_from_output says it suffices).
Tensor activation_backward(const Tensor& g, const Tensor& h, const Tensor& y, const HeadConfig& cfg) {
  const std::string& act = cfg.activation;
  if (act.empty()) return g;
  const bool from_y = !h.defined();
  const Tensor& at_point = from_y ? y : h;
  if (act == "relu") return at::threshold_backward(g, at_point, 0);
  if (act == "leaky_relu") return at::leaky_relu_backward(g, at_point, cfg.negative_slope, from_y);
  if (act == "gelu") return at::gelu_backward(g, h, "none");
  if (act == "gelu_tanh") return at::gelu_backward(g, h, "tanh");
  TORCH_CHECK(act == "silu", "epifuse::fused_linear: unknown activation '", act, "'");
  return at::silu_backward(g, h);
}

}  // namespace

HeadConfig linear_config(c10::string_view precision, bool softmax, c10::string_view activation,
                         double negative_slope, OptDType gemm_dtype, OptDType out_dtype,
                         bool for_backward) {
  HeadConfig cfg;
  cfg.precision = std::string(precision);
  cfg.training = false;  // no statistics: training and eval are the same math
  cfg.scale_before_bn = false;
  cfg.softmax = softmax;
  cfg.activation = std::string(activation);
  cfg.negative_slope = negative_slope;
  cfg.momentum = std::nullopt;
  cfg.eps = 0.0;
  cfg.group_name = "";
  cfg.has_scale = false;
  cfg.gemm_dtype = gemm_dtype;
  cfg.out_dtype = out_dtype;
  cfg.grad_x_dtype = std::nullopt;
  cfg.for_backward = for_backward;
  return cfg;
}

Tensor2 fused_linear_forward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                             const HeadConfig& cfg) {
  // The weight's 3x split and 16-bit cast: kept as a head's are (keep_policy).
  const WeightOperandsKept keep(keep_policy(cfg));
  check_output_settings(x, cfg, kOp);
  EPIFUSE_CHECK(weight.dim() == 2, "epifuse::", kOp, ": expected weight to be 2-D [N, K], got ",
                weight.dim(), "-D");
  const Tensor x_gemm = gemm_input(x, cfg), w_gemm = gemm_weight(weight, cfg);
  check_gemm_operands(x_gemm, w_gemm, cfg.precision, kOp);
  const int64_t n = weight.size(0);
  const auto [ones, zeros] = unit_columns(n, x);
  // The bias in the epilogue's fp32 (a 16-bit model's widened: added to the fp32 accumulator).
  Tensor c = zeros;
  if (bias) {
    check_device(*bias, kOp, "bias", x);
    // Added in the epilogue's fp32: a 16-bit or fp32 bias (an autocast model's fp32 parameters
    // beside a weight the autograd kernel hands over cast, or a 16-bit model's own).
    const at::ScalarType b = bias->scalar_type();
    EPIFUSE_CHECK(b == at::kFloat || b == at::kHalf || b == at::kBFloat16, "epifuse::", kOp,
                  ": expected bias to be float32, float16 or bfloat16, got ", b);
    c = column_vector(bias->scalar_type() == at::kFloat ? *bias : bias->to(at::kFloat), n, kOp,
                      "bias", x);
  }
  const bool recast = cfg.out_dtype && *cfg.out_dtype != x_gemm.scalar_type();
  // h = x . W^T + bias as a tensor of its own: what a softmax reads (the activation goes into its
  // pass), what a wider output is made from (z rounded once, as in eager), and what the
  // derivative of GELU or SiLU reads.
  const bool keep_h = cfg.softmax || recast || (cfg.for_backward && !derivative_from_output(cfg));
  if (!keep_h) {
    Tensor out = EPIFUSE_OP(gemm_affine).call(x_gemm, w_gemm, ones, c, cfg.precision,
                                              cfg.activation, cfg.negative_slope);
    return {out, at::empty({0}, out.options())};
  }
  Tensor h = EPIFUSE_OP(gemm_affine).call(x_gemm, w_gemm, ones, c, cfg.precision, "", 0.01);
  Tensor out;
  if (cfg.softmax && !cfg.for_backward && !recast) {
    EPIFUSE_OP(affine_softmax_).call(h, std::nullopt, std::nullopt, cfg.activation,
                                     cfg.negative_slope);
    return {h, at::empty({0}, h.options())};
  }
  if (cfg.softmax) {
    out = EPIFUSE_OP(affine_softmax).call(h, std::nullopt, std::nullopt, cfg.activation,
                                          cfg.negative_slope, cfg.out_dtype);
  } else {
    out = EPIFUSE_OP(affine).call(h, ones, zeros, cfg.activation, cfg.negative_slope,
                                  cfg.out_dtype);
  }
  // The backward reads h only for an activation's derivative.
  return {out, keeps_pre_activation(cfg) ? h : at::empty({0}, h.options())};
}

Tensor2 fused_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                     c10::string_view precision, bool softmax, c10::string_view activation,
                     double negative_slope, OptDType gemm_dtype, OptDType out_dtype,
                     bool for_backward) {
  return fused_linear_forward(x, weight, bias,
                              linear_config(precision, softmax, activation, negative_slope,
                                            gemm_dtype, out_dtype, for_backward));
}

std::array<Tensor, 3> linear_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                      const Tensor& out, const Tensor& h, LinearNeeds needs,
                                      at::ScalarType param_dtype, const HeadConfig& cfg) {
  // The GEMM's dtype (16 bits under autocast): dh, dX and dW run in it, as eager's.
  const at::ScalarType z_dtype = cfg.gemm_dtype.value_or(grad.scalar_type());
  Tensor g = grad;
  if (cfg.softmax) g = at::_softmax_backward_data(g, out, 1, out.scalar_type());
  if (g.scalar_type() != z_dtype) g = g.to(z_dtype);
  const Tensor dh = activation_backward(g, keeps_pre_activation(cfg) ? h : Tensor(), out, cfg);
  std::array<Tensor, 3> r;
  if (needs[2]) {  // column sums, accumulated in fp32 (eager's 16-bit sum then widened)
    r[2] = dh.sum(0, false, dh.element_size() == 2 ? OptDType(at::kFloat) : std::nullopt);
    if (r[2].scalar_type() != param_dtype) r[2] = r[2].to(param_dtype);
  }
  if (needs[0]) r[0] = backward_dx(dh, weight, cfg);
  if (needs[1]) r[1] = backward_dw(dh, x, param_dtype, cfg);
  return r;
}

namespace {

void define(torch::Library& m) {
  // (out, h): out = softmax?(act(x . W^T + bias)) in out_dtype (None: the GEMM's); h the
  // pre-activation x . W^T + bias where the backward reads it (else empty). Settings keyword-only,
  // the head's (head_config.h) that a Linear has.
  m.def(("fused_linear(Tensor x, Tensor weight, Tensor? bias, " +
         head_schema_kwargs({"precision", "softmax", "activation", "negative_slope", "gemm_dtype",
                             "out_dtype", "for_backward"}) +
         ") -> (Tensor, Tensor)")
            .c_str());
}

void impls(torch::Library& m) { m.impl("fused_linear", &fused_linear); }

}  // namespace
}  // namespace epifuse::ops

TORCH_LIBRARY_FRAGMENT(epifuse, m) { epifuse::ops::define(m); }
TORCH_LIBRARY_IMPL(epifuse, CPU, m) { epifuse::ops::impls(m); }
TORCH_LIBRARY_IMPL(epifuse, CUDA, m) { epifuse::ops::impls(m); }
