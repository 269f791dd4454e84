"""PyTorch's default precision on the tensor cores: the Hopper 3x GEMM (precision '3xtf32').

Under ``torch.get_float32_matmul_precision() == 'highest'`` (PyTorch's default) the fused path runs
the fp32-accurate 3x mode (precision.py): on Hopper, operands split into row-scaled FP16 hi/lo
parts (split_fp16.cu) and three FP16 wgmma products. These tests hold it to what that promises:
errors against float64 no larger than cuBLAS's SGEMM (what eager PyTorch runs there), on a shape
sweep with small K and on offset inputs; rows far outside FP16's range scaled exactly; IEEE
results for non-finite inputs; a weight split that is never stale; and a KernelBench-style harness
check of both problems at full size.
"""

from __future__ import annotations

import pytest
import torch

from epifuse import fold, ops
from epifuse.head import fast_path_reason
from helpers import PROBLEMS, cuda_kernels_run, launches, rel_err

pytestmark = pytest.mark.hopper

CUDA = torch.device("cuda")


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


hopper_only = pytest.mark.skipif(not _is_hopper(), reason="the 3x wgmma GEMM is Hopper's")


def _ran_split_gemm(fn) -> bool:
    return any("split_fp16" in name for name in cuda_kernels_run(fn))


def _operands(m, k, n, offset=0.0, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.rand(m, k, device=CUDA, generator=g) + offset
    w = (torch.rand(n, k, device=CUDA, generator=g) * 2 - 1) / k ** 0.5
    return x, w


def _sgemm(x, w):
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return x @ w.T
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# (M, K, N) of at least 2^30 multiply-adds, K >= 64 (smaller problems run SGEMM: see
# test_small_problems_run_sgemm): small K (2 K-tiles of 32 k), a ragged batch tile, both problems'
# shapes, a stream-K grid (fewer 128x128 tiles than SMs).
SWEEP = [(4096, 64, 4096), (2048, 256, 2048), (2100, 2304, 256), (1024, 1024, 1024),
         (400, 2048, 4096), (1024, 8192, 8192), (4096, 4096, 4096)]


@hopper_only
@pytest.mark.parametrize("offset", [0.0, 100.0], ids=["x", "x+100"])
@pytest.mark.parametrize("m,k,n", SWEEP, ids=[f"M{m}-K{k}-N{n}" for m, k, n in SWEEP])
def test_error_no_larger_than_sgemm(m, k, n, offset):
    x, w = _operands(m, k, n, offset, seed=m + k + n)
    ref = x.double() @ w.double().T
    a, c = torch.ones(n, device=CUDA), torch.zeros(n, device=CUDA)
    assert _ran_split_gemm(lambda: ops.gemm_affine(x, w, a, c, "3xtf32"))
    ours = rel_err(ops.gemm_affine(x, w, a, c, "3xtf32"), ref)
    sgemm = rel_err(_sgemm(x, w), ref)
    z, colsum, colsumsq = ops.gemm_colstats(x, w, "3xtf32")
    assert ours <= sgemm, (ours, sgemm)
    assert rel_err(z, ref) <= sgemm
    # The statistics sum the GEMM's own fp32 accumulator (z) in fp64.
    assert rel_err(colsum, z.double().sum(0)) <= 1e-9
    assert rel_err(colsumsq, (z.double() ** 2).sum(0)) <= 1e-9


# Below 64 rows, K = 64 or 2^30 multiply-adds, SGEMM is faster or more accurate (gemm_plan.cu).
SMALL = [(32, 8192, 8192), (4096, 32, 4096), (256, 17, 256), (128, 1024, 512)]


@hopper_only
@pytest.mark.parametrize("m,k,n", SMALL, ids=[f"M{m}-K{k}-N{n}" for m, k, n in SMALL])
def test_small_problems_run_sgemm(m, k, n):
    x, w = _operands(m, k, n, seed=3)
    a, c = torch.ones(n, device=CUDA), torch.zeros(n, device=CUDA)
    assert not _ran_split_gemm(lambda: ops.gemm_affine(x, w, a, c, "3xtf32"))
    torch.testing.assert_close(ops.gemm_affine(x, w, a, c, "3xtf32"), _sgemm(x, w),
                               rtol=1e-6, atol=1e-6)


@hopper_only
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_batches_taller_than_one_split_launch(layout):
    """Over 2^21 rows (a per-pixel head): row-major, split_fp16's row path (a block per row); column-
    major (a transposed view), its tiled path, which runs in bands of 65535 row tiles of 32 (the
    grid.y limit). The GEMM, its statistics and a non-finite row in the last band come out as for
    any batch."""
    m, k, n = 65535 * 32 + 4000, 64, 64
    x, w = _operands(m, k, n, seed=5)
    x[m - 7, 3] = float("nan")  # a row of the second band
    if layout == "column-major":
        x = x.t().contiguous().t()
    assert _ran_split_gemm(lambda: ops.gemm_colstats(x, w, "3xtf32"))
    z, colsum, colsumsq = ops.gemm_colstats(x, w, "3xtf32")
    expected = x.double() @ w.double().T
    assert torch.isnan(z[m - 7]).all() and torch.isfinite(z[: m - 7]).all()
    finite = torch.ones(m, dtype=torch.bool, device=CUDA)
    finite[m - 7] = False
    assert rel_err(z[finite], expected[finite]) <= 1e-6
    assert torch.isnan(colsum).all() and torch.isnan(colsumsq).all()  # eager BatchNorm's too


@hopper_only
@pytest.mark.parametrize("layout", ["row-major", "column-major"])
def test_rows_scaled_by_powers_of_two_scale_the_product_exactly(layout):
    """split_fp16 scales each operand row into FP16's range by a power of two and the epilogue
    scales the product back (ldexp, exact): rows of x scaled by 2^-40 .. 2^100 (far outside FP16's
    2^-24 .. 2^16) and a weight scaled by 2^-30 give the product of the unscaled operands scaled by
    the same powers, bit for bit, in both epilogues and both split paths (row-major: a block per
    row; column-major, a transposed view: the tiled path)."""
    m = k = n = 1024
    x, w = _operands(m, k, n, seed=21)
    g = torch.Generator(device=CUDA).manual_seed(22)
    e = torch.randint(-40, 101, (m,), device=CUDA, generator=g)
    scale = torch.pow(2.0, e.double()).float()[:, None]
    xs, ws = x * scale, w * 2.0 ** -30  # exact: powers of two, no value leaves fp32's normals
    expected = scale * 2.0 ** -30
    if layout == "column-major":
        x, xs = x.t().contiguous().t(), xs.t().contiguous().t()
    a, c = torch.ones(n, device=CUDA), torch.zeros(n, device=CUDA)
    assert _ran_split_gemm(lambda: ops.gemm_affine(xs, ws, a, c, "3xtf32"))
    y = ops.gemm_affine(x, w, a, c, "3xtf32")
    assert torch.equal(ops.gemm_affine(xs, ws, a, c, "3xtf32"), y * expected)
    z = ops.gemm_colstats(x, w, "3xtf32")[0]
    assert torch.equal(ops.gemm_colstats(xs, ws, "3xtf32")[0], z * expected)
    assert rel_err(y, x.double() @ w.double().T) <= 1e-6


@hopper_only
def test_nonfinite_rows_match_ieee():
    x, w = _operands(1024, 1024, 1024)
    x[3, 7] = float("inf")
    x[10, 0] = float("-inf")
    x[20, 100] = float("nan")
    a, c = torch.ones(1024, device=CUDA), torch.zeros(1024, device=CUDA)
    assert _ran_split_gemm(lambda: ops.gemm_affine(x, w, a, c, "3xtf32"))
    y = ops.gemm_affine(x, w, a, c, "3xtf32")
    expected = _sgemm(x, w)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(torch.isinf(y), torch.isinf(expected))
    finite = torch.isfinite(expected)
    assert rel_err(y[finite], expected.double()[finite]) <= 1e-6


@hopper_only
@pytest.mark.parametrize("activation", ["relu", "leaky_relu"])
def test_nonfinite_rows_repair_applies_the_activation(activation):
    """The repair pass recomputes a non-finite row's act(a * acc + c), as the epilogue would have."""
    x, w = _operands(1024, 1024, 1024)
    x[3, 7] = float("inf")
    x[10, 0] = float("-inf")
    a = torch.rand(1024, device=CUDA) + 0.5
    c = torch.randn(1024, device=CUDA)
    kw = {"activation": activation, "negative_slope": 0.2}
    assert _ran_split_gemm(lambda: ops.gemm_affine(x, w, a, c, "3xtf32", **kw))
    y = ops.gemm_affine(x, w, a, c, "3xtf32", **kw)
    expected = fold.activate(a.double() * _sgemm(x, w).double() + c.double(), activation, 0.2)
    assert torch.equal(torch.isnan(y), torch.isnan(expected))
    assert torch.equal(torch.isinf(y), torch.isinf(expected))
    assert torch.equal(y[3] == 0, expected[3] == 0)  # ReLU's zeros of the -inf entries
    finite = torch.isfinite(expected)
    assert rel_err(y[finite], expected[finite]) <= 1e-6


@hopper_only
def test_weight_split_cache_sees_in_place_updates():
    x, w = _operands(1024, 1024, 1024)
    a, c = torch.ones(1024, device=CUDA), torch.zeros(1024, device=CUDA)
    for _ in range(3):  # the second call with an unchanged weight caches its split
        ops.gemm_affine(x, w, a, c, "3xtf32")
    with torch.no_grad():
        w.mul_(-2.0)  # an optimizer step: same storage, new version
    y = ops.gemm_affine(x, w, a, c, "3xtf32")
    assert rel_err(y, x.double() @ w.double().T) <= 1e-6
    w2 = w.clone()  # another weight, same shape: its own entry
    y2 = ops.gemm_affine(x, w2, a, c, "3xtf32")
    assert rel_err(y2, x.double() @ w2.double().T) <= 1e-6


@hopper_only
def test_graph_replay_sees_weight_updates():
    x, w = _operands(1024, 1024, 1024)
    a, c = torch.ones(1024, device=CUDA), torch.zeros(1024, device=CUDA)
    for _ in range(3):
        ops.gemm_affine(x, w, a, c, "3xtf32")  # the split is cached before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = ops.gemm_affine(x, w, a, c, "3xtf32")
    torch.cuda.current_stream().wait_stream(stream)
    with torch.no_grad():
        w.add_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, x.double() @ w.double().T) <= 1e-6


