#!/usr/bin/env python3
"""Workload for scripts/sanitize.sh: every epifuse op and both ModelNew problems, small shapes.

Covers: ragged tiles (M, N not multiples of 128/256), stream-K (few tiles) and data-parallel
(more tiles than SMs) sm90 GEMMs, the portable SIMT GEMM (fp32 'ieee' with TF32 allowed in
cuBLAS; K not a multiple of 8 for 16-bit / of 4 for fp32; N unaligned; strided x), the cuBLAS
IEEE path, the sm80 mma.sync GEMMs (3xTF32 always; every mode with EPIFUSE_FORCE_SM80=1), empty problems, the fold and the ops of synchronized statistics for N = 1..4097, the row kernels from 1 column to the
staged and looped wide-row softmax (N = 8192 .. 40000, many rows), fp32 / bf16 / fp16, in-place ops on strided views.

Each launch is followed by a synchronize (so the sanitizer attributes errors to the right op)
and a loose value check against float64 math: a silent wrong answer also fails the run.
Exit status: 0 all good, 1 a value check failed, 0 with a message when no GPU is present.

    python scripts/sanitize_driver.py [--quick] [--list]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="skip the data-parallel (many-tile) GEMMs: for racecheck")
    parser.add_argument("--list", action="store_true", help="print the sweep and exit")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # Before torch and epifuse load: --help (and a bad option) must answer without a build.
    OPTS = parse_args()

import torch  # noqa: E402

try:
    import epifuse
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    import epifuse

from epifuse import cli, fold, ops  # noqa: E402
from epifuse import synced_ops as synced_ops_module  # noqa: E402
from epifuse.problems import gemm_bn_scale_softmax as p84  # noqa: E402
from epifuse.problems import gemm_scale_bn as p39  # noqa: E402

DTYPES = cli.TORCH_DTYPES  # fp32, bf16, fp16: the command lines' names (epifuse.cli)
TOL = {"fp32": 1e-4, "3xtf32": 1e-4, "tf32": 5e-3, "bf16": 3e-2, "fp16": 5e-3}

# (M, N, K). Alignment for the TMA path: K, N multiples of 4 (fp32) / 8 (16-bit).
GEMM_SHAPES = [
    (1, 1, 1),          # SIMT, a single element
    (5, 3, 7),          # SIMT: nothing aligned
    (0, 8, 16),         # empty M
    (4, 8, 0),          # K = 0: z = 0
    (130, 264, 72),     # sm90 stream-K, ragged M and N
    (257, 136, 64),     # ragged M (2 tiles + 1 row)
    (64, 520, 13),      # K odd: SIMT with more rows
    (33, 100, 40),      # N = 100: TMA for fp32 (4 | 100), SIMT for 16-bit (8 does not divide 100)
    (40, 1000, 64),     # M <= 384: the transposed sm90 GEMM (z^T = w . x^T), ragged tiles
]
GEMM_SHAPES_FULL = [
    (1536, 1536, 64),   # training: 12 x 6 transposed 128x256 tiles -> stream-K kernel
    (1536, 3072, 32),   # affine 128x256 tiles: 144 -> data-parallel kernel; training: 24 x 6 = 144
                        # transposed tiles -> data-parallel kernel, 6 partials per column
    (1030, 4104, 64),   # training: 33 x 5 transposed tiles, ragged both ways (data-parallel)
    (64, 4096, 4096),   # transposed small-batch GEMM, 2^30 multiply-adds, both epilogues
    # fp32 3xtf32 takes the Hopper 3xTF32 GEMM from 64 rows, K = 64 and 2^30 multiply-adds
    # (gemm_plan.cu); below, SGEMM. The small-batch shape above is one; these two are:
    (1024, 1024, 1024),  # 8 x 8 tiles of 128x128 in both forms -> the stream-K kernels
    (2100, 1040, 512),   # 17 x 9 tiles, ragged M and N -> the persistent kernels
]
# (300, 12288) and (300, 20000): more rows than resident blocks, so the staged softmax kernels go
# round their persistent loop (shared-memory stages reused) several times.
ROW_SHAPES = [(3, 1), (5, 7), (33, 100), (7, 1000), (4, 4097), (2, 8192), (2, 40000), (1, 33),
              (300, 12288), (300, 20000)]
FOLD_N = [1, 7, 256, 4097]
MODEL_SHAPES = [(2, 16, 8), (33, 13, 65), (130, 72, 264), (300, 256, 264)]  # (M, K, N)

failures: list[str] = []
launches = 0


def sync_check(label: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    global launches
    torch.cuda.synchronize()
    launches += 1
    want = want.detach().double().cpu()
    got = got.detach().double().cpu()
    if got.shape != want.shape:
        failures.append(f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    if want.numel() == 0:
        return
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    if not err <= tol:  # NaN fails too
        failures.append(f"{label}: rel err {err:.2e} > {tol:.0e}")


def precisions(dtype_id: str):
    if dtype_id != "fp32":
        return [("", dtype_id)]
    return [(p, "fp32" if p == "ieee" else p) for p in cli.PRECISION_ORDER]


def gemm_ops(shapes) -> None:
    dev = "cuda"
    for (m, n, k) in shapes:
        for dtype_id, dtype in DTYPES.items():
            g = torch.Generator(device=dev).manual_seed(m + 3 * n + 7 * k)
            x = (torch.rand(m, k, device=dev, generator=g) - 0.3).to(dtype)
            w = ((torch.rand(n, k, device=dev, generator=g) - 0.5) / max(k, 1) ** 0.5).to(dtype)
            a = torch.rand(n, device=dev, generator=g) + 0.5
            c = torch.randn(n, device=dev, generator=g)
            z64 = x.double() @ w.double().T
            for precision, tol_id in precisions(dtype_id):
                # fp32 'ieee': cuBLAS SGEMM + epilogue pass, also with TF32 allowed globally
                modes = [False, True] if precision == "ieee" else [False]
                for allow_tf32 in modes:
                    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
                    path = f"{dtype_id}/{precision or '-'}{'/simt' if allow_tf32 else ''}"
                    tag = f"{path} {m}x{n}x{k}"
                    y = ops.gemm_affine(x, w, a, c, precision)
                    sync_check(f"gemm_affine {tag}", y, a.double() * z64 + c.double(), TOL[tol_id])
                    z, s1, s2 = ops.gemm_colstats(x, w, precision)
                    sync_check(f"gemm_colstats z {tag}", z, z64, TOL[tol_id])
                    if m > 0:
                        sync_check(f"gemm_colstats colsum {tag}", s1, z64.sum(0), TOL[tol_id])
                        sync_check(f"gemm_colstats colsumsq {tag}", s2, (z64 ** 2).sum(0),
                                   TOL[tol_id])
                torch.backends.cuda.matmul.allow_tf32 = False
        # strided x (row stride > K): the copy-free path with a leading dimension
        base = torch.rand(m, k + 8, device=dev)
        x = base[:, :k]
        w = torch.rand(n, k, device=dev)
        a, c = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        y = ops.gemm_affine(x, w, a, c, "tf32")
        sync_check(f"gemm_affine strided-x fp32/tf32 {m}x{n}x{k}", y,
                   x.double() @ w.double().T, TOL["tf32"])


def fold_ops() -> None:
    dev = "cuda"
    for n in FOLD_N:
        for dtype_id, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(n)

            def t(lo, hi, size=n, g=g, dtype=dtype):
                return (torch.rand(size, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(
                    dev, dtype)

            zz = torch.randn(37, n, generator=g, dtype=torch.float64) * 2 + 1
            colsum, colsumsq = (s.to(dev) for s in fold.column_stats(zz))
            bias, gamma, beta = t(-1, 1), t(0.5, 1.5), t(-1, 1)
            for pre, post, momentum in ((None, t(0.5, 2, 1), 0.1), (t(0.5, 2), None, None)):
                rm, rv = t(-1, 1), t(0.5, 2)
                nbt = torch.tensor(2, device=dev)
                rm64, rv64, nbt64 = rm.double().cpu(), rv.double().cpu(), nbt.cpu().clone()
                a, c = ops.bn_fold_train(colsum, colsumsq, 37, bias, gamma, beta, pre, post,
                                         rm, rv, nbt, momentum=momentum, eps=1e-5)
                f = fold.fold_train(colsum.cpu(), colsumsq.cpu(), 37, _cpu(bias), _cpu(gamma),
                                    _cpu(beta), _cpu(pre), _cpu(post), 1e-5)
                fold.update_running_stats(rm64, rv64, nbt64, f.mean, f.var, 37, momentum)
                tol = TOL[dtype_id]
                sync_check(f"bn_fold_train a {dtype_id} N{n}", a, f.a, tol)
                sync_check(f"bn_fold_train c {dtype_id} N{n}", c, f.c, tol)
                sync_check(f"bn_fold_train running_var {dtype_id} N{n}", rv, rv64, tol)
                if nbt.item() != 3:
                    failures.append(f"bn_fold_train num_batches_tracked {nbt.item()} != 3")
                a, c = ops.bn_fold_eval(bias, gamma, beta, pre, post, rm, rv, eps=1e-5)
                f = fold.fold_eval(_cpu(bias), _cpu(gamma), _cpu(beta), _cpu(pre), _cpu(post),
                                   _cpu(rm), _cpu(rv), 1e-5)
                sync_check(f"bn_fold_eval a {dtype_id} N{n}", a, f.a, tol)
                sync_check(f"bn_fold_eval c {dtype_id} N{n}", c, f.c, tol)


def _cpu(t):
    return None if t is None else t.cpu()


def synced_ops() -> None:
    """The ops of synchronized statistics against their CPU kernels: a rank's row, three ranks'
    rows (one empty) merged and folded, the backward's row."""
    dev = "cuda"
    for n in FOLD_N:
        for dtype_id, dtype in DTYPES.items():
            g = torch.Generator().manual_seed(n)
            zz = torch.randn(37, n, generator=g, dtype=torch.float64) * 2 + 1
            colsum, colsumsq = fold.column_stats(zz)
            bias, gamma, beta, pre, post = ((torch.rand(size, generator=g) + 0.5).to(dtype)
                                            for size in (n, n, n, n, 1))
            row = synced_ops_module.pack_moments(colsum, colsumsq, 37, bias, pre)
            rows = torch.stack([row, torch.zeros_like(row), row * torch.tensor([2.0])])
            sums = torch.cat([torch.randn(2 * n, generator=g, dtype=torch.float64), row[:1]])
            calls = {"pack_moments": (colsum, colsumsq, 37, bias, pre),
                     "merge_fold": (rows, bias, gamma, beta, pre, post),
                     "normalized_grad_sums": (sums, rows[0].roll(-1), bias, gamma, pre, post)}
            for name, args in calls.items():
                op = getattr(torch.ops.epifuse, name)
                want = op(*args)
                got = op(*(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args))
                for i, (g_out, w_out) in enumerate(zip(*(o if isinstance(o, tuple) else (o,)
                                                         for o in (got, want)))):
                    sync_check(f"{name}[{i}] {dtype_id} N{n}", g_out, w_out, TOL[dtype_id])


