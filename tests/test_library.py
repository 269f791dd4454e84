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
