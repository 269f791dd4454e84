"""Small batches and whole heads: the projection heads of self-supervised learning and a tabular
MLP as their papers build them, two views per step at the per-GPU batches they train with (64,
128, 256 rows per view) and one call of a large batch (4096 rows), plus one end-to-end row (the
Barlow Twins projector on a ResNet-50, two views of 128 images), fused by ``epifuse.fuse`` as a
user would, against eager PyTorch and ``torch.compile``.

    python -m benchmarks.small_batch [--models M ...] [--batches 128 256 4096] [--settings S ...]
                                     [--modes head sgd] [--compile-batches 128]
                                     [--no-compile] [--quick] [--out bench-out/small-batch]
                                     [--markdown PATH] [--dry]

A section of ``python -m benchmarks`` (BENCHMARKS.md, "Small batches"); alone, this writes its
table.

Models (as the papers' code builds them: a Linear that a BatchNorm follows without bias, the
others with one; the batches each runs at by default in MODEL_BATCHES):
  barlow_twins  Barlow Twins' projector: Linear(2048, 8192) -> BN -> ReLU -> Linear(8192, 8192)
                -> BN -> ReLU -> Linear(8192, 8192) (the last one plain)
  moco_v3       MoCo v3's projector and predictor (ResNet-50): Linear(2048, 4096) -> BN -> ReLU
                -> Linear(4096, 4096) -> BN -> ReLU -> Linear(4096, 256) -> BatchNorm1d(256,
                affine=False), then Linear(256, 4096) -> BN -> ReLU -> Linear(4096, 256)
  byol          BYOL's projector and predictor: Linear(2048, 4096) -> BN -> ReLU ->
                Linear(4096, 256), then Linear(256, 4096) -> BN -> ReLU -> Linear(4096, 256)
  simclr_v1     SimCLR v1's projection head (ResNet-50): Linear(2048, 2048) -> ReLU ->
                Linear(2048, 128), with biases, no BatchNorm (plain Linears only)
  tabular       a tabular MLP: Linear(512, 1024) -> BN -> ReLU -> Linear(1024, 1024) -> BN ->
                ReLU -> Linear(1024, 128)
  resnet50_barlow_twins
                end to end: a ResNet-50 backbone (torchvision's where installed, else the same
                architecture from benchmarks/resnet.py; its fc dropped) and the Barlow Twins
                projector, two views of 128 images at 224 x 224, an SGD step (never compiled)

One timed step, as SSL code runs a head (each view a separate call)::

    with torch.autocast(...):                  # amp-bf16 only
        z1, z2 = model(x1), model(x2)
        loss = -F.cosine_similarity(z1, z2).mean()      # one view (4096 rows): mean(z ** 2)
    loss.backward()
    # mode "sgd": optimizer.step() (SGD, momentum 0.9, fused); mode "head": the parameters'
    # versions bumped instead, as an optimizer's in-place update would

x1, x2 [rows, d_in] require grad (the head sits on a backbone: dX is computed); gradients are
dropped before each step. Settings: ``fp32-3xtf32`` (PyTorch's default precision: eager IEEE fp32
SGEMM, the fused heads the 3x FP16 split), ``fp32-tf32``, ``amp-bf16``. Implementations, each its
own copy of one seeded model: eager; compile (``torch.compile(model)``); fused
(``epifuse.fuse`` of a copy); compile_fused (``torch.compile`` of the fused copy, for
COMPILE_FUSED_MODELS). torch.compile runs at the batches of ``--compile-batches`` only (each
batch and setting is a compile).

Columns: ms per step, timed back to back (``timing.measure_rounds``: CUDA events around each
step, steps queued behind each other, implementations interleaved in 3 rounds; a step whose host
is slower than its GPU work counts the host's time); the GPU's time per step with the host
ahead (``timing.measure_queued_rounds``); where the GPU time goes, from one profiled run of
3 steps (torch.profiler, CUDA kernels by name): GEMMs (CUTLASS and cuBLAS; the backbone's
convolutions in the end-to-end row), operand preparation (the 3x splits, 16-bit casts and copies
of operands: epifuse's ``split_fp16``, ``narrowing_cast``, ``transpose`` kernels, PyTorch's copy
kernels, which under autocast are its casts), everything else; and the step's peak memory above
the parameters (``timing.peak_memory``). Whether each fused step ran ``epifuse::fused_head`` for
every fused head, forward and backward, and ``epifuse::fused_linear`` for every plain Linear the
setting fuses, is checked by profiling one step (``loop.check_path``).

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

from . import resnet, timing
from .cases import DTYPES, DTypeSpec, compile_model, describe, free_memory
from .loop import _timings, check_path, fused_linears, make_optimizer

MODELS = ("barlow_twins", "moco_v3", "byol", "simclr_v1", "tabular", "resnet50_barlow_twins")
# The end-to-end model: the Barlow Twins projector on a ResNet-50 backbone, fed images.
END_TO_END = "resnet50_barlow_twins"
# in, hidden, out (the end-to-end row: its head's, fed the backbone's 2048 features)
DIMS = {"barlow_twins": (2048, 8192, 8192), "moco_v3": (2048, 4096, 256),
        "byol": (2048, 4096, 256), "simclr_v1": (2048, 2048, 128), "tabular": (512, 1024, 128),
        END_TO_END: (2048, 8192, 8192)}
DRY_DIMS = {"barlow_twins": (32, 64, 64), "moco_v3": (32, 64, 16), "byol": (32, 64, 16),
            "simclr_v1": (32, 32, 16), "tabular": (16, 32, 8), END_TO_END: (256, 64, 64)}
IMAGE, DRY_IMAGE = 224, 32  # the end-to-end row's images (height = width)
DRY_BACKBONE_WIDTH = 8  # the CPU dry run's ResNet-50 at 1/8 of its channels
# Rows per view. SSL code calls a head once per view, two views per step, at 64-256 rows per GPU;
# LARGE_BATCH is one call of 4096 rows (a large-batch or tabular step: one view).
DRY_BATCHES = (8,)  # one: the dry run tests the plumbing, in CI too
LARGE_BATCH = 4096
# The batches each model runs at by default (what --batches asks for, where a model runs it).
MODEL_BATCHES = {"barlow_twins": (128, 256, LARGE_BATCH), "moco_v3": (128, 256),
                 "byol": (128, LARGE_BATCH), "simclr_v1": (128, LARGE_BATCH),
                 "tabular": (128, LARGE_BATCH), END_TO_END: (128,)}
COMPILE_BATCHES = (128,)
# torch.compile of the fused model: for the heads whose every large layer has a BatchNorm or whose
# fused blocks dominate (the compile-of-fused question is the same for the others).
COMPILE_FUSED_MODELS = ("barlow_twins", "moco_v3")
SETTINGS = ("fp32-3xtf32", "fp32-tf32", "amp-bf16")
MODES = ("head", "sgd")
# Mode "sgd" (head + loss + SGD) at this batch for these models; the end-to-end row is an SGD step
# only.
SGD_BATCHES, SGD_MODELS = (128,), ("barlow_twins", "moco_v3", END_TO_END)
IMPLS = ("eager", "compile", "fused", "compile_fused")
COMPILED = {"compile": False, "compile_fused": True}  # impl -> whether its model is fused
VIEWS = 2
EST_COMPILE_S = 25.0  # a compile of one model's forward and backward at one batch and setting
EST_ROW_S = 3.0
EST_END_TO_END_S = 20.0  # one setting of the ResNet-50 row (its steps are ~0.1-0.3 s)

# Kernel names -> where the GPU time goes. Operand preparation first: a split or cast kernel of
# ours has no "gemm" in its name, but be explicit about the order.
_OPERANDS = re.compile(r"split_fp16|narrowing_cast|transpose_kernel|copy_kernel|_to_copy", re.I)
_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|Kernel2|conv", re.I)
BREAKDOWN = ("gemm", "operands", "other")


def views_for(batch: int) -> int:
    """Views per step: two at SSL's batches, one call at LARGE_BATCH and above."""
    return 1 if batch >= LARGE_BATCH else VIEWS


