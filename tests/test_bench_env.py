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

    monkeypatch.setattr("sys.argv", ["benchmarks", "--quick"])
    monkeypatch.delenv("EPIFUSE_BENCH_CMD", raising=False)
    info = report.environment(torch.device("cpu"))
    assert info["epifuse_version"] == epifuse.__version__
    # The library's own record, where the package exports it (the benchmark reads only the
    # public package).
    build = epifuse.build_info() if hasattr(epifuse, "build_info") else None
    assert info["epifuse_build"] == (build.summary() if build else None)
    assert info["gpu_count"] == torch.cuda.device_count()
    assert info["device"] == "cpu" and info["gpu"].startswith("none")
    assert info["command"] == "python -m benchmarks --quick"
    monkeypatch.setenv("EPIFUSE_BENCH_CMD", "scripts/bench.sh")
    assert report.environment(torch.device("cpu"))["command"] == "scripts/bench.sh --quick"


def test_benchmarks_import_only_the_public_package():
    """benchmarks/ reads epifuse through its public names: no private module, no
    epifuse.__main__."""
    import ast

    for path in sorted(Path(report.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("epifuse"):
                    assert not any(part.startswith("_") for part in name.split(".")), (path, name)
                    assert name in ("epifuse", "epifuse.cli", "epifuse.problems",
                                    "epifuse.precision", "epifuse.distributed"), (path, name)
