"""Real heads: the models people train with Linear -> BatchNorm1d -> activation heads, fused by
``epifuse.fuse`` as a user would, against eager PyTorch and ``torch.compile`` of the same model.

    python -m benchmarks.real_heads [--batch 4096] [--models M ...] [--dtype D ...] [--modes ...]
                                    [--no-compile] [--out bench-out/real-heads] [--markdown PATH]
                                    [--dry]

A section of ``python -m benchmarks`` (BENCHMARKS.md, "Real heads"); alone, this writes its table.

Models (sizes of MoCo v3's projector on a ResNet-50 and of an ImageNet classifier head):
  projection   Linear(2048, 4096) -> BN -> ReLU -> Linear(4096, 4096) -> BN -> ReLU
               -> Linear(4096, 256) -> BatchNorm1d(256, affine=False)
  classifier   Linear(2048, 4096) -> BN -> GELU -> Linear(4096, 1000) -> BN -> Softmax(dim=1)
Columns: the dtype columns of ``python -m benchmarks`` (``epifuse.cli``'s spellings; default
fp32-3xtf32 = PyTorch's default precision, fp32-tf32, amp-bf16 and amp-fp16: fp32 models and
inputs under torch.autocast, the backward outside the region). Modes: training-mode forward
(no_grad), eval forward, training step (forward + backward with dX, the parameters' versions
bumped each step as an optimizer's update would), and the same step queued: its GPU time with the
host ahead (timing.measure_queued_rounds: steps issued behind a spin kernel and timed back to
back), what the head costs inside a model whose GPU work hides the host, where "train-step" times
each step alone, host latency included. Timing as the main benchmark (benchmarks/timing.py: CUDA
events, inputs rotated, implementations interleaved in 3 rounds).
--dry runs tiny shapes on whatever device there is (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

import epifuse
from epifuse import cli

from . import step_gemms, timing
from .cases import (DEFAULT_DTYPES, DEFAULT_PRECISIONS, DTYPES, TRAIN_STEP, DTypeSpec,
                    compile_model, estimate_call_s, estimate_timing_s, make_step, EST_CASE_S,
                    EST_COMPILE_S)

MODELS = ("projection", "classifier", "linear")
QUEUED = "train-step-queued"
MODES = ("train", "eval", TRAIN_STEP, QUEUED)
# in, hidden, out ("linear": one plain Linear(in, out), hidden unused)
DIMS = {"projection": (2048, 4096, 256), "classifier": (2048, 4096, 1000),
        "linear": (8192, 8192, 8192)}
DRY_DIMS = {"projection": (32, 64, 16), "classifier": (32, 64, 10), "linear": (32, 32, 32)}
BATCH, DRY_BATCH = 4096, 64
# The plain Linear's rows: its forward and its training step (eval is the same math).
LINEAR_MODES = ("train", TRAIN_STEP)


def build_model(name: str, dims: tuple[int, int, int], *, bias: bool = True) -> nn.Module:
    """The unfused model, initialized from the current RNG state; ``bias=False``: Linears
    without bias (as MoCo v3 builds its projector: the training loop's)."""
    d_in, hidden, d_out = dims
    if name == "projection":
        return nn.Sequential(
            nn.Linear(d_in, hidden, bias=bias), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden, bias=bias), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, d_out, bias=bias), nn.BatchNorm1d(d_out, affine=False))
    if name == "classifier":
        return nn.Sequential(
            nn.Linear(d_in, hidden, bias=bias), nn.BatchNorm1d(hidden), nn.GELU(),
            nn.Linear(hidden, d_out, bias=bias), nn.BatchNorm1d(d_out), nn.Softmax(dim=1))
    if name == "linear":  # a plain Linear (fuse's plain_linear): the 3x GEMM against SGEMM
        return nn.Sequential(nn.Linear(d_in, d_out, bias=bias))
    raise ValueError(f"unknown model {name!r} (expected one of {MODELS})")


