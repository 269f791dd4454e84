"""``python -m benchmarks.distributed``: data-parallel training steps on several GPUs.

A section of ``python -m benchmarks`` on a machine with 2 GPUs or more (BENCHMARKS.md,
"Data-parallel training step"); alone, this prints and writes its table.

Times one training step (forward + backward, as in the single-GPU "train-step" mode) of
ModelNew with synchronized batch statistics (``epifuse.convert_sync_batchnorm``) against the
reference Model converted with ``nn.SyncBatchNorm.convert_sync_batchnorm``, both with and
without ``DistributedDataParallel`` (with DDP the weight gradient's all-reduce is in the step,
the same for both sides). Every rank holds the problem's KernelBench batch, so the global
batch is ``--nproc`` times it. One process per GPU (NCCL), started by this module itself.

Timing: a fixed number of warm-up and timed steps on every rank (each step runs collectives,
so every rank must run the same count), CUDA events around each step on the current stream,
inputs rotated so that consecutive steps do not find theirs in L2. A row reports the slowest
rank's median. Host time per step beside it (``timing.measure_host``: ``time.perf_counter``
around each step issued while a spin kernel keeps the GPU busy, so that the host's own cost is
what is timed, Python, dispatch, allocation and launches; the synchronized statistics' path must
not synchronize with the device, or the GPU goes idle and the row says so): where the host, not
the GPU, is what a rank waits on, NCCL waits for the slower rank's host too. ``--device cpu`` is a dry run at tiny sizes (gloo; nn.SyncBatchNorm has no CPU
kernels, so the reference's BatchNorm runs epifuse's pure-PyTorch synchronized BatchNorm):
it tests this module's plumbing, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import epifuse
from epifuse import distributed as ef_dist

from .cases import DTYPES, Case, Shape, base_state, build, input_bytes, make_inputs, make_step
from .cases import problem_shapes
from .timing import Settings, measure, measure_host, rotation_count

DEFAULT_DTYPES = ("fp32-3xtf32", "fp32-tf32", "bf16")
PROBLEMS = (84, 39)
WARMUP, ITERS = 5, 20


@dataclass
class StepResult:
    problem: int
    shape: str  # per rank
    dtype: str
    ddp: bool
    ours_ms: float  # slowest rank's median
    reference_ms: float
    path: str  # ModelNew's path on the slowest rank ("fused" or the reason it was not)
    output_err: float  # ours vs the reference on the first step, relative Frobenius, max over ranks
    ours_host_ms: float = float("nan")  # host time to issue a step, slowest rank's median
    reference_host_ms: float = float("nan")
    gpu_kept_busy: bool = True  # False: a step synchronized with the device on some rank

    @property
    def speedup(self) -> float:
        return self.reference_ms / self.ours_ms


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Dry-run stand-in for nn.SyncBatchNorm, which has no CPU kernels: epifuse's synced BN.

    Not a SyncBatchNorm subclass, so that DDP accepts it on CPU.
    """

    def forward(self, input):
        group = self.process_group or dist.group.WORLD
        if self.training and dist.is_initialized() and dist.get_world_size(group) > 1:
            return ef_dist.synced_batch_norm(input, self.weight, self.bias, self.running_mean,
                                             self.running_var, self.num_batches_tracked,
                                             self.momentum, self.eps, group)
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                            self.training, self.momentum or 0.0, self.eps)


def _pair(case: Case, device: torch.device, ddp: bool) -> tuple[nn.Module, nn.Module]:
    """(reference under nn.SyncBatchNorm, synced ModelNew), the same state, optionally in DDP."""
    state = base_state(case.shape, device)
    ref, new = (build(case, state, device, new=new) for new in (False, True))
    ref = nn.SyncBatchNorm.convert_sync_batchnorm(ref)
    if device.type == "cpu":
        ref.bn.__class__ = CpuSyncBatchNorm
    new = ef_dist.convert_sync_batchnorm(new)
    if ddp:
        ids = [device.index] if device.type == "cuda" else None
        ref, new = DDP(ref, device_ids=ids), DDP(new, device_ids=ids)
    return ref, new


