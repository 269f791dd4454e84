"""The head's ops (``cpp/ops/head.cpp``): fake kernels. Their CPU and CUDA kernels are the C++
composites over the per-pass ops, so the CPU path runs the other families' references."""

from __future__ import annotations

import torch

from ..head_config import DEFAULT as _D
from ._registry import F32, F64, fake


@fake("fused_head")
def _fused_head_fake(x, weight, bias, gamma, beta, scale, running_mean, running_var,
                     num_batches_tracked, **config):
    # config: the settings given (HeadConfig's fields, keyword-only); no shape depends on them.
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    torch._check(x.shape[1] == weight.shape[1], lambda: "x and weight disagree on K")
    n = weight.shape[0]
    # z in the GEMM's dtype (gemm_dtype: autocast's), the output in out_dtype (default z's).
    z = x.new_empty((x.shape[0], n), dtype=config.get("gemm_dtype") or x.dtype)
    out = torch.empty_like(z, dtype=config.get("out_dtype") or z.dtype)
    if not config.get("for_backward", _D.for_backward):
        # A forward for no backward: the output alone, the rest empty (z's in its dtype).
        return (out, x.new_empty((0,), dtype=z.dtype), x.new_empty((0,), dtype=F64),
                x.new_empty((0,), dtype=F64), x.new_empty((0,), dtype=F64),
                x.new_empty((0,), dtype=F32), x.new_empty((0,), dtype=F32))
    return (out, z, x.new_empty((n,), dtype=F64), x.new_empty((n,), dtype=F64),
            x.new_empty((2 * n + 1,), dtype=F64), x.new_empty((n,), dtype=F32),
            x.new_empty((n,), dtype=F32))


@fake("fused_head_backward")
def _fused_head_backward_fake(grad, x, weight, bias, gamma, beta, scale, z, out, colsum,
                              colsumsq, moments, needs, a=None, c=None, **config):
    # config: the settings given (HeadConfig's fields, keyword-only); no shape depends on them.
    torch._check(grad.dim() == 2, lambda: "grad must be 2-D")
    m, n = grad.shape
    # dX in z's dtype (the GEMM's) or float32 from a 16-bit z when grad_x_dtype asks, dW in the
    # parameters' (fp32 under autocast); one not needed is an empty tensor in grad's dtype.
    fp32_dx = config.get("grad_x_dtype") == torch.float32 and z.element_size() == 2
    grad_x = (z.new_empty((m, weight.shape[1]), dtype=torch.float32 if fp32_dx else z.dtype)
              if needs[0] else grad.new_empty((0,)))
    grad_w = z.new_empty((n, x.shape[1]), dtype=gamma.dtype) if needs[1] else grad.new_empty((0,))
    grad_bias = gamma.new_empty((0,), dtype=F32) if bias is None else torch.empty_like(bias)
    # A head without a scale (has_scale=False) reads none: zeros where asked for, else empty.
    has_grad_scale = config.get("has_scale", _D.has_scale) or needs[5]
    grad_scale = torch.empty_like(scale) if has_grad_scale else scale.new_empty((0,))
    return (grad_x, grad_w, grad_bias, torch.empty_like(gamma), torch.empty_like(beta), grad_scale)
