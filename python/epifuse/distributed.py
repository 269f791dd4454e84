"""Synchronized batch statistics for data-parallel training (torch.distributed).

With ``sync_batchnorm=True`` (or after ``convert_sync_batchnorm``) a head in
training mode normalizes with the statistics of the union of all ranks'
batches, as ``nn.SyncBatchNorm`` does:

  fused:     epifuse::fused_head (cpp/ops/head.cpp) with the group's name: gemm_colstats
             -> pack_moments (local count, mean, M2 of u) -> all_gather -> merge_fold (merge
             and fold in one kernel) -> update_running_stats (global count on device)
             -> affine[_softmax]. The synced_batch_fold hook between the GEMM and the apply
             pass is C++ on every device (cpp/ops/synced.cpp: no Python there).
  reference: linear (-> scale) -> the same local moments -> all_gather -> merge
             -> normalize (-> scale) (-> softmax), in plain PyTorch ops

u is BatchNorm's input (``pre * (z + bias)``). Each rank sends one float64
row ``[count, mean(N), M2(N)]``; the rows are merged with the parallel-variance
formula (Chan et al.) in float64, so unequal and empty batches are weighted
exactly and no ``E[u²] - E[u]²`` cancellation happens across ranks. Every
rank merges the same gathered rows the same way, so all ranks end with
identical running statistics.

Backward is nn.SyncBatchNorm's: the input gradient uses sums over all ranks'
rows, the BatchNorm weight/bias gradients stay local (DDP averages them). Both
paths all-reduce the same ``[N] + [N] + 1`` float64 row (``fold.normalized_grad_sums``):
the sums of dy and dy·yhat, dy the gradient at BatchNorm's output (nn.SyncBatchNorm's
sums of dy and dy·(u - mean), the latter times invstd), and the row count; each rank
then scales the batch terms by its own BatchNorm weight, as nn.SyncBatchNorm does.
The fused backward (fused_head_backward, via the synced_grad_sums hook: the
normalized_grad_sums op, then the all_reduce, from C++) forms the row from its column
sums, the reference path (``_SyncedNormalize``) from its own.

Every rank issues the same collectives in the same order whichever path it
takes (one all_gather in the forward, one all_reduce in the backward), so a
rank whose batch is empty or of one row (reference path) can train beside
ranks on the fused path. They are the same calls, too: ``gather_moments`` and
``sum_over_ranks`` run the functional collectives (``_c10d_functional``) that the fused path's
CUDA kernels call from C++, with rows of the same size.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import fold

_F64 = torch.float64


class BatchMoments(NamedTuple):
    """Moments of u over the rows of all ranks' batches, float64 on the device."""

    count: Tensor  # 0-d: total number of rows
    mean: Tensor  # [N]
    var: Tensor  # [N], biased (what BatchNorm normalizes with)


# --------------------------------------------------------------------------- when to sync

def configure_sync_batchnorm(module: nn.Module, sync_batchnorm: bool,
                             process_group: Optional["dist.ProcessGroup"]) -> None:
    """Validate and store a head's synchronization settings (ModelNew's keywords)."""
    if not isinstance(sync_batchnorm, bool):
        raise TypeError(f"sync_batchnorm must be a bool, got {type(sync_batchnorm).__name__}")
    if process_group is not None and not sync_batchnorm:
        raise ValueError("process_group is only used with sync_batchnorm=True")
    module.sync_batchnorm = sync_batchnorm
    module.process_group = process_group


def convert_sync_batchnorm(module: nn.Module,
                           process_group: Optional["dist.ProcessGroup"] = None) -> nn.Module:
    """Turn on synchronized batch statistics in every epifuse head of ``module``.

    Like ``nn.SyncBatchNorm.convert_sync_batchnorm`` (same arguments; the
    module is changed in place and returned). Other BatchNorm layers are left
    alone: convert them with ``nn.SyncBatchNorm.convert_sync_batchnorm``,
    which can also be applied to the whole model, epifuse heads included
    (a head whose ``bn`` is an ``nn.SyncBatchNorm`` synchronizes over its
    ``process_group``). Warns (UserWarning) when the model holds no epifuse
    head, naming the BatchNorm layers it found instead.
    """
    converted = 0
    for head_module in _heads(module):
        configure_sync_batchnorm(head_module, True, process_group)
        converted += 1
    if converted == 0:
        warnings.warn(_nothing_converted_message(module), UserWarning, stacklevel=2)
    return module


def _is_head(module: nn.Module) -> bool:
    return isinstance(getattr(module, "sync_batchnorm", None), bool) and hasattr(module, "bn")


