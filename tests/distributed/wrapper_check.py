"""2 ranks (torchrun): a model fused by ``epifuse.fuse`` and wrapped by DDP or FSDP2 (``fully_shard``)
runs the fused ops and gets the unfused model's outputs, running statistics and gradients.

    torchrun --nproc_per_node=2 tests/distributed/wrapper_check.py --wrapper ddp|fsdp2 [--device cpu]

On CPU (gloo) the fused path is let run on CPU tensors: the same ops, each computing its float64
reference (what the CPU suite exercises). Prints "wrapper_check OK <wrapper>" on rank 0 and exits
non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import epifuse
from epifuse import head


def projection_mlp() -> nn.Sequential:
    """A MoCo-v3-style projection head: Linear(bias=False) -> BN -> ReLU twice, last BN affine=False."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 128, bias=False), nn.BatchNorm1d(128), nn.ReLU(),
                         nn.Linear(128, 32, bias=False), nn.BatchNorm1d(32, affine=False))


def wrap(model: nn.Module, wrapper: str, device: torch.device) -> nn.Module:
    if wrapper == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                       else None)
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)  # one unit: a head must not be split across units
    return model


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2's sharded gradient
            g = g.full_tensor()
        grads[name.removeprefix("module.")] = g.detach().clone()
    return grads


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    y = model(x)
    (y * torch.linspace(-1, 1, y.shape[1], device=y.device)).square().sum().backward()
    return y.detach()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrapper", choices=("ddp", "fsdp2"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        head._device_reason = lambda x: None  # the fused ops on CPU: their float64 references
    unfused = projection_mlp().to(device)
    fused = copy.deepcopy(unfused)
    _, report = epifuse.fuse(fused, strict=True)  # strict: a fallback on CUDA raises
    assert len(report.fused) == 3, report
    unfused, fused = wrap(unfused, args.wrapper, device), wrap(fused, args.wrapper, device)
    torch.manual_seed(100 + rank)  # each rank its own batch
    x = torch.randn(32, 64, device=device)
    failures = []
    for it in range(2):
        y_ref = step(unfused, x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y_new = step(fused, x)
        names = {e.name() for e in prof.profiler.kineto_results.events()}
        if "epifuse::fused_head" not in names or "epifuse::head_grad_coefficients" not in names:
            failures.append(f"step {it}: the fused ops did not run ({sorted(names)[:20]})")
        if not torch.allclose(y_new, y_ref, rtol=1e-3, atol=1e-4):
            failures.append(f"step {it}: outputs differ by {(y_new - y_ref).abs().max().item():.3g}")
    g_ref, g_new = full_grads(unfused), full_grads(fused)
    for name, g in g_ref.items():
        if not torch.allclose(g_new[name], g, rtol=2e-3, atol=1e-4):
            failures.append(f"grad {name} differs by {(g_new[name] - g).abs().max().item():.3g}")
    stats_ref = dict(unfused.named_buffers())
    for name, b in fused.named_buffers():
        if not torch.allclose(b.float(), stats_ref[name].float(), rtol=1e-4, atol=1e-5):
            failures.append(f"buffer {name} differs")
    for f in failures:
        print(f"[rank {rank}] {args.wrapper}: {f}", flush=True)
    ok = torch.tensor([0 if failures else 1], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0 and ok.item():
        print(f"wrapper_check OK {args.wrapper}", flush=True)
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
