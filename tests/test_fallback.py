"""Where the fused kernels do not run, and the CPU path of every op.

* A fused head that runs its unfused modules on a CUDA input (a module hook, a float64 input, ...)
  says so once per head and reason with a warning on the ``"epifuse"`` logger; a strict head
  (``epifuse.fuse(model, strict=True)``, or ``head.strict = True``) raises a RuntimeError naming
  the reason instead. CPU inputs fall back silently (the fused kernels are CUDA's). Marked `gpu`:
  the CUDA cases (whatever the reason is on that machine, e.g. a GPU the library has no kernels
  for, the head says it).
* Every per-pass op ``epifuse::X`` has a twin ``epifuse_reference::X`` of the same schema: its
  float64 reference, which the C++ op calls for CPU tensors once its checks passed (the head ops
  and the synchronized hooks are composites of the others, with no twin). ``epifuse.ops.X`` is
  the op itself.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import epifuse
from epifuse import head, ops
from fuse_models import IN, OUT, fused_pair, sequential
from helpers import init_args, make_pair, rel_err, traced_epifuse_ops

CUDA = torch.device("cuda")
COMPOSITES = {"fused_head", "fused_head_backward", "fused_linear", "synced_batch_fold",
              "synced_grad_sums"}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "epifuse" and r.levelno == logging.WARNING]


# --------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_cpu_inputs_fall_back_silently(strict, caplog):
    """On CPU the unfused modules run with nothing logged and nothing raised, strict or not."""
    original, model, _ = fused_pair(sequential)
    for h in model._epifuse_heads:
        h.strict = strict
    _, p84 = make_pair(84, init_args(84, IN, OUT))
    p84.strict = strict
    caplog.set_level(logging.DEBUG, logger="epifuse")
    x = torch.rand(8, IN)
    with traced_epifuse_ops() as ran:
        for _ in range(2):
            assert rel_err(model(x), original(x)) < 1e-6
            p84(x)
            p84.double()(x.double())
            p84.float()
    assert ran == []  # the reference path
    assert _warnings(caplog) == [] and caplog.records == []


def test_fuse_strict_sets_strict_on_every_head():
    _, model, report = fused_pair(sequential)
    assert len(report.fused) == 2
    assert [h.strict for h in model._epifuse_heads] == [False, False]
    torch.manual_seed(0)
    strict_model, report = epifuse.fuse(sequential(), strict=True)
    heads = strict_model._epifuse_heads
    assert len(heads) == len(report.fused) == 2 and all(h.strict is True for h in heads)
    # per head, too
    heads[0].strict = False
    assert [h.strict for h in heads] == [False, True]


# --------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
def test_cuda_fallback_warns_once_per_head_and_reason(caplog):
    """A forward hook on the first head's Linear, then (the hook removed) a float64 model and
    input: each head says each reason it runs its modules for once, however many forwards. (On
    a GPU this library has no kernels for, that reason comes first: every head says it once.)"""
    _, model, _ = fused_pair(sequential)
    model.to(CUDA)
    first, second = model._epifuse_heads
    caplog.set_level(logging.WARNING, logger="epifuse")
    x = torch.rand(16, IN, device=CUDA)
    device_reason = head._device_reason(x)
    handle = first.gemm.register_forward_hook(lambda *args: None)
    hooked = head.fast_path_reason(first, x)
    assert hooked is not None and (device_reason or "hooks") in hooked
    for _ in range(3):
        model(x)
    logged = _warnings(caplog)
    if device_reason is None:  # the second head ran fused
        assert len(logged) == 1, logged
    else:
        assert len(logged) == 2 and second.where in logged[1], logged
    assert re.search(rf"head {re.escape(first.where)} runs its unfused modules: "
                     rf"{re.escape(hooked)}", logged[0]), logged
    handle.remove()
    caplog.clear()
    model.double()
    x64 = x.double()
    for _ in range(2):
        model(x64)
    logged = _warnings(caplog)
    if device_reason is None:  # a reason new to both heads
        reason = head.fast_path_reason(first, x64)
        assert "dtype" in reason
        assert len(logged) == 2 and all(reason in m for m in logged), logged
        assert first.where in logged[0] and second.where in logged[1], logged
    else:  # the same reason as before: said already
        assert logged == []
    caplog.clear()
    model(x64)
    assert _warnings(caplog) == []  # every head and reason said once already


@pytest.mark.gpu
def test_cuda_fallback_of_modelnew_warns_once(caplog):
    _, new = make_pair(39, init_args(39, IN, OUT))
    new.to(CUDA, torch.float64)
    x = torch.rand(8, IN, device=CUDA, dtype=torch.float64)
    reason = head.fast_path_reason(new, x)
    caplog.set_level(logging.WARNING, logger="epifuse")
    with torch.no_grad():
        new(x), new(x)
    logged = _warnings(caplog)
    assert len(logged) == 1 and reason in logged[0] and "ModelNew head" in logged[0], logged


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["fuse", "attribute"])
def test_strict_heads_raise_naming_the_reason(how, caplog):
    if how == "fuse":
        torch.manual_seed(0)
        model, _ = epifuse.fuse(sequential().to(CUDA), strict=True)
        module = model._epifuse_heads[0]
    else:
        _, model = make_pair(84, init_args(84, IN, OUT))
        model.to(CUDA)
        model.strict = True
        module = model
    caplog.set_level(logging.WARNING, logger="epifuse")
    x = torch.rand(16, IN, device=CUDA, dtype=torch.float64)
    reason = head.fast_path_reason(module, x)
    with pytest.raises(RuntimeError, match=rf"cannot run fused: {re.escape(reason)}.*strict"):
        model(x)
    assert _warnings(caplog) == []  # raised, not logged


# --------------------------------------------------------------------------- the ops' CPU path

def _op_names() -> list[str]:
    return [n.split("::", 1)[1] for n in ops.OP_NAMES]


def test_op_names_are_the_tensor_ops():
    names = _op_names()
    assert len(names) == len(set(names))
    assert {"gemm_affine", "bn_fold_train", "affine_softmax_", "head_grad_z", "pack_moments",
            "fused_head", "fused_head_backward", "synced_batch_fold"} <= set(names)
    # the build-information ops take no tensors
    assert not {"built_archs", "supports_device", "precision_names"} & set(names)


@pytest.mark.parametrize("name", _op_names())
def test_epifuse_ops_attribute_is_the_op(name):
    assert getattr(epifuse.ops, name) is getattr(torch.ops.epifuse, name).default


def test_epifuse_ops_has_no_other_op():
    for name in ("nope", "precision_names", "fold_train"):  # (a build-information op, no tensors)
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(epifuse.ops, name)


def _reference_names() -> set[str]:
    return {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
            if s.name.startswith("epifuse_reference::")}


@pytest.mark.parametrize("name", sorted(set(_op_names()) - COMPOSITES))
def test_every_pass_has_a_reference_twin_with_its_schema(name):
    """The twin's schema is the op's but for the namespace (one schema string defines both), and
    its only kernel is the float64 reference for CPU tensors."""
    schema = str(getattr(torch.ops.epifuse, name).default._schema)
    twin = str(getattr(torch.ops.epifuse_reference, name).default._schema)
    assert schema.startswith(f"epifuse::{name}(")
    assert twin == schema.replace("epifuse::", "epifuse_reference::", 1)
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_kernel(f"epifuse_reference::{name}", "CPU")
    assert not has_kernel(f"epifuse_reference::{name}", "CUDA")
    assert has_kernel(f"epifuse::{name}", "CPU")


def test_the_composites_have_no_twin():
    assert _reference_names() == set(_op_names()) - COMPOSITES


def _kernel_registrations(qualified_name: str) -> dict[str, str]:
    """{dispatch key: where its kernel was registered} (the dispatcher's own table)."""
    lines = torch._C._dispatch_dump(qualified_name).splitlines()
    return dict(line.split(": registered at ", 1) for line in lines
                if ": registered at " in line and not line.startswith("debug"))


@pytest.mark.parametrize("name", _op_names())
def test_every_op_is_one_cpp_kernel_for_cpu_and_cuda(name):
    """The checks exist once: every op's CPU and CUDA kernel is its C++ function (cpp/ops/), the
    synchronized hooks' too (no Python kernel for CPU tensors); only the twins' are Python."""
    kernels = _kernel_registrations(f"epifuse::{name}")
    for key in ("CPU", "CUDA") if ops.has_cuda_kernels() else ("CPU",):
        assert "cpp/ops/" in kernels.get(key, ""), (key, kernels)
    if name not in COMPOSITES:
        twin = _kernel_registrations(f"epifuse_reference::{name}")
        assert set(twin) == {"CPU"} and "torch/library.py" in twin["CPU"], twin
