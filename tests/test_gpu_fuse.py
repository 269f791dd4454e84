"""epifuse.fuse on CUDA: the fused kernels run for a Sequential and an fx-traced custom module,
and the results match the unfused model in training and eval."""

from __future__ import annotations

import copy

import pytest
import torch

import epifuse
from fuse_models import IN, Custom, randomize_bn_, sequential
from helpers import rel_err, traced_epifuse_ops

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [sequential, Custom], ids=["sequential", "custom"])
def test_fuse_runs_fused_kernels_and_matches(build, dtype, op_calls):
    torch.manual_seed(0)
    model = randomize_bn_(build()).to(CUDA, dtype)
    original = copy.deepcopy(model)
    _, report = epifuse.fuse(model, precision="ieee")
    assert len(report.fused) == 2, str(report)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    g = torch.Generator(device=CUDA).manual_seed(0)
    for training in (True, False, True):
        model.train(training), original.train(training)
        x = torch.rand(64, IN, device=CUDA, generator=g).to(dtype)
        for chain in model._epifuse_heads:
            assert chain.bn.training is training
        op_calls.clear()
        with torch.no_grad():
            y, y_ref = model(x), original(x)
        first = "gemm_colstats" if training else "bn_fold_eval"
        assert op_calls.count(first) == 2, op_calls  # both heads ran fused
        assert rel_err(y, y_ref) <= tol
        for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
            assert rel_err(a, b) <= tol, name
    # Training with autograd goes through the fused forward as well.
    model.train(), original.train()
    x = torch.rand(64, IN, device=CUDA, generator=g).to(dtype)
    with traced_epifuse_ops() as calls:
        loss = (model(x) * torch.linspace(0, 1, 8, device=CUDA, dtype=dtype)).sum()
        loss.backward()
    assert calls.count("fused_head") == calls.count("fused_head_backward") == 2, calls
    assert all(p.grad is not None for p in model.parameters())
