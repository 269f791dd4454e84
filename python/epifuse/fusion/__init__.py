"""``epifuse.fuse(model)``: run the Linear -> BatchNorm heads of any model on the fused path.

The model's forward is traced with ``torch.fx`` (``nn.Sequential`` and
custom modules alike; nested modules are traced through). Every
``Linear -> [x scale] -> BatchNorm1d -> [x scale] -> [activation] -> [softmax(dim=1|-1)]``
chain found (activation: ReLU, LeakyReLU, GELU, SiLU) is replaced, in the
traced forward, by one ``FusedChain`` call (``fusion.chain``), and the model's
``forward`` becomes that traced forward.

Nothing else about the model changes: same class, same submodules, same
parameter and buffer objects, so ``state_dict()`` keys and values, optimizers
built before or after, hooks and ``train()``/``eval()``/``to()`` keep working (a head whose
Linear or BatchNorm has hooks runs those modules while it does: ``head.has_module_hooks``).
A module whose forward cannot be traced (data-dependent control flow) is
left as is and its children are tried one by one.
"""

from __future__ import annotations

import functools
from typing import Optional

from torch import fx, nn

from ..nn import BATCH_NORMS, FusedLinearBatchNorm
from ..precision import validate_precision
from .chain import FusedChain
from .graph import match_chains, rewrite
from .linear_chain import FusedLinearChain
from .report import Fused, FuseReport, Skipped  # noqa: F401  (re-exported)

# Set on a module whose forward fuse() replaced: its FusedChains (which are not submodules,
# so that containers such as nn.Sequential keep their length and indices), and its
# FusedLinearChains (the plain Linears: no BatchNorm, hence none of a head's BatchNorm settings).
HEADS_ATTR = "_epifuse_heads"
LINEARS_ATTR = "_epifuse_linears"
_FUSED_MODULES = (FusedLinearBatchNorm, FusedChain, FusedLinearChain)


