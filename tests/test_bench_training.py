"""The benchmark's training step and host-time measurement (epifuse.bench), CPU only."""

from __future__ import annotations

import pytest
import torch

from epifuse.bench import hosttime, models, runner, training
from epifuse.bench.configs import DTYPES, Case, Shape

SHAPE = Shape(84, 16, 64, 32, "kb-small")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def state():
    return models.base_state(SHAPE, CPU)


def _pairs(count=2):
    return training.make_step_inputs(SHAPE, torch.float32, CPU, count, seed=7)


def test_step_inputs_need_grad_and_have_an_output_shaped_gradient():
    (x, g), = _pairs(1)
    assert x.requires_grad and not g.requires_grad
    assert g.shape == (SHAPE.m, SHAPE.n) and g.std() > 0.5  # N(0, 1), not all ones
    assert training.step_bytes(SHAPE, 4) == (16 * 64 + 16 * 32) * 4


def test_a_step_trains_and_starts_from_fresh_gradients(state):
    """Two steps leave the gradients of the second alone: set to None, not accumulated."""
    model = models.build(SHAPE, state, new=False, dtype=torch.float32, device=CPU,
                         mode="train-step")
    assert model.training
    pairs = _pairs(2)
    step = training.make_step(model, model)
    step(pairs[1])
    tracked = model.bn.num_batches_tracked.item()
    step(pairs[0])
    assert model.bn.num_batches_tracked.item() == tracked + 1  # a training-mode forward
    got = {k: v.clone() for k, v in training.gradients(model, pairs[0][0]).items()}

    fresh = models.build(SHAPE, state, new=False, dtype=torch.float32, device=CPU,
                         mode="train-step")
    x = pairs[0][0].detach().clone().requires_grad_()
    fresh(x).backward(pairs[0][1])
    torch.testing.assert_close(got["dx"], x.grad)
    torch.testing.assert_close(got["dw"], fresh.gemm.weight.grad)


def test_gradient_accuracy_against_float64(state):
    case = Case(SHAPE, DTYPES["fp32-ieee"], "train-step", compile=False, gemm_alone=False)
    result = runner.CaseResult(case)
    runner._accuracy(case, state, CPU, result, print, verbose=True)
    assert not result.failures
    assert set(result.accuracy) == {f"{i}:{g}" for i in ("ours", "eager") for g in ("dx", "dw")}
    for stats in result.accuracy.values():
        assert stats.finite and stats.rel_fro < 1e-5


def test_gradient_check_catches_a_wrong_gradient(state):
    """step_errors compares against the reference it is given: a wrong one shows."""
    model = models.build(SHAPE, state, new=True, dtype=torch.float32, device=CPU,
                         mode="train-step")
    pair = _pairs(1)[0]
    ref = training.reference_gradients(SHAPE, state, pair, dtype=torch.float32, device=CPU,
                                       mode="train-step")
    good = training.step_errors(model, pair, ref)
    bad = training.step_errors(model, pair, {k: 2 * v for k, v in ref.items()})
    assert good["dx"].rel_fro < 1e-5 and bad["dx"].rel_fro == pytest.approx(0.5, rel=1e-4)


def test_run_case_times_a_train_step(state):
    from epifuse.bench.timing import TimingSettings

    case = Case(SHAPE, DTYPES["fp32-ieee"], "train-step", compile=False, gemm_alone=False,
                compile_note="not run (--no-compile)")
    r = runner.run_case(case, state, CPU, TimingSettings(warmup=1, iters=2, max_seconds=0.1),
                        runner.KBReference(), print)
    assert set(r.timings) == {"ours", "eager"} and r.kb_reference_ms == r.ms("eager")
    assert "gemm" not in r.timings and r.to_dict()["flops"] == 3 * SHAPE.flops


def test_host_time_counts_every_call():
    calls = []
    settings = hosttime.HostSettings(warmup=2, rounds=3, calls=4)
    t = hosttime.measure_host(lambda: calls.append(1), CPU, settings)
    assert len(calls) == 2 + 4 + 3 * 4  # warm-up, sizing round, timed rounds
    assert t.calls == 12 and t.gpu_kept_busy is None and 0 < t.min_us <= t.median_us


def test_host_point_times_ours_and_eager(state):
    from epifuse.bench.configs import HostPoint

    r = hosttime.run_host_point(HostPoint(SHAPE, DTYPES["bf16"], "eval"), state, CPU,
                                hosttime.HostSettings(warmup=1, rounds=1, calls=3), print)
    assert set(r.timings) == {"ours", "eager"} and r.ratio() > 0 and not r.failures


@pytest.mark.gpu
def test_host_time_keeps_the_gpu_busy_and_flags_a_synchronizing_call():
    """The method's premise: calls that only queue kernels stay behind the spin kernel; a
    call that waits for the GPU is reported as such, not silently timed as host time."""
    cuda = torch.device("cuda")
    x = torch.randn(128, 1024, device=cuda)
    w = torch.randn(512, 1024, device=cuda)
    settings = hosttime.HostSettings(warmup=3, rounds=2, calls=20)
    queued = hosttime.measure_host(lambda: torch.mm(x, w.t()), cuda, settings)
    assert queued.gpu_kept_busy is True and queued.median_us < 1000
    waits = hosttime.measure_host(lambda: torch.mm(x, w.t()).sum().item(), cuda, settings)
    assert waits.gpu_kept_busy is False


def test_measure_rounds_interleaves_and_isolates_a_failure():
    """Every implementation runs its share of calls in each round, in turn; one that raises
    reports its exception and the others still get their timings."""
    from epifuse.bench.timing import Timing, TimingSettings, measure_rounds

    calls = []

    def impl(name, fail_after=None):
        def fn(x):
            if fail_after is not None and calls.count(name) >= fail_after:
                raise RuntimeError(f"{name} broke")
            calls.append(name)
        return fn

    settings = TimingSettings(warmup=1, iters=6, max_seconds=10.0, min_iters=1)
    fns = {"a": impl("a"), "b": impl("b"), "c": impl("c", fail_after=4)}
    r = measure_rounds(fns, [0, 1], CPU, settings, rounds=3)
    assert list(r) == ["a", "b", "c"]
    assert isinstance(r["a"], Timing) and r["a"].iters == 6 and r["b"].iters == 6
    assert isinstance(r["c"], RuntimeError) and "c broke" in str(r["c"])
    # first call + warm-up per implementation, then rounds of two calls each, interleaved
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert calls[6:14] == ["a", "a", "b", "b", "c", "c", "a", "a"]
    assert calls[14:] == ["b", "b", "a", "a", "b", "b"]


def test_host_point_is_measured_again_while_the_gpu_went_idle(monkeypatch):
    """An idle GPU invalidates a host-time measurement: it is repeated, at most 3 times in all."""
    results = iter([False, False, True, True])
    seen = []

    def fake(fn, device, settings):
        seen.append(1)
        return hosttime.HostTiming(median_us=1.0, min_us=1.0, mean_us=1.0, calls=1,
                                   gpu_kept_busy=next(results))

    monkeypatch.setattr(hosttime, "measure_host", fake)
    assert hosttime.measure_host_checked(lambda: None, CPU).gpu_kept_busy is True
    assert len(seen) == 3
    seen.clear()
    results = iter([False] * 5)
    assert hosttime.measure_host_checked(lambda: None, CPU).gpu_kept_busy is False
    assert len(seen) == 3
