"""Memory-bound kernels: our row softmax vs torch.softmax, and the copy bandwidth.

The softmax is the op itself, ``torch.ops.epifuse.affine_softmax(x, None, None)``
(what ``epifuse.softmax`` calls on supported tensors), so a device without our
kernels shows as a failure instead of silently timing torch.softmax twice.
Bandwidth counts bytes read plus bytes written: 2 * numel * element size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from epifuse import ops

from .accuracy import ErrorStats, error_stats
from .configs import SOFTMAX_TORCH_DTYPES
from .runner import describe, free_memory
from .timing import Timing, TimingSettings, measure, rotation_count


def gbps(nbytes: float, ms: Optional[float]) -> Optional[float]:
    return nbytes / (ms * 1e-3) / 1e9 if ms else None


@dataclass
class CopyResult:
    nbytes: int  # bytes moved per call (read + write)
    timing: Optional[Timing] = None
    failure: Optional[str] = None

    @property
    def gbps(self) -> Optional[float]:
        return gbps(self.nbytes, self.timing.median_ms if self.timing else None)

    def to_dict(self) -> dict:
        return {"bytes_read_plus_written": self.nbytes, "gbps": self.gbps,
                "timing_ms": self.timing.to_dict() if self.timing else None,
                "failure": self.failure}


@dataclass
class SoftmaxResult:
    dtype: str
    m: int
    n: int
    nbytes: int  # read + write per call
    timings: dict[str, Timing] = field(default_factory=dict)  # "ours" | "torch"
    failures: dict[str, str] = field(default_factory=dict)
    accuracy: dict[str, ErrorStats] = field(default_factory=dict)
    copy_gbps: Optional[float] = None

    def gbps(self, impl: str) -> Optional[float]:
        t = self.timings.get(impl)
        return gbps(self.nbytes, t.median_ms if t else None)

    def of_copy(self, impl: str) -> Optional[float]:
        g = self.gbps(impl)
        return g / self.copy_gbps if g and self.copy_gbps else None

    def speedup(self) -> Optional[float]:
        ours, ref = self.timings.get("ours"), self.timings.get("torch")
        return ref.median_ms / ours.median_ms if ours and ref else None

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "M": self.m, "N": self.n,
                "bytes_read_plus_written": self.nbytes,
                "timings_ms": {k: v.to_dict() for k, v in self.timings.items()},
                "gbps": {k: self.gbps(k) for k in self.timings},
                "fraction_of_copy_bandwidth": {k: self.of_copy(k) for k in self.timings},
                "speedup_vs_torch": self.speedup(),
                "failures": dict(self.failures),
                "errors_vs_fp64": {k: v.to_dict() for k, v in self.accuracy.items()}}


@torch.no_grad()
def copy_bandwidth(nbytes: int, device: torch.device, settings: TimingSettings) -> CopyResult:
    """Device-to-device ``dst.copy_(src)`` of an ``nbytes`` float32 tensor."""
    numel = nbytes // 4
    result = CopyResult(nbytes=2 * numel * 4)
    try:
        src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        result.timing = measure(lambda s: dst.copy_(s), [src], device, settings)
        src = dst = None  # free before free_memory()
    except Exception as e:  # noqa: BLE001
        result.failure = describe(e)
    free_memory(device)
    return result


@torch.no_grad()
def softmax_point(dtype_name: str, n: int, m: int, device: torch.device,
                  settings: TimingSettings, copy_gbps: Optional[float],
                  log: Callable[[str], None]) -> SoftmaxResult:
    dtype = SOFTMAX_TORCH_DTYPES[dtype_name]
    esize = dtype.itemsize
    result = SoftmaxResult(dtype_name, m, n, 2 * m * n * esize, copy_gbps=copy_gbps)
    try:
        count = rotation_count(m * n * esize, device, cap=8)
        gen = torch.Generator(device=device).manual_seed(7)
        inputs = [(torch.randn(m, n, generator=gen, device=device) * 4).to(dtype)
                  for _ in range(count)]
    except Exception as e:  # noqa: BLE001
        result.failures = {"ours": describe(e), "torch": describe(e)}
        free_memory(device)
        return result
    impls = {"ours": lambda x: ops.affine_softmax(x, None, None),
             "torch": lambda x: torch.softmax(x, dim=-1)}
    try:
        ref64 = torch.softmax(inputs[0].to(torch.float64), dim=-1)
    except Exception as e:  # noqa: BLE001
        ref64 = None
        log(f"  softmax {dtype_name} N={n}: fp64 reference failed: {describe(e)}")
    for impl, fn in impls.items():
        try:
            if ref64 is not None:
                result.accuracy[impl] = error_stats(fn(inputs[0]), ref64)
            result.timings[impl] = measure(fn, inputs, device, settings)
        except Exception as e:  # noqa: BLE001
            result.failures[impl] = describe(e)
            log(f"  softmax {dtype_name} N={n}: {impl} failed: {describe(e)}")
        free_memory(device)
    del inputs, ref64
    free_memory(device)
    return result
