"""The ops' CPU kernels refuse what the CUDA ops refuse, with the same exception and message.

Cases and patterns follow tests/test_errors.py's GPU op tests (cpp/ops/ops.cpp's
checks); a CPU kernel that accepted an int or float64 argument would let code
pass CI that fails on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from helpers import assert_row_op_rejects_bad_arguments

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def _vec(n, dtype=F32):
    return torch.rand(n, dtype=dtype) + 0.5


def _fold_args(n=3, count=5, dtype=F32):
    """bn_fold_train's (positional arguments, keyword settings)."""
    colsum = torch.rand(n, dtype=F64)
    stats = (torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype),
             torch.zeros((), dtype=torch.long))
    return ([colsum, colsum * colsum + 1, count, None, _vec(n, dtype), _vec(n, dtype), None, None,
             *stats], {"momentum": 0.1, "eps": 1e-5})


def _gemm_cases():
    x, w, a, c = torch.rand(5, 7), torch.rand(3, 7), _vec(3), _vec(3)
    return {
        "K-mismatch": ((x, torch.rand(3, 8), a, c, "ieee"), RuntimeError,
                       r"shapes cannot be multiplied \(5x7 and 8x3\)"),
        "dtype-mismatch": ((x, w.bfloat16(), a, c, "ieee"), RuntimeError,
                           r"same dtype.*Float.*BFloat16"),
        "a-length": ((x, w, _vec(4), c, "ieee"), RuntimeError, r"\ba\b.*\[3\].*\[4\]"),
        "c-length": ((x, w, a, _vec(2), "ieee"), RuntimeError, r"\bc\b.*\[3\].*\[2\]"),
        "a-float64": ((x, w, a.double(), c, "ieee"), RuntimeError, r"a to be float32.*Double"),
        "c-bf16": ((x, w, a, c.bfloat16(), "ieee"), RuntimeError, r"c to be float32.*BFloat16"),
        "precision-bogus": ((x, w, a, c, "bogus"), ValueError, r"precision.*bogus"),
        "fp32-no-precision": ((x, w, a, c, ""), ValueError, r"precision"),
        "int-x-and-w": ((x.int(), w.int(), a, c, "ieee"), RuntimeError,
                        r"not implemented for 'Int'"),
        "float64-x-and-w": ((x.double(), w.double(), a, c, "ieee"), RuntimeError,
                            r"not implemented for 'Double'"),
        "x-3d": ((x[None], w, a, c, "ieee"), RuntimeError, r"2-D"),
    }


@pytest.mark.parametrize("name", list(_gemm_cases()))
def test_gemm_affine_errors_cpu(name):
    args, exc, key = _gemm_cases()[name]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_affine(*args)


@pytest.mark.parametrize("name", ["K-mismatch", "dtype-mismatch", "precision-bogus",
                                  "int-x-and-w", "float64-x-and-w", "x-3d"])
def test_gemm_colstats_errors_cpu(name):
    (x, w, _, _, precision), exc, key = _gemm_cases()[name]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_colstats(x, w, precision)


@pytest.mark.parametrize("count", [1, 0, -3])
def test_bn_fold_train_rejects_small_count_cpu(count):
    args, kwargs = _fold_args(count=count)
    nbt, rv = args[10], args[9]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)
    assert nbt.item() == 0 and torch.equal(rv, torch.ones_like(rv)), "state changed on error"


_FOLD_VALUES = {
    "vec4": lambda: _vec(4), "vec3": lambda: _vec(3), "vec3-bf16": lambda: _vec(3, BF16),
    "vec3-f64": lambda: _vec(3, F64), "int32-scalar": lambda: torch.zeros((), dtype=torch.int32),
    "float-scalar": lambda: torch.zeros(()), "int-vec3": lambda: torch.ones(3, dtype=torch.long),
}


@pytest.mark.parametrize("name,index,value,exc,key", [
    ("gamma-length", 4, "vec4", RuntimeError, r"beta|gamma"),
    ("gamma-int", 4, "int-vec3", RuntimeError, r"not implemented for 'Long'|dtype"),
    ("beta-dtype", 5, "vec3-bf16", RuntimeError, r"beta to have dtype Float like gamma"),
    ("pre_scale-float64", 6, "vec3-f64", RuntimeError, r"pre_scale to have dtype"),
    ("running_mean-length", 8, "vec4", RuntimeError, r"running_mean"),
    ("running_var-dtype", 9, "vec3-f64", RuntimeError, r"running_var to have dtype"),
    ("nbt-dtype", 10, "int32-scalar", RuntimeError, r"num_batches_tracked.*int64"),
    ("nbt-float", 10, "float-scalar", RuntimeError, r"num_batches_tracked.*int64"),
    ("colsum-float32", 0, "vec3", RuntimeError, r"float64.*Float \[3\]"),
    ("colsumsq-length", 1, "vec4", RuntimeError, r"colsum"),
    ("momentum>1", "momentum", 1.5, ValueError, r"momentum must be in \[0, 1\].*1\.5"),
    ("eps<0", "eps", -1.0, ValueError, r"eps must be non-negative"),
])
def test_bn_fold_train_bad_arguments_cpu(name, index, value, exc, key):
    """index: a positional argument's, or a keyword setting's name."""
    args, kwargs = _fold_args()
    (kwargs if isinstance(index, str) else args)[index] = _FOLD_VALUES.get(value, lambda: value)()
    nbt = args[10]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)
    if name != "nbt-dtype" and name != "nbt-float":
        assert nbt.item() == 0, "running statistics updated although the call failed"


def test_bn_fold_eval_bad_arguments_cpu():
    args, _ = _fold_args()
    bias, gamma, beta, rm, rv = _vec(3), args[4], args[5], args[8], args[9]
    with pytest.raises(RuntimeError, match="running_var"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, None, rm, _vec(5), eps=1e-5)
    with pytest.raises(RuntimeError, match="post_scale"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, _vec(2), rm, rv, eps=1e-5)
    with pytest.raises(RuntimeError, match="bias to have dtype Float like gamma, got Double"):
        torch.ops.epifuse.bn_fold_eval(bias.double(), gamma, beta, None, None, rm, rv, eps=1e-5)
    with pytest.raises(RuntimeError, match="not implemented for 'Double'"):
        f64 = [t.double() for t in (bias, gamma, beta, rm, rv)]
        torch.ops.epifuse.bn_fold_eval(*f64[:3], None, None, *f64[3:], eps=1e-5)


@pytest.mark.parametrize("op", ["affine_softmax", "affine_softmax_", "affine_"])
def test_row_ops_bad_arguments_cpu(op):
    assert_row_op_rejects_bad_arguments(op, "cpu", [
        (lambda z, a, c: (z.int(), a, c), "not implemented for 'Int'"),
        (lambda z, a, c: (z.double(), a, c), "not implemented for 'Double'"),
        (lambda z, a, c: (z, a.double(), c), "a to be float32, got Double"),
    ])
