"""Public modules: a ``Linear -> BatchNorm1d [-> scale] [-> softmax]`` head you build yourself.

``FusedLinearBatchNorm`` takes existing ``nn.Linear`` / ``nn.BatchNorm1d``
modules (and optionally a scale tensor) and runs them through
``head.run_head``, the fused path of the KernelBench ``ModelNew`` classes: on
a GPU the library was built for, one GEMM with a fused epilogue, the fold
kernel and (with ``softmax=True``) one softmax pass; anywhere else the same
modules called one after the other. ``epifuse.fuse(model)`` builds the
borrowing variant (``epifuse.fusion.chain``) for chains it finds in a model.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .distributed import configure_sync_batchnorm
from .head import HeadSpec, run_head
from .precision import validate_precision
from .scripting import NotScriptable

SCALE_POSITIONS = ("before_bn", "after_bn")
# BatchNorm modules the head can stand in for on 2-D input. SyncBatchNorm outside an
# initialized process group is BatchNorm1d; inside one, run_head synchronizes the statistics.
BATCH_NORMS = (nn.BatchNorm1d, nn.SyncBatchNorm)


def check_head_parts(linear: nn.Module, batch_norm: nn.Module, scale: Optional[Tensor],
                     scale_position: str) -> None:
    """Raise TypeError / ValueError (PyTorch style) unless the parts form a fusable head."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected linear to be an nn.Linear, got {type(linear).__name__}")
    if not isinstance(batch_norm, BATCH_NORMS):
        raise TypeError(f"expected batch_norm to be an nn.BatchNorm1d or nn.SyncBatchNorm, got "
                        f"{type(batch_norm).__name__}")
    n = linear.out_features
    if batch_norm.num_features != n:
        raise ValueError(f"batch_norm has {batch_norm.num_features} features, linear has "
                         f"out_features={n}")
    if scale_position not in SCALE_POSITIONS:
        raise ValueError(f"scale_position must be one of {SCALE_POSITIONS}, got "
                         f"{scale_position!r}")
    if scale is not None:
        if not isinstance(scale, Tensor):
            raise TypeError(f"expected scale to be a Tensor or None, got {type(scale).__name__}")
        if scale.dim() != 1 or scale.numel() not in (1, n):
            raise ValueError(f"scale must have shape (1,) or ({n},), got {tuple(scale.shape)}")


def head_reference(module: nn.Module, x: Tensor) -> Tensor:
    """The unfused forward: the head's own modules called in order (any input, any device).

    ``run_head`` takes it for inputs the fused kernels do not cover, so the
    results and error messages are those of the modules themselves.
    """
    y = module.gemm(x)
    if module.has_scale and module.scale_position == "before_bn":
        y = y * module.scale
    y = module.bn(y)
    if module.has_scale and module.scale_position == "after_bn":
        y = y * module.scale
    if module.softmax_dim is not None:
        y = torch.softmax(y, module.softmax_dim)
    return y


class HeadModule(NotScriptable, nn.Module):
    """What both fused head modules share: the spec, the precision and the forward.

    Subclasses provide ``gemm``, ``bn``, ``scale`` (a ones(1) stand-in when the
    head has none: the fold multiplies by it exactly) and ``has_scale``.
    """

    def _configure(self, scale_position: str, softmax_dim: Optional[int],
                   precision: Optional[str]) -> None:
        self.precision = validate_precision(precision)
        self.scale_position = scale_position
        self.softmax_dim = softmax_dim
        self._spec = HeadSpec(scale_before_bn=scale_position == "before_bn",
                              softmax=softmax_dim is not None, has_scale=self.has_scale)
        configure_sync_batchnorm(self, False, None)  # epifuse.convert_sync_batchnorm flips it

    def forward(self, x: Tensor) -> Tensor:
        return run_head(self, x, self._spec, head_reference)

    def extra_repr(self) -> str:
        scale = self.scale_position if self.has_scale else "none"
        softmax = "none" if self.softmax_dim is None else f"dim={self.softmax_dim}"
        return f"scale={scale}, softmax={softmax}, precision={self.precision}"


class FusedLinearBatchNorm(HeadModule):
    """``Linear -> BatchNorm1d [-> scale] [-> softmax(dim=1)]`` as one fused head.

    Args:
        linear: the ``nn.Linear`` (kept as the submodule ``gemm``).
        batch_norm: an ``nn.BatchNorm1d`` (or ``nn.SyncBatchNorm``) over ``linear.out_features``
            features (``bn``); any variant: ``affine=False``, ``track_running_stats=False`` (batch
            statistics in eval too), ``momentum=None`` (cumulative average).
        scale: optional per-column multiplier of shape ``(1,)`` or ``(out_features,)``; an
            ``nn.Parameter`` stays a parameter (``scale``), any other tensor becomes a buffer.
        scale_position: ``"after_bn"`` (``bn(z) * scale``, KernelBench 84) or ``"before_bn"``
            (``bn(z * scale)``, KernelBench 39).
        softmax: end with ``softmax(dim=1)``.
        precision: fp32 GEMM policy, ``"ieee" | "3xtf32" | "tf32"`` or None (follow
            ``torch.get_float32_matmul_precision()``, as ``nn.Linear`` does).

    The module holds the very objects it was given, so parameters, buffers and
    optimizer state are shared with them. Training and eval behave like the
    modules called in order (running statistics included); inputs the fused
    kernels do not cover (CPU, 3-D, float64, ...) run exactly that sequence.
    ``epifuse.fast_path_reason(module, x)`` says which path ``module(x)`` takes.
    """

    def __init__(self, linear: nn.Linear, batch_norm: nn.Module, scale: Optional[Tensor] = None,
                 *, scale_position: str = "after_bn", softmax: bool = False,
                 precision: Optional[str] = None):
        super().__init__()
        check_head_parts(linear, batch_norm, scale, scale_position)
        if not isinstance(softmax, bool):
            raise TypeError(f"softmax must be a bool, got {type(softmax).__name__}")
        self.gemm = linear
        self.bn = batch_norm
        self.has_scale = scale is not None
        if isinstance(scale, nn.Parameter):
            self.scale = scale
        elif scale is not None:
            self.register_buffer("scale", scale)
        else:  # not state: the head's math needs a tensor, a ones(1) is exact
            self.register_buffer("scale", linear.weight.new_ones(1).detach(), persistent=False)
        self._configure(scale_position, 1 if softmax else None, precision)


__all__ = ["FusedLinearBatchNorm", "check_head_parts", "head_reference"]
