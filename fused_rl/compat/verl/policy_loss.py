"""Mirrors the policy-loss registry of ``verl.trainer.ppo.core_algos``:
``POLICY_LOSS_REGISTRY``, ``register_policy_loss`` and ``get_policy_loss_fn``, and the
registered losses that map onto one fused surrogate (``gspo``, ``sapo``, ``gpg``,
``cispo``).

Every entry has the signature ``(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``. ``vanilla`` is
:func:`~fused_rl.compat.verl.core_algos.compute_policy_loss_vanilla` (verl's op sequence);
``gspo``, ``sapo``, ``gpg`` and ``cispo`` run :func:`fused_rl.policy_loss_from_logprobs` (one
token-layer kernel and one reduction forward, two elementwise ops backward) with verl's
``agg_loss`` expressed as per-token weights and a divisor, and compute verl's metrics beside
it. These four compute in fp32 (fp64 for fp64 log-probs) and round the loss once to verl's
dtype in both ``half_precision`` modes: no verl half-precision op sequence is reproduced for
them (``vanilla`` keeps its ``"original"``). ``clip_cov``, ``kl_cov``, ``geo_mean``,
``dppo_tv``, ``dppo_kl`` and ``dro`` (:mod:`fused_rl.compat.verl.policy_loss_composed`) run
the same op with their token-space terms (selections, trust-region masks, truncated ratios,
weights) computed in plain PyTorch beside it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from ._accurate import _fp32
from ._policy_loss_common import (
    _LOG_RATIO_CLAMP,
    _actor_field,
    _agg_as_weights,
    _check_registry_inputs,
    _clip_band,
    _global_batch_info,
    _verl_loss_dtype,
)
from .core_algos import compute_policy_loss_vanilla
from .policy_loss_composed import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_kl_cov,
)
from .torch_functional import _masked_mean

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "VERL_POLICY_LOSSES",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_sapo",
    "get_policy_loss_fn",
    "register_policy_loss",
]

# verl 0.9.1's registry, in its order (the list its ValueError prints)
VERL_POLICY_LOSSES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
    "dro", "cispo", "bypass_mode",
)  # fmt: skip

_NOT_BUILT = {
    "bypass_mode": "bypass mode (rollout correction computed inside the loss)",
}

_GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of GSPO's log sequence ratio (upper only)


def _registered_policy_loss(
    name, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights,
):  # fmt: skip
    """verl's ``compute_policy_loss_<name>`` for ``name`` in gspo | sapo | gpg | cispo."""
    from ...losses import policy_loss_from_logprobs

    if config is None:
        raise AssertionError(f"compute_policy_loss_{name} needs config (verl's ActorConfig)")
    weights = rollout_is_weights
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    batch_info = _global_batch_info(config)
    if name == "sapo":  # verl aggregates SAPO per sequence whatever loss_agg_mode says
        loss_agg_mode = "seq-mean-token-mean"
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    agg_w, divisor = _agg_as_weights(response_mask, loss_agg_mode, acc, **batch_info)
    out_dtype = _verl_loss_dtype(
        name, old_log_prob, log_prob, advantages, response_mask, weights, loss_agg_mode,
        batch_info,
    )  # fmt: skip
    low, high = _clip_band(config)
    if name in ("gspo", "cispo"):
        V.check_nonnegative(low, "config.clip_ratio_low (or clip_ratio)")
        V.check_nonnegative(high, "config.clip_ratio_high (or clip_ratio)")
    kwargs = {"surrogate": "ppo" if name == "gspo" else name}
    metrics: dict[str, float] = {}
    with torch.no_grad():
        mask = _fp32(response_mask)
        valid = response_mask.bool()
        lp, old = log_prob.detach().to(acc), old_log_prob.detach().to(acc)
        log_ratio = lp - old
        clamped = torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        outside = log_ratio.abs() > _LOG_RATIO_CLAMP  # where verl's clamp is active
    if name == "gspo":
        with torch.no_grad():
            m = mask.to(acc)
            seq = (torch.where(valid, log_ratio, 0.0) * m).sum(-1) / m.sum(-1).clamp(min=1)
            seq = seq[:, None].expand_as(log_ratio)
            log_s = torch.clamp(seq, max=_GSPO_LOG_RATIO_MAX)
        # verl's GSPO-token ratio exp(logp - sg(logp) + sg(log s)): the sequence's value,
        # each token's own gradient, none where the clamp at 10 is active
        active = seq > _GSPO_LOG_RATIO_MAX
        logp_in = torch.where(active, log_s, log_prob - log_prob.detach() + log_s)
        old_in = torch.zeros_like(log_s)
        kwargs.update(eps_low=low, eps_high=high)
        with torch.no_grad():
            s = torch.exp(log_s)
            adv = _fp32(advantages).to(acc)
            unclipped, clipped = -adv * s, -adv * torch.clamp(s, 1 - low, 1 + high)
            metrics = {
                "actor/pg_clipfrac": _masked_mean(torch.gt(clipped, unclipped).float(), mask),
                "actor/ppo_kl": _masked_mean(-log_ratio, mask),
                "actor/pg_clipfrac_lower": 0.0,
            }
    elif name == "sapo":
        # the ratio is exp(clamp(logp - old, -20, 20)): its value exactly, the gradient 0
        # where the clamp is active (as verl's clamp)
        logp_in = torch.where(outside, clamped, log_prob - log_prob.detach() + clamped)
        old_in = torch.zeros_like(clamped)
        tau_pos, tau_neg = _actor_field(config, "tau_pos"), _actor_field(config, "tau_neg")
        V.check_positive(tau_pos, "config.tau_pos")  # verl divides by them
        V.check_positive(tau_neg, "config.tau_neg")
        kwargs.update(sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
        metrics = {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0}
        with torch.no_grad():
            metrics["actor/ppo_kl"] = _masked_mean(-clamped, mask)
    elif name == "cispo":
        # the loss holds logp itself (-sg(w) A logp): keep it, and move old_log_prob where the
        # clamp is active so that the ratio is exp(clamped); w is detached, so the gradient
        # (-w A) is verl's either way
        logp_in = log_prob
        old_in = torch.where(outside, lp - clamped, old)
        kwargs.update(eps_low=low, eps_high=high)
        with torch.no_grad():
            ratio = torch.exp(clamped)
            out = (ratio != torch.clamp(ratio, 1 - low, 1 + high)).float()
            metrics = {
                "actor/pg_clipfrac": _masked_mean(out, mask),
                "actor/ppo_kl": _masked_mean(-clamped, mask),
                "actor/pg_clipfrac_lower": 0.0,
            }
    else:  # gpg: -A logp, no ratio, no metric
        logp_in, old_in = log_prob, None
    loss, _ = policy_loss_from_logprobs(
        logp_in, advantages, old_logprobs=old_in, mask=agg_w, is_weights=weights,
        loss_agg="token-mean", num_items=divisor, **kwargs,
    )  # fmt: skip
    metrics = {k: v if isinstance(v, float) else v.detach().item() for k, v in metrics.items()}
    return loss.to(out_dtype), metrics


def compute_policy_loss_gspo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_gspo`` (verl 0.9.x, the
    ``"gspo"`` entry of :func:`get_policy_loss_fn`; GSPO, arXiv 2507.18071).

    Per sequence ``i``, ``d_i = sum_t (log_prob - old_log_prob) m / max(sum_t m, 1)``; per
    token the "GSPO-token" ratio ``s = exp(min(logp - sg(logp) + sg(d_i), 10))`` (the
    sequence's value ``exp(min(d_i, 10))``, the gradient through the token's own log-prob
    only, zero where ``d_i > 10``), ``L = max(-A s, -A clip(s, 1 - clip_ratio_low,
    1 + clip_ratio_high))`` (no dual clip), times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` (default ``"seq-mean-token-mean"``) and
    ``config.global_batch_info``. Runs :func:`fused_rl.policy_loss_from_logprobs`.

    Args:
        old_log_prob, log_prob, advantages, response_mask: ``(B, T)`` tensors.
        loss_agg_mode: see :func:`agg_loss`. (verl's main branch before 0.9 always used
            ``"seq-mean-token-mean"``.)
        config: verl's ``ActorConfig``, an OmegaConf config, any object with attributes or a
            dict: ``clip_ratio`` / ``clip_ratio_low`` / ``clip_ratio_high`` (``ActorConfig``'s
            0.2 where absent) and ``global_batch_info``. Required (``AssertionError``).
        rollout_is_weights: optional ``(B, T)`` (or ``(B, 1)``, ``(B,)``) constant weights.

    Returns:
        ``(pg_loss, metrics)``: the loss in verl's dtype, differentiable w.r.t. ``log_prob``;
        ``{"actor/pg_clipfrac": masked mean of [clipped branch strictly larger],
        "actor/ppo_kl": masked mean of old - new (unclamped), "actor/pg_clipfrac_lower": 0.0}``
        as Python floats (host syncs, as in verl).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> fn = core_algos.get_policy_loss_fn("gspo")
        >>> old = torch.zeros(2, 3)
        >>> new = torch.tensor([[0.3, 0.3, 0.3], [-0.1, 0.0, 0.1]], requires_grad=True)
        >>> adv = torch.tensor([[1.0], [-1.0]]).expand(2, 3)
        >>> loss, metrics = fn(old, new, adv, torch.ones(2, 3), config={"clip_ratio": 0.2})
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]
        (-0.1, 0.5)
    """
    return _registered_policy_loss(
        "gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_sapo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_sapo`` (the ``"sapo"``
    entry; SAPO, arXiv 2511.20347).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``, ``tau = config.tau_pos``
    where ``A > 0`` else ``config.tau_neg``, ``L = -A sigmoid(tau (r - 1)) 4 / tau``, times
    ``rollout_is_weights``, aggregated by :func:`agg_loss` with ``"seq-mean-token-mean"``
    **whatever** ``loss_agg_mode`` says (as verl), and ``config.global_batch_info``. The
    gradient is ``-4 A sigma (1 - sigma) r``, zero where the ``+-20`` clamp is active.

    Args:
        config: as :func:`compute_policy_loss_gspo`'s, with ``tau_pos`` (1.0) and
            ``tau_neg`` (1.05), each ``> 0`` (``ValueError``; verl divides by them).

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": masked mean of the clamped
        old - new, "actor/pg_clipfrac_lower": 0.0})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> loss, metrics = core_algos.compute_policy_loss_sapo(
        ...     torch.zeros(1, 2), torch.zeros(1, 2, requires_grad=True), torch.ones(1, 2),
        ...     torch.ones(1, 2), config={})
        >>> loss.item(), metrics["actor/ppo_kl"]  # sigmoid(0) * 4 / tau_pos = 2
        (-2.0, 0.0)
    """
    return _registered_policy_loss(
        "sapo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_gpg(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_gpg`` (the ``"gpg"`` entry).

    ``L = -log_prob * A`` per token, times ``rollout_is_weights``, aggregated by
    :func:`agg_loss` with ``loss_agg_mode`` and ``config.global_batch_info``;
    ``old_log_prob`` is not used.

    Returns:
        ``(pg_loss, {})``: verl reports no metric for GPG.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> loss, metrics = core_algos.compute_policy_loss_gpg(
        ...     torch.zeros(1, 2), logp, torch.ones(1, 2), torch.ones(1, 2), config={})
        >>> loss.item(), metrics
        (1.5, {})
    """
    return _registered_policy_loss(
        "gpg", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


def compute_policy_loss_cispo(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Mirrors ``verl.trainer.ppo.core_algos.compute_policy_loss_cispo`` (the ``"cispo"``
    entry; CISPO, MiniMax-M1, arXiv 2506.13585).

    Per token ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``,
    ``L = -sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) A log_prob`` (verl's band,
    two-sided and relative to 1; TRL's and Liger's CISPO cap the ratio at an absolute
    ``epsilon_high`` instead), times ``rollout_is_weights``, aggregated by :func:`agg_loss`
    with ``loss_agg_mode`` and ``config.global_batch_info``. The gradient is
    ``-sg(clamp(r)) A w``.

    Returns:
        ``(pg_loss, {"actor/pg_clipfrac": masked mean of [r outside the band, either side],
        "actor/ppo_kl": masked mean of the clamped old - new, "actor/pg_clipfrac_lower":
        0.0})``.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as core_algos
        >>> config = {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}  # verl's example band
        >>> logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        >>> old = torch.tensor([[-1.0, -1.5]])  # ratios 1 and e^0.5 (capped at 1.2)
        >>> loss, metrics = core_algos.compute_policy_loss_cispo(
        ...     old, logp, torch.ones(1, 2), torch.ones(1, 2), config=config)
        >>> round(loss.item(), 4), metrics["actor/pg_clipfrac"]
        (1.1, 0.5)
    """
    return _registered_policy_loss(
        "cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
        rollout_is_weights,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the registry


POLICY_LOSS_REGISTRY: dict = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "dro": compute_policy_loss_dro,
}


def register_policy_loss(name: str):
    """Mirrors ``verl.trainer.ppo.core_algos.register_policy_loss``: a decorator adding
    ``func`` to :data:`POLICY_LOSS_REGISTRY` under ``name`` (replacing any entry), so that
    :func:`get_policy_loss_fn` returns it.

    Example:
        >>> from fused_rl.compat import verl as core_algos
        >>> @core_algos.register_policy_loss("my_loss")
        ... def my_loss(old_log_prob, log_prob, advantages, response_mask,
        ...             loss_agg_mode="token-mean", config=None, rollout_is_weights=None):
        ...     return -(log_prob * advantages).mean(), {}
        >>> core_algos.get_policy_loss_fn("my_loss") is my_loss
        True
        >>> del core_algos.POLICY_LOSS_REGISTRY["my_loss"]
    """

    def decorator(func):
        POLICY_LOSS_REGISTRY[name] = func
        return func

    return decorator


def get_policy_loss_fn(name: str):
    """Mirrors ``verl.trainer.ppo.core_algos.get_policy_loss_fn``: the policy loss registered
    under ``name``.

    ``"vanilla"``, ``"gspo"``, ``"sapo"``, ``"gpg"``, ``"clip_cov"``, ``"kl_cov"``,
    ``"geo_mean"``, ``"cispo"``, ``"dppo_tv"``, ``"dppo_kl"``, ``"dro"`` (and whatever
    :func:`register_policy_loss` added) are here. verl 0.9's ``"bypass_mode"`` is not built
    yet: ``NotImplementedError`` naming the variant and the losses that are.
    Any other name raises verl's ``ValueError("Unsupported loss mode: ...")`` listing the
    known names.

    Example:
        >>> from fused_rl.compat import verl as core_algos
        >>> core_algos.get_policy_loss_fn("geo_mean").__name__
        'compute_policy_loss_geo_mean'
        >>> core_algos.get_policy_loss_fn("bypass_mode")
        Traceback (most recent call last):
        ...
        NotImplementedError: verl's policy loss 'bypass_mode' (bypass mode ...) is not built ...
    """
    if name in POLICY_LOSS_REGISTRY:
        return POLICY_LOSS_REGISTRY[name]
    if name in _NOT_BUILT:
        built = ", ".join(repr(n) for n in POLICY_LOSS_REGISTRY)
        raise NotImplementedError(
            f"verl's policy loss {name!r} ({_NOT_BUILT[name]}) is not built in fused_rl yet; "
            f"fused_rl.compat.verl has {built}"
        )
    known = [
        *POLICY_LOSS_REGISTRY,
        *(n for n in VERL_POLICY_LOSSES if n not in POLICY_LOSS_REGISTRY),
    ]
    raise ValueError(f"Unsupported loss mode: {name}. Supported modes are: {known}")
