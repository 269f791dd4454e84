"""What the benchmark's reports, charts and bench.json say about a run (benchmarks), CPU only.

A CPU run must not claim CUDA-event timings or a cuBLAS column; a run without torch.compile
must not show it in legends; --resume reuses what bench.json holds; the page (BENCHMARKS.md) is
one run's, whole, and stays a page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as bench_main, report
from benchmarks.cases import DTYPES, TRAIN_STEP, Case, Shape, new_row

ROOT = Path(__file__).resolve().parents[1]
CPU = {"device": "cpu", "gpu": "none (CPU dry run)", "torch": "x", "cuda": None}
GPU = {"device": "cuda:0", "gpu": "H200", "torch": "x", "cuda": "13.0"}
SETTINGS = {"iters": 5, "min_iters": 5, "warmup": 1}


def doc(env=GPU, rows=(), softmax=(), copy=None, host=(), heads=(), dist=None) -> dict:
    """A bench.json's content."""
    return {"complete": True, "env": env, "settings": SETTINGS, "cases": list(rows),
            "host_time": list(host), "softmax": list(softmax), "copy_bandwidth": copy,
            "real_heads": list(heads), "distributed": dist}


def _t(ms: float) -> dict:
    return {"median_ms": ms, "iqr_ms": 0.0, "min_ms": ms, "max_ms": ms, "mean_ms": ms, "iters": 5}


def _result(compile: bool, spec: str = "bf16") -> dict:
    row = new_row(Case(Shape(84, 32, 256, 256, "kernelbench"), DTYPES[spec], "eval",
                       compile=compile, gemm_alone=True,
                       compile_note=None if compile else "not run (--no-compile)"))
    row["timings_ms"] = {i: _t(1.0) for i in ("ours", "eager", "gemm", "torch_mm")
                         + (("compile",) if compile else ())}
    return row


def _step_result(ours_ms: float = 1.0, eager_ms: float = 1.5, compile_ms: float = 1.2) -> dict:
    row = new_row(Case(Shape(39, 64, 128, 128, "kernelbench"), DTYPES["bf16"], TRAIN_STEP,
                       compile=True))
    e = lambda rel, mx, finite=True: {"rel_fro": rel, "max_abs": mx, "finite": finite}  # noqa
    row.update(path="fused", kb_reference_ms=3.0,
               timings_ms={"ours": _t(ours_ms), "eager": _t(eager_ms), "compile": _t(compile_ms)},
               errors_vs_fp64={"ours:dx": e(1.1e-3, 2.2e-4), "ours:dw": e(3.3e-3, 4.4e-4),
                               "eager:dx": e(5.5e-3, 6.6e-4),
                               "eager:dw": e(float("inf"), float("inf"), False)})
    return row


def _host_result(busy=True) -> dict:
    row = new_row(Case(Shape(84, 128, 1024, 512, "kb-small"), DTYPES["fp16"], "eval"))
    t = lambda us: {"median_us": us, "min_us": us, "mean_us": us, "calls": 200,  # noqa: E731
                    "gpu_kept_busy": busy}
    return dict(row, timings_us={"ours": t(40.0), "eager": t(50.0)})


def _head_row(model="projection", dtype="fp32-3xtf32", mode="train-step", ours=1.0,
              eager=1.5, compile=1.2, batch=4096) -> dict:
    """A real-heads row (benchmarks.real_heads.run_case's)."""
    return {"model": model, "dtype": dtype, "mode": mode, "batch": batch,
            "dims": [2048, 4096, 256], "compile_timed": True, "fused": ["0", "3", "6"],
            "skipped": [], "peak_mib": {"ours": 300.0, "eager": 400.0, "compile": 350.0},
            "timings_ms": {"ours": _t(ours), "eager": _t(eager), "compile": _t(compile)}}


def _section(text: str, title: str) -> str:
    """The lines of one table of a text report (title to the next blank line)."""
    return text.split(title, 1)[1].split("\n\n", 1)[0]


