// The head's sequence as functions, shared by its ops (head.cpp) and their autograd and autocast
// kernels (head_autograd.cpp), which run the backward's steps themselves under autocast.
#pragma once

#include <utility>

#include "head_config.h"
#include "ops.h"
#include "weight_split_cache.h"

namespace epifuse::ops {

// Problem 39's scale multiplies BatchNorm's input, problem 84's its output: (pre_scale, post_scale).
// A head without a scale (has_scale false) passes neither: its `scale` is a stand-in that nothing
// reads, so the fold multiplies by nothing and the backward skips a one-element scale's gradient
// (a sum over every column: scratch, a memset and a last-block reduction per backward).
std::pair<OptTensor, OptTensor> scales(const Tensor& scale, const HeadConfig& cfg);

// How long a forward's weight operands (3x split, 16-bit cast) are kept: while the weight is
// unchanged where no backward follows (an eval model makes them once), for the step's forwards
// where one does (released when its backward starts). weight_split_cache.h.
KeepPolicy keep_policy(const HeadConfig& cfg);

// The activation's name and the output dtype, checked before any pass runs (the rule for both
// head kinds): out_dtype is the GEMM's dtype, or float32 from a 16-bit GEMM.
void check_output_settings(const Tensor& x, const HeadConfig& cfg, const char* op);

// x or W as the GEMMs read them: cast to cfg.gemm_dtype (autocast), or as they are. The weight's
// 16-bit cast is kept while the weight is unchanged (weight_split_cache.h).
Tensor gemm_input(const Tensor& x, const HeadConfig& cfg);
Tensor gemm_weight(const Tensor& w, const HeadConfig& cfg);

// fused_head with its settings parsed.
Tensor7 fused_head_forward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                           const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                           const Tensor& running_mean, const Tensor& running_var,
                           const OptTensor& num_batches_tracked, const HeadConfig& cfg);

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
                              const HeadConfig& cfg);

// The backward's GEMMs from dz: dX (in grad_x_dtype where the GEMM can write it: fp32 from 16-bit
// operands) and dW (in the parameters' dtype).
Tensor backward_dx(const Tensor& dz, const Tensor& weight, const HeadConfig& cfg);
Tensor backward_dw(const Tensor& dz, const Tensor& x, at::ScalarType param_dtype,
                   const HeadConfig& cfg);

// The scale's gradient as the backward returns it: computed (has_scale), or, for a head without a
// scale, whose stand-in nothing read, zeros where one is asked for and else an empty tensor.
Tensor scale_gradient(const HeadGradZ& r, const Tensor& scale, bool needed);

// The head's backward, its one sequence: head_backward_to_dz -> dX -> dW (fused_head_backward's
// kernel and FusedHead's backward both call it). dX and dW are computed only where needs asks
// (else empty tensors), the [N] parameter gradients always (the scale's: see scale_gradient).
// grad, x and weight are taken by value and dropped after their last use (grad once dz exists,
// the weight after dX), as eager's autograd frees a node's inputs once its backward has run: a
// caller that moves its last references in (the autograd node) peaks lower; x and weight are the
// GEMMs' operands (the forward's 16-bit casts under autocast), undefined where not needed.
Tensor6 head_backward(Tensor grad, Tensor x, Tensor weight, const OptTensor& bias,
                      const Tensor& gamma, const Tensor& beta, const Tensor& scale, const Tensor& z,
                      const OptTensor& out, const OptTensor& colsum, const OptTensor& colsumsq,
                      const Tensor& moments, Needs needs, const OptTensor& a, const OptTensor& c,
                      const HeadConfig& cfg);

}  // namespace epifuse::ops