def _heads(module: nn.Module):
    """Every epifuse head in module: submodules, and the chains epifuse.fuse attached to a
    module's forward (``_epifuse_heads``: not submodules, so containers keep their indices)."""
    seen: set[int] = set()
    for m in module.modules():
        for h in (m, *m.__dict__.get("_epifuse_heads", ())):
            if id(h) not in seen and _is_head(h):
                seen.add(id(h))
                yield h


def _nothing_converted_message(module: nn.Module) -> str:
    """Names the BatchNorm layers found (if any), since the user probably expected them."""
    norms = [(name or "<root>", type(m).__name__) for name, m in module.named_modules()
             if isinstance(m, nn.modules.batchnorm._NormBase)]
    found = ("it holds no BatchNorm layer" if not norms else
             "it holds " + ", ".join(f"{kind} '{name}'" for name, kind in norms[:5])
             + (f" and {len(norms) - 5} more" if len(norms) > 5 else "")
             + ", none of them in an epifuse head")
    return (f"epifuse.convert_sync_batchnorm converted nothing: {type(module).__name__} contains "
            f"no epifuse head ({found}). Run epifuse.fuse(model) first to turn "
            f"Linear -> BatchNorm1d chains into heads, or use "
            f"nn.SyncBatchNorm.convert_sync_batchnorm for plain BatchNorm layers.")


_NOT_REQUESTED = object()


def _requested_group(module: nn.Module, bn: nn.Module):
    """The group a head asks to synchronize over (None: WORLD), or _NOT_REQUESTED."""
    if getattr(module, "sync_batchnorm", False):
        return module.process_group
    if isinstance(bn, nn.SyncBatchNorm):  # nn.SyncBatchNorm.convert_sync_batchnorm
        return bn.process_group
    return _NOT_REQUESTED


def sync_group(module: nn.Module, bn: Optional[nn.Module] = None) -> Optional["dist.ProcessGroup"]:
    """The process group to synchronize ``module``'s batch statistics over, or None.

    nn.SyncBatchNorm's rule: only in training mode, with torch.distributed
    available and initialized, and a group of more than one rank; otherwise
    the head behaves exactly as without synchronization. ``bn``: the head's
    BatchNorm where the caller has looked it up already (else ``module.bn``).
    """
    bn = module.bn if bn is None else bn
    requested = _requested_group(module, bn)
    if requested is _NOT_REQUESTED or not bn.training:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = requested if requested is not None else dist.group.WORLD
    return group if dist.get_world_size(group) > 1 else None


# --------------------------------------------------------------------------- the merge

def local_moments(u: Tensor) -> Tensor:
    """``[count, mean(N), M2(N)]`` of the rows of u [M, N], float64 (zeros when M == 0)."""
    u64 = u.detach().to(_F64)
    rows = u64.shape[0]
    mean = u64.sum(0) / max(rows, 1)
    m2 = ((u64 - mean) ** 2).sum(0)
    return pack_moments(rows, mean, m2)


def pack_moments(count: int, mean: Tensor, m2: Tensor) -> Tensor:
    """One rank's row for the all_gather: ``[count, mean(N), M2(N)]`` in float64."""
    mean = mean.to(_F64)
    return torch.cat([mean.new_full((1,), float(count)), mean, m2.to(_F64)])


def gather_moments(row: Tensor, group: "dist.ProcessGroup") -> Tensor:
    """All ranks' rows, [world_size, 2N + 1], in rank order (on the current stream).

    Through the functional all_gather that the fused path's CUDA kernel issues from C++
    (cpp/ops/synced.cpp), so that a rank on the reference path makes the very collective
    call of its fused peers (c10d's allgather_into_tensor_coalesced; dist.all_gather_into_tensor
    would be _allgather_base), on every backend.
    """
    world = dist.get_world_size(group)
    functional = torch.ops._c10d_functional
    gathered = functional.all_gather_into_tensor(row, world, group.group_name)
    return functional.wait_tensor(gathered).view(world, row.numel())


def sum_over_ranks(row: Tensor, group: "dist.ProcessGroup") -> Tensor:
    """``row`` summed over the group's ranks, a new tensor (on the current stream): the functional
    all_reduce the fused path's CUDA kernel issues from C++, as gather_moments' all_gather."""
    functional = torch.ops._c10d_functional
    return functional.wait_tensor(functional.all_reduce(row, "sum", group.group_name))


