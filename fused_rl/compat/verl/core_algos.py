"""Mirrors ``verl.trainer.ppo.core_algos`` (verl 0.9.x): :func:`agg_loss`,
:func:`compute_policy_loss` (deprecated) and :func:`compute_policy_loss_vanilla`,
:func:`compute_value_loss`, :func:`compute_entropy_loss` (fused), :func:`kl_penalty` /
:func:`kl_penalty_forward` (fused), :func:`compute_gae_advantage_return` (fused, no loop over
time) and :func:`compute_grpo_outcome_advantage` (vectorised over groups).

``from verl.trainer.ppo import core_algos`` becomes
``from fused_rl.compat import verl as core_algos`` (the package has every name of this
module, and the policy-loss registry of :mod:`fused_rl.compat.verl.policy_loss`). verl v0.5's
variants are :mod:`fused_rl.compat.verl.legacy_v05`.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from ... import _validation as V
from ...advantages import gae
from ...kl import kl_estimate
from ...logprobs import token_entropy
from .._precision import original_half_precision
from ._accurate import _HALF, _fp32, _out_dtypes, _run
from ._precision_twins import _gae_loop, _grpo_loop, _kl_eager
from .torch_functional import (
    _masked_mean,
    _masked_sum,
    _masked_whiten,
    clip_by_value,
    entropy_from_logits,
)

__all__ = [
    "KL_PENALTIES",
    "LOSS_AGG_MODES",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "kl_penalty",
    "kl_penalty_forward",
]

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
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

KL_PENALTIES = (*_KL_NAMES, *(f"{name}+" for name in _KL_NAMES))

# verl v0.5's modes (:mod:`.legacy_v05`; ``_policy`` and ``_value`` take its aggregation)
LOSS_AGG_MODES_V05 = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


# ----------------------------------------------------------------------------- loss aggregation


def _agg(
    loss_mat,
    loss_mask,
    loss_agg_mode,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl 0.9's ``agg_loss``, op for op (the order fixes every rounding and dtype)."""
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = loss_mask.sum()
        return _masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return _masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        counts = torch.sum(loss_mask, dim=-1)
        per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            per_seq = per_seq / (counts + 1e-8)
        present = (counts > 0).float()  # fully masked sequences do not count
        if global_batch_size is None:
            if dp_size > 1:
                raise ValueError("global_batch_size is required when dp_size > 1")
            global_batch_size = present.sum()
        loss = _masked_sum(per_seq, present) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss /= loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return loss
    raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES})")


