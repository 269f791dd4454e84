"""What pyproject.toml cannot say statically: this wheel holds a compiled library.

* The library (``epifuse/lib/libepifuse_ops.so``) is built by CMake at the
  repository root (scripts/build.sh). Without it, or without the
  ``build_info.json`` the build writes beside it, there is nothing true to
  package: the build stops here instead of producing a wheel that cannot be
  imported.
* The library links libtorch and libcudart of the torch it was built against.
  The wheel nevertheless requires plain ``torch`` (pyproject.toml), without a
  version: a pin would make ``pip install epifuse-*.whl`` replace the user's
  torch with another release (and another CUDA build), silently, for every
  package in that environment. Which torch the library needs is recorded in
  ``epifuse/lib/build_info.json``, shipped in the wheel; ``import epifuse``
  checks the installed torch against it before loading the library and, on a
  mismatch, raises an ImportError naming the torch to install (or: rebuild).
* The library is a binary for this platform but does not use Python's C API
  (it is loaded with ``torch.ops.load_library``): the wheel is tagged
  ``py3-none-<platform>`` rather than ``py3-none-any``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
LIB_DIR = HERE / "epifuse" / "lib"
LIBRARY = LIB_DIR / "libepifuse_ops.so"


def _load_build_info_module():
    # By path: importing the epifuse package would load the library it is about to package.
    spec = importlib.util.spec_from_file_location("_epifuse_build_info",
                                                  HERE / "epifuse" / "_build_info.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_build() -> None:
    """Stop unless the library and the record of the torch it was built against are here."""
    build_info = _load_build_info_module()
    if not LIBRARY.is_file():
        raise SystemExit(
            f"epifuse: {LIBRARY} is missing: the wheel would not be importable. Build the library "
            "first, at the repository root: scripts/build.sh (or cmake -S . -B build -G Ninja && "
            "cmake --build build), then build the wheel again (pip wheel ./python).")
    if build_info.read(LIB_DIR) is None:
        raise SystemExit(
            f"epifuse: {build_info.path_in(LIB_DIR)} is missing: the library's build did not "
            "record the torch it was built against, which import epifuse checks. Rebuild with "
            "scripts/build.sh (cmake --build build writes it).")


class BinaryDistribution(Distribution):
    """A distribution with a compiled part: platlib, and a platform-tagged wheel."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


check_build()
setup(
    distclass=BinaryDistribution,
    cmdclass={"bdist_wheel": PlatformWheel},
)
