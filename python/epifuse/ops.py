"""Typed wrappers over ``torch.ops.epifuse.*`` plus their CPU and fake kernels.

The schemas and CUDA kernels come from the compiled library (``cpp/ops``).
This module registers, for every op:
  * a fake (meta) kernel, so the ops trace under torch.compile / FakeTensor;
  * a CPU kernel computed with ``fold.py`` in float64, which makes the CPU
    path the executable spec of the CUDA kernels and lets opcheck run in CI.

The head's two composite ops (``fused_head``, ``fused_head_backward``) are the exception: their
CPU and CUDA kernels are one C++ composite over the ops above (``cpp/ops/fused_head.cpp``), their
fake kernels are in ``fused_head.py``. The ops of synchronized batch statistics (``pack_moments``,
``merge_fold``, ``normalized_grad_sums``) have theirs in ``synced_ops.py``.

The head's settings (momentum, eps, training; head_config.py) are keyword-only with defaults, in
the schemas and in every wrapper and kernel here; a kernel's defaults must be the schema's (the
dispatcher leaves out keyword arguments equal to their default), so they are read from
``head_config.DEFAULT``.

Import it only after the library is loaded (``epifuse/__init__.py`` does).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import fold
from . import op_checks as _checks
from .head_config import DEFAULT as _D

OP_NAMES = (
    "epifuse::gemm_affine",
    "epifuse::gemm_colstats",
    "epifuse::bn_fold_train",
    "epifuse::bn_fold_eval",
    "epifuse::affine_softmax",
    "epifuse::affine_softmax_",
    "epifuse::affine_",
    "epifuse::affine",
    "epifuse::bn_fold_batch",
    "epifuse::update_running_stats",
    "epifuse::softmax_grad_rowdot",
    "epifuse::head_grad_sums",
    "epifuse::head_grad_coefficients",
    "epifuse::head_grad_z",
    "epifuse::backward_matmul",
    "epifuse::gemm_operand",
    "epifuse::pack_moments",
    "epifuse::merge_fold",
    "epifuse::normalized_grad_sums",
    "epifuse::fused_head",
    "epifuse::fused_head_backward",
)

_ops = torch.ops.epifuse
# OpOverloads bound once: calling .default skips the overload-packet lookup.
_gemm_affine = _ops.gemm_affine.default
_gemm_colstats = _ops.gemm_colstats.default
_bn_fold_train = _ops.bn_fold_train.default
_bn_fold_eval = _ops.bn_fold_eval.default
_affine_softmax = _ops.affine_softmax.default
_affine_softmax_inplace = _ops.affine_softmax_.default
_affine_inplace = _ops.affine_.default
_affine = _ops.affine.default
_bn_fold_batch = _ops.bn_fold_batch.default
_update_running_stats = _ops.update_running_stats.default
_softmax_grad_rowdot = _ops.softmax_grad_rowdot.default
_head_grad_sums = _ops.head_grad_sums.default
_head_grad_coefficients = _ops.head_grad_coefficients.default
_head_grad_z = _ops.head_grad_z.default
_backward_matmul = _ops.backward_matmul.default
_gemm_operand = _ops.gemm_operand.default


def has_cuda_kernels() -> bool:
    """Whether the loaded library has a CUDA kernel for every op."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") for name in OP_NAMES)


def built_archs() -> list[str]:
    """GPU architectures the kernels were compiled for (CMake's EPIFUSE_ARCHS), e.g. ['80', '90a']."""
    return [a for a in _ops.built_archs().split(",") if a]


def device_unsupported_reason(index: int) -> Optional[str]:
    """Why CUDA device ``index`` cannot run the epifuse kernels (None: it can)."""
    if not has_cuda_kernels():
        return "epifuse library built without CUDA kernels"
    major, minor = torch.cuda.get_device_capability(index)
    if not _ops.supports_device(major, minor):
        built = ", ".join(f"sm_{a}" for a in built_archs())
        return (f"GPU is sm_{major}{minor}; this epifuse build has kernels for {built} only "
                f"(rebuild with -DEPIFUSE_ARCHS={major}{minor})")
    return None


