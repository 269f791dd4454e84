"""Small batches: the projection heads of self-supervised learning as their papers build them,
two views per step at the per-GPU batches they train with (64, 128, 256 rows per view), fused by
``epifuse.fuse`` as a user would, against eager PyTorch and ``torch.compile``.

    python -m benchmarks.small_batch [--models M ...] [--batches 64 128 256] [--settings S ...]
                                     [--modes head sgd] [--compile-batches 128 256]
                                     [--no-compile] [--quick] [--out bench-out/small-batch]
                                     [--markdown PATH] [--dry]

A section of ``python -m benchmarks`` (BENCHMARKS.md, "Small batches"); alone, this writes its
table.

Models (as the papers' code builds them; the BatchNorm heads' Linears without bias):
  barlow_twins  Barlow Twins' projector: Linear(2048, 8192) -> BN -> ReLU -> Linear(8192, 8192)
                -> BN -> ReLU -> Linear(8192, 8192) (the last one plain)
  moco_v3       MoCo v3's projector and predictor (ResNet-50): Linear(2048, 4096) -> BN -> ReLU
                -> Linear(4096, 4096) -> BN -> ReLU -> Linear(4096, 256) -> BatchNorm1d(256,
                affine=False), then Linear(256, 4096) -> BN -> ReLU -> Linear(4096, 256)
  simclr_v1     SimCLR v1's projection head (ResNet-50): Linear(2048, 2048) -> ReLU ->
                Linear(2048, 128), with biases, no BatchNorm (plain Linears only)

One timed step, as SSL code runs a head (each view a separate call)::

    with torch.autocast(...):                  # amp-bf16 only
        z1, z2 = model(x1), model(x2)
        loss = -F.cosine_similarity(z1, z2).mean()
    loss.backward()
    # mode "sgd": optimizer.step() (SGD, momentum 0.9, fused); mode "head": the parameters'
    # versions bumped instead, as an optimizer's in-place update would

x1, x2 [rows, 2048] require grad (the head sits on a backbone: dX is computed); gradients are
dropped before each step. Settings: ``fp32-3xtf32`` (PyTorch's default precision: eager IEEE fp32
SGEMM, the fused heads the 3x FP16 split), ``fp32-tf32``, ``amp-bf16``. Implementations, each its
own copy of one seeded model: eager; compile (``torch.compile(model)``); fused
(``epifuse.fuse`` of a copy); compile_fused (``torch.compile`` of the fused copy). torch.compile
runs at the batches of ``--compile-batches`` only (each batch and setting is a compile).

Columns: ms per step, timed back to back (``timing.measure_rounds``: CUDA events around each
step, steps queued behind each other, implementations interleaved in 3 rounds; a step whose host
is slower than its GPU work counts the host's time); the GPU's time per step with the host
ahead (``timing.measure_queued_rounds``); where the GPU time goes, from one profiled run of
3 steps (torch.profiler, CUDA kernels by name): GEMMs (CUTLASS and cuBLAS), operand preparation
(the 3x splits, 16-bit casts and copies of operands: epifuse's ``split_fp16``,
``narrowing_cast``, ``transpose`` kernels, PyTorch's copy kernels, which under autocast are its
casts), everything else; and the step's peak memory above the parameters (``timing.peak_memory``).
Whether each fused step ran ``epifuse::fused_head`` for every fused head, forward and backward,
is checked by profiling one step (``loop.check_path``).

--dry runs tiny shapes on whatever device there is (a smoke test; the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import epifuse

from . import timing
from .cases import DTYPES, DTypeSpec, compile_model, describe, free_memory
from .loop import _timings, check_path, fused_linears, make_optimizer

MODELS = ("barlow_twins", "moco_v3", "simclr_v1")
# in, hidden, out
DIMS = {"barlow_twins": (2048, 8192, 8192), "moco_v3": (2048, 4096, 256),
        "simclr_v1": (2048, 2048, 128)}
DRY_DIMS = {"barlow_twins": (32, 64, 64), "moco_v3": (32, 64, 16), "simclr_v1": (32, 32, 16)}
BATCHES, DRY_BATCHES = (64, 128, 256), (8, 16)
COMPILE_BATCHES = (128, 256)
SETTINGS = ("fp32-3xtf32", "fp32-tf32", "amp-bf16")
MODES = ("head", "sgd")
IMPLS = ("eager", "compile", "fused", "compile_fused")
COMPILED = {"compile": False, "compile_fused": True}  # impl -> whether its model is fused
VIEWS = 2
EST_COMPILE_S = 25.0  # a compile of one model's forward and backward at one batch and setting
EST_ROW_S = 3.0

# Kernel names -> where the GPU time goes. Operand preparation first: a split or cast kernel of
# ours has no "gemm" in its name, but be explicit about the order.
_OPERANDS = re.compile(r"split_fp16|narrowing_cast|transpose_kernel|copy_kernel|_to_copy", re.I)
_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|Kernel2", re.I)
BREAKDOWN = ("gemm", "operands", "other")


def build_model(name: str, dims: tuple[int, int, int]) -> nn.Module:
    """The unfused head, initialized from the current RNG state."""
    d_in, hidden, d_out = dims

    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Linear(i, o, bias=False), nn.BatchNorm1d(o), nn.ReLU(inplace=True)]

    if name == "barlow_twins":
        return nn.Sequential(*block(d_in, hidden), *block(hidden, hidden),
                             nn.Linear(hidden, d_out, bias=False))
    if name == "simclr_v1":  # no BatchNorm: every layer a plain Linear (with its bias)
        return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(inplace=True),
                             nn.Linear(hidden, d_out))
    if name == "moco_v3":
        projector = nn.Sequential(*block(d_in, hidden), *block(hidden, hidden),
                                  nn.Linear(hidden, d_out, bias=False),
                                  nn.BatchNorm1d(d_out, affine=False))
        predictor = nn.Sequential(*block(d_out, hidden), nn.Linear(hidden, d_out, bias=False))
        return nn.Sequential(projector, predictor)
    raise ValueError(f"unknown model {name!r} (expected one of {MODELS})")


@dataclass(frozen=True)
class SmallBatchGroup:
    """The rows of one model, batch and setting (one per mode); compiled once for all modes."""

    model: str
    batch: int
    spec: DTypeSpec
    dims: tuple[int, int, int]
    modes: tuple[str, ...]
    compile: bool

    @property
    def impls(self) -> tuple[str, ...]:
        return IMPLS if self.compile else tuple(i for i in IMPLS if i not in COMPILED)

    @property
    def label(self) -> str:
        return f"{self.model} {self.batch} rows x {VIEWS} views {self.spec.name}"


def plan(models, settings, batches, modes, *, dry: bool, compile: bool,
         compile_batches=COMPILE_BATCHES) -> list[SmallBatchGroup]:
    dims = DRY_DIMS if dry else DIMS
    return [SmallBatchGroup(m, b, DTYPES[s], dims[m], tuple(modes),
                            compile and (dry or b in compile_batches))
            for m in models for s in settings for b in batches]


def estimate_s(groups, dry: bool) -> float:
    if dry:
        return 2.0 * len(groups)
    return sum(EST_ROW_S * len(g.modes) * len(g.impls) / 2 + EST_COMPILE_S * 2 * g.compile
               for g in groups)


def make_step(model: nn.Module, forward: Callable, spec: DTypeSpec, device: torch.device,
              mode: str) -> Callable:
    """One step on a pair of views (x1, x2): both through ``forward`` (each its own call, in
    one autocast region as a training step opens), a cosine loss, backward; then the optimizer
    (mode "sgd") or the parameters' versions bumped (mode "head": ``increment_version`` launches
    no kernel, so the step times no update, but nothing made from a weight survives the step, as
    in training)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer("sgd", params, device)[0] if mode == "sgd" else None

    def step(views) -> None:
        x1, x2 = views
        x1.grad = x2.grad = None
        for p in params:
            p.grad = None
        if optimizer is None:
            for p in params:
                torch.autograd.graph.increment_version(p)
        with spec.amp(device.type):
            loss = -F.cosine_similarity(forward(x1), forward(x2), dim=-1).mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    def release(views) -> None:
        views[0].grad = views[1].grad = None
        for p in params:
            p.grad = None

    step.release = release
    return step


