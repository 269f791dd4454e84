"""How the benchmark measures (benchmarks.timing, benchmarks.cases): training steps, errors
against float64, interleaved rounds, host time; CPU only except where marked."""

from __future__ import annotations

import pytest
import torch

from benchmarks import cases, timing
from benchmarks.cases import DTYPES, TRAIN_STEP, Case, Runner, Shape

SHAPE = Shape(84, 16, 64, 32, "kb-small")
CPU = torch.device("cpu")
STEP = Case(SHAPE, DTYPES["fp32-ieee"], TRAIN_STEP, compile_note="not run (--no-compile)")


@pytest.fixture(scope="module")
def state():
    return cases.base_state(SHAPE, CPU)


def _pairs(count=2):
    return cases.make_inputs(STEP, CPU, count, seed=7)


def test_step_inputs_need_grad_and_have_an_output_shaped_gradient():
    (x, g), = _pairs(1)
    assert x.requires_grad and not g.requires_grad
    assert g.shape == (SHAPE.m, SHAPE.n) and g.std() > 0.5  # N(0, 1), not all ones
    assert cases.input_bytes(STEP) == (16 * 64 + 16 * 32) * 4
    assert cases.input_bytes(Case(SHAPE, DTYPES["bf16"], "eval")) == 16 * 64 * 2


def test_models_share_the_seeded_state_with_primed_running_statistics(state):
    assert state["bn.num_batches_tracked"].item() == 1
    assert not torch.allclose(state["bn.running_var"], torch.ones(SHAPE.n))
    ours = cases.build(Case(SHAPE, DTYPES["bf16"], "eval"), state, CPU, new=True)
    eager = cases.build(Case(SHAPE, DTYPES["bf16"], "eval"), state, CPU, new=False)
    assert not ours.training and ours.gemm.weight.dtype == torch.bfloat16
    torch.testing.assert_close(ours.gemm.weight, eager.gemm.weight, rtol=0, atol=0)
    assert type(ours).__name__ == "ModelNew" and type(eager).__name__ == "Model"


def test_a_step_trains_and_starts_from_fresh_gradients(state):
    """Two steps leave the gradients of the second alone: set to None, not accumulated."""
    model = cases.build(STEP, state, CPU, new=False)
    assert model.training
    pairs = _pairs(2)
    step = cases.make_step(model, model)
    step(pairs[1])
    tracked = model.bn.num_batches_tracked.item()
    step(pairs[0])
    assert model.bn.num_batches_tracked.item() == tracked + 1  # a training-mode forward
    got = {"dx": pairs[0][0].grad.clone(), "dw": model.gemm.weight.grad.clone()}

    fresh = cases.build(STEP, state, CPU, new=False)
    x = pairs[0][0].detach().clone().requires_grad_()
    fresh(x).backward(pairs[0][1])
    torch.testing.assert_close(got["dx"], x.grad)
    torch.testing.assert_close(got["dw"], fresh.gemm.weight.grad)


def test_gradient_check_catches_a_wrong_gradient(state):
    """errors() compares against the reference it is given: a wrong one shows."""
    model = cases.build(STEP, state, CPU, new=True)
    pair = _pairs(1)[0]
    ref = cases.reference64(STEP, state, CPU, pair)
    good = cases.errors(model, pair, ref)
    bad = cases.errors(model, pair, {k: 2 * v for k, v in ref.items()})
    assert good["dx"]["rel_fro"] < 1e-5 and bad["dx"]["rel_fro"] == pytest.approx(0.5, rel=1e-4)


def test_error_stats_flags_non_finite_and_shape_mismatch():
    ref = torch.ones(2, 3, dtype=torch.float64)
    assert cases.error_stats(torch.full((2, 3), float("nan")), ref)["finite"] is False
    assert cases.error_stats(torch.ones(2, 3), ref) == {"rel_fro": 0.0, "max_abs": 0.0,
                                                         "finite": True}
    with pytest.raises(ValueError):
        cases.error_stats(torch.ones(3, 2), ref)


def test_run_case_times_a_train_step_and_checks_its_gradients(state):
    runner = Runner(CPU, timing.Settings(warmup=1, iters=2, max_seconds=0.1), print)
    r = runner.run_case(STEP, state)
    assert set(r["timings_ms"]) == {"ours", "eager"} and not r["failures"].keys() - {"compile"}
    assert r["kb_reference_ms"] == r["timings_ms"]["eager"]["median_ms"]
    assert "gemm" not in r["timings_ms"] and r["flops"] == 3 * SHAPE.flops
    assert set(r["errors_vs_fp64"]) == {f"{i}:{g}" for i in ("ours", "eager") for g in ("dx", "dw")}
    for stats in r["errors_vs_fp64"].values():
        assert stats["finite"] and stats["rel_fro"] < 1e-5


def test_run_case_forward_times_the_gemm_alone_and_the_kernelbench_reference(state):
    case = Case(Shape(84, 16, 64, 32, "kernelbench"), DTYPES["bf16"], "train", gemm_alone=True,
                compile_note="not run (--no-compile)")
    runner = Runner(CPU, timing.Settings(warmup=1, iters=2, max_seconds=0.1), print)
    r = runner.run_case(case, state)
    assert set(r["timings_ms"]) == {"ours", "eager", "gemm", "torch_mm"}
    assert r["gemm_op"] == "gemm_colstats" and r["failures"] == {"compile": case.compile_note}
    assert set(r["errors_vs_fp64"]) == {"ours", "eager"} and r["kb_reference_ms"] > 0
    assert r["path"] and r["path"] != "fused"  # the CPU: ModelNew's reference path, and why


