"""The epifuse ops, each on its own.

Everywhere: the ops on CPU tensors (the C++ op's checks, then its float64 reference: the executable
spec) and schemas, and opcheck on CPU, for every op of ``epifuse.ops.OP_NAMES``.
Marked `hopper` (skipped with a reason without a GPU the kernels were built for): each CUDA op
against the Python oracle (fold.py / float64 math) and against its CPU kernel, and opcheck on CUDA.
Bad arguments: tests/test_errors.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from epifuse import fold, ops
from epifuse.head_config import DEFAULT, HeadConfig
from helpers import cuda_kernels_run, cutlass_gemms, ops_run, rel_err
from op_samples import DTYPES, HOOKS, all_cases, op, samples

CUDA = torch.device("cuda")
CASES = [pytest.param(name, d, i, id=f"{name}-{d}-{i}") for name, d, i in all_cases()]
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.hopper)]


def _affine64(z, a, c):
    """a * z + c in float64 (a, c None: z itself)."""
    y = z.double()
    return y if a is None else y * a.double() + c.double()


def _sample(name, device, dtype_id, index, request):
    """Sample ``index`` of op ``name``; a synchronized hook's reduces over a one-rank group."""
    group_name = request.getfixturevalue("one_rank_group") if name in HOOKS else ""
    return samples(device, DTYPES[dtype_id], group_name=group_name)[name][index]


@pytest.mark.parametrize("name,dtype_id,index", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, name, dtype_id, index, request):
    args, kwargs = _sample(name, device, dtype_id, index, request)
    torch.library.opcheck(op(name), args, kwargs)


# --------------------------------------------------------------------------- the CPU kernels

@pytest.mark.parametrize("name,dtype_id,index", CASES)
def test_fake_kernel_matches_cpu_kernel(name, dtype_id, index, request):
    args, kwargs = _sample(name, "cpu", dtype_id, index, request)
    real = op(name)(*copy.deepcopy(args), **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = op(name)(*fake_args, **kwargs)
    flat_real = real if isinstance(real, tuple) else (real,)
    flat_fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(flat_real, flat_fake, strict=True):
        if r is None:
            assert f is None
            continue
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device)


# The head ops' keyword-only settings, in schema order (cpp/ops/head_config.h's table).
HEAD_OP_SETTINGS = {
    "fused_head": HeadConfig._fields,
    "fused_head_backward": HeadConfig._fields,
    "fused_linear": ("precision", "softmax", "activation", "negative_slope", "gemm_dtype",
                     "out_dtype", "for_backward"),
    "bn_fold_train": ("momentum", "eps"),
    "bn_fold_eval": ("eps",),
    "bn_fold_batch": ("eps",),
    "update_running_stats": ("momentum",),
    "head_grad_coefficients": ("training", "eps"),
    "merge_fold": ("eps",),
    "normalized_grad_sums": ("eps",),
    "synced_batch_fold": ("eps", "group_name"),
    "synced_grad_sums": ("eps", "group_name"),
}


@pytest.mark.parametrize("name", HEAD_OP_SETTINGS)
def test_head_op_settings_are_keyword_only_with_defaults(name):
    """Tensors (and counts, needs) positional; settings keyword-only, defaulted as HeadConfig."""
    arguments = getattr(torch.ops.epifuse, name).default._schema.arguments
    keyword = [a for a in arguments if a.kwarg_only]
    assert tuple(a.name for a in keyword) == HEAD_OP_SETTINGS[name]
    for a in keyword:
        assert a.has_default_value(), a.name
        assert a.default_value == getattr(DEFAULT, a.name), a.name
    assert not any(a.name in HeadConfig._fields for a in arguments if not a.kwarg_only)


def test_fused_head_defaults_are_head_config_defaults():
    g = torch.Generator().manual_seed(1)
    x, w = torch.rand(6, 5, generator=g), torch.rand(4, 5, generator=g)
    params = [torch.rand(4, generator=g) + 0.5 for _ in range(6)]
    tensors = (x, w, *params, None)  # num_batches_tracked None: the running statistics stay
    by_default = torch.ops.epifuse.fused_head(*tensors)
    assert DEFAULT.kwargs() == {}  # only what differs from the defaults is passed
    spelled_out = torch.ops.epifuse.fused_head(*tensors, **DEFAULT._asdict())
    for a, b in zip(by_default, spelled_out, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError):  # settings are keyword-only
        torch.ops.epifuse.fused_head(*tensors, "ieee")


def test_head_config_kwargs_pass_only_what_differs():
    """HeadConfig.kwargs() leaves the schemas' defaults to the op (the Python call converts every
    keyword given: half of fused_head's host time with all of them); the op's result is the same."""
    config = HeadConfig(training=False, activation="relu", momentum=None, has_scale=False)
    assert config.kwargs() == {"training": False, "activation": "relu", "momentum": None,
                               "has_scale": False}
    g = torch.Generator().manual_seed(2)
    x, w = torch.rand(6, 5, generator=g), torch.rand(4, 5, generator=g)
    tensors = (x, w, *(torch.rand(4, generator=g) + 0.5 for _ in range(6)), None)
    short = torch.ops.epifuse.fused_head(*tensors, **config.kwargs())
    full = torch.ops.epifuse.fused_head(*tensors, **config._asdict())
    for a, b in zip(short, full, strict=True):
        assert torch.equal(a, b)


