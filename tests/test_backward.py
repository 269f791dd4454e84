"""The fused backward.

On CPU: fold.py's backward math against autograd in float64, the backward ops' CPU kernels against
fold.py, and ModelNew's gradients (through epifuse::fused_head, on CPU via the ``fused_on_cpu``
fixture) against a float64 Model.

Marked `hopper` (skipped with a reason without a GPU the kernels were built for): the CUDA kernels
against fold.py, ModelNew's gradients against a float64 oracle (no worse than eager's), opcheck with
autograd, torch.compile, CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epifuse import fold, head, ops
from epifuse.head_config import HeadConfig
from helpers import (DTYPE_OF, FUSED_NODE, ORACLE_TOL, cuda_kernels_run, cutlass_gemms,
                     float64_twin, init_args, launches, make_pair, ops_run, precision_of, rel_err,
                     traced_epifuse_ops)

CUDA = torch.device("cuda")
F64 = torch.float64
IN, OUT = 24, 16
CASES = [pytest.param(n, s, id=f"p{n}-scale{s[0]}")
         for n, shapes in ((84, [(1,), (OUT,)]), (39, [(OUT,), (1,)])) for s in shapes]
KINDS = ["ieee", "tf32", "bf16", "fp16"]
PARAMS = ("gemm.weight", "gemm.bias", "bn.weight", "bn.bias", "scale")
# fused_head(x, weight, bias, gamma, beta, scale, running_mean, running_var, num_batches_tracked,
# **HeadConfig.kwargs()) -> (out, z, colsum, colsumsq, moments, a, c)
fused_head = ops.fused_head


def _grads(model, x, w):
    y = model(x)
    names = ["x", *PARAMS]
    leaves = [x, *(model.get_parameter(p) for p in PARAMS)]
    return y, dict(zip(names, torch.autograd.grad((y * w).sum(), leaves)))


def _head_tensors(m, n, k, scale_numel, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(shape, generator=g, dtype=F64) * (hi - lo) + lo).requires_grad_()

    return dict(x=t(m, k), w=t(n, k), b=t(n), gamma=t(n, lo=0.5, hi=1.5), beta=t(n),
                scale=t(scale_numel, lo=0.5, hi=2.0), rm=t(n).detach(),
                rv=t(n, lo=0.5, hi=2.0).detach(), grad=t(m, n).detach())


def _autograd_head(p, training, softmax, scale_before_bn, eps=1e-5):
    z = p["x"] @ p["w"].T
    u = (z + p["b"]) * p["scale"] if scale_before_bn else z + p["b"]
    y = F.batch_norm(u, None if training else p["rm"], None if training else p["rv"], p["gamma"],
                     p["beta"], training, 0.0, eps)
    v = y if scale_before_bn else p["scale"] * y
    return torch.softmax(v, dim=1) if softmax else v


@pytest.mark.parametrize("scale_numel", [1, 5])
@pytest.mark.parametrize("scale_before_bn", [True, False], ids=["pre", "post"])
@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "plain"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_fold_backward_matches_autograd(training, softmax, scale_before_bn, scale_numel):
    """fold.py's formulas against autograd through F.batch_norm, all in float64."""
    m, n, k, eps = 9, 5, 4, 1e-5
    p = _head_tensors(m, n, k, scale_numel)
    out = _autograd_head(p, training, softmax, scale_before_bn, eps)
    leaves = [p[name] for name in ("x", "w", "b", "gamma", "beta", "scale")]
    expected = torch.autograd.grad(out, leaves, p["grad"])

    z = (p["x"] @ p["w"].T).detach()
    pre, post = (p["scale"], None) if scale_before_bn else (None, p["scale"])
    colsum, colsumsq = fold.column_stats(z)
    if training:
        mean, var = fold.input_moments(colsum, colsumsq, m, p["b"], pre, like=p["gamma"])
    else:
        mean, var = p["rm"], p["rv"]
    moments = fold.moments_vector(mean, var, m)
    saved_out = out.detach() if softmax else None
    sums = fold.grad_sums(p["grad"], saved_out, z)
    co = fold.grad_coefficients(sums, None, colsum, colsumsq, moments, p["b"], p["gamma"],
                                p["beta"], pre, post, training, eps)
    dz = fold.grad_z(p["grad"], saved_out, z, co.A, co.B, co.C)
    d_scale = co.pre if scale_before_bn else co.post
    actual = [dz @ p["w"].detach(), dz.T @ p["x"].detach(), co.bias, co.gamma, co.beta,
              d_scale.sum().reshape(1) if scale_numel == 1 else d_scale]
    for name, a, e in zip(("x", "w", "bias", "gamma", "beta", "scale"), actual, expected):
        # Training: d bias is zero and d pre-scale nearly so (BatchNorm removes them); compare
        # those against the weight gradient's size.
        floor = expected[1].norm().item() if training and name in ("bias", "scale") else 0.0
        err = ((a - e).norm() / e.norm().clamp_min(max(floor, 1e-300))).item()
        assert err < 1e-12, (name, err)


