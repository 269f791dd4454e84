"""Model-level large-mean statistics on every GEMM path (GPU with the epifuse kernels).

tests/test_head.py::test_large_mean_statistics covers IEEE fp32 only,
i.e. the cuBLAS + separate statistics pass; the TF32, bf16 and fp16 GEMMs
compute the column statistics in their epilogues (EVT, fp64 sums of the fp32
accumulator). Here each path's running variance, when the columns' mean
dwarfs their spread, is bounded by eager PyTorch's error at the same
precision (both against a float64 oracle).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from epifuse import head
from helpers import float64_twin, init_args, make_pair, rel_err

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
# kind -> (ModelNew precision, model dtype, torch's fp32 matmul precision for both models)
KINDS = {
    "default-highest": (None, torch.float32, "highest"),  # precision=None follows torch: IEEE
    "default-high": (None, torch.float32, "high"),  # ... and TF32
    "tf32": ("tf32", torch.float32, "high"),
    "bf16": (None, torch.bfloat16, "highest"),
    "fp16": (None, torch.float16, "highest"),
}


@contextlib.contextmanager
def _matmul_precision(value: str):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.parametrize("shift", ["x+100", "bias1e4"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_large_mean_statistics_every_gemm_path(number, kind, shift):
    precision, dtype, torch_precision = KINDS[kind]
    ref, new = make_pair(number, init_args(number, 512, 256, momentum=1.0), precision=precision)
    ref.to(CUDA, dtype).train(), new.to(CUDA, dtype).train()
    x = torch.rand(1000, 512, device=CUDA)
    if shift == "x+100":
        x = x + 100
    else:
        with torch.no_grad():
            new.gemm.bias.fill_(1e4), ref.gemm.bias.fill_(1e4)
    x = x.to(dtype)
    oracle = float64_twin(ref).train()
    with torch.no_grad(), _matmul_precision(torch_precision):
        assert head.fast_path_reason(new, x) is None
        y_new, y_ref, y64 = new(x), ref(x), oracle(x.double())
    # momentum 1: the running statistics are the batch's (running_var unbiased).
    errs = {name: (rel_err(m.bn.running_var, oracle.bn.running_var),
                   rel_err(m.bn.running_mean, oracle.bn.running_mean), rel_err(y, y64))
            for name, m, y in (("ModelNew", new, y_new), ("eager", ref, y_ref))}
    print(f"p{number} {kind} {shift}: (var, mean, output) rel err " +
          ", ".join(f"{k} {v[0]:.2e} {v[1]:.2e} {v[2]:.2e}" for k, v in errs.items()))
    for i, what in enumerate(("running_var", "running_mean", "output")):
        ours, eager = errs["ModelNew"][i], errs["eager"][i]
        # Twice eager's error, or the IEEE test's bound where eager is itself (near) exact.
        bound = max(2 * eager, 1e-3 if what == "running_var" else 1e-5)
        assert ours <= bound, f"{what}: ModelNew {ours:.2e} > {bound:.2e} (eager {eager:.2e})"
