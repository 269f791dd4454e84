"""The backward's passes (``cpp/ops/backward.cpp``): float64 references and fake kernels."""

from __future__ import annotations

import torch

from .. import fold
from ..head_config import DEFAULT as _D
from ._registry import F32, F64, affine64, fake, reference, vec_f32


def _activation_input(z, a, c, activation):
    """h = a * z + c in float64 for the activation's derivative (None without an activation)."""
    return affine64(z, a, c) if activation else None


def _param_grad(values, like):
    """A per-column float64 gradient in ``like``'s dtype and shape (summed for one element)."""
    if like is None:
        return values.new_empty((0,), dtype=F32)
    if like.numel() == 1 and values.numel() != 1:
        values = values.sum()
    return values.reshape(like.shape).to(like.dtype)


@reference("softmax_grad_rowdot")
def _softmax_grad_rowdot(grad, out):
    return (grad.to(F64) * out.to(F64)).sum(1).float()


@reference("head_grad_sums")
def _head_grad_sums(grad, out, rowdot, z, a=None, c=None, *, activation=_D.activation,
                    negative_slope=_D.negative_slope):
    # (rowdot is the CUDA kernels' input; the row term is recomputed here in float64.)
    h = _activation_input(z, a, c, activation)
    return fold.grad_sums(grad, out, z, h, activation, negative_slope)


@reference("head_grad_coefficients")
def _head_grad_coefficients(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                            pre_scale, post_scale, *, training=_D.training, eps=_D.eps):
    g = fold.grad_coefficients(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                               pre_scale, post_scale, training, eps)
    coef = torch.stack([g.A, g.B, g.C]).float()
    return (coef, _param_grad(g.bias, bias), _param_grad(g.gamma, gamma),
            _param_grad(g.beta, beta), _param_grad(g.pre, pre_scale),
            _param_grad(g.post, post_scale))


@reference("head_grad_z")
def _head_grad_z(grad, out, rowdot, z, coef, a=None, c=None, *, activation=_D.activation,
                 negative_slope=_D.negative_slope):
    h = _activation_input(z, a, c, activation)
    dz = fold.grad_z(grad, out, z, *coef.unbind(0), h, activation, negative_slope)
    return dz.to(z.dtype).contiguous()


@fake("softmax_grad_rowdot")
def _softmax_grad_rowdot_fake(grad, out):
    torch._check(grad.dim() == 2, lambda: "grad must be 2-D")
    return vec_f32(grad, grad.shape[0])


@fake("head_grad_sums")
def _head_grad_sums_fake(grad, out, rowdot, z, a=None, c=None, *, activation=_D.activation,
                         negative_slope=_D.negative_slope):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty((2 * z.shape[1] + 1,), dtype=F64)


@fake("head_grad_coefficients")
def _head_grad_coefficients_fake(sums, global_sums, colsum, colsumsq, moments, bias, gamma, beta,
                                 pre_scale, post_scale, *, training=_D.training, eps=_D.eps):
    n = gamma.shape[0]

    def like(t):
        return gamma.new_empty((0,), dtype=F32) if t is None else torch.empty_like(t)

    return (gamma.new_empty((3, n), dtype=F32), like(bias), like(gamma), like(beta),
            like(pre_scale), like(post_scale))


@fake("head_grad_z")
def _head_grad_z_fake(grad, out, rowdot, z, coef, a=None, c=None, *, activation=_D.activation,
                      negative_slope=_D.negative_slope):
    torch._check(z.dim() == 2, lambda: "z must be 2-D")
    return z.new_empty(z.shape)
