"""``python -m epifuse``: check ModelNew against Model on both problems and time them.

For each problem and dtype: build Model and ModelNew from the same seed (and
load Model's state_dict into ModelNew), run a training step and an eval step
on the same input, compare outputs and running statistics, report which path
ran, and time both forwards. Exit status 1 on any mismatch.

On a CUDA machine the problems run at their KernelBench sizes; without a GPU
the CPU path runs on a small size. Problems, dtypes and precisions are spelled
as for ``python -m benchmarks`` (one table: ``epifuse.cli``). An autocast column
(``amp-bf16``, ``amp-fp16``) keeps both models and the input in fp32 and runs
every forward under ``torch.autocast`` (the device's) to that dtype, held to
that dtype's tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import cli, problems
from ._library import build_info
from ._version import __version__
from .head import fast_path_reason
from .precision import resolve_precision

# Relative (Frobenius-norm) error allowed between ModelNew and Model. Both carry
# their own rounding, so these are looser than the tests' bounds against float64.
_TOLERANCE = {"ieee": 1e-4, "3xtf32": 1e-4, "tf32": 5e-3, torch.float16: 1e-2,
              torch.bfloat16: 3e-2}
_SMALL = (64, 256, 128)  # batch, in_features, out_features without a GPU (or with --small)


@dataclass
class Check:
    name: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance  # False for NaN as well


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (NaN/inf anywhere -> inf)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape or not torch.isfinite(a).all():
        return float("inf")
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def median_ms(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    for _ in range(3):  # warm-up: lazy init, allocator, autotuning
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_problem(number: int, dtype: torch.dtype, precision: Optional[str], iters: int,
                device: torch.device, sizes: Optional[tuple[int, int, int]],
                autocast: Optional[torch.dtype] = None) -> bool:
    """``autocast``: run every forward under torch.autocast(device.type, dtype=autocast), with
    ``dtype`` (the models' and input's) float32."""
    module = problems.BY_NUMBER[number]
    batch, args = cli.init_inputs(module, sizes)
    torch.manual_seed(0)
    ref = module.Model(*args)
    torch.manual_seed(0)
    new = module.ModelNew(*args, precision=precision)
    new.load_state_dict(ref.state_dict())
    ref.to(device, dtype)
    new.to(device, dtype)
    x = torch.rand(batch, args[0], generator=torch.Generator().manual_seed(1)).to(device, dtype)

    def amp():  # a region per call, as a training loop enters one per step
        return (torch.autocast(device.type, dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    def run(model):
        with amp():
            return model(x)

    prec = None if autocast is not None else resolve_precision(precision, dtype)
    tol = (_TOLERANCE[autocast] if autocast is not None else
           _TOLERANCE[prec] if dtype == torch.float32 else _TOLERANCE[dtype])
    label = f"problem {number} ({module.__name__.rsplit('.', 1)[-1]}) {batch}x{args[0]}->{args[1]}"
    print(f"{label}: device={device} dtype={str(dtype).removeprefix('torch.')} "
          + (f"autocast={str(autocast).removeprefix('torch.')}" if autocast is not None
             else f"precision={prec or '-'}"))

    ok = True
    with torch.no_grad():
        for mode in ("train", "eval"):
            ref.train(mode == "train")
            new.train(mode == "train")
            with amp():
                reason = fast_path_reason(new, x)
            path = "fused" if reason is None else f"reference ({reason})"
            y_new, y_ref = run(new), run(ref)
            checks = [Check("output", rel_error(y_new, y_ref), tol)]
            if mode == "train":
                checks += [
                    Check("running_mean", rel_error(new.bn.running_mean, ref.bn.running_mean), tol),
                    Check("running_var", rel_error(new.bn.running_var, ref.bn.running_var), tol),
                    Check("num_batches_tracked", float(
                        new.bn.num_batches_tracked.item() != ref.bn.num_batches_tracked.item()), 0.0),
                ]
            ms_new = median_ms(lambda: run(new), iters, device)
            ms_ref = median_ms(lambda: run(ref), iters, device)
            for c in checks:
                ok &= c.ok
            verdict = "OK" if all(c.ok for c in checks) else "MISMATCH"
            detail = ", ".join(f"{c.name} {c.error:.2e}" for c in checks)
            print(f"  {mode:5s} {verdict:8s} path={path}; rel.err {detail} (tol {tol:.0e}); "
                  f"ModelNew {ms_new:.3f} ms vs Model {ms_ref:.3f} ms "
                  f"({ms_ref / ms_new:.2f}x)")
    return ok


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m epifuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--version", action="version", version=f"epifuse {__version__}")
    cli.add_selection_arguments(p, default_dtypes="fp32",
                                default_precisions="follow torch.get_float32_matmul_precision()")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    p.add_argument("--small", action="store_true",
                   help=f"use the small size (batch, in, out) = {_SMALL} on CUDA too")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error("--iters must be >= 1")
    # None: follow torch's fp32 matmul setting, as ModelNew(precision=None) does.
    args.selection = cli.selection(args, default_dtypes=["fp32"], default_fp32_precisions=[None])
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    info = build_info()
    print(f"epifuse {__version__}" + (f" ({info.summary()})" if info else ""))
    if torch.cuda.is_available():
        device = torch.device("cuda")
        sizes = _SMALL if args.small else None
        print(f"GPU: {torch.cuda.get_device_name(device)} "
              f"(sm_{''.join(map(str, torch.cuda.get_device_capability(device)))})")
    else:
        device, sizes = torch.device("cpu"), _SMALL
        print("No CUDA GPU: running the CPU (reference) path on a small size "
              f"(batch {_SMALL[0]}, {_SMALL[1]}->{_SMALL[2]}).")
    ok = True
    for number in args.selection.problems:
        for column in args.selection.columns:
            ok &= run_problem(number, column.torch_dtype, column.precision, args.iters, device,
                              sizes, autocast=column.autocast_dtype)
    print("ALL OK" if ok else "MISMATCH: ModelNew disagrees with Model")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
