// The C++ functions of the torch.ops.epifuse ops, one per op and named as the op: the kernel
// registered for CPU and CUDA (checks, then the CUDA kernels or the float64 reference), and the
// signature that types every dispatcher call of the op (EPIFUSE_OP, dispatch.h). The schemas sit
// beside each family's functions:
//
//   gemm.cpp      gemm_affine, gemm_colstats, backward_matmul, gemm_operand   (+ build info)
//   fold.cpp      bn_fold_train, bn_fold_eval, bn_fold_batch, update_running_stats
//   apply.cpp     affine_softmax, affine_softmax_, affine_, affine
//   backward.cpp  softmax_grad_rowdot, head_grad_sums, head_grad_coefficients, head_grad_z
//   synced.cpp    pack_moments, merge_fold, normalized_grad_sums, synced_batch_fold,
//                 synced_grad_sums
//   head.cpp      fused_head, fused_head_backward (the composites: the one sequence of the passes)
//
// What each computes is the math of python/epifuse/fold.py, the reference they are tested against.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>

#include "head_config.h"

// In a namespace of their own: the launchers of epifuse/kernels.h have the ops' names (and call
// them as ::epifuse::name from inside this one).
namespace epifuse::ops {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Tensor2 = std::tuple<Tensor, Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor6 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;
using Needs = std::array<bool, 6>;  // x, weight, bias, gamma, beta, scale

// ---- gemm.cpp --------------------------------------------------------------------------------
Tensor gemm_affine(const Tensor& x, const Tensor& weight, const Tensor& a, const Tensor& c,
                   c10::string_view precision, c10::string_view activation, double negative_slope);
Tensor3 gemm_colstats(const Tensor& x, const Tensor& weight, c10::string_view precision);
Tensor backward_matmul(const Tensor& a, const Tensor& b, c10::string_view precision,
                       OptDType out_dtype);
Tensor gemm_operand(const Tensor& t, at::ScalarType dtype);

// ---- fold.cpp --------------------------------------------------------------------------------
Tensor3 bn_fold_train(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                      const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                      const OptTensor& pre_scale, const OptTensor& post_scale,
                      const Tensor& running_mean, const Tensor& running_var,
                      const Tensor& num_batches_tracked, std::optional<double> momentum,
                      double eps);
Tensor2 bn_fold_eval(const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                     const OptTensor& pre_scale, const OptTensor& post_scale,
                     const Tensor& running_mean, const Tensor& running_var, double eps);
Tensor3 bn_fold_batch(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                      const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                      const OptTensor& pre_scale, const OptTensor& post_scale, double eps);
void update_running_stats(const Tensor& moments, const Tensor& running_mean,
                          const Tensor& running_var, const Tensor& num_batches_tracked,
                          std::optional<double> momentum);

// ---- apply.cpp -------------------------------------------------------------------------------
Tensor affine_softmax(const Tensor& z, const OptTensor& a, const OptTensor& c,
                      c10::string_view activation, double negative_slope, OptDType out_dtype);
void affine_softmax_(const Tensor& z, const OptTensor& a, const OptTensor& c,
                     c10::string_view activation, double negative_slope);
void affine_(const Tensor& z, const OptTensor& a, const OptTensor& c, c10::string_view activation,
             double negative_slope);
Tensor affine(const Tensor& z, const Tensor& a, const Tensor& c, c10::string_view activation,
              double negative_slope, OptDType out_dtype);

// ---- backward.cpp ----------------------------------------------------------------------------
Tensor softmax_grad_rowdot(const Tensor& grad, const Tensor& out);
Tensor head_grad_sums(const Tensor& grad, const OptTensor& out, const OptTensor& rowdot,
                      const Tensor& z, const OptTensor& a, const OptTensor& c,
                      c10::string_view activation, double negative_slope);
Tensor6 head_grad_coefficients(const Tensor& sums, const OptTensor& global_sums,
                               const OptTensor& colsum, const OptTensor& colsumsq,
                               const Tensor& moments, const OptTensor& bias, const Tensor& gamma,
                               const Tensor& beta, const OptTensor& pre_scale,
                               const OptTensor& post_scale, bool training, double eps);
Tensor head_grad_z(const Tensor& grad, const OptTensor& out, const OptTensor& rowdot,
                   const Tensor& z, const Tensor& coef, const OptTensor& a, const OptTensor& c,
                   c10::string_view activation, double negative_slope);

// ---- synced.cpp ------------------------------------------------------------------------------
Tensor pack_moments(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                    const OptTensor& bias, const OptTensor& pre_scale);
Tensor3 merge_fold(const Tensor& rows, const OptTensor& bias, const Tensor& gamma,
                   const Tensor& beta, const OptTensor& pre_scale, const OptTensor& post_scale,
                   double eps);
Tensor normalized_grad_sums(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                            const Tensor& gamma, const OptTensor& pre_scale,
                            const OptTensor& post_scale, double eps);
Tensor3 synced_batch_fold(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                          const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                          const OptTensor& pre_scale, const OptTensor& post_scale, double eps,
                          c10::string_view group_name);
Tensor synced_grad_sums(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                        const Tensor& gamma, const OptTensor& pre_scale,
                        const OptTensor& post_scale, double eps, c10::string_view group_name);

// ---- head.cpp --------------------------------------------------------------------------------
Tensor7 fused_head(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                   const Tensor& gamma, const Tensor& beta, const Tensor& scale,
                   const Tensor& running_mean, const Tensor& running_var,
                   const OptTensor& num_batches_tracked EPIFUSE_HEAD_PARAMS);
Tensor6 fused_head_backward(const Tensor& grad, const OptTensor& x, const OptTensor& weight,
                            const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                            const Tensor& scale, const Tensor& z, const OptTensor& out,
                            const OptTensor& colsum, const OptTensor& colsumsq,
                            const Tensor& moments, Needs needs, const OptTensor& a,
                            const OptTensor& c EPIFUSE_HEAD_PARAMS);

}  // namespace epifuse::ops
