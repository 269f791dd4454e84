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
    # per dispatch key it passes), the backward its fused backward (head_grad_coefficients: every
    # fused backward runs it).
    assert names.count("epifuse::gemm_colstats") == 2, names
    assert "epifuse::head_grad_coefficients" in names, names
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


def _fresh_base() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _memory_of_steps(model, x, steps: int = 2) -> tuple[int, int]:
    """(resident after the steps, peak during them) in bytes, the model's own included (as the
    benchmark's memory columns count it) and what other tests left allocated excluded: a step is a
    forward and a backward to x, the weights frozen. The model comes on the CPU and goes back."""
    base = _fresh_base()
    model.to(CUDA)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        xr = x.clone().requires_grad_()
        model(xr).sum().backward()
        del xr
    torch.cuda.synchronize()
    measured = torch.cuda.memory_allocated() - base, torch.cuda.max_memory_allocated() - base
    model.cpu()
    return measured


_UNCHANGED_WEIGHT_CASES = [(84, [8192, 8192, 1e-5, 0.1, (1,)], 1024),
                           (39, [4096, 4096, (4096,)], 4096)]


def _unchanged_weight_steps(number, args, rows) -> dict:
    ref, new = make_pair(number, args, randomize=False)
    x = torch.randn(rows, args[0], device=CUDA)
    measured = {}
    for name, model in (("eager", ref), ("fused", new)):
        model.train().requires_grad_(False)
        if name == "fused":
            assert fast_path_reason(model.to(CUDA), x) is None
            model.cpu()
        measured[name] = _memory_of_steps(model, x)
    return measured


@pytest.mark.hopper
@pytest.mark.parametrize("number, args, rows", _UNCHANGED_WEIGHT_CASES)
def test_unchanged_weights_cost_no_resident_memory(number, args, rows):
    """Default fp32 precision (the 3x split on Hopper), weights frozen, training steps: no operand
    of the weight stays; resident memory within 5% of eager's."""
    measured = _unchanged_weight_steps(number, args, rows)
    assert measured["fused"][0] <= 1.05 * measured["eager"][0] + (1 << 20), measured


@pytest.mark.hopper
@pytest.mark.xfail(strict=True, reason="the 3x GEMMs split W (and dZ) into a workspace for the "
                   "forward and for dX (up to 128 MiB of W's fp32 rows at a time); eager's "
                   "frozen-weight step allocates no dW, so the split shows above its peak "
                   "(measured on an H200: problem 84 320 / 225 MiB, 39 384 / 193 MiB; with weight "
                   "gradients 448 / 416 and 448 / 448). Splitting in the mainloop would remove it")
@pytest.mark.parametrize("number, args, rows", _UNCHANGED_WEIGHT_CASES)
def test_unchanged_weights_step_peak_within_a_tenth_of_eager(number, args, rows):
    measured = _unchanged_weight_steps(number, args, rows)
    assert measured["fused"][1] <= 1.10 * measured["eager"][1] + (1 << 20), measured


@pytest.mark.hopper
def test_no_grad_forward_keeps_the_weight_split():
    """Where keeping pays (eval under no_grad, the same weight again), the split stays resident
    after the second forward (FP16 parts of the fp32 weight: of the order of its bytes); a
    training step with the same frozen weight keeps none."""
    _, new = make_pair(84, [2048, 2048, 1e-5, 0.1, (1,)], randomize=False)
    new = new.requires_grad_(False)
    weight_bytes = new.gemm.weight.numel() * new.gemm.weight.element_size()
    model_bytes = sum(t.numel() * t.element_size() for t in new.state_dict().values())
    x = torch.randn(256, 2048, device=CUDA)
    assert fast_path_reason(new.to(CUDA), x) is None
    new.cpu()
    resident_train, _ = _memory_of_steps(new.train(), x, steps=3)
    assert resident_train - model_bytes < weight_bytes // 2, (resident_train, model_bytes)
    new.to(CUDA).eval()
    base = _fresh_base()
    with torch.no_grad():
        for _ in range(3):
            new(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base >= weight_bytes // 2
