"""Median timing of a callable over rotated inputs, after warm-up.

On CUDA each timed call sits between two CUDA events recorded on the current
stream; all calls are queued back to back and the device is synchronized once
at the end, so the numbers are device time per call (host launch gaps show up
only where the host is slower than the device, as they would for a user).
Inputs are created by the caller beforehand and cycled, so host-side setup is
never timed and consecutive calls do not find their input in L2.
On CPU (the dry run) time.perf_counter brackets each call.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    iters: int
    warmup: int
    n_inputs: int
    first_call_ms: float  # the first (cold) call, torch.compile's compilation included

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TimingSettings:
    warmup: int = 10
    iters: int = 50
    max_seconds: float = 2.0  # per measurement: fewer iterations for slow calls ...
    min_iters: int = 5  # ... but never fewer than this


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def measure(fn: Callable[[torch.Tensor], object], inputs: Sequence[torch.Tensor],
            device: torch.device, settings: TimingSettings) -> Timing:
    """Time ``fn(inputs[i % len(inputs)])``; returns the median over the timed calls."""
    if not inputs:
        raise ValueError("measure() needs at least one input")
    n = len(inputs)
    first_ms = _wall_ms(lambda: fn(inputs[0]), device)

    # Warm-up, timed as a whole to size the measurement.
    warm = max(1, settings.warmup)
    sync(device)
    t0 = time.perf_counter()
    for i in range(warm):
        fn(inputs[(i + 1) % n])
    sync(device)
    per_call_s = (time.perf_counter() - t0) / warm
    iters = settings.iters
    if per_call_s > 0:
        iters = min(iters, max(settings.min_iters, math.floor(settings.max_seconds / per_call_s)))
    iters = max(1, iters)

    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        sync(device)
        for i in range(iters):
            x = inputs[i % n]
            starts[i].record()
            fn(x)
            ends[i].record()
        sync(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        times = []
        for i in range(iters):
            x = inputs[i % n]
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e3)
    return Timing(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                  mean_ms=statistics.fmean(times), iters=iters, warmup=warm, n_inputs=n,
                  first_call_ms=first_ms)


def rotation_count(bytes_per_input: int, device: torch.device, *, cap: int = 16) -> int:
    """How many distinct inputs to cycle so that together they overflow the L2 cache.

    Enough inputs to cover 4x the L2 size (at least 2, at most ``cap``).
    """
    l2 = 64 << 20  # a safe upper bound for current GPUs (H100 50 MB, H200 60 MB)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", l2) or l2
    if bytes_per_input <= 0:
        return cap
    return max(2, min(cap, math.ceil(4 * l2 / bytes_per_input)))
