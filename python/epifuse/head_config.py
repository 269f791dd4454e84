"""``HeadConfig``: a head's settings, as the head ops take them (keyword-only, with defaults).

The ops take their tensors positionally and their settings as keywords, e.g.
``fused_head(x, weight, bias, gamma, beta, scale, running_mean, running_var, num_batches_tracked,
**config.kwargs())``;
the per-pass ops take the few they use (``bn_fold_train(..., momentum=..., eps=...)``).

The settings' one table on the C++ side is ``cpp/ops/head_config.h`` (``EPIFUSE_HEAD_CONFIG``): it
generates the schemas' keyword sections, the C++ ``HeadConfig`` and the autograd's save/restore.
This tuple has the same fields, in the same order and with the same defaults (tests/test_ops.py
checks them against the schemas). Adding a setting: a row there, a field here.

A NamedTuple rather than a dataclass: one is built per forward, and constructing it costs a
fraction of a frozen dataclass's (host time counts for small batches).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class HeadConfig(NamedTuple):
    """A head's settings. The defaults are the schemas' (PyTorch's BatchNorm1d defaults)."""

    # The GEMMs' math for float32 inputs: 'ieee' (SGEMM), '3xtf32' (three products of split
    # operands, fp32 accuracy: FP16 parts on Hopper, TF32 on sm80; what PyTorch's 'highest' maps
    # to) or 'tf32'; 16-bit inputs ignore it ('' or any of these).
    # The backward's dX / dW run in the same mode. epifuse.precision resolves user spellings.
    precision: str = "3xtf32"
    # BatchNorm normalizes with the batch's statistics (True) or the running ones (False).
    training: bool = True
    # Where the model's scale sits: before BatchNorm (problem 39: bn(z * scale)) or after it
    # (problem 84: scale * bn(z)).
    scale_before_bn: bool = False
    # A row softmax ends the head (problem 84).
    softmax: bool = False
    # The activation after the per-column affine (and a scale after BatchNorm), before the
    # softmax: '' (none), 'relu', 'leaky_relu', 'gelu', 'gelu_tanh' (GELU approximate='tanh') or
    # 'silu' (fold.ACTIVATIONS).
    activation: str = ""
    # LeakyReLU's slope for negative inputs (its default); the other activations ignore it.
    negative_slope: float = 0.01
    # BatchNorm's momentum for the running-statistics update (None: cumulative average), which
    # fused_head makes in training when given num_batches_tracked.
    momentum: Optional[float] = 0.1
    # BatchNorm's eps.
    eps: float = 1e-5
    # Non-empty: training statistics over the ranks of this process group (its group_name);
    # '': this process's batch only.
    group_name: str = ""
    # The head owns a scale (False: the ``scale`` tensor is a stand-in, e.g. a ones(1), that the
    # ops do not read: the fold multiplies by nothing and the backward computes no scale gradient,
    # returning zeros where one is asked for). Under autocast a real fp32 scale also promotes the
    # output's dtype, as it does in eager.
    has_scale: bool = True
    # The dtype the GEMMs run in (x and W are cast to it inside the op; statistics, fold and passes
    # stay fp32). None: x's dtype. Under torch.autocast the op's AutocastCUDA kernel sets it.
    gemm_dtype: Optional[torch.dtype] = None
    # The output's dtype; None: the GEMM's. Under autocast: what the unfused modules return.
    out_dtype: Optional[torch.dtype] = None
    # The dtype fused_head_backward returns dX in; None: z's (the GEMM's). float32 from a 16-bit
    # z: the dX GEMM writes it itself (fp16 with fp16's overflow), no 16-bit dX and no cast pass.
    # The autograd sets x's dtype (an fp32 x under autocast).
    grad_x_dtype: Optional[torch.dtype] = None
    # The output may be differentiated: fused_head returns z and the statistics for a backward.
    # False (no_grad, inference): nothing is kept (an eval head runs its layer as one GEMM with
    # the fold and the activation in the epilogue; a training head's last pass overwrites z), and
    # fused_head returns the output alone, the rest empty.
    for_backward: bool = True

    def kwargs(self) -> dict[str, Any]:
        """The settings that differ from the schemas' defaults, by name: the keyword arguments of
        fused_head / fused_head_backward, which fill in the rest. Leaving the defaults out halves
        the op call's host time: the call from Python converts every keyword it is given
        (measured on an H200, a projection head's fused_head under bf16 autocast: 162 us with all
        14 settings, 82 us with the 2 that differ; three such heads a step)."""
        return {name: value for name, value, default in zip(self._fields, self, DEFAULT)
                if value != default}


DEFAULT = HeadConfig()
