"""Facts about the run's environment, for the JSON and the Markdown header."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch


def _git_commit() -> str | None:
    # A checkout copied without its .git (e.g. to a remote GPU machine) names its commit here.
    given = os.environ.get("EPIFUSE_GIT_COMMIT")
    if given:
        return given
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def command_line() -> str:
    """The command as typed: ``python -m epifuse.bench ARGS`` (or the wrapper's own name)."""
    wrapper = os.environ.get("EPIFUSE_BENCH_CMD")  # scripts/bench.sh sets this
    args = " ".join(shlex.quote(a) for a in sys.argv[1:])
    base = wrapper or "python -m epifuse.bench"
    return f"{base} {args}".strip()


def collect(device: torch.device) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command_line(),
        "argv": list(sys.argv),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": _git_commit(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": torch.cuda.get_device_name(device),
            "capability": "sm_%d%d" % torch.cuda.get_device_capability(device),
            "sm_count": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "l2_cache_mib": round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            "driver": _driver_version(),
        })
    else:
        info["gpu"] = f"none (CPU dry run: {platform.processor() or platform.machine()})"
    try:
        import epifuse
        from epifuse._library import build_info

        info["epifuse_version"] = epifuse.__version__
        build = build_info()  # the library's own record: its commit may predate git_commit's
        info["epifuse_build"] = build.summary() if build else None
        info["epifuse_cuda_kernels"] = epifuse.ops.has_cuda_kernels()
        info["epifuse_path"] = os.path.dirname(epifuse.__file__)
    except Exception as e:  # the bench imports epifuse already; this only describes it
        info["epifuse_error"] = repr(e)
    return info


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
