"""Layer 2, token layer: loss math on per-token numbers (Triton device functions).

Used as the epilogue of the vocab-stream forward (so a token-level loss costs one pass over
the logits) and by the token-space kernels. Each function returns the value and its
derivative w.r.t. ``logp`` so the backward needs only the per-token coefficients.
"""

import triton
import triton.language as tl

from .common import clamp, nan_min


@triton.jit
def k3_and_expm1(n):
    """``(exp(n) - n - 1, exp(n) - 1)`` without the cancellation of the direct formulas near
    ``n = 0`` (fp32 would lose ~6% of k3 at |n| ~ 1e-3): a Horner series for |n| < 1/2
    (truncation < 1e-20 relative), the direct formulas beyond."""
    small = tl.abs(n) < 0.5
    t = tl.where(small, n, 0.0)  # the series never sees a large n
    q = 1.0 + t / 18.0
    for k in tl.static_range(17, 2, -1):
        q = 1.0 + t / k * q
    k3_series = 0.5 * t * t * q  # n^2/2 (1 + n/3 (1 + n/4 (...)))
    e = tl.exp(n)
    k3 = tl.where(small, k3_series, e - n - 1.0)
    em1 = tl.where(small, t + k3_series, e - 1.0)
    return k3, em1


@triton.jit
def kl_and_grad(logp, ref_logp, KIND: tl.constexpr):
    """``(kl, d kl / d logp)`` for ``log_ratio = logp - ref_logp``; clamps pass gradient
    inclusively at their bounds, as ``torch.clamp`` does.

    ``KIND`` indexes ``fused_rl.reference.kl.KL_KINDS``: 0 k1, 1 k2, 2 k3, 3 low_var_kl, 4 abs.
    """
    d = logp - ref_logp
    if KIND == 0:
        kl = d
        grad = tl.zeros_like(d) + 1.0  # not d * 0 + 1: NaN at d = +-inf (padding)
    elif KIND == 1:
        kl = 0.5 * d * d
        grad = d
    elif KIND == 2:
        kl, em1 = k3_and_expm1(-d)
        grad = -em1  # 1 - exp(-d)
    elif KIND == 3:
        neg = clamp(-d, -20.0, 20.0)
        raw, em1 = k3_and_expm1(neg)
        kl = clamp(raw, -10.0, 10.0)
        inside = (-d >= -20.0) & (-d <= 20.0) & (raw >= -10.0) & (raw <= 10.0)
        grad = tl.where(inside, -em1, 0.0)
    else:
        kl = tl.abs(d)
        grad = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return kl, grad


@triton.jit
def _min_weight(a, b):
    """d min(a, b) / da as torch.minimum does it: 1, 0, or 0.5 on a tie."""
    return tl.where(a < b, 1.0, tl.where(a == b, 0.5, 0.0))


@triton.jit
def clipped_surrogate(
    ratio,
    adv,
    eps_low,
    eps_high,
    dual_clip,
    delta,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
):
    """``(loss, d loss / d ratio, code)`` of ``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``.

    ``USE_DELTA``: the unclipped ratio is capped at ``delta`` first (TRL's two-sided clip).
    ``USE_DUAL``: where ``A < 0`` the loss is capped at ``-dual_clip * A``.
    ``code`` packs bit flags: 1 the clipped branch strictly chosen, 2 at the low bound,
    4 at the high bound, 8 the dual clip active (unpacked in ``fused_rl.losses``).
    """
    lo = 1.0 - eps_low
    hi = 1.0 + eps_high
    if USE_DELTA:
        r_unc = nan_min(ratio, delta)
        d_unc = tl.where(ratio <= delta, 1.0, 0.0)
    else:
        r_unc = ratio
        d_unc = 1.0
    r_clip = clamp(ratio, lo, hi)
    d_clip = tl.where((ratio >= lo) & (ratio <= hi), 1.0, 0.0)
    s_unc = r_unc * adv
    s_clip = r_clip * adv
    w_unc = _min_weight(s_unc, s_clip)
    loss = -nan_min(s_unc, s_clip)
    dloss = -(w_unc * d_unc + (1.0 - w_unc) * d_clip) * adv
    clipped = s_clip < s_unc
    code = tl.where(clipped, 1, 0)
    code += tl.where(clipped & (ratio < lo), 2, 0)
    code += tl.where(clipped & (ratio > hi), 4, 0)
    if USE_DUAL:
        cap = -dual_clip * adv
        negative = adv < 0
        dloss = tl.where(negative, _min_weight(loss, cap) * dloss, dloss)
        code += tl.where(negative & (loss > cap), 8, 0)
        loss = tl.where(negative, nan_min(loss, cap), loss)
    return loss, dloss, code


