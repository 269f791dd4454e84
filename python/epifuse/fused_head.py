"""``epifuse::fused_head``: a head's fused forward as one differentiable op, with a fused backward.

The op, its backward op ``epifuse::fused_head_backward`` and their autograd are C++
(``cpp/ops/fused_head.cpp``): one composite per direction over the per-pass ops,

  forward   gemm_colstats -> fold (batch: bn_fold_batch; synchronized: synced_batch_fold;
            eval: bn_fold_eval) -> affine_softmax / affine
  backward  softmax_grad_rowdot (softmax heads) -> head_grad_sums (-> synced_grad_sums when
            synchronized) -> head_grad_coefficients -> head_grad_z -> backward_matmul (dX, dW)

which saves z, the softmax's output (softmax heads), the inputs the GEMMs need, and [N]
vectors. The op is functional: the caller (head.py) updates the running statistics from
the returned moments (``update_running_stats``: one kernel, no second fold). An eval call with ``for_backward=False`` (head.py: no_grad
under autocast) runs bn_fold_eval -> gemm_affine (fold and activation in the GEMM's epilogue)
[-> softmax] and returns the output with z, colsum, colsumsq and moments empty.

This module registers the Python side: both ops' fake kernels, and the CPU kernels of the two
synchronized-statistics hooks (``group_name`` non-empty), which reduce across the ranks between
the GEMM and the fold (synced_batch_fold: pack_moments -> all_gather -> merge_fold), and between
the gradient sums and the coefficients (synced_grad_sums: normalized_grad_sums -> all_reduce).
Their CUDA kernels are C++ (``cpp/ops/synced_hooks.cpp``): the same per-pass ops (synced_ops.py)
around the same collectives, with no Python between the GEMM and the apply pass.

Tensors are positional, the head's settings keyword-only with defaults (``HeadConfig``,
head_config.py; ``cpp/ops/head_config.h`` on the C++ side). The kernels here take them as
keywords with the same defaults (the dispatcher leaves out those equal to their default).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from . import distributed, synced_ops
from .head_config import DEFAULT as _D

_F64 = torch.float64
_F32 = torch.float32

# The op: fused_head(x, weight, bias, gamma, beta, scale, running_mean, running_var,
# **HeadConfig.kwargs()) -> (out, z, colsum, colsumsq, moments, a, c).
fused_head = torch.ops.epifuse.fused_head.default


def _group(group_name: str) -> "dist.ProcessGroup":
    from torch.distributed import distributed_c10d

    if not group_name:
        raise ValueError("epifuse: the synchronized-statistics hooks need a process group's "
                         "group_name, got ''")
    return distributed_c10d._resolve_process_group(group_name)


# --------------------------------------------------------------------------- synchronized hooks

# The CPU kernels; the CUDA kernels are C++ (cpp/ops/synced_hooks.cpp: the same per-pass ops around
# functional collectives, with no Python between the GEMM and the apply pass).

@torch.library.register_kernel("epifuse::synced_batch_fold", "cpu")
def _synced_batch_fold(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                       eps=_D.eps, group_name=_D.group_name):
    """The fold from this batch's column sums merged with every rank's: (a, c, moments)."""
    group = _group(group_name)
    row = synced_ops.pack_moments(colsum, colsumsq, count, bias, pre_scale)
    return synced_ops.merge_fold(distributed.gather_moments(row, group), bias, gamma, beta,
                                 pre_scale, post_scale, eps=eps)


@torch.library.register_kernel("epifuse::synced_grad_sums", "cpu")
def _synced_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale, *, eps=_D.eps,
                      group_name=_D.group_name):
    """``fold.normalized_grad_sums`` of this batch, summed over the ranks (nn.SyncBatchNorm's)."""
    group = _group(group_name)
    row = synced_ops.normalized_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale,
                                          eps=eps)
    return distributed.sum_over_ranks(row, group)


# --------------------------------------------------------------------------- fake kernels

def _check_gemm_operands(x: Tensor, weight: Tensor) -> None:
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")


@torch.library.register_fake("epifuse::fused_head")
def _fused_head_fake(x, weight, bias, gamma, beta, scale, running_mean, running_var, **config):
    # config: the settings given (HeadConfig's fields, keyword-only); no shape depends on them.
    _check_gemm_operands(x, weight)
    n = weight.shape[0]
    # z in the GEMM's dtype (gemm_dtype: autocast's), the output in out_dtype (default z's).
    z = x.new_empty((x.shape[0], n), dtype=config.get("gemm_dtype") or x.dtype)
    out = torch.empty_like(z, dtype=config.get("out_dtype") or z.dtype)
    if not config.get("training", _D.training) and not config.get("for_backward", _D.for_backward):
        # An eval forward for no backward: the output alone, the rest empty (z's in its dtype).
        return (out, x.new_empty((0,), dtype=z.dtype), x.new_empty((0,), dtype=_F64),
                x.new_empty((0,), dtype=_F64), x.new_empty((0,), dtype=_F64),
                x.new_empty((0,), dtype=_F32), x.new_empty((0,), dtype=_F32))
    return (out, z, x.new_empty((n,), dtype=_F64), x.new_empty((n,), dtype=_F64),
            x.new_empty((2 * n + 1,), dtype=_F64), x.new_empty((n,), dtype=_F32),
            x.new_empty((n,), dtype=_F32))


@torch.library.register_fake("epifuse::fused_head_backward")
def _fused_head_backward_fake(grad, x, weight, bias, gamma, beta, scale, z, out, colsum,
                              colsumsq, moments, needs, a=None, c=None, **config):
    # config: the settings given (HeadConfig's fields, keyword-only); no shape depends on them.
    torch._check(grad.dim() == 2, lambda: "grad must be 2-D")
    m, n = grad.shape
    # dX in z's dtype (the GEMM's) or float32 from a 16-bit z when grad_x_dtype asks, dW in the
    # parameters' (fp32 under autocast); one not needed is an empty tensor in grad's dtype.
    fp32_dx = config.get("grad_x_dtype") == torch.float32 and z.element_size() == 2
    grad_x = (z.new_empty((m, weight.shape[1]), dtype=torch.float32 if fp32_dx else z.dtype)
              if needs[0] else grad.new_empty((0,)))
    grad_w = z.new_empty((n, x.shape[1]), dtype=gamma.dtype) if needs[1] else grad.new_empty((0,))
    grad_bias = gamma.new_empty((0,), dtype=torch.float32) if bias is None else torch.empty_like(bias)
    # A head without a scale (has_scale=False) reads none: zeros where asked for, else empty.
    has_grad_scale = config.get("has_scale", _D.has_scale) or needs[5]
    grad_scale = torch.empty_like(scale) if has_grad_scale else scale.new_empty((0,))
    return (grad_x, grad_w, grad_bias, torch.empty_like(gamma), torch.empty_like(beta), grad_scale)


@torch.library.register_fake("epifuse::synced_batch_fold")
def _synced_batch_fold_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                            eps=_D.eps, group_name=_D.group_name):
    n = colsum.shape[0]
    return (colsum.new_empty((n,), dtype=torch.float32), colsum.new_empty((n,), dtype=torch.float32),
            colsum.new_empty((2 * n + 1,), dtype=_F64))


@torch.library.register_fake("epifuse::synced_grad_sums")
def _synced_grad_sums_fake(sums, moments, bias, gamma, pre_scale, post_scale, *, eps=_D.eps,
                           group_name=_D.group_name):
    return torch.empty_like(sums)
