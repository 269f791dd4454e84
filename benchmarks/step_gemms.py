"""The three GEMMs of a fused training step, each timed from its op's own kernels.

A head's step runs three products of the same size: the forward x·Wᵀ (``epifuse::gemm_colstats``,
the GEMM whose epilogue gathers the column statistics) and, in its backward, dX = dZ·W and
dW = dZᵀ·X (the two ``epifuse::backward_matmul`` calls, in that order, after
``epifuse::head_grad_z``). One profiled run of a few steps (torch.profiler: each CUDA kernel is
attributed to the op that launched it) gives each op's GPU time, every split, copy and chunk it
makes included; TFLOP/s per kind is the kind's flops over its time, summed over a model's heads.
The backward's rates beside the forward's show how far the step is from three forward GEMMs.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

KINDS = ("forward", "dx", "dw")
FORWARD_OP, BACKWARD_OP, DZ_OP = ("epifuse::gemm_colstats", "epifuse::backward_matmul",
                                  "epifuse::head_grad_z")


def _product_flops(a: list, b: list) -> float:
    """2·r·s·t of an (r x s) by (s x t) product; the forward's b is the weight, (t x s)."""
    return 2.0 * a[0] * a[1] * (b[1] if b[0] == a[1] else b[0])


def _kinds(events) -> list[tuple[str, object]]:
    """(kind, event) of the GEMM ops among ``events`` (in start order). Each head's backward runs
    head_grad_z, then dX, then dW, each only where needed: of one call, a b of a weight's shape
    (a forward's N x K) is dX's."""
    out, weights, group = [], [], None

    def flush(group) -> None:
        if group is None:
            return
        if len(group) == 2:
            out.extend([("dx", group[0]), ("dw", group[1])])
        for e in group if len(group) != 2 else ():
            out.append(("dx" if list(e.input_shapes[1]) in weights else "dw", e))

    for e in events:
        if e.name == FORWARD_OP:
            out.append(("forward", e))
            weights.append(list(e.input_shapes[1]))
        elif e.name == DZ_OP:
            flush(group)
            group = []
        elif e.name == BACKWARD_OP and group is not None:
            group.append(e)
    flush(group)
    return out


def gemm_events(prof) -> list:
    """A finished profile's GEMM ops and head_grad_z calls (what _kinds reads), in start order."""
    return sorted((e for e in prof.events() if e.name in (FORWARD_OP, BACKWARD_OP, DZ_OP)),
                  key=lambda e: e.time_range.start)


def _kernel_count(e) -> int:
    """Kernels an op event and the ops inside it launched (what its device_time_total sums)."""
    return len(e.kernels) + sum(_kernel_count(c) for c in e.cpu_children)


def check_steps_alike(kernels: dict, steps: int) -> None:
    """Raise RuntimeError unless each kind's op calls launched the same kernels in every profiled
    step: ``kernels`` holds, per kind, each call's kernel count in order, ``steps`` steps of them.
    A count that differs is kernels from outside the profiled steps attributed to one of their ops
    (a profile that starts after an unprofiled step gave the first forward that step's kernels
    too), which would time a kind wrong: measure() then reports nothing rather than that."""
    for kind, counts in kernels.items():
        if not counts:
            continue
        if len(counts) % steps:
            raise RuntimeError(f"step_gemms: {len(counts)} {kind} GEMM calls in {steps} steps")
        per_step = len(counts) // steps
        if any(c != counts[i % per_step] for i, c in enumerate(counts)):
            raise RuntimeError(f"step_gemms: the {kind} GEMM calls' kernel counts differ between "
                               f"steps ({counts}): kernels from outside the profiled steps")


def measure(step: Callable, pair, device: torch.device, steps: int = 3) -> Optional[dict]:
    """{kind: {"ms": GPU ms per step, "tflops": ...}} of ``steps`` calls of ``step(pair)`` (warmed
    up), or None off CUDA or where the step ran no fused head; raises (check_steps_alike) where
    the profile attributed kernels from outside its steps."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    # The warm-up step runs inside the profile, in a window the schedule discards: a step run
    # before the profile starts, synchronized or not, left its forward's kernels attributed to the
    # first profiled forward (measured on an H200: 4 forwards' kernels in 3 steps).
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=steps)) as prof:
        for _ in range(steps + 2):
            step(pair)
            torch.cuda.synchronize(device)
            prof.step()
    totals = {k: [0.0, 0.0] for k in KINDS}  # GPU us, flops
    kernels: dict = {k: [] for k in KINDS}
    for kind, e in _kinds(gemm_events(prof)):
        totals[kind][0] += e.device_time_total
        totals[kind][1] += _product_flops(list(e.input_shapes[0]), list(e.input_shapes[1]))
        kernels[kind].append(_kernel_count(e))
    check_steps_alike(kernels, steps)
    if not totals["forward"][0]:
        return None
    return {k: {"ms": us / 1e3 / steps, "tflops": flops / (us * 1e-6) / 1e12 if us else None}
            for k, (us, flops) in totals.items() if us}
