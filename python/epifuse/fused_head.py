"""``epifuse::fused_head``: a head's fused forward as one differentiable op, with a fused backward.

The op is functional (``torch.library.register_autograd`` refuses ops that
mutate their inputs), so it leaves the running statistics alone: the caller
(head.py) updates them from the returned column sums / moments. It writes its
output out of place and returns z (the GEMM output) for the backward, which
saves z, the softmax's output (softmax heads), the inputs, and [N] vectors:

  forward   gemm_colstats -> fold (batch: bn_fold_batch, or merged over the
            ranks; eval: bn_fold_eval) -> affine_softmax / affine
  backward  softmax_grad_rowdot (softmax heads) -> head_grad_sums
            (-> all_reduce of normalized_grad_sums when synchronized)
            -> head_grad_coefficients -> head_grad_z -> backward_matmul (dX, dW)

Synchronized batch statistics (``group_name`` non-empty) are the same op with
the cross-rank reduction of the statistics between the GEMM and the fold, and
of the gradient sums between head_grad_sums and the coefficients.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import distributed, fold, ops


def _group(group_name: str) -> "dist.ProcessGroup":
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name)


def _scales(scale: Tensor, scale_before_bn: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    return (scale, None) if scale_before_bn else (None, scale)


@torch.library.custom_op("epifuse::fused_head", mutates_args=())
def fused_head(x: Tensor, weight: Tensor, bias: Optional[Tensor], gamma: Tensor, beta: Tensor,
               scale: Tensor, running_mean: Tensor, running_var: Tensor, precision: str,
               training: bool, scale_before_bn: bool, softmax: bool, eps: float,
               group_name: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The head's output and what its backward needs: ``(out, z, colsum, colsumsq, moments)``.

    ``moments`` is ``fold.moments_vector`` of the statistics u was normalized with: the batch's
    (over all ranks of ``group_name``'s group when non-empty) in training, the running ones in
    eval. ``colsum`` / ``colsumsq`` are this batch's, for the running-statistics update.
    """
    pre, post = _scales(scale, scale_before_bn)
    z, colsum, colsumsq = ops.gemm_colstats(x, weight, precision)
    rows = x.shape[0]
    if not training:
        a, c = ops.bn_fold_eval(bias, gamma, beta, pre, post, running_mean, running_var, eps)
        moments = fold.moments_vector(running_mean, running_var, 0)
    elif group_name:
        mean, var = fold.input_moments(colsum, colsumsq, rows, bias, pre, like=gamma)
        merged = distributed.synced_moments(distributed.pack_moments(rows, mean, var * rows),
                                            _group(group_name))
        # fold.py in float64 torch ops: the global count is a device tensor, and reading it back
        # for bn_fold_batch would stall the stream.
        f = fold.fold_batch(merged.mean, merged.var, bias, gamma, beta, pre, post, eps)
        a, c = f.a.float().contiguous(), f.c.float().contiguous()
        moments = fold.moments_vector(merged.mean, merged.var, merged.count)
    else:
        a, c, moments = ops.bn_fold_batch(colsum, colsumsq, rows, bias, gamma, beta, pre, post,
                                          eps)
    out = ops.affine_softmax(z, a, c) if softmax else ops.affine(z, a, c)
    return out, z, colsum, colsumsq, moments


@fused_head.register_fake
def _fused_head_fake(x, weight, bias, gamma, beta, scale, running_mean, running_var, precision,
                     training, scale_before_bn, softmax, eps, group_name):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    n = weight.shape[0]
    z = x.new_empty((x.shape[0], n))
    f64 = torch.float64
    return (torch.empty_like(z), z, x.new_empty((n,), dtype=f64), x.new_empty((n,), dtype=f64),
            x.new_empty((2 * n + 1,), dtype=f64))


def _setup_context(ctx, inputs, output) -> None:
    (x, weight, bias, gamma, beta, scale, _, _, precision, training, scale_before_bn, softmax, eps,
     group_name) = inputs
    out, z, colsum, colsumsq, moments = output
    ctx.mark_non_differentiable(z, colsum, colsumsq, moments)
    ctx.set_materialize_grads(False)
    need_x, need_w = ctx.needs_input_grad[:2]
    # dX needs W, dW needs x; z and out are the only [M, N] tensors kept.
    ctx.save_for_backward(x if need_w else None, weight if need_x else None, bias, gamma, beta,
                          scale, z, out if softmax else None, colsum if training else None,
                          colsumsq if training else None, moments)
    ctx.config = (precision, training, scale_before_bn, softmax, eps, group_name)


@torch.autograd.function.once_differentiable
def _backward(ctx, grad_out, *_non_differentiable):
    needs = ctx.needs_input_grad
    if grad_out is None:
        return (None,) * len(needs)
    x, weight, bias, gamma, beta, scale, z, out, colsum, colsumsq, moments = ctx.saved_tensors
    precision, training, scale_before_bn, softmax, eps, group_name = ctx.config
    pre, post = _scales(scale, scale_before_bn)
    rowdot = ops.softmax_grad_rowdot(grad_out, out) if softmax else None
    sums = ops.head_grad_sums(grad_out, out, rowdot, z)
    global_sums = None
    # du (hence dz, d bias and a scale before BatchNorm) needs the batch terms of every rank;
    # nn.SyncBatchNorm's condition, so ranks on the reference path issue the same all_reduce.
    need_du = needs[0] or needs[1] or needs[2] or (scale_before_bn and needs[5])
    if training and group_name and need_du:
        global_sums = fold.normalized_grad_sums(sums, moments, bias, gamma, pre, post, eps)
        dist.all_reduce(global_sums, dist.ReduceOp.SUM, group=_group(group_name))
    coef, g_bias, g_gamma, g_beta, g_pre, g_post = ops.head_grad_coefficients(
        sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta, pre, post, training, eps)
    grad_x = grad_w = None
    if needs[0] or needs[1]:
        dz = ops.head_grad_z(grad_out, out, rowdot, z, coef)
        if needs[0]:
            grad_x = ops.backward_matmul(dz, weight, precision)
        if needs[1]:
            grad_w = ops.backward_matmul(dz.t(), x, precision)
    g_scale = g_pre if scale_before_bn else g_post
    param_grads = [g if need else None
                   for g, need in zip((g_bias, g_gamma, g_beta, g_scale), needs[2:6])]
    return (grad_x, grad_w, *param_grads, *([None] * (len(needs) - 6)))


fused_head.register_autograd(_backward, setup_context=_setup_context)
