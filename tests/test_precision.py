"""The fp32 precision policy."""

from __future__ import annotations

import pytest
import torch

from epifuse.precision import resolve_precision, validate_precision


@pytest.fixture
def matmul_precision():
    """Set torch's fp32 matmul precision for one test, restoring it afterwards."""
    saved = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize("given,expected", [
    ("ieee", "ieee"), ("highest", "3xtf32"), ("3xtf32", "3xtf32"), ("tf32", "tf32"), ("high", "tf32"),
    ("medium", "tf32"),
])
def test_explicit_precision_for_float32(given, expected, matmul_precision):
    matmul_precision("high")  # an explicit choice ignores torch's setting...
    assert resolve_precision(given, torch.float32) == expected
    matmul_precision("highest")  # ...either way
    assert resolve_precision(given, torch.float32) == expected


@pytest.mark.parametrize("torch_setting,expected", [
    ("highest", "3xtf32"), ("high", "tf32"), ("medium", "tf32"),
])
def test_none_follows_torch(torch_setting, expected, matmul_precision):
    matmul_precision(torch_setting)
    assert resolve_precision(None, torch.float32) == expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("given", [None, "ieee", "3xtf32", "tf32"])
def test_16bit_inputs_have_no_precision(dtype, given):
    assert resolve_precision(given, dtype) == ""


@pytest.mark.parametrize("bad", ["fp32", "IEEE", "", 3])
def test_unknown_precision_raises(bad):
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision(bad, torch.float32)
    with pytest.raises(ValueError, match="unknown precision"):
        validate_precision(bad)


@pytest.mark.parametrize("number", [84, 39])
def test_model_new_validates_precision(number):
    from helpers import PROBLEMS, init_args

    with pytest.raises(ValueError, match="unknown precision"):
        PROBLEMS[number].ModelNew(*init_args(number, 8, 4), precision="double")
    assert PROBLEMS[number].ModelNew(*init_args(number, 8, 4), precision="high").precision == "tf32"
