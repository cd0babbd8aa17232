"""Drop-in replacements for torchtune's RLHF (PPO) utilities, fused.

Change ``from torchtune import rlhf`` / ``from torchtune.rlhf.loss import PPOLoss`` to
``from fused_rl.compat import torchtune as rlhf`` / ``from fused_rl.compat.torchtune import
PPOLoss``. torchtune is not imported (nor needed).

Mirrors torchtune at commit ``bd2a0fc7c314`` (2026): ``torchtune/rlhf/loss/ppo.py``,
``torchtune/rlhf/rewards.py`` and ``torchtune/rlhf/sequence_processing.py``, quirks included:

* ``masked_mean`` divides by ``mask.sum() + 1e-8`` (an empty mask gives 0, not NaN);
* ``masked_var`` expects CENTRED input and applies Bessel's correction with the global mask
  count (one valid element gives NaN);
* ``whiten(..., shift_mean=True)`` (the default) ADDS the mean back after scaling, the
  opposite of TRL's / verl's ``masked_whiten``;
* ``estimate_advantages`` computes ``returns = A + values`` before whitening and zeroes the
  advantages outside ``masks``; the GAE recursion ignores the mask;
* ``PPOLoss``: ``clipfrac`` = "the clipped branch is strictly larger", ``ratios.mean()`` is
  unmasked, the value clip is ``clamp(v, v_old - c, v_old + c)``, only ``loss`` has a graph.

Fused: :func:`logits_to_logprobs` streams the logits through :func:`fused_rl.token_logprobs`
(the temperature division happens in fp32 inside the kernel, so bf16 logits are not first
rounded to bf16 by ``logits / T``; ``temperature <= 0`` raises ``ValueError`` instead of
giving inf/NaN); :class:`PPOLoss` runs :func:`fused_rl.ppo_loss` (one launch forward, one
backward; outputs cast to the inputs' dtype); :func:`estimate_advantages` runs
:func:`fused_rl.gae` (no Python loop over time; no gradient, as in torchtune's recipe, which
calls it under ``torch.no_grad``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _validation as V
from ..advantages import gae
from ..values import ppo_loss
from .trl import _check_index_range, _checked_logprobs, _gather_logprobs


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """The promoted dtype of ``tensors`` (the default float dtype for integer inputs)."""
    out = tensors[0].dtype
    for t in tensors[1:]:
        out = torch.promote_types(out, t.dtype)
    return out if out.is_floating_point else torch.get_default_dtype()


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mirrors ``torchtune.rlhf.masked_mean``.

    ``(x * mask).sum(dim) / (mask.sum(dim) + 1e-8)``: an all-False mask (or row) gives 0.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> rlhf.masked_mean(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([True, True, False]))
        tensor(1.5000)
    """
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def masked_var(centered_values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Mirrors ``torchtune.rlhf.masked_var``.

    ``masked_mean(centered_values ** 2, mask)``, times ``n / (n - 1)`` with
    ``n = mask.sum() + 1e-8`` when ``unbiased``. The input must already be centred.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0])
        >>> mask = torch.tensor([True, True, True, False])
        >>> rlhf.masked_var(x - rlhf.masked_mean(x, mask), mask)
        tensor(1.)
    """
    var = masked_mean(centered_values.pow(2), mask)
    if unbiased:
        count = mask.sum() + 1e-8
        var = var * (count / (count - 1))
    return var


def whiten(x: Tensor, mask: Tensor | None = None, shift_mean: bool = True) -> Tensor:
    """Mirrors ``torchtune.rlhf.whiten``.

    ``(x - mean) * rsqrt(var + 1e-8)``, then ``+ mean`` when ``shift_mean`` (the default):
    torchtune's convention, inverted relative to TRL / verl. Without a mask the mean and the
    unbiased variance are plain ``x.mean()`` / ``x.var()``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> rlhf.whiten(torch.tensor([1.0, 2.0, 3.0]))  # mean 2 added back
        tensor([1., 2., 3.])
    """
    if mask is not None:
        mean = masked_mean(x, mask)
        var = masked_var(x - mean, mask)
    else:
        mean, var = x.mean(), x.var()
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if shift_mean:
        whitened = whitened + mean
    return whitened


def estimate_advantages(
    values: Tensor,
    rewards: Tensor,
    gamma: float,
    lmbda: float,
    masks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``torchtune.rlhf.estimate_advantages``.

    GAE ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V_L = 0``), ``A_t = delta_t + gamma lmbda
    A_{t+1}`` over the whole row (the mask does not enter the recursion), ``returns = A +
    values``, then ``advantages = whiten(A, mask=masks)`` (mean added back) and zeroed where
    ``masks`` is False.

    Args:
        values, rewards: ``(b, L)`` tensors (integer tensors are accepted, as in torchtune).
        gamma, lmbda: numbers in ``[0, 1]``.
        masks: optional ``(b, L)`` bool tensor, True at valid tokens.

    Returns:
        ``(advantages, returns)``, ``(b, L)`` each. ``advantages`` carry no gradient;
        ``returns = A + values`` carries the gradient of ``values`` only (torchtune's recipe
        calls this under ``torch.no_grad()``, where neither does).

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> v = r = torch.tensor([[0, 0, 0, 1]])
        >>> adv, ret = rlhf.estimate_advantages(v, r, gamma=0.9, lmbda=0.95)
        >>> [round(x, 4) for x in ret[0].tolist()]  # [g^3 l^2, g^2 l, g, 1]
        [0.6579, 0.7695, 0.9, 1.0]
    """
    dtype = _float_dtype(values, rewards)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    adv, _ = gae(rewards.to(acc), values.to(acc), gamma=gamma, lam=lmbda)
    adv = adv.to(dtype)
    returns = adv + values
    advantages = whiten(adv, mask=masks)
    if masks is not None:
        advantages = advantages.masked_fill(~masks.bool(), 0.0)
    return advantages, returns


