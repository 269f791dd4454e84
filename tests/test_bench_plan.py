"""What the benchmark measures (epifuse.bench.configs.build_plan), CPU only."""

from __future__ import annotations

import pytest

from epifuse.bench.configs import (DTYPES, HEAD_SOFTMAX_SHAPE, MODES, SOFTMAX_BYTES,
                                   SOFTMAX_TORCH_DTYPES, build_plan)


def _plan(**overrides):
    kwargs = dict(compile=True, sweep=False, sweep_ms=(), sweep_compile=False, softmax=True,
                  dry=False)
    kwargs.update(overrides)
    return build_plan([84, 39], list(DTYPES), list(MODES), **kwargs)


def test_gemm_alone_on_both_kernelbench_shapes():
    plan = _plan()
    alone = {(c.shape.problem, c.shape.tag) for c in plan.cases if c.gemm_alone}
    assert alone == {(84, "kernelbench"), (39, "kernelbench")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_softmax_at_the_head_shape_and_over_row_lengths(dtype):
    points = [p for p in _plan().softmax_points if p.dtype == dtype]
    m, n = HEAD_SOFTMAX_SHAPE
    assert [(p.m, p.n) for p in points].count((m, n)) == 1, "problem 84's own softmax shape"
    esize = SOFTMAX_TORCH_DTYPES[dtype].itemsize
    sweep = [p for p in points if (p.m, p.n) != (m, n)]
    assert [p.n for p in sweep] == [2 ** i for i in range(6, 17)]
    assert all(p.m * p.n * esize == SOFTMAX_BYTES for p in sweep)


def test_no_softmax_points_without_softmax():
    assert _plan(softmax=False).softmax_points == []


def test_dry_plan_is_tiny():
    plan = _plan(dry=True)
    assert all(p.m * p.n <= 1 << 20 for p in plan.softmax_points)


def test_train_step_on_every_fixed_shape_and_dtype_but_not_the_sweep():
    from epifuse.bench.configs import TRAIN_STEP

    plan = _plan(sweep=True, sweep_ms=(16, 128))
    steps = [c for c in plan.cases if c.mode == TRAIN_STEP]
    fixed = {(c.shape.problem, c.shape.tag) for c in plan.cases if c.shape.tag != "sweep"}
    assert {(c.shape.problem, c.shape.tag, c.spec.name) for c in steps} == {
        (p, t, d) for p, t in fixed for d in DTYPES}
    assert all(c.shape.tag != "sweep" for c in steps), "the sweep is of forwards"
    assert not any(c.gemm_alone for c in steps), "the GEMM alone is a forward kernel"
    assert all(c.compile for c in steps)


def test_full_size_plan_size():
    """The count build_plan's docstring budgets for (45 cases, 10 of them with the GEMM alone)."""
    plan = _plan(softmax=False)
    assert len(plan.cases) == 3 * len(MODES) * len(DTYPES) == 45
    assert sum(c.gemm_alone for c in plan.cases) == 2 * 2 * len(DTYPES)


def test_train_step_is_a_training_mode_and_not_swept():
    from epifuse.bench.configs import TRAIN_STEP

    from epifuse.bench.configs import is_training

    plan = build_plan([84], ["bf16"], ["train-step"], compile=False, sweep=True, sweep_ms=(1,),
                      sweep_compile=False, softmax=False, dry=False)
    assert plan.cases and all(c.mode == TRAIN_STEP and c.skip is None for c in plan.cases)
    assert is_training("train") and is_training(TRAIN_STEP) and not is_training("eval")


def test_modes_option_selects_train_step_and_defaults_to_all():
    from epifuse.bench.__main__ import parse_args

    assert parse_args(["--modes", "train-step"]).modes == ["train-step"]
    assert parse_args([]).modes == ["train", "eval", "train-step"]
    with pytest.raises(SystemExit):
        parse_args(["--modes", "backward"])


def test_host_time_at_the_small_shape_per_dtype_and_forward_mode():
    plan = _plan()
    assert {(p.shape.problem, p.shape.m, p.shape.k, p.shape.n) for p in plan.host_points} == {
        (84, 128, 1024, 512)}
    assert [(p.spec.name, p.mode) for p in plan.host_points] == [
        (d, m) for m in ("train", "eval") for d in DTYPES]
    assert _plan(host_time=False).host_points == []
    no84 = build_plan([39], list(DTYPES), list(MODES), compile=False, sweep=False, sweep_ms=(),
                      sweep_compile=False, softmax=False, dry=False)
    assert no84.host_points == []
    steps_only = build_plan([84], ["bf16"], ["train-step"], compile=False, sweep=False,
                            sweep_ms=(), sweep_compile=False, softmax=False, dry=False)
    assert steps_only.host_points == [], "host time is of forwards"
