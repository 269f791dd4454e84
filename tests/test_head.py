"""ModelNew's fused path (head.py).

On CPU, through the ops' float64 references (fixture fused_on_cpu): the one fused_head call and
the passes it sequences, the running-stat update, the autograd Function and torch.compile
tracing, without a GPU.

Marked `hopper` (skipped with a reason without a GPU the kernels were built for): the fused path on
the CUDA kernels against Model and a float64 oracle. Errors are Frobenius relative errors vs the
float64 oracle, bounded per dtype/precision (helpers.ORACLE_TOL) and printed (pytest -s) for the
record.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import epifuse
from epifuse import head
from helpers import (DTYPE_OF, FUSED_NODE, ORACLE_TOL, PROBLEMS, assert_head_grads_close,
                     float64_twin, init_args, make_pair, precision_of, rel_err, traced_epifuse_ops)

CUDA = torch.device("cuda")
IN, OUT = 24, 16
CASES = [pytest.param(n, s, id=f"p{n}-scale{s[0]}")
         for n, shapes in ((84, [(1,), (OUT,)]), (39, [(OUT,), (1,)])) for s in shapes]
PRECISIONS = list(ORACLE_TOL)  # ieee, 3xtf32, tf32, fp16, bf16


@pytest.fixture
def spy(op_calls):
    """Which epifuse ops ran (conftest.op_calls): head.py's one fused_head call per forward, then
    the passes it sequenced."""
    return op_calls


def test_cpu_input_takes_reference_path():
    _, new = make_pair(84, init_args(84, IN, OUT))
    assert "not CUDA" in head.fast_path_reason(new, torch.rand(4, IN))


@pytest.mark.parametrize("number,scale", CASES)
def test_fused_path_matches_model(number, scale, fused_on_cpu, spy):
    ref, new = make_pair(number, init_args(number, IN, OUT, scale))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            x = torch.rand(32, IN, generator=g)
            assert head.fast_path_reason(new.train(), x) is None
            assert rel_err(new(x), ref.train()(x)) < 1e-6
        assert rel_err(new.bn.running_mean, ref.bn.running_mean) < 1e-6
        assert rel_err(new.bn.running_var, ref.bn.running_var) < 1e-6
        assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item() == 3
        last = "affine_softmax_" if number == 84 else "affine_"
        assert spy == ["fused_head", "gemm_colstats", "bn_fold_train", last] * 3
        spy.clear()
        x = torch.rand(32, IN, generator=g)
        assert rel_err(new.eval()(x), ref.eval()(x)) < 1e-6
        assert spy == ["fused_head", "bn_fold_eval", "gemm_affine"] + (
            ["affine_softmax_"] if number == 84 else [])


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number,scale", CASES)
def test_fused_path_gradients(number, scale, mode, fused_on_cpu):
    ref, new = make_pair(number, init_args(number, IN, OUT, scale))
    ref.train(mode == "train"), new.train(mode == "train")
    x = torch.rand(32, IN, requires_grad=True)
    y_ref, y_new = ref(x), new(x)
    assert y_new.grad_fn.name() == FUSED_NODE
    w = torch.randn_like(y_ref)
    g_ref = torch.autograd.grad((y_ref * w).sum(), [x, *ref.parameters()])
    g_new = torch.autograd.grad((y_new * w).sum(), [x, *new.parameters()])
    assert_head_grads_close(number, mode == "train", new, g_new, g_ref, 1e-5)
    # Running statistics were updated once, by the forward, not again by the backward.
    torch.testing.assert_close(new.bn.running_var, ref.bn.running_var)
    assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item()


def test_fused_path_partial_requires_grad(fused_on_cpu):
    ref, new = make_pair(39, init_args(39, IN, OUT))
    for model in (ref, new):
        for p in model.parameters():
            p.requires_grad_(False)
        model.bn.weight.requires_grad_(True)
    x = torch.rand(32, IN)
    w = torch.randn(32, OUT)
    (g_ref,) = torch.autograd.grad((ref(x) * w).sum(), [ref.bn.weight])
    (g_new,) = torch.autograd.grad((new(x) * w).sum(), [new.bn.weight])
    assert rel_err(g_new, g_ref) < 1e-5


def test_double_backward_is_refused(fused_on_cpu):
    _, new = make_pair(84, init_args(84, IN, OUT))
    x = torch.rand(8, IN, requires_grad=True)
    y = new(x)
    v = torch.randn_like(y, requires_grad=True)  # a grad_output that itself requires grad
    (gx,) = torch.autograd.grad(y, [x], v, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_fused_path_reads_parametrized_and_reassigned_parameters(fused_on_cpu, spy):
    """head._member reads the registries directly; a parametrization (a property, its tensor no
    longer in _parameters) and a reassigned Parameter must still be what the fused path uses."""
    ref, new = make_pair(84, init_args(84, IN, OUT))
    for model in (ref, new):
        torch.nn.utils.parametrize.register_parametrization(model.gemm, "weight", _Doubled())
        model.bn.weight = torch.nn.Parameter(torch.full((OUT,), 0.5))
    x = torch.rand(8, IN)
    with torch.no_grad():
        y_ref, y_new = ref(x), new(x)
    assert spy[:2] == ["fused_head", "gemm_colstats"]  # the fused path ran
    assert rel_err(y_new, y_ref) < 1e-6


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_no_autograd_state_without_grad(context, fused_on_cpu):
    _, new = make_pair(84, init_args(84, IN, OUT))
    with getattr(torch, context)():
        y = new(torch.rand(8, IN))
    assert y.grad_fn is None


def test_training_batch_of_one_raises_before_any_gemm(fused_on_cpu, spy):
    _, new = make_pair(84, init_args(84, IN, OUT))
    x = torch.rand(1, IN)
    assert head.fast_path_reason(new.train(), x) == "training batch of 1 row"
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        new(x)
    assert spy == []
    assert head.fast_path_reason(new.eval(), x) is None  # eval takes a single row fine


def _reason_cases():
    def model(**kw):
        _, new = make_pair(84, init_args(84, IN, OUT, kw.pop("scale", None)))
        for path, value in kw.items():
            obj, attr = path.split(".")
            setattr(getattr(new, obj), attr, value)
        return new

    x = torch.rand(4, IN)
    return [
        ("3-D", model(), x[None], "3-D"),
        ("features", model(), torch.rand(4, IN + 1), "features"),
        ("empty", model(), x[:0], "empty"),
        ("float64", model(), x.double(), "dtype"),
        ("mixed-dtype", model().half(), x, "dtype"),
        ("half-affine", model(**{"bn.bias": None}), x, "weight without a bias"),
        ("no-running-stats", model(**{"bn.running_mean": None}), x, "running"),
        ("scale-2d", model(scale=(1, OUT)), x, "scale shape"),
        ("scale-odd", model(scale=(3,)), x, "scale shape"),
    ]


@pytest.mark.parametrize("module,x,expected", [pytest.param(*c[1:], id=c[0]) for c in _reason_cases()])
def test_fast_path_reasons(module, x, expected, fused_on_cpu):
    reason = head.fast_path_reason(module, x)
    assert reason is not None and expected in reason


def test_fused_path_works_with_16bit_model(fused_on_cpu):
    ref, new = make_pair(39, init_args(39, IN, OUT))
    ref.bfloat16(), new.bfloat16()
    x = torch.rand(32, IN).bfloat16()
    assert head.fast_path_reason(new, x) is None
    with torch.no_grad():
        assert rel_err(new(x), ref(x)) < 3e-2
    assert new.bn.running_mean.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_compile_fullgraph_traces_fused_path(number, mode, fused_on_cpu):
    torch._dynamo.reset()
    ref, new = make_pair(number, init_args(number, IN, OUT))
    ref.train(mode == "train"), new.train(mode == "train")
    compiled = torch.compile(new, fullgraph=True, backend="aot_eager")
    x = torch.rand(32, IN, requires_grad=True)
    y_new, y_ref = compiled(x), ref(x)
    assert rel_err(y_new, y_ref) < 1e-6
    # A random projection, not y.square(): BatchNorm's backward projects 2*y out almost
    # entirely, so that loss's gradient is cancellation noise.
    w = torch.randn_like(y_ref)
    (g_new,) = torch.autograd.grad((y_new * w).sum(), [x])
    (g_ref,) = torch.autograd.grad((y_ref * w).sum(), [x])
    assert rel_err(g_new, g_ref) < 1e-5
    with torch.no_grad():
        assert rel_err(compiled(x), ref(x)) < 1e-6
    assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item()
    assert rel_err(new.bn.running_var, ref.bn.running_var) < 1e-6


def test_softmax_uses_op_only_where_it_applies(fused_on_cpu, spy):
    x = torch.randn(5, 7)
    torch.testing.assert_close(epifuse.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(epifuse.softmax(x, dim=1), torch.softmax(x, 1))
    assert spy == ["affine_softmax"] * 2
    for args in [(x, 0), (x[None], -1), (x.double(), -1), (x[:0], -1)]:
        torch.testing.assert_close(epifuse.softmax(*args), torch.softmax(*args))
    xg = x.clone().requires_grad_()
    y = epifuse.softmax(xg)
    assert y.grad_fn is not None  # autograd falls back to torch.softmax
    assert spy == ["affine_softmax"] * 2  # no fallback case reached the op


def test_nvtx_flag_is_read_at_import():
    code = "import epifuse.head as h; print(h._NVTX)"
    env = dict(os.environ, EPIFUSE_NVTX="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True"
    assert head._NVTX is (os.environ.get("EPIFUSE_NVTX") == "1")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_parametrized_and_reassigned_parameters_are_honoured(mode, fused_on_cpu, spy):
    """The head reads its tensors through the modules (head._parts), so a parametrized weight is
    evaluated and a reassigned parameter is seen, as in the reference model."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    ref, new = make_pair(84, init_args(84, IN, OUT))
    for model in (ref, new):
        parametrize.register_parametrization(model.gemm, "weight", Doubled())
        model.bn.bias = torch.nn.Parameter(torch.full((OUT,), 0.25))
        model.train(mode == "train")
    x = torch.rand(16, IN)
    with torch.no_grad():
        assert rel_err(new(x), ref(x)) < 1e-6
    assert spy[0] == "fused_head" and spy[1] in ("gemm_colstats", "bn_fold_eval")  # fused


