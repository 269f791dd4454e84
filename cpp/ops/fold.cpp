// The fold ops: BatchNorm (with the head's bias and scale) reduced to out = a[n] * z + c[n].
//
//   bn_fold_train         the batch statistics' fold and their moments, the running statistics
//                         updated in place: one kernel (a training forward's whole fold)
//   bn_fold_eval          the running statistics' fold (eval)
//   bn_fold_batch         the batch statistics' fold and their moments, nothing updated
//   update_running_stats  nn.BatchNorm's running-statistics update from a fold's moments
//
// float32 a, c; float64 statistics. The math is python/epifuse/fold.py's.
#include <torch/library.h>

#include <optional>
#include <string>

#include "dispatch.h"
#include "op_args.h"
#include "ops.h"

namespace epifuse::ops {
namespace {

// A running statistic: gamma's dtype (also_fp64: or float64, bn_fold_eval folding the moments a
// backward kept) and length, contiguous; ref_name names gamma's stand-in in the message
// (running_mean in update_running_stats).
void check_running(const Tensor& t, const char* name, const Tensor& gamma, const char* op,
                   bool also_fp64 = false, const char* ref_name = "gamma") {
  check_device(t, op, name, gamma);
  EPIFUSE_CHECK(t.scalar_type() == gamma.scalar_type() ||
                    (also_fp64 && t.scalar_type() == at::kDouble),
                "epifuse::", op, ": expected ", name, " to have dtype ", gamma.scalar_type(),
                " like ", ref_name, also_fp64 ? " (or float64)" : "", ", got ", t.scalar_type());
  EPIFUSE_CHECK(t.is_contiguous() && t.dim() == 1 && t.size(0) == gamma.size(0), "epifuse::", op,
                ": expected ", name, " to be a contiguous [", gamma.size(0), "] tensor, got ",
                t.sizes());
}

// The running-statistics update's settings (bn_fold_train, update_running_stats).
void check_counter_and_momentum(const Tensor& num_batches_tracked, std::optional<double> momentum,
                                const Tensor& ref, const char* op) {
  check_device(num_batches_tracked, op, "num_batches_tracked", ref);
  EPIFUSE_CHECK(num_batches_tracked.scalar_type() == at::kLong && num_batches_tracked.numel() == 1,
                "epifuse::", op, ": expected num_batches_tracked to be a one-element int64 tensor");
  if (momentum) {
    EPIFUSE_CHECK_VALUE(*momentum >= 0 && *momentum <= 1, "epifuse::", op,
                        ": momentum must be in [0, 1] or None, got ", *momentum);
  }
}

// BatchNorm's own check (same message): batch statistics need two rows or more.
void check_count(int64_t count) {
  EPIFUSE_CHECK_VALUE(count > 1, "Expected more than 1 value per channel when training, got ",
                      count, " rows");
}

}  // namespace

Tensor3 bn_fold_train(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                      const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                      const OptTensor& pre_scale, const OptTensor& post_scale,
                      const Tensor& running_mean, const Tensor& running_var,
                      const Tensor& num_batches_tracked, std::optional<double> momentum,
                      double eps) {
  const char* op = "bn_fold_train";
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_count(count);
  check_sums(colsum, "colsum", f.N, gamma, op);
  check_sums(colsumsq, "colsumsq", f.N, gamma, op);
  check_running(running_mean, "running_mean", gamma, op);
  check_running(running_var, "running_var", gamma, op);
  check_counter_and_momentum(num_batches_tracked, momentum, gamma, op);
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(bn_fold_train)(colsum, colsumsq, count, bias, gamma, beta, pre_scale,
                                            post_scale, running_mean, running_var,
                                            num_batches_tracked, momentum, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  auto [a, c] = fold_outputs(gamma, f);
  Tensor moments = new_cuda({2 * f.N + 1}, gamma.options().dtype(at::kDouble));
  ::epifuse::bn_fold_train(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
                           running_mean.data_ptr(), running_var.data_ptr(),
                           num_batches_tracked.data_ptr<int64_t>(), momentum ? *momentum : -1.0,
                           moments.data_ptr<double>(), current_stream());
  return {a, c, moments};
}

Tensor2 bn_fold_eval(const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                     const OptTensor& pre_scale, const OptTensor& post_scale,
                     const Tensor& running_mean, const Tensor& running_var, double eps) {
  const char* op = "bn_fold_eval";
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_running(running_mean, "running_mean", gamma, op, /*also_fp64=*/true);
  check_running(running_var, "running_var", gamma, op, /*also_fp64=*/true);
  EPIFUSE_CHECK(running_mean.scalar_type() == running_var.scalar_type(), "epifuse::", op,
                ": expected running_mean and running_var of one dtype, got ",
                running_mean.scalar_type(), " and ", running_var.scalar_type());
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(bn_fold_eval)(bias, gamma, beta, pre_scale, post_scale, running_mean,
                                           running_var, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  auto outputs = fold_outputs(gamma, f);
  ::epifuse::bn_fold_eval(f, running_mean.data_ptr(), running_var.data_ptr(),
                          running_mean.scalar_type() == at::kDouble, current_stream());
  return outputs;
}

Tensor3 bn_fold_batch(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                      const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                      const OptTensor& pre_scale, const OptTensor& post_scale, double eps) {
  const char* op = "bn_fold_batch";
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_count(count);
  check_sums(colsum, "colsum", f.N, gamma, op);
  check_sums(colsumsq, "colsumsq", f.N, gamma, op);
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(bn_fold_batch)(colsum, colsumsq, count, bias, gamma, beta, pre_scale,
                                            post_scale, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  auto [a, c] = fold_outputs(gamma, f);
  Tensor moments = new_cuda({2 * f.N + 1}, gamma.options().dtype(at::kDouble));
  ::epifuse::bn_fold_batch(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
                           moments.data_ptr<double>(), current_stream());
  return {a, c, moments};
}

// The running statistics (in place) from the moments a training fold returned: bn_fold_batch's, or
// the synchronized fold's merged ones, whose count (moments[2N]) stays on the device.
void update_running_stats(const Tensor& moments, const Tensor& running_mean,
                          const Tensor& running_var, const Tensor& num_batches_tracked,
                          std::optional<double> momentum) {
  const char* op = "update_running_stats";
  const DType dtype = to_dtype(running_mean, op);
  EPIFUSE_CHECK(running_mean.is_contiguous() && running_mean.dim() == 1, "epifuse::", op,
                ": expected running_mean to be a contiguous 1-D tensor, got ", running_mean.sizes());
  const int64_t n = running_mean.size(0);
  check_running(running_var, "running_var", running_mean, op, false, "running_mean");
  check_sums(moments, "moments", 2 * n + 1, running_mean, op);
  check_counter_and_momentum(num_batches_tracked, momentum, running_mean, op);
  if (!running_mean.is_cuda()) {
    return EPIFUSE_REFERENCE(update_running_stats)(moments, running_mean, running_var,
                                                   num_batches_tracked, momentum);
  }
  const auto guard = guard_for(running_mean, op, "running_mean");
  ::epifuse::update_running_stats(n, dtype, moments.data_ptr<double>(), running_mean.data_ptr(),
                                  running_var.data_ptr(), num_batches_tracked.data_ptr<int64_t>(),
                                  momentum ? *momentum : -1.0, current_stream());
}

namespace {

std::vector<std::string> schemas() {
  const std::string fold_params =
      "Tensor? bias, Tensor gamma, Tensor beta, Tensor? pre_scale, Tensor? post_scale, ";
  return {
      // (a, c, moments): bn_fold_batch's outputs, and the running statistics updated in place.
      "bn_fold_train(Tensor colsum, Tensor colsumsq, int count, " + fold_params +
          "Tensor(a!) running_mean, Tensor(b!) running_var, Tensor(c!) num_batches_tracked, " +
          head_schema_kwargs({"momentum", "eps"}) + ") -> (Tensor, Tensor, Tensor)",
      "bn_fold_eval(" + fold_params + "Tensor running_mean, Tensor running_var, " +
          head_schema_kwargs({"eps"}) + ") -> (Tensor, Tensor)",
      // (a, c, moments); moments: float64 [mean (N), biased variance (N), count] of u, what the
      // backward normalizes with (fold.moments_vector).
      "bn_fold_batch(Tensor colsum, Tensor colsumsq, int count, " + fold_params +
          head_schema_kwargs({"eps"}) + ") -> (Tensor, Tensor, Tensor)",
      "update_running_stats(Tensor moments, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor(c!) num_batches_tracked, " +
          head_schema_kwargs({"momentum"}) + ") -> ()",
  };
}

void impls(torch::Library& m) {
  m.impl("bn_fold_train", &bn_fold_train);
  m.impl("bn_fold_eval", &bn_fold_eval);
  m.impl("bn_fold_batch", &bn_fold_batch);
  m.impl("update_running_stats", &update_running_stats);
}

}  // namespace
}  // namespace epifuse::ops

EPIFUSE_REGISTER_OPS(epifuse::ops::schemas, epifuse::ops::impls)
