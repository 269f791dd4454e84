"""Bad input: ModelNew fails (or propagates NaN/Inf) exactly like the reference Model.

* Input errors (rank, feature count, dtype, integer input, training batch of 1, devices):
  ModelNew must raise the same exception type as Model, both messages must name the
  problem, and the module state afterwards must equal Model's (PyTorch's BatchNorm bumps
  num_batches_tracked before it rejects a batch of 1: so must ModelNew).
  The CPU tests run each case twice: as shipped (CPU input -> reference path) and with the
  device check bypassed (``fused_on_cpu``), where a missing fast-path guard would send the
  bad input into the ops' CPU kernels and fail differently (or not at all).
* NaN / +-Inf in the input reach the same output positions (and running statistics) as in
  the reference: CPU through the fused_on_cpu op sequence, GPU through the CUDA kernels.
  In training one NaN row poisons every column's batch statistics, as in PyTorch: we
  compare masks, not values.
* The ops themselves on bad arguments. GPU: PyTorch-style exceptions, no crash, no hang,
  and the CUDA context still works afterwards. CPU: the ops' CPU kernels refuse what the
  CUDA ops refuse, with the same exception and message (cases and patterns follow the GPU
  op tests, i.e. cpp/ops/ops.cpp's checks); a CPU kernel that accepted an int or float64
  argument would let code pass CI that fails on the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

from epifuse import head, ops
import op_samples
from helpers import ORACLE_TOL, assert_row_op_rejects_bad_arguments, init_args, make_pair, rel_err

CUDA = torch.device("cuda")
IN, OUT = 24, 16
NUMBERS = [pytest.param(84, id="p84"), pytest.param(39, id="p39")]


# --------------------------------------------------------------------------- shared checks

def _state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def assert_raises_like_model(ref, new, x, key: str):
    """Model(x) raises; ModelNew(x) raises the same type; both messages match ``key``."""
    before = _state(new)
    assert all(torch.equal(before[k], v) for k, v in _state(ref).items()), "models differ"
    with pytest.raises(Exception) as ref_info:  # the type is what we learn here
        ref(x)
    with pytest.raises(Exception) as new_info:
        new(x)
    e_ref, e_new = ref_info.value, new_info.value
    assert type(e_new) is type(e_ref), (
        f"ModelNew raised {type(e_new).__name__}: {e_new}\n"
        f"Model raised {type(e_ref).__name__}: {e_ref}")
    for who, e in (("Model", e_ref), ("ModelNew", e_new)):
        assert re.search(key, str(e), re.IGNORECASE), f"{who}'s message lacks /{key}/: {e}"
    after_ref, after_new = _state(ref), _state(new)
    for k, v in after_ref.items():
        assert torch.equal(after_new[k], v), f"{k} after the error: {after_new[k]} vs Model's {v}"
    return e_ref, e_new


def _bad_inputs(device, k=IN):
    """(id, input, exception type Model raises, key fact) for input-only errors."""
    return [
        ("1d", torch.rand(k, device=device), ValueError, r"2D or 3D.*1D"),
        ("3d", torch.rand(2, 3, k, device=device), RuntimeError, r"running_mean.*3"),
        ("features", torch.rand(5, k + 1, device=device), RuntimeError,
         rf"shapes cannot be multiplied.*5x{k + 1}"),
        ("int64", torch.randint(0, 5, (5, k), device=device), RuntimeError, r"dtype.*Long"),
        ("int32", torch.randint(0, 5, (5, k), device=device, dtype=torch.int32), RuntimeError,
         r"dtype.*Int"),
        ("bool", torch.rand(5, k, device=device) > 0.5, RuntimeError, r"dtype.*Bool"),
    ]


BAD_IDS = [case[0] for case in _bad_inputs("cpu")]


def _run_bad_input(number, case_id, training, device):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    ref.to(device).train(training), new.to(device).train(training)
    _, x, exc, key = next(c for c in _bad_inputs(device) if c[0] == case_id)
    e_ref, _ = assert_raises_like_model(ref, new, x, key)
    assert isinstance(e_ref, exc)  # the expectation itself is pinned, so a change shows


def _run_dtype_mismatch(number, model_dtype, x_dtype, training, device):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    ref.to(device, model_dtype).train(training), new.to(device, model_dtype).train(training)
    x = torch.rand(6, IN, device=device, dtype=x_dtype)
    assert head.fast_path_reason(new, x) is not None
    e_ref, _ = assert_raises_like_model(ref, new, x, r"same dtype|dtype")
    assert isinstance(e_ref, RuntimeError)


def _run_batch_of_one(number, device, dtype=torch.float32):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    ref.to(device, dtype).train(), new.to(device, dtype).train()
    x = torch.rand(1, IN, device=device, dtype=dtype)
    e_ref, _ = assert_raises_like_model(ref, new, x, r"more than 1 value per channel")
    assert isinstance(e_ref, ValueError)
    # Eval accepts a batch of 1, and so must ModelNew (same values).
    ref.eval(), new.eval()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        assert rel_err(new(x), ref(x)) <= tol


# --------------------------------------------------------------------------- CPU: ModelNew

@pytest.fixture(params=["reference", "fused_on_cpu"])
def route(request):
    """Run a CPU test as shipped, and again with head.py's device check bypassed."""
    if request.param == "fused_on_cpu":
        request.getfixturevalue("fused_on_cpu")
    return request.param


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case_id", BAD_IDS)
@pytest.mark.parametrize("number", NUMBERS)
def test_bad_input_cpu(number, case_id, mode, route):
    _run_bad_input(number, case_id, mode == "train", "cpu")


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("model_dtype,x_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.float64, torch.float32)],
    ids=["bf16model-fp32x", "fp32model-bf16x", "fp16model-bf16x", "fp64model-fp32x"])
