"""Locating and loading the compiled op library (libepifuse_ops.so).

The build writes the library into ``epifuse/lib/`` so that a wheel built from
``python/`` ships it as package data; the op schemas and CUDA kernels live
there, the CPU and fake kernels are registered from ``ops.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

LIBRARY_NAME = "libepifuse_ops.so"

BUILD_HINT = ("Build it with `scripts/build.sh` (or cmake -S . -B build -G Ninja && "
              "cmake --build build && pip install ./python).")


class LibraryNotFoundError(ImportError):
    """The compiled library is missing: the package was not built."""


def default_library_path() -> Path:
    return Path(__file__).resolve().parent / "lib" / LIBRARY_NAME


def load_library(path: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Load the op library at ``path`` (default: the packaged one); returns its path.

    Loading the same file again is a no-op (the dynamic loader returns the
    handle it already has, so the op registrations run once).
    """
    lib = Path(path) if path is not None else default_library_path()
    if not lib.is_file():
        raise LibraryNotFoundError(f"epifuse: compiled library not found at {lib}. {BUILD_HINT}")
    torch.ops.load_library(str(lib))
    return lib

