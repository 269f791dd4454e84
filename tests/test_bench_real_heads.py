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
                            "--settings", "fp32", "--modes", "train", "train-step",
                            "--markdown", str(md)]) == 0
    rows = json.loads((tmp_path / "real_heads.json").read_text())["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("classifier", "train"),
                                                       ("classifier", "train-step")]
    for r in rows:
        assert r["timings_ms"]["ours"]["median_ms"] > 0
        assert r["timings_ms"]["eager"]["median_ms"] > 0
        assert len(r["fused"]) == 2
    text = md.read_text()
    assert "| classifier | fp32 | train | 2 |" in text
    assert torch.get_float32_matmul_precision() == "highest"  # the run restored it