class _Tracer(fx.Tracer):
    """fx's default tracer, with epifuse heads and already-fused modules as leaves."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, _FUSED_MODULES) or HEADS_ATTR in m.__dict__:
            return True
        return super().is_leaf_module(m, qualname)


def _has_candidates(module: nn.Module) -> bool:
    """Whether a Linear and a BatchNorm1d both live under module (worth reporting)."""
    kinds = {type(m) for m in module.modules()}
    return any(issubclass(k, nn.Linear) for k in kinds) and any(
        issubclass(k, BATCH_NORMS) for k in kinds)


def _is_builtin_leaf(module: nn.Module) -> bool:
    # torch.nn's own layers (not containers): nothing of ours can be inside them.
    return module.__module__.startswith("torch.nn") and not isinstance(
        module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


def _fuse_traced(module: nn.Module, path: str, precision: Optional[str], plain_linear: bool,
                 report: FuseReport) -> bool:
    """Trace module and fuse its chains; False if it cannot be traced."""
    try:
        graph = _Tracer().trace(module)
    except Exception as e:  # noqa: BLE001 - fx raises many types for untraceable code
        if _has_candidates(module) and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            report.skipped.append(Skipped(
                path or type(module).__name__,
                f"{type(module).__name__}.forward cannot be traced by torch.fx "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"its submodules were searched instead"))
        return False
    matches, skipped = match_chains(module, graph, f"{path}." if path else "", plain_linear)
    report.skipped.extend(skipped)
    if not matches:
        return True
    chains, fused = rewrite(module, graph, matches, precision)
    _look_up_at_each_call(graph, set(chains))
    traced = fx.GraphModule(chains, graph, class_name=f"{type(module).__name__}Fused")
    # The instance attribute shadows the class's forward; nn.Module.__call__ (hooks included)
    # calls it with the model as the graph's first input. The GraphModule holds the fused heads
    # only, and pickles and deep-copies with the model.
    module.forward = functools.partial(traced.forward, module)
    setattr(module, HEADS_ATTR, tuple(c for c in chains.values() if isinstance(c, FusedChain)))
    setattr(module, LINEARS_ATTR,
            tuple(c for c in chains.values() if isinstance(c, FusedLinearChain)))
    report.fused.extend(fused)
    return True


def _lookup(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _call_member(owner: nn.Module, target: str, *args, **kwargs):
    """``owner.<target>(*args, **kwargs)``, the submodule looked up at the call."""
    return _lookup(owner, target)(*args, **kwargs)


def _member(owner: nn.Module, target: str):
    """``owner.<target>`` (a parameter, buffer or other attribute), looked up at the call."""
    return _lookup(owner, target)


# Leaves for fx (the GraphModule re-traces its code when unpickled): calls, not inlined.
fx.wrap("_call_member")
fx.wrap("_member")


def _look_up_at_each_call(graph: fx.Graph, chains: set[str]) -> None:
    """Make the fused forward read the model's submodules, parameters and buffers through the
    model at each call, as its own forward does, instead of holding the objects found at fuse
    time: a parameter reassigned later (``load_state_dict(assign=True)``, ``to_empty()`` after a
    meta-device build) or a submodule replaced is then the one used. The model becomes the
    graph's first input; the fused heads (``chains``) stay attributes of the GraphModule (they
    look their own parts up at each call)."""
    first = next(iter(graph.nodes))
    with graph.inserting_before(first):
        owner = graph.placeholder("epifuse_owner")
    for node in list(graph.nodes):
        if node.op == "get_attr":
            new_args, target = (owner, node.target), _member
        elif node.op == "call_module" and node.target not in chains:
            new_args, target = (owner, node.target, *node.args), _call_member
        else:
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(target, new_args, dict(node.kwargs))
        replacement.meta = node.meta
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    graph.lint()


def _fuse(module: nn.Module, path: str, precision: Optional[str], plain_linear: bool,
          report: FuseReport) -> None:
    if _is_builtin_leaf(module) or isinstance(module, _FUSED_MODULES):
        return
    if HEADS_ATTR in module.__dict__:
        report.skipped.append(Skipped(path or type(module).__name__, "already fused"))
        return
    is_container = isinstance(module, (nn.ModuleList, nn.ModuleDict))  # no forward of their own
    if not is_container and _fuse_traced(module, path, precision, plain_linear, report):
        return
    for name, child in module.named_children():
        _fuse(child, f"{path}.{name}" if path else name, precision, plain_linear, report)


def fuse(model: nn.Module, *, precision: Optional[str] = None, strict: bool = False,
         plain_linear: bool = True) -> tuple[nn.Module, FuseReport]:
    """Fuse every ``Linear -> BatchNorm1d [-> scale] [-> activation] [-> softmax]`` chain of
    ``model``, in place.

    A chain is an ``nn.Linear`` whose output feeds only an ``nn.BatchNorm1d``
    (or ``nn.SyncBatchNorm``; any variant: ``affine=False``, ``track_running_stats=False``,
    ``momentum=None``; the Linear with or without bias),
    optionally multiplied before or after the BatchNorm by a parameter or
    buffer of shape ``(1,)`` or ``(out_features,)``, optionally followed by an
    activation (``nn.ReLU``, ``nn.LeakyReLU``, ``nn.GELU`` with ``approximate``
    ``'none'`` or ``'tanh'``, ``nn.SiLU``, or their functional forms ``F.relu``,
    ``torch.relu``, ``Tensor.relu``, ``F.leaky_relu``, ``F.gelu``, ``F.silu``,
    in place or not) whose output has no other reader, and optionally by a
    softmax over dim 1 or -1 (``nn.Softmax``, ``torch.softmax``, ``F.softmax``,
    ``Tensor.softmax``). Any other activation stays outside the chain.

    With ``plain_linear`` (the default), every other ``nn.Linear`` it reaches fuses too, with the
    activation and softmax after it (``FusedLinearChain``): at fp32 default precision its GEMM is
    epifuse's 3x split instead of SGEMM; at 16 bits and in TF32 it runs PyTorch's GEMM, the same
    one (``linear.PYTORCH_GEMM``). ``plain_linear=False`` fuses the BatchNorm chains only.

    Returns ``(model, report)``: the same model object, and a ``FuseReport``
    listing the chains fused and the near misses left with their reason.
    ``precision`` is the fp32 GEMM policy of the fused heads (as ``ModelNew``'s).

    A fused head runs the unfused modules for inputs the kernels do not cover (CPU tensors, an
    unsupported dtype, a module hook, ...). On a CUDA input it says so once per head and reason on
    the ``"epifuse"`` logger (``logging.getLogger("epifuse")``); with ``strict=True`` it raises a
    RuntimeError naming the reason instead (``head.strict`` sets it per head).

    The fused forward is ``torch.fx``'s trace of the original one: Python-level
    branches (``if self.training:``, flags) are fixed as they were at fuse time,
    as with any fx transform. Fuse again after changing the model's structure.
    Submodules, parameters and buffers are looked up on the model at each call, and a
    head whose modules changed since (replaced, re-set, hooked) runs them as they are.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"epifuse.fuse expects an nn.Module, got {type(model).__name__}")
    precision = validate_precision(precision)
    report = FuseReport()
    _fuse(model, "", precision, plain_linear, report)
    if strict:
        for module in model.modules():
            for head in (*module.__dict__.get(HEADS_ATTR, ()),
                         *module.__dict__.get(LINEARS_ATTR, ())):
                head.strict = True
    return model, report


__all__ = ["FuseReport", "Fused", "FusedChain", "FusedLinearChain", "HEADS_ATTR", "LINEARS_ATTR",
           "Skipped", "fuse"]
