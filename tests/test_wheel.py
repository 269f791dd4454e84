"""The wheel built from python/ says what it is (CPU only; needs the built library).

Each wheel is built from a copy of python/ in a temporary folder, offline
(--no-build-isolation: the installed setuptools), so the checkout is never written.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import epifuse
from epifuse import _build_info

ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIR = ROOT / "python"
LIB_DIR = PYTHON_DIR / "epifuse" / "lib"
LIBRARY = LIB_DIR / "libepifuse_ops.so"

def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


# The offline build uses the installed setuptools; SPDX licenses need 77 (scripts/build.sh
# installs it).
needs_setuptools = pytest.mark.skipif(_setuptools_major() < 77,
                                      reason="setuptools >= 77 is not installed")
needs_build = pytest.mark.skipif(
    not LIBRARY.is_file() or _build_info.read(LIB_DIR) is None,
    reason="the checkout's python/epifuse/lib holds no built library with build_info.json "
           "(scripts/build.sh)")


def _copy_python(dest: Path, *, library: bool, build_info: bool) -> Path:
    tree = dest / "python"
    shutil.copytree(PYTHON_DIR, tree, ignore=shutil.ignore_patterns(
        "lib", "build", "*.egg-info", "__pycache__"))
    (tree / "epifuse" / "lib").mkdir()
    if library:  # a link: setuptools packages the file it points to, without a 26 MB copy
        os.symlink(LIBRARY, tree / "epifuse" / "lib" / LIBRARY.name)
    if build_info:
        shutil.copy(_build_info.path_in(LIB_DIR), tree / "epifuse" / "lib")
    return tree


def _pip_wheel(tree: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--no-cache-dir", "--disable-pip-version-check", str(tree), "-w", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PIP_NO_INDEX="1"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    out = _pip_wheel(_copy_python(tmp, library=True, build_info=True), tmp / "dist")
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = (tmp / "dist").glob("epifuse-*.whl")
    return path


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


@needs_setuptools
@needs_build
def test_wheel_is_tagged_for_this_platform(wheel):
    platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
    assert wheel.name == f"epifuse-{epifuse.__version__}-py3-none-{platform}.whl"
    with zipfile.ZipFile(wheel) as z:
        info = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: false" in info


@needs_setuptools
@needs_build
def test_wheel_pins_the_torch_it_was_built_against(wheel):
    info = _build_info.read(LIB_DIR)
    requires = _metadata(wheel).get_all("Requires-Dist")
    torch_reqs = [r for r in requires if r.split(";")[0].strip().startswith("torch")]
    assert torch_reqs == [f"torch=={_build_info.public_version(info.torch_version)}"]


@needs_setuptools
@needs_build
def test_wheel_declares_and_ships_its_license(wheel):
    meta = _metadata(wheel)
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Version"] == epifuse.__version__
    with zipfile.ZipFile(wheel) as z:
        (lic,) = [n for n in z.namelist() if n.endswith(".dist-info/licenses/LICENSE")]
        assert z.read(lic) == (ROOT / "LICENSE").read_bytes()


@needs_setuptools
@needs_build
def test_wheel_ships_the_library_its_record_and_py_typed(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert z.getinfo("epifuse/lib/libepifuse_ops.so").file_size == LIBRARY.stat().st_size
    assert {"epifuse/lib/build_info.json", "epifuse/py.typed", "epifuse/_version.py"} <= names


@needs_setuptools
@needs_build
def test_wheel_holds_the_library_not_the_benchmark(wheel):
    """The benchmark lives in the repository's benchmarks/, outside the package."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert not [n for n in names if "bench" in n.split("/")[0] or n.startswith("epifuse/bench")]
    assert all(n.startswith(("epifuse/", "epifuse-")) for n in names), names
    assert "bench" not in (_metadata(wheel).get_all("Provides-Extra") or [])


@needs_setuptools
def test_no_wheel_without_the_library(tmp_path):
    out = _pip_wheel(_copy_python(tmp_path, library=False, build_info=False), tmp_path / "dist")
    assert out.returncode != 0
    assert "libepifuse_ops.so is missing" in out.stdout + out.stderr
    assert "scripts/build.sh" in out.stdout + out.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


@needs_setuptools
@needs_build
def test_no_wheel_without_the_build_record(tmp_path):
    out = _pip_wheel(_copy_python(tmp_path, library=True, build_info=False), tmp_path / "dist")
    assert out.returncode != 0
    assert "build_info.json is missing" in out.stdout + out.stderr


def test_py_typed_and_license_are_in_the_checkout():
    assert (PYTHON_DIR / "epifuse" / "py.typed").is_file()
    assert (PYTHON_DIR / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()
