"""Drop-in replacements for torchtune's RLHF (PPO) utilities, fused.

Change ``from torchtune import rlhf`` / ``from torchtune.rlhf.loss import PPOLoss`` to
``from fused_rl.compat import torchtune as rlhf`` / ``from fused_rl.compat.torchtune import
PPOLoss``. torchtune is not imported (nor needed).

Mirrors torchtune 0.6.1 (the current release) and main at ``bd2a0fc7c314`` (2026), which agree
on every function here except two that exist on main only: :func:`masked_sum` and
:func:`batched_logits_to_logprobs`. Files: ``torchtune/rlhf/loss/ppo.py``,
``torchtune/rlhf/rewards.py``, ``torchtune/rlhf/sequence_processing.py``. Quirks included:

* ``masked_mean`` divides by ``mask.sum() + 1e-8`` (an empty mask gives 0, not NaN);
* ``masked_var`` expects CENTRED input and applies Bessel's correction with the global mask
  count (one valid element gives NaN);
* ``whiten(..., shift_mean=True)`` (the default) ADDS the mean back after scaling, the
  opposite of TRL's / verl's ``masked_whiten``;
* ``estimate_advantages`` computes ``returns = A + values`` before whitening and zeroes the
  advantages outside ``masks``; the GAE recursion ignores the mask;
* ``PPOLoss``: ``clipfrac`` = "the clipped branch is strictly larger", ``ratios.mean()`` is
  unmasked, the value clip is ``clamp(v, v_old - c, v_old + c)``, only ``loss`` has a graph.

Output dtypes are torchtune's, each rule checked against 0.6.1 and main by the live check
(docs/compat.md): ``PPOLoss``'s ``clipfrac`` is cast to ``pi_logprobs.dtype`` before its
(masked) mean, so fp64 inputs give fp64, bf16 ones bf16 without a mask and fp32 with a bool
mask (``masked_mean`` divides by ``mask.sum() + 1e-8``, an fp32 0-dim tensor); every masked
mean follows that rule; ``batched_logits_to_logprobs`` is always fp32; integer ``values`` /
``rewards`` count as fp32 in ``estimate_advantages``.

Fused: :func:`logits_to_logprobs` / :func:`batched_logits_to_logprobs` stream the logits
through :func:`fused_rl.token_logprobs` (the temperature division happens in fp32 inside the
kernel; ``temperature <= 0`` raises ``ValueError``: torchtune gives NaN for 0);
:class:`PPOLoss` runs :func:`fused_rl.ppo_loss` (one launch forward, one backward);
:func:`estimate_advantages` runs :func:`fused_rl.gae` (no Python loop over time), with a
backward through the same kernel, so ``returns`` and ``advantages`` carry torchtune's gradient
when called with grad enabled (torchtune's recipe calls it under ``torch.no_grad``).
:func:`masked_mean`, :func:`masked_sum`, :func:`masked_var`, :func:`whiten` and
:func:`get_rewards_ppo` are torchtune's own eager expressions: bit-identical results in every
dtype.

Half precision (``fused_rl.compat.half_precision``): by default (``"accurate"``) the fused
functions compute in fp32 and round each output once to torchtune's dtype;
``half_precision("original")`` runs torchtune's own fp16 / bf16 arithmetic for fp16 / bf16
inputs (the same ops in the same order), bit for bit.

Differences from torchtune, all deliberate (docs/compat.md):

* ``PPOLoss``: positions where a mask is False contribute exactly 0 even if they hold inf /
  NaN (torchtune's ``x * mask`` turns them into NaN); ``epsilon`` / ``value_clip_range`` /
  ``value_coeff`` must be ``>= 0``.
* token ids outside ``[0, V)`` raise ``ValueError`` (torchtune's ``gather`` raises
  ``RuntimeError``, or reads garbage on a GPU).
* ``estimate_advantages`` accepts a float 0/1 ``masks`` (torchtune's ``~masks`` needs bool).
* Not mirrored (no loss math here; import them from torchtune):
  ``truncate_sequence_at_first_stop_token``, ``truncate_sequence_for_logprobs``,
  ``get_reward_penalty_mask``, ``get_batch_log_probs``, ``DPOLoss`` / ``RSOLoss`` and the
  ``Trajectory`` / ``PPOStats`` / ``ChosenRejectedOutputs`` types.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from .. import _validation as V
from ..advantages import gae
from ..values import ppo_loss
from ._checks import check_index_range, checked_logprobs, gather_logprobs
from ._precision import original_half_precision

__all__ = [
    "PPOLoss",
    "batched_logits_to_logprobs",
    "estimate_advantages",
    "get_rewards_ppo",
    "logits_to_logprobs",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "whiten",
]


def _as_float(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype.is_floating_point else torch.get_default_dtype()


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    """The promoted dtype of ``tensors``, an integer tensor counting as the default float dtype
    (torchtune's ``gamma * values`` turns integer values into fp32 before they meet bf16)."""
    out = _as_float(tensors[0].dtype)
    for t in tensors[1:]:
        out = torch.promote_types(out, _as_float(t.dtype))
    return out


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype fused_rl computes in for outputs of ``dtype``: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- rewards


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mirrors ``torchtune.rlhf.masked_mean``.

    ``(x * mask).sum(dim) / (mask.sum(dim) + 1e-8)``: an all-False mask (or row) gives 0.
    torchtune's expression, so the same values and dtype (bf16 ``x`` with a bool mask: an fp32
    result, from the fp32 denominator).

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> rlhf.masked_mean(torch.tensor([1.0, 2.0, 6.0]), torch.tensor([True, True, False]))
        tensor(1.5000)
    """
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mirrors ``torchtune.rlhf.masked_sum`` (torchtune main; not in 0.6.1).

    ``(x * mask).sum(dim)``, in the dtype ``x * mask`` promotes to.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
        >>> rlhf.masked_sum(x, torch.tensor([[True, False], [True, True]]), dim=1)
        tensor([1., 7.])
    """
    return (x * mask).sum(dim=dim)


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


