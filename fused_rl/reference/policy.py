"""Reference token layer of the policy losses (plain PyTorch on ``(B, T)`` tensors).

The same math as the epilogue of the fused kernel (``kernels/policy/layer2.py``), written for
reading: the surrogates (PPO's clipped one with asymmetric clip, TRL's two-sided ``delta``
cap and dual clip; CISPO, SAPO, GPG), the rollout IS weight, KL to a reference policy
(optionally bias-corrected) and an entropy bonus. Ties in ``torch.minimum`` split their
gradient 50/50, a clamp passes gradient on its bounds (:mod:`.clamp`, on every torch); the
kernel does the same.
"""

from __future__ import annotations

import torch

from .clamp import clamp
from .kl import kl_estimate


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip):
    """Per-token ``-min(r A, clip(r) A)`` with the optional caps, and its branch flags.

    Returns ``(loss, clipped, clipped_low, clipped_high, dual_clipped)``; the flags are bool
    tensors: the clipped branch strictly chosen (and at which bound), the dual clip active.
    """
    lo, hi = 1.0 - clip.eps_low, 1.0 + clip.clip_high
    unclipped_ratio = ratio if clip.delta is None else clamp(ratio, hi=clip.delta)
    surr_unclipped = unclipped_ratio * adv
    surr_clipped = clamp(ratio, lo, hi) * adv
    loss = -torch.minimum(surr_unclipped, surr_clipped)
    clipped = surr_clipped < surr_unclipped
    dual = torch.zeros_like(clipped)
    if clip.dual_clip is not None:
        cap = -clip.dual_clip * adv
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return loss, clipped, clipped & (ratio < lo), clipped & (ratio > hi), dual


def sequence_log_ratio(log_ratio: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """GSPO: the masked mean log-ratio ``sum m lr / sum m`` of each sequence, broadcast to its
    tokens; a sequence with no counted token gets 0 (ratio 1). Equals TRL's formulation
    (denominator clamped to 1) for 0/1 masks, and stays a weighted mean for fractional ones."""
    n = mask_f.sum(-1)
    per_seq = (log_ratio * mask_f).sum(-1) / torch.where(n > 0, n, torch.ones_like(n))
    return per_seq[:, None].expand_as(log_ratio)


def gmpo_log_ratio(log_ratio: torch.Tensor, adv: torch.Tensor, clip) -> torch.Tensor:
    """GMPO's token log-ratio, clipped in log space on the advantage's side (verl
    ``geo_mean``): ``min(d, clamp(d))`` where ``A > 0``, ``max`` where ``A < 0``, 0 at ``A = 0``."""
    clipped = clamp(log_ratio, -clip.eps_low, clip.clip_high)
    value = torch.where(
        adv > 0, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped)
    )
    return torch.where(adv != 0, value, torch.zeros_like(value))


def surrogate_terms(
    ratio: torch.Tensor,
    logp: torch.Tensor,
    adv: torch.Tensor,
    config,
    token_log_ratio: torch.Tensor | None = None,
):
    """Per-token policy term of ``config.surrogate`` (``kernels/policy/layer2.surrogate_loss``):
    ``(loss, clipped, clipped_low, clipped_high, aux)``, ``aux`` the surrogate's own metric
    (ppo: dual clip active; cispo: ``r > 1 + eps_high and A > 0``; sapo: the soft gate;
    gmpo: none, its flags are the tokens frozen by the log-space clip)."""
    surrogate, clip, params = config.surrogate, config, config.surrogate_params()
    no = torch.zeros_like(ratio, dtype=torch.bool)
    if surrogate == "ppo":
        loss, clipped, low, high, dual = clipped_surrogate(ratio, adv, clip)
        return loss, clipped, low, high, dual
    if surrogate == "cispo":
        lo, hi = 1.0 - clip.eps_low, 1.0 + clip.clip_high
        weight = torch.clamp(ratio, lo, hi).detach()
        low, high = ratio < lo, ratio > hi
        return -weight * adv * logp, low | high, low, high, high & (adv > 0)
    if surrogate == "sapo":
        # one branch a tensor of the ratio's dtype: torch.where of two Python floats gives
        # the default dtype (fp32), which float64 callers would see; full_like copies nothing
        # from the host (new_tensor would, a sync on CUDA)
        tau = torch.where(adv > 0, torch.full_like(ratio, params[0]), params[1])
        gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
        return -adv * gate, no, no, no, gate
    if surrogate == "gpg":
        return -adv * logp, no, no, no, torch.zeros_like(ratio)
    if surrogate == "gmpo":  # ratio: the geometric mean of the clipped token ratios
        low = (adv < 0) & (token_log_ratio < -clip.eps_low)
        high = (adv > 0) & (token_log_ratio > clip.clip_high)
        return -adv * ratio, low | high, low, high, torch.zeros_like(ratio)
    if surrogate == "vespo":  # ratio: the sequence's log-weight sum S (policy_token_terms)
        log_w = clamp(torch.log(ratio), LN_1E_8, 20.0)
        positive = adv >= 0
        k = torch.where(positive, torch.full_like(ratio, params[0]), params[2])
        lam = torch.where(positive, torch.full_like(ratio, params[1]), params[3]).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        phi = torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi)).detach()
        return -phi * adv * logp, no, no, no, phi
    raise ValueError(f"unknown surrogate {surrogate!r}")


LN_1E_8 = -18.420680743952367  # log(1e-8), VESPO's floor on the log-weight