@pytest.mark.parametrize("number", NUMBERS)
def test_dtype_mismatch_cpu(number, model_dtype, x_dtype, mode, route):
    _run_dtype_mismatch(number, model_dtype, x_dtype, mode == "train", "cpu")


@pytest.mark.parametrize("number", NUMBERS)
def test_training_batch_of_one_cpu(number, route):
    _run_batch_of_one(number, "cpu")


def test_fused_on_cpu_route_is_really_fused(fused_on_cpu):
    """Guard for the tests above: with the fixture, a good input does take the fused path."""
    _, new = make_pair(84, init_args(84, IN, OUT))
    assert head.fast_path_reason(new.train(), torch.rand(4, IN)) is None


def _poisoned(m, k, poison, device, seed=0, rows=(1, 5)):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(m, k, generator=g)
    vals = {"nan": [float("nan")], "posinf": [float("inf")], "neginf": [float("-inf")],
            "mixed": [float("nan"), float("inf"), float("-inf")]}[poison]
    for i, r in enumerate(rows):
        col = int(torch.randint(0, k, (1,), generator=g))
        x[r, col] = vals[i % len(vals)]
    if poison == "mixed":  # one row with +inf and -inf products: inf - inf = NaN inside the GEMM
        x[rows[0] + 1, 0], x[rows[0] + 1, 1] = float("inf"), float("-inf")
    return x.to(device)


def _check_nonfinite_like_model(ref, new, x, training, tol):
    ref.train(training), new.train(training)
    with torch.no_grad():
        y_ref, y_new = ref(x), new(x)
    assert torch.equal(torch.isnan(y_new), torch.isnan(y_ref)), (
        f"NaN positions differ: ModelNew {int(torch.isnan(y_new).sum())} NaNs, "
        f"Model {int(torch.isnan(y_ref).sum())}")
    assert torch.equal(torch.isinf(y_new), torch.isinf(y_ref)), "Inf positions differ"
    assert torch.equal(torch.signbit(y_new[torch.isinf(y_ref)]),
                       torch.signbit(y_ref[torch.isinf(y_ref)])), "Inf signs differ"
    bad_rows = ~torch.isfinite(x).all(dim=1)
    if training:  # PyTorch: batch statistics of every column are poisoned
        assert not torch.isfinite(y_ref).any()
    else:  # only the poisoned rows; the others must still be right
        assert torch.isfinite(y_ref[~bad_rows]).all()
        assert (~torch.isfinite(y_ref[bad_rows])).any(dim=1).all()
        assert rel_err(y_new[~bad_rows], y_ref[~bad_rows]) <= tol
    for name in ("running_mean", "running_var"):
        r, n = getattr(ref.bn, name), getattr(new.bn, name)
        assert torch.equal(torch.isfinite(n), torch.isfinite(r)), (
            f"{name}: ModelNew {n.tolist()[:4]}... vs Model {r.tolist()[:4]}...")
    assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item()


POISONS = ["nan", "posinf", "neginf", "mixed"]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("number", NUMBERS)
def test_nan_inf_propagate_cpu(number, poison, mode, fused_on_cpu):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    x = _poisoned(9, IN, poison, "cpu")
    assert head.fast_path_reason(new.train(mode == "train"), x) is None
    _check_nonfinite_like_model(ref, new, x, mode == "train", 1e-5)


# --------------------------------------------------------------------------- GPU: ModelNew

