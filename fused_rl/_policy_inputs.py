"""The per-token inputs of the policy losses (private): shapes, checks and the forms the
kernels read, shared by ``fused_rl.losses`` and ``fused_rl.linear``."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as V
from ._agg import check_num_items, sequence_scale
from .policy_config import PolicyConfig
from .reference.reductions import mask_weights


class RolloutInputs(NamedTuple):
    """A policy loss's per-token inputs beside the logits / log-probs, under the public
    keywords' names: what the composed routes (vocabulary parallelism, the token selections,
    the exact KL, hidden states) hand on as one bundle. ``advantages`` ``(B,)`` or
    ``(B, T)``; ``old_logprobs``, ``rollout_logprobs``, ``ref_logprobs``, ``mask``
    ``(B, T)``; ``is_weights`` ``(B, T)``, ``(B, 1)`` or ``(B,)``; ``num_items`` a number
    or a one-element tensor. Built after the public op has checked them."""

    advantages: Tensor
    old_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    mask: Tensor | None = None
    is_weights: Tensor | None = None
    num_items: int | float | Tensor | None = None

    def keywords(self) -> dict:
        """Every input but ``advantages``, as the keywords of the public policy losses."""
        return dict(
            old_logprobs=self.old_logprobs, rollout_logprobs=self.rollout_logprobs,
            ref_logprobs=self.ref_logprobs, mask=self.mask, is_weights=self.is_weights,
            num_items=self.num_items,
        )  # fmt: skip


def check_call(
    policy: PolicyConfig,
    ref_logprobs,
    num_items,
    ref_logits=None,
    ref_name: str = "ref_logits",
    rollout_logprobs=None,
) -> None:
    """What a call adds to the config's own checks: ``beta != 0`` needs ``ref_logprobs``;
    ``kl_estimator="full"`` needs ``ref_logits`` (named ``ref_name``) whatever ``beta`` and
    reads nothing else; ``rollout_logprobs`` is read by the off-policy mask only;
    ``num_items`` (a per-call value: a number or a one-element tensor)."""
    if rollout_logprobs is not None and policy.off_policy_mask_threshold is None:
        raise ValueError(
            "rollout_logprobs is read only by the off-policy sequence mask: pass "
            "off_policy_mask_threshold= with it (rollout IS weights go in is_weights=, see "
            "fused_rl.rollout_is_weights)"
        )
    full = policy.kl_estimator == "full"
    if full and ref_logprobs is not None:
        raise ValueError(
            f"kl_estimator='full' computes the exact KL from the reference's logits: pass "
            f"{ref_name}=, not ref_logprobs="
        )
    if not full and ref_logits is not None:
        raise ValueError(
            f"{ref_name} is read only by kl_estimator='full' (the exact KL over the "
            f"vocabulary); kl_estimator={policy.kl_estimator!r} takes ref_logprobs="
        )
    if full and ref_logits is None:  # even for the metric alone (beta = 0)
        raise ValueError(
            f"kl_estimator='full' needs {ref_name} (the reference policy's logits or lm_head)"
        )
    if policy.beta != 0.0 and not full and ref_logprobs is None:
        raise ValueError(
            f"beta = {policy.beta} needs ref_logprobs (the reference policy's log-probs)"
        )
    check_num_items(num_items)


def check_ref_logits(ref_logits: Tensor, logits: Tensor, length: int, name: str) -> None:
    """``ref_logits`` ``(B, S_r, V)`` beside ``logits`` ``(B, S, V)`` for ``T = length``
    targets: a float tensor on the same device, the same batch and vocabulary, ``S_r >= T``
    positions (``S_r > T``: positions ``S_r - T - 1 ...`` predict the targets, as for the
    policy's buffer). ``name`` is the policy's argument (``logits``)."""
    V.check_float(ref_logits, "ref_logits")
    V.check_same_device(**{name: logits, "ref_logits": ref_logits})
    if ref_logits.dim() != 3:
        raise ValueError(
            f"ref_logits must be (B, S, V) like {name}, got shape {tuple(ref_logits.shape)}"
        )
    batch, vocab = logits.shape[0], logits.shape[-1]
    if ref_logits.shape[-1] != vocab:
        raise ValueError(
            f"ref_logits has a vocabulary of {ref_logits.shape[-1]} but {name} has {vocab}: "
            "the exact KL needs both models over the same vocabulary"
        )
    if ref_logits.shape[0] != batch or ref_logits.shape[1] < length:
        raise ValueError(
            f"ref_logits must be ({batch}, S, {vocab}) with S >= T = {length} (the "
            f"positions that predict the targets), got {tuple(ref_logits.shape)}"
        )


def check_token_tensors(batch: int, length: int, **tensors: Tensor | None) -> None:
    """Optional ``(B, T)`` per-token inputs: float tensors (``mask``: bool / int / float)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if name == "mask":
            V.check_mask_dtype(t, name)
        else:
            V.check_float(t, name)
        V.check_shape(t, (batch, length), name, "(B, T)")


def rollout_constants(acc: torch.dtype, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Rollout inputs (advantages, old / reference log-probs) detached and in the
    accumulation dtype ``acc``, as the kernels read them: the fused kernel never
    differentiates w.r.t. them, and computes in fp32 (fp64 for fp64 log-probs) whatever
    their own dtypes, so an fp64 ``old_logprobs`` next to fp32 logits gives an fp32 loss."""
    return tuple(None if t is None else t.detach().to(acc) for t in tensors)


def advantages_2d(advantages: Tensor, batch: int, length: int) -> Tensor:
    """``(B,)`` (one per sequence) or ``(B, T)`` (per token) advantages as a ``(B, T)`` view."""
    V.check_float(advantages, "advantages")
    shape = tuple(advantages.shape)
    if shape == (batch,):
        return advantages[:, None].expand(batch, length)
    if shape == (batch, length):
        return advantages
    if shape == (batch, 1):
        raise ValueError(
            f"advantages of shape (B, 1) = {shape} is ambiguous: pass (B,) for one advantage "
            f"per sequence or (B, T) = ({batch}, {length}) for one per token"
        )
    raise ValueError(
        f"advantages must have shape (B,) = ({batch},) or (B, T) = ({batch}, {length}), got {shape}"
    )


def is_weights_2d(is_weights: Tensor | None, batch: int, length: int) -> Tensor | None:
    """Rollout IS weights ``(B, T)``, ``(B, 1)`` or ``(B,)`` as a ``(B, T)`` view."""
    if is_weights is None:
        return None
    V.check_float(is_weights, "is_weights")
    shape = tuple(is_weights.shape)
    if shape == (batch,):
        return is_weights[:, None].expand(batch, length)
    if shape == (batch, 1):
        return is_weights.expand(batch, length)
    if shape == (batch, length):
        return is_weights
    raise ValueError(
        f"is_weights must have shape (B, T) = ({batch}, {length}), (B, 1) or (B,), got {shape}"
    )


def num_items_args(num_items, device: torch.device) -> tuple[float, Tensor | None]:
    """``num_items`` as the kernels take it: a number (``-1``: not given) or a tensor on the
    kernels' ``device`` (a trainer's count may sit on the CPU: copied, never read on the
    host). While ``torch.compile`` traces the call a number is made a 0-dim tensor too: a
    custom op's float argument is a constant of the graph, so a count that changes every
    step (a trainer's ``num_items_in_batch``) would recompile it each step, where a tensor
    made from it is an input of the graph."""
    if isinstance(num_items, Tensor):
        return -1.0, num_items.reshape(()).to(device)
    if num_items is not None and torch.compiler.is_compiling():
        return -1.0, torch.scalar_tensor(num_items, dtype=torch.float64, device=device)
    return (-1.0 if num_items is None else float(num_items)), None


def counted_mask(mask: Tensor | None, targets: Tensor, ignore_index: int) -> Tensor:
    """``mask`` (None: every token) restricted to the tokens whose target is not
    ``ignore_index``, in ``mask``'s own dtype (bool, integer or float weights)."""
    counted = targets != ignore_index
    if mask is None:
        return counted
    if mask.dtype == torch.bool:
        return mask & counted
    return torch.where(counted, mask, torch.zeros_like(mask))


def weights_of(mask, like: Tensor, dtype, targets=None, ignore_index: int = -100) -> Tensor:
    """The ``(B, T)`` token weights ``m`` in ``dtype``: ``mask``'s (None: 1), 0 where
    ``targets`` is ``ignore_index`` (the ignore mask after the weight, as the kernels)."""
    m = (
        torch.ones(like.shape, dtype=dtype, device=like.device)
        if mask is None
        else (mask_weights(mask.detach(), dtype))
    )
    return m if targets is None else torch.where(targets != ignore_index, m, 0.0)


def entropy_scale(m: Tensor, policy: PolicyConfig, num_items) -> Tensor | None:
    """The per-sequence factor ``c`` (``(B, 1)`` or ``(1, 1)``, ``m``'s dtype) that turns the
    entropy bonus aggregated by ``loss_agg`` into a token mean (``entropy_agg="token-mean"``):
    with ``loss_agg``'s weights ``m_t s_b``, ``sum_t m_t s_b c_b H_t = sum_t m_t H_t / sum m``
    for ``c_b = 1 / (s_b sum m)`` (0 where that is 0: nothing counts). From the mask alone,
    so it is known before any logit is read. None when the bonus follows ``loss_agg``."""
    if policy.entropy_agg is None or policy.entropy_coef == 0.0:
        return None
    s = sequence_scale(m, policy.loss_agg, max_length=policy.max_length, num_items=num_items)
    den = s * m.sum()
    return torch.where(den != 0, 1.0 / torch.where(den != 0, den, 1.0), 0.0)


def per_row(scale: Tensor | None, shape) -> Tensor | None:
    """A ``(B, 1)`` / ``(1, 1)`` factor as the contiguous ``(B * T,)`` rows the kernels read."""
    return None if scale is None else scale.expand(shape).contiguous().view(-1)


def check_full_kl_route(policy: PolicyConfig, sharded: bool) -> None:
    """What ``kl_estimator="full"`` cannot do where the loss is composed from per-token
    statistics (vocabulary parallelism, GSPO / VESPO, the top-entropy selection, the
    off-policy mask): the bias-corrected KL, whose ratio factor lives in the fused
    token-level pass."""
    option = not_token_level(policy)
    if sharded:
        option = "vocabulary-parallel logits (process_group= or DTensor logits)"
    if option is None:
        return
    if policy.kl_bias_correction:
        raise NotImplementedError(
            f"kl_estimator='full' with kl_bias_correction=True is implemented for the fused "
            f"token-level pass, not with {option}"
        )


def not_token_level(policy: PolicyConfig) -> str | None:
    """The option that keeps a token's gradient from being known from its own row."""
    if policy.importance_sampling != "token":
        return f"importance_sampling={policy.importance_sampling!r} (the sequence's ratio)"
    if policy.surrogate == "vespo":
        return "surrogate='vespo' (the sequence's weight phi)"
    if policy.top_entropy_quantile < 1.0:
        return f"top_entropy_quantile={policy.top_entropy_quantile} (every token's entropy)"
    if policy.off_policy_mask_threshold is not None:
        return (
            f"off_policy_mask_threshold={policy.off_policy_mask_threshold} (the sequence's "
            "log-probs)"
        )
    return None
