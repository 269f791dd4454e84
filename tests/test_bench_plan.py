"""What the benchmark measures (benchmarks.cases.build_plan), CPU only."""

from __future__ import annotations

import pytest

from benchmarks.cases import (DTYPES, HEAD_SOFTMAX_SHAPE, MODES, SOFTMAX_BYTES, SOFTMAX_DTYPES,
                              TRAIN_STEP, Case, build_plan)

PAGE = ["fp32-3xtf32", "fp32-tf32", "amp-bf16", "amp-fp16"]  # BENCHMARKS.md's columns


def _plan(dtypes=None, **overrides):
    kwargs = dict(compile=True, sweep=False, sweep_ms=(), sweep_compile=False, softmax=True,
                  dry=False)
    kwargs.update(overrides)
    return build_plan([84, 39], list(dtypes or DTYPES), list(MODES), **kwargs)


def test_gemm_alone_on_both_kernelbench_shapes():
    alone = {(c.shape.problem, c.shape.tag) for c in _plan().cases if c.gemm_alone}
    assert alone == {(84, "kernelbench"), (39, "kernelbench")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_softmax_at_the_head_shape_and_over_row_lengths(dtype):
    points = [(n, m) for d, n, m in _plan().softmax_points if d == dtype]
    m, n = HEAD_SOFTMAX_SHAPE
    assert points.count((n, m)) == 1, "problem 84's own softmax shape"
    sweep = [p for p in points if p != (n, m)]
    assert [p[0] for p in sweep] == [2 ** i for i in range(6, 17, 2)]
    assert all(pn * pm * SOFTMAX_DTYPES[dtype].itemsize == SOFTMAX_BYTES for pn, pm in sweep)


def test_no_softmax_points_without_softmax():
    assert _plan(softmax=False).softmax_points == []


def test_dry_plan_is_tiny():
    plan = _plan(dry=True)
    assert plan.softmax_points and all(n * m <= 1 << 20 for _, n, m in plan.softmax_points)
    assert all(c.shape.m * c.shape.k <= 1 << 14 for c in plan.cases)


def test_kernelbench_reference_first_for_each_shape_and_mode():
    """Eager fp32 at 'highest' is the KernelBench reference: fp32-ieee's or fp32-3xtf32's."""
    for ref in ("fp32-ieee", "fp32-3xtf32"):
        plan = build_plan([84, 39], ["bf16", "amp-fp16", ref], ["eval", "train"], compile=False,
                          sweep=False, sweep_ms=(), sweep_compile=False, softmax=False, dry=False)
        assert [c.spec.name for c in plan.cases] == [ref, "bf16", "amp-fp16"] * 4
        assert [c.spec.kb_reference for c in plan.cases] == [True, False, False] * 4
    assert not DTYPES["fp32-tf32"].kb_reference and not DTYPES["amp-bf16"].kb_reference


def test_train_step_on_every_fixed_shape_and_dtype_but_not_the_sweep():
    plan = _plan(sweep=True, sweep_ms=(16, 128))
    steps = [c for c in plan.cases if c.mode == TRAIN_STEP]
    fixed = {(c.shape.problem, c.shape.tag) for c in plan.cases if c.shape.tag != "sweep"}
    assert {(c.shape.problem, c.shape.tag, c.spec.name) for c in steps} == {
        (p, t, d) for p, t in fixed for d in DTYPES}
    assert all(c.shape.tag != "sweep" for c in steps), "the sweep is of forwards"
    assert not any(c.gemm_alone for c in steps), "the GEMM alone is a forward kernel"
    assert all(c.compile for c in steps)


def test_sweep_compiles_only_when_asked_and_skips_one_row_training():
    plan = _plan(sweep=True, sweep_ms=(1, 16), softmax=False)
    sweep = [c for c in plan.cases if c.shape.tag == "sweep"]
    assert sweep and not any(c.compile for c in sweep)
    assert all("--sweep-compile" in c.compile_note for c in sweep)
    assert {c.mode for c in sweep if c.skip} == {"train"} and all(
        c.shape.m == 1 for c in sweep if c.skip)
    assert all(c.compile for c in _plan(sweep=True, sweep_ms=(16,), sweep_compile=True).cases)


def test_full_size_plan_size():
    """The count build_plan's docstring budgets for: the page's 24 cases on the 2 KernelBench
    shapes, 8 of them with the GEMM alone (the fp32 columns' forwards: the autocast columns' GEMM
    is the bf16 / fp16 one); every column, 42."""
    plan = _plan(PAGE, softmax=False)
    assert len(plan.cases) == 2 * len(MODES) * len(PAGE) == 24
    assert {(c.shape.problem, c.shape.tag) for c in plan.cases} == {(84, "kernelbench"),
                                                                    (39, "kernelbench")}
    assert sum(c.gemm_alone for c in plan.cases) == 2 * 2 * 2 == 8
    every = _plan(softmax=False)
    assert len(every.cases) == 2 * len(MODES) * len(DTYPES) == 42
    plain = [d for d, spec in DTYPES.items() if spec.autocast is None]
    assert sum(c.gemm_alone for c in every.cases) == 2 * 2 * len(plain) == 20


def test_train_step_is_a_training_mode_and_not_swept():
    plan = build_plan([84], ["bf16"], ["train-step"], compile=False, sweep=True, sweep_ms=(1,),
                      sweep_compile=False, softmax=False, dry=False)
    assert plan.cases and all(c.mode == TRAIN_STEP and c.skip is None for c in plan.cases)
    shape = plan.cases[0].shape
    assert [Case(shape, DTYPES["bf16"], m).training for m in MODES] == [True, False, True]


def test_modes_option_selects_train_step_and_defaults_to_all():
    from benchmarks.__main__ import parse_args

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
    assert {p.shape.tag for p in plan.host_points} == {"kb-small"}
    assert _plan(host_time=False).host_points == []
    no84 = build_plan([39], list(DTYPES), list(MODES), compile=False, sweep=False, sweep_ms=(),
                      sweep_compile=False, softmax=False, dry=False)
    assert no84.host_points == []
    steps_only = build_plan([84], ["bf16"], ["train-step"], compile=False, sweep=False,
                            sweep_ms=(), sweep_compile=False, softmax=False, dry=False)
    assert steps_only.host_points == [], "host time is of forwards"


def test_the_page_plan_fits_its_time_budget():
    """The default GPU run (KernelBench, host time, real heads, softmax; the 2-GPU section apart)
    is estimated well inside the ~8 minutes BENCHMARKS.md's run may take on one H100 / H200."""
    from benchmarks import real_heads
    from benchmarks.cases import EST_FIRST_COMPILE_S, estimate_case_s
    from benchmarks.timing import Settings

    settings = Settings()
    plan = _plan(PAGE)
    heads = real_heads.plan(real_heads.MODELS, PAGE, real_heads.modes_for(MODES), dry=False)
    assert len(heads) == 2 * 4 * 4 + 4 * len(real_heads.LINEAR_MODES)
    total = (EST_FIRST_COMPILE_S + sum(estimate_case_s(c, settings, False) for c in plan.cases)
             + sum(real_heads.estimate_s(c, settings, False) for c in heads)
             + 0.5 * (len(plan.host_points) + len(plan.softmax_points)))
    assert 60 < total < 6 * 60, total
