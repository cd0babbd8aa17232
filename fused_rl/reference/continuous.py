"""Reference diagonal-Gaussian log-prob and entropy (``Independent(Normal(mu, sigma), 1)``).

Plain PyTorch, computed in fp32 (fp64 when an input is fp64). The log-prob's backward is
written out (:class:`_GaussianLogprob`, itself differentiable) in the kernel's order of
operations: autograd's own backward of ``(a - mu) / sigma`` forms ``(a - mu) / sigma^2``,
which overflows fp32 for a tiny ``sigma`` (``|a - mu| / sigma^2 > 3.4e38``, e.g.
``sigma = 1e-20``) even where the gradient is finite, and a zero upstream gradient (a ratio
``exp(-inf) = 0``, a clipped sample) then gave ``0 * inf = NaN`` where the kernel, and
float64, give 0.
"""

from __future__ import annotations

import math

import torch

from .reductions import acc_dtype

HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _terms(mu: torch.Tensor, sigma: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Per action dimension ``-(a - mu)^2 / (2 sigma^2) - log sigma``, as the kernel rounds it:
    ``(-0.5 z) z`` (``z^2`` alone would overflow for ``|z| > 1.8e19``, where the term is
    still finite)."""
    z = (actions - mu) / sigma
    return (-0.5 * z) * z - torch.log(sigma)


class _GaussianLogprob(torch.autograd.Function):
    """``sum_n`` of :func:`_terms` minus ``N log(2 pi) / 2`` on inputs of one shape, with the
    kernel's backward: ``z = (a - mu) / sigma``, ``d mu = (g z) / sigma``,
    ``d sigma = d mu * z - g / sigma``, ``d a = -d mu``, products taken in that order so no
    intermediate overflows where the result is finite; a row whose upstream ``g`` is 0 gets
    exact zeros (a finite loss never has a NaN gradient there, as in the vocab backward's
    skipped rows). The backward is plain PyTorch on the saved inputs: differentiable again."""

    @staticmethod
    def forward(ctx, mu, sigma, actions):
        ctx.save_for_backward(mu, sigma, actions)
        n = mu.shape[-1]
        return _terms(mu, sigma, actions).sum(dim=-1) - n * HALF_LOG_2PI

    @staticmethod
    def backward(ctx, grad):
        mu, sigma, actions = ctx.saved_tensors
        g = grad.unsqueeze(-1)
        inv_sigma = 1.0 / sigma
        z = (actions - mu) * inv_sigma
        counted = g != 0
        d_mu = torch.where(counted, g * z * inv_sigma, 0.0)
        d_sigma = torch.where(counted, d_mu * z - g * inv_sigma, 0.0)
        d_actions = -d_mu if ctx.needs_input_grad[2] else None
        return d_mu, d_sigma, d_actions


def gaussian_logprob(mu: torch.Tensor, sigma: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``sum_n -(a - mu)^2 / (2 sigma^2) - log sigma - 0.5 log(2 pi)`` over the last dim;
    inputs broadcast like ``torch.distributions`` does. Gradients as the kernel's: finite
    wherever the float64 gradient fits the dtype, exact zeros under a zero upstream."""
    dtype = acc_dtype(mu, sigma, actions)
    mu, sigma, actions = torch.broadcast_tensors(mu.to(dtype), sigma.to(dtype), actions.to(dtype))
    return _GaussianLogprob.apply(mu, sigma, actions)


def gaussian_entropy(sigma: torch.Tensor) -> torch.Tensor:
    """``sum_n 0.5 + 0.5 log(2 pi) + log sigma`` over the last dim."""
    sigma = sigma.to(acc_dtype(sigma))
    return (torch.log(sigma) + (0.5 + HALF_LOG_2PI)).sum(dim=-1)
