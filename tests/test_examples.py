"""The scripts in examples/ run as a user would run them, at tiny sizes.

Each runs in a subprocess: on a GPU the epifuse kernels are built for, the GPU path, which must
take the fused path; elsewhere the CPU path. The DDP example also runs under torchrun with 2
processes on the CPU (gloo).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import epifuse
from distributed.launch import run_torchrun

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The epifuse this test imported (an installed one, or the checkout's python/).
PACKAGE_PARENT = str(Path(epifuse.__file__).resolve().parents[1])
TINY = ["--steps", "3", "--batch", "32", "--in-dim", "32", "--hidden", "64", "--out-dim", "16"]
HEADS = 3  # the projection MLP's Linear -> BatchNorm1d chains


def _fast_path_expected() -> bool:
    """Whether the examples' default device runs epifuse's kernels."""
    return (torch.cuda.is_available()
            and epifuse.ops.device_unsupported_reason(torch.cuda.current_device()) is None)


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, f"{script} failed (rc {out.returncode}):\n{out.stdout}{out.stderr}"
    return out.stdout


def _losses(stdout: str, steps: int) -> list[float]:
    losses = [float(v) for v in re.findall(r"^step \d+/\d+ loss (\S+)$", stdout, re.MULTILINE)]
    assert len(losses) == steps, stdout  # one line per step, from one process
    assert all(math.isfinite(v) for v in losses), stdout
    return losses


def _heads_on_kernels(stdout: str) -> int:
    assert f"epifuse.fuse: {HEADS} fused, 0 left" in stdout, stdout
    m = re.search(r"^fused heads: (\d+), on epifuse's kernels: (\d+)", stdout, re.MULTILINE)
    assert m is not None, stdout
    assert int(m.group(1)) == HEADS, stdout
    return int(m.group(2))


def test_train_projection():
    stdout = _run("train_projection.py", *TINY)
    _losses(stdout, 3)
    on_kernels = _heads_on_kernels(stdout)
    if _fast_path_expected():
        assert on_kernels == HEADS, stdout
    else:
        assert on_kernels == 0, stdout
        assert torch.cuda.is_available() or "(input is on cpu, not CUDA)" in stdout, stdout


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available")
def test_train_projection_ddp_on_cpu():
    result = run_torchrun(EXAMPLES / "train_projection.py", [*TINY, "--cpu"], nproc=2,
                          timeout_s=180, env={"PYTHONPATH": PACKAGE_PARENT})
    assert result.returncode == 0, f"torchrun failed (rc {result.returncode}):\n{result.stdout}"
    _losses(result.stdout, 3)
    assert _heads_on_kernels(result.stdout) == 0  # the CPU runs the heads' modules


@pytest.mark.parametrize("problem", [84, 39])
def test_kernelbench(problem):
    stdout = _run("kernelbench.py", "--problem", str(problem), "--small", "--iters", "2")
    assert f"problem {problem} " in stdout and "OK at atol = rtol = 1e-2" in stdout, stdout
    assert re.search(r"^Model [\d.]+ ms, ModelNew [\d.]+ ms", stdout, re.MULTILINE), stdout
    if _fast_path_expected():
        assert "ModelNew path: fused" in stdout, stdout
    elif not torch.cuda.is_available():
        assert "ModelNew path: reference (input is on cpu, not CUDA)" in stdout, stdout
    else:  # a GPU the library has no kernels for
        assert "ModelNew path: reference" in stdout, stdout