def gpu_breakdown(step: Callable, views, device: torch.device, steps: int = 3) -> dict:
    """GPU ms per step by kind of kernel (BREAKDOWN) and kernels per step, from one profiled run
    of ``steps`` steps; {} on the CPU."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    step(views)
    timing.sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(views)
        timing.sync(device)
    out = dict.fromkeys(BREAKDOWN, 0.0)
    kernels = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "memset" in e.name.lower() \
                or "memcpy" in e.name.lower():
            continue
        kind = ("operands" if _OPERANDS.search(e.name) else
                "gemm" if _GEMM.search(e.name) else "other")
        out[kind] += e.device_time / 1e3 / steps  # us -> ms
        kernels += 1
    out["kernels"] = kernels / steps
    return out


def _views(group: SmallBatchGroup, device: torch.device) -> list:
    d_in = group.dims[0]
    gen = torch.Generator(device=device).manual_seed(1)
    count = timing.rotation_count(VIEWS * group.batch * d_in * 4, device, cap=4)
    return [tuple(torch.rand(group.batch, d_in, device=device, generator=gen).requires_grad_()
                  for _ in range(VIEWS)) for _ in range(count)]


def build_models(group: SmallBatchGroup, device: torch.device) -> tuple[dict, list, list]:
    """Per implementation (model, what a step calls), copies of one seeded fp32 model; the
    fused heads' places and what fuse left, with its reasons."""
    torch.manual_seed(0)
    base = build_model(group.model, group.dims).to(device)
    models, fused, skipped, counts = {"eager": (base, base)}, [], [], (0, 0)
    for impl in group.impls[1:]:
        model = copy.deepcopy(base)
        if impl in ("fused", "compile_fused"):
            _, rep = epifuse.fuse(model, precision=group.spec.precision)
            fused = [f.where for f in rep.fused]
            skipped = [f"{s.where}: {s.reason}" for s in rep.skipped]
            # Per step: each head's ops once per view; each plain Linear's where it runs fused.
            counts = (VIEWS * sum(f.kind == "head" for f in rep.fused),
                      fused_linears(rep, group.spec, calls=VIEWS))
        models[impl] = (model, model if impl == "fused" else compile_model(model, device))
    return models, fused, skipped, counts