@hopper_only
@pytest.mark.parametrize("precision,tol", [("3xtf32", 1e-6), ("ieee", 1e-6), ("tf32", 3e-3)])
def test_backward_matmul_transposed_views(precision, tol):
    """The backward's GEMMs, dX = dZ . W and dW = dZ^T . X, take transposed views, no copies."""
    g = torch.Generator(device=CUDA).manual_seed(5)
    dz = torch.randn(2048, 1024, device=CUDA, generator=g)  # [M, N]
    w = torch.randn(1024, 512, device=CUDA, generator=g)    # [N, K]
    x = torch.randn(2048, 512, device=CUDA, generator=g)    # [M, K]
    dx = ops.backward_matmul(dz, w, precision)
    assert dx.shape == (2048, 512) and dx.is_contiguous()
    assert rel_err(dx, dz.double() @ w.double()) <= tol
    dw = ops.backward_matmul(dz.t(), x, precision)
    assert dw.shape == (1024, 512)
    assert rel_err(dw, dz.double().T @ x.double()) <= tol
    if precision == "3xtf32":  # both with transposed views: dX's b and dW's a
        assert _ran_split_gemm(lambda: ops.backward_matmul(dz, w, precision))
        assert _ran_split_gemm(lambda: ops.backward_matmul(dz.t(), x, precision))