def test_normalized_grad_sums_over_split_batches_give_whole_batch_coefficients():
    """Synchronized backward: sums of normalized_grad_sums over row blocks reproduce the whole
    batch's dz coefficients (the all_reduce's algebra)."""
    m, n, k, eps = 12, 5, 4, 1e-5
    p = _head_tensors(m, n, k, 1)
    z = (p["x"] @ p["w"].T).detach()
    colsum, colsumsq = fold.column_stats(z)
    mean, var = fold.input_moments(colsum, colsumsq, m, p["b"], None, like=p["gamma"])
    moments = fold.moments_vector(mean, var, m)
    args = (p["b"], p["gamma"], p["beta"], None, p["scale"])
    whole = fold.grad_coefficients(fold.grad_sums(p["grad"], None, z), None, colsum, colsumsq,
                                   moments, *args, True, eps)
    blocks = [slice(0, 5), slice(5, 12)]
    local = [fold.grad_sums(p["grad"][r], None, z[r]) for r in blocks]
    total = sum(fold.normalized_grad_sums(s, moments, p["b"], p["gamma"], None, p["scale"], eps)
                for s in local)
    for r, s in zip(blocks, local):
        cs, css = fold.column_stats(z[r])
        part = fold.grad_coefficients(s, total, cs, css, moments, *args, True, eps)
        for name in ("A", "B", "C"):
            torch.testing.assert_close(getattr(part, name), getattr(whole, name), rtol=1e-12,
                                       atol=1e-14)
    # Parameter gradients are local: the blocks' add up to the whole batch's.
    torch.testing.assert_close(sum(fold.grad_coefficients(
        s, total, *fold.column_stats(z[r]), moments, *args, True, eps).gamma
        for r, s in zip(blocks, local)), whole.gamma, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the ops' CPU kernels

def test_backward_ops_cpu_match_fold():
    m, n = 7, 6
    g = torch.Generator().manual_seed(2)
    grad, z = torch.randn(m, n, generator=g), torch.randn(m, n, generator=g)
    out = torch.softmax(torch.randn(m, n, generator=g), dim=1)
    rowdot = ops.softmax_grad_rowdot(grad, out)
    torch.testing.assert_close(rowdot, (grad.double() * out.double()).sum(1).float())
    sums = ops.head_grad_sums(grad, out, rowdot, z)
    torch.testing.assert_close(sums, fold.grad_sums(grad, out, z), rtol=0, atol=0)
    assert sums[-1].item() == m
    gamma, beta, bias = torch.rand(n) + 0.5, torch.randn(n), torch.randn(n)
    post = torch.rand(1) + 0.5
    colsum, colsumsq = fold.column_stats(z)
    a, c, moments = ops.bn_fold_batch(colsum, colsumsq, m, bias, gamma, beta, None, post, eps=1e-5)
    f = fold.fold_train(colsum, colsumsq, m, bias, gamma, beta, None, post, 1e-5)
    torch.testing.assert_close(moments, fold.moments_vector(f.mean, f.var, m), rtol=0, atol=0)
    torch.testing.assert_close((a, c), (f.a.float(), f.c.float()))
    coef, g_bias, g_gamma, g_beta, g_pre, g_post = ops.head_grad_coefficients(
        sums, None, colsum, colsumsq, moments, bias, gamma, beta, None, post, training=True,
        eps=1e-5)
    ref = fold.grad_coefficients(sums, None, colsum, colsumsq, moments, bias, gamma, beta, None,
                                 post, True, 1e-5)
    torch.testing.assert_close(coef, torch.stack([ref.A, ref.B, ref.C]).float())
    torch.testing.assert_close(g_gamma, ref.gamma.float())
    torch.testing.assert_close(g_post, ref.post.sum().reshape(1).float())
    assert g_pre.numel() == 0 and g_bias.shape == bias.shape
    dz = ops.head_grad_z(grad, out, rowdot, z, coef)
    torch.testing.assert_close(dz, fold.grad_z(grad, out, z, *coef.unbind(0)).float())


def test_backward_matmul_cpu_values():
    a, b = torch.randn(5, 3), torch.randn(4, 5)
    torch.testing.assert_close(ops.backward_matmul(a.t(), b.t(), "tf32"), a.t() @ b.t())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ops.backward_matmul(a, b, "ieee")
    with pytest.raises(ValueError, match="precision"):
        ops.backward_matmul(a.t(), b.t(), "fp64")


def test_affine_cpu_out_of_place():
    z, a, c = torch.randn(4, 9).bfloat16(), torch.randn(9), torch.randn(9)
    before = z.clone()
    assert torch.equal(ops.affine(z, a, c), (z.double() * a.double() + c.double()).bfloat16())
    assert torch.equal(z, before)


def _fused_head_sample(requires_grad=True, training=True, softmax=True, scale_before_bn=False,
                       tracked=True):
    """fused_head's 9 tensors and settings; ``tracked``: a num_batches_tracked tensor (the op
    then updates the running statistics in training), else None."""
    g = torch.Generator().manual_seed(4)
    m, k, n = 6, 5, 4

    def t(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(shape, generator=g) * (hi - lo) + lo).requires_grad_(requires_grad)

    scale = t(n if scale_before_bn else 1, lo=0.5, hi=2.0)
    args = (t(m, k), t(n, k), t(n), t(n, lo=0.5, hi=1.5), t(n), scale,
            torch.rand(n, generator=g), torch.rand(n, generator=g) + 0.5,
            torch.tensor(3) if tracked else None)
    return args, HeadConfig(precision="ieee", training=training, scale_before_bn=scale_before_bn,
                            softmax=softmax, eps=1e-5, group_name="").kwargs()


@pytest.mark.parametrize("variant", [dict(), dict(training=False), dict(softmax=False),
                                     dict(scale_before_bn=True), dict(requires_grad=False),
                                     dict(tracked=False),
                                     dict(training=False, requires_grad=False, for_backward=False),
                                     dict(requires_grad=False, for_backward=False)],
                         ids=["train-softmax", "eval", "train-plain", "pre-scale", "no-grad",
                              "untracked", "eval-for-no-backward", "train-for-no-backward"])
def test_opcheck_fused_head_cpu(variant):
    """With autograd (inputs requiring grad) and the running statistics' in-place update."""
    for_backward = variant.pop("for_backward", True)
    args, kwargs = _fused_head_sample(**variant)
    torch.library.opcheck(torch.ops.epifuse.fused_head.default, args,
                          {**kwargs, "for_backward": for_backward})


def test_fused_head_refuses_double_backward():
    args, kwargs = _fused_head_sample()
    out = fused_head(*args, **kwargs)[0]
    v = torch.randn_like(out, requires_grad=True)
    (gx,) = torch.autograd.grad(out, [args[0]], v, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


def test_fused_head_ops_reject_bad_arguments():
    args, kwargs = _fused_head_sample(requires_grad=False)
    x, w, bias, gamma, beta, scale, running_mean, running_var, num_batches_tracked = args
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        # weight's K (6) differs from x's (5)
        torch.ops.epifuse.fused_head(x, torch.rand(4, 6), bias, gamma, beta, scale, running_mean,
                                     running_var, num_batches_tracked, **kwargs)
    assert num_batches_tracked.item() == 3  # refused before any update
    out, z, colsum, colsumsq, moments, _, _ = torch.ops.epifuse.fused_head(*args, **kwargs)
    grad = torch.rand_like(out)

    def backward(x_saved, w_saved, out_saved, needs):
        return torch.ops.epifuse.fused_head_backward(
            grad, x_saved, w_saved, bias, gamma, beta, scale, z, out_saved, colsum, colsumsq,
            moments, needs, precision="ieee", training=True, scale_before_bn=False, softmax=True,
            eps=1e-5, group_name="")

    with pytest.raises(RuntimeError, match="softmax head needs out"):
        backward(x, w, None, [True] * 6)
    with pytest.raises(RuntimeError, match="dX needs weight"):
        backward(x, None, out, [True, False, True, True, True, True])
    with pytest.raises(RuntimeError, match="dW needs x"):
        backward(None, w, out, [False, True, True, True, True, True])
    grads = backward(None, w, out, [True, False, True, True, True, True])
    assert grads[0].shape == x.shape and grads[1].numel() == 0  # dW not asked for: empty


def _epifuse_ops_run(fn) -> list[str]:
    """The epifuse ops fn ran, nested calls from the C++ composites included (profiler events)."""
    return ops_run(fn, "epifuse::")


@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "plain"])
def test_eval_call_for_no_backward_runs_one_gemm_with_the_fold(softmax):
    """for_backward=False in eval: bn_fold_eval -> gemm_affine (the activation in its epilogue)
    [-> softmax], nothing kept (z and the statistics empty); for a backward, the statistics GEMM
    and z as before. Both give the reference's output; asking for no backward while recording
    one is refused."""
    args, kwargs = _fused_head_sample(training=False, softmax=softmax, requires_grad=False)
    kwargs["activation"] = "gelu"
    expected = head.reference_head(*args[:8], HeadConfig(**kwargs))
    results = {}
    names = _epifuse_ops_run(lambda: results.update(
        plain=torch.ops.epifuse.fused_head(*args, **{**kwargs, "for_backward": False})))
    out, z, colsum, colsumsq, moments, a, c = results["plain"]
    assert "epifuse::gemm_affine" in names and "epifuse::gemm_colstats" not in names, names
    assert ("epifuse::affine_softmax_" in names) == softmax and "epifuse::affine" not in names
    assert z.numel() == colsum.numel() == colsumsq.numel() == moments.numel() == 0
    assert a.numel() == c.numel() == 0
    assert rel_err(out, expected) <= 1e-6
    x = args[0].clone().requires_grad_()
    names = _epifuse_ops_run(lambda: results.update(
        grad=torch.ops.epifuse.fused_head(x, *args[1:], **kwargs)))
    out, z, *_ = results["grad"]
    assert "epifuse::gemm_colstats" in names and "epifuse::gemm_affine" not in names, names
    assert z.shape == out.shape and out.grad_fn is not None
    assert rel_err(out, expected) <= 1e-6
    with pytest.raises(RuntimeError, match="for_backward=False, but an input requires grad"):
        torch.ops.epifuse.fused_head(x, *args[1:], **{**kwargs, "for_backward": False})


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_backward_reads_the_forwards_fold_for_the_activation(training):
    """fused_head returns the fold it applied (out = act(a * z + c)); the autograd keeps it and
    the backward reads it for the activation's derivative instead of folding again (no
    bn_fold_eval in the backward). A direct backward call without it folds again from the
    moments: the same gradients."""
    args, kwargs = _fused_head_sample(training=training, softmax=False)
    kwargs["activation"] = "gelu"
    x, w, bias, gamma, beta, scale = args[:6]
    out, z, colsum, colsumsq, moments, a, c = fused_head(*args, **kwargs)
    expected_a, expected_c = ops.bn_fold_eval(bias, gamma, beta, None, scale, moments[:4],
                                              moments[4:8])
    torch.testing.assert_close(a, expected_a, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c, expected_c, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out, F.gelu(a.double() * z.double() + c.double()).float())
    grad = torch.rand_like(out)
    names = _epifuse_ops_run(lambda: out.backward(grad))
    assert "epifuse::head_grad_z" in names and "epifuse::bn_fold_eval" not in names, names
    needs = [True] * 6
    detached = [t.detach() for t in (grad, x, w, bias, gamma, beta, scale, z)]
    stats = [colsum, colsumsq] if training else [None, None]
    given = torch.ops.epifuse.fused_head_backward(*detached, None, *stats, moments, needs, a, c,
                                                  **kwargs)
    folded = []
    names = _epifuse_ops_run(lambda: folded.extend(torch.ops.epifuse.fused_head_backward(
        *detached, None, *stats, moments, needs, **kwargs)))
    assert "epifuse::bn_fold_eval" in names, names
    autograd = (x.grad, w.grad, bias.grad, gamma.grad, beta.grad, scale.grad)
    for mine, direct, again in zip(autograd, given, folded):
        torch.testing.assert_close(mine, direct)
        torch.testing.assert_close(direct, again, rtol=1e-6, atol=1e-7)


