"""Kept operands (cpp/ops/weight_split_cache.h) across CUDA streams.

A weight's 3x split, or its 16-bit cast under autocast, is kept while the weight is unchanged
and made on whichever stream first needs it. A forward on another stream must wait for it to be
written, and a weight written in between must never be read through a stale copy. Each test delays
the stream that makes the kept operand (``torch.cuda._sleep``) and reads it at once from a second
stream that does not wait for the first: without the event the cache records, the second stream
would read memory the first has not written yet. The kernels launched prove the kept copy was read.
"""

from __future__ import annotations

import pytest
import torch

from epifuse import ops
from helpers import cuda_kernels_run, rel_err

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
SLEEP_CYCLES = 200_000_000  # ~0.1 s at Hopper clocks: far longer than the reads that follow


def _on(stream: torch.cuda.Stream, fn, *, late: bool = False):
    """fn() on `stream`; late: behind a long sleep (what fn makes there is written ~0.1 s later)."""
    with torch.cuda.stream(stream):
        if late:
            torch.cuda._sleep(SLEEP_CYCLES)
        return fn()


def _fresh_blocks():
    """Let the kept copy land in memory that held nothing useful (not a freed earlier copy)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _race(make_on, read_on, fn):
    """The kept operand made on `make_on` behind a sleep, read at once on `read_on` (no ordering
    between the two streams from the caller: only the cache's event can order them)."""
    _fresh_blocks()
    made = _on(make_on, fn, late=True)
    read = _on(read_on, fn)
    torch.cuda.synchronize()
    return made, read


def _streams():
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    return s1, s2


def test_weight_split_made_on_one_stream_is_waited_for_on_another():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the split 3x GEMM (and its kept weight split) is Hopper's")
    # 1024 x 2048 -> 1024: 2^31 multiply-adds, over the split's threshold (gemm_plan.cu).
    gen = torch.Generator(device=CUDA).manual_seed(0)
    x = torch.randn(1024, 2048, device=CUDA, generator=gen)
    w = torch.randn(1024, 2048, device=CUDA, generator=gen)
    a, c = torch.ones(1024, device=CUDA), torch.zeros(1024, device=CUDA)
    s1, s2 = _streams()

    def gemm():
        return ops.gemm_affine(x, w, a, c, "3xtf32")

    def splits(stream):  # split_fp16 launches of one call: x's, and w's unless it was kept
        return sum("split_fp16" in k for k in cuda_kernels_run(lambda: _on(stream, gemm)))

    assert splits(s1) == 2  # first sight of w: x and w split in place, w's version remembered
    y1, y2 = _race(s1, s2, gemm)  # second sight: w's split made on s1 and kept; read on s2
    expected = x.double() @ w.double().T
    assert rel_err(y1, expected) <= 1e-6
    assert rel_err(y2, expected) <= 1e-6
    assert splits(s2) == 1  # x only: w's split is the kept one

    # A weight update on s2 (an optimizer step), then the split kept again, made on s2, read on s1.
    with torch.cuda.stream(s2), torch.no_grad():
        w.mul_(-0.5)
    s1.wait_stream(s2)  # the caller orders the update, as for any tensor
    assert splits(s1) == 2  # a new version: split in place again
    _, y3 = _race(s2, s1, gemm)
    assert rel_err(y3, x.double() @ w.double().T) <= 1e-6
    assert splits(s1) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_cast_made_on_one_stream_is_waited_for_on_another(dtype):
    """Eval under autocast: the 16-bit weight is kept per version, like the split."""
    from epifuse.problems import gemm_scale_bn

    torch.manual_seed(0)
    model = gemm_scale_bn.ModelNew(1024, 1024, (1024,)).to(CUDA).eval()
    with torch.no_grad():  # running statistics that make the output depend on every column
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    x = torch.rand(512, 1024, device=CUDA)
    s1, s2 = _streams()

    def forward():
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            return model(x)

    def expected():  # the unfused modules under the same autocast
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
            return gemm_scale_bn.Model.forward(model, x).double()

    def launches(stream):
        return len(cuda_kernels_run(lambda: _on(stream, forward)))

    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    first = launches(s1)  # first sight: x and W cast in place
    y1, y2 = _race(s1, s2, forward)  # second sight: W's cast made on s1 and kept; read on s2
    assert torch.equal(y1, y2)
    assert rel_err(y2, expected()) <= tol
    assert launches(s2) == first - 1  # one cast fewer: W's is the kept one

    with torch.cuda.stream(s2), torch.no_grad():
        model.gemm.weight.mul_(-0.5)
    s1.wait_stream(s2)
    assert launches(s1) == first  # a new version: cast in place again
    _, y3 = _race(s2, s1, forward)
    assert rel_err(y3, expected()) <= tol
    assert launches(s1) == first - 1


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["3xtf32", "bf16"])
def test_inference_tensor_weights_are_never_kept(autocast):
    """A model made under torch.inference_mode has inference-tensor weights, without a version
    counter to key a kept operand on (reading it raised "Inference tensors do not track version
    counter"): its eval forward runs fused, making the weight's split or cast at every call."""
    if autocast is None and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the split 3x GEMM (and its kept weight split) is Hopper's")
    from epifuse import fast_path_reason
    from epifuse.problems import gemm_scale_bn

    torch.manual_seed(0)
    amp = torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    with torch.inference_mode():
        # 1024 x 2048 -> 1024: 2^31 multiply-adds, over the split's threshold (gemm_plan.cu).
        model = gemm_scale_bn.ModelNew(2048, 1024, (1024,)).to(CUDA).eval()
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
        x = torch.rand(1024, 2048, device=CUDA)
        assert model.gemm.weight.is_inference()
        assert fast_path_reason(model, x) is None

        def forward():
            with amp:
                return model(x)

        # A kept operand would be made at the second call and read from the third on, each of
        # those calls launching one kernel fewer (test_weight_split_made_on_...: split_fp16).
        launches = [len(cuda_kernels_run(forward)) for _ in range(4)]
        y = forward()
        if autocast is None:  # the head in float64
            m = model
            z = (x.double() @ m.gemm.weight.double().T + m.gemm.bias.double()) * m.scale.double()
            expected = ((z - m.bn.running_mean.double()) / (m.bn.running_var.double() + m.bn.eps)
                        .sqrt() * m.bn.weight.double() + m.bn.bias.double())
        else:  # the unfused modules under the same autocast
            with amp:
                expected = gemm_scale_bn.Model.forward(model, x)
    assert len(set(launches)) == 1, launches
    assert rel_err(y, expected) <= (1e-5 if autocast is None else 1e-2)


