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

import math
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
    # The sums are of z as stored (fp32 or 16-bit values) summed in float64, so the
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


# --------------------------------------------------------------------------- activation
#
# The head's activation acts on h = a * z + c (after a scale after BatchNorm), before the softmax.
# Names as HeadConfig's (cpp/ops/op_args.cpp, kActivations, in this order); float64 as everything here.

ACTIVATIONS = ("", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_K = 0.044715


def check_activation(activation: str, op: str) -> None:
    """The ops' ValueError for a name HeadConfig does not know."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"epifuse::{op}: unknown activation '{activation}' (expected '', 'relu', "
                         f"'leaky_relu', 'gelu', 'gelu_tanh' or 'silu')")


def activate(h: Tensor, activation: str, negative_slope: float = 0.01) -> Tensor:
    """act(h) in float64, as PyTorch's modules define it."""
    h = h.to(_F64)
    if activation == "":
        return h
    if activation == "relu":
        return h.clamp_min(0.0)
    if activation == "leaky_relu":
        return torch.where(h > 0, h, h * negative_slope)
    if activation == "gelu":
        return 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
    if activation == "gelu_tanh":
        return 0.5 * h * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (h + _GELU_TANH_K * h ** 3)))
    if activation == "silu":
        return h * torch.sigmoid(h)
    check_activation(activation, "activate")
    raise AssertionError("unreachable")


def activation_grad(h: Tensor, activation: str, negative_slope: float = 0.01) -> Tensor:
    """d act / d h at h in float64 (ReLU's at 0 is 0, LeakyReLU's negative_slope, as PyTorch's)."""
    h = h.to(_F64)
    if activation == "":
        return torch.ones_like(h)
    if activation == "relu":
        return (h > 0).to(_F64)
    if activation == "leaky_relu":
        return torch.where(h > 0, torch.ones_like(h), torch.full_like(h, negative_slope))
    if activation == "gelu":
        pdf = torch.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
        return 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))) + h * pdf
    if activation == "gelu_tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (h + _GELU_TANH_K * h ** 3))
        return 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _GELU_TANH_K * h * h)
    if activation == "silu":
        s = torch.sigmoid(h)
        return s * (1.0 + h * (1.0 - s))
    check_activation(activation, "activation_grad")
    raise AssertionError("unreachable")


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


# --------------------------------------------------------------------------- backward
#
# With g the gradient of the head's output, per column n (float64 throughout):
#   dv      = out * (g - rowsum(g * out))       (softmax heads; dv = g otherwise)
#   yhat    = (u - mean) * invstd = alpha * z + delta,  alpha = pre * invstd,
#             delta = (pre * bias - mean) * invstd
#   S1 = sum_m dv, S3 = sum_m dv * z, S2 = sum_m dv * yhat = alpha * S3 + delta * S1
#   d beta = post * S1, d gamma = post * S2, d post = gamma * S2 + beta * S1
#   du      = k * (dv - S1 / M - yhat * S2 / M)  (training; eval: du = k * dv), k = gamma * post * invstd
#   dz      = pre * du = A * dv + B * z + C
#   d pre   = sum_m du * (z + bias),  d bias = sum_m dz
# S3 rather than S2 is summed over the rows: dv * z is exact in float64 (fp32 operands), where
# yhat would first be rounded to fp32; S2 follows per column. The sums over the rows of z that
# d pre and d bias need come from the forward's colsum / colsumsq, so the backward reads g, out
# and z in two passes only (the sums, then dz).
# With synchronized batch statistics the batch terms of du use sums over all ranks' rows, the
# parameter gradients this rank's rows only (DDP averages them), as nn.SyncBatchNorm does. The
# ranks all-reduce ``normalized_grad_sums``: G1 = sum dy and G2 = sum dy * yhat of the gradient at
# BatchNorm's output, dy = post * dv (nn.SyncBatchNorm's sum_dy and sum_dy_xmu * invstd, what a
# rank on the reference path forms as well), so that du = gamma * invstd * (dy - G1 / M - yhat *
# G2 / M) with this rank's gamma, as nn.SyncBatchNorm computes it (which matters when the ranks'
# parameters differ, e.g. without DDP).


def moments_vector(mean: Tensor, var: Tensor, count: Union[int, float, Tensor]) -> Tensor:
    """``[mean(N), var(N), count]`` in float64: the statistics BatchNorm normalized u with.

    The fused forward saves this for the backward (``count`` may be a 0-d device tensor: the
    global row count of a synchronized batch).
    """
    mean = mean.to(_F64)
    count_t = count.to(mean) if isinstance(count, Tensor) else mean.new_full((), float(count))
    return torch.cat([mean, var.to(_F64), count_t.reshape(1)])


def dv_of(grad: Tensor, out: Optional[Tensor], h: Optional[Tensor] = None,
          activation: str = "", negative_slope: float = 0.01) -> Tensor:
    """Gradient at the head's affine output ``h = a * z + c`` (float64): through the softmax
    (``out`` its output; None: no softmax, ``grad`` itself), then through the activation at h."""
    g = grad.detach().to(_F64)
    if out is None:
        dv = g
    else:
        o = out.detach().to(_F64)
        dv = o * (g - (g * o).sum(1, keepdim=True))
    if activation:
        if h is None:
            raise ValueError(f"activation {activation!r} needs h = a * z + c")
        dv = dv * activation_grad(h, activation, negative_slope)
    return dv