def test_a_head_without_a_scale_does_not_read_its_stand_in():
    """has_scale=False: the scale tensor is a stand-in nothing reads (no scale in the fold, no
    scale gradient computed): a 2.0 there changes nothing, and its gradient, when asked for, is
    zero; not asked for, the backward returns it empty (as the fake kernel says)."""
    args, kwargs = _fused_head_sample(softmax=False)
    args = list(args)
    args[5] = torch.full((1,), 2.0, requires_grad=True)
    kwargs["has_scale"] = False
    out = fused_head(*args, **kwargs)[0]
    unscaled = head.reference_head(*args[:5], torch.ones(1), *args[6:8],
                                   HeadConfig(**{**kwargs, "has_scale": True}))
    torch.testing.assert_close(out, unscaled)
    out.backward(torch.rand_like(out))
    assert torch.equal(args[5].grad, torch.zeros(1))
    assert args[0].grad is not None and args[3].grad is not None
    torch.library.opcheck(torch.ops.epifuse.fused_head.default, tuple(args), kwargs)
    detached = [t.detach() for t in args[:8]]
    _, z, colsum, colsumsq, moments, _, _ = fused_head(*detached, None, **kwargs)
    grads = torch.ops.epifuse.fused_head_backward(
        torch.rand_like(z), *detached[:6], z, None, colsum, colsumsq, moments,
        [True, True, True, True, True, False], **kwargs)
    assert grads[5].numel() == 0 and grads[3].shape == args[3].shape


