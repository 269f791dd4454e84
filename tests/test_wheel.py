"""The wheel built from python/ says what it is (CPU only; needs the built library).

It requires ``torch`` without a version, so that installing it never replaces the user's torch;
``import epifuse`` checks the torch the library was built against (build_info.json, shipped).

Each wheel is built from a copy of python/ in a temporary folder, offline
(--no-build-isolation: the installed setuptools), so the checkout is never written.
"""

from __future__ import annotations

import email.parser
import json
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
def _pip_version() -> tuple[int, ...]:
    from importlib.metadata import version
    return tuple(int(p) for p in re.findall(r"\d+", version("pip"))[:2])


# pip install --dry-run --report: pip 22.2
needs_pip_report = pytest.mark.skipif(_pip_version() < (22, 2),
                                      reason="pip < 22.2 has no install --dry-run --report")
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


def _torch_requirements(wheel: Path) -> list[str]:
    requires = _metadata(wheel).get_all("Requires-Dist") or []
    return [r for r in requires if r.split(";")[0].strip().startswith("torch")]


@needs_setuptools
@needs_build
def test_wheel_requires_torch_without_a_version(wheel):
    """A pin would make pip replace the user's torch; import epifuse checks the release instead
    (test_library: test_import_epifuse_names_the_torch_it_needs)."""
    assert _torch_requirements(wheel) == ["torch"]
    with zipfile.ZipFile(wheel) as z:  # what the import check reads ships with the library
        shipped = z.read("epifuse/lib/build_info.json").decode()
    assert shipped == _build_info.path_in(LIB_DIR).read_text()


@needs_setuptools
@needs_build
@needs_pip_report
def test_installing_a_wheel_built_for_another_torch_keeps_the_installed_torch(tmp_path):
    """pip's plan for a wheel whose library records another torch release: install epifuse, and
    nothing else (offline, a dry run: the environment is not changed)."""
    tree = _copy_python(tmp_path, library=True, build_info=False)
    (tree / "epifuse" / "lib" / _build_info.FILE_NAME).write_text(json.dumps(
        {"torch_version": "1.13.0+cu117", "torch_cuda": "11.7", "archs": ["90a"]}))
    # A version no installed epifuse has (scripts/build.sh installs this checkout's): pip then
    # plans to install the wheel and resolves its requirements, instead of finding it satisfied.
    (tree / "epifuse" / "_version.py").write_text(
        f'__version__ = "{_build_info.public_version(epifuse.__version__)}+other"\n')
    out = _pip_wheel(tree, tmp_path / "dist")
    assert out.returncode == 0, out.stdout + out.stderr
    (path,) = (tmp_path / "dist").glob("epifuse-*.whl")
    assert _torch_requirements(path) == ["torch"]
    report = tmp_path / "report.json"
    plan = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
         "--disable-pip-version-check", "--report", str(report), str(path)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PIP_NO_INDEX="1"))
    assert plan.returncode == 0, plan.stdout + plan.stderr
    planned = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert planned == ["epifuse"]


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
