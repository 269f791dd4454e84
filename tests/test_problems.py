"""The problem modules: KernelBench convention and the ModelNew contract, on CPU.

Output comparisons run ModelNew's fused path on CPU tensors (fixture ``fused_on_cpu``: one
epifuse::fused_head call, its passes' float64 references) and assert, with ``op_calls``, that it
ran and which passes it sequenced: a CPU input as shipped takes the reference path, which is
Model's own code and so cannot disagree with it.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest
import torch
from torch import nn

from epifuse import head
from helpers import (FUSED_NODE, PROBLEMS, assert_head_grads_close, init_args, make_pair, rel_err,
                     traced_epifuse_ops)

NUMBERS = [pytest.param(84, id="p84"), pytest.param(39, id="p39")]
SCALES = {84: [(1,), (8,)], 39: [(8,), (1,)]}
SCALE_CASES = [pytest.param(n, s, id=f"p{n}-scale{s[0]}") for n in (84, 39) for s in SCALES[n]]
IN, OUT = 12, 8


def _fused_ops(number, training):
    """The ops of one fused forward without grad: one fused_head call and the passes it runs
    (training: the fold updating the running statistics, the pass in place over z; eval: the fold,
    then the GEMM with it in its epilogue)."""
    last = ["affine_softmax_" if number == 84 else "affine_"]
    return ["fused_head", "gemm_colstats", "bn_fold_train", *last] if training else \
        ["fused_head", "bn_fold_eval", "gemm_affine",
         *(["affine_softmax_"] if number == 84 else [])]


@pytest.mark.parametrize("number", NUMBERS)
def test_file_follows_kernelbench_convention(number, fused_on_cpu, op_calls):
    """A harness exec()s the file's source and looks the names up."""
    source = Path(PROBLEMS[number].__file__).read_text()
    scope: dict = {}
    exec(compile(source, f"problem_{number}.py", "exec"), scope)
    for name in ("Model", "ModelNew", "get_inputs", "get_init_inputs"):
        assert name in scope, name
    (x,) = scope["get_inputs"]()
    init = scope["get_init_inputs"]()
    assert x.shape == (scope["batch_size"], scope["in_features"]) and x.dtype == torch.float32
    assert init[:2] == [scope["in_features"], scope["out_features"]]
    # Small instances built from the exec'd classes run and agree.
    small = init_args(number, IN, OUT)
    torch.manual_seed(0)
    ref = scope["Model"](*small)
    torch.manual_seed(0)
    new = scope["ModelNew"](*small)
    x = torch.rand(4, IN)
    with torch.no_grad():
        assert rel_err(new(x), ref(x)) < 1e-6
    assert op_calls == _fused_ops(number, training=True)


def test_kernelbench_constants():
    p84, p39 = PROBLEMS[84], PROBLEMS[39]
    assert p84.get_init_inputs() == [8192, 8192, 1e-5, 0.1, (1,)] and p84.batch_size == 1024
    assert p39.get_init_inputs() == [4096, 4096, (4096,)] and p39.batch_size == 16384


@pytest.mark.parametrize("number", NUMBERS)
def test_signature_matches_model(number):
    module = PROBLEMS[number]
    ref = inspect.signature(module.Model.__init__).parameters
    new = inspect.signature(module.ModelNew.__init__).parameters
    assert list(new)[:len(ref)] == list(ref)
    assert all(new[k].default == ref[k].default for k in ref)
    extra = {"precision": None, "sync_batchnorm": False, "process_group": None}
    assert list(new)[len(ref):] == list(extra)
    for name, default in extra.items():
        assert new[name].kind is inspect.Parameter.KEYWORD_ONLY and new[name].default is default


@pytest.mark.parametrize("number,scale", SCALE_CASES)
def test_same_seed_same_parameters(number, scale):
    module, args = PROBLEMS[number], init_args(number, IN, OUT, scale)
    torch.manual_seed(7)
    ref = module.Model(*args)
    torch.manual_seed(7)
    new = module.ModelNew(*args)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in new.named_parameters()]
    ref_state, new_state = ref.state_dict(), new.state_dict()
    assert list(ref_state) == list(new_state)
    for key in ref_state:
        assert torch.equal(ref_state[key], new_state[key]), key
    for name in ("gemm", "bn", "scale") + (("softmax",) if number == 84 else ()):
        assert type(getattr(new, name)) is type(getattr(ref, name)), name
    # A different seed gives different weights: the equality above is not vacuous.
    torch.manual_seed(8)
    assert not torch.equal(module.Model(*args).gemm.weight, ref.gemm.weight)


@pytest.mark.parametrize("number", NUMBERS)
def test_state_dict_loads_both_ways(number):
    ref, new = make_pair(number, init_args(number, IN, OUT), seed=1)
    other_ref, other_new = make_pair(number, init_args(number, IN, OUT), seed=2)
    other_new.load_state_dict(ref.state_dict())  # Model -> ModelNew (strict)
    other_ref.load_state_dict(new.state_dict())  # ModelNew -> Model (strict)
    for key, value in ref.state_dict().items():
        assert torch.equal(other_new.state_dict()[key], value)
        assert torch.equal(other_ref.state_dict()[key], value)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["mom0.1", "momNone"])