@pytest.mark.parametrize("momentum", [0.1, None], ids=["mom0.1", "momNone"])
@pytest.mark.parametrize("for_backward", [True, False], ids=["for-backward", "no-backward"])
def test_fused_head_updates_the_running_stats_in_training(for_backward, momentum):
    """In training, given num_batches_tracked, fused_head updates the running statistics in place
    as nn.BatchNorm1d does (bn_fold_train: the fold, the moments and the update in one kernel, for
    a backward or not); None, or eval: nothing changes."""
    args, kwargs = _fused_head_sample(requires_grad=for_backward, softmax=False)
    kwargs.update(momentum=momentum, for_backward=for_backward)
    x, w, bias, gamma, beta, scale, running_mean, running_var, num_batches_tracked = args
    bn = torch.nn.BatchNorm1d(gamma.shape[0], eps=1e-5, momentum=momentum).double()
    with torch.no_grad():
        bn.running_mean.copy_(running_mean), bn.running_var.copy_(running_var)
        bn.num_batches_tracked.copy_(num_batches_tracked)
        bn.train()((x.double() @ w.double().T + bias.double()))  # the oracle's update
    before = [t.clone() for t in (running_mean, running_var, num_batches_tracked)]
    for untouched in (dict(training=False), dict(untracked=True)):
        call_args = list(args)
        if "untracked" in untouched:
            call_args[8] = None
        with torch.no_grad():
            fused_head(*call_args, **{**kwargs, **{k: v for k, v in untouched.items()
                                                   if k != "untracked"}})
        for t, b in zip((running_mean, running_var, num_batches_tracked), before):
            assert torch.equal(t, b), untouched
    with torch.set_grad_enabled(for_backward):
        fused_head(*args, **kwargs)
    assert num_batches_tracked.item() == bn.num_batches_tracked.item() == 4
    assert rel_err(running_mean, bn.running_mean) < 1e-6
    assert rel_err(running_var, bn.running_var) < 1e-6


