"""Shared pytest setup: import path, the `gpu` / `hopper` markers and their skips."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

try:  # an installed epifuse (pip install ./python) wins; else the source tree
    import epifuse  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import epifuse  # noqa: F401
sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/ (not in the package)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "hopper: needs a GPU the epifuse CUDA kernels were built for (fused path: sm_90a "
        "kernels on Hopper, sm80 kernels elsewhere or with EPIFUSE_FORCE_SM80=1)")


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU available"
    return None


def _hopper_skip_reason() -> str | None:
    reason = _gpu_skip_reason()
    if reason is not None:
        return reason
    return epifuse.ops.device_unsupported_reason(torch.cuda.current_device())


def pytest_collection_modifyitems(config, items):
    gpu_reason, hopper_reason = _gpu_skip_reason(), _hopper_skip_reason()
    for item in items:
        if gpu_reason and ("gpu" in item.keywords or "hopper" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=gpu_reason))
        elif hopper_reason and "hopper" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=hopper_reason))


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Let the fused path run on CPU tensors, through the ops' CPU (fold.py) kernels.

    This exercises head.py's op sequence, autograd Function and tracing in CI
    without a GPU; only the device check is bypassed.
    """
    from epifuse import head

    monkeypatch.setattr(head, "_device_reason", lambda x: None)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="epifuse: also run the long randomized tests "
                          "(same as EPIFUSE_LONG_TESTS=1)")


@pytest.fixture
def op_calls(monkeypatch):
    """The names of the epifuse ops head.py calls (through epifuse.ops), in order.

    With ``fused_on_cpu`` this is how a CPU test proves the fused path ran:
    the reference path calls none of them.
    """
    from epifuse import ops

    calls: list[str] = []
    for name in ("gemm_affine", "gemm_colstats", "bn_fold_train", "bn_fold_eval", "bn_fold_batch",
                 "update_running_stats", "affine_softmax", "affine_softmax_", "affine_", "affine"):
        real = getattr(ops, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, name, wrapper)
    return calls