def _agg_v05(loss_mat, loss_mask, loss_agg_mode):
    """verl v0.5's ``agg_loss``, op for op."""
    if loss_agg_mode == "token-mean":
        return _masked_mean(loss_mat, loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES_V05:
        raise ValueError(
            f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES_V05})"
        )
    per_seq = torch.sum(loss_mat * loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return torch.mean(per_seq)
    if loss_agg_mode == "seq-mean-token-mean":
        return torch.mean(per_seq / torch.sum(loss_mask, dim=-1))
    return torch.sum(per_seq) / loss_mask.shape[-1]


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.agg_loss`` (verl 0.9.x).

    With ``S = masked_sum(loss_mat, loss_mask)`` and per-sequence sums ``s_b``:

    * ``token-mean``: ``S / batch_num_tokens * dp_size`` (``batch_num_tokens`` defaults to
      ``loss_mask.sum()``; no ``+ 1e-8``, so an all-masked batch gives NaN);
    * ``token-sum``: ``S * dp_size``;
    * ``seq-mean-token-sum``: ``sum_b s_b / global_batch_size * dp_size`` over the sequences
      with a valid token (``global_batch_size`` defaults to their number);
    * ``seq-mean-token-mean``: the same with ``s_b / (n_b + 1e-8)``;
    * ``seq-mean-token-sum-norm``: ``seq-mean-token-sum / loss_scale_factor`` (default:
      ``loss_mask.shape[-1]``, the response length).

    ``dp_size > 1`` needs ``batch_num_tokens`` (token-mean) / ``global_batch_size`` (the
    seq-mean modes): ``ValueError`` otherwise, as in verl. An unknown mode raises
    ``ValueError("Invalid loss_agg_mode: ...")``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> x = torch.arange(1.0, 9.0).reshape(2, 4)
        >>> mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
        >>> core_algos.agg_loss(x, mask, "seq-mean-token-sum")  # the empty row does not count
        tensor(3.)
        >>> core_algos.agg_loss(x, torch.ones(2, 4), "seq-mean-token-sum-norm")
        tensor(4.5000)
        >>> core_algos.agg_loss(x, mask, "token-mean", dp_size=2, batch_num_tokens=6)
        tensor(1.)
    """
    return _run(
        _agg,
        loss_mat,
        loss_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )


# ----------------------------------------------------------------------------- policy / value


def _check_clip_ratio_c(clip_ratio_c) -> None:
    if not clip_ratio_c > 1.0:  # verl asserts this; raised even under python -O
        raise AssertionError(
            "The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0,"
            + f" but get the value: {clip_ratio_c}."
        )


def _policy(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    rollout_is_weights,
    cliprange,
    cliprange_low,
    cliprange_high,
    clip_ratio_c,
    loss_agg_mode,
    legacy=False,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's vanilla PPO loss, op for op: ``(pg_loss, clipfrac, ppo_kl, clipfrac_lower)``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = _masked_mean(-log_ratio, response_mask)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = _masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    clipfrac_lower = _masked_mean(torch.gt(loss_ppo, dual_bound) * negative.float(), response_mask)
    per_token = torch.where(negative, torch.min(dual_bound, loss_ppo), loss_ppo)
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights
    if legacy:
        pg_loss = _agg_v05(per_token, response_mask, loss_agg_mode)
    else:
        pg_loss = _agg(
            per_token,
            response_mask,
            loss_agg_mode,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
            loss_scale_factor=loss_scale_factor,
        )
    return pg_loss, clipfrac, ppo_kl, clipfrac_lower


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
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss`` (vanilla PPO, dual clip):
    deprecated in verl 0.9 in favour of :func:`compute_policy_loss_vanilla`, and so it warns
    (``FutureWarning``) as verl's does.

    Per token: ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``L = max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high))``, and where ``A < 0``
    additionally ``min(L, -A clip_ratio_c)``; aggregated by :func:`agg_loss` with its
    defaults (no global-batch arguments here, as in verl).

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
        >>> import torch, warnings
        >>> from fused_rl.compat import verl as core_algos
        >>> old = torch.full((1, 3), -1.0)
        >>> new = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", FutureWarning)
        ...     out = core_algos.compute_policy_loss(old, new, torch.ones(1, 3),
        ...                                          torch.ones(1, 3), cliprange=0.2)
        >>> out[0].backward(); [round(v.item(), 4) for v in out]
        [-0.9355, 0.3333, 0.0, 0.0]
    """
    if not torch.compiler.is_compiling():  # Dynamo cannot trace warnings.warn
        warnings.warn(  # named after the package users import it from, fused_rl.compat.verl
            f"Warning: Function '{__package__}.compute_policy_loss' is deprecated. Please "
            f"use '{__package__}.compute_policy_loss_vanilla' instead.",
            category=FutureWarning,
            stacklevel=2,
        )
    _check_clip_ratio_c(clip_ratio_c)
    return _run(
        _policy, old_log_prob, log_prob, advantages, response_mask, None, cliprange,
        cliprange_low, cliprange_high, clip_ratio_c, loss_agg_mode,
    )  # fmt: skip


_MISSING = object()


def _config_value(config, name: str, default=_MISSING):
    """``config.name`` for verl's ``ActorConfig`` / an OmegaConf ``DictConfig`` / any object
    with attributes, or ``config[name]`` for a plain mapping."""
    if isinstance(config, dict):
        if name in config:
            return config[name]
    elif hasattr(config, name):
        return getattr(config, name)
    if default is _MISSING:
        raise AttributeError(f"config has no {name!r} (verl's ActorConfig field)")
    return default


def compute_policy_loss_vanilla(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_vanilla`` (verl 0.9's
    ``"vanilla"`` policy loss, the one ``get_policy_loss_fn("vanilla")`` returns).

    The loss of :func:`compute_policy_loss` with the clip ranges read from ``config``
    (``clip_ratio``; ``clip_ratio_low`` / ``clip_ratio_high`` when not None; ``clip_ratio_c``,
    default 3.0), per-token losses multiplied by ``rollout_is_weights`` when given, and
    :func:`agg_loss` called with ``config.global_batch_info`` (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``; empty by default).

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        loss_agg_mode: see :func:`agg_loss`.
        config: verl's ``ActorConfig``, an OmegaConf config or any object (or dict) with those
            fields; required (``AssertionError`` when None, as in verl).
        rollout_is_weights: optional ``(B, T)`` rollout-correction weights.

    Returns:
        ``(pg_loss, metrics)``: the loss (differentiable w.r.t. ``log_prob``) and
        ``{"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}`` as Python floats
        (host syncs, as in verl).

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> from fused_rl.compat import verl as core_algos
        >>> config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28,
        ...                          clip_ratio_c=3.0, global_batch_info={})
        >>> old = torch.full((1, 3), -1.0)
        >>> new = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
        >>> loss, metrics = core_algos.compute_policy_loss_vanilla(
        ...     old, new, torch.ones(1, 3), torch.ones(1, 3), config=config)
        >>> round(loss.item(), 4), round(metrics["actor/pg_clipfrac"], 4)
        (-0.9622, 0.3333)
    """
    if config is None:
        raise AssertionError("compute_policy_loss_vanilla needs config (verl's ActorConfig)")
    clip_ratio = _config_value(config, "clip_ratio")
    low = _config_value(config, "clip_ratio_low", None)
    high = _config_value(config, "clip_ratio_high", None)
    low = clip_ratio if low is None else low
    high = clip_ratio if high is None else high
    clip_ratio_c = _config_value(config, "clip_ratio_c", 3.0)
    _check_clip_ratio_c(clip_ratio_c)
    batch_info = dict(_config_value(config, "global_batch_info", {}) or {})
    unknown = set(batch_info) - {
        "dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor",
    }  # fmt: skip
    if unknown:
        raise TypeError(f"config.global_batch_info has unknown keys {sorted(unknown)}")
    pg_loss, clipfrac, ppo_kl, lower = _run(
        _policy, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights,
        clip_ratio, low, high, clip_ratio_c, loss_agg_mode, **batch_info,
    )  # fmt: skip
    metrics = {
        "actor/pg_clipfrac": clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": lower.detach().item(),
    }
    return pg_loss, metrics


def _value(
    vpreds,
    returns,
    values,
    response_mask,
    cliprange_value,
    loss_agg_mode,
    legacy=False,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
):
    """verl's clipped value loss, op for op: ``(vf_loss, vf_clipfrac)``."""
    clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (clipped - returns) ** 2
    worst = torch.max(err_unclipped, err_clipped)
    if legacy:
        agg = _agg_v05(worst, response_mask, loss_agg_mode)
    else:
        agg = _agg(
            worst,
            response_mask,
            loss_agg_mode,
            dp_size=dp_size,
            batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size,
            loss_scale_factor=loss_scale_factor,
        )
    clipfrac = _masked_mean(torch.gt(err_clipped, err_unclipped).float(), response_mask)
    return 0.5 * agg, clipfrac


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | Tensor | None = None,
    global_batch_size: int | Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_value_loss`` (clipped value loss).

    ``0.5 * agg(max((v - R)^2, (clip(v, old - c, old + c) - R)^2))`` with verl's
    ``clip_by_value`` (``max(min(v, old + c), old - c)``); the global-batch arguments go to
    :func:`agg_loss`.

    Returns:
        ``(vf_loss, vf_clipfrac)``: the loss (differentiable w.r.t. ``vpreds``) and the masked
        fraction where the clipped error is strictly larger (never affected by the
        global-batch arguments).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> v = torch.tensor([[1.0, 0.0]])
        >>> loss, frac = core_algos.compute_value_loss(v, torch.ones(1, 2), torch.zeros(1, 2),
        ...                                             torch.ones(1, 2), 0.5)
        >>> loss.item(), frac.item()
        (0.3125, 0.5)
    """
    return _run(
        _value, vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode,
        dp_size=dp_size, batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
    )  # fmt: skip


def _entropy_loss(logits, response_mask, loss_agg_mode, aggregate):
    if original_half_precision(logits):
        return aggregate(entropy_from_logits(logits), response_mask, loss_agg_mode)
    V.check_logits(logits, "logits")
    entropy = token_entropy(logits)  # fp32 (fp64 for fp64 logits)
    if logits.dtype not in _HALF:
        return aggregate(entropy.to(logits.dtype), response_mask, loss_agg_mode)
    # verl aggregates a half-precision entropy: aggregate the fp32 one, return verl's dtype
    nominal = torch.empty(entropy.shape, dtype=logits.dtype, device="meta")
    dtype = _out_dtypes(aggregate, (nominal, response_mask, loss_agg_mode), {})
    return aggregate(entropy, _fp32(response_mask), loss_agg_mode).to(dtype)


def compute_entropy_loss(
    logits: Tensor, response_mask: Tensor, loss_agg_mode: str = "token-mean"
) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_entropy_loss``.

    :func:`agg_loss` (with its defaults) of the per-token entropy of ``(B, T, V)`` logits,
    fused (differentiable).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.compute_entropy_loss(torch.zeros(1, 2, 4), torch.ones(1, 2))
        tensor(1.3863)
    """
    return _entropy_loss(logits, response_mask, loss_agg_mode, _agg)


# ----------------------------------------------------------------------------- KL


def _kl_kind(kl_penalty, allowed) -> str:
    if not isinstance(kl_penalty, str):
        raise TypeError(f"kl_penalty must be a str (one of {allowed}), got {kl_penalty!r}")
    kind = _KL_NAMES.get(kl_penalty)
    if kind is None:  # "full" included: verl raises NotImplementedError for both
        raise NotImplementedError(
            f"kl_penalty {kl_penalty!r} is not implemented (verl accepts {allowed})"
        )
    return kind


def kl_penalty_forward(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.kl_penalty_forward``: the KL estimators.

    Per token with ``d = logprob - ref_logprob``: ``"kl"``/``"k1"`` ``d``, ``"abs"`` ``|d|``,
    ``"mse"``/``"k2"`` ``d^2 / 2``, ``"low_var_kl"``/``"k3"`` ``exp(-d) + d - 1`` with ``-d``
    clamped to ``[-20, 20]`` and the result to ``[-10, 10]`` (zero gradient where clamped).
    ``"full"`` and unknown names raise ``NotImplementedError``, as in verl. Fused
    (:func:`fused_rl.kl_estimate`), differentiable w.r.t. both inputs; the inputs broadcast
    and the result has their promoted dtype, as verl's arithmetic gives.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.kl_penalty_forward(torch.tensor([0.5]), torch.tensor([0.0]), "k2")
        tensor([0.1250])
    """
    kind = _kl_kind(kl_penalty, tuple(_KL_NAMES))
    V.check_float(logprob, "logprob")
    V.check_float(ref_logprob, "ref_logprob")
    if original_half_precision(logprob, ref_logprob):
        return _kl_eager(logprob, ref_logprob, kind)
    out_dtype = _result_dtype(logprob, ref_logprob)
    if logprob.shape != ref_logprob.shape:
        logprob, ref_logprob = torch.broadcast_tensors(logprob, ref_logprob)
    return kl_estimate(logprob, ref_logprob, kl_estimator=_KL_NAMES[kl_penalty]).to(out_dtype)


def _result_dtype(a: Tensor, b: Tensor) -> torch.dtype:
    """``torch.result_type`` of two float tensors (a 0-dim one yields to one with
    dimensions), written out: Dynamo cannot trace ``torch.result_type``."""
    if (a.dim() == 0) != (b.dim() == 0):
        return b.dtype if a.dim() == 0 else a.dtype
    return torch.promote_types(a.dtype, b.dtype)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """Mirrors ``verl.trainer.ppo.core_algos.kl_penalty`` (verl 0.9.x).

    :func:`kl_penalty_forward` of the named estimator. A ``"+"`` suffix (``"k1+"``, ``"kl+"``,
    ``"abs+"``, ``"k3+"``, ``"low_var_kl+"``, ``"k2+"``, ``"mse+"``) is verl's straight-through
    form ``k2 - k2.detach() + value.detach()``: the base estimator's value with the gradient of
    ``k2 = d^2 / 2`` (``d`` w.r.t. ``logprob``, ``-d`` w.r.t. ``ref_logprob``, unclamped),
    the unbiased KL gradient. Where ``k2`` overflows to inf (``|d| > 1.8e19``) or ``d`` is
    infinite, the value is NaN, as in verl.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> kl = core_algos.kl_penalty(lp, torch.tensor([-1.5, -1.0]), "k3+")
        >>> kl.sum().backward()
        >>> [round(v, 4) for v in kl.tolist()], lp.grad.tolist()
        ([0.1065, 0.7183], [0.5, -1.0])
    """
    straight = isinstance(kl_penalty, str) and kl_penalty.endswith("+")
    value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1] if straight else kl_penalty)
    if not straight:
        return value
    k2 = kl_penalty_forward(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


# ----------------------------------------------------------------------------- advantages


def _as_unit(x) -> float | None:
    """``x`` as a float when the fused kernel takes it (a real number in ``[0, 1]``)."""
    if isinstance(x, Tensor):
        if x.numel() != 1 or x.is_complex() or x.dtype == torch.bool:
            return None
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if 0.0 <= x <= 1.0 else None


def compute_gae_advantage_return(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float | Tensor,
    lam: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``.

    GAE over the tokens where ``response_mask`` is set, skipping the others (verl's
    multi-turn form: a masked token passes the next valid token's value and advantage
    through), then ``returns = advantages + values`` and ``advantages`` whitened by
    :func:`masked_whiten` (zero masked mean; masked positions are not zeroed).

    Runs :func:`fused_rl.gae` on the valid tokens gathered to the front of each row: no
    Python loop over time (``gamma`` / ``lam`` outside ``[0, 1]`` take a step-by-step loop).
    No gradient (verl runs it under ``torch.no_grad``).

    Args:
        token_level_rewards, values: ``(B, T)`` float tensors.
        response_mask: ``(B, T)`` 0/1 mask: float, integer or bool (verl raises on bool).
        gamma, lam: real numbers (0-dim tensors are accepted).

    Returns:
        ``(advantages, returns)``, ``(B, T)`` each, in verl's dtype: the promotion of the
        rewards', values' and (floating) mask's dtypes (bf16 rewards and values with an fp32
        mask give fp32).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
        >>> adv, ret = core_algos.compute_gae_advantage_return(
        ...     r, torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]]), 1.0, 1.0)
        >>> ret.tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    """
    V.check_float(token_level_rewards, "token_level_rewards")
    V.check_float(values, "values")
    if token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards must be (B, T), got shape {tuple(token_level_rewards.shape)}"
        )
    V.check_shape(values, token_level_rewards.shape, "values", "token_level_rewards.shape")
    V.check_mask_dtype(response_mask, "response_mask")
    V.check_shape(
        response_mask, token_level_rewards.shape, "response_mask", "token_level_rewards.shape"
    )
    V.check_same_device(
        token_level_rewards=token_level_rewards, values=values, response_mask=response_mask
    )
    dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
    if response_mask.is_floating_point():  # verl's x * mask: a floating mask promotes
        dtype = torch.promote_types(dtype, response_mask.dtype)
    with torch.no_grad():
        if original_half_precision(token_level_rewards, values, response_mask):
            advantages = _gae_loop(token_level_rewards, values, response_mask, gamma, lam)
            returns = advantages + values
            return _masked_whiten(advantages, response_mask), returns
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        rewards, vals = token_level_rewards.to(acc), values.to(acc)
        gamma_f, lam_f = _as_unit(gamma), _as_unit(lam)
        if gamma_f is None or lam_f is None:
            advantages = _gae_loop(rewards, vals, response_mask, gamma, lam).to(acc)
        else:
            valid = response_mask.bool()
            length = valid.shape[-1]
            steps = torch.arange(length, device=valid.device)
            # valid tokens first, in order: GAE on them is verl's skip-the-masked recursion
            order = torch.argsort(torch.where(valid, steps, steps + length), dim=-1)
            n_valid = valid.sum(dim=-1, keepdim=True)
            packed, _ = gae(
                rewards.gather(-1, order),
                vals.gather(-1, order),
                gamma=gamma_f,
                lam=lam_f,
                mask=steps < n_valid,
            )
            # a masked token carries the advantage of the next valid one (0 past the last):
            # its packed index is the number of valid tokens before it
            before = torch.cumsum(valid, dim=-1) - valid.long()
            advantages = packed.gather(-1, before)
        returns = (advantages + vals).to(dtype)
        advantages = _masked_whiten(advantages, _fp32(response_mask)).to(dtype)
    return advantages, returns


def _group_ids(index, n: int) -> list:
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != n:
        raise ValueError(f"index must hold {n} group ids (one per sample), got {len(ids)}")
    return ids


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
    one keeps ``s / (1 + epsilon)`` (verl's mean 0, std 1, with ``1 + epsilon`` rounded to
    fp32 as verl's ``torch.tensor(1.0) + epsilon`` is). Broadcast over the response by
    ``* response_mask``. Vectorised over groups (no Python loop over samples).

    Args:
        token_level_rewards: ``(B, T)`` float rewards.
        response_mask: ``(B, T)`` mask.
        index: ``B`` group ids (numpy array, list or tensor).
        config: accepted for compatibility, unused (as in verl's GRPO estimator).

    Returns:
        ``(advantages, returns)``: the same ``(B, T)`` tensor twice, as verl returns it, in
        the dtype of ``scores * response_mask`` (the scores rounded to the rewards' dtype).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> r = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
        >>> adv, _ = core_algos.compute_grpo_outcome_advantage(r, torch.ones(3, 2),
        ...                                                    ["a", "a", "b"])
        >>> [round(v, 4) for v in adv[:, 0].tolist()]
        [0.7071, -0.7071, 1.0]
    """
    V.check_float(token_level_rewards, "token_level_rewards")
    V.check_mask_dtype(response_mask, "response_mask")
    ids = _group_ids(index, token_level_rewards.shape[0])
    with torch.no_grad():
        if original_half_precision(token_level_rewards):
            scores = _grpo_loop(
                token_level_rewards.sum(dim=-1), ids, epsilon, norm_adv_by_std_in_grpo
            )
            advantages = scores.unsqueeze(-1) * response_mask
            return advantages, advantages
        dtype = token_level_rewards.dtype
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scores = token_level_rewards.to(acc).sum(dim=-1)
        groups: dict = {}
        group = torch.tensor([groups.setdefault(i, len(groups)) for i in ids], dtype=torch.long)
        group = group.to(scores.device)
        count = torch.zeros(len(groups), dtype=acc, device=scores.device)
        count.index_add_(0, group, torch.ones_like(scores))
        mean = torch.zeros_like(count).index_add_(0, group, scores) / count
        centred = scores - mean[group]
        sq = torch.zeros_like(count).index_add_(0, group, centred**2)
        std = torch.sqrt(sq / (count - 1))
        single = count[group] == 1
        centred = torch.where(single, scores, centred)  # a group of one: mean 0 ...
        if norm_adv_by_std_in_grpo:
            one_eps = (torch.tensor(1.0) + epsilon).to(acc)  # ... std 1, plus eps in fp32
            divisor = torch.where(single, one_eps.to(scores.device), std[group] + epsilon)
            centred = centred / divisor
        advantages = centred.to(dtype).unsqueeze(-1) * response_mask
    return advantages, advantages
