"""Loss aggregation (``loss_agg``): ``loss = sum_t w_t L_t`` with ``w_t = m_t s_b``.

``m`` is the mask weight and ``s`` the mode's normaliser (:func:`sequence_scale`: one value
per sequence for ``seq-mean-token-mean``, else one for all), which depends on the mask only,
never on the logits. Two users, one definition of ``s``:

* the reference path multiplies per-token losses by :func:`token_weights`;
* the Triton path applies the same ``s`` after the per-token pass, inside the finalize
  kernel (``kernels/policy/token_pass.py``, ``AGG``), which also hands ``s`` to the backward; the
  fused-linear loss needs ``s`` before its chunk loop and takes it from
  :func:`sequence_scale` here.
"""

from __future__ import annotations

import torch

from . import _validation as V
from .kernels.modes import LOSS_AGG_MODES  # noqa: F401  (re-exported: the modes' old home)
from .reference.reductions import mask_weights


def check_loss_agg(loss_agg: str, *, max_length, num_items) -> None:
    """The aggregation arguments of every loss (:func:`token_weights`).

    ``loss_agg``: one of ``LOSS_AGG_MODES``; ``max_length``: None or an int ``>= 1`` (checked
    whichever the mode); ``num_items``: None, a finite number ``> 0``, or a one-element real
    tensor (its value is not checked: that would sync with the host).
    """
    V.check_choice(loss_agg, LOSS_AGG_MODES, "loss_agg")
    V.check_positive_int(max_length, "max_length", allow_none=True)
    check_num_items(num_items)


def check_num_items(num_items) -> None:
    """``num_items``: None, a finite number ``> 0``, or a one-element real tensor (its value
    is not checked: that would sync with the host)."""
    if isinstance(num_items, torch.Tensor):
        if num_items.is_complex() or num_items.dtype == torch.bool:
            raise TypeError(f"num_items must be a real number tensor, got {num_items.dtype}")
        if num_items.numel() != 1:
            raise ValueError(
                f"num_items must be a number or a one-element tensor, got shape "
                f"{tuple(num_items.shape)}"
            )
        return
    V.check_positive(num_items, "num_items", allow_none=True)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with 0 where ``den == 0`` (an empty sequence contributes 0, never NaN)."""
    safe = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe, torch.zeros_like(num))


def token_weights(
    mask: torch.Tensor,
    loss_agg: str,
    *,
    max_length: int | None = None,
    num_items: int | float | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(B, T)`` weights ``w`` in ``dtype`` (the kernels' accumulation dtype: fp32, fp64 for
    fp64 log-probs) with ``loss = (w * per_token_loss).sum()``: ``w = m * s`` with ``m`` the
    mask weights and ``s`` :func:`sequence_scale`.

    * ``token-mean``: ``m / sum(m)`` (``num_items`` replaces ``sum(m)``: a global token count
      for DAPO-style normalisation across micro-batches and ranks; a tensor holding a value
      <= 0 gives NaN, never a silent 0);
    * ``seq-mean-token-mean``: ``m / (B * sum_t m)``, an empty sequence weighs 0;
    * ``seq-mean-token-sum``: ``m / B``;
    * ``seq-mean-token-sum-norm``: ``m / (B * max_length)`` (Dr. GRPO; ``max_length`` = T
      by default).
    """
    m = mask_weights(mask, dtype)
    if m.dim() != 2:
        raise ValueError(f"mask must be (B, T), got shape {tuple(m.shape)}")
    return m * sequence_scale(m, loss_agg, max_length=max_length, num_items=num_items)


def sequence_scale(
    m: torch.Tensor,
    loss_agg: str,
    *,
    max_length: int | None = None,
    num_items: int | float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The aggregation's normaliser ``s`` of :func:`token_weights` for ``(B, T)`` float
    mask weights ``m``: ``(B, 1)`` for ``seq-mean-token-mean``, else ``(1, 1)``, in ``m``'s
    dtype. Depends on the mask only, so it is known before any logit is read (the
    fused-linear loss scales each chunk's gradient by it, ``fused_rl.linear``)."""
    if num_items is not None and not isinstance(num_items, torch.Tensor):
        V.check_number(num_items, "num_items")
        if not num_items > 0:
            raise ValueError(f"num_items must be > 0, got {num_items}")
    n_seq, length = m.shape
    one = torch.ones((1, 1), dtype=m.dtype, device=m.device)
    if loss_agg == "token-mean":
        if num_items is None:
            return _safe_div(one, m.sum().reshape(1, 1))
        # a count tensor is never read on the host: one <= 0 makes the loss NaN (a float one
        # raises), so a bad global token count cannot pass as a finite loss
        if torch.compiler.is_compiling() and not isinstance(num_items, torch.Tensor):
            # as_tensor would make a count that changes between calls a graph constant
            den = torch.scalar_tensor(num_items, dtype=m.dtype, device=m.device)
        else:
            den = torch.as_tensor(num_items, dtype=m.dtype, device=m.device)
        den = den.reshape(1, 1)
        return one / torch.where(den > 0, den, float("nan"))
    if loss_agg == "seq-mean-token-mean":
        return _safe_div(one, m.sum(dim=1, keepdim=True)) / max(n_seq, 1)
    if loss_agg == "seq-mean-token-sum":
        return one / max(n_seq, 1)
    if loss_agg == "seq-mean-token-sum-norm":
        if max_length is not None and max_length <= 0:
            raise ValueError(f"max_length must be > 0, got {max_length}")
        norm = length if max_length is None else max_length
        return one / (max(n_seq, 1) * max(norm, 1))  # norm 0 only when T = 0: no weight at all
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")


def masked_mean_all(x: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """``sum(x * m) / sum(m)`` as a 0-dim fp32 tensor, 0 for an empty mask (metrics).

    Values at tokens that do not count never matter, even NaN / inf ones."""
    x = torch.where(mask_f != 0, x.to(mask_f.dtype) * mask_f, torch.zeros_like(mask_f))
    return _safe_div(x.sum(), mask_f.sum()).float()  # summed in the mask's dtype, as kernels


def poison_empty(loss: torch.Tensor, num_items, numel: int) -> torch.Tensor:
    """``loss``, NaN when the batch is empty (``numel == 0``) and ``num_items`` is a tensor
    holding a value <= 0 or NaN: with no token there is no weight to carry that NaN, and an
    invalid global count must never pass as a finite loss. A static-shape test, no sync."""
    if numel != 0 or not isinstance(num_items, torch.Tensor):
        return loss
    bad = ~(num_items.reshape(()).to(loss.device) > 0)
    return loss + torch.where(bad, float("nan"), 0.0).to(loss.dtype)
