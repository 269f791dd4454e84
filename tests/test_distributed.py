"""Synchronized batch statistics (epifuse.distributed): merge math, API, 2-rank runs.

The multi-rank checks run tests/distributed/*.py under torchrun. On CPU, with the gloo
backend: oracle_check.py compares synced ModelNew (reference and fused paths)
with one-process BatchNorm over the concatenated batch; sync_bn_check.py
--smoke-cpu dry-runs the GPU check script.

Marked `gpu` and skipped below 2 CUDA GPUs: ModelNew against nn.SyncBatchNorm on 2 GPUs (NCCL),
tests/distributed/sync_bn_check.py (and the float64-oracle check) under
``torchrun --nproc_per_node=2``; see README "Data-parallel training (SyncBatchNorm)".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import epifuse
from epifuse import distributed as ef_dist
from helpers import PROBLEMS, init_args, make_pair

from distributed.launch import run_torchrun

SCRIPTS = Path(__file__).resolve().parent / "distributed"
IN, OUT = 12, 6


# --------------------------------------------------------------------------- merge math

def _merged(chunks):
    rows = torch.stack([ef_dist.local_moments(c) for c in chunks])
    return ef_dist.merge_moments(rows)


@pytest.mark.parametrize("offset", [0.0, 1e6], ids=["centred", "offset1e6"])
def test_merge_matches_whole_batch(offset):
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(40, 5, generator=g, dtype=torch.float64) * 3 + offset
    chunks = whole.split([7, 0, 1, 32])  # unequal, an empty rank and a one-row rank
    m = _merged(chunks)
    assert m.count.item() == 40 and m.count.dim() == 0
    torch.testing.assert_close(m.mean, whole.mean(0), rtol=1e-15, atol=0)
    # Deviations are taken about the per-rank and global means: at offset 1e6, where
    # E[u²] - E[u]² would keep ~5 digits, the merge agrees with torch's two-pass
    # variance to the inputs' own rounding (ulp(1e6) / std ~ 1e-11).
    rtol = 1e-12 if offset == 0.0 else 1e-9
    torch.testing.assert_close(m.var, whole.var(0, unbiased=False), rtol=rtol, atol=0)


def test_merge_from_fused_sums_matches_local_moments():
    """The fused path's row (from gemm_colstats' sums) equals the reference path's row."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(9, 4, generator=g, dtype=torch.float64) + 5
    bias, pre = torch.randn(4, generator=g, dtype=torch.float64), torch.tensor([1.5])
    colsum, colsumsq = epifuse.fold.column_stats(z)
    mean, var = epifuse.fold.input_moments(colsum, colsumsq, 9, bias, pre, like=bias)
    fused_row = ef_dist.pack_moments(9, mean, var * 9)
    torch.testing.assert_close(fused_row, ef_dist.local_moments(pre * (z + bias)), rtol=1e-12,
                               atol=1e-12)


def test_update_running_stats_takes_a_count_tensor():
    rm, rv, nbt = torch.zeros(3), torch.ones(3), torch.tensor(4)
    rm2, rv2, nbt2 = rm.clone(), rv.clone(), nbt.clone()
    mean, var = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 1.0, 2.0])
    epifuse.fold.update_running_stats(rm, rv, nbt, mean, var, 10, None)
    epifuse.fold.update_running_stats(rm2, rv2, nbt2, mean, var, torch.tensor(10.0), None)
    torch.testing.assert_close((rm, rv, nbt), (rm2, rv2, nbt2), rtol=0, atol=0)


# --------------------------------------------------------------------------- API

@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_constructor_keywords(number):
    module = PROBLEMS[number]
    args = init_args(number, IN, OUT)
    assert module.ModelNew(*args).sync_batchnorm is False
    assert module.ModelNew(*args, sync_batchnorm=True).sync_batchnorm is True
    with pytest.raises(ValueError, match="sync_batchnorm=True"):
        module.ModelNew(*args, process_group=object())
    with pytest.raises(TypeError, match="bool"):
        module.ModelNew(*args, sync_batchnorm="yes")


def test_convert_sync_batchnorm_flips_every_head_in_place():
    heads = [PROBLEMS[n].ModelNew(*init_args(n, IN, OUT)) for n in (84, 39)]
    model = nn.Sequential(nn.Linear(3, IN), nn.ModuleList(heads))
    group = object()  # stored as given; used only when training under torch.distributed
    assert epifuse.convert_sync_batchnorm(model, group) is model
    assert all(h.sync_batchnorm and h.process_group is group for h in heads)
    assert isinstance(model[0], nn.Linear)


