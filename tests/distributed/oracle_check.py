"""Synced ModelNew on each rank against one-process BatchNorm over the concatenated batch.

    torchrun --standalone --nproc_per_node=2 tests/distributed/oracle_check.py [--device cpu|cuda]

Every rank draws all ranks' inputs from the same seed, so each can compute the
float64 oracle by itself: one nn.BatchNorm over the concatenation of the ranks'
batches, with a copy of every parameter per rank block, so that the gradient
of block r's copy is what nn.SyncBatchNorm gives rank r (local parameter
gradients, input gradients of the global loss). Checks outputs, input and
parameter gradients, running statistics and num_batches_tracked over 3 steps
with unequal, one-row and empty per-rank batches, on both paths:

  reference  float64 input: the pure-PyTorch synced BatchNorm
  fused      float32 input: gemm_colstats -> merge -> fold (on CPU through the
             ops' CPU kernels, with head's device check bypassed as in the
             ``fused_on_cpu`` test fixture; on a supported GPU the CUDA kernels)

Exit status 0 when every rank passed; failures are printed tagged with the rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),  # tests/ (helpers)
                str(Path(__file__).resolve().parents[2] / "python")]

import epifuse  # noqa: E402
from epifuse import head  # noqa: E402
from checks import BUFFERS, PARAMS, Failures, vanishing_grads  # noqa: E402
from helpers import init_args, make_pair  # noqa: E402

IN, OUT, STEPS = 24, 16, 3
# (problem, scale_shape, per-rank batch sizes, momentum)
CASES = [
    (84, (1,), (7, 12), 0.1),
    (39, (OUT,), (7, 12), 0.1),
    (84, (OUT,), (1, 9), None),  # rank 0 has one row: reference path beside a fused rank
    (39, (1,), (0, 10), 0.1),  # rank 0 is empty: it still joins every collective
]
TOL = {"reference": 1e-10, "fused": 2e-5}


def oracle_step(number, params, buffers, xs, ws, eps, momentum):
    """Float64 outputs, gradients (per rank block) and updated buffers of one training step."""
    leaves = [{k: v.clone().requires_grad_() for k, v in params.items()} for _ in xs]
    xs = [x.detach().clone().requires_grad_() for x in xs]
    us = []
    for x, p in zip(xs, leaves):
        u = F.linear(x, p["gemm.weight"], p["gemm.bias"])
        us.append(u * p["scale"] if number == 39 else u)
    nbt = buffers["bn.num_batches_tracked"]
    factor = momentum if momentum is not None else 1.0 / float(nbt + 1)
    xhat = F.batch_norm(torch.cat(us), buffers["bn.running_mean"], buffers["bn.running_var"],
                        None, None, True, factor, eps)  # updates the running stats in place
    buffers["bn.num_batches_tracked"] = nbt + 1
    outs, loss = [], 0.0
    for block, p, w in zip(xhat.split([x.shape[0] for x in xs]), leaves, ws):
        y = block * p["bn.weight"] + p["bn.bias"]
        if number == 84:
            y = torch.softmax(p["scale"] * y, dim=1)
        outs.append(y)
        loss = loss + (y * w).sum()
    loss.backward()
    grads = [{"x": x.grad, **{k: v.grad for k, v in p.items()}} for x, p in zip(xs, leaves)]
    return [y.detach() for y in outs], grads


def check_case(number, scale, sizes, momentum, path, device, rank, failures):
    dtype = torch.float64 if path == "reference" else torch.float32
    tag = f"p{number} scale{scale} sizes{sizes} mom{momentum} {path}"
    ref, new = make_pair(number, init_args(number, IN, OUT, scale, momentum=momentum), seed=3)
    epifuse.convert_sync_batchnorm(new)
    new.to(device=device, dtype=dtype).train()
    state = {k: v.detach().double().clone() for k, v in ref.state_dict().items()}
    params = {k: state[k] for k in PARAMS}
    buffers = {k: state[k] for k in (*BUFFERS, "bn.num_batches_tracked")}
    gen = torch.Generator().manual_seed(11)

    def expect(what, actual, expected, floor=0.0):
        failures.expect(tag, what, actual, expected, TOL[path], floor)

    for step in range(STEPS):
        xs = [torch.rand(m, IN, generator=gen) for m in sizes]
        ws = [torch.randn(m, OUT, generator=gen).double() for m in sizes]
        x = xs[rank].to(device=device, dtype=dtype).requires_grad_()
        fused = head.fast_path_reason(new, x) is None
        # The fused kernels must run where they can (on CPU: forced, see main).
        if path == "fused" and x.shape[0] > 1 and not fused and head._device_reason(x) is None:
            failures.append(f"{tag}: fused path not taken: {head.fast_path_reason(new, x)}")
        new.zero_grad(set_to_none=True)
        y = new(x)
        (y.double() * ws[rank].to(device)).sum().backward()
        outs, grads = oracle_step(number, params, buffers, [t.double() for t in xs], ws,
                                  new.bn.eps, momentum)
        expect(f"step {step} output", y, outs[rank])
        expect(f"step {step} grad x", x.grad, grads[rank]["x"])
        named = dict(new.named_parameters())
        floor = grads[rank]["gemm.weight"].norm().item()
        for name in PARAMS:
            expect(f"step {step} grad {name}", named[name].grad, grads[rank][name],
                   floor if name in vanishing_grads(number) else 0.0)
        for name in BUFFERS:
            expect(f"step {step} {name}", new.get_buffer(name), buffers[name])
        nbt = int(new.bn.num_batches_tracked)
        if nbt != buffers["bn.num_batches_tracked"]:
            failures.append(f"{tag}: num_batches_tracked {nbt} != "
                            f"{buffers['bn.num_batches_tracked']}")

    # Eval: the running statistics, no synchronization (only this rank's batch).
    new.eval()
    x = xs[rank].to(device=device, dtype=dtype)
    with torch.no_grad():
        expected = head.reference_head(x.double().cpu(), *params.values(),
                                       buffers["bn.running_mean"], buffers["bn.running_var"],
                                       new_spec(number), False, new.bn.eps)
        expect("eval output", new(x), expected)


def new_spec(number):
    return head.HeadSpec(scale_before_bn=number == 39, softmax=number == 84)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        head._device_reason = lambda x: None  # the fused path on CPU, via the ops' CPU kernels
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=120),
                            device_id=device if device.type == "cuda" else None)
    rank = dist.get_rank()
    failures = Failures()
    for case in CASES:
        for path in ("reference", "fused"):
            try:
                check_case(*case, path, device, rank, failures)
            except Exception:
                # A peer may now wait in a collective: abort the job rather than desynchronize.
                print(f"[rank {rank}] ERROR in case {case} {path}:\n{traceback.format_exc()}",
                      flush=True)
                os._exit(1)
    for line in failures:
        print(f"[rank {rank}] FAIL {line}", flush=True)
    status = torch.tensor([len(failures)], device=device)
    dist.all_reduce(status)
    if rank == 0:
        print(f"[oracle_check] {'PASS' if status.item() == 0 else 'FAIL'}: "
              f"{len(CASES) * 2} cases x {STEPS} steps on {dist.get_world_size()} ranks, "
              f"{int(status.item())} failure(s)", flush=True)
    dist.destroy_process_group()
    return 0 if status.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
