"""The plain Linear's op (``cpp/ops/linear.cpp``): its fake kernel. Its CPU and CUDA kernels are the
C++ composite over the GEMM and row-pass ops, so the CPU path runs their float64 references."""

from __future__ import annotations

import torch

from ..head_config import DEFAULT as _D
from ._registry import fake


def keeps_pre_activation(config: dict, gemm_dtype: torch.dtype) -> bool:
    """Whether fused_linear returns h = x . W^T + bias (non-empty): what the backward reads for an
    activation's derivative at its input (before a softmax, or GELU / SiLU / a negative LeakyReLU
    slope); the C++ forward's rule."""
    activation = config.get("activation", _D.activation)
    if not config.get("for_backward", _D.for_backward) or not activation:
        return False
    from_output = activation == "relu" or (
        activation == "leaky_relu" and config.get("negative_slope", _D.negative_slope) >= 0)
    return config.get("softmax", _D.softmax) or not from_output


@fake("fused_linear")
def _fused_linear_fake(x, weight, bias, **config):
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    z_dtype = config.get("gemm_dtype") or x.dtype
    out = x.new_empty((x.shape[0], weight.shape[0]), dtype=config.get("out_dtype") or z_dtype)
    if keeps_pre_activation(config, z_dtype):
        return out, x.new_empty((x.shape[0], weight.shape[0]), dtype=z_dtype)
    return out, x.new_empty((0,), dtype=z_dtype)
