"""Synchronized batch statistics (``cpp/ops/synced.cpp``): the per-pass ops' float64 references
(composed of ``distributed.py`` and ``fold.py``) and every op's fake kernel. The two hooks
(``synced_batch_fold``, ``synced_grad_sums``) are C++ composites on every device: the passes
around one functional collective."""

from __future__ import annotations

import torch

from .. import distributed, fold
from ..head_config import DEFAULT as _D
from ._registry import F64, fake, reference, vec_f32


@reference("pack_moments")
def _pack_moments(colsum, colsumsq, count, bias, pre_scale):
    mean, var = fold.input_moments(colsum, colsumsq, count, bias, pre_scale, like=colsum)
    return distributed.pack_moments(count, mean, var * count)


@reference("merge_fold")
def _merge_fold(rows, bias, gamma, beta, pre_scale, post_scale, *, eps=_D.eps):
    merged = distributed.merge_moments(rows)
    f = fold.fold_batch(merged.mean, merged.var, bias, gamma, beta, pre_scale, post_scale, eps)
    return f.a.float(), f.c.float(), fold.moments_vector(merged.mean, merged.var, merged.count)


@reference("normalized_grad_sums")
def _normalized_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale, *, eps=_D.eps):
    return fold.normalized_grad_sums(sums, moments, bias, gamma, pre_scale, post_scale, eps)


@fake("pack_moments")
def _pack_moments_fake(colsum, colsumsq, count, bias, pre_scale):
    return colsum.new_empty((2 * colsum.shape[0] + 1,), dtype=F64)


def _fold_and_moments(like, n):
    return vec_f32(like, n), vec_f32(like, n), like.new_empty((2 * n + 1,), dtype=F64)


@fake("merge_fold")
def _merge_fold_fake(rows, bias, gamma, beta, pre_scale, post_scale, *, eps=_D.eps):
    return _fold_and_moments(gamma, gamma.shape[0])


@fake("normalized_grad_sums")
def _normalized_grad_sums_fake(sums, moments, bias, gamma, pre_scale, post_scale, *,
                               eps=_D.eps):
    return sums.new_empty((2 * gamma.shape[0] + 1,), dtype=F64)


@fake("synced_batch_fold")
def _synced_batch_fold_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                            eps=_D.eps, group_name=_D.group_name):
    return _fold_and_moments(colsum, colsum.shape[0])


@fake("synced_grad_sums")
def _synced_grad_sums_fake(sums, moments, bias, gamma, pre_scale, post_scale, *, eps=_D.eps,
                           group_name=_D.group_name):
    return torch.empty_like(sums)
