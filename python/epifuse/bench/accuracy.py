"""Errors of an output against a float64 reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class ErrorStats:
    rel_fro: float  # ||out - ref|| / ||ref|| (Frobenius)
    max_abs: float  # max |out - ref|
    finite: bool  # out has no NaN/inf

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def error_stats(out: torch.Tensor, ref64: torch.Tensor) -> ErrorStats:
    """Errors of ``out`` (any dtype) against the float64 ``ref64``, computed on their device."""
    if out.shape != ref64.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    out64 = out.detach().to(torch.float64)
    finite = bool(torch.isfinite(out64).all())
    diff = out64 - ref64
    if not finite:
        return ErrorStats(float("inf"), float("inf"), False)
    denom = torch.linalg.vector_norm(ref64).clamp_min(1e-300)
    rel = (torch.linalg.vector_norm(diff) / denom).item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    return ErrorStats(rel, max_abs, True)
