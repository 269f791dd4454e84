"""Finding ``Linear -> [x scale] -> BatchNorm1d -> [x scale] -> [activation] -> [softmax]`` in an
fx graph, and the plain ``Linear -> [activation] -> [softmax]`` layers beside them.

``match_chains`` walks a traced graph from every ``nn.Linear`` call and
returns the chains it can fuse plus the near misses (a feature-count mismatch,
a Linear output used twice, ...) with the reason.
``rewrite`` replaces each matched run of nodes by one call of a FusedChain.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..head import computes_as_batch_norm, computes_as_linear, has_module_hooks
from ..nn import BATCH_NORMS, DEFAULT_NEGATIVE_SLOPE, activation_of_module, describe_activation
from .chain import FusedChain, slot_of
from .linear_chain import FusedLinearChain
from .report import Fused, Skipped

_MULS = (operator.mul, torch.mul)
_SOFTMAX_FUNCTIONS = (torch.softmax, F.softmax)
# The activation functions and Tensor methods fuse() takes: target -> (activation, the arguments
# after the input that may be positional, those that may only be keywords). Python functions of
# torch.nn.functional reach the graph with every argument as a keyword, builtins as written.
# ``inplace`` is accepted and ignored: its input, the BatchNorm's output, has no other reader.
_ACTIVATION_FUNCTIONS = {
    F.relu: ("relu", ("inplace",), ()),
    torch.relu: ("relu", (), ()),
    torch.relu_: ("relu", (), ()),  # also F.relu_
    F.leaky_relu: ("leaky_relu", ("negative_slope", "inplace"), ()),
    F.leaky_relu_: ("leaky_relu", ("negative_slope",), ()),
    F.gelu: ("gelu", (), ("approximate",)),
    F.silu: ("silu", ("inplace",), ()),
}
_ACTIVATION_METHODS = {"relu": ("relu", (), ()), "relu_": ("relu", (), ())}


@dataclass
class Match:
    """A fusable chain: its nodes in graph order and where its parts live."""

    nodes: list[fx.Node]
    linear: str  # call_module targets
    bn: Optional[str]  # None: a plain Linear (no BatchNorm)
    scale: Optional[str] = None  # get_attr target
    scale_position: str = "after_bn"
    activation: str = ""  # HeadConfig's name, '' none
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE
    softmax_dim: Optional[int] = None
    # call_module targets of an activation / softmax module the chain took in (None: a function)
    activation_module: Optional[str] = None
    softmax_module: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    prefix: str = ""  # the traced module's path in the model, for the report

    @property
    def where(self) -> str:
        p = self.prefix
        parts = [p + self.linear]
        if self.scale and self.scale_position == "before_bn":
            parts.append(f"* {p}{self.scale}")
        if self.bn is not None:
            parts.append(p + self.bn)
        if self.scale and self.scale_position == "after_bn":
            parts.append(f"* {p}{self.scale}")
        if self.activation:
            parts.append(describe_activation(self.activation, self.negative_slope))
        if self.softmax_dim is not None:
            parts.append(f"softmax(dim={self.softmax_dim})")
        return " -> ".join(parts)


def _sole_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _module(modules: dict[str, nn.Module], node: fx.Node) -> Optional[nn.Module]:
    return modules.get(node.target) if node.op == "call_module" else None


def _only_input(node: fx.Node, source: fx.Node) -> bool:
    """node is called on ``source`` alone (``module(source)``)."""
    return node.args == (source,) and not node.kwargs


def _scale_target(root: nn.Module, node: fx.Node, source: fx.Node, n: int) -> Optional[str]:
    """If node is ``source * t`` / ``t * source`` for a module tensor t of shape (1,) or (n,),
    the get_attr target of t."""
    is_mul = ((node.op == "call_function" and node.target in _MULS)
              or (node.op == "call_method" and node.target == "mul"))
    if not is_mul or node.kwargs or len(node.args) != 2 or source not in node.args:
        return None
    other = node.args[1] if node.args[0] is source else node.args[0]
    if not isinstance(other, fx.Node) or other.op != "get_attr" or other is source:
        return None
    slot = slot_of(root, other.target)
    value = slot.get()
    if isinstance(value, Tensor) and value.dim() == 1 and value.numel() in (1, n):
        return other.target
    return None


def _softmax_dim(modules: dict[str, nn.Module], node: fx.Node, source: fx.Node):
    """(is a softmax of source, its dim) for nn.Softmax, torch/F.softmax, Tensor.softmax."""
    module = _module(modules, node)
    if isinstance(module, nn.Softmax) and _only_input(node, source):
        return True, module.dim
    is_call = ((node.op == "call_function" and node.target in _SOFTMAX_FUNCTIONS)
               or (node.op == "call_method" and node.target == "softmax"))
    if not is_call or not node.args or node.args[0] is not source:
        return False, None
    kwargs = {k: v for k, v in node.kwargs.items() if k != "_stacklevel"}
    if kwargs.get("dtype") is not None or len(node.args) > 2 or set(kwargs) - {"dim", "dtype"}:
        return False, None  # a dtype-casting softmax is not the head's
    dim = node.args[1] if len(node.args) == 2 else kwargs.get("dim")
    return True, dim


def _activation(modules: dict[str, nn.Module], node: fx.Node,
                source: fx.Node) -> Optional[tuple[str, float]]:
    """(HeadConfig name, negative_slope) if node is a supported activation of source alone:
    nn.ReLU / LeakyReLU / GELU / SiLU, F.relu, torch.relu, Tensor.relu, F.leaky_relu,
    F.gelu(approximate='none' | 'tanh'), F.silu (and their in-place forms)."""
    if node.op == "call_module":
        module = _module(modules, node)
        return activation_of_module(module) if _only_input(node, source) else None
    if node.op == "call_function":
        entry = _ACTIVATION_FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        entry = _ACTIVATION_METHODS.get(node.target)
    else:
        entry = None
    if entry is None or not node.args or node.args[0] is not source:
        return None
    name, positional, keywords = entry
    if len(node.args) - 1 > len(positional):
        return None
    settings = dict(zip(positional, node.args[1:]))
    for key, value in node.kwargs.items():
        if key in settings or key not in positional + keywords:
            return None
        settings[key] = value
    if any(isinstance(v, fx.Node) for v in settings.values()):
        return None  # a setting computed in the graph: not a constant the head can take
    if name == "gelu":
        approximate = settings.get("approximate", "none")
        return ({"none": ("gelu", DEFAULT_NEGATIVE_SLOPE),
                 "tanh": ("gelu_tanh", DEFAULT_NEGATIVE_SLOPE)}.get(approximate)
                if isinstance(approximate, str) else None)
    if name == "leaky_relu":
        slope = settings.get("negative_slope", DEFAULT_NEGATIVE_SLOPE)
        if isinstance(slope, bool) or not isinstance(slope, (int, float)):
            return None
        return name, float(slope)
    return name, DEFAULT_NEGATIVE_SLOPE


def _hooked_module(modules: dict[str, nn.Module], node: Optional[fx.Node]) -> Optional[str]:
    """The target of a module call node whose module has hooks (which only its call runs)."""
    module = _module(modules, node) if node is not None else None
    return node.target if module is not None and has_module_hooks(module) else None


def _bn_problem(bn: nn.Module, n: int) -> Optional[str]:
    if not isinstance(bn, BATCH_NORMS):
        return None  # not a BatchNorm1d at all: not a candidate, nothing to report
    if not computes_as_batch_norm(bn):
        return f"{type(bn).__name__} has a forward of its own, not BatchNorm's"
    if bn.num_features != n:
        return f"BatchNorm has {bn.num_features} features, the Linear {n}"
    return None


def _match_from(root: nn.Module, modules: dict[str, nn.Module], lin_node: fx.Node,
                skipped: list[Skipped], prefix: str) -> Optional[Match]:
    linear = modules[lin_node.target]
    n = linear.out_features

    def reaches_bn(node: fx.Node) -> bool:  # node, or node * scale, feeds a BatchNorm
        for user in node.users:
            if isinstance(_module(modules, user), BATCH_NORMS):
                return True
            if _scale_target(root, user, node, n) and any(
                    isinstance(_module(modules, u), BATCH_NORMS) for u in user.users):
                return True
        return False

    if not computes_as_linear(linear):
        if reaches_bn(lin_node):
            skipped.append(Skipped(prefix + lin_node.target, f"{type(linear).__name__} has a "
                                   f"forward of its own, not nn.Linear's (e.g. a QAT Linear)"))
        return None
    if len(lin_node.users) > 1:
        if reaches_bn(lin_node):
            skipped.append(Skipped(prefix + lin_node.target, f"the Linear's output has "
                                   f"{len(lin_node.users)} consumers; fusing would drop the "
                                   f"value the others read"))
        return None
    cur, user = lin_node, _sole_user(lin_node)
    if user is None:
        return None
    scale = _scale_target(root, user, cur, n)
    if scale is not None:
        after_mul = _sole_user(user)
        if after_mul is None:
            if reaches_bn(lin_node):
                skipped.append(Skipped(prefix + lin_node.target, f"the scaled output has "
                                       f"{len(user.users)} consumers"))
            return None
        cur, user = user, after_mul
    bn = _module(modules, user)
    if not isinstance(bn, BATCH_NORMS) or not _only_input(user, cur):
        return None
    problem = _bn_problem(bn, n)
    if problem is not None:
        skipped.append(Skipped(f"{prefix}{lin_node.target} -> {prefix}{user.target}", problem))
        return None
    match = Match([lin_node] + ([cur] if cur is not lin_node else []) + [user], lin_node.target,
                  user.target, scale, "before_bn" if scale else "after_bn", prefix=prefix)
    cur = user
    nxt = _sole_user(cur)
    if nxt is not None and scale is None:
        post = _scale_target(root, nxt, cur, n)
        if post is not None:
            match.scale, match.scale_position = post, "after_bn"
            match.nodes.append(nxt)
            cur, nxt = nxt, _sole_user(nxt)
    if has_module_hooks(linear) or has_module_hooks(bn):
        match.notes.append("the Linear or the BatchNorm has module hooks: the head runs its "
                           "modules, hooks and all, while they do")
    _take_tail(modules, match, cur, nxt)
    return match


def _take_tail(modules: dict[str, nn.Module], match: Match, cur: fx.Node,
               nxt: Optional[fx.Node]) -> None:
    """Extend ``match`` (ending at ``cur``, whose sole user is ``nxt``) by the activation and the
    softmax that follow, where they can fuse; a note says why one that follows did not."""
    act = _activation(modules, nxt, cur) if nxt is not None else None
    hooked = _hooked_module(modules, nxt)
    if act is not None and hooked:
        # The head applies its activation by name: the module, and its hooks, would not run.
        match.notes.append(f"{describe_activation(*act)} left unfused: {hooked} has module hooks")
        nxt = None
    elif act is not None and len(nxt.users) > 1:
        # A shared activation stays the model's own (a conservative rule: fusing it would be
        # exact too, every reader getting the head's output), and so does any softmax after it.
        match.notes.append(f"{describe_activation(*act)} left unfused: its output has "
                           f"{len(nxt.users)} consumers")
        nxt = None
    elif act is not None:
        match.activation, match.negative_slope = act
        match.activation_module = nxt.target if nxt.op == "call_module" else None
        match.nodes.append(nxt)
        cur, nxt = nxt, _sole_user(nxt)
    if nxt is not None:
        is_softmax, dim = _softmax_dim(modules, nxt, cur)
        hooked = _hooked_module(modules, nxt)
        if is_softmax and hooked:
            match.notes.append(f"softmax left unfused: {hooked} has module hooks")
        elif is_softmax and dim in (1, -1):
            match.softmax_dim = dim
            match.softmax_module = nxt.target if nxt.op == "call_module" else None
            match.nodes.append(nxt)
        elif is_softmax:
            match.notes.append(f"softmax over dim {dim} left unfused (only the feature "
                               f"dimension, 1 or -1, fuses)")
    elif len(cur.users) > 1:
        match.notes.append(f"output used by {len(cur.users)} consumers; any activation or "
                           f"softmax left unfused")


def _match_plain(modules: dict[str, nn.Module], lin_node: fx.Node, prefix: str) -> Optional[Match]:
    """A plain ``Linear [-> activation] [-> softmax]`` from lin_node: any nn.Linear that keeps
    nn.Linear's forward (its output may have several readers: then it fuses alone)."""
    linear = modules[lin_node.target]
    if not computes_as_linear(linear):
        return None
    match = Match([lin_node], lin_node.target, None, prefix=prefix)
    match.notes.append("plain Linear: epifuse's 3x GEMM at fp32 default precision, PyTorch's own "
                       "GEMM at 16 bits and in TF32")
    if has_module_hooks(linear):
        match.notes.append("the Linear has module hooks: it runs as a module, hooks and all, "
                           "while it does")
    _take_tail(modules, match, lin_node, _sole_user(lin_node))
    return match


