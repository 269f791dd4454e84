"""Models with Linear -> BatchNorm heads for the epifuse.fuse tests (CPU and GPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import epifuse

IN, HID, OUT = 12, 10, 8


def sequential() -> nn.Module:
    """Two chains, one nested; the first ends in an nn.ReLU, the second in nn.Softmax(dim=1)."""
    return nn.Sequential(nn.Linear(IN, HID), nn.BatchNorm1d(HID), nn.ReLU(),
                         nn.Sequential(nn.Linear(HID, OUT), nn.BatchNorm1d(OUT),
                                       nn.Softmax(dim=1)))


class Custom(nn.Module):
    """Attribute names of its own; scales before and after the BatchNorm; torch.relu after the
    first, torch.softmax(-1) after the second."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(IN, HID)
        self.gain = nn.Parameter(torch.rand(HID) + 0.5)
        self.norm = nn.BatchNorm1d(HID)
        self.out = nn.Linear(HID, OUT)
        self.out_norm = nn.BatchNorm1d(OUT)
        self.temperature = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        h = torch.relu(self.norm(self.proj(x) * self.gain))
        return torch.softmax(self.temperature * self.out_norm(self.out(h)), dim=-1)


class NearMisses(nn.Module):
    """Near misses and edge cases: a Linear feeding two consumers (left, with the reason), an
    affine-free BatchNorm (fused: weight 1, bias 0), a softmax over the batch (the chain fused, the
    softmax left with a note)."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(IN, OUT)
        self.shared_bn = nn.BatchNorm1d(OUT)
        self.plain = nn.Linear(IN, OUT)
        self.plain_bn = nn.BatchNorm1d(OUT, affine=False)
        self.cols = nn.Linear(IN, OUT)
        self.cols_bn = nn.BatchNorm1d(OUT)

    def forward(self, x):
        s = self.shared(x)
        a = self.shared_bn(s) + s  # the Linear's output feeds two consumers
        b = self.plain_bn(self.plain(x))  # BatchNorm without affine: fuses
        c = torch.softmax(self.cols_bn(self.cols(x)), dim=0)  # softmax over the batch
        return a + b + c


class Untraceable(nn.Module):
    """Data-dependent control flow around a traceable Sequential."""

    def __init__(self):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT))

    def forward(self, x):
        if x.sum() > 0:
            return self.head(x)
        return -self.head(x)


@torch.no_grad()
def randomize_bn_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-default BatchNorm parameters and running statistics, whichever a BatchNorm has (a
    swapped term shows)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if not isinstance(m, nn.BatchNorm1d):
            continue
        if m.affine:
            m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.bias.copy_(torch.rand(m.num_features, generator=g) - 0.5)
        if m.track_running_stats:
            m.running_mean.copy_(torch.rand(m.num_features, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def fused_pair(build, plain_linear: bool = False):
    """(original, fused, report): a model from ``build()`` with randomized BatchNorms, a copy of
    it, and the model after epifuse.fuse (in place). These models test the BatchNorm chains:
    their plain Linears are fused only where ``plain_linear`` asks (tests/test_plain_linear.py)."""
    torch.manual_seed(0)
    model = randomize_bn_(build())
    original = copy.deepcopy(model)
    fused, report = epifuse.fuse(model, plain_linear=plain_linear)
    assert fused is model
    return original, model, report


def fused_graph(model: nn.Module):
    """The fx graph of a fused model's forward (a partial of its GraphModule's forward)."""
    return model.forward.func.__self__.graph
