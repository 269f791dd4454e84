"""``epifuse.ops``: the ``torch.ops.epifuse`` ops, and what the loaded library was built for.

``epifuse.ops.gemm_affine(x, weight, a, c, "3xtf32", activation="relu")`` is
``torch.ops.epifuse.gemm_affine.default(...)``: the op itself, with the schema's own argument
names and defaults. The schemas, argument checks and CUDA kernels are C++ (``cpp/ops/``); the CPU
references and fake kernels are in ``epifuse/_ops/``. ``docs/design.md`` lists the ops by family.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops  # noqa: F401  (registers the CPU references and the fake kernels)

_ops_namespace = torch.ops.epifuse


def _tensor_op_names() -> tuple[str, ...]:
    """The library's ops that take tensors ("epifuse::name"), in registration order: every op but
    the build-information ones."""
    names = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("epifuse::") and any(
                "Tensor" in str(arg.type) for arg in schema.arguments):
            names.append(schema.name)
    return tuple(dict.fromkeys(names))


OP_NAMES = _tensor_op_names()


_OP_NAME_SET = frozenset(OP_NAMES)


def __getattr__(name: str):
    """``epifuse.ops.<name>``: the op's default overload, e.g. ``epifuse.ops.affine_``; looked up
    once, then a module attribute (a call site on a hot path pays no lookup)."""
    if f"epifuse::{name}" in _OP_NAME_SET:
        op = getattr(_ops_namespace, name).default
        globals()[name] = op
        return op
    raise AttributeError(f"module 'epifuse.ops' has no attribute '{name}'")


def has_cuda_kernels() -> bool:
    """Whether the loaded library has a CUDA kernel for every op."""
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA") for name in OP_NAMES)


def built_archs() -> list[str]:
    """GPU architectures the kernels were compiled for (CMake's EPIFUSE_ARCHS), e.g. ['80', '90a']."""
    return [a for a in _ops_namespace.built_archs().split(",") if a]


def device_unsupported_reason(index: int) -> Optional[str]:
    """Why CUDA device ``index`` cannot run the epifuse kernels (None: it can)."""
    if not has_cuda_kernels():
        return "epifuse library built without CUDA kernels"
    major, minor = torch.cuda.get_device_capability(index)
    if not _ops_namespace.supports_device(major, minor):
        built = ", ".join(f"sm_{a}" for a in built_archs())
        return (f"GPU is sm_{major}{minor}; this epifuse build has kernels for {built} only "
                f"(rebuild with -DEPIFUSE_ARCHS={major}{minor})")
    return None