# --------------------------------------------------------------------------- wrappers

def gemm_affine(x: Tensor, weight: Tensor, a: Tensor, c: Tensor, precision: str, *,
                activation: str = _D.activation,
                negative_slope: float = _D.negative_slope) -> Tensor:
    """``act(a * (x @ weight.T) + c)`` (a, c float32 [N]; act the head's activation, applied in
    the GEMM's epilogue); output dtype x.dtype, [M, N]."""
    return _gemm_affine(x, weight, a, c, precision, activation=activation,
                        negative_slope=negative_slope)


def gemm_colstats(x: Tensor, weight: Tensor, precision: str) -> tuple[Tensor, Tensor, Tensor]:
    """``z = x @ weight.T`` and float64 column sums / sums of squares of z as returned (a 16-bit
    z's statistics are those of its rounded values, which BatchNorm then normalizes)."""
    return _gemm_colstats(x, weight, precision)


def bn_fold_train(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
                  gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
                  post_scale: Optional[Tensor], running_mean: Tensor, running_var: Tensor,
                  num_batches_tracked: Tensor, *, momentum: Optional[float] = _D.momentum,
                  eps: float = _D.eps) -> tuple[Tensor, Tensor]:
    """Training fold (float32 a, c); updates the running buffers in place."""
    return _bn_fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale,
                          running_mean, running_var, num_batches_tracked, momentum=momentum,
                          eps=eps)


def bn_fold_eval(bias: Optional[Tensor], gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
                 post_scale: Optional[Tensor], running_mean: Tensor, running_var: Tensor, *,
                 eps: float = _D.eps) -> tuple[Tensor, Tensor]:
    """Eval fold (float32 a, c) from the running statistics (the parameters' dtype, or float64)."""
    return _bn_fold_eval(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var,
                         eps=eps)


