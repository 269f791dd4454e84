"""Seeded models with primed running statistics, and identical copies of them.

Every implementation of a configuration (ModelNew, eager Model, compiled Model,
the float64 reference) is built from one base state_dict, so parameters and
running statistics match exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from epifuse import problems

from .configs import Shape, is_training

SEED = 0
_PRIME_ROWS = 256


def problem_module(number: int):
    return problems.BY_NUMBER[number]


def init_args(number: int, k: int, n: int) -> list:
    """The problem's get_init_inputs() with in/out features set to k, n."""
    module = problem_module(number)
    args = list(module.get_init_inputs())
    resized = [k, n]
    for a in args[2:]:  # a per-column scale shape follows out_features
        resized.append((n,) if a == (module.out_features,) else a)
    return resized


@torch.no_grad()
def base_state(shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """Seeded fp32 Model state on ``device``, running statistics primed from one batch.

    The parameters are KernelBench's (torch.manual_seed(SEED), Model(*init) on CPU).
    A fresh BatchNorm has running mean 0 / var 1, which makes eval mode
    unrepresentative; the running statistics are set to the batch statistics
    of the BatchNorm input for one random batch instead.
    """
    module = problem_module(shape.problem)
    torch.manual_seed(SEED)
    model = module.Model(*init_args(shape.problem, shape.k, shape.n)).to(device)
    gen = torch.Generator(device=device).manual_seed(SEED + 1)
    x = torch.rand(_PRIME_ROWS, shape.k, generator=gen, device=device)
    captured = {}

    def grab(mod, inp):  # returns None: the input goes on unchanged
        captured["u"] = inp[0]

    hook = model.bn.register_forward_pre_hook(grab)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        model.eval()
        model(x)
    finally:
        hook.remove()
        torch.set_float32_matmul_precision(old)
    u = captured["u"].double()
    model.bn.running_mean.copy_(u.mean(0))
    model.bn.running_var.copy_(u.var(0, unbiased=True))
    model.bn.num_batches_tracked.fill_(1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(shape: Shape, state: dict[str, torch.Tensor], *, new: bool, dtype: torch.dtype,
          device: torch.device, mode: str, precision=None) -> nn.Module:
    """Model (new=False) or ModelNew(precision=...) holding ``state``, cast to ``dtype``.

    Built on the meta device and then materialized, so no throw-away random
    initialization of a large weight happens per copy.
    """
    module = problem_module(shape.problem)
    args = init_args(shape.problem, shape.k, shape.n)
    with torch.device("meta"):
        model = module.ModelNew(*args, precision=precision) if new else module.Model(*args)
    model = model.to_empty(device=device)
    model.load_state_dict(state)
    model.to(dtype)
    model.train(is_training(mode))
    return model


def build_reference64(shape: Shape, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
                      device: torch.device, mode: str) -> nn.Module:
    """The float64 reference Model: the parameters as rounded to ``dtype``, then widened."""
    model = build(shape, state, new=False, dtype=dtype, device=device, mode=mode)
    return model.to(torch.float64)


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, count: int,
                seed: int) -> list[torch.Tensor]:
    """``count`` distinct KernelBench-style inputs (torch.rand) of ``dtype``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.rand(shape.m, shape.k, generator=gen, device=device).to(dtype)
            for _ in range(count)]
