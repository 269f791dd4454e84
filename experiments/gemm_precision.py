"""The GEMM alone at each fp32 precision: speed and error against float64.

    PYTHONPATH=python python experiments/gemm_precision.py [--problems 84 39]
                                                           [--promotion 2 4 8 16] [--json F]
                                                           [--error-sweep K ...]

Rows, each on problem 84's and problem 39's GEMM (z = x . W^T, x ~ U[0, 1), W as nn.Linear
initializes it, and the same with x + 100, where a column's mean dwarfs its spread):

  cuBLAS SGEMM     torch.mm at 'highest' (IEEE fp32 FFMA): what eager PyTorch runs by default
  cuBLAS TF32      torch.mm with TF32 allowed
  epifuse TF32     gemm_affine(precision='tf32')
  epifuse 3x       gemm_affine(precision='3xtf32'): the Hopper 3x GEMM (FP16 parts) with promoted
                   sums (per promotion interval, when --promotion is given)
  epifuse 3xTF32 sm80   the same op with EPIFUSE_FORCE_SM80=1 (CUTLASS's mma.sync FastF32, TF32
                        parts)

Error = ||C - C64|| / ||C64|| (Frobenius), C64 from float64 operands on the GPU. TFLOP/s count
2*M*N*K per call, the median of CUDA-event timings (L2 flushed before each call as
triton.testing.do_bench does). Settings that the library reads once per process
(EPIFUSE_FORCE_SM80, EPIFUSE_3X_PROMOTION) run in a child process each. What it measured, and
what followed from it (the default promotion interval, the Hopper 3x GEMM over the sm80 one):
experiments/README.md, "gemm_precision.py".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Optional

import torch

SHAPES = {84: (1024, 8192, 8192), 39: (16384, 4096, 4096)}  # M, K, N
OFFSET = 100.0


def _operands(m: int, k: int, n: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.rand(m, k, generator=gen, device=device)
    bound = 1.0 / k ** 0.5
    w = (torch.rand(n, k, generator=gen, device=device) * 2 - 1) * bound
    return x, w


def median_ms(fn, x, reps: int, warmup: int = 3) -> float:
    """Median CUDA-event time of fn(x), a buffer larger than L2 overwritten before each call."""
    l2 = getattr(torch.cuda.get_device_properties(x.device), "L2_cache_size", 0) or 0
    flush = torch.empty(max(256 << 20, 2 * l2), dtype=torch.int8, device=x.device)
    for _ in range(warmup):
        fn(x)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return float((c.double() - ref).norm() / ref.norm())


def measure(impl: str, problem: int, reps: int) -> dict:
    """One implementation on one problem's GEMM, in this process."""
    import epifuse  # noqa: F401  (loads the op library)
    ops = torch.ops.epifuse

    device = torch.device("cuda")
    m, k, n = SHAPES[problem]
    x, w = _operands(m, k, n, seed=problem, device=device)
    one = torch.ones(n, device=device)
    zero = torch.zeros(n, device=device)

    def product(xx):
        if impl == "cublas-sgemm":
            torch.backends.cuda.matmul.allow_tf32 = False
            return torch.mm(xx, w.t())
        if impl == "cublas-tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            return torch.mm(xx, w.t())
        precision = {"epifuse-tf32": "tf32"}.get(impl, "3xtf32")
        return ops.gemm_affine(xx, w, one, zero, precision)

    row = {"impl": impl, "problem": problem, "M": m, "K": k, "N": n}
    errors = {}
    for label, xx in (("x", x), ("x+100", x + OFFSET)):
        ref = xx.double() @ w.double().t()
        errors[label] = _rel_err(product(xx), ref)
        del ref
    row["rel_err"] = errors
    row["ms"] = ms = median_ms(product, x, reps)
    row["tflops"] = 2.0 * m * n * k / (ms * 1e-3) / 1e12
    torch.backends.cuda.matmul.allow_tf32 = False
    return row


def _child(impl: str, problem: int, reps: int, env: dict) -> Optional[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl,
           "--problems", str(problem), "--reps", str(reps)]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def rows(problems: list[int], promotions: list[int], reps: int) -> list[dict]:
    result = []
    for p in problems:
        for impl in ("cublas-sgemm", "cublas-tf32", "epifuse-tf32", "epifuse-3xtf32"):
            r = measure(impl, p, reps)
            r["label"] = impl
            result.append(r)
            torch.cuda.empty_cache()
        for interval in promotions:
            r = _child("epifuse-3xtf32", p, reps, {"EPIFUSE_3X_PROMOTION": str(interval)})
            if r:
                r["label"] = f"epifuse-3xtf32 (promote every {32 * interval} k)"
                result.append(r)
        r = _child("epifuse-3xtf32", p, reps, {"EPIFUSE_FORCE_SM80": "1"})
        if r:
            r["label"] = "epifuse-3xtf32 sm80 (mma.sync FastF32)"
            result.append(r)
    return result


def error_sweep(ks: list[int], m: int, n: int, seeds: int = 3) -> list[dict]:
    """Error vs float64 of SGEMM and of this process's 3x GEMM at each K (x and x + 100)."""
    import epifuse  # noqa: F401  (loads the op library)
    ops = torch.ops.epifuse

    device = torch.device("cuda")
    out = []
    for k in ks:
        for offset in (0.0, OFFSET):
            errs = {"sgemm": [], "3xtf32": []}
            for seed in range(seeds):
                x, w = _operands(m, k, n, seed=seed + 17 * k, device=device)
                x = x + offset
                ref = x.double() @ w.double().t()
                torch.backends.cuda.matmul.allow_tf32 = False
                errs["sgemm"].append(_rel_err(torch.mm(x, w.t()), ref))
                one, zero = torch.ones(n, device=device), torch.zeros(n, device=device)
                errs["3xtf32"].append(_rel_err(ops.gemm_affine(x, w, one, zero, "3xtf32"), ref))
            out.append({"K": k, "offset": offset, "M": m, "N": n,
                        **{key: max(v) for key, v in errs.items()}})
    return out


def markdown(table: list[dict]) -> str:
    lines = ["| problem | GEMM (M x K -> N) | implementation | ms | TFLOP/s | rel. error vs fp64 | "
             "same, x + 100 |", "|:--|:--|:--|--:|--:|--:|--:|"]
    for r in table:
        lines.append(f"| {r['problem']} | {r['M']}x{r['K']}->{r['N']} | {r['label']} | "
                     f"{r['ms']:.3f} | {r['tflops']:.1f} | {r['rel_err']['x']:.2e} | "
                     f"{r['rel_err']['x+100']:.2e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="experiments/gemm_precision.py",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", "--problem", type=int, nargs="+", default=[84, 39],
                    choices=sorted(SHAPES))
    ap.add_argument("--promotion", type=int, nargs="*", default=[],
                    help="also time the 3x GEMM at these promotion intervals (K-tiles of 32 k)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--error-sweep", type=int, nargs="*", metavar="K",
                    help="only the error of SGEMM and 3xTF32 at these K (M = N = 1024)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("experiments/gemm_precision.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.error_sweep:
        for r in error_sweep(args.error_sweep, 1024, 1024):
            ratio = r["3xtf32"] / r["sgemm"]
            print(f"K={r['K']:6d} offset={r['offset']:5.0f}  sgemm {r['sgemm']:.2e}  "
                  f"3xtf32 {r['3xtf32']:.2e}  ratio {ratio:.2f}")
        return 0
    if args.child:
        print(json.dumps(measure(args.child, args.problems[0], args.reps)))
        return 0
    table = rows(args.problems, args.promotion, args.reps)
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(markdown(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
