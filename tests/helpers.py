"""Test helpers: building reference/fused model pairs and comparing tensors."""

from __future__ import annotations

import contextlib
import copy
from types import ModuleType
from typing import Optional

import torch
from torch import nn

from epifuse.problems import gemm_bn_scale_softmax as p84
from epifuse.problems import gemm_scale_bn as p39

PROBLEMS = {84: p84, 39: p39}

# The autograd node of epifuse::fused_head (its C++ autograd, cpp/ops/head_autograd.cpp): a gradient
# whose grad_fn is this came from the fused backward.
FUSED_NODE = "torch::autograd::CppNode<epifuse::FusedHead>"


def ops_run(fn, prefix: str = "") -> list[str]:
    """The names of the ops fn ran (profiler events, nested calls from the C++ composites
    included, each call listed), those starting with ``prefix``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name() for e in prof.profiler.kineto_results.events() if e.name().startswith(prefix)]


def cuda_kernels_run(fn) -> list[str]:
    """Names of the CUDA kernels fn() launches, in launch order (repeats kept); the device is
    synchronized before and after, so that only fn's kernels are listed."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def launches(fn, name: str) -> int:
    """How many CUDA kernels whose name contains ``name`` fn() launches."""
    return sum(name in k for k in cuda_kernels_run(fn))


def cutlass_gemms(fn) -> list[str]:
    """Names of the CUTLASS GEMM kernels fn() launches, in order."""
    return [k for k in cuda_kernels_run(fn) if "device_kernel" in k and "GemmUniversal" in k]


def epifuse_ops_in(prof) -> list[str]:
    """The epifuse ops a finished profile saw (short names, in call order, nested included).

    The profiler sees every op call, also those the C++ composites (fused_head and its backward)
    make through the dispatcher, which no Python spy can intercept. An op that calls itself again
    below autograd (the C++ autograd kernels do) is listed once. The float64 references that the
    ops call for CPU tensors (``epifuse_reference::``) are not listed: they are the ops' insides.
    """
    events = sorted((e for e in prof.events() if e.name.startswith("epifuse::")),
                    key=lambda e: (e.time_range.start, -e.time_range.end))
    kept: list = []
    for e in events:
        outer = next((k for k in reversed(kept) if k.time_range.end >= e.time_range.end), None)
        if outer is not None and outer.name == e.name and outer.time_range.start <= e.time_range.start:
            continue  # the same op again inside itself (the autograd kernel's redispatch)
        kept.append(e)
    return [e.name.split("::", 1)[1] for e in kept]


@contextlib.contextmanager
def traced_epifuse_ops():
    """The epifuse ops that ran inside the block (epifuse_ops_in: short names, in call order,
    nested included): a head's forward lists ``fused_head`` and then the passes it ran."""
    names: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        yield names
    names.extend(epifuse_ops_in(prof))


class OpCalls(list):
    """The epifuse ops run since the recorder started or was last cleared (epifuse_ops_in: short
    names in call order, the per-pass ops that fused_head's C++ kernel calls included), e.g.
    ``["fused_head", "gemm_colstats", "bn_fold_train", "affine_"]`` for a training forward
    without grad.

    A list kept up to date by a profiler that runs from start() to stop(): every read (==, in,
    len, count, indexing, iteration, repr) first adds what ran since the last one (the profile is
    closed, read and a new one opened). Don't nest traced_epifuse_ops or ops_run inside (one
    profiler at a time).
    """

    def start(self) -> "OpCalls":
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def stop(self) -> None:
        prof, self._prof = getattr(self, "_prof", None), None
        if prof is not None:
            prof.__exit__(None, None, None)
            list.extend(self, epifuse_ops_in(prof))

    def _sync(self) -> None:
        if getattr(self, "_prof", None) is not None:
            self.stop()
            self.start()

    def clear(self) -> None:
        self._sync()
        list.clear(self)

    def __eq__(self, other):
        self._sync()
        return list.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    __hash__ = None

    def __len__(self):
        self._sync()
        return list.__len__(self)

    def __iter__(self):
        self._sync()
        return list.__iter__(self)

    def __contains__(self, item):
        self._sync()
        return list.__contains__(self, item)

    def __getitem__(self, index):
        self._sync()
        return list.__getitem__(self, index)

    def __repr__(self):
        self._sync()
        return list.__repr__(self)

    def count(self, item) -> int:
        self._sync()
        return list.count(self, item)

    def index(self, *args) -> int:
        self._sync()
        return list.index(self, *args)