@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case_id", BAD_IDS)
@pytest.mark.parametrize("number", NUMBERS)
def test_bad_input_cuda(number, case_id, mode):
    _run_bad_input(number, case_id, mode == "train", CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("model_dtype,x_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.float32, torch.float16)],
    ids=["bf16model-fp32x", "fp32model-bf16x", "fp16model-bf16x", "fp32model-fp16x"])
@pytest.mark.parametrize("number", NUMBERS)
def test_dtype_mismatch_cuda(number, model_dtype, x_dtype):
    for training in (True, False):
        _run_dtype_mismatch(number, model_dtype, x_dtype, training, CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("number", NUMBERS)
def test_training_batch_of_one_cuda(number, dtype):
    _run_batch_of_one(number, CUDA, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("where", ["cuda-input-cpu-model", "cpu-input-cuda-model"])
@pytest.mark.parametrize("number", NUMBERS)
def test_device_mismatch(number, where, mode):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    x = torch.rand(6, IN)
    if where == "cuda-input-cpu-model":
        x = x.to(CUDA)
    else:
        ref.to(CUDA), new.to(CUDA)
    ref.train(mode == "train"), new.train(mode == "train")
    assert head.fast_path_reason(new, x) is not None
    e_ref, _ = assert_raises_like_model(ref, new, x, r"same device|device")
    assert isinstance(e_ref, RuntimeError)


@pytest.mark.gpu
@pytest.mark.parametrize("number", NUMBERS)
def test_partly_moved_model(number):
    """Buffers left on CPU while parameters are on CUDA: the reference's error, not a crash."""
    ref, new = make_pair(number, init_args(number, IN, OUT))
    for m in (ref, new):
        m.to(CUDA)
        m.bn.running_mean = m.bn.running_mean.cpu()
    x = torch.rand(6, IN, device=CUDA)
    assert head.fast_path_reason(new.train(), x) is not None
    ref.train()
    assert_raises_like_model(ref, new, x, r"device|cpu|cuda")


@pytest.mark.hopper
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", ["ieee", "3xtf32", "tf32"])
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("number", NUMBERS)
def test_nan_inf_propagate_cuda(number, poison, kind, mode):
    """Ragged multi-tile shape (M, N not multiples of 128), TMA-aligned so tf32 is fused."""
    ref, new = make_pair(number, init_args(number, 96, 264), precision=kind)
    ref.to(CUDA), new.to(CUDA)
    x = _poisoned(300, 96, poison, CUDA, rows=(3, 130, 299))
    assert head.fast_path_reason(new.train(mode == "train"), x) is None
    _check_nonfinite_like_model(ref, new, x, mode == "train", 2 * ORACLE_TOL[kind])


# --------------------------------------------------------------------------- CPU: the ops

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16


def _cpu_vec(n, dtype=F32):
    return torch.rand(n, dtype=dtype) + 0.5


def _cpu_fold_args(n=3, count=5, dtype=F32):
    """bn_fold_train's (positional arguments, keyword settings)."""
    colsum = torch.rand(n, dtype=F64)
    stats = (torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype),
             torch.zeros((), dtype=torch.long))
    return ([colsum, colsum * colsum + 1, count, None, _cpu_vec(n, dtype), _cpu_vec(n, dtype),
             None, None, *stats], {"momentum": 0.1, "eps": 1e-5})


def _cpu_gemm_cases():
    x, w, a, c = torch.rand(5, 7), torch.rand(3, 7), _cpu_vec(3), _cpu_vec(3)
    return {
        "K-mismatch": ((x, torch.rand(3, 8), a, c, "ieee"), RuntimeError,
                       r"shapes cannot be multiplied \(5x7 and 8x3\)"),
        "dtype-mismatch": ((x, w.bfloat16(), a, c, "ieee"), RuntimeError,
                           r"same dtype.*Float.*BFloat16"),
        "a-length": ((x, w, _cpu_vec(4), c, "ieee"), RuntimeError, r"\ba\b.*\[3\].*\[4\]"),
        "c-length": ((x, w, a, _cpu_vec(2), "ieee"), RuntimeError, r"\bc\b.*\[3\].*\[2\]"),
        "a-float64": ((x, w, a.double(), c, "ieee"), RuntimeError, r"a to be float32.*Double"),
        "c-bf16": ((x, w, a, c.bfloat16(), "ieee"), RuntimeError, r"c to be float32.*BFloat16"),
        "precision-bogus": ((x, w, a, c, "bogus"), ValueError, r"precision.*bogus"),
        "fp32-no-precision": ((x, w, a, c, ""), ValueError, r"precision"),
        "int-x-and-w": ((x.int(), w.int(), a, c, "ieee"), RuntimeError,
                        r"not implemented for 'Int'"),
        "float64-x-and-w": ((x.double(), w.double(), a, c, "ieee"), RuntimeError,
                            r"not implemented for 'Double'"),
        "x-3d": ((x[None], w, a, c, "ieee"), RuntimeError, r"2-D"),
    }


@pytest.mark.parametrize("name", list(_cpu_gemm_cases()))
def test_gemm_affine_errors_cpu(name):
    args, exc, key = _cpu_gemm_cases()[name]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_affine(*args)


@pytest.mark.parametrize("name", ["K-mismatch", "dtype-mismatch", "precision-bogus",
                                  "int-x-and-w", "float64-x-and-w", "x-3d"])
def test_gemm_colstats_errors_cpu(name):
    (x, w, _, _, precision), exc, key = _cpu_gemm_cases()[name]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_colstats(x, w, precision)


@pytest.mark.parametrize("count", [1, 0, -3])
def test_bn_fold_train_rejects_small_count_cpu(count):
    args, kwargs = _cpu_fold_args(count=count)
    nbt, rv = args[10], args[9]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)
    assert nbt.item() == 0 and torch.equal(rv, torch.ones_like(rv)), "state changed on error"


_FOLD_VALUES = {
    "vec4": lambda: _cpu_vec(4), "vec3": lambda: _cpu_vec(3),
    "vec3-bf16": lambda: _cpu_vec(3, BF16), "vec3-f64": lambda: _cpu_vec(3, F64),
    "int32-scalar": lambda: torch.zeros((), dtype=torch.int32),
    "float-scalar": lambda: torch.zeros(()), "int-vec3": lambda: torch.ones(3, dtype=torch.long),
}


@pytest.mark.parametrize("name,index,value,exc,key", [
    ("gamma-length", 4, "vec4", RuntimeError, r"beta|gamma"),
    ("gamma-int", 4, "int-vec3", RuntimeError, r"not implemented for 'Long'|dtype"),
    ("beta-dtype", 5, "vec3-bf16", RuntimeError, r"beta to have dtype Float like gamma"),
    ("pre_scale-float64", 6, "vec3-f64", RuntimeError, r"pre_scale to have dtype"),
    ("running_mean-length", 8, "vec4", RuntimeError, r"running_mean"),
    ("running_var-dtype", 9, "vec3-f64", RuntimeError, r"running_var to have dtype"),
    ("nbt-dtype", 10, "int32-scalar", RuntimeError, r"num_batches_tracked.*int64"),
    ("nbt-float", 10, "float-scalar", RuntimeError, r"num_batches_tracked.*int64"),
    ("colsum-float32", 0, "vec3", RuntimeError, r"float64.*Float \[3\]"),
    ("colsumsq-length", 1, "vec4", RuntimeError, r"colsum"),
    ("momentum>1", "momentum", 1.5, ValueError, r"momentum must be in \[0, 1\].*1\.5"),
    ("eps<0", "eps", -1.0, ValueError, r"eps must be non-negative"),
])
def test_bn_fold_train_bad_arguments_cpu(name, index, value, exc, key):
    """index: a positional argument's, or a keyword setting's name."""
    args, kwargs = _cpu_fold_args()
    (kwargs if isinstance(index, str) else args)[index] = _FOLD_VALUES.get(value, lambda: value)()
    nbt = args[10]
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)
    if name != "nbt-dtype" and name != "nbt-float":
        assert nbt.item() == 0, "running statistics updated although the call failed"


