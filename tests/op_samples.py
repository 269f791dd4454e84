"""Sample arguments for every epifuse op (shared by the CPU and CUDA op tests)."""

from __future__ import annotations

import torch

from epifuse import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else ""


def samples(device, dtype, m=5, k=7, n=3, seed=0):
    """{op name: [args, ...]} covering optional arguments (None) and scale shapes."""
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

    prec = _precision(dtype)
    return {
        "gemm_affine": [(x, w, a, c, prec)],
        "gemm_colstats": [(x, w, prec)],
        "bn_fold_train": [
            (colsum, colsumsq, m, bias, gamma, beta, None, s1, *stats(), 0.1, 1e-5),
            (colsum, colsumsq, m, None, gamma, beta, sn, None, *stats(), None, 1e-3),
        ],
        "bn_fold_eval": [
            (bias, gamma, beta, None, sn, *stats()[:2], 1e-5),
            (None, gamma, beta, s1, None, *stats()[:2], 1e-5),
        ],
        "affine_softmax": [(z, a, c), (z, None, None)],
        "affine_softmax_": [(z.clone(), a, c), (z.clone(), None, None)],
        "affine_": [(z.clone(), a, c)],
        "affine": [(z, a, c), (z.t().contiguous().t(), a, c)],
        "bn_fold_batch": [
            (colsum, colsumsq, m, bias, gamma, beta, None, s1, 1e-5),
            (colsum, colsumsq, m, None, gamma, beta, sn, None, 1e-3),
        ],
        "softmax_grad_rowdot": [(grad, out)],
        "head_grad_sums": [(grad, out, rowdot, z), (grad, None, None, z)],
        "head_grad_coefficients": [
            (sums, None, colsum, colsumsq, moments, bias, gamma, beta, None, s1, True, 1e-5),
            (sums, global_sums, colsum, colsumsq, moments, None, gamma, beta, sn, None, True, 1e-5),
            (sums, None, None, None, moments, bias, gamma, beta, s1, sn, False, 1e-3),
        ],
        "head_grad_z": [(grad, out, rowdot, z, coef), (grad, None, None, z, coef)],
        "backward_matmul": [(z, t(n, k), prec), (z.t(), x, prec)],
        # (x, weight, bias, gamma, beta, scale, running_mean, running_var, precision, training,
        #  scale_before_bn, softmax, eps, group_name)
        "fused_head": [
            (x, w, bias, gamma, beta, s1, *stats()[:2], prec, True, False, True, 1e-5, ""),
            (x, w, None, gamma, beta, sn, *stats()[:2], prec, True, True, False, 1e-3, ""),
            (x, w, bias, gamma, beta, s1, *stats()[:2], prec, False, False, True, 1e-5, ""),
        ],
        # (grad, x, weight, bias, gamma, beta, scale, z, out, colsum, colsumsq, moments,
        #  precision, training, scale_before_bn, softmax, eps, group_name, needs)
        "fused_head_backward": [
            (grad, x, w, bias, gamma, beta, s1, z, out, colsum, colsumsq, moments, prec, True,
             False, True, 1e-5, "", [True] * 6),
            (grad, x, None, None, gamma, beta, sn, z, None, colsum, colsumsq, moments, prec, True,
             True, False, 1e-3, "", [False, True, False, True, True, True]),
            (grad, None, w, bias, gamma, beta, s1, z, out, None, None, moments, prec, False,
             False, True, 1e-5, "", [True, False, True, True, True, True]),
        ],
    }


def op(name):
    return getattr(torch.ops.epifuse, name).default


def all_cases():
    """(op name, dtype id, sample index) triples, for parametrize ids."""
    names = [n.split("::")[1] for n in ops.OP_NAMES]
    counts = {k: len(v) for k, v in samples("cpu", torch.float32).items()}
    return [(name, d, i) for name in names for d in DTYPES for i in range(counts[name])]