class _GAE(torch.autograd.Function):
    """GAE advantages ``A = GAE(rewards, values)`` with a backward. ``A`` is linear in both:
    ``A_t = sum_{k >= t} (gamma lmbda)^(k-t) delta_k``, ``delta_k = r_k + gamma v_{k+1} - v_k``,
    so ``dL/ddelta_k = sum_{t <= k} (gamma lmbda)^(k-t) g_t`` is the same recursion run forward
    in time: the GAE kernel on the time-reversed upstream gradient (values 0, decay
    ``gamma * lmbda``)."""

    @staticmethod
    def forward(ctx, rewards: Tensor, values: Tensor, gamma: float, lmbda: float) -> Tensor:
        ctx.gamma, ctx.lmbda = gamma, lmbda
        ctx.dtypes = (rewards.dtype, values.dtype)
        return gae(rewards, values, gamma=gamma, lam=lmbda)[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        reversed_grad = grad.flip(1)
        g_delta, _ = gae(
            reversed_grad, torch.zeros_like(reversed_grad), gamma=ctx.gamma * ctx.lmbda, lam=1.0
        )
        g_delta = g_delta.flip(1)
        g_values = -g_delta
        g_values[:, 1:] += ctx.gamma * g_delta[:, :-1]
        return g_delta.to(ctx.dtypes[0]), g_values.to(ctx.dtypes[1]), None, None


def _gae_loop(values: Tensor, rewards: Tensor, gamma: float, lmbda: float) -> Tensor:
    """torchtune's GAE loop, op for op (``"original"`` mode): the reverse recursion over time
    in the inputs' own dtypes."""
    length = values.shape[-1]
    last = 0
    reversed_adv = []
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lmbda * last
        reversed_adv.append(last)
    return torch.stack(reversed_adv[::-1], dim=1)


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
        masks: optional ``(b, L)`` bool (or 0/1) tensor, True at valid tokens.

    Returns:
        ``(advantages, returns)``, ``(b, L)`` each, in the promoted dtype of the inputs (an
        integer tensor counting as fp32). Differentiable w.r.t. ``values`` and ``rewards``,
        as torchtune's are (its recipe calls this under ``torch.no_grad()``, where neither
        carries a graph and nothing is saved).

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> v = r = torch.tensor([[0, 0, 0, 1]])
        >>> adv, ret = rlhf.estimate_advantages(v, r, gamma=0.9, lmbda=0.95)
        >>> [round(x, 4) for x in ret[0].tolist()]  # [g^3 l^2, g^2 l, g, 1]
        [0.6579, 0.7695, 0.9, 1.0]
    """
    V.check_tensor(values, "values")
    V.check_tensor(rewards, "rewards")
    V.check_unit_interval(gamma, "gamma")
    V.check_unit_interval(lmbda, "lmbda")
    dtype = _float_dtype(values, rewards)
    if original_half_precision(values, rewards):
        adv = _gae_loop(values, rewards, gamma, lmbda)
        returns = adv + values
        advantages = whiten(adv, mask=masks)
    else:
        acc = _acc(dtype)
        values_a, rewards_a = values.to(acc), rewards.to(acc)
        if torch.is_grad_enabled() and (values.requires_grad or rewards.requires_grad):
            adv = _GAE.apply(rewards_a, values_a, float(gamma), float(lmbda))
        else:
            adv = gae(rewards_a, values_a, gamma=gamma, lam=lmbda)[0]
        returns = (adv + values_a).to(dtype)
        advantages = whiten(adv, mask=masks).to(dtype)
    if masks is not None:
        advantages = advantages.masked_fill(masks == 0, 0.0)
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
    None). torchtune's expressions: the same values and dtypes.

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


# ----------------------------------------------------------------------------- sequence_processing


def _eager_logprobs(logits: Tensor, sequences: Tensor, temperature: float) -> Tensor:
    """torchtune's ``gather(log_softmax(logits / temperature), 2, ...)`` in the logits' dtype
    (``"original"`` mode)."""
    return torch.gather(
        F.log_softmax(logits / temperature, dim=-1), 2, sequences.long().unsqueeze(-1)
    ).squeeze(-1)


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
    original = "torchtune's logits_to_logprobs"
    if original_half_precision(logits):
        V.check_logits(logits)
        V.check_targets(sequences, logits, "sequences")
        V.check_positive(temperature, "temperature")
        check_index_range(sequences, logits.shape[-1], "sequences", original)
        return _eager_logprobs(logits, sequences, temperature)
    return gather_logprobs(
        logits, sequences, temperature=temperature, name="sequences", original=original
    )


def batched_logits_to_logprobs(
    logits: Tensor, sequences: Tensor, temperature: float = 1.0, chunk_size: int = 4
) -> Tensor:
    """Mirrors ``torchtune.rlhf.batched_logits_to_logprobs`` (torchtune main; not in 0.6.1).

    :func:`logits_to_logprobs`, but always fp32 (torchtune writes the chunks into an fp32
    buffer, so fp64 logits come back rounded to fp32 too); ``chunk_size`` (an int ``>= 1``)
    sets torchtune's chunking only under ``half_precision("original")``: one fused pass
    otherwise.

    Example:
        >>> import torch
        >>> from fused_rl.compat import torchtune as rlhf
        >>> ids = torch.zeros(3, 2, dtype=torch.long)
        >>> rlhf.batched_logits_to_logprobs(torch.zeros(3, 2, 4, dtype=torch.bfloat16), ids).dtype
        torch.float32
    """
    V.check_logits(logits, "logits")
    V.check_targets(sequences, logits, "sequences")
    V.check_positive(temperature, "temperature")
    V.check_positive_int(chunk_size, "chunk_size")
    original = "torchtune's batched_logits_to_logprobs"
    check_index_range(sequences, logits.shape[-1], "sequences", original)
    if original_half_precision(logits):
        parts = [
            _eager_logprobs(z, s, temperature).to(torch.float32)
            for z, s in zip(logits.split(chunk_size), sequences.split(chunk_size), strict=True)
        ]
        return torch.cat(parts) if parts else logits.new_empty(sequences.shape, dtype=torch.float32)
    logp = checked_logprobs(logits, sequences, temperature=temperature)
    return logp.to(torch.float32)


# ----------------------------------------------------------------------------- loss/ppo


def _reduced_dtype(dtype: torch.dtype, mask: Tensor | None) -> torch.dtype:
    """dtype of torchtune's ``x.mean()`` (mask None) or ``masked_mean(x, mask)`` for ``x`` of
    ``dtype``: ``(x * mask).sum() / (mask.sum() + 1e-8)`` promotes two 0-dim tensors, so a
    bf16 ``x`` with a bool mask comes out in the default float dtype (fp32)."""
    if mask is None:
        return dtype
    numerator = torch.promote_types(dtype, mask.dtype)
    count = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    return torch.promote_types(numerator, count)


def _ppo_dtypes(inputs: tuple[Tensor, ...], pm: Tensor | None, vm: Tensor | None) -> list:
    """The dtypes of torchtune's ``(loss, policy_loss, value_loss, ratios.mean(), clipfrac)``."""
    old, new, adv, v_old, v, ret = inputs
    policy = _reduced_dtype(_float_dtype(old, new, adv), pm)
    value = _reduced_dtype(_float_dtype(v_old, v, ret), vm)
    clipfrac = _reduced_dtype(new.dtype, pm)  # ``.to(pi_logprobs.dtype)`` before the mean
    return [torch.promote_types(policy, value), policy, value, _float_dtype(old, new), clipfrac]