def affine_softmax(z: Tensor, a: Optional[Tensor], c: Optional[Tensor], *,
                   activation: str = _D.activation, negative_slope: float = _D.negative_slope,
                   out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``softmax(act(a * z + c), dim=1)`` into a new tensor (a, c None: identity; ``activation``
    a HeadConfig name, '' none).

    Its dtype is ``out_dtype``: z's (None), or float32 from a 16-bit z (autocast).
    """
    return _affine_softmax(z, a, c, activation=activation, negative_slope=negative_slope,
                           out_dtype=out_dtype)


def affine_softmax_(z: Tensor, a: Optional[Tensor], c: Optional[Tensor], *,
                    activation: str = _D.activation,
                    negative_slope: float = _D.negative_slope) -> None:
    """In-place ``z = softmax(act(a * z + c), dim=1)``; a and c must not share memory with z."""
    _affine_softmax_inplace(z, a, c, activation=activation, negative_slope=negative_slope)


def affine_(z: Tensor, a: Optional[Tensor], c: Optional[Tensor], *,
            activation: str = _D.activation, negative_slope: float = _D.negative_slope) -> None:
    """In-place ``z = act(a * z + c)`` (a, c None: the activation alone); a and c must not share
    memory with z."""
    _affine_inplace(z, a, c, activation=activation, negative_slope=negative_slope)


def affine(z: Tensor, a: Tensor, c: Tensor, *, activation: str = _D.activation,
           negative_slope: float = _D.negative_slope,
           out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``act(a * z + c)`` into a new tensor of ``out_dtype`` (z's, or float32 from a 16-bit z)."""
    return _affine(z, a, c, activation=activation, negative_slope=negative_slope,
                   out_dtype=out_dtype)


def bn_fold_batch(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
                  gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
                  post_scale: Optional[Tensor], *,
                  eps: float = _D.eps) -> tuple[Tensor, Tensor, Tensor]:
    """Training fold without the running-statistics update: (a, c, moments).

    ``moments`` is ``fold.moments_vector`` of the batch statistics of u: float64
    ``[mean(N), var(N), count]``, what the backward normalizes with.
    """
    return _bn_fold_batch(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale,
                          eps=eps)


def update_running_stats(moments: Tensor, running_mean: Tensor, running_var: Tensor,
                         num_batches_tracked: Tensor, *,
                         momentum: Optional[float] = _D.momentum) -> None:
    """nn.BatchNorm's running-statistics update, in place, from a training fold's ``moments``
    (bn_fold_batch's, or a synchronized batch's merged ones: ``[mean(N), var(N), count]``, the
    count read where it lives, unchecked, as nn.SyncBatchNorm does)."""
    if momentum == _D.momentum:  # a keyword given costs the call its conversion (host time)
        _update_running_stats(moments, running_mean, running_var, num_batches_tracked)
    else:
        _update_running_stats(moments, running_mean, running_var, num_batches_tracked,
                              momentum=momentum)


# Backward of a head (see fold.py's backward section for the math).

def softmax_grad_rowdot(grad: Tensor, out: Tensor) -> Tensor:
    """``sum_n grad[m, n] * out[m, n]`` per row, float32 [M]: the softmax backward's row term."""
    return _softmax_grad_rowdot(grad, out)


def head_grad_sums(grad: Tensor, out: Optional[Tensor], rowdot: Optional[Tensor], z: Tensor,
                   a: Optional[Tensor] = None, c: Optional[Tensor] = None, *,
                   activation: str = _D.activation,
                   negative_slope: float = _D.negative_slope) -> Tensor:
    """``[S1(N), S3(N), M]`` float64: column sums of dv and dv * z (dv from grad, out, rowdot;
    with an activation times act'(a * z + c), a and c the forward's fold)."""
    return _head_grad_sums(grad, out, rowdot, z, a, c, activation=activation,
                           negative_slope=negative_slope)


def head_grad_coefficients(sums: Tensor, global_sums: Optional[Tensor],
                           colsum: Optional[Tensor], colsumsq: Optional[Tensor],
                           moments: Tensor, bias: Optional[Tensor], gamma: Tensor, beta: Tensor,
                           pre_scale: Optional[Tensor], post_scale: Optional[Tensor], *,
                           training: bool = _D.training,
                           eps: float = _D.eps) -> tuple[Tensor, ...]:
    """(coef [3, N] float32 = A, B, C of dz; grads of bias, gamma, beta, pre_scale, post_scale).

    Parameter gradients have the parameters' dtype and shape; an absent (None) parameter
    gets an empty gradient.
    """
    return _head_grad_coefficients(sums, global_sums, colsum, colsumsq, moments, bias, gamma,
                                   beta, pre_scale, post_scale, training=training, eps=eps)


def head_grad_z(grad: Tensor, out: Optional[Tensor], rowdot: Optional[Tensor], z: Tensor,
                coef: Tensor, a: Optional[Tensor] = None, c: Optional[Tensor] = None, *,
                activation: str = _D.activation,
                negative_slope: float = _D.negative_slope) -> Tensor:
    """``dz = A * dv + B * z + C``, dtype of z (dv as head_grad_sums')."""
    return _head_grad_z(grad, out, rowdot, z, coef, a, c, activation=activation,
                        negative_slope=negative_slope)


def backward_matmul(a: Tensor, b: Tensor, precision: str, *,
                    out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``a @ b`` in the forward GEMM's precision (the backward's dX and dW GEMMs).

    ``out_dtype``: a's (None), or float32 for 16-bit a and b (written by the GEMM itself).
    """
    return _backward_matmul(a, b, precision, out_dtype=out_dtype)


def gemm_operand(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)`` as a new tensor: how a head under autocast casts x and W for its GEMMs
    (on CUDA, fp32 to bf16 / fp16 in one kernel of ours, rounded as ``Tensor.to`` rounds)."""
    return _gemm_operand(t, dtype)


# --------------------------------------------------------------------------- CPU kernels
# Reference semantics in float64, rounded once to the output dtype.

_F64 = torch.float64


def _affine64(z: Tensor, a: Optional[Tensor], c: Optional[Tensor]) -> Tensor:
    y = z.to(_F64)
    if a is not None:
        y = y * a.to(_F64)
    if c is not None:
        y = y + c.to(_F64)
    return y


def _gemm64(x: Tensor, weight: Tensor) -> Tensor:  # callers checked the operands
    return x.to(_F64) @ weight.to(_F64).T


@torch.library.register_kernel("epifuse::gemm_affine", "cpu")
def _gemm_affine_cpu(x, weight, a, c, precision, *, activation=_D.activation,
                     negative_slope=_D.negative_slope):
    _checks.check_gemm(x, weight, precision, "gemm_affine")
    _checks.check_column_vector(a, weight.shape[0], "gemm_affine", "a")
    _checks.check_column_vector(c, weight.shape[0], "gemm_affine", "c")
    fold.check_activation(activation, "gemm_affine")
    y = fold.activate(_affine64(_gemm64(x, weight), a, c), activation, negative_slope)
    return y.to(x.dtype)


@torch.library.register_kernel("epifuse::gemm_colstats", "cpu")
def _gemm_colstats_cpu(x, weight, precision):
    _checks.check_gemm(x, weight, precision, "gemm_colstats")
    z = _gemm64(x, weight).to(x.dtype)
    colsum, colsumsq = fold.column_stats(z)
    return z, colsum, colsumsq


@torch.library.register_kernel("epifuse::bn_fold_train", "cpu")
def _bn_fold_train_cpu(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale,
                       running_mean, running_var, num_batches_tracked, *, momentum=_D.momentum,
                       eps=_D.eps):
    _checks.check_fold(bias, gamma, beta, pre_scale, post_scale, eps, "bn_fold_train")
    _checks.check_fold_train(colsum, colsumsq, count, gamma, running_mean, running_var,
                             num_batches_tracked, momentum)
    f = fold.fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, eps)
    fold.update_running_stats(running_mean, running_var, num_batches_tracked, f.mean, f.var,
                              count, momentum)
    return f.a.float(), f.c.float()


