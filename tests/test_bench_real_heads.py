"""benchmarks.real_heads: the models fuse as a user's would, and the report has their rows."""

from __future__ import annotations

import json

import torch

import epifuse
from benchmarks import real_heads


def test_models_fuse_every_linear_batchnorm():
    for name, heads in (("projection", 3), ("classifier", 2)):
        model = real_heads.build_model(name, (8, 16, 4))
        _, report = epifuse.fuse(model)
        assert len(report.fused) == heads, (name, report)
        assert report.skipped == [], (name, report)


def test_dry_run_writes_rows(tmp_path):
    md = tmp_path / "real.md"
    assert real_heads.main(["--dry", "--out", str(tmp_path), "--models", "classifier",
                            "--dtype", "fp32-3xtf32", "--modes", "train", "train-step",
                            "train-step-queued", "--markdown", str(md), "--no-compile"]) == 0
    rows = json.loads((tmp_path / "real_heads.json").read_text())["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("classifier", "train"),
                                                       ("classifier", "train-step"),
                                                       ("classifier", "train-step-queued")]
    for r in rows:
        assert r["timings_ms"]["ours"]["median_ms"] > 0
        assert r["timings_ms"]["eager"]["median_ms"] > 0
        assert len(r["fused"]) == 2
    assert rows[2]["timings_ms"]["ours"]["calls"] == 3  # the queued step's own timing (dry: 3)
    text = md.read_text()
    assert "| classifier | fp32-3xtf32 | train | 2 |" in text
    assert "| classifier | fp32-3xtf32 | train-step-queued | 2 |" in text
    assert torch.get_float32_matmul_precision() == "highest"  # the run restored it


def test_columns_are_the_main_benchmarks():
    """The same spellings and columns as python -m benchmarks (epifuse.cli); --settings is
    --dtype's other name."""
    assert real_heads.parse_args([]).columns == ["fp32-3xtf32", "fp32-tf32", "amp-bf16",
                                                 "amp-fp16"]
    assert real_heads.parse_args(["--settings", "float32-high", "amp-half"]).columns == [
        "fp32-tf32", "amp-fp16"]
    assert real_heads.parse_args(["--dtype", "fp32"]).columns == ["fp32-3xtf32", "fp32-tf32"]
    assert real_heads.modes_for(["eval", "train-step"]) == ["eval", "train-step",
                                                            "train-step-queued"]
    assert real_heads.modes_for(["train"]) == ["train"]


def test_a_tf32_row_runs_its_heads_in_tf32(monkeypatch):
    """A column's precision reaches the fused heads (epifuse.fuse(precision=...)) and torch's
    matmul policy the eager side, restored afterwards."""
    from benchmarks import timing
    from benchmarks.cases import DTYPES

    seen = {}
    real_fuse = epifuse.fuse

    def spy(model, *, precision=None):
        seen["precision"] = precision
        return real_fuse(model, precision=precision)

    monkeypatch.setattr(epifuse, "fuse", spy)
    case = real_heads.HeadCase("classifier", DTYPES["fp32-tf32"], "eval", (8, 16, 4), 16, False)
    row = real_heads.run_case(case, torch.device("cpu"),
                              timing.Settings(warmup=1, iters=1, min_iters=1))
    assert seen == {"precision": "tf32"} and row["dtype"] == "fp32-tf32"
    assert row["timings_ms"]["ours"]["median_ms"] > 0 and "compile" not in row["timings_ms"]
    assert torch.get_float32_matmul_precision() == "highest"


def test_every_case_compiles_afresh(monkeypatch):
    """Each case resets dynamo before compiling its model: cases compile new instances of the same
    code, and past dynamo's recompile limit a torch.compile wrapper silently runs eager (the
    full runs' later "compile" columns equalled eager's before this)."""
    from benchmarks import timing
    events = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(torch, "compile",
                        lambda model, **kw: events.append("compile") or model)
    settings = timing.Settings(warmup=1, iters=1, min_iters=1)
    from benchmarks.cases import DTYPES

    for mode in ("train", "eval"):
        case = real_heads.HeadCase("classifier", DTYPES["fp32-3xtf32"], mode, (8, 16, 4), 16)
        row = real_heads.run_case(case, torch.device("cpu"), settings)
        assert row["timings_ms"]["compile"]["median_ms"] > 0
    assert events == ["reset", "compile", "reset"] * 2


def test_queued_timing_keeps_the_gpu_ahead_of_the_host():
    """timing.measure_queued_rounds times calls queued behind a spin kernel: the spin outlasts the
    host's queueing (gpu_kept_busy), and the per-call GPU time of a fixed kernel does not depend
    on how many calls a round queues."""
    import pytest

    from benchmarks import timing
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    fns = {"mm": lambda x: torch.mm(x, x)}
    few = timing.measure_queued_rounds(fns, [a], device, calls=4, rounds=3)["mm"]
    many = timing.measure_queued_rounds(fns, [a], device, calls=16, rounds=3)["mm"]
    assert few["gpu_kept_busy"] is True and many["gpu_kept_busy"] is True
    assert few["rounds"] == 3 and many["calls"] == 16
    assert 0.5 < few["median_ms"] / many["median_ms"] < 2.0
