"""Training loop: the steps a data-parallel training run takes on one GPU, with the fused heads
of ``epifuse.fuse`` against eager PyTorch and ``torch.compile``, optimizer and loss scaling
included.

    python -m benchmarks.loop [--batches 256 1024 4096] [--models M ...] [--settings S ...]
                              [--optimizers sgd adamw] [--no-compile] [--no-host-time]
                              [--out bench-out/loop] [--markdown PATH] [--dry]

A section of ``python -m benchmarks`` (BENCHMARKS.md, "Training loop"); alone, this writes its
tables.

Models (``real_heads.build_model``): the MoCo v3 projection MLP as MoCo v3 builds it, every Linear
without bias (Linear(2048, 4096, bias=False) -> BN -> ReLU -> Linear(4096, 4096, bias=False) -> BN
-> ReLU -> Linear(4096, 256, bias=False) -> BatchNorm1d(256, affine=False)), and the classifier
(Linear(2048, 4096) -> BN -> GELU -> Linear(4096, 1000) -> BN -> Softmax), at per-GPU batches of
256, 1024 and 4096 rows.

One timed step is what a training loop runs per batch::

    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(...):            # the amp settings
        loss = (model(x) * g).sum()      # a fixed g per input: the loss's gradient is g
    loss.backward()                      # amp-fp16: scaler.scale(loss).backward()
    optimizer.step()                     # amp-fp16: scaler.step(optimizer); scaler.update()

x requires grad (the head sits on a backbone: dX is computed) and its gradient is dropped before
each step; g is N(0, 1) / batch (a mean-reduced loss's scale, which GradScaler's default scale
does not overflow). Optimizers: SGD(lr=1e-3, momentum=0.9) and AdamW(lr=1e-3), each with
``fused=True`` (PyTorch's one-kernel multi-tensor update) where the device supports it, else
PyTorch's default (the row says which). Settings (``epifuse.cli``'s spellings): ``fp32-tf32`` (fp32
with TF32 GEMMs, the fused heads ``precision='tf32'``), ``amp-bf16`` and ``amp-fp16`` (fp32
parameters under torch.autocast; fp16 with a ``torch.amp.GradScaler`` as a user runs it).

Implementations of each row, each with its own copy of the same initial parameters and its own
optimizer:
  eager             the model
  fused             ``epifuse.fuse`` of a copy
  compile           ``torch.compile(model)``, default mode
  compile_ro        ``torch.compile(model, mode="reduce-overhead")`` (CUDA graphs; each step
                    starts with ``torch.compiler.cudagraph_mark_step_begin()``)
  compile_fused     ``torch.compile`` of the fused copy, default mode
  compile_fused_ro  ``torch.compile`` of the fused copy, mode="reduce-overhead"
torch.compile compiles the model, and the loss, backward and optimizer run eagerly around it: the
pattern PyTorch's tutorials and most training scripts use (compiling the whole step, optimizer
included, is rarer and recompiles with every change of the optimizer). The compiled models are
compiled once per model, batch and setting and serve both optimizers' rows.

Timing (benchmarks/timing.py): every step timed alone, the device synchronized before it and
CUDA events around it (``measure_rounds(alone=True)``: the step's latency from an idle GPU, the
host's time included, what a loop that synchronizes every step meets), inputs rotated,
implementations interleaved in 3 rounds, the median; and the queued GPU time
(``timing.measure_queued_rounds``: steps issued back to back behind a spin kernel, what the step
costs when a larger model's GPU work hides the host); and the host's time per step
(``host_per_step``: steps issued while a spin kernel keeps the GPU busy, so that only the host's
share counts: where a step timed alone goes beyond its queued GPU time). The first call of each
implementation (compilation, CUDA-graph warm-up) is recorded, not timed.

The path: on the first row of each model, batch and setting, one step of each fused
implementation (eager, and each compiled one after its compiling call: reduce-overhead's
recording call) runs under ``torch.profiler`` (CPU events), which counts its calls of
``epifuse::fused_head`` and of ``epifuse::head_grad_coefficients`` (every fused backward's); a
row whose fused model ran fewer than one per head is marked, with ``epifuse.fast_path_reason``'s reason (on the CPU: the heads run
their modules).

Host time per head: for the projection MLP's first head (Linear(2048, 4096, bias=False) -> BN ->
ReLU, batch 256), the host (Python) time of its forward and of its backward, eager modules
against the fused head (``timing.measure_host_checked``: calls issued while a spin kernel keeps
the GPU busy, so only the host's time counts); the backward's is (forward + backward) - forward.

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

from . import report, timing
from .cases import (DTYPES, EST_FIRST_COMPILE_S, DTypeSpec, compile_model, describe,
                    estimate_call_s, free_memory)
from .real_heads import DIMS, DRY_DIMS, build_model

# The heads a training loop trains (the real heads' BatchNorm models; the plain Linear is a
# real-heads row only).
MODELS = ("projection", "classifier")

SETTINGS = ("fp32-tf32", "amp-bf16", "amp-fp16")
BATCHES, DRY_BATCHES = (256, 1024, 4096), (16, 64)
OPTIMIZERS = tuple(report.LOOP_OPTIMIZERS)  # sgd, adamw
BIAS = {"projection": False, "classifier": True}  # MoCo v3 builds its MLPs without biases
LR = 1e-3
IMPLS = ("eager", "fused", "compile", "compile_ro", "compile_fused", "compile_fused_ro")
FUSED_IMPLS = ("fused", "compile_fused", "compile_fused_ro")
RO_IMPLS = ("compile_ro", "compile_fused_ro")
# How each compiled implementation is made: (fused copy, torch.compile mode).
COMPILED = {"compile": (False, None), "compile_ro": (False, "reduce-overhead"),
            "compile_fused": (True, None), "compile_fused_ro": (True, "reduce-overhead")}
# What one fused head's forward and backward each run once: fused_head, and head_grad_coefficients,
# which every fused backward calls (inside fused_head_backward, or, under autocast, from the
# autograd node's stepwise backward that frees each 16-bit cast after its last GEMM).
HEAD_OPS = ("epifuse::fused_head", "epifuse::head_grad_coefficients")
# A plain Linear's fused forward (its backward is the op's C++ autograd node, no op of its own).
LINEAR_OP = "epifuse::fused_linear"
HOST_MODEL, HOST_BATCH, DRY_HOST_BATCH = "projection", 256, 16

# Rough costs (seconds) for the estimate printed before the section: building, copying, fusing
# and profiling a group's models; torch.compile's warm-up of a model's training step, its first
# compile in a group and its reduce-overhead twin's (same graph: inductor's kernels cached); an
# eager step's host time at least (3 heads' modules, autocast, the optimizer); the host-time
# table per setting.
EST_GROUP_S = 1.0
EST_COMPILE_S = (4.0, 2.5)
EST_STEP_HOST_S = 1.0e-3
EST_HOST_SETTING_S = 1.5


@dataclass(frozen=True)
class LoopGroup:
    """One model at one batch in one setting: its models are built (and compiled) once and
    timed with each optimizer, a row per optimizer."""

    model: str
    spec: DTypeSpec
    batch: int
    dims: tuple[int, int, int]
    optimizers: tuple[str, ...]
    compile: bool = True

    @property
    def label(self) -> str:
        return f"{self.model} batch {self.batch} {self.spec.name}"

    @property
    def impls(self) -> tuple[str, ...]:
        return IMPLS if self.compile else IMPLS[:2]

    @property
    def layers(self) -> list[tuple[int, int]]:
        d_in, hidden, d_out = self.dims
        return ([(d_in, hidden), (hidden, hidden), (hidden, d_out)] if self.model == "projection"
                else [(d_in, hidden), (hidden, d_out)])

    @property
    def flops(self) -> float:
        """GEMM flops of one step (3 GEMMs per Linear: forward, dX, dW)."""
        return 3 * 2.0 * self.batch * sum(k * n for k, n in self.layers)

    @property
    def params(self) -> int:
        return sum(k * n + 3 * n for k, n in self.layers)


def plan(models, settings, batches, optimizers, *, dry: bool,
         compile: bool = True) -> list[LoopGroup]:
    """Every model x batch x setting (the rows: x optimizer), in that order."""
    dims = DRY_DIMS if dry else DIMS
    for s in settings:
        if s not in SETTINGS:
            raise ValueError(f"setting {s!r} is not one of the training loop's {SETTINGS}")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"optimizer {o!r} is not one of {OPTIMIZERS}")
    if any(b < 2 for b in batches):
        raise ValueError("BatchNorm training needs a batch of at least 2 rows")
    return [LoopGroup(m, DTYPES[s], b, dims[m], tuple(optimizers), compile)
            for m in models for b in batches for s in settings]


def settings_for(dtypes) -> list[str]:
    """The loop's settings among a run's dtype columns (python -m benchmarks --dtype)."""
    return [s for s in SETTINGS if s in dtypes]


def timing_settings(s: timing.Settings) -> timing.Settings:
    """The main benchmark's step count (a step timed alone varies by 10-20% from the host: the
    median needs them), a shorter cap; the compiles take most of the section's ~5 minutes."""
    return timing.Settings(warmup=min(3, s.warmup), iters=min(50, s.iters),
                           max_seconds=min(0.5, s.max_seconds), min_iters=min(5, s.iters))


