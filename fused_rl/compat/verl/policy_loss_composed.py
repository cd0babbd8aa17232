"""verl 0.9.1's registered policy losses that compose fused_rl's op with token-space terms:
``clip_cov`` and ``kl_cov`` (covariance-selected tokens), ``geo_mean`` (GMPO's geometric
mean), ``dppo_tv`` / ``dppo_kl`` (trust regions, truncated ratios) and ``dro`` (a quadratic
penalty). Each runs :func:`fused_rl.policy_loss_from_logprobs` once, with its selections,
masks and weights computed in plain PyTorch on the ``(B, T)`` log-probs beside it; they are
registered in :mod:`fused_rl.compat.verl.policy_loss` (``get_policy_loss_fn``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from ._accurate import _fp32
from ._policy_loss_common import (
    _LOG_RATIO_CLAMP,
    _agg_as_weights,
    _as_floats,
    _check_registry_inputs,
    _global_batch_info,
    _policy_loss_field,
    _registry_prologue,
    _rollout_weights_2d,
    _verl_loss_dtype,
)
from .core_algos import _config_value
from .torch_functional import _masked_mean

__all__ = [
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_kl_cov",
]


def _clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, low, high, ratio,
                        lb, ub) -> Tensor:  # fmt: skip
    """verl 0.9.1's Clip-Cov token choice, as its op sequence (in the inputs' dtypes, so the
    same tokens are candidates): ``corr``, 0 on the chosen tokens, 1 elsewhere, in the
    advantages' dtype. Consumes the global CPU RNG as verl does (one ``torch.randperm`` when
    there is a candidate)."""
    with torch.no_grad():
        lp = log_prob.detach()
        r = torch.exp(lp - old_log_prob)
        pg1 = -advantages * r
        pg2 = -advantages * torch.clamp(r, 1 - low, 1 + high)
        clip_by_origin = (pg2 > pg1) & (response_mask > 0)
        cov = (advantages - _masked_mean(advantages, response_mask)) * (
            lp - _masked_mean(lp, response_mask)
        )
        cov[response_mask == 0] = -torch.inf
        cov[clip_by_origin] = -torch.inf
        clip_num = max(int(ratio * response_mask.sum().item()), 1)
        chosen = torch.nonzero((cov < ub) & (cov > lb) & (response_mask > 0))
        corr = torch.ones_like(advantages)
        if len(chosen) > 0:
            perm = torch.randperm(len(chosen))  # verl's call: the global CPU generator
            chosen = chosen[perm[: min(clip_num, len(chosen))]]
            corr[chosen[:, 0], chosen[:, 1]] = 0
    return corr


def compute_policy_loss_clip_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_clip_cov`` (the
    ``"clip_cov"`` entry; Clip-Cov, arXiv 2505.22617).

    Per token ``r = exp(log_prob - old_log_prob)`` (no clamp),
    ``L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * corr`` (no dual
    clip), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``corr`` is 0 on at most
    ``max(int(clip_cov_ratio * sum(m)), 1)`` tokens drawn at random (``torch.randperm`` on
    the global CPU generator, as verl: the same seed picks the same tokens) among the
    counted, not PPO-clipped tokens whose covariance ``(A - mean A) (logp - mean logp)``
    (masked means over this micro-batch, ``+ 1e-8`` as verl) lies strictly inside
    ``(clip_cov_lb, clip_cov_ub)``: they get loss and gradient 0 (and still count in the
    aggregation's denominator). Runs :func:`fused_rl.policy_loss_from_logprobs` with
    ``corr`` (times the rollout weights) as its ``is_weights``.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, plus ``config.policy_loss``'s
            ``clip_cov_ratio`` (0.0002, ``> 0``), ``clip_cov_lb`` (1.0), ``clip_cov_ub``
            (5.0) (verl's ``PolicyLossConfig`` defaults, also where None).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [corr == 0] (the covariance-chosen
        tokens only), "actor/ppo_kl": masked mean of old - new})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], requires_grad=True)
        >>> adv = torch.tensor([[2.0, 0.0, 0.0, -2.0]])  # covariances 3, 0, 0, 3
        >>> _ = torch.manual_seed(0)
        >>> loss, metrics = core_algos.compute_policy_loss_clip_cov(
        ...     logp.detach(), logp, adv, torch.ones(1, 4), config={})
        >>> metrics["actor/pg_clipfrac"]  # one of the two candidates dropped
        0.25
    """
    from ...losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        "clip_cov", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    ratio = _policy_loss_field(config, "clip_cov_ratio")
    if not ratio > 0:
        raise AssertionError("clip_ratio should be larger than 0.")  # verl's message
    lb, ub = _policy_loss_field(config, "clip_cov_lb"), _policy_loss_field(config, "clip_cov_ub")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "clip_cov", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    corr = _clip_cov_selection(old_log_prob, log_prob, advantages, response_mask, low, high,
                               ratio, lb, ub)  # fmt: skip
    w = _rollout_weights_2d(weights, corr)
    is_w = corr.to(acc) if w is None else corr.to(acc) * w.to(acc)
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, mask=agg_w, is_weights=is_w,
        eps_low=low, eps_high=high, loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {
            "actor/pg_clipfrac": _masked_mean((corr == 0).float(), mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
        }
    return loss.to(out_dtype), _as_floats(metrics)


def _kl_cov_selection(log_prob, advantages, response_mask, ratio) -> Tensor:
    """verl 0.9.1's KL-Cov token choice (bool ``(B, T)``): the ``max(1, int(N ratio))``
    largest covariances ``(A - mean A) (logp - mean logp)`` over the ``N`` counted tokens
    (plain means, on the CPU, ``torch.topk``, as verl; none when ``N == 0``)."""
    with torch.no_grad():
        valid = response_mask > 0
        valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        adv = advantages[valid].detach().reshape(-1).cpu()
        lp = log_prob[valid].detach().reshape(-1).cpu()
        chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        if min(ratio, len(adv)) != 0:
            cov = (adv - adv.mean()) * (lp - lp.mean())
            k = max(1, int(len(cov) * ratio))
            top = torch.topk(cov, k, largest=True).indices
            if len(top) != 0:
                chosen[valid_idx[top.to(valid_idx.device)]] = True
    return chosen.reshape(valid.shape)


def compute_policy_loss_kl_cov(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_kl_cov`` (the ``"kl_cov"``
    entry; KL-Cov, arXiv 2505.22617).

    Per token ``r = exp(log_prob - old_log_prob)`` (no clamp, no clipping), ``L = -A r``,
    plus ``ppo_kl_coef * |log_prob - old_log_prob|`` on the ``max(1, int(N kl_cov_ratio))``
    counted tokens of largest covariance ``(A - mean A) (logp - mean logp)`` (``N`` counted
    tokens, plain means, ``torch.topk`` as verl), times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``. Runs
    :func:`fused_rl.policy_loss_from_logprobs`: the PPO surrogate with a band that never
    binds (``eps_low=1``, ``eps_high`` the dtype's largest number) and ``beta=ppo_kl_coef,
    kl_estimator="abs"`` against ``where(chosen, old_log_prob, log_prob.detach())`` (0,
    gradient 0, off the chosen tokens; ``sign(0) = 0`` as ``torch.abs``); the rollout
    weights weigh the penalty too (as verl), through the aggregation's per-token weights.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, plus ``config.policy_loss``'s
            ``kl_cov_ratio`` (0.0002, ``> 0``) and ``ppo_kl_coef`` (0.1, verl's
            ``PolicyLossConfig`` default; 1.0 where it is None, verl's fallback).
        rollout_is_weights: ``>= 0`` (``ValueError`` otherwise).

    Returns:
        ``(pg_loss, {"actor/ppo_kl": masked mean of |log_prob - old_log_prob|})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.5, -2.0, -3.0]])
        >>> adv = torch.tensor([[2.0, 0.0, -1.0]])  # token 0 has the largest covariance
        >>> loss, metrics = core_algos.compute_policy_loss_kl_cov(
        ...     old, logp, adv, torch.ones(1, 3), config={"policy_loss": {"ppo_kl_coef": 1.0}})
        >>> loss.backward(); [round(g, 4) for g in logp.grad[0].tolist()]  # (-A r + sign) / 3
        [-0.7658, 0.0, 0.3333]
    """
    from ...losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    _, _, acc = _registry_prologue(
        "kl_cov", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    ratio = _policy_loss_field(config, "kl_cov_ratio")
    if not ratio > 0:
        raise AssertionError("kl_cov_ratio should be larger than 0.")  # verl's message
    coef = _policy_loss_field(config, "ppo_kl_coef")
    V.check_number(coef, "config.policy_loss.ppo_kl_coef")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "kl_cov", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    w = _rollout_weights_2d(weights, log_prob)
    if w is not None:  # verl weighs the whole per-token loss, penalty included
        if bool((w < 0).any()):
            raise ValueError("rollout_is_weights must be >= 0 for kl_cov")
        agg_w = agg_w * w.to(acc)
    chosen = _kl_cov_selection(log_prob, advantages, response_mask, ratio)
    ref = torch.where(chosen, old_log_prob.detach().to(acc), log_prob.detach().to(acc))
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, ref_logprobs=ref, mask=agg_w,
        eps_low=1.0, eps_high=float(torch.finfo(acc).max), beta=float(coef),
        kl_estimator="abs", loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {"actor/ppo_kl": _masked_mean(d.abs(), _fp32(response_mask))}
    return loss.to(out_dtype), _as_floats(metrics)


def compute_policy_loss_geo_mean(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_geo_mean`` (the
    ``"geo_mean"`` entry; GMPO, arXiv 2507.20673).

    Per token ``d = log_prob - old_log_prob`` (no clamp), ``dc = clamp(d, -clip_ratio_low,
    clip_ratio_high)`` (log-space bounds), ``d* = min(d, dc)`` where ``A > 0``, ``max`` where
    ``A < 0``, 0 where ``A = 0``; per sequence ``rho_i = exp(sum_t d* m / n_i)``,
    ``A_i = sum_t A m / (n_i + 1e-8)``, ``L_i = -A_i rho_i`` times, with rollout weights,
    their geometric mean ``exp(sum_t log(w + 1e-10) m / (n_i + 1e-8))``; the loss is the
    mean of ``L_i`` over **all** ``B`` sequences (a fully masked one counts, with
    ``L_i = 0``); ``loss_agg_mode`` and ``config.global_batch_info`` are not used (as verl).
    A token the clip froze (``A > 0, d > high`` or ``A < 0, d < -low``) gets no gradient.
    Runs :func:`fused_rl.policy_loss_from_logprobs` (``surrogate="gmpo",
    importance_sampling="sequence"``, per-token weights ``m / (n_i + 1e-8)``, divisor ``B``,
    the geometric-mean weight as ``(B, 1)`` ``is_weights``). The exponent's denominator is
    ``n_i`` where verl's is ``n_i + 1e-8``: a relative difference of ``1e-8 / n_i`` in
    ``log rho_i``, below fp32 rounding (at ``n_i = 0`` both give ``rho = 1`` and ``L_i = 0``).

    Args:
        config: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (0.2; ``>= 0``).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [d != dc and A > 0] (verl's: also
        counts A > 0 tokens below -low, which are not frozen), "actor/ppo_kl": masked mean
        of old - new, "actor/pg_clipfrac_lower": masked mean of [d != dc and A < 0]})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[0.1, 0.5], [0.0, 0.0]], requires_grad=True)
        >>> adv = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
        >>> loss, metrics = core_algos.compute_policy_loss_geo_mean(
        ...     torch.zeros(2, 2), logp, adv, torch.ones(2, 2), config={})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]  # -exp((0.1 + 0.2) / 2) / 2
        (-0.5809, 0.25)
    """
    from ...losses import policy_loss_from_logprobs

    del loss_agg_mode  # verl's GMPO ignores it
    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        "geo_mean", old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    dtype = torch.promote_types(
        torch.promote_types(log_prob.dtype, old_log_prob.dtype), advantages.dtype
    )
    if response_mask.is_floating_point():
        dtype = torch.promote_types(dtype, response_mask.dtype)
    with torch.no_grad():
        valid = response_mask.bool()
        m = response_mask.detach().to(acc)
        n = m.sum(-1, keepdim=True)
        agg_w = m / (n + 1e-8)
        seq_w = None
        w = _rollout_weights_2d(weights, log_prob)
        if w is not None:
            dtype = torch.promote_types(dtype, w.dtype)
            log_w = torch.where(valid, torch.log(w.to(acc) + 1e-10), 0.0)
            seq_w = torch.exp((log_w * m).sum(-1, keepdim=True) / (n + 1e-8))
        batch = torch.as_tensor(float(log_prob.shape[0]), dtype=acc, device=log_prob.device)
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, old_logprobs=old_log_prob, mask=agg_w, is_weights=seq_w,
        eps_low=low, eps_high=high, surrogate="gmpo", importance_sampling="sequence",
        loss_agg="token-mean", num_items=batch,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        adv = advantages.detach().to(acc)
        frozen = torch.ne(d, torch.clamp(d, -low, high))
        metrics = {
            "actor/pg_clipfrac": _masked_mean((frozen & (adv > 0)).float(), mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
            "actor/pg_clipfrac_lower": _masked_mean((frozen & (adv < 0)).float(), mask),
        }
    return loss.to(dtype), _as_floats(metrics)


_DPPO_CLIP_RATIO_C = 20.0  # verl's ``config.get("clip_ratio_c", 20.0)`` in the DPPO losses


def _dppo(kind, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights):  # fmt: skip
    """verl 0.9.1's DPPO-Binary-TV / -KL (``kind`` "tv" | "kl") on the native op."""
    from ...losses import policy_loss_from_logprobs

    name = f"dppo_{kind}"
    weights = rollout_is_weights
    low, high, acc = _registry_prologue(
        name, old_log_prob, log_prob, advantages, response_mask, config, weights
    )
    c = _config_value(config, "clip_ratio_c", _DPPO_CLIP_RATIO_C)
    V.check_positive(c, "config.clip_ratio_c")
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        name, old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    with torch.no_grad():
        # the trust-region test in the inputs' dtypes, as verl (the same tokens pass)
        lp, old = log_prob.detach(), old_log_prob.detach()
        prob, old_prob = torch.exp(lp), torch.exp(old)
        if kind == "tv":
            pos = (prob - old_prob) <= high
            neg = (prob - old_prob) >= -low
        else:
            binary_kl = old_prob * (old - lp) + (1 - old_prob) * torch.log(
                (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
            )
            pos = (binary_kl <= high) | (prob <= old_prob)
            neg = (binary_kl <= low) | (prob >= old_prob)
        valid = torch.where(advantages > 0, pos, neg).to(acc)
        d = torch.clamp(lp.to(acc) - old.to(acc), -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(d)
        trunc = torch.clamp(ratio, max=c)  # TIS: the detached, truncated ratio
        is_w = trunc * valid
        w = _rollout_weights_2d(weights, is_w)
        if w is not None:
            is_w = is_w * w.to(acc)
    # -A logp (GPG's surrogate) times sg(min(r, c)) [valid] w: verl's loss and gradient
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, mask=agg_w, is_weights=is_w, surrogate="gpg",
        loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        metrics = {
            "actor/pg_clipfrac": _masked_mean(1.0 - valid, mask),
            "actor/ppo_kl": _masked_mean(-d, mask),
            "actor/pg_clipfrac_lower": _masked_mean((ratio > c).to(acc) * valid, mask),
        }
    return loss.to(out_dtype), _as_floats(metrics)


def compute_policy_loss_dppo_tv(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dppo_tv`` (the ``"dppo_tv"``
    entry; DPPO-Binary-TV, arXiv 2602.04879).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and
    ``L = -A sg(min(r, clip_ratio_c)) log_prob * valid`` (truncated importance sampling
    instead of the dual clip; ``clip_ratio_c`` is ``config.get("clip_ratio_c", 20.0)`` as
    verl reads it: verl's ``ActorConfig`` carries 3.0, a dict without the key gives 20.0; it
    must be ``> 0``), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``valid`` (detached, computed in the
    inputs' dtypes as verl, so the same tokens pass) is ``p - p_old <= clip_ratio_high``
    where ``A > 0`` and ``p - p_old >= -clip_ratio_low`` where ``A <= 0``
    (``p = exp(log_prob)``, the total-variation bound); ``clip_ratio_low`` /
    ``clip_ratio_high`` (each ``clip_ratio`` when None) are the divergence thresholds, not a
    ratio band. The gradient is ``-A sg(min(r, c)) valid w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    ``sg(min(r, c)) valid w`` as its ``is_weights`` (those weights computed in plain PyTorch on
    the ``(B, T)`` log-probs, no gradient).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [not valid], "actor/ppo_kl": masked
        mean of the clamped old - new, "actor/pg_clipfrac_lower": masked mean of
        [r > clip_ratio_c and valid]})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.5]])  # ratios 1 and e^-0.5, both in the region
        >>> loss, metrics = core_algos.compute_policy_loss_dppo_tv(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]  # (1 + 2 e^-0.5) / 2
        (1.1065, 0.0)
    """
    return _dppo(
        "tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dppo_kl(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dppo_kl`` (the ``"dppo_kl"``
    entry; DPPO-Binary-KL, arXiv 2602.04879).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and
    ``L = -A sg(min(r, clip_ratio_c)) log_prob * valid`` (truncated importance sampling
    instead of the dual clip; ``clip_ratio_c`` is ``config.get("clip_ratio_c", 20.0)`` as
    verl reads it: verl's ``ActorConfig`` carries 3.0, a dict without the key gives 20.0; it
    must be ``> 0``), times ``rollout_is_weights``, aggregated by :func:`agg_loss` with
    ``loss_agg_mode`` and ``config.global_batch_info``. ``valid`` (detached, computed in the
    inputs' dtypes as verl, so the same tokens pass) is
    ``kl <= clip_ratio_high or p <= p_old`` where ``A > 0`` and
    ``kl <= clip_ratio_low or p >= p_old`` where ``A <= 0``, with ``p = exp(log_prob)`` and
    the binary KL
    ``kl = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``;
    ``clip_ratio_low`` /
    ``clip_ratio_high`` (each ``clip_ratio`` when None) are the divergence thresholds, not a
    ratio band. The gradient is ``-A sg(min(r, c)) valid w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    ``sg(min(r, c)) valid w`` as its ``is_weights`` (those weights computed in plain PyTorch on
    the ``(B, T)`` log-probs, no gradient).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [not valid], "actor/ppo_kl": masked
        mean of the clamped old - new, "actor/pg_clipfrac_lower": masked mean of
        [r > clip_ratio_c and valid]})``.
    """
    return _dppo(
        "kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_dro(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_dro`` (the ``"dro"`` entry;
    Direct Reward Optimization with a quadratic log-ratio penalty).

    Per token ``L = -(A log_prob - beta / 2 (log_prob - old_log_prob)^2)`` (no clamp),
    times ``rollout_is_weights`` (the whole term, penalty included, as verl), aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``; ``beta`` is
    ``config.policy_loss.dro_beta`` (verl's ``PolicyLossConfig``: None by default, which
    raises verl's ``ValueError``, as does ``beta <= 0``). The gradient is
    ``(-A + beta (log_prob - old_log_prob)) w``. Runs
    :func:`fused_rl.policy_loss_from_logprobs` with ``surrogate="gpg"`` (``-A log_prob``) and
    its KL term ``beta * k2`` against ``ref_logprobs=old_log_prob``; the rollout weights go
    into its per-token ``mask`` (with the aggregation's weights) rather than ``is_weights``,
    which would leave the penalty unweighted (so they must be ``>= 0``).

    Returns:
        ``(pg_loss, {"actor/ppo_kl": masked mean of old - new})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.0]])
        >>> loss, metrics = core_algos.compute_policy_loss_dro(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2),
        ...     config={"policy_loss": {"dro_beta": 1.0}})
        >>> round(loss.item(), 4), metrics["actor/ppo_kl"]  # (1 + 2.5) / 2
        (1.75, 0.5)
    """
    from ...losses import policy_loss_from_logprobs

    weights = rollout_is_weights
    if config is None:
        raise AssertionError("compute_policy_loss_dro needs config (verl's ActorConfig)")
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    sub = _config_value(config, "policy_loss", {})
    if sub is None:
        raise AssertionError("config.policy_loss is None (verl asserts it is set)")
    beta = _config_value(sub, "dro_beta", None)
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    batch_info = _global_batch_info(config)
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        "dro", old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    w = _rollout_weights_2d(weights, agg_w)
    if w is not None:
        counted = torch.where(agg_w != 0, w.to(acc).expand_as(agg_w), 0.0)
        if bool((counted < 0).any()):  # they weigh the mask: no negative weight there
            raise ValueError("rollout_is_weights must be >= 0 on counted tokens for DRO")
        agg_w = agg_w * counted
    loss, _ = policy_loss_from_logprobs(
        log_prob, advantages, ref_logprobs=old_log_prob, mask=agg_w, surrogate="gpg",
        beta=float(beta), kl_estimator="k2", loss_agg="token-mean", num_items=divisor,
    )  # fmt: skip
    with torch.no_grad():
        mask = _fp32(response_mask)
        d = log_prob.detach().to(acc) - old_log_prob.detach().to(acc)
        metrics = {"actor/ppo_kl": _masked_mean(-d, mask)}
    return loss.to(out_dtype), _as_floats(metrics)
