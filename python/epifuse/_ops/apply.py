"""The row passes (``cpp/ops/apply.cpp``): float64 references and fake kernels."""

from __future__ import annotations

import torch

from .. import fold
from ..head_config import DEFAULT as _D
from ._registry import affine64, fake, out_dtype_of, reference


def _softmax64(z, a, c, activation, negative_slope):
    return torch.softmax(fold.activate(affine64(z, a, c), activation, negative_slope), dim=1)


@reference("affine_softmax")
def _affine_softmax(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                    out_dtype=None):
    return _softmax64(z, a, c, activation, negative_slope).to(out_dtype_of(z, out_dtype))


@reference("affine_softmax_")
def _affine_softmax_inplace(z, a, c, *, activation=_D.activation,
                            negative_slope=_D.negative_slope):
    z.copy_(_softmax64(z, a, c, activation, negative_slope))


@reference("affine_")
def _affine_inplace(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope):
    z.copy_(fold.activate(affine64(z, a, c), activation, negative_slope))


@reference("affine")
def _affine(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
            out_dtype=None):
    y = fold.activate(affine64(z, a, c), activation, negative_slope)
    return y.to(out_dtype_of(z, out_dtype)).contiguous()  # the CUDA kernel's layout


def _new_like(z, out_dtype):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty(z.shape, dtype=out_dtype or z.dtype)


@fake("affine_softmax")
def _affine_softmax_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                         out_dtype=None):
    return _new_like(z, out_dtype)


@fake("affine_softmax_")
def _affine_softmax_inplace_fake(z, a, c, *, activation=_D.activation,
                                 negative_slope=_D.negative_slope):
    return None


@fake("affine_")
def _affine_inplace_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope):
    return None


@fake("affine")
def _affine_fake(z, a, c, *, activation=_D.activation, negative_slope=_D.negative_slope,
                 out_dtype=None):
    return _new_like(z, out_dtype)
