"""The fused forward shared by both problems' ModelNew.

A "head" module has the attributes of the reference models: ``gemm``
(nn.Linear), ``bn`` (nn.BatchNorm1d), ``scale`` (nn.Parameter) and a
``precision`` policy. On CUDA tensors of a GPU the library was built for
(sm_80 and later; Hopper gets the TMA/wgmma kernels) the forward runs the
epifuse ops:

  one call of the op epifuse::fused_head (cpp/ops/head.cpp), the one sequencer of the passes:
  the GEMM with its epilogue, the fold (updating the running statistics in training), the
  activation and softmax pass, in place when no backward will read z; its C++ autograd node runs
  the fused backward (fused_head_backward).

Anything else runs the reference module sequence, so results (and PyTorch's
own error messages for bad input) are those of the reference model; on a CUDA input the head
says so once per reason on the "epifuse" logger, or raises if it is strict (_fall_back).

The settings travel as one ``HeadConfig`` (head_config.py): the model's spec gives where the
scale sits, the activation after it and whether a softmax ends the head, each forward adds the
precision, the BatchNorm's mode, momentum and eps, and the process group; the ops get them as
keyword arguments.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import distributed, fold, ops
from .head_config import HeadConfig
from .precision import resolve_precision

# Read once: the NVTX ranges cost nothing unless asked for at import time.
_NVTX = os.environ.get("EPIFUSE_NVTX") == "1"
_NULL_RANGE = contextlib.nullcontext()


def _range(name: str):
    return torch.cuda.nvtx.range(name) if _NVTX else _NULL_RANGE


_FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Where a head says that it runs its unfused modules on a CUDA input (_fall_back).
_LOG = logging.getLogger("epifuse")

# The op: fused_head(x, weight, bias, gamma, beta, scale, running_mean, running_var,
# num_batches_tracked, **HeadConfig.kwargs()) -> (out, z, colsum, colsumsq, moments, a, c).
_fused_head = torch.ops.epifuse.fused_head.default


# A model's spec: a HeadConfig of which the model sets where the ``scale`` sits, the activation
# (and its negative_slope) and whether a softmax ends the head
# (``HeadSpec(scale_before_bn=True, softmax=False)``: problem 39); run_head fills in the rest from
# the module at each forward.
HeadSpec = HeadConfig


# The activations a head applies after its affine (and a scale after BatchNorm), by their
# HeadConfig name, computed as their nn modules do: the reference paths' math. The slope argument
# is LeakyReLU's negative_slope; the others ignore it.
_ACTIVATIONS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "": lambda y, slope: y,
    "relu": lambda y, slope: F.relu(y),
    "leaky_relu": lambda y, slope: F.leaky_relu(y, slope),
    "gelu": lambda y, slope: F.gelu(y),
    "gelu_tanh": lambda y, slope: F.gelu(y, approximate="tanh"),
    "silu": lambda y, slope: F.silu(y),
}
# The names: fold.ACTIVATIONS ('' none; the C++ table's order). tests/test_activations.py checks
# that _ACTIVATIONS has exactly these.
ACTIVATION_NAMES = fold.ACTIVATIONS


def apply_activation(y: Tensor, name: str, negative_slope: float = 0.01) -> Tensor:
    """The activation ``name`` (a HeadConfig name, '' none) of y, as its nn module computes it."""
    return _ACTIVATIONS[name](y, negative_slope)


# --------------------------------------------------------------------------- dispatch

_DEVICE_REASONS: dict[int, Optional[str]] = {}


# A device's answer never changes: cache it, and let torch.compile fold it to a
# constant (Dynamo cannot trace the capability query).
@torch.compiler.assume_constant_result
def _device_supported(index: int) -> Optional[str]:
    if index not in _DEVICE_REASONS:
        _DEVICE_REASONS[index] = ops.device_unsupported_reason(index)
    return _DEVICE_REASONS[index]


def transform_reason() -> Optional[str]:
    """Why the fused ops cannot run now: inside a torch.func transform (vmap, grad, jvp, jacrev,
    ...), which they do not implement (no batching rule, a C++ autograd Function); the reference
    modules then run, with eager's results and errors. None outside any transform."""
    if torch._C._are_functorch_transforms_active():  # a constant to torch.compile
        return "inside a torch.func transform (vmap, grad, jvp, jacrev, ...)"
    return None


