"""Independent oracle of ``fused_rl.policy_loss``, written from the issue's formulas.

Plain autograd PyTorch, no import from ``fused_rl``. Run it on float64 logits for the
oracle, or on bf16 logits for the "eager bf16" baseline that sets the bf16 tolerance.
The surrogate is written in DI-engine's max/min form (``-max(min(rA, clip(r)A), cA)``),
not in the library's ``-min`` form, so the two codings check each other.
"""

from __future__ import annotations

import torch
from helpers import clamp_in


def _kl(logp, ref, kind):
    d = logp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2
    if kind == "k3":
        return torch.exp(-d) + d - 1
    if kind == "low_var_kl":
        x = clamp_in(ref - logp, -20.0, 20.0)
        return clamp_in(torch.exp(x) - x - 1, -10.0, 10.0)
    if kind == "abs":
        return torch.abs(d)
    raise AssertionError(kind)


def _promoted(x, work):
    """Eager type promotion: fp32 log-probs stay fp32 next to bf16 logits."""
    return x.to(torch.promote_types(x.dtype, work))


def _masked_mean(x, m):
    n = m.sum()
    return (x * m).sum() / n if n > 0 else x.new_zeros(())


def _seq_extreme(x, m, pick):
    shares = [(x[b] * m[b]).sum() / m[b].sum() for b in range(x.shape[0]) if m[b].sum() > 0]
    return pick(shares) if shares else x.new_zeros(())


def _seq_mean(x, m):
    shares = [(x[b] * m[b]).sum() / m[b].sum() for b in range(x.shape[0]) if m[b].sum() > 0]
    return torch.stack(shares).mean() if shares else x.new_zeros(())


def oracle_policy_loss(
    logits,
    targets,
    advantages,
    *,
    old_logprobs=None,
    ref_logprobs=None,
    mask=None,
    temperature=1.0,
    eps_low=0.2,
    eps_high=None,
    dual_clip=None,
    delta=None,
    beta=0.0,
    kl_estimator="k3",
    entropy_coef=0.0,
    with_entropy=False,
    importance_sampling="token",
    loss_agg="token-mean",
    max_length=None,
    num_items=None,
    ignore_index=-100,
    log_ratio_clamp=None,
    ref_logits=None,
    kl_bias_correction=False,
):
    """``(loss, metrics)`` in the dtype of ``logits`` (call it with ``logits.double()``).

    ``ref_logits`` (``(B, T, V)``, for ``kl_estimator="full"``): the exact per-token
    ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, ``q = softmax(ref_logits / T)``."""
    n_seq, length, _ = logits.shape
    work = logits.dtype
    log_p = torch.log_softmax(logits / temperature, dim=-1)
    counted = targets != ignore_index
    m = counted.to(work) if mask is None else mask.to(work) * counted
    safe_t = torch.where(counted, targets, torch.zeros_like(targets)).long()
    logp = log_p.gather(-1, safe_t[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)

    adv = advantages.to(work)
    if adv.dim() == 1:
        adv = adv[:, None].expand(n_seq, length)
    old = logp.detach() if old_logprobs is None else _promoted(old_logprobs, work)
    log_ratio = logp - old
    if log_ratio_clamp is not None:  # verl's clamp: the ratio of the clamped log-ratio
        log_ratio = clamp_in(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    if importance_sampling == "sequence":
        n = m.sum(-1)
        per_seq = (m * log_ratio).sum(-1) / torch.where(n > 0, n, torch.ones_like(n))
        log_ratio = per_seq[:, None].expand(n_seq, length)
    elif importance_sampling == "sequence-sum":
        log_ratio = (m * log_ratio).sum(-1)[:, None].expand(n_seq, length)
    elif importance_sampling != "token":
        raise ValueError(f"the oracle has no importance_sampling={importance_sampling!r}")
    ratio = torch.exp(log_ratio)

    lo = 1.0 - eps_low
    hi = 1.0 + (eps_low if eps_high is None else eps_high)
    capped = ratio if delta is None else torch.minimum(ratio, torch.full_like(ratio, delta))
    surr1 = capped * adv
    surr2 = clamp_in(ratio, lo, hi) * adv
    objective = torch.minimum(surr1, surr2)
    clipped = surr2 < surr1
    if dual_clip is not None:
        floor = dual_clip * adv
        dual = (adv < 0) & (objective < floor)
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    else:
        dual = torch.zeros_like(clipped)
    per_token = -objective
    kl_tok = None
    if ref_logprobs is not None:
        kl_tok = _kl(logp, _promoted(ref_logprobs, work), kl_estimator)
    if ref_logits is not None:
        log_q = torch.log_softmax(ref_logits.to(work) / temperature, dim=-1)
        p = log_p.exp()
        kl_tok = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)
    if kl_tok is not None:
        per_token = per_token + beta * (kl_tok * ratio if kl_bias_correction else kl_tok)
    per_token = per_token - entropy_coef * entropy
    # never let a non-counted token's value reach the sum (0 * inf would be NaN)
    contrib = torch.where(m != 0, per_token * m, torch.zeros_like(per_token))

    if loss_agg == "token-mean":
        den = (
            m.sum()
            if num_items is None
            else torch.as_tensor(num_items, dtype=work, device=m.device)
        )
        loss = contrib.sum() / den if den > 0 else contrib.sum() * 0
    elif loss_agg == "seq-mean-token-mean":
        rows = []
        for b in range(n_seq):
            n_b = m[b].sum()
            rows.append(contrib[b].sum() / n_b if n_b > 0 else contrib[b].sum() * 0)
        loss = torch.stack(rows).mean()
    elif loss_agg == "seq-mean-token-sum":
        loss = contrib.sum() / n_seq
    elif loss_agg == "seq-mean-token-sum-norm":
        loss = contrib.sum() / (n_seq * (length if max_length is None else max_length))
    else:
        raise AssertionError(loss_agg)

    with torch.no_grad():
        keep = m != 0
        r = ratio.detach()
        metrics = {
            "clip_frac": _masked_mean(clipped.to(work), m),
            "clip_frac_low": _masked_mean((clipped & (r < lo)).to(work), m),
            "clip_frac_high": _masked_mean((clipped & (r > hi)).to(work), m),
            "dual_clip_frac": _masked_mean(dual.to(work), m),
            "ratio_mean": _masked_mean(r, m),
            "ratio_max": r[keep].max() if keep.any() else r.new_zeros(()),
            "approx_kl": _masked_mean(old - logp.detach(), m),
            # per sequence: the weighted share of clipped tokens; the extreme over sequences
            # that have a counted token (0 when none has)
            "clip_frac_low_seq_min": _seq_extreme((clipped & (r < lo)).to(work), m, min),
            "clip_frac_high_seq_max": _seq_extreme((clipped & (r > hi)).to(work), m, max),
            "clip_frac_low_seq_mean": _seq_mean((clipped & (r < lo)).to(work), m),
            "clip_frac_high_seq_mean": _seq_mean((clipped & (r > hi)).to(work), m),
        }
        if kl_tok is not None:
            metrics["kl"] = _masked_mean(kl_tok.detach(), m)
            if kl_bias_correction:
                metrics["kl_bias_corrected"] = _masked_mean((kl_tok * ratio).detach(), m)
        if entropy_coef != 0 or with_entropy:
            metrics["entropy"] = _masked_mean(entropy.detach(), m)
    return loss, metrics
