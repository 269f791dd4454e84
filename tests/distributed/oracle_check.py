"""Synced ModelNew on each rank against one-process BatchNorm over the concatenated batch.

    torchrun --standalone --nproc_per_node=2 tests/distributed/oracle_check.py [--device cpu|cuda]

Every rank draws all ranks' inputs from the same seed, so each can compute the
float64 oracle by itself: one BatchNorm over the concatenation of the ranks'
batches, with a copy of every parameter per rank block, so that the gradient
of block r's copy is what nn.SyncBatchNorm gives rank r (local parameter
gradients, input gradients from the sums over all ranks). The normalization's
backward is written out as nn.SyncBatchNorm's (sums of dy over all rows, then
each rank's own weight), which is the gradient of the summed loss only while
the ranks' parameters agree; two cases give each rank different parameters.
Checks outputs, input and parameter gradients, running statistics and
num_batches_tracked over 3 steps with unequal, one-row and empty per-rank
batches, on both paths:

  reference  float64 input: the pure-PyTorch synced BatchNorm
  fused      float32 input: gemm_colstats -> merge -> fold (on CPU through the
             ops' CPU kernels, with head's device check bypassed as in the
             ``fused_on_cpu`` test fixture; on a supported GPU the CUDA kernels)
  hooked     float32 input, with hooks on the Linear and the BatchNorm and (problem 84) the
             softmax module changed to an equal one: the synchronized path that calls the
             modules (their hooks run once per step), then the softmax module

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
# (problem, scale_shape, per-rank batch sizes, momentum, distinct per-rank parameters)
CASES = [
    (84, (1,), (7, 12), 0.1, False),
    (39, (OUT,), (7, 12), 0.1, False),
    (84, (OUT,), (1, 9), None, False),  # rank 0 has one row: reference path beside a fused rank
    (39, (1,), (0, 10), 0.1, False),  # rank 0 is empty: it still joins every collective
    # Ranks whose parameters differ (training without DDP): nn.SyncBatchNorm scales the
    # all-reduced sums of dy by each rank's own weight, which is not the gradient of the
    # summed loss; the oracle follows nn.SyncBatchNorm.
    (84, (1,), (7, 12), 0.1, True),
    (39, (OUT,), (9, 5), 0.1, True),
]
TOL = {"reference": 1e-10, "fused": 2e-5, "hooked": 2e-5}


def rank_params(base, rank, distinct):
    """Rank ``rank``'s parameters: ``base``, or (distinct) a rank-dependent variation of it."""
    if not distinct:
        return dict(base)
    f = 1.0 + 0.25 * rank
    varied = {"gemm.weight": base["gemm.weight"] * (1.0 + 0.05 * rank),
              "bn.weight": base["bn.weight"] * f, "bn.bias": base["bn.bias"] + 0.1 * rank,
              "scale": base["scale"] * (2.0 - f / 2)}
    # Rounded to float32, as the model holding them is built in it.
    return {**base, **{k: v.float().double() for k, v in varied.items()}}


class _SyncBatchNormAffine(torch.autograd.Function):
    """``gamma_rows * (u - mean) * invstd`` over the concatenated batch; backward as
    nn.SyncBatchNorm's: the input gradient from the sums of dy over every rank's rows, scaled by
    each row's own (its rank's) gamma."""

    @staticmethod
    def forward(ctx, u, gamma_rows, eps):
        mean, var = u.mean(0), u.var(0, unbiased=False)
        invstd = torch.rsqrt(var + eps)
        xhat = (u - mean) * invstd
        ctx.save_for_backward(xhat, invstd, gamma_rows)
        return xhat * gamma_rows

    @staticmethod
    def backward(ctx, dy):
        xhat, invstd, gamma_rows = ctx.saved_tensors
        grad_u = gamma_rows * invstd * (dy - dy.mean(0) - xhat * (dy * xhat).mean(0))
        return grad_u, dy * xhat, None


def oracle_step(number, params, buffers, xs, ws, eps, momentum):
    """Float64 outputs, gradients (per rank block) and updated buffers of one training step.

    ``params``: one parameter dict per rank.
    """
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
    xs = [x.detach().clone().requires_grad_() for x in xs]
    us = []
    for x, p in zip(xs, leaves):
        u = F.linear(x, p["gemm.weight"], p["gemm.bias"])
        us.append(u * p["scale"] if number == 39 else u)
    nbt = buffers["bn.num_batches_tracked"]
    factor = momentum if momentum is not None else 1.0 / float(nbt + 1)
    u = torch.cat(us)
    F.batch_norm(u.detach(), buffers["bn.running_mean"], buffers["bn.running_var"], None, None,
                 True, factor, eps)  # updates the running stats in place
    buffers["bn.num_batches_tracked"] = nbt + 1
    gamma_rows = torch.cat([p["bn.weight"].expand(x.shape[0], -1) for x, p in zip(xs, leaves)])
    scaled = _SyncBatchNormAffine.apply(u, gamma_rows, eps)
    outs, loss = [], 0.0
    for block, p, w in zip(scaled.split([x.shape[0] for x in xs]), leaves, ws):
        y = block + p["bn.bias"]
        if number == 84:
            y = torch.softmax(p["scale"] * y, dim=1)
        outs.append(y)
        loss = loss + (y * w).sum()
    loss.backward()
    grads = [{"x": x.grad, **{k: v.grad for k, v in p.items()}} for x, p in zip(xs, leaves)]
    return [y.detach() for y in outs], grads


def check_case(number, scale, sizes, momentum, distinct, path, device, rank, failures):
    dtype = torch.float64 if path == "reference" else torch.float32
    tag = (f"p{number} scale{scale} sizes{sizes} mom{momentum}"
           f"{' distinct-params' if distinct else ''} {path}")
    ref, new = make_pair(number, init_args(number, IN, OUT, scale, momentum=momentum), seed=3)
    state = {k: v.detach().double().clone() for k, v in ref.state_dict().items()}
    base = {k: state[k] for k in PARAMS}
    all_params = [rank_params(base, r, distinct) for r in range(len(sizes))]
    params = all_params[rank]
    with torch.no_grad():
        for name, value in params.items():
            new.get_parameter(name).copy_(value)
    epifuse.convert_sync_batchnorm(new)
    new.to(device=device, dtype=dtype).train()
    calls = []
    if path == "hooked":
        new.gemm.register_forward_pre_hook(lambda *args: calls.append("gemm"))
        new.bn.register_forward_hook(lambda *args: calls.append("bn"))
        if number == 84:
            new.softmax = torch.nn.Softmax(dim=-1)  # not Model's module: it runs after the head
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
        outs, grads = oracle_step(number, all_params, buffers, [t.double() for t in xs], ws,
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
        if path == "hooked" and calls != ["gemm", "bn"] * (step + 1):
            failures.append(f"{tag}: step {step}: the hooks ran {calls}")
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
                                       new_spec(number)._replace(training=False, eps=new.bn.eps))
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
        for path in ("reference", "fused", "hooked"):
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
              f"{len(CASES) * 3} cases x {STEPS} steps on {dist.get_world_size()} ranks, "
              f"{int(status.item())} failure(s)", flush=True)
    dist.destroy_process_group()
    return 0 if status.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
