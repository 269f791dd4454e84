"""Activations inside the fused head: ``Linear -> BatchNorm1d [-> scale] -> activation [->
softmax]``, built with ``FusedLinearBatchNorm(activation=...)`` or found by ``epifuse.fuse``.

On CPU the fused path runs through the ops' float64 references (``fused_on_cpu``) and ``op_calls``
(one fused_head call and the passes it sequenced) / the autograd node prove it ran; the unfused
modules are the reference. On the GPU (marked ``hopper``) the CUDA kernels run and the results are
held to a float64 twin, no farther from it than eager PyTorch, in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import epifuse
from epifuse import fold, head
from epifuse.head_config import HeadConfig
from epifuse.nn import DEFAULT_NEGATIVE_SLOPE, FusedLinearBatchNorm
from epifuse.fusion import _call_member
from fuse_models import fused_graph, fused_pair, randomize_bn_
from helpers import FUSED_NODE, assert_no_farther_from_float64_than_eager, fused_nodes, rel_err

IN, OUT, ROWS = 24, 16, 32
CUDA = torch.device("cuda")

# The activations a head takes: the module a model would hold (the fused head is given the same
# module) and the HeadConfig name it stands for.
ACTIVATIONS = {
    "relu": (lambda: nn.ReLU(inplace=True), "relu"),
    "leaky_relu0.2": (lambda: nn.LeakyReLU(0.2), "leaky_relu"),
    "gelu": (nn.GELU, "gelu"),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), "gelu_tanh"),
    "silu": (nn.SiLU, "silu"),
}
# Head layouts: BatchNorm1d keyword arguments and where the scale sits (None: no scale).
HEADS = {
    "bn": ({}, None),
    "bn(affine=False)*scale": ({"affine": False}, "after_bn"),
    "scale*bn(track_running_stats=False)": ({"track_running_stats": False}, "before_bn"),
}


class Unfused(nn.Module):
    """The head's modules called in order, under the fused head's attribute names."""

    def __init__(self, gemm: nn.Linear, bn: nn.BatchNorm1d, scale, scale_position, act: nn.Module,
                 softmax: bool):
        super().__init__()
        self.gemm, self.bn, self.act = gemm, bn, act
        self.scale = scale
        self.scale_position, self.softmax = scale_position, softmax

    def forward(self, x):
        y = self.gemm(x)
        if self.scale_position == "before_bn":
            y = y * self.scale
        y = self.bn(y)
        if self.scale_position == "after_bn":
            y = y * self.scale
        y = self.act(y)
        return torch.softmax(y, dim=1) if self.softmax else y


def _signed_scale(n: int) -> nn.Parameter:
    # Some columns negative: relu(s * y) != s * relu(y) there, so the order of scale and
    # activation shows.
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    return nn.Parameter((torch.rand(n, generator=g) + 0.5) * sign)


def _pair(head_id: str, act_id: str, softmax: bool, device="cpu", in_f=IN, out_f=OUT):
    """(unfused modules, fused head) over copies of the same modules."""
    bn_kwargs, position = HEADS[head_id]
    make_act, _ = ACTIVATIONS[act_id]
    torch.manual_seed(0)
    lin, bn = nn.Linear(in_f, out_f), randomize_bn_(nn.BatchNorm1d(out_f, **bn_kwargs), seed=3)
    scale = _signed_scale(out_f) if position else None
    act = make_act()
    ref = Unfused(copy.deepcopy(lin), copy.deepcopy(bn), copy.deepcopy(scale), position, act,
                  softmax)
    new = FusedLinearBatchNorm(lin, bn, scale, scale_position=position or "after_bn",
                               activation=act, softmax=softmax)
    return ref.to(device), new.to(device)


def _batch_statistics(head_id: str, training: bool) -> bool:
    return training or not HEADS[head_id][0].get("track_running_stats", True)


def _expected_ops(head_id: str, training: bool, softmax: bool) -> list[str]:
    """One forward's ops without grad (fused_head, then the passes it runs): the activation inside
    the last pass; in eval without a softmax, inside the GEMM's epilogue (no pass of its own)."""
    last = "affine_softmax_" if softmax else "affine_"
    if _batch_statistics(head_id, training):
        tracking = HEADS[head_id][0].get("track_running_stats", True)
        return ["fused_head", "gemm_colstats", "bn_fold_train" if tracking else "bn_fold_batch",
                last]
    return ["fused_head", "bn_fold_eval", "gemm_affine"] + (["affine_softmax_"] if softmax else [])