def test_cpu_report_claims_neither_cuda_events_nor_cublas():
    rows = [_result(compile=True)]
    for text in (report.text_report(doc(CPU, rows)), report.markdown_report(doc(CPU, rows))):
        assert "CUDA-event" not in text and "cuBLAS" not in text
        assert "time.perf_counter" in text and "torch.mm (CPU)" in text


def test_gpu_report_names_cuda_events_and_cublas():
    text = report.text_report(doc(GPU, [_result(compile=True)]))
    assert "CUDA-event" in text and "cuBLAS mm ms" in text


# The columns of the page's tables, in order: a run stays comparable with the last one (new
# columns may be added between them).
COLUMNS = {
    report.FORWARD_TITLE: ["problem", "M x K -> N", "dtype", "mode", "ModelNew path", "ours ms",
                           "TFLOP/s", "eager ms", "compile ms", "vs eager", "vs compile",
                           "vs KB ref", "peak MiB ours / eager / compile", "peak ours / eager",
                           "err ours (rel / max)", "err eager (rel / max)"],
    report.STEP_TITLE: ["problem", "M x K -> N", "dtype", "ModelNew path", "ours ms", "eager ms",
                        "compile ms", "vs eager", "vs compile", "vs KB ref",
                        "err dX ours (rel / max)", "err dW eager (rel / max)"],
    report.HOST_TITLE: ["problem", "M x K -> N", "dtype", "mode", "ours us", "eager us",
                        "ours / eager", "GPU kept busy"],
    report.GEMM_TITLE: ["M x K -> N", "dtype", "mode", "our GEMM op", "GEMM ms", "TFLOP/s",
                        "cuBLAS mm ms", "end-to-end ms", "end-to-end / GEMM"],
    report.REAL_HEADS_TITLE: ["model", "dtype", "mode", "fused heads", "ours ms", "eager ms",
                              "compile ms", "vs eager", "vs compile"],
}


def test_markdown_tables_keep_their_columns():
    """The page's tables keep their columns, in order, and the cells their formats."""
    md = report.markdown_report(doc(GPU, [_result(True), _step_result()], host=[_host_result()],
                                    heads=[_head_row()]))
    for title, expected in COLUMNS.items():
        headers = iter(md.split(f"### {title}\n\n" if f"### {title}" in md else f"## {title}\n\n",
                                1)[1].splitlines()[0].strip("| ").split(" | "))
        assert all(h in headers for h in expected), title  # a subsequence
    assert "| 84 gemm_bn_scale_softmax | 32x256->256 | bf16 | eval | - | 1.000 | 0.004 |" in md


def test_failures_and_reference_paths_become_numbered_notes():
    row = _result(compile=True)
    del row["timings_ms"]["eager"]
    row["failures"]["eager"] = "RuntimeError: boom | pipe"
    row["path"] = "input is on cpu, not CUDA"
    text = report.text_report(doc(GPU, [row, _result(True)]))
    assert "n/a [2]" in text and "reference [1]" in text
    assert "[2] eager: RuntimeError: boom | pipe" in text
    assert "[1] ModelNew ran its reference path: input is on cpu, not CUDA" in text
    assert "[2] eager: RuntimeError: boom | pipe  " in report.markdown_report(doc(GPU, [row]))
    assert report.table(["a|b", "n"], [["c|d", "1"]], 1, markdown=True).splitlines() == [
        "| a\\|b | n |", "|:--|--:|", "| c\\|d | 1 |"]
    assert report.table(["a", "n"], [["ccc", "1"]], 1, markdown=False).splitlines() == [
        "a    n", "---  -", "ccc  1"]


def test_legend_leaves_out_compile_when_it_was_not_timed():
    assert "compile = torch.compile" in report.legend(doc(GPU, [_result(compile=True)]))[0]
    legend = report.legend(doc(GPU, [_result(compile=False)]))[0]
    assert "compile = torch.compile" not in legend and "--no-compile" in legend
    assert report.impls_drawn([_result(compile=False)]) == ["ours", "eager"]
    assert report.impls_drawn([_result(compile=True)]) == ["ours", "eager", "compile"]


def test_missing_matplotlib_is_a_message_not_a_failure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    messages = []
    assert report.draw(str(tmp_path), doc(GPU, [_result(True)]), messages.append) == []
    assert any("pip install matplotlib" in m for m in messages), messages


