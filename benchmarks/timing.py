"""How the benchmark times: per-call CUDA events, interleaved rounds, an L2 flush, host time.

Device time (``measure_rounds``, ``measure``): every timed call sits between two CUDA events on
the current stream, calls are queued back to back and the device is synchronized once per round,
so the numbers are device time per call (host gaps count only where the host is slower than the
device, as they would for a user). Each implementation gets its first call and a warm-up (which
also sizes its number of calls), then all take turns in ``rounds`` rounds, so that a slow spell
of the machine (another process, the GPU's clocks) falls on all of them: timed one after the other
(ours first), problem 84's 16-bit steps took 0.63 ms in one run and 1.42 ms in another. The
result of each is a ``torch.utils.benchmark.Measurement`` of the per-call times (median, IQR); an
implementation that raises gets its exception instead and the others go on.

Cold caches, two ways. Model calls cycle distinct inputs (``rotation_count``), created before
timing. Single kernels (softmax, copy, the GEMM precision table) take ``flush``: like
``triton.testing.do_bench``, a buffer larger than L2 is overwritten before each timed call, and
one input suffices. Model calls do not, because a flush kernel queued before a call runs while
the host issues that call and hides up to its own duration of host time: the host-bound rows (the
128x1024->512 forwards, problem 84's 16-bit steps) would no longer compare with earlier runs.

Peak memory (``peak_memory``): one more call after the timed ones (so caches and workspaces
exist, as in a steady state), between the allocator's peak statistics; not timed.

Host time (``measure_host``): ``time.perf_counter`` around each Python call while a spin kernel
(``torch.cuda._sleep``) queued first keeps the GPU busy, so calls only queue their kernels. An
event recorded behind the spin kernel still pending after a round shows the GPU stayed busy (a
call that synchronized would have waited). On the CPU (the dry run) perf_counter brackets calls.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch.utils.benchmark import Measurement
from torch.utils.benchmark.utils.common import TaskSpec


@dataclass(frozen=True)
class Settings:
    warmup: int = 10
    iters: int = 50
    max_seconds: float = 2.0  # per measurement: fewer calls for slow ones ...
    min_iters: int = 5  # ... but never fewer than this

    @staticmethod
    def fixed(warmup: int, iters: int) -> "Settings":
        """Exactly ``iters`` timed calls, however slow (e.g. steps that run collectives: every
        rank must run the same count)."""
        return Settings(warmup=warmup, iters=iters, max_seconds=1e12, min_iters=iters)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def l2_flush(device: torch.device) -> Optional[torch.Tensor]:
    """triton.testing.do_bench's cache flush: a buffer to ``zero_()`` before each timed call
    (256 MB, or twice the L2 if that is larger); None on the CPU."""
    if device.type != "cuda":
        return None
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return torch.empty(max(256 << 20, 2 * l2), dtype=torch.int8, device=device)


def rotation_count(bytes_per_input: int, device: torch.device, *, cap: int = 16) -> int:
    """How many distinct inputs to cycle so that together they cover 4x the L2 (2 to ``cap``)."""
    l2 = 64 << 20  # an upper bound for current GPUs (H100 50 MB, H200 60 MB)
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", l2) or l2
    if bytes_per_input <= 0:
        return cap
    return max(2, min(cap, math.ceil(4 * l2 / bytes_per_input)))


class _Timed:
    """One implementation under measurement: first call, warm-up, then per-call times."""

    def __init__(self, name: str, fn: Callable[[Any], object], inputs: Sequence[Any],
                 device: torch.device, s: Settings, flush: Optional[torch.Tensor],
                 alone: bool = False) -> None:
        self.name, self.fn, self.inputs, self.device, self.flush = name, fn, inputs, device, flush
        self.alone = alone
        sync(device)
        t0 = time.perf_counter()
        fn(inputs[0])
        sync(device)
        self.first_ms = (time.perf_counter() - t0) * 1e3
        self.warmup = max(1, s.warmup)
        t0 = time.perf_counter()
        for i in range(self.warmup):
            fn(inputs[(i + 1) % len(inputs)])
        sync(device)
        per_call_s = (time.perf_counter() - t0) / self.warmup
        iters = s.iters
        if per_call_s > 0:
            iters = min(iters, max(s.min_iters, math.floor(s.max_seconds / per_call_s)))
        self.iters, self.times = max(1, iters), []

    def run(self, count: int) -> None:
        """``count`` more timed calls (the inputs continue their rotation)."""
        fn, inputs, flush, first = self.fn, self.inputs, self.flush, len(self.times)
        if self.device.type != "cuda":
            for i in range(count):
                x = inputs[(first + i) % len(inputs)]
                t0 = time.perf_counter()
                fn(x)
                self.times.append(time.perf_counter() - t0)
            return
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(count)]
        sync(self.device)
        for i, (start, end) in enumerate(events):
            x = inputs[(first + i) % len(inputs)]
            if flush is not None:
                flush.zero_()
            if self.alone:  # from an idle device: the call's whole latency, host's included
                sync(self.device)
            start.record()
            fn(x)
            end.record()
        sync(self.device)
        self.times += [s.elapsed_time(e) * 1e-3 for s, e in events]

    def measurement(self) -> Measurement:
        return Measurement(1, self.times, TaskSpec(self.name, "", description=self.name),
                           metadata={"warmup": self.warmup, "n_inputs": len(self.inputs),
                                     "first_call_ms": self.first_ms, "alone": self.alone})


def measure_rounds(fns: Mapping[str, Callable[[Any], object]], inputs: Sequence[Any],
                   device: torch.device, settings: Settings, rounds: int = 3,
                   flush: Optional[torch.Tensor] = None, alone: bool = False
                   ) -> dict[str, Union[Measurement, Exception]]:
    """Time ``fn(inputs[i % len(inputs)])`` for each of ``fns``, interleaved in ``rounds`` rounds
    (each runs its share of its calls in turn); an implementation that raises gets its exception.
    ``alone``: the device is synchronized before each timed call (each call's latency from an idle
    GPU, host time included, as a loop that synchronizes every step sees it), where by default
    calls are queued back to back."""
    if not inputs:
        raise ValueError("measure_rounds() needs at least one input")
    results: dict[str, Union[Measurement, Exception]] = {}
    timed: dict[str, _Timed] = {}
    for name, fn in fns.items():
        try:
            timed[name] = _Timed(name, fn, inputs, device, settings, flush, alone)
        except Exception as e:  # noqa: BLE001 -- reported per implementation
            results[name] = e
    rounds = max(1, rounds)
    for r in range(rounds):
        for name, t in list(timed.items()):
            try:  # round r's share: the counts add up to t.iters
                t.run(t.iters * (r + 1) // rounds - t.iters * r // rounds)
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del timed[name]
    results.update({name: t.measurement() for name, t in timed.items()})
    return {name: results[name] for name in fns}


def queued_counts(s: Settings, calls: int = 10, rounds: int = 5,
                  warmup: Optional[int] = None) -> dict:
    """measure_queued_rounds' keyword counts for ``s``: ``rounds`` rounds of ``calls`` calls
    (fewer in a dry run's few iterations) after ``warmup`` calls (default 2: calls already warmed
    by their timed rounds)."""
    return {"calls": min(calls, s.iters), "rounds": min(rounds, s.iters),
            "warmup": min(2, s.warmup) if warmup is None else warmup}


def measure_queued_rounds(fns: Mapping[str, Callable[[Any], object]], inputs: Sequence[Any],
                          device: torch.device, calls: int = 10, rounds: int = 5,
                          warmup: int = 5) -> dict[str, Union[dict, Exception]]:
    """The GPU's time per call with the host ahead of it: what a call costs inside a larger model
    whose GPU work hides the host's (a projection head after a backbone), where ``measure_rounds``
    times each call alone, host latency included.

    Per round and implementation (implementations interleaved), a spin kernel holds the GPU while
    the host queues ``calls`` calls (~50 launches each at most: the launch queue holds ~1000), and
    CUDA events time them back to back from the end of the spin. ``median_ms`` per call over
    ``rounds`` rounds; ``gpu_kept_busy`` False if in some round the spin ended before the host had
    queued every call (that round then counts host stalls too). On a CPU device: wall time per
    call (a dry run's smoke test)."""
    if not inputs:
        raise ValueError("measure_queued_rounds() needs at least one input")

    def call_each(fn: Callable[[Any], object], n: int) -> None:
        for i in range(n):
            fn(inputs[i % len(inputs)])

    results: dict[str, Union[dict, Exception]] = {}
    per_call: dict[str, list] = {}
    busy: dict[str, Optional[bool]] = {}
    round_s: dict[str, float] = {}
    for name, fn in fns.items():
        try:
            call_each(fn, warmup)
            sync(device)
            t0 = time.perf_counter()
            call_each(fn, calls)
            sync(device)
            round_s[name] = time.perf_counter() - t0  # an upper bound on the host's share
            per_call[name], busy[name] = [], (True if device.type == "cuda" else None)
        except Exception as e:  # noqa: BLE001 -- reported per implementation
            results[name] = e
    gc.collect()
    for _ in range(max(1, rounds)):
        for name in list(per_call):
            fn = fns[name]
            try:
                if device.type != "cuda":
                    t0 = time.perf_counter()
                    call_each(fn, calls)
                    per_call[name].append((time.perf_counter() - t0) * 1e3 / calls)
                    continue
                torch.cuda._sleep(max(1, int((2 * round_s[name] + 0.005)
                                             * _cycles_per_s(device))))
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                call_each(fn, calls)
                end.record()
                busy[name] = busy[name] and not start.query()
                end.synchronize()
                per_call[name].append(start.elapsed_time(end) / calls)
            except Exception as e:  # noqa: BLE001
                results[name] = e
                del per_call[name]
    for name, times in per_call.items():
        results[name] = {"median_ms": statistics.median(times), "min_ms": min(times),
                         "rounds": len(times), "calls": calls, "gpu_kept_busy": busy[name]}
    return {name: results[name] for name in fns}


def measure(fn: Callable[[Any], object], inputs: Sequence[Any], device: torch.device,
            settings: Settings, flush: Optional[torch.Tensor] = None) -> Measurement:
    """One implementation (raises what it raises)."""
    result = measure_rounds({"fn": fn}, inputs, device, settings, rounds=1, flush=flush)["fn"]
    if isinstance(result, Exception):
        raise result
    return result


def peak_memory(fn: Callable[[Any], object], x: Any, device: torch.device,
                release: Optional[Callable[[Any], None]] = None) -> Optional[int]:
    """Bytes one call ``fn(x)`` allocates at its peak above what was allocated before it (the
    caching allocator's statistics: ``max_memory_allocated`` after ``reset_peak_memory_stats``,
    minus ``memory_allocated`` before the call); its output counts, what stays allocated from
    earlier calls (parameters, inputs, kept caches) does not. ``release(x)`` first drops what an
    earlier call left for this one to free (a step's gradients), so that the baseline holds none
    of it. None on the CPU."""
    if device.type != "cuda":
        return None
    if release is not None:
        release(x)
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = fn(x)
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    return peak


def to_dict(m: Measurement) -> dict:
    """A Measurement as bench.json records it (milliseconds)."""
    t = m.times
    return {"median_ms": m.median * 1e3, "iqr_ms": m.iqr * 1e3, "min_ms": min(t) * 1e3,
            "max_ms": max(t) * 1e3, "mean_ms": m.mean * 1e3, "iters": len(t), **m.metadata}


# --------------------------------------------------------------------------- host time

def _cycles_per_s(device: torch.device, _cache: dict = {}) -> float:  # noqa: B006 -- a cache
    """The spin kernel's clock rate, measured once per device with CUDA events."""
    if device not in _cache:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # wake the clocks before the measured spin
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _cache[device] = cycles / (start.elapsed_time(end) * 1e-3)
    return _cache[device]


def measure_host(fn: Callable[[], object], device: torch.device, warmup: int = 10,
                 rounds: int = 5, calls: int = 40, margin_s: float = 0.005) -> dict:
    """Median host time (us) of ``fn()`` over rounds of ``calls`` calls issued while the GPU is
    busy (at most ~40 x 8 launches pending: a full launch queue would block the host)."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    round_s = time.perf_counter() - t0  # synchronized: an upper bound on a round's host time
    gc.collect()  # not in the middle of the timed rounds
    times, busy = [], (True if device.type == "cuda" else None)
    for _ in range(rounds):
        behind = None
        if device.type == "cuda":
            torch.cuda._sleep(max(1, int((2 * round_s + margin_s) * _cycles_per_s(device))))
            behind = torch.cuda.Event()
            behind.record()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        if behind is not None:
            busy = busy and not behind.query()
        sync(device)
    return {"median_us": statistics.median(times), "min_us": min(times),
            "mean_us": statistics.fmean(times), "calls": len(times), "gpu_kept_busy": busy}


def measure_host_checked(fn: Callable[[], object], device: torch.device, attempts: int = 3,
                         **kwargs) -> dict:
    """``measure_host``, again (up to ``attempts`` in all) while the GPU went idle: a host stall
    (another process, a garbage collection) passes; a call that synchronizes fails every attempt
    and is reported as such (``gpu_kept_busy`` False)."""
    timing = measure_host(fn, device, **kwargs)
    for _ in range(attempts - 1):
        if timing["gpu_kept_busy"] is not False:
            break
        timing = measure_host(fn, device, **kwargs)
    return timing
