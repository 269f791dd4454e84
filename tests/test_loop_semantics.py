"""What a training loop meets beyond one step: activation checkpointing's recomputed forward, and
weights that do not change between steps (frozen layers, linear probing).

- Checkpointing (``torch.utils.checkpoint``, non-reentrant): the recomputed forward is the head's
  forward again, so the running statistics are updated a second time, as eager's BatchNorm does;
  the gradients are those of the plain step.
- Unchanged weights: a training step keeps no operand made from a weight (3x split, 16-bit cast),
  so its resident memory stays at eager's; only forwards without a backward (eval, no_grad) keep
  them (cpp/ops/weight_split_cache.h).
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from epifuse.head import fast_path_reason
from helpers import make_pair, ops_run

CUDA = "cuda"


def _checkpointed_step(model, x):
    y = checkpoint(model, x, use_reentrant=False)
    (y * torch.linspace(-1, 1, y.shape[1], device=y.device)).sum().backward()
    return y


def _run_checkpoint_case(device: str):
    ref, new = make_pair(39, [64, 48, (48,)], seed=3)
    ref, new = ref.to(device).train(), new.to(device).train()
    x = torch.randn(32, 64, device=device)
    assert fast_path_reason(new, x) is None
    names = ops_run(lambda: _checkpointed_step(new, x.clone().requires_grad_()), "epifuse::")
    # The forward and its recomputation each ran the fused head's GEMM (fused_head is listed once
    # per dispatch key it passes), the backward its fused backward.
    assert names.count("epifuse::gemm_colstats") == 2, names
    assert "epifuse::fused_head_backward" in names, names
    _checkpointed_step(ref, x.clone().requires_grad_())
    # Two forwards each updated the running statistics, in both models.
    assert int(new.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 2
    torch.testing.assert_close(new.bn.running_mean, ref.bn.running_mean, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(new.bn.running_var, ref.bn.running_var, rtol=1e-4, atol=1e-5)
    for (name, p_new), p_ref in zip(new.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p_new.grad, p_ref.grad, rtol=1e-3, atol=1e-4, msg=name)


def test_checkpointed_head_updates_running_stats_as_eager_cpu(fused_on_cpu):
    _run_checkpoint_case("cpu")


@pytest.mark.hopper
def test_checkpointed_head_updates_running_stats_as_eager_gpu():
    _run_checkpoint_case(CUDA)


def _memory_of_steps(model, x, steps: int = 2) -> tuple[int, int]:
    """(resident after the steps, peak during them) in bytes, everything on the GPU counted (the
    model and x too, as the benchmark's memory columns count it): a step is a forward and a
    backward to x, the weights frozen."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        xr = x.clone().requires_grad_()
        model(xr).sum().backward()
        del xr
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()


@pytest.mark.hopper
@pytest.mark.parametrize("number, args, rows", [(84, [8192, 8192, 1e-5, 0.1, (1,)], 1024),
                                                (39, [4096, 4096, (4096,)], 4096)])
def test_unchanged_weights_cost_no_resident_memory(number, args, rows):
    """Default fp32 precision (the 3x split on Hopper), weights frozen, training steps: resident
    memory within 5% of eager's and the step's peak within 10%."""
    ref, new = make_pair(number, args, randomize=False)
    x = torch.randn(rows, args[0], device=CUDA)
    measured = {}
    for name, model in (("eager", ref), ("fused", new)):
        model.to(CUDA).train().requires_grad_(False)
        if name == "fused":
            assert fast_path_reason(model, x) is None
        measured[name] = _memory_of_steps(model, x)
        model.cpu()
    (res_eager, peak_eager), (res_fused, peak_fused) = measured["eager"], measured["fused"]
    slack = 1 << 20  # the allocator's rounding of small blocks
    assert res_fused <= 1.05 * res_eager + slack, measured
    assert peak_fused <= 1.10 * peak_eager + slack, measured


@pytest.mark.hopper
def test_no_grad_forward_keeps_the_weight_split():
    """Where keeping pays (eval under no_grad, the same weight again), the split stays resident
    after the second forward (FP16 hi and lo parts: the fp32 weight's bytes); a training step
    with the same frozen weight keeps none."""
    _, new = make_pair(84, [2048, 2048, 1e-5, 0.1, (1,)], randomize=False)
    new = new.to(CUDA).requires_grad_(False)
    weight_bytes = new.gemm.weight.numel() * new.gemm.weight.element_size()
    x = torch.randn(256, 2048, device=CUDA)
    assert fast_path_reason(new, x) is None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    resident_train, _ = _memory_of_steps(new.train(), x, steps=3)
    assert resident_train - base < weight_bytes // 2, (resident_train, base)
    new.eval()
    with torch.no_grad():
        for _ in range(3):
            new(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base >= 0.9 * weight_bytes
