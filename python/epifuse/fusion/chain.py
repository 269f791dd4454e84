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

from ..head import (_member, apply_activation, has_module_hooks, run_head,
                    softmax_module_changed, stand_in)
from ..nn import DEFAULT_NEGATIVE_SLOPE, HeadModule, activation_of_module, head_body_reference


class Slot(NamedTuple):
    """An attribute of a module: ``getattr(owner, name)``, read from ``registry`` (the owner's
    ``_modules``, ``_parameters`` or ``_buffers``, where the name was at fuse time) without
    nn.Module.__getattr__: a head reads its slots on every forward. A name no longer there (a
    parametrization's property, a parameter re-registered as a buffer) takes the normal lookup."""

    owner: nn.Module
    name: str
    registry: str = "_modules"

    def get(self):
        return _member(self.owner, self.registry, self.name)


_REGISTRIES = ("_modules", "_parameters", "_buffers")


def slot_of(root: nn.Module, target: str) -> Slot:
    """The Slot of a dotted attribute path (an fx node target) under ``root``."""
    owner_path, _, name = target.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    registry = next((r for r in _REGISTRIES if name in owner.__dict__[r]), "_modules")
    return Slot(owner, name, registry)


class TakenTail:
    """The activation and softmax a chain took in at fuse time (``_activation_slot``,
    ``_softmax_slot``: the model's modules, None for functions; ``activation``,
    ``negative_slope``, ``softmax_dim``): whether they changed since, and running them unfused.
    Shared by FusedChain and the plain Linear's FusedLinearChain."""

    def _modules_changed(self) -> bool:
        """Whether the activation or softmax module taken in at fuse time has changed since: a
        setting (LeakyReLU's slope, Softmax's dim), the module put in its place, or hooks of its
        own, which only its call runs. The chain then runs its modules, these included."""
        if self._activation_slot is not None:
            module = self._activation_slot.get()
            if (activation_of_module(module) != (self.activation, self.negative_slope)
                    or has_module_hooks(module)):
                return True
        return (self._softmax_slot is not None
                and softmax_module_changed(self._softmax_slot.get(), self.softmax_dim))

    def activation_and_softmax(self, y: Tensor) -> Tensor:
        """The unfused tail: the model's own activation and softmax modules where it has them."""
        if self._activation_slot is not None:
            y = self._activation_slot.get()(y)
        elif self.activation:
            y = apply_activation(y, self.activation, self.negative_slope)
        if self._softmax_slot is not None:
            return self._softmax_slot.get()(y)
        return y if self.softmax_dim is None else torch.softmax(y, self.softmax_dim)


class FusedChain(TakenTail, HeadModule):
    """A fused ``Linear -> BatchNorm1d [-> scale] [-> activation] [-> softmax]`` over borrowed
    modules.

    Built by ``epifuse.fuse``; users who build heads themselves want
    ``epifuse.nn.FusedLinearBatchNorm``. ``where`` is the chain as the report
    prints it. The activation comes by name (``activation``, '' for none; see
    ``HeadModule``): an activation module holds no state to borrow.
    """

    def __init__(self, gemm: Slot, bn: Slot, scale: Optional[Slot], scale_position: str,
                 softmax_dim: Optional[int], precision: Optional[str], where: str,
                 activation: str = "", negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
                 activation_module: Optional[Slot] = None, softmax_module: Optional[Slot] = None):
        super().__init__()
        # Plain attributes, not submodules: the model already owns these modules.
        self._gemm_slot, self._bn_slot, self._scale_slot = gemm, bn, scale
        # The activation and softmax modules the chain took in (None: functions, or none).
        self._activation_slot, self._softmax_slot = activation_module, softmax_module
        self.has_scale = scale is not None
        self.where = where
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
        # No scale in the model: a ones(1) stand-in like the weight, which the ops do not read
        # (the head's has_scale is False).
        return stand_in(1.0, 1, self.gemm.weight)

    def _head_members(self) -> tuple:
        """(gemm, bn, scale) from the slots; a scale of None: the model has none (a stand-in)."""
        scale = None if self._scale_slot is None else self._scale_slot.get()
        return self._gemm_slot.get(), self._bn_slot.get(), scale

    def forward(self, x: Tensor) -> Tensor:
        if self._modules_changed():
            # The head up to the scale as always (fused, or synchronized), then the model's own
            # activation and softmax modules as they are now.
            body = self._spec._replace(activation="", softmax=False)
            return self.activation_and_softmax(run_head(self, x, body, head_body_reference))
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{self.where}: {super().extra_repr()}"