def host_counts(s: timing.Settings) -> dict:
    """measure_host's counts for a step's host time: rounds of 8 steps behind a busy GPU."""
    return {"warmup": min(2, s.warmup), "rounds": min(3, s.iters), "calls": min(8, s.iters)}


def host_per_step(fn: Callable, pair, device: torch.device, s: timing.Settings) -> dict:
    """The host's time to issue one step while the GPU is kept busy (so the step only queues
    its work): Python, dispatch, allocations, launches, the optimizer's and the autograd
    engine's share included; the GPU's time excluded. gpu_kept_busy False: a step synchronized
    (GradScaler's check for infs), and the time includes waiting for the GPU."""
    t = timing.measure_host_checked(lambda: fn(pair), device, **host_counts(s))
    return {"median_ms": t["median_us"] / 1e3, "min_ms": t["min_us"] / 1e3,
            "calls": t["calls"], "gpu_kept_busy": t["gpu_kept_busy"]}


def queued_counts(s: timing.Settings) -> dict:
    """measure_queued_rounds' counts: 3 rounds of 8 steps."""
    return timing.queued_counts(s, calls=8, rounds=3)


def estimate_step_s(group: LoopGroup) -> float:
    """A guess at one step's time: its GEMMs, the optimizer's passes over the parameters."""
    gpu = estimate_call_s(group.flops, group.spec) + group.params * 4 * 8 / 3e12
    return max(EST_STEP_HOST_S, gpu)


