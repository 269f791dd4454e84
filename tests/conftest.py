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
    """Let the fused path run on CPU tensors: one epifuse::fused_head call (fused_linear for a plain
    Linear), whose C++ kernel runs the same sequence of passes as on CUDA, each checking its
    arguments and then computing its float64 reference (python/epifuse/_ops/, over fold.py).

    This exercises head.py's decision, the op's sequence, its C++ autograd and tracing in CI
    without a GPU; only the device check is bypassed (and, with it, the fallback warning).
    """
    from epifuse import head

    monkeypatch.setattr(head, "_device_reason", lambda x: None)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="epifuse: also run the long randomized tests "
                          "(same as EPIFUSE_LONG_TESTS=1)")


@pytest.fixture
def op_calls():
    """The epifuse ops run during the test (helpers.OpCalls: short names in call order, the
    passes that fused_head's C++ kernel runs included), e.g. a training forward without grad:
    ``["fused_head", "gemm_colstats", "bn_fold_train", "affine_"]``.

    With ``fused_on_cpu`` this is how a CPU test proves the fused path ran, and which passes its
    one ``fused_head`` call sequenced: the reference path runs none of them.
    """
    from helpers import OpCalls

    calls = OpCalls().start()
    yield calls
    calls.stop()


@pytest.fixture
def healthy_cuda():
    """After the test: no sticky CUDA error, and a valid op still gives the right answer."""
    yield
    torch.cuda.synchronize()
    x, w = torch.rand(5, 8, device="cuda"), torch.rand(3, 8, device="cuda")
    a, c = torch.full((3,), 2.0, device="cuda"), torch.ones(3, device="cuda")
    y = torch.ops.epifuse.gemm_affine(x, w, a, c, "ieee")
    torch.cuda.synchronize()
    expected = 2 * x.double() @ w.double().T + 1
    assert ((y.double() - expected).norm() / expected.norm()).item() <= 1e-6


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone (gloo for CPU tensors, and NCCL for CUDA ones where
    there are both); yields its group_name, which the synchronized-statistics hooks take."""
    import torch.distributed as dist
    from helpers import one_rank_group as group_of_one

    backend = ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available()
               else "gloo")
    with group_of_one(tmp_path, backend) as group_name:
        yield group_name