def _misaligned_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a tensor whose data starts 4 bytes past a 16-byte boundary."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = base[1:].view(t.shape)
    out.copy_(t)
    return out


@hopper_only
@pytest.mark.parametrize("rows", [2048, 1000], ids=["K2048", "K1000-padded"])
def test_transposed_split_tiles_agree(rows):
    """The split of a transposed operand (dW = dZ^T . X: both row-contiguous views) in 64 x 64 tiles
    of 16-byte vectors gives the general 32 x 64 tiles' parts bit for bit: the same dW, NaN and Inf
    rows included (dZ^T's rows are dW's, recomputed in IEEE fp32), from 16-byte-aligned operands
    (the wide tiles) and from the same values 4 bytes off (the general tiles)."""
    # dW [1536, 1040] over K = rows (1000: a last k-tile of the split padded with zeros, and 1040
    # rows of X^T end in a partial 64-row tile), past the 2^30 multiply-adds below which SGEMM runs.
    g = torch.Generator(device=CUDA).manual_seed(17)
    dz = torch.randn(rows, 1536, device=CUDA, generator=g) * 3
    x = torch.rand(rows, 1040, device=CUDA, generator=g) + 1
    x[:, 7] *= 2.0 ** -30  # a row of X^T far below the others
    dz[5, 9], dz[11, 300] = float("nan"), float("inf")
    dz_off, x_off = _misaligned_copy(dz), _misaligned_copy(x)
    wide = set(cuda_kernels_run(lambda: ops.backward_matmul(dz.t(), x, "3xtf32")))
    general = set(cuda_kernels_run(lambda: ops.backward_matmul(dz_off.t(), x_off, "3xtf32")))
    assert any("split_fp16_tiles_wide" in k for k in wide), wide
    assert not any("split_fp16_tiles_wide" in k for k in general), general
    a = ops.backward_matmul(dz.t(), x, "3xtf32")
    b = ops.backward_matmul(dz_off.t(), x_off, "3xtf32")
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(dz).all(0)
    assert not finite[9] and not finite[300] and int(finite.sum()) == 1534
    assert rel_err(a[finite], (dz.double().T @ x.double())[finite]) <= 1e-6