def estimate_s(groups, settings: timing.Settings, dry: bool, host_settings=()) -> float:
    """Seconds the section takes, roughly: compiles dominate (4 per group)."""
    s, q = timing_settings(settings), queued_counts(settings)
    if dry:
        return sum(0.3 + (1.6 if g.compile else 0.0) + 0.4 * len(g.optimizers)
                   for g in groups) + 0.3 * len(host_settings)
    h = host_counts(settings)
    calls = (2 + 1 + s.warmup + s.iters + q["warmup"] + q["calls"] * (q["rounds"] + 1)
             + h["warmup"] + h["calls"] * (h["rounds"] + 1))
    total = EST_FIRST_COMPILE_S if any(g.compile for g in groups) else 0.0
    for g in groups:
        total += EST_GROUP_S + (2 * sum(EST_COMPILE_S) if g.compile else 0.0)
        total += len(g.optimizers) * len(g.impls) * calls * estimate_step_s(g)
    return total + EST_HOST_SETTING_S * len(host_settings)


# --------------------------------------------------------------------------- one step


def make_optimizer(name: str, params, device: torch.device):
    """(optimizer, how): ``fused=True`` where PyTorch supports it for these parameters on this
    device, else PyTorch's default implementation, with the reason."""
    cls, kwargs = ((torch.optim.SGD, {"lr": LR, "momentum": 0.9}) if name == "sgd"
                   else (torch.optim.AdamW, {"lr": LR}))
    params = list(params)
    try:
        return cls(params, fused=True, **kwargs), "fused"
    except (RuntimeError, ValueError, TypeError) as e:
        return cls(params, **kwargs), f"default ({describe(e)})"


