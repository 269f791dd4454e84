"""``python -m benchmarks`` (from the repository root; ``scripts/bench.sh`` from anywhere):
ModelNew against PyTorch eager and torch.compile.

Problems 84 (gemm_bn_scale_softmax) and 39 (gemm_scale_bn) at their KernelBench sizes (and 84
at the original small size): train and eval forwards and training steps, in fp32 with TF32 off
('fp32-ieee'), in 3xTF32 against PyTorch's IEEE fp32 ('fp32-3xtf32') and with TF32 on
('fp32-tf32'), bf16 and fp16, and fp32 models under torch.autocast to bf16 and fp16 ('amp-bf16',
'amp-fp16'); with each time the peak memory of one call; our GEMM alone; the host time of a
small-batch forward; our row softmax against torch.softmax and the copy bandwidth. Prints a
table and writes bench.json (after every configuration: --resume measures only what is missing),
Markdown and PNG charts.

`--device cpu` is a dry run at tiny sizes that tests the plumbing; without a GPU the default
device falls back to it, with a note. Problems, dtypes and precisions are spelled as for
``python -m epifuse`` (``epifuse.cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Optional

import torch

from epifuse import cli

from . import report
from .cases import (DRY_SWEEP_M, DTYPES, MODES, SWEEP_M, Runner, Shape, base_state,
                    build_plan, describe, free_memory, new_row)
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
    p.add_argument("--out", default="bench-out",
                   help="output folder for JSON, Markdown, text and PNG (default bench-out)")
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
    sel = cli.selection(args, default_dtypes=cli.DTYPE_ORDER,
                        default_fp32_precisions=cli.PRECISION_ORDER)
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
                "date": old.get("date"), "commands": old.get("commands") or [old.get("command")]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"--resume: cannot read {path} ({type(e).__name__}: {e}); measuring everything")
        return None
    log(f"--resume: reusing {len(prev['cases'])} configurations, {len(prev['host'])} host-time "
        f"points and {len(prev['softmax'])} softmax points from {path} ({prev['date']})")
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
    settings = Settings(warmup=args.warmup, iters=args.iters, max_seconds=args.max_seconds)
    env = report.environment(device)
    settings_doc = {"warmup": settings.warmup, "iters": settings.iters,
                    "max_seconds": settings.max_seconds, "min_iters": settings.min_iters,
                    "dry_run": dry, "problems": args.problems, "dtypes": args.dtypes,
                    "modes": args.modes, "compile": args.compile, "sweep": args.sweep,
                    "sweep_m": args.sweep_m if args.sweep else None,
                    "softmax": args.softmax, "host_time": args.host_time}
    print(f"benchmarks: {env['gpu']} | torch {env['torch']} | CUDA {env['cuda']}", flush=True)
    if dry:
        print("benchmarks: --device cpu is a DRY RUN at tiny sizes; its timings only test the "
              "plumbing.", flush=True)
    elif not env.get("epifuse_cuda_kernels", True):
        print("benchmarks: WARNING: the loaded epifuse library has no CUDA kernels; ModelNew "
              "will run its reference path and the op benchmarks will fail.", flush=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "bench.json")
    prev = load_previous(json_path, env, log) if args.resume else None
    if prev:
        env["resumed_from"] = prev["date"]
        env["commands"] = [c for c in prev["commands"] if c] + [env["command"]]
    rows, host, softmax, copy = [], [], [], None

    def save(complete: bool = False) -> None:
        doc = {"complete": complete, "env": env, "settings": settings_doc, "cases": rows,
               "host_time": host, "softmax": softmax, "copy_bandwidth": copy}
        with open(json_path + ".tmp", "w") as f:  # atomic: a kill mid-write keeps the last file
            json.dump(doc, f, indent=2)  # an infinite error as Infinity, which json.load reads
        os.replace(json_path + ".tmp", json_path)

    total = len(plan.cases) + len(plan.host_points) + len(plan.softmax_points) + (
        1 if plan.softmax_points else 0)
    done = [0]

    def step(label: str) -> None:
        done[0] += 1
        if args.progress:
            log(f"[{done[0]}/{total} {time.perf_counter() - t_start:6.0f}s] {label}")

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

    for case in plan.cases:
        step(case.label)
        old = prev["cases"].get(case_key(new_row(case))) if prev else None
        if old is not None:
            rows.append(old)
            if old.get("kb_reference_ms") is not None:
                runner.kb[(case.shape, case.mode)] = old["kb_reference_ms"]
            log(_summary(old) + " (reused)")
            continue
        state = None if case.skip else state_for(case.shape)
        if isinstance(state, str):
            r = dict(new_row(case), failures={i: state for i in ("ours", "eager", "compile")})
        else:
            r = runner.run_case(case, state)
        rows.append(r)
        log(_summary(r))
        save()
    for pt in plan.host_points:
        step(f"host time {pt.label}")
        old = prev["host"].get(host_key(new_row(pt))) if prev else None
        if old is None:
            state = state_for(pt.shape)
            if isinstance(state, str):
                host.append(dict(new_row(pt), timings_us={},
                                 failures={"ours": state, "eager": state}))
            else:
                host.append(runner.host_point(pt, state))
            save()
        else:
            host.append(old)
        log(f"host time {pt.label}: {_host_line(host[-1])}" + (" (reused)" if old else ""))
    states.clear()
    free_memory(device)
    if plan.softmax_points:
        step("copy bandwidth")
        copy = (prev or {}).get("copy") or runner.copy_bandwidth(plan.copy_bytes)
        log(f"copy bandwidth: {report.copy_line(copy)}")
        for dt, n, m in plan.softmax_points:
            step(f"softmax {dt} {m}x{n}")
            old = prev["softmax"].get((dt, n, m)) if prev else None
            softmax.append(old or runner.softmax_point(dt, n, m))
            save()

    if prev:  # keep what an earlier run measured beyond this run's plan
        order = {k: i for i, k in enumerate(DTYPES)}
        have = {case_key(r) for r in rows}
        rows += [r for k, r in prev["cases"].items() if k not in have]
        rows.sort(key=lambda r: ((84, 39).index(r["problem"]) if r["problem"] in (84, 39) else 9,
                                 ("kernelbench", "kb-small", "sweep").index(r["tag"]), r["M"],
                                 r["K"], r["N"], MODES.index(r["mode"]), order[r["dtype"]]))
        have = {host_key(r) for r in host}
        host += [r for k, r in prev["host"].items() if k not in have]
        host.sort(key=lambda r: (r["problem"], r["M"], MODES.index(r["mode"]), order[r["dtype"]]))
        have = {softmax_key(r) for r in softmax}
        softmax += [r for k, r in prev["softmax"].items() if k not in have]
        softmax.sort(key=lambda r: (r["dtype"] != "fp32", r["dtype"], r["N"], r["M"]))
        copy = copy or prev["copy"]
    env["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    save(complete=True)
    text = report.text_report(env, rows, softmax, copy, host)
    print("\n" + text)
    written = [json_path, os.path.join(args.out, "bench.txt")]
    with open(written[-1], "w") as f:
        f.write(text + "\n")
    charts = report.draw(args.out, env, rows, softmax, copy, print)
    written += charts
    outputs = [(os.path.join(args.out, "bench.md"), charts)]
    if args.markdown:  # its charts go to <stem>-charts/ beside it
        chart_dir = os.path.splitext(os.path.abspath(args.markdown))[0] + "-charts"
        if charts:
            os.makedirs(chart_dir, exist_ok=True)
        outputs.append((args.markdown, [shutil.copy(c, chart_dir) for c in charts]))
    for path, pngs in outputs:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(report.markdown_report(env, settings_doc, rows, softmax, copy, pngs, path,
                                           host))
        written += [path] + (pngs if path == args.markdown else [])
    print(f"\nwrote: {', '.join(written)} ({env['elapsed_s']:.0f} s)")
    measured = any(r["timings_ms"] for r in rows + softmax) or any(h["timings_us"] for h in host)
    return 0 if measured or not (rows or softmax) else 1


if __name__ == "__main__":
    sys.exit(main())