def test_softmax_table_against_copy_bandwidth():
    row = {"dtype": "fp32", "M": 256, "N": 1024, "bytes_read_plus_written": 2 << 20,
           "timings_ms": {"ours": _t(0.001)}, "failures": {"torch": "RuntimeError: x"},
           "errors_vs_fp64": {"ours": {"rel_fro": 0, "max_abs": 1e-7, "finite": True}}}
    copy = {"gbps": 4194.304, "bytes_read_plus_written": 2 << 30, "failure": None}
    text = report.text_report(doc(GPU, softmax=[row], copy=copy))
    line = [ln for ln in text.splitlines() if ln.startswith("fp32")][0]
    assert "2097" in line and "50%" in line and "1.0e-07" in line and "n/a [1]" in line
    assert "copy bandwidth 4194 GB/s: 1024 MiB tensor.copy_" in text
    assert "[1] softmax torch: RuntimeError: x" in text


@pytest.mark.skipif(sys.platform != "linux", reason="subprocess run of the CLI")
def test_bench_runs_on_a_machine_without_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-compile", "--no-softmax",
         "--no-real-heads", "--no-small-batch", "--problem", "39", "--dtype", "bfloat16",
         "--mode", "eval",
         "--iters", "2", "--warmup", "0", "--max-seconds", "0.01", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA device: running the CPU dry run" in out.stdout
    assert "CUDA-event" not in out.stdout and "cuBLAS" not in out.stdout
    assert "[1/1 " in out.stderr, "a progress line per configuration"
    assert (tmp_path / "bench.json").is_file() and (tmp_path / "bench.md").is_file()


# --------------------------------------------------------------------------- train-step, host time

def test_training_step_table_has_speedups_and_gradient_errors():
    forward, step = _result(compile=True), _step_result()
    text = report.text_report(doc(GPU, [forward, step]))
    table = _section(text, report.STEP_TITLE)
    assert "training step (forward + backward)" in report.STEP_TITLE.lower()
    row = [ln for ln in table.splitlines() if "64x128->128" in ln]
    assert len(row) == 1
    for cell in ("1.50x", "1.20x", "3.00x", "1.1e-03 / 2.2e-04", "5.5e-03 / 6.6e-04",
                 "3.3e-03 / 4.4e-04", "non-finite"):
        assert cell in row[0], (cell, row[0])
    # the step is not a forward row, and the forward is not a step row
    assert "train-step" not in _section(text, report.FORWARD_TITLE)
    assert "32x256->256" not in table
    assert "x requires grad" in text and "dX" in text


def test_training_step_table_has_the_queued_steps():
    """A step row's queued GPU time (the host ahead) beside its time alone: ours / eager /
    compile and eager's over ours; an idle GPU while queuing gets a note; a row measured before
    the column existed shows "-"."""
    q = lambda ms, busy=True: {"median_ms": ms, "min_ms": ms, "rounds": 5, "calls": 10,  # noqa
                               "gpu_kept_busy": busy}
    step = _step_result()
    step["queued_ms"] = {"ours": q(0.8), "eager": q(1.6), "compile": q(1.0, busy=False)}
    old = _step_result()
    old.pop("queued_ms")
    old["M"] = 96  # another row
    table = _section(report.text_report(doc(GPU, [step, old])), report.STEP_TITLE)
    row = [ln for ln in table.splitlines() if "64x128->128" in ln][0]
    assert "0.8000 / 1.600 / 1.000 [" in row and "2.00x" in row, row
    old_row = [ln for ln in table.splitlines() if "96x128->128" in ln][0]
    # peak ratio (none in these rows), then the two queued cells, then the errors
    assert re.search(r"n/a\s+-\s+-\s+1\.1e-03", old_row), old_row


def test_training_step_counts_three_gemms():
    step = _step_result()
    assert step["flops"] == 3 * 2 * 64 * 128 * 128
    assert report.tflops(step) == pytest.approx(step["flops"] / 1e-3 / 1e12)
    assert report.tflops(_result(True), "gemm") == pytest.approx(2 * 32 * 256 * 256 / 1e-3 / 1e12)