# --------------------------------------------------------------------------- ModelNew on CPU

@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("number,scale", CASES)
def test_model_gradients_against_float64(number, scale, mode, fused_on_cpu):
    ref, new = make_pair(number, init_args(number, IN, OUT, scale))
    oracle = float64_twin(ref)
    for m in (new, oracle):
        m.train(mode == "train")
    g = torch.Generator().manual_seed(5)
    x = torch.rand(32, IN, generator=g).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    w = torch.randn(32, OUT, generator=g)
    y, grads = _grads(new, x, w)
    assert y.grad_fn.name() == FUSED_NODE  # the fused backward, not a recompute
    y64, grads64 = _grads(oracle, x64, w.double())
    assert rel_err(y, y64) < 1e-6
    vanishing = {"gemm.bias"} | ({"scale"} if number == 39 else set())
    for name, a in grads.items():
        e = grads64[name]
        floor = grads64["gemm.weight"].norm() if mode == "train" and name in vanishing else 0.0
        err = ((a.double() - e).norm() / e.norm().clamp_min(max(float(floor), 1e-300))).item()
        assert a.dtype == torch.float32 and a.shape == e.shape
        assert err < 1e-5, (name, err)
    assert new.bn.num_batches_tracked.item() == (1 if mode == "train" else 0)
    assert rel_err(new.bn.running_var, oracle.bn.running_var) < 1e-6


def test_backward_runs_the_fused_ops(fused_on_cpu):
    _, new = make_pair(84, init_args(84, IN, OUT))
    x = torch.rand(8, IN, requires_grad=True)
    with traced_epifuse_ops() as calls:
        y = new(x)
    assert calls == ["fused_head", "gemm_colstats", "bn_fold_train", "affine_softmax"]
    with traced_epifuse_ops() as calls:
        y.sum().backward()  # an expanded (stride 0) gradient
    # The autograd node runs the backward's steps itself (no fused_head_backward call), so that
    # it can free the output's gradient once dz exists.
    assert calls == ["softmax_grad_rowdot", "head_grad_sums", "head_grad_coefficients",
                     "head_grad_z", "backward_matmul", "backward_matmul"]


