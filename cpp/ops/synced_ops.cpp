// The per-pass ops of synchronized batch statistics: their schemas and CUDA kernels.
//
//   pack_moments          this rank's fp64 [count, mean (N), M2 (N)] row of BatchNorm's input
//   merge_fold            every rank's rows merged, and the fold with the merged moments
//   normalized_grad_sums  the backward's fp64 [G1 (N), G2 (N), M] row, summed over the ranks next
//
// The synchronized-statistics hooks run them around one collective per direction
// (synced_hooks.cpp). CPU and fake kernels are registered from python/epifuse/synced_ops.py, the
// CPU ones composed of fold.py and distributed.py, the reference these kernels are tested against.
// Checks and messages are those of the other fold ops (op_args.h); op_checks.py mirrors them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "epifuse/sync_kernels.h"
#include "head_config.h"
#include "op_args.h"

namespace epifuse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// pack_moments' parameters into a FoldProblem (N, dtype, bias, pre_scale; no gamma: bias, or else
// pre_scale, sets the dtype both must have). Neither: nothing to read, the dtype is a placeholder.
FoldProblem prepare_input_params(const OptTensor& bias, const OptTensor& pre_scale,
                                 const Tensor& colsum, const char* op) {
  FoldProblem f;
  f.N = colsum.size(0);
  const char* like_name = bias ? "bias" : "pre_scale";
  const Tensor* like = bias ? &*bias : pre_scale ? &*pre_scale : nullptr;
  if (like == nullptr) return f;
  check_cuda(*like, op, like_name, colsum);
  f.param_dtype = to_dtype(*like, op);
  if (bias) {
    check_fold_param(*bias, "bias", /*scale=*/false, f.N, *like, like_name, op);
    f.bias = bias->data_ptr();
  }
  if (pre_scale) {
    check_fold_param(*pre_scale, "pre_scale", /*scale=*/true, f.N, *like, like_name, op);
    f.pre_scale = pre_scale->data_ptr();
    f.pre_scale_numel = pre_scale->numel();
  }
  return f;
}

Tensor pack_moments_cuda(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                         const OptTensor& bias, const OptTensor& pre_scale) {
  const char* op = "pack_moments";
  const auto guard = guard_for(colsum, op, "colsum");
  EPIFUSE_CHECK(colsum.dim() == 1, "epifuse::", op, ": expected colsum to be 1-D, got ",
                colsum.sizes());
  check_sums(colsum, "colsum", colsum.size(0), colsum, op);
  check_sums(colsumsq, "colsumsq", colsum.size(0), colsum, op);
  EPIFUSE_CHECK_VALUE(count >= 1, "epifuse::", op, ": count must be >= 1, got ", count);
  const FoldProblem f = prepare_input_params(bias, pre_scale, colsum, op);
  Tensor row = new_cuda({2 * f.N + 1}, colsum.options());
  pack_moments(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
               row.data_ptr<double>(), current_stream());
  return row;
}

// The all-gathered rows: fp64 [world >= 1, 2N + 1], a pack_moments row per rank.
void check_rows(const Tensor& rows, int64_t N, const Tensor& gamma, const char* op) {
  check_cuda(rows, op, "rows", gamma);
  EPIFUSE_CHECK(rows.scalar_type() == at::kDouble && rows.dim() == 2 && rows.size(0) >= 1 &&
                    rows.size(1) == 2 * N + 1 && rows.is_contiguous(),
                "epifuse::", op, ": expected rows to be a contiguous float64 [world, ", 2 * N + 1,
                "] tensor (a [count, mean, M2] row per rank, world >= 1), got ", rows.scalar_type(),
                " ", rows.sizes());
}

std::tuple<Tensor, Tensor, Tensor> merge_fold_cuda(const Tensor& rows, const OptTensor& bias,
                                                   const Tensor& gamma, const Tensor& beta,
                                                   const OptTensor& pre_scale,
                                                   const OptTensor& post_scale, double eps) {
  const char* op = "merge_fold";
  const auto guard = guard_for(gamma, op, "gamma");
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_rows(rows, f.N, gamma, op);
  auto [a, c] = fold_outputs(gamma, f);
  Tensor moments = new_cuda({2 * f.N + 1}, gamma.options().dtype(at::kDouble));
  merge_fold(f, rows.data_ptr<double>(), rows.size(0), moments.data_ptr<double>(),
             current_stream());
  return {a, c, moments};
}

Tensor normalized_grad_sums_cuda(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                                 const Tensor& gamma, const OptTensor& pre_scale,
                                 const OptTensor& post_scale, double eps) {
  const char* op = "normalized_grad_sums";
  const auto guard = guard_for(gamma, op, "gamma");
  // No beta in this row's math: gamma stands in for it (checked already, read by no kernel).
  const FoldProblem f = prepare_fold(bias, gamma, gamma, pre_scale, post_scale, eps, op);
  check_sums(sums, "sums", 2 * f.N + 1, gamma, op);
  check_sums(moments, "moments", 2 * f.N + 1, gamma, op);
  Tensor out = new_cuda({2 * f.N + 1}, sums.options());
  normalized_grad_sums(f, sums.data_ptr<double>(), moments.data_ptr<double>(),
                       out.data_ptr<double>(), current_stream());
  return out;
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY_FRAGMENT(epifuse, m) {
  using epifuse::head_schema_kwargs;
  // row: fp64 [count, mean (N), M2 (N)] of u = pre_scale * (z + bias) over count >= 1 rows.
  m.def("pack_moments(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, Tensor? pre_scale) "
        "-> Tensor");
  // rows: fp64 [world, 2N + 1], a pack_moments row per rank -> (a, c, moments), as bn_fold_batch's
  // with the merged statistics (moments' count, the total, stays on the device).
  m.def((std::string("merge_fold(Tensor rows, Tensor? bias, Tensor gamma, Tensor beta, "
                     "Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"eps"}) + ") -> (Tensor, Tensor, Tensor)")
            .c_str());
  // sums: head_grad_sums' [S1, S3, M]; moments: the forward's -> fp64 [G1 (N), G2 (N), M].
  m.def((std::string("normalized_grad_sums(Tensor sums, Tensor moments, Tensor? bias, "
                     "Tensor gamma, Tensor? pre_scale, Tensor? post_scale, ") +
         head_schema_kwargs({"eps"}) + ") -> Tensor")
            .c_str());
}

TORCH_LIBRARY_IMPL(epifuse, CUDA, m) {
  m.impl("pack_moments", &epifuse::pack_moments_cuda);
  m.impl("merge_fold", &epifuse::merge_fold_cuda);
  m.impl("normalized_grad_sums", &epifuse::normalized_grad_sums_cuda);
}
