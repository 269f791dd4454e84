"""Train a MoCo-v3-style projection MLP whose Linear -> BatchNorm1d heads epifuse fuses.

    python examples/train_projection.py                          # one process
    torchrun --nproc_per_node=2 examples/train_projection.py     # DDP, one process per GPU
    python examples/train_projection.py --steps 5 --batch 64 --in-dim 64 --hidden 128 --out-dim 32

The MLP is MoCo v3's projector: (Linear(bias=False) -> BatchNorm1d -> ReLU) x 2, then
Linear(bias=False) -> BatchNorm1d(affine=False). ``epifuse.fuse`` turns each Linear -> BatchNorm1d
[-> ReLU] into one fused head, in place (same parameters, same state_dict). On a GPU a step runs
under bf16 autocast with a GradScaler; under torchrun the model is wrapped in DDP (NCCL) with
synchronized batch statistics, as MoCo v3 trains its projector. Without a GPU (or with --cpu) the
same script runs on the CPU: gloo for DDP, no autocast, and the fused heads run their original
modules (epifuse's kernels are CUDA only).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import epifuse


def projection_mlp(in_dim, hidden, out_dim):
    return nn.Sequential(
        nn.Linear(in_dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
        nn.Linear(hidden, out_dim, bias=False), nn.BatchNorm1d(out_dim, affine=False))


def contrastive_loss(q, k, tau=0.2):
    """InfoNCE between two views' projections: row i of q should match row i of k."""
    q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
    logits = q @ k.T / tau
    return F.cross_entropy(logits, torch.arange(len(q), device=q.device)) * 2 * tau


def fast_path_heads(model, x):
    """How many fused heads run epifuse's kernels on a batch like x, and why the others do not."""
    heads = getattr(model, epifuse.fusion.HEADS_ATTR, ())
    reasons = [epifuse.fast_path_reason(h, x.new_empty(len(x), h.gemm.in_features)) for h in heads]
    return sum(r is None for r in reasons), sorted({r for r in reasons if r is not None})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=256, help="rows per process and step")
    p.add_argument("--in-dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--out-dim", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is")
    args = p.parse_args()

    cuda = torch.cuda.is_available() and not args.cpu
    distributed = "LOCAL_RANK" in os.environ  # launched by torchrun
    rank = 0
    if distributed:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = projection_mlp(args.in_dim, args.hidden, args.out_dim)
    model, report = epifuse.fuse(model)  # in place: same parameters, state_dict and class
    if distributed:
        epifuse.convert_sync_batchnorm(model)  # batch statistics over all ranks' rows
    model.to(device)
    net = DDP(model, device_ids=[device.index] if cuda else None) if distributed else model
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-6)
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)  # needed for fp16, harmless for bf16

    gen = torch.Generator(device).manual_seed(1 + rank)  # each rank its own data
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.in_dim, device=device, generator=gen)
        view1 = x + 0.5 * torch.randn(x.shape, device=device, generator=gen)
        view2 = x + 0.5 * torch.randn(x.shape, device=device, generator=gen)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            q1, q2 = net(view1), net(view2)
        loss = contrastive_loss(q1, q2) + contrastive_loss(q2, q1)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if rank == 0:
            print(f"step {step}/{args.steps} loss {loss.item():.4f}", flush=True)

    if rank == 0:
        print(report)  # the chains fused, and any left with the reason
        on_kernels, why_not = fast_path_heads(model, x)
        print(f"fused heads: {len(report.fused)}, on epifuse's kernels: {on_kernels}"
              + (f" ({'; '.join(why_not)})" if why_not else ""))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
