"""``python -m benchmarks`` (from the repository root; ``scripts/bench.sh`` from anywhere): every
section of BENCHMARKS.md in one run.

1. KernelBench problems 84 (gemm_bn_scale_softmax) and 39 (gemm_scale_bn) at their KernelBench
   sizes: ModelNew against PyTorch eager and torch.compile, train and eval forwards and training
   steps, by default at PyTorch's default fp32 precision ('fp32-3xtf32': ours 3xTF32, PyTorch
   IEEE fp32), with TF32 ('fp32-tf32') and as fp32 models under torch.autocast to bf16 and fp16
   ('amp-bf16', 'amp-fp16'); each with the peak memory of one call and the errors against
   float64; our GEMM alone beside torch.mm; the host time of a small-batch forward.
2. Real heads (``benchmarks.real_heads``): a projection MLP and a classifier fused by
   ``epifuse.fuse``, in the same columns, forwards and training steps.
3. Training loop (``benchmarks.loop``): the same models' whole training steps (zero_grad,
   forward, loss, backward, SGD / AdamW step; fp32-tf32, amp-bf16, amp-fp16 with GradScaler) at
   batches 256 to 4096, eager and fused, each also under torch.compile (default and
   reduce-overhead), and the host time of one head's forward and backward.
4. Small batches and whole heads (``benchmarks.small_batch``): Barlow Twins', MoCo v3's, BYOL's
   and SimCLR v1's heads and a tabular MLP, two views per step at 128-256 rows per view and one
   call of 4096 rows, default fp32, TF32 and bf16 autocast, eager, compile, fused and compile of
   the fused model, with where the GPU time goes; and one end-to-end row (ResNet-50 + Barlow
   Twins projector, two views of 128 images, SGD).
5. Our row softmax against torch.softmax and the copy bandwidth.
6. On a machine with 2 GPUs or more, data-parallel training steps (``benchmarks.distributed``);
   otherwise the page says it was not run.

Prints an estimate of each section's time before it and its time after it, a table at the end,
and writes bench.json (after every configuration: --resume measures only what is missing),
bench.md, bench.txt and PNG charts to --out; ``--markdown BENCHMARKS.md`` writes the page itself
(charts in BENCHMARKS-charts/). ``--device cpu`` is a dry run at tiny sizes that tests the
plumbing; without a GPU the default device falls back to it, with a note. Problems, dtypes and
precisions are spelled as for ``python -m epifuse`` (``epifuse.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

import torch

from epifuse import cli

from . import distributed, loop, real_heads, report, small_batch
from .cases import (DEFAULT_DTYPES, DEFAULT_PRECISIONS, DRY_SWEEP_M, DTYPES, MODES, SWEEP_M,
                    Runner, Shape, base_state, build_plan, describe, estimate_case_s, free_memory,
                    new_row, EST_FIRST_COMPILE_S)
from .timing import Settings

AUTO = "auto"  # --device default: cuda when there is one, else the CPU dry run


def _csv(kind: str, choices, convert=str):
    def parse(text: str):
        out = []
        for t in filter(None, (t.strip() for t in text.split(","))):
            try:
                v = convert(t)
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad {kind} {t!r}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {t!r}; choose from {','.join(map(str, choices))}")
            out += [v] if v not in out else []
        if not out:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        return out
    return parse


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark epifuse against PyTorch eager and torch.compile: KernelBench "
                    "problems 84 and 39, real heads fused by epifuse.fuse, our softmax, and "
                    "data-parallel steps on 2 GPUs; BENCHMARKS.md in one run.",
        epilog="Output: a table on stdout; bench.json, bench.md, bench.txt and PNG charts in "
               "--out. Failures of single configurations are reported in the table.")
    cli.add_selection_arguments(
        p, default_dtypes="fp32 and amp: fp32-3xtf32, fp32-tf32, amp-bf16, amp-fp16",
        default_precisions=",".join(DEFAULT_PRECISIONS) + " (ieee on request)")
    p.add_argument("--modes", "--mode", type=_csv("mode", MODES), default=list(MODES),
                   help="comma list of train,eval,train-step (default all three): training-"
                        "mode and eval-mode forwards, and training steps (forward + backward "
                        "with dX; fixed shapes only, not the --sweep); the real heads run the "
                        "same modes (a training step also queued)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="do not time torch.compile(Model)")
    p.add_argument("--sweep", action="store_true",
                   help="also run problem 84 at 8192->8192 over a range of batch sizes M")
    p.add_argument("--sweep-m", type=_csv("M", None, int), default=None,
                   help="the M values of --sweep (default " + ",".join(map(str, SWEEP_M))
                        + "; dry run " + ",".join(map(str, DRY_SWEEP_M)) + ")")
    p.add_argument("--sweep-compile", action="store_true",
                   help="time torch.compile on the sweep points too (one compilation each)")
    p.add_argument("--host-time", action=argparse.BooleanOptionalAction, default=True,
                   help="host (CPU) time per forward of ours and eager at problem 84's small "
                        "shape, 128x1024->512 (default on; needs problem 84 and a forward mode)")
    p.add_argument("--softmax", action=argparse.BooleanOptionalAction, default=True,
                   help="softmax-alone sweep over row lengths, and the copy bandwidth (default on)")
    p.add_argument("--real-heads", action=argparse.BooleanOptionalAction, default=True,
                   help="the real heads (benchmarks.real_heads) in the selected dtypes and "
                        "modes (default on)")
    p.add_argument("--small-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="the small-batch SSL heads (benchmarks.small_batch): settings "
                        + ",".join(small_batch.SETTINGS) + ", whatever --dtype says")
    p.add_argument("--loop", action=argparse.BooleanOptionalAction, default=None,
                   help="the training loop (benchmarks.loop): optimizer steps of the real heads' "
                        "models at batches " + ",".join(map(str, loop.BATCHES)) + " in the "
                        "selected settings among " + ",".join(loop.SETTINGS) + " (default on: "
                        "on CUDA, and in a --quick CPU dry run at tiny sizes)")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                   help="data-parallel steps (benchmarks.distributed; default: on a machine "
                        "with 2 GPUs or more; --distributed with --device cpu: gloo dry run)")
    p.add_argument("--nproc", type=int, default=2,
                   help="processes (GPUs) of the data-parallel section (default 2)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per measurement (default 50, --quick 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up calls per measurement (default 10, --quick 3)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per measurement: slow calls get fewer iterations, at "
                        "least 5 (default 2.0, --quick 0.5)")
    p.add_argument("--quick", action="store_true", help="fewer iterations, for smoke runs")
    p.add_argument("--out", default="bench-out",
                   help="output folder for JSON, Markdown, text and PNG (default bench-out)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the Markdown report to PATH (e.g. BENCHMARKS.md); its charts "
                        "go to PATH's folder as <name>-charts/")
    p.add_argument("--device", default=AUTO,
                   help="cuda, cuda:N, or cpu for a dry run at tiny sizes (default: cuda, or cpu "
                        "with a note when there is no GPU)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the results already in --out/bench.json (same GPU and torch): "
                        "configurations there are not measured again, and those outside this "
                        "run's selection stay in the report. For runs cut short, or split into "
                        "parts (e.g. --problems 84, then --problems 39 --resume)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress lines")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    if args.sweep_m is not None and any(m < 1 for m in args.sweep_m):
        p.error("--sweep-m values must be >= 1")
    args.iters = args.iters if args.iters is not None else (10 if args.quick else 50)
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
    if args.max_seconds is None:
        args.max_seconds = 0.5 if args.quick else 2.0
    if args.iters < 1 or args.warmup < 0 or args.max_seconds <= 0:
        p.error("--iters must be >= 1, --warmup >= 0, --max-seconds > 0")
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    sel = cli.selection(args, default_dtypes=DEFAULT_DTYPES,
                        default_fp32_precisions=DEFAULT_PRECISIONS)
    args.problems = list(sel.problems)
    args.dtypes = [c.name for c in sel.columns]  # fp32-<prec.>, bf16, fp16, amp-*: DTYPES' keys
    return args


def resolve_device(name: str) -> torch.device:
    if name == AUTO:
        if torch.cuda.is_available():
            name = "cuda"
        else:  # like `python -m epifuse`: a machine without a GPU still runs
            print("benchmarks: no CUDA device: running the CPU dry run (--device cpu) at tiny "
                  "sizes instead.", flush=True)
            name = "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("benchmarks: no CUDA device available; use --device cpu for a dry run")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        sys.exit(f"benchmarks: unsupported device {name!r} (cuda or cpu)")
    return device


def case_key(r: dict) -> tuple:
    return (r["problem"], r["tag"], r["M"], r["K"], r["N"], r["dtype"], r["mode"],
            r["compile_timed"])


def host_key(r: dict) -> tuple:
    return (r["problem"], r["M"], r["K"], r["N"], r["dtype"], r["mode"])


def softmax_key(r: dict) -> tuple:
    return (r["dtype"], r["N"], r["M"])


def load_previous(path: str, env: dict, log) -> Optional[dict]:
    """An earlier bench.json in --out, when measured on the same GPU, torch and device."""
    if not os.path.exists(path):
        log(f"--resume: no {path} yet; measuring everything")
        return None
    try:
        with open(path) as f:
            doc = json.load(f)
        old = doc["env"]
        if any(old.get(k) != env.get(k) for k in ("gpu", "torch", "cuda", "device")):
            log(f"--resume: {path} was measured on {old.get('gpu')} / torch {old.get('torch')}; "
                "not reusing it")
            return None
        for r in doc["cases"]:  # written before torch.mm's column was renamed
            for d in (r["timings_ms"], r["failures"]):
                if "cublas" in d:
                    d["torch_mm"] = d.pop("cublas")
        prev = {"cases": {case_key(r): r for r in doc["cases"]},
                "host": {host_key(r): r for r in doc.get("host_time", [])},  # older files: none
                "softmax": {softmax_key(r): r for r in doc.get("softmax", [])},
                "copy": (doc.get("copy_bandwidth") or {}).get("gbps") and doc["copy_bandwidth"],
                "real_heads": {real_heads.row_key(r): r for r in doc.get("real_heads") or []},
                "loop": {loop.row_key(r): r for r in doc.get("loop") or []},
                "small_batch": {small_batch.row_key(r): r
                                for r in doc.get("small_batch") or []},
                "loop_host": {r["setting"]: r for r in doc.get("loop_host") or []},
                "distributed": (doc.get("distributed") or {}).get("results") and doc[
                    "distributed"],
                "date": old.get("date"), "commands": old.get("commands") or [old.get("command")]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"--resume: cannot read {path} ({type(e).__name__}: {e}); measuring everything")
        return None
    log(f"--resume: reusing {len(prev['cases'])} configurations, {len(prev['host'])} host-time "
        f"points, {len(prev['softmax'])} softmax points, {len(prev['real_heads'])} real-heads "
        f"rows and {len(prev['loop'])} training-loop rows from {path} ({prev['date']})")
    return prev


def _summary(r: dict) -> str:
    label = f"p{r['problem']} {report.dims(r)} {r['dtype']} {r['mode']}"
    if r["skipped"]:
        return f"{label}: skipped ({r['skipped']})"
    parts = [f"{label}: ours {report.fmt_ms(report.ms(r, 'ours'))} ms"] + [
        f"{b} {report.fmt_ms(report.ms(r, b))} ms ({report.fmt_x(report.speedup(r, b))})"
        for b in ("eager", "compile")]
    path = r["path"] if r["path"] in (None, "fused") else f"reference: {r['path']}"
    peaks = "/".join(report.fmt_mib(report.peak_mib(r, i)) for i in ("ours", "eager", "compile"))
    return ", ".join(parts) + f"; path {path}; peak MiB ours/eager/compile {peaks}"


def _host_line(r: dict) -> str:
    t = r["timings_us"]
    return ", ".join(f"{i} {t[i]['median_us']:.1f} us" if i in t else f"{i} failed"
                     for i in ("ours", "eager")) + \
        f" (ours / eager {report.fmt_num(report.host_ratio(r), 2)})"


class Run:
    """One run's document (bench.json), saved after every configuration, and its log."""

    def __init__(self, args: argparse.Namespace, env: dict, settings_doc: dict,
                 prev: Optional[dict]) -> None:
        self.args, self.prev, self.t0 = args, prev, time.perf_counter()
        self.path = os.path.join(args.out, "bench.json")
        self.doc = {"complete": False, "env": env, "settings": settings_doc, "cases": [],
                    "host_time": [], "softmax": [], "copy_bandwidth": None, "real_heads": [],
                    "small_batch": [],
                    "loop": [], "loop_host": [], "distributed": None}
        env["sections_s"] = {}
        self.done, self.total = 0, 0

    def log(self, msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def save(self) -> None:
        with open(self.path + ".tmp", "w") as f:  # atomic: a kill mid-write keeps the last file
            json.dump(self.doc, f, indent=2)  # an infinite error as Infinity, which json.load reads
        os.replace(self.path + ".tmp", self.path)

    def step(self, label: str) -> None:
        self.done += 1
        if self.args.progress:
            self.log(f"[{self.done}/{self.total} {time.perf_counter() - self.t0:6.0f}s] {label}")

    def reused(self, kind: str, key) -> Optional[dict]:
        return (self.prev or {}).get(kind, {}).get(key)

    def section(self, name: str, count: int, estimate_s: float, body: Callable[[], None]) -> None:
        """Runs ``body`` (one section of the page), with its estimate before and time after."""
        if not count:
            return
        self.log(f"== {report.SECTION_NAMES[name]}: {count} configurations, estimate "
                 f"~{estimate_s:.0f} s")
        t0 = time.perf_counter()
        body()
        took = time.perf_counter() - t0
        self.doc["env"]["sections_s"][name] = round(took, 1)
        self.log(f"== {report.SECTION_NAMES[name]}: {took:.0f} s (estimate ~{estimate_s:.0f} s)")
        self.save()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    dry = device.type == "cpu"
    if args.sweep_m is None:
        args.sweep_m = list(DRY_SWEEP_M if dry else SWEEP_M)
    if dry:
        torch.set_num_threads(1)  # tiny sizes: threads only add noise (and contention)
    plan = build_plan(args.problems, args.dtypes, args.modes, compile=args.compile,
                      sweep=args.sweep, sweep_ms=tuple(args.sweep_m),
                      sweep_compile=args.sweep_compile, softmax=args.softmax, dry=dry,
                      host_time=args.host_time)
    heads = (real_heads.plan(real_heads.MODELS, args.dtypes, real_heads.modes_for(args.modes),
                             dry=dry, compile=args.compile) if args.real_heads else [])
    settings = Settings(warmup=args.warmup, iters=args.iters, max_seconds=args.max_seconds)
    small = (small_batch.plan(small_batch.MODELS, small_batch.SETTINGS, None,
                              small_batch.MODES, dry=dry, compile=args.compile)
             if args.small_batch else [])
    want_loop = args.loop if args.loop is not None else (not dry or args.quick)
    loop_settings = loop.settings_for(args.dtypes) if want_loop else []
    loop_groups = loop.plan(loop.MODELS, loop_settings, loop.DRY_BATCHES if dry else loop.BATCHES,
                            loop.OPTIMIZERS, dry=dry, compile=args.compile)
    loop_host = loop_settings if args.host_time else []
    env = report.environment(device)
    gpus = torch.cuda.device_count()
    want_dist = args.distributed if args.distributed is not None else (
        not dry and gpus >= args.nproc)
    settings_doc = {"warmup": settings.warmup, "iters": settings.iters,
                    "max_seconds": settings.max_seconds, "min_iters": settings.min_iters,
                    "dry_run": dry, "problems": args.problems, "dtypes": args.dtypes,
                    "modes": args.modes, "compile": args.compile, "sweep": args.sweep,
                    "sweep_m": args.sweep_m if args.sweep else None,
                    "softmax": args.softmax, "host_time": args.host_time,
                    "real_heads": args.real_heads, "small_batch": args.small_batch,
                    "loop": want_loop, "distributed": want_dist}
    print(f"benchmarks: {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']}", flush=True)
    if dry:
        print("benchmarks: --device cpu is a DRY RUN at tiny sizes; its timings only test the "
              "plumbing.", flush=True)
    elif not env.get("epifuse_cuda_kernels", True):
        print("benchmarks: WARNING: the loaded epifuse library has no CUDA kernels; ModelNew "
              "will run its reference path and the op benchmarks will fail.", flush=True)

    os.makedirs(args.out, exist_ok=True)
    prev = None
    if args.resume:
        prev = load_previous(os.path.join(args.out, "bench.json"), env,
                             lambda m: print(m, file=sys.stderr, flush=True))
    if prev:
        env["resumed_from"] = prev["date"]
        env["commands"] = [c for c in prev["commands"] if c] + [env["command"]]
    run = Run(args, env, settings_doc, prev)
    doc, log = run.doc, run.log
    dist_problems = [p for p in args.problems if p in distributed.PROBLEMS]
    dist_dtypes = [d for d in distributed.DEFAULT_DTYPES]
    run.total = (len(plan.cases) + len(plan.host_points) + len(plan.softmax_points)
                 + bool(plan.softmax_points) + len(heads) + len(small) + len(loop_groups)
                 + len(loop_host)
                 + bool(want_dist))
    first_compile = EST_FIRST_COMPILE_S if args.compile and not dry else 0.0
    estimates = {
        "kernelbench": first_compile + sum(estimate_case_s(c, settings, dry) for c in plan.cases),
        "host_time": 0.5 * len(plan.host_points),
        "softmax": (0.05 if dry else 0.5) * len(plan.softmax_points),
        "real_heads": sum(real_heads.estimate_s(c, settings, dry) for c in heads),
        "small_batch": small_batch.estimate_s(small, dry),
        "loop": loop.estimate_s(loop_groups, settings, dry, loop_host),
        "distributed": distributed.estimate_s(dist_problems, dist_dtypes, distributed.WARMUP,
                                              distributed.ITERS, "cpu" if dry else "cuda")
        if want_dist else 0.0}
    log("benchmarks: estimate ~" + f"{sum(estimates.values()):.0f} s in all: " + ", ".join(
        f"{report.SECTION_NAMES[k]} ~{v:.0f} s" for k, v in estimates.items() if v))

    runner = Runner(device, settings, log, args.verbose)
    states: dict[tuple, object] = {}

    def state_for(shape: Shape):
        """One seeded parameter set per (problem, K, N), the last one only."""
        key = (shape.problem, shape.k, shape.n)
        if key not in states:
            states.clear()
            free_memory(device)
            try:
                states[key] = base_state(shape, device)
            except Exception as e:  # noqa: BLE001
                states[key] = f"model set-up failed: {describe(e)}"
                log(f"  problem {shape.problem} {shape}: {states[key]}")
        return states[key]

    def kernelbench() -> None:
        for case in plan.cases:
            run.step(case.label)
            old = run.reused("cases", case_key(new_row(case)))
            if old is not None:
                doc["cases"].append(old)
                if old.get("kb_reference_ms") is not None:
                    runner.kb[(case.shape, case.mode)] = old["kb_reference_ms"]
                log(_summary(old) + " (reused)")
                continue
            state = None if case.skip else state_for(case.shape)
            if isinstance(state, str):
                r = dict(new_row(case), failures={i: state for i in ("ours", "eager", "compile")})
            else:
                r = runner.run_case(case, state)
            doc["cases"].append(r)
            log(_summary(r))
            run.save()

    def host_time() -> None:
        for pt in plan.host_points:
            run.step(f"host time {pt.label}")
            old = run.reused("host", host_key(new_row(pt)))
            if old is None:
                state = state_for(pt.shape)
                if isinstance(state, str):
                    doc["host_time"].append(dict(new_row(pt), timings_us={},
                                                 failures={"ours": state, "eager": state}))
                else:
                    doc["host_time"].append(runner.host_point(pt, state))
                run.save()
            else:
                doc["host_time"].append(old)
            log(f"host time {pt.label}: {_host_line(doc['host_time'][-1])}"
                + (" (reused)" if old else ""))
        states.clear()
        free_memory(device)

    def softmax() -> None:
        run.step("copy bandwidth")
        doc["copy_bandwidth"] = (prev or {}).get("copy") or runner.copy_bandwidth(
            plan.copy_bytes)
        log(f"copy bandwidth: {report.copy_line(doc['copy_bandwidth'])}")
        for dt, n, m in plan.softmax_points:
            run.step(f"softmax {dt} {m}x{n}")
            doc["softmax"].append(run.reused("softmax", (dt, n, m))
                                  or runner.softmax_point(dt, n, m))
            run.save()

    def heads_section() -> None:
        for case in heads:
            run.step(f"real heads {case.label}")
            old = run.reused("real_heads", (case.model, case.spec.name, case.mode, case.batch))
            try:
                row = old or real_heads.run_case(case, device, settings)
            except Exception as e:  # noqa: BLE001 -- a row of failures, the run goes on
                row = {"model": case.model, "dtype": case.spec.name, "mode": case.mode,
                       "batch": case.batch, "dims": list(case.dims), "fused": [],
                       "skipped": [], "compile_timed": case.compile, "peak_mib": {},
                       "timings_ms": {i: {"error": describe(e)} for i in ("ours", "eager")}}
            doc["real_heads"].append(row)
            log(real_heads.summary(row) + (" (reused)" if old else ""))
            run.save()
            free_memory(device)

    def small_batch_section() -> None:
        for group in small:
            run.step(f"small batches {group.label}")
            keys = [(group.model, group.batch, group.spec.name, m) for m in group.modes]
            old = [run.reused("small_batch", k) for k in keys]
            if all(old):
                rows = old
            else:
                try:
                    rows = small_batch.run_group(group, device, settings)
                except Exception as e:  # noqa: BLE001 -- rows of failures, the run goes on
                    rows = [small_batch.failed_row(group, m, e) for m in group.modes]
            for row in rows:
                doc["small_batch"].append(row)
                log(small_batch.summary(row) + (" (reused)" if all(old) else ""))
            run.save()
            free_memory(device)

    def loop_section() -> None:
        for group in loop_groups:
            run.step(f"training loop {group.label}")
            keys = [(group.model, group.batch, group.spec.name, o) for o in group.optimizers]
            old = [run.reused("loop", k) for k in keys]
            if all(old):
                rows = old
            else:
                try:
                    rows = loop.run_group(group, device, settings)
                except Exception as e:  # noqa: BLE001 -- rows of failures, the run goes on
                    rows = [{"model": group.model, "batch": group.batch,
                             "setting": group.spec.name, "optimizer": o, "dims": list(group.dims),
                             "compile_timed": group.compile, "fused_heads": 0, "path": {},
                             "optimizer_impl": "n/a", "queued_ms": {},
                             "timings_ms": {i: {"error": describe(e)} for i in group.impls}}
                            for o in group.optimizers]
            for row in rows:
                doc["loop"].append(row)
                log(loop.summary(row) + (" (reused)" if all(old) else ""))
            run.save()
            free_memory(device)
        for name in loop_host:
            run.step(f"training loop host time per head {name}")
            old = run.reused("loop_host", name)
            doc["loop_host"].append(old or loop.host_head(DTYPES[name], device, dry))
            log(loop.host_summary(doc["loop_host"][-1]) + (" (reused)" if old else ""))
            run.save()

    def dist_section() -> None:
        run.step(f"data-parallel steps on {args.nproc} processes")
        if prev and prev.get("distributed"):
            doc["distributed"] = prev["distributed"]
            log("data-parallel steps: reused")
            return
        free_memory(device)
        try:
            doc["distributed"] = distributed.run(args.nproc, dist_problems, dist_dtypes,
                                                 device="cpu" if dry else "cuda")
        except Exception as e:  # noqa: BLE001
            doc["distributed"] = {"failure": describe(e)}
        log(report.distributed_text(doc, markdown=False))

    run.section("kernelbench", len(plan.cases), estimates["kernelbench"], kernelbench)
    run.section("host_time", len(plan.host_points), estimates["host_time"], host_time)
    run.section("real_heads", len(heads), estimates["real_heads"], heads_section)
    run.section("small_batch", len(small), estimates["small_batch"], small_batch_section)
    run.section("loop", len(loop_groups) + len(loop_host), estimates["loop"], loop_section)
    run.section("softmax", len(plan.softmax_points), estimates["softmax"], softmax)
    if want_dist:
        run.section("distributed", 1, estimates["distributed"], dist_section)
    elif args.distributed is None and not dry:
        doc["distributed"] = {"not_run": f"this machine has {gpus} GPU{'s' * (gpus != 1)}; the "
                                         f"data-parallel section needs {args.nproc}"}
    elif args.distributed is None:
        doc["distributed"] = {"not_run": "CPU dry run (--distributed runs it on gloo)"}

    if prev:
        _keep_previous(doc, prev)
    env["elapsed_s"] = round(time.perf_counter() - run.t0, 1)
    doc["complete"] = True
    run.save()
    text = report.text_report(doc)
    print("\n" + text)
    written = [run.path, os.path.join(args.out, "bench.txt")]
    with open(written[-1], "w") as f:
        f.write(text + "\n")
    written += report.write_markdown(doc, os.path.join(args.out, "bench.md"), log)
    if args.markdown:
        written += report.write_markdown(doc, args.markdown, log)
    print(f"\nwrote: {', '.join(written)} ({env['elapsed_s']:.0f} s)")
    measured = (any(r["timings_ms"] for r in doc["cases"] + doc["softmax"])
                or any(h["timings_us"] for h in doc["host_time"])
                or any(r["timings_ms"] for r in doc["real_heads"] + doc["small_batch"])
                or any(loop_timed(r) for r in doc["loop"]))
    return 0 if measured or not (doc["cases"] or doc["softmax"] or doc["real_heads"]
                                 or doc["loop"]) else 1


def loop_timed(row: dict) -> bool:
    """Whether a training-loop row has a timing (not only errors)."""
    return any("error" not in t for t in row["timings_ms"].values())


def _keep_previous(doc: dict, prev: dict) -> None:
    """What an earlier run measured beyond this run's plan stays in the report, in order."""
    order = {k: i for i, k in enumerate(DTYPES)}
    have = {case_key(r) for r in doc["cases"]}
    doc["cases"] += [r for k, r in prev["cases"].items() if k not in have]
    doc["cases"].sort(key=lambda r: ((84, 39).index(r["problem"]) if r["problem"] in (84, 39)
                                     else 9, ("kernelbench", "kb-small", "sweep").index(r["tag"]),
                                     r["M"], r["K"], r["N"], MODES.index(r["mode"]),
                                     order[r["dtype"]]))
    have = {host_key(r) for r in doc["host_time"]}
    doc["host_time"] += [r for k, r in prev["host"].items() if k not in have]
    doc["host_time"].sort(key=lambda r: (r["problem"], r["M"], MODES.index(r["mode"]),
                                         order[r["dtype"]]))
    have = {softmax_key(r) for r in doc["softmax"]}
    doc["softmax"] += [r for k, r in prev["softmax"].items() if k not in have]
    doc["softmax"].sort(key=lambda r: (r["dtype"] != "fp32", r["dtype"], r["N"], r["M"]))
    doc["copy_bandwidth"] = doc["copy_bandwidth"] or prev["copy"]
    have = {real_heads.row_key(r) for r in doc["real_heads"]}
    doc["real_heads"] += [r for k, r in prev["real_heads"].items() if k not in have]
    doc["real_heads"].sort(key=lambda r: (
        real_heads.MODELS.index(r["model"]) if r["model"] in real_heads.MODELS else 9,
        order.get(r["dtype"], 99), real_heads.MODES.index(r["mode"])
        if r["mode"] in real_heads.MODES else 9))
    have = {small_batch.row_key(r) for r in doc["small_batch"]}
    doc["small_batch"] += [r for k, r in prev["small_batch"].items() if k not in have]
    doc["small_batch"].sort(key=lambda r: (
        small_batch.MODELS.index(r["model"]) if r["model"] in small_batch.MODELS else 9,
        small_batch.SETTINGS.index(r["setting"]) if r["setting"] in small_batch.SETTINGS else 9,
        r["batch"], small_batch.MODES.index(r["mode"]) if r["mode"] in small_batch.MODES else 9))
    have = {loop.row_key(r) for r in doc["loop"]}
    doc["loop"] += [r for k, r in prev["loop"].items() if k not in have]
    doc["loop"].sort(key=lambda r: (
        loop.MODELS.index(r["model"]) if r["model"] in loop.MODELS else 9, r["batch"],
        loop.SETTINGS.index(r["setting"]) if r["setting"] in loop.SETTINGS else 9,
        loop.OPTIMIZERS.index(r["optimizer"]) if r["optimizer"] in loop.OPTIMIZERS else 9))
    have = {r["setting"] for r in doc["loop_host"]}
    doc["loop_host"] += [r for k, r in prev["loop_host"].items() if k not in have]
    doc["loop_host"].sort(key=lambda r: loop.SETTINGS.index(r["setting"])
                          if r["setting"] in loop.SETTINGS else 9)
    if not (doc["distributed"] or {}).get("results") and prev.get("distributed"):
        doc["distributed"] = prev["distributed"]


if __name__ == "__main__":
    sys.exit(main())
