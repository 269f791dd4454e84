"""The ops' CPU kernels (the executable spec) and schemas, without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from epifuse import ops
from epifuse.head_config import DEFAULT, HeadConfig
from op_samples import DTYPES, all_cases, op, samples

CASES = [pytest.param(name, d, i, id=f"{name}-{d}-{i}") for name, d, i in all_cases()]


@pytest.mark.parametrize("name,dtype_id,index", CASES)
def test_opcheck_cpu(name, dtype_id, index):
    args, kwargs = samples("cpu", DTYPES[dtype_id])[name][index]
    torch.library.opcheck(op(name), args, kwargs)


@pytest.mark.parametrize("name,dtype_id,index", CASES)
def test_fake_kernel_matches_cpu_kernel(name, dtype_id, index):
    args, kwargs = samples("cpu", DTYPES[dtype_id])[name][index]
    real = op(name)(*copy.deepcopy(args), **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(name)(*fake_args, **kwargs)
    flat_real = real if isinstance(real, tuple) else (real,)
    flat_fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(flat_real, flat_fake, strict=True):
        if r is None:
            assert f is None
            continue
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


# The head ops' keyword-only settings, in schema order (cpp/ops/head_config.h's table).
HEAD_OP_SETTINGS = {
    "fused_head": HeadConfig._fields,
    "fused_head_backward": HeadConfig._fields,
    "bn_fold_train": ("momentum", "eps"),
    "bn_fold_eval": ("eps",),
    "bn_fold_batch": ("eps",),
    "head_grad_coefficients": ("training", "eps"),
    "synced_batch_fold": ("eps", "group_name"),
    "synced_grad_sums": ("eps", "group_name"),
}


@pytest.mark.parametrize("name", HEAD_OP_SETTINGS)
def test_head_op_settings_are_keyword_only_with_defaults(name):
    """Tensors (and counts, needs) positional; settings keyword-only, defaulted as HeadConfig."""
    arguments = getattr(torch.ops.epifuse, name).default._schema.arguments
    keyword = [a for a in arguments if a.kwarg_only]
    assert tuple(a.name for a in keyword) == HEAD_OP_SETTINGS[name]
    for a in keyword:
        assert a.has_default_value(), a.name
        assert a.default_value == getattr(DEFAULT, a.name), a.name
    assert not any(a.name in HeadConfig._fields for a in arguments if not a.kwarg_only)


def test_fused_head_defaults_are_head_config_defaults():
    g = torch.Generator().manual_seed(1)
    x, w = torch.rand(6, 5, generator=g), torch.rand(4, 5, generator=g)
    params = [torch.rand(4, generator=g) + 0.5 for _ in range(6)]
    tensors = (x, w, *params)
    by_default = torch.ops.epifuse.fused_head(*tensors)
    spelled_out = torch.ops.epifuse.fused_head(*tensors, **DEFAULT.kwargs())
    for a, b in zip(by_default, spelled_out, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError):  # settings are keyword-only
        torch.ops.epifuse.fused_head(*tensors, "ieee")


def test_gemm_affine_cpu_values():
    x, w = torch.randn(6, 5), torch.randn(4, 5)
    a, c = torch.randn(4), torch.randn(4)
    expected = a.double() * (x.double() @ w.double().T) + c.double()
    torch.testing.assert_close(ops.gemm_affine(x, w, a, c, "ieee"), expected.float())
    assert ops.gemm_affine(x.half(), w.half(), a, c, "").dtype == torch.float16


def test_gemm_colstats_cpu_values():
    x, w = torch.randn(6, 5), torch.randn(4, 5)
    z, s1, s2 = ops.gemm_colstats(x, w, "tf32")
    z64 = x.double() @ w.double().T
    torch.testing.assert_close(z, z64.float())
    assert s1.dtype == s2.dtype == torch.float64
    torch.testing.assert_close(s1, z64.sum(0))
    torch.testing.assert_close(s2, (z64 ** 2).sum(0))


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["mom0.1", "momNone"])
def test_bn_fold_train_cpu_matches_batchnorm1d(momentum, position):
    """Against nn.BatchNorm1d in float64 (not fold.py, which the CPU kernel itself calls)."""
    g = torch.Generator().manual_seed(3)
    m, n = 7, 5
    z = torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 2
    bias, gamma, beta = (torch.randn(n, generator=g) for _ in range(3))
    scale = torch.rand(n, generator=g) + 0.5
    bn = torch.nn.BatchNorm1d(n, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(gamma), bn.bias.copy_(beta)
        bn.running_mean.copy_(torch.randn(n, generator=g)), bn.running_var.uniform_(0.5, 2)
        bn.num_batches_tracked.fill_(4)
    rm, rv, nbt = bn.running_mean.float(), bn.running_var.float(), bn.num_batches_tracked.clone()
    pre, post = (scale, None) if position == "pre" else (None, scale)
    a, c = ops.bn_fold_train(z.sum(0), (z * z).sum(0), m, bias, gamma, beta, pre, post, rm, rv,
                             nbt, momentum=momentum, eps=bn.eps)
    u = (z + bias.double()) * (scale.double() if pre is not None else 1)
    with torch.no_grad():
        expected = bn.train()(u) * (scale.double() if post is not None else 1)
    assert a.dtype == c.dtype == torch.float32
    torch.testing.assert_close(a.double() * z + c.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rm, bn.running_mean.float())
    torch.testing.assert_close(rv, bn.running_var.float())
    assert nbt.item() == bn.num_batches_tracked.item() == 5


def test_bn_fold_eval_cpu_values():
    n = 3
    bias, gamma, beta, scale = torch.randn(n), torch.rand(n) + 0.5, torch.randn(n), torch.rand(n) + 1
    rm, rv = torch.randn(n), torch.rand(n) + 0.5
    a, c = ops.bn_fold_eval(bias, gamma, beta, scale, None, rm, rv, eps=1e-5)
    z = torch.randn(4, n, dtype=torch.float64)
    expected = torch.nn.functional.batch_norm(
        (z + bias.double()) * scale.double(), rm.double(), rv.double(), gamma.double(),
        beta.double(), False, 0.0, 1e-5)
    torch.testing.assert_close(a.double() * z + c.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_affine", [True, False], ids=["affine", "plain"])
def test_affine_softmax_cpu_values(with_affine):
    z = torch.randn(4, 9)
    a, c = (torch.randn(9), torch.randn(9)) if with_affine else (None, None)
    expected = torch.softmax(z * a + c if with_affine else z, dim=1)
    torch.testing.assert_close(ops.affine_softmax(z, a, c), expected)
    inplace = z.clone()
    assert ops.affine_softmax_(inplace, a, c) is None
    torch.testing.assert_close(inplace, expected)


def test_affine_inplace_cpu_values():
    z, a, c = torch.randn(4, 9).bfloat16(), torch.randn(9), torch.randn(9)
    expected = (z.double() * a.double() + c.double()).bfloat16()
    ops.affine_(z, a, c)
    assert torch.equal(z, expected)


def test_bad_precision_string_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        ops.gemm_affine(torch.randn(2, 3), torch.randn(4, 3), torch.ones(4), torch.zeros(4), "fp64")