def get_rewards_ppo(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    kl_coeff: float,
    valid_score_idxs: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Mirrors ``torchtune.rlhf.get_rewards_ppo``.

    ``kl = logprobs - ref_logprobs``, ``kl_reward = -kl_coeff * kl`` and ``total_reward =
    kl_reward`` plus ``scores[b]`` at ``valid_score_idxs[b]`` (at the last position when
    None).

    Returns:
        ``(total_reward, kl, kl_reward)``, each ``(b, L)``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> lp = torch.full((1, 3), -1.0)
        >>> total, kl, _ = rlhf.get_rewards_ppo(torch.tensor([1.0]), lp, lp - 0.1, 0.5)
        >>> [round(x, 4) for x in total[0].tolist()]
        [-0.05, -0.05, 0.95]
    """
    kl = logprobs - ref_logprobs
    kl_reward = -kl_coeff * kl
    total_reward = kl_reward.clone()
    if valid_score_idxs is not None:
        total_reward.scatter_add_(1, valid_score_idxs.unsqueeze(-1), scores.unsqueeze(-1))
    else:
        total_reward[:, -1] += scores
    return total_reward, kl, kl_reward


def logits_to_logprobs(logits: Tensor, sequences: Tensor, temperature: float = 1.0) -> Tensor:
    """Mirrors ``torchtune.rlhf.logits_to_logprobs``.

    ``log_softmax(logits / temperature)`` gathered at ``sequences``, fused.

    Args:
        logits: ``(b, L, V)`` float logits, any strides (``logits[:, ctx - 1:-1]`` is read
            in place).
        sequences: ``(b, L)`` int64/int32 token ids in ``[0, V)``.
        temperature: ``> 0``.

    Returns:
        ``(b, L)`` log-probs in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> rlhf.logits_to_logprobs(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long))
        tensor([[-1.3863, -1.3863]])
    """
    return _gather_logprobs(
        logits,
        sequences,
        temperature=temperature,
        name="sequences",
        original="torchtune's logits_to_logprobs",
    )


def batched_logits_to_logprobs(
    logits: Tensor, sequences: Tensor, temperature: float = 1.0, chunk_size: int = 4
) -> Tensor:
    """Mirrors ``torchtune.rlhf.batched_logits_to_logprobs``.

    :func:`logits_to_logprobs`, but always fp32 (torchtune writes the chunks into an fp32
    buffer); ``chunk_size`` is accepted and has no effect (one fused pass).

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> ids = torch.zeros(3, 2, dtype=torch.long)
        >>> rlhf.batched_logits_to_logprobs(torch.zeros(3, 2, 4, dtype=torch.bfloat16), ids).dtype
        torch.float32
    """
    V.check_logits(logits, "logits")
    V.check_targets(sequences, logits, "sequences")
    original = "torchtune's batched_logits_to_logprobs"
    _check_index_range(sequences, logits.shape[-1], "sequences", original)
    logp = _checked_logprobs(logits, sequences, temperature=temperature)
    return logp.to(torch.float32)


class PPOLoss(nn.Module):
    """Mirrors ``torchtune.rlhf.loss.PPOLoss`` (clipped policy surrogate + clipped value loss).

    Same constructor (module defaults ``epsilon=0.1``, ``value_clip_range=0.2``,
    ``value_coeff=0.1``; torchtune's configs use ``epsilon=0.2``), same ``forward`` arguments,
    same 5-tuple. Runs :func:`fused_rl.ppo_loss`: the masked means carry torchtune's
    ``+ 1e-8``; masked-out positions contribute exactly 0 even when they hold inf / NaN;
    the gradient flows to ``pi_logprobs`` and ``phi_values`` only (the other inputs are
    rollout constants in torchtune's recipe).

    Example:
        >>> import torch
        >>> from fused_rl.compat.torchtune import PPOLoss
        >>> lp = torch.zeros(2, 3, requires_grad=True)
        >>> v = torch.zeros(2, 3, requires_grad=True)
        >>> out = PPOLoss()(torch.zeros(2, 3), lp, torch.ones(2, 3), torch.zeros(2, 3), v,
        ...                 torch.ones(2, 3))
        >>> out[0].backward(); [round(x.item(), 4) for x in out]
        [-0.95, -1.0, 0.5, 1.0, 0.0]
    """

    def __init__(
        self, epsilon: float = 0.1, value_clip_range: float = 0.2, value_coeff: float = 0.1
    ):
        super().__init__()
        self.epsilon = epsilon
        self.value_clip_range = value_clip_range
        self.value_coeff = value_coeff

    def forward(
        self,
        pi_old_logprobs: Tensor,
        pi_logprobs: Tensor,
        advantages: Tensor,
        phi_old_values: Tensor,
        phi_values: Tensor,
        returns: Tensor,
        padding_masks: Tensor | None = None,
        value_padding_masks: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``(loss, policy_loss, value_loss, ratios.mean(), clipfrac)``, 0-dim tensors; only
        ``loss`` is differentiable. Inputs ``(b, L)``; masks True where valid."""
        loss, policy, value, ratios, clipfrac = ppo_loss(
            pi_old_logprobs,
            pi_logprobs,
            advantages,
            phi_old_values,
            phi_values,
            returns,
            padding_masks,
            value_padding_masks,
            epsilon=self.epsilon,
            value_clip_range=self.value_clip_range,
            value_coeff=self.value_coeff,
        )
        # the dtypes torchtune's eager chain ends in (the values are fp32-accurate here)
        policy_dtype = _reduced_dtype(
            _float_dtype(pi_old_logprobs, pi_logprobs, advantages), padding_masks
        )
        value_dtype = _reduced_dtype(
            _float_dtype(phi_old_values, phi_values, returns), value_padding_masks
        )
        return (
            loss.to(torch.promote_types(policy_dtype, value_dtype)),
            policy.to(policy_dtype),
            value.to(value_dtype),
            ratios.to(_float_dtype(pi_old_logprobs, pi_logprobs)),
            clipfrac.to(_reduced_dtype(torch.float32, padding_masks)),  # ``.float()`` first
        )


def _reduced_dtype(dtype: torch.dtype, mask: Tensor | None) -> torch.dtype:
    """dtype of torchtune's ``x.mean()`` (mask None) or ``masked_mean(x, mask)`` for ``x`` of
    ``dtype``: ``(x * mask).sum() / (mask.sum() + 1e-8)`` promotes two 0-dim tensors, so a
    bf16 ``x`` with a bool mask comes out in the default float dtype (fp32)."""
    if mask is None:
        return dtype
    numerator = torch.promote_types(dtype, mask.dtype)
    count = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    return torch.promote_types(numerator, count)