def grad_sums(grad: Tensor, out: Optional[Tensor], z: Tensor, h: Optional[Tensor] = None,
              activation: str = "", negative_slope: float = 0.01) -> Tensor:
    """``[S1(N), S3(N), M]`` in float64: column sums of dv and dv * z over this batch's rows."""
    dv = dv_of(grad, out, h, activation, negative_slope)
    z64 = z.detach().to(_F64)
    return torch.cat([dv.sum(0), (dv * z64).sum(0), dv.new_full((1,), float(z.shape[0]))])


class GradCoefficients(NamedTuple):
    """``dz = A * dv + B * z + C`` and the parameter gradients, float64."""

    A: Tensor  # [N]
    B: Tensor  # [N]
    C: Tensor  # [N]
    bias: Tensor  # [N]
    gamma: Tensor  # [N]
    beta: Tensor  # [N]
    pre: Tensor  # [N], per column (sum it for a one-element scale)
    post: Tensor  # [N], per column


def _columns(sums: Tensor, moments: Tensor, bias: Optional[Tensor], gamma: Tensor,
             pre_scale: Optional[Tensor], post_scale: Optional[Tensor], eps: float):
    n = gamma.numel()
    ref = gamma
    s = sums.to(device=ref.device, dtype=_F64)
    m = moments.to(device=ref.device, dtype=_F64)
    b, g = _col(bias, n, ref, 0.0), _col(gamma, n, ref, 1.0)
    pre, post = _col(pre_scale, n, ref, 1.0), _col(post_scale, n, ref, 1.0)
    invstd = torch.rsqrt(m[n:2 * n] + eps)
    alpha, delta = pre * invstd, (pre * b - m[:n]) * invstd
    s1, s3 = s[:n], s[n:2 * n]
    return s1, s3, s[2 * n], alpha * s3 + delta * s1, b, g, pre, post, invstd, alpha, delta


def normalized_grad_sums(sums: Tensor, moments: Tensor, bias: Optional[Tensor], gamma: Tensor,
                         pre_scale: Optional[Tensor], post_scale: Optional[Tensor],
                         eps: float) -> Tensor:
    """``[G1(N), G2(N), M]``: this batch's sums of dy and dy * yhat (dy = post * dv).

    What synchronized ranks all-reduce: the batch terms of du are ``gamma * G1 / M`` and
    ``gamma * G2 / M`` over the rows of all ranks.
    """
    s1, _, rows, s2, _, _, _, post, *_ = _columns(sums, moments, bias, gamma, pre_scale,
                                                  post_scale, eps)
    return torch.cat([post * s1, post * s2, rows.reshape(1)])


def grad_coefficients(sums: Tensor, global_sums: Optional[Tensor], colsum: Optional[Tensor],
                      colsumsq: Optional[Tensor], moments: Tensor, bias: Optional[Tensor],
                      gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
                      post_scale: Optional[Tensor], training: bool,
                      eps: float) -> GradCoefficients:
    """Per-column backward coefficients of the head (see the block comment above).

    ``sums``: this batch's ``grad_sums``; ``global_sums``: ``normalized_grad_sums`` summed over
    all ranks (None: not synchronized, this batch is the whole batch); ``colsum`` /
    ``colsumsq``: this batch's sums of z and z² (training only); ``moments``:
    ``moments_vector`` of the statistics the forward normalized with (batch, possibly global,
    or running in eval).
    """
    n = gamma.numel()
    s1, s3, rows, s2, b, g, pre, post, invstd, alpha, delta = _columns(
        sums, moments, bias, gamma, pre_scale, post_scale, eps)
    bt = _col(beta, n, gamma, 0.0)
    k = g * post * invstd
    d_beta, d_gamma, d_post = post * s1, post * s2, g * s2 + bt * s1
    a_coef = pre * k
    if training:
        if global_sums is None:
            g1, g2, rows_g = post * s1, post * s2, rows
        else:
            gs = global_sums.to(device=gamma.device, dtype=_F64)
            g1, g2, rows_g = gs[:n], gs[n:2 * n], gs[2 * n]
        mean_g1, mean_g2 = g * g1 / rows_g, g * g2 / rows_g
        b_coef = -pre * invstd * alpha * mean_g2
        c_coef = -pre * invstd * (mean_g1 + delta * mean_g2)
        cs, css = colsum.to(gamma.device, _F64), colsumsq.to(gamma.device, _F64)
        sum_yhat = alpha * cs + delta * rows
        # sum_m yhat * (z + bias), expanded over the sums of z and z² of this batch.
        sum_yhat_zb = alpha * css + (alpha * b + delta) * cs + delta * b * rows
        sum_du = k * s1 - invstd * (rows * mean_g1 + sum_yhat * mean_g2)
        sum_du_zb = k * (s3 + b * s1) - invstd * (mean_g1 * (cs + b * rows) + mean_g2 * sum_yhat_zb)
    else:
        b_coef = c_coef = torch.zeros_like(a_coef)
        sum_du, sum_du_zb = k * s1, k * (s3 + b * s1)
    return GradCoefficients(a_coef, b_coef, c_coef, pre * sum_du, d_gamma, d_beta, sum_du_zb,
                            d_post)


def grad_z(grad: Tensor, out: Optional[Tensor], z: Tensor, A: Tensor, B: Tensor,
           C: Tensor, h: Optional[Tensor] = None, activation: str = "",
           negative_slope: float = 0.01) -> Tensor:
    """``dz = A * dv + B * z + C`` in float64."""
    dv = dv_of(grad, out, h, activation, negative_slope)
    return A.to(_F64) * dv + B.to(_F64) * z.detach().to(_F64) + C.to(_F64)
