"""Registration helpers shared by the family modules."""

from __future__ import annotations

import torch

F64 = torch.float64
F32 = torch.float32


def reference(name: str):
    """Registers the decorated function as the CPU kernel of ``epifuse_reference::name``: the float64
    math the C++ op runs for CPU tensors, after its checks."""
    return torch.library.register_kernel(f"epifuse_reference::{name}", "cpu")


def fake(name: str):
    """Registers the decorated function as the fake (meta) kernel of ``epifuse::name``."""
    return torch.library.register_fake(f"epifuse::{name}")


def affine64(z, a, c):
    """``a * z + c`` in float64 (a, c None: the identity)."""
    y = z.to(F64)
    if a is not None:
        y = y * a.to(F64)
    if c is not None:
        y = y + c.to(F64)
    return y


def out_dtype_of(z, out_dtype):
    """An out-of-place pass's output dtype: ``out_dtype``, or z's (None). The C++ op checked it."""
    return z.dtype if out_dtype is None else out_dtype


def vec_f32(like, n):
    return like.new_empty((n,), dtype=F32)