@pytest.mark.parametrize("number,scale", SCALE_CASES)
def test_train_then_eval_matches_model(number, scale, momentum, fused_on_cpu, op_calls):
    ref, new = make_pair(number, init_args(number, IN, OUT, scale, momentum=momentum))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _ in range(3):
            x = torch.rand(16, IN, generator=g)
            assert head.fast_path_reason(new.train(), x) is None
            assert rel_err(new(x), ref.train()(x)) < 1e-6
        for key, value in ref.bn.state_dict().items():  # running stats and num_batches_tracked
            assert rel_err(new.bn.state_dict()[key], value) < 1e-6, key
        assert new.bn.num_batches_tracked.item() == 3
        x = torch.rand(16, IN, generator=g)
        assert rel_err(new.eval()(x), ref.eval()(x)) < 1e-6
    assert op_calls == _fused_ops(number, True) * 3 + _fused_ops(number, False)


@pytest.mark.parametrize("number", NUMBERS)
def test_cpu_input_as_shipped_takes_reference_path(number, op_calls):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    x = torch.rand(16, IN)
    assert "not CUDA" in head.fast_path_reason(new, x)
    assert torch.equal(new(x), ref(x))  # Model's own code, bit for bit
    assert op_calls == []


@pytest.mark.parametrize("number", NUMBERS)
def test_train_eval_flags_reach_submodules(number):
    _, new = make_pair(number, init_args(number, IN, OUT))
    assert new.eval().bn.training is False
    assert new.train().bn.training is True


@pytest.mark.parametrize("number", NUMBERS)
@pytest.mark.parametrize("convert", ["half", "bfloat16", "to-float64", "double"])
def test_dtype_conversions_keep_structure(number, convert, fused_on_cpu, op_calls):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    dtype = {"half": torch.float16, "bfloat16": torch.bfloat16, "to-float64": torch.float64,
             "double": torch.float64}[convert]
    if convert == "to-float64":
        new = new.to("cpu", dtype)
        ref = ref.to("cpu", dtype)
    else:
        new, ref = getattr(new, convert)(), getattr(ref, convert)()
    assert new.precision is None and isinstance(new.gemm, nn.Linear)
    for name, p in new.named_parameters():
        assert p.dtype == dtype, name
    assert new.bn.running_mean.dtype == dtype
    assert new.bn.num_batches_tracked.dtype == torch.int64
    x = torch.rand(6, IN, dtype=dtype)
    with torch.no_grad():
        y_new, y_ref = new.eval()(x), ref.eval()(x)
    if dtype == torch.float64:  # no kernel for it: the reference path, i.e. Model's code
        assert "dtype" in head.fast_path_reason(new, x) and op_calls == []
        assert torch.equal(y_new, y_ref)
    else:  # 16-bit: the fused path, rounded once from float64 (Model rounds at every step)
        assert op_calls == _fused_ops(number, training=False)
        assert y_new.dtype == dtype and rel_err(y_new, y_ref) < 2e-2


@pytest.mark.parametrize("number", NUMBERS)
def test_deepcopy_and_precision_attribute(number):
    _, new = make_pair(number, init_args(number, IN, OUT), precision="tf32")
    clone = copy.deepcopy(new)
    assert clone.precision == "tf32"
    assert "precision" not in new.state_dict()


@pytest.mark.parametrize("number", NUMBERS)
def test_bad_inputs_raise_pytorch_errors(number):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        new.train()(torch.rand(1, IN))
    with pytest.raises(RuntimeError):
        new(torch.rand(4, IN + 1))
    with pytest.raises(RuntimeError):
        new(torch.rand(4, IN, dtype=torch.float64))  # dtype mismatch with the float32 weights


@pytest.mark.parametrize("number", NUMBERS)
def test_gradients_match_model(number, fused_on_cpu):
    ref, new = make_pair(number, init_args(number, IN, OUT))
    x = torch.rand(10, IN, requires_grad=True)
    y_ref = ref(x)
    with traced_epifuse_ops() as calls:
        y_new = new(x)
    assert y_new.grad_fn.name() == FUSED_NODE
    # With autograd the output is written out of place (z is saved for the backward), and the op
    # folds, keeps the moments and updates the running statistics in one kernel (bn_fold_train).
    assert calls == ["fused_head", "gemm_colstats", "bn_fold_train",
                     "affine_softmax" if number == 84 else "affine"]
    w = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *ref.parameters()])
    g_new = torch.autograd.grad((y_new * w).sum(), [x, *new.parameters()])
    assert_head_grads_close(number, True, new, g_new, g_ref, 1e-5)


# torch 2.14 deprecates torch.jit.script itself (a FutureWarning); what is tested is our error.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("number", NUMBERS)
def test_torch_jit_script_raises_a_clear_error(number):
    _, new = make_pair(number, init_args(number, IN, OUT))
    with pytest.raises(RuntimeError, match=r"ModelNew \(epifuse\) cannot be compiled with "
                                           r"torch.jit.script.*torch.compile"):
        torch.jit.script(new)
