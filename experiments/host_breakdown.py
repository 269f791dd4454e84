"""Where a head's host time goes: the projection MLP's first head (Linear(2048, 4096, bias=False)
-> BatchNorm1d -> ReLU, batch 256), eager modules against the fused head, forward and forward +
backward, per setting.

    PYTHONPATH=python python experiments/host_breakdown.py [--settings fp32-tf32 amp-bf16]
                                                           [--out DIR]

For each setting and implementation: the host time per call (benchmarks.timing.measure_host: calls
issued while a spin kernel keeps the GPU busy), then one torch.profiler recording of 20 calls
(CPU ops and the CUDA runtime calls), printed as per-call self CPU time by op, most first. The
profiler's own cost inflates every row; the table says which ops and runtime calls the host time is
spent in, the timing above it says how much.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import epifuse  # noqa: E402
from benchmarks import timing  # noqa: E402
from benchmarks.cases import DTYPES  # noqa: E402
from benchmarks.real_heads import build_model  # noqa: E402

CALLS = 20


def table(prof, calls: int, limit: int = 28) -> str:
    rows = []
    for e in prof.key_averages():
        rows.append((e.self_cpu_time_total / calls, e.cpu_time_total / calls, e.count / calls,
                     e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"{'self us/call':>12} {'total us/call':>13} {'n/call':>6}  op   (sum of self: "
             f"{total:.1f} us/call)"]
    for self_us, total_us, n, key in rows[:limit]:
        lines.append(f"{self_us:12.1f} {total_us:13.1f} {n:6.1f}  {key[:90]}")
    return "\n".join(lines)


def per_op(device: torch.device, batch: int) -> None:
    """Host time (us) of each op a fused head's step calls, alone with its inputs prepared, beside
    the aten ops eager's head calls: which op's host cost stands out."""
    ops = torch.ops.epifuse
    d_in, n = 2048, 4096
    g = torch.Generator(device=device).manual_seed(0)
    for dtype, prec in ((torch.float32, "tf32"), (torch.bfloat16, "")):
        x = torch.rand(batch, d_in, device=device, generator=g).to(dtype)
        w = (torch.rand(n, d_in, device=device, generator=g) - 0.5).to(dtype)
        gamma, beta = torch.ones(n, device=device), torch.zeros(n, device=device)
        rm, rv = torch.zeros(n, device=device), torch.ones(n, device=device)
        nbt = torch.zeros((), dtype=torch.long, device=device)
        z, colsum, colsumsq = ops.gemm_colstats(x, w, prec)
        a, c, moments = ops.bn_fold_train(colsum, colsumsq, batch, None, gamma, beta, None, None,
                                          rm, rv, nbt)
        grad = torch.randn(batch, n, device=device, generator=g)
        sums = ops.head_grad_sums(grad, None, None, z, a, c, activation="relu")
        coef = ops.head_grad_coefficients(sums, None, colsum, colsumsq, moments, None, gamma, beta,
                                          None, None)[0]
        dz = ops.head_grad_z(grad, None, None, z, coef, a, c, activation="relu")
        zf = z.float()
        calls = {
            "empty tensor op (aten::empty 0)": lambda: torch.empty(0, device=device),
            "aten::mm": lambda: torch.mm(x, w.t()),
            "aten batch_norm (training)": lambda: torch.nn.functional.batch_norm(
                zf, rm, rv, gamma, beta, True, 0.1, 1e-5),
            "aten::relu": lambda: torch.relu(zf),
            "gemm_colstats": lambda: ops.gemm_colstats(x, w, prec),
            "bn_fold_train": lambda: ops.bn_fold_train(colsum, colsumsq, batch, None, gamma, beta,
                                                       None, None, rm, rv, nbt),
            "affine (relu)": lambda: ops.affine(z, a, c, activation="relu"),
            "head_grad_sums": lambda: ops.head_grad_sums(grad, None, None, z, a, c,
                                                         activation="relu"),
            "head_grad_coefficients": lambda: ops.head_grad_coefficients(
                sums, None, colsum, colsumsq, moments, None, gamma, beta, None, None),
            "head_grad_z": lambda: ops.head_grad_z(grad, None, None, z, coef, a, c,
                                                   activation="relu"),
            "backward_matmul dX": lambda: ops.backward_matmul(dz, w, prec),
            "backward_matmul dW": lambda: ops.backward_matmul(dz.t(), x, prec),
        }
        print(f"\n=== per op, {dtype}, batch {batch}, {d_in} -> {n}: host us (median / min)")
        for name, fn in calls.items():
            t = timing.measure_host_checked(fn, device, calls=CALLS)
            print(f"{t['median_us']:8.1f} {t['min_us']:8.1f}  {name}")


def split(device: torch.device, batch: int, settings: list[str]) -> None:
    """Where a fused head's host time goes, layer by layer: the Python decision alone
    (fast_path_reason), the op called from Python with its arguments prepared (fused_head, the
    forward; fused_head_backward, the backward without the autograd engine), beside the module's
    whole forward and the engine's backward."""
    from epifuse.fusion import HEADS_ATTR
    from epifuse.head import _bn_defaults, _parts

    dims = (2048, 4096, 256)
    for name in settings:
        spec = DTYPES[name]
        torch.manual_seed(0)
        model = nn.Sequential(*list(build_model("projection", dims, bias=False))[:3]).to(device)
        epifuse.fuse(model, precision=spec.precision, strict=True)
        head = getattr(model, HEADS_ATTR)[0]
        x = torch.rand(batch, dims[0], device=device).requires_grad_()
        g = torch.randn(batch, dims[1], device=device)
        config = epifuse.head.HeadConfig(
            precision=epifuse.precision.resolve_precision(head.precision, x.dtype),
            activation=head.activation, has_scale=head.has_scale)
        kw = config.kwargs()
        p = _bn_defaults(_parts(head))
        op = torch.ops.epifuse.fused_head.default
        args = (x, p.weight, p.bias, p.gamma, p.beta, p.scale, p.running_mean, p.running_var,
                p.num_batches_tracked)
        with spec.context(), spec.amp("cuda"):
            outs = op(*args, **kw)
            out, z, colsum, colsumsq, moments, a, c = outs
            needs = [True, True, False, True, True, False]
            bkw = dict(kw, training=True, grad_x_dtype=x.dtype)
            operands = x.detach().to(z.dtype), p.weight.detach().to(z.dtype)
            bargs = (g.to(out.dtype), *operands, None, p.gamma, p.beta, p.scale, z, None, colsum,
                     colsumsq, moments, needs, a, c)
            calls = {
                "module forward (fused)": lambda: head(x),
                "fast_path_reason": lambda: epifuse.head.fast_path_reason(head, x),
                "HeadConfig + kwargs()": lambda: epifuse.head.HeadConfig(
                    precision="tf32", training=True, activation="relu", momentum=0.1,
                    eps=1e-5, has_scale=False, for_backward=True).kwargs(),
                "fused_head op from Python": lambda: op(*args, **kw),
                "fused_head_backward op (no grad)": lambda: _no_grad(
                    torch.ops.epifuse.fused_head_backward.default, bargs, bkw),
                "forward + engine backward": lambda: head(x).backward(g),
            }
            print(f"\n=== split, {name}, batch {batch}: host us (median / min)")
            for what, fn in calls.items():
                t = timing.measure_host_checked(fn, device, calls=CALLS)
                print(f"{t['median_us']:8.1f} {t['min_us']:8.1f}  {what}")