def test_backward_skips_unneeded_gemms(fused_on_cpu):
    _, new = make_pair(39, init_args(39, IN, OUT))
    x = torch.rand(8, IN)  # no grad for x: dW only
    with traced_epifuse_ops() as calls:
        new(x).sum().backward()
    assert calls.count("backward_matmul") == 1 and new.gemm.weight.grad is not None
    for p in new.parameters():
        p.requires_grad_(False)
    new.bn.weight.requires_grad_(True)  # gamma only: no dz, no GEMM
    with traced_epifuse_ops() as calls:
        new(x).sum().backward()
    assert "head_grad_z" not in calls and "backward_matmul" not in calls
    assert "head_grad_coefficients" in calls and new.bn.weight.grad is not None


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_without_grad_the_in_place_path_runs(context, fused_on_cpu):
    """No grad: one fused_head call for no backward, whose fold updates the running statistics
    in the same kernel (bn_fold_train) and whose softmax pass overwrites z (in place)."""
    _, new = make_pair(84, init_args(84, IN, OUT))
    with traced_epifuse_ops() as calls, getattr(torch, context)():
        y = new(torch.rand(8, IN))
    assert y.grad_fn is None
    assert calls == ["fused_head", "gemm_colstats", "bn_fold_train", "affine_softmax_"], calls
    assert new.bn.num_batches_tracked.item() == 1


# --------------------------------------------------------------------------- on a GPU

def _pair(number, args, kind):
    ref, new = make_pair(number, args, precision=precision_of(kind))
    dtype = DTYPE_OF[kind]
    return ref.to(CUDA, dtype), new.to(CUDA, dtype)


def _err(actual, expected, floor=0.0):
    e = expected.detach().double()
    a = actual.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(max(floor, 1e-300))).item()


@pytest.mark.hopper
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


@pytest.mark.hopper
@pytest.mark.parametrize("softmax", [True, False], ids=["softmax", "plain"])
# head_grad_sums splits the rows of narrow problems (head_grad_sums.cu, sums_row_splits): (2048, 1024)
# in 2 splits, (4096, 256) in 4, (5003, 100) in 4 with a shorter last one; the others in none
# (on a 132-SM H100/H200).
@pytest.mark.parametrize("shape", [(64, 96), (33, 65), (1000, 4097), (2048, 1024), (4096, 256),
                                   (5003, 100)], ids=str)
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


@pytest.mark.hopper
@pytest.mark.parametrize("shape,dtype,split", [
    ((4096, 256), torch.float32, True), ((2048, 1024), torch.float32, True),
    ((4096, 4096), torch.float32, False), ((1000, 4097), torch.float32, False),
    # 16-bit bands are 64 columns wide: 4096 columns are 64 bands, two splits of 2048 rows
    ((4096, 4096), torch.bfloat16, True), ((1000, 4096), torch.bfloat16, False),
    ((4096, 8192), torch.float16, False)], ids=str)
def test_sums_split_the_rows_of_narrow_problems_only(shape, dtype, split):
    """head_grad_sums splits the rows where its column bands (32 columns of fp32, 64 of 16-bit
    types) leave SMs idle and adds the splits in sum_tile_partials (head_grad_sums.cu,
    sums_row_splits); bands that fill the SMs run one split, and fewer than 2048 rows never split.
    The row count (the last element) is written either way. (The cases assume 114-132 SMs: H100
    PCIe/SXM, H200.)"""
    g = torch.Generator(device=CUDA).manual_seed(3)
    grad, z = (torch.randn(*shape, device=CUDA, generator=g).to(dtype) for _ in range(2))
    ops.head_grad_sums(grad, None, None, z)
    out = []
    kernels = cuda_kernels_run(lambda: out.append(ops.head_grad_sums(grad, None, None, z)))
    sums = out[0]
    assert any("head_grad_sums_kernel" in k for k in kernels), kernels
    assert any("sum_tile_partials" in k for k in kernels) == split, kernels
    assert rel_err(sums[:-1], fold.grad_sums(grad, None, z)[:-1]) < 1e-5
    assert sums[-1].item() == shape[0]