def row_ops(shapes) -> None:
    dev = "cuda"
    for (m, n) in shapes:
        for dtype_id, dtype in DTYPES.items():
            g = torch.Generator(device=dev).manual_seed(m * 31 + n)
            z = (torch.randn(m, n, device=dev, generator=g) * 3).to(dtype)
            a = torch.rand(n, device=dev, generator=g) + 0.5
            c = torch.randn(n, device=dev, generator=g)
            tol = TOL[dtype_id] if dtype_id != "fp32" else 1e-5
            lin = a.double() * z.double() + c.double()
            tag = f"{dtype_id} {m}x{n}"
            sync_check(f"affine_softmax {tag}", ops.affine_softmax(z, a, c),
                       torch.softmax(lin, 1), tol)
            sync_check(f"affine_softmax plain {tag}", ops.affine_softmax(z, None, None),
                       torch.softmax(z.double(), 1), tol)
            zi = z.clone()
            ops.affine_softmax_(zi, a, c)
            sync_check(f"affine_softmax_ {tag}", zi, torch.softmax(lin, 1), tol)
            zi = z.clone()
            ops.affine_(zi, a, c)
            sync_check(f"affine_ {tag}", zi, lin, tol)
            # strided views (row stride > N): in place through the view, the padding untouched
            wide = torch.zeros(m, n + 8, device=dev, dtype=dtype)
            view = wide[:, :n]
            view.copy_(z)
            ops.affine_softmax_(view, a, c)
            sync_check(f"affine_softmax_ strided {tag}", view, torch.softmax(lin, 1), tol)
            view.copy_(z)
            ops.affine_(view, a, c)
            sync_check(f"affine_ strided {tag}", view, lin, tol)
            sync_check(f"strided padding {tag}", wide[:, n:], torch.zeros(m, 8), 0.0)


