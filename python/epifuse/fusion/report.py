"""What ``epifuse.fuse`` did: the chains it fused and the candidates it left, with reasons."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Fused:
    """One fused chain: ``where`` names its modules in the model (e.g. ``fc -> bn -> softmax``)."""

    where: str
    note: str = ""  # e.g. a softmax left outside the chain
    kind: str = "head"  # "head": Linear -> BatchNorm1d (FusedChain); "linear": a plain Linear


@dataclass(frozen=True)
class Skipped:
    """A place that looked like a head but was not fused, and why."""

    where: str
    reason: str


@dataclass
class FuseReport:
    """Returned by ``epifuse.fuse``; ``print(report)`` lists both."""

    fused: list[Fused] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"epifuse.fuse: {len(self.fused)} fused, {len(self.skipped)} left"]
        lines += [f"  fused {f.where}" + (f" ({f.note})" if f.note else "") for f in self.fused]
        lines += [f"  left  {s.where}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)