def match_chains(root: nn.Module, graph: fx.Graph, prefix: str = "",
                 plain_linear: bool = True) -> tuple[list[Match], list[Skipped]]:
    """Every fusable chain of ``graph`` (traced from ``root``) and the near misses.

    ``prefix`` (root's path in the model, with a trailing dot) prefixes the report's names.
    ``plain_linear``: also every other nn.Linear, with the activation and softmax after it.
    """
    modules = dict(root.named_modules())
    matches: list[Match] = []
    skipped: list[Skipped] = []
    for node in graph.nodes:
        module = _module(modules, node)
        if not isinstance(module, nn.Linear) or isinstance(module, nn.modules.lazy.LazyModuleMixin):
            continue
        if not (len(node.args) == 1 and not node.kwargs):
            continue
        match = _match_from(root, modules, node, skipped, prefix)
        if match is None and plain_linear:
            match = _match_plain(modules, node, prefix)
        if match is not None:
            matches.append(match)
    return matches, skipped


def rewrite(root: nn.Module, graph: fx.Graph, matches: list[Match],
            precision: Optional[str]) -> tuple[dict[str, nn.Module], list[Fused]]:
    """Replace each match in ``graph`` by a call of a new FusedChain (FusedLinearChain for a
    plain Linear).

    Returns the chains by the attribute name the graph calls them under, and
    the report entries.
    """
    chains: dict[str, nn.Module] = {}
    fused: list[Fused] = []
    for i, m in enumerate(matches):
        activation_module = slot_of(root, m.activation_module) if m.activation_module else None
        softmax_module = slot_of(root, m.softmax_module) if m.softmax_module else None
        if m.bn is None:  # a plain Linear
            name = f"epifuse_linear_{i}"
            chains[name] = FusedLinearChain(slot_of(root, m.linear), m.softmax_dim, precision,
                                            m.where, m.activation, m.negative_slope,
                                            activation_module, softmax_module)
        else:
            name = f"epifuse_head_{i}"
            chains[name] = FusedChain(slot_of(root, m.linear), slot_of(root, m.bn),
                                      slot_of(root, m.scale) if m.scale else None,
                                      m.scale_position, m.softmax_dim, precision, m.where,
                                      m.activation, m.negative_slope, activation_module,
                                      softmax_module)
        first, last = m.nodes[0], m.nodes[-1]
        with graph.inserting_after(last):
            call = graph.call_module(name, args=first.args)
        last.replace_all_uses_with(call)
        scale_reads = [a for node in m.nodes for a in node.args
                       if isinstance(a, fx.Node) and a.op == "get_attr"]
        for node in reversed(m.nodes):
            graph.erase_node(node)
        # Only the scale reads: a general dead-code pass would also drop module calls whose
        # output is unused but whose side effects (running statistics) are not.
        for node in scale_reads:
            if not node.users:
                graph.erase_node(node)
        fused.append(Fused(m.where, "; ".join(m.notes), "head" if m.bn is not None else "linear"))
    graph.lint()
    return chains, fused


__all__ = ["Match", "match_chains", "rewrite"]
