"""The plain-Linear module ``epifuse.fuse`` swaps in: ``Linear [-> activation] [-> softmax]`` over
the model's own modules (no BatchNorm after the Linear).

Like ``FusedChain`` it owns no parameters, buffers or submodules: it names where the Linear (and
an activation or softmax module it took in) lives in the model and looks it up on every forward,
so state_dict keys, optimizers, weight tying and parametrizations (``weight_norm``) are the
model's own. The forward is ``linear.run_linear``.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from ..head_config import DEFAULT
from ..linear import run_linear
from ..nn import DEFAULT_NEGATIVE_SLOPE, NotScriptable, describe_activation
from ..precision import validate_precision
from .chain import Slot, TakenTail


class FusedLinearChain(TakenTail, NotScriptable, nn.Module):
    """A fused plain ``Linear [-> activation] [-> softmax(dim=1|-1)]`` over borrowed modules.

    Built by ``epifuse.fuse``. ``where`` is the chain as the report prints it; ``strict``: where
    the fused path does not cover a CUDA input, raise instead of running the modules with a
    warning (at 16 bits and in TF32 the layer runs PyTorch's GEMM by design: linear.PYTORCH_GEMM).
    """

    strict: bool = False

    def __init__(self, gemm: Slot, softmax_dim: Optional[int], precision: Optional[str],
                 where: str, activation: str = "",
                 negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
                 activation_module: Optional[Slot] = None, softmax_module: Optional[Slot] = None):
        super().__init__()
        self._gemm_slot = gemm
        self._activation_slot, self._softmax_slot = activation_module, softmax_module
        self.where = where
        self.precision = validate_precision(precision)
        self.softmax_dim = softmax_dim
        self.activation = activation
        self.negative_slope = negative_slope
        # The op's settings that differ from its defaults (the precision is its default, 3x,
        # wherever the layer runs fused), built once: a keyword costs host time at every call.
        settings = {"softmax": softmax_dim is not None, "activation": activation,
                    "negative_slope": negative_slope}
        self.op_kwargs = {k: v for k, v in settings.items() if v != getattr(DEFAULT, k)}
        self.op_kwargs_no_backward = dict(self.op_kwargs, for_backward=False)

    @property
    def gemm(self) -> nn.Module:
        return self._gemm_slot.get()

    def forward(self, x: Tensor) -> Tensor:
        if self._modules_changed():
            return self.run_modules(x)
        return run_linear(self, x)

    def run_modules(self, x: Tensor) -> Tensor:
        """The unfused layer: the model's Linear, then its own activation and softmax modules
        where it has them (their math where they were functions)."""
        return self.activation_and_softmax(self.gemm(x))

    def extra_repr(self) -> str:
        softmax = "none" if self.softmax_dim is None else f"dim={self.softmax_dim}"
        return (f"{self.where}: activation={describe_activation(self.activation, self.negative_slope)}, "
                f"softmax={softmax}, precision={self.precision}")