def build_head(name: str, dims: tuple[int, int, int]) -> nn.Module:
    """The unfused head, initialized from the current RNG state (as the papers' code builds
    them: the Linears a BatchNorm follows without bias, the others with one)."""
    d_in, hidden, d_out = dims

    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Linear(i, o, bias=False), nn.BatchNorm1d(o), nn.ReLU(inplace=True)]

    if name in ("barlow_twins", END_TO_END):
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
    if name == "byol":  # projector and predictor: the same MLP, its last Linear plain
        return nn.Sequential(nn.Sequential(*block(d_in, hidden), nn.Linear(hidden, d_out)),
                             nn.Sequential(*block(d_out, hidden), nn.Linear(hidden, d_out)))
    if name == "tabular":  # two BatchNorm blocks, a plain output layer
        return nn.Sequential(*block(d_in, hidden), *block(hidden, hidden),
                             nn.Linear(hidden, d_out))
    raise ValueError(f"unknown model {name!r} (expected one of {MODELS})")


def build_model(name: str, dims: tuple[int, int, int], *, dry: bool = False) -> nn.Module:
    """The unfused model: the head, or for END_TO_END a ResNet-50 backbone and the head (its
    ``backbone`` attribute says where the ResNet-50 came from)."""
    if name != END_TO_END:
        return build_head(name, dims)
    backbone, source = resnet.resnet50(DRY_BACKBONE_WIDTH if dry else 64)
    model = nn.Sequential(backbone, build_head(name, dims))
    model.backbone_source = source
    return model