@torch.library.register_kernel("epifuse::bn_fold_eval", "cpu")
def _bn_fold_eval_cpu(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, *,
                      eps=_D.eps):
    _checks.check_fold(bias, gamma, beta, pre_scale, post_scale, eps, "bn_fold_eval")
    _checks.check_running(running_mean, "running_mean", gamma, "bn_fold_eval", also_fp64=True)
    _checks.check_running(running_var, "running_var", gamma, "bn_fold_eval", also_fp64=True)
    if running_mean.dtype != running_var.dtype:
        raise RuntimeError(f"epifuse::bn_fold_eval: expected running_mean and running_var of one "
                           f"dtype, got {_checks.type_name(running_mean.dtype)} and "
                           f"{_checks.type_name(running_var.dtype)}")
    f = fold.fold_eval(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, eps)
    return f.a.float(), f.c.float()


def _affine_softmax64(z, a, c, op, activation, negative_slope):
    _checks.check_matrix(z, op)
    fold.check_activation(activation, op)
    _checks.check_optional_affine(z, a, c, op)
    return torch.softmax(fold.activate(_affine64(z, a, c), activation, negative_slope), dim=1)


def _out_dtype(z: Tensor, out_dtype: Optional[torch.dtype], op: str) -> torch.dtype:
    """The CUDA kernels' rule: z's dtype, or float32 from a 16-bit z."""
    if out_dtype is None or out_dtype == z.dtype:
        return z.dtype
    if out_dtype == torch.float32 and z.element_size() == 2:
        return out_dtype
    raise RuntimeError(f"epifuse::{op}: out_dtype must be z's dtype ({z.dtype}) or float32 for "
                       f"a 16-bit z, got {out_dtype}")