@dataclass(frozen=True)
class HeadCase:
    """One row: a model at a batch size, a dtype column and a mode."""

    model: str
    spec: DTypeSpec
    mode: str
    dims: tuple[int, int, int]
    batch: int
    compile: bool = True

    @property
    def label(self) -> str:
        return f"{self.model} {self.spec.name} {self.mode}"

    @property
    def flops(self) -> float:
        """GEMM flops of one call (a step counts 3 GEMMs per Linear)."""
        d_in, hidden, d_out = self.dims
        layers = {"projection": ((d_in, hidden), (hidden, hidden), (hidden, d_out)),
                  "linear": ((d_in, d_out),)}.get(self.model, ((d_in, hidden), (hidden, d_out)))
        return 2.0 * self.batch * sum(k * n for k, n in layers) * (
            3 if self.mode.startswith(TRAIN_STEP) else 1)


def modes_for(modes) -> list[str]:
    """The real heads' modes for the main benchmark's --modes: a training step also queued."""
    return [m for m in MODES if m in modes or (m == QUEUED and TRAIN_STEP in modes)]


def plan(models, dtypes, modes, *, dry: bool, batch: Optional[int] = None,
         compile: bool = True) -> list[HeadCase]:
    """Every model x column x mode, in that order (the plain Linear in LINEAR_MODES only)."""
    dims = DRY_DIMS if dry else DIMS
    batch = batch or (DRY_BATCH if dry else BATCH)
    return [HeadCase(m, DTYPES[d], mode, dims[m], batch, compile)
            for m in models for d in dtypes for mode in modes
            if m != "linear" or mode in LINEAR_MODES]


def estimate_s(case: HeadCase, settings: timing.Settings, dry: bool) -> float:
    """Seconds one row takes, roughly (as cases.estimate_case_s)."""
    if dry:
        return 0.3 + 0.3 * case.compile
    call = estimate_call_s(case.flops, case.spec)
    if case.mode == QUEUED:
        calls = min(10, settings.iters) * (min(5, settings.iters) + 1) + settings.warmup
        timed = (3 if case.compile else 2) * calls * call
    else:
        timed = estimate_timing_s(call, settings, 3 if case.compile else 2)
    return EST_CASE_S + timed + (EST_COMPILE_S[case.mode.startswith(TRAIN_STEP)]
                                 if case.compile else 0.0)


def _callables(models: dict[str, Callable], mode: str, spec: DTypeSpec,
               device: torch.device) -> dict[str, Callable]:
    fns = {}
    for impl, (model, forward) in models.items():
        forward = spec.amp_calls(forward, device.type)
        model.train(mode != "eval")
        if mode.startswith(TRAIN_STEP):
            fns[impl] = make_step(model, forward, new_weights=True)
        else:
            def call(x, forward=forward):
                with torch.no_grad():
                    return forward(x)
            fns[impl] = call
    return fns


def _timings(results: dict) -> dict:
    """Per implementation, its timing dict, or {"error": ...} for one that raised."""
    return {k: ({"error": f"{type(v).__name__}: {v}"} if isinstance(v, Exception) else v)
            for k, v in results.items()}


