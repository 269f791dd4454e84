"""Public modules: a ``Linear -> BatchNorm1d [-> scale] [-> activation] [-> softmax]`` head you
build yourself.

``FusedLinearBatchNorm`` takes existing ``nn.Linear`` / ``nn.BatchNorm1d``
modules (and optionally a scale tensor and an activation: ReLU, LeakyReLU,
GELU, SiLU) and runs them through ``head.run_head``, the fused path of the
KernelBench ``ModelNew`` classes: on a GPU the library was built for, one GEMM
with a fused epilogue, the fold kernel and one pass that applies the affine,
the activation and (with ``softmax=True``) the softmax; anywhere else the same
modules called one after the other. ``epifuse.fuse(model)`` builds the
borrowing variant (``epifuse.fusion.chain``) for chains it finds in a model.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from .distributed import configure_sync_batchnorm
from .head import (ACTIVATION_NAMES, HeadSpec, apply_activation, computes_as_batch_norm,
                   computes_as_linear, run_head)
from .head_config import DEFAULT as HEAD_DEFAULTS
from .precision import validate_precision
from .scripting import NotScriptable

SCALE_POSITIONS = ("before_bn", "after_bn")
# BatchNorm modules the head can stand in for on 2-D input. SyncBatchNorm outside an
# initialized process group is BatchNorm1d; inside one, run_head synchronizes the statistics.
BATCH_NORMS = (nn.BatchNorm1d, nn.SyncBatchNorm)
# LeakyReLU's default slope: HeadConfig's negative_slope default, which the other activations
# keep (tests/test_activations.py checks it is nn.LeakyReLU's).
DEFAULT_NEGATIVE_SLOPE = HEAD_DEFAULTS.negative_slope
_GELU_NAMES = {"none": "gelu", "tanh": "gelu_tanh"}
_SUPPORTED_MODULES = "nn.ReLU, nn.LeakyReLU, nn.GELU (approximate='none' or 'tanh') or nn.SiLU"


def activation_of_module(module: object) -> Optional[tuple[str, float]]:
    """(HeadConfig name, negative_slope) of an activation module the head can apply; None for any
    other object. The types are matched exactly: a subclass may compute something else. Their
    ``inplace`` flag does not matter, the head's output is a tensor of its own."""
    kind = type(module)
    if kind is nn.ReLU:
        return "relu", DEFAULT_NEGATIVE_SLOPE
    if kind is nn.LeakyReLU:
        slope = module.negative_slope
        if isinstance(slope, (int, float)) and not isinstance(slope, bool):
            return "leaky_relu", float(slope)
        return None
    if kind is nn.GELU and module.approximate in _GELU_NAMES:
        return _GELU_NAMES[module.approximate], DEFAULT_NEGATIVE_SLOPE
    if kind is nn.SiLU:
        return "silu", DEFAULT_NEGATIVE_SLOPE
    return None