def _masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """torchtune's ``x.mean()`` / ``masked_mean(x, mask)`` for an ``x`` whose masked-out
    entries are already 0 (so ``x * mask`` is ``x`` for a bool mask)."""
    if mask is None:
        return x.mean()
    kept = x if mask.dtype == torch.bool else x * mask
    return kept.sum() / (mask.sum() + 1e-8)


def _zero_unmasked(mask: Tensor | None, *tensors: Tensor) -> tuple[Tensor, ...]:
    """``tensors`` with the entries ``mask`` excludes replaced by 0 (a ``where``, whose
    backward gives the replaced entries exactly 0): inf / NaN there never reach the loss nor
    any gradient. Counted entries are untouched, so the sums equal torchtune's."""
    if mask is None:
        return tensors
    keep = mask != 0
    return tuple(torch.where(keep, t, 0.0) for t in tensors)


def _ppo_eager(inputs, pm, vm, epsilon, value_clip_range, value_coeff, upcast):
    """torchtune's ``PPOLoss.forward`` in eager PyTorch: in the inputs' dtypes (``"original"``
    mode), or in fp32 / fp64 (``upcast``; the caller rounds each output once)."""
    if upcast:
        acc = _acc(_float_dtype(*inputs))
        inputs = tuple(t.to(acc) for t in inputs)
    ratios_mean = torch.exp(inputs[1] - inputs[0]).mean()  # unmasked, as in torchtune
    old, new, adv = _zero_unmasked(pm, *inputs[:3])
    v_old, v, ret = _zero_unmasked(vm, *inputs[3:])
    ratios = torch.exp(new - old)
    clipped_ratios = torch.clamp(ratios, 1.0 - epsilon, 1.0 + epsilon)
    losses_clipped = -adv * clipped_ratios
    losses_unclipped = -adv * ratios
    clipfrac = _masked_mean((losses_clipped > losses_unclipped).to(new.dtype), pm)
    policy_loss = _masked_mean(torch.maximum(losses_clipped, losses_unclipped), pm)
    values_clipped = torch.clamp(v, v_old - value_clip_range, v_old + value_clip_range)
    value_loss = torch.maximum((v - ret) ** 2, (values_clipped - ret) ** 2)
    value_loss = 0.5 * _masked_mean(value_loss, vm)
    loss = policy_loss + value_loss * value_coeff
    return (
        loss,
        policy_loss.detach(),
        value_loss.detach(),
        ratios_mean.detach(),
        clipfrac.detach(),
    )


