"""A fused model's training step captured in CUDA graphs, as a user captures one:
``torch.compile(model, mode="reduce-overhead")`` and ``torch.cuda.make_graphed_callables``.

The model is a real one (benchmarks.real_heads: the MoCo v3 projection MLP and the classifier,
small dims) fused by ``epifuse.fuse(strict=True)``, so a head that cannot run fused raises instead
of running its modules. Each step (forward, loss, backward, SGD with momentum) is compared with
the same fused model's uncaptured step on the same batch: outputs, x's gradient, the parameters
after the optimizer and the running statistics. They run the same kernels, so they agree to the
column-statistics atomics' ordering.

What shows the fused ops inside the capture:
- reduce-overhead: the code Inductor generated calls ``epifuse.fused_head`` once per head in the
  forward and the head's backward once per head in the backward (``fused_head_backward`` where
  the backward is traced with create_graph, else the stepwise backward, whose
  ``head_grad_coefficients`` every fused backward runs), no graph was skipped (Inductor's ``cudagraph_skips`` counter) and the CUDA-graph tree
  recorded the forward and the backward;
- make_graphed_callables: its warm-up and capture calls ran one ``fused_head`` and one
  ``head_grad_coefficients`` per head each (strict heads: no fallback).
"""

from __future__ import annotations

import copy

import pytest
import torch

import epifuse
from benchmarks.real_heads import build_model
from helpers import ops_run

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
DIMS = (256, 512, 128)
BATCH = 64
STEPS = 5  # reduce-overhead: warm-up, recording, then replays
HEADS = {"projection": 3, "classifier": 2}
# The captured and the uncaptured step run the same kernels; only the column statistics' atomics
# may add in another order (and Inductor's loss kernel sums in its own order).
TOL = {"fp32": dict(rtol=1e-5, atol=1e-6), "amp-bf16": dict(rtol=2e-2, atol=1e-3)}


def _autocast(setting: str, **kwargs):
    return torch.autocast("cuda", torch.bfloat16, enabled=setting == "amp-bf16", **kwargs)


def _models(name: str):
    torch.manual_seed(0)
    base = build_model(name, DIMS, bias=name == "classifier").to(CUDA).train()
    return (epifuse.fuse(copy.deepcopy(base), strict=True)[0],
            epifuse.fuse(copy.deepcopy(base), strict=True)[0])


def _batches(n: int):
    gen = torch.Generator(device=CUDA).manual_seed(1)
    return [(torch.randn(BATCH, DIMS[0], device=CUDA, generator=gen),
             torch.randn(BATCH, DIMS[2], device=CUDA, generator=gen) / BATCH) for _ in range(n)]


def _step(forward, optimizer, x, g, setting: str, **autocast_kwargs):
    """One training step; (output, x's gradient), cloned (a CUDA-graph output is overwritten by
    the next replay)."""
    optimizer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with _autocast(setting, **autocast_kwargs):
        y = forward(x)
    (y.float() * g).sum().backward()
    optimizer.step()
    return y.detach().clone(), x.grad.clone()


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _assert_same_state(captured, uncaptured, tol):
    for (name, a), b in zip(captured.state_dict().items(), uncaptured.state_dict().values()):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


def _recorded_graphs() -> int:
    """CUDA graphs the cudagraph-tree manager of this device recorded (forward and backward nodes
    of every compiled function)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(CUDA.index or 0, create_if_none_exists=False)
    if manager is None:
        return 0
    count, todo = 0, [n for nodes in manager.roots.values() for n in nodes]
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(c for children in node.children.values() for c in children)
    return count


@pytest.mark.parametrize("setting", ["fp32", "amp-bf16"])
@pytest.mark.parametrize("name", ["projection", "classifier"])
def test_reduce_overhead_training_step_is_the_uncaptured_one(name, setting):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    uncaptured, model = _models(name)
    compiled = torch.compile(model, mode="reduce-overhead")
    opt_u, opt_c = _sgd(uncaptured), _sgd(model)
    for i, (x, g) in enumerate(_batches(STEPS)):
        expected = _step(uncaptured, opt_u, x, g, setting)
        torch.compiler.cudagraph_mark_step_begin()
        if i == 0:
            got, code = run_and_get_code(_step, compiled, opt_c, x, g, setting)
            code = "\n".join(code)
            assert code.count("torch.ops.epifuse.fused_head.default(") == HEADS[name], code
            backward = (code.count("torch.ops.epifuse.fused_head_backward.default(")
                        + code.count("torch.ops.epifuse.head_grad_coefficients.default("))
            assert backward == HEADS[name], code
        else:
            got = _step(compiled, opt_c, x, g, setting)
        for a, b, what in zip(got, expected, ("output", "x.grad")):
            torch.testing.assert_close(a, b, **TOL[setting], msg=lambda m: f"step {i} {what}: {m}")
    _assert_same_state(model, uncaptured, TOL[setting])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert _recorded_graphs() >= 2  # the forward and the backward


@pytest.mark.parametrize("setting", ["fp32", "amp-bf16"])
@pytest.mark.parametrize("name", ["projection", "classifier"])
def test_make_graphed_callables_training_step_is_the_uncaptured_one(name, setting):
    uncaptured, model = _models(name)
    buffers = [b.clone() for b in model.buffers()]
    sample = torch.randn(BATCH, DIMS[0], device=CUDA, requires_grad=True)
    graphed = []
    # Autocast's weight-cast cache must be off while capturing (torch.cuda.graphs says so).
    with _autocast(setting, cache_enabled=False):
        names = ops_run(lambda: graphed.append(
            torch.cuda.make_graphed_callables(model, (sample,), num_warmup_iters=3)), "epifuse::")
    # Three warm-up calls and the capture, each a forward and a backward through every head.
    assert names.count("epifuse::fused_head") >= 4 * HEADS[name], names
    assert names.count("epifuse::head_grad_coefficients") == 4 * HEADS[name], names
    # The warm-up updated the running statistics: back to where the uncaptured twin is.
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    graphed = graphed[0]
    opt_u, opt_g = _sgd(uncaptured), _sgd(model)
    for i, (x, g) in enumerate(_batches(STEPS)):
        expected = _step(uncaptured, opt_u, x, g, setting, cache_enabled=False)
        got = _step(graphed, opt_g, x, g, setting, cache_enabled=False)
        for a, b, what in zip(got, expected, ("output", "x.grad")):
            torch.testing.assert_close(a, b, **TOL[setting], msg=lambda m: f"step {i} {what}: {m}")
    _assert_same_state(model, uncaptured, TOL[setting])