def _affine_case(m, k, n, *, seed, bad):
    """x [m, k] with x[row, col] = value (bad), w [n, k], and affine vectors a, c [n]. The weight is
    written in place (its version bumped) here and before each further call in the tests, as an
    optimizer would, so that no kept split stands in for the chunks."""
    x, w = _operands(m, k, n, seed=seed)
    row, col, value = bad
    x[row, col] = value
    g = torch.Generator(device=CUDA).manual_seed(seed + 1)
    a = torch.rand(n, device=CUDA, generator=g) + 0.5
    c = torch.randn(n, device=CUDA, generator=g)
    w.add_(0.0)
    return x, w, a, c


@hopper_only
def test_large_weight_split_in_chunks():
    """A weight whose split exceeds 128 MiB is split and multiplied in chunks of its rows
    (operand_chunks.cu, copy_chunk_rows): here 8704 rows of K = 8192 (272 MiB of FP16 parts) in
    chunks of 3072, 3072 and 2560 rows. Each chunk's columns get their own epilogue vectors and
    statistics, and a non-finite row of x is repaired across all of them."""
    m, k, n = 512, 8192, 8704
    x, w, a, c = _affine_case(m, k, n, seed=11, bad=(17, 5, float("inf")))
    # x's split, then one split per chunk of w.
    assert launches(lambda: ops.gemm_affine(x, w, a, c, "3xtf32"), "split_fp16") == 4
    w.add_(0.0)
    y = ops.gemm_affine(x, w, a, c, "3xtf32")
    w.add_(0.0)
    z, colsum, colsumsq = ops.gemm_colstats(x, w, "3xtf32")
    ref = x.double() @ w.double().T
    finite = torch.ones(m, dtype=torch.bool, device=CUDA)
    finite[17] = False
    expected_y = a.double() * ref + c.double()
    assert rel_err(y[finite], expected_y[finite]) <= 1e-6
    assert rel_err(z[finite], ref[finite]) <= 1e-6
    sgemm = _sgemm(x, w)
    assert torch.equal(torch.isinf(z[17]), torch.isinf(sgemm[17]))
    assert torch.equal(torch.isnan(z[17]), torch.isnan(sgemm[17]))
    zs = z[finite].double()
    w.add_(0.0)
    _, colsum_f, colsumsq_f = ops.gemm_colstats(x[finite].contiguous(), w, "3xtf32")
    assert rel_err(colsum_f, zs.sum(0)) <= 1e-9
    assert rel_err(colsumsq_f, (zs * zs).sum(0)) <= 1e-9
    assert not torch.isfinite(colsum).any()  # the inf row reaches every column's sums


@hopper_only
def test_tall_x_split_in_chunks_of_rows():
    """With the affine epilogue an x whose split exceeds 256 MiB is split in chunks of its rows
    too (16896 rows of K = 8192: three chunks of 5632), each chunk multiplied by every chunk of w
    (4608 rows: 2304 + 2304, split again for each chunk of x); a non-finite row in the second chunk
    is repaired where its chunk put it."""
    m, k, n = 16896, 8192, 4608
    x, w, a, c = _affine_case(m, k, n, seed=14, bad=(6000, 7, float("nan")))
    assert launches(lambda: ops.gemm_affine(x, w, a, c, "3xtf32"), "split_fp16") == 3 + 3 * 2
    w.add_(0.0)
    y = ops.gemm_affine(x, w, a, c, "3xtf32")
    assert torch.isnan(y[6000]).all()
    finite = torch.ones(m, dtype=torch.bool, device=CUDA)
    finite[6000] = False
    expected = a.double() * (x[finite].double() @ w.double().T) + c.double()
    assert rel_err(y[finite], expected) <= 1e-6


