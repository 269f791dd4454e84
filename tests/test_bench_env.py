"""The benchmark's record of where it ran (epifuse.bench.env), CPU only."""

from __future__ import annotations

import subprocess

from epifuse.bench import env


def test_git_commit_names_this_checkout(monkeypatch):
    monkeypatch.delenv("EPIFUSE_GIT_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=env.__file__.rsplit("/", 1)[0])
    commit = env._git_commit()
    if head.returncode != 0:  # an installed copy outside the repository: nothing to name
        assert commit is None
    else:
        assert commit is not None and commit.split("-")[0] == head.stdout.strip()


def test_git_commit_from_environment(monkeypatch):
    """A checkout copied without .git (a remote GPU machine) names its commit itself."""
    monkeypatch.setenv("EPIFUSE_GIT_COMMIT", "abc1234")
    assert env._git_commit() == "abc1234"


def test_environment_names_the_epifuse_build():
    import epifuse
    import torch
    from epifuse._library import build_info

    info = env.collect(torch.device("cpu"))
    assert info["epifuse_version"] == epifuse.__version__
    build = build_info()
    assert info["epifuse_build"] == (build.summary() if build else None)
    assert info["device"] == "cpu" and info["gpu"].startswith("none")
