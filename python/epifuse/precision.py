"""fp32 GEMM precision policy.

The ops take a precision string. The names are defined once, by the op library
(``torch.ops.epifuse.precision_names()``, cpp/ops/op_args.cpp); this module binds
them to the constants below and maps the user-facing spellings onto them:

* ``"3xtf32"``: fp32 accuracy on the tensor cores. Each fp32 operand is split
  into hi + lo parts of 11 significant bits and three products are summed
  (lo*hi + hi*lo + hi*hi). On Hopper the parts are FP16, each operand row
  scaled by a power of two into FP16's range and the product scaled back
  exactly (cpp/kernels/split_fp16.cu), and the tensor-core sums are promoted
  into fp32 registers every K-tile, which keeps the error below cuBLAS's SGEMM
  (measured on an H200 at problem 84's shape: 8.7e-7 against SGEMM's 5.0e-6,
  max error over max result against float64); elsewhere (sm80) they are TF32
  parts, which gave the mode its name. Batches too small to gain from it run
  SGEMM (the kernel dispatcher decides, cpp/kernels/gemm_plan.cu). This is
  what PyTorch's default ``'highest'`` maps to.
* ``"ieee"``: exact IEEE fp32 products: cuBLAS's FFMA SGEMM, whatever the
  global TF32 flag says.
* ``"tf32"``: one TF32 tensor-core pass (~1e-3 relative error), what
  ``'high'``/``'medium'`` give ``nn.Linear``.
* ``""``: 16-bit inputs, where it has no meaning.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import torch

# The op library's names (the library is loaded before this module is imported), in its order.
IEEE, TF32X3, TF32 = NAMES = tuple(torch.ops.epifuse.precision_names())

# Accepted spellings: ours, and torch.set_float32_matmul_precision's. The one table:
# ModelNew (validate_precision) and both command lines (epifuse.cli) read it.
ALIASES: Mapping[str, str] = MappingProxyType({
    IEEE: IEEE,
    "highest": TF32X3,  # torch's name for fp32 accuracy: what None runs under it
    TF32X3: TF32X3,
    TF32: TF32,
    "high": TF32,
    "medium": TF32,
})


def validate_precision(precision: Optional[str]) -> Optional[str]:
    """Canonical form of a user-given precision (None stays None: follow torch)."""
    if precision is None:
        return None
    canonical = ALIASES.get(precision) if isinstance(precision, str) else None
    if canonical is None:
        raise ValueError(
            f"epifuse: unknown precision {precision!r}; expected one of "
            f"{sorted(ALIASES)} or None (follow torch.get_float32_matmul_precision())")
    return canonical


@torch.compiler.assume_constant_result
def _torch_matmul_precision() -> str:
    # Dynamo cannot trace this string-returning call; under torch.compile the
    # policy is read once, when the graph is compiled.
    return torch.get_float32_matmul_precision()


def resolve_precision(precision: Optional[str], dtype: torch.dtype) -> str:
    """The precision string to pass to the ops for inputs of ``dtype``.

    None follows ``torch.get_float32_matmul_precision()`` at call time:
    ``'highest'`` (PyTorch's default: fp32 accuracy) runs the 3x GEMM, whose error
    is below the SGEMM that ``nn.Linear`` runs there; ``'high'``/``'medium'``
    run TF32, as they do for ``nn.Linear``.
    """
    canonical = validate_precision(precision)
    if dtype != torch.float32:
        return ""
    if canonical is None:
        return TF32X3 if _torch_matmul_precision() == "highest" else TF32
    return canonical