@pytest.mark.parametrize("number", sorted(PROBLEMS))
def test_without_process_group_sync_is_a_no_op(number):
    """Not initialized: synced modules (either converter) run exactly the unsynced forward."""
    assert not dist.is_initialized()
    ref, plain = make_pair(number, init_args(number, IN, OUT))
    synced = epifuse.convert_sync_batchnorm(make_pair(number, init_args(number, IN, OUT))[1])
    by_torch = nn.SyncBatchNorm.convert_sync_batchnorm(make_pair(number, init_args(number, IN,
                                                                                   OUT))[1])
    x = torch.rand(8, IN)
    for m in (synced, by_torch):
        assert ef_dist.sync_group(m) is None
        torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
        torch.testing.assert_close(m.bn.running_var, plain.bn.running_var, rtol=0, atol=0)
        plain.load_state_dict(ref.state_dict())


def test_world_size_one_and_eval_do_not_sync(tmp_path):
    _, plain = make_pair(39, init_args(39, IN, OUT))
    synced = epifuse.convert_sync_batchnorm(make_pair(39, init_args(39, IN, OUT))[1])
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert ef_dist.sync_group(synced) is None  # one rank: nothing to synchronize
        x = torch.rand(8, IN)
        torch.testing.assert_close(synced(x), plain(x), rtol=0, atol=0)
        synced.eval()
        assert ef_dist.sync_group(synced) is None
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- 2 ranks (gloo)

def _run(script: str, *args: str):
    result = run_torchrun(SCRIPTS / script, list(args), nproc=2, timeout_s=180)
    assert result.returncode == 0, f"{script} failed (rc {result.returncode}):\n{result.stdout}"
    return result.stdout


def test_two_ranks_match_concatenated_batch_oracle():
    assert "[oracle_check] PASS" in _run("oracle_check.py", "--device", "cpu")


def test_gpu_check_script_smoke_on_cpu():
    assert "[sync_bn_check] PASS" in _run("sync_bn_check.py", "--smoke-cpu")


# --------------------------------------------------------------------------- 2 GPUs (NCCL)

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")

# NVLink SHARP (multicast) is left off: not every machine/driver offers it.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}


def _run_on_gpus(script: str, *args: str) -> str:
    result = run_torchrun(SCRIPTS / script, list(args), nproc=2, timeout_s=600, env=_NCCL_ENV)
    print(result.stdout)
    assert result.returncode == 0, f"{script} failed (rc {result.returncode}):\n{result.stdout}"
    return result.stdout


@pytest.mark.gpu
@two_gpus
def test_sync_batchnorm_matches_torch_sync_batchnorm():
    assert "[sync_bn_check] PASS" in _run_on_gpus("sync_bn_check.py")


@pytest.mark.gpu
@two_gpus
def test_sync_batchnorm_matches_concatenated_batch_oracle():
    assert "[oracle_check] PASS" in _run_on_gpus("oracle_check.py", "--device", "cuda")


# --------------------------------------------------------------------------- 2-GPU benchmark

def test_distributed_bench_dry_run_on_cpu(tmp_path):
    """python -m benchmarks.distributed --device cpu: 2 gloo ranks, both models, a table."""
    from benchmarks import distributed as bench_dist

    md = tmp_path / "dist.md"
    assert bench_dist.main(["--device", "cpu", "--problems", "39", "--dtypes", "fp32-tf32",
                            "--warmup", "0", "--iters", "2", "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "Training step on 2 x CPU (dry run)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 39:")]
    assert len(rows) == 2 and {"no", "yes"} == {r.split("|")[3].strip() for r in rows}
    # The host time per step, ours / the reference's, beside the step times.
    assert "host ms ours / SyncBN" in text
    for row in rows:
        ours, ref = (float(v) for v in row.split("|")[-2].split("/"))
        assert ours > 0 and ref > 0, row


def test_distributed_bench_rejects_bad_arguments(capsys):
    from benchmarks import distributed as bench_dist

    with pytest.raises(SystemExit):
        bench_dist.main(["--nproc", "1"])
    assert "--nproc must be at least 2" in capsys.readouterr().err
    if torch.cuda.device_count() < 2:
        assert bench_dist.main([]) == 2
        assert "needs 2 CUDA GPUs" in capsys.readouterr().err