# --------------------------------------------------------------------------- on a GPU

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


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_outputs_fully_written(number, mode):
    ref, new = _pair(number, init_args(number, 1000, 4097), "bf16")
    x = torch.rand(1001, 1000, device=CUDA).bfloat16()
    _poison_allocator()
    _check(number, "bf16", ref, new, x, mode == "train", "nan-poisoned")


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
def test_main_on_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-m", "epifuse", "--small", "--dtype", "all",
                          "--iters", "3"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "path=fused" in out.stdout and "ALL OK" in out.stdout


# ------------------------------------------------------------------------ torch.func transforms

_TRANSFORMS = {  # each of a module and an input batch x [M, IN]
    "vmap": lambda m, x: torch.func.vmap(m)(torch.stack([x, x.flip(0)])),
    "jacrev": lambda m, x: torch.func.jacrev(m)(x[:4]),
    "jvp": lambda m, x: torch.func.jvp(m, (x,), (torch.ones_like(x),))[1],
    "grad": lambda m, x: torch.func.grad(lambda t: m(t).square().sum())(x),
}


# torch.func.jvp's own first call scripts a helper with torch.jit, deprecated in torch 2.14.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("transform", list(_TRANSFORMS))
@pytest.mark.parametrize("number", [84, 39])
@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"),
                                    pytest.param("cuda", id="cuda", marks=pytest.mark.hopper)])