def models(shapes) -> None:
    for (m, k, n) in shapes:
        for number, module in ((84, p84), (39, p39)):
            args = ([k, n, 1e-5, 0.1, (1,)] if number == 84 else [k, n, (n,), 1e-5, None])
            for kind, dtype, precision in (("ieee", torch.float32, "ieee"),
                                           ("tf32", torch.float32, "tf32"),
                                           ("bf16", torch.bfloat16, None),
                                           ("fp16", torch.float16, None)):
                torch.manual_seed(m + n + k)
                ref = module.Model(*args)
                new = module.ModelNew(*args, precision=precision)
                new.load_state_dict(ref.state_dict())
                ref.to("cuda", dtype), new.to("cuda", dtype)
                twin = module.Model(*args).double().cuda()
                twin.load_state_dict({k_: v.double() if v.is_floating_point() else v
                                      for k_, v in ref.state_dict().items()})
                x = torch.rand(m, k, device="cuda").to(dtype)
                tol = {"ieee": 1e-4, "tf32": 1e-2, "bf16": 5e-2, "fp16": 2e-2}[kind]
                for training in (True, False):
                    new.train(training), twin.train(training)
                    with torch.no_grad():
                        y = new(x)
                        want = twin(x.double())
                    sync_check(f"p{number} ModelNew {kind} {'train' if training else 'eval'} "
                               f"M{m} K{k} N{n}", y, want, tol)


