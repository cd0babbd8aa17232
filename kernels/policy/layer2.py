"""Layer 2, token layer: loss math on per-token numbers (Triton device functions).

Used as the epilogue of the vocab-stream forward (so a token-level loss costs one pass over
the logits) and by the token-space kernels. Each function returns the value and its
derivative w.r.t. ``logp`` so the backward needs only the per-token coefficients.
"""

import triton
import triton.language as tl

from ..common import clamp, nan_max, nan_min, pair
from ..modes import KL_KINDS, POLICY_COLUMNS, POLICY_PARAMS, SEQUENCE_METRICS, SURROGATES

KL_K1 = tl.constexpr(KL_KINDS.index("k1"))
KL_K2 = tl.constexpr(KL_KINDS.index("k2"))
KL_K3 = tl.constexpr(KL_KINDS.index("k3"))
KL_LOW_VAR = tl.constexpr(KL_KINDS.index("low_var_kl"))
KL_ABS = tl.constexpr(KL_KINDS.index("abs"))
KL_FULL = tl.constexpr(KL_KINDS.index("full"))


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
    inclusively at their bounds, as ``fused_rl/reference/clamp.py`` (torch <= 2.13's clamp).

    ``KIND`` indexes ``kernels/modes.py`` ``KL_KINDS`` (``abs`` is the ``else``; ``full`` is not
    an estimate from two log-probs: ``policy_token_loss`` takes it as given).
    """
    d = logp - ref_logp
    if KIND == KL_K1:
        kl = d
        grad = tl.zeros_like(d) + 1.0  # not d * 0 + 1: NaN at d = +-inf (padding)
    elif KIND == KL_K2:
        kl = 0.5 * d * d
        grad = d
    elif KIND == KL_K3:
        kl, em1 = k3_and_expm1(-d)
        grad = -em1  # 1 - exp(-d)
    elif KIND == KL_LOW_VAR:
        neg = clamp(-d, -20.0, 20.0)
        raw, em1 = k3_and_expm1(neg)
        kl = clamp(raw, -10.0, 10.0)
        inside = (-d >= -20.0) & (-d <= 20.0) & (raw >= -10.0) & (raw <= 10.0)
        grad = tl.where(inside, -em1, 0.0)
    else:  # every other kind is refused in Python (``full`` is not an estimate)
        tl.static_assert(KIND == KL_ABS, "kl_and_grad: not an estimate from two log-probs")
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
    r_unc = nan_min(ratio, delta) if USE_DELTA else ratio
    r_clip = clamp(ratio, lo, hi)
    s_unc = r_unc * adv
    s_clip = r_clip * adv
    w_unc = _min_weight(s_unc, s_clip)
    loss = -nan_min(s_unc, s_clip)
    # each branch's share through a where, not a product with its clamp's 0 / 1 derivative:
    # a clamp at its bound passes exactly 0, even with a NaN advantage (as torch.clamp does)
    d_unc = w_unc * adv
    if USE_DELTA:
        d_unc = tl.where(ratio <= delta, d_unc, 0.0)
    d_clip = tl.where((ratio >= lo) & (ratio <= hi), (1.0 - w_unc) * adv, 0.0)
    dloss = -(d_unc + d_clip)
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
# column-major; kernels/modes.py POLICY_COLUMNS) and ``finalize.py`` reduces. Each holds
# ``m * x`` for the token's weight ``m`` (mask * not-ignored), 0 elsewhere.
COL_COUNT = tl.constexpr(POLICY_COLUMNS.index("count"))
COL_LOSS = tl.constexpr(POLICY_COLUMNS.index("loss"))
COL_CLIPPED = tl.constexpr(POLICY_COLUMNS.index("clip_frac"))
COL_CLIPPED_LOW = tl.constexpr(POLICY_COLUMNS.index("clip_frac_low"))
COL_CLIPPED_HIGH = tl.constexpr(POLICY_COLUMNS.index("clip_frac_high"))
COL_AUX = tl.constexpr(POLICY_COLUMNS.index("aux"))  # the surrogate's own metric
COL_RATIO = tl.constexpr(POLICY_COLUMNS.index("ratio_mean"))
COL_APPROX_KL = tl.constexpr(POLICY_COLUMNS.index("approx_kl"))
COL_KL = tl.constexpr(POLICY_COLUMNS.index("kl"))
COL_ENTROPY = tl.constexpr(POLICY_COLUMNS.index("entropy"))
COL_RATIO_MAX = tl.constexpr(POLICY_COLUMNS.index("ratio_max"))  # the ratio (reduced: max)
COL_KL_CORRECTED = tl.constexpr(POLICY_COLUMNS.index("kl_bias_corrected"))  # kl * ratio
# rollout IS weights, written only with them (HAS_IS) and reduced only then: m * w (mean),
# w at counted tokens (+inf elsewhere, reduced with min), w (0 elsewhere, reduced with max)
COL_IS = tl.constexpr(POLICY_COLUMNS.index("is_weight_mean"))
COL_IS_MIN = tl.constexpr(POLICY_COLUMNS.index("is_weight_min"))
COL_IS_MAX = tl.constexpr(POLICY_COLUMNS.index("is_weight_max"))
# the finalize kernel's outputs past the columns (kernels/modes.py SEQUENCE_METRICS)
OUT_LOW_SEQ_MIN = tl.constexpr(
    len(POLICY_COLUMNS) + SEQUENCE_METRICS.index("clip_frac_low_seq_min")
)
OUT_HIGH_SEQ_MAX = tl.constexpr(
    len(POLICY_COLUMNS) + SEQUENCE_METRICS.index("clip_frac_high_seq_max")
)
OUT_LOW_SEQ_MEAN = tl.constexpr(
    len(POLICY_COLUMNS) + SEQUENCE_METRICS.index("clip_frac_low_seq_mean")
)
OUT_HIGH_SEQ_MEAN = tl.constexpr(
    len(POLICY_COLUMNS) + SEQUENCE_METRICS.index("clip_frac_high_seq_mean")
)
OUT_AUX_SEQ_MEAN = tl.constexpr(len(POLICY_COLUMNS) + SEQUENCE_METRICS.index("aux_seq_mean"))


SURROGATE_PPO = tl.constexpr(SURROGATES.index("ppo"))
SURROGATE_CISPO = tl.constexpr(SURROGATES.index("cispo"))
SURROGATE_SAPO = tl.constexpr(SURROGATES.index("sapo"))
SURROGATE_GPG = tl.constexpr(SURROGATES.index("gpg"))
SURROGATE_GMPO = tl.constexpr(SURROGATES.index("gmpo"))
SURROGATE_VESPO = tl.constexpr(SURROGATES.index("vespo"))

# positions in the ``hyper`` tuple of fp32 pairs (kernels/modes.py POLICY_PARAMS)
P_EPS_LOW = tl.constexpr(POLICY_PARAMS.index("eps_low"))
P_EPS_HIGH = tl.constexpr(POLICY_PARAMS.index("eps_high"))
P_DUAL_CLIP = tl.constexpr(POLICY_PARAMS.index("dual_clip"))
P_DELTA = tl.constexpr(POLICY_PARAMS.index("delta"))
P_BETA = tl.constexpr(POLICY_PARAMS.index("beta"))
P_ENTROPY_COEF = tl.constexpr(POLICY_PARAMS.index("entropy_coef"))
P_SP0 = tl.constexpr(POLICY_PARAMS.index("sp0"))
P_SP1 = tl.constexpr(POLICY_PARAMS.index("sp1"))
P_SP2 = tl.constexpr(POLICY_PARAMS.index("sp2"))
P_SP3 = tl.constexpr(POLICY_PARAMS.index("sp3"))
P_LOG_RATIO_CLAMP = tl.constexpr(POLICY_PARAMS.index("log_ratio_clamp"))


@triton.jit
def param(hyper, INDEX: tl.constexpr, ACC: tl.constexpr):
    """Hyper-parameter ``INDEX`` (a ``P_*`` position) of the ``hyper`` tuple, recombined from
    its fp32 pair in ``ACC``: fp64-exact for fp64 inputs (gradcheck, the oracles)."""
    return pair(hyper[2 * INDEX], hyper[2 * INDEX + 1], ACC)


@triton.jit
def token_log_ratio(logp, old, hyper, ACC: tl.constexpr):
    """``(log_ratio, inside)``: each token's ``logp - old``, clamped to ``[-c, c]`` by the
    ``log_ratio_clamp`` option ``c`` (``+inf``: off), and where its gradient passes (as
    the reference's ``clamp``: inclusive bounds, none at NaN; everywhere when off, so a NaN
    keeps its NaN gradient)."""
    c = param(hyper, P_LOG_RATIO_CLAMP, ACC)
    d = logp - old
    inside = tl.where(c == float("inf"), 1, tl.where((d >= -c) & (d <= c), 1, 0)) != 0
    return clamp(d, -c, c), inside


LN_1E_8 = tl.constexpr(-18.420680743952367)  # log(1e-8), VESPO's floor on the log-weight


@triton.jit
def gmpo_log_ratio(log_ratio, adv, eps_low, eps_high):
    """GMPO's token log-ratio clipped in log space on the advantage's side:
    ``(sign(A) min(sign(A) d, sign(A) clamp(d, -eps_low, eps_high)), d/d logp)`` with ``d``
    the token's log-ratio; ``A = 0`` gives ``(0, 0)`` (verl's ``geo_mean``)."""
    clipped = clamp(log_ratio, -eps_low, eps_high)
    up = adv > 0
    down = adv < 0
    value = tl.where(up, nan_min(log_ratio, clipped), nan_max(log_ratio, clipped))
    value = tl.where(up | down, value, 0.0)
    frozen = (up & (log_ratio > eps_high)) | (down & (log_ratio < -eps_low))
    grad = tl.where((up | down) & ~frozen, 1.0, 0.0)
    return value, grad


@triton.jit
def surrogate_loss(
    logp, log_ratio, token_log_ratio, adv, hyper, SURROGATE: tl.constexpr,
    USE_DUAL: tl.constexpr, USE_DELTA: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The policy term of one token: ``(loss, d loss / d log_ratio, d loss / d logp direct,
    ratio, code, aux)``; ``code`` packs the clip flags (1 clipped, 2 low, 4 high), ``aux`` is
    the surrogate's own metric (``fused_rl._policy_ops.AUX_METRIC``).

    * ppo: ``-min(r A, clip(r) A)`` with the ``delta`` / dual-clip caps; aux: dual clip active;
    * cispo: ``-sg(clamp(r, 1-eps_low, 1+eps_high)) A logp``; flags: ``r`` outside the band
      (verl's two-sided ``pg_clipfrac``); aux: ``r > 1+eps_high and A > 0`` (TRL / Liger);
    * sapo: ``-A sigmoid(tau (r-1)) 4/tau``, ``tau`` = ``tau_pos`` where ``A > 0`` else
      ``tau_neg``; aux: that soft gate;
    * gpg: ``-A logp`` (REINFORCE); aux 0;
    * gmpo: ``-A r`` with ``r`` the geometric-mean ratio built by the sequence pass from
      :func:`gmpo_log_ratio`; flags from this token's own log-ratio ``token_log_ratio``
      (frozen by the log-space clip: 2 low where ``A < 0``, 4 high where ``A > 0``);
    * vespo: ``-sg(phi) A logp`` with ``log_ratio`` the sequence's log-weight sum ``S`` (the
      sequence pass), ``ln w = clamp(S, ln 1e-8, 20)``, ``phi = exp(lam + k ln w - lam w)``
      (0 where not finite), ``(k, lam)`` = ``(sp0, sp1)`` where ``A >= 0`` else
      ``(sp2, sp3)``, ``lam >= 1e-4``; aux: ``phi``.

    ``sp0 ... sp3`` are the surrogate's own parameters (sapo: ``tau_pos``, ``tau_neg``).
    """
    eps_low = param(hyper, P_EPS_LOW, ACC)
    eps_high = param(hyper, P_EPS_HIGH, ACC)
    ratio = tl.exp(log_ratio)
    zero = tl.zeros_like(logp)  # not logp * 0.0: NaN at logp = -inf
    d_direct = zero
    aux = zero
    if SURROGATE == SURROGATE_PPO:
        dual_clip = param(hyper, P_DUAL_CLIP, ACC)
        delta = param(hyper, P_DELTA, ACC)
        loss, dloss_dratio, code = clipped_surrogate(
            ratio, adv, eps_low, eps_high, dual_clip, delta, USE_DUAL, USE_DELTA
        )
        d_ratio = dloss_dratio * ratio
        aux = tl.where((code & 8) != 0, 1.0, 0.0)
        code = code & 7
    elif SURROGATE == SURROGATE_CISPO:
        lo = 1.0 - eps_low
        hi = 1.0 + eps_high
        weight = clamp(ratio, lo, hi)  # a constant (stop-gradient) weight
        loss = -weight * adv * logp
        d_ratio = zero
        d_direct = -weight * adv
        low = ratio < lo
        high = ratio > hi
        code = tl.where(low | high, 1, 0) + tl.where(low, 2, 0) + tl.where(high, 4, 0)
        aux = tl.where(high & (adv > 0), 1.0, 0.0)
    elif SURROGATE == SURROGATE_SAPO:
        tau = tl.where(adv > 0, param(hyper, P_SP0, ACC), param(hyper, P_SP1, ACC))
        gate = tl.sigmoid(tau * (ratio - 1.0))
        aux = gate * 4.0 / tau
        loss = -adv * aux
        d_ratio = -adv * 4.0 * gate * (1.0 - gate) * ratio  # tau cancels
        code = tl.where(ratio != ratio, 0, 0)
    elif SURROGATE == SURROGATE_GPG:
        loss = -adv * logp
        d_ratio = zero
        d_direct = -adv
        code = tl.where(ratio != ratio, 0, 0)
    elif SURROGATE == SURROGATE_GMPO:
        loss = -adv * ratio
        d_ratio = loss
        low = (adv < 0) & (token_log_ratio < -eps_low)
        high = (adv > 0) & (token_log_ratio > eps_high)
        code = tl.where(low | high, 1, 0) + tl.where(low, 2, 0) + tl.where(high, 4, 0)
    else:
        log_w = clamp(log_ratio, LN_1E_8, 20.0)
        positive = adv >= 0
        k = tl.where(positive, param(hyper, P_SP0, ACC), param(hyper, P_SP2, ACC))
        lam = tl.where(positive, param(hyper, P_SP1, ACC), param(hyper, P_SP3, ACC))
        lam = nan_max(lam, 1e-4)
        phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
        phi = tl.where(tl.abs(phi) < float("inf"), phi, 0.0)  # NaN / inf -> 0, as TRL
        aux = phi
        ratio = tl.exp(token_log_ratio)  # for the metrics and a bias-corrected KL
        loss = -phi * adv * logp
        d_ratio = zero
        d_direct = -phi * adv
        code = tl.where(ratio != ratio, 0, 0)
    return loss, d_ratio, d_direct, ratio, code, aux