# Columns of the per-token partial sums every policy-loss forward writes (``(N_COLS, rows)``,
# column-major) and ``_policy_finalize_kernel`` reduces; ``fused_rl._policy_partials`` names
# them. Each holds ``m * x`` for the token's weight ``m`` (mask * not-ignored), 0 elsewhere.
COL_COUNT = tl.constexpr(0)
COL_LOSS = tl.constexpr(1)
COL_CLIPPED = tl.constexpr(2)
COL_CLIPPED_LOW = tl.constexpr(3)
COL_CLIPPED_HIGH = tl.constexpr(4)
COL_DUAL = tl.constexpr(5)
COL_RATIO = tl.constexpr(6)
COL_APPROX_KL = tl.constexpr(7)
COL_KL = tl.constexpr(8)
COL_ENTROPY = tl.constexpr(9)
COL_RATIO_MAX = tl.constexpr(10)  # the ratio itself (reduced with max, not sum)


@triton.jit
def policy_token_loss(
    logp,
    entropy,
    log_ratio,
    adv,
    ref_logp,
    eps_low,
    eps_high,
    dual_clip,
    delta,
    beta,
    entropy_coef,
    HAS_REF: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
):
    """Per-token policy loss on scalars or blocks: ``(loss, dloss/dratio, ratio, code, kl,
    dkl/dlogp)`` with ``ratio = exp(log_ratio)``; ``kl``/``dkl`` are 0 without ``HAS_REF``.

    ``loss = -min(r A, clip(r) A) [capped] + beta kl(logp, ref) - entropy_coef H``.
    """
    ratio = tl.exp(log_ratio)
    loss, dloss_dratio, code = clipped_surrogate(
        ratio, adv, eps_low, eps_high, dual_clip, delta, USE_DUAL, USE_DELTA
    )
    kl = logp * 0.0
    dkl = logp * 0.0
    if HAS_REF:
        kl, dkl = kl_and_grad(logp, ref_logp, KL_KIND)
        if ADD_KL:
            loss += beta * kl
    if ENTROPY_BONUS:
        loss -= entropy_coef * entropy
    return loss, dloss_dratio, ratio, code, kl, dkl


@triton.jit
def _flag(code, bit: tl.constexpr, counted, m):
    return tl.where(counted & ((code & bit) != 0), m, m * 0.0)


@triton.jit
def store_policy_partials(
    part_ptr, n_rows, rows, store_mask, m, loss, code, ratio, neg_log_ratio, kl, entropy
):
    """Write one token's (or a block's) ``m * x`` for every metric column; tokens with
    ``m == 0`` write exact zeros whatever their (possibly NaN / inf) values."""
    counted = m != 0
    zero = m * 0.0
    col = part_ptr + rows
    tl.store(col + COL_COUNT * n_rows, m, mask=store_mask)
    tl.store(col + COL_LOSS * n_rows, tl.where(counted, m * loss, zero), mask=store_mask)
    tl.store(col + COL_CLIPPED * n_rows, _flag(code, 1, counted, m), mask=store_mask)
    tl.store(col + COL_CLIPPED_LOW * n_rows, _flag(code, 2, counted, m), mask=store_mask)
    tl.store(col + COL_CLIPPED_HIGH * n_rows, _flag(code, 4, counted, m), mask=store_mask)
    tl.store(col + COL_DUAL * n_rows, _flag(code, 8, counted, m), mask=store_mask)
    tl.store(col + COL_RATIO * n_rows, tl.where(counted, m * ratio, zero), mask=store_mask)
    nlr = tl.where(counted, m * neg_log_ratio, zero)
    tl.store(col + COL_APPROX_KL * n_rows, nlr, mask=store_mask)
    tl.store(col + COL_KL * n_rows, tl.where(counted, m * kl, zero), mask=store_mask)
    tl.store(col + COL_ENTROPY * n_rows, tl.where(counted, m * entropy, zero), mask=store_mask)
    tl.store(col + COL_RATIO_MAX * n_rows, tl.where(counted, ratio, zero), mask=store_mask)
