"""What verl's registered policy losses (:mod:`.policy_loss`, :mod:`.policy_loss_composed`)
share: verl 0.9.1's ``ActorConfig`` / ``PolicyLossConfig`` defaults and how a config's fields
are read, verl's ``agg_loss`` as per-token weights and a divisor for
:func:`fused_rl.policy_loss_from_logprobs`, the input checks and verl's loss dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from ._accurate import _out_dtypes
from .core_algos import LOSS_AGG_MODES, _agg, _config_value

_LOG_RATIO_CLAMP = 20.0  # verl's clamp of log_prob - old_log_prob (sapo, cispo, dppo)

# verl 0.9.1 ``ActorConfig`` defaults, for fields a config object or dict leaves out
_ACTOR_DEFAULTS = {
    "clip_ratio": 0.2,
    "clip_ratio_low": 0.2,
    "clip_ratio_high": 0.2,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
}

# verl 0.9.1 ``PolicyLossConfig`` defaults (``config.policy_loss.*``) and the fallbacks its
# functions use when a field is None (``ppo_kl_coef``: 0.1 in the dataclass, 1.0 when None)
_POLICY_LOSS_DEFAULTS = {
    "clip_cov_ratio": (0.0002, 0.0002),
    "clip_cov_lb": (1.0, 1.0),
    "clip_cov_ub": (5.0, 5.0),
    "kl_cov_ratio": (0.0002, 0.0002),
    "ppo_kl_coef": (0.1, 1.0),
}

_BATCH_INFO_KEYS = ("dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")


def _actor_field(config, name: str):
    return _config_value(config, name, _ACTOR_DEFAULTS[name])


def _clip_band(config) -> tuple[float, float]:
    """verl's ``clip_ratio_low`` / ``clip_ratio_high``, each ``clip_ratio`` when None."""
    ratio = _actor_field(config, "clip_ratio")
    low, high = _actor_field(config, "clip_ratio_low"), _actor_field(config, "clip_ratio_high")
    return (ratio if low is None else low), (ratio if high is None else high)


def _global_batch_info(config) -> dict:
    info = dict(_config_value(config, "global_batch_info", {}) or {})
    unknown = set(info) - set(_BATCH_INFO_KEYS)
    if unknown:
        raise TypeError(f"config.global_batch_info has unknown keys {sorted(unknown)}")
    return info


def _agg_as_weights(
    mask: Tensor,
    loss_agg_mode: str,
    dtype: torch.dtype,
    dp_size=1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> tuple[Tensor, Tensor]:
    """verl 0.9's ``agg_loss`` as ``(w, n)`` with ``agg_loss(L) = sum(w * L) / n``: ``w`` the
    per-token weights (``fused_rl``'s float mask) and ``n`` a 0-dim divisor (its
    ``num_items``, never read on the host: a zero count gives NaN, as verl's ``0 / 0``)."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"Invalid loss_agg_mode: {loss_agg_mode} (expected one of {LOSS_AGG_MODES})"
        )
    weights = mask.detach().to(dtype)

    def divisor(x) -> Tensor:
        return torch.as_tensor(x, device=weights.device).to(dtype).reshape(()) / dp_size

    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            batch_num_tokens = weights.sum()
        return weights, divisor(batch_num_tokens)
    if loss_agg_mode == "token-sum":
        return weights, divisor(1.0)
    counts = weights.sum(dim=-1, keepdim=True)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        global_batch_size = (counts > 0).sum()  # sequences with a valid token
    n = divisor(global_batch_size)
    if loss_agg_mode == "seq-mean-token-mean":
        weights = weights / (counts + 1e-8)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        n = n * (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return weights, n


def _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights) -> None:
    V.check_float(log_prob, "log_prob")
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be (B, T), got shape {tuple(log_prob.shape)}")
    shape = tuple(log_prob.shape)
    V.check_float(old_log_prob, "old_log_prob")
    V.check_float(advantages, "advantages")
    V.check_mask_dtype(response_mask, "response_mask")
    for name, t in (("old_log_prob", old_log_prob), ("advantages", advantages),
                    ("response_mask", response_mask)):  # fmt: skip
        V.check_shape(t, shape, name, "log_prob.shape")
    if weights is not None:
        V.check_float(weights, "rollout_is_weights")
        if tuple(weights.shape) not in (shape, (shape[0], 1), (shape[0],)):
            raise ValueError(
                f"rollout_is_weights must have shape (B, T) = {shape}, (B, 1) or (B,), got "
                f"{tuple(weights.shape)}"
            )


def _verl_loss_dtype(name, old_log_prob, log_prob, advantages, response_mask, weights, mode,
                     batch_info) -> torch.dtype:  # fmt: skip
    """The dtype verl's loss comes out in: its per-token loss's (the promotion of the inputs
    its arithmetic touches), then through ``agg_loss`` (probed on meta tensors)."""
    dtype = torch.promote_types(log_prob.dtype, advantages.dtype)
    if name != "gpg":
        dtype = torch.promote_types(dtype, old_log_prob.dtype)
    if name == "gspo" and response_mask.is_floating_point():  # the sequence mean's mask
        dtype = torch.promote_types(dtype, response_mask.dtype)
    if weights is not None:
        dtype = torch.promote_types(dtype, weights.dtype)
    nominal = torch.empty(log_prob.shape, dtype=dtype, device="meta")
    return _out_dtypes(_agg, (nominal, response_mask, mode), batch_info)


def _policy_loss_field(config, name: str):
    """``config.policy_loss.<name>`` (verl's ``PolicyLossConfig``): its default where the
    field (or ``policy_loss`` itself) is absent, verl's fallback where it is None; an explicit
    ``policy_loss=None`` fails verl's assert."""
    default, fallback = _POLICY_LOSS_DEFAULTS[name]
    sub = _config_value(config, "policy_loss", {})
    if sub is None:
        raise AssertionError("config.policy_loss is None (verl asserts it is set)")
    value = _config_value(sub, name, default)
    return fallback if value is None else value


def _rollout_weights_2d(weights, like: Tensor):
    """rollout IS weights ``(B, T)`` / ``(B, 1)`` / ``(B,)`` as a tensor broadcasting to
    ``(B, T)`` (detached)."""
    if weights is None:
        return None
    w = weights.detach()
    return w[:, None] if w.dim() == 1 else w


def _registry_prologue(name, old_log_prob, log_prob, advantages, response_mask, config, weights):
    if config is None:
        raise AssertionError(f"compute_policy_loss_{name} needs config (verl's ActorConfig)")
    _check_registry_inputs(old_log_prob, log_prob, advantages, response_mask, weights)
    low, high = _clip_band(config)
    V.check_nonnegative(low, "config.clip_ratio_low (or clip_ratio)")
    V.check_nonnegative(high, "config.clip_ratio_high (or clip_ratio)")
    acc = torch.float64 if log_prob.dtype == torch.float64 else torch.float32
    return low, high, acc


def _as_floats(metrics: dict) -> dict:
    return {k: v if isinstance(v, float) else v.detach().item() for k, v in metrics.items()}