def test_bn_fold_eval_bad_arguments_cpu():
    args, _ = _cpu_fold_args()
    bias, gamma, beta, rm, rv = _cpu_vec(3), args[4], args[5], args[8], args[9]
    with pytest.raises(RuntimeError, match="running_var"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, None, rm, _cpu_vec(5), eps=1e-5)
    with pytest.raises(RuntimeError, match="post_scale"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, _cpu_vec(2), rm, rv, eps=1e-5)
    with pytest.raises(RuntimeError, match="bias to have dtype Float like gamma, got Double"):
        torch.ops.epifuse.bn_fold_eval(bias.double(), gamma, beta, None, None, rm, rv, eps=1e-5)
    with pytest.raises(RuntimeError, match="not implemented for 'Double'"):
        f64 = [t.double() for t in (bias, gamma, beta, rm, rv)]
        torch.ops.epifuse.bn_fold_eval(*f64[:3], None, None, *f64[3:], eps=1e-5)


@pytest.mark.parametrize("op", ["affine_softmax", "affine_softmax_", "affine_"])
def test_row_ops_bad_arguments_cpu(op):
    assert_row_op_rejects_bad_arguments(op, "cpu", [
        (lambda z, a, c: (z.int(), a, c), "not implemented for 'Int'"),
        (lambda z, a, c: (z.double(), a, c), "not implemented for 'Double'"),
        (lambda z, a, c: (z, a.double(), c), "a to be float32, got Double"),
    ])


# --------------------------------------------------------------------------- GPU: the ops

@pytest.fixture
def healthy_cuda():
    """After the test: no sticky CUDA error, and a valid op still gives the right answer."""
    yield
    torch.cuda.synchronize()
    x, w = torch.rand(5, 8, device=CUDA), torch.rand(3, 8, device=CUDA)
    a, c = torch.full((3,), 2.0, device=CUDA), torch.ones(3, device=CUDA)
    y = ops.gemm_affine(x, w, a, c, "ieee")
    torch.cuda.synchronize()
    assert rel_err(y, 2 * x.double() @ w.double().T + 1) <= 1e-6


def _vec(n, dtype=torch.float32):
    return torch.rand(n, device=CUDA, dtype=dtype) + 0.5


def _fold_args(n=3, count=5, dtype=torch.float32):
    colsum = torch.rand(n, device=CUDA, dtype=torch.float64)
    colsumsq = colsum * colsum + 1
    stats = (torch.zeros(n, device=CUDA, dtype=dtype), torch.ones(n, device=CUDA, dtype=dtype),
             torch.zeros((), device=CUDA, dtype=torch.long))
    # bn_fold_train's (positional arguments, keyword settings)
    return ([colsum, colsumsq, count, None, _vec(n, dtype), _vec(n, dtype), None, None, *stats],
            {"momentum": 0.1, "eps": 1e-5})


def _gemm_case(name):
    x, w = torch.rand(5, 7, device=CUDA), torch.rand(3, 7, device=CUDA)
    a, c = _vec(3), _vec(3)
    cases = {
        "K-mismatch": ((x, torch.rand(3, 8, device=CUDA), a, c, "ieee"), RuntimeError,
                       r"shapes cannot be multiplied \(5x7 and 8x3\)"),
        "dtype-mismatch": ((x, w.bfloat16(), a, c, "ieee"), RuntimeError,
                           r"same dtype.*Float.*BFloat16"),
        "a-length": ((x, w, _vec(4), c, "ieee"), RuntimeError, r"\ba\b.*\[3\].*\[4\]"),
        "c-length": ((x, w, a, _vec(2), "ieee"), RuntimeError, r"\bc\b.*\[3\].*\[2\]"),
        "a-dtype": ((x, w, a.double(), c, "ieee"), RuntimeError, r"float32|Float"),
        "a-on-cpu": ((x, w, a.cpu(), c, "ieee"), RuntimeError, r"CUDA|device"),
        "x-on-cpu": ((x.cpu(), w, a, c, "ieee"), RuntimeError, r"CUDA|device"),
        "precision-bogus": ((x, w, a, c, "bogus"), ValueError, r"precision.*bogus"),
        "fp32-no-precision": ((x, w, a, c, ""), ValueError, r"precision"),
        "int-x": ((x.int(), w, a, c, "ieee"), RuntimeError, r"dtype|Int"),
        "int-x-and-w": ((x.int(), w.int(), a, c, "ieee"), RuntimeError, r"Int"),
        "x-3d": ((x[None], w, a, c, "ieee"), RuntimeError, r"2-D"),
    }
    return cases[name]


