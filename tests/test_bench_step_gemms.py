"""benchmarks.step_gemms: which op call is a step's forward, dX and dW GEMM, and the page's table
(CPU: the fused path's ops run their references, so the profiler sees the same op calls)."""

from __future__ import annotations

import copy

import torch

import epifuse
from benchmarks import report, step_gemms
from benchmarks.real_heads import build_model


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
