"""Data-parallel wrappers around a fused model (tests/distributed/wrapper_check.py under torchrun):
DDP and FSDP2's ``fully_shard`` run the fused ops and give the unfused model's outputs, running
statistics and gradients. DDP on 2 CPU ranks (gloo) in CI; both on 2 GPUs (NCCL)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed.launch import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "distributed" / "wrapper_check.py"

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _check(wrapper: str, device: str) -> None:
    proc = run_torchrun(SCRIPT, ["--wrapper", wrapper, "--device", device], nproc=2,
                        timeout_s=240)
    assert proc.returncode == 0 and f"wrapper_check OK {wrapper}" in proc.stdout, proc.stdout[-4000:]


def test_ddp_wraps_a_fused_model_cpu():
    _check("ddp", "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_wrappers_run_the_fused_ops_on_two_gpus(wrapper):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _check(wrapper, "cuda")
