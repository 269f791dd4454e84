"""The fold ops (``cpp/ops/fold.cpp``): float64 references and fake kernels."""

from __future__ import annotations

from .. import fold
from ..head_config import DEFAULT as _D
from ._registry import F64, fake, reference, vec_f32


@reference("bn_fold_train")
def _bn_fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, running_mean,
                   running_var, num_batches_tracked, *, momentum=_D.momentum, eps=_D.eps):
    f = fold.fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, eps)
    fold.update_running_stats(running_mean, running_var, num_batches_tracked, f.mean, f.var,
                              count, momentum)
    return f.a.float(), f.c.float(), fold.moments_vector(f.mean, f.var, count)


@reference("bn_fold_eval")
def _bn_fold_eval(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, *,
                  eps=_D.eps):
    f = fold.fold_eval(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, eps)
    return f.a.float(), f.c.float()


@reference("bn_fold_batch")
def _bn_fold_batch(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                   eps=_D.eps):
    f = fold.fold_train(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, eps)
    return f.a.float(), f.c.float(), fold.moments_vector(f.mean, f.var, count)


@reference("update_running_stats")
def _update_running_stats(moments, running_mean, running_var, num_batches_tracked, *,
                          momentum=_D.momentum):
    n = running_mean.shape[0]
    fold.update_running_stats(running_mean, running_var, num_batches_tracked, moments[:n],
                              moments[n:2 * n], moments[2 * n], momentum)


@fake("bn_fold_train")
def _bn_fold_train_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale,
                        running_mean, running_var, num_batches_tracked, *, momentum=_D.momentum,
                        eps=_D.eps):
    n = colsum.shape[0]
    return vec_f32(colsum, n), vec_f32(colsum, n), colsum.new_empty((2 * n + 1,), dtype=F64)


@fake("bn_fold_eval")
def _bn_fold_eval_fake(bias, gamma, beta, pre_scale, post_scale, running_mean, running_var, *,
                       eps=_D.eps):
    n = gamma.shape[0]
    return vec_f32(gamma, n), vec_f32(gamma, n)


@fake("bn_fold_batch")
def _bn_fold_batch_fake(colsum, colsumsq, count, bias, gamma, beta, pre_scale, post_scale, *,
                        eps=_D.eps):
    n = colsum.shape[0]
    return vec_f32(colsum, n), vec_f32(colsum, n), colsum.new_empty((2 * n + 1,), dtype=F64)


@fake("update_running_stats")
def _update_running_stats_fake(moments, running_mean, running_var, num_batches_tracked, *,
                               momentum=_D.momentum):
    return None
