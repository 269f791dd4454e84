"""``python -m epifuse.bench``: benchmark ModelNew against PyTorch eager and torch.compile.

Runs problems 84 (gemm_bn_scale_softmax) and 39 (gemm_scale_bn) at their
KernelBench sizes (and 84 at the original small size), train and eval forwards and
training steps (forward + backward), fp32
with TF32 off ('fp32-ieee'), in 3xTF32 against PyTorch's IEEE fp32 ('fp32-3xtf32') and with
TF32 on ('fp32-tf32'), bf16 and fp16; our GEMM alone; the host time of a
small-batch forward; and our row softmax against torch.softmax and the copy bandwidth. Prints a
table and writes JSON, Markdown and PNG charts to --out.

`--device cpu` is a dry run at tiny sizes (CPU timings) that tests the plumbing;
without a GPU the default device falls back to it, with a note. Problems, dtypes
and precisions are spelled as for ``python -m epifuse`` (see ``epifuse.cli``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Optional

import torch

from .. import cli
from . import chart, env as envinfo, report
from .configs import DRY_SWEEP_M, DTYPES, MODES, SWEEP_M, build_plan
from .hosttime import HostResult, HostSettings, run_host_point
from .kernels import copy_bandwidth, softmax_point
from .models import base_state
from .persist import Previous, case_key, host_key, save, softmax_from_dict, softmax_key
from .progress import Progress
from .runner import CaseResult, KBReference, describe, free_memory, run_case
from .timing import TimingSettings


AUTO = "auto"  # --device default: cuda when there is one, else the CPU dry run


def _csv(kind: str, choices, convert=str):
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"empty {kind} list")
        out = []
        for t in items:
            try:
                v = convert(t)
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad {kind} {t!r}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(
                    f"unknown {kind} {t!r}; choose from {','.join(map(str, choices))}")
            if v not in out:
                out.append(v)
        return out
    return parse


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m epifuse.bench",
        description="Benchmark epifuse ModelNew against PyTorch eager and torch.compile "
                    "(KernelBench problems 84 and 39), our GEMM alone, and our softmax.",
        epilog="Output: a table on stdout; bench.json, bench.md, bench.txt and PNG charts in "
               "--out. Failures of single configurations are reported in the table.")
    cli.add_selection_arguments(p, default_dtypes="all",
                                default_precisions="all three: " + ",".join(cli.PRECISION_ORDER))
    p.add_argument("--modes", "--mode", type=_csv("mode", MODES), default=list(MODES),
                   help="comma list of train,eval,train-step (default all three): training-"
                        "mode and eval-mode forwards, and training steps (forward + backward "
                        "with dX; fixed shapes only, not the --sweep)")
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
    p.add_argument("--iters", type=int, default=None,
                   help="timed calls per measurement (default 50, --quick 10)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up calls per measurement (default 10, --quick 3)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget per measurement: slow calls get fewer iterations, at "
                        "least 5 (default 2.0, --quick 0.5)")
    p.add_argument("--quick", action="store_true", help="fewer iterations, for smoke runs")
    p.add_argument("--out", default="bench-out", help="output folder for JSON, Markdown, text and PNG (default bench-out)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the Markdown report to PATH (e.g. BENCHMARKS.md); its charts "
                        "are copied to PATH's folder as <name>-charts/")
    p.add_argument("--device", default=AUTO,
                   help="cuda, cuda:N, or cpu for a dry run at tiny sizes (default: cuda, or cpu "
                        "with a note when there is no GPU)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the results already in --out/bench.json (same GPU and torch): "
                        "configurations there are not measured again, and those outside this "
                        "run's selection stay in the report. For runs cut short, or split into "
                        "parts (e.g. --problems 84, then --problems 39 --resume)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
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
    sel = cli.selection(args, default_dtypes=cli.DTYPE_ORDER,
                        default_fp32_precisions=cli.PRECISION_ORDER)
    args.problems = list(sel.problems)
    args.dtypes = [c.name for c in sel.columns]  # fp32-<precision>, bf16, fp16: DTYPES' keys
    return args


def resolve_device(name: str) -> torch.device:
    if name == AUTO:
        if torch.cuda.is_available():
            name = "cuda"
        else:
            # Like `python -m epifuse`: a machine without a GPU still runs (the CPU dry run).
            print("epifuse.bench: no CUDA device: running the CPU dry run (--device cpu) at tiny "
                  "sizes instead.", flush=True)
            name = "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("epifuse.bench: no CUDA device available; use --device cpu for a dry run")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        sys.exit(f"epifuse.bench: unsupported device {name!r} (cuda or cpu)")
    return device


def _summary(r: CaseResult) -> str:
    if r.case.skip:
        return f"{r.case.label}: skipped ({r.case.skip})"
    parts = [f"{r.case.label}: ours {report.fmt_ms(r.ms('ours'))} ms"]
    for base in ("eager", "compile"):
        parts.append(f"{base} {report.fmt_ms(r.ms(base))} ms ({report.fmt_x(r.speedup(base))})")
    path = r.path if r.path in (None, "fused") else f"reference: {r.path}"
    return ", ".join(parts) + f"; path {path}"


def _case_order(r: CaseResult) -> tuple:
    c, s = r.case, r.case.shape
    problems = (84, 39)
    tags = ("kernelbench", "kb-small", "sweep")
    return (problems.index(s.problem) if s.problem in problems else s.problem,
            tags.index(s.tag) if s.tag in tags else 9, s.m, s.k, s.n,
            MODES.index(c.mode), list(DTYPES).index(c.spec.name))


def _host_order(r: HostResult) -> tuple:
    return (r.point.shape.problem, r.point.shape.m, MODES.index(r.point.mode),
            list(DTYPES).index(r.point.spec.name))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
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
    settings = TimingSettings(warmup=args.warmup, iters=args.iters, max_seconds=args.max_seconds)
    env = envinfo.collect(device)
    settings_doc = {"warmup": settings.warmup, "iters": settings.iters,
                    "max_seconds": settings.max_seconds, "min_iters": settings.min_iters,
                    "dry_run": dry, "problems": args.problems, "dtypes": args.dtypes,
                    "modes": args.modes, "compile": args.compile, "sweep": args.sweep,
                    "sweep_m": args.sweep_m if args.sweep else None,
                    "softmax": args.softmax, "host_time": args.host_time}

    print(f"epifuse.bench: {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']}", flush=True)
    if dry:
        print("epifuse.bench: --device cpu is a DRY RUN at tiny sizes; its timings only test the "
              "plumbing.", flush=True)
    if not env.get("epifuse_cuda_kernels", True) and not dry:
        print("epifuse.bench: WARNING: the loaded epifuse library has no CUDA kernels; ModelNew "
              "will run its reference path and the op benchmarks will fail.", flush=True)

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    previous = Previous(json_path, env, print) if args.resume else None
    if previous is not None and previous.date:
        env["resumed_from"] = previous.date
        env["commands"] = [c for c in previous.commands if c] + [env["command"]]

    n_soft = len(plan.softmax_points)
    progress = Progress(len(plan.cases) + len(plan.host_points) + (1 + n_soft if n_soft else 0),
                        enabled=args.progress)
    log = progress.write
    kb = KBReference()
    results: list[CaseResult] = []
    host: list[HostResult] = []
    softmax, copy = [], None

    def checkpoint(complete: bool = False) -> None:
        save(json_path, env, settings_doc, results, softmax, copy, complete, host=host)

    state, state_key, state_error = None, None, None
    for case in plan.cases:
        progress.start(case.label)
        old = previous.cases.get(case_key(case)) if previous else None
        if old is not None:
            results.append(old)
            if old.kb_reference_ms is not None:
                kb.set(case.shape, case.mode, old.kb_reference_ms)
            log(_summary(old) + " (reused)")
            progress.advance()
            continue
        if not case.skip and case.shape.weights_key != state_key:
            state, state_error = None, None
            free_memory(device)
            state_key = case.shape.weights_key
            try:
                state = base_state(case.shape, device)
            except Exception as e:  # noqa: BLE001
                state_error = f"model set-up failed: {describe(e)}"
                log(f"  problem {case.shape.problem} {case.shape}: {state_error}")
        if case.skip:
            r = CaseResult(case)
        elif state is None:
            r = CaseResult(case, failures={i: state_error or "no model" for i in
                                           ("ours", "eager", "compile")})
        else:
            r = run_case(case, state, device, settings, kb, log, args.verbose)
        results.append(r)
        log(_summary(r))
        checkpoint()
        progress.advance()
    state = None
    free_memory(device)

    host_state, host_state_key, host_error = None, None, "no model"
    for pt in plan.host_points:
        progress.start(pt.label)
        old = previous.host.get(host_key(pt)) if previous else None
        if old is not None:
            host.append(old)
        else:
            if pt.shape.weights_key != host_state_key:
                host_state_key, host_state = pt.shape.weights_key, None
                try:
                    host_state = base_state(pt.shape, device)
                except Exception as e:  # noqa: BLE001
                    host_error = f"model set-up failed: {describe(e)}"
            if host_state is None:
                host.append(HostResult(pt, failures={i: host_error for i in ("ours", "eager")}))
            else:
                host.append(run_host_point(pt, host_state, device, HostSettings(), log,
                                           args.verbose))
            checkpoint()
        log(f"{pt.label}: {report.host_line(host[-1])}" + (" (reused)" if old else ""))
        progress.advance()
    host_state = None

    if n_soft:
        progress.start("copy bandwidth")
        copy = previous.copy if previous and previous.copy else None
        if copy is None:
            copy = copy_bandwidth(plan.copy_bytes, device, settings)
        log(f"copy bandwidth: {report.copy_line(copy)}")
        progress.advance()
        for pt in plan.softmax_points:
            progress.start(f"softmax {pt.dtype} {pt.m}x{pt.n}")
            old = previous.softmax.get(softmax_key(pt.dtype, pt.n, pt.m)) if previous else None
            if old is not None:
                softmax.append(softmax_from_dict(old, copy.gbps))
            else:
                softmax.append(softmax_point(pt.dtype, pt.n, pt.m, device, settings, copy.gbps,
                                             log))
                checkpoint()
            progress.advance()
    progress.close()

    if previous is not None:  # keep what an earlier run measured beyond this run's plan
        planned = {case_key(c) for c in plan.cases}
        results += [r for k, r in previous.cases.items() if k not in planned]
        results.sort(key=_case_order)
        have = {softmax_key(r.dtype, r.n, r.m) for r in softmax}
        softmax += [softmax_from_dict(d, copy.gbps if copy else None)
                    for k, d in previous.softmax.items() if k not in have]
        softmax.sort(key=lambda r: (r.dtype != "fp32", r.dtype, r.n, r.m))
        have_host = {host_key(r.point) for r in host}
        host += [r for k, r in previous.host.items() if k not in have_host]
        host.sort(key=_host_order)
        if copy is None:
            copy = previous.copy
    env["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    checkpoint(complete=True)
    text = report.text_report(env, results, softmax, copy, host)
    print()
    print(text)
    written = [json_path]
    txt_path = os.path.join(args.out, "bench.txt")
    with open(txt_path, "w") as f:
        f.write(text + "\n")
    written.append(txt_path)
    charts = chart.draw(args.out, env, results, softmax, copy, lambda m: print(m))
    written += charts
    md_path = os.path.join(args.out, "bench.md")
    with open(md_path, "w") as f:
        f.write(report.markdown_report(env, settings_doc, results, softmax, copy, charts, md_path,
                                       host))
    written.append(md_path)
    if args.markdown:
        md_dir = os.path.dirname(os.path.abspath(args.markdown))
        os.makedirs(md_dir, exist_ok=True)
        copied = []
        if charts:
            stem = os.path.splitext(os.path.basename(args.markdown))[0]
            chart_dir = os.path.join(md_dir, f"{stem}-charts")
            os.makedirs(chart_dir, exist_ok=True)
            for c in charts:
                copied.append(shutil.copy(c, os.path.join(chart_dir, os.path.basename(c))))
        with open(args.markdown, "w") as f:
            f.write(report.markdown_report(env, settings_doc, results, softmax, copy, copied,
                                           args.markdown, host))
        written += [args.markdown, *copied]
    print(f"\nwrote: {', '.join(written)} ({env['elapsed_s']:.0f} s)")
    measured = (any(r.timings for r in results) or any(s.timings for s in softmax)
                or any(h.timings for h in host))
    return 0 if measured or not (results or softmax) else 1


if __name__ == "__main__":
    sys.exit(main())