def make_loop_step(model: nn.Module, forward: Callable, optimizer, spec: DTypeSpec,
                   device: torch.device, *, cuda_graphs: bool = False) -> Callable:
    """One training-loop step on an (x, g) pair: zero_grad(set_to_none=True), the forward and
    the loss in the setting's autocast region, backward, optimizer step (amp-fp16: through a
    GradScaler). ``cuda_graphs``: a reduce-overhead model's step first marks a new step for its
    CUDA graphs, as PyTorch documents for training loops."""
    scaler = (torch.amp.GradScaler(device.type) if spec.autocast == torch.float16 else None)

    def step(pair) -> None:
        x, g = pair
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        x.grad = None  # the backbone's gradient: a fresh one every step
        with spec.amp(device.type):
            loss = (forward(x) * g).sum()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    step.scaler = scaler
    return step


def count_head_ops(fn: Callable[[], object]) -> dict:
    """Calls of the head's forward and backward ops (HEAD_OPS) in one ``fn()``
    (torch.profiler, CPU events: the ops' dispatches, eager or from compiled code)."""
    from torch.profiler import ProfilerActivity, profile

    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # no profiler start/stop lines in the log
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = [e.name for e in prof.events()]
    return {"forward": names.count(HEAD_OPS[0]), "backward": names.count(HEAD_OPS[1]),
            "linear": names.count(LINEAR_OP)}


def head_reason(model: nn.Module, x: torch.Tensor, spec: DTypeSpec,
                device: torch.device) -> Optional[str]:
    """epifuse.fast_path_reason for the model's first Linear -> BatchNorm1d on its input (what
    its fused head decides), or without one the first plain Linear's, in the setting's autocast
    region."""
    mods = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.BatchNorm1d))]
    pairs = [(a, b) for a, b in zip(mods, mods[1:])
             if isinstance(a, nn.Linear) and isinstance(b, nn.BatchNorm1d)]
    with spec.amp(device.type), torch.no_grad():
        if pairs:
            return epifuse.fast_path_reason(epifuse.nn.FusedLinearBatchNorm(*pairs[0]), x)
        if mods:  # plain Linears only (SimCLR): the first one's decision
            return epifuse.linear.linear_reason(mods[0], x, None)
    return "no Linear in the model"


def check_path(fn: Callable[[], object], model: nn.Module, x: torch.Tensor, heads: int,
               spec: DTypeSpec, device: torch.device, *, compiled: bool = False,
               linears: int = 0) -> dict:
    """How many of ``heads`` fused heads one ``fn()`` ran on epifuse::fused_head, forward and
    backward, and of ``linears`` plain Linears on epifuse::fused_linear (the fused model's plain
    Linears where the setting fuses them: fused_linears), and the reason where fewer. Where epifuse.fast_path_reason already says the heads
    run their modules (the CPU dry run) it says so without profiling (kineto logs every profiler
    start and stop on a machine without a GPU)."""
    reason = head_reason(model, x, spec, device)
    if reason is not None and device.type != "cuda":
        fn()
        return {"forward": 0, "backward": 0, "linear": 0, "heads": heads, "linears": linears,
                "reason": reason}
    counts = count_head_ops(fn)
    if counts["forward"] >= heads and counts["backward"] >= heads and counts["linear"] >= linears:
        reason = None
    elif reason is None:
        reason = ("the compiled model did not call the fused ops" if compiled
                  else "the heads ran their modules")
    return dict(counts, heads=heads, linears=linears, reason=reason)


