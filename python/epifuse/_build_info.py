"""What the compiled library was built against: ``lib/build_info.json``.

The build (CMake, through ``cmake/write_build_info.py``) records next to
``libepifuse_ops.so`` the torch it was compiled and linked against, the CUDA
toolkit, the GPU architectures and the git commit. Two readers need it:

* ``setup.py`` refuses to build a wheel without it (the wheel ships it);
* ``_library.load_library`` refuses, with an ImportError that names the torch
  to install, a library built against another torch (loading it would fail
  with an undefined C++ symbol, or worse, load and misbehave).

That import-time check is what holds the library to its torch: the wheel
itself requires plain ``torch`` (no version), so that installing it never
replaces the torch a user already has (setup.py).

Standard library only: setup.py loads this file by path, without importing
epifuse (which would load the library it is about to package).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

FILE_NAME = "build_info.json"


@dataclass(frozen=True)
class BuildInfo:
    torch_version: str  # torch.__version__ at build time, e.g. "2.14.1+cu130"
    torch_cuda: Optional[str]  # torch.version.cuda, e.g. "13.0"
    nvcc_version: Optional[str]  # the CUDA compiler that built the kernels
    archs: tuple[str, ...]  # EPIFUSE_ARCHS, e.g. ("80", "90a")
    git_commit: Optional[str]  # "abc1234" or "abc1234-dirty"; None outside a git checkout
    epifuse_version: Optional[str] = None

    @property
    def torch_public_version(self) -> str:
        return public_version(self.torch_version)

    def torch_requirement(self) -> str:
        """The torch to install for this library: the same release (any local build tag),
        as the ImportError of ``torch_mismatch`` names it.

        Local tags (+cu130, +cpu) are left out: PyPI's torch has none, and ``==2.14.1``
        matches ``2.14.1+cu130`` (PEP 440). The CUDA major version, which the tag would
        carry, is checked too (``torch_mismatch``) and named beside it. Not the wheel's
        requirement, which is plain ``torch`` (setup.py).
        """
        return f"torch=={self.torch_public_version}"

    def summary(self) -> str:
        """One line for logs: ``commit abc1234, torch 2.14.1+cu130 (CUDA 13.0), archs 80,90a``."""
        cuda = f" (CUDA {self.torch_cuda})" if self.torch_cuda else ""
        return (f"commit {self.git_commit or 'unknown'}, torch {self.torch_version}{cuda}, "
                f"archs {','.join(self.archs) or 'none'}")


def public_version(version: str) -> str:
    """``2.14.1+cu130`` -> ``2.14.1`` (PEP 440's public version)."""
    return version.split("+", 1)[0]


def _major(version: Optional[str]) -> Optional[str]:
    return version.split(".", 1)[0] if version else None


def path_in(lib_dir: Union[str, Path]) -> Path:
    return Path(lib_dir) / FILE_NAME


def read(lib_dir: Union[str, Path]) -> Optional[BuildInfo]:
    """The build info in ``lib_dir``; None if there is none (a build from before it existed).

    Raises ValueError when the file exists but is not a build record.
    """
    path = path_in(lib_dir)
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        return BuildInfo(torch_version=str(doc["torch_version"]),
                         torch_cuda=doc.get("torch_cuda"),
                         nvcc_version=doc.get("nvcc_version"),
                         archs=tuple(doc.get("archs") or ()),
                         git_commit=doc.get("git_commit"),
                         epifuse_version=doc.get("epifuse_version"))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"epifuse: {path} is not a valid build record ({e})") from None


def torch_mismatch(info: BuildInfo, torch_version: str, torch_cuda: Optional[str]) -> Optional[str]:
    """Why the library cannot run with this torch, or None when it can.

    The C++ ABI of libtorch changes between releases, so the release must be the one built
    against; the library links libcudart of the toolkit's major version and libtorch_cuda, so
    the CUDA major version must match too (and a CPU-only torch cannot load it).
    """
    built = f"torch {info.torch_version}"
    built += f" (CUDA {info.torch_cuda})" if info.torch_cuda else ""
    have = f"torch {torch_version}" + (f" (CUDA {torch_cuda})" if torch_cuda else " (no CUDA)")
    same_release = public_version(torch_version) == info.torch_public_version
    same_cuda = _major(torch_cuda) == _major(info.torch_cuda)
    if same_release and same_cuda:
        return None
    cuda_note = f", a CUDA {_major(info.torch_cuda)} build" if info.torch_cuda else ""
    return (f"epifuse's compiled library was built against {built}, but this Python has {have}. "
            f"It loads only with the torch it was built against: install "
            f"{info.torch_requirement()}{cuda_note}, or rebuild epifuse against this torch "
            f"(scripts/build.sh).")
