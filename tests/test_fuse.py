"""epifuse.fuse and epifuse.nn.FusedLinearBatchNorm.

On CPU, forwards run the fused path through the ops' float64 references
(``fused_on_cpu``) and ``op_calls`` proves it ran (one fused_head call per head and the passes it
sequenced); the unfused deep copy of the same model is the reference.

Marked `hopper` (skipped with a reason without a GPU the kernels were built for): epifuse.fuse on
CUDA, where the fused kernels run for a Sequential and an fx-traced custom module, and the results
match the unfused model in training and eval.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import epifuse
from epifuse import head
from epifuse.nn import FusedLinearBatchNorm
from fuse_models import (IN, OUT, Custom, NearMisses, Untraceable, fused_pair, randomize_bn_,
                         sequential)
from helpers import rel_err, traced_epifuse_ops

CUDA = torch.device("cuda")
# A head's forward without grad: one fused_head call, then its passes (the last pass follows).
TRAIN_OPS = ["fused_head", "gemm_colstats", "bn_fold_train"]
EVAL_OPS = ["fused_head", "bn_fold_eval", "gemm_affine"]


def fused_linear_biases(model: nn.Module, report) -> set[int]:
    """ids of the biases of the Linear layers that fused heads feed into BatchNorm."""
    linears = [model.get_submodule(f.where.split(" -> ")[0]) for f in report.fused]
    return {id(m.bias) for m in linears if m.bias is not None}


def _run_both(original, model, training, steps=3):
    g = torch.Generator().manual_seed(1)
    original.train(training), model.train(training)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.rand(16, IN, generator=g)
            assert rel_err(model(x), original(x)) < 1e-5
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert rel_err(a, b) < 1e-5, name


def test_sequential_chains_are_fused(fused_on_cpu, op_calls):
    original, model, report = fused_pair(sequential)
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu", "3.0 -> 3.1 -> softmax(dim=1)"]
    assert report.skipped == []
    assert type(model) is nn.Sequential and len(model) == 4  # indices and length unchanged
    _run_both(original, model, training=True)
    assert op_calls == (TRAIN_OPS + ["affine_"] + TRAIN_OPS + ["affine_softmax_"]) * 3
    op_calls.clear()
    _run_both(original, model, training=False)
    # The first head's ReLU: a pass of its own after the GEMM's affine epilogue.
    # eval: the ReLU inside the first GEMM's epilogue, the softmax a pass of its own
    assert op_calls == (EVAL_OPS + EVAL_OPS + ["affine_softmax_"]) * 3


def test_custom_module_with_scales_is_fused(fused_on_cpu, op_calls):
    original, model, report = fused_pair(Custom)
    assert [f.where for f in report.fused] == [
        "proj -> * gain -> norm -> relu", "out -> out_norm -> * temperature -> softmax(dim=-1)"]
    assert isinstance(model, Custom)
    for training in (True, False):
        _run_both(original, model, training)
    assert op_calls.count("gemm_colstats") == op_calls.count("gemm_affine") == 6


def test_near_misses_are_reported_and_left_alone(fused_on_cpu, op_calls):
    original, model, report = fused_pair(NearMisses)
    reasons = {s.where: s.reason for s in report.skipped}
    assert "2 consumers" in reasons["shared"]
    assert "plain -> plain_bn" not in reasons  # an affine-free BatchNorm fuses (weight 1, bias 0)
    assert [(f.where, "dim 0" in f.note) for f in report.fused] == [
        ("plain -> plain_bn", False), ("cols -> cols_bn", True)]
    for training in (True, False):
        _run_both(original, model, training)
    assert op_calls.count("gemm_colstats") == op_calls.count("gemm_affine") == 6
    assert "affine_softmax_" not in op_calls  # the dim-0 softmax stayed torch.softmax
    assert "fused cols -> cols_bn" in str(report) and "left  shared" in str(report)


def test_untraceable_module_is_searched_inside(fused_on_cpu, op_calls):
    original, model, report = fused_pair(Untraceable)
    assert [f.where for f in report.fused] == ["head.0 -> head.1"]
    assert "cannot be traced" in report.skipped[0].reason
    _run_both(original, model, training=True)
    assert op_calls == (TRAIN_OPS + ["affine_"]) * 3


@pytest.mark.parametrize("build", [sequential, Custom], ids=["sequential", "custom"])
def test_state_dict_and_optimizer_keep_the_same_tensors(build, fused_on_cpu):
    torch.manual_seed(0)
    model = build()
    params = dict(model.named_parameters())
    state = model.state_dict(keep_vars=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.detach().clone() for k, v in state.items()}
    _, report = epifuse.fuse(model)
    after = model.state_dict(keep_vars=True)
    assert list(after) == list(state)
    assert all(after[k] is state[k] for k in state)
    assert dict(model.named_parameters()) == params  # same names, same Parameter objects
    with traced_epifuse_ops() as calls:
        model(torch.rand(16, IN)).square().sum().backward()
    assert calls[:2] == ["fused_head", "gemm_colstats"] and "head_grad_coefficients" in calls
    optimizer.step()
    for name, p in params.items():  # the optimizer's tensors are the ones the fused path read
        assert p.grad is not None, name
        if id(p) in fused_linear_biases(model, report):
            # Training-mode BatchNorm subtracts the batch mean: the Linear's bias has no effect
            # and its gradient is 0 up to rounding, so SGD leaves it as it was.
            assert p.grad.abs().max() <= 1e-12
            continue
        assert not torch.equal(p.detach(), before[name]), name
    for key in ("running_mean", "num_batches_tracked"):
        k = next(k for k in state if k.endswith(key))
        assert not torch.equal(state[k], before[k])
        assert model.state_dict(keep_vars=True)[k] is state[k]
    # And a state_dict saved from the unfused model loads strictly into the fused one.
    model.load_state_dict(build().state_dict())


def test_gradients_through_fused_chain(fused_on_cpu):
    original, model, _ = fused_pair(Custom)
    x = torch.rand(16, IN, requires_grad=True)
    y_new, y_ref = model(x), original(x)
    w = torch.randn_like(y_ref)
    g_new = torch.autograd.grad((y_new * w).sum(), [x, *model.parameters()])
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *original.parameters()])
    # assert_close, not rel_err: the Linear biases' gradients are 0 up to rounding (BatchNorm
    # removes any per-column shift), so only their absolute error means anything.
    for a, b in zip(g_new, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_fused_model_copies(how, fused_on_cpu, op_calls):
    original, model, _ = fused_pair(Custom)
    clone = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    head_ = clone._epifuse_heads[0]
    assert head_.gemm is clone.proj and head_.bn is clone.norm and head_.scale is clone.gain
    with torch.no_grad():
        x = torch.rand(16, IN)
        assert rel_err(clone.eval()(x), original.eval()(x)) < 1e-5
    assert op_calls.count("gemm_affine") == 2


def test_fuse_twice_and_bad_arguments():
    _, model, _ = fused_pair(sequential)
    assert epifuse.fuse(model)[1].skipped[0].reason == "already fused"
    with pytest.raises(TypeError, match="nn.Module"):
        epifuse.fuse(lambda x: x)
    with pytest.raises(ValueError, match="precision"):
        epifuse.fuse(sequential(), precision="fp64")


def test_convert_sync_batchnorm_warns_when_nothing_converts():
    plain = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT))
    with pytest.warns(UserWarning, match=r"converted nothing.*BatchNorm1d '1'.*epifuse.fuse"):
        epifuse.convert_sync_batchnorm(plain)
    with pytest.warns(UserWarning, match="holds no BatchNorm layer"):
        epifuse.convert_sync_batchnorm(nn.Linear(2, 2))
    epifuse.fuse(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        epifuse.convert_sync_batchnorm(plain)
    assert plain._epifuse_heads[0].sync_batchnorm is True


# --------------------------------------------------------------------------- FusedLinearBatchNorm

@pytest.mark.parametrize("position,softmax", [("after_bn", True), ("before_bn", False),
                                              (None, True)])
def test_fused_linear_batchnorm_module(position, softmax, fused_on_cpu, op_calls):
    torch.manual_seed(0)
    linear, bn = nn.Linear(IN, OUT), randomize_bn_(nn.BatchNorm1d(OUT))
    scale = nn.Parameter(torch.rand(OUT) + 0.5) if position else None
    module = FusedLinearBatchNorm(linear, bn, scale, scale_position=position or "after_bn",
                                  softmax=softmax, precision="tf32")
    assert module.gemm is linear and module.bn is bn and (scale is None or module.scale is scale)
    keys = {f"gemm.{k}" for k in linear.state_dict()} | {f"bn.{k}" for k in bn.state_dict()}
    assert set(module.state_dict()) == keys | ({"scale"} if scale is not None else set())

    def reference(x):
        y = linear(x) * (scale if position == "before_bn" else 1)
        y = bn(y) * (scale if position == "after_bn" else 1)
        return torch.softmax(y, 1) if softmax else y

    x = torch.rand(16, IN)
    assert epifuse.fast_path_reason(module, x) is None
    with torch.no_grad():
        expected = reference(x)  # updates bn's running statistics once ...
        bn.num_batches_tracked.sub_(1)  # ... rewound so that the fused call sees the same state
        assert rel_err(module(x), expected) < 1e-5
    assert op_calls[:3] == TRAIN_OPS
    assert "precision=tf32" in repr(module)


# torch 2.14 deprecates torch.jit.script itself (a FutureWarning); what is tested is our error.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
def test_fused_linear_batchnorm_rejects_bad_parts():
    lin, bn = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
    with pytest.raises(TypeError, match="nn.Linear"):
        FusedLinearBatchNorm(nn.Identity(), bn)
    with pytest.raises(TypeError, match="BatchNorm1d"):
        FusedLinearBatchNorm(lin, nn.BatchNorm2d(OUT))
    with pytest.raises(ValueError, match=f"9 features.*out_features={OUT}"):
        FusedLinearBatchNorm(lin, nn.BatchNorm1d(9))
    with pytest.raises(ValueError, match=r"shape \(1,\) or \(8,\)"):
        FusedLinearBatchNorm(lin, bn, torch.ones(3))
    with pytest.raises(ValueError, match="scale_position"):
        FusedLinearBatchNorm(lin, bn, torch.ones(1), scale_position="middle")
    with pytest.raises(TypeError, match="softmax must be a bool"):
        FusedLinearBatchNorm(lin, bn, softmax=1)
    with pytest.raises(ValueError, match="precision"):
        FusedLinearBatchNorm(lin, bn, precision="fp64")
    with pytest.raises(RuntimeError, match="cannot be compiled with torch.jit.script"):
        torch.jit.script(FusedLinearBatchNorm(lin, bn))


def test_fused_linear_batchnorm_reference_path_is_the_modules(fused_on_cpu, op_calls):
    torch.manual_seed(0)
    lin, bn = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
    module = FusedLinearBatchNorm(lin, bn, softmax=True).double()
    x = torch.rand(16, IN, dtype=torch.float64)
    assert "dtype" in head.fast_path_reason(module, x)
    expected = torch.softmax(copy.deepcopy(bn)(copy.deepcopy(lin)(x)), 1)
    assert torch.equal(module(x), expected) and op_calls == []


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.hopper
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [sequential, Custom], ids=["sequential", "custom"])
def test_fuse_runs_fused_kernels_and_matches(build, dtype, op_calls):
    torch.manual_seed(0)
    model = randomize_bn_(build()).to(CUDA, dtype)
    original = copy.deepcopy(model)
    _, report = epifuse.fuse(model, precision="ieee")
    assert len(report.fused) == 2, str(report)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    g = torch.Generator(device=CUDA).manual_seed(0)
    for training in (True, False, True):
        model.train(training), original.train(training)
        x = torch.rand(64, IN, device=CUDA, generator=g).to(dtype)
        for chain in model._epifuse_heads:
            assert chain.bn.training is training
        op_calls.clear()
        with torch.no_grad():
            y, y_ref = model(x), original(x)
        first = "gemm_colstats" if training else "bn_fold_eval"
        assert op_calls.count(first) == 2, op_calls  # both heads ran fused
        assert rel_err(y, y_ref) <= tol
        for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
            assert rel_err(a, b) <= tol, name
    # Training with autograd goes through the fused forward as well.
    model.train(), original.train()
    x = torch.rand(64, IN, device=CUDA, generator=g).to(dtype)
    op_calls.clear()
    loss = (model(x) * torch.linspace(0, 1, 8, device=CUDA, dtype=dtype)).sum()
    loss.backward()
    assert op_calls.count("fused_head") == op_calls.count("head_grad_coefficients") == 2, op_calls
    assert all(p.grad is not None for p in model.parameters())


# ------------------------------------------------------------------------ module hooks
# The fused path never calls the Linear or the BatchNorm, so their hooks (a feature extractor's
# forward hook, torch.nn.utils.prune's pre-hook that recomputes the weight, an FSDP unit's
# all-gather) would not run: while a head's modules have hooks, the head runs them.

def _record(log, name):
    return lambda module, *args: log.append(name)


def _one_head() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), nn.ReLU())


@pytest.mark.parametrize("where", ["linear-pre-hook", "bn-forward-hook", "bn-backward-hook",
                                   "global-forward-hook"])
def test_hooks_of_a_heads_modules_run_as_without_fusion(where, fused_on_cpu):
    original, model, report = fused_pair(_one_head)
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu"]
    log, ref_log = [], []
    handles = []
    for m, sink in ((model, log), (original, ref_log)):
        if where == "linear-pre-hook":
            handles.append(m[0].register_forward_pre_hook(_record(sink, "pre")))
        elif where == "bn-forward-hook":
            handles.append(m[1].register_forward_hook(_record(sink, "fwd")))
        elif where == "bn-backward-hook":
            handles.append(m[1].register_full_backward_hook(_record(sink, "bwd")))
    if where == "global-forward-hook":
        handles.append(nn.modules.module.register_module_forward_hook(
            lambda module, *args: log.append(type(module).__name__)))
    x = torch.rand(16, IN)
    try:
        with traced_epifuse_ops() as ran:
            y = model(x)
            y.sum().backward()
        if where == "global-forward-hook":
            assert {"Linear", "BatchNorm1d"} <= set(log), log
        else:
            y_ref = original(x)
            y_ref.sum().backward()
            assert log == ref_log and log, (log, ref_log)
            assert rel_err(y, y_ref) < 1e-6
        assert ran == [], f"a head with hooked modules ran the fused ops: {ran}"
        assert "hooks" in head.fast_path_reason(model._epifuse_heads[0], x)
    finally:
        for h in handles:
            h.remove()
    with traced_epifuse_ops() as ran:  # the hooks gone: fused again
        model(x)
    assert "gemm_colstats" in ran


def test_fuse_reports_hooked_modules_and_leaves_a_hooked_activation(fused_on_cpu):
    torch.manual_seed(0)
    model = randomize_bn_(sequential())
    log = []
    model[1].register_forward_hook(_record(log, "bn"))
    model[2].register_forward_hook(_record(log, "relu"))  # the activation: left to the model
    original = copy.deepcopy(model)
    _, report = epifuse.fuse(model)
    first = report.fused[0]
    assert first.where == "0 -> 1", report
    assert "has module hooks" in first.note and "relu left unfused: 2 has module hooks" in first.note
    x = torch.rand(16, IN)
    assert rel_err(model(x), original(x)) < 1e-6
    assert log == ["bn", "relu"] * 2  # the fused model's call, then the deep copy's


def test_pruned_linear_runs_its_pruning_hook(fused_on_cpu):
    """torch.nn.utils.prune recomputes the weight in a forward pre-hook: the head must run it
    (the fused path would read the weight as the hook last left it)."""
    from torch.nn.utils import prune

    original, model, _ = fused_pair(sequential)
    for m in (model, original):
        prune.l1_unstructured(m[0], "weight", amount=0.5)
    x = torch.rand(16, IN)
    for m in (model, original):  # a new mask after a forward: the hook's next call applies it
        m(x)
        m[0].weight_mask.zero_()
        m.eval()
    assert rel_err(model(x), original(x)) < 1e-6


# ------------------------------------------------------------------------ changes after fuse
# A fused model is still the user's model: settings, parameters and modules changed after fuse()
# (or modules the head cannot compute) give what the unfused model gives.

def _same_as_eager(original, model, x, *, steps=2, training=True):
    original.train(training), model.train(training)
    for _ in range(steps):
        assert rel_err(model(x), original(x)) < 1e-6
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b) if a.dtype == torch.long else rel_err(a, b) < 1e-6, name


def test_track_running_stats_cleared_freezes_the_statistics(fused_on_cpu):
    """BatchNorm's rule: with track_running_stats cleared on a trained BatchNorm (its buffers
    kept), training uses batch statistics and leaves the running ones alone; eval reads them."""
    original, model, _ = fused_pair(_one_head)
    for m in (original, model):
        m[1].track_running_stats = False
    x = torch.rand(16, IN)
    with traced_epifuse_ops() as ran:
        _same_as_eager(original, model, x)
    assert "fused_head" in ran and "update_running_stats" not in ran
    assert model[1].num_batches_tracked.item() == 0
    _same_as_eager(original, model, x, training=False)


def test_a_linear_or_batchnorm_with_its_own_forward_is_not_fused(fused_on_cpu):
    """A QAT Linear (fake-quantized weight) computes something else than nn.Linear: fuse() leaves
    it, with the reason; FusedLinearBatchNorm refuses it."""
    import torch.ao.nn.qat as nnqat
    from torch.ao.quantization import get_default_qat_qconfig

    def build():
        return nn.Sequential(nnqat.Linear(IN, OUT, qconfig=get_default_qat_qconfig("x86")),
                             nn.BatchNorm1d(OUT))

    original, model, report = fused_pair(build)
    assert report.fused == [] and "forward of its own" in report.skipped[0].reason
    _same_as_eager(original, model, torch.rand(16, IN))

    class MyNorm(nn.BatchNorm1d):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(TypeError, match="linear to be an nn.Linear .*keeps its forward"):
        FusedLinearBatchNorm(build()[0], nn.BatchNorm1d(OUT))
    with pytest.raises(TypeError, match="batch_norm to be .*keeps its forward.*got MyNorm"):
        FusedLinearBatchNorm(nn.Linear(IN, OUT), MyNorm(OUT))
    # Put in a fused chain's place after fuse: the chain runs the modules.
    original, model, _ = fused_pair(_one_head)
    for m in (original, model):
        m[1] = MyNorm(OUT)
    _same_as_eager(original, model, torch.rand(16, IN))


def test_parameters_and_modules_rebound_after_fuse_are_used(fused_on_cpu):
    """The fused forward looks the model's members up at each call, as the model's own forward
    does: load_state_dict(assign=True), a replaced submodule, to_empty() after a meta build."""

    class WithOffset(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = nn.Linear(IN, OUT), nn.BatchNorm1d(OUT)
            self.offset = nn.Parameter(torch.zeros(OUT))
            self.out = nn.Linear(OUT, 4)

        def forward(self, x):
            return self.out(self.bn(self.fc(x)) + self.offset)

    original, model, report = fused_pair(WithOffset)
    assert len(report.fused) == 1
    state = {k: v + 1 if k == "offset" else v for k, v in original.state_dict().items()}
    x = torch.rand(16, IN)
    for m in (original, model):
        m.load_state_dict(state, assign=True)
        m.out = nn.Linear(OUT, 2)
    model.out.load_state_dict(original.out.state_dict())
    _same_as_eager(original, model, x)
    model(x).sum().backward()
    assert model.offset.grad is not None and model.out.weight.grad is not None

    with torch.device("meta"):
        meta = WithOffset()
    epifuse.fuse(meta)
    meta.to_empty(device="cpu")
    meta.load_state_dict(state)
    reference = WithOffset()
    reference.load_state_dict(state)
    with traced_epifuse_ops() as ran:
        assert rel_err(meta.eval()(x), reference.eval()(x)) < 1e-6
    assert "fused_head" in ran


@pytest.mark.parametrize("change", ["slope", "activation-hook", "activation-replaced",
                                    "softmax-dim", "softmax-replaced"])
def test_activation_and_softmax_modules_changed_after_fuse(change, fused_on_cpu):
    """The activation and softmax modules a chain took in: changed after fuse (a setting, a
    replacement, a hook), the chain runs the model's modules as they are now."""
    def build():
        return nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT), nn.LeakyReLU(0.1),
                             nn.Softmax(dim=1))

    original, model, report = fused_pair(build)
    assert [f.where for f in report.fused] == [
        "0 -> 1 -> leaky_relu(negative_slope=0.1) -> softmax(dim=1)"]
    log = []
    for m in (original, model):
        if change == "slope":
            m[2].negative_slope = 0.5
        elif change == "activation-hook":
            m[2].register_forward_hook(lambda *args: log.append("act"))
        elif change == "activation-replaced":
            m[2] = nn.Tanh()
        elif change == "softmax-dim":
            m[3].dim = 0
        else:
            m[3] = nn.Identity()
    x = torch.rand(16, IN)
    _same_as_eager(original, model, x)
    if change == "activation-hook":
        assert log == ["act"] * 4
    for m in (original, model):  # a change undone: fused again (a hook stays)
        m[2], m[3] = nn.LeakyReLU(0.1), nn.Softmax(dim=1)
    with traced_epifuse_ops() as ran:
        _same_as_eager(original, model, x, steps=1)
    assert "fused_head" in ran