def _vespo_log_weight(log_ratio, mask_f, is_weights):
    """VESPO's per-sequence ``S = sum_t m clamp(d_t, -20, 20) + sum_t clamp(log w_t, ln 1e-8,
    20)`` (detached, broadcast to the tokens; IS terms over counted tokens)."""
    counted = mask_f != 0
    total = torch.where(counted, mask_f * log_ratio.detach().clamp(-20.0, 20.0), 0.0).sum(-1)
    if is_weights is not None:
        log_is = torch.log(is_weights.detach()).clamp(LN_1E_8, 20.0)
        total = total + torch.where(counted, log_is, 0.0).sum(-1)
    return total[:, None].expand_as(log_ratio)


def policy_token_terms(
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask_f: torch.Tensor,
    *,
    old_logp: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    config,
    is_weights: torch.Tensor | None = None,
    entropy_scale: torch.Tensor | None = None,
    full_kl: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token loss (differentiable w.r.t. ``logp`` and ``entropy``) and metric terms of
    the options in ``config`` (a :class:`fused_rl.PolicyConfig`).

    ``old_logp=None`` is on-policy: ``old = logp.detach()``, so the ratio is 1 and the
    gradient is the policy gradient. ``is_weights`` (constants) multiply the policy term
    only; ``kl_bias_correction`` multiplies the KL by the (not detached) ratio.
    ``full_kl`` (``kl_estimator="full"``, in place of ``ref_logp``): each token's exact
    ``KL(pi || pi_ref)``, differentiable w.r.t. the logits it came from.
    ``keep`` (bool, or None): the tokens whose policy term stays (the top-entropy selection,
    the off-policy sequence mask); the others' policy term is multiplied by 0, as TRL's
    ``per_token_loss * mask``, after the IS weights and before the KL and entropy terms.
    """
    # Inputs at tokens that do not count never matter, even NaN / inf ones (padding): give
    # them log-prob 0, ratio 1, KL 0 and advantage 0 so neither the loss, its gradient (a
    # where() passes exactly 0 to the branch not taken) nor a GSPO sequence ratio can pick
    # them up.
    counted = mask_f != 0
    logp = torch.where(counted, logp, torch.zeros_like(logp))
    if entropy is not None:
        entropy = torch.where(counted, entropy, torch.zeros_like(entropy))
    detached = logp.detach()
    old = detached if old_logp is None else torch.where(counted, old_logp, detached)
    if ref_logp is not None:
        ref_logp = torch.where(counted, ref_logp, detached)
    if full_kl is not None:
        full_kl = torch.where(counted, full_kl, torch.zeros_like(full_kl))
    adv = torch.where(counted, adv, torch.zeros_like(adv))
    surrogate, importance_sampling = config.surrogate, config.importance_sampling
    log_ratio = logp - old
    if config.log_ratio_clamp is not None:
        log_ratio = clamp(log_ratio, -config.log_ratio_clamp, config.log_ratio_clamp)
    token_log_ratio = log_ratio
    if surrogate == "gmpo":
        log_ratio = gmpo_log_ratio(log_ratio, adv, config)
    if surrogate == "vespo":  # phi from the clamped log-weight sum, rollout IS folded in
        log_ratio = _vespo_log_weight(log_ratio, mask_f, is_weights)
    elif importance_sampling == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, mask_f)
    elif importance_sampling == "sequence-sum":  # RLOO: the summed log-ratio of the sequence
        log_ratio = (log_ratio * mask_f).sum(-1, keepdim=True).expand_as(log_ratio)
    elif importance_sampling == "sequence-token":  # the sequence's value, each token's gradient
        own = logp if config.log_ratio_clamp is None else token_log_ratio  # (none if clamped)
        log_ratio = sequence_log_ratio(log_ratio.detach(), mask_f) + (own - own.detach())
    ratio = torch.exp(log_ratio)
    loss, clipped, low, high, aux = surrogate_terms(
        ratio, logp, adv, config, token_log_ratio.detach()
    )
    if surrogate == "vespo":  # the metrics (and a bias-corrected KL) see the token's ratio
        ratio = torch.exp(token_log_ratio)
    if is_weights is not None and surrogate != "vespo":
        loss = loss * torch.where(counted, is_weights, torch.ones_like(is_weights))
    if keep is not None:
        loss = loss * torch.where(counted, keep.to(loss.dtype), torch.ones_like(loss))
    terms = {
        "ratio": ratio,
        "clipped": clipped,
        "clipped_low": low,
        "clipped_high": high,
        "aux": aux,
        "neg_log_ratio": old - logp,
    }
    if ref_logp is not None or full_kl is not None:
        if full_kl is not None:
            kl_tok = full_kl
        else:
            kl_tok = kl_estimate(logp, ref_logp, config.kl_estimator)
        terms["kl"] = kl_tok
        if config.kl_bias_correction:  # TRL's kl metric under bias correction
            terms["kl_bias_corrected"] = kl_tok * ratio
        if config.beta != 0.0:
            kl_term = kl_tok * ratio if config.kl_bias_correction else kl_tok
            loss = loss + config.beta * kl_term
    if entropy is not None:
        terms["entropy"] = entropy
        if config.entropy_coef != 0.0:  # entropy_scale: the bonus as a token mean
            bonus = entropy if entropy_scale is None else entropy_scale * entropy
            loss = loss - config.entropy_coef * bonus
    terms["loss"] = loss
    return terms
