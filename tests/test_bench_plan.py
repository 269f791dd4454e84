"""What the benchmark measures (epifuse.bench.configs.build_plan), CPU only."""

from __future__ import annotations

import pytest

from epifuse.bench.configs import (DTYPES, HEAD_SOFTMAX_SHAPE, MODES, SOFTMAX_BYTES,
                                   SOFTMAX_TORCH_DTYPES, build_plan)


def _plan(**overrides):
    kwargs = dict(compile=True, sweep=False, sweep_ms=(), sweep_compile=False, softmax=True,
                  dry=False)
    kwargs.update(overrides)
    return build_plan([84, 39], list(DTYPES), list(MODES), **kwargs)


def test_gemm_alone_on_both_kernelbench_shapes():
    plan = _plan()
    alone = {(c.shape.problem, c.shape.tag) for c in plan.cases if c.gemm_alone}
    assert alone == {(84, "kernelbench"), (39, "kernelbench")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_softmax_at_the_head_shape_and_over_row_lengths(dtype):
    points = [p for p in _plan().softmax_points if p.dtype == dtype]
    m, n = HEAD_SOFTMAX_SHAPE
    assert [(p.m, p.n) for p in points].count((m, n)) == 1, "problem 84's own softmax shape"
    esize = SOFTMAX_TORCH_DTYPES[dtype].itemsize
    sweep = [p for p in points if (p.m, p.n) != (m, n)]
    assert [p.n for p in sweep] == [2 ** i for i in range(6, 17)]
    assert all(p.m * p.n * esize == SOFTMAX_BYTES for p in sweep)


def test_no_softmax_points_without_softmax():
    assert _plan(softmax=False).softmax_points == []


def test_dry_plan_is_tiny():
    plan = _plan(dry=True)
    assert all(p.m * p.n <= 1 << 20 for p in plan.softmax_points)
