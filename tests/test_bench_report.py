"""What the benchmark's reports, charts and bench.json say about a run (benchmarks), CPU only.

A CPU run must not claim CUDA-event timings or a cuBLAS column; a run without torch.compile
must not show it in legends; --resume reuses what bench.json holds.
"""

from __future__ import annotations

import json
import os
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


def _section(text: str, title: str) -> str:
    """The lines of one table of a text report (title to the next blank line)."""
    return text.split(title, 1)[1].split("\n\n", 1)[0]


def test_cpu_report_claims_neither_cuda_events_nor_cublas():
    rows = [_result(compile=True)]
    for text in (report.text_report(CPU, rows, [], None),
                 report.markdown_report(CPU, SETTINGS, rows, [], None)):
        assert "CUDA-event" not in text and "cuBLAS" not in text
        assert "time.perf_counter" in text and "torch.mm (CPU)" in text


def test_gpu_report_names_cuda_events_and_cublas():
    text = report.text_report(GPU, [_result(compile=True)], [], None)
    assert "CUDA-event" in text and "cuBLAS mm ms" in text


def test_markdown_tables_keep_the_benchmarks_md_columns():
    """BENCHMARKS.md's rows stay comparable: its tables' columns are all still there, in the
    same order (new columns may be added), and the cells keep their formats."""
    md = report.markdown_report(GPU, SETTINGS, [_result(True), _step_result()], [], None,
                                host=[_host_result()])
    bench_md = (ROOT / "BENCHMARKS.md").read_text()
    for title in (report.FORWARD_TITLE, report.STEP_TITLE, report.HOST_TITLE,
                  "Our GEMM alone (KernelBench shapes)"):
        ours, theirs = (iter(doc.split(f"## {title}\n\n", 1)[1].splitlines()[0].split(" | "))
                        for doc in (md, bench_md))
        assert all(header in ours for header in theirs), title  # a subsequence
    assert "| 84 gemm_bn_scale_softmax | 32x256->256 | bf16 | eval | - | 1.000 | 0.004 |" in md


def test_failures_and_reference_paths_become_numbered_notes():
    row = _result(compile=True)
    del row["timings_ms"]["eager"]
    row["failures"]["eager"] = "RuntimeError: boom | pipe"
    row["path"] = "input is on cpu, not CUDA"
    text = report.text_report(GPU, [row, _result(True)], [], None)
    assert "n/a [2]" in text and "reference [1]" in text
    assert "[2] eager: RuntimeError: boom | pipe" in text
    assert "[1] ModelNew ran its reference path: input is on cpu, not CUDA" in text
    assert "[2] eager: RuntimeError: boom | pipe  " in report.markdown_report(GPU, SETTINGS, [row],
                                                                           [], None)
    assert report.table(["a|b", "n"], [["c|d", "1"]], 1, markdown=True).splitlines() == [
        "| a\\|b | n |", "|:--|--:|", "| c\\|d | 1 |"]
    assert report.table(["a", "n"], [["ccc", "1"]], 1, markdown=False).splitlines() == [
        "a    n", "---  -", "ccc  1"]


def test_legend_leaves_out_compile_when_it_was_not_timed():
    assert "compile = torch.compile" in report.legend(GPU, [_result(compile=True)])
    legend = report.legend(GPU, [_result(compile=False)])
    assert "compile = torch.compile" not in legend and "--no-compile" in legend
    assert report.impls_drawn([_result(compile=False)]) == ["ours", "eager"]
    assert report.impls_drawn([_result(compile=True)]) == ["ours", "eager", "compile"]


def test_missing_matplotlib_is_a_message_not_a_failure(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    messages = []
    assert report.draw(str(tmp_path), GPU, [_result(True)], [], None, messages.append) == []
    assert any("pip install matplotlib" in m for m in messages), messages


def test_softmax_table_against_copy_bandwidth():
    row = {"dtype": "fp32", "M": 256, "N": 1024, "bytes_read_plus_written": 2 << 20,
           "timings_ms": {"ours": _t(0.001)}, "failures": {"torch": "RuntimeError: x"},
           "errors_vs_fp64": {"ours": {"rel_fro": 0, "max_abs": 1e-7, "finite": True}}}
    copy = {"gbps": 4194.304, "bytes_read_plus_written": 2 << 30, "failure": None}
    text = report.text_report(GPU, [], [row], copy)
    line = [ln for ln in text.splitlines() if ln.startswith("fp32")][0]
    assert "2097" in line and "50%" in line and "1.0e-07" in line and "n/a [1]" in line
    assert "copy bandwidth 4194 GB/s: 1024 MiB tensor.copy_" in text
    assert "[1] softmax torch: RuntimeError: x" in text


@pytest.mark.skipif(sys.platform != "linux", reason="subprocess run of the CLI")
def test_bench_runs_on_a_machine_without_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--no-compile", "--no-softmax",
         "--problem", "39", "--dtype", "bfloat16", "--mode", "eval",
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
    text = report.text_report(GPU, [forward, step], [], None)
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


def test_training_step_counts_three_gemms():
    step = _step_result()
    assert step["flops"] == 3 * 2 * 64 * 128 * 128
    assert report.tflops(step) == pytest.approx(step["flops"] / 1e-3 / 1e12)
    assert report.tflops(_result(True), "gemm") == pytest.approx(2 * 32 * 256 * 256 / 1e-3 / 1e12)


def test_host_time_table_in_text_and_markdown():
    host = [_host_result()]
    for text in (report.text_report(GPU, [_result(True)], [], None, host),
                 report.markdown_report(GPU, SETTINGS, [_result(True)], [], None, host=host)):
        assert report.HOST_TITLE in text
        row = [ln for ln in text.splitlines() if "128x1024->512" in ln and "fp16" in ln]
        assert len(row) == 1 and "40.0" in row[0] and "50.0" in row[0] and "0.80" in row[0]
        assert "yes" in row[0] and "spin kernel" in text


def test_host_time_flags_a_gpu_that_went_idle():
    text = report.text_report(GPU, [], [], None, [_host_result(busy=False)])
    assert "the GPU went idle" in text
    assert report.HOST_TITLE not in report.text_report(GPU, [_result(True)], [], None)


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
    argv = ["--device", "cpu", "--no-compile", "--no-softmax", "--no-host-time", "--problem",
            "39", "--mode", "eval", "--iters", "2", "--warmup", "0", "--out", str(tmp_path)]
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
    paths = report.draw(str(tmp_path), GPU, [_result(True), _step_result()], [], None, print)
    assert sorted(os.path.basename(p) for p in paths) == ["bench-train-step.png", "bench.png"]