def fused_linears(fuse_report, spec: DTypeSpec, calls: int = 1) -> int:
    """How many epifuse::fused_linear calls ``calls`` forwards of a model fused with
    ``fuse_report`` make in ``spec``: every plain Linear where the GEMM is the 3x split (fp32 at
    default precision), none at 16 bits or in TF32, where they run PyTorch's GEMM
    (epifuse.linear.PYTORCH_GEMM)."""
    plain = sum(f.kind == "linear" for f in fuse_report.fused)
    three_x = spec.precision == epifuse.precision.TF32X3 or (
        spec.precision is None and spec.torch_precision == "highest")
    return plain * calls if spec.autocast is None and spec.dtype == torch.float32 and three_x else 0


def _cudagraph_skips() -> Optional[int]:
    """Inductor's count of graphs it ran without CUDA graphs (torch's counters; None where this
    torch has none)."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 -- a diagnostic only
        return None


# --------------------------------------------------------------------------- a group of rows


def _timings(results: dict) -> dict:
    return {k: ({"error": describe(v)} if isinstance(v, Exception)
                else timing.to_dict(v) if not isinstance(v, dict) else v)
            for k, v in results.items()}


def _inputs(group: LoopGroup, device: torch.device) -> list:
    d_in, _, d_out = group.dims
    gen = torch.Generator(device=device).manual_seed(1)
    count = timing.rotation_count(group.batch * d_in * 4, device, cap=4)
    return [(torch.rand(group.batch, d_in, device=device, generator=gen).requires_grad_(),
             torch.randn(group.batch, d_out, device=device, generator=gen) / group.batch)
            for _ in range(count)]


def build_models(group: LoopGroup, device: torch.device) -> tuple[dict, list]:
    """Per implementation (model, what a step calls), all from one seeded fp32 model, and the
    fused heads' places."""
    torch.manual_seed(0)
    base = build_model(group.model, group.dims, bias=BIAS[group.model]).to(device)
    models = {"eager": (base, base)}
    fused_where: list = []
    fuse_report = None
    for impl in group.impls[1:]:
        fuse_it, mode = COMPILED.get(impl, (True, None))
        model = copy.deepcopy(base)
        if fuse_it:
            _, fuse_report = epifuse.fuse(model, precision=group.spec.precision)
            fused_where = [f.where for f in fuse_report.fused]
        models[impl] = (model, model if impl == "fused" else compile_model(model, device, mode))
    return models, fused_where, fuse_report


