"""Synced ModelNew against the reference Model converted with nn.SyncBatchNorm (2+ GPUs, NCCL).

    torchrun --standalone --nproc_per_node=2 tests/distributed/sync_bn_check.py
    torchrun --standalone --nproc_per_node=2 tests/distributed/sync_bn_check.py --smoke-cpu

For problems 84 and 39, each rank trains both models on its own batch (unequal
sizes per rank, one case with a one-row rank and one with an empty rank,
two DDP-wrapped cases) for 3 SGD steps and compares outputs, running
statistics, num_batches_tracked and the gradients of the input and of every
parameter; then one eval-mode forward. fp32 with precision='ieee' (IEEE GEMMs
on both sides) and PyTorch's default precision (ModelNew's 3xTF32 against the
reference's fp32 GEMM) are held to tight bounds, 'tf32' and bf16 to looser ones. Where the GPU
has epifuse's fused kernels the fused path must be taken (rows > 1);
elsewhere the script checks the synchronized reference path and says so.

``--smoke-cpu`` runs the same script with gloo on CPU, ModelNew on its fused
path through the ops' CPU kernels; nn.SyncBatchNorm has no CPU kernels, so
there the reference's SyncBatchNorm layers run epifuse's pure-PyTorch synced
BatchNorm. That checks this script, not the math (tests/distributed/
oracle_check.py checks the math on CPU).

Failures are printed as ``[rank R] FAIL <case>: <what> error E > bound``;
an exception aborts every rank (torchrun tears the job down) after printing
its traceback tagged with the rank. Exit status 0 when every rank passed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # tests/ (helpers)
                str(Path(__file__).resolve().parents[2] / "python"),
                str(Path(__file__).resolve().parents[2])]  # benchmarks/

import epifuse  # noqa: E402
from epifuse import head  # noqa: E402
from benchmarks.distributed import CpuSyncBatchNorm  # noqa: E402
from checks import BUFFERS, PARAMS, Failures, vanishing_grads  # noqa: E402
from helpers import init_args, make_pair  # noqa: E402

IN, OUT, STEPS, LR = 512, 384, 3, 0.05
# (outputs and running statistics, gradients) bounds on the relative Frobenius error.
TOL = {"ieee": (5e-5, 2e-4), "default": (5e-5, 2e-4), "tf32": (1e-2, 2e-2),
       "bf16": (3e-2, 6e-2)}


@dataclass(frozen=True)
class Case:
    number: int
    precision: str  # "ieee" | "tf32" | "default" (precision=None under 'highest': 3xTF32)
    sizes: tuple  # rows per rank (rank r uses sizes[r % len(sizes)])
    ddp: bool = False
    converter: str = "epifuse"  # "epifuse" | "kwarg" | "torch": how ModelNew is made synced
    dtype: torch.dtype = torch.float32

    @property
    def tolerance(self) -> tuple:
        return TOL["bf16" if self.dtype == torch.bfloat16 else self.precision]

    @property
    def model_precision(self):
        return None if self.precision == "default" else self.precision

    def __str__(self):
        dtype = "" if self.dtype == torch.float32 else f" {str(self.dtype)[6:]}"
        return (f"p{self.number} {self.precision}{dtype} rows{self.sizes}"
                f"{' ddp' if self.ddp else ''} via-{self.converter}")


CASES = [
    Case(84, "ieee", (96, 160)),
    Case(39, "ieee", (96, 160), converter="kwarg"),
    Case(84, "tf32", (96, 160)),
    Case(39, "tf32", (96, 160)),
    Case(84, "ieee", (1, 127)),  # a one-row rank takes the reference path beside a fused one
    Case(39, "ieee", (0, 64)),  # an empty rank still joins every collective
    Case(39, "ieee", (64, 200), converter="torch"),  # nn.SyncBatchNorm.convert_sync_batchnorm
    Case(84, "ieee", (96, 160), ddp=True),
    Case(39, "tf32", (128, 80), ddp=True),
    Case(84, "default", (96, 160)),
    Case(39, "default", (128, 80), ddp=True),
    Case(84, "default", (96, 160), dtype=torch.bfloat16),
    Case(39, "default", (64, 200), ddp=True, dtype=torch.bfloat16),
]


def build(case: Case, device, rank):
    """(reference, epifuse) modules, identical parameters on every rank, on ``device``."""
    scale = (1,) if case.number == 84 else (OUT,)
    ref, new = make_pair(case.number, init_args(case.number, IN, OUT, scale), seed=5,
                         precision=case.model_precision)
    ref = nn.SyncBatchNorm.convert_sync_batchnorm(ref)
    if device.type == "cpu":  # --smoke-cpu
        ref.bn.__class__ = CpuSyncBatchNorm
    if case.converter == "epifuse":
        new = epifuse.convert_sync_batchnorm(new)
    elif case.converter == "torch":
        new = nn.SyncBatchNorm.convert_sync_batchnorm(new)
    else:  # the constructor keyword
        synced = type(new)(*init_args(case.number, IN, OUT, scale),
                           precision=case.model_precision, sync_batchnorm=True)
        synced.load_state_dict(new.state_dict())
        new = synced
    ref.to(device, case.dtype).train()
    new.to(device, case.dtype).train()
    if case.ddp:
        ids = [device.index] if device.type == "cuda" else None
        ref, new = DDP(ref, device_ids=ids), DDP(new, device_ids=ids)
    return ref, new


def run_case(case: Case, device, rank: int, world: int, failures: Failures) -> str:
    torch.set_float32_matmul_precision("high" if case.precision == "tf32" else "highest")
    tol_out, tol_grad = case.tolerance
    ref, new = build(case, device, rank)
    ref_m, new_m = (ref.module, new.module) if case.ddp else (ref, new)
    gen = torch.Generator().manual_seed(17)
    tag = f"{case}"
    paths = []
    for step in range(STEPS):
        rows = [case.sizes[r % len(case.sizes)] for r in range(world)]
        xs = [torch.rand(m, IN, generator=gen) for m in rows]  # every rank draws all batches
        ws = [torch.randn(m, OUT, generator=gen) for m in rows]
        x0, w = xs[rank].to(device, case.dtype), ws[rank].to(device, case.dtype)
        reason = head.fast_path_reason(new_m, x0)
        paths.append("fused" if reason is None else f"reference ({reason})")
        results = []
        for model in (ref, new):
            model.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_()
            y = model(x)
            (y * w).sum().backward()
            results.append((y.detach(), x.grad))
        (y_ref, gx_ref), (y_new, gx_new) = results
        s = f"step {step}"
        failures.expect(tag, f"{s} output", y_new, y_ref, tol_out)
        failures.expect(tag, f"{s} grad x", gx_new, gx_ref, tol_grad)
        ref_p, new_p = dict(ref_m.named_parameters()), dict(new_m.named_parameters())
        # Where a rank's gradient is the global one, the vanishing ones compare absolutely.
        # (On an empty rank nn.SyncBatchNorm leaves every gradient None: zeros.)
        weight_grad = ref_p["gemm.weight"].grad
        floor = (weight_grad.norm().item() if weight_grad is not None and
                 (case.ddp or 0 in case.sizes) else 0.0)
        for name in PARAMS:
            expected = ref_p[name].grad
            if expected is None:
                expected = torch.zeros_like(ref_p[name])
            failures.expect(tag, f"{s} grad {name}", new_p[name].grad, expected, tol_grad,
                            floor if name in vanishing_grads(case.number) else 0.0)
        for name in BUFFERS:
            failures.expect(tag, f"{s} {name}", new_m.get_buffer(name), ref_m.get_buffer(name),
                            tol_out)
        nbt_ref, nbt_new = (int(m.bn.num_batches_tracked) for m in (ref_m, new_m))
        if nbt_ref != nbt_new:
            failures.append(f"{tag}: {s} num_batches_tracked {nbt_new} != {nbt_ref}")
        with torch.no_grad():  # SGD on both; DDP averaged the gradients, else they are local
            for name, p in new_p.items():
                if p.grad is not None:
                    p -= LR * p.grad
            for name, p in ref_p.items():
                if p.grad is not None:
                    p -= LR * p.grad
            if case.dtype != torch.float32:
                # 16-bit gradients differ by rounding at the percent level (the bound), which SGD
                # turns into diverging trajectories: each step starts from the reference's state.
                new_m.load_state_dict(ref_m.state_dict())
    # On a device with the fused kernels (or forced, --smoke-cpu) a batch of 2+ rows must use them.
    if head._device_reason(x0) is None and case.sizes[rank % len(case.sizes)] > 1 and \
            any(p != "fused" for p in paths):
        failures.append(f"{tag}: fused path not taken: {paths}")
    # Eval: running statistics, no synchronization.
    ref.eval()
    new.eval()
    with torch.no_grad():
        x = xs[rank].to(device, case.dtype)
        failures.expect(tag, "eval output", new(x), ref(x), tol_out)
    return paths[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="gloo on CPU; checks the script, not the math (see module doc)")
    args = parser.parse_args()
    if args.smoke_cpu:
        device = torch.device("cpu")
        head._device_reason = lambda x: None  # fused path through the ops' CPU kernels
        backend = "gloo"
    else:
        if torch.cuda.device_count() < 2:
            print("sync_bn_check: needs 2 CUDA GPUs (or --smoke-cpu)", flush=True)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        backend = "nccl"
    # device_id: NCCL binds this rank's GPU at init rather than guessing it later.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        where = "CPU smoke" if args.smoke_cpu else torch.cuda.get_device_name(device)
        fused = "forced on CPU" if args.smoke_cpu else \
            (head._device_reason(torch.empty(1, device=device)) or "available")
        print(f"[sync_bn_check] {world} ranks, {backend}, {where}; fused kernels: {fused}; "
              f"torch {torch.__version__}", flush=True)
    failures = Failures()
    for case in CASES:
        try:
            path = run_case(case, device, rank, world, failures)
        except Exception:
            # A peer may now wait in a collective: abort the job rather than desynchronize.
            print(f"[rank {rank}] ERROR in case {case}:\n{traceback.format_exc()}", flush=True)
            os._exit(1)
        print(f"[rank {rank}] {case}: {path}", flush=True)
    for line in failures:
        print(f"[rank {rank}] FAIL {line}", flush=True)
    count = torch.tensor([len(failures)], device=device)
    dist.all_reduce(count)
    if rank == 0:
        verdict = "PASS" if count.item() == 0 else "FAIL"
        print(f"[sync_bn_check] {verdict}: {len(CASES)} cases x {STEPS} steps, "
              f"{int(count.item())} failure(s) over all ranks", flush=True)
    dist.destroy_process_group()
    return 0 if count.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
