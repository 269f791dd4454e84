"""`python -m epifuse` smoke test (CPU path, small size)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def _run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "epifuse", *args], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke; the GPU run is in test_head")
def test_main_cpu_smoke():
    out = _run("--iters", "2", "--dtype", "float32", "bfloat16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "No CUDA GPU" in out.stdout
    import epifuse

    for needle in (f"epifuse {epifuse.__version__}", "problem 84", "problem 39", "train OK",
                   "eval  OK", "dtype=bfloat16", "ALL OK"):
        assert needle in out.stdout, needle


def test_main_rejects_bad_option(capsys):
    from epifuse import __main__ as cli

    with pytest.raises(SystemExit) as info:  # in process: argparse's usage error, exit status 2
        cli.main(["--problem", "12"])
    assert info.value.code == 2 and "unknown problem '12'" in capsys.readouterr().err


def test_mismatch_sets_exit_code(monkeypatch, capsys):
    """A ModelNew that disagrees with Model must make main() return nonzero."""
    from epifuse import __main__ as cli
    from epifuse.problems import gemm_scale_bn

    real_forward = gemm_scale_bn.ModelNew.forward
    monkeypatch.setattr(gemm_scale_bn.ModelNew, "forward", lambda self, x: real_forward(self, x) + 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--problem", "39", "--iters", "1"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
