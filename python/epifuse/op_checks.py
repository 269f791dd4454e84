"""Argument checks of the ops' CPU kernels: those of the CUDA ops (cpp/ops/ops.cpp).

The CPU kernels are the executable spec of the CUDA ones, so they must also
refuse what the CUDA ops refuse (an int or float64 parameter, a float32
colsum, an int32 step counter, a wrong length), with the same exception type
and message; otherwise code tested on CPU fails only on the GPU.
TORCH_CHECK is a RuntimeError and TORCH_CHECK_VALUE a ValueError.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import precision as _precision

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
               torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
               torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool"}


def type_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype ('Float', 'Long', ...), as the C++ messages print it."""
    return _TYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _sizes(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_kernel_dtype(t: Tensor, op: str) -> None:
    if t.dtype not in _KERNEL_DTYPES:
        raise RuntimeError(f"epifuse::{op} not implemented for '{type_name(t.dtype)}' "
                           f"(expected Float, Half or BFloat16)")


def _quoted(names: tuple[str, ...], last: str) -> str:
    return ", ".join(f"'{n}'" for n in names) + f" or {last}"


def check_precision(precision: str, dtype: torch.dtype, op: str) -> None:
    # The messages of cpp/ops/ops.cpp's math_mode, from the same names.
    names = _precision.NAMES
    if precision not in names and precision != "":
        raise ValueError(f"epifuse::{op}: precision must be {_quoted(names, repr(''))} "
                         f"(16-bit inputs), got '{precision}'")
    if dtype == torch.float32 and precision == "":
        raise ValueError(f"epifuse::{op}: float32 inputs need precision "
                         f"{_quoted(names[:-1], repr(names[-1]))}")


def _check_same_dtype(a: Tensor, b: Tensor) -> None:
    if a.dtype != b.dtype:  # torch.mm's message
        raise RuntimeError(f"mat1 and mat2 must have the same dtype, but got "
                           f"{type_name(a.dtype)} and {type_name(b.dtype)}")


def check_gemm(x: Tensor, weight: Tensor, precision: str, op: str) -> None:
    if x.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected x to be 2-D [M, K], got {x.dim()}-D")
    if weight.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected weight to be 2-D [N, K], got "
                           f"{weight.dim()}-D")
    _check_same_dtype(x, weight)
    if x.shape[1] != weight.shape[1]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({x.shape[0]}x"
                           f"{x.shape[1]} and {weight.shape[1]}x{weight.shape[0]})")
    check_kernel_dtype(x, op)
    check_precision(precision, x.dtype, op)


def check_matmul(a: Tensor, b: Tensor, precision: str, op: str) -> None:
    """``a @ b`` (backward_matmul): the checks of its CUDA kernel, in its order."""
    if a.dim() != 2 or b.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected 2-D a and b, got {a.dim()}-D and {b.dim()}-D")
    _check_same_dtype(a, b)
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} "
                           f"and {b.shape[0]}x{b.shape[1]})")
    check_kernel_dtype(a, op)
    check_precision(precision, a.dtype, op)


def check_column_vector(v: Tensor, n: int, op: str, name: str) -> None:
    if v.dtype != torch.float32:
        raise RuntimeError(f"epifuse::{op}: expected {name} to be float32, got "
                           f"{type_name(v.dtype)}")
    if v.dim() != 1 or v.shape[0] != n:
        raise RuntimeError(f"epifuse::{op}: expected {name} of shape [{n}], got {_sizes(v)}")


def check_matrix(z: Tensor, op: str) -> None:
    if z.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected a 2-D tensor, got {z.dim()}-D")
    check_kernel_dtype(z, op)


def check_optional_affine(z: Tensor, a: Optional[Tensor], c: Optional[Tensor], op: str) -> None:
    if (a is None) != (c is None):
        raise RuntimeError(f"epifuse::{op}: pass both a and c, or neither (no affine)")
    if a is not None:
        check_column_vector(a, z.shape[1], op, "a")
        check_column_vector(c, z.shape[1], op, "c")