def test_gemm_affine_cpu_values():
    x, w = torch.randn(6, 5), torch.randn(4, 5)
    a, c = torch.randn(4), torch.randn(4)
    expected = a.double() * (x.double() @ w.double().T) + c.double()
    torch.testing.assert_close(ops.gemm_affine(x, w, a, c, "ieee"), expected.float())
    assert ops.gemm_affine(x.half(), w.half(), a, c, "").dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemm_colstats_cpu_values(dtype):
    x, w = torch.randn(6, 5).to(dtype), torch.randn(4, 5).to(dtype)
    z, s1, s2 = ops.gemm_colstats(x, w, "tf32" if dtype == torch.float32 else "")
    z64 = x.double() @ w.double().T
    torch.testing.assert_close(z, z64.to(dtype))
    assert s1.dtype == s2.dtype == torch.float64
    # The statistics of z as returned (a 16-bit z's rounded values), not of the exact product.
    zs = z.double()
    torch.testing.assert_close(s1, zs.sum(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(s2, (zs * zs).sum(0), rtol=1e-12, atol=0)


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["mom0.1", "momNone"])
def test_bn_fold_train_cpu_matches_batchnorm1d(momentum, position):
    """Against nn.BatchNorm1d in float64 (not fold.py, which the CPU kernel itself calls)."""
    g = torch.Generator().manual_seed(3)
    m, n = 7, 5
    z = torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 2
    bias, gamma, beta = (torch.randn(n, generator=g) for _ in range(3))
    scale = torch.rand(n, generator=g) + 0.5
    bn = torch.nn.BatchNorm1d(n, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(gamma), bn.bias.copy_(beta)
        bn.running_mean.copy_(torch.randn(n, generator=g)), bn.running_var.uniform_(0.5, 2)
        bn.num_batches_tracked.fill_(4)
    rm, rv, nbt = bn.running_mean.float(), bn.running_var.float(), bn.num_batches_tracked.clone()
    pre, post = (scale, None) if position == "pre" else (None, scale)
    a, c, moments = ops.bn_fold_train(z.sum(0), (z * z).sum(0), m, bias, gamma, beta, pre, post,
                                      rm, rv, nbt, momentum=momentum, eps=bn.eps)
    u = (z + bias.double()) * (scale.double() if pre is not None else 1)
    with torch.no_grad():
        expected = bn.train()(u) * (scale.double() if post is not None else 1)
    assert a.dtype == c.dtype == torch.float32
    torch.testing.assert_close(a.double() * z + c.double(), expected, rtol=1e-5, atol=1e-5)
    # The batch's moments of u (mean, biased variance, rows): what the backward normalizes with.
    torch.testing.assert_close(moments, torch.cat([u.mean(0), u.var(0, unbiased=False),
                                                   u.new_full((1,), m)]))
    torch.testing.assert_close(rm, bn.running_mean.float())
    torch.testing.assert_close(rv, bn.running_var.float())
    assert nbt.item() == bn.num_batches_tracked.item() == 5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_id", ["fp16", "bf16"])
def test_backward_matmul_fp32_out_keeps_the_16_bit_overflow(device, dtype_id):
    """backward_matmul(out_dtype=float32) of 16-bit operands (dW under autocast): the product in
    fp32, with +-inf exactly where the fp16 product overflows (GradScaler then skips the steps
    eager's fp16 dW makes it skip); bf16 has fp32's range, so nothing overflows there."""
    dtype = DTYPES[dtype_id]
    rows = torch.tensor([1.0, -10.0, 100.0, -1000.0])[:, None]
    cols = torch.tensor([1.0, 10.0, -100.0])[None, :]
    a = (torch.ones(4, 8) * rows).to(device, dtype)
    b = (torch.ones(8, 3) * cols).to(device, dtype)
    got = ops.backward_matmul(a, b, "", out_dtype=torch.float32)
    exact = 8 * rows * cols  # small integers: exact in every dtype here
    assert got.dtype == torch.float32 and got.device.type == device
    want = exact.half().float() if dtype == torch.float16 else exact
    assert torch.equal(got.cpu(), want), (got, want)
    assert torch.isinf(got).any() == (dtype == torch.float16)
    assert ops.backward_matmul(a, b, "").dtype == dtype  # without out_dtype: a's dtype


@pytest.mark.hopper
@pytest.mark.parametrize("n,hopper", [(136, True), (130, False)], ids=["aligned", "n130"])
@pytest.mark.parametrize("layout", ["dX", "dW"])
def test_fp16_product_applies_the_overflow_in_the_gemm_epilogue(layout, n, hopper):
    """backward_matmul(out_dtype=float32) of fp16 operands on an H100/H200: one Hopper GEMM whose
    epilogue sets fp16's overflow (no cuBLAS product and no fp16_overflow_ pass), for a row-major a
    (dX = dz . W) and a column-major view (dW = dz^T . x); rows TMA cannot read (N = 130) take
    cuBLAS and the pass. Either way: +-inf exactly where the fp16 product overflows, every other
    value the fp32 product. Row scales of 1 or -+100 and column scales of 1 or 10 over positive
    factors in [0.75, 1] keep every product either below 25600 or above 144000 in magnitude."""
    m, k = 200, 256
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([1.0, -100.0, 100.0, -1.0]).repeat(m // 4)[:, None]
    cols = torch.tensor([1.0, 10.0]).repeat(n // 2)[None, :]
    a64 = torch.empty(m, k, dtype=torch.float64).uniform_(0.75, 1, generator=g) * rows
    b64 = torch.empty(k, n, dtype=torch.float64).uniform_(0.75, 1, generator=g) * cols
    a16, b = a64.half(), b64.half().cuda()
    a = a16.cuda() if layout == "dX" else a16.t().contiguous().cuda().t()  # dW: an M-major view
    out = []
    names = cuda_kernels_run(lambda: out.append(ops.backward_matmul(a, b, "", out_dtype=torch.float32)))
    ran_pass = any("fp16_overflow" in name for name in names)
    assert ran_pass != hopper, names
    assert any("Fp16Overflow" in name for name in names) == hopper, names  # our epilogue's node
    got = out[0].cpu()
    exact = a16.double() @ b64.half().double()
    overflow = exact.abs() >= 65520
    assert got.dtype == torch.float32
    assert 0 < overflow.sum() < overflow.numel()
    assert torch.equal(torch.isinf(got), overflow)
    assert torch.equal(torch.sign(got[overflow]), torch.sign(exact[overflow]))
    # fp32 accumulation of exact products (~1e-6 over K = 256); an fp16 result would be ~3e-4
    assert rel_err(got[~overflow], exact[~overflow]) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype_id", ["fp32", "bf16"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["mom0.1", "momNone"])
def test_update_running_stats_from_the_batch_moments_matches_batchnorm1d(momentum, dtype_id,
                                                                         device):
    """bn_fold_batch's moments, then update_running_stats: nn.BatchNorm1d's update (float64
    module, the buffers compared in their dtype), as bn_fold_train makes it in one kernel."""
    g = torch.Generator().manual_seed(5)
    m, n, dtype = 9, 300, DTYPES[dtype_id]  # 300 columns: two blocks of the CUDA kernel
    z = torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 2
    bias, gamma, beta = (torch.randn(n, generator=g) for _ in range(3))
    bn = torch.nn.BatchNorm1d(n, momentum=momentum).double()
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(n, generator=g)), bn.running_var.uniform_(0.5, 2)
        bn.num_batches_tracked.fill_(4)
    stats = [bn.running_mean.to(device, dtype, copy=True),
             bn.running_var.to(device, dtype, copy=True),
             bn.num_batches_tracked.to(device, copy=True)]
    params = [p.to(device, dtype) for p in (bias, gamma, beta)]
    zd = z.to(device)
    _, _, moments = ops.bn_fold_batch(zd.sum(0), (zd * zd).sum(0), m, *params, None, None)
    ops.update_running_stats(moments, *stats, momentum=momentum)
    with torch.no_grad():
        bn.train()(z + bias.to(dtype).double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(stats[0].cpu(), bn.running_mean) <= tol
    assert rel_err(stats[1].cpu(), bn.running_var) <= tol
    assert stats[2].item() == bn.num_batches_tracked.item() == 5


def test_bn_fold_eval_cpu_values():
    n = 3
    bias, gamma, beta, scale = torch.randn(n), torch.rand(n) + 0.5, torch.randn(n), torch.rand(n) + 1
    rm, rv = torch.randn(n), torch.rand(n) + 0.5
    a, c = ops.bn_fold_eval(bias, gamma, beta, scale, None, rm, rv, eps=1e-5)
    z = torch.randn(4, n, dtype=torch.float64)
    expected = torch.nn.functional.batch_norm(
        (z + bias.double()) * scale.double(), rm.double(), rv.double(), gamma.double(),
        beta.double(), False, 0.0, 1e-5)
    torch.testing.assert_close(a.double() * z + c.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_affine", [True, False], ids=["affine", "plain"])
def test_affine_softmax_cpu_values(with_affine):
    z = torch.randn(4, 9)
    a, c = (torch.randn(9), torch.randn(9)) if with_affine else (None, None)
    expected = torch.softmax(z * a + c if with_affine else z, dim=1)
    torch.testing.assert_close(ops.affine_softmax(z, a, c), expected)
    inplace = z.clone()
    assert ops.affine_softmax_(inplace, a, c) is None
    torch.testing.assert_close(inplace, expected)


def test_affine_inplace_cpu_values():
    z, a, c = torch.randn(4, 9).bfloat16(), torch.randn(9), torch.randn(9)
    expected = (z.double() * a.double() + c.double()).bfloat16()
    ops.affine_(z, a, c)
    assert torch.equal(z, expected)


def test_bad_precision_string_is_rejected():
    with pytest.raises(ValueError, match="precision"):
        ops.gemm_affine(torch.randn(2, 3), torch.randn(4, 3), torch.ones(4), torch.zeros(4), "fp64")


# --------------------------------------------------------------------------- the CUDA kernels

# 3xtf32 must stay within twice the IEEE bound (fp32-class accuracy on the tensor cores).
KINDS = {"ieee": (torch.float32, "ieee", 2e-6), "3xtf32": (torch.float32, "3xtf32", 4e-6),
         "tf32": (torch.float32, "tf32", 2e-3),
         "fp16": (torch.float16, "", 2e-3), "bf16": (torch.bfloat16, "", 1e-2)}
# Hopper paths (gemm_plan.cu, sm90_kernel): (1024, 4096, 128) stream-K (eval 8 x 16 tiles of
# 128x256, training 32 x 4 transposed tiles); (512, 4096, 512) stream-K in fp32 and the narrow-output
# SmallM tiles in 16 bits (64 wide tiles: at most half the SMs); (4096, 256, 64): narrow in every
# dtype (32 wide tiles), SmallM at 4096 rows; (2048, 2304, 64) and (2100, 2304, 64): data-parallel
# 128x256 tiles in both forms (training: 18 x 8-9 transposed tiles, 8-9 partials per column; 2100
# rows leave a ragged batch tile); (256, 4096, 512), (40, 1000, 64), (300, 1000, 72),
# (33, 8200, 4096) and (200, 8200, 1024): batches of <= 384 rows, the transposed 128x64 tiles (one to
# five batch tiles, ragged) for both epilogues.
GEMM_SHAPES = [(1, 1, 1), (3, 17, 5), (17, 1000, 3), (1000, 3, 4097), (4097, 129, 17),
               (256, 4096, 512), (512, 4096, 512), (1024, 4096, 128), (4096, 256, 64),
               (2048, 2304, 64), (2100, 2304, 64), (40, 1000, 64), (300, 1000, 72),
               (33, 8200, 4096), (200, 8200, 1024)]
GEMM_CASES = [pytest.param(kind, s, id=f"{kind}-M{s[0]}-N{s[1]}-K{s[2]}")
              for kind in KINDS for s in GEMM_SHAPES]


def _gemm_inputs(m, n, k, dtype):
    g = torch.Generator(device=CUDA).manual_seed(m * 7 + n * 3 + k)
    x = (torch.rand(m, k, device=CUDA, generator=g) - 0.3).to(dtype)
    w = (torch.rand(n, k, device=CUDA, generator=g) - 0.5).to(dtype) / k ** 0.5
    return x, w


@pytest.mark.hopper
@pytest.mark.parametrize("kind,shape", GEMM_CASES)
def test_gemm_affine(kind, shape):
    dtype, precision, tol = KINDS[kind]
    x, w = _gemm_inputs(*shape, dtype)
    a = torch.rand(shape[1], device=CUDA) + 0.5
    c = torch.randn(shape[1], device=CUDA)
    expected = a.double() * (x.double() @ w.double().T) + c.double()
    y = ops.gemm_affine(x, w, a, c, precision)
    assert y.dtype == dtype and y.shape == (shape[0], shape[1])
    assert rel_err(y, expected) <= tol


@pytest.mark.hopper
@pytest.mark.parametrize("op_name", ["colstats", "affine"])
@pytest.mark.parametrize("kind", ["bf16", "tf32"])
def test_narrow_outputs_run_the_small_batch_tiles(kind, op_name):
    """A batch of 4096 rows into 256 columns (32 wide tiles: a quarter of the SMs or fewer) runs the
    transposed 128x64 tiles of small batches, not stream-K (gemm_plan.cu, narrow_output): the
    very kernel a 128-row batch launches. 1024 x 4096 (128 wide tiles) keeps another one."""
    dtype, precision, _ = KINDS[kind]

    def gemm(m, n, k):
        x, w = _gemm_inputs(m, n, k, dtype)
        if op_name == "colstats":
            return lambda: ops.gemm_colstats(x, w, precision)
        a, c = torch.ones(n, device=CUDA), torch.zeros(n, device=CUDA)
        return lambda: ops.gemm_affine(x, w, a, c, precision)

    narrow = cutlass_gemms(gemm(4096, 256, 64))
    small_batch = cutlass_gemms(gemm(128, 256, 64))
    wide = cutlass_gemms(gemm(1024, 4096, 128))
    assert len(narrow) == len(small_batch) == len(wide) == 1, (narrow, small_batch, wide)
    # The rule: wide tiles x (2 in 16 bits, 4 in fp32) <= SMs (32 tiles: every H100 / H200 in 16
    # bits; in fp32 those with >= 128 SMs).
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    assert (narrow == small_batch) == ((4 if kind == "tf32" else 2) * 32 <= sms)
    assert wide != small_batch


# Shapes reaching each eval kernel form: the portable GEMM and pass (3, 17, 5: misaligned K), the
# transposed small-batch tiles (40, 1000, 64), the 128x256 tiles (2100, 2304, 64), stream-K
# (512, 4096, 512).
EPILOGUE_ACTIVATION_CASES = [
    pytest.param(kind, s, act, id=f"{kind}-M{s[0]}-N{s[1]}-K{s[2]}-{act}")
    for kind in KINDS for s in [(3, 17, 5), (40, 1000, 64), (2100, 2304, 64), (512, 4096, 512)]
    for act in ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu")]


@pytest.mark.hopper
@pytest.mark.parametrize("kind,shape,activation", EPILOGUE_ACTIVATION_CASES)
def test_gemm_affine_applies_the_activation_in_its_epilogue(kind, shape, activation):
    """An eval head's layer in one GEMM: act(a * (x . W^T) + c) against fold.activate in float64."""
    dtype, precision, tol = KINDS[kind]
    x, w = _gemm_inputs(*shape, dtype)
    a = torch.rand(shape[1], device=CUDA) + 0.5
    c = torch.randn(shape[1], device=CUDA)
    h = a.double() * (x.double() @ w.double().T) + c.double()
    y = ops.gemm_affine(x, w, a, c, precision, activation=activation, negative_slope=0.2)
    assert y.dtype == dtype and y.shape == (shape[0], shape[1])
    expected = fold.activate(h, activation, 0.2)
    # The activation's slope is at most ~1.1: the GEMM's error carries through unamplified.
    assert rel_err(y, expected) <= tol
    # Not the affine alone: the activation changed the negative half.
    assert rel_err(y, h) > 10 * tol


@pytest.mark.hopper
@pytest.mark.parametrize("kind,shape", GEMM_CASES)
def test_gemm_colstats(kind, shape):
    dtype, precision, tol = KINDS[kind]
    x, w = _gemm_inputs(*shape, dtype)
    z64 = x.double() @ w.double().T
    z, colsum, colsumsq = ops.gemm_colstats(x, w, precision)
    assert z.dtype == dtype and colsum.dtype == colsumsq.dtype == torch.float64
    assert rel_err(z, z64) <= tol
    # Every path (the fused epilogues and the portable pass, taken here by the shapes that are not
    # 16-byte aligned) sums z as stored, in fp64: a 16-bit z's statistics are those of its rounded
    # values, which the affine pass then normalizes (epilogues.hpp says why).
    zs = z.double()
    assert rel_err(colsum, zs.sum(0)) <= 1e-11
    assert rel_err(colsumsq, (zs * zs).sum(0)) <= 1e-11


# Column statistics are sums of the GEMM's fp32 accumulator, which for fp32 inputs is the stored z:
# whichever kernel sums it (fused epilogue or portable pass), the fp64 sums must be those of z itself,
# and the variance derived from them must survive columns whose mean dwarfs their spread (x + 100:
# |mean| / std ~ 1e3, where E[z^2] - E[z]^2 cancels ~6 digits that fp32 sums would not have).
# Shapes: transposed 128x256 tiles data-parallel (ragged batch tile), the same with stream-K
# (1024 x 4096: 128 tiles), the narrow-output 128x64 tiles (32 and 15 wide tiles, the second ragged
# in both directions), and the small-batch 128x64 tiles (ragged).
STATS_SHAPES = [(2100, 2304, 64), (1024, 4096, 64), (512, 2048, 128), (1030, 264, 64),
                (300, 1000, 72)]


@pytest.mark.hopper
@pytest.mark.parametrize("shape", STATS_SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in STATS_SHAPES])
def test_gemm_colstats_sums_the_accumulator_exactly(shape):
    m, n, k = shape
    x, w = _gemm_inputs(m, n, k, torch.float32)
    z, colsum, colsumsq = ops.gemm_colstats(x + 100, w, "tf32")
    z64 = z.double()
    assert rel_err(colsum, z64.sum(0)) <= 1e-12
    assert rel_err(colsumsq, (z64 * z64).sum(0)) <= 1e-12
    mean = colsum / m
    var = colsumsq / m - mean * mean
    assert (z64.mean(0).abs() / z64.std(0)).median() > 100  # the cancellation is really there
    assert rel_err(var, z64.var(0, unbiased=False)) <= 1e-6


# Ragged and aligned shapes over every GEMM path: SIMT (unaligned), cuBLAS + pass (ieee), sm90
# stream-K and data-parallel, sm80 (3xtf32; every kind under EPIFUSE_FORCE_SM80=1).
COVERAGE_SHAPES = [(5, 3, 7), (130, 264, 72), (257, 136, 64), (33, 100, 40), (1536, 1536, 64),
                   (2048, 2304, 64), (4100, 264, 64), (40, 1000, 64), (300, 1000, 72),
                   (33, 8200, 4096)]
COVERAGE_CASES = [pytest.param(kind, simt, s, id=f"{kind}{'-simt' if simt else ''}-M{s[0]}-N{s[1]}-K{s[2]}")
                  for kind in KINDS for simt in ((False, True) if kind == "ieee" else (False,))
                  for s in COVERAGE_SHAPES]


def _poison_cached_block(shape, dtype):
    """Leave a NaN-filled block of the output's size in the caching allocator.

    The op's output is then (almost surely) carved from it, so an element the kernels fail to write
    reads NaN instead of whatever an earlier, correct result left there.
    """
    torch.full(shape, float("nan"), dtype=dtype, device=CUDA)
    torch.cuda.synchronize()


@pytest.mark.hopper
@pytest.mark.parametrize("kind,simt,shape", COVERAGE_CASES)
def test_gemm_writes_every_output_element(kind, simt, shape):
    dtype, precision, _ = KINDS[kind]
    m, n, k = shape
    x, w = _gemm_inputs(m, n, k, dtype)
    a, c = torch.ones(n, device=CUDA), torch.zeros(n, device=CUDA)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = simt  # forced 'ieee' under TF32: the SIMT kernel
    try:
        _poison_cached_block((m, n), dtype)
        y = ops.gemm_affine(x, w, a, c, precision)
        _poison_cached_block((m, n), dtype)
        z, colsum, colsumsq = ops.gemm_colstats(x, w, precision)
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    for name, t in (("gemm_affine", y), ("gemm_colstats z", z), ("colsum", colsum),
                    ("colsumsq", colsumsq)):
        holes = torch.isnan(t).nonzero()
        assert holes.numel() == 0, f"{name}: {holes.shape[0]} unwritten elements, first {holes[:3].tolist()}"


def _fold_inputs(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(lo, hi, dt=dtype):
        return (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(CUDA, dt)

    m = 37
    z = torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 5
    colsum, colsumsq = (s.to(CUDA) for s in fold.column_stats(z))
    return dict(m=m, colsum=colsum, colsumsq=colsumsq, bias=t(-1, 1), gamma=t(0.5, 1.5),
                beta=t(-1, 1), s1=t(0.5, 2)[:1].clone(), sn=t(0.5, 2), rm=t(-1, 1), rv=t(0.5, 2))


FOLD_CASES = [pytest.param(d, n, scale, pos, mom, id=f"{d}-N{n}-{pos}{scale}-mom{mom}")
              for d in DTYPES for n in (1, 7, 4097) for scale in ("1", "N")
              for pos in ("pre", "post") for mom in (0.1, None)]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n,scale,pos,momentum", FOLD_CASES)
def test_bn_fold_train_and_eval(dtype_id, n, scale, pos, momentum):
    dtype = DTYPES[dtype_id]
    p = _fold_inputs(n, dtype)
    s = p["s1"] if scale == "1" else p["sn"]
    pre, post = (s, None) if pos == "pre" else (None, s)
    rm, rv, nbt = p["rm"].clone(), p["rv"].clone(), torch.tensor(2, device=CUDA)
    a, c, moments = ops.bn_fold_train(p["colsum"], p["colsumsq"], p["m"], p["bias"], p["gamma"],
                                      p["beta"], pre, post, rm, rv, nbt, momentum=momentum,
                                      eps=1e-5)
    f = fold.fold_train(p["colsum"], p["colsumsq"], p["m"], p["bias"], p["gamma"], p["beta"],
                        pre, post, 1e-5)
    assert a.dtype == c.dtype == torch.float32 and a.shape == c.shape == (n,)
    assert rel_err(a, f.a) <= 1e-6 and rel_err(c, f.c) <= 1e-6
    # The batch's moments, as bn_fold_batch writes them (the backward's input).
    assert moments.dtype == torch.float64 and moments.shape == (2 * n + 1,)
    torch.testing.assert_close(moments, fold.moments_vector(f.mean, f.var, p["m"]), rtol=1e-12,
                               atol=0)
    rm_ref, rv_ref, nbt_ref = p["rm"].clone(), p["rv"].clone(), torch.tensor(2, device=CUDA)
    fold.update_running_stats(rm_ref, rv_ref, nbt_ref, f.mean, f.var, p["m"], momentum)
    buf_tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert rm.dtype == dtype and rel_err(rm, rm_ref) <= buf_tol
    assert rel_err(rv, rv_ref) <= buf_tol
    assert nbt.item() == 3

    a, c = ops.bn_fold_eval(p["bias"], p["gamma"], p["beta"], pre, post, p["rm"], p["rv"],
                            eps=1e-5)
    f = fold.fold_eval(p["bias"], p["gamma"], p["beta"], pre, post, p["rm"], p["rv"], 1e-5)
    assert rel_err(a, f.a) <= 1e-6 and rel_err(c, f.c) <= 1e-6


@pytest.mark.hopper
def test_bn_fold_without_bias():
    p = _fold_inputs(9, torch.float32)
    a, c = ops.bn_fold_eval(None, p["gamma"], p["beta"], None, None, p["rm"], p["rv"], eps=1e-3)
    f = fold.fold_eval(None, p["gamma"], p["beta"], None, None, p["rm"], p["rv"], 1e-3)
    assert rel_err(a, f.a) <= 1e-6 and rel_err(c, f.c) <= 1e-6


WIDTHS = [1, 2, 3, 4, 5, 127, 1000, 4097, 8192, 70000]
SOFTMAX_CASES = [pytest.param(d, n, aff, id=f"{d}-N{n}-{'affine' if aff else 'plain'}")
                 for d in DTYPES for n in WIDTHS for aff in (True, False)]
SOFTMAX_TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _softmax_inputs(n, dtype, affine):
    g = torch.Generator(device=CUDA).manual_seed(n)
    z = (torch.randn(5, n, device=CUDA, generator=g) * 3).to(dtype)
    if not affine:
        return z, None, None
    return z, torch.rand(n, device=CUDA, generator=g) + 0.5, torch.randn(n, device=CUDA,
                                                                          generator=g)


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n,affine", SOFTMAX_CASES)
def test_affine_softmax(dtype_id, n, affine):
    dtype = DTYPES[dtype_id]
    z, a, c = _softmax_inputs(n, dtype, affine)
    expected = torch.softmax(_affine64(z, a, c), dim=1)
    y = ops.affine_softmax(z, a, c)
    assert y.dtype == dtype and rel_err(y, expected) <= SOFTMAX_TOL[dtype]
    inplace = z.clone()
    ops.affine_softmax_(inplace, a, c)
    assert rel_err(inplace, expected) <= SOFTMAX_TOL[dtype]


# Every kernel boundary of the vectorized dispatch (launch_vectorized): rows of exactly b vectors
# and of b + 1 (the next kernel, its last vectors padding). Padding holds -inf and must contribute
# exp(-inf) = 0 with no per-element test in the kernel; -inf entries must give 0 and a row of -inf
# must give NaN in every column, as torch.softmax does.
VEC_BOUNDARIES = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
BOUNDARY_CASES = [pytest.param(d, v, id=f"{d}-vecs{v}")
                  for d in DTYPES for b in VEC_BOUNDARIES for v in (b, b + 1)]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,vecs", BOUNDARY_CASES)
def test_affine_softmax_kernel_boundaries(dtype_id, vecs):
    dtype = DTYPES[dtype_id]
    n = vecs * (16 // torch.empty((), dtype=dtype).element_size())
    g = torch.Generator(device=CUDA).manual_seed(vecs)
    z = (torch.randn(300, n, device=CUDA, generator=g) * 3).to(dtype)
    z[::7, ::5] = float("-inf")
    z[11] = float("-inf")
    a = torch.rand(n, device=CUDA, generator=g) + 0.5
    c = torch.randn(n, device=CUDA, generator=g)
    for aa, cc in ((None, None), (a, c)):
        expected = torch.softmax(_affine64(z, aa, cc), dim=1)
        y = ops.affine_softmax(z, aa, cc)
        assert torch.isnan(y[11]).all()
        finite = torch.ones(300, dtype=torch.bool, device=CUDA)
        finite[11] = False
        assert not torch.isnan(y[finite]).any()
        assert (y[::7, ::5] == 0).all()  # the -inf entries (rows 0, 7, ...; not row 11)
        assert rel_err(y[finite], expected[finite]) <= SOFTMAX_TOL[dtype]
        inplace = z.clone()
        ops.affine_softmax_(inplace, aa, cc)
        assert torch.equal(torch.nan_to_num(inplace), torch.nan_to_num(y))
        if dtype != torch.float32:  # fp32 rows from a 16-bit z (autocast): lane pairs store them
            y32 = ops.affine_softmax(z, aa, cc, out_dtype=torch.float32)
            assert y32.dtype == torch.float32 and torch.isnan(y32[11]).all()
            assert not torch.isnan(y32[finite]).any() and (y32[::7, ::5] == 0).all()
            assert rel_err(y32[finite], expected[finite]) <= SOFTMAX_TOL[torch.float32]


# Many rows: the wide-row kernels run on a persistent grid and stage the next row while reducing the
# current one, so each block must go round its loop several times (more rows than resident blocks).
# Widths cover each kernel of affine_softmax.cu for fp32 and 16-bit rows, ragged last chunks included.
MANY_ROW_WIDTHS = [(3000, 1200), (8196, 1200), (12288, 700), (20000, 400), (40000, 300), (60000, 300)]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n,m", [pytest.param(d, n, m, id=f"{d}-N{n}-M{m}")
                                          for d in DTYPES for n, m in MANY_ROW_WIDTHS])
def test_affine_softmax_many_rows(dtype_id, n, m):
    dtype = DTYPES[dtype_id]
    g = torch.Generator(device=CUDA).manual_seed(n + m)
    z = (torch.randn(m, n, device=CUDA, generator=g) * 3).to(dtype)
    a = torch.rand(n, device=CUDA, generator=g) + 0.5
    c = torch.randn(n, device=CUDA, generator=g)
    for aa, cc in ((a, c), (None, None)):
        expected = torch.softmax(_affine64(z, aa, cc), dim=1)
        y = ops.affine_softmax(z, aa, cc)
        assert rel_err(y, expected) <= SOFTMAX_TOL[dtype]
        # every row, not just the norm: a row skipped or staged from the wrong place stands out
        row_err = ((y.double() - expected).norm(dim=1) / expected.norm(dim=1)).max().item()
        assert row_err <= 4 * SOFTMAX_TOL[dtype]
        inplace = z.clone()
        ops.affine_softmax_(inplace, aa, cc)
        assert torch.equal(inplace, y)
        if dtype != torch.float32:  # fp32 rows from a 16-bit z (autocast)
            y32 = ops.affine_softmax(z, aa, cc, out_dtype=torch.float32)
            assert rel_err(y32, expected) <= SOFTMAX_TOL[torch.float32]
            row_err32 = ((y32.double() - expected).norm(dim=1) / expected.norm(dim=1)).max()
            assert row_err32.item() <= 4 * SOFTMAX_TOL[torch.float32]
    # the affine pass alone (column_affine.cu) streams bands of rows per thread: same coverage
    shifted = z.clone()
    ops.affine_(shifted, a, c)
    assert rel_err(shifted, _affine64(z, a, c)) <= SOFTMAX_TOL[dtype]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id", ["bf16", "fp16"])
@pytest.mark.parametrize("offset", [0, 1, 2, 4, 8])
def test_widening_affine_on_offset_views(dtype_id, offset):
    """The widening pass (16-bit z, fp32 output: problem 39 under autocast) reads 8-byte vectors and
    stores 16-byte ones: views whose rows start 2, 4, 8 or 16 bytes into an allocation, with a
    leading dimension past the width, take the vector path where 8-byte loads are aligned and the
    element path otherwise; every band of rows and column block gives fold.py's values."""
    dtype = DTYPES[dtype_id]
    g = torch.Generator(device=CUDA).manual_seed(offset)
    base = (torch.randn(3001, 4096 + 16, device=CUDA, generator=g) * 3).to(dtype)
    z = base[:, offset:offset + 4096]
    a = torch.rand(4096, device=CUDA, generator=g) + 0.5
    c = torch.randn(4096, device=CUDA, generator=g)
    for act in ("", "relu"):
        y = ops.affine(z, a, c, activation=act, out_dtype=torch.float32)
        expected = fold.activate(_affine64(z, a, c), act, 0.01)
        assert y.dtype == torch.float32 and y.is_contiguous()
        row_err = ((y.double() - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-30))
        assert row_err.max().item() <= 1e-6


# Values whose rounding to 16 bits is where casts differ: NaN, +-inf, fp16's overflow (65520
# rounds to inf, 65504 is its largest finite value), fp32's largest, subnormals, signed zeros, and
# ties (1 + 2^-8 and 1 + 3 * 2^-8 for bf16, 1 + 2^-11 and 1 + 3 * 2^-11 for fp16: to even).
_CAST_SPECIALS = [float("nan"), float("inf"), -float("inf"), 7e4, -7e4, 65520.0, 65504.0, 3.4e38,
                  1e-40, -1e-45, 0.0, -0.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11,
                  2**-25, 3 * 2**-26, -(1 + 2**-8)]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["vectors", "tail", "misaligned"])
def test_gemm_operand_rounds_as_tensor_to(dtype_id, layout):
    """The heads' autocast cast of x and W (narrowing_cast.cu, not aten::to): bit for bit
    Tensor.to's, NaN for NaN, over the values where roundings differ; in whole 8-element vectors,
    with a tail past the last one, and from a view 4 bytes into its allocation (every element on
    the scalar path). No aten::to runs."""
    dtype = DTYPES[dtype_id]
    g = torch.Generator(device=CUDA).manual_seed(0)
    n = 4096 * 33 + (5 if layout == "tail" else 0)
    offset = 1 if layout == "misaligned" else 0
    t = (torch.randn(n + offset, device=CUDA, generator=g) * 100)[offset:]
    specials = torch.tensor(_CAST_SPECIALS, device=CUDA)
    t[:specials.numel()] = specials
    t[-specials.numel():] = specials  # in the tail too
    t = t.view(-1, 1) if layout == "tail" else t.view(33, 4096)
    got = []
    names = ops_run(lambda: got.append(ops.gemm_operand(t, dtype)))
    got = got[0]
    assert "epifuse::gemm_operand" in names and not any(
        name in names for name in ("aten::to", "aten::_to_copy", "aten::copy_")), names
    want = t.to(dtype)
    assert (got.dtype, got.shape, got.is_contiguous()) == (dtype, t.shape, True)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    # Strided (a transposed view) and non-float32 inputs take aten::to, with its layout.
    for other in (t.t(), t.double()):
        assert torch.equal(ops.gemm_operand(other, dtype).view(torch.int16),
                           other.to(dtype).view(torch.int16))
        assert ops.gemm_operand(other, dtype).stride() == other.to(dtype).stride()


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n", [pytest.param(d, n, id=f"{d}-N{n}")
                                        for d in DTYPES for n in WIDTHS])
def test_affine_inplace(dtype_id, n):
    dtype = DTYPES[dtype_id]
    z, a, c = _softmax_inputs(n, dtype, True)
    expected = _affine64(z, a, c)
    ops.affine_(z, a, c)
    assert rel_err(z, expected) <= SOFTMAX_TOL[dtype]


@pytest.mark.hopper
@pytest.mark.parametrize("name,dtype_id,index", CASES)
def test_cuda_matches_cpu_kernel(name, dtype_id, index, request):
    """The CUDA kernel against the CPU kernel (fold.py) on the same sample."""
    args, kwargs = _sample(name, CUDA, dtype_id, index, request)
    cuda_args = copy.deepcopy(args)
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in copy.deepcopy(args)]
    out_cuda, out_cpu = op(name)(*cuda_args, **kwargs), op(name)(*cpu_args, **kwargs)
    # a 16-bit GEMM asked for directly (gemm_dtype) rounds its products like a 16-bit sample
    sixteen_bit = DTYPES[dtype_id] != torch.float32 or kwargs.get("gemm_dtype") not in (
        None, torch.float32)
    tol = 1e-2 if sixteen_bit else 1e-5
    flat = lambda o: o if isinstance(o, tuple) else (() if o is None else (o,))  # noqa: E731
    for got, want in zip(flat(out_cuda), flat(out_cpu), strict=True):
        assert got.dtype == want.dtype and rel_err(got, want) <= tol
    for got, want in zip(cuda_args, cpu_args):  # mutated arguments agree too
        if isinstance(got, torch.Tensor):
            assert rel_err(got, want) <= tol


# --------------------------------------------------------------------------- activations (CUDA)
# Every kernel of the row passes (widths as above: register, staged and looped softmax kernels,
# vector and element paths) with each activation, against fold.py's float64 reference.
ACTIVATION_CASES = [pytest.param(d, n, act, id=f"{d}-N{n}-{act}")
                    for d in DTYPES for n in (5, 1000, 8192, 70000)
                    for act in ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu")]


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n,activation", ACTIVATION_CASES)
def test_row_passes_apply_the_activation(dtype_id, n, activation):
    dtype = DTYPES[dtype_id]
    z, a, c = _softmax_inputs(n, dtype, True)
    kw = {"activation": activation, "negative_slope": 0.2}
    h = fold.activate(_affine64(z, a, c), activation, 0.2)
    tol = max(SOFTMAX_TOL[dtype], 1e-6)
    assert rel_err(ops.affine(z, a, c, **kw), h) <= tol
    inplace = z.clone()
    ops.affine_(inplace, a, c, **kw)
    assert rel_err(inplace, h) <= tol
    alone = z.clone()  # no affine: the eval path's activation pass after gemm_affine
    ops.affine_(alone, None, None, **kw)
    assert rel_err(alone, fold.activate(z, activation, 0.2)) <= tol
    expected = torch.softmax(h, dim=1)
    assert rel_err(ops.affine_softmax(z, a, c, **kw), expected) <= tol
    inplace = z.clone()
    ops.affine_softmax_(inplace, a, c, **kw)
    assert rel_err(inplace, expected) <= tol
    if dtype != torch.float32:  # autocast's fp32 output from a 16-bit z
        y = ops.affine(z, a, c, out_dtype=torch.float32, **kw)
        assert y.dtype == torch.float32 and rel_err(y, h) <= 1e-6


@pytest.mark.hopper
@pytest.mark.parametrize("dtype_id,n,activation", ACTIVATION_CASES)
def test_backward_passes_through_the_activation(dtype_id, n, activation):
    """head_grad_sums / head_grad_z with an activation (vector and element paths) vs fold.py."""
    dtype = DTYPES[dtype_id]
    g = torch.Generator(device=CUDA).manual_seed(n + 1)
    m = 300
    z = (torch.randn(m, n, device=CUDA, generator=g) * 2).to(dtype)
    a = torch.rand(n, device=CUDA, generator=g) + 0.5
    c = torch.randn(n, device=CUDA, generator=g)
    grad = torch.randn(m, n, device=CUDA, generator=g).to(dtype)
    coef = torch.randn(3, n, device=CUDA, generator=g)
    kw = {"activation": activation, "negative_slope": 0.2}
    h = _affine64(z, a, c)
    for softmax in (False, True):
        out = torch.softmax(fold.activate(h, activation, 0.2), dim=1).to(dtype) if softmax else None
        rowdot = ops.softmax_grad_rowdot(grad, out) if softmax else None
        sums = ops.head_grad_sums(grad, out, rowdot, z, a, c, **kw)
        want = fold.grad_sums(grad, out, z, h, activation, 0.2)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_err(sums[:n], want[:n]) <= tol and rel_err(sums[n:], want[n:]) <= tol
        dz = ops.head_grad_z(grad, out, rowdot, z, coef, a, c, **kw)
        want_dz = fold.grad_z(grad, out, z, *coef.unbind(0), h, activation, 0.2)
        assert dz.dtype == dtype and rel_err(dz, want_dz) <= tol


@pytest.mark.parametrize("device", DEVICES)
def test_activation_errors(device):
    z = torch.rand(4, 3, device=device)
    a, c = torch.ones(3, device=device), torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        ops.affine_(z, a, c, activation="tanh")
    with pytest.raises(ValueError, match="unknown activation 'Relu'"):
        ops.affine_softmax(z, a, c, activation="Relu")
    with pytest.raises(RuntimeError, match="activation 'gelu' needs a and c"):
        ops.head_grad_sums(z, None, None, z, activation="gelu")
    with pytest.raises(RuntimeError, match="activation 'silu' needs a and c"):
        ops.head_grad_z(z, None, None, z, torch.zeros(3, 3, device=device), activation="silu")
    with pytest.raises(RuntimeError, match="pass both a and c"):
        ops.affine_(z, a, None, activation="relu")


def test_activation_names_are_the_ops():
    """Every name of fold.ACTIVATIONS (the reference) is an op setting: the C++ table
    (op_args.cpp's kActivations) takes it, on CPU tensors too (then the float64 reference)."""
    z = torch.rand(4, 3)
    for name in fold.ACTIVATIONS:
        ops.affine_(z.clone(), None, None, activation=name)
    assert fold.ACTIVATIONS[0] == "" and len(set(fold.ACTIVATIONS)) == 6
