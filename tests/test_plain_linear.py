"""Plain Linear layers on epifuse's GEMM: ``fuse`` finds every nn.Linear that no BatchNorm follows
(with the activation and softmax after it) and runs it as one ``epifuse::fused_linear`` call.

Everywhere (``fused_on_cpu``: the op's C++ sequence over the float64 references): what fuse finds
and reports, the fused path against eager (the path asserted: the op ran, its autograd node is in
the graph), N-D inputs, shared outputs, tied weights, the policy (TF32: PyTorch's GEMM), double
backward refused. Marked ``hopper``: every activation x softmax x bias against float64, no farther
than eager's error; real heads (Barlow Twins, SimCLR) at default precision; autocast, strict,
CUDA graphs and torch.compile.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import epifuse
from epifuse.fusion import LINEARS_ATTR
from helpers import FUSED_NODE, graph_node_names, rel_err

LINEAR_NODE = "torch::autograd::CppNode<epifuse::FusedLinear>"
IN, HID, OUT = 16, 24, 12
ACTIVATIONS = {"none": None, "relu": nn.ReLU, "leaky_relu0.2": lambda: nn.LeakyReLU(0.2),
               "leaky_relu-0.3": lambda: nn.LeakyReLU(-0.3), "gelu": nn.GELU,
               "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


def barlow_twins(d_in=IN, hidden=HID, out=OUT) -> nn.Module:
    """Barlow Twins' projector as its paper builds it: two Linear -> BatchNorm1d -> ReLU blocks
    (no bias), then a plain Linear (no bias)."""
    return nn.Sequential(nn.Linear(d_in, hidden, bias=False), nn.BatchNorm1d(hidden),
                         nn.ReLU(inplace=True), nn.Linear(hidden, hidden, bias=False),
                         nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, out, bias=False))


def simclr(d_in=IN, hidden=HID, out=OUT) -> nn.Module:
    """SimCLR v1's projection head: Linear -> ReLU -> Linear, no BatchNorm."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, out))


def layer(act_id: str, softmax_dim, bias: bool = True) -> nn.Module:
    mods = [nn.Linear(IN, OUT, bias=bias)]
    if ACTIVATIONS[act_id] is not None:
        mods.append(ACTIVATIONS[act_id]())
    if softmax_dim is not None:
        mods.append(nn.Softmax(dim=softmax_dim))
    return nn.Sequential(*mods)


def fused_copy(model: nn.Module, **kw):
    new = copy.deepcopy(model)
    _, report = epifuse.fuse(new, **kw)
    return new, report


def step(model: nn.Module, x: torch.Tensor, w: torch.Tensor):
    """(output, dX, {parameter name: gradient}) of one forward and backward of (y * w).sum()."""
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * w.to(y.dtype)).sum().backward()
    # (torch.compile's wrapper names them under _orig_mod.)
    return y, x.grad, {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()}


def assert_same_step(new, ref, x, tol=1e-5):
    y_new, dx_new, g_new = step(new, x, w := torch.randn(new(x).shape, dtype=x.dtype,
                                                          device=x.device))
    y_ref, dx_ref, g_ref = step(ref, x, w)
    assert rel_err(y_new, y_ref) < tol
    assert rel_err(dx_new, dx_ref) < tol
    assert g_new.keys() == g_ref.keys()
    for name in g_new:
        assert rel_err(g_new[name], g_ref[name]) < tol, name
    return y_new


# --------------------------------------------------------------------------- what fuse finds


def test_fuse_finds_the_plain_linears_of_real_heads():
    _, report = fused_copy(barlow_twins())
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu", "3 -> 4 -> relu", "6"]
    assert "plain Linear" in report.fused[2].note and "plain Linear" not in report.fused[0].note
    _, report = fused_copy(simclr())
    assert [f.where for f in report.fused] == ["0 -> relu", "2"]
    assert "fused 0 -> relu" in str(report)


def test_plain_linear_false_keeps_the_batchnorm_chains_only():
    model, report = fused_copy(barlow_twins(), plain_linear=False)
    assert [f.where for f in report.fused] == ["0 -> 1 -> relu", "3 -> 4 -> relu"]
    assert getattr(model, LINEARS_ATTR) == ()
    model, report = fused_copy(simclr(), plain_linear=False)
    assert report.fused == [] and LINEARS_ATTR not in model.__dict__


def test_state_dict_and_parameters_are_the_models_own():
    model = simclr()
    keys, params = list(model.state_dict()), list(model.parameters())
    epifuse.fuse(model)
    assert list(model.state_dict()) == keys
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))


# --------------------------------------------------------------------------- the fused path on CPU


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("softmax_dim", [None, 1, -1], ids=["plain", "softmax1", "softmax-1"])
@pytest.mark.parametrize("act_id", list(ACTIVATIONS))
def test_fused_layer_matches_eager(fused_on_cpu, op_calls, act_id, softmax_dim, bias):
    torch.manual_seed(0)
    ref = layer(act_id, softmax_dim, bias)
    new, report = fused_copy(ref)
    assert len(report.fused) == 1
    x = torch.randn(10, IN)
    y = assert_same_step(new, ref, x)
    assert LINEAR_NODE in graph_node_names(y)
    assert "fused_linear" in op_calls and "gemm_affine" in op_calls
    op_calls.clear()
    with torch.no_grad():  # the forward for no backward
        assert rel_err(new(x), ref(x)) < 1e-5
    assert op_calls[:1] == ["fused_linear"]