def _fp64_with_half_grads(inputs: tuple[Tensor, ...]) -> bool:
    """An fp64 input (the kernel computes in fp64) with an fp16 / bf16 ``pi_logprobs`` or
    ``phi_values``. The kernel would store fp64 values into fp16 / bf16 gradient buffers,
    which the Triton interpreter (3.9) converts by bits, not by value: this rare mix runs the
    eager path."""
    return any(t.dtype == torch.float64 for t in inputs) and any(
        inputs[i].dtype in (torch.float16, torch.bfloat16) for i in (1, 4)
    )


class PPOLoss(nn.Module):
    """Mirrors ``torchtune.rlhf.loss.PPOLoss`` (clipped policy surrogate + clipped value loss).

    Same constructor (module defaults ``epsilon=0.1``, ``value_clip_range=0.2``,
    ``value_coeff=0.1``; torchtune's configs use ``epsilon=0.2``), same ``forward`` arguments,
    same 5-tuple in torchtune's dtypes. Runs :func:`fused_rl.ppo_loss`: the masked means carry
    torchtune's ``+ 1e-8``; masked-out positions contribute exactly 0 even when they hold
    inf / NaN. The gradient flows to ``pi_logprobs`` and ``phi_values``; when another input
    requires grad (torchtune differentiates through every input) or the inputs do not share
    one shape (torchtune broadcasts), the same math runs eagerly in fp32 instead, with the
    same results and torchtune's gradients.

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
        inputs = (pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns)
        names = ("pi_old_logprobs", "pi_logprobs", "advantages", "phi_old_values",
                 "phi_values", "returns")  # fmt: skip
        for name, t in zip(names, inputs, strict=True):
            V.check_float(t, name)
        V.check_mask_dtype(padding_masks, "padding_masks")
        V.check_mask_dtype(value_padding_masks, "value_padding_masks")
        V.check_nonnegative(self.epsilon, "epsilon")
        V.check_nonnegative(self.value_clip_range, "value_clip_range")
        V.check_nonnegative(self.value_coeff, "value_coeff")
        hyper = (float(self.epsilon), float(self.value_clip_range), float(self.value_coeff))
        masks = (padding_masks, value_padding_masks)
        if original_half_precision(*inputs):
            return _ppo_eager(inputs, *masks, *hyper, upcast=False)
        dtypes = _ppo_dtypes(inputs, *masks)
        constants = (pi_old_logprobs, advantages, phi_old_values, returns)
        shapes = [t.shape for t in (*inputs, *masks) if t is not None]
        eager = (
            any(shape != pi_logprobs.shape for shape in shapes)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in constants))
            or _fp64_with_half_grads(inputs)
        )
        out = None
        if not eager:
            try:
                out = ppo_loss(
                    *inputs, *masks, epsilon=hyper[0], value_clip_range=hyper[1],
                    value_coeff=hyper[2],
                )  # fmt: skip
            except V.NegativeMaskWeightError:
                pass  # torchtune weighs by a negative mask value too: its math, eagerly
        if out is None:
            out = _ppo_eager(inputs, *masks, *hyper, upcast=True)
        return tuple(t.to(dtype) for t, dtype in zip(out, dtypes, strict=True))
