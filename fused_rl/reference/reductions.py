"""Reference masked reductions (plain PyTorch, differentiable through autograd).

``mask`` is ``None`` (every element counts) or a tensor of ``x``'s shape holding 0/1 or
non-negative weights (bool, integer or floating); a negative weight makes the result NaN (the
public ops reject one first in eager mode, ``fused_rl._validation.check_mask_weights``). A
position whose weight is 0 contributes exactly 0 to every statistic and receives exactly 0
gradient, even if ``x`` is NaN or inf there. Empty masks give 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(*tensors: Tensor | None) -> torch.dtype:
    """fp64 when any input is fp64, else fp32: the accumulation and output dtype of every
    token-space op (fp64 so that gradcheck runs through the kernels)."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def mask_weights(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``mask`` as weights of ``dtype``. Weights must be >= 0: the public ops reject a negative
    one in eager mode with value checks on (a host read); otherwise it becomes NaN and makes the
    result loudly NaN, as in the kernels (``kernels/common.py`` ``as_weight``)."""
    w = mask.to(dtype)
    if mask.dtype == torch.bool:
        return w
    return torch.where(w < 0, float("nan"), w)


def _weights(x: Tensor, mask: Tensor | None) -> Tensor:
    return torch.ones_like(x) if mask is None else mask_weights(mask, x.dtype)


def _div_positive(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, 0 where ``den <= 0``, NaN where ``den`` is NaN (and no
    NaN gradient through the unused branch)."""
    empty = den <= 0
    return torch.where(
        empty, torch.zeros_like(num), num / torch.where(empty, torch.ones_like(den), den)
    )


def masked_count(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Sum of the weights (the number of counted elements for a 0/1 mask)."""
    w = _weights(x, mask)
    return w.sum() if dim is None else w.sum(dim)


def masked_sum(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """``sum(w * x)`` over everything (``dim=None``) or along ``dim``."""
    w = _weights(x, mask)
    terms = torch.where(w != 0, x * w, torch.zeros_like(x))
    return terms.sum() if dim is None else terms.sum(dim)


def masked_mean(x: Tensor, mask: Tensor | None = None, dim: int | None = None) -> Tensor:
    """``sum(w * x) / sum(w)``; 0 where ``sum(w) == 0``."""
    return _div_positive(masked_sum(x, mask, dim), masked_count(x, mask, dim))


def masked_var(x: Tensor, mask: Tensor | None = None, unbiased: bool = True) -> Tensor:
    """``sum(w (x - mean)^2) / (n - 1)`` (``/ n`` if not ``unbiased``), ``n = sum(w)``, centred
    on the masked mean; 0 when there are no degrees of freedom left (``n <= 1`` unbiased)."""
    w = _weights(x, mask)
    # centre a copy with padding zeroed, so a NaN / inf there cannot reach the gradient
    dev = torch.where(w != 0, x, torch.zeros_like(x)) - masked_mean(x, mask)
    dof = masked_count(x, mask) - (1.0 if unbiased else 0.0)
    return _div_positive(masked_sum(dev * dev, mask), dof)


class _Scale(torch.autograd.Function):
    """``d * r`` for a 0-dim ``r``, whose gradient for ``r`` sums ``g * d`` only where the
    upstream ``g`` is not 0. Plain autograd would add ``0 * NaN`` for a masked-out NaN / inf
    whose output is zeroed downstream, and so make every gradient NaN. The backward is
    plain PyTorch, so it is differentiable again."""

    @staticmethod
    def forward(ctx, d, r):
        ctx.save_for_backward(d, r)
        return d * r

    @staticmethod
    def backward(ctx, g):
        d, r = ctx.saved_tensors
        return g * r, torch.where(g != 0, g * d, torch.zeros_like(d)).sum()


def masked_whiten(
    x: Tensor, mask: Tensor | None = None, keep_mean: bool = False, eps: float = 1e-8
) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with the masked mean and unbiased masked variance,
    applied to every position (masked ones too); ``keep_mean`` adds the mean back. A masked
    position whose upstream gradient is 0 adds nothing to the gradient, even if NaN / inf."""
    mean = masked_mean(x, mask)
    y = _Scale.apply(x - mean, torch.rsqrt(masked_var(x, mask, unbiased=True) + eps))
    return y + mean if keep_mean else y
