"""Sample arguments for every epifuse op (shared by the CPU and CUDA op tests): one dict of
samples per device and dtype, with an entry for every op of ``epifuse.ops.OP_NAMES``."""

from __future__ import annotations

import torch

from epifuse import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else ""


def case(*args, **kwargs):
    """One sample: the positional arguments (tensors, counts) and the keyword-only settings."""
    return args, kwargs


# The synchronized-statistics hooks: their samples need a process group (its group_name).
HOOKS = ("synced_batch_fold", "synced_grad_sums")


def samples(device, dtype, m=5, k=7, n=3, seed=0, group_name=""):
    """{op name: [(args, kwargs), ...]} covering optional arguments (None) and scale shapes.

    ``op(*args, **kwargs)``; ``torch.library.opcheck(op, args, kwargs)``. The HOOKS' samples
    reduce over ``group_name``'s process group (a one-rank group: conftest's one_rank_group);
    without one they are not runnable.
    """
    g = torch.Generator().manual_seed(seed)

    def t(*shape, lo=-1.0, hi=1.0, dt=dtype):
        return (torch.rand(shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).to(device, dt)

    x, w = t(m, k), t(n, k)
    a, c = t(n, dt=torch.float32), t(n, dt=torch.float32)
    z = t(m, n)
    colsum, colsumsq = t(n, dt=torch.float64), t(n, lo=5.0, hi=6.0, dt=torch.float64)
    bias, gamma, beta = t(n), t(n, lo=0.5, hi=1.5), t(n)
    s1, sn = t(1, lo=0.5, hi=2.0), t(n, lo=0.5, hi=2.0)

    def stats():
        return t(n), t(n, lo=0.5, hi=2.0), torch.tensor(3, device=device)

    # Backward operands: a gradient, a softmax output, its row term, column sums of dv (S1, S3,
    # rows), the forward's moments [mean, var, rows] and rank-summed normalized sums.
    grad = t(m, n)
    out = torch.softmax(t(m, n, dt=torch.float64), dim=1).to(device, dtype)
    rowdot = (grad.double() * out.double()).sum(1).float()
    f64 = torch.float64

    def with_rows(v, rows):
        return torch.cat([v, torch.tensor([float(rows)], dtype=f64, device=device)])

    sums = with_rows(t(2 * n, dt=f64), m)
    global_sums = with_rows(t(2 * n, dt=f64), 3 * m)
    moments = with_rows(torch.cat([t(n, dt=f64), t(n, lo=0.5, hi=2.0, dt=f64)]), m)
    coef = t(3, n, dt=torch.float32)
    z16 = z if z.element_size() == 2 else z.bfloat16()  # a 16-bit GEMM's z (autocast)

    def moment_rows(*counts):
        """Per-rank pack_moments rows [count, mean(N), M2(N)] (an empty rank's: zeros)."""
        def row(count):
            mean, m2 = t(n, dt=f64) * (count > 0), t(n, lo=0.0, hi=3.0, dt=f64) * count
            return torch.cat([torch.tensor([float(count)], dtype=f64, device=device), mean, m2])

        return torch.stack([row(c) for c in counts])

    prec = _precision(dtype)
    return {
        "gemm_affine": [case(x, w, a, c, prec), case(x, w, a, c, prec, activation="relu"),
                        case(x, w, a, c, prec, activation="leaky_relu", negative_slope=0.2),
                        case(x, w, a, c, prec, activation="gelu"),
                        case(x, w, a, c, prec, activation="gelu_tanh"),
                        case(x, w, a, c, prec, activation="silu")],
        "gemm_colstats": [case(x, w, prec)],
        "bn_fold_train": [
            case(colsum, colsumsq, m, bias, gamma, beta, None, s1, *stats(), momentum=0.1,
                 eps=1e-5),
            case(colsum, colsumsq, m, None, gamma, beta, sn, None, *stats(), momentum=None,
                 eps=1e-3),
            case(colsum, colsumsq, m, bias, gamma, beta, sn, None, *stats()),  # the defaults
        ],
        "bn_fold_eval": [
            case(bias, gamma, beta, None, sn, *stats()[:2], eps=1e-5),
            case(None, gamma, beta, s1, None, *stats()[:2], eps=1e-5),
            # float64 statistics: the backward folds the moments it kept without casting them
            case(bias, gamma, beta, None, sn, *(s.double() for s in stats()[:2]), eps=1e-5),
        ],
        "affine_softmax": [case(z, a, c), case(z, None, None),
                           case(z, a, c, activation="gelu"),
                           case(z, None, None, activation="leaky_relu", negative_slope=0.2)],
        "affine_softmax_": [case(z.clone(), a, c), case(z.clone(), None, None),
                            case(z.clone(), a, c, activation="silu")],
        "affine_": [case(z.clone(), a, c), case(z.clone(), a, c, activation="relu"),
                    case(z.clone(), None, None, activation="gelu_tanh")],
        "affine": [case(z, a, c), case(z.t().contiguous().t(), a, c),
                   case(z, a, c, activation="leaky_relu", negative_slope=0.2),
                   case(z, a, c, activation="gelu")],
        "bn_fold_batch": [
            case(colsum, colsumsq, m, bias, gamma, beta, None, s1, eps=1e-5),
            case(colsum, colsumsq, m, None, gamma, beta, sn, None, eps=1e-3),
        ],
        # From a batch's moments (count m) and a synchronized one's (count 3m, the merged rows).
        "update_running_stats": [
            case(moments, *stats(), momentum=0.1),
            case(with_rows(moments[:2 * n], 3 * m), *stats(), momentum=None),
            case(moments, *stats()),  # the default momentum
        ],
        "softmax_grad_rowdot": [case(grad, out)],
        "head_grad_sums": [case(grad, out, rowdot, z), case(grad, None, None, z),
                           case(grad, out, rowdot, z, a, c, activation="gelu"),
                           case(grad, None, None, z, a, c, activation="leaky_relu",
                                negative_slope=0.2)],
        "head_grad_coefficients": [
            case(sums, None, colsum, colsumsq, moments, bias, gamma, beta, None, s1,
                 training=True, eps=1e-5),
            case(sums, global_sums, colsum, colsumsq, moments, None, gamma, beta, sn, None,
                 training=True, eps=1e-5),
            case(sums, None, None, None, moments, bias, gamma, beta, s1, sn, training=False,
                 eps=1e-3),
        ],
        "head_grad_z": [case(grad, out, rowdot, z, coef), case(grad, None, None, z, coef),
                        case(grad, None, None, z, coef, a, c, activation="silu"),
                        case(grad, out, rowdot, z, coef, a, c, activation="gelu_tanh")],
        "backward_matmul": [case(z, t(n, k), prec), case(z.t(), x, prec),
                            # dW under autocast: written in fp32 by the GEMM (16-bit samples)
                            case(z.t(), x, prec, out_dtype=torch.float32)],
        # The GEMM operands under autocast (fp32 x or W to 16 bits), a transposed view (aten::to's
        # strides), and a copy in the dtype t has already.
        "gemm_operand": [case(x.float(), torch.bfloat16), case(w.float(), torch.float16),
                         case(x.float().t(), torch.bfloat16), case(x, dtype)],
        # Synchronized statistics: this rank's row of u's moments, every rank's rows merged and
        # folded (unequal counts, an empty rank, a single rank), the backward's row.
        "pack_moments": [case(colsum, colsumsq, m, bias, None),
                         case(colsum, colsumsq, m, None, sn), case(colsum, colsumsq, 1, bias, s1),
                         case(colsum, colsumsq, m, None, None)],
        "merge_fold": [
            case(moment_rows(m, 0, 2 * m), bias, gamma, beta, None, s1, eps=1e-5),
            case(moment_rows(m), None, gamma, beta, sn, None, eps=1e-3),
            case(moment_rows(1, m), bias, gamma, beta, s1, sn),  # the default eps
        ],
        "normalized_grad_sums": [
            case(sums, moments, bias, gamma, None, s1, eps=1e-5),
            case(sums, moments, None, gamma, sn, None, eps=1e-3),
            case(sums, moments, bias, gamma, s1, sn),  # the default eps
        ],
        # The hooks: the passes above around one collective (all_gather, all_reduce) over
        # group_name's ranks.
        "synced_batch_fold": [
            case(colsum, colsumsq, m, bias, gamma, beta, None, s1, eps=1e-5,
                 group_name=group_name),
            case(colsum, colsumsq, m, None, gamma, beta, sn, None, eps=1e-3,
                 group_name=group_name),
        ],
        "synced_grad_sums": [
            case(sums, moments, bias, gamma, None, s1, eps=1e-5, group_name=group_name),
            case(sums, moments, None, gamma, sn, None, group_name=group_name),
        ],
        # (x, weight, bias, *, the Linear's settings): the bias and activation in the GEMM's
        # epilogue; h (the pre-activation) returned where the backward reads it (GELU, SiLU, a
        # negative LeakyReLU slope, any activation before a softmax); an output wider than the
        # GEMM's; no backward.
        "fused_linear": [
            case(x, w, bias, precision=prec), case(x, w, None, precision=prec, activation="relu"),
            case(x, w, bias, precision=prec, activation="gelu"),
            case(x, w, bias, precision=prec, activation="leaky_relu", negative_slope=-0.5),
            case(x, w, None, precision=prec, softmax=True, activation="silu"),
            case(x, w, bias, precision=prec, softmax=True, for_backward=False),
            case(x, w, bias, precision=prec, activation="gelu_tanh", for_backward=False),
            case(x, w, bias, precision=prec, gemm_dtype=torch.bfloat16, out_dtype=torch.float32,
                 activation="relu"),
        ],
        # (x, weight, bias, gamma, beta, scale, running_mean, running_var, num_batches_tracked,
        #  *, HeadConfig's fields). In training, given num_batches_tracked, the op updates the
        # running statistics in place (the schema's Tensor(a!) running_mean, Tensor(b!)
        # running_var, Tensor(c!)? num_batches_tracked); None: nothing is updated.
        "fused_head": [
            case(x, w, bias, gamma, beta, s1, *stats(), precision=prec, training=True,
                 scale_before_bn=False, softmax=True, eps=1e-5, group_name=""),
            case(x, w, None, gamma, beta, sn, *stats(), precision=prec, training=True,
                 scale_before_bn=True, softmax=False, eps=1e-3, momentum=None),
            # Statistics not tracked (or frozen): no update
            case(x, w, bias, gamma, beta, sn, *stats()[:2], None, precision=prec, training=True,
                 scale_before_bn=True, activation="relu"),
            case(x, w, bias, gamma, beta, s1, *stats(), precision=prec, training=False,
                 softmax=True, momentum=None),
            case(x, w, bias, gamma, beta, sn, *stats(), precision=prec, training=True,
                 activation="gelu"),
            case(x, w, None, gamma, beta, s1, *stats()[:2], None, precision=prec, training=False,
                 softmax=True, activation="leaky_relu", negative_slope=0.2),
            # A head without a scale: its stand-in is not read (and gets no gradient computed)
            case(x, w, bias, gamma, beta, s1, *stats(), precision=prec, training=True,
                 activation="relu", has_scale=False),
            # A training forward for no backward: bn_fold_train folds and updates, the pass runs
            # in place over z, the output alone comes back ...
            case(x, w, bias, gamma, beta, s1, *stats(), precision=prec, training=True,
                 softmax=True, for_backward=False),
            # ... or, the statistics not tracked, bn_fold_batch's fold
            case(x, w, bias, gamma, beta, sn, *stats()[:2], None, precision=prec, training=True,
                 activation="silu", for_backward=False),
            # ... a direct call asking for a bf16 GEMM (what the autocast kernel passes on)
            case(x, w, bias, gamma, beta, sn, *stats(), precision=prec, training=False,
                 for_backward=False, gemm_dtype=torch.bfloat16),
            case(x, w, bias, gamma, beta, s1, *stats(), precision=prec, training=True,
                 for_backward=False, gemm_dtype=torch.bfloat16, out_dtype=torch.float32),
            # An eval forward for no backward: one GEMM with the fold and activation in its
            # epilogue, the output alone (no_grad under autocast).
            case(x, w, bias, gamma, beta, sn, *stats(), precision=prec, training=False,
                 activation="silu", for_backward=False),
            case(x, w, bias, gamma, beta, s1, *stats()[:2], None, precision=prec, training=False,
                 softmax=True, for_backward=False),
            # ... into a wider output (16-bit samples): the GEMM, then the widening affine pass.
            case(x, w, bias, gamma, beta, sn, *stats(), precision=prec, training=False,
                 activation="gelu", for_backward=False, out_dtype=torch.float32),
        ],
        # (grad, x, weight, bias, gamma, beta, scale, z, out, colsum, colsumsq, moments, needs,
        #  a=None, c=None, *, HeadConfig's fields)
        "fused_head_backward": [
            case(grad, x, w, bias, gamma, beta, s1, z, out, colsum, colsumsq, moments, [True] * 6,
                 precision=prec, training=True, scale_before_bn=False, softmax=True, eps=1e-5,
                 group_name=""),
            case(grad, x, None, None, gamma, beta, sn, z, None, colsum, colsumsq, moments,
                 [False, True, False, True, True, True], precision=prec, training=True,
                 scale_before_bn=True, softmax=False, eps=1e-3),
            case(grad, None, w, bias, gamma, beta, s1, z, out, None, None, moments,
                 [True, False, True, True, True, True], precision=prec, training=False,
                 softmax=True),
            case(grad, x, w, bias, gamma, beta, sn, z, None, colsum, colsumsq, moments,
                 [True] * 6, precision=prec, training=True, activation="silu"),
            # ... with the forward's fold (a, c) for the activation's derivative
            case(grad, x, w, bias, gamma, beta, sn, z, None, colsum, colsumsq, moments,
                 [True] * 6, a, c, precision=prec, training=True, activation="gelu"),
            # A head without a scale: no scale gradient (empty: not asked for; zeros: asked for)
            case(grad, x, w, bias, gamma, beta, s1, z, None, colsum, colsumsq, moments,
                 [True, True, True, True, True, False], precision=prec, training=True,
                 has_scale=False),
            case(grad, x, w, None, gamma, beta, s1, z, None, None, None, moments, [True] * 6, a, c,
                 precision=prec, training=False, activation="relu", has_scale=False),
            case(grad, x, w, None, gamma, beta, s1, z, out, None, None, moments,
                 [True, True, False, True, True, True], precision=prec, training=False,
                 softmax=True, activation="relu"),
            # A softmax head under autocast: an fp32 grad and output over a 16-bit z, no dX or dW
            case(grad.float(), x, w, bias, gamma, beta, s1, z16, out.float(), colsum, colsumsq,
                 moments, [False, False, True, True, True, True], precision=prec, training=True,
                 softmax=True),
            # dX in float32 (an fp32 x under autocast; from a 16-bit z the GEMM writes it)
            case(grad, x, w, bias, gamma, beta, s1, z, out, colsum, colsumsq, moments, [True] * 6,
                 precision=prec, training=True, softmax=True, grad_x_dtype=torch.float32),
        ],
    }


def op(name):
    return getattr(torch.ops.epifuse, name).default


def op_names() -> list[str]:
    """The short names of every tensor op of the library (epifuse.ops.OP_NAMES)."""
    return sorted(n.split("::")[1] for n in ops.OP_NAMES)


def all_cases():
    """(op name, dtype id, sample index) triples, for parametrize ids: every op of OP_NAMES (an
    op without samples is an error here, at collection)."""
    counts = {k: len(v) for k, v in samples("cpu", torch.float32).items()}
    missing = sorted(set(op_names()) - set(counts))
    assert not missing, f"tests/op_samples.py has no samples for {missing}"
    return [(name, d, i) for name in op_names() for d in DTYPES for i in range(counts[name])]
