"""fold.py against nn.BatchNorm1d itself, in float64 (both problems, both modes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from epifuse import fold
from helpers import init_args, make_pair, scales

M, K, N = 24, 16, 8

CASES = [
    pytest.param(number, scale, id=f"p{number}-scale{'1' if scale == (1,) else 'N'}")
    for number in (84, 39) for scale in ((1,), (N,))
]


def _reference_pre_softmax(number, model, x):
    """The model's forward up to (not including) the softmax: what y = a*z + c must equal."""
    y = model.gemm(x)
    if number == 39:
        return model.bn(y * model.scale)
    return model.scale * model.bn(y)


def _folded(number, model, x, training, momentum):
    """a*z + c from the fold, updating a deep copy of the BN buffers like the ops do."""
    z = F.linear(x, model.gemm.weight)  # the GEMM has no bias: the fold adds it
    pre, post = scales(number, model)
    bn = model.bn
    if training:
        s1, s2 = fold.column_stats(z)
        f = fold.fold_train(s1, s2, x.shape[0], model.gemm.bias, bn.weight, bn.bias, pre, post,
                            bn.eps)
        fold.update_running_stats(bn.running_mean, bn.running_var, bn.num_batches_tracked,
                                  f.mean, f.var, x.shape[0], momentum)
    else:
        f = fold.fold_eval(model.gemm.bias, bn.weight, bn.bias, pre, post, bn.running_mean,
                           bn.running_var, bn.eps)
    assert f.a.dtype == f.c.dtype == torch.float64
    return f.a * z + f.c


@pytest.mark.parametrize("momentum", [0.1, 1.0, None], ids=["mom0.1", "mom1", "momNone"])
@pytest.mark.parametrize("number,scale", CASES)
@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centred", "offset1e3"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@torch.no_grad()
def test_fold_matches_batchnorm(number, scale, momentum, offset, with_bias):
    ref, _ = make_pair(number, init_args(number, K, N, scale, momentum=momentum))
    ref.double()
    if not with_bias:
        ref.gemm.bias = None
    folded = copy.deepcopy(ref)
    # E[z^2] - E[z]^2 (the contract's formula) loses log10((mean/std)^2) ~ 7 digits at offset 1e3.
    tol = 1e-9 if offset == 0.0 else 1e-7
    g = torch.Generator().manual_seed(3)
    # Three training steps (exercising the cumulative average when momentum is None), then eval.
    for step in range(3):
        x = torch.rand(M, K, generator=g, dtype=torch.float64) + offset
        expected = _reference_pre_softmax(number, ref.train(), x)
        got = _folded(number, folded, x, True, momentum)
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        torch.testing.assert_close(folded.bn.running_mean, ref.bn.running_mean, rtol=1e-12,
                                   atol=1e-12)
        torch.testing.assert_close(folded.bn.running_var, ref.bn.running_var, rtol=tol, atol=tol)
        assert folded.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item() == step + 1
    x = torch.rand(M, K, generator=g, dtype=torch.float64) + offset
    expected = _reference_pre_softmax(number, ref.eval(), x)
    torch.testing.assert_close(_folded(number, folded.eval(), x, False, momentum), expected,
                               rtol=tol, atol=tol)


def test_column_stats_in_float64():
    z = torch.randn(5, 3, dtype=torch.float32)
    s1, s2 = fold.column_stats(z)
    assert s1.dtype == s2.dtype == torch.float64
    torch.testing.assert_close(s1, z.double().sum(0))
    torch.testing.assert_close(s2, (z.double() ** 2).sum(0))


def test_constant_column_has_zero_variance():
    z = torch.full((7, 2), 3.0e4, dtype=torch.float64)
    mean, var = fold.batch_moments(*fold.column_stats(z), 7)
    assert torch.equal(var, torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(mean, torch.full((2,), 3.0e4, dtype=torch.float64))


@pytest.mark.parametrize("momentum,nbt,expected", [(0.1, 5, 0.1), (None, 0, 1.0), (None, 3, 0.25)],
                         ids=["mom0.1", "cumulative-first", "cumulative-fourth"])
def test_update_factor(momentum, nbt, expected):
    assert fold.update_factor(momentum, nbt) == expected


def test_update_needs_two_rows():
    rm, rv, nbt = torch.zeros(2), torch.ones(2), torch.tensor(0)
    with pytest.raises(ValueError, match="more than 1 value"):
        fold.update_running_stats(rm, rv, nbt, torch.zeros(2), torch.ones(2), 1, 0.1)
    assert nbt.item() == 0  # untouched, as nn.BatchNorm leaves it


def test_scale_of_wrong_size_is_rejected():
    with pytest.raises(ValueError, match="1 or 4 elements"):
        fold.fold_eval(None, torch.ones(4), torch.zeros(4), torch.ones(3), None,
                       torch.zeros(4), torch.ones(4), 1e-5)
