"""Where a training step's peak memory is reached: the memory each op call holds at its peak.

    PYTHONPATH=python python experiments/step_memory.py [--models projection classifier]
                                                        [--setting fp32-3xtf32]

For each model (benchmarks.real_heads, 4096 rows), eager and fused by epifuse.fuse, one training
step (every parameter's version bumped, as an optimizer's update would) after a warm-up, with a
TorchDispatchMode that records, for every op the dispatcher runs (aten's and epifuse's, in the
autograd engine's thread too), the memory allocated when it starts and the peak while it runs,
both above what was allocated before the step (the benchmark's peak column measures the same).
Prints the step's peak and the ops whose peaks come within 64 MiB of it, in call order.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import epifuse  # noqa: E402
from benchmarks.cases import DTYPES  # noqa: E402
from benchmarks.real_heads import BATCH, DIMS, build_model  # noqa: E402

MIB = 2.0 ** 20


class PeakByOp(TorchDispatchMode):
    def __init__(self, base: int):
        super().__init__()
        self.base, self.rows = base, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        peak = torch.cuda.max_memory_allocated()
        self.rows.append((str(func.name()), (start - self.base) / MIB, (peak - self.base) / MIB))
        return out


def run(model_name: str, setting: str, fused: bool) -> None:
    spec = DTYPES[setting]
    torch.manual_seed(0)
    model = build_model(model_name, DIMS[model_name], bias=False).cuda().train()
    if fused:
        model, _ = epifuse.fuse(model, precision=spec.precision)
    x = torch.rand(BATCH, DIMS[model_name][0], device="cuda", requires_grad=True)
    params = [p for p in model.parameters() if p.requires_grad]
    with spec.context():
        def step(mode=None):
            x.grad = None
            for p in params:
                p.grad = None
                torch.autograd.graph.increment_version(p)
            with spec.amp("cuda"):
                out = model(x)
            out.backward(torch.ones_like(out))

        step()
        torch.cuda.synchronize()
        for p in params:
            p.grad = None
        x.grad = None
        base = torch.cuda.memory_allocated()
        mode = PeakByOp(base)
        with mode:
            step()
        torch.cuda.synchronize()
    top = max(r[2] for r in mode.rows)
    label = "fused" if fused else "eager"
    print(f"== {model_name} {setting} {label}: step peak {top:.0f} MiB above the step's start")
    for name, start, peak in mode.rows:
        if peak >= top - 64:
            print(f"    {name:40s} start {start:7.0f}  peak {peak:7.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["projection", "classifier"])
    p.add_argument("--setting", default="fp32-3xtf32")
    args = p.parse_args()
    for name in args.models:
        for fused in (False, True):
            run(name, args.setting, fused)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