def test_torch_func_transforms_run_the_reference_modules(number, transform, device, request):
    """Inside vmap, grad, jvp or jacrev (which the ops do not implement: the fused autograd is a
    C++ Function, and there are no batching rules) an eval ModelNew runs Model's modules, so the
    result is eager's to the bit; outside, the same call is fused."""
    if device == "cpu":
        request.getfixturevalue("fused_on_cpu")
    ref, new = (m.to(device).eval() for m in make_pair(number, init_args(number, IN, OUT)))
    x = torch.rand(8, IN, device=device)
    with traced_epifuse_ops() as inside:
        got = _TRANSFORMS[transform](new, x)
    assert inside == [], f"the ops ran inside torch.func.{transform}: {inside}"
    assert torch.equal(got, _TRANSFORMS[transform](ref, x))
    with traced_epifuse_ops() as outside:
        new(x).square().sum().backward()
    assert "fused_head" in outside, "outside a transform the same call must be fused"
    seen = []
    torch.func.vmap(lambda t: seen.append(head.fast_path_reason(new, t)) or t)(x)
    assert seen and "torch.func transform" in seen[0]


@pytest.mark.parametrize("number", [84, 39])
def test_vmap_of_a_training_head_raises_eagers_error(number, fused_on_cpu):
    """Batch statistics under vmap: BatchNorm's own refusal (its running statistics are not
    batched), not a failure inside an op."""
    ref, new = make_pair(number, init_args(number, IN, OUT))
    xs = torch.rand(2, 8, IN)
    with pytest.raises(RuntimeError) as ref_error:
        torch.func.vmap(ref)(xs)
    with traced_epifuse_ops() as ran, pytest.raises(type(ref_error.value),
                                                    match="running_mean or running_var"):
        torch.func.vmap(new)(xs)
    assert ran == []


@pytest.mark.parametrize("number", [84, 39])
def test_modelnew_with_a_hooked_submodule_runs_model_forward(number, fused_on_cpu):
    """A forward hook on ModelNew.bn (a feature extractor's): Model.forward runs, hook and all."""
    ref, new = make_pair(number, init_args(number, IN, OUT))
    seen, seen_ref = [], []
    new.bn.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    ref.bn.register_forward_hook(lambda m, i, o: seen_ref.append(o.detach().clone()))
    x = torch.rand(8, IN)
    assert "hooks" in head.fast_path_reason(new, x)
    with traced_epifuse_ops() as ran:
        y = new(x)
    assert ran == [] and len(seen) == 1
    assert torch.equal(y, ref(x)) and torch.equal(seen[0], seen_ref[0])


@pytest.mark.parametrize("change", ["dim", "hook", "replaced"])
def test_p84_softmax_module_changed_runs_that_module(change, fused_on_cpu):
    """ModelNew (problem 84) fuses Model's nn.Softmax(dim=1): made into something else, the head
    up to the scale stays fused and that module runs after it."""
    ref, new = make_pair(84, init_args(84, IN, OUT))
    log = []
    for m in (ref, new):
        if change == "dim":
            m.softmax.dim = 0
        elif change == "hook":
            m.softmax.register_forward_hook(lambda *args: log.append(1))
        else:
            m.softmax = torch.nn.LogSoftmax(dim=1)
    x = torch.rand(8, IN)
    with traced_epifuse_ops() as ran:
        y = new(x)
    assert "fused_head" in ran and "affine_softmax" not in ran, ran
    assert rel_err(y, ref(x)) < 1e-6
    assert log == ([1, 1] if change == "hook" else [])
