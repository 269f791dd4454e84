"""Every script in scripts/ answers -h/--help with its usage, and does nothing else.

Each runs from a throw-away copy of scripts/ (so the repository it sees is empty), with
stand-ins for cmake, ninja, nvcc, pip, nsys and compute-sanitizer that leave a mark when
called and pip pointed at an empty index. A --help that built, installed or created an
output folder would leave a file in the copy or the working folder, or a mark.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TOOLS = ("cmake", "ninja", "nvcc", "pip", "pip3", "nsys", "compute-sanitizer")


def _scripts() -> list[str]:
    return sorted(p.name for p in SCRIPTS.iterdir() if p.suffix in (".sh", ".py"))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def sandbox(tmp_path):
    repo, work, stubs = tmp_path / "repo", tmp_path / "work", tmp_path / "stubs"
    (repo / "scripts").mkdir(parents=True)
    work.mkdir()
    stubs.mkdir()
    for p in SCRIPTS.iterdir():
        if p.is_file():
            target = repo / "scripts" / p.name
            target.write_bytes(p.read_bytes())
            target.chmod(0o755)
    marks = tmp_path / "called"
    for tool in TOOLS:
        stub = stubs / tool
        stub.write_text(f"#!/bin/sh\necho {tool} \"$@\" >> '{marks}'\nexit 1\n")
        stub.chmod(0o755)
    (tmp_path / "empty-index").mkdir()
    env = dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHON=sys.executable, PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(tmp_path / "empty-index"), PYTHONDONTWRITEBYTECODE="1",
               CUDA_VISIBLE_DEVICES="")
    env.pop("CUTLASS_DIR", None)
    return repo, work, env, marks


def _run(script: Path, args: list[str], work: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    return subprocess.run(cmd + args, cwd=work, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_script_is_covered():
    names = _scripts()
    for expected in ("build.sh", "run.sh", "test.sh", "bench.sh", "sanitize.sh",
                     "profile_nsys.sh"):
        assert expected in names


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", _scripts())
def test_help_prints_usage_without_side_effects(name, flag, sandbox):
    repo, work, env, marks = sandbox
    before_repo, before_work = _tree(repo), _tree(work)
    out = _run(repo / "scripts" / name, [flag], work, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "usage" in out.stdout.lower() or f"scripts/{name}" in out.stdout, out.stdout
    assert _tree(repo) == before_repo, "--help wrote into the repository"
    assert _tree(work) == before_work, "--help wrote into the working folder"
    assert not marks.exists(), f"--help ran a tool: {marks.read_text()}"


@pytest.mark.parametrize("name,args", [("build.sh", ["--jobs"]), ("sanitize.sh", ["--bogus"]),
                                        ("sanitize.sh", ["out-a", "out-b"])])
def test_bad_arguments_are_refused_before_any_work(name, args, sandbox):
    repo, work, env, marks = sandbox
    before = _tree(repo) | _tree(work)
    out = _run(repo / "scripts" / name, args, work, env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--help" in out.stderr
    assert _tree(repo) | _tree(work) == before and not marks.exists()


@pytest.mark.parametrize("name,option", [("run.sh", "--dtype"), ("bench.sh", "--modes")])
def test_help_of_a_wrapper_lists_the_module_options(name, option, tmp_path):
    """In the checkout, whose library is built, run.sh --help adds python -m epifuse's options
    and bench.sh --help python -m benchmarks' (from any folder: scripts/_module_help.sh)."""
    if not (SCRIPTS.parent / "python" / "epifuse" / "lib" / "libepifuse_ops.so").is_file():
        pytest.skip("the checkout's library is not built")
    env = dict(os.environ, PYTHON=sys.executable, PYTHONDONTWRITEBYTECODE="1")
    out = _run(SCRIPTS / name, ["--help"], tmp_path, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert option in out.stdout and "--problem" in out.stdout
    assert not list(tmp_path.iterdir())
