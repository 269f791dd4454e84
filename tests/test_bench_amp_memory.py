"""The benchmark's autocast columns (amp-bf16, amp-fp16) and its peak-memory columns.

CPU: the plan and the command line select the autocast columns; each call gets an autocast region
of its own and a step's backward runs outside it; steps bump the weights' versions; a CPU dry run
lists the autocast rows in their own sections; the report formats the memory columns. GPU (marked):
a tiny amp-bf16 training step yields finite timings, errors and peak memory for every
implementation, and peak_memory counts what a call allocates.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import __main__ as bench_main, cases, report, timing
from benchmarks.cases import DTYPES, MODES, TRAIN_STEP, Case, Runner, Shape, build_plan, new_row

AMP = ("amp-bf16", "amp-fp16")
CPU = torch.device("cpu")
SHAPE = Shape(84, 16, 64, 32, "kb-small")
GPU = {"device": "cuda:0", "gpu": "H100", "torch": "x", "cuda": "13.0"}
CPU_ENV = {"device": "cpu", "gpu": "none (CPU dry run)", "torch": "x", "cuda": None}
SETTINGS = {"iters": 5, "min_iters": 5, "warmup": 1}


def doc(env, rows) -> dict:
    return {"env": env, "settings": SETTINGS, "cases": list(rows)}


def _plan_for(*argv):
    args = bench_main.parse_args(list(argv))
    return build_plan(args.problems, args.dtypes, args.modes, compile=args.compile, sweep=False,
                      sweep_ms=(), sweep_compile=False, softmax=False, dry=False)


# --------------------------------------------------------------------------- plan and command line

@pytest.mark.parametrize("argv,expected", [
    (("--dtype", "amp"), AMP),
    (("--dtype", "amp-bf16"), ("amp-bf16",)),
    (("--dtypes", "amp-half"), ("amp-fp16",)),
    (("--dtype", "all"), tuple(d for d in DTYPES if d != "fp32-ieee")),
    (("--dtype", "all", "--precision", "ieee", "3xtf32", "tf32"), tuple(DTYPES)),
    ((), ("fp32-3xtf32", "fp32-tf32", "amp-bf16", "amp-fp16")),  # the default: the page's
])
def test_plan_selects_the_autocast_columns(argv, expected):
    plan = _plan_for("--problems", "84", "39", *argv)
    got = {c.spec.name for c in plan.cases}
    assert got == set(expected)
    amp = [c for c in plan.cases if c.spec.autocast is not None]
    assert {c.spec.name for c in amp} == set(expected) & set(AMP)
    for c in amp:  # fp32 models and inputs, torch's default precision, no GEMM-alone row
        assert c.spec.dtype == torch.float32 and c.spec.precision is None
        assert c.spec.torch_precision == "highest" and not c.gemm_alone
    assert {c.mode for c in amp} == (set(MODES) if amp else set())
    assert {c.spec.autocast for c in amp} <= {torch.bfloat16, torch.float16}


def test_autocast_specs():
    assert DTYPES["amp-bf16"].autocast == torch.bfloat16
    assert DTYPES["amp-fp16"].autocast == torch.float16
    assert all(DTYPES[d].autocast is None for d in DTYPES if d not in AMP)
    # Inputs are fp32: the L2 rotation counts 4-byte elements.
    assert cases.input_bytes(Case(SHAPE, DTYPES["amp-bf16"], "eval")) == 16 * 64 * 4


# --------------------------------------------------------------------------- autocast regions

def test_each_call_has_an_autocast_region_of_its_own():
    seen = []

    def fn(x):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return x

    call = DTYPES["amp-bf16"].amp_calls(fn, "cpu")
    call(1)
    call(2)
    assert seen == [(True, torch.bfloat16)] * 2
    assert not torch.is_autocast_enabled("cpu"), "no region outlives a call"
    assert DTYPES["bf16"].amp_calls(fn, "cpu") is fn, "other columns call fn itself"


def test_step_backward_runs_outside_the_region_and_bumps_the_weights(monkeypatch):
    spec = DTYPES["amp-bf16"]
    case = Case(SHAPE, spec, TRAIN_STEP)
    state = cases.base_state(SHAPE, CPU)
    model = cases.build(case, state, CPU, new=False)
    assert model.gemm.weight.dtype == torch.float32
    backward_in_region = []

    def forward(x):
        y = model(x)
        assert y.dtype == torch.float32  # scale (and softmax) promote, as under CUDA autocast
        y.register_hook(lambda g: backward_in_region.append(torch.is_autocast_enabled("cpu")))
        return y

    step = cases.make_step(model, spec.amp_calls(forward, "cpu"), new_weights=True)
    pairs = cases.make_inputs(case, CPU, 2, seed=3)
    assert pairs[0][0].dtype == torch.float32 and pairs[0][1].dtype == torch.float32
    versions = [p._version for p in model.parameters()]
    step(pairs[0])
    step(pairs[1])
    assert backward_in_region == [False, False]
    # two steps, two bumps of every parameter (and no other write: no optimizer runs)
    assert [p._version for p in model.parameters()] == [v + 2 for v in versions]
    assert model.gemm.weight.grad is not None and pairs[1][0].grad is not None
    step.release(pairs[1])
    assert model.gemm.weight.grad is None and pairs[1][0].grad is None
    plain = cases.make_step(model, model)
    versions = [p._version for p in model.parameters()]
    plain(pairs[0])
    assert [p._version for p in model.parameters()] == versions


def test_runner_steps_bump_the_weights_of_every_implementation(monkeypatch):
    runner = Runner(CPU, timing.Settings(warmup=1, iters=2, max_seconds=0.1), lambda m: None)
    made = []
    real = cases.make_step

    def spy(model, forward, **kw):
        made.append(kw.get("new_weights"))
        return real(model, forward, **kw)

    monkeypatch.setattr(cases, "make_step", spy)
    state = cases.base_state(SHAPE, CPU)
    for name in ("fp32-ieee", "amp-bf16"):
        fns = runner._callables(Case(SHAPE, DTYPES[name], TRAIN_STEP), state, ["ours", "eager"])
        assert all(callable(f) for f in fns.values())
    assert made == [True] * 4


def test_errors_of_an_autocast_step_are_16_bit_and_finite():
    state = cases.base_state(SHAPE, CPU)
    for name, bound in (("amp-bf16", 3e-2), ("amp-fp16", 1e-2)):
        case = Case(SHAPE, DTYPES[name], TRAIN_STEP, compile_note="not run (--no-compile)")
        runner = Runner(CPU, timing.Settings(warmup=1, iters=2, max_seconds=0.1), print)
        r = runner.run_case(case, state)
        assert set(r["timings_ms"]) == {"ours", "eager"} and r["failures"] == {
            "compile": case.compile_note}
        errs = r["errors_vs_fp64"]
        assert set(errs) == {f"{i}:{g}" for i in ("ours", "eager") for g in ("dx", "dw")}
        for stats in errs.values():
            assert stats["finite"] and stats["rel_fro"] < bound
        # 16-bit GEMMs: clearly less accurate than the fp32 step (below 1e-5, see
        # test_bench_training), so the forward did run under autocast.
        assert errs["eager:dx"]["rel_fro"] > 1e-4
        assert r["peak_mib"] == {} and r["peak_ours_vs_eager"] is None  # CPU: not measured


# --------------------------------------------------------------------------- CPU dry run

def test_dry_run_lists_the_autocast_rows(tmp_path, capsys):
    argv = ["--device", "cpu", "--no-compile", "--no-softmax", "--no-host-time",
            "--no-real-heads", "--problem", "39", "--dtype", "amp", "--mode", "eval,train-step",
            "--iters", "2", "--warmup", "0", "--out", str(tmp_path)]
    assert bench_main.main(argv) == 0
    captured = capsys.readouterr()
    for name in AMP:
        for mode in ("eval", TRAIN_STEP):
            assert f"{name} {mode}" in captured.err  # the progress and summary lines
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["settings"]["dtypes"] == list(AMP)
    assert {(r["dtype"], r["mode"]) for r in doc["cases"]} == {
        (d, m) for d in AMP for m in ("eval", TRAIN_STEP)}
    assert all("peak_mib" in r and "peak_ours_vs_eager" in r for r in doc["cases"])
    md = (tmp_path / "bench.md").read_text()
    assert f"## {report.AMP_FORWARD_TITLE}" in md and f"## {report.AMP_STEP_TITLE}" in md
    assert f"## {report.FORWARD_TITLE}" not in md and f"## {report.STEP_TITLE}" not in md
    assert "| 39 gemm_scale_bn | 64x128->128 | amp-bf16 | eval |" in md
    assert "torch.autocast('cpu'" in md and "peak MiB: measured on CUDA only" in md
    # The report again from bench.json alone (a GPU run's results, written on another machine)
    again = tmp_path / "again" / "bench.md"
    assert report.main([str(tmp_path / "bench.json"), "--markdown", str(again)]) == 0
    assert again.read_text() == md  # charts (with matplotlib) in again/bench-charts/
    assert report.AMP_STEP_TITLE in capsys.readouterr().out


# --------------------------------------------------------------------------- report

def _t(ms: float) -> dict:
    return {"median_ms": ms, "iqr_ms": 0.0, "min_ms": ms, "max_ms": ms, "mean_ms": ms, "iters": 5}


def _row(dtype: str = "bf16", mode: str = "eval", peaks=None) -> dict:
    row = new_row(Case(Shape(84, 32, 256, 256, "kernelbench"), DTYPES[dtype], mode,
                       compile=True))
    row.update(path="fused", kb_reference_ms=2.0,
               timings_ms={i: _t(1.0) for i in ("ours", "eager", "compile")})
    if peaks is not None:
        row["peak_mib"] = dict(zip(("ours", "eager", "compile"), peaks))
    return row


def _line(text: str, *needles: str) -> str:
    (line,) = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    return line


def test_report_formats_the_memory_columns():
    rows = [_row(peaks=(12.5, 50.0, 40.0)), _row("fp16", peaks=(0.25, 0.5, 1234.4))]
    text = report.text_report(doc(GPU, rows))
    assert "peak MiB ours / eager / compile" in text and "peak ours / eager" in text
    assert "12.5 / 50.0 / 40.0" in _line(text, " bf16 ") and "0.25" in _line(text, " bf16 ")
    assert "0.25 / 0.50 / 1234" in _line(text, " fp16 ") and "0.50" in _line(text, " fp16 ")
    assert "max_memory_allocated" in text  # the legend says what the numbers are
    md = report.markdown_report(doc(GPU, rows))
    assert "| 12.5 / 50.0 / 40.0 | 0.25 |" in md
    assert report.peak_ratio(rows[0]) == pytest.approx(0.25)


def test_memory_cells_without_a_measurement():
    old = _row()
    del old["peak_mib"], old["peak_ours_vs_eager"]  # a bench.json from before the columns
    no_compile = _row(peaks=(1.0, 2.0, None))
    del no_compile["peak_mib"]["compile"]
    failed = _row("fp16", peaks=(1.0, 2.0, 3.0))
    del failed["peak_mib"]["ours"]
    failed["failures"]["memory:ours"] = "RuntimeError: out of memory"
    text = report.text_report(doc(GPU, [old, no_compile, failed]))
    lines = [ln for ln in text.splitlines() if ln.startswith("84 ")]
    assert "n/a / n/a / n/a" in lines[0] and "1.0 / 2.0 / n/a" in lines[1]
    assert "n/a [1] / 2.0 / 3.0" in lines[2]
    assert "[1] peak memory of ours: RuntimeError: out of memory" in text
    assert report.peak_ratio(old) is None and report.peak_ratio(failed) is None


def test_autocast_rows_get_sections_of_their_own():
    rows = [_row("bf16"), _row("amp-bf16", peaks=(1.0, 2.0, 2.0)), _row("amp-fp16", TRAIN_STEP),
            _row("fp32-3xtf32", TRAIN_STEP)]
    text = report.text_report(doc(GPU, rows))
    plain_fwd = text.split(report.FORWARD_TITLE, 1)[1].split("\n\n", 1)[0]
    plain_step = text.split(report.STEP_TITLE, 1)[1].split("\n\n", 1)[0]
    amp_fwd = text.split(report.AMP_FORWARD_TITLE, 1)[1].split("\n\n", 1)[0]
    amp_step = text.split(report.AMP_STEP_TITLE, 1)[1].split("\n\n", 1)[0]
    assert "amp-" not in plain_fwd + plain_step
    assert " bf16 " in plain_fwd and "fp32-3xtf32" in plain_step
    assert "amp-bf16" in amp_fwd and "amp-fp16" not in amp_fwd
    assert "amp-fp16" in amp_step and "err dX ours" in amp_step
    assert text.index(report.STEP_TITLE) < text.index(report.AMP_FORWARD_TITLE)
    assert "torch.autocast('cuda'" in text and "backward after the region" in text
    md = report.markdown_report(doc(GPU, rows))
    assert f"## {report.AMP_FORWARD_TITLE}" in md and f"## {report.AMP_STEP_TITLE}" in md
    no_amp = report.text_report(doc(GPU, rows[:1]))
    assert "Autocast" not in no_amp


def test_peak_memory_is_none_on_the_cpu():
    assert timing.peak_memory(lambda x: x + 1, torch.ones(3), CPU) is None


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_peak_memory_counts_what_a_call_allocates():
    cuda = torch.device("cuda")
    held = torch.empty(8 << 20, dtype=torch.uint8, device=cuda)  # allocated before: not counted
    mib = 1 << 20
    peak = timing.peak_memory(lambda n: torch.empty(n, dtype=torch.uint8, device=cuda), 4 * mib,
                              cuda)
    assert 4 * mib <= peak < 6 * mib
    released = []
    peak = timing.peak_memory(lambda x: None, held, cuda, released.append)
    assert peak == 0 and released == [held]


@pytest.mark.gpu
@pytest.mark.parametrize("problem", [84, 39])
def test_tiny_amp_bf16_train_step_yields_timings_errors_and_memory(problem):
    cuda = torch.device("cuda")
    shape = Shape(problem, 256, 512, 256, "kb-small")
    case = Case(shape, DTYPES["amp-bf16"], TRAIN_STEP, compile=True)
    state = cases.base_state(shape, cuda)
    runner = Runner(cuda, timing.Settings(warmup=2, iters=6, max_seconds=0.5), print)
    r = runner.run_case(case, state)
    assert not r["failures"], r["failures"]
    assert set(r["timings_ms"]) == {"ours", "eager", "compile"}
    for t in r["timings_ms"].values():
        assert math.isfinite(t["median_ms"]) and t["median_ms"] > 0
    assert r["kb_reference_ms"] and r["kb_reference_ms"] > 0  # eager fp32-ieee's step
    errs = r["errors_vs_fp64"]
    assert set(errs) == {f"{i}:{g}" for i in ("ours", "eager") for g in ("dx", "dw")}
    for key, stats in errs.items():
        assert stats["finite"] and 0 < stats["rel_fro"] < 3e-2, (key, stats)  # bf16 GEMMs
    assert set(r["peak_mib"]) == {"ours", "eager", "compile"}
    # a step allocates at least dW (fp32) and dX (fp32)
    floor = (shape.n * shape.k + shape.m * shape.k) * 4 / 2**20
    for impl, mib in r["peak_mib"].items():
        assert math.isfinite(mib) and mib >= floor, (impl, mib)
    assert r["peak_ours_vs_eager"] == pytest.approx(r["peak_mib"]["ours"] / r["peak_mib"]["eager"])
    from epifuse.ops import device_unsupported_reason

    if device_unsupported_reason(torch.cuda.current_device()) is None:
        assert r["path"] == "fused"
    text = report.text_report(doc(report.environment(cuda), [r]))
    assert report.AMP_STEP_TITLE in text and "amp-bf16" in text