@torch.library.register_kernel("epifuse::affine_softmax", "cpu")
def _affine_softmax_cpu(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                        out_dtype=None):
    dtype = _out_dtype(z, out_dtype, "affine_softmax")
    return _affine_softmax64(z, a, c, "affine_softmax", activation, negative_slope).to(dtype)


@torch.library.register_kernel("epifuse::affine_softmax_", "cpu")
def _affine_softmax_inplace_cpu(z, a, c, *, activation=_D.activation,
                                negative_slope=_D.negative_slope):
    y = _affine_softmax64(z, a, c, "affine_softmax_", activation, negative_slope)
    _check_read_apart_from_z(z, a, c, "affine_softmax_")
    z.copy_(y)


def _check_read_apart_from_z(z, a, c, op):
    """An in-place pass's a and c share no memory with z (the CUDA kernel would race)."""
    _checks.check_written_apart(z, a, op, "z", "a")
    _checks.check_written_apart(z, c, op, "z", "c")


@torch.library.register_kernel("epifuse::affine_", "cpu")
def _affine_inplace_cpu(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope):
    _checks.check_matrix(z, "affine_")
    fold.check_activation(activation, "affine_")
    _checks.check_optional_affine(z, a, c, "affine_")
    _check_read_apart_from_z(z, a, c, "affine_")
    z.copy_(fold.activate(_affine64(z, a, c), activation, negative_slope))


@torch.library.register_kernel("epifuse::affine", "cpu")
def _affine_cpu(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                out_dtype=None):
    _checks.check_matrix(z, "affine")
    fold.check_activation(activation, "affine")
    _checks.check_column_vector(a, z.shape[1], "affine", "a")
    _checks.check_column_vector(c, z.shape[1], "affine", "c")
    dtype = _out_dtype(z, out_dtype, "affine")
    y = fold.activate(_affine64(z, a, c), activation, negative_slope)
    return y.to(dtype).contiguous()  # the CUDA kernel's layout


@torch.library.register_kernel("epifuse::bn_fold_batch", "cpu")
def _bn_fold_batch_cpu(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                       eps=_D.eps):
    op = "bn_fold_batch"
    _checks.check_fold(bias, gamma, beta, pre_scale, post_scale, eps, op)
    if count < 2:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} rows")
    _checks.check_sums(colsum, "colsum", gamma.shape[0], op)
    _checks.check_sums(colsumsq, "colsumsq", gamma.shape[0], op)
    f = fold.fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, eps)
    return f.a.float(), f.c.float(), fold.moments_vector(f.mean, f.var, count)


@torch.library.register_kernel("epifuse::update_running_stats", "cpu")
def _update_running_stats_cpu(moments, running_mean, running_var, num_batches_tracked, *,
                              momentum=_D.momentum):
    _checks.check_update_running_stats(moments, running_mean, running_var, num_batches_tracked,
                                       momentum)
    n = running_mean.shape[0]
    fold.update_running_stats(running_mean, running_var, num_batches_tracked, moments[:n],
                              moments[n:2 * n], moments[2 * n], momentum)


@torch.library.register_kernel("epifuse::softmax_grad_rowdot", "cpu")
def _softmax_grad_rowdot_cpu(grad, out):
    _checks.check_rowdot_operands(grad, out)
    return (grad.to(_F64) * out.to(_F64)).sum(1).float()


def _dv_inputs(grad, out, rowdot, z, op):
    """grad, out as fold.dv_of takes them, checked as the CUDA op checks them (rowdot included,
    though the row term is recomputed in float64)."""
    _checks.check_grad_operands(grad, out, rowdot, z, op)
    return grad, out


