// A plain Linear layer [-> activation] [-> row softmax] on epifuse's GEMM: the op fused_linear
// (linear.cpp), its backward's sequence, shared with the autograd and autocast kernels
// (linear_autograd.cpp).
#pragma once

#include <array>

#include "head_config.h"
#include "ops.h"

namespace epifuse::ops {

// Which of (x, weight, bias) want a gradient.
using LinearNeeds = std::array<bool, 3>;

// fused_linear's kernel: (out, h). out = softmax?(act(x . W^T + bias)); h = x . W^T + bias, kept
// where the backward reads it (an activation whose derivative needs its input, a softmax before
// which an activation sits, an output wider than the GEMM's), else empty.
Tensor2 fused_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                     c10::string_view precision, bool softmax, c10::string_view activation,
                     double negative_slope, OptDType gemm_dtype, OptDType out_dtype,
                     bool for_backward);

// Whether fused_linear returns h (else empty): for a backward, where an activation's derivative
// reads its input (before a softmax; GELU, SiLU, a negative LeakyReLU slope). The fake kernel
// (python/epifuse/_ops/linear.py) states the same rule.
bool keeps_pre_activation(const HeadConfig& cfg);

// The settings of a plain Linear as the head's config (the fields a head without a BatchNorm
// reads; the rest at neutral values), so that both kinds share gemm_input / gemm_weight,
// backward_dx / backward_dw and the output rules.
HeadConfig linear_config(c10::string_view precision, bool softmax, c10::string_view activation,
                         double negative_slope, OptDType gemm_dtype, OptDType out_dtype,
                         bool for_backward);

// The forward with its settings parsed; x and weight as the caller passed them (cast here where
// cfg.gemm_dtype asks).
Tensor2 fused_linear_forward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                             const HeadConfig& cfg);

// The backward from the output's gradient: (dX, dW, d bias), each undefined where needs does not
// ask. x and weight are the GEMMs' operands (the forward's casts under autocast); out and h what
// fused_linear returned (h read only where keeps_pre_activation). dX comes back in cfg.grad_x_dtype where the GEMM can write it (else
// the GEMM's dtype), dW and d bias in param_dtype.
std::array<Tensor, 3> linear_backward(const Tensor& grad, const Tensor& x, const Tensor& weight,
                                      const Tensor& out, const Tensor& h, LinearNeeds needs,
                                      at::ScalarType param_dtype, const HeadConfig& cfg);

}  // namespace epifuse::ops
