"""Public functional ops."""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from . import head

_SOFTMAX_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``torch.softmax(x, dim)``, by the epifuse row-softmax kernel where it applies.

    The kernel covers 2-D, non-empty float32/float16/bfloat16 CUDA tensors on
    Hopper with ``dim`` the last one and no autograd, outside torch.func transforms; anything
    else is torch.softmax itself (same result, same errors, and gradients).
    """
    if (isinstance(x, Tensor) and x.dim() == 2 and dim in (1, -1) and x.dtype in _SOFTMAX_DTYPES
            and x.numel() > 0 and not (x.requires_grad and torch.is_grad_enabled())
            and head._device_reason(x) is None and head.transform_reason() is None):
        return ops.affine_softmax(x, None, None)
    return torch.softmax(x, dim)