@pytest.mark.hopper
def test_sums_are_deterministic():
    g = torch.Generator(device=CUDA).manual_seed(2)
    grad, z = (torch.randn(4096, 1024, device=CUDA, generator=g) for _ in range(2))
    first = ops.head_grad_sums(grad, None, None, z)
    for _ in range(3):
        assert torch.equal(ops.head_grad_sums(grad, None, None, z), first)


@pytest.mark.hopper
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


def _cuda_fused_head_sample(training=True, softmax=True, scale_before_bn=False):
    g = torch.Generator(device=CUDA).manual_seed(3)

    def t(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(shape, device=CUDA, generator=g) * (hi - lo) + lo).requires_grad_()

    n = 64
    args = (t(48, 40), t(n, 40), t(n), t(n, lo=0.5, hi=1.5), t(n),
            t(n if scale_before_bn else 1, lo=0.5, hi=2.0),
            torch.rand(n, device=CUDA), torch.rand(n, device=CUDA) + 0.5,
            torch.tensor(3, device=CUDA))
    return args, HeadConfig(precision="ieee", training=training, scale_before_bn=scale_before_bn,
                            softmax=softmax, eps=1e-5, group_name="").kwargs()


@pytest.mark.hopper
@pytest.mark.parametrize("variant", [dict(), dict(training=False), dict(softmax=False),
                                     dict(scale_before_bn=True)],
                         ids=["train-softmax", "eval", "train-plain", "pre-scale"])
def test_opcheck_fused_head(variant):
    torch.library.opcheck(torch.ops.epifuse.fused_head.default, *_cuda_fused_head_sample(**variant))