# The module hooks the unfused forward would run (nn.Module.__call__ of gemm and bn) and the fused
# path does not call: their own, and those registered for every module.
_GLOBAL_HOOKS = (nn.modules.module._global_forward_pre_hooks,
                 nn.modules.module._global_forward_hooks,
                 nn.modules.module._global_backward_pre_hooks,
                 nn.modules.module._global_backward_hooks)


def has_module_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs hooks: forward (pre-)hooks or backward (pre-)hooks of its
    own (register_forward_hook, register_full_backward_hook, ...) or of every module."""
    d = module.__dict__
    return bool(d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"]
                or d["_backward_hooks"] or any(_GLOBAL_HOOKS))


def softmax_module_changed(module: nn.Module, dim: int) -> bool:
    """Whether a softmax module a head took in (its math computed by the head) is now something
    else: not an nn.Softmax over ``dim``, or one with hooks, which only its call runs."""
    return type(module) is not nn.Softmax or module.dim != dim or has_module_hooks(module)


def _device_reason(x: Tensor) -> Optional[str]:
    """Why x's device cannot run the fused kernels (None: it can)."""
    if not x.is_cuda:
        return f"input is on {x.device.type}, not CUDA"
    return _device_supported(x.device.index)  # a CUDA tensor's device always has an index


# The head computes nn.Linear's and BatchNorm1d's math from their parameters and buffers. A subclass
# with a forward of its own (a QAT Linear's fake-quantized weight, a custom BatchNorm) computes
# something else: such a head runs its modules.
_BATCH_NORM_FORWARDS = (nn.BatchNorm1d.forward, nn.SyncBatchNorm.forward)


