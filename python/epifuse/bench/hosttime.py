"""Host time per forward: what one Python call of a model costs the CPU.

A small-batch forward (128x1024->512) is short enough on the GPU that the host's work per
call (Python, dispatch, argument checks, allocation, kernel launches) sets its speed. To
measure that work alone, the GPU is kept busy while the host issues the calls: a spin
kernel (``torch.cuda._sleep``) is queued first, long enough to outlast a round of calls, so
every call only queues its kernels behind it and returns; ``time.perf_counter`` around each
Python call is then host time, with no GPU time and no synchronization in it. An event
recorded behind the spin kernel is still pending at the end of a round exactly when the
GPU stayed busy throughout (a call that synchronized would have waited for the spin
kernel, and the event would be done); each result says whether that held.

Rounds of a few dozen calls, each behind its own spin kernel, keep the queue of pending
launches short (a full launch queue would block the host and count as host time).
On the CPU (the dry run) the same loop times whole calls.
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from . import models
from .configs import HostPoint
from .runner import describe
from .timing import sync


@dataclass(frozen=True)
class HostSettings:
    warmup: int = 10
    rounds: int = 5
    calls: int = 40  # per round: ~40 x (up to ~8 kernels) pending launches at most
    margin_s: float = 0.005  # spin this much longer than twice a round's synchronized time


@dataclass
class HostTiming:
    median_us: float
    min_us: float
    mean_us: float
    calls: int
    gpu_kept_busy: Optional[bool]  # None on the CPU: no GPU to keep busy

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HostResult:
    point: HostPoint
    timings: dict[str, HostTiming] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)

    def us(self, impl: str) -> Optional[float]:
        t = self.timings.get(impl)
        return t.median_us if t is not None else None

    def ratio(self) -> Optional[float]:
        """Ours / eager host time (at most 1 is the target)."""
        ours, eager = self.us("ours"), self.us("eager")
        return ours / eager if ours and eager else None

    def to_dict(self) -> dict:
        s = self.point.shape
        return {"problem": s.problem, "tag": s.tag, "M": s.m, "K": s.k, "N": s.n,
                "dtype": self.point.spec.name, "mode": self.point.mode,
                "timings_us": {k: v.to_dict() for k, v in self.timings.items()},
                "failures": dict(self.failures), "ours_over_eager": self.ratio()}


_CYCLES_PER_S: dict[int, float] = {}


def _cycles_per_s(device: torch.device) -> float:
    """The spin kernel's clock rate, measured once per device with CUDA events."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CYCLES_PER_S:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # wake the clocks before the measured spin
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_S[index] = cycles / (start.elapsed_time(end) * 1e-3)
    return _CYCLES_PER_S[index]


def _keep_busy(device: torch.device, seconds: float) -> Optional[torch.cuda.Event]:
    """Queue a spin kernel of ``seconds``; returns an event recorded behind it (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda._sleep(max(1, int(seconds * _cycles_per_s(device))))
    behind = torch.cuda.Event()
    behind.record()
    return behind


def _synchronized_s(fn: Callable[[], object], device: torch.device, calls: int) -> float:
    """Wall time of ``calls`` back-to-back calls, synchronized: an upper bound on their host time."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return time.perf_counter() - t0


def measure_host(fn: Callable[[], object], device: torch.device,
                 settings: HostSettings = HostSettings()) -> HostTiming:
    """Median host time of ``fn()`` over rounds of calls issued while the GPU is busy."""
    for _ in range(settings.warmup):
        fn()
    round_s = _synchronized_s(fn, device, settings.calls)
    gc.collect()  # not in the middle of the timed rounds
    times: list[float] = []
    busy: Optional[bool] = None if device.type != "cuda" else True
    for _ in range(settings.rounds):
        behind = _keep_busy(device, 2 * round_s + settings.margin_s)
        for _ in range(settings.calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if behind is not None:
            busy = busy and not behind.query()
        sync(device)
    us = [t * 1e6 for t in times]
    return HostTiming(median_us=statistics.median(us), min_us=min(us),
                      mean_us=statistics.fmean(us), calls=len(us), gpu_kept_busy=busy)


def measure_host_checked(fn: Callable[[], object], device: torch.device,
                         settings: HostSettings = HostSettings(), attempts: int = 3) -> HostTiming:
    """``measure_host``, measured again (up to ``attempts`` times in all) while the GPU went idle.

    A GPU that went idle means some round outlasted its spin kernel: the host stalled (another
    process, a garbage collection) or a call waited for the GPU, and that measurement is not host
    time. A stall passes, so the point is measured again; a call that synchronizes fails every
    attempt and is reported as such (``gpu_kept_busy`` False).
    """
    timing = measure_host(fn, device, settings)
    for _ in range(attempts - 1):
        if timing.gpu_kept_busy is not False:
            break
        timing = measure_host(fn, device, settings)
    return timing


def run_host_point(point: HostPoint, state: dict, device: torch.device,
                   settings: HostSettings, log: Callable[[str], None],
                   verbose: bool = False) -> HostResult:
    """Host time of one forward (under torch.no_grad(), like the timed forwards) per impl."""
    result = HostResult(point)
    spec, shape = point.spec, point.shape
    x = models.make_inputs(shape, spec.dtype, device, 1, seed=models.SEED + 400)[0]
    for impl in ("ours", "eager"):
        try:
            model = models.build(shape, state, new=impl == "ours", dtype=spec.dtype,
                                 device=device, mode=point.mode,
                                 precision=spec.precision if impl == "ours" else None)
            with spec.torch_settings(), torch.no_grad():
                result.timings[impl] = measure_host_checked(lambda: model(x), device, settings)
            del model
        except Exception as e:  # noqa: BLE001 -- a failure becomes a table entry
            result.failures[impl] = describe(e)
            log(f"  {point.label}: {impl} failed: {describe(e)}")
            if verbose:
                log(traceback.format_exc())
    return result


def host_from_dict(d: dict, point: HostPoint) -> HostResult:
    """A bench.json entry back into a result (for --resume)."""
    timings = {k: HostTiming(**v) for k, v in (d.get("timings_us") or {}).items()}
    return HostResult(point, timings=timings, failures=dict(d.get("failures") or {}))