def _byte_span(t: Tensor) -> tuple[int, int]:
    """[first, last) bytes a strided tensor's elements lie in ((0, 0) when empty)."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def check_written_apart(written: Tensor, read: Optional[Tensor], op: str, written_name: str,
                        read_name: str) -> None:
    """An in-place op's input shares no memory with the tensor it writes (op_args.h says why)."""
    if read is None:
        return
    (w0, w1), (r0, r1) = _byte_span(written), _byte_span(read)
    if w0 != w1 and r0 != r1 and r1 > w0 and w1 > r0:
        raise RuntimeError(
            f"epifuse::{op}: unsupported operation: {read_name} and the written-to {written_name} "
            f"share memory (some elements refer to a single memory location). Please clone() "
            f"{read_name} before performing the operation.")


def check_grad_operands(grad: Tensor, out: Optional[Tensor], rowdot: Optional[Tensor], z: Tensor,
                        op: str) -> None:
    """prepare_grad: the [M, N] operands of a backward pass. grad and out share one dtype, z's
    or float32 over a 16-bit z (a head's fp32 output under autocast); rowdot is a float32 [M]."""
    if z.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected z to be 2-D [M, N], got {z.dim()}-D")
    check_kernel_dtype(z, op)
    g_dtype = (torch.float32 if grad.dtype == torch.float32 and z.element_size() == 2
               else z.dtype)

    def check_like_z(t: Tensor, name: str) -> None:
        if t.dtype != g_dtype:
            like = "like z" if g_dtype == z.dtype else "like grad"
            raise RuntimeError(f"epifuse::{op}: expected {name} to have dtype "
                               f"{type_name(g_dtype)} {like}, got {type_name(t.dtype)}")
        if t.shape != z.shape:
            raise RuntimeError(f"epifuse::{op}: expected {name} of shape {_sizes(z)} like z, "
                               f"got {_sizes(t)}")

    check_like_z(grad, "grad")
    if (out is None) != (rowdot is None):
        raise RuntimeError(f"epifuse::{op}: pass both out and rowdot (softmax heads), or neither")
    if out is not None:
        check_like_z(out, "out")
        check_column_vector(rowdot, z.shape[0], op, "rowdot")


def check_rowdot_operands(grad: Tensor, out: Tensor) -> None:
    """softmax_grad_rowdot: grad and out of one dtype and shape (out stands as z)."""
    op = "softmax_grad_rowdot"
    if out.dim() != 2:
        raise RuntimeError(f"epifuse::{op}: expected out to be 2-D [M, N], got {out.dim()}-D")
    if grad.dtype != out.dtype:
        raise RuntimeError(f"epifuse::{op}: expected grad to have dtype {type_name(out.dtype)} "
                           f"like out, got {type_name(grad.dtype)}")
    check_grad_operands(grad, None, None, out, op)


def check_coef(coef: Tensor, n: int, op: str = "head_grad_z") -> None:
    """head_grad_z's per-column coefficients: a float32 [3, N] (A, B, C)."""
    if not (coef.dtype == torch.float32 and coef.dim() == 2 and coef.shape[0] == 3
            and coef.shape[1] == n):
        raise RuntimeError(f"epifuse::{op}: expected coef to be a float32 [3, {n}] tensor, got "
                           f"{type_name(coef.dtype)} {_sizes(coef)}")


def check_grad_coefficients(sums: Tensor, global_sums: Optional[Tensor], colsum: Optional[Tensor],
                            colsumsq: Optional[Tensor], moments: Tensor, gamma: Tensor,
                            training: bool, op: str = "head_grad_coefficients") -> None:
    """head_grad_coefficients's checks after check_fold, in the CUDA op's order."""
    n = gamma.shape[0]
    check_sums(sums, "sums", 2 * n + 1, op)
    check_sums(moments, "moments", 2 * n + 1, op)
    if global_sums is not None:
        check_sums(global_sums, "global_sums", 2 * n + 1, op)
    if training and (colsum is None or colsumsq is None):
        raise RuntimeError(f"epifuse::{op}: training-mode coefficients need colsum and colsumsq")
    if training:
        check_sums(colsum, "colsum", n, op)
        check_sums(colsumsq, "colsumsq", n, op)


