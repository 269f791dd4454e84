"""The "train-step" mode: one training-mode forward plus its backward per timed call.

A step is what a head inside a network costs per optimizer step: the input requires grad
(the network below needs dX), the parameters require grad, and the upstream gradient is a
fixed random tensor ``g`` drawn once per input. ``y.backward(g)`` gives exactly the gradients
of ``(y * g).sum()`` without timing that stand-in loss's own multiply, sum and their
backward kernels, which are not part of the head. Parameter (and input) gradients are set
to None before every step (``zero_grad(set_to_none=True)``), so the backward writes fresh
gradients instead of accumulating into old ones.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import models
from .accuracy import ErrorStats, error_stats
from .configs import Shape

# The gradients compared against float64 (accuracy keys "<impl>:<name>").
GRADIENTS = ("dx", "dw")

StepInput = tuple[torch.Tensor, torch.Tensor]  # (x requiring grad, upstream gradient g)


def step_bytes(shape: Shape, esize: int) -> int:
    """Bytes of one step's input and upstream gradient (for the L2 rotation count)."""
    return (shape.m * shape.k + shape.m * shape.n) * esize


def make_step_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, count: int,
                     seed: int) -> list[StepInput]:
    """``count`` (x, g) pairs: KernelBench-style x requiring grad, g ~ N(0, 1) of the output's shape."""
    xs = models.make_inputs(shape, dtype, device, count, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    return [(x.requires_grad_(), torch.randn(shape.m, shape.n, generator=gen,
                                             device=device).to(dtype))
            for x in xs]


def make_step(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]
              ) -> Callable[[StepInput], None]:
    """One training step of ``forward`` (``model`` itself or its torch.compile wrapper)."""
    params = [p for p in model.parameters() if p.requires_grad]

    def step(pair: StepInput) -> None:
        x, g = pair
        # zero_grad(set_to_none=True), without walking the module tree on every call.
        x.grad = None
        for p in params:
            p.grad = None
        forward(x).backward(g)

    return step


def gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """After a backward: the input gradient and the Linear weight's gradient."""
    return {"dx": x.grad, "dw": model.gemm.weight.grad}


def reference_gradients(shape: Shape, state: dict, pair: StepInput, *, dtype: torch.dtype,
                        device: torch.device, mode: str) -> dict[str, torch.Tensor]:
    """The float64 step's gradients: parameters as rounded to ``dtype``, x and g widened."""
    ref = models.build_reference64(shape, state, dtype=dtype, device=device, mode=mode)
    x, g = pair
    x64 = x.detach().to(torch.float64).requires_grad_()
    ref(x64).backward(g.to(torch.float64))
    return gradients(ref, x64)


def step_errors(model: nn.Module, pair: StepInput,
                ref: dict[str, torch.Tensor]) -> dict[str, ErrorStats]:
    """Run one step of ``model`` on a copy of ``pair``'s x; errors of its gradients vs ``ref``."""
    x, g = pair
    x = x.detach().clone().requires_grad_()
    model(x).backward(g)
    got = gradients(model, x)
    missing = [k for k in GRADIENTS if got[k] is None]
    if missing:
        raise RuntimeError(f"no gradient for {', '.join(missing)} after backward")
    return {k: error_stats(got[k], ref[k]) for k in GRADIENTS}