def _slowest(values: list[float], device: torch.device) -> list[float]:
    """Elementwise max over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _run_config(shape: Shape, dtype: str, ddp: bool, device: torch.device, rank: int,
                warmup: int, iters: int) -> StepResult:
    case = Case(shape, DTYPES[dtype], "train-step")
    with case.spec.context():
        ref, new = _pair(case, device, ddp)
        count = rotation_count(input_bytes(case), device, cap=4)
        pairs = make_inputs(case, device, count, seed=100 + rank)
        x0 = pairs[0][0].detach()
        reason = epifuse.fast_path_reason(new.module if ddp else new, x0)  # None: fused
        # First step of each on the same input: outputs compared (the step updates the
        # running statistics of both alike).
        outs = []
        for model in (ref, new):
            x = x0.clone().requires_grad_()
            y = model(x)
            y.backward(pairs[0][1])
            outs.append(y.detach().double())
        err = ((outs[1] - outs[0]).norm() / outs[0].norm().clamp_min(1e-300)).item()
        # Fixed counts: every step runs collectives, so every rank must run the same number.
        times = [measure(make_step(m, m), pairs, device, Settings.fixed(warmup, iters)).median
                 * 1e3 for m in (new, ref)]
        # Host time: the same fixed counts on every rank (the steps run collectives).
        hosts = [measure_host(lambda step=make_step(m, m): step(pairs[0]), device,
                              warmup=warmup, rounds=3, calls=iters) for m in (new, ref)]
    busy = all(h["gpu_kept_busy"] is not False for h in hosts)
    ours, reference, err, ours_host, ref_host, idle = _slowest(
        [*times, err, *(h["median_us"] * 1e-3 for h in hosts), float(not busy)], device)
    return StepResult(shape.problem, str(shape), dtype, ddp, ours, reference,
                      "fused" if reason is None else f"reference ({reason})", err, ours_host,
                      ref_host, idle == 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    cpu = args.device == "cpu"
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast is not on every machine
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.nproc, timeout=datetime.timedelta(seconds=300),
                            device_id=device if not cpu else None)
    try:
        results = []
        for problem in args.problems:
            shape = next(s for s in problem_shapes(problem, cpu) if s.tag == "kernelbench")
            for dtype in args.dtypes:
                for ddp in (False, True):
                    r = _run_config(shape, dtype, ddp, device, rank, args.warmup, args.iters)
                    results.append(r)
                    if rank == 0:
                        print(f"[benchmarks.distributed] p{problem} {shape} {dtype}"
                              f"{' ddp' if ddp else ''}: ours {r.ours_ms:.3f} ms, reference "
                              f"{r.reference_ms:.3f} ms ({r.speedup:.2f}x), {r.path}", flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if rank == 0:
            queue.put([asdict(r) for r in results])
    finally:
        dist.destroy_process_group()


def markdown_table(results: list[StepResult], nproc: int, device_name: str,
                   markdown: bool = True) -> str:
    """The table (``report.distributed_table``'s)."""
    from .report import distributed_table

    return distributed_table([asdict(r) for r in results], nproc, device_name, markdown)


def estimate_s(problems, dtypes, warmup: int, iters: int, device: str) -> float:
    """Seconds the section takes, roughly: starting the processes, then per configuration the
    model set-up and 2 x (warm-up + timed + host-time) steps of ours and the reference."""
    if device == "cpu":
        return 15.0 + 1.0 * len(problems) * len(dtypes) * 2
    per_step = {84: {"fp32-3xtf32": 0.010, "fp32-ieee": 0.010}, 39: {
        "fp32-3xtf32": 0.035, "fp32-ieee": 0.035, "fp32-tf32": 0.008}}
    total = 20.0
    for p in problems:
        for d in dtypes:
            step = per_step[p].get(d, 0.006 if p == 39 else 0.003)
            total += 2 * (2.0 + 2 * (warmup + iters + warmup + 4 * iters) * step)
    return total


def run(nproc: int, problems, dtypes, *, warmup: int = WARMUP, iters: int = ITERS,
        device: str = "cuda") -> dict:
    """Every configuration on ``nproc`` processes (one per GPU; gloo on the CPU); the results
    as bench.json's "distributed" holds them."""
    args = argparse.Namespace(nproc=nproc, problems=list(problems), dtypes=list(dtypes),
                              warmup=warmup, iters=iters, device=device)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, _free_port(), queue), nprocs=nproc,
                       start_method="spawn")
    name = "CPU (dry run)" if device == "cpu" else torch.cuda.get_device_name(0)
    return {"nproc": nproc, "device_name": name, "results": queue.get()}


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed",
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--nproc", type=int, default=2, help="processes = GPUs (default 2)")
    p.add_argument("--problems", type=int, nargs="+", choices=PROBLEMS, default=list(PROBLEMS))
    p.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES),
                   choices=[d for d, spec in DTYPES.items() if spec.autocast is None],
                   help="dtype columns as in python -m benchmarks, but for the autocast ones "
                        "(default: " + " ".join(DEFAULT_DTYPES) + ")")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run at tiny sizes that tests the plumbing")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    args = p.parse_args(argv)
    if args.nproc < 2:
        p.error("--nproc must be at least 2")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be at least 1 and --warmup at least 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        print(f"python -m benchmarks.distributed: needs {args.nproc} CUDA GPUs, found "
              f"{torch.cuda.device_count()} (--device cpu runs the dry run)", file=sys.stderr)
        return 2
    doc = run(args.nproc, args.problems, args.dtypes, warmup=args.warmup, iters=args.iters,
              device=args.device)
    results = [StepResult(**r) for r in doc["results"]]
    print(markdown_table(results, args.nproc, doc["device_name"], markdown=False))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_table(results, args.nproc, doc["device_name"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