def init_args(number: int, in_f: int, out_f: int, scale_shape=None, *, eps: float = 1e-5,
              momentum: Optional[float] = 0.1) -> list:
    """Positional __init__ arguments of problem ``number``'s Model."""
    if number == 84:
        return [in_f, out_f, eps, momentum, scale_shape if scale_shape is not None else (1,)]
    return [in_f, out_f, scale_shape if scale_shape is not None else (out_f,), eps, momentum]


def scales(number: int, model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(pre_scale, post_scale) of the fold for this problem's model."""
    return (None, model.scale) if number == 84 else (model.scale, None)


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 1) -> nn.Module:
    """Non-default BN affine/running stats and scale, so a swapped term cannot pass."""
    g = torch.Generator().manual_seed(seed)

    def like(t, lo, hi):
        return (torch.rand(t.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(t)

    model.bn.weight.copy_(like(model.bn.weight, 0.5, 1.5))
    model.bn.bias.copy_(like(model.bn.bias, -0.5, 0.5))
    model.bn.running_mean.copy_(like(model.bn.running_mean, -0.3, 0.3))
    model.bn.running_var.copy_(like(model.bn.running_var, 0.5, 2.0))
    model.scale.copy_(like(model.scale, 0.5, 2.0))
    return model


def make_pair(number: int, args: list, *, seed: int = 0, randomize: bool = True,
              precision: Optional[str] = None) -> tuple[nn.Module, nn.Module]:
    """(Model, ModelNew) from the same seed, ModelNew loaded with Model's state."""
    module: ModuleType = PROBLEMS[number]
    torch.manual_seed(seed)
    ref = module.Model(*args)
    if randomize:
        randomize_(ref)
    torch.manual_seed(seed)
    new = module.ModelNew(*args, precision=precision)
    new.load_state_dict(ref.state_dict())
    return ref, new


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Frobenius-norm relative error in float64; inf when shapes differ or actual is not finite."""
    e = expected.detach().double()
    a = actual.detach().to(e.device, torch.float64)
    if a.shape != e.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-300)).item()


def float64_twin(model: nn.Module) -> nn.Module:
    """A float64 copy of a Model (holding the same, already-rounded values): the oracle."""
    return copy.deepcopy(model).double()


# Bounds on the Frobenius relative error against the float64 oracle, per dtype / fp32
# precision. The oracle sees the same (rounded) inputs and parameters, so these measure
# accumulation and output rounding only.
# 3xtf32 is held to twice the IEEE bound: the bar for an fp32-accurate tensor-core mode.
ORACLE_TOL = {"ieee": 2e-5, "3xtf32": 4e-5, "tf32": 3e-3, "fp16": 1e-2, "bf16": 2e-2}
DTYPE_OF = {"ieee": torch.float32, "3xtf32": torch.float32, "tf32": torch.float32,
            "fp16": torch.float16, "bf16": torch.bfloat16}


def precision_of(kind: str) -> str:
    """ModelNew's precision argument for a test kind (16-bit kinds: 'ieee', which they ignore)."""
    return kind if kind in ("tf32", "3xtf32") else "ieee"


def long_tests_requested(config) -> bool:
    """Whether the long test variants run: pytest --long or EPIFUSE_LONG_TESTS=1."""
    import os

    return bool(config.getoption("--long", default=False)) or \
        os.environ.get("EPIFUSE_LONG_TESTS", "") not in ("", "0")


def assert_head_grads_close(number: int, training: bool, model: nn.Module, g_new, g_ref,
                            tol: float) -> None:
    """Gradients of [x, *model.parameters()] from ModelNew (g_new) against Model's (g_ref).

    In training, BatchNorm removes gemm.bias (and, up to eps, problem 39's scale, which multiplies
    before it): their true gradients vanish and Model's are rounding noise, so those two are
    compared against the weight gradient's size (tests/test_backward.py holds every gradient
    to float64).
    """
    names = ["x"] + [n for n, _ in model.named_parameters()]
    vanishing = ({"gemm.bias"} | ({"scale"} if number == 39 else set())) if training else set()
    g_weight = dict(zip(names, g_ref))["gemm.weight"]
    for name, a, b in zip(names, g_new, g_ref, strict=True):
        err = ((a - b).norm() / g_weight.norm()).item() if name in vanishing else rel_err(a, b)
        assert err <= tol, (name, err)


def graph_node_names(y: torch.Tensor) -> list[str]:
    """The names of the autograd nodes in y's graph, each node once."""
    seen, stack = set(), [y.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(f for f, _ in fn.next_functions)
    return [fn.name() for fn in seen]


def fused_nodes(y: torch.Tensor) -> int:
    """How many fused-head autograd nodes (FUSED_NODE) y's graph holds: the heads that ran fused."""
    return graph_node_names(y).count(FUSED_NODE)


def float64_errors(model: nn.Module, twin: nn.Module, x: torch.Tensor, grad: torch.Tensor, *,
                   name_of=lambda name: name, bias_cancels: bool = False,
                   autocast: Optional[torch.dtype] = None):
    """(output, {name: relative error}) of a head's output, dX and every parameter gradient
    against ``twin``, its float64 copy; errors are keyed by ``name_of(parameter name)`` (one
    naming for a fused head and the unfused modules). ``bias_cancels``: the head normalizes with batch statistics, whose mean cancels the
    Linear bias, so that bias's gradient is 0 and its error is measured against the scale of the
    weight's gradient instead of its own (rounding noise). ``autocast``: the model's forward runs
    under torch.autocast to that dtype."""
    xs = [x.clone().requires_grad_(), x.double().requires_grad_()]
    with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = model(xs[0])
    y64 = twin(xs[1])
    y.backward(grad.to(y.dtype)), y64.backward(grad.double())
    errors = {"out": rel_err(y, y64), "dx": rel_err(xs[0].grad, xs[1].grad)}
    twin_params = {name_of(n): q for n, q in twin.named_parameters()}
    params = {name_of(n): p for n, p in model.named_parameters()}
    assert set(twin_params) == set(params)
    for name, p in params.items():
        q = twin_params[name]
        if name == "gemm.bias" and bias_cancels:
            scale = twin_params["gemm.weight"].grad.norm()
            errors[name] = ((p.grad.double() - q.grad).norm() / scale).item()
        else:
            errors[name] = rel_err(p.grad, q.grad)
    return y, errors


def assert_no_farther_from_float64_than_eager(ref: nn.Module, new: nn.Module, x: torch.Tensor,
                                              grad: torch.Tensor, same_state, **kw) -> None:
    """The fused head ``new`` (its fused backward asserted) against the unfused ``ref`` built from
    the same modules: output and every gradient no farther from float64 than eager's (1.25x +
    1e-6), running statistics as ``ref``'s (``same_state(new, ref)``), and the no-grad path too.
    ``kw``: float64_errors's (name_of, bias_cancels, autocast)."""
    twin = copy.deepcopy(ref).double()
    twin_again = copy.deepcopy(twin)  # the first twin's running statistics move once
    y_new, err_new = float64_errors(new, twin, x, grad, **kw)
    assert y_new.grad_fn.name() == FUSED_NODE
    y_ref, err_eager = float64_errors(ref, twin_again, x, grad, **kw)
    assert y_new.dtype == y_ref.dtype
    for name, e in err_new.items():
        assert e <= 1.25 * err_eager[name] + 1e-6, (name, err_new, err_eager)
    same_state(new, ref)
    autocast = kw.get("autocast")
    with torch.no_grad(), torch.autocast("cuda", dtype=autocast or torch.bfloat16,
                                         enabled=autocast is not None):
        y_new, y_ref = new(x), ref(x)  # the in-place path (no autograd)
    y64 = twin_again(x.double())
    assert y_new.dtype == y_ref.dtype
    assert rel_err(y_new, y64) <= 1.25 * rel_err(y_ref, y64) + 1e-6


@contextlib.contextmanager
def one_rank_group(tmp_path, backend: str):
    """A process group of this process alone, on ``backend``; yields its group_name, which the
    synchronized-statistics hooks take."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
