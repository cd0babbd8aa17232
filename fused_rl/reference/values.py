"""Reference value losses: the clipped value loss and torchtune's complete ``PPOLoss``.

Plain PyTorch, differentiable through autograd. Positions whose mask / weight is 0 contribute
exactly 0 (a NaN or inf there never leaks into a masked statistic).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reductions as red
from .clamp import clamp


def clipped_value_sq(
    values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None
) -> tuple[Tensor, Tensor]:
    """``(sq, clipped)``: ``sq = max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)``
    (``(v - R)^2`` when ``clip`` is None) and whether the clipped branch is strictly larger."""
    sq_unclipped = (values - returns).square()
    if clip is None:
        return sq_unclipped, torch.zeros_like(sq_unclipped, dtype=torch.bool)
    v_clipped = clamp(values, old_values - clip, old_values + clip)
    sq_clipped = (v_clipped - returns).square()
    return torch.maximum(sq_unclipped, sq_clipped), sq_clipped > sq_unclipped


def zero_unmasked(mask: Tensor | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` with 0 wherever ``mask == 0``: padding then adds exactly 0 to a masked sum
    and to its gradient (``0 * inf`` in a backward would otherwise give NaN)."""
    if mask is None:
        return tensors
    keep = mask != 0
    return tuple(torch.where(keep, t, torch.zeros_like(t)) for t in tensors)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    weights: Tensor,
    mask: Tensor | None,
    clip: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, clip_frac, value_mean)``: ``loss = sum(weights * 0.5 * sq)`` (the weights come
    from ``fused_rl._agg.token_weights``); the metrics are masked means over ``mask``."""
    sq, _ = clipped_value_sq(*zero_unmasked(weights, values, old_values, returns), clip)
    loss = red.masked_sum(0.5 * sq, weights)
    # the metric counts by the mask (not the weights, which num_items may scale to 0)
    _, clipped = clipped_value_sq(*zero_unmasked(mask, values, old_values, returns), clip)
    clip_frac = red.masked_mean(clipped.to(values.dtype), mask)
    return loss, clip_frac, red.masked_mean(values, mask)


def _torchtune_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """torchtune: ``x.mean()`` without a mask, ``sum(m x) / (sum(m) + 1e-8)`` with one."""
    if mask is None:
        return x.mean()
    return red.masked_sum(x, mask) / (red.masked_count(x, mask) + 1e-8)


def ppo_loss(
    pi_old_logprobs: Tensor,
    pi_logprobs: Tensor,
    advantages: Tensor,
    phi_old_values: Tensor,
    phi_values: Tensor,
    returns: Tensor,
    padding_masks: Tensor | None,
    value_padding_masks: Tensor | None,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torchtune's ``PPOLoss.forward``: ``(loss, policy_loss, value_loss, ratios_mean,
    clipfrac)``, only ``loss`` differentiable; ``ratios_mean`` is unmasked."""
    ratios_mean = torch.exp(pi_logprobs - pi_old_logprobs).mean()  # unmasked, no gradient
    old_lp, new_lp, adv = zero_unmasked(padding_masks, pi_old_logprobs, pi_logprobs, advantages)
    ratios = torch.exp(new_lp - old_lp)
    losses_clipped = -adv * clamp(ratios, 1.0 - epsilon, 1.0 + epsilon)
    losses_unclipped = -adv * ratios
    clipfrac = _torchtune_mean((losses_clipped > losses_unclipped).to(ratios.dtype), padding_masks)
    policy_loss = _torchtune_mean(torch.maximum(losses_clipped, losses_unclipped), padding_masks)
    values = zero_unmasked(value_padding_masks, phi_values, phi_old_values, returns)
    sq, _ = clipped_value_sq(*values, value_clip_range)
    value_loss = 0.5 * _torchtune_mean(sq, value_padding_masks)
    loss = policy_loss + value_loss * value_coeff
    return (
        loss,
        policy_loss.detach(),
        value_loss.detach(),
        ratios_mean.detach(),
        clipfrac.detach(),
    )
