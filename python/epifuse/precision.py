"""fp32 GEMM precision policy: which tensor-core mode a float32 GEMM may use.

The ops take a precision string: ``"ieee"`` (true fp32 math: cuBLAS SGEMM or
a SIMT GEMM), ``"3xtf32"`` (fp32 inputs split into TF32 big + small parts and
multiplied in three tensor-core passes: near-fp32 accuracy at tensor-core
speed), ``"tf32"`` (one TF32 pass), or ``""`` for 16-bit inputs, where it has
no meaning.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import torch

IEEE = "ieee"
TF32X3 = "3xtf32"
TF32 = "tf32"

# Accepted spellings: ours, and torch.set_float32_matmul_precision's. The one table:
# ModelNew (validate_precision) and both command lines (epifuse.cli) read it.
ALIASES: Mapping[str, str] = MappingProxyType({
    "ieee": IEEE,
    "highest": IEEE,
    "3xtf32": TF32X3,
    "tf32": TF32,
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

    None follows ``torch.get_float32_matmul_precision()`` at call time, so
    ``torch.set_float32_matmul_precision("high")`` switches fp32 models to
    TF32 the same way it switches nn.Linear.
    """
    canonical = validate_precision(precision)
    if dtype != torch.float32:
        return ""
    if canonical is None:
        return IEEE if _torch_matmul_precision() == "highest" else TF32
    return canonical
