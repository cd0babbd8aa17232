"""Reference diagonal-Gaussian log-prob and entropy (``Independent(Normal(mu, sigma), 1)``).

Plain PyTorch, differentiable by autograd, computed in fp32 (fp64 when an input is fp64).
"""

from __future__ import annotations

import math

import torch

from .reductions import acc_dtype

HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def gaussian_logprob(mu: torch.Tensor, sigma: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """``sum_n -(a - mu)^2 / (2 sigma^2) - log sigma - 0.5 log(2 pi)`` over the last dim;
    inputs broadcast like ``torch.distributions`` does."""
    dtype = acc_dtype(mu, sigma, actions)
    mu, sigma, actions = mu.to(dtype), sigma.to(dtype), actions.to(dtype)
    z = (actions - mu) / sigma
    return (-0.5 * z.square() - torch.log(sigma) - HALF_LOG_2PI).sum(dim=-1)


def gaussian_entropy(sigma: torch.Tensor) -> torch.Tensor:
    """``sum_n 0.5 + 0.5 log(2 pi) + log sigma`` over the last dim."""
    sigma = sigma.to(acc_dtype(sigma))
    return (torch.log(sigma) + (0.5 + HALF_LOG_2PI)).sum(dim=-1)