def _activation_h(z, a, c, activation, op):
    """h = a * z + c in float64 for the activation's derivative (None without an activation)."""
    fold.check_activation(activation, op)
    if not activation:
        return None
    if a is None or c is None:
        raise RuntimeError(f"epifuse::{op}: activation '{activation}' needs a and c (the "
                           f"forward's fold)")
    _checks.check_column_vector(a, z.shape[1], op, "a")
    _checks.check_column_vector(c, z.shape[1], op, "c")
    return _affine64(z, a, c)


@torch.library.register_kernel("epifuse::head_grad_sums", "cpu")
def _head_grad_sums_cpu(grad, out, rowdot, z, a=None, c=None, *, activation=_D.activation,
                        negative_slope=_D.negative_slope):
    dv_inputs = _dv_inputs(grad, out, rowdot, z, "head_grad_sums")
    h = _activation_h(z, a, c, activation, "head_grad_sums")
    return fold.grad_sums(*dv_inputs, z, h, activation, negative_slope)


def _param_grad(values: Tensor, like: Optional[Tensor]) -> Tensor:
    """A per-column float64 gradient in ``like``'s dtype and shape (summed for one element)."""
    if like is None:
        return values.new_empty((0,), dtype=torch.float32)
    if like.numel() == 1 and values.numel() != 1:
        values = values.sum()
    return values.reshape(like.shape).to(like.dtype)


@torch.library.register_kernel("epifuse::head_grad_coefficients", "cpu")
def _head_grad_coefficients_cpu(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                                pre_scale, post_scale, *, training=_D.training, eps=_D.eps):
    op = "head_grad_coefficients"
    _checks.check_fold(bias, gamma, beta, pre_scale, post_scale, eps, op)
    _checks.check_grad_coefficients(sums, global_sums, colsum, colsumsq, moments, gamma, training)
    g = fold.grad_coefficients(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                               pre_scale, post_scale, training, eps)
    coef = torch.stack([g.A, g.B, g.C]).float()
    return (coef, _param_grad(g.bias, bias), _param_grad(g.gamma, gamma),
            _param_grad(g.beta, beta), _param_grad(g.pre, pre_scale),
            _param_grad(g.post, post_scale))


@torch.library.register_kernel("epifuse::head_grad_z", "cpu")
def _head_grad_z_cpu(grad, out, rowdot, z, coef, a=None, c=None, *, activation=_D.activation,
                     negative_slope=_D.negative_slope):
    dv_inputs = _dv_inputs(grad, out, rowdot, z, "head_grad_z")
    h = _activation_h(z, a, c, activation, "head_grad_z")
    _checks.check_coef(coef, z.shape[1])
    dz = fold.grad_z(*dv_inputs, z, *coef.unbind(0), h, activation, negative_slope)
    return dz.to(z.dtype).contiguous()


@torch.library.register_kernel("epifuse::gemm_operand", "cpu")
def _gemm_operand_cpu(t, dtype):
    return t.to(dtype, copy=True)


@torch.library.register_kernel("epifuse::backward_matmul", "cpu")
def _backward_matmul_cpu(a, b, precision, *, out_dtype=None):
    _checks.check_matmul(a, b, precision, "backward_matmul")
    product = a.to(_F64) @ b.to(_F64)
    dtype = _out_dtype(a, out_dtype, "backward_matmul")
    if a.dtype == torch.float16 and dtype != a.dtype:  # fp32 out: fp16's overflow kept
        product = _fp16_overflow(product)
    return product.to(dtype)


# The smallest magnitude that fp16 rounds to inf (halfway above its largest, 65504).
_FP16_OVERFLOW = 65520.0


def _fp16_overflow(t: Tensor) -> Tensor:
    """A wider product of fp16 operands with fp16's overflow: +-inf where ``|t| >= 65520``, as
    the fp16 product would hold (backward_matmul's fp32 output from fp16 operands; NaN stays)."""
    return torch.where(t.abs() >= _FP16_OVERFLOW, t.sign() * float("inf"), t)


# --------------------------------------------------------------------------- fake kernels
# Shapes and dtypes only (the contract's), for FakeTensor / torch.compile tracing.