@dataclass(frozen=True)
class SmallBatchGroup:
    """The rows of one model, batch and setting (one per mode); compiled once for all modes."""

    model: str
    batch: int
    spec: DTypeSpec
    dims: tuple[int, int, int]
    modes: tuple[str, ...]
    compile: bool
    dry: bool = False

    @property
    def views(self) -> int:
        return views_for(self.batch) if not self.dry else VIEWS

    @property
    def impls(self) -> tuple[str, ...]:
        if not self.compile:
            return tuple(i for i in IMPLS if i not in COMPILED)
        if self.model in COMPILE_FUSED_MODELS or self.dry:
            return IMPLS
        return tuple(i for i in IMPLS if i != "compile_fused")

    @property
    def label(self) -> str:
        return f"{self.model} {self.batch} rows x {self.views} views {self.spec.name}"


def plan(models, settings, batches=None, modes=MODES, *, dry: bool, compile: bool,
         compile_batches=COMPILE_BATCHES) -> list[SmallBatchGroup]:
    """The groups: each model at ``batches`` (None: the batches it runs at by default,
    MODEL_BATCHES; a dry run DRY_BATCHES), mode "sgd" where SGD_MODELS / SGD_BATCHES ask for it
    (every batch given explicitly), the end-to-end row an SGD step only and never compiled (a
    compile of ResNet-50's step takes minutes)."""
    dims = DRY_DIMS if dry else DIMS
    if batches is None and dry:
        batches = DRY_BATCHES
    groups = []
    for m in models:
        for s in settings:
            for b in (MODEL_BATCHES[m] if batches is None else batches):
                sgd = m in SGD_MODELS and (batches is not None or b in SGD_BATCHES)
                ms = tuple(x for x in modes if (x == "sgd" and sgd)
                           or (x == "head" and m != END_TO_END))
                if ms:
                    groups.append(SmallBatchGroup(
                        m, b, DTYPES[s], dims[m], ms,
                        compile and m != END_TO_END and (dry or b in compile_batches), dry))
    return groups


def estimate_s(groups, dry: bool) -> float:
    if dry:
        return 2.0 * len(groups)
    return sum(EST_END_TO_END_S if g.model == END_TO_END else
               EST_ROW_S * len(g.modes) * len(g.impls) / 2
               + EST_COMPILE_S * sum(i in COMPILED for i in g.impls)
               for g in groups)