def _assert_same_state(new: nn.Module, ref: nn.Module, tol: float = 1e-6) -> None:
    new_state, ref_state = new.state_dict(), ref.state_dict()
    assert set(new_state) == set(ref_state)
    for name, value in ref_state.items():
        assert rel_err(new_state[name], value) < tol, name


# --------------------------------------------------------------------------- FusedLinearBatchNorm

@pytest.mark.parametrize("softmax", [False, True], ids=["", "softmax"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("head_id", HEADS)
@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_forward_matches_the_modules_cpu(fused_on_cpu, op_calls, act_id, head_id, training,
                                         softmax):
    ref, new = _pair(head_id, act_id, softmax)
    assert new.activation == ACTIVATIONS[act_id][1]
    ref.train(training), new.train(training)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(3):
            x = torch.rand(ROWS, IN, generator=g)
            assert head.fast_path_reason(new, x) is None  # on CPU only with fused_on_cpu
            assert rel_err(new(x), ref(x)) < 1e-5, step
            _assert_same_state(new, ref)
    assert op_calls == _expected_ops(head_id, training, softmax) * 3, op_calls


@pytest.mark.parametrize("softmax", [False, True], ids=["", "softmax"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("head_id", HEADS)
@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_gradients_match_the_modules_cpu(fused_on_cpu, act_id, head_id, training, softmax):
    ref, new = _pair(head_id, act_id, softmax)
    ref.train(training), new.train(training)
    x = torch.rand(ROWS, IN, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(ROWS, OUT, generator=torch.Generator().manual_seed(4))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    y_new, y_ref = new(xs[0]), ref(xs[1])
    assert y_new.grad_fn.name() == FUSED_NODE  # the fused backward, not the modules' autograd
    y_new.backward(grad), y_ref.backward(grad)
    assert rel_err(y_new, y_ref) < 1e-5
    assert rel_err(xs[0].grad, xs[1].grad) < 1e-5
    new_params, ref_params = dict(new.named_parameters()), dict(ref.named_parameters())
    assert set(new_params) == set(ref_params)
    # Under batch statistics BatchNorm removes the Linear's bias and (up to eps) a scale before
    # it: their gradients are ~0 and eager's are rounding noise, so both are held to the scale
    # of the weight's gradient instead.
    vanishing = {"gemm.bias"} | ({"scale"} if HEADS[head_id][1] == "before_bn" else set())
    weight_scale = new_params["gemm.weight"].grad.abs().max()
    for name, p in new_params.items():
        if name in vanishing and _batch_statistics(head_id, training):
            assert (p.grad - ref_params[name].grad).abs().max() <= 1e-5 * weight_scale, name
            continue
        assert rel_err(p.grad, ref_params[name].grad) < 1e-5, name
    _assert_same_state(new, ref)


@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_reference_path_applies_the_activation(fused_on_cpu, op_calls, act_id):
    """Inputs the kernels do not cover (here float64) run the modules in order, activation too."""
    ref, new = _pair("bn", act_id, softmax=True)
    ref, new = ref.double(), new.double()
    x = torch.rand(ROWS, IN, dtype=torch.float64)
    assert "dtype" in head.fast_path_reason(new, x)
    assert torch.equal(new(x), ref(x)) and op_calls == []
    _assert_same_state(new, ref, tol=1e-15)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_reference_head_applies_the_activation_after_the_scale(act_id, training):
    """head.reference_head (the synchronized path's math): the activation after the scale,
    before the softmax."""
    make_act, name = ACTIVATIONS[act_id]
    act = make_act()
    torch.manual_seed(0)
    lin, bn = nn.Linear(IN, OUT), randomize_bn_(nn.BatchNorm1d(OUT), seed=3)
    scale = _signed_scale(OUT)
    x = torch.rand(ROWS, IN)
    config = HeadConfig(training=training, softmax=True, activation=name,
                        negative_slope=getattr(act, "negative_slope", DEFAULT_NEGATIVE_SLOPE))
    with torch.no_grad():
        y = head.reference_head(x, lin.weight, lin.bias, bn.weight, bn.bias, scale,
                                bn.running_mean, bn.running_var, config)
        expected = Unfused(lin, bn.train(training), scale, "after_bn", act, True)(x)
    assert rel_err(y, expected) < 1e-6


@pytest.mark.parametrize("act_id", ["leaky_relu0.2", "gelu_tanh"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compile_fullgraph_traces_an_activation_head(fused_on_cpu, training, act_id):
    torch._dynamo.reset()
    ref, new = _pair("bn", act_id, softmax=True)
    ref.train(training), new.train(training)
    compiled = torch.compile(new, fullgraph=True, backend="aot_eager")
    x = torch.rand(ROWS, IN, requires_grad=True)
    y_new, y_ref = compiled(x), ref(x)
    assert rel_err(y_new, y_ref) < 1e-5
    w = torch.randn_like(y_ref)
    (g_new,) = torch.autograd.grad((y_new * w).sum(), [x])
    (g_ref,) = torch.autograd.grad((y_ref * w).sum(), [x])
    assert rel_err(g_new, g_ref) < 1e-5
    with torch.no_grad():
        assert rel_err(compiled(x), ref(x)) < 1e-5
    _assert_same_state(new, ref)


@pytest.mark.parametrize("given,name,slope", [
    (None, "", DEFAULT_NEGATIVE_SLOPE),
    ("relu", "relu", DEFAULT_NEGATIVE_SLOPE),
    (nn.ReLU(), "relu", DEFAULT_NEGATIVE_SLOPE),
    (nn.ReLU(inplace=True), "relu", DEFAULT_NEGATIVE_SLOPE),
    ("leaky_relu", "leaky_relu", DEFAULT_NEGATIVE_SLOPE),
    (nn.LeakyReLU(0.2, inplace=True), "leaky_relu", 0.2),
    ("gelu", "gelu", DEFAULT_NEGATIVE_SLOPE),
    (nn.GELU(), "gelu", DEFAULT_NEGATIVE_SLOPE),
    ("gelu_tanh", "gelu_tanh", DEFAULT_NEGATIVE_SLOPE),
    (nn.GELU(approximate="tanh"), "gelu_tanh", DEFAULT_NEGATIVE_SLOPE),
    ("silu", "silu", DEFAULT_NEGATIVE_SLOPE),
    (nn.SiLU(inplace=True), "silu", DEFAULT_NEGATIVE_SLOPE),
], ids=lambda v: repr(v) if not isinstance(v, (str, float)) else None)
def test_activation_argument_forms(given, name, slope):
    module = FusedLinearBatchNorm(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), activation=given)
    assert (module.activation, module.negative_slope) == (name, slope)
    assert (module._spec.activation, module._spec.negative_slope) == (name, slope)
    assert not any(isinstance(m, type(given)) for m in module.modules())  # kept by name only
    assert f"activation={epifuse.nn.describe_activation(name, slope)}," in repr(module)


def test_activation_names_and_defaults_agree():
    assert head.ACTIVATION_NAMES == fold.ACTIVATIONS  # the reference math's (the ops') names
    assert tuple(head._ACTIVATIONS) == fold.ACTIVATIONS  # the reference path has each of them
    assert head.ACTIVATION_NAMES == ("", "relu", "leaky_relu", "gelu", "gelu_tanh", "silu")
    assert DEFAULT_NEGATIVE_SLOPE == HeadConfig().negative_slope == nn.LeakyReLU().negative_slope
    assert HeadConfig().activation == ""
    module = FusedLinearBatchNorm(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT),
                                  activation="leaky_relu", negative_slope=0.3, softmax=True)
    assert (module.activation, module.negative_slope) == ("leaky_relu", 0.3)
    assert ("scale=none, activation=leaky_relu(negative_slope=0.3), softmax=dim=1"
            in repr(module))
    gelu = FusedLinearBatchNorm(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), activation="gelu_tanh")
    assert "activation=gelu(approximate='tanh')" in repr(gelu)
    plain = FusedLinearBatchNorm(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT))
    assert "activation=none" in repr(plain)


def test_activation_argument_rejects_what_the_head_cannot_apply():
    class ClippedReLU(nn.ReLU):  # a subclass may compute something else: not taken
        def forward(self, x):
            return super().forward(x).clamp_max(6)

    lin, bn = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
    cases = [
        (dict(activation="tanh"), ValueError, "activation must be None, one of 'relu'"),
        (dict(activation="none"), ValueError, "got 'none'"),
        (dict(activation=nn.Tanh()), ValueError,
         r"Tanh\(\) is not one the head can apply.*nn.ReLU"),
        (dict(activation=nn.GELU(approximate="erf")), ValueError, "approximate='none' or 'tanh'"),
        (dict(activation=ClippedReLU()), ValueError, "ClippedReLU"),
        (dict(activation=F.relu), TypeError, "a str or an nn.Module, got function"),
        (dict(activation=1), TypeError, "got int"),
        (dict(activation="relu", negative_slope=0.2), ValueError,
         "negative_slope is for activation='leaky_relu' only"),
        (dict(activation=nn.LeakyReLU(0.1), negative_slope=0.2), ValueError,
         "negative_slope is for activation='leaky_relu' only"),
        (dict(activation="leaky_relu", negative_slope="0.2"), TypeError,
         "negative_slope must be a float or None, got str"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            FusedLinearBatchNorm(lin, bn, **kwargs)


# --------------------------------------------------------------------------- epifuse.fuse

def projection_mlp() -> nn.Module:
    """The self-supervised projection head (SimCLR / MoCo v3)."""
    return nn.Sequential(nn.Linear(IN, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                         nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                         nn.Linear(32, OUT), nn.BatchNorm1d(OUT, affine=False))


def classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, 32), nn.BatchNorm1d(32), nn.GELU(),
                         nn.Linear(32, OUT), nn.BatchNorm1d(OUT), nn.Softmax(dim=1))


# One head per functional spelling of an activation: (its forward from the BatchNorm's output,
# the report's entry for it). Each out of place, so that the unfused model trains too.
FUNCTIONAL_FORMS = [
    (lambda h: F.relu(h), "relu"),
    (torch.relu, "relu"),
    (lambda h: h.relu(), "relu"),
    (lambda h: F.gelu(h), "gelu"),
    (lambda h: F.gelu(h, approximate="tanh"), "gelu(approximate='tanh')"),
    (lambda h: F.leaky_relu(h, 0.1), "leaky_relu(negative_slope=0.1)"),
    (lambda h: torch.nn.functional.leaky_relu(h), "leaky_relu(negative_slope=0.01)"),
    (lambda h: F.silu(h), "silu"),
]
# The in-place spellings (an in-place activation of BatchNorm's output has no reader to spoil).
INPLACE_FORMS = [
    (lambda h: F.relu(h, inplace=True), "relu"),
    (torch.relu_, "relu"),
    (F.relu_, "relu"),
    (lambda h: h.relu_(), "relu"),
    (lambda h: F.leaky_relu(h, negative_slope=0.2, inplace=True), "leaky_relu(negative_slope=0.2)"),
    (lambda h: F.leaky_relu_(h, 0.3), "leaky_relu(negative_slope=0.3)"),
    (lambda h: torch.nn.functional.silu(h, inplace=True), "silu"),
]


class Forms(nn.Module):
    """Linear -> BatchNorm1d -> one of ``forms`` per head, and a last head with a negative scale,
    SiLU and a softmax: the activation after the scale, the softmax after the activation."""

    def __init__(self, forms):
        super().__init__()
        self.forms = [f for f, _ in forms]
        self.fcs = nn.ModuleList(nn.Linear(IN, OUT) for _ in forms)
        self.bns = nn.ModuleList(nn.BatchNorm1d(OUT) for _ in forms)
        self.last, self.last_bn = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
        self.temperature = nn.Parameter(torch.full((1,), -1.5))

    def forward(self, x):
        outs = [f(bn(fc(x))) for f, fc, bn in zip(self.forms, self.fcs, self.bns)]
        last = torch.softmax(F.silu(self.last_bn(self.last(x)) * self.temperature), dim=-1)
        return torch.cat(outs + [last], dim=1)


def _expected_forms(forms) -> list[str]:
    return [f"fcs.{i} -> bns.{i} -> {entry}" for i, (_, entry) in enumerate(forms)] + [
        "last -> last_bn -> * temperature -> silu -> softmax(dim=-1)"]


class ActivationNearMisses(nn.Module):
    """Activations fuse() leaves as they are, each after a head that does fuse: a ReLU whose output
    is read twice, activations the head has not (nn.Tanh, F.elu), a BatchNorm output read by a
    ReLU and a residual sum; and a GELU fused but a softmax over the batch after it not."""

    def __init__(self):
        super().__init__()
        for name in ("shared", "tanh", "elu", "residual", "cols"):
            setattr(self, name, nn.Linear(IN, OUT))
            setattr(self, f"{name}_bn", nn.BatchNorm1d(OUT))
        self.tanh_act = nn.Tanh()

    def forward(self, x):
        h = F.relu(self.shared_bn(self.shared(x)))
        a = h + torch.sigmoid(h)  # the ReLU's output read twice
        b = self.tanh_act(self.tanh_bn(self.tanh(x)))
        c = F.elu(self.elu_bn(self.elu(x)))
        u = self.residual_bn(self.residual(x))
        d = F.relu(u) + u  # the BatchNorm's output read by the ReLU and the sum
        e = torch.softmax(F.gelu(self.cols_bn(self.cols(x))), dim=0)
        return a + b + c + d + e


def _called_modules(model: nn.Module) -> set[str]:
    """The submodules the fused forward (fx's GraphModule) still calls."""
    nodes = fused_graph(model).nodes
    return ({n.target for n in nodes if n.op == "call_module"}  # the fused heads
            | {n.args[1] for n in nodes if n.op == "call_function" and n.target is _call_member})


def _forward_both(original, model, training, steps=3, tol=1e-5):
    g = torch.Generator().manual_seed(1)
    original.train(training), model.train(training)
    with torch.no_grad():
        for step in range(steps):
            x = torch.rand(ROWS, IN, generator=g)
            assert rel_err(model(x), original(x)) < tol, step
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert rel_err(a, b) < 1e-5, name


def _assert_every_head_fused(calls, training: bool, heads: int, steps: int = 3) -> None:
    """_forward_both's forwards (no grad) ran every head fused: one fused_head call per head and
    step, each with its GEMM (gemm_colstats in training, gemm_affine with the fold in eval)."""
    gemm = "gemm_colstats" if training else "gemm_affine"
    assert calls.count("fused_head") == calls.count(gemm) == heads * steps, calls


def _gradients_match(original, model, training):
    original.train(training), model.train(training)
    x = torch.rand(ROWS, IN, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y_new, y_ref = model(x), original(x)
    assert fused_nodes(y_new) == len(model._epifuse_heads)  # every head's fused backward
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3))
    names = ["x"] + [name for name, _ in model.named_parameters()]
    g_new = torch.autograd.grad((y_new * w).sum(), [x, *model.parameters()])
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *original.parameters()])
    # Under batch statistics the Linear biases' gradients are 0 (BatchNorm removes any
    # per-column shift) and eager's are rounding noise: held to the weights' gradients' scale.
    biases = {f"{name}.bias" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    weight_scale = max(g.abs().max() for n, g in zip(names, g_ref) if n.endswith("weight"))
    for name, a, b in zip(names, g_new, g_ref, strict=True):
        if training and name in biases:
            assert (a - b).abs().max() <= 1e-5 * weight_scale, name
        else:
            assert rel_err(a, b) < 1e-5, name


def test_fuse_takes_the_projection_mlp_with_its_relus(fused_on_cpu, op_calls):
    original, model, report = fused_pair(projection_mlp)
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu", "3 -> 4 -> relu", "6 -> 7"]
    assert report.skipped == [] and all(not f.note for f in report.fused)
    assert [h.activation for h in model._epifuse_heads] == ["relu", "relu", ""]
    assert _called_modules(model) == {"epifuse_head_0", "epifuse_head_1", "epifuse_head_2"}
    assert "fused 0 -> 1 -> relu" in str(report)
    _forward_both(original, model, training=True)
    assert op_calls == ["fused_head", "gemm_colstats", "bn_fold_train", "affine_"] * 9
    op_calls.clear()
    _forward_both(original, model, training=False)
    # the ReLUs in the GEMMs' epilogues
    assert op_calls == ["fused_head", "bn_fold_eval", "gemm_affine"] * 9
    for training in (True, False):
        _gradients_match(original, model, training)


def test_fuse_takes_the_classifier_with_its_gelu(fused_on_cpu, op_calls):
    original, model, report = fused_pair(classifier)
    assert [f.where for f in report.fused] == ["0 -> 1 -> gelu", "3 -> 4 -> softmax(dim=1)"]
    assert report.skipped == []
    assert [h.activation for h in model._epifuse_heads] == ["gelu", ""]
    assert _called_modules(model) == {"epifuse_head_0", "epifuse_head_1"}
    _forward_both(original, model, training=True)
    assert op_calls == ["fused_head", "gemm_colstats", "bn_fold_train", "affine_",
                        "fused_head", "gemm_colstats", "bn_fold_train", "affine_softmax_"] * 3
    op_calls.clear()
    _forward_both(original, model, training=False)
    assert op_calls == ["fused_head", "bn_fold_eval", "gemm_affine",
                        "fused_head", "bn_fold_eval", "gemm_affine", "affine_softmax_"] * 3
    for training in (True, False):
        _gradients_match(original, model, training)


def test_fuse_takes_the_functional_forms(fused_on_cpu, op_calls):
    original, model, report = fused_pair(lambda: Forms(FUNCTIONAL_FORMS))
    assert [f.where for f in report.fused] == _expected_forms(FUNCTIONAL_FORMS)
    assert report.skipped == [] and all(not f.note for f in report.fused)
    graph = fused_graph(model)
    assert not [n for n in graph.nodes if n.op in ("call_function", "call_method")
                and n.target not in (torch.cat, _call_member)]  # every activation inside a head
    for training in (True, False):
        op_calls.clear()
        _forward_both(original, model, training)
        _assert_every_head_fused(op_calls, training, heads=9)
        _gradients_match(original, model, training)


def test_fuse_takes_the_inplace_forms(fused_on_cpu, op_calls):
    original, model, report = fused_pair(lambda: Forms(INPLACE_FORMS))
    assert [f.where for f in report.fused] == _expected_forms(INPLACE_FORMS)
    for training in (True, False):
        op_calls.clear()
        _forward_both(original, model, training)
        _assert_every_head_fused(op_calls, training, heads=8)


def test_activations_fuse_leaves_outside(fused_on_cpu, op_calls):
    original, model, report = fused_pair(ActivationNearMisses)
    fused = {f.where: f.note for f in report.fused}
    assert list(fused) == ["shared -> shared_bn", "tanh -> tanh_bn", "elu -> elu_bn",
                           "residual -> residual_bn", "cols -> cols_bn -> gelu"]
    assert fused["shared -> shared_bn"] == "relu left unfused: its output has 2 consumers"
    assert "2 consumers" in fused["residual -> residual_bn"]
    assert "dim 0" in fused["cols -> cols_bn -> gelu"]
    assert fused["tanh -> tanh_bn"] == fused["elu -> elu_bn"] == ""
    assert report.skipped == []
    assert "tanh_act" in _called_modules(model)  # the module runs as before
    graph = fused_graph(model)
    left = {n.target for n in graph.nodes if n.op == "call_function"}
    assert {F.relu, F.elu, torch.softmax} <= left and F.gelu not in left
    for training in (True, False):
        op_calls.clear()
        _forward_both(original, model, training)
        _assert_every_head_fused(op_calls, training, heads=5)
        _gradients_match(original, model, training)


# --------------------------------------------------------------------------- GPU

@pytest.mark.hopper
@pytest.mark.parametrize("softmax", [False, True], ids=["", "softmax"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_activations_on_gpu_no_farther_from_float64_than_eager(act_id, training, softmax):
    # 1024 x 1024 -> 1024: at PyTorch's default precision the split 3x GEMM runs (Hopper).
    ref, new = _pair("bn", act_id, softmax, device="cuda", in_f=1024, out_f=1024)
    ref.train(training), new.train(training)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(1024, 1024, device="cuda", generator=g)
    grad = torch.randn(1024, 1024, device="cuda", generator=g)
    assert head.fast_path_reason(new, x) is None
    assert_no_farther_from_float64_than_eager(ref, new, x, grad, _assert_same_state,
                                              bias_cancels=training)


@pytest.mark.hopper
@pytest.mark.parametrize("softmax", [False, True], ids=["", "softmax"])
@pytest.mark.parametrize("act_id", ACTIVATIONS)
def test_activations_under_bf16_autocast_no_farther_from_float64_than_eager(act_id, softmax):
    ref, new = _pair("bn", act_id, softmax, device="cuda", in_f=1024, out_f=1024)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(1024, 1024, device="cuda", generator=g)
    grad = torch.randn(1024, 1024, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        # The dtype eager gives: the activation keeps bf16, a softmax returns fp32.
        assert new(x).dtype == ref(x).dtype == (torch.float32 if softmax else torch.bfloat16)
    ref, new = _pair("bn", act_id, softmax, device="cuda", in_f=1024, out_f=1024)  # fresh stats

    def same_state(a, b):  # statistics of the bf16 GEMM's output, both
        _assert_same_state(a, b, tol=1e-3)

    assert_no_farther_from_float64_than_eager(ref, new, x, grad, same_state, bias_cancels=True,
                                              autocast=torch.bfloat16)


@pytest.mark.hopper
@pytest.mark.parametrize("build", [projection_mlp, classifier], ids=["projection", "classifier"])
def test_fuse_on_gpu_runs_the_activations_fused(build, op_calls):
    torch.manual_seed(0)
    model = randomize_bn_(build()).to(CUDA)
    original = copy.deepcopy(model)
    _, report = epifuse.fuse(model, precision="ieee")
    g = torch.Generator(device=CUDA).manual_seed(0)
    for training in (True, False):
        model.train(training), original.train(training)
        x = torch.rand(256, IN, device=CUDA, generator=g)
        op_calls.clear()
        with torch.no_grad():
            y, y_ref = model(x), original(x)
        first = "gemm_colstats" if training else "bn_fold_eval"
        assert op_calls.count(first) == len(report.fused), op_calls  # every head ran fused
        assert rel_err(y, y_ref) <= 1e-4
    model.train(), original.train()
    x = torch.rand(256, IN, device=CUDA, generator=g, requires_grad=True)
    y, y_ref = model(x), original(x)
    assert y.grad_fn.name() == FUSED_NODE
    w = torch.randn(y.shape, device=CUDA, generator=g)
    g_new = torch.autograd.grad((y * w).sum(), [x, *model.parameters()])
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *original.parameters()])
    for a, b in zip(g_new, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
