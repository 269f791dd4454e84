"""The fused backward on a supported GPU: kernels against fold.py, ModelNew's gradients against a
float64 oracle (no worse than eager's), opcheck with autograd, torch.compile, CUDA graphs.

Marked `hopper` (skipped with a reason without a GPU the kernels were built for).
"""

from __future__ import annotations

import pytest
import torch

from epifuse import fold, head, ops
from epifuse.fused_head import fused_head
from epifuse.head_config import HeadConfig
from helpers import (DTYPE_OF, FUSED_NODE, ORACLE_TOL, float64_twin, init_args, make_pair,
                     precision_of, rel_err)

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")
KINDS = ["ieee", "tf32", "bf16", "fp16"]
PARAMS = ("gemm.weight", "gemm.bias", "bn.weight", "bn.bias", "scale")


def _pair(number, args, kind):
    ref, new = make_pair(number, args, precision=precision_of(kind))
    dtype = DTYPE_OF[kind]
    return ref.to(CUDA, dtype), new.to(CUDA, dtype)


def _grads(model, x, w):
    y = model(x)
    names = ["x", *PARAMS]
    leaves = [x, *(model.get_parameter(p) for p in PARAMS)]
    return y, dict(zip(names, torch.autograd.grad((y * w).sum(), leaves)))