def test_host_time_table_in_text_and_markdown():
    host = [_host_result()]
    for text in (report.text_report(doc(GPU, [_result(True)], host=host)),
                 report.markdown_report(doc(GPU, [_result(True)], host=host))):
        assert report.HOST_TITLE in text
        row = [ln for ln in text.splitlines() if "128x1024->512" in ln and "fp16" in ln]
        assert len(row) == 1 and "40.0" in row[0] and "50.0" in row[0] and "0.80" in row[0]
        assert "yes" in row[0] and "spin kernel" in text


def test_host_time_flags_a_gpu_that_went_idle():
    text = report.text_report(doc(GPU, host=[_host_result(busy=False)]))
    assert "the GPU went idle" in text
    assert report.HOST_TITLE not in report.text_report(doc(GPU, [_result(True)]))


def _write(path: Path, env: dict, cases, host=(), softmax=()) -> None:
    path.write_text(json.dumps({"complete": True, "env": env, "settings": {}, "cases": list(cases),
                                "host_time": list(host), "softmax": list(softmax),
                                "copy_bandwidth": None}))


def test_resume_reads_cases_host_time_and_old_files(tmp_path):
    env = dict(GPU, date="d", command="c")
    path = tmp_path / "bench.json"
    _write(path, env, [_result(True), _step_result()], host=[_host_result()])
    prev = bench_main.load_previous(str(path), env, lambda m: None)
    assert len(prev["cases"]) == 2 and len(prev["host"]) == 1 and prev["commands"] == ["c"]
    (key, r), = prev["host"].items()
    assert key == bench_main.host_key(_host_result()) and report.host_ratio(r) == 0.8

    old = _result(False)  # a bench.json from before host time, with torch.mm's old name
    old["timings_ms"]["cublas"] = old["timings_ms"].pop("torch_mm")
    old["failures"] = {"cublas": "boom"}
    _write(path, env, [old])
    doc = json.loads(path.read_text())
    del doc["host_time"]
    path.write_text(json.dumps(doc))
    (r,) = bench_main.load_previous(str(path), env, lambda m: None)["cases"].values()
    assert "torch_mm" in r["timings_ms"] and r["failures"] == {"torch_mm": "boom"}

    assert bench_main.load_previous(str(path), dict(env, gpu="A100"), print) is None
    capsys_free = tmp_path / "nothing.json"
    assert bench_main.load_previous(str(capsys_free), env, lambda m: None) is None


def test_resume_measures_only_what_is_missing(tmp_path, capsys):
    argv = ["--device", "cpu", "--no-compile", "--no-softmax", "--no-host-time",
            "--no-real-heads", "--problem", "39", "--mode", "eval", "--iters", "2", "--warmup",
            "0", "--out", str(tmp_path)]
    assert bench_main.main(argv + ["--dtype", "bf16"]) == 0
    capsys.readouterr()
    assert bench_main.main(argv + ["--dtype", "bf16", "fp16", "--resume"]) == 0
    lines = capsys.readouterr().err.splitlines()
    (bf16,) = [ln for ln in lines if "bf16 eval: ours" in ln]
    (fp16,) = [ln for ln in lines if "fp16 eval: ours" in ln]
    assert bf16.endswith("(reused)") and not fp16.endswith("(reused)")
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["complete"] and [r["dtype"] for r in doc["cases"]] == ["bf16", "fp16"]
    assert len(doc["env"]["commands"]) == 2
    assert "Commands (in this order" in (tmp_path / "bench.md").read_text()


def test_step_chart_is_drawn_apart_from_the_forwards(tmp_path):
    pytest.importorskip("matplotlib")
    paths = report.draw(str(tmp_path), doc(GPU, [_result(True), _step_result()],
                                           heads=[_head_row()]), print)
    assert sorted(os.path.basename(p) for p in paths) == ["bench-train-step.png", "bench.png",
                                                         "real-heads.png"]


# --------------------------------------------------------------------------- the page