@pytest.mark.hopper
def test_double_backward_raises():
    args, kwargs = _cuda_fused_head_sample()
    out = fused_head(*args, **kwargs)[0]
    (gx,) = torch.autograd.grad(out, [args[0]], torch.randn_like(out, requires_grad=True),
                                create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


@pytest.mark.hopper
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


@pytest.mark.hopper
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


@pytest.mark.hopper
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
    # The running statistics, updated in place by the op (its bn_fold_train), inside the graph.
    assert new.bn.num_batches_tracked.item() == 1
    for name in ("bn.running_mean", "bn.running_var"):
        assert _err(new.get_buffer(name), oracle.get_buffer(name)) <= 1e-5, name


@pytest.mark.hopper
@pytest.mark.parametrize("number", [84, 39], ids=["p84", "p39"])
def test_training_step_folds_once(number):
    """A training step (forward and backward) launches one fold, which also writes the moments the
    backward reads and updates the running statistics (no second fold, no separate update), with
    BatchNorm's result."""
    ref, new = _pair(number, init_args(number, 256, 128), "ieee")
    oracle = float64_twin(ref).train()
    new.train()
    x = torch.rand(64, 256, device=CUDA)
    w = torch.randn(64, 128, device=CUDA)
    new(x)  # warm-up: lazy initialization outside the profile
    kernels = cuda_kernels_run(lambda: (new(x) * w).sum().backward())
    assert sum("bn_fold_kernel" in k for k in kernels) == 1, kernels
    assert sum("running_stats_kernel" in k for k in kernels) == 0, kernels
    for _ in range(2):
        oracle(x.double())
    assert new.bn.num_batches_tracked.item() == 2
    for name in ("bn.running_mean", "bn.running_var"):
        assert _err(new.get_buffer(name), oracle.get_buffer(name)) <= 1e-5, name


@pytest.mark.hopper
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


@pytest.mark.hopper
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


# case: (rows, n_out, n_in, dtype, K-major copies expected); cublas_k_major_copies.cu's
# cublas_tf32_k_major_copies says why each.
_COPY_CASES = {
    "dW": (2304, 2048, 2048, torch.float32, 1),         # both MN-major: one copy (a tie: X^T)
    "dW-narrow": (2304, 256, 2048, torch.float32, 1),   # both MN-major: dZ^T, the smaller
    # The projection MLP's 4096 x 4096 dW at batch 4096: X^T's 64 MiB copy in two chunks of 2048
    # rows (each product 256 of cuBLAS's 128x256 tiles), so the step holds 32 MiB of copy.
    "dW-two-chunks": (4096, 4096, 4096, torch.float32, 2),
    "dX": (2304, 2048, 2048, torch.float32, 0),         # W MN-major, few rows: cuBLAS as is
    "dX-many-rows": (8192, 2048, 2048, torch.float32, 1),  # W MN-major, 8192 rows: W^T copied
    "small": (256, 384, 512, torch.float32, 0),
    "bf16": (2304, 2048, 2048, torch.bfloat16, 0),
}


@pytest.mark.hopper
@pytest.mark.parametrize("case", list(_COPY_CASES))
def test_backward_matmul_k_major_copies(case):
    """TF32 products with MN-major operands copy them K-major where that pays (cublas_k_major_copies.cu,
    cublas_tf32_k_major_copies), with the same result as cuBLAS on the views."""
    g = torch.Generator(device=CUDA).manual_seed(3)
    rows, n_out, n_in, dtype, expected_copies = _COPY_CASES[case]
    dz = torch.randn(rows, n_out, device=CUDA, generator=g).to(dtype)
    x = torch.rand(rows, n_in, device=CUDA, generator=g).to(dtype)
    w = torch.randn(n_out, n_in, device=CUDA, generator=g).to(dtype)
    # dW = dz^T . x (both MN-major); dX = dz . W (W MN-major)
    a, b = (dz, w) if case.startswith("dX") else (dz.t(), x)
    precision = "tf32" if dtype == torch.float32 else ""
    out = []
    # K-major copies: transpose.cu's kernel launches
    copies = launches(lambda: out.append(ops.backward_matmul(a, b, precision)),
                      "transpose_tiles_kernel")
    assert copies == expected_copies
    exact = a.double() @ b.double()
    bound = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert out[0].dtype == dtype and rel_err(out[0], exact) < bound
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
    try:
        views = a @ b  # cuBLAS on the views, as without the copies
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    assert rel_err(out[0], exact) <= 1.5 * rel_err(views, exact) + 1e-6


@pytest.mark.hopper
@pytest.mark.parametrize("kind", ["dX", "dW"])
def test_split_products_chunk_a_large_w_for_memory(kind):
    """The projection MLP's 4096 x 4096 backward products (K = 4096) in the default precision:
    x is one chunk, so w's 64 MiB split is made in two chunks of 32 MiB (operand_chunks.hpp,
    refine_split_chunks), two GEMMs of 512 tiles; each output element is the same product, bit for
    bit, as the product of its own half of w alone (one chunk), and the product's peak holds the
    output, x's split and one chunk of w's split."""
    g = torch.Generator(device=CUDA).manual_seed(5)
    n = 4096
    dz = torch.randn(n, n, device=CUDA, generator=g)
    other = torch.randn(n, n, device=CUDA, generator=g)
    a, b = (dz, other) if kind == "dX" else (dz.t(), other)  # b: W for dX, X for dW
    out = []
    assert len(cutlass_gemms(lambda: out.append(ops.backward_matmul(a, b, "3xtf32")))) == 2
    halves = [ops.backward_matmul(a, b[:, c:c + n // 2], "3xtf32") for c in (0, n // 2)]
    assert torch.equal(out[0], torch.cat(halves, dim=1))
    assert rel_err(out[0], a.double() @ b.double()) < 1e-6
    out.clear()
    del halves
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ops.backward_matmul(a, b, "3xtf32")
    mib = (torch.cuda.max_memory_allocated() - before) / 2**20
    assert mib < 64 + 64 + 32 + 8, mib  # output, x's split, w's chunk, exponents and workspace


@pytest.mark.gpu
def test_the_head_backward_frees_the_output_gradient():
    """The autograd node runs the backward's steps itself and drops the incoming gradient once dz
    exists, as eager's autograd frees a node's inputs: a backward whose gradient reaches the head
    from another node (an inner head's, only autograd holds it) peaks no higher than one whose
    gradient the caller holds, allocated before (not counted). Holding it through dX and dW would
    add its 8 MiB."""
    n, rows = 1024, 2048
    _, new = make_pair(39, [n, n, (n,)], seed=1)
    new = new.to(CUDA).train()
    x = torch.rand(rows, n, device=CUDA, requires_grad=True)

    def backward_peak(from_node: bool) -> int:
        x.grad = None
        for p in new.parameters():
            p.grad = None
        y = new(x)
        if from_node:
            loss = (y * 2).sum()  # mul's backward makes the head's gradient inside the backward
            run = loss.backward
        else:
            held = torch.full_like(y, 2.0)
            run = lambda: y.backward(held)  # noqa: E731
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        names = _epifuse_ops_run(run)
        assert "epifuse::head_grad_z" in names and "epifuse::fused_head_backward" not in names
        return torch.cuda.max_memory_allocated() - before

    backward_peak(True)  # warm-up: workspaces, the allocator's blocks
    from_node, held = backward_peak(True), backward_peak(False)
    assert from_node <= held + rows * n * 4 // 2, (from_node / 2**20, held / 2**20)