def run_group(group: SmallBatchGroup, device: torch.device, settings: timing.Settings,
              log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """The group's rows, one per mode."""
    t0 = time.perf_counter()
    if group.compile:
        torch._dynamo.reset()
    models, fused, skipped, (heads, linears) = build_models(group, device)
    views = _views(group, device)
    q = timing.queued_counts(settings)
    rows = []
    for mode in group.modes:
        r0 = time.perf_counter()
        row = {"model": group.model, "batch": group.batch, "views": VIEWS,
               "setting": group.spec.name, "mode": mode, "dims": list(group.dims),
               "compile_timed": group.compile, "fused": fused, "skipped": skipped,
               "device": device.type}
        fns, errors, first_s, path, peaks, breakdown = {}, {}, {}, {}, {}, {}
        with group.spec.context():
            for impl, (model, forward) in models.items():
                try:
                    fn = make_step(model, forward, group.spec, device, mode)
                    timing.sync(device)
                    c0 = time.perf_counter()
                    fn(views[0])  # compiles the compiled ones (their first mode)
                    timing.sync(device)
                    first_s[impl] = round(time.perf_counter() - c0, 3)
                    if impl in ("fused", "compile_fused"):
                        path[impl] = check_path(lambda fn=fn: fn(views[1 % len(views)]), model,
                                                views[0][0], heads, group.spec, device,
                                                linears=linears,
                                                compiled=impl != "fused")
                    fns[impl] = fn
                except Exception as e:  # noqa: BLE001 -- reported per implementation
                    errors[impl] = e
            results = timing.measure_rounds(fns, views, device, settings) if fns else {}
            timed = {k: f for k, f in fns.items() if not isinstance(results.get(k), Exception)}
            queued = timing.measure_queued_rounds(timed, views, device, **q) if timed else {}
            for impl, fn in timed.items():
                try:
                    breakdown[impl] = gpu_breakdown(fn, views[0], device)
                    peak = timing.peak_memory(fn, views[0], device, release=fn.release)
                    peaks[impl] = None if peak is None else peak / 2**20
                except Exception as e:  # noqa: BLE001
                    errors[impl] = e
        row["timings_ms"] = _timings({**errors, **results})
        row["queued_ms"] = _timings({**errors, **queued})
        row["gpu_ms"] = breakdown
        row["peak_mib"] = peaks
        row["path"] = path
        row["first_call_s"] = first_s
        row["wall_s"] = round(time.perf_counter() - (t0 if not rows else r0), 2)
        rows.append(row)
        log(summary(row))
        free_memory(device)
    models.clear()
    views.clear()
    if group.compile:
        torch._dynamo.reset()
    free_memory(device)
    return rows


# --------------------------------------------------------------------------- rows


def row_key(r: dict) -> tuple:
    return (r["model"], r["batch"], r["setting"], r["mode"])


def ms(row: dict, impl: str, key: str = "timings_ms") -> Optional[float]:
    t = (row.get(key) or {}).get(impl) or {}
    return t.get("median_ms")


def ratio(row: dict, base: str, ours: str, key: str = "timings_ms") -> Optional[float]:
    a, b = ms(row, base, key), ms(row, ours, key)
    return a / b if a and b else None


def fell_back(row: dict) -> list[tuple[str, str]]:
    """(impl, reason) of the fused implementations whose step did not run the fused ops."""
    return [(i, p["reason"]) for i, p in (row.get("path") or {}).items() if p.get("reason")]


def summary(row: dict) -> str:
    parts = [f"{i} {ms(row, i):.3f} ms" if ms(row, i) else f"{i} failed"
             for i in IMPLS if i in row["timings_ms"]]
    back = fell_back(row)
    return (f"small batch {row['model']} {row['batch']}x{row['views']} {row['setting']} "
            f"{row['mode']}: " + ", ".join(parts)
            + ("; fused ops in every fused step" if not back
               else "; fell back: " + "; ".join(f"{i}: {r}" for i, r in back)))


# --------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help=f"rows per view (default {' '.join(map(str, BATCHES))})")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--compile-batches", type=int, nargs="+", default=list(COMPILE_BATCHES),
                   help="batches at which torch.compile is timed")
    p.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    p.add_argument("--quick", action="store_true", help="fewer steps per measurement")
    p.add_argument("--out", default="bench-out/small-batch")
    p.add_argument("--markdown", default=None, help="also write the Markdown table to PATH")
    p.add_argument("--dry", action="store_true", help="tiny shapes, few steps (smoke test)")
    args = p.parse_args(argv)
    if args.batches is not None and any(b < 2 for b in args.batches):
        p.error("--batches: BatchNorm training needs a batch of at least 2 rows")
    return args