def _no_grad(op, args, kwargs):
    with torch.no_grad():
        return op(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="*", default=["fp32-tf32", "amp-bf16", "fp32-3xtf32"])
    p.add_argument("--impls", nargs="*", default=["eager", "fused"])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", default=None, help="folder for Chrome traces (none: no traces)")
    p.add_argument("--per-op", action="store_true", help="also time each op alone")
    p.add_argument("--split", action="store_true",
                   help="also time the fused head's layers: decision, op call, backward op")
    args = p.parse_args()
    device = torch.device("cuda")
    if args.per_op:
        per_op(device, args.batch)
    if args.split:
        split(device, args.batch, args.settings)
    dims = (2048, 4096, 256)
    for name in args.settings:
        spec = DTYPES[name]
        torch.manual_seed(0)
        eager = nn.Sequential(*list(build_model("projection", dims, bias=False))[:3]).to(device)
        fused = copy.deepcopy(eager)
        epifuse.fuse(fused, precision=spec.precision, strict=True)
        x = torch.rand(args.batch, dims[0], device=device).requires_grad_()
        g = torch.randn(args.batch, dims[1], device=device)
        with spec.context():
            for impl, model in (("eager", eager), ("fused", fused)):
                if impl not in args.impls:
                    continue
                params = list(model.parameters())
                call = spec.amp_calls(model, "cuda")

                def fwd(call=call):
                    return call(x)

                def fwd_bwd(call=call, params=params):
                    x.grad = None
                    for q in params:
                        q.grad = None
                    call(x).backward(g)

                for what, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
                    t = timing.measure_host_checked(fn, device, calls=CALLS)
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                    torch.cuda._sleep(int(2e8))  # the GPU busy: the calls only queue
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(CALLS):
                            fn()
                    torch.cuda.synchronize()
                    print(f"\n=== {name} {impl} {what}: host {t['median_us']:.1f} us/call "
                          f"(min {t['min_us']:.1f}, GPU kept busy: {t['gpu_kept_busy']})")
                    print(table(prof, CALLS))
                    if args.out:
                        os.makedirs(args.out, exist_ok=True)
                        prof.export_chrome_trace(
                            os.path.join(args.out, f"{name}_{impl}_{what.replace('+', '_')}.json"))


if __name__ == "__main__":
    main()