def test_training_steps_see_every_weight_and_input_update():
    """Default precision (3x GEMM) training as a loop runs it: between steps the weight is updated in
    place (an optimizer) and the input batch is copied into the same buffer (a static input, as for
    CUDA graphs or pinned loading). Every step's dX and dW must follow both. The backward's products
    read W^T and x^T, views made below autograd whose version counters no such write bumps: a kept
    split of them returned the first weight's dX and the first batch's dW from the third step on."""
    from helpers import FUSED_NODE, init_args, make_pair

    ref, new = make_pair(84, init_args(84, 2048, 1024))  # 512 x 2048 -> 1024: the split pays
    ref, new = ref.to(CUDA).train(), new.to(CUDA).train()
    g = torch.Generator(device=CUDA).manual_seed(21)
    x_ref = torch.rand(512, 2048, device=CUDA, generator=g)
    x_new = x_ref.clone()
    grad = torch.randn(512, 1024, device=CUDA, generator=g)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for step in range(5):
            grads = []
            for model, x in ((ref, x_ref), (new, x_new)):
                model.zero_grad(set_to_none=True)
                xr = x.requires_grad_()
                y = model(xr)
                if model is new:  # the fused head ran, its backward on split (3x) GEMMs
                    assert y.grad_fn.name() == FUSED_NODE
                    assert any("split_fp16" in k for k in cuda_kernels_run(lambda: y.backward(grad)))
                else:
                    y.backward(grad)
                grads.append((xr.grad.clone(), model.gemm.weight.grad.clone()))
                xr.grad = None
                x.requires_grad_(False)
            (dx_ref, dw_ref), (dx_new, dw_new) = grads
            assert rel_err(dx_new, dx_ref) <= 1e-4, (step, rel_err(dx_new, dx_ref))
            assert rel_err(dw_new, dw_ref) <= 1e-4, (step, rel_err(dw_new, dw_ref))
            with torch.no_grad():
                update = torch.randn(ref.gemm.weight.shape, device=CUDA, generator=g) * 0.05
                ref.gemm.weight.add_(update)
                new.gemm.weight.add_(update)
                batch = torch.rand(512, 2048, device=CUDA, generator=g)
                x_ref.copy_(batch)
                x_new.copy_(batch)
    finally:
        torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["3xtf32", "bf16"])
