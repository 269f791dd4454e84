"""The fused forward of a plain Linear layer [-> activation] [-> row softmax]: ``run_linear``.

The layers of a head that no BatchNorm follows (Barlow Twins' and VICReg's last Linear, SimCLR's
and MoCo v2's projector, a classifier's output layer) run as one call of ``epifuse::fused_linear``
(cpp/ops/linear.cpp): the GEMM with the bias and the activation in its epilogue, its C++ autograd
node the backward (dh through the activation, d bias, dX and dW in the forward's precision).

Only where it pays: at PyTorch's default fp32 precision ('highest') the GEMM is epifuse's 3x split
on the tensor cores, fp32's accuracy at several times SGEMM's speed. At 16 bits (autocast) and in
TF32, ``nn.Linear`` runs cuBLAS's own tensor-core GEMM, the one epifuse would run: there the layer
runs as PyTorch runs it (``PYTORCH_GEMM``, not a fallback: nothing is logged).

Inputs the fused path does not cover run the layer's own modules, with eager's results and errors;
on a CUDA input the head says why once per reason on the "epifuse" logger, or raises if it is
strict (head._fall_back).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import head as _head
from .head import _FAST_DTYPES, _fall_back, _member, computes_as_linear, has_module_hooks, transform_reason
from .precision import TF32X3, resolve_precision

# The op: fused_linear(x, weight, bias, *, precision, softmax, activation, negative_slope,
# gemm_dtype, out_dtype, for_backward) -> (out, h).
_fused_linear = torch.ops.epifuse.fused_linear.default

# Why a plain Linear runs PyTorch's GEMM where it could run fused: the policy, not a fallback.
PYTORCH_GEMM = ("at 16 bits and in TF32 nn.Linear runs cuBLAS's own tensor-core GEMM, the one "
                "epifuse would run: the layer runs as PyTorch runs it")


def linear_reason(linear: nn.Module, x: Tensor, softmax_dim: Optional[int]) -> Optional[str]:
    """Why ``linear(x)`` (with the softmax over ``softmax_dim`` after it) cannot run fused (None:
    it can); then its modules run."""
    if not isinstance(x, Tensor):
        return "input is not a tensor"
    reason = _head._device_reason(x) or transform_reason()  # (looked up: tests patch it)
    if reason is not None:
        return reason
    if not computes_as_linear(linear):
        return f"the layer is a {type(linear).__name__}, not an nn.Linear with nn.Linear's forward"
    if has_module_hooks(linear):
        return "the Linear has module hooks, which only the module's own call runs"
    if x.dim() < 2:
        return f"input is {x.dim()}-D (the fused Linear takes [*, in_features], 2-D or more)"
    if x.shape[-1] != linear.in_features:
        return f"input has {x.shape[-1]} features, the Linear expects {linear.in_features}"
    if x.numel() == 0:
        return "empty input"
    if softmax_dim == 1 and x.dim() != 2:
        return f"softmax over dim 1 of a {x.dim()}-D input is not over the features"
    if x.dtype not in _FAST_DTYPES:
        return f"dtype {x.dtype} not supported"
    weight, bias = _member(linear, "_parameters", "weight"), _member(linear, "_parameters", "bias")
    if not torch.is_autocast_enabled("cuda") and x.dtype != weight.dtype:
        return "the parameters differ from the input in dtype or device"
    for t in (weight, bias):
        if t is not None and (t.dtype != weight.dtype or t.device != x.device):
            return "the parameters differ from the input in dtype or device"
    return None


def runs_pytorch_gemm(x: Tensor, precision: str) -> bool:
    """Where epifuse's GEMM would be PyTorch's (PYTORCH_GEMM): under CUDA autocast, for 16-bit
    inputs, and in any fp32 mode but the 3x split (TF32, or 'ieee': SGEMM itself)."""
    return torch.is_autocast_enabled("cuda") or precision != TF32X3


def run_linear(head: nn.Module, x: Tensor) -> Tensor:
    """Forward of a FusedLinearChain: fused (one fused_linear call) where it pays and the inputs
    allow, else the layer's own modules (``head.run_modules``)."""
    linear = head.gemm
    reason = linear_reason(linear, x, head.softmax_dim)
    if reason is not None:
        _fall_back(head, x, reason)
        return head.run_modules(x)
    precision = resolve_precision(head.precision, x.dtype)
    if runs_pytorch_gemm(x, precision):
        return head.run_modules(x)
    weight, bias = _member(linear, "_parameters", "weight"), _member(linear, "_parameters", "bias")
    for_backward = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [*, K] as a 2-D view
    kwargs = head.op_kwargs if for_backward else head.op_kwargs_no_backward
    out = _fused_linear(rows, weight, bias, **kwargs)[0]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