def make_step(model: nn.Module, forward: Callable, spec: DTypeSpec, device: torch.device,
              mode: str) -> Callable:
    """One step on a tuple of views: each through ``forward`` (its own call, in one autocast
    region as a training step opens), a loss (two views: -cosine_similarity(z1, z2).mean(); one:
    mean(z^2)), backward; then the optimizer (mode "sgd") or the parameters' versions bumped (mode
    "head": ``increment_version`` launches no kernel, so the step times no update, but nothing made
    from a weight survives the step, as in training)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer("sgd", params, device)[0] if mode == "sgd" else None

    def step(views) -> None:
        for v in views:
            v.grad = None
        for p in params:
            p.grad = None
        if optimizer is None:
            for p in params:
                torch.autograd.graph.increment_version(p)
        with spec.amp(device.type):
            zs = [forward(v) for v in views]
            loss = (-F.cosine_similarity(zs[0], zs[1], dim=-1).mean() if len(zs) == 2
                    else zs[0].float().square().mean())
        loss.backward()
        if optimizer is not None:
            optimizer.step()

    def release(views) -> None:
        for v in views:
            v.grad = None
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
    """Tuples of the step's views, enough of them to rotate through: [rows, d_in] features that
    require grad (the head sits on a backbone: dX is computed), or for the end-to-end row
    [rows, 3, H, W] images."""
    if group.model == END_TO_END:
        side = DRY_IMAGE if group.dry else IMAGE
        shape = (group.batch, 3, side, side)
    else:
        shape = (group.batch, group.dims[0])
    gen = torch.Generator(device=device).manual_seed(1)
    numel = 1
    for d in shape:
        numel *= d
    count = timing.rotation_count(group.views * numel * 4, device, cap=4)
    grad = group.model != END_TO_END
    return [tuple(torch.rand(shape, device=device, generator=gen).requires_grad_(grad)
                  for _ in range(group.views)) for _ in range(count)]


def build_models(group: SmallBatchGroup, device: torch.device) -> tuple[dict, list, list]:
    """Per implementation (model, what a step calls), copies of one seeded fp32 model; the
    fused heads' places and what fuse left, with its reasons."""
    torch.manual_seed(0)
    base = build_model(group.model, group.dims, dry=group.dry).to(device)
    models, fused, skipped, counts = {"eager": (base, base)}, [], [], (0, 0)
    for impl in group.impls[1:]:
        model = copy.deepcopy(base)
        if impl in ("fused", "compile_fused"):
            _, rep = epifuse.fuse(model, precision=group.spec.precision)
            fused = [f.where for f in rep.fused]
            skipped = [f"{s.where}: {s.reason}" for s in rep.skipped]
            # Per step: each head's ops once per view; each plain Linear's where it runs fused.
            counts = (group.views * sum(f.kind == "head" for f in rep.fused),
                      fused_linears(rep, group.spec, calls=group.views))
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
    # What the first head is fed (the fused-path check asks fast_path_reason about it).
    head_input = (views[0][0] if group.model != END_TO_END
                  else torch.rand(group.batch, group.dims[0], device=device))
    q = timing.queued_counts(settings)
    rows = []
    for mode in group.modes:
        r0 = time.perf_counter()
        row = {"model": group.model, "batch": group.batch, "views": group.views,
               "setting": group.spec.name, "mode": mode, "dims": list(group.dims),
               "compile_timed": group.compile, "fused": fused, "skipped": skipped,
               "device": device.type,
               "backbone": getattr(models["eager"][0], "backbone_source", None),
               "image": (DRY_IMAGE if group.dry else IMAGE) if group.model == END_TO_END
               else None}
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
                                                head_input, heads, group.spec, device,
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
                   help="rows per view, every model at each (default: each model's own, "
                        "MODEL_BATCHES; one view from 4096 rows)")
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
    batches = args.batches or (list(DRY_BATCHES) if dry else None)
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
    return {"model": group.model, "batch": group.batch, "views": group.views,
            "setting": group.spec.name, "mode": mode, "dims": list(group.dims),
            "compile_timed": group.compile, "fused": [], "skipped": [], "peak_mib": {},
            "gpu_ms": {}, "queued_ms": {}, "path": {},
            "timings_ms": {i: {"error": describe(e)} for i in group.impls}}


if __name__ == "__main__":
    raise SystemExit(main())