def main(argv=None) -> int:
    from . import report

    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = args.dry or device.type == "cpu"
    batches = args.batches or list(DRY_BATCHES if dry else BATCHES)
    settings = (timing.Settings(warmup=1, iters=3, min_iters=1) if dry
                else timing.Settings(warmup=3, iters=15, max_seconds=0.5) if args.quick
                else timing.Settings())
    groups = plan(args.models, args.settings, batches, args.modes, dry=dry,
                  compile=not args.no_compile, compile_batches=args.compile_batches)
    env = report.environment(device)
    doc = {"env": env, "small_batch": []}
    os.makedirs(args.out, exist_ok=True)
    print(f"small batches: {len(groups) * len(args.modes)} rows, ~{estimate_s(groups, dry):.0f} s"
          " (estimate)", flush=True)

    def save() -> str:
        with open(os.path.join(args.out, "small_batch.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
        text = report.small_batch_markdown(doc)
        for path in [os.path.join(args.out, "small_batch.md")] + [args.markdown] * bool(
                args.markdown):
            with open(path, "w") as fh:
                fh.write(text)
        return text

    for group in groups:
        try:
            doc["small_batch"] += run_group(group, device, settings,
                                            lambda m: print(m, flush=True))
        except Exception as e:  # noqa: BLE001 -- a row of failures, the run goes on
            doc["small_batch"] += [failed_row(group, mode, e) for mode in group.modes]
        save()
    print(save())
    return 0


def failed_row(group: SmallBatchGroup, mode: str, e: BaseException) -> dict:
    return {"model": group.model, "batch": group.batch, "views": VIEWS,
            "setting": group.spec.name, "mode": mode, "dims": list(group.dims),
            "compile_timed": group.compile, "fused": [], "skipped": [], "peak_mib": {},
            "gpu_ms": {}, "queued_ms": {}, "path": {},
            "timings_ms": {i: {"error": describe(e)} for i in group.impls}}


if __name__ == "__main__":
    raise SystemExit(main())