GEMM_ERRORS = ["K-mismatch", "dtype-mismatch", "a-length", "c-length", "a-dtype", "a-on-cpu",
               "x-on-cpu", "precision-bogus", "fp32-no-precision", "int-x", "int-x-and-w", "x-3d"]


@pytest.mark.hopper
@pytest.mark.parametrize("name", GEMM_ERRORS)
def test_gemm_affine_errors(name, healthy_cuda):
    args, exc, key = _gemm_case(name)
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_affine(*args)


@pytest.mark.hopper
@pytest.mark.parametrize("name", ["K-mismatch", "dtype-mismatch", "precision-bogus", "int-x",
                                  "int-x-and-w", "x-3d"])
def test_gemm_colstats_errors(name, healthy_cuda):
    (x, w, _, _, precision), exc, key = _gemm_case(name)
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.gemm_colstats(x, w, precision)


@pytest.mark.hopper
@pytest.mark.parametrize("count", [1, 0, -3])
def test_bn_fold_train_rejects_small_count(count, healthy_cuda):
    args, kwargs = _fold_args(count=count)
    nbt, rv = args[10], args[9]
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)
    torch.cuda.synchronize()
    assert nbt.item() == 0 and torch.equal(rv, torch.ones_like(rv)), "state changed on error"


@pytest.mark.hopper
@pytest.mark.parametrize("name,index,value,exc,key", [
    ("gamma-length", 4, "vec4", RuntimeError, r"beta|gamma"),
    ("beta-dtype", 5, "vec3-bf16", RuntimeError, r"dtype"),
    ("running_mean-length", 8, "vec4", RuntimeError, r"running_mean"),
    ("running_var-dtype", 9, "vec3-f64", RuntimeError, r"running_var"),
    ("nbt-dtype", 10, "int32-scalar", RuntimeError, r"num_batches_tracked"),
    ("colsum-float32", 0, "vec3", RuntimeError, r"float64|colsum"),
    ("momentum>1", "momentum", 1.5, ValueError, r"momentum"),
    ("eps<0", "eps", -1.0, ValueError, r"eps"),
])
def test_bn_fold_train_bad_arguments(name, index, value, exc, key, healthy_cuda):
    """index: a positional argument's, or a keyword setting's name."""
    args, kwargs = _fold_args()
    (kwargs if isinstance(index, str) else args)[index] = {
        "vec4": lambda: _vec(4), "vec3": lambda: _vec(3),
        "vec3-bf16": lambda: _vec(3, torch.bfloat16),
        "vec3-f64": lambda: _vec(3, torch.float64),
        "int32-scalar": lambda: torch.zeros((), device=CUDA, dtype=torch.int32),
    }.get(value, lambda: value)()
    with pytest.raises(exc, match=key):
        torch.ops.epifuse.bn_fold_train(*args, **kwargs)


@pytest.mark.hopper
def test_bn_fold_eval_bad_arguments(healthy_cuda):
    args, _ = _fold_args()
    bias, gamma, beta, rm, rv = _vec(3), args[4], args[5], args[8], args[9]
    with pytest.raises(RuntimeError, match="running_var"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, None, rm, _vec(5), eps=1e-5)
    with pytest.raises(RuntimeError, match="post_scale"):
        torch.ops.epifuse.bn_fold_eval(bias, gamma, beta, None, _vec(2), rm, rv, eps=1e-5)
    with pytest.raises(RuntimeError, match="CUDA|device"):
        torch.ops.epifuse.bn_fold_eval(bias.cpu(), gamma, beta, None, None, rm, rv, eps=1e-5)


@pytest.mark.hopper
@pytest.mark.parametrize("op", ["affine_softmax", "affine_softmax_", "affine_"])
def test_row_ops_bad_arguments(op, healthy_cuda):
    assert_row_op_rejects_bad_arguments(op, CUDA, [
        (lambda z, a, c: (z.int(), a, c), "not implemented for 'Int'|Int"),
        (lambda z, a, c: (z, a.cpu(), c), "CUDA|device"),
    ])


# --------------------------------------------------------------------------- CPU and CUDA kernels

ON_BOTH_DEVICES = pytest.mark.parametrize("device", [
    pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.hopper)])


def _assert_rejects(op_name, args, kwargs, index, value, exc, key, device, request):
    """Op op_name on (args, kwargs) with one argument replaced raises exc matching key.

    index: a positional argument's index (value(device) replaces it) or a keyword setting's name
    (value replaces it). On CUDA the context must still work afterwards (healthy_cuda).
    """
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    if isinstance(index, str):
        kwargs[index] = value
    else:
        args[index] = value(device)
    with pytest.raises(exc, match=key):
        getattr(torch.ops.epifuse, op_name)(*args, **kwargs)


# --------------------------------------------------------------------------- update_running_stats