def test_real_heads_run_every_layer_fused(fused_on_cpu, op_calls):
    torch.manual_seed(1)
    for build, heads, linears in ((barlow_twins, 2, 1), (simclr, 0, 2)):
        ref = build()
        new, _ = fused_copy(ref)
        y = assert_same_step(new, ref, torch.randn(8, IN))
        nodes = graph_node_names(y)
        assert nodes.count(FUSED_NODE) == heads and nodes.count(LINEAR_NODE) == linears
        assert "AddmmBackward0" not in nodes and "MmBackward0" not in nodes


def test_nd_input_runs_as_a_2d_view(fused_on_cpu, op_calls):
    torch.manual_seed(2)
    ref = layer("gelu", -1)
    new, _ = fused_copy(ref)
    y = assert_same_step(new, ref, torch.randn(3, 5, IN))
    assert y.shape == (3, 5, OUT) and LINEAR_NODE in graph_node_names(y)


def test_softmax_over_dim_1_of_a_3d_input_runs_the_modules(fused_on_cpu, op_calls):
    """dim 1 of [B, T, C] is not the features: the layer runs its modules, as eager."""
    torch.manual_seed(3)
    ref = layer("relu", 1)
    new, _ = fused_copy(ref)
    y = assert_same_step(new, ref, torch.randn(3, 5, IN))
    assert LINEAR_NODE not in graph_node_names(y) and "fused_linear" not in op_calls


def test_a_shared_output_fuses_the_linear_alone(fused_on_cpu, op_calls):
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(IN, OUT)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y) + y

    torch.manual_seed(4)
    ref = Shared()
    new, report = fused_copy(ref)
    assert [f.where for f in report.fused] == ["fc"]
    assert "2 consumers" in report.fused[0].note
    assert LINEAR_NODE in graph_node_names(assert_same_step(new, ref, torch.randn(6, IN)))


def test_tied_weights_get_both_layers_gradients(fused_on_cpu):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(IN, IN), nn.Linear(IN, IN)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(5)
    ref = Tied()
    new, report = fused_copy(ref)
    assert len(report.fused) == 2 and new.a.weight is new.b.weight
    y = assert_same_step(new, ref, torch.randn(6, IN))
    assert graph_node_names(y).count(LINEAR_NODE) == 2


def test_tf32_runs_pytorchs_gemm(fused_on_cpu, op_calls):
    """Where nn.Linear runs cuBLAS's tensor-core GEMM (TF32, 16 bits), the layer runs as PyTorch
    runs it: epifuse's GEMM would be the same one (linear.PYTORCH_GEMM); nothing is logged."""
    torch.manual_seed(6)
    ref = simclr()
    new, _ = fused_copy(ref)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        y = assert_same_step(new, ref, torch.randn(6, IN))
    finally:
        torch.set_float32_matmul_precision(old)
    assert LINEAR_NODE not in graph_node_names(y) and "fused_linear" not in op_calls


