"""Every BatchNorm1d variant in a fused head: affine=False, track_running_stats=False (batch
statistics in eval too, no running statistics to update), momentum=None (cumulative average), and a
Linear without bias; the unfused modules are the reference.

On CPU the fused path runs through the ops' float64 references (``fused_on_cpu``) and
``op_calls`` (one fused_head call and the passes it sequenced) / the autograd node prove it ran;
on the GPU the CUDA kernels run and the results are held to a float64 twin, no farther from it
than eager PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import epifuse
from epifuse import head
from epifuse.nn import FusedLinearBatchNorm
from fuse_models import randomize_bn_
from helpers import FUSED_NODE, assert_no_farther_from_float64_than_eager, rel_err

IN, OUT, ROWS = 24, 16, 32

VARIANTS = {
    "affine=False": ({}, {"affine": False}),
    "track_running_stats=False": ({}, {"track_running_stats": False}),
    "affine=False,track_running_stats=False": ({}, {"affine": False, "track_running_stats": False}),
    "momentum=None": ({}, {"momentum": None}),
    "Linear(bias=False)": ({"bias": False}, {}),
}


def _pair(variant: str, softmax: bool, device="cpu", in_f=IN, out_f=OUT):
    """(unfused Sequential, fused head) over copies of the same modules."""
    linear_kwargs, bn_kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    lin, bn = nn.Linear(in_f, out_f, **linear_kwargs), nn.BatchNorm1d(out_f, **bn_kwargs)
    randomize_bn_(bn, seed=3)
    layers = [copy.deepcopy(lin), copy.deepcopy(bn)] + ([nn.Softmax(dim=1)] if softmax else [])
    fused = FusedLinearBatchNorm(lin, bn, softmax=softmax)
    return nn.Sequential(*layers).to(device), fused.to(device)


def _expected_ops(variant: str, training: bool, softmax: bool) -> list[str]:
    """One forward without grad: fused_head and its passes. Batch statistics: the fold updating
    the running statistics (bn_fold_train), or without them bn_fold_batch, then the pass in place;
    running statistics: the fold in the GEMM's epilogue [then the softmax in place]."""
    tracking = VARIANTS[variant][1].get("track_running_stats", True)
    if training or not tracking:  # batch statistics
        return ["fused_head", "gemm_colstats",
                "bn_fold_train" if tracking and training else "bn_fold_batch",
                "affine_softmax_" if softmax else "affine_"]
    return ["fused_head", "bn_fold_eval", "gemm_affine"] + (["affine_softmax_"] if softmax else [])


def _head_name(name: str) -> str:
    """The fused head's name of a parameter or buffer of the unfused Sequential (0: gemm, 1: bn)."""
    return name.replace("0.", "gemm.", 1) if name.startswith("0.") else name.replace("1.", "bn.", 1)


def _assert_same_state(new: nn.Module, ref: nn.Module) -> None:
    new_state = new.state_dict()
    ref_state = {_head_name(k): v for k, v in ref.state_dict().items()}
    assert set(new_state) == set(ref_state)
    for name, value in ref_state.items():
        assert rel_err(new_state[name], value) < 1e-6, name