def _update_args(device, n=3, dtype=F32):
    """update_running_stats's positional arguments: moments [mean, var, count], the buffers."""
    moments = torch.cat([torch.rand(2 * n, dtype=F64), torch.tensor([5.0], dtype=F64)])
    return [moments.to(device), torch.zeros(n, device=device, dtype=dtype),
            torch.ones(n, device=device, dtype=dtype),
            torch.zeros((), device=device, dtype=torch.long)]


@ON_BOTH_DEVICES
@pytest.mark.parametrize("name,index,value,exc,key", [
    ("moments-float32", 0, lambda d: torch.rand(7, device=d), RuntimeError,
     r"moments to be a contiguous float64 \[7\] tensor, got Float \[7\]"),
    ("moments-length", 0, lambda d: torch.rand(6, device=d, dtype=F64), RuntimeError,
     r"moments to be a contiguous float64 \[7\] tensor, got Double \[6\]"),
    ("running_mean-2d", 1, lambda d: torch.zeros(3, 1, device=d), RuntimeError,
     r"running_mean to be a contiguous 1-D tensor"),
    ("running_mean-int", 1, lambda d: torch.zeros(3, device=d, dtype=torch.long), RuntimeError,
     r"not implemented for 'Long'"),
    ("running_var-dtype", 2, lambda d: torch.ones(3, device=d, dtype=BF16), RuntimeError,
     r"running_var to have dtype Float like running_mean, got BFloat16"),
    ("running_var-length", 2, lambda d: torch.ones(4, device=d), RuntimeError,
     r"running_var to be a contiguous \[3\] tensor"),
    ("nbt-int32", 3, lambda d: torch.zeros((), device=d, dtype=torch.int32), RuntimeError,
     r"num_batches_tracked to be a one-element int64 tensor"),
    ("momentum>1", "momentum", 1.5, ValueError, r"momentum must be in \[0, 1\] or None, got 1\.5"),
])
def test_update_running_stats_bad_arguments(name, index, value, exc, key, device, request):
    """The CPU and CUDA kernels' messages; the buffers untouched by a failed call."""
    args = _update_args(device)
    _assert_rejects("update_running_stats", args, {"momentum": 0.1}, index, value, exc, key, device,
                    request)
    if isinstance(args[3], torch.Tensor) and args[3].dtype == torch.long:
        assert args[3].item() == 0, "num_batches_tracked counted although the call failed"


# ------------------------------------------------------------------------ passes and backward ops
# The ops the autograd and the fused paths call between the GEMMs: each case replaces one argument
# of a valid sample (tests/op_samples.py, N = 3 columns, M = 5 rows) with a bad one. The CPU
# kernels once skipped these checks (a broadcast a, a NaN fold for eps < 0, a silently summed
# coefficient row); the CUDA ops' messages are the reference.

def _pass_op_args(op_name, dtype_id, device):
    args, kwargs = op_samples.samples(device, op_samples.DTYPES[dtype_id])[op_name][0]
    return list(args), dict(kwargs)


PASS_OP_ERRORS = [
    ("affine", "fp32", "a-length", 1, lambda d: _vec3(d, n=1), RuntimeError,
     r"epifuse::affine: expected a of shape \[3\], got \[1\]"),
    ("affine", "fp32", "c-float64", 2, lambda d: _vec3(d, F64), RuntimeError,
     r"epifuse::affine: expected c to be float32, got Double"),
    ("affine", "fp32", "z-float64", 0, lambda d: torch.rand(5, 3, device=d, dtype=F64),
     RuntimeError, r"epifuse::affine not implemented for 'Double'"),
    ("bn_fold_batch", "fp32", "eps<0", "eps", -1.0, ValueError, r"eps must be non-negative"),
    ("bn_fold_batch", "fp32", "colsum-float32", 0, lambda d: _vec3(d), RuntimeError,
     r"bn_fold_batch: expected colsum to be a contiguous float64 \[3\] tensor, got Float"),
    ("bn_fold_batch", "fp32", "bias-length", 3, lambda d: _vec3(d, n=1), RuntimeError,
     r"bn_fold_batch: expected bias of shape \[3\], got \[1\]"),
    ("bn_fold_batch", "fp32", "gamma-float64", 4, lambda d: _vec3(d, F64), RuntimeError,
     r"bn_fold_batch: expected beta to have dtype Double like gamma, got Float"),
    ("head_grad_coefficients", "fp32", "sums-length", 0,
     lambda d: torch.rand(9, device=d, dtype=F64), RuntimeError,
     r"expected sums to be a contiguous float64 \[7\] tensor, got Double \[9\]"),
    ("head_grad_coefficients", "fp32", "moments-float32", 4, lambda d: _vec3(d, n=7),
     RuntimeError, r"expected moments to be a contiguous float64 \[7\] tensor, got Float"),
    ("head_grad_coefficients", "fp32", "no-colsum", 2, lambda d: None, RuntimeError,
     r"training-mode coefficients need colsum and colsumsq"),
    ("head_grad_coefficients", "fp32", "eps<0", "eps", -1.0, ValueError,
     r"head_grad_coefficients: eps must be non-negative"),
    ("head_grad_z", "fp32", "coef-column", 4, lambda d: torch.rand(3, 1, device=d), RuntimeError,
     r"expected coef to be a float32 \[3, 3\] tensor, got Float \[3, 1\]"),
    ("head_grad_z", "fp32", "coef-two-rows", 4, lambda d: torch.rand(2, 3, device=d),
     RuntimeError, r"expected coef to be a float32 \[3, 3\] tensor, got Float \[2, 3\]"),
    ("head_grad_z", "fp32", "coef-float64", 4, lambda d: torch.rand(3, 3, device=d, dtype=F64),
     RuntimeError, r"expected coef to be a float32 \[3, 3\] tensor, got Double"),
    ("head_grad_sums", "fp32", "rowdot-length", 2, lambda d: _vec3(d, n=1), RuntimeError,
     r"head_grad_sums: expected rowdot of shape \[5\], got \[1\]"),
    ("head_grad_sums", "fp32", "grad-bf16", 0, lambda d: torch.rand(5, 3, device=d, dtype=BF16),
     RuntimeError, r"head_grad_sums: expected grad to have dtype Float like z, got BFloat16"),
    ("head_grad_sums", "fp32", "grad-shape", 0, lambda d: torch.rand(5, 4, device=d),
     RuntimeError, r"head_grad_sums: expected grad of shape \[5, 3\] like z, got \[5, 4\]"),
    ("head_grad_sums", "fp32", "out-without-rowdot", 2, lambda d: None, RuntimeError,
     r"pass both out and rowdot"),
    # The CUDA kernel read a bf16 out as float32 here: past the end of out.
    ("softmax_grad_rowdot", "bf16", "grad-float32", 0, lambda d: torch.rand(5, 3, device=d),
     RuntimeError, r"softmax_grad_rowdot: expected grad to have dtype BFloat16 like out, got Float"),
    ("softmax_grad_rowdot", "fp32", "out-1d", 1, lambda d: _vec3(d, n=15), RuntimeError,
     r"softmax_grad_rowdot: expected out to be 2-D \[M, N\], got 1-D"),
    # The out_dtype branch (dW under autocast) checks what the other branch's GEMM checks.
    ("backward_matmul", "bf16", "precision-bogus", 2, lambda d: "bogus", ValueError,
     r"backward_matmul: precision must be .*got 'bogus'"),
]