def merge_moments(rows: Tensor) -> BatchMoments:
    """Merge per-rank ``[count, mean, M2]`` rows (Chan et al.'s parallel variance, float64).

    ``M2 = sum_r M2_r + sum_r n_r (mean_r - mean)²``: every term is
    non-negative and taken about the global mean, so the result is as
    accurate as the per-rank M2s. Empty ranks (n_r = 0) contribute nothing.
    """
    n_features = (rows.shape[1] - 1) // 2
    counts = rows[:, :1]
    means, m2s = rows[:, 1:1 + n_features], rows[:, 1 + n_features:]
    count = counts.sum()
    mean = (counts * means).sum(0) / count
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return BatchMoments(count, mean, m2 / count)


def synced_moments(row: Tensor, group: "dist.ProcessGroup") -> BatchMoments:
    """This rank's ``[count, mean, M2]`` row merged with every other rank's."""
    return merge_moments(gather_moments(row, group))


# --------------------------------------------------------------------------- normalization

def _compute_dtype(u: Tensor) -> torch.dtype:
    # 16-bit inputs are normalized in float32, as F.batch_norm does.
    return torch.promote_types(u.dtype, torch.float32)


class _SyncedNormalize(torch.autograd.Function):
    """``(u - mean) * invstd * weight + bias`` with global statistics; SyncBatchNorm's backward.

    The statistics are inputs rather than computed here (synced_batch_norm
    merges them). setup_context (not ctx in forward) lets torch.func trace it.
    """

    @staticmethod
    def forward(u, weight, bias, mean, invstd, count, group):
        cd = _compute_dtype(u)
        v = (u.to(cd) - mean.to(cd)) * invstd.to(cd)
        if weight is not None:
            v = v * weight.to(cd)
        if bias is not None:
            v = v + bias.to(cd)
        return v.to(u.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, weight, _, mean, invstd, count, group = inputs
        ctx.save_for_backward(u, weight, mean, invstd)
        ctx.group = group
        ctx.bias_dtype = None if inputs[2] is None else inputs[2].dtype

    @staticmethod
    def backward(ctx, grad_v):
        u, weight, mean, invstd = ctx.saved_tensors
        cd = _compute_dtype(u)
        dy = grad_v.to(cd)
        inv = invstd.to(cd)
        xhat = (u.to(cd) - mean.to(cd)) * inv
        n_features = mean.numel()
        grad_u = grad_weight = grad_bias = None
        need_u, need_weight, need_bias = ctx.needs_input_grad[:3]
        if need_weight and weight is not None:  # local; DDP averages it over the ranks
            grad_weight = (dy * xhat).sum(0).to(weight.dtype)
        if need_bias and ctx.bias_dtype is not None:
            grad_bias = dy.sum(0).to(ctx.bias_dtype)
        if need_u:
            # Every rank reaches this point together: same graph, same needs_input_grad. The row
            # is fold.normalized_grad_sums' layout, which ranks on the fused path send, by the
            # same collective call: sums of dy, then this rank's weight applied
            # (nn.SyncBatchNorm's batch_norm_backward_elemt).
            total = sum_over_ranks(torch.cat([dy.sum(0).to(_F64), (dy * xhat).sum(0).to(_F64),
                                              dy.new_full((1,), float(u.shape[0]), dtype=_F64)]),
                                   ctx.group)
            rows = total[2 * n_features].to(cd)
            mean_g1 = total[:n_features].to(cd) / rows
            mean_g2 = total[n_features:2 * n_features].to(cd) / rows
            grad_u = (dy - mean_g1 - xhat * mean_g2) * inv
            if weight is not None:
                grad_u = grad_u * weight.to(cd)
            grad_u = grad_u.to(u.dtype)
        return grad_u, grad_weight, grad_bias, None, None, None, None


def synced_normalize(u: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     moments: BatchMoments, eps: float,
                     group: "dist.ProcessGroup") -> Tensor:
    """Normalize u with global moments; differentiable like nn.SyncBatchNorm."""
    invstd = torch.rsqrt(moments.var + eps)
    return _SyncedNormalize.apply(u, weight, bias, moments.mean, invstd, moments.count, group)


def synced_batch_norm(u: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                      running_mean: Optional[Tensor], running_var: Optional[Tensor],
                      num_batches_tracked: Optional[Tensor], momentum: Optional[float],
                      eps: float, group: "dist.ProcessGroup") -> Tensor:
    """Training-mode nn.SyncBatchNorm on a 2-D u, in plain PyTorch ops (any device and backend).

    Updates the running statistics (when given) with the global moments.
    """
    if u.dim() != 2:
        raise ValueError(f"expected 2D input (got {u.dim()}D input)")
    moments = synced_moments(local_moments(u), group)
    if running_mean is not None and running_var is not None and num_batches_tracked is not None:
        fold.update_running_stats(running_mean, running_var, num_batches_tracked,
                                  moments.mean, moments.var, moments.count, momentum)
    return synced_normalize(u, weight, bias, moments, eps, group)