def _err(actual, expected, floor=0.0):
    e = expected.detach().double()
    a = actual.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(max(floor, 1e-300))).item()


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_gradients_no_worse_than_eager(number, kind, mode):
    """Every gradient's error against float64 within 2x eager's (plus the dtype's floor)."""
    ref, new = _pair(number, init_args(number, 512, 384), kind)
    oracle = float64_twin(ref)
    for m in (ref, new, oracle):
        m.train(mode == "train")
    if kind == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True  # eager TF32, as our 'tf32' forces
    try:
        g = torch.Generator(device=CUDA).manual_seed(0)
        x = torch.rand(256, 512, device=CUDA, generator=g).to(DTYPE_OF[kind])
        w = torch.randn(256, 384, device=CUDA, generator=g)
        y, ours = _grads(new, x.clone().requires_grad_(), w.to(x.dtype))
        assert y.grad_fn.name() == FUSED_NODE
        _, eager = _grads(ref, x.clone().requires_grad_(), w.to(x.dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    _, exact = _grads(oracle, x.double().requires_grad_(), w.double())
    vanishing = {"gemm.bias"} | ({"scale"} if number == 39 else set())
    for name, e in exact.items():
        floor = exact["gemm.weight"].norm().item() if mode == "train" and name in vanishing else 0
        err_ours, err_eager = _err(ours[name], e, floor), _err(eager[name], e, floor)
        print(f"p{number} {kind} {mode} grad {name}: ours {err_ours:.2e}, eager {err_eager:.2e}")
        assert ours[name].dtype == eager[name].dtype and ours[name].shape == eager[name].shape
        assert err_ours <= 2 * err_eager + ORACLE_TOL[kind] / 10, name


@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "plain"])
@pytest.mark.parametrize("shape", [(64, 96), (33, 65), (1000, 4097), (2048, 1024)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernels_match_fold(dtype, shape, softmax):
    m, n = shape
    g = torch.Generator(device=CUDA).manual_seed(1)
    grad = torch.randn(m, n, device=CUDA, generator=g).to(dtype)
    z = torch.randn(m, n, device=CUDA, generator=g).to(dtype)
    out = torch.softmax(torch.randn(m, n, device=CUDA, generator=g), 1).to(dtype) if softmax \
        else None
    rowdot = ops.softmax_grad_rowdot(grad, out) if softmax else None
    if softmax:
        torch.testing.assert_close(rowdot, (grad.double() * out.double()).sum(1).float(),
                                   rtol=1e-5, atol=1e-5)
    sums = ops.head_grad_sums(grad, out, rowdot, z)
    expected = fold.grad_sums(grad, out, z)
    assert rel_err(sums[:2 * n], expected[:2 * n]) < 1e-5 and sums[-1].item() == m
    gamma, beta, bias = (torch.rand(n, device=CUDA) + 0.5, torch.randn(n, device=CUDA),
                         torch.randn(n, device=CUDA))
    pre = torch.rand(n, device=CUDA) + 0.5
    colsum, colsumsq = fold.column_stats(z)
    a, c, moments = ops.bn_fold_batch(colsum, colsumsq, m, bias, gamma, beta, pre, None, eps=1e-5)
    f = fold.fold_train(colsum, colsumsq, m, bias, gamma, beta, pre, None, 1e-5)
    torch.testing.assert_close(moments, fold.moments_vector(f.mean, f.var, m), rtol=1e-12,
                               atol=1e-12)
    for training in (True, False):
        got = ops.head_grad_coefficients(sums, None, colsum, colsumsq, moments, bias, gamma, beta,
                                         pre, None, training=training, eps=1e-5)
        ref = fold.grad_coefficients(sums, None, colsum, colsumsq, moments, bias, gamma, beta,
                                     pre, None, training, 1e-5)
        torch.testing.assert_close(got[0], torch.stack([ref.A, ref.B, ref.C]).float())
        for actual, exp in zip(got[1:5], (ref.bias, ref.gamma, ref.beta, ref.pre)):
            torch.testing.assert_close(actual, exp.float(), rtol=1e-5, atol=1e-5)
        dz = ops.head_grad_z(grad, out, rowdot, z, got[0])
        exp = fold.grad_z(grad, out, z, *got[0].unbind(0))
        assert dz.dtype == dtype
        assert rel_err(dz, exp) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_sums_are_deterministic():
    g = torch.Generator(device=CUDA).manual_seed(2)
    grad, z = (torch.randn(4096, 1024, device=CUDA, generator=g) for _ in range(2))
    first = ops.head_grad_sums(grad, None, None, z)
    for _ in range(3):
        assert torch.equal(ops.head_grad_sums(grad, None, None, z), first)


def test_scalar_scale_gradient_on_reused_scratch():
    """A one-element scale's gradient is summed over the column blocks through a scratch counter.

    The scratch comes from the caching allocator uninitialized, and back-to-back calls get the
    same block (holding the last call's count): every call must clear the counter itself, or the
    last block is never recognised and the scale's gradient is left unwritten.
    """
    g = torch.Generator(device=CUDA).manual_seed(4)
    m, n = 64, 1000  # four column blocks
    z = torch.randn(m, n, device=CUDA, generator=g)
    grad = torch.randn(m, n, device=CUDA, generator=g)
    gamma, beta, bias = (torch.rand(n, device=CUDA) + 0.5, torch.randn(n, device=CUDA),
                         torch.randn(n, device=CUDA))
    colsum, colsumsq = fold.column_stats(z)
    sums = ops.head_grad_sums(grad, None, None, z)
    _, _, moments = ops.bn_fold_batch(colsum, colsumsq, m, bias, gamma, beta, None, None, eps=1e-5)
    for step in range(4):
        post = torch.full((1,), 0.5 + step, device=CUDA)
        got = ops.head_grad_coefficients(sums, None, colsum, colsumsq, moments, bias, gamma,
                                         beta, None, post, training=True, eps=1e-5)
        ref = fold.grad_coefficients(sums, None, colsum, colsumsq, moments, bias, gamma, beta,
                                     None, post, True, 1e-5)
        expected = ref.post.sum().reshape(1)
        torch.testing.assert_close(got[5].double(), expected, rtol=1e-5,
                                   atol=1e-6 * ref.post.abs().sum().item())


def _fused_head_sample(training=True, softmax=True, scale_before_bn=False):
    g = torch.Generator(device=CUDA).manual_seed(3)

    def t(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(shape, device=CUDA, generator=g) * (hi - lo) + lo).requires_grad_()

    n = 64
    args = (t(48, 40), t(n, 40), t(n), t(n, lo=0.5, hi=1.5), t(n),
            t(n if scale_before_bn else 1, lo=0.5, hi=2.0),
            torch.rand(n, device=CUDA), torch.rand(n, device=CUDA) + 0.5)
    return args, HeadConfig(precision="ieee", training=training, scale_before_bn=scale_before_bn,
                            softmax=softmax, eps=1e-5, group_name="").kwargs()


@pytest.mark.parametrize("variant", [dict(), dict(training=False), dict(softmax=False),
                                     dict(scale_before_bn=True)],
                         ids=["train-softmax", "eval", "train-plain", "pre-scale"])
def test_opcheck_fused_head(variant):
    torch.library.opcheck(torch.ops.epifuse.fused_head.default, *_fused_head_sample(**variant))


def test_double_backward_raises():
    args, kwargs = _fused_head_sample()
    out = fused_head(*args, **kwargs)[0]
    (gx,) = torch.autograd.grad(out, [args[0]], torch.randn_like(out, requires_grad=True),
                                create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_no_grad_saves_nothing(context):
    _, new = _pair(84, init_args(84, 256, 512), "bf16")
    x = torch.rand(512, 256, device=CUDA).bfloat16()
    new(x)  # warm the allocator
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    with getattr(torch, context)():
        y = new(x)
    assert y.grad_fn is None
    # Only the output (plus the [N] vectors freed with the forward) remains.
    assert torch.cuda.memory_allocated() - base <= y.numel() * y.element_size()


def test_saved_memory_below_eager():
    ref, new = _pair(84, init_args(84, 512, 2048), "ieee")
    x = torch.rand(1024, 512, device=CUDA, requires_grad=True)
    used = []
    for model in (new, ref):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = model(x)
        used.append(torch.cuda.memory_allocated() - base)
        del y
    assert used[0] < used[1], used


@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_compile_fullgraph_training_step(number):
    torch._dynamo.reset()
    ref, new = _pair(number, init_args(number, 256, 128), "ieee")
    oracle = float64_twin(ref).train()
    new.train()

    # fullgraph forward; AOTAutograd compiles the backward graph (the fused backward's ops) with it.
    compiled = torch.compile(new, fullgraph=True)
    x = torch.rand(64, 256, device=CUDA)
    w = torch.randn(64, 128, device=CUDA)
    (compiled(x) * w).sum().backward()
    (oracle(x.double()) * w.double()).sum().backward()
    for name in PARAMS:
        p, q = new.get_parameter(name), oracle.get_parameter(name)
        vanishing = name == "gemm.bias" or (number == 39 and name == "scale")
        floor = oracle.gemm.weight.grad.norm().item() if vanishing else 0.0
        assert _err(p.grad, q.grad, floor) <= 1e-4, name
    assert new.bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_cuda_graph_forward_backward(number, mode):
    ref, new = _pair(number, init_args(number, 256, 128), "bf16")
    new.train(mode == "train")
    static_x = torch.rand(96, 256, device=CUDA).bfloat16().requires_grad_()
    static_w = torch.randn(96, 128, device=CUDA).bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch.cuda.graphs asks
        for _ in range(2):
            new.zero_grad(set_to_none=False)
            (new(static_x) * static_w).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    new.zero_grad(set_to_none=False)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = new(static_x)
        (static_y * static_w).sum().backward()
    x = torch.rand(96, 256, device=CUDA).bfloat16()
    static_x.data.copy_(x)
    new.zero_grad(set_to_none=False)
    graph.replay()
    torch.cuda.synchronize()
    eager_x = x.clone().requires_grad_()
    twin = float64_twin(ref).train(mode == "train")
    twin.load_state_dict({k: v.double() for k, v in new.state_dict().items()})
    y64 = twin(eager_x.double())
    (y64 * static_w.double()).sum().backward()
    assert head.fast_path_reason(new, x) is None
    assert rel_err(static_y, y64) <= ORACLE_TOL["bf16"]
    assert rel_err(static_x.grad, eager_x.grad) <= 4 * ORACLE_TOL["bf16"]


def test_backward_matmul_precision_ignores_global_flag():
    a = torch.randn(256, 512, device=CUDA)
    b = torch.randn(512, 128, device=CUDA)
    exact = (a.double() @ b.double())
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        ieee = ops.backward_matmul(a, b, "ieee")
        assert torch.backends.cuda.matmul.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    tf32 = ops.backward_matmul(a, b, "tf32")
    assert not torch.backends.cuda.matmul.allow_tf32
    assert rel_err(ieee, exact) < 1e-6 < rel_err(tf32, exact)


def _copies_in(fn) -> int:
    """How many K-major operand copies (transpose.cu's kernel launches) ran inside ``fn()``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "transpose_tiles_kernel" in e.name)


@pytest.mark.parametrize("case", ["dW", "dX", "small", "bf16"])
def test_backward_matmul_k_major_copies(case):
    """TF32 products with MN-major operands copy them K-major where that pays (gemm_dispatch.cu,
    cublas_tf32_k_major_copies), with the same result as cuBLAS on the views."""
    g = torch.Generator(device=CUDA).manual_seed(3)
    rows, n_out, n_in = (256, 384, 512) if case == "small" else (2304, 2048, 2048)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    dz = torch.randn(rows, n_out, device=CUDA, generator=g).to(dtype)
    x = torch.rand(rows, n_in, device=CUDA, generator=g).to(dtype)
    w = torch.randn(n_out, n_in, device=CUDA, generator=g).to(dtype)
    # dW = dz^T . x (both MN-major); dX = dz . W (W MN-major)
    a, b = (dz, w) if case == "dX" else (dz.t(), x)
    precision = "tf32" if dtype == torch.float32 else ""
    expected_copies = {"dW": 2, "dX": 1, "small": 0, "bf16": 0}[case]
    out = []
    assert _copies_in(lambda: out.append(ops.backward_matmul(a, b, precision))) == expected_copies
    exact = a.double() @ b.double()
    bound = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert out[0].dtype == dtype and rel_err(out[0], exact) < bound
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
    try:
        views = a @ b  # cuBLAS on the views, as without the copies
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert rel_err(out[0], exact) <= 1.5 * rel_err(views, exact) + 1e-6
