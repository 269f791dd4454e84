"""The benchmark's record of where it ran (benchmarks.report.environment), CPU only."""

from __future__ import annotations

import subprocess
from pathlib import Path

from benchmarks import report


def test_git_commit_names_this_checkout(monkeypatch):
    monkeypatch.delenv("EPIFUSE_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(report.__file__).parent)
    commit = report.git_commit()
    if head.returncode != 0:  # a copy outside the repository: nothing to name
        assert commit is None
    else:
        assert commit is not None and commit.split("-")[0] == head.stdout.strip()


def test_git_commit_from_environment(monkeypatch):
    """A checkout copied without .git (a remote GPU machine) names its commit itself."""
    monkeypatch.setenv("EPIFUSE_GIT_COMMIT", "abc1234")
    assert report.git_commit() == "abc1234"


def test_environment_names_the_epifuse_build_and_the_command(monkeypatch):
    import epifuse
    import torch
    from epifuse._library import build_info

    monkeypatch.setattr("sys.argv", ["benchmarks", "--quick"])
    monkeypatch.delenv("EPIFUSE_BENCH_CMD", raising=False)
    info = report.environment(torch.device("cpu"))
    assert info["epifuse_version"] == epifuse.__version__
    build = build_info()
    assert info["epifuse_build"] == (build.summary() if build else None)
    assert info["device"] == "cpu" and info["gpu"].startswith("none")
    assert info["command"] == "python -m benchmarks --quick"
    monkeypatch.setenv("EPIFUSE_BENCH_CMD", "scripts/bench.sh")
    assert report.environment(torch.device("cpu"))["command"] == "scripts/bench.sh --quick"