def test_a_steps_views_share_the_weight_operand(autocast):
    """Two views through one fused head in a training step (SSL heads call it once per view): the
    second forward reads the first's split (default precision) or 16-bit cast (autocast) of the
    weight instead of making its own, the backward releases it, and a weight written between the
    views (its version bumped) is split again. Outputs and gradients as eager's, every step."""
    import copy

    from torch import nn

    import epifuse
    from helpers import launches

    torch.manual_seed(0)
    # MoCo v3's first projector layer at 128 rows per view: a product that runs the 3x GEMM on
    # split operands (a smaller one runs cuBLAS's SGEMM, which splits nothing)
    ref = nn.Sequential(nn.Linear(2048, 4096, bias=False), nn.BatchNorm1d(4096), nn.ReLU())
    ref = ref.to(CUDA)
    new = copy.deepcopy(ref)
    _, report = epifuse.fuse(new, strict=True)
    assert len(report.fused) == 1
    kernel = "split_fp16" if autocast is None else "narrowing_cast"
    g = torch.Generator(device=CUDA).manual_seed(3)
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for step in range(3):
            x1, x2 = (torch.rand(128, 2048, device=CUDA, generator=g) for _ in range(2))
            grads = []
            for model in (ref, new):
                model.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=autocast or torch.bfloat16,
                                    enabled=autocast is not None):
                    count = {}
                    y1 = y2 = None

                    def first():
                        nonlocal y1
                        y1 = model(x1)
                    count["first"] = launches(first, kernel)

                    def second():
                        nonlocal y2
                        y2 = model(x2)
                    count["second"] = launches(second, kernel)
                    # the weight written in between: the third forward must not reuse
                    with torch.no_grad():
                        model[0].weight.mul_(1.0)
                    count["after_write"] = launches(lambda: model(x1), kernel)
                loss = (y1.float() * y2.float()).sum()
                loss.backward()
                grads.append((y1.detach().float(), y2.detach().float(),
                              model[0].weight.grad.clone()))
                if model is new:
                    # the first view makes the weight's operand and its input's (x's split or
                    # cast); the second view only its input's, the weight's read again; a
                    # written weight (a new version) is made again
                    assert count["first"] == 2, count
                    assert count["second"] == 1, count
                    assert count["after_write"] == 2, count
            (a1, a2, dw_ref), (b1, b2, dw_new) = grads
            tol = 1e-5 if autocast is None else 2e-2
            assert rel_err(b1, a1) <= tol and rel_err(b2, a2) <= tol, step
            assert rel_err(dw_new, dw_ref) <= (1e-4 if autocast is None else 2e-2), step
    finally:
        torch.set_float32_matmul_precision(saved)