def describe_activation(name: str, negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> str:
    """An activation as the report and repr print it, in PyTorch's spelling: ``relu``,
    ``leaky_relu(negative_slope=0.2)``, ``gelu(approximate='tanh')``; '' is ``none``."""
    if name == "leaky_relu":
        return f"leaky_relu(negative_slope={negative_slope})"
    if name == "gelu_tanh":
        return "gelu(approximate='tanh')"
    return name or "none"


def resolve_activation(activation: Optional[Union[str, nn.Module]],
                       negative_slope: Optional[float]) -> tuple[str, float]:
    """(name, negative_slope) of FusedLinearBatchNorm's ``activation`` / ``negative_slope``
    arguments; TypeError / ValueError (PyTorch style) for anything the head cannot apply."""
    if negative_slope is not None and (isinstance(negative_slope, bool)
                                       or not isinstance(negative_slope, (int, float))):
        raise TypeError(f"negative_slope must be a float or None, got "
                        f"{type(negative_slope).__name__}")
    if activation is None:
        name, slope = "", DEFAULT_NEGATIVE_SLOPE
    elif isinstance(activation, str):
        if activation not in ACTIVATION_NAMES:
            names = ", ".join(repr(n) for n in ACTIVATION_NAMES if n)
            raise ValueError(f"activation must be None, one of {names} or an activation module, "
                             f"got {activation!r}")
        name, slope = activation, DEFAULT_NEGATIVE_SLOPE
    elif isinstance(activation, nn.Module):
        found = activation_of_module(activation)
        if found is None:
            raise ValueError(f"activation {activation!r} is not one the head can apply; expected "
                             f"{_SUPPORTED_MODULES}")
        name, slope = found
    else:
        raise TypeError(f"activation must be None, a str or an nn.Module, got "
                        f"{type(activation).__name__}")
    if negative_slope is not None:
        # An nn.LeakyReLU brings its own slope, and no other activation has one: a second,
        # ignored value would be a silent mistake.
        if not (isinstance(activation, str) and activation == "leaky_relu"):
            raise ValueError(f"negative_slope is for activation='leaky_relu' only, got "
                             f"activation={activation!r}")
        slope = float(negative_slope)
    return name, slope


def check_head_parts(linear: nn.Module, batch_norm: nn.Module, scale: Optional[Tensor],
                     scale_position: str) -> None:
    """Raise TypeError / ValueError (PyTorch style) unless the parts form a fusable head."""
    if not computes_as_linear(linear):
        raise TypeError(f"expected linear to be an nn.Linear (or a subclass that keeps its "
                        f"forward), got {type(linear).__name__}")
    if not computes_as_batch_norm(batch_norm):
        raise TypeError(f"expected batch_norm to be an nn.BatchNorm1d or nn.SyncBatchNorm (or a "
                        f"subclass that keeps its forward), got {type(batch_norm).__name__}")
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
    return module.activation_and_softmax(head_body_reference(module, x))


def head_body_reference(module: nn.Module, x: Tensor) -> Tensor:
    """``head_reference`` up to the scale: Linear, BatchNorm and the scale, without the activation
    and the softmax."""
    y = module.gemm(x)
    if module.has_scale and module.scale_position == "before_bn":
        y = y * module.scale
    y = module.bn(y)
    if module.has_scale and module.scale_position == "after_bn":
        y = y * module.scale
    return y


class HeadModule(NotScriptable, nn.Module):
    """What both fused head modules share: the spec, the precision and the forward.

    Subclasses provide ``gemm``, ``bn``, ``scale`` (a ones(1) stand-in when the
    head has none, which the ops do not read) and ``has_scale``. The
    activation is kept by name (``activation``, '' for none, and ``negative_slope``),
    not as a module: the activations hold no state.

    ``strict``: where the fused kernels do not cover a CUDA input, raise (True) instead of running
    the unfused modules with a warning on the "epifuse" logger (``epifuse.fuse(..., strict=True)``
    sets it on every head it makes).
    """

    strict: bool = False

    def _configure(self, scale_position: str, softmax_dim: Optional[int],
                   precision: Optional[str], activation: str = "",
                   negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> None:
        self.precision = validate_precision(precision)
        self.scale_position = scale_position
        self.softmax_dim = softmax_dim
        self.activation = activation
        self.negative_slope = negative_slope
        self._spec = HeadSpec(scale_before_bn=scale_position == "before_bn",
                              softmax=softmax_dim is not None, activation=activation,
                              negative_slope=negative_slope, has_scale=self.has_scale)
        configure_sync_batchnorm(self, False, None)  # epifuse.convert_sync_batchnorm flips it

    def forward(self, x: Tensor) -> Tensor:
        return run_head(self, x, self._spec, head_reference)

    def activation_and_softmax(self, y: Tensor) -> Tensor:
        """The unfused tail of the head: its activation (the module's math; it holds no state)
        and softmax."""
        if self.activation:
            y = apply_activation(y, self.activation, self.negative_slope)
        return y if self.softmax_dim is None else torch.softmax(y, self.softmax_dim)

    def extra_repr(self) -> str:
        scale = self.scale_position if self.has_scale else "none"
        softmax = "none" if self.softmax_dim is None else f"dim={self.softmax_dim}"
        activation = describe_activation(self.activation, self.negative_slope)
        return (f"scale={scale}, activation={activation}, softmax={softmax}, "
                f"precision={self.precision}")


class FusedLinearBatchNorm(HeadModule):
    """``Linear -> BatchNorm1d [-> scale] [-> activation] [-> softmax(dim=1)]`` as one fused head.

    Args:
        linear: the ``nn.Linear`` (kept as the submodule ``gemm``).
        batch_norm: an ``nn.BatchNorm1d`` (or ``nn.SyncBatchNorm``) over ``linear.out_features``
            features (``bn``); any variant: ``affine=False``, ``track_running_stats=False`` (batch
            statistics in eval too), ``momentum=None`` (cumulative average).
        scale: optional per-column multiplier of shape ``(1,)`` or ``(out_features,)``; an
            ``nn.Parameter`` stays a parameter (``scale``), any other tensor becomes a buffer.
        scale_position: ``"after_bn"`` (``bn(z) * scale``, KernelBench 84) or ``"before_bn"``
            (``bn(z * scale)``, KernelBench 39).
        activation: applied after the BatchNorm and the scale, before the softmax: None, a name
            (``"relu"``, ``"leaky_relu"``, ``"gelu"``, ``"gelu_tanh"``: GELU with
            ``approximate='tanh'``, ``"silu"``) or a module: ``nn.ReLU``, ``nn.LeakyReLU``
            (its ``negative_slope``), ``nn.GELU`` (``approximate='none'`` or ``'tanh'``),
            ``nn.SiLU`` (``inplace`` either way). Kept by name (``activation``); a module
            given is not held.
        negative_slope: LeakyReLU's slope for ``activation="leaky_relu"`` (default 0.01).
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
                 *, scale_position: str = "after_bn",
                 activation: Optional[Union[str, nn.Module]] = None,
                 negative_slope: Optional[float] = None, softmax: bool = False,
                 precision: Optional[str] = None):
        super().__init__()
        check_head_parts(linear, batch_norm, scale, scale_position)
        name, slope = resolve_activation(activation, negative_slope)
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
        self._configure(scale_position, 1 if softmax else None, precision, name, slope)


__all__ = ["FusedLinearBatchNorm", "activation_of_module", "check_head_parts",
           "describe_activation", "head_reference", "resolve_activation"]