def _full_run_doc(nproc_results: bool = True) -> dict:
    """A document the size of the default GPU run's: every KernelBench case, host-time point,
    real-heads row and softmax point of the page's plan, and the 2-GPU table."""
    from benchmarks import real_heads
    from benchmarks.cases import MODES, build_plan

    page = ["fp32-3xtf32", "fp32-tf32", "amp-bf16", "amp-fp16"]
    plan = build_plan([84, 39], page, list(MODES), compile=True, sweep=False, sweep_ms=(),
                      sweep_compile=False, softmax=True, dry=False)
    rows = []
    for case in plan.cases:
        r = new_row(case)
        r["timings_ms"] = {i: _t(1.0) for i in ("ours", "eager", "compile")
                           + (("gemm", "torch_mm") if case.gemm_alone else ())}
        r.update(path="fused", kb_reference_ms=2.0)
        rows.append(r)
    host = []
    for pt in plan.host_points:
        h = _host_result()
        h.update(dtype=pt.spec.name, mode=pt.mode)
        host.append(h)
    heads = [_head_row(c.model, c.spec.name, c.mode) for c in real_heads.plan(
        real_heads.MODELS, page, real_heads.modes_for(MODES), dry=False)]
    softmax = [{"dtype": d, "M": m, "N": n, "bytes_read_plus_written": 2 * m * n * 4,
                "timings_ms": {"ours": _t(0.1), "torch": _t(0.2)}, "failures": {},
                "errors_vs_fp64": {}} for d, n, m in plan.softmax_points]
    dist = {"nproc": 2, "device_name": "NVIDIA H100 80GB HBM3", "results": [
        {"problem": p, "shape": "1024x8192->8192", "dtype": d, "ddp": ddp, "ours_ms": 1.0,
         "reference_ms": 2.0, "path": "fused", "output_err": 1e-6, "ours_host_ms": 0.5,
         "reference_host_ms": 0.6, "gpu_kept_busy": True}
        for p in (84, 39) for d in ("fp32-3xtf32", "fp32-tf32", "bf16") for ddp in (False, True)]}
    env = dict(GPU, capability="sm_90", sm_count=132, gpu_memory_gib=79.2, driver="580",
               gpu_count=2, date="2026-01-01 00:00:00 UTC", command="scripts/bench.sh --markdown "
               "BENCHMARKS.md", git_commit="abc1234", epifuse_version="0.1.0", elapsed_s=300.0,
               sections_s={"kernelbench": 150.0, "real_heads": 100.0, "loop": 180.0})
    from benchmarks import loop
    from test_bench_loop import loop_host_row, loop_row

    groups = loop.plan(loop.MODELS, loop.settings_for(page), loop.BATCHES, loop.OPTIMIZERS,
                       dry=False)
    return dict(doc(env, rows, softmax, {"gbps": 3000.0, "bytes_read_plus_written": 2 << 30,
                                         "failure": None}, host, heads, dist),
                settings={"iters": 50, "min_iters": 5, "warmup": 10},
                loop=[loop_row(g.model, g.batch, g.spec.name, o) for g in groups
                      for o in g.optimizers],
                loop_host=[loop_host_row(s) for s in loop.settings_for(page)])


def test_the_default_run_fits_a_page():
    md = report.markdown_report(_full_run_doc(), charts=["x/bench.png", "x/real-heads.png"])
    lines = md.splitlines()
    assert len(lines) <= report.PAGE_MAX_LINES, len(lines)
    for heading in ("## Environment", "## KernelBench problems 84 and 39",
                    f"### {report.FORWARD_TITLE}", f"### {report.STEP_TITLE}",
                    f"### {report.AMP_FORWARD_TITLE}", f"### {report.AMP_STEP_TITLE}",
                    f"## {report.REAL_HEADS_TITLE}", f"## {report.LOOP_TITLE}",
                    f"### {report.LOOP_HOST_TITLE}", f"## {report.DISTRIBUTED_TITLE}",
                    "## Legend", "## Charts"):
        assert heading in lines, heading
    assert "Training step on 2 x NVIDIA H100 80GB HBM3" in md
    assert "commit `abc1234`" in md and ("in 300 s (KernelBench 150 s, real heads 100 s, "
                                         "training loop 180 s)") in md
    assert "| projection | amp-bf16 | train-step-queued | 3 |" in md
    assert "| classifier | 4096 | amp-fp16 | SGD fused | yes (2 heads) |" in md
    for stale in ("Round of", "session"):  # a run's page, not a log
        assert stale not in md
    assert not re.search(r"[Ii]ssue #?\d|#\d", md)  # nor a tracker's


