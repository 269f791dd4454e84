"""Median timing of a callable over rotated inputs, after warm-up.

On CUDA each timed call sits between two CUDA events recorded on the current
stream; all calls are queued back to back and the device is synchronized once
at the end, so the numbers are device time per call (host launch gaps show up
only where the host is slower than the device, as they would for a user).
Inputs are created by the caller beforehand and cycled, so host-side setup is
never timed and consecutive calls do not find their input in L2.
``measure_rounds`` times several implementations of one call in interleaved rounds.
On CPU (the dry run) time.perf_counter brackets each call.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence, Union

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


class _Timed:
    """One implementation under measurement: its first call, warm-up, and the per-call times."""

    def __init__(self, fn: Callable[[Any], object], inputs: Sequence[Any], device: torch.device,
                 settings: TimingSettings) -> None:
        self.fn, self.inputs, self.device = fn, inputs, device
        n = len(inputs)
        self.first_ms = _wall_ms(lambda: fn(inputs[0]), device)
        # Warm-up, timed as a whole to size the measurement.
        self.warmup = max(1, settings.warmup)
        sync(device)
        t0 = time.perf_counter()
        for i in range(self.warmup):
            fn(inputs[(i + 1) % n])
        sync(device)
        per_call_s = (time.perf_counter() - t0) / self.warmup
        iters = settings.iters
        if per_call_s > 0:
            iters = min(iters, max(settings.min_iters, math.floor(settings.max_seconds / per_call_s)))
        self.iters = max(1, iters)
        self.times: list[float] = []

    def run(self, count: int) -> None:
        """``count`` more timed calls (inputs continue their rotation)."""
        fn, inputs, device, n = self.fn, self.inputs, self.device, len(self.inputs)
        first = len(self.times)
        if device.type == "cuda":
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
            sync(device)
            for i in range(count):
                x = inputs[(first + i) % n]
                starts[i].record()
                fn(x)
                ends[i].record()
            sync(device)
            self.times += [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            for i in range(count):
                x = inputs[(first + i) % n]
                t0 = time.perf_counter()
                fn(x)
                self.times.append((time.perf_counter() - t0) * 1e3)

    def timing(self) -> Timing:
        t = self.times
        return Timing(median_ms=statistics.median(t), min_ms=min(t), max_ms=max(t),
                      mean_ms=statistics.fmean(t), iters=len(t), warmup=self.warmup,
                      n_inputs=len(self.inputs), first_call_ms=self.first_ms)


def measure(fn: Callable[[Any], object], inputs: Sequence[Any],
            device: torch.device, settings: TimingSettings) -> Timing:
    """Time ``fn(inputs[i % len(inputs)])``; returns the median over the timed calls."""
    if not inputs:
        raise ValueError("measure() needs at least one input")
    timed = _Timed(fn, inputs, device, settings)
    timed.run(timed.iters)
    return timed.timing()


def measure_rounds(fns: Mapping[str, Callable[[Any], object]], inputs: Sequence[Any],
                   device: torch.device, settings: TimingSettings,
                   rounds: int = 3) -> dict[str, Union[Timing, Exception]]:
    """``measure`` for several implementations of one call, interleaved.

    Each implementation gets its first call and warm-up (in order), then ``rounds`` rounds in
    which every implementation runs its share of its timed calls in turn; each median is over
    all its rounds. A slow spell of the machine (another process on the host, the GPU's clocks)
    then falls on every implementation alike instead of on whichever was being timed: the
    training steps of problem 84 in 16 bits are partly host-bound, and timed one after the other
    (ours first) ours took 0.63 ms in one run and 1.42 ms in another (H100 machine). An implementation that raises
    gets its exception as its result and drops out; the others go on.
    """
    if not inputs:
        raise ValueError("measure_rounds() needs at least one input")
    rounds = max(1, rounds)
    results: dict[str, Union[Timing, Exception]] = {}
    timed: dict[str, _Timed] = {}
    for name, fn in fns.items():
        try:
            timed[name] = _Timed(fn, inputs, device, settings)
        except Exception as e:  # noqa: BLE001 -- reported per implementation
            results[name] = e
    for r in range(rounds):
        for name, t in list(timed.items()):
            # Round r's share of the calls: the counts add up to t.iters.
            count = t.iters * (r + 1) // rounds - t.iters * r // rounds
            try:
                t.run(count)
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del timed[name]
    for name, t in timed.items():
        results[name] = t.timing()
    return {name: results[name] for name in fns}


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
