// Synchronized batch statistics: the per-pass ops, and the two hooks that run them around one
// collective per direction, which fused_head / fused_head_backward call when group_name names a
// process group.
//
//   pack_moments          this rank's fp64 [count, mean (N), M2 (N)] row of BatchNorm's input
//   merge_fold            every rank's rows merged, and the fold with the merged moments
//   normalized_grad_sums  the backward's fp64 [G1 (N), G2 (N), M] row, summed over the ranks next
//   synced_batch_fold     pack_moments -> all_gather of the [2N + 1] rows -> merge_fold
//   synced_grad_sums      normalized_grad_sums -> all_reduce (sum) of the [2N + 1] row
//
// The hooks call PyTorch's functional collectives (_c10d_functional) through the dispatcher, on any
// backend (NCCL, gloo): no Python between the GEMM and the apply pass (the Python hooks cost ~2 ms
// of host time per step in a dozen small float64 ops and the collectives' Python). On CUDA the
// collective runs on the process group's stream, ordered after the current stream's work, and
// wait_tensor orders the current stream after it: nothing waits on the host, nothing is read back
// (the merged count stays on the device).
//
// A rank on the reference path (an empty or one-row batch) issues the same collectives, in the same
// order, of the same sizes (python/epifuse/distributed.py: gather_moments, sum_over_ranks).
#include <ATen/core/stack.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <optional>
#include <string>

#include "dispatch.h"
#include "epifuse/sync_kernels.h"
#include "op_args.h"
#include "ops.h"

