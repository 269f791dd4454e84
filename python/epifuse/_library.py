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

from . import _build_info

LIBRARY_NAME = "libepifuse_ops.so"

BUILD_HINT = ("Build it with `scripts/build.sh` (or cmake -S . -B build -G Ninja && "
              "cmake --build build && pip install ./python).")


class LibraryNotFoundError(ImportError):
    """The compiled library is missing: the package was not built."""


class TorchMismatchError(ImportError):
    """The compiled library was built against another torch than the one installed."""


def default_library_path() -> Path:
    return Path(__file__).resolve().parent / "lib" / LIBRARY_NAME


def build_info() -> Optional[_build_info.BuildInfo]:
    """What the packaged library was built against (None for a build without the record)."""
    return _build_info.read(default_library_path().parent)


def check_torch(lib_dir: Union[str, os.PathLike]) -> None:
    """Raise TorchMismatchError if the library in ``lib_dir`` needs another torch.

    A library without build_info.json (built before the build recorded it) is not checked.
    """
    info = _build_info.read(lib_dir)
    if info is None:
        return
    reason = _build_info.torch_mismatch(info, torch.__version__, torch.version.cuda)
    if reason is not None:
        raise TorchMismatchError(reason)


def load_library(path: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Load the op library at ``path`` (default: the packaged one); returns its path.

    The torch check comes first: a library built against another libtorch fails to load
    with an undefined-symbol error that does not say which torch it needs. Loading the
    same file again is a no-op (the dynamic loader returns the handle it already has, so
    the op registrations run once).
    """
    lib = Path(path) if path is not None else default_library_path()
    if not lib.is_file():
        raise LibraryNotFoundError(f"epifuse: compiled library not found at {lib}. {BUILD_HINT}")
    check_torch(lib.parent)
    torch.ops.load_library(str(lib))
    return lib
