"""ModelNew's forward captured in a CUDA graph and replayed == eager ModelNew, step by step.

Training replays must update running_mean / running_var / num_batches_tracked exactly
as eager steps do (the fold kernel reads and bumps num_batches_tracked on the device, so
momentum=None works too). Procedure (torch.cuda.graph's documented recipe):
  1. snapshot the buffers; warm up on a side stream (this updates the running stats);
  2. restore the buffers in place (same storage the graph will read and write);
  3. capture one forward on a static input;
  4. for each step: copy a new batch into the static input, replay, clone the output;
     the eager twin (a deepcopy taken before warm-up) runs the same batch eagerly.
Outputs are compared each step, buffers after the last one; Model (the reference) runs
the same steps eagerly as a sanity bound. Eval additionally changes the running stats
between replays: the graph must read them live, not bake them in.
"""

from __future__ import annotations

import copy

import pytest
import torch

from epifuse import head
from helpers import DTYPE_OF, ORACLE_TOL, init_args, make_pair, rel_err

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
STEPS = 4
# Graph replay vs eager ModelNew: the same kernels on the same data. Only the order of the
# column-statistics atomics may differ, so fp32 agrees to rounding and 16-bit to an ulp.
SAME_TOL = {"ieee": 1e-5, "tf32": 1e-5, "bf16": 1e-2, "fp16": 2e-3}


def _models(number, kind, in_f, out_f, momentum, scale_n):
    args = init_args(number, in_f, out_f, (out_f,) if scale_n else (1,), momentum=momentum)
    ref, new = make_pair(number, args, precision="tf32" if kind == "tf32" else "ieee")
    dtype = DTYPE_OF[kind]
    ref, new = ref.to(CUDA, dtype), new.to(CUDA, dtype)
    return ref, new, copy.deepcopy(new)


def _buffers(model):
    return [model.bn.running_mean, model.bn.running_var, model.bn.num_batches_tracked]


def _capture(model, x_static, warmup=3):
    """Warm up on a side stream, restore the buffers, capture one forward; (graph, output)."""
    snapshot = [b.clone() for b in _buffers(model)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            model(x_static)
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        for b, s in zip(_buffers(model), snapshot):
            b.copy_(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = model(x_static)
    torch.cuda.synchronize()
    # Capturing records kernels without running them: the buffers are still the snapshot.
    for b, s in zip(_buffers(model), snapshot):
        assert torch.equal(b, s), "capture changed the running statistics"
    return graph, y_static


def _batches(m, k, dtype, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return [(torch.rand(m, k, device=CUDA, generator=g) + 0.1 * i).to(dtype)
            for i in range(STEPS)]


# (M, K, N): small = ragged tiles (M, N not multiples of 128), few tiles -> stream-K kernels;
# big = more tiles than SMs -> the data-parallel kernels. All TMA-aligned (fused, not SIMT).
SMALL, BIG = (300, 256, 264), (2304, 256, 2048)
CASES = [pytest.param(n, kind, mom, scale_n, SMALL,
                      id=f"p{n}-{kind}-mom{mom}-scale{'N' if scale_n else 1}")
         for n in (84, 39) for kind in ("tf32", "bf16", "ieee")
         for mom, scale_n in ((0.1, n == 39), (None, n == 84))]
CASES += [pytest.param(n, "bf16", 0.1, n == 39, BIG, id=f"p{n}-bf16-big") for n in (84, 39)]


@pytest.mark.parametrize("number,kind,momentum,scale_n,size", CASES)
def test_graph_replay_training(number, kind, momentum, scale_n, size):
    m, k, n = size
    ref, new, eager = _models(number, kind, k, n, momentum, scale_n)
    initial_mean = new.bn.running_mean.clone()
    ref.train(), new.train(), eager.train()
    xs = _batches(m, k, DTYPE_OF[kind])
    x_static = torch.zeros_like(xs[0])
    assert head.fast_path_reason(new, x_static) is None
    with torch.no_grad():
        graph, y_static = _capture(new, x_static)
        for step, x in enumerate(xs):
            x_static.copy_(x)
            graph.replay()
            y_graph = y_static.clone()
            y_eager, y_ref = eager(x), ref(x)
            assert rel_err(y_graph, y_eager) <= SAME_TOL[kind], f"step {step}: graph != eager"
            assert rel_err(y_graph, y_ref) <= 2 * ORACLE_TOL[kind], f"step {step}: graph != Model"
    torch.cuda.synchronize()
    assert new.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == STEPS
    assert ref.bn.num_batches_tracked.item() == STEPS
    for name in ("running_mean", "running_var"):
        got, want = getattr(new.bn, name), getattr(eager.bn, name)
        assert rel_err(got, want) <= SAME_TOL[kind], f"{name}: graph != eager"
        assert rel_err(got, getattr(ref.bn, name)) <= 2 * ORACLE_TOL[kind], f"{name} != Model"
    # The premise of the comparison: the replays did move the statistics.
    assert rel_err(new.bn.running_mean, initial_mean) > 10 * SAME_TOL[kind]


EVAL_CASES = [pytest.param(n, kind, (257, 128, 392), id=f"p{n}-{kind}")
              for n in (84, 39) for kind in ("tf32", "bf16", "ieee")]
EVAL_CASES += [pytest.param(n, "bf16", BIG, id=f"p{n}-bf16-big") for n in (84, 39)]


@pytest.mark.parametrize("number,kind,size", EVAL_CASES)
def test_graph_replay_eval(number, kind, size):
    m, k, n = size
    ref, new, eager = _models(number, kind, k, n, 0.1, number == 39)
    ref.eval(), new.eval(), eager.eval()
    xs = _batches(m, k, DTYPE_OF[kind], seed=1)
    x_static = torch.zeros_like(xs[0])
    assert head.fast_path_reason(new, x_static) is None
    g = torch.Generator(device=CUDA).manual_seed(2)
    with torch.no_grad():
        graph, y_static = _capture(new, x_static)
        for step, x in enumerate(xs):
            x_static.copy_(x)
            graph.replay()
            y_graph = y_static.clone()
            y_eager, y_ref = eager(x), ref(x)
            assert rel_err(y_graph, y_eager) <= SAME_TOL[kind], f"step {step}: graph != eager"
            assert rel_err(y_graph, y_ref) <= 2 * ORACLE_TOL[kind], f"step {step}: graph != Model"
            # Move the running statistics in place on all three: the graph must follow.
            shift = (torch.rand(n, device=CUDA, generator=g) - 0.5).to(DTYPE_OF[kind])
            for model in (new, eager, ref):
                model.bn.running_mean.add_(shift)
                model.bn.running_var.mul_(1.5)
    for model in (new, eager):
        assert model.bn.num_batches_tracked.item() == 0


def test_graph_replay_with_autograd_enabled():
    """Capturing with grad enabled goes through the autograd Function's forward; replays agree."""
    _, new, eager = _models(84, "ieee", 64, 72, 0.1, False)
    new.train(), eager.train()
    xs = _batches(96, 64, torch.float32, seed=3)
    x_static = torch.zeros_like(xs[0])
    graph, y_static = _capture(new, x_static)
    assert y_static.requires_grad
    for x in xs:
        x_static.copy_(x)
        graph.replay()
        assert rel_err(y_static, eager(x)) <= SAME_TOL["ieee"]
    assert new.bn.num_batches_tracked.item() == STEPS
    assert rel_err(new.bn.running_var, eager.bn.running_var) <= SAME_TOL["ieee"]