def main(opts: argparse.Namespace) -> int:
    gemm_shapes = GEMM_SHAPES + ([] if opts.quick else GEMM_SHAPES_FULL)
    if opts.list:
        print(f"gemm (M, N, K): {gemm_shapes}\nrows (M, N): {ROW_SHAPES}\nfold N: {FOLD_N}\n"
              f"models (M, K, N): {MODEL_SHAPES}")
        return 0
    if not torch.cuda.is_available():
        print("sanitize_driver: no CUDA GPU available; skipping (nothing was checked)")
        return 0
    if not ops.has_cuda_kernels():
        print("sanitize_driver: the epifuse library has no CUDA kernels; nothing to check")
        return 1
    print(f"sanitize_driver: {torch.cuda.get_device_name()} torch {torch.__version__} "
          f"epifuse {getattr(epifuse, '__version__', '?')}", flush=True)
    t0 = time.time()
    steps = (("gemm", lambda: gemm_ops(gemm_shapes)), ("fold", fold_ops), ("synced", synced_ops),
             ("rows", lambda: row_ops(ROW_SHAPES)), ("models", lambda: models(MODEL_SHAPES)))
    for name, fn in steps:
        t = time.time()
        fn()
        print(f"sanitize_driver: {name} done ({time.time() - t:.1f}s)", flush=True)
    for f in failures:
        print(f"sanitize_driver: VALUE CHECK FAILED: {f}")
    print(f"sanitize_driver: {launches} checked launches, {len(failures)} value failures, "
          f"{time.time() - t0:.1f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(OPTS))
