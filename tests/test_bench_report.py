"""What the benchmark's reports and charts say about a run (epifuse.bench), CPU only.

A CPU run must not claim CUDA-event timings or a cuBLAS column; a run without
torch.compile must not show it in legends; a missing optional package names the extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from epifuse.bench import EXTRA_HINT, chart, progress, report
from epifuse.bench.configs import DTYPES, Case, Shape
from epifuse.bench.runner import CaseResult
from epifuse.bench.timing import Timing

CPU = {"device": "cpu", "gpu": "none (CPU dry run)", "torch": "x", "cuda": None}
GPU = {"device": "cuda:0", "gpu": "H200", "torch": "x", "cuda": "13.0"}


def _result(compile: bool, spec: str = "bf16") -> CaseResult:
    ms = Timing(1.0, 1.0, 1.0, 1.0, 5, 1, 2, 1.0)
    case = Case(Shape(84, 32, 256, 256, "kernelbench"), DTYPES[spec], "eval", compile=compile,
                gemm_alone=True, compile_note=None if compile else "not run (--no-compile)")
    timings = {"ours": ms, "eager": ms, "gemm": ms, "torch_mm": ms}
    if compile:
        timings["compile"] = ms
    return CaseResult(case, timings=timings)


def test_cpu_report_claims_neither_cuda_events_nor_cublas():
    results = [_result(compile=True)]
    for text in (report.text_report(CPU, results, [], None),
                 report.markdown_report(CPU, {"iters": 5, "min_iters": 5, "warmup": 1}, results,
                                        [], None)):
        assert "CUDA-event" not in text and "cuBLAS" not in text
        assert "time.perf_counter" in text and "torch.mm (CPU)" in text


def test_gpu_report_names_cuda_events_and_cublas():
    text = report.text_report(GPU, [_result(compile=True)], [], None)
    assert "CUDA-event" in text and "cuBLAS mm ms" in text


def test_legend_leaves_out_compile_when_it_was_not_timed():
    assert "compile = torch.compile" in report.legend(GPU, [_result(compile=True)])
    legend = report.legend(GPU, [_result(compile=False)])
    assert "compile = torch.compile" not in legend and "--no-compile" in legend
    assert chart.impls_drawn([_result(compile=False)]) == ["ours", "eager"]
    assert chart.impls_drawn([_result(compile=True)]) == ["ours", "eager", "compile"]


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr(chart, "_pyplot", lambda: None)
    messages = []
    assert chart.draw(str(tmp_path), GPU, [_result(True)], [], None, messages.append) == []
    assert any("epifuse[bench]" in m for m in messages), messages


def test_missing_tqdm_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes `import tqdm.auto` fail
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    progress.Progress(3).close()
    assert "epifuse[bench]" in capsys.readouterr().err
    assert "epifuse[bench]" in EXTRA_HINT


def test_old_bench_json_cublas_timings_are_read_as_torch_mm():
    from epifuse.bench import persist

    doc = _result(compile=False).to_dict()
    doc["timings_ms"]["cublas"] = doc["timings_ms"].pop("torch_mm")
    doc["failures"] = {"cublas": "boom"}
    back = persist.case_from_dict(doc)
    assert "torch_mm" in back.timings and back.failures == {"torch_mm": "boom"}


@pytest.mark.skipif(sys.platform != "linux", reason="subprocess run of the CLI")
def test_bench_runs_on_a_machine_without_gpu(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-m", "epifuse.bench", "--quick", "--no-compile", "--no-softmax",
         "--no-progress", "--problem", "39", "--dtype", "bfloat16", "--mode", "eval",
         "--iters", "2", "--warmup", "0", "--max-seconds", "0.01", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA device: running the CPU dry run" in out.stdout
    assert "CUDA-event" not in out.stdout and "cuBLAS" not in out.stdout
    assert (tmp_path / "bench.json").is_file()


# --------------------------------------------------------------------------- train-step, host time

def _step_result(ours_ms: float = 1.0, eager_ms: float = 1.5, compile_ms: float = 1.2) -> CaseResult:
    from epifuse.bench.accuracy import ErrorStats

    def t(ms):
        return Timing(ms, ms, ms, ms, 5, 1, 2, ms)

    case = Case(Shape(39, 64, 128, 128, "kernelbench"), DTYPES["bf16"], "train-step",
                compile=True, gemm_alone=False)
    acc = {"ours:dx": ErrorStats(1.1e-3, 2.2e-4, True), "ours:dw": ErrorStats(3.3e-3, 4.4e-4, True),
           "eager:dx": ErrorStats(5.5e-3, 6.6e-4, True),
           "eager:dw": ErrorStats(float("inf"), float("inf"), False)}
    return CaseResult(case, path="fused", timings={"ours": t(ours_ms), "eager": t(eager_ms),
                                                    "compile": t(compile_ms)},
                      accuracy=acc, kb_reference_ms=3.0)


def _host_result(busy=True):
    from epifuse.bench.configs import HostPoint
    from epifuse.bench.hosttime import HostResult, HostTiming

    point = HostPoint(Shape(84, 128, 1024, 512, "kb-small"), DTYPES["fp16"], "eval")
    return HostResult(point, timings={"ours": HostTiming(40.0, 38.0, 41.0, 200, busy),
                                      "eager": HostTiming(50.0, 45.0, 52.0, 200, busy)})


def _section(text: str, title: str) -> str:
    """The lines of one table of a text report (title to the next blank line)."""
    return text.split(title, 1)[1].split("\n\n", 1)[0]


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
    assert "train-step" not in _section(text, "ModelNew vs PyTorch (median ms per forward)")
    assert "32x256->256" not in table
    assert "x requires grad" in text and "dX" in text


def test_training_step_counts_three_gemms_and_reads_back_from_json():
    from epifuse.bench import persist

    step = _step_result()
    assert step.flops == 3 * step.case.shape.flops
    doc = step.to_dict()
    assert doc["mode"] == "train-step" and set(doc["errors_vs_fp64"]) == {
        "ours:dx", "ours:dw", "eager:dx", "eager:dw"}
    back = persist.case_from_dict(json.loads(json.dumps(report._clean(doc))))
    assert back.case == step.case and back.speedup("compile") == pytest.approx(1.2)
    assert back.accuracy["ours:dw"].rel_fro == pytest.approx(3.3e-3)


def test_host_time_table_in_text_markdown_and_json():
    host = [_host_result()]
    settings = {"iters": 5, "min_iters": 5, "warmup": 1}
    for text in (report.text_report(GPU, [_result(True)], [], None, host),
                 report.markdown_report(GPU, settings, [_result(True)], [], None, host=host)):
        assert report.HOST_TITLE in text
        row = [ln for ln in text.splitlines() if "128x1024->512" in ln and "fp16" in ln]
        assert len(row) == 1 and "40.0" in row[0] and "50.0" in row[0] and "0.80" in row[0]
        assert "yes" in row[0] and "spin kernel" in text
    doc = json.loads(report.json_report(GPU, settings, [], [], None, host=host))
    assert doc["host_time"][0]["ours_over_eager"] == pytest.approx(0.8)
    assert doc["host_time"][0]["timings_us"]["eager"]["median_us"] == 50.0


def test_host_time_flags_a_gpu_that_went_idle():
    text = report.text_report(GPU, [], [], None, [_host_result(busy=False)])
    assert "the GPU went idle" in text
    assert report.HOST_TITLE not in report.text_report(GPU, [_result(True)], [], None)


def test_resume_reads_host_time_and_old_files_without_it(tmp_path):
    from epifuse.bench import persist

    env = dict(GPU, date="d", command="c")
    path = str(tmp_path / "bench.json")
    persist.save(path, env, {}, [_result(True), _step_result()], [], None, True,
                 host=[_host_result()])
    prev = persist.Previous(path, env, lambda m: None)
    assert len(prev.cases) == 2 and len(prev.host) == 1
    (key, r), = prev.host.items()
    assert key == persist.host_key(_host_result().point) and r.ratio() == pytest.approx(0.8)

    doc = json.loads(open(path).read())
    del doc["host_time"]  # a bench.json from before train-step and host time
    doc["cases"] = [c for c in doc["cases"] if c["mode"] != "train-step"]
    with open(path, "w") as f:
        json.dump(doc, f)
    old = persist.Previous(path, env, lambda m: None)
    assert len(old.cases) == 1 and old.host == {}


def test_step_chart_is_drawn_apart_from_the_forwards(tmp_path):
    pytest.importorskip("matplotlib")
    paths = chart.draw(str(tmp_path), GPU, [_result(True), _step_result()], [], None, print)
    assert sorted(os.path.basename(p) for p in paths) == ["bench-train-step.png", "bench.png"]
