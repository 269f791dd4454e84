"""benchmarks.step_gemms: which op call is a step's forward, dX and dW GEMM, and the page's table
(CPU: the fused path's ops run their references, so the profiler sees the same op calls)."""

from __future__ import annotations

import copy

import pytest
import torch

import epifuse
from benchmarks import report, step_gemms
from benchmarks.real_heads import DIMS, build_model


def _gemm_calls(model, x):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        (model(x) * 1.5).sum().backward()
    return [(kind, [list(s) for s in e.input_shapes[:2]])
            for kind, e in step_gemms._kinds(step_gemms.gemm_events(prof))]


def test_kinds_of_a_fused_models_gemm_calls(fused_on_cpu):
    torch.manual_seed(0)
    model = epifuse.fuse(copy.deepcopy(build_model("classifier", (32, 64, 16))), strict=True)[0]
    x = torch.randn(8, 32, requires_grad=True)
    calls = _gemm_calls(model, x)
    # Forwards of both heads, then the backward from the last head: each head's dX then dW.
    assert calls == [("forward", [[8, 32], [64, 32]]), ("forward", [[8, 64], [16, 64]]),
                     ("dx", [[8, 16], [16, 64]]), ("dw", [[16, 8], [8, 64]]),
                     ("dx", [[8, 64], [64, 32]]), ("dw", [[64, 8], [8, 32]])]
    # Without x's gradient the first head's backward runs dW alone.
    calls = _gemm_calls(model, x.detach())
    assert [k for k, _ in calls] == ["forward", "forward", "dx", "dw", "dw"]
    assert step_gemms._product_flops([8, 32], [64, 32]) == 2.0 * 8 * 32 * 64  # x by weight^T
    assert step_gemms._product_flops([64, 8], [8, 32]) == 2.0 * 64 * 8 * 32


def test_measure_is_for_cuda_only():
    assert step_gemms.measure(lambda pair: None, None, torch.device("cpu")) is None


def test_the_pages_table_of_step_gemms():
    g = {"forward": {"ms": 0.7, "tflops": 200.0}, "dx": {"ms": 1.0, "tflops": 140.0},
         "dw": {"ms": 0.8, "tflops": 175.0}}
    row = {"problem": 84, "M": 1024, "K": 8192, "N": 8192, "dtype": "fp32-3xtf32",
           "step_gemms": g}
    head = {"model": "projection", "batch": 4096, "dtype": "fp32-3xtf32", "step_gemms": g}
    headers, cells, _ = report._step_gemms_table(
        [row, dict(row, step_gemms=None), dict(row, dtype="amp-bf16")], [head])
    assert len(cells) == 2 and headers[6] == "of forward's"  # default precision only
    assert cells[0] == ["problem 84 1024x8192->8192", "fp32-3xtf32", "0.7000", "200", "1.000",
                        "140", "70%", "0.8000", "175", "88%"]
    assert cells[1][0] == "projection batch 4096"


def test_steps_alike_takes_each_heads_own_count():
    # Two heads a step, each launching its own number of kernels, alike in every step.
    step_gemms.check_steps_alike({"forward": [5, 3, 5, 3, 5, 3], "dx": [], "dw": [4, 4, 4]}, 3)


def test_steps_alike_refuses_kernels_from_outside_the_steps():
    # The bug it guards: a warm-up step's kernels attributed to the first profiled forward.
    with pytest.raises(RuntimeError, match="forward GEMM calls' kernel counts differ"):
        step_gemms.check_steps_alike({"forward": [10, 5, 5]}, 3)
    with pytest.raises(RuntimeError, match="4 dw GEMM calls in 3 steps"):
        step_gemms.check_steps_alike({"dw": [2, 2, 2, 2]}, 3)


@pytest.mark.hopper
def test_measure_times_each_gemm_of_a_fused_step():
    # A fused two-head classifier's default-precision step on the GPU (3x GEMMs with their
    # splits): each kind measured, no kernels from outside the profiled steps (measure raises
    # where a profiled op's kernel count differs by step).
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = epifuse.fuse(build_model("classifier", DIMS["classifier"]).to(device), strict=True)[0]
    x = torch.randn(1024, DIMS["classifier"][0], device=device, requires_grad=True)
    g = torch.randn(1024, DIMS["classifier"][2], device=device)

    def step(_):
        x.grad = None
        for p in model.parameters():
            p.grad = None
            torch.autograd.graph.increment_version(p)
        model(x).backward(g)

    gemms = step_gemms.measure(step, None, device)
    assert gemms is not None and set(gemms) == set(step_gemms.KINDS)
    assert all(v["ms"] > 0 and v["tflops"] > 0 for v in gemms.values())