@hopper_only
def test_product_with_a_large_weight_allocates_chunks_not_its_whole_split():
    """Problem 84's dX = dZ . W at default precision: the split of W^T (256 MiB whole) is
    made 128 MiB at a time, so the product allocates its output, dZ's split (32 MiB) and one chunk
    (the training step's peak stayed at 1.47x eager's with the whole split; BENCHMARKS.md)."""
    g = torch.Generator(device=CUDA).manual_seed(16)
    dz = torch.randn(1024, 8192, device=CUDA, generator=g)
    w = torch.randn(8192, 8192, device=CUDA, generator=g) / 90.0
    ops.backward_matmul(dz, w, "3xtf32")  # workspaces of the first call (cuBLAS, allocator) settle
    torch.cuda.synchronize()
    w.add_(0.0)  # as an optimizer step would: no kept split
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dx = ops.backward_matmul(dz, w, "3xtf32")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= dx.numel() * 4 + (64 + 128 + 16) * 2**20, peak / 2**20
    assert rel_err(dx, dz.double() @ w.double()) <= 1e-6


@hopper_only
def test_chunks_count_the_operands_fp32_rows():
    """Problem 84's dX = dZ . W: W^T's 8192 rows of K = 8192 (128 MiB of fp32 rows per 4096) are
    split in two chunks of 4096 rows, 128 tiles of 128x256 per GEMM at M = 1024. Budgets counting
    the split's padded bytes made three chunks of 2816, whose GEMMs filled two thirds of the SMs
    (operand_chunks.hpp)."""
    g = torch.Generator(device=CUDA).manual_seed(17)
    dz = torch.randn(1024, 8192, device=CUDA, generator=g)
    w = torch.randn(8192, 8192, device=CUDA, generator=g) / 90.0
    assert launches(lambda: ops.backward_matmul(dz, w, "3xtf32"), "split_fp16_tiles") == 2


@hopper_only
def test_tf32_product_copies_a_large_operand_in_chunks():
    """dW = dZ^T . X in TF32 with a K-major copy of X^T larger than 128 MiB: copied and multiplied
    in chunks of its rows (2304 rows of K = 16384 -> 1280 + 1024), each chunk's output columns
    written in place. (dZ^T, the larger operand, stays MN-major: one copy of the two suffices.)"""
    g = torch.Generator(device=CUDA).manual_seed(13)
    dz = torch.randn(16384, 2560, device=CUDA, generator=g)
    x = torch.randn(16384, 2304, device=CUDA, generator=g)
    assert launches(lambda: ops.backward_matmul(dz.t(), x, "tf32"), "transpose_tiles") == 2
    dw = ops.backward_matmul(dz.t(), x, "tf32")
    assert dw.shape == (2560, 2304) and dw.is_contiguous()
    assert rel_err(dw, dz.double().T @ x.double()) <= 3e-3


def test_ieee_ignores_the_global_tf32_setting():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU available")
    x, w = _operands(256, 2048, 256)
    a, c = torch.ones(256, device=CUDA), torch.zeros(256, device=CUDA)
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        y = ops.gemm_affine(x, w, a, c, "ieee")
        assert torch.get_float32_matmul_precision() == "high"  # restored after the op
    finally:
        torch.set_float32_matmul_precision(saved)
    assert rel_err(y, x.double() @ w.double().T) <= 2e-6  # IEEE, not TF32 (~1e-3)


# --------------------------------------------------------------------------- harness check


def _harness(number: int, trials: int = 5):
    """What a KernelBench-style harness does: same seed on CPU, move, training mode, fp32,
    torch.rand inputs, allclose(atol=rtol=1e-4), at PyTorch's default precision."""
    module = PROBLEMS[number]
    init = module.get_init_inputs()
    torch.manual_seed(42)
    ref = module.Model(*init).to(CUDA)
    torch.manual_seed(42)
    new = module.ModelNew(*init).to(CUDA)
    assert new.training and ref.training and new.precision is None
    for trial in range(trials):
        torch.manual_seed(trial)
        (x,) = [t.to(CUDA) for t in module.get_inputs()]
        assert fast_path_reason(new, x) is None
        with torch.no_grad():
            expected = ref(x)
            if trial == 0:
                assert _ran_split_gemm(lambda: new(x.clone()))
                ref(x)  # keep the running statistics of both models in step
            got = new(x)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (
            number, trial, (got - expected).abs().max().item())
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(new.bn, name), getattr(ref.bn, name),
                                   atol=1e-4, rtol=1e-4)


@hopper_only
@pytest.mark.parametrize("number", [84, 39])
def test_kernelbench_harness_default_precision(number):
    assert torch.get_float32_matmul_precision() == "highest"
    _harness(number)