def test_the_page_says_when_the_2_gpu_section_was_not_run():
    d = doc(GPU, [_result(True)], dist={"not_run": "this machine has 1 GPU; the data-parallel "
                                                   "section needs 2"})
    md = report.markdown_report(d)
    assert (f"## {report.DISTRIBUTED_TITLE}\n\nNot run: this machine has 1 GPU; the "
            "data-parallel section needs 2.") in md
    assert report.DISTRIBUTED_TITLE not in report.markdown_report(doc(GPU, [_result(True)]))


def test_the_page_replaces_its_charts(tmp_path):
    """A page's charts are its run's: PNGs an earlier run left beside it go."""
    pytest.importorskip("matplotlib")
    charts = tmp_path / "PAGE-charts"
    charts.mkdir()
    (charts / "amp-forwards.png").write_bytes(b"stale")
    written = report.write_markdown(doc(GPU, [_result(True)]), str(tmp_path / "PAGE.md"), print)
    assert sorted(p.name for p in charts.iterdir()) == ["bench.png"]
    assert written == [str(tmp_path / "PAGE.md"), str(charts / "bench.png")]
    assert "![bench.png](PAGE-charts/bench.png)" in (tmp_path / "PAGE.md").read_text()


def test_benchmarks_md_is_generated_text():
    """BENCHMARKS.md holds one run's tables or the note that none ran yet: no dated rounds."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert len(text.splitlines()) <= report.PAGE_MAX_LINES
    assert "scripts/bench.sh --markdown BENCHMARKS.md" in text
    assert "Round of" not in text and "session" not in text


@pytest.mark.skipif(sys.platform != "linux", reason="runs scripts/bench.sh")
def test_bench_sh_dry_run_writes_the_whole_page(tmp_path):
    """scripts/bench.sh --device cpu --quick --markdown PAGE: every section of the page from one
    run (a part of the selection, to keep it short), each announced with its estimate."""
    page = tmp_path / "PAGE.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHON=sys.executable)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench.sh"), "--device", "cpu", "--quick", "--problem",
         "39", "--dtype", "fp32-tf32,amp-bf16", "--modes", "eval,train-step", "--out",
         str(tmp_path / "out"), "--markdown", str(page)],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for section in ("KernelBench", "real heads", "training loop", "softmax"):
        assert f"== {section}: " in out.stderr and "estimate ~" in out.stderr, section
    md = page.read_text()
    assert len(md.splitlines()) <= report.PAGE_MAX_LINES
    assert "Dry run on the CPU" in md and "`scripts/bench.sh --device cpu --quick" in md
    for heading in (f"### {report.FORWARD_TITLE}", f"### {report.AMP_STEP_TITLE}",
                    f"## {report.REAL_HEADS_TITLE}", f"## {report.LOOP_TITLE}",
                    f"### {report.LOOP_HOST_TITLE}", f"## {report.SOFTMAX_TITLE}",
                    f"## {report.DISTRIBUTED_TITLE}"):
        assert heading in md, heading
    assert "| projection | amp-bf16 | train-step-queued | 3 |" in md
    # the loop at tiny sizes: the fused heads fall back on the CPU, and the row says so
    assert "| projection | 16 | amp-bf16 | AdamW fused | no [" in md
    assert "the fused heads ran their modules, not epifuse::fused_head (input is on cpu" in md
    assert "Not run: CPU dry run" in md
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert doc["complete"] and set(doc["env"]["sections_s"]) == {
        "kernelbench", "real_heads", "small_batch", "loop", "softmax"}
    assert len(doc["loop"]) == 2 * 2 * 2 * 2 and len(doc["loop_host"]) == 2