@pytest.mark.parametrize("softmax", [False, True], ids=["", "softmax"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_the_modules_cpu(fused_on_cpu, op_calls, variant, training, softmax):
    ref, new = _pair(variant, softmax)
    ref.train(training), new.train(training)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step in range(3):
            x = torch.rand(ROWS, IN, generator=g)
            assert head.fast_path_reason(new, x) is None  # on CPU only with fused_on_cpu
            assert rel_err(new(x), ref(x)) < 1e-5, step
            _assert_same_state(new, ref)
    assert op_calls == _expected_ops(variant, training, softmax) * 3, op_calls


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_match_the_modules_cpu(fused_on_cpu, variant, training):
    ref, new = _pair(variant, softmax=True)
    ref.train(training), new.train(training)
    x = torch.rand(ROWS, IN, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(ROWS, OUT, generator=torch.Generator().manual_seed(4))
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    y_new, y_ref = new(xs[0]), ref(xs[1])
    assert y_new.grad_fn.name() == FUSED_NODE  # the fused backward, not the modules' autograd
    y_new.backward(grad), y_ref.backward(grad)
    assert rel_err(y_new, y_ref) < 1e-5
    assert rel_err(xs[0].grad, xs[1].grad) < 1e-5
    ref_params = {_head_name(k): v for k, v in ref.named_parameters()}
    new_params = dict(new.named_parameters())
    assert set(new_params) == set(ref_params)
    batch_stats = training or not VARIANTS[variant][1].get("track_running_stats", True)
    for name, p in new_params.items():
        if name == "gemm.bias" and batch_stats:
            # The batch mean cancels the Linear's bias: its gradient is 0 exactly. Eager's is
            # rounding noise around 0, so hold both to the scale of the weight's gradient.
            scale = new_params["gemm.weight"].grad.abs().max()
            assert p.grad.abs().max() <= 1e-5 * scale, name
            assert ref_params[name].grad.abs().max() <= 1e-5 * scale, name
            continue
        assert rel_err(p.grad, ref_params[name].grad) < 1e-5, name
    _assert_same_state(new, ref)


def test_fuse_takes_a_projection_mlp_with_an_affine_free_last_batchnorm(fused_on_cpu, op_calls):
    """The self-supervised projection head (SimCLR / MoCo v3): every Linear -> BatchNorm fused,
    the ReLUs inside the first two heads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                          nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True),
                          nn.Linear(32, OUT, bias=False), nn.BatchNorm1d(OUT, affine=False))
    original = copy.deepcopy(model)
    _, report = epifuse.fuse(model)
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu", "3 -> 4 -> relu", "6 -> 7"]
    assert report.skipped == []
    x = torch.rand(ROWS, IN)
    with torch.no_grad():
        assert rel_err(model(x), original(x)) < 1e-5
    assert op_calls == ["fused_head", "gemm_colstats", "bn_fold_train", "affine_"] * 3, op_calls


# --------------------------------------------------------------------------- GPU


@pytest.mark.hopper
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_on_gpu_no_farther_from_float64_than_eager(variant, training):
    # 1024 x 1024 -> 1024: at PyTorch's default precision the split 3x GEMM runs (Hopper).
    ref, new = _pair(variant, softmax=False, device="cuda", in_f=1024, out_f=1024)
    ref.train(training), new.train(training)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.rand(1024, 1024, device="cuda", generator=g)
    grad = torch.randn(1024, 1024, device="cuda", generator=g)
    assert head.fast_path_reason(new, x) is None
    bias_cancels = training or not VARIANTS[variant][1].get("track_running_stats", True)
    # running statistics updated as BatchNorm's (or not at all)
    assert_no_farther_from_float64_than_eager(ref, new, x, grad, _assert_same_state,
                                              name_of=_head_name, bias_cancels=bias_cancels)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.hopper)])
def test_stand_ins_of_an_affine_free_untracked_batchnorm_are_made_once(fused_on_cpu, device):
    """affine=False and track_running_stats=False: the ops read ones / zeros in place of gamma,
    beta and the running statistics. They are made once per (length, dtype, device) and kept,
    not allocated and filled on every forward."""
    _, new = _pair("affine=False,track_running_stats=False", softmax=False, device=device)
    parts = head._parts(new)
    first, second = head._bn_defaults(parts), head._bn_defaults(parts)
    for name in ("gamma", "beta", "running_mean", "running_var"):
        assert getattr(first, name) is getattr(second, name), name
    assert torch.equal(first.gamma, torch.ones(OUT, device=device))
    assert torch.equal(first.beta, torch.zeros(OUT, device=device))
    assert first.running_var is first.gamma and first.running_mean is first.beta
    # A scale-less chain head's ones(1) comes from the same place.
    assert head.stand_in(1.0, 1, parts.weight) is head.stand_in(1.0, 1, parts.weight)


@pytest.mark.hopper
def test_stand_ins_first_made_in_a_cuda_graph_capture_are_not_kept():
    """Under CUDA-graph capture a fill only runs at replay: a stand-in first made there must not
    be kept for eager calls (they would read unfilled memory). The captured head still computes
    the modules' result on replay."""
    ref, new = _pair("affine=False,track_running_stats=False", softmax=False, device="cuda",
                     in_f=256, out_f=384)
    ref.eval(), new.eval()  # batch statistics in eval too (no running statistics)
    x = torch.rand(512, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        new(x)  # warm-up (as torch.cuda.graph asks): kernels and plans, stand-ins kept
    torch.cuda.current_stream().wait_stream(side)
    head._STAND_INS.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        y_static = new(x)
    assert head._STAND_INS == {}, "a stand-in made during capture was kept"
    graph.replay()
    with torch.no_grad():
        expected = ref(x)
        assert rel_err(y_static, expected) < 1e-4
        assert rel_err(new(x), expected) < 1e-4  # made (and kept) outside the capture
    assert len(head._STAND_INS) == 2  # ones and zeros of length 384
