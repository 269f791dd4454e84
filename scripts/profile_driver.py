#!/usr/bin/env python3
"""Driver for scripts/profile_nsys.sh: runs one epifuse problem (ModelNew, or the
reference Model) for warm-up + N timed iterations inside NVTX ranges.

Problems, dtypes and precisions are spelled as for ``python -m epifuse`` (epifuse.cli's table).

  --profiler nsys   just run; nsys (started by profile_nsys.sh with
                    --capture-range=cudaProfilerApi) records the timed iterations
  --profiler torch  fallback: record with torch.profiler, print the per-kernel
                    table (name, calls, total, avg) and write a Chrome trace

The package emits its per-stage NVTX ranges (GEMM, fold, softmax) when
EPIFUSE_NVTX=1 is set before it is imported (profile_nsys.sh sets it).
Errors are reported in one line, never as a stack trace (EPIFUSE_DEBUG=1 shows it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings

MODES = ("train", "eval")


class DriverError(Exception):
    pass


def parse_args(argv):
    """Options only: the words are checked against epifuse.cli's spelling table once epifuse is
    imported (``resolve``), so that --help answers without a built library."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("words", nargs="*", metavar="PROBLEM|MODE",
                   help="the problem as python -m epifuse spells it (84, 39, "
                        "gemm_bn_scale_softmax, gemm_scale_bn; default 84) and/or the mode "
                        "(train, eval)")
    p.add_argument("--mode", choices=MODES, default=None, help="train (default) or eval")
    p.add_argument("--dtype", default="fp32",
                   help="as python -m epifuse spells it (epifuse.cli): fp32|float32, "
                        "bf16|bfloat16, fp16|float16|half, fp32-<precision>, amp-bf16 / amp-fp16 "
                        "(an fp32 model "
                        "under torch.autocast); default fp32")
    p.add_argument("--precision", default="tf32",
                   help="fp32 GEMM precision of ModelNew, as python -m epifuse spells it (ieee, "
                        "3xtf32, tf32, or torch's highest, high, medium; default tf32); the "
                        "reference Model runs at torch's matching setting (highest or high)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: the problem's)")
    p.add_argument("--in-features", type=int, default=None)
    p.add_argument("--out-features", type=int, default=None)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--model", choices=["new", "ref"], default="new",
                   help="ModelNew (epifuse) or the reference Model")
    p.add_argument("--profiler", choices=["nsys", "torch"], default="torch")
    p.add_argument("--out", default="profile-out", help="output folder (Chrome trace)")
    p.add_argument("--tag", default=None, help="file name stem (default derived from the options)")
    p.add_argument("--check", action="store_true",
                   help="only build the model and inputs, print the report's file name stem, "
                        "and exit")
    return p.parse_args(argv)


def _import_epifuse():
    try:
        import epifuse  # noqa: F401
        from epifuse import cli, problems
    except ImportError as e:
        hint = "" if "build" in str(e) else "; run scripts/build.sh first"
        raise DriverError(f"cannot import epifuse: {e}{hint}") from None
    return cli, problems


def resolve(args):
    """The problem number, mode and dtype column of the command line, through epifuse.cli (the
    one spelling table of every command line)."""
    cli, _ = _import_epifuse()
    problem, mode = None, args.mode
    for word in args.words:
        if word in MODES:
            if mode not in (None, word):
                raise DriverError(f"two modes given: {mode} and {word}")
            mode = word
            continue
        try:
            numbers = cli.parse_problem(word)
        except ValueError as e:
            raise DriverError(str(e)) from None
        if len(numbers) != 1:
            raise DriverError(f"{word!r}: profile one problem at a time")
        (number,) = numbers
        if problem not in (None, number):
            raise DriverError(f"two problems given: {problem} and {number}")
        problem = number
    try:
        column = cli.column(args.dtype)
        if column.dtype == "fp32" and column.precision is None:
            column = cli.Column("fp32", cli.parse_precision(args.precision))
    except ValueError as e:
        raise DriverError(str(e)) from None
    return problem or 84, mode or "train", column


def stem(args, number, mode, column):
    """The report's file name stem, e.g. ``p84_train_fp32-tf32_new``."""
    if args.tag:
        return args.tag
    return f"p{number}_{mode}_{column.name}_{args.model}"


def build(args, torch, number, mode, column):
    cli, problems = _import_epifuse()
    mod = problems.BY_NUMBER[number]
    cuda = torch.cuda.is_available()
    sizes = (args.batch or mod.batch_size, args.in_features or mod.in_features,
             args.out_features or mod.out_features)
    if not cuda and args.batch is None and args.in_features is None and args.out_features is None:
        sizes = (256, 512, 512)
        print("[profile] no CUDA device: CPU reference path at a small size "
              f"(batch {sizes[0]}, {sizes[1]} -> {sizes[2]})")
    batch, init = cli.init_inputs(mod, sizes)
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_float32_matmul_precision(column.torch_matmul_precision)
    torch.manual_seed(0)
    if args.model == "new":
        model = mod.ModelNew(*init, precision=column.precision)
    else:
        model = mod.Model(*init)
    model = model.to(device=device, dtype=column.torch_dtype)
    model.train(mode == "train")
    x = torch.rand(batch, init[0]).to(device=device, dtype=column.torch_dtype)
    if column.autocast_dtype is not None:
        inner, amp = model, column.autocast_dtype

        def model(t):
            with torch.autocast(device.type, dtype=amp):
                return inner(t)
    return mod, model, [x], device