namespace epifuse::ops {
namespace {

// pack_moments' parameters into a FoldProblem (N, dtype, bias, pre_scale; no gamma: bias, or else
// pre_scale, sets the dtype both must have). Neither: nothing to read, the dtype is a placeholder.
FoldProblem prepare_input_params(const OptTensor& bias, const OptTensor& pre_scale,
                                 const Tensor& colsum, const char* op) {
  FoldProblem f;
  f.N = colsum.size(0);
  const char* like_name = bias ? "bias" : "pre_scale";
  const Tensor* like = bias ? &*bias : pre_scale ? &*pre_scale : nullptr;
  if (like == nullptr) return f;
  check_device(*like, op, like_name, colsum);
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

// The all-gathered rows: fp64 [world >= 1, 2N + 1], a pack_moments row per rank.
void check_rows(const Tensor& rows, int64_t N, const Tensor& gamma, const char* op) {
  check_device(rows, op, "rows", gamma);
  EPIFUSE_CHECK(rows.scalar_type() == at::kDouble && rows.dim() == 2 && rows.size(0) >= 1 &&
                    rows.size(1) == 2 * N + 1 && rows.is_contiguous(),
                "epifuse::", op, ": expected rows to be a contiguous float64 [world, ", 2 * N + 1,
                "] tensor (a [count, mean, M2] row per rank, world >= 1), got ", rows.scalar_type(),
                " ", rows.sizes());
}

// The functional collectives' handles, called boxed: their group argument's schema type is `Any` in
// recent PyTorch (a group name or a group object), which no typed C++ signature matches.
const c10::OperatorHandle& all_gather_into_tensor_op() {
  static const c10::OperatorHandle h = c10::Dispatcher::singleton().findSchemaOrThrow(
      "_c10d_functional::all_gather_into_tensor", "");
  return h;
}

const c10::OperatorHandle& all_reduce_op() {
  static const c10::OperatorHandle h =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce", "");
  return h;
}

const auto& wait_tensor_op() {
  static const auto h = find_op<Tensor(const Tensor&)>("_c10d_functional::wait_tensor");
  return h;
}

// The collective's result, once the current stream is ordered after it (wait_tensor).
Tensor run_collective(const c10::OperatorHandle& op, torch::jit::Stack stack) {
  op.callBoxed(&stack);
  return wait_tensor_op().call(stack.at(0).toTensor());
}

void check_group_name(c10::string_view group_name) {
  EPIFUSE_CHECK_VALUE(!group_name.empty(),
                      "epifuse: the synchronized-statistics hooks need a process group's "
                      "group_name, got ''");
}

// Every rank's row, [world, 2N + 1] in rank order (distributed.gather_moments).
Tensor gather_rows(const Tensor& row, const std::string& group_name) {
  const int64_t world = c10d::resolve_process_group(group_name)->getSize();
  const Tensor gathered =
      run_collective(all_gather_into_tensor_op(), {row, world, group_name});  // [world * (2N + 1)]
  return gathered.view({world, row.numel()});
}

}  // namespace

Tensor pack_moments(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                    const OptTensor& bias, const OptTensor& pre_scale) {
  const char* op = "pack_moments";
  EPIFUSE_CHECK(colsum.dim() == 1, "epifuse::", op, ": expected colsum to be 1-D, got ",
                colsum.sizes());
  check_sums(colsum, "colsum", colsum.size(0), colsum, op);
  check_sums(colsumsq, "colsumsq", colsum.size(0), colsum, op);
  EPIFUSE_CHECK_VALUE(count >= 1, "epifuse::", op, ": count must be >= 1, got ", count);
  const FoldProblem f = prepare_input_params(bias, pre_scale, colsum, op);
  if (!colsum.is_cuda()) {
    return EPIFUSE_REFERENCE(pack_moments)(colsum, colsumsq, count, bias, pre_scale);
  }
  const auto guard = guard_for(colsum, op, "colsum");
  Tensor row = new_cuda({2 * f.N + 1}, colsum.options());
  ::epifuse::pack_moments(f, colsum.data_ptr<double>(), colsumsq.data_ptr<double>(), count,
                          row.data_ptr<double>(), current_stream());
  return row;
}

Tensor3 merge_fold(const Tensor& rows, const OptTensor& bias, const Tensor& gamma,
                   const Tensor& beta, const OptTensor& pre_scale, const OptTensor& post_scale,
                   double eps) {
  const char* op = "merge_fold";
  FoldProblem f = prepare_fold(bias, gamma, beta, pre_scale, post_scale, eps, op);
  check_rows(rows, f.N, gamma, op);
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(merge_fold)(rows, bias, gamma, beta, pre_scale, post_scale, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  auto [a, c] = fold_outputs(gamma, f);
  Tensor moments = new_cuda({2 * f.N + 1}, gamma.options().dtype(at::kDouble));
  ::epifuse::merge_fold(f, rows.data_ptr<double>(), rows.size(0), moments.data_ptr<double>(),
                        current_stream());
  return {a, c, moments};
}

Tensor normalized_grad_sums(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                            const Tensor& gamma, const OptTensor& pre_scale,
                            const OptTensor& post_scale, double eps) {
  const char* op = "normalized_grad_sums";
  // No beta in this row's math: gamma stands in for it (checked already, read by no kernel).
  const FoldProblem f = prepare_fold(bias, gamma, gamma, pre_scale, post_scale, eps, op);
  check_sums(sums, "sums", 2 * f.N + 1, gamma, op);
  check_sums(moments, "moments", 2 * f.N + 1, gamma, op);
  if (!gamma.is_cuda()) {
    return EPIFUSE_REFERENCE(normalized_grad_sums)(sums, moments, bias, gamma, pre_scale,
                                                   post_scale, eps);
  }
  const auto guard = guard_for(gamma, op, "gamma");
  Tensor out = new_cuda({2 * f.N + 1}, sums.options());
  ::epifuse::normalized_grad_sums(f, sums.data_ptr<double>(), moments.data_ptr<double>(),
                                  out.data_ptr<double>(), current_stream());
  return out;
}

Tensor3 synced_batch_fold(const Tensor& colsum, const Tensor& colsumsq, int64_t count,
                          const OptTensor& bias, const Tensor& gamma, const Tensor& beta,
                          const OptTensor& pre_scale, const OptTensor& post_scale, double eps,
                          c10::string_view group_name) {
  check_group_name(group_name);
  const Tensor row = EPIFUSE_OP(pack_moments).call(colsum, colsumsq, count, bias, pre_scale);
  const Tensor rows = gather_rows(row, std::string(group_name));
  return EPIFUSE_OP(merge_fold).call(rows, bias, gamma, beta, pre_scale, post_scale, eps);
}

Tensor synced_grad_sums(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                        const Tensor& gamma, const OptTensor& pre_scale,
                        const OptTensor& post_scale, double eps, c10::string_view group_name) {
  check_group_name(group_name);
  const Tensor row = EPIFUSE_OP(normalized_grad_sums)
                         .call(sums, moments, bias, gamma, pre_scale, post_scale, eps);
  return run_collective(all_reduce_op(), {row, std::string("sum"), std::string(group_name)});
}

namespace {

// The per-pass ops: checked here, then CUDA kernels or their float64 reference.
std::vector<std::string> pass_schemas() {
  const std::string fold_params =
      "Tensor? bias, Tensor gamma, Tensor beta, Tensor? pre_scale, Tensor? post_scale, ";
  return {
      // row: fp64 [count, mean (N), M2 (N)] of u = pre_scale * (z + bias) over count >= 1 rows.
      "pack_moments(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, Tensor? pre_scale) "
      "-> Tensor",
      // rows: fp64 [world, 2N + 1], a pack_moments row per rank -> (a, c, moments), as
      // bn_fold_batch's with the merged statistics (moments' count, the total, stays on the device).
      "merge_fold(Tensor rows, " + fold_params + head_schema_kwargs({"eps"}) +
          ") -> (Tensor, Tensor, Tensor)",
      // sums: head_grad_sums' [S1, S3, M]; moments: the forward's -> fp64 [G1 (N), G2 (N), M].
      "normalized_grad_sums(Tensor sums, Tensor moments, Tensor? bias, Tensor gamma, "
      "Tensor? pre_scale, Tensor? post_scale, " + head_schema_kwargs({"eps"}) + ") -> Tensor",
  };
}

// The hooks: composites of the passes above and a collective, one kernel for every device.
// group_name must name a process group.
std::vector<std::string> hook_schemas() {
  const std::string kwargs = head_schema_kwargs({"eps", "group_name"});
  return {
      "synced_batch_fold(Tensor colsum, Tensor colsumsq, int count, Tensor? bias, Tensor gamma, "
      "Tensor beta, Tensor? pre_scale, Tensor? post_scale, " + kwargs +
          ") -> (Tensor, Tensor, Tensor)",
      "synced_grad_sums(Tensor sums, Tensor moments, Tensor? bias, Tensor gamma, "
      "Tensor? pre_scale, Tensor? post_scale, " + kwargs + ") -> Tensor",
  };
}

void impls(torch::Library& m) {
  m.impl("pack_moments", &pack_moments);
  m.impl("merge_fold", &merge_fold);
  m.impl("normalized_grad_sums", &normalized_grad_sums);
  m.impl("synced_batch_fold", &synced_batch_fold);
  m.impl("synced_grad_sums", &synced_grad_sums);
}

}  // namespace
}  // namespace epifuse::ops

EPIFUSE_REGISTER_OPS(epifuse::ops::pass_schemas, epifuse::ops::impls)
// The hooks: no float64 reference of their own (their passes have one).
TORCH_LIBRARY_FRAGMENT(epifuse, m) { epifuse::define_ops(m, epifuse::ops::hook_schemas()); }