def check_fold_param(t: Optional[Tensor], name: str, scale: bool, n: int, like: Tensor,
                     like_name: str, op: str) -> None:
    """check_fold_param: a fold's parameter vector in like's dtype (``like_name`` names it),
    contiguous, [n] or, for a scale, 1 or n elements. None: nothing to check."""
    if t is None:
        return
    if t.dtype != like.dtype:
        raise RuntimeError(f"epifuse::{op}: expected {name} to have dtype "
                           f"{type_name(like.dtype)} like {like_name}, got {type_name(t.dtype)}")
    if not t.is_contiguous():
        raise RuntimeError(f"epifuse::{op}: expected {name} to be contiguous")
    if scale and not (t.numel() == 1 or (t.dim() == 1 and t.numel() == n)):
        raise RuntimeError(f"epifuse::{op}: expected {name} to have 1 or {n} elements (one "
                           f"per column), got shape {_sizes(t)}")
    if not scale and not (t.dim() == 1 and t.numel() == n):
        raise RuntimeError(f"epifuse::{op}: expected {name} of shape [{n}], got {_sizes(t)}")


def check_fold(bias: Optional[Tensor], gamma: Tensor, beta: Tensor, pre_scale: Optional[Tensor],
               post_scale: Optional[Tensor], eps: float, op: str) -> None:
    """prepare_fold: the parameter vectors share gamma's dtype, are contiguous, [N] or scales."""
    if gamma.dim() != 1:
        raise RuntimeError(f"epifuse::{op}: expected gamma to be 1-D, got {_sizes(gamma)}")
    n = gamma.shape[0]
    for t, name, scale in ((gamma, "gamma", False), (beta, "beta", False), (bias, "bias", False),
                           (pre_scale, "pre_scale", True), (post_scale, "post_scale", True)):
        check_fold_param(t, name, scale, n, gamma, "gamma", op)
    if not eps >= 0:
        raise ValueError(f"epifuse::{op}: eps must be non-negative, got {eps:f}")
    check_kernel_dtype(gamma, op)


def check_running(t: Tensor, name: str, gamma: Tensor, op: str, also_fp64: bool = False,
                  ref_name: str = "gamma") -> None:
    """also_fp64: float64 is accepted too (bn_fold_eval, folding the moments a backward kept).
    ``gamma``: the tensor whose dtype and length t must have (``ref_name`` names it)."""
    if t.dtype != gamma.dtype and not (also_fp64 and t.dtype == torch.float64):
        raise RuntimeError(f"epifuse::{op}: expected {name} to have dtype "
                           f"{type_name(gamma.dtype)} like {ref_name}"
                           f"{' (or float64)' if also_fp64 else ''}, got {type_name(t.dtype)}")
    if not (t.is_contiguous() and t.dim() == 1 and t.shape[0] == gamma.shape[0]):
        raise RuntimeError(f"epifuse::{op}: expected {name} to be a contiguous "
                           f"[{gamma.shape[0]}] tensor, got {_sizes(t)}")


def check_fold_train(colsum: Tensor, colsumsq: Tensor, count: int, gamma: Tensor,
                     running_mean: Tensor, running_var: Tensor, num_batches_tracked: Tensor,
                     momentum: Optional[float], op: str = "bn_fold_train") -> None:
    """bn_fold_train's checks after check_fold, in the CUDA op's order."""
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {count} "
                         f"rows")
    n = gamma.shape[0]
    for s in (colsum, colsumsq):
        if not (s.dtype == torch.float64 and s.is_contiguous() and s.dim() == 1
                and s.shape[0] == n):
            raise RuntimeError(f"epifuse::{op}: expected colsum and colsumsq to be contiguous "
                               f"float64 [{n}] tensors, got {type_name(s.dtype)} {_sizes(s)}")
    check_running(running_mean, "running_mean", gamma, op)
    check_running(running_var, "running_var", gamma, op)
    _check_counter_and_momentum(num_batches_tracked, momentum, op)