@ON_BOTH_DEVICES
@pytest.mark.parametrize("op_name,dtype_id,name,index,value,exc,key", PASS_OP_ERRORS,
                         ids=[f"{case[0]}-{case[2]}" for case in PASS_OP_ERRORS])
def test_pass_and_backward_ops_bad_arguments(op_name, dtype_id, name, index, value, exc, key,
                                             device, request):
    """The CPU and CUDA kernels refuse alike: exception type and message naming the argument."""
    args, kwargs = _pass_op_args(op_name, dtype_id, device)
    if op_name == "backward_matmul":
        kwargs["out_dtype"] = torch.float32
    _assert_rejects(op_name, args, kwargs, index, value, exc, key, device, request)


@ON_BOTH_DEVICES
@pytest.mark.parametrize("op_name", ["affine_", "affine_softmax_"])
@pytest.mark.parametrize("alias", ["a-row-of-z", "c-row-of-z", "a-overlapping-z-tail", "a-is-z"])
def test_inplace_passes_refuse_a_or_c_sharing_memory_with_z(op_name, alias, device, request):
    """a or c inside z's memory: the CUDA pass would read them while writing z (a race); both
    devices refuse as PyTorch's in-place ops do, z untouched. Separate memory is accepted."""
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    base = torch.rand(6 * 8 + 4, device=device)
    z = base[: 6 * 8].view(6, 8)
    a, c = torch.rand(8, device=device) + 0.5, torch.rand(8, device=device)
    name = alias[0]
    if alias == "a-row-of-z":
        a = z[2]
    elif alias == "c-row-of-z":
        c = z[5]
    elif alias == "a-overlapping-z-tail":
        a = base[6 * 8 - 4: 6 * 8 + 4]
    else:  # one row: a is z's memory exactly
        z, a = base[:8].view(1, 8), base[:8]
    before = z.clone()
    with pytest.raises(RuntimeError, match=rf"epifuse::{op_name}: unsupported operation: {name} "
                                           rf"and the written-to z share memory"):
        getattr(ops, op_name)(z, a, c)
    assert torch.equal(z, before)
    # the same values in memory of their own run
    getattr(ops, op_name)(z, a.clone(), c.clone())
    assert not torch.equal(z, before)


@ON_BOTH_DEVICES
def test_backward_matmul_fp32_out_rejects_a_non_kernel_dtype(device, request):
    """int16 operands have 16-bit elements too: refused by dtype, not passed to a GEMM."""
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    a = torch.ones(4, 8, device=device, dtype=torch.int16)
    b = torch.ones(8, 4, device=device, dtype=torch.int16)
    with pytest.raises(RuntimeError, match=r"epifuse::backward_matmul not implemented for 'Short'"):
        torch.ops.epifuse.backward_matmul(a, b, "", out_dtype=torch.float32)


# ------------------------------------------------------------------------ synchronized statistics
# pack_moments, merge_fold, normalized_grad_sums (cpp/ops/synced_ops.cpp; op_checks.py mirrors
# them): N = 3 columns, float32 parameters.

def _vec3(d, dtype=F32, n=3):
    return torch.rand(n, device=d, dtype=dtype) + 0.5


