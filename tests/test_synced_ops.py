"""The ops of synchronized batch statistics: pack_moments, merge_fold, normalized_grad_sums.

Everywhere: the ops on CPU tensors (their float64 references, composed of distributed.py and
fold.py, behind the C++ op's checks) against independent oracles: rows packed from column sums and
merged give what BatchNorm computes over the concatenated batch, a packed row is the reference
path's local_moments, the normalized sums are their definition. Marked `hopper`: each CUDA kernel
against its CPU kernel on random rows (empty ranks, unequal counts, one rank, large means, several
blocks of columns, no column).
Bad arguments: tests/test_errors.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epifuse import distributed, fold, ops
from helpers import rel_err

CUDA = torch.device("cuda")
F64 = torch.float64
EPS = 1e-3


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _params(n, dtype, gen, *, bias=True, pre="n", post="1"):
    """(bias, gamma, beta, pre_scale, post_scale) on CPU; a scale: "n" elements, "1" or None."""
    def vec(size, lo, hi):
        return (torch.rand(size, generator=gen, dtype=F64) * (hi - lo) + lo).to(dtype)

    def scale(kind):
        return None if kind is None else vec(n if kind == "n" else 1, 0.5, 2.0)

    return (vec(n, -1.0, 1.0) if bias else None, vec(n, 0.5, 1.5), vec(n, -1.0, 1.0), scale(pre),
            scale(post))


def _rank_rows(chunks, bias, pre_scale):
    """The rows the ranks send: pack_moments of the column sums on a rank with rows (the fused
    path), local_moments on an empty one (the reference path's zeros)."""
    rows = []
    for z in chunks:
        if z.shape[0] == 0:
            u = torch.empty(0, z.shape[1], dtype=F64)
            rows.append(distributed.local_moments(u))
            continue
        colsum, colsumsq = fold.column_stats(z)
        rows.append(ops.pack_moments(colsum, colsumsq, z.shape[0], bias, pre_scale))
    return torch.stack(rows)


# --------------------------------------------------------------------------- CPU kernels

@pytest.mark.parametrize("sizes", [(7, 0, 1, 32), (12,), (0, 5, 9)],
                         ids=["unequal-empty-one", "one-rank", "empty-first"])
@pytest.mark.parametrize("scales", [("n", None), (None, "1"), (None, None)],
                         ids=["pre", "post", "none"])
def test_merged_fold_is_batch_norm_over_the_concatenated_batch(sizes, scales):
    """a * z + c over every rank's rows is post * BatchNorm(pre * (z + bias)) of their
    concatenation, and moments are its batch statistics with the total count."""
    gen = _generator(sum(sizes))
    n = 5
    bias, gamma, beta, pre, post = _params(n, torch.float32, gen, pre=scales[0], post=scales[1])
    chunks = [torch.randn(m, n, generator=gen, dtype=F64) * 3 + 50 for m in sizes]
    a, c, moments = ops.merge_fold(_rank_rows(chunks, bias, pre), bias, gamma, beta, pre,
                                          post, eps=EPS)
    z = torch.cat(chunks)
    u = (z + bias.double()) * (1.0 if pre is None else pre.double())
    y = F.batch_norm(u, None, None, gamma.double(), beta.double(), True, 0.0, EPS)
    y = y * (1.0 if post is None else post.double())
    assert (a.dtype, c.dtype, moments.dtype) == (torch.float32, torch.float32, F64)
    assert rel_err(a.double() * z + c.double(), y) <= 1e-6
    expected = fold.moments_vector(u.mean(0), u.var(0, unbiased=False), z.shape[0])
    torch.testing.assert_close(moments, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("count", [1, 9])
@pytest.mark.parametrize("with_bias,pre", [(True, "n"), (False, "1"), (True, None), (False, None)])
def test_packed_row_is_the_reference_paths_row(count, with_bias, pre):
    """pack_moments from column sums == distributed.local_moments of u (what a rank on the
    reference path sends)."""
    gen = _generator(count)
    n = 4
    bias, _, _, pre_scale, _ = _params(n, torch.float32, gen, bias=with_bias, pre=pre)
    z = torch.randn(count, n, generator=gen, dtype=F64) + 5
    colsum, colsumsq = fold.column_stats(z)
    row = ops.pack_moments(colsum, colsumsq, count, bias, pre_scale)
    u = (z + (0.0 if bias is None else bias.double())) * (
        1.0 if pre_scale is None else pre_scale.double())
    torch.testing.assert_close(row, distributed.local_moments(u), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pre,post", [("n", None), (None, "n"), ("1", "1")])
def test_normalized_grad_sums_are_sums_of_dy_and_dy_times_yhat(pre, post):
    """[sum dy, sum dy * yhat, M] with dy = post * dv and yhat the normalized input, from the
    column sums head_grad_sums returns."""
    gen = _generator(3)
    m, n = 11, 6
    bias, gamma, _, pre_scale, post_scale = _params(n, torch.float32, gen, pre=pre, post=post)
    z = torch.randn(m, n, generator=gen, dtype=F64) + 2
    dv = torch.randn(m, n, generator=gen, dtype=F64)
    u = (z + bias.double()) * (1.0 if pre_scale is None else pre_scale.double())
    mean, var = u.mean(0), u.var(0, unbiased=False)
    moments = fold.moments_vector(mean, var, m)
    got = ops.normalized_grad_sums(fold.grad_sums(dv, None, z), moments, bias, gamma,
                                          pre_scale, post_scale, eps=EPS)
    dy = dv * (1.0 if post_scale is None else post_scale.double())
    yhat = (u - mean) / torch.sqrt(var + EPS)
    expected = torch.cat([dy.sum(0), (dy * yhat).sum(0), torch.tensor([float(m)], dtype=F64)])
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- CUDA against CPU

def _random_rows(counts, n, offset, gen):
    """Gathered rows [count, mean, M2] of ranks with these counts (count 0: zeros)."""
    rows = []
    for count in counts:
        mean = (torch.randn(n, generator=gen, dtype=F64) * 3 + offset) * (count > 0)
        m2 = torch.rand(n, generator=gen, dtype=F64) * 4 * count
        rows.append(torch.cat([torch.tensor([float(count)], dtype=F64), mean, m2]))
    return torch.stack(rows)


def _on_cuda_and_cpu(name, args, kwargs):
    """The op's outputs on CUDA (copied back) and from its CPU kernel, as tuples."""
    op = getattr(torch.ops.epifuse, name)
    on_cuda = [a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args]
    got, want = op(*on_cuda, **kwargs), op(*args, **kwargs)
    got, want = (o if isinstance(o, tuple) else (o,) for o in (got, want))
    assert all(g.device.type == CUDA.type for g in got)
    assert [(g.dtype, g.shape) for g in got] == [(w.dtype, w.shape) for w in want]
    return [g.cpu() for g in got], list(want)


def _assert_close_by_part(got, want, sizes, rtol):
    """A float64 vector compared part by part (e.g. mean, variance, count), each by its norm:
    a part of small values next to one of large values (variances next to means of 1e6) is held
    to its own scale."""
    for g, w in zip(got.split(sizes), want.split(sizes), strict=True):
        assert rel_err(g, w) <= rtol, (g, w)


MERGE_CASES = [
    pytest.param((7, 0, 1, 32), 5, 0.0, id="unequal-empty-one"),
    pytest.param((16,), 5, 0.0, id="one-rank"),
    pytest.param((0, 0, 3), 1000, 0.0, id="two-empty"),
    pytest.param((9, 4, 30, 2), 70000, 0.0, id="many-blocks"),
    pytest.param((7, 12, 1), 5, 1e6, id="large-means"),  # M2 about the merged mean: no cancellation
    pytest.param((3, 4), 0, 0.0, id="no-column"),
]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,n,offset", MERGE_CASES)
def test_merge_fold_cuda_matches_cpu(counts, n, offset, dtype):
    gen = _generator(n + len(counts))
    rows = _random_rows(counts, n, offset, gen)
    bias, gamma, beta, pre, post = _params(n, dtype, gen, pre="n", post="1")
    for args, kwargs in (([rows, bias, gamma, beta, pre, post], {"eps": EPS}),
                         ([rows, None, gamma, beta, None, None], {})):  # the default eps
        (a, c, moments), (a_cpu, c_cpu, moments_cpu) = _on_cuda_and_cpu("merge_fold", args, kwargs)
        assert rel_err(a, a_cpu) <= 1e-6 and rel_err(c, c_cpu) <= 1e-6
        # Deviations from a merged mean of 1e6 carry its rounding (ulp(1e6) ~ 1e-10).
        _assert_close_by_part(moments, moments_cpu, [n, n, 1], 1e-9 if offset else 1e-12)


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,count", [(5, 1), (5, 9), (70000, 300), (0, 4)])
@pytest.mark.parametrize("with_bias,pre", [(True, "n"), (False, "1"), (False, None)])
def test_pack_moments_cuda_matches_cpu(n, count, with_bias, pre, dtype):
    gen = _generator(n + count)
    bias, _, _, pre_scale, _ = _params(n, dtype, gen, bias=with_bias, pre=pre)
    z = torch.randn(count, n, generator=gen, dtype=F64) + 3
    colsum, colsumsq = fold.column_stats(z)
    (row,), (row_cpu,) = _on_cuda_and_cpu("pack_moments",
                                          [colsum, colsumsq, count, bias, pre_scale], {})
    # One row (count 1): M2 cancels to exactly 0 on both (the kernel rounds mean^2 on its own).
    _assert_close_by_part(row, row_cpu, [1, n, n], 1e-12)


@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [6, 70000, 0])
@pytest.mark.parametrize("pre,post", [("n", None), (None, "1"), ("1", "n")])
def test_normalized_grad_sums_cuda_matches_cpu(n, pre, post, dtype):
    gen = _generator(n + 1)
    bias, gamma, _, pre_scale, post_scale = _params(n, dtype, gen, pre=pre, post=post)
    rows = torch.tensor([13.0], dtype=F64)
    sums = torch.cat([torch.randn(2 * n, generator=gen, dtype=F64), rows])
    moments = torch.cat([torch.randn(n, generator=gen, dtype=F64),
                         torch.rand(n, generator=gen, dtype=F64) + 0.5, rows])
    (got,), (want,) = _on_cuda_and_cpu(
        "normalized_grad_sums", [sums, moments, bias, gamma, pre_scale, post_scale], {"eps": EPS})
    _assert_close_by_part(got, want, [n, n, 1], 1e-12)
