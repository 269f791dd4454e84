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
* The ops themselves on bad arguments: every check of cpp/ops/*.cpp (and op_args.cpp), on CPU
  and, marked `hopper`, on CUDA. The checks are C++ and run on any device before the CUDA
  kernels or, for CPU tensors, the float64 reference, so both devices raise the same exception
  type with a message naming the op, the argument and what is wrong (asserted by those words,
  not letter for letter); a refused call changes none of its arguments; on CUDA there is no
  crash, no hang, and the context still works afterwards (``healthy_cuda``). Mixed devices: the
  dispatcher's own wording, with the op and the argument.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest
import torch

from epifuse import head, ops
import op_samples
from helpers import ORACLE_TOL, init_args, make_pair, rel_err

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


# --------------------------------------------------------------------------- the ops
# Each case takes a valid sample of tests/op_samples.py (M = 5 rows, K = 7, N = 3 columns) and
# replaces arguments, by their schema names, with bad ones: ``bad`` maps a name to a value, or to
# a function of (the sample's value, the device) giving one. The pattern is the key words of the
# message, in order: the op (where the message names it), the argument, what is wrong.

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.hopper)]


def words(*parts: str) -> str:
    """A regex of ``parts`` in this order, anything between; identifiers as whole words."""
    return ".*".join(rf"\b{re.escape(p)}\b" if re.fullmatch(r"\w+", p) else re.escape(p)
                     for p in parts)


class Case(NamedTuple):
    op: str
    id: str
    bad: dict
    exc: type
    pattern: str
    sample: int = 0
    dtype: str = "fp32"


def _vec(n, dtype=F32):
    return lambda v, d: torch.rand(n, device=d, dtype=dtype) + 0.5


def _rows(*shape, dtype=F32):
    return lambda v, d: torch.rand(*shape, device=d, dtype=dtype)


def _as(dtype):
    return lambda v, d: v.to(dtype)


def _3d(v, d):
    return v[None]


def _column(v, d):
    return v.reshape(-1, 1)


def _non_contiguous(v, d):
    return torch.stack([v, v], 1)[:, 0]


def _none(v, d):
    return None


R, V = RuntimeError, ValueError
OP_ERRORS = [
    # gemm_affine (x [5, 7], weight [3, 7], a, c [3], precision 'ieee')
    Case("gemm_affine", "x-3d", {"x": _3d}, R, words("gemm_affine", "x", "2-D")),
    Case("gemm_affine", "weight-1d", {"weight": lambda v, d: v[0]}, R,
         words("gemm_affine", "weight", "2-D")),
    Case("gemm_affine", "weight-bf16", {"weight": _as(BF16)}, R,
         words("same dtype", "Float", "BFloat16")),
    Case("gemm_affine", "K-mismatch", {"weight": _rows(3, 8)}, R,
         words("shapes cannot be multiplied", "5x7", "8x3")),
    Case("gemm_affine", "int", {"x": _as(torch.int32), "weight": _as(torch.int32)}, R,
         words("gemm_affine", "not implemented", "'Int'")),
    Case("gemm_affine", "float64", {"x": _as(F64), "weight": _as(F64)}, R,
         words("gemm_affine", "not implemented", "'Double'")),
    Case("gemm_affine", "precision-bogus", {"precision": "bogus"}, V,
         words("gemm_affine", "precision", "'bogus'")),
    Case("gemm_affine", "fp32-no-precision", {"precision": ""}, V,
         words("gemm_affine", "float32", "need precision")),
    Case("gemm_affine", "activation-tanh", {"activation": "tanh"}, V,
         words("gemm_affine", "unknown activation", "'tanh'")),
    Case("gemm_affine", "a-float64", {"a": _as(F64)}, R,
         words("gemm_affine", "a", "float32", "Double")),
    Case("gemm_affine", "a-length", {"a": _vec(4)}, R, words("gemm_affine", "a", "[3]", "[4]")),
    Case("gemm_affine", "c-length", {"c": _vec(2)}, R, words("gemm_affine", "c", "[3]", "[2]")),
    # gemm_colstats
    Case("gemm_colstats", "x-3d", {"x": _3d}, R, words("gemm_colstats", "x", "2-D")),
    Case("gemm_colstats", "K-mismatch", {"weight": _rows(3, 8)}, R,
         words("shapes cannot be multiplied", "5x7", "8x3")),
    Case("gemm_colstats", "weight-bf16", {"weight": _as(BF16)}, R, words("same dtype")),
    Case("gemm_colstats", "float64", {"x": _as(F64), "weight": _as(F64)}, R,
         words("gemm_colstats", "not implemented", "'Double'")),
    Case("gemm_colstats", "precision-bogus", {"precision": "bogus"}, V,
         words("gemm_colstats", "precision", "'bogus'")),
    # backward_matmul (a [5, 3], b [3, 7])
    Case("backward_matmul", "a-3d", {"a": _3d}, R, words("backward_matmul", "2-D a and b", "3-D")),
    Case("backward_matmul", "b-bf16", {"b": _as(BF16)}, R,
         words("same dtype", "Float", "BFloat16")),
    Case("backward_matmul", "K-mismatch", {"b": _rows(4, 7)}, R,
         words("shapes cannot be multiplied", "5x3", "4x7")),
    Case("backward_matmul", "precision-bogus", {"precision": "bogus"}, V,
         words("backward_matmul", "precision", "'bogus'")),
    # The out_dtype branch (dW under autocast) checks what the other branch's GEMM checks.
    Case("backward_matmul", "fp32-out-precision-bogus", {"precision": "bogus"}, V,
         words("backward_matmul", "precision", "'bogus'"), sample=2, dtype="bf16"),
    Case("backward_matmul", "out_dtype-half-from-fp32", {"out_dtype": torch.float16}, R,
         words("backward_matmul", "out_dtype", "float32 for 16-bit", "Half")),
    Case("backward_matmul", "out_dtype-float64", {"out_dtype": F64}, R,
         words("backward_matmul", "out_dtype", "Double"), sample=2, dtype="bf16"),
    # int16 operands have 16-bit elements too: refused by dtype, not passed to a GEMM.
    Case("backward_matmul", "int16-fp32-out", {"a": _as(torch.int16), "b": _as(torch.int16)}, R,
         words("backward_matmul", "not implemented", "'Short'"), sample=2, dtype="bf16"),
    # bn_fold_train (colsum, colsumsq, count 5, bias, gamma, beta, None, post_scale [1],
    # running_mean, running_var, num_batches_tracked; momentum 0.1, eps 1e-5)
    Case("bn_fold_train", "count-1", {"count": 1}, V,
         words("Expected more than 1 value per channel when training", "1 rows")),
    Case("bn_fold_train", "count-0", {"count": 0}, V, words("more than 1 value per channel")),
    Case("bn_fold_train", "gamma-2d", {"gamma": _column}, R,
         words("bn_fold_train", "gamma", "1-D")),
    Case("bn_fold_train", "gamma-long", {"gamma": _as(torch.long)}, R,
         words("bn_fold_train", "beta", "dtype", "Long", "gamma", "Float")),
    Case("bn_fold_train", "beta-length", {"beta": _vec(4)}, R,
         words("bn_fold_train", "beta", "[3]", "[4]")),
    Case("bn_fold_train", "beta-bf16", {"beta": _as(BF16)}, R,
         words("bn_fold_train", "beta", "dtype Float", "gamma", "BFloat16")),
    Case("bn_fold_train", "bias-strided", {"bias": _non_contiguous}, R,
         words("bn_fold_train", "bias", "contiguous")),
    Case("bn_fold_train", "post_scale-length", {"post_scale": _vec(2)}, R,
         words("bn_fold_train", "post_scale", "1 or 3 elements")),
    Case("bn_fold_train", "pre_scale-float64", {"pre_scale": _vec(3, F64)}, R,
         words("bn_fold_train", "pre_scale", "dtype Float", "Double")),
    Case("bn_fold_train", "eps<0", {"eps": -1.0}, V, words("bn_fold_train", "eps", "non-negative")),
    Case("bn_fold_train", "colsum-float32", {"colsum": _as(F32)}, R,
         words("bn_fold_train", "colsum", "float64 [3]", "Float")),
    Case("bn_fold_train", "colsumsq-length", {"colsumsq": _vec(4, F64)}, R,
         words("bn_fold_train", "colsumsq", "[3]", "[4]")),
    Case("bn_fold_train", "running_mean-length", {"running_mean": _vec(4)}, R,
         words("bn_fold_train", "running_mean", "[3]", "[4]")),
    Case("bn_fold_train", "running_var-float64", {"running_var": _as(F64)}, R,
         words("bn_fold_train", "running_var", "dtype Float", "Double")),
    Case("bn_fold_train", "nbt-int32", {"num_batches_tracked": _as(torch.int32)}, R,
         words("bn_fold_train", "num_batches_tracked", "int64")),
    Case("bn_fold_train", "nbt-two", {"num_batches_tracked": lambda v, d: v.repeat(2)}, R,
         words("bn_fold_train", "num_batches_tracked", "one-element")),
    Case("bn_fold_train", "momentum>1", {"momentum": 1.5}, V,
         words("bn_fold_train", "momentum", "[0, 1]", "1.5")),
    Case("bn_fold_train", "momentum<0", {"momentum": -0.1}, V, words("bn_fold_train", "momentum")),
    # bn_fold_eval (bias, gamma, beta, None, post_scale [3], running_mean, running_var)
    Case("bn_fold_eval", "running_var-length", {"running_var": _vec(5)}, R,
         words("bn_fold_eval", "running_var", "[3]", "[5]")),
    Case("bn_fold_eval", "running_var-bf16", {"running_var": _as(BF16)}, R,
         words("bn_fold_eval", "running_var", "dtype Float", "float64", "BFloat16")),
    Case("bn_fold_eval", "statistics-of-two-dtypes", {"running_mean": _as(F64)}, R,
         words("bn_fold_eval", "running_mean and running_var", "one dtype", "Double", "Float")),
    Case("bn_fold_eval", "post_scale-length", {"post_scale": _vec(2)}, R,
         words("bn_fold_eval", "post_scale", "1 or 3")),
    Case("bn_fold_eval", "bias-float64", {"bias": _as(F64)}, R,
         words("bn_fold_eval", "bias", "dtype Float", "gamma", "Double")),
    Case("bn_fold_eval", "all-float64", {name: _as(F64) for name in (
        "bias", "gamma", "beta", "post_scale", "running_mean", "running_var")}, R,
         words("bn_fold_eval", "not implemented", "'Double'")),
    Case("bn_fold_eval", "eps<0", {"eps": -1e-3}, V, words("bn_fold_eval", "eps", "non-negative")),
    # bn_fold_batch (colsum, colsumsq, count, bias, gamma, beta, None, post_scale)
    Case("bn_fold_batch", "count-1", {"count": 1}, V, words("more than 1 value per channel")),
    Case("bn_fold_batch", "colsum-float32", {"colsum": _as(F32)}, R,
         words("bn_fold_batch", "colsum", "float64 [3]", "Float")),
    Case("bn_fold_batch", "bias-length", {"bias": _vec(1)}, R,
         words("bn_fold_batch", "bias", "[3]", "[1]")),
    Case("bn_fold_batch", "gamma-float64", {"gamma": _as(F64)}, R,
         words("bn_fold_batch", "beta", "dtype Double", "gamma", "Float")),
    Case("bn_fold_batch", "eps<0", {"eps": -1.0}, V, words("bn_fold_batch", "eps", "non-negative")),
    # update_running_stats (moments [7], running_mean, running_var, num_batches_tracked)
    Case("update_running_stats", "moments-float32", {"moments": _as(F32)}, R,
         words("update_running_stats", "moments", "float64 [7]", "Float")),
    Case("update_running_stats", "moments-length", {"moments": _vec(6, F64)}, R,
         words("update_running_stats", "moments", "[7]", "[6]")),
    Case("update_running_stats", "running_mean-2d", {"running_mean": _column}, R,
         words("update_running_stats", "running_mean", "contiguous 1-D")),
    Case("update_running_stats", "running_mean-long", {"running_mean": _as(torch.long)}, R,
         words("update_running_stats", "not implemented", "'Long'")),
    Case("update_running_stats", "running_var-bf16", {"running_var": _as(BF16)}, R,
         words("update_running_stats", "running_var", "dtype Float", "running_mean", "BFloat16")),
    Case("update_running_stats", "running_var-length", {"running_var": _vec(4)}, R,
         words("update_running_stats", "running_var", "[3]", "[4]")),
    Case("update_running_stats", "nbt-int32", {"num_batches_tracked": _as(torch.int32)}, R,
         words("update_running_stats", "num_batches_tracked", "int64")),
    Case("update_running_stats", "momentum>1", {"momentum": 1.5}, V,
         words("update_running_stats", "momentum", "[0, 1]", "1.5")),
]

# The row passes (z [5, 3], a, c [3]): the same checks in each, plus their own.
for _op in ("affine_softmax", "affine_softmax_", "affine_", "affine"):
    OP_ERRORS += [
        Case(_op, "z-3d", {"z": _3d}, R, words(_op, "2-D", "3-D")),
        Case(_op, "z-float64", {"z": _as(F64)}, R, words(_op, "not implemented", "'Double'")),
        Case(_op, "z-int", {"z": _as(torch.int32)}, R, words(_op, "not implemented", "'Int'")),
        Case(_op, "activation-Relu", {"activation": "Relu"}, V,
             words(_op, "unknown activation", "'Relu'")),
        Case(_op, "a-length", {"a": _vec(4)}, R, words(_op, "a", "[3]", "[4]")),
        Case(_op, "c-float64", {"c": _as(F64)}, R, words(_op, "c", "float32", "Double")),
    ]
    if _op != "affine":  # a and c optional: both or neither
        OP_ERRORS.append(Case(_op, "a-without-c", {"c": _none}, R, words(_op, "both a and c")))
    if not _op.endswith("_"):  # out of place: an output dtype
        OP_ERRORS.append(Case(_op, "out_dtype-half-from-fp32", {"out_dtype": torch.float16}, R,
                              words(_op, "out_dtype", "float32 for a 16-bit z", "Half")))

OP_ERRORS += [
    # softmax_grad_rowdot (grad, out [5, 3])
    Case("softmax_grad_rowdot", "out-1d", {"out": lambda v, d: v.flatten()}, R,
         words("softmax_grad_rowdot", "out", "2-D", "1-D")),
    # The CUDA kernel once read a bf16 out as float32 here: past the end of out.
    Case("softmax_grad_rowdot", "grad-float32", {"grad": _as(F32)}, R,
         words("softmax_grad_rowdot", "grad", "dtype BFloat16", "out", "Float"), dtype="bf16"),
    Case("softmax_grad_rowdot", "grad-shape", {"grad": _rows(5, 4)}, R,
         words("softmax_grad_rowdot", "grad", "[5, 3]", "[5, 4]")),
    Case("softmax_grad_rowdot", "float64", {"grad": _as(F64), "out": _as(F64)}, R,
         words("softmax_grad_rowdot", "not implemented", "'Double'")),
    # head_grad_sums (grad, out, rowdot [5], z, a, c; activation 'gelu')
    Case("head_grad_sums", "z-3d", {"z": _3d}, R, words("head_grad_sums", "z", "2-D", "3-D"),
         sample=2),
    Case("head_grad_sums", "z-float64", {"z": _as(F64)}, R,
         words("head_grad_sums", "not implemented", "'Double'"), sample=2),
    Case("head_grad_sums", "grad-bf16", {"grad": _as(BF16)}, R,
         words("head_grad_sums", "grad", "dtype Float", "z", "BFloat16"), sample=2),
    Case("head_grad_sums", "grad-shape", {"grad": _rows(5, 4)}, R,
         words("head_grad_sums", "grad", "[5, 3]", "z", "[5, 4]"), sample=2),
    Case("head_grad_sums", "out-bf16", {"out": _as(BF16)}, R,
         words("head_grad_sums", "out", "dtype Float", "BFloat16"), sample=2),
    # An fp32 grad over a 16-bit z (a head's fp32 output under autocast): out must be fp32 too.
    Case("head_grad_sums", "fp32-grad-half-out", {"grad": _as(F32)}, R,
         words("head_grad_sums", "out", "dtype Float", "grad", "Half"), dtype="fp16"),
    Case("head_grad_sums", "out-without-rowdot", {"rowdot": _none}, R,
         words("head_grad_sums", "both out and rowdot"), sample=2),
    Case("head_grad_sums", "rowdot-length", {"rowdot": _vec(1)}, R,
         words("head_grad_sums", "rowdot", "[5]", "[1]"), sample=2),
    Case("head_grad_sums", "rowdot-float64", {"rowdot": _as(F64)}, R,
         words("head_grad_sums", "rowdot", "float32", "Double"), sample=2),
    Case("head_grad_sums", "activation-without-a-and-c", {"a": _none, "c": _none}, R,
         words("head_grad_sums", "activation 'gelu'", "needs a and c"), sample=2),
    Case("head_grad_sums", "a-length", {"a": _vec(4)}, R,
         words("head_grad_sums", "a", "[3]", "[4]"), sample=2),
    Case("head_grad_sums", "activation-tanh", {"activation": "tanh"}, V,
         words("head_grad_sums", "unknown activation", "'tanh'"), sample=2),
    # head_grad_coefficients (sums, None, colsum, colsumsq, moments, bias, gamma, beta, None,
    # post_scale; training)
    Case("head_grad_coefficients", "sums-length", {"sums": _vec(9, F64)}, R,
         words("head_grad_coefficients", "sums", "float64 [7]", "[9]")),
    Case("head_grad_coefficients", "moments-float32", {"moments": _as(F32)}, R,
         words("head_grad_coefficients", "moments", "float64 [7]", "Float")),
    Case("head_grad_coefficients", "global_sums-length", {"global_sums": _vec(6, F64)}, R,
         words("head_grad_coefficients", "global_sums", "[7]", "[6]"), sample=1),
    Case("head_grad_coefficients", "training-without-colsum", {"colsum": _none}, R,
         words("head_grad_coefficients", "training", "need colsum and colsumsq")),
    Case("head_grad_coefficients", "colsumsq-float32", {"colsumsq": _as(F32)}, R,
         words("head_grad_coefficients", "colsumsq", "float64 [3]", "Float")),
    Case("head_grad_coefficients", "gamma-2d", {"gamma": _column}, R,
         words("head_grad_coefficients", "gamma", "1-D")),
    Case("head_grad_coefficients", "post_scale-length", {"post_scale": _vec(2)}, R,
         words("head_grad_coefficients", "post_scale", "1 or 3")),
    Case("head_grad_coefficients", "eps<0", {"eps": -1.0}, V,
         words("head_grad_coefficients", "eps", "non-negative")),
    # head_grad_z (grad, out, rowdot, z, coef [3, 3], a, c; activation 'gelu_tanh')
    Case("head_grad_z", "coef-column", {"coef": _rows(3, 1)}, R,
         words("head_grad_z", "coef", "float32 [3, 3]", "[3, 1]"), sample=3),
    Case("head_grad_z", "coef-two-rows", {"coef": _rows(2, 3)}, R,
         words("head_grad_z", "coef", "[3, 3]", "[2, 3]"), sample=3),
    Case("head_grad_z", "coef-float64", {"coef": _as(F64)}, R,
         words("head_grad_z", "coef", "float32", "Double"), sample=3),
    Case("head_grad_z", "activation-without-c", {"c": _none}, R,
         words("head_grad_z", "activation 'gelu_tanh'", "needs a and c"), sample=3),
    Case("head_grad_z", "grad-shape", {"grad": _rows(4, 3)}, R,
         words("head_grad_z", "grad", "[5, 3]", "[4, 3]"), sample=3),
    Case("head_grad_z", "out-without-rowdot", {"rowdot": _none}, R,
         words("head_grad_z", "both out and rowdot"), sample=3),
    # pack_moments (colsum, colsumsq, count, bias, pre_scale: sample 0 bias, sample 1 pre_scale)
    Case("pack_moments", "colsum-float32", {"colsum": _as(F32)}, R,
         words("pack_moments", "colsum", "float64 [3]", "Float")),
    Case("pack_moments", "colsum-2d", {"colsum": _column}, R,
         words("pack_moments", "colsum", "1-D", "[3, 1]")),
    Case("pack_moments", "colsumsq-length", {"colsumsq": _vec(4, F64)}, R,
         words("pack_moments", "colsumsq", "[3]", "[4]")),
    Case("pack_moments", "count-0", {"count": 0}, V, words("pack_moments", "count", ">= 1", "0")),
    Case("pack_moments", "bias-float64", {"bias": _as(F64)}, R,
         words("pack_moments", "not implemented", "'Double'")),
    Case("pack_moments", "bias-length", {"bias": _vec(4)}, R,
         words("pack_moments", "bias", "[3]", "[4]")),
    Case("pack_moments", "pre_scale-bf16", {"pre_scale": _vec(3, BF16)}, R,
         words("pack_moments", "pre_scale", "dtype Float", "bias", "BFloat16")),
    Case("pack_moments", "pre_scale-length", {"pre_scale": _vec(2)}, R,
         words("pack_moments", "pre_scale", "1 or 3"), sample=1),
    # merge_fold (rows [3, 7], bias, gamma, beta, None, post_scale)
    Case("merge_fold", "rows-float32", {"rows": _as(F32)}, R,
         words("merge_fold", "rows", "float64 [world, 7]", "Float [3, 7]")),
    Case("merge_fold", "rows-1d", {"rows": lambda v, d: v[0]}, R,
         words("merge_fold", "rows", "[world, 7]", "Double [7]")),
    Case("merge_fold", "rows-width", {"rows": lambda v, d: v[:, :6].contiguous()}, R,
         words("merge_fold", "rows", "[world, 7]", "[3, 6]")),
    Case("merge_fold", "no-rank", {"rows": lambda v, d: v[:0]}, R,
         words("merge_fold", "rows", "world >= 1", "[0, 7]")),
    Case("merge_fold", "rows-strided", {"rows": lambda v, d: v.t().contiguous().t()}, R,
         words("merge_fold", "rows", "contiguous")),
    Case("merge_fold", "beta-bf16", {"beta": _as(BF16)}, R,
         words("merge_fold", "beta", "dtype Float", "gamma", "BFloat16")),
    Case("merge_fold", "post_scale-length", {"post_scale": _vec(2)}, R,
         words("merge_fold", "post_scale", "1 or 3")),
    Case("merge_fold", "eps<0", {"eps": -1.0}, V, words("merge_fold", "eps", "non-negative")),
    # normalized_grad_sums (sums [7], moments [7], bias, gamma, None, post_scale)
    Case("normalized_grad_sums", "sums-float32", {"sums": _as(F32)}, R,
         words("normalized_grad_sums", "sums", "float64 [7]", "Float")),
    Case("normalized_grad_sums", "moments-length", {"moments": _vec(6, F64)}, R,
         words("normalized_grad_sums", "moments", "[7]", "[6]")),
    Case("normalized_grad_sums", "bias-float64", {"bias": _as(F64)}, R,
         words("normalized_grad_sums", "bias", "dtype Float", "gamma", "Double")),
    Case("normalized_grad_sums", "gamma-2d", {"gamma": _column}, R,
         words("normalized_grad_sums", "gamma", "1-D")),
    Case("normalized_grad_sums", "eps<0", {"eps": -1.0}, V,
         words("normalized_grad_sums", "eps", "non-negative")),
    # The hooks: a group name first; then their passes check before any collective (the group
    # named here does not exist, and is never looked up).
    Case("synced_batch_fold", "no-group", {"group_name": ""}, V,
         words("need a process group's group_name")),
    Case("synced_batch_fold", "colsum-float32", {"colsum": _as(F32), "group_name": "none"}, R,
         words("pack_moments", "colsum", "float64 [3]", "Float")),
    Case("synced_batch_fold", "count-0", {"count": 0, "group_name": "none"}, V,
         words("pack_moments", "count", ">= 1")),
    Case("synced_grad_sums", "no-group", {"group_name": ""}, V,
         words("need a process group's group_name")),
    Case("synced_grad_sums", "sums-length", {"sums": _vec(6, F64), "group_name": "none"}, R,
         words("normalized_grad_sums", "sums", "[7]", "[6]")),
    Case("synced_grad_sums", "eps<0", {"eps": -1.0, "group_name": "none"}, V,
         words("normalized_grad_sums", "eps", "non-negative")),
    # fused_head (x [5, 7], weight, bias, gamma, beta, scale [1], running_mean, running_var,
    # num_batches_tracked; training, softmax): its passes' checks, before anything is updated.
    Case("fused_head", "K-mismatch", {"weight": _rows(3, 8)}, R,
         words("shapes cannot be multiplied", "5x7", "8x3")),
    Case("fused_head", "x-3d", {"x": _3d}, R, words("gemm_colstats", "x", "2-D")),
    Case("fused_head", "precision-bogus", {"precision": "bogus"}, V,
         words("gemm_colstats", "precision", "'bogus'")),
    Case("fused_head", "training-batch-of-1", {"x": lambda v, d: v[:1]}, V,
         words("more than 1 value per channel")),
    # (bn_fold_train: the fold, the moments and the running statistics' update in one kernel)
    Case("fused_head", "eps<0", {"eps": -1.0}, V, words("bn_fold_train", "eps", "non-negative")),
    Case("fused_head", "beta-length", {"beta": _vec(4)}, R, words("bn_fold_train", "beta", "[3]")),
    Case("fused_head", "running_var-length", {"running_var": _vec(4)}, R,
         words("bn_fold_train", "running_var", "[3]", "[4]")),
    Case("fused_head", "nbt-int32", {"num_batches_tracked": _as(torch.int32)}, R,
         words("bn_fold_train", "num_batches_tracked", "int64")),
    Case("fused_head", "momentum>1", {"momentum": 1.5}, V,
         words("bn_fold_train", "momentum", "[0, 1]")),
    # ... for no backward (the same fold, then the pass in place over z)
    Case("fused_head", "no-backward-running_var-length", {"running_var": _vec(4)}, R,
         words("bn_fold_train", "running_var", "[3]", "[4]"), sample=7),
    Case("fused_head", "no-backward-momentum>1", {"momentum": 1.5}, V,
         words("bn_fold_train", "momentum", "[0, 1]"), sample=7),
    # ... eval: the running statistics folded
    Case("fused_head", "eval-running_var-bf16", {"running_var": _as(BF16)}, R,
         words("bn_fold_eval", "running_var", "BFloat16"), sample=3),
    # fused_linear (x [5, 7], weight [3, 7], bias [3]; precision 'ieee')
    Case("fused_linear", "K-mismatch", {"weight": _rows(3, 8)}, R,
         words("shapes cannot be multiplied", "5x7", "8x3")),
    Case("fused_linear", "x-3d", {"x": _3d}, R, words("fused_linear", "x", "2-D", "3-D")),
    Case("fused_linear", "weight-3d", {"weight": _3d}, R,
         words("fused_linear", "weight", "2-D", "3-D")),
    Case("fused_linear", "bias-length", {"bias": _vec(4)}, R,
         words("fused_linear", "bias", "[3]", "[4]")),
    Case("fused_linear", "bias-float64", {"bias": _as(F64)}, R,
         words("fused_linear", "bias", "float32, float16 or bfloat16", "Double")),
    Case("fused_linear", "precision-bogus", {"precision": "bogus"}, V,
         words("fused_linear", "precision", "'bogus'")),
    Case("fused_linear", "activation-bogus", {"activation": "tanh"}, V,
         words("fused_linear", "unknown activation", "'tanh'")),
    Case("fused_linear", "out_dtype-float64", {"out_dtype": F64}, R,
         words("fused_linear", "out_dtype", "Double")),
    # fused_head_backward (grad, x, weight, bias, gamma, beta, scale, z, out, colsum, colsumsq,
    # moments, needs; training, softmax)
    Case("fused_head_backward", "softmax-without-out", {"out": _none}, R,
         words("fused_head_backward", "softmax head needs out")),
    Case("fused_head_backward", "dx-without-weight", {"weight": _none}, R,
         words("fused_head_backward", "dX needs weight")),
    Case("fused_head_backward", "dw-without-x", {"x": _none}, R,
         words("fused_head_backward", "dW needs x")),
    Case("fused_head_backward", "training-without-colsum", {"colsum": _none}, R,
         words("head_grad_coefficients", "need colsum and colsumsq")),
    Case("fused_head_backward", "grad-shape", {"grad": _rows(5, 4)}, R,
         words("softmax_grad_rowdot", "grad", "[5, 3]", "[5, 4]")),
    Case("fused_head_backward", "moments-float32", {"moments": _as(F32)}, R,
         words("head_grad_coefficients", "moments", "float64")),
]


def _sample(op_name: str, device, dtype_id: str, index: int):
    args, kwargs = op_samples.samples(device, op_samples.DTYPES[dtype_id])[op_name][index]
    return list(args), dict(kwargs)


def _replace(op_name: str, args: list, kwargs: dict, bad: dict, device) -> None:
    """Replaces the arguments named in ``bad`` (schema names: positional or keyword)."""
    arguments = getattr(torch.ops.epifuse, op_name).default._schema.arguments
    position = {a.name: i for i, a in enumerate(arguments) if not a.kwarg_only}
    for name, value in bad.items():
        if name in position and position[name] < len(args):
            i = position[name]
            args[i] = value(args[i], device) if callable(value) else value
        else:
            assert any(a.name == name for a in arguments), (op_name, name)
            kwargs[name] = value(kwargs.get(name), device) if callable(value) else value


def _tensors(args) -> list:
    return [a for a in args if isinstance(a, torch.Tensor)]


def assert_refused(op_name: str, args: list, kwargs: dict, exc: type, pattern: str) -> None:
    """The op raises ``exc`` matching ``pattern`` and changes none of its arguments."""
    before = [t.clone() for t in _tensors(args)]
    with pytest.raises(exc, match=pattern):
        getattr(torch.ops.epifuse, op_name)(*args, **kwargs)
    for i, (t, b) in enumerate(zip(_tensors(args), before, strict=True)):
        assert torch.equal(t, b), f"tensor argument {i} changed by a refused call"


def _case_id(case: Case) -> str:
    return f"{case.op}-{case.id}" + ("" if case.dtype == "fp32" else f"-{case.dtype}")


@pytest.mark.parametrize("case", [pytest.param(c, id=_case_id(c)) for c in OP_ERRORS])
@pytest.mark.parametrize("device", DEVICES)
def test_op_refuses_bad_arguments(case, device, request):
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    args, kwargs = _sample(case.op, device, case.dtype, case.sample)
    _replace(case.op, args, kwargs, case.bad, device)
    assert_refused(case.op, args, kwargs, case.exc, case.pattern)


def test_every_op_has_error_cases():
    """Every tensor op of the library is in OP_ERRORS, but gemm_operand, which takes any tensor
    and dtype (Tensor.to's)."""
    covered = {c.op for c in OP_ERRORS}
    assert set(op_samples.op_names()) - covered == {"gemm_operand"}


def test_cuda_only_checks_are_gone():
    """CPU tensors are the ops' own inputs now (the float64 reference): no op asks for a CUDA
    tensor (the check "expected x to be a CUDA tensor" is not reached on CPU)."""
    args, kwargs = _sample("gemm_affine", "cpu", "fp32", 0)
    assert ops.gemm_affine(*args, **kwargs).device.type == "cpu"


# Mixed devices (CUDA): every tensor argument of a sample moved to the CPU is refused, with the
# dispatcher's wording and the op and argument named (the reference argument, moved, makes
# another argument the odd one out). (op, samples with every optional tensor between them,
# reference argument)
MIXED_DEVICE_SAMPLES = [
    ("gemm_affine", (0,), "x"), ("gemm_colstats", (0,), "x"), ("backward_matmul", (0,), "a"),
    ("bn_fold_train", (0, 2), "gamma"), ("bn_fold_eval", (0, 1), "gamma"),
    ("bn_fold_batch", (0, 1), "gamma"), ("update_running_stats", (0,), "running_mean"),
    ("affine_softmax", (0,), "z"), ("affine_softmax_", (0,), "z"), ("affine_", (0,), "z"),
    ("affine", (0,), "z"), ("softmax_grad_rowdot", (0,), "out"), ("head_grad_sums", (2,), "z"),
    ("head_grad_coefficients", (0, 1), "gamma"), ("head_grad_z", (3,), "z"),
    ("pack_moments", (0, 1), "colsum"), ("merge_fold", (2,), "gamma"),
    ("normalized_grad_sums", (2,), "gamma"),
]
MIXED_DEVICE_CASES = []
for _op, _samples, _ref in MIXED_DEVICE_SAMPLES:
    _names = [a.name for a in getattr(torch.ops.epifuse, _op).default._schema.arguments]
    for _index in _samples:
        _args, _ = _sample(_op, "cpu", "fp32", _index)
        MIXED_DEVICE_CASES += [
            pytest.param(_op, _index, _names[i], _ref, id=f"{_op}-{_index}-{_names[i]}")
            for i, a in enumerate(_args) if isinstance(a, torch.Tensor)]


@pytest.mark.hopper
@pytest.mark.parametrize("op_name,index,arg,ref", MIXED_DEVICE_CASES)
def test_op_refuses_a_tensor_on_another_device(op_name, index, arg, ref, healthy_cuda):
    args, kwargs = _sample(op_name, "cuda", "fp32", index)
    _replace(op_name, args, kwargs, {arg: lambda v, d: v.cpu()}, "cuda")
    named = rf"epifuse::{op_name}, argument \w+" if arg == ref else \
        rf"epifuse::{op_name}, argument {arg}\)"
    assert_refused(op_name, args, kwargs, RuntimeError,
                   "Expected all tensors to be on the same device.*" + named)


@pytest.mark.hopper
@pytest.mark.parametrize("op_name,arg", [("fused_head", "weight"), ("fused_head", "beta"),
                                         ("fused_head", "running_var"),
                                         ("fused_head", "num_batches_tracked"),
                                         ("fused_head_backward", "x"),
                                         ("fused_head_backward", "moments")])
def test_head_ops_refuse_a_tensor_on_another_device(op_name, arg, healthy_cuda):
    """The composites: one of their passes names the argument (as it calls it)."""
    args, kwargs = _sample(op_name, "cuda", "fp32", 0)
    _replace(op_name, args, kwargs, {arg: lambda v, d: v.cpu()}, "cuda")
    assert_refused(op_name, args, kwargs, RuntimeError,
                   r"Expected all tensors to be on the same device.*\(epifuse::\w+, argument \w+\)")


@pytest.mark.parametrize("device", DEVICES)
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
    with pytest.raises(RuntimeError, match=words(op_name, "unsupported operation", name,
                                                 "written-to z", "share memory")):
        getattr(ops, op_name)(z, a, c)
    assert torch.equal(z, before)
    # the same values in memory of their own run
    getattr(ops, op_name)(z, a.clone(), c.clone())
    assert not torch.equal(z, before)


@pytest.mark.parametrize("device", DEVICES)
def test_head_op_for_no_backward_refuses_inputs_requiring_grad(device, request):
    """fused_head(for_backward=False) records no autograd node: refused while an input requires
    grad under grad mode, before anything runs (the running statistics stay)."""
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    args, kwargs = _sample("fused_head", device, "fp32", 7)
    args[1] = args[1].clone().requires_grad_()
    assert_refused("fused_head", args, kwargs, RuntimeError,
                   words("fused_head", "for_backward=False", "requires grad"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setting", [{"activation": "tanh"}, {"out_dtype": torch.float16}],
                         ids=["activation", "out_dtype"])
def test_fused_head_refuses_bad_settings_before_updating_anything(setting, device, request):
    """A setting only the last pass reads is checked before the first pass runs: a refused call
    has not updated the running statistics."""
    if device == "cuda":
        request.getfixturevalue("healthy_cuda")
    args, kwargs = _sample("fused_head", device, "fp32", 0)
    exc = ValueError if "activation" in setting else RuntimeError
    assert_refused("fused_head", args, {**kwargs, **setting}, exc, next(iter(setting)))
