"""ModelNew on Hopper: fused path against Model and a float64 oracle.

Marked `hopper` (skipped with a reason without an sm_90 GPU and CUDA kernels).
Errors are Frobenius relative errors vs the float64 oracle, bounded per
dtype/precision (helpers.ORACLE_TOL) and printed (pytest -s) for the record.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from epifuse import head
from helpers import (DTYPE_OF, FUSED_NODE, ORACLE_TOL, PROBLEMS, assert_head_grads_close,
                     float64_twin, init_args, make_pair, precision_of, rel_err)

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
PRECISIONS = list(ORACLE_TOL)  # ieee, 3xtf32, tf32, fp16, bf16


def _pair(number, args, kind, seed=0):
    ref, new = make_pair(number, args, seed=seed, precision=precision_of(kind))
    dtype = DTYPE_OF[kind]
    return ref.to(CUDA, dtype), new.to(CUDA, dtype)


def _check(number, kind, ref, new, x, training, label=""):
    """One forward of each; asserts the fused path ran and the error bound held."""
    ref.train(training), new.train(training)
    oracle = float64_twin(ref)
    assert head.fast_path_reason(new, x) is None
    with torch.no_grad():
        y_new, y_ref, y64 = new(x), ref(x), oracle(x.double())
    err_new, err_ref = rel_err(y_new, y64), rel_err(y_ref, y64)
    print(f"p{number} {kind} {'train' if training else 'eval'} {tuple(x.shape)}->{y_new.shape[1]}"
          f" {label}: ModelNew err {err_new:.2e}, Model err {err_ref:.2e}")
    assert y_new.dtype == x.dtype and y_new.shape == y_ref.shape
    assert err_new <= ORACLE_TOL[kind], f"error {err_new:.2e} > {ORACLE_TOL[kind]:.0e}"
    return oracle


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", PRECISIONS)
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_kernelbench_size(number, kind, mode):
    module = PROBLEMS[number]
    ref, new = _pair(number, module.get_init_inputs(), kind)
    x = module.get_inputs()[0].to(CUDA, DTYPE_OF[kind])
    oracle = _check(number, kind, ref, new, x, mode == "train", "kernelbench")
    if mode == "train":
        tol = ORACLE_TOL[kind]
        assert rel_err(new.bn.running_mean, oracle.bn.running_mean) <= tol
        assert rel_err(new.bn.running_var, oracle.bn.running_var) <= tol
        assert new.bn.num_batches_tracked.item() == 1


def _sweep():
    base = {"M": 33, "N": 65, "K": 47}
    for axis in ("M", "N", "K"):
        for v in (1, 3, 17, 1000, 4097):
            yield {**base, axis: v}


SWEEP = [pytest.param(s, id=f"M{s['M']}-N{s['N']}-K{s['K']}") for s in _sweep()]


@pytest.mark.parametrize("kind", ["ieee", "bf16"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
@pytest.mark.parametrize("shape", SWEEP)
def test_odd_shapes(shape, number, mode, kind):
    m, n, k = shape["M"], shape["N"], shape["K"]
    ref, new = _pair(number, init_args(number, k, n), kind)
    x = torch.rand(m, k, device=CUDA).to(DTYPE_OF[kind])
    if mode == "train" and m == 1:
        new.train()
        assert head.fast_path_reason(new, x) is not None
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            new(x)
        return
    _check(number, kind, ref, new, x, mode == "train")


@pytest.mark.parametrize("kind", PRECISIONS)
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_running_stats_after_three_steps(number, kind):
    ref, new = _pair(number, init_args(number, 256, 192), kind)
    oracle = float64_twin(ref).train()
    new.train()
    g = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            x = torch.rand(129, 256, device=CUDA, generator=g).to(DTYPE_OF[kind])
            assert head.fast_path_reason(new, x) is None
            new(x), oracle(x.double())
    tol = ORACLE_TOL[kind]
    assert rel_err(new.bn.running_mean, oracle.bn.running_mean) <= tol
    assert rel_err(new.bn.running_var, oracle.bn.running_var) <= tol
    assert new.bn.num_batches_tracked.item() == 3


@pytest.mark.parametrize("shift", ["x+100", "bias1e4"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_large_mean_statistics(number, shift):
    """Batch variance of columns whose mean dwarfs their spread (momentum 1: running = batch)."""
    ref, new = _pair(number, init_args(number, 512, 256, momentum=1.0), "ieee")
    x = torch.rand(1000, 512, device=CUDA)
    if shift == "x+100":
        x = x + 100
    else:
        with torch.no_grad():
            new.gemm.bias.fill_(1e4)
            ref.gemm.bias.fill_(1e4)
    oracle = float64_twin(ref).train()
    with torch.no_grad():
        assert head.fast_path_reason(new.train(), x) is None
        new(x), oracle(x.double())
    err = rel_err(new.bn.running_var, oracle.bn.running_var)
    print(f"p{number} {shift}: running_var rel err {err:.2e}")
    assert err <= 1e-3
    assert rel_err(new.bn.running_mean, oracle.bn.running_mean) <= 1e-5


def _poison_allocator():
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    junk = torch.full((min(free // 8, 2 << 30) // 4,), float("nan"), device=CUDA)
    del junk  # back to the cache, still NaN-filled


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_outputs_fully_written(number, mode):
    ref, new = _pair(number, init_args(number, 1000, 4097), "bf16")
    x = torch.rand(1001, 1000, device=CUDA).bfloat16()
    _poison_allocator()
    _check(number, "bf16", ref, new, x, mode == "train", "nan-poisoned")


@pytest.mark.parametrize("layout", ["column-major", "strided"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_non_contiguous_input(number, layout):
    ref, new = _pair(number, init_args(number, 96, 80), "ieee")
    base = torch.rand(64, 192, device=CUDA)
    x = base[:, ::2] if layout == "strided" else base[:, :96].t().contiguous().t()
    assert not x.is_contiguous()
    twin = float64_twin(ref)  # one twin, so its running statistics follow new's through both modes
    for training in (True, False):
        twin.train(training), new.train(training)
        with torch.no_grad():
            assert rel_err(new(x), twin(x.double())) <= ORACLE_TOL["ieee"]


@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_empty_batch_behaves_like_model(number):
    ref, new = _pair(number, init_args(number, 32, 16), "ieee")
    x = torch.rand(0, 32, device=CUDA)
    assert head.fast_path_reason(new, x) == "empty batch"
    for training in (False, True):
        ref.train(training), new.train(training)
        try:
            expected = ref(x)
        except Exception as e:  # noqa: BLE001 - whatever PyTorch raises, ModelNew must too
            with pytest.raises(type(e)):
                new(x)
            continue
        assert new(x).shape == expected.shape


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_gradients_on_gpu(number, mode):
    ref, new = _pair(number, init_args(number, 256, 128), "ieee")
    ref.train(mode == "train"), new.train(mode == "train")
    x = torch.rand(100, 256, device=CUDA, requires_grad=True)
    y_ref, y_new = ref(x), new(x)
    assert y_new.grad_fn.name() == FUSED_NODE
    w = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *ref.parameters()])
    g_new = torch.autograd.grad((y_new * w).sum(), [x, *new.parameters()])
    assert_head_grads_close(number, mode == "train", new, g_new, g_ref, 1e-4)


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_torch_compile_fullgraph(number, mode):
    torch._dynamo.reset()
    ref, new = _pair(number, init_args(number, 256, 128), "ieee")
    ref.train(mode == "train"), new.train(mode == "train")
    compiled = torch.compile(new, fullgraph=True)
    x = torch.rand(64, 256, device=CUDA)
    with torch.no_grad():
        for _ in range(2):
            y_new, y_ref = compiled(x), ref(x)
            assert rel_err(y_new, y_ref) <= 1e-4
    assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item()
    assert rel_err(new.bn.running_var, ref.bn.running_var) <= 1e-4


def test_main_on_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "epifuse", "--small", "--dtype", "all",
                          "--iters", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "path=fused" in out.stdout and "ALL OK" in out.stdout