def run_iters(model, inputs, n, torch, cuda, label):
    nvtx = torch.cuda.nvtx if cuda else None
    for i in range(n):
        if nvtx:
            nvtx.range_push(f"{label}[{i}]")
        model(*inputs)
        if nvtx:
            nvtx.range_pop()


def demangle(name, torch):
    """Readable kernel name: torch's demangler, then c++filt, then the qualified
    name's prefix (very long CUTLASS names are sometimes beyond both)."""
    if not name.startswith("_Z"):
        return name
    try:
        out = torch._C._demangle(name)
        if not out.startswith("_Z"):
            return out
    except Exception:
        pass
    try:
        import subprocess
        out = subprocess.run(["c++filt"], input=name, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if out and not out.startswith("_Z"):
            return out
    except Exception:
        pass
    import re
    parts, i = [], 3 if name.startswith("_ZN") else 2
    while True:
        m = re.match(r"(\d+)", name[i:])
        if not m:
            break
        n = int(m.group(1))
        i += len(m.group(1))
        parts.append(name[i:i + n])
        i += n
    return ("::".join(parts) + ("<...>" if name[i:i + 1] == "I" else "")) if parts else name


def kernel_table(prof, torch, skip=()):
    """Aggregate device kernels (and copies) by name: (name, calls, total_us)."""
    from torch.autograd import DeviceType
    agg = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False) or e.name in skip or e.name.startswith("epifuse."):
            continue  # GPU-side mirror of a record_function range, not a kernel
        us = e.time_range.elapsed_us()
        name = demangle(e.name, torch)
        calls, total = agg.get(name, (0, 0.0))
        agg[name] = (calls + 1, total + us)
    return sorted(((n, c, t) for n, (c, t) in agg.items()), key=lambda r: -r[2])


def cpu_op_table(prof):
    rows = []
    for e in prof.key_averages():
        rows.append((e.key, e.count, e.self_cpu_time_total))
    rows.sort(key=lambda r: -r[2])
    return rows[:25]


def print_table(title, rows, iters):
    print(f"\n{title}")
    if not rows:
        print("  (none recorded)")
        return
    width = min(max(len(r[0]) for r in rows), 90)
    total_all = sum(r[2] for r in rows) or 1.0
    print(f"  {'time %':>6}  {'total (us)':>12}  {'calls':>6}  {'avg (us)':>10}  {'per iter (us)':>13}  name")
    for name, calls, total in rows:
        short = name if len(name) <= width else name[: width - 3] + "..."
        print(f"  {100.0 * total / total_all:6.1f}  {total:12.1f}  {calls:6d}  {total / max(calls, 1):10.2f}  "
              f"{total / max(iters, 1):13.2f}  {short}")


def main(argv):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        raise DriverError("torch is not installed; run scripts/build.sh first") from None
    cuda = torch.cuda.is_available()
    if args.profiler == "nsys" and not cuda:
        raise DriverError("no CUDA device visible: nothing for Nsight Systems to record")
    number, mode, column = resolve(args)
    mod, model, inputs, device = build(args, torch, number, mode, column)
    name = stem(args, number, mode, column)
    if args.check:
        print(name)
        return 0
    label = f"epifuse.{args.model}.{mode}"
    print(f"[profile] {mod.__name__}.{'ModelNew' if args.model == 'new' else 'Model'} {mode} "
          f"{column.name} on {device}; x {tuple(inputs[0].shape)}; warm-up {args.warmup}, "
          f"iterations {args.iters}")

    grad = contextlib.nullcontext() if mode == "train" else torch.no_grad()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with grad:
        if cuda:
            torch.cuda.nvtx.range_push(f"{label}.warmup")
        run_iters(model, inputs, args.warmup, torch, cuda, "warmup")
        sync()
        if cuda:
            torch.cuda.nvtx.range_pop()

        if args.profiler == "nsys":
            torch.cuda.profiler.start()           # nsys --capture-range=cudaProfilerApi
            torch.cuda.nvtx.range_push(f"{label}.iters")
            t0 = time.perf_counter()
            run_iters(model, inputs, args.iters, torch, cuda, "iter")
            sync()
            dt = time.perf_counter() - t0
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
            print(f"[profile] {args.iters} iterations: {1e3 * dt / max(args.iters, 1):.3f} ms/iter (wall, under nsys)")
            return 0

        from torch.profiler import ProfilerActivity, profile, record_function
        warnings.filterwarnings("ignore", module="torch.profiler")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            with record_function(f"{label}.iters"):
                if cuda:
                    torch.cuda.nvtx.range_push(f"{label}.iters")
                run_iters(model, inputs, args.iters, torch, cuda, "iter")
                sync()
                if cuda:
                    torch.cuda.nvtx.range_pop()
    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, f"{name}.trace.json")
    prof.export_chrome_trace(trace)
    if cuda:
        print_table(f"GPU kernels over {args.iters} iterations (torch.profiler):",
                    kernel_table(prof, torch, skip=(f"{label}.iters",)), args.iters)
    else:
        print_table(f"CPU ops (self time) over {args.iters} iterations (torch.profiler; no GPU):",
                    cpu_op_table(prof), args.iters)
    print(f"\n[profile] Chrome trace: {trace}  (open in chrome://tracing or https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except DriverError as e:
        print(f"[profile] error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # one line, not a stack trace
        if os.environ.get("EPIFUSE_DEBUG") == "1":
            raise
        print(f"[profile] error: {type(e).__name__}: {e}  (EPIFUSE_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