def run_group(group: LoopGroup, device: torch.device, settings: timing.Settings,
              log: Callable[[str], None] = lambda m: None) -> list[dict]:
    """The group's rows, one per optimizer: timings (or errors) per implementation, the path of
    the fused ones, the optimizer's implementation."""
    t0 = time.perf_counter()
    s, q = timing_settings(settings), queued_counts(settings)
    if group.compile:  # a fresh dynamo cache (and CUDA-graph trees) for every group
        torch._dynamo.reset()
    models, fused_where, fuse_report = build_models(group, device)
    inputs = _inputs(group, device)
    heads = sum(f.kind == "head" for f in fuse_report.fused) if fuse_report is not None else 0
    linears = fused_linears(fuse_report, group.spec) if fuse_report is not None else 0
    path: dict = {}
    first_s: dict = {}
    skips: dict = {}
    rows = []
    for n, opt_name in enumerate(group.optimizers):
        r0 = time.perf_counter()
        row = {"model": group.model, "batch": group.batch, "setting": group.spec.name,
               "optimizer": opt_name, "dims": list(group.dims), "bias": BIAS[group.model],
               "compile_timed": group.compile, "fused_heads": heads, "fused": fused_where,
               "device": device.type}
        fns, errors, how = {}, {}, {}
        for impl, (model, forward) in models.items():
            try:
                opt, how[impl] = make_optimizer(opt_name, model.parameters(), device)
                fns[impl] = make_loop_step(model, forward, opt, group.spec, device,
                                           cuda_graphs=impl in RO_IMPLS and device.type == "cuda")
            except Exception as e:  # noqa: BLE001 -- reported per implementation
                errors[impl] = e
        row["optimizer_impl"] = how.get("eager") or next(iter(how.values()), "n/a")
        with group.spec.context():
            for impl, fn in list(fns.items()):
                try:  # the first call (compiles on the group's first row), then the path
                    before = _cudagraph_skips()
                    timing.sync(device)
                    c0 = time.perf_counter()
                    fn(inputs[0])
                    timing.sync(device)
                    if n == 0:
                        first_s[impl] = round(time.perf_counter() - c0, 3)
                        after = _cudagraph_skips()
                        if impl in RO_IMPLS and before is not None and after is not None:
                            skips[impl] = after - before
                    if n == 0 and impl in FUSED_IMPLS:
                        path[impl] = check_path(lambda: fn(inputs[1 % len(inputs)]),
                                                models[impl][0], inputs[0][0], heads, group.spec,
                                                device, compiled=impl != "fused",
                                                linears=linears)
                except Exception as e:  # noqa: BLE001
                    errors[impl] = e
                    del fns[impl]
            results = timing.measure_rounds(fns, inputs, device, s, alone=True) if fns else {}
            timed = {k: fn for k, fn in fns.items() if not isinstance(results.get(k), Exception)}
            queued = timing.measure_queued_rounds(timed, inputs, device, **q) if timed else {}
            host = {}
            for impl, fn in timed.items():
                try:
                    host[impl] = host_per_step(fn, inputs[0], device, settings)
                except Exception as e:  # noqa: BLE001
                    host[impl] = e
        row["timings_ms"] = _timings({**errors, **results})
        row["queued_ms"] = _timings({**errors, **queued})
        row["host_ms"] = _timings({**errors, **host})
        row["path"] = {k: v for k, v in path.items() if k in models}
        row["first_call_s"] = dict(first_s)
        row["cudagraph_skips"] = dict(skips)
        row["optimizer_impls"] = how
        row["wall_s"] = round(time.perf_counter() - (t0 if n == 0 else r0), 2)  # 1st: set-up too
        rows.append(row)
        log(summary(row))
        fns.clear()
        free_memory(device)
    models.clear()
    inputs.clear()
    if group.compile:
        torch._dynamo.reset()
    free_memory(device)
    return rows


# --------------------------------------------------------------------------- host time per head


def host_head(spec: DTypeSpec, device: torch.device, dry: bool) -> dict:
    """Host time (us) of the projection MLP's first head's forward, and of its backward
    ((forward + backward) - forward), eager modules against the fused head."""
    dims = (DRY_DIMS if dry else DIMS)[HOST_MODEL]
    batch = DRY_HOST_BATCH if dry else HOST_BATCH
    row = {"setting": spec.name, "model": HOST_MODEL, "batch": batch, "dims": list(dims[:2]),
           "timings_us": {}, "failures": {}, "path": None}
    try:
        torch.manual_seed(0)
        eager = nn.Sequential(*list(build_model(HOST_MODEL, dims, bias=BIAS[HOST_MODEL]))[:3])
        eager = eager.to(device)
        fused = copy.deepcopy(eager)
        epifuse.fuse(fused, precision=spec.precision)
        gen = torch.Generator(device=device).manual_seed(2)
        x = torch.rand(batch, dims[0], device=device, generator=gen).requires_grad_()
        g = torch.randn(batch, dims[1], device=device, generator=gen)
    except Exception as e:  # noqa: BLE001
        row["failures"] = {"eager": describe(e), "fused": describe(e)}
        return row
    with spec.context():
        for impl, model in (("eager", eager), ("fused", fused)):
            params = list(model.parameters())
            call = spec.amp_calls(model, device.type)

            def fwd_bwd(call=call, params=params) -> None:
                x.grad = None
                for p in params:
                    p.grad = None
                call(x).backward(g)

            try:
                fwd = timing.measure_host_checked(lambda call=call: call(x), device, calls=20)
                both = timing.measure_host_checked(fwd_bwd, device, calls=20)
                row["timings_us"][impl] = {"forward": fwd, "forward_backward": both,
                                           "backward_us": both["median_us"] - fwd["median_us"]}
                if impl == "fused":
                    row["path"] = check_path(fwd_bwd, fused, x, 1, spec, device)
            except Exception as e:  # noqa: BLE001
                row["failures"][impl] = describe(e)
    return row


