"""The GEMM ops (``cpp/ops/gemm.cpp``): float64 references and fake kernels."""

from __future__ import annotations

import torch

from .. import fold
from ..head_config import DEFAULT as _D
from ._registry import F64, affine64, fake, out_dtype_of, reference

# The smallest magnitude that fp16 rounds to inf (halfway above its largest, 65504).
_FP16_OVERFLOW = 65520.0


def _gemm64(x, weight):
    return x.to(F64) @ weight.to(F64).T


def _fp16_overflow(t):
    """A wider product of fp16 operands with fp16's overflow: +-inf where ``|t| >= 65520``, as
    the fp16 product would hold (backward_matmul's fp32 output from fp16 operands; NaN stays)."""
    return torch.where(t.abs() >= _FP16_OVERFLOW, t.sign() * float("inf"), t)


@reference("gemm_affine")
def _gemm_affine(x, weight, a, c, precision, *, activation=_D.activation,
                 negative_slope=_D.negative_slope):
    y = fold.activate(affine64(_gemm64(x, weight), a, c), activation, negative_slope)
    return y.to(x.dtype)


@reference("gemm_colstats")
def _gemm_colstats(x, weight, precision):
    z = _gemm64(x, weight).to(x.dtype)
    colsum, colsumsq = fold.column_stats(z)
    return z, colsum, colsumsq


@reference("backward_matmul")
def _backward_matmul(a, b, precision, *, out_dtype=None):
    product = a.to(F64) @ b.to(F64)
    dtype = out_dtype_of(a, out_dtype)
    if a.dtype == torch.float16 and dtype != a.dtype:  # fp32 out: fp16's overflow kept
        product = _fp16_overflow(product)
    return product.to(dtype)


@reference("gemm_operand")
def _gemm_operand(t, dtype):
    return t.to(dtype, copy=True)


def _check_operands(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")


@fake("gemm_affine")
def _gemm_affine_fake(x, weight, a, c, precision, *, activation=_D.activation,
                      negative_slope=_D.negative_slope):
    _check_operands(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0]))


@fake("gemm_colstats")
def _gemm_colstats_fake(x, weight, precision):
    _check_operands(x, weight)
    n = weight.shape[0]
    return (x.new_empty((x.shape[0], n)), x.new_empty((n,), dtype=F64),
            x.new_empty((n,), dtype=F64))


@fake("backward_matmul")
def _backward_matmul_fake(a, b, precision, *, out_dtype=None):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[0], lambda: "a and b disagree on K")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)


@fake("gemm_operand")
def _gemm_operand_fake(t, dtype):
    # Tensor.to's layout: a contiguous t's cast is contiguous, another keeps t's strides.
    return torch.empty_like(t, dtype=dtype)