def test_a_failing_implementation_is_a_table_entry(state, monkeypatch):
    runner = Runner(CPU, timing.Settings(warmup=1, iters=2, max_seconds=0.1), lambda m: None)
    real = Runner._callables

    def broken(self, case, state, impls):  # ours cannot be built; eager can
        fns = real(self, case, state, impls)
        return dict(fns, ours=RuntimeError("no kernel for this")) if "ours" in fns else fns

    monkeypatch.setattr(Runner, "_callables", broken)
    r = runner.run_case(Case(SHAPE, DTYPES["bf16"], "eval"), state)
    assert "ours" not in r["timings_ms"] and "eager" in r["timings_ms"]
    assert r["failures"]["ours"] == "RuntimeError: no kernel for this"
    assert set(r["errors_vs_fp64"]) == {"ours", "eager"}


def test_host_time_counts_every_call():
    calls = []
    t = timing.measure_host(lambda: calls.append(1), CPU, warmup=2, rounds=3, calls=4)
    assert len(calls) == 2 + 4 + 3 * 4  # warm-up, sizing round, timed rounds
    assert t["calls"] == 12 and t["gpu_kept_busy"] is None and 0 < t["min_us"] <= t["median_us"]


def test_host_point_times_ours_and_eager(state):
    runner = Runner(CPU, timing.Settings(), print)
    r = runner.host_point(Case(SHAPE, DTYPES["bf16"], "eval"), state)
    assert set(r["timings_us"]) == {"ours", "eager"} and not r["failures"]
    assert r["timings_us"]["ours"]["calls"] == 200


@pytest.mark.gpu
def test_host_time_keeps_the_gpu_busy_and_flags_a_synchronizing_call():
    """The method's premise: calls that only queue kernels stay behind the spin kernel; a
    call that waits for the GPU is reported as such, not silently timed as host time."""
    cuda = torch.device("cuda")
    x = torch.randn(128, 1024, device=cuda)
    w = torch.randn(512, 1024, device=cuda)
    queued = timing.measure_host(lambda: torch.mm(x, w.t()), cuda, warmup=3, rounds=2, calls=20)
    assert queued["gpu_kept_busy"] is True and queued["median_us"] < 1000
    waits = timing.measure_host(lambda: torch.mm(x, w.t()).sum().item(), cuda, warmup=3,
                                rounds=2, calls=20)
    assert waits["gpu_kept_busy"] is False


@pytest.mark.gpu
def test_l2_flush_is_larger_than_l2_and_timings_stay_positive():
    cuda = torch.device("cuda")
    flush = timing.l2_flush(cuda)
    assert flush.numel() >= 2 * torch.cuda.get_device_properties(cuda).L2_cache_size
    x = torch.randn(1024, 1024, device=cuda)
    m = timing.measure(lambda t: torch.softmax(t, dim=-1), [x], cuda,
                       timing.Settings(warmup=2, iters=5), flush=flush)
    assert len(m.times) == 5 and m.median > 0


def test_no_l2_flush_on_the_cpu():
    assert timing.l2_flush(CPU) is None


def test_measure_rounds_interleaves_and_isolates_a_failure():
    """Every implementation runs its share of calls in each round, in turn; one that raises
    reports its exception and the others still get their timings."""
    calls = []

    def impl(name, fail_after=None):
        def fn(x):
            if fail_after is not None and calls.count(name) >= fail_after:
                raise RuntimeError(f"{name} broke")
            calls.append(name)
        return fn

    settings = timing.Settings(warmup=1, iters=6, max_seconds=10.0, min_iters=1)
    fns = {"a": impl("a"), "b": impl("b"), "c": impl("c", fail_after=4)}
    r = timing.measure_rounds(fns, [0, 1], CPU, settings, rounds=3)
    assert list(r) == ["a", "b", "c"]
    assert isinstance(r["a"], torch.utils.benchmark.Measurement) and len(r["a"].times) == 6
    assert len(r["b"].times) == 6 and r["b"].metadata["n_inputs"] == 2
    assert isinstance(r["c"], RuntimeError) and "c broke" in str(r["c"])
    # first call + warm-up per implementation, then rounds of two calls each, interleaved
    assert calls[:6] == ["a", "a", "b", "b", "c", "c"]
    assert calls[6:14] == ["a", "a", "b", "b", "c", "c", "a", "a"]
    assert calls[14:] == ["b", "b", "a", "a", "b", "b"]
    d = timing.to_dict(r["a"])
    assert d["iters"] == 6 and d["min_ms"] <= d["median_ms"] <= d["max_ms"] and d["warmup"] == 1


def test_slow_calls_get_fewer_iterations_unless_fixed():
    import time

    slow = lambda x: time.sleep(0.02)  # noqa: E731
    few = timing.measure(slow, [0], CPU, timing.Settings(warmup=1, iters=50, max_seconds=0.05))
    assert len(few.times) == 5  # min_iters
    fixed = timing.measure(slow, [0], CPU, timing.Settings.fixed(0, 7))
    assert len(fixed.times) == 7


def test_host_point_is_measured_again_while_the_gpu_went_idle(monkeypatch):
    """An idle GPU invalidates a host-time measurement: it is repeated, at most 3 times in all."""
    results = iter([False, False, True, True])
    seen = []

    def fake(fn, device, **kwargs):
        seen.append(1)
        return {"median_us": 1.0, "gpu_kept_busy": next(results)}

    monkeypatch.setattr(timing, "measure_host", fake)
    assert timing.measure_host_checked(lambda: None, CPU)["gpu_kept_busy"] is True
    assert len(seen) == 3
    seen.clear()
    results = iter([False] * 5)
    assert timing.measure_host_checked(lambda: None, CPU)["gpu_kept_busy"] is False
    assert len(seen) == 3
