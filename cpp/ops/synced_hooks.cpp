// The CUDA kernels of the synchronized-statistics hooks (schemas in fused_head.cpp), which
// fused_head / fused_head_backward call when group_name names a process group:
//
//   synced_batch_fold  pack_moments -> all_gather of the [2N + 1] rows -> merge_fold
//   synced_grad_sums   normalized_grad_sums -> all_reduce (sum) of the [2N + 1] row
//
// One collective per direction, through PyTorch's functional collectives (_c10d_functional), called
// through the dispatcher from here: no Python between the GEMM and the apply pass (the Python
// hooks cost ~2 ms of host time per step in a dozen small float64 ops and the collectives' Python).
// The collective runs on the process group's stream, ordered after the current stream's work, and
// wait_tensor orders the current stream after it: nothing waits on the host, nothing is read back
// (the merged count stays on the device).
//
// A rank on the reference path (an empty or one-row batch) issues the same collectives, in the same
// order, of the same sizes: distributed.gather_moments' all_gather_into_tensor (the same
// ProcessGroup::_allgather_base as the functional all_gather) and _SyncedNormalize's all_reduce.
// The CPU kernels stay in Python (python/epifuse/fused_head.py) over the same per-pass ops.
#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "op_args.h"
#include "op_handles.h"

namespace epifuse {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

EPIFUSE_OP(pack_moments_op, "pack_moments",
           Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, const OptTensor&))
EPIFUSE_OP(merge_fold_op, "merge_fold",
           std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptTensor&, const Tensor&,
                                              const Tensor&, const OptTensor&, const OptTensor&,
                                              double))
EPIFUSE_OP(normalized_grad_sums_op, "normalized_grad_sums",
           Tensor(const Tensor&, const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                  const OptTensor&, double))
#undef EPIFUSE_OP

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

// The same message as the Python kernels' (fused_head._group).
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

std::tuple<Tensor, Tensor, Tensor> synced_batch_fold_cuda(
    const Tensor& colsum, const Tensor& colsumsq, int64_t count, const OptTensor& bias,
    const Tensor& gamma, const Tensor& beta, const OptTensor& pre_scale,
    const OptTensor& post_scale, double eps, c10::string_view group_name) {
  check_group_name(group_name);
  const Tensor row = pack_moments_op().call(colsum, colsumsq, count, bias, pre_scale);
  const Tensor rows = gather_rows(row, std::string(group_name));
  return merge_fold_op().call(rows, bias, gamma, beta, pre_scale, post_scale, eps);
}

Tensor synced_grad_sums_cuda(const Tensor& sums, const Tensor& moments, const OptTensor& bias,
                             const Tensor& gamma, const OptTensor& pre_scale,
                             const OptTensor& post_scale, double eps, c10::string_view group_name) {
  check_group_name(group_name);
  const Tensor row =
      normalized_grad_sums_op().call(sums, moments, bias, gamma, pre_scale, post_scale, eps);
  return run_collective(all_reduce_op(), {row, std::string("sum"), std::string(group_name)});
}

}  // namespace
}  // namespace epifuse

TORCH_LIBRARY_IMPL(epifuse, CUDA, m) {
  m.impl("synced_batch_fold", &epifuse::synced_batch_fold_cuda);
  m.impl("synced_grad_sums", &epifuse::synced_grad_sums_cuda);
}
