"""The fold: GEMM-head BatchNorm algebra reduced to a per-column affine map.

A head is ``z = x @ W.T``; ``u = pre * (z + bias)``; ``v = BatchNorm(u)``;
``y = post * v`` (optionally followed by a softmax over columns). Whatever the
mode, ``y = a * z + c`` with per-column ``a`` and ``c``; this module computes
them and the running-statistics update, in float64 whatever the inputs' dtype
and on whatever device they live.

This is the single source of truth for that math: it is the CPU kernel of the
``epifuse`` ops (see ``ops.py``) and the oracle the CUDA kernels are tested
against, and it is tested against ``nn.BatchNorm1d`` directly.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

_F64 = torch.float64


class Fold(NamedTuple):
    """Per-column affine map ``y = a * z + c`` plus the statistics it used."""

    a: Tensor  # float64 [N]
    c: Tensor  # float64 [N]
    mean: Tensor  # float64 [N]: mean of u (batch mean in training, running mean in eval)
    var: Tensor  # float64 [N]: biased variance of u (batch) or running variance (eval)


def _col(t: Optional[Tensor], n: int, like: Tensor, default: float) -> Tensor:
    """A per-column float64 vector from an optional scalar-or-[N] tensor."""
    if t is None:
        return torch.full((n,), default, dtype=_F64, device=like.device)
    t = t.detach().to(device=like.device, dtype=_F64).reshape(-1)
    if t.numel() not in (1, n):
        raise ValueError(f"expected a tensor of 1 or {n} elements, got {t.numel()}")
    return t.expand(n)


def column_stats(z: Tensor) -> tuple[Tensor, Tensor]:
    """Column sums and sums of squares of a [M, N] matrix, in float64."""
    z64 = z.detach().to(_F64)
    return z64.sum(0), (z64 * z64).sum(0)


def batch_moments(colsum: Tensor, colsumsq: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """Mean and biased variance of z per column, from its sums (float64)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    s1 = colsum.detach().to(_F64)
    mean = s1 / count
    # The sums come from the fp32 accumulators and are summed in float64, so the
    # textbook formula is accurate enough unless |mean| / std exceeds ~1e6;
    # clamp the rounding residue so that a constant column gives var 0, not < 0.
    var = (colsumsq.detach().to(_F64) / count - mean * mean).clamp_min_(0.0)
    return mean, var


def _affine(bias: Tensor, gamma: Tensor, beta: Tensor, pre: Tensor, post: Tensor,
            mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    invstd = torch.rsqrt(var + eps)
    g = gamma * invstd
    return post * g * pre, post * (g * (pre * bias - mean) + beta)


def input_moments(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
                  pre_scale: Optional[Tensor], like: Tensor) -> tuple[Tensor, Tensor]:
    """Batch mean and biased variance of BatchNorm's input ``u = pre * (z + bias)``.

    From the column sums of z over ``count`` rows; float64 on ``like``'s device.
    """
    n = like.numel()
    bias64, pre = _col(bias, n, like, 0.0), _col(pre_scale, n, like, 1.0)
    mean_z, var_z = batch_moments(colsum, colsumsq, count)
    return pre * (mean_z.to(like.device) + bias64), pre * pre * var_z.to(like.device)


def fold_batch(mean: Tensor, var: Tensor, bias: Optional[Tensor], gamma: Tensor, beta: Tensor,
               pre_scale: Optional[Tensor], post_scale: Optional[Tensor], eps: float) -> Fold:
    """Training-mode fold from the batch mean and biased variance of u.

    The moments may be this batch's (``fold_train``) or merged over the batches
    of all data-parallel ranks (``distributed.py``).
    """
    n = gamma.numel()
    ref = gamma
    mean, var = mean.to(device=ref.device, dtype=_F64), var.to(device=ref.device, dtype=_F64)
    a, c = _affine(_col(bias, n, ref, 0.0), _col(gamma, n, ref, 1.0), _col(beta, n, ref, 0.0),
                   _col(pre_scale, n, ref, 1.0), _col(post_scale, n, ref, 1.0), mean, var, eps)
    return Fold(a, c, mean, var)


def fold_train(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
               gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
               post_scale: Optional[Tensor], eps: float) -> Fold:
    """Training-mode fold from the column sums of z over a batch of ``count`` rows."""
    mean, var = input_moments(colsum, colsumsq, count, bias, pre_scale, like=gamma)
    return fold_batch(mean, var, bias, gamma, beta, pre_scale, post_scale, eps)


def fold_eval(bias: Optional[Tensor], gamma: Tensor, beta: Tensor,
              pre_scale: Optional[Tensor], post_scale: Optional[Tensor],
              running_mean: Tensor, running_var: Tensor, eps: float) -> Fold:
    """Eval-mode fold: BatchNorm normalises with the running statistics."""
    n = gamma.numel()
    ref = gamma
    mean, var = _col(running_mean, n, ref, 0.0), _col(running_var, n, ref, 1.0)
    a, c = _affine(_col(bias, n, ref, 0.0), _col(gamma, n, ref, 1.0), _col(beta, n, ref, 0.0),
                   _col(pre_scale, n, ref, 1.0), _col(post_scale, n, ref, 1.0), mean, var, eps)
    return Fold(a, c, mean, var)


def update_factor(momentum: Optional[float],
                  num_batches_tracked: Union[int, Tensor]) -> Union[float, Tensor]:
    """nn.BatchNorm's averaging factor; ``num_batches_tracked`` is the count *before* this batch.

    Given the buffer itself (a tensor), the cumulative factor stays a float64
    tensor on its device, so that reading the buffer costs no host sync.
    """
    if momentum is None:  # cumulative moving average
        if isinstance(num_batches_tracked, Tensor):
            return 1.0 / (num_batches_tracked.to(_F64) + 1.0)
        return 1.0 / float(num_batches_tracked + 1)
    return float(momentum)


@torch.no_grad()
def update_running_stats(running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor,
                         batch_mean: Tensor, batch_var: Tensor, count: Union[int, Tensor],
                         momentum: Optional[float]) -> None:
    """In-place running-statistics update of nn.BatchNorm in training mode.

    ``batch_var`` is the biased variance (as returned by ``fold_train``); the
    running variance tracks the unbiased one, as nn.BatchNorm does.
    ``count`` may be a 0-d tensor (the global row count of a synchronized
    batch, which lives on the device): it is then used as is, unchecked, as
    nn.SyncBatchNorm does, rather than read back to the host.
    """
    if isinstance(count, Tensor):
        count = count.to(device=running_var.device, dtype=_F64)
    elif count < 2:
        # nn.BatchNorm refuses such a batch before touching its buffers.
        raise ValueError(f"running statistics need more than 1 value per channel, got {count}")
    f = update_factor(momentum, num_batches_tracked)
    unbiased = batch_var.to(_F64) * (count / (count - 1))
    new_mean = (1.0 - f) * running_mean.to(_F64) + f * batch_mean.to(_F64)
    new_var = (1.0 - f) * running_var.to(_F64) + f * unbiased
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    num_batches_tracked.add_(1)
