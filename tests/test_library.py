"""Loading the compiled op library."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epifuse import _build_info, _library, ops


def test_missing_library_names_the_build_command(tmp_path):
    missing = tmp_path / "lib" / _library.LIBRARY_NAME
    with pytest.raises(ImportError) as info:
        _library.load_library(missing)
    message = str(info.value)
    assert f"compiled library not found at {missing}" in message
    assert "scripts/build.sh" in message
    assert "cmake -S . -B build -G Ninja && cmake --build build && pip install ./python" in message


def test_default_path_is_inside_the_package():
    path = _library.default_library_path()
    assert path.name == "libepifuse_ops.so"
    assert path.parent.name == "lib" and path.parent.parent.name == "epifuse"


def test_loading_twice_is_harmless():
    assert _library.load_library() == _library.default_library_path()


@pytest.mark.parametrize("name", ops.OP_NAMES)
def test_every_op_is_registered(name):
    namespace, op = name.split("::")
    assert hasattr(getattr(torch.ops, namespace), op)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")


def test_built_archs_are_compute_capabilities():
    archs = ops.built_archs()
    assert archs, "the library names no GPU architecture"
    for arch in archs:
        digits = arch[:-1] if arch.endswith("a") else arch
        assert digits.isdigit() and int(digits) >= 80, arch


def _runs_on(arch: str, major: int, minor: int) -> bool:
    """The rule CUDA applies to SASS: 'XY' runs on X.Y and later minors of X; 'XYa' on X.Y only."""
    specific = arch.endswith("a")
    digits = arch[:-1] if specific else arch
    a_major, a_minor = int(digits[:-1]), int(digits[-1])
    return a_major == major and (a_minor == minor if specific else a_minor <= minor)


@pytest.mark.parametrize("cc", [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)],
                         ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
def test_supports_device_follows_the_built_archs(cc):
    expected = any(_runs_on(a, *cc) for a in ops.built_archs())
    assert torch.ops.epifuse.supports_device(*cc) == expected


def test_unsupported_gpu_is_reported_with_the_rebuild_flag(monkeypatch):
    """A GPU the build has no kernels for: the reason names it, the build, and the CMake flag."""
    monkeypatch.setattr(ops, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 5))
    reason = ops.device_unsupported_reason(0)
    assert reason is not None and "sm_75" in reason and "-DEPIFUSE_ARCHS=75" in reason
    assert all(f"sm_{a}" in reason for a in ops.built_archs())


def test_supported_gpu_has_no_reason(monkeypatch):
    arch = ops.built_archs()[0]
    digits = arch[:-1] if arch.endswith("a") else arch
    monkeypatch.setattr(ops, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index=None: (int(digits[:-1]), int(digits[-1])))
    assert ops.device_unsupported_reason(0) is None


# --------------------------------------------------------------------------- the torch check


def _lib_dir(tmp_path, torch_version: str, torch_cuda) -> Path:
    """A library folder whose .so is not a library at all, recorded as built for a torch."""
    import json

    lib = tmp_path / "lib"
    lib.mkdir(parents=True)
    (lib / _library.LIBRARY_NAME).write_bytes(b"not an ELF file")
    (lib / _build_info.FILE_NAME).write_text(json.dumps(
        {"torch_version": torch_version, "torch_cuda": torch_cuda, "archs": ["90a"]}))
    return lib


def test_other_torch_release_is_refused_before_loading(tmp_path):
    """The check runs first: loading this .so would raise OSError instead of ImportError."""
    lib = _lib_dir(tmp_path, "1.13.0+cu117", "11.7")
    with pytest.raises(_library.TorchMismatchError) as info:
        _library.load_library(lib / _library.LIBRARY_NAME)
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    assert "built against torch 1.13.0+cu117 (CUDA 11.7)" in message
    assert f"this Python has torch {torch.__version__}" in message
    assert "install torch==1.13.0, a CUDA 11 build" in message and "scripts/build.sh" in message


def test_same_release_for_another_cuda_major_is_refused(tmp_path):
    other_cuda = "12.8" if (torch.version.cuda or "").split(".")[0] != "12" else "13.0"
    lib = _lib_dir(tmp_path, torch.__version__, other_cuda)
    with pytest.raises(_library.TorchMismatchError, match=f"CUDA {other_cuda}"):
        _library.check_torch(lib)


@pytest.mark.parametrize("have,cuda,ok", [
    ("2.14.1+cu130", "13.0", True),
    ("2.14.1", "13.2", True),        # PyPI's spelling of the same build: local tags do not matter
    ("2.14.0+cu130", "13.0", False),
    ("2.14.1+cu128", "12.8", False),
    ("2.14.1+cpu", None, False),     # a CPU-only torch cannot load a library linked to CUDA
])
def test_torch_mismatch_rule(have, cuda, ok):
    info = _build_info.BuildInfo(torch_version="2.14.1+cu130", torch_cuda="13.0",
                                 nvcc_version="13.0", archs=("90a",), git_commit=None)
    assert (_build_info.torch_mismatch(info, have, cuda) is None) == ok
    assert info.torch_requirement() == "torch==2.14.1"


def test_library_without_build_record_is_not_checked(tmp_path):
    lib = _lib_dir(tmp_path, "0", None)
    (lib / _build_info.FILE_NAME).unlink()
    _library.check_torch(lib)  # a build from before the record existed still imports


def test_malformed_build_record_is_an_error(tmp_path):
    lib = _lib_dir(tmp_path, "0", None)
    (lib / _build_info.FILE_NAME).write_text("{}")
    with pytest.raises(ValueError, match="not a valid build record"):
        _library.check_torch(lib)


def test_import_epifuse_names_the_torch_it_needs(tmp_path):
    """End to end: `import epifuse` from a package whose library was built for another torch."""
    import epifuse

    package = tmp_path / "epifuse"
    shutil.copytree(Path(epifuse.__file__).parent, package,
                    ignore=shutil.ignore_patterns("lib", "__pycache__"))
    lib = _lib_dir(tmp_path / "x", "1.13.0", "11.7")
    shutil.copytree(lib, package / "lib")
    out = subprocess.run([sys.executable, "-c", "import epifuse"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "TorchMismatchError" in out.stderr and "install torch==1.13.0" in out.stderr


def test_this_build_recorded_this_torch_and_its_archs():
    info = _build_info.read(_library.default_library_path().parent)
    if info is None:
        pytest.skip("the loaded library has no build_info.json (built before it was recorded)")
    assert _build_info.torch_mismatch(info, torch.__version__, torch.version.cuda) is None
    assert sorted(info.archs) == sorted(ops.built_archs())
