"""The per-pass ops of synchronized batch statistics, with their CPU and fake kernels.

Schemas and CUDA kernels: ``cpp/ops/synced_ops.cpp``. The synchronized-statistics hooks run them
around one collective per direction (CUDA: ``cpp/ops/synced_hooks.cpp``; CPU: ``fused_head.py``):

  forward   pack_moments (this rank's row) -> all_gather -> merge_fold (merge, fold)
  backward  normalized_grad_sums (this rank's row) -> all_reduce (sum)

The CPU kernels are composed of ``distributed.py`` and ``fold.py``, the single source of truth for
this math, which the CUDA kernels are tested against. They refuse what the CUDA kernels refuse,
with the same exception and message (``op_checks.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import distributed, fold
from . import op_checks as _checks
from .head_config import DEFAULT as _D

_F64 = torch.float64

_pack_moments = torch.ops.epifuse.pack_moments.default
_merge_fold = torch.ops.epifuse.merge_fold.default
_normalized_grad_sums = torch.ops.epifuse.normalized_grad_sums.default


# --------------------------------------------------------------------------- wrappers

def pack_moments(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
                 pre_scale: Optional[Tensor]) -> Tensor:
    """This rank's float64 ``[count, mean(N), M2(N)]`` row of BatchNorm's input
    ``u = pre_scale * (z + bias)`` over ``count`` >= 1 rows, from the column sums of z."""
    return _pack_moments(colsum, colsumsq, count, bias, pre_scale)


def merge_fold(rows: Tensor, bias: Optional[Tensor], gamma: Tensor, beta: Tensor,
               pre_scale: Optional[Tensor], post_scale: Optional[Tensor], *,
               eps: float = _D.eps) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's pack_moments row (float64 [world, 2N + 1]) merged, then the training fold:
    ``(a, c, moments)`` as bn_fold_batch returns them, from the merged statistics (the count in
    ``moments`` is the total over the ranks, on the rows' device)."""
    return _merge_fold(rows, bias, gamma, beta, pre_scale, post_scale, eps=eps)


def normalized_grad_sums(sums: Tensor, moments: Tensor, bias: Optional[Tensor], gamma: Tensor,
                         pre_scale: Optional[Tensor], post_scale: Optional[Tensor], *,
                         eps: float = _D.eps) -> Tensor:
    """``fold.normalized_grad_sums``: float64 ``[G1(N), G2(N), M]`` from head_grad_sums' sums
    and the forward's moments, the row synchronized ranks all-reduce."""
    return _normalized_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale, eps=eps)


# --------------------------------------------------------------------------- CPU kernels

@torch.library.register_kernel("epifuse::pack_moments", "cpu")
def _pack_moments_cpu(colsum, colsumsq, count, bias, pre_scale):
    _checks.check_pack_moments(colsum, colsumsq, count, bias, pre_scale)
    mean, var = fold.input_moments(colsum, colsumsq, count, bias, pre_scale, like=colsum)
    return distributed.pack_moments(count, mean, var * count)


@torch.library.register_kernel("epifuse::merge_fold", "cpu")
def _merge_fold_cpu(rows, bias, gamma, beta, pre_scale, post_scale, *, eps=_D.eps):
    _checks.check_fold(bias, gamma, beta, pre_scale, post_scale, eps, "merge_fold")
    _checks.check_moment_rows(rows, gamma.shape[0], "merge_fold")
    merged = distributed.merge_moments(rows)
    f = fold.fold_batch(merged.mean, merged.var, bias, gamma, beta, pre_scale, post_scale, eps)
    return f.a.float(), f.c.float(), fold.moments_vector(merged.mean, merged.var, merged.count)


@torch.library.register_kernel("epifuse::normalized_grad_sums", "cpu")
def _normalized_grad_sums_cpu(sums, moments, bias, gamma, pre_scale, post_scale, *, eps=_D.eps):
    op = "normalized_grad_sums"
    # No beta in this row's math: gamma stands in for it, as in the CUDA kernel's checks.
    _checks.check_fold(bias, gamma, gamma, pre_scale, post_scale, eps, op)
    n = 2 * gamma.shape[0] + 1
    _checks.check_sums(sums, "sums", n, op)
    _checks.check_sums(moments, "moments", n, op)
    return fold.normalized_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale, eps)


# --------------------------------------------------------------------------- fake kernels

@torch.library.register_fake("epifuse::pack_moments")
def _pack_moments_fake(colsum, colsumsq, count, bias, pre_scale):
    return colsum.new_empty((2 * colsum.shape[0] + 1,), dtype=_F64)


@torch.library.register_fake("epifuse::merge_fold")
def _merge_fold_fake(rows, bias, gamma, beta, pre_scale, post_scale, *, eps=_D.eps):
    n = gamma.shape[0]
    return (gamma.new_empty((n,), dtype=torch.float32), gamma.new_empty((n,), dtype=torch.float32),
            gamma.new_empty((2 * n + 1,), dtype=_F64))


@torch.library.register_fake("epifuse::normalized_grad_sums")
def _normalized_grad_sums_fake(sums, moments, bias, gamma, pre_scale, post_scale, *,
                               eps=_D.eps):
    return sums.new_empty((2 * gamma.shape[0] + 1,), dtype=_F64)