@triton.jit
def policy_token_loss(
    logp,
    entropy,
    log_ratio,
    token_log_ratio,
    adv,
    ref_logp,
    is_weight,
    keep,
    hyper,
    ent_scale,
    SURROGATE: tl.constexpr,
    HAS_REF: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    BIAS_KL: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per-token policy loss on scalars or blocks: ``(loss, d_ratio, d_direct, ratio, code,
    aux, kl)``.

    ``loss = keep * is_weight * surrogate + beta kl(logp, ref) [* r] - entropy_coef c H``:
    the rollout IS weight multiplies the policy term only (VESPO folds it into ``phi``
    instead), and so does ``keep``, 1 or 0 where a token-selection mask drops the policy
    term (the top-entropy selection, the off-policy sequence mask; a product, as TRL's
    ``per_token_loss * mask``); ``BIAS_KL`` multiplies the KL by the
    ratio ``r``, NOT detached (DeepSeek-V3.2, TRL's ``use_bias_correction_kl``).
    ``d_ratio`` is the derivative through ``log_ratio`` (a sequence ratio passes it on to
    every token of the sequence; ``token_log_ratio`` is the token's own, for GMPO's flags),
    ``d_direct`` the one through this token's ``logp`` alone;
    at token level ``dL/dlogp = d_ratio + d_direct``. ``kl`` is 0 without ``HAS_REF``.
    ``KL_KIND == KL_FULL``: ``ref_logp`` is the token's exact ``KL(p || q)`` over the
    vocabulary (``kernels/vocab/pair.py``), whose gradient reaches the logits through
    layer 3 with ``dL/dKL = beta [* r]``, not through ``logp``.
    ``ent_scale`` (``c``): 1, or the factor that makes the bonus a token mean whatever the
    loss aggregation (``entropy_agg="token-mean"``, ``fused_rl._policy_inputs``).
    """
    loss, d_ratio, d_direct, ratio, code, aux = surrogate_loss(
        logp, log_ratio, token_log_ratio, adv, hyper, SURROGATE, USE_DUAL, USE_DELTA, ACC
    )
    term_weight = keep
    if SURROGATE != SURROGATE_VESPO:  # VESPO folds the IS weights into phi
        term_weight = is_weight * keep
    loss = loss * term_weight
    d_ratio = d_ratio * term_weight
    d_direct = d_direct * term_weight
    kl = tl.zeros_like(logp)
    if HAS_REF:
        if KL_KIND == KL_FULL:  # the exact KL, from the vocab stream: no gradient via logp
            kl = ref_logp
            dkl = tl.zeros_like(logp)
        else:
            kl, dkl = kl_and_grad(logp, ref_logp, KL_KIND)
        if ADD_KL:
            beta = param(hyper, P_BETA, ACC)
            if BIAS_KL:
                loss += beta * kl * ratio
                d_ratio += beta * kl * ratio
                d_direct += beta * dkl * ratio
            else:
                loss += beta * kl
                d_direct += beta * dkl
    if ENTROPY_BONUS:
        loss -= param(hyper, P_ENTROPY_COEF, ACC) * ent_scale * entropy
    return loss, d_ratio, d_direct, ratio, code, aux, kl


@triton.jit
def _flag(code, bit: tl.constexpr, counted, m):
    return tl.where(counted & ((code & bit) != 0), m, m * 0.0)


@triton.jit
def store_policy_partials(
    part_ptr,
    n_rows,
    rows,
    store_mask,
    m,
    loss,
    code,
    aux,
    ratio,
    neg_log_ratio,
    kl,
    entropy,
    is_weight,
    HAS_IS: tl.constexpr,
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
    tl.store(col + COL_AUX * n_rows, tl.where(counted, m * aux, zero), mask=store_mask)
    tl.store(col + COL_RATIO * n_rows, tl.where(counted, m * ratio, zero), mask=store_mask)
    nlr = tl.where(counted, m * neg_log_ratio, zero)
    tl.store(col + COL_APPROX_KL * n_rows, nlr, mask=store_mask)
    tl.store(col + COL_KL * n_rows, tl.where(counted, m * kl, zero), mask=store_mask)
    tl.store(col + COL_ENTROPY * n_rows, tl.where(counted, m * entropy, zero), mask=store_mask)
    tl.store(col + COL_RATIO_MAX * n_rows, tl.where(counted, ratio, zero), mask=store_mask)
    kl_corrected = tl.where(counted, m * kl * ratio, zero)  # TRL's bias-corrected kl metric
    tl.store(col + COL_KL_CORRECTED * n_rows, kl_corrected, mask=store_mask)
    if HAS_IS:
        w = is_weight + zero
        tl.store(col + COL_IS * n_rows, tl.where(counted, m * w, zero), mask=store_mask)
        tl.store(col + COL_IS_MIN * n_rows, tl.where(counted, w, float("inf")), mask=store_mask)
        tl.store(col + COL_IS_MAX * n_rows, tl.where(counted, w, zero), mask=store_mask)
