#!/usr/bin/env python3
"""Record what libepifuse_ops.so was built against, in build_info.json next to it.

Run by CMake after every link of the library (target epifuse_build_info), with
the interpreter whose torch the build used. The file is read back by
python/epifuse/_build_info.py: by setup.py to pin the wheel's torch, and at
import to refuse a torch other than the one built against.

    python3 cmake/write_build_info.py --out python/epifuse/lib/build_info.json \
        --nvcc 13.0.88 --archs 80,90a [--source-dir .]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def git_commit(source_dir: Path) -> str | None:
    """Short commit of the checkout, "-dirty" when tracked files differ; None without git.
    EPIFUSE_GIT_COMMIT names it for a copy of the tree without .git (as the benchmark's report
    reads it), where git would find no checkout or another one."""
    if os.environ.get("EPIFUSE_GIT_COMMIT"):
        return os.environ["EPIFUSE_GIT_COMMIT"]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(source_dir), *args], capture_output=True,
                              text=True, timeout=30)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def epifuse_version(source_dir: Path) -> str | None:
    text = (source_dir / "python" / "epifuse" / "_version.py").read_text()
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', text, re.MULTILINE)
    return m.group(1) if m else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="path of build_info.json")
    p.add_argument("--nvcc", default=None,
                   help="CUDA compiler version (CMAKE_CUDA_COMPILER_VERSION)")
    p.add_argument("--archs", default="", help="comma list of EPIFUSE_ARCHS")
    p.add_argument("--source-dir", default=str(Path(__file__).resolve().parents[1]))
    args = p.parse_args(argv)

    import torch  # the torch this interpreter has: the one CMake found and linked against

    source = Path(args.source_dir)
    doc = {
        "epifuse_version": epifuse_version(source),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cxx11_abi": bool(torch.compiled_with_cxx11_abi()),
        "nvcc_version": args.nvcc or None,
        "archs": [a for a in args.archs.replace(";", ",").split(",") if a],
        "git_commit": git_commit(source),
        "python": "%d.%d" % sys.version_info[:2],
        "built_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out)  # never a half-written record next to the library
    print(f"epifuse: {out}: torch {doc['torch_version']}, CUDA {doc['torch_cuda']}, "
          f"archs {','.join(doc['archs'])}, commit {doc['git_commit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