def _synced_op_args(name, device):
    """(positional arguments, keyword settings) of a valid call."""
    colsum = torch.rand(3, dtype=F64, device=device)
    row = torch.cat([torch.rand(6, dtype=F64, device=device),
                     torch.ones(1, dtype=F64, device=device)])  # [mean, var or M2, count]
    args = {"pack_moments": [colsum, colsum * colsum + 1, 5, _vec3(device), _vec3(device, n=1)],
            "merge_fold": [torch.stack([row.roll(1), row.roll(1)]), _vec3(device), _vec3(device),
                           _vec3(device), None, _vec3(device, n=1)],
            "normalized_grad_sums": [row, row, _vec3(device), _vec3(device), _vec3(device), None]}
    return args[name], ({} if name == "pack_moments" else {"eps": 1e-5})


SYNCED_OP_ERRORS = [
    ("pack_moments", "colsum-float32", 0, lambda d: _vec3(d), RuntimeError,
     r"colsum to be a contiguous float64 \[3\] tensor, got Float \[3\]"),
    ("pack_moments", "colsum-2d", 0, lambda d: _vec3(d, F64).reshape(3, 1), RuntimeError,
     r"colsum to be 1-D, got \[3, 1\]"),
    ("pack_moments", "colsumsq-length", 1, lambda d: _vec3(d, F64, n=4), RuntimeError,
     r"colsumsq to be a contiguous float64 \[3\] tensor, got Double \[4\]"),
    ("pack_moments", "count-0", 2, lambda d: 0, ValueError, r"count must be >= 1, got 0"),
    ("pack_moments", "bias-float64", 3, lambda d: _vec3(d, F64), RuntimeError,
     r"pack_moments not implemented for 'Double'"),
    ("pack_moments", "bias-length", 3, lambda d: _vec3(d, n=4), RuntimeError,
     r"bias of shape \[3\], got \[4\]"),
    ("pack_moments", "pre_scale-bf16", 4, lambda d: _vec3(d, BF16), RuntimeError,
     r"pre_scale to have dtype Float like bias, got BFloat16"),
    ("pack_moments", "pre_scale-length", 4, lambda d: _vec3(d, n=2), RuntimeError,
     r"pre_scale to have 1 or 3 elements"),
    ("merge_fold", "rows-float32", 0, lambda d: torch.rand(2, 7, device=d), RuntimeError,
     r"rows to be a contiguous float64 \[world, 7\] tensor .*got Float \[2, 7\]"),
    ("merge_fold", "rows-1d", 0, lambda d: _vec3(d, F64, n=7), RuntimeError,
     r"rows to be .*got Double \[7\]"),
    ("merge_fold", "rows-width", 0, lambda d: torch.rand(2, 6, device=d, dtype=F64), RuntimeError,
     r"rows to be .*\[world, 7\].*got Double \[2, 6\]"),
    ("merge_fold", "no-rank", 0, lambda d: torch.rand(0, 7, device=d, dtype=F64), RuntimeError,
     r"world >= 1.*got Double \[0, 7\]"),
    ("merge_fold", "beta-bf16", 3, lambda d: _vec3(d, BF16), RuntimeError,
     r"beta to have dtype Float like gamma, got BFloat16"),
    ("merge_fold", "post_scale-length", 5, lambda d: _vec3(d, n=2), RuntimeError,
     r"post_scale to have 1 or 3 elements"),
    ("merge_fold", "eps<0", "eps", -1.0, ValueError, r"eps must be non-negative"),
    ("normalized_grad_sums", "sums-float32", 0, lambda d: _vec3(d, n=7), RuntimeError,
     r"sums to be a contiguous float64 \[7\] tensor, got Float \[7\]"),
    ("normalized_grad_sums", "moments-length", 1, lambda d: _vec3(d, F64, n=6), RuntimeError,
     r"moments to be a contiguous float64 \[7\] tensor, got Double \[6\]"),
    ("normalized_grad_sums", "bias-float64", 2, lambda d: _vec3(d, F64), RuntimeError,
     r"bias to have dtype Float like gamma, got Double"),
    ("normalized_grad_sums", "gamma-2d", 3, lambda d: _vec3(d).reshape(3, 1), RuntimeError,
     r"gamma to be 1-D"),
    ("normalized_grad_sums", "eps<0", "eps", -1.0, ValueError, r"eps must be non-negative"),
]


@ON_BOTH_DEVICES
@pytest.mark.parametrize("op_name,name,index,value,exc,key", SYNCED_OP_ERRORS,
                         ids=[f"{case[0]}-{case[1]}" for case in SYNCED_OP_ERRORS])
def test_synced_ops_bad_arguments(op_name, name, index, value, exc, key, device, request):
    """The CPU and CUDA kernels refuse alike: exception type and message naming the argument."""
    args, kwargs = _synced_op_args(op_name, device)
    _assert_rejects(op_name, args, kwargs, index, value, exc, key, device, request)


@pytest.mark.hopper
@pytest.mark.parametrize("op_name,index", [("pack_moments", 1), ("merge_fold", 0),
                                           ("normalized_grad_sums", 1)])
def test_synced_ops_reject_a_tensor_off_the_gpu(op_name, index, healthy_cuda):
    args, kwargs = _synced_op_args(op_name, "cuda")
    args[index] = args[index].cpu()
    with pytest.raises(RuntimeError, match="CUDA|device"):
        getattr(torch.ops.epifuse, op_name)(*args, **kwargs)
