"""Run a script under ``torchrun --standalone`` from pytest: bounded in time, never hanging.

``--standalone`` lets torchrun pick a free rendezvous port itself; the whole
process tree runs in its own session so that a timeout can kill every rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(script: Path, args: list[str], nproc: int, timeout_s: float,
                 env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node=nproc script args``.

    Returns the completed process (stdout and stderr merged into stdout); on
    timeout, kills all ranks and returns rc 124 with what they printed.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *args]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python"), str(ROOT / "tests"), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("OMP_NUM_THREADS", "1")  # two CPU ranks must not oversubscribe the cores
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, None)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: torchrun and its ranks
        out, _ = proc.communicate()
        return subprocess.CompletedProcess(
            cmd, 124, (out or "") + f"\n[launch] killed after {timeout_s:.0f} s timeout\n", None)