def run_case(case: HeadCase, device: torch.device, settings: timing.Settings) -> dict:
    """One row: timings (or errors) of ours (the fused copy), eager and compile, peak MiB."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    eager = build_model(case.model, case.dims).to(device, case.spec.dtype)
    fused = copy.deepcopy(eager)
    _, report = epifuse.fuse(fused, precision=case.spec.precision)
    models = {"ours": (fused, fused), "eager": (eager, eager)}
    if case.compile:
        # A fresh dynamo cache for every case, as the KernelBench cases': each case compiles
        # another model instance of the same code, and past dynamo's recompile limit the
        # compiled wrapper runs eager without a word (a full run's later rows timed eager twice).
        torch._dynamo.reset()
        twin = copy.deepcopy(eager)
        models["compile"] = (twin, compile_model(twin, device))
    row = {"model": case.model, "dtype": case.spec.name, "mode": case.mode, "batch": case.batch,
           "dims": list(case.dims), "compile_timed": case.compile,
           "fused": [f.where for f in report.fused], "skipped": [s.where for s in report.skipped]}
    d_in, _, d_out = case.dims
    g = torch.Generator(device=device).manual_seed(1)
    count = timing.rotation_count(case.batch * d_in * 4, device, cap=4)
    xs = [torch.rand(case.batch, d_in, device=device, generator=g).to(case.spec.dtype)
          for _ in range(count)]
    if case.mode.startswith(TRAIN_STEP):
        inputs = [(x.clone().requires_grad_(),
                   torch.randn(case.batch, d_out, device=device, generator=g).to(case.spec.dtype))
                  for x in xs]
    else:
        inputs = xs
    with case.spec.context():
        fns = _callables(models, case.mode, case.spec, device)
        row["peak_mib"] = {}  # a queued step's peak is its train-step row's
        if case.mode == QUEUED:
            # Rounds of 10 steps (fewer in a dry run's few iterations).
            row["timings_ms"] = _timings(timing.measure_queued_rounds(
                fns, inputs, device, **timing.queued_counts(settings, warmup=settings.warmup)))
        else:
            results = timing.measure_rounds(fns, inputs, device, settings)
            row["timings_ms"] = _timings({k: (v if isinstance(v, Exception)
                                              else timing.to_dict(v))
                                          for k, v in results.items()})
            for impl, fn in fns.items():
                if isinstance(results[impl], Exception):
                    continue
                peak = timing.peak_memory(fn, inputs[0], device, getattr(fn, "release", None))
                if peak is not None:
                    row["peak_mib"][impl] = peak / 2**20
            if case.mode == TRAIN_STEP and not isinstance(results["ours"], Exception):
                # Our step's three GEMMs (forward, dX, dW) over the heads, from their ops' kernels.
                try:
                    row["step_gemms"] = step_gemms.measure(fns["ours"], inputs[0], device)
                except Exception as e:  # noqa: BLE001 -- a diagnostic column, as in cases.py
                    print(f"  {case.label}: step GEMMs not measured: {type(e).__name__}: {e}",
                          flush=True)
                finally:
                    fns["ours"].release(inputs[0])
    if case.compile:
        torch._dynamo.reset()
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def row_key(r: dict) -> tuple:
    return (r["model"], r["dtype"], r["mode"], r["batch"])


def ms(row: dict, impl: str) -> Optional[float]:
    t = row["timings_ms"].get(impl)
    return None if t is None or "error" in t else t["median_ms"]


def summary(row: dict) -> str:
    parts = [f"{impl} {ms(row, impl):.4g} ms" if ms(row, impl) is not None else f"{impl} n/a"
             for impl in ("ours", "eager", "compile") if impl in row["timings_ms"]]
    return (f"{row['model']} {row['dtype']} {row['mode']}: " + ", ".join(parts)
            + f"; fused {len(row['fused'])}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_heads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=None, help=f"rows (default {BATCH}; --dry "
                                                           f"{DRY_BATCH})")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    cli.add_dtype_arguments(p, default_dtypes="fp32 and amp (fp32-3xtf32, fp32-tf32, amp-bf16, "
                                              "amp-fp16)",
                            default_precisions=",".join(DEFAULT_PRECISIONS),
                            aliases=("--settings",))
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    p.add_argument("--out", default="bench-out/real-heads")
    p.add_argument("--markdown", default=None, help="also write the Markdown table to PATH")
    p.add_argument("--dry", action="store_true", help="tiny shapes, few calls (smoke test)")
    args = p.parse_args(argv)
    args.columns = [c.name for c in cli.columns(args, default_dtypes=DEFAULT_DTYPES,
                                                default_fp32_precisions=DEFAULT_PRECISIONS)]
    return args


def main(argv=None) -> int:
    from . import report  # the table's one definition (report imports this module)

    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = args.dry or device.type == "cpu"
    settings = (timing.Settings(warmup=1, iters=3, min_iters=1) if args.dry
                else timing.Settings())
    cases = plan(args.models, args.columns, args.modes, dry=args.dry, batch=args.batch,
                 compile=not args.no_compile)
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)",
           "torch": torch.__version__, "device": str(device)}
    rows: list[dict] = []
    os.makedirs(args.out, exist_ok=True)
    print(f"real heads: {len(cases)} rows, ~"
          f"{sum(estimate_s(c, settings, dry) for c in cases):.0f} s (estimate)", flush=True)

    def save() -> str:  # after every case, so that an interrupted run keeps what it measured
        with open(os.path.join(args.out, "real_heads.json"), "w") as fh:
            json.dump({"env": env, "rows": rows}, fh, indent=1)
        text = report.real_heads_markdown(env, rows)
        for path in [os.path.join(args.out, "real_heads.md")] + [args.markdown] * bool(
                args.markdown):
            with open(path, "w") as fh:
                fh.write(text)
        return text

    for case in cases:
        rows.append(run_case(case, device, settings))
        save()
        print(summary(rows[-1]), flush=True)
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
