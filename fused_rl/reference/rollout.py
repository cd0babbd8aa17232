"""Reference rollout (behaviour-policy) importance-sampling weights: ``rollout_is_weights``.

Plain PyTorch, readable first; the twin of ``kernels/token_ops/rollout.py`` and the CPU fallback.
The semantics (and how each library's mode maps onto them) are documented on the public
function, :func:`fused_rl.rollout.rollout_is_weights`.

Per token, ``counted = mask != 0`` (an indicator: a float mask's values do not scale the
log-ratios) and ``lam = old - rollout`` where counted, exactly 0 elsewhere (a ``where``, so
NaN / inf at padding never reaches a sum). The level gives ``log_w``: ``lam`` itself, its sum
over the sequence, or its mean over the sequence's counted tokens (0 for an empty row),
broadcast to the sequence's tokens. Then ``w = exp(log_w)`` and

* ``truncate``: ``clamp(w, clip_min, clip_max)``;
* ``mask``: ``rejected = (w < clip_min) | (w > clip_max)`` (NaN is never rejected: it stays
  NaN), weight 0 where rejected and the raw ``w`` elsewhere, ``keep = counted & ~rejected``.

Tokens that do not count get weight exactly 1 (and ``keep`` False).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reductions import acc_dtype

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")


def rollout_log_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor | None, level: str
) -> tuple[Tensor, Tensor]:
    """``(log_w, counted)``: the ``(B, T)`` log importance weight of each token in the
    accumulation dtype (0 where not counted) and the bool ``counted`` indicator."""
    dtype = acc_dtype(old_logprobs, rollout_logprobs)
    old, roll = old_logprobs.detach().to(dtype), rollout_logprobs.detach().to(dtype)
    if mask is None:
        counted = torch.ones(old.shape, dtype=torch.bool, device=old.device)
    else:
        counted = mask != 0
    lam = torch.where(counted, old - roll, torch.zeros((), dtype=dtype, device=old.device))
    if level == "token":
        return lam, counted
    total = lam.sum(dim=-1, keepdim=True)
    if level == "geometric":
        n = counted.sum(dim=-1, keepdim=True).to(dtype)
        total = torch.where(n > 0, total / n.clamp(min=1.0), torch.zeros_like(total))
    elif level != "sequence":
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    # zeros outside the counted tokens: only their weight (1) is written there
    return torch.where(counted, total.expand_as(lam), torch.zeros_like(lam)), counted


def rollout_is_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor | None,
    level: str,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Weights (``mode="truncate"``) or ``(weights, keep)`` (``mode="mask"``); fp32 (fp64
    for an fp64 input) and bool, ``(B, T)``, no graph."""
    log_w, counted = rollout_log_weights(old_logprobs, rollout_logprobs, mask, level)
    lo = 0.0 if clip_min is None else float(clip_min)
    hi = math.inf if clip_max is None else float(clip_max)
    w = torch.exp(log_w)
    one = torch.ones((), dtype=w.dtype, device=w.device)
    if mode == "truncate":
        return torch.where(counted, torch.clamp(w, min=lo, max=hi), one).contiguous()
    if mode != "mask":
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    rejected = (w < lo) | (w > hi)
    w = torch.where(rejected, torch.zeros_like(w), w)
    return torch.where(counted, w, one).contiguous(), (counted & ~rejected).contiguous()
