"""Comparisons shared by the torchrun check scripts (rank-tagged failure lists)."""

from __future__ import annotations

import torch

PARAMS = ("gemm.weight", "gemm.bias", "bn.weight", "bn.bias", "scale")
BUFFERS = ("bn.running_mean", "bn.running_var")


def error(actual, expected, floor: float = 0.0) -> float:
    """``|actual - expected| / max(|expected|, floor)``, Frobenius norms in float64.

    None counts as zeros (autograd leaves a gradient unset where none flowed,
    e.g. nn.SyncBatchNorm's on an empty rank). inf when shapes differ or
    ``actual`` is not finite.
    """
    if actual is None and expected is None:
        return 0.0
    e = None if expected is None else expected.detach().double().cpu()
    a = None if actual is None else actual.detach().double().cpu()
    e = torch.zeros_like(a) if e is None else e
    a = torch.zeros_like(e) if a is None else a
    if a.shape != e.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(max(floor, 1e-300))).item()


def vanishing_grads(number: int) -> set[str]:
    """Parameters whose gradient summed over all ranks is zero up to rounding.

    BatchNorm removes a per-column shift (gemm.bias) and, up to eps, a scale
    applied before it (problem 39's scale). Where a rank's gradient is the
    global one (one rank holds the whole batch, or DDP averaged it), only an
    absolute comparison is meaningful.
    """
    return {"gemm.bias", "scale"} if number == 39 else {"gemm.bias"}


class Failures(list):
    """Failure lines of one rank; ``expect`` appends one when an error exceeds its bound."""

    def expect(self, tag: str, what: str, actual, expected: torch.Tensor, tol: float,
               floor: float = 0.0) -> None:
        err = error(actual, expected, floor)
        if not err <= tol:  # also catches nan
            self.append(f"{tag}: {what} error {err:.3g} > {tol:g}")
