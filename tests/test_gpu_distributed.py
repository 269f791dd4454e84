"""Synchronized batch statistics on 2 GPUs (NCCL): ModelNew against nn.SyncBatchNorm.

Launches tests/distributed/sync_bn_check.py (and the float64-oracle check) under
``torchrun --nproc_per_node=2``; see README "Data-parallel training (SyncBatchNorm)".
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed.launch import run_torchrun

SCRIPTS = Path(__file__).resolve().parent / "distributed"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}"),
]

# NVLink SHARP (multicast) is left off: not every machine/driver offers it.
_ENV = {"NCCL_NVLS_ENABLE": "0"}


def _run(script: str, *args: str) -> str:
    result = run_torchrun(SCRIPTS / script, list(args), nproc=2, timeout_s=600, env=_ENV)
    print(result.stdout)
    assert result.returncode == 0, f"{script} failed (rc {result.returncode}):\n{result.stdout}"
    return result.stdout


def test_sync_batchnorm_matches_torch_sync_batchnorm():
    assert "[sync_bn_check] PASS" in _run("sync_bn_check.py")


def test_sync_batchnorm_matches_concatenated_batch_oracle():
    assert "[oracle_check] PASS" in _run("oracle_check.py", "--device", "cuda")