def computes_as_linear(module: object) -> bool:
    """An nn.Linear whose class keeps nn.Linear's forward."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def computes_as_batch_norm(module: object) -> bool:
    """An nn.BatchNorm1d or nn.SyncBatchNorm whose class keeps its forward."""
    return (isinstance(module, (nn.BatchNorm1d, nn.SyncBatchNorm))
            and type(module).forward in _BATCH_NORM_FORWARDS)


class _Parts(NamedTuple):
    """A head's submodules, parameters and buffers, each looked up once per forward.

    An nn.Module attribute lookup (``module.gemm``, ``gemm.weight``) costs
    0.5-2 us in ``nn.Module.__getattr__``; the checks and the fused call used
    to repeat ~25 of them, a sizeable share of a small batch's forward, which
    is host-bound. ``_member`` reads the module's registries directly and falls
    back to attribute access, so parametrizations and reassigned parameters
    are honoured.
    """

    gemm: nn.Module
    bn: nn.Module
    weight: Tensor
    bias: Optional[Tensor]
    gamma: Optional[Tensor]
    beta: Optional[Tensor]
    scale: Tensor
    running_mean: Optional[Tensor]
    running_var: Optional[Tensor]
    num_batches_tracked: Optional[Tensor]


_MISSING = object()


def _member(module: nn.Module, registry: str, name: str):
    """``getattr(module, name)`` for a submodule, parameter or buffer, without nn.Module.__getattr__.

    Read straight from the module's ``_modules`` / ``_parameters`` / ``_buffers`` dict (~0.1 us
    instead of ~2 us on the H100 machine's host; ten of them per forward). A name that is not there
    (a parametrization's property, an attribute set some other way) takes the normal lookup.
    """
    value = module.__dict__[registry].get(name, _MISSING)
    return getattr(module, name) if value is _MISSING else value


def _registered_members(module: nn.Module) -> tuple:
    """(gemm, bn, scale) of a head that holds them (FusedLinearBatchNorm, the problems' ModelNew):
    from its registries, or the normal lookup for a name not there (head._member)."""
    return (_member(module, "_modules", "gemm"), _member(module, "_modules", "bn"),
            _member(module, "_parameters", "scale"))


def _parts(module: nn.Module) -> _Parts:
    # A head that borrows its members reads them its own way (FusedChain._head_members: the slots
    # in the model); a scale of None is a head without one: the ops get a ones(1) stand-in, which
    # they do not read (has_scale is False).
    own_read = getattr(type(module), "_head_members", None)
    gemm, bn, scale = _registered_members(module) if own_read is None else own_read(module)
    if not (computes_as_linear(gemm) and computes_as_batch_norm(bn)):
        # Not the modules the head computes (a LayerNorm put where the BatchNorm was, a QAT
        # Linear): nothing else is read; _reason sends the head to its modules.
        return _Parts(gemm, bn, *(None,) * 8)
    weight = _member(gemm, "_parameters", "weight")
    return _Parts(gemm, bn, weight, _member(gemm, "_parameters", "bias"),
                  _member(bn, "_parameters", "weight"), _member(bn, "_parameters", "bias"),
                  stand_in(1.0, 1, weight) if scale is None else scale,
                  _member(bn, "_buffers", "running_mean"), _member(bn, "_buffers", "running_var"),
                  _member(bn, "_buffers", "num_batches_tracked"))


def fast_path_reason(module: nn.Module, x: Tensor) -> Optional[str]:
    """None when ``module(x)`` will take the fused path; otherwise a short reason why not."""
    return _reason(_parts(module), x)


def _reason(parts: _Parts, x: Tensor) -> Optional[str]:
    if not isinstance(x, Tensor):
        return "input is not a tensor"
    reason = _device_reason(x) or transform_reason()
    if reason is not None:
        return reason
    gemm, bn, scale = parts.gemm, parts.bn, parts.scale
    if parts.weight is None:  # _parts found modules the head does not compute, and read no more
        if not computes_as_linear(gemm):
            return f"gemm is a {type(gemm).__name__}, not an nn.Linear with nn.Linear's forward"
        return (f"bn is a {type(bn).__name__}, not an nn.BatchNorm1d / nn.SyncBatchNorm with its "
                f"forward")
    if has_module_hooks(gemm) or has_module_hooks(bn):
        # The hooks see (and may change) the Linear's and the BatchNorm's inputs and outputs,
        # which the fused path never forms: the modules run, hooks and all.
        return "the Linear or the BatchNorm has module hooks, which only the modules' own calls run"
    if x.dim() != 2:
        return f"input is {x.dim()}-D, not 2-D"
    if x.shape[1] != gemm.in_features:
        return f"input has {x.shape[1]} features, gemm expects {gemm.in_features}"
    if x.shape[0] == 0:
        return "empty batch"
    if _batch_statistics(parts) and x.shape[0] == 1:
        # BatchNorm raises for this; the reference path raises it before any GEMM runs.
        return "training batch of 1 row"
    if x.dtype not in _FAST_DTYPES:
        return f"dtype {x.dtype} not supported"
    # Settings BatchNorm itself handles (eps = 0 with batch statistics: an error in torch 2.14;
    # a momentum outside [0, 1]: accepted) and the ops refuse: the modules decide.
    if not bn.eps >= 0 or (bn.eps == 0 and _batch_statistics(parts)):
        return f"BatchNorm eps={bn.eps} (the ops take eps > 0, or eps = 0 with running statistics)"
    if bn.momentum is not None and not 0 <= bn.momentum <= 1:
        return f"BatchNorm momentum={bn.momentum} outside [0, 1]"
    if (parts.gamma is None) != (parts.beta is None):
        return "BatchNorm has a weight without a bias or a bias without a weight"
    if (parts.running_mean is None) != (parts.running_var is None):
        return "BatchNorm has one running statistic without the other"
    if (parts.running_mean is not None and bn.track_running_stats
            and parts.num_batches_tracked is None and _batch_statistics(parts)):
        return "BatchNorm tracks running statistics without a num_batches_tracked buffer"
    n = gemm.out_features
    if bn.num_features != n:
        return f"BatchNorm has {bn.num_features} features, gemm has {n}"
    if scale.dim() != 1 or scale.numel() not in (1, n):
        return f"scale shape {tuple(scale.shape)} is neither (1,) nor ({n},)"
    # Mixed devices/dtypes: the reference raises PyTorch's own error. Under CUDA autocast the
    # input may differ from the parameters (a 16-bit activation from the layer before): the op's
    # autocast kernel casts both to the autocast dtype, as nn.Linear does.
    dtype, device = parts.weight.dtype, x.device
    if x.dtype != dtype and not torch.is_autocast_enabled("cuda"):
        return "parameters/buffers differ from the input in dtype or device"
    for t in (parts.weight, parts.bias, parts.gamma, parts.beta, scale, parts.running_mean,
              parts.running_var):
        if t is not None and (t.dtype != dtype or t.device != device):
            return "parameters/buffers differ from the input in dtype or device"
    if parts.num_batches_tracked is not None and parts.num_batches_tracked.device != device:
        return "num_batches_tracked is on another device"
    return None


def _batch_statistics(parts: _Parts) -> bool:
    """BatchNorm's rule: batch statistics in training, and in eval too without running ones."""
    return parts.bn.training or parts.running_mean is None


# Constant stand-ins the ops read in place of an absent tensor (ones, zeros), by (value, length,
# dtype, device). Read-only: no op writes them and none requires grad, so heads share them.
_STAND_INS: dict[tuple[float, int, torch.dtype, torch.device], Tensor] = {}


def stand_in(value: float, n: int, like: Tensor) -> Tensor:
    """A length-``n`` tensor of ``value`` with ``like``'s dtype and device, made once and kept: an
    affine-free BatchNorm's head otherwise allocated and filled two of them per forward (two fill
    kernels and their host time). Made afresh (not kept) while a CUDA graph is being captured,
    where the fill would only run at replay, and while torch.compile traces."""
    key = (value, n, like.dtype, like.device)
    t = _STAND_INS.get(key)
    if t is None:
        t = torch.full((n,), value, dtype=like.dtype, device=like.device)
        capturing = like.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and not torch.compiler.is_compiling():
            _STAND_INS[key] = t
    return t


def _bn_defaults(parts: _Parts) -> _Parts:
    """The BatchNorm variants as the ops take them: affine=False is weight 1 and bias 0, and
    without running statistics (track_running_stats=False) the ops get mean 0 / variance 1
    stand-ins that batch statistics never read (and nothing updates)."""
    if parts.gamma is not None and parts.running_mean is not None:
        return parts
    like = parts.weight
    n = parts.bn.num_features
    ones, zeros = stand_in(1.0, n, like), stand_in(0.0, n, like)
    if parts.gamma is None:
        parts = parts._replace(gamma=ones, beta=zeros)
    if parts.running_mean is None:
        parts = parts._replace(running_mean=zeros, running_var=ones)
    return parts


def _head_name(module: nn.Module) -> str:
    where = module.__dict__.get("where")
    return f"head {where}" if where else f"{type(module).__name__} head"


def _fall_back(module: nn.Module, x: Tensor, reason: str) -> None:
    """A head about to run its unfused modules: on a CUDA input, a warning on the "epifuse" logger
    once per head and reason, or, for a strict head (``epifuse.fuse(model, strict=True)``, or
    ``head.strict = True``), a RuntimeError naming the reason. Elsewhere (CPU) nothing: the fused
    kernels are CUDA's."""
    if not (isinstance(x, Tensor) and x.is_cuda):
        return
    if getattr(module, "strict", False):
        raise RuntimeError(f"epifuse: {_head_name(module)} cannot run fused: {reason} "
                           f"(strict head; clear `strict` to run the unfused modules instead)")
    seen = module.__dict__.setdefault("_epifuse_fallbacks", set())
    if reason not in seen:
        seen.add(reason)
        _LOG.warning("epifuse: %s runs its unfused modules: %s", _head_name(module), reason)


def run_head(module: nn.Module, x: Tensor, spec: HeadConfig,
             reference: Callable[[nn.Module, Tensor], Tensor]) -> Tensor:
    """Forward of a head module: fused on supported inputs, ``reference(module, x)`` otherwise.

    Fused, it is one call of ``epifuse::fused_head`` (cpp/ops/head.cpp), which sequences the
    passes for every mode (training, eval, for a backward or not, synchronized) and updates the
    running statistics; this function only decides and gathers the head's tensors and settings.
    """
    parts = _parts(module)
    # Synchronized batch statistics in data-parallel training (None: not synchronized).
    group = distributed.sync_group(module, parts.bn)
    reason = _reason(parts, x)
    if reason is not None:
        _fall_back(module, x, reason)
        if group is None or not isinstance(parts.bn, _BatchNorm):
            return reference(module, x)  # (no batch statistics to synchronize without a BatchNorm)
        return _synced_reference(module, x, spec, group)
    training = _batch_statistics(parts)
    # BatchNorm's rule: running statistics are updated in training only while track_running_stats
    # is set (a flag people clear on a trained BatchNorm to freeze its statistics; the buffers stay).
    # The op updates them when given num_batches_tracked.
    updates = training and parts.running_mean is not None and parts.bn.track_running_stats
    # (A stand-in for an absent parameter, _bn_defaults' below, never requires grad.)
    for_backward = torch.is_grad_enabled() and (
        x.requires_grad or parts.weight.requires_grad or parts.scale.requires_grad
        or any(p is not None and p.requires_grad for p in (parts.bias, parts.gamma, parts.beta)))
    bn = parts.bn
    config = HeadConfig(precision=resolve_precision(module.precision, x.dtype), training=training,
                        scale_before_bn=spec.scale_before_bn, softmax=spec.softmax,
                        activation=spec.activation, negative_slope=spec.negative_slope,
                        momentum=bn.momentum, eps=bn.eps,
                        group_name="" if group is None else group.group_name,
                        has_scale=spec.has_scale, for_backward=for_backward)
    p = _bn_defaults(parts)
    with _range("epifuse.fused_head"):
        return _fused_head(x, p.weight, p.bias, p.gamma, p.beta, p.scale, p.running_mean,
                           p.running_var, p.num_batches_tracked if updates else None,
                           **config.kwargs())[0]


def _synced_reference(module: nn.Module, x: Tensor, spec: HeadConfig, group) -> Tensor:
    """The head in PyTorch ops with a synchronized BatchNorm (any device, any batch).

    The Linear and the BatchNorm are called as modules, so their hooks run (and a Linear subclass
    computes its own forward); the BatchNorm's call computes nn.SyncBatchNorm's math instead of
    its own forward, which a subclass cannot keep: that is refused.
    """
    gemm, bn = module.gemm, module.bn
    if not computes_as_batch_norm(bn):
        raise RuntimeError(f"epifuse: synchronized batch statistics take an nn.BatchNorm1d or "
                           f"nn.SyncBatchNorm that keeps its forward, got {type(bn).__name__}")
    tracking = bn.track_running_stats

    def synced(u):
        return distributed.synced_batch_norm(
            u, bn.weight, bn.bias, bn.running_mean if tracking else None,
            bn.running_var if tracking else None, bn.num_batches_tracked if tracking else None,
            bn.momentum, bn.eps, group)

    return reference_head(x, gemm.weight, gemm.bias, bn.weight, bn.bias, module.scale, None, None,
                          spec._replace(training=True, eps=bn.eps),
                          batch_norm=lambda u, gamma, beta: _call_computing(bn, synced, u),
                          linear=gemm)


def _call_computing(module: nn.Module, forward: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``module(x)`` with its hooks, computing ``forward(x)`` in place of its own forward."""
    own = module.__dict__.get("forward", _MISSING)
    module.forward = forward
    try:
        return module(x)
    finally:
        if own is _MISSING:
            del module.forward
        else:
            module.forward = own


def reference_head(x, weight, bias, gamma, beta, scale, running_mean, running_var,
                   config: HeadConfig,
                   batch_norm: Optional[Callable[[Tensor, Optional[Tensor], Optional[Tensor]],
                                                 Tensor]] = None,
                   linear: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """The head's math in plain PyTorch ops, without touching running statistics.

    Of ``config`` it reads where the scale sits, the activation (after the scale, before the
    softmax), the softmax, ``training`` and ``eps``.

    ``batch_norm(u, gamma, beta)``, if given, replaces the training-mode
    BatchNorm (the synchronized reference path passes nn.SyncBatchNorm's), and ``linear(x)``
    the Linear (that path passes the module).
    """
    training, eps = config.training, config.eps
    y = F.linear(x, weight, bias) if linear is None else linear(x)
    if config.scale_before_bn:
        y = y * scale
    if training and batch_norm is not None:
        y = batch_norm(y, gamma, beta)
    elif training:  # batch statistics; the forward already updated the running ones
        y = F.batch_norm(y, None, None, gamma, beta, True, 0.0, eps)
    else:
        y = F.batch_norm(y, running_mean, running_var, gamma, beta, False, 0.0, eps)
    if not config.scale_before_bn:
        y = scale * y
    y = apply_activation(y, config.activation, config.negative_slope)
    if config.softmax:
        y = torch.softmax(y, dim=1)
    return y