def test_double_backward_is_refused(fused_on_cpu):
    torch.manual_seed(7)
    new, _ = fused_copy(layer("gelu", None))
    x = torch.randn(5, IN, requires_grad=True)
    (gx,) = torch.autograd.grad(new(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


def test_cpu_input_without_the_patch_runs_the_modules(op_calls):
    ref = simclr()
    new, _ = fused_copy(ref)
    y = assert_same_step(new, ref, torch.randn(4, IN))
    assert LINEAR_NODE not in graph_node_names(y) and "fused_linear" not in op_calls


# --------------------------------------------------------------------------- on the GPU

CUDA = torch.device("cuda")


def _float64_errors(model, twin, x, w):
    y, dx, grads = step(model, x, w)
    y64, dx64, grads64 = step(twin, x.double(), w.double())
    errors = {"out": rel_err(y, y64), "dx": rel_err(dx, dx64)}
    errors.update({n: rel_err(grads[n], grads64[n]) for n in grads})
    return y, errors


@pytest.mark.hopper
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("softmax_dim", [None, -1], ids=["plain", "softmax"])
@pytest.mark.parametrize("act_id", list(ACTIVATIONS))
def test_default_precision_error_no_larger_than_eager(act_id, softmax_dim, bias, seed):
    """At fp32 default precision ('highest': eager runs SGEMM), the fused layer (3x GEMM) is no
    farther from float64 than eager, in the output, dX, dW and d bias."""
    torch.manual_seed(seed)
    mods = [nn.Linear(256, 384, bias=bias)]
    if ACTIVATIONS[act_id] is not None:
        mods.append(ACTIVATIONS[act_id]())
    if softmax_dim is not None:
        mods.append(nn.Softmax(dim=softmax_dim))
    ref = nn.Sequential(*mods).to(CUDA)
    new, _ = fused_copy(ref, strict=True)
    twin = copy.deepcopy(ref).double()
    x = torch.randn(128, 256, device=CUDA)
    w = torch.randn(128, 384, device=CUDA)
    y_new, err_new = _float64_errors(new, twin, x, w)
    assert LINEAR_NODE in graph_node_names(y_new)
    _, err_eager = _float64_errors(ref, twin, x, w)
    for name, e in err_new.items():
        assert e <= 1.25 * err_eager[name] + 1e-6, (name, err_new, err_eager)


@pytest.mark.hopper
@pytest.mark.parametrize("build", [barlow_twins, simclr], ids=["barlow_twins", "simclr"])
def test_real_heads_on_the_gpu(build):
    """The heads at default precision, two views (two calls) per step: every layer fused, errors
    against float64 no larger than eager's."""
    torch.manual_seed(0)
    ref = build(256, 512, 512).to(CUDA)
    new, _ = fused_copy(ref, strict=True)
    twin = copy.deepcopy(ref).double()
    errors = {}
    for impl, model in (("fused", new), ("eager", ref)):
        views = [torch.randn(64, 256, device=CUDA) for _ in range(2)]
        model.zero_grad(set_to_none=True), twin.zero_grad(set_to_none=True)
        ys = [model(v) for v in views]
        ys64 = [twin(v.double()) for v in views]
        sum(y.square().sum() for y in ys).backward()
        sum(y.square().sum() for y in ys64).backward()
        if impl == "fused":
            nodes = graph_node_names(ys[0])
            assert LINEAR_NODE in nodes and "MmBackward0" not in nodes
        errors[impl] = {"out": max(rel_err(a, b) for a, b in zip(ys, ys64))}
        errors[impl].update({n: rel_err(p.grad, q.grad) for (n, p), (_, q) in
                             zip(model.named_parameters(), twin.named_parameters())})
        twin = copy.deepcopy(ref).double()  # the running statistics moved: the same start again
    for name, e in errors["fused"].items():
        assert e <= 1.25 * errors["eager"][name] + 1e-6, (name, errors)


@pytest.mark.hopper
def test_autocast_runs_pytorchs_gemm():
    torch.manual_seed(1)
    ref = simclr(256, 512, 256).to(CUDA)
    new, _ = fused_copy(ref, strict=True)  # the policy is not a fallback: strict does not raise
    x = torch.randn(64, 256, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_new, y_ref = new(x), ref(x)
    assert LINEAR_NODE not in graph_node_names(y_new)
    assert torch.equal(y_new, y_ref)


@pytest.mark.hopper
def test_the_op_under_autocast_casts_as_nn_linear():
    """A direct call of the op under autocast: the GEMM in bf16, the output in bf16 (fp32 after a
    softmax), as nn.Linear [-> softmax] under the same autocast; gradients in the parameters'
    dtype."""
    torch.manual_seed(2)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    w = (torch.randn(128, 256, device=CUDA) / 16).requires_grad_()
    b = torch.randn(128, device=CUDA, requires_grad=True)
    for softmax in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.ops.epifuse.fused_linear(x, w, b, activation="gelu", softmax=softmax)[0]
            ref = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            ref = ref.softmax(-1) if softmax else ref
        assert y.dtype == ref.dtype
        assert rel_err(y, ref) < 2e-2
        gx, gw, gb = torch.autograd.grad(y.float().sum(), (x, w, b))
        assert (gx.dtype, gw.dtype, gb.dtype) == (torch.float32,) * 3


@pytest.mark.hopper
def test_strict_layer_with_a_hook_raises():
    new, _ = fused_copy(simclr().to(CUDA), strict=True)
    new[2].register_forward_hook(lambda m, i, o: None)
    with pytest.raises(RuntimeError, match="cannot run fused.*hooks"):
        new(torch.randn(4, IN, device=CUDA))


@pytest.mark.hopper
def test_cuda_graph_replays_the_fused_layers():
    torch.manual_seed(3)
    ref = simclr(256, 512, 256).to(CUDA).eval()
    new, _ = fused_copy(ref, strict=True)
    static_x = torch.randn(32, 256, device=CUDA)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            new(static_x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = new(static_x)
        for seed in range(3):
            static_x.copy_(torch.randn(32, 256, device=CUDA, generator=torch.Generator(
                device=CUDA).manual_seed(seed)))
            graph.replay()
            assert rel_err(static_y, ref(static_x)) < 1e-5


@pytest.mark.hopper
def test_compile_fullgraph_of_a_fused_head():
    torch._dynamo.reset()
    torch.manual_seed(4)
    ref = barlow_twins(256, 512, 512).to(CUDA)
    new, _ = fused_copy(ref, strict=True)
    compiled = torch.compile(new, fullgraph=True)
    x = torch.randn(64, 256, device=CUDA)
    with contextlib.nullcontext():
        assert_same_step(compiled, ref, x, tol=1e-4)