def _vec_f32(like: Tensor, n) -> Tensor:
    return like.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("epifuse::gemm_affine")
def _gemm_affine_fake(x, weight, a, c, precision, *, activation=_D.activation,
                      negative_slope=_D.negative_slope):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("epifuse::gemm_colstats")
def _gemm_colstats_fake(x, weight, precision):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    n = weight.shape[0]
    return (x.new_empty((x.shape[0], n)), x.new_empty((n,), dtype=_F64),
            x.new_empty((n,), dtype=_F64))


@torch.library.register_fake("epifuse::bn_fold_train")
def _bn_fold_train_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale,
                        running_mean, running_var, num_batches_tracked, *, momentum=_D.momentum,
                        eps=_D.eps):
    n = colsum.shape[0]
    return _vec_f32(colsum, n), _vec_f32(colsum, n)


@torch.library.register_fake("epifuse::bn_fold_eval")
def _bn_fold_eval_fake(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, *,
                       eps=_D.eps):
    n = gamma.shape[0]
    return _vec_f32(gamma, n), _vec_f32(gamma, n)


@torch.library.register_fake("epifuse::affine_softmax")
def _affine_softmax_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                         out_dtype=None):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty(z.shape, dtype=out_dtype or z.dtype)


@torch.library.register_fake("epifuse::affine_softmax_")
def _affine_softmax_inplace_fake(z, a, c, *, activation=_D.activation,
                                 negative_slope=_D.negative_slope):
    return None


@torch.library.register_fake("epifuse::affine_")
def _affine_inplace_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope):
    return None


@torch.library.register_fake("epifuse::affine")
def _affine_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                 out_dtype=None):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty(z.shape, dtype=out_dtype or z.dtype)


@torch.library.register_fake("epifuse::bn_fold_batch")
def _bn_fold_batch_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                        eps=_D.eps):
    n = colsum.shape[0]
    return _vec_f32(colsum, n), _vec_f32(colsum, n), colsum.new_empty((2 * n + 1,), dtype=_F64)


@torch.library.register_fake("epifuse::update_running_stats")
def _update_running_stats_fake(moments, running_mean, running_var, num_batches_tracked, *,
                               momentum=_D.momentum):
    return None


@torch.library.register_fake("epifuse::softmax_grad_rowdot")
def _softmax_grad_rowdot_fake(grad, out):
    torch._check(grad.dim() == 2, lambda: "grad must be 2-D")
    return _vec_f32(grad, grad.shape[0])


@torch.library.register_fake("epifuse::head_grad_sums")
def _head_grad_sums_fake(grad, out, rowdot, z, a=None, c=None, *, activation=_D.activation,
                         negative_slope=_D.negative_slope):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty((2 * z.shape[1] + 1,), dtype=_F64)


@torch.library.register_fake("epifuse::head_grad_coefficients")
def _head_grad_coefficients_fake(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                                 pre_scale, post_scale, *, training=_D.training, eps=_D.eps):
    n = gamma.shape[0]

    def like(t):
        return gamma.new_empty((0,), dtype=torch.float32) if t is None else torch.empty_like(t)

    return (gamma.new_empty((3, n), dtype=torch.float32), like(bias), like(gamma), like(beta),
            like(pre_scale), like(post_scale))


@torch.library.register_fake("epifuse::head_grad_z")
def _head_grad_z_fake(grad, out, rowdot, z, coef, a=None, c=None, *, activation=_D.activation,
                      negative_slope=_D.negative_slope):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty(z.shape)


@torch.library.register_fake("epifuse::gemm_operand")
def _gemm_operand_fake(t, dtype):
    # Tensor.to's layout: a contiguous t's cast is contiguous, another keeps t's strides.
    return torch.empty_like(t, dtype=dtype)


@torch.library.register_fake("epifuse::backward_matmul")
def _backward_matmul_fake(a, b, precision, *, out_dtype=None):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "a and b disagree on K")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)
