"""The synchronized-statistics hooks, synced_batch_fold and synced_grad_sums, in one process.

The hooks are C++ composites on every device (cpp/ops/synced.cpp): the per-pass ops
(pack_moments -> all_gather -> merge_fold; normalized_grad_sums -> all_reduce) around PyTorch's
functional collectives, the passes running their CUDA kernels or, for CPU tensors, their float64
references.

* One rank (a FileStore process group in tmp_path): the whole batch is this rank's, so on CPU
  (gloo) the hooks must give the unsynchronized fold and sums. Marked `hopper` with NCCL: the
  CUDA kernels against the CPU path, the pack and merge kernels seen by the profiler, and no host
  synchronization.
* Two ranks on the `fake` backend (CPU, no peer needed): a rank on the reference path and one on
  the fused path issue the same functional collectives, of the same sizes, in the same order; the
  GPU test holds the C++ path to the same list. (The 2-process checks of the math are
  tests/test_distributed.py's.)
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from epifuse import distributed, fold
from helpers import one_rank_group, rel_err, traced_epifuse_ops

EPS = 1e-3
N, ROWS = 6, 9


def _inputs(device, dtype=torch.float32, seed=0):
    """synced_batch_fold's positional arguments and synced_grad_sums' sums (ROWS rows, N columns)."""
    gen = torch.Generator().manual_seed(seed)

    def vec(n, lo, hi, dt=dtype):
        return (torch.rand(n, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(device, dt)

    z = torch.randn(ROWS, N, generator=gen, dtype=torch.float64) * 2 + 3
    colsum, colsumsq = (s.to(device) for s in fold.column_stats(z))
    fold_args = [colsum, colsumsq, ROWS, vec(N, -1, 1), vec(N, 0.5, 1.5), vec(N, -1, 1),
                 vec(N, 0.5, 2.0), vec(1, 0.5, 2.0)]  # bias, gamma, beta, pre_scale, post_scale
    sums = torch.cat([vec(2 * N, -1, 1, torch.float64),
                      torch.tensor([float(ROWS)], dtype=torch.float64, device=device)])
    return fold_args, sums


def _run_hooks(fold_args, sums, group_name):
    """(a, c, moments, global_sums): the forward hook, then the backward's from its moments."""
    colsum, colsumsq, count, bias, gamma, beta, pre, post = fold_args
    a, c, moments = torch.ops.epifuse.synced_batch_fold(*fold_args, eps=EPS, group_name=group_name)
    global_sums = torch.ops.epifuse.synced_grad_sums(sums, moments, bias, gamma, pre, post, eps=EPS,
                                                     group_name=group_name)
    return a, c, moments, global_sums


def _collectives(prof) -> list[tuple[str, list]]:
    """The functional collectives issued under the profiler, in order: (name, row shape)."""
    events = sorted((e for e in prof.events() if e.name.startswith("_c10d_functional::")
                     and e.name != "_c10d_functional::wait_tensor"), key=lambda e: e.time_range.start)
    return [(e.name, list(e.input_shapes[0])) for e in events]


def _expected_collectives(n: int) -> list[tuple[str, list]]:
    """One all_gather of a [2N + 1] row in the forward, one all_reduce of one in the backward."""
    return [("_c10d_functional::all_gather_into_tensor", [2 * n + 1]),
            ("_c10d_functional::all_reduce", [2 * n + 1])]


def _profiled(fn, *activities):
    activities = activities or (torch.profiler.ProfilerActivity.CPU,)
    with torch.profiler.profile(activities=list(activities), record_shapes=True) as prof:
        result = fn()
    return result, prof


# --------------------------------------------------------------------------- CPU kernels (gloo)

def test_cpu_hooks_on_one_rank_are_the_unsynchronized_fold(tmp_path):
    fold_args, sums = _inputs("cpu")
    with one_rank_group(tmp_path, "gloo") as group_name:
        with traced_epifuse_ops() as calls:
            a, c, moments, global_sums = _run_hooks(fold_args, sums, group_name)
    # The C++ composites on CPU tensors too: the per-pass ops, each checking its arguments.
    assert calls == ["synced_batch_fold", "pack_moments", "merge_fold", "synced_grad_sums",
                     "normalized_grad_sums"], calls
    expected = torch.ops.epifuse.bn_fold_batch(*fold_args, eps=EPS)
    for got, want in zip((a, c, moments), expected, strict=True):
        assert got.dtype == want.dtype and rel_err(got, want) <= 1e-12
    _, _, _, bias, gamma, _, pre, post = fold_args
    want_sums = fold.normalized_grad_sums(sums, moments, bias, gamma, pre, post, EPS)
    assert rel_err(global_sums, want_sums) <= 1e-12


def test_hooks_need_a_group_name():
    fold_args, sums = _inputs("cpu")
    with pytest.raises(ValueError, match="need a process group's group_name"):
        _run_hooks(fold_args, sums, "")


# --------------------------------------------------------------------------- collective pairing

@pytest.fixture
def fake_two_ranks():
    """Rank 0 of a 2-rank group on PyTorch's fake backend (collectives return at once)."""
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_reference_and_fused_paths_issue_the_same_collectives(fake_two_ranks):
    """What lets an empty or one-row rank (reference path) train beside fused ranks: the same
    collective calls, of the same sizes, in the same order."""
    fold_args, sums = _inputs("cpu")
    _, fused = _profiled(lambda: _run_hooks(fold_args, sums, fake_two_ranks.group_name))
    u = torch.randn(1, N, dtype=torch.float64, requires_grad=True)
    gamma, beta = fold_args[4].double(), fold_args[5].double()

    def reference_step():
        y = distributed.synced_batch_norm(u, gamma, beta, None, None, None, 0.1, EPS,
                                          fake_two_ranks)
        y.sum().backward()

    _, reference = _profiled(reference_step)
    assert _collectives(fused) == _collectives(reference) == _expected_collectives(N)


# --------------------------------------------------------------------------- CUDA kernels (NCCL)

@pytest.mark.hopper
@pytest.mark.skipif(not dist.is_nccl_available(), reason="PyTorch built without NCCL")
def test_cuda_hooks_run_in_cpp(tmp_path):
    """The CUDA kernels against the CPU path (same group: gloo for CPU tensors, NCCL for CUDA
    ones); the profiler sees the pack and merge kernels and the collectives the reference path
    issues; nothing synchronizes with the host."""
    fold_args, sums = _inputs("cpu")
    cuda_args, cuda_sums = _inputs("cuda")
    cuda = torch.profiler.ProfilerActivity.CUDA
    with one_rank_group(tmp_path, "cpu:gloo,cuda:nccl") as group_name:
        want = _run_hooks(fold_args, sums, group_name)
        got, prof = _profiled(lambda: _run_hooks(cuda_args, cuda_sums, group_name),
                              torch.profiler.ProfilerActivity.CPU, cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # warm now: any host sync raises
        try:
            _run_hooks(cuda_args, cuda_sums, group_name)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cuda" and g.dtype == w.dtype
        assert rel_err(g, w) <= (1e-6 if g.dtype == torch.float32 else 1e-12)
    names = [e.name for e in prof.events()]
    for kernel in ("pack_moments_kernel", "merge_fold_kernel", "normalized_grad_sums_kernel"):
        assert any(kernel in name for name in names), f"{kernel} did not run"
    assert _collectives(prof) == _expected_collectives(N)