def check_update_running_stats(moments: Tensor, running_mean: Tensor, running_var: Tensor,
                               num_batches_tracked: Tensor, momentum: Optional[float]) -> None:
    """update_running_stats's checks, in the CUDA op's order."""
    op = "update_running_stats"
    check_kernel_dtype(running_mean, op)
    if not (running_mean.is_contiguous() and running_mean.dim() == 1):
        raise RuntimeError(f"epifuse::{op}: expected running_mean to be a contiguous 1-D tensor, "
                           f"got {_sizes(running_mean)}")
    check_running(running_var, "running_var", running_mean, op, ref_name="running_mean")
    check_sums(moments, "moments", 2 * running_mean.shape[0] + 1, op)
    _check_counter_and_momentum(num_batches_tracked, momentum, op)


def check_sums(t: Tensor, name: str, numel: int, op: str) -> None:
    """check_sums: a contiguous float64 [numel] tensor (column sums, moments, a row of sums)."""
    if not (t.dtype == torch.float64 and t.is_contiguous() and t.dim() == 1
            and t.shape[0] == numel):
        raise RuntimeError(f"epifuse::{op}: expected {name} to be a contiguous float64 [{numel}] "
                           f"tensor, got {type_name(t.dtype)} {_sizes(t)}")


def _check_counter_and_momentum(num_batches_tracked: Tensor, momentum: Optional[float],
                                op: str) -> None:
    if num_batches_tracked.dtype != torch.int64 or num_batches_tracked.numel() != 1:
        raise RuntimeError(f"epifuse::{op}: expected num_batches_tracked to be a one-element "
                           f"int64 tensor")
    if momentum is not None and not 0 <= momentum <= 1:
        raise ValueError(f"epifuse::{op}: momentum must be in [0, 1] or None, got {momentum:f}")


# ------------------------------------------------------------------------ synchronized statistics
# cpp/ops/synced_ops.cpp's checks, in its order.

def check_pack_moments(colsum: Tensor, colsumsq: Tensor, count: int, bias: Optional[Tensor],
                       pre_scale: Optional[Tensor]) -> None:
    """pack_moments: float64 [N] sums, count >= 1, bias / pre_scale in one kernel dtype
    (bias's, or else pre_scale's)."""
    op = "pack_moments"
    if colsum.dim() != 1:
        raise RuntimeError(f"epifuse::{op}: expected colsum to be 1-D, got {_sizes(colsum)}")
    n = colsum.shape[0]
    check_sums(colsum, "colsum", n, op)
    check_sums(colsumsq, "colsumsq", n, op)
    if count < 1:
        raise ValueError(f"epifuse::{op}: count must be >= 1, got {count}")
    like, like_name = (bias, "bias") if bias is not None else (pre_scale, "pre_scale")
    if like is None:
        return
    check_kernel_dtype(like, op)
    check_fold_param(bias, "bias", False, n, like, like_name, op)
    check_fold_param(pre_scale, "pre_scale", True, n, like, like_name, op)


def check_moment_rows(rows: Tensor, n: int, op: str) -> None:
    """merge_fold's rows: float64 [world >= 1, 2n + 1], a [count, mean, M2] row per rank."""
    width = 2 * n + 1
    if not (rows.dtype == torch.float64 and rows.dim() == 2 and rows.shape[0] >= 1
            and rows.shape[1] == width and rows.is_contiguous()):
        raise RuntimeError(f"epifuse::{op}: expected rows to be a contiguous float64 [world, "
                           f"{width}] tensor (a [count, mean, M2] row per rank, world >= 1), got "
                           f"{type_name(rows.dtype)} {_sizes(rows)}")
