"""Loading the compiled op library."""

from __future__ import annotations

import pytest
import torch

from epifuse import _library, ops


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