@pytest.mark.parametrize("replacement", ["LayerNorm", "Identity", "BatchNorm2d"])
def test_batchnorm_replaced_after_fuse(replacement, fused_on_cpu):
    """The chain's BatchNorm replaced by another module: it runs, with its own result or error."""
    original, model, _ = fused_pair(_one_head)
    for m in (original, model):
        m[1] = {"LayerNorm": lambda: nn.LayerNorm(OUT), "Identity": nn.Identity,
                "BatchNorm2d": lambda: nn.BatchNorm2d(OUT)}[replacement]()
    x = torch.rand(16, IN)
    if replacement == "BatchNorm2d":
        with pytest.raises(ValueError, match="expected 4D input"):
            original(x)
        with pytest.raises(ValueError, match="expected 4D input"):
            model(x)
    else:
        _same_as_eager(original, model, x)


@pytest.mark.parametrize("eps,momentum", [(0.0, 0.1), (-1e-3, 0.1), (1e-5, 1.5), (1e-5, -0.5)])
def test_batchnorm_settings_the_ops_refuse_behave_as_eager(eps, momentum, fused_on_cpu):
    """eps <= 0 with batch statistics (an error in torch 2.14), a momentum outside [0, 1]
    (accepted by BatchNorm): the modules decide, result or error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, OUT), nn.BatchNorm1d(OUT, eps=eps, momentum=momentum))
    original = copy.deepcopy(model)
    epifuse.fuse(model)
    x = torch.rand(16, IN)
    try:
        expected = original(x)
    except Exception as e:  # noqa: BLE001 - whichever error this torch's BatchNorm raises
        with pytest.raises(type(e)):
            model(x)
        return
    assert rel_err(model(x), expected) < 1e-6 or (expected.isnan() == model(x).isnan()).all()
    assert rel_err(model[1].running_mean, original[1].running_mean) < 1e-6


def test_a_scale_parametrized_after_fuse_is_read_through_its_property(fused_on_cpu):
    """A chain reads its members from the registry they were in at fuse time; a scale that
    torch.nn.utils.parametrize has since moved out of ``_parameters`` (a property now) is read
    through the property, not missed or stale."""
    from torch.nn.utils import parametrize

    class Doubled(nn.Module):
        def forward(self, t):
            return 2 * t

    original, model, report = fused_pair(Custom)
    assert len(report.fused) == 2
    for m in (original, model):
        parametrize.register_parametrization(m, "gain", Doubled())
        parametrize.register_parametrization(m, "temperature", Doubled())
    x = torch.rand(16, IN)
    first, second = model._epifuse_heads
    assert "gain" not in model._parameters  # a property now
    assert head.fast_path_reason(first, x) is None
    assert head.fast_path_reason(second, torch.rand(16, second.gemm.in_features)) is None
    assert torch.equal(model._epifuse_heads[0].scale, 2 * original.parametrizations.gain.original)
    _same_as_eager(original, model, x)
