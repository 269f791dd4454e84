"""What the benchmark's reports and charts say about a run (epifuse.bench), CPU only.

A CPU run must not claim CUDA-event timings or a cuBLAS column; a run without
torch.compile must not show it in legends; a missing optional package names the extra.
"""

from __future__ import annotations

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