# --------------------------------------------------------------------------- rows


def row_key(r: dict) -> tuple:
    return (r["model"], r["batch"], r["setting"], r["optimizer"])


def summary(row: dict) -> str:
    parts = [f"{impl} {report.fmt_ms(report.loop_ms(row, impl))} ms"
             for impl in IMPLS if impl in row["timings_ms"]]
    back = report.loop_path(row)
    path = ("fused_head in every fused step" if not back else
            "fell back: " + "; ".join(f"{i}: {r}" for i, r in back))
    return (f"loop {row['model']} batch {row['batch']} {row['setting']} "
            f"{report.LOOP_OPTIMIZERS[row['optimizer']]} ({row['optimizer_impl']}): "
            + ", ".join(parts) + f"; {path}")


def host_summary(row: dict) -> str:
    t = row["timings_us"]
    parts = [f"{impl} fwd {t[impl]['forward']['median_us']:.1f} us, bwd "
             f"{t[impl]['backward_us']:.1f} us" if impl in t else f"{impl} failed"
             for impl in ("eager", "fused")]
    return f"loop host time per head {row['setting']}: " + "; ".join(parts)


# --------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help=f"per-GPU batch sizes (default {' '.join(map(str, BATCHES))}; --dry "
                        f"{' '.join(map(str, DRY_BATCHES))})")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    cli.add_dtype_arguments(p, default_dtypes=", ".join(SETTINGS), default_precisions="tf32",
                            aliases=("--settings",))
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--no-compile", action="store_true", help="do not time torch.compile")
    p.add_argument("--no-host-time", action="store_true",
                   help="no host-time-per-head table")
    p.add_argument("--quick", action="store_true", help="fewer steps per measurement")
    p.add_argument("--out", default="bench-out/loop")
    p.add_argument("--markdown", default=None, help="also write the Markdown tables to PATH")
    p.add_argument("--dry", action="store_true", help="tiny shapes, few steps (smoke test)")
    args = p.parse_args(argv)
    args.settings = [c.name for c in cli.columns(args, default_dtypes=SETTINGS,
                                                 default_fp32_precisions=("tf32",))]
    other = [s for s in args.settings if s not in SETTINGS]
    if other:
        p.error(f"--settings: the training loop runs {', '.join(SETTINGS)}, not "
                f"{', '.join(other)}")
    if args.batches is not None and any(b < 2 for b in args.batches):
        p.error("--batches: BatchNorm training needs a batch of at least 2 rows")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dry = args.dry or device.type == "cpu"
    batches = args.batches or list(DRY_BATCHES if dry else BATCHES)
    base = (timing.Settings(warmup=1, iters=3, min_iters=1) if args.dry
            else timing.Settings(warmup=3, iters=10, max_seconds=0.5) if args.quick
            else timing.Settings())
    groups = plan(args.models, args.settings, batches, args.optimizers, dry=dry,
                  compile=not args.no_compile)
    host_settings = [] if args.no_host_time else list(args.settings)
    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)",
           "torch": torch.__version__, "device": str(device)}
    doc = {"env": env, "loop": [], "loop_host": []}
    os.makedirs(args.out, exist_ok=True)
    print(f"training loop: {len(groups) * len(args.optimizers)} rows, ~"
          f"{estimate_s(groups, base, dry, host_settings):.0f} s (estimate)", flush=True)

    def save() -> str:
        with open(os.path.join(args.out, "loop.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
        text = report.loop_markdown(doc)
        for path in [os.path.join(args.out, "loop.md")] + [args.markdown] * bool(args.markdown):
            with open(path, "w") as fh:
                fh.write(text)
        return text

    for group in groups:
        doc["loop"] += run_group(group, device, base, lambda m: print(m, flush=True))
        save()
    for name in host_settings:
        doc["loop_host"].append(host_head(DTYPES[name], device, dry))
        print(host_summary(doc["loop_host"][-1]), flush=True)
        save()
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
