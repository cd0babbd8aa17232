"""Drop-in replacements for the verl functions an actor / critic update calls, fused where
the vocabulary is involved.

Change ``import verl.utils.torch_functional as verl_F`` and
``from verl.trainer.ppo import core_algos`` to ``from fused_rl.compat import verl as verl_F``
and ``from fused_rl.compat import verl as core_algos``. verl is not imported (nor needed).

Signatures, defaults, return tuples and numerics mirror verl's v0.5 line (2025:
``verl/trainer/ppo/core_algos.py`` at commit ``012be9d9`` and the matching
``verl/utils/torch_functional.py``):
the deprecated-but-kept ``compute_policy_loss`` with explicit clip ranges and the
``clip_ratio_c = 3.0`` dual clip, ``agg_loss`` with its four modes (``seq-mean-token-sum-norm``
divides by the response length only, not by the batch size), the NaN-safe ``masked_sum``,
``masked_mean`` with ``+ 1e-8``, ``masked_var`` raising on a mask count of 0 or 1,
``masked_whiten`` returning zero mean by default, ``kl_penalty`` with ``k3`` =
``low_var_kl`` (clamped), GAE that skips masked (observation) tokens, and GRPO's per-group
``(s - mean) / (std + eps)`` where a group of one counts as mean 0, std 1. Labels outside
``[0, V)`` raise ``ValueError`` (verl's ``gather`` raises ``RuntimeError``).

Fused: :func:`logprobs_from_logits`, :func:`entropy_from_logits` and
:func:`compute_entropy_loss` stream the logits through :func:`fused_rl.token_logprobs` /
:func:`fused_rl.token_entropy` (no ``(..., V)`` temporary; fp32 math, cast to the logits'
dtype as verl does). :func:`compute_gae_advantage_return` runs :func:`fused_rl.gae` (no loop
over time). The rest is O(B*T) PyTorch on per-token tensors, as in verl.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .. import _validation as V
from ..advantages import gae
from ..kl import kl_estimate
from ..logprobs import token_entropy
from .trl import _gather_logprobs

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# verl's names for the KL estimators -> fused_rl's (``fused_rl.kl_estimate``)
_KL_NAMES = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}


# ----------------------------------------------------------------------------- torch_functional


def logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.logprobs_from_logits``.

    ``log_softmax(logits, -1)`` gathered at ``labels``, fused.

    Args:
        logits: ``(..., V)`` float logits, any strides (``logits[:, -L - 1:-1]`` is not copied).
        labels: ``(...)`` int64/int32 ids in ``[0, V)`` (out of range raises ``ValueError``).
        inplace_backward: accepted for compatibility; the fused backward writes one fresh
            gradient and never keeps a ``(..., V)`` activation.

    Returns:
        ``labels.shape`` log-probs in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> labels = torch.zeros(2, 3, dtype=torch.long)
        >>> verl_F.logprobs_from_logits(torch.zeros(2, 3, 4), labels)[0]
        tensor([-1.3863, -1.3863, -1.3863])
    """
    return _gather_logprobs(
        logits, labels, temperature=1.0, name="labels", original="verl's logprobs_from_logits"
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.entropy_from_logits``.

    Entropy of ``softmax(logits)`` per position (``logsumexp - sum p z``), fused.

    Args:
        logits: ``(..., V)`` float logits, any strides.

    Returns:
        ``logits.shape[:-1]`` tensor in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.entropy_from_logits(torch.zeros(1, 2))
        tensor([0.6931])
    """
    V.check_logits(logits, "logits")
    return token_entropy(logits).to(logits.dtype)


def masked_sum(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_sum``.

    ``sum(values * mask)`` where values outside the mask (even NaN) count as 0.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_sum(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0]))
        tensor(1.)
    """
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (kept * mask).sum(axis=axis)


def masked_mean(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_mean``.

    ``masked_sum / (mask.sum() + 1e-8)``: an empty mask gives 0.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([1, 1, 0]))
        tensor(2.)
    """
    return masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_var``.

    Masked variance about the masked mean; ``unbiased`` applies Bessel's correction with the
    mask count and raises ``ValueError`` when that count is 0 or 1 (one host sync, as verl).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_var(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
    """
    centred = values - masked_mean(values, mask)
    variance = masked_mean(centred**2, mask)
    if unbiased:
        count = mask.sum()
        if count == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if count == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_whiten``.

    ``(values - mean) * rsqrt(var + 1e-8)`` with masked mean / unbiased variance; the default
    ``shift_mean=True`` gives zero mean, ``False`` adds the mean back (TRL's convention, the
    opposite of torchtune's ``whiten``).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
        tensor([-1.,  0.,  1.])
    """
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ----------------------------------------------------------------------------- core_algos


def agg_loss(loss_mat: Tensor, loss_mask: Tensor, loss_agg_mode: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.agg_loss``.

    * ``token-mean``: :func:`masked_mean` over all tokens (``+ 1e-8``);
    * ``seq-mean-token-sum``: mean over sequences of the masked token sum;
    * ``seq-mean-token-mean``: mean over sequences of ``sum / mask.sum(-1)`` (a sequence with
      no valid token gives NaN, as in verl);
    * ``seq-mean-token-sum-norm``: ``sum of all masked tokens / loss_mask.shape[-1]``
      (verl's Dr. GRPO form: divided by the response length, not by the batch size).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> loss = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
        >>> core_algos.agg_loss(loss, torch.tensor([[1, 0], [1, 1]]), "seq-mean-token-mean")
        tensor(2.5000)
    """
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, loss_mask)
    per_seq = (loss_mat * loss_mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return per_seq.mean()
    if loss_agg_mode == "seq-mean-token-mean":
        return (per_seq / loss_mask.sum(dim=-1)).mean()
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return per_seq.sum() / loss_mask.shape[-1]
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")


def compute_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss`` (vanilla PPO, dual clip).

    Per token: ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``L = max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high))``, and where ``A < 0``
    additionally ``min(L, -A clip_ratio_c)``; aggregated by :func:`agg_loss`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        cliprange: symmetric clip range, the default of ``cliprange_low`` / ``cliprange_high``.
        clip_ratio_c: dual-clip constant, must be ``> 1`` (``AssertionError`` otherwise).
        loss_agg_mode: see :func:`agg_loss`.

    Returns:
        ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the loss (differentiable
        w.r.t. ``log_prob``), the masked fraction where the clipped branch is strictly larger,
        the masked mean of ``old - new`` (clamped), and the masked fraction where the dual
        clip bound is active.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> old = torch.full((1, 3), -1.0)
        >>> new = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
        >>> out = core_algos.compute_policy_loss(old, new, torch.ones(1, 3), torch.ones(1, 3),
        ...                                      cliprange=0.2)
        >>> out[0].backward(); [round(v.item(), 4) for v in out]
        [-0.9355, 0.3333, 0.0, 0.0]
    """
    assert clip_ratio_c > 1.0, (
        "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
        + f" but get the value: {clip_ratio_c}."
    )
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean(
        torch.gt(loss_ppo, dual_bound) * negative.float(), response_mask
    )
    per_token = torch.where(negative, torch.min(dual_bound, loss_ppo), loss_ppo)
    pg_loss = agg_loss(per_token, response_mask, loss_agg_mode)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_value_loss`` (clipped value loss).

    ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))`` with verl's
    ``clip_by_value`` (``max(min(v, old + c), old - c)``).

    Returns:
        ``(vf_loss, vf_clipfrac)``: the loss (differentiable w.r.t. ``vpreds``) and the masked
        fraction where the clipped error is strictly larger.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> v = torch.tensor([[1.0, 0.0]])
        >>> loss, frac = core_algos.compute_value_loss(v, torch.ones(1, 2), torch.zeros(1, 2),
        ...                                             torch.ones(1, 2), 0.5)
        >>> loss.item(), frac.item()
        (0.3125, 0.5)
    """
    clipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.max(err_unclipped, err_clipped), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean(torch.gt(err_clipped, err_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"
) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_entropy_loss``.

    :func:`agg_loss` of the per-token entropy of ``(B, T, V)`` logits, fused (differentiable).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.compute_entropy_loss(torch.zeros(1, 2, 4), torch.ones(1, 2))
        tensor(1.3863)
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.kl_penalty``.

    Per-token KL estimate with ``d = logprob - ref_logprob``: ``"kl"``/``"k1"`` ``d``,
    ``"abs"`` ``|d|``, ``"mse"``/``"k2"`` ``d^2 / 2``, ``"low_var_kl"``/``"k3"``
    ``exp(-d) + d - 1`` with ``-d`` clamped to ``[-20, 20]`` and the result to ``[-10, 10]``.
    ``"full"`` and unknown names raise ``NotImplementedError``, as in verl. Fused
    (:func:`fused_rl.kl_estimate`), differentiable w.r.t. both inputs.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.kl_penalty(torch.tensor([0.5]), torch.tensor([0.0]), "k2")
        tensor([0.1250])
    """
    kind = _KL_NAMES.get(kl_penalty)
    if kind is None:
        raise NotImplementedError(f"kl_penalty {kl_penalty!r} is not implemented")
    out_dtype = torch.promote_types(logprob.dtype, ref_logprob.dtype)
    return kl_estimate(logprob, ref_logprob, kind=kind).to(out_dtype)


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``.

    GAE over the tokens where ``response_mask`` is set, skipping the others (verl's
    multi-turn form: a masked token passes the next valid token's value and advantage
    through), then ``returns = advantages + values`` and ``advantages`` whitened by
    :func:`masked_whiten` (zero masked mean; masked positions are not zeroed).

    Runs :func:`fused_rl.gae` on the valid tokens gathered to the front of each row: no
    Python loop over time. No gradient (verl runs it under ``torch.no_grad``).

    Args:
        token_level_rewards, values, response_mask: ``(B, T)``.
        gamma, lam: numbers in ``[0, 1]`` (0-dim tensors are accepted).

    Returns:
        ``(advantages, returns)``, ``(B, T)`` each.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> adv, ret = core_algos.compute_gae_advantage_return(
        ...     r, torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]]), 1.0, 1.0)
        >>> ret.tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    """
    with torch.no_grad():
        valid = response_mask.bool()
        length = valid.shape[-1]
        steps = torch.arange(length, device=valid.device)
        # valid tokens first, in order: GAE on them is verl's skip-the-masked recursion
        order = torch.argsort(torch.where(valid, steps, steps + length), dim=-1)
        n_valid = valid.sum(dim=-1, keepdim=True)
        dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        adv_packed, _ = gae(
            token_level_rewards.gather(-1, order).to(acc),
            values.gather(-1, order).to(acc),
            gamma=float(gamma),
            lam=float(lam),
            mask=steps < n_valid,
        )
        # a masked token carries the advantage of the next valid one (0 past the last):
        # its packed index is the number of valid tokens before it
        before = torch.cumsum(valid, dim=-1) - valid.long()
        advantages = adv_packed.gather(-1, before).to(dtype)
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config=None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage``.

    ``s = token_level_rewards.sum(-1)``; within each group of equal ``index`` (any hashable
    ids, e.g. verl's uid strings, in any order): ``(s - mean) / (std + epsilon)`` with the
    unbiased std (``s - mean`` when ``norm_adv_by_std_in_grpo=False``: Dr. GRPO); a group of
    one keeps ``s / (1 + epsilon)`` (verl's mean 0, std 1). Broadcast over the response by
    ``* response_mask``. Vectorised over groups (no Python loop over samples).

    Args:
        token_level_rewards, response_mask: ``(B, T)``.
        index: ``B`` group ids (numpy array, list or tensor).
        config: accepted for compatibility, unused (as in verl's GRPO estimator).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, as verl returns it.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
        >>> adv, _ = core_algos.compute_grpo_outcome_advantage(r, torch.ones(3, 2),
        ...                                                    ["a", "a", "b"])
        >>> [round(v, 4) for v in adv[:, 0].tolist()]
        [0.7071, -0.7071, 1.0]
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = index.tolist() if hasattr(index, "tolist") else list(index)
        if len(ids) != scores.shape[0]:
            raise ValueError(f"index must hold {scores.shape[0]} group ids, got {len(ids)}")
        groups: dict = {}
        group = torch.tensor([groups.setdefault(i, len(groups)) for i in ids], dtype=torch.long).to(
            scores.device
        )
        n_groups = len(groups)
        count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
        count.index_add_(0, group, torch.ones_like(scores))
        total = torch.zeros_like(count).index_add_(0, group, scores)
        mean = total / count
        centred = scores - mean[group]
        sq = torch.zeros_like(count).index_add_(0, group, centred**2)
        std = torch.sqrt(sq / (count - 1))
        single = count[group] == 1
        # verl: a singleton group has mean 0 and std 1
        centred = torch.where(single, scores, centred)
        if norm_adv_by_std_in_grpo:
            std_b = torch.where(single, torch.ones_like(scores), std[group])
            centred = centred / (std_b + epsilon)
        advantages = centred.unsqueeze(-1) * response_mask
    return advantages, advantages
