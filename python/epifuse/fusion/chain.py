"""The head module ``epifuse.fuse`` swaps in: it borrows the model's own modules.

A ``FusedChain`` owns no parameters, buffers or submodules. It names where
the Linear, the BatchNorm and the scale live in the model (owner module +
attribute) and looks them up on every forward, so the model keeps its
state_dict keys, its optimizer's parameter objects, and sees later changes
made in place (``nn.SyncBatchNorm.convert_sync_batchnorm`` replacing the
BatchNorm, a reassigned or parametrized weight).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from ..nn import DEFAULT_NEGATIVE_SLOPE, HeadModule


class Slot(NamedTuple):
    """An attribute of a module: ``getattr(owner, name)``."""

    owner: nn.Module
    name: str

    def get(self):
        return getattr(self.owner, self.name)


def slot_of(root: nn.Module, target: str) -> Slot:
    """The Slot of a dotted attribute path (an fx node target) under ``root``."""
    owner_path, _, name = target.rpartition(".")
    return Slot(root.get_submodule(owner_path) if owner_path else root, name)


class FusedChain(HeadModule):
    """A fused ``Linear -> BatchNorm1d [-> scale] [-> activation] [-> softmax]`` over borrowed
    modules.

    Built by ``epifuse.fuse``; users who build heads themselves want
    ``epifuse.nn.FusedLinearBatchNorm``. ``where`` is the chain as the report
    prints it. The activation comes by name (``activation``, '' for none; see
    ``HeadModule``): an activation module holds no state to borrow.
    """

    def __init__(self, gemm: Slot, bn: Slot, scale: Optional[Slot], scale_position: str,
                 softmax_dim: Optional[int], precision: Optional[str], where: str,
                 activation: str = "", negative_slope: float = DEFAULT_NEGATIVE_SLOPE):
        super().__init__()
        # Plain attributes, not submodules: the model already owns these modules.
        self._gemm_slot, self._bn_slot, self._scale_slot = gemm, bn, scale
        self.has_scale = scale is not None
        self.where = where
        self._unit: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._configure(scale_position, softmax_dim, precision, activation, negative_slope)

    @property
    def gemm(self) -> nn.Module:
        return self._gemm_slot.get()

    @property
    def bn(self) -> nn.Module:
        return self._bn_slot.get()

    @property
    def scale(self) -> Tensor:
        if self._scale_slot is not None:
            return self._scale_slot.get()
        # No scale in the model: the head's math takes a ones(1) like the weight (exact).
        weight = self.gemm.weight
        key = (weight.dtype, weight.device)
        unit = self._unit.get(key)
        if unit is None:
            unit = self._unit[key] = torch.ones(1, dtype=weight.dtype, device=weight.device)
        return unit

    def extra_repr(self) -> str:
        return f"{self.where}: {super().extra_repr()}"
