"""Layer 2 as a kernel of its own, on ``(B, T)`` tensors (no logits row in sight).

``_policy_token_fwd_kernel`` -- one program per sequence: the token layer of
``policy_loss_from_logprobs`` and of sequence-level importance sampling (GSPO, GMPO,
VESPO), whose ratio or weight needs the whole sequence's log-probs before any token's loss.
Writes the same ``g``, ``h`` and partials as the fused vocab-stream forward
(``vocab/policy_fused.py``); ``finalize.py`` reduces them.
"""

import triton
import triton.language as tl

from ..common import as_weight, clamp, token_offset
from .layer2 import (
    KL_FULL,
    LN_1E_8,
    P_BETA,
    P_ENTROPY_COEF,
    P_EPS_HIGH,
    P_EPS_LOW,
    SURROGATE_GMPO,
    SURROGATE_VESPO,
    gmpo_log_ratio,
    kl_and_grad,
    param,
    policy_token_loss,
    store_policy_partials,
    token_log_ratio,
)


@triton.jit
def _load_tokens(ptr, b, ts, rows_inner, stride_outer, stride_inner, in_seq):
    return tl.load(ptr + token_offset(b * rows_inner + ts, rows_inner, stride_outer, stride_inner),
                   mask=in_seq, other=0.0)  # fmt: skip


@triton.jit
def _token_inputs(
    logp_ptr, targets_ptr, adv_ptr, old_ptr, ref_ptr, mask_ptr, b, ts, in_seq, rows_inner,
    logp_so, logp_si, t_so, t_si, adv_so, adv_si, old_so, old_si, ref_so, ref_si, mask_so,
    mask_si, ignore_index, HAS_TARGETS: tl.constexpr, HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr, HAS_MASK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A block of one sequence's per-token inputs, with the values of tokens that do not
    count (weight ``m == 0``) replaced so nothing can leak from them: ``logp`` 0, ``old`` and
    ``ref`` = ``logp`` (ratio 1, KL 0), advantage 0. Returns ``(m, logp, old, ref, adv, 0)``."""
    m = tl.where(in_seq, 1.0, 0.0).to(ACC)
    if HAS_MASK:
        m = m * as_weight(
            _load_tokens(mask_ptr, b, ts, rows_inner, mask_so, mask_si, in_seq).to(ACC)
        )
    if HAS_TARGETS:  # after the weight: an ignored token never counts, whatever its weight
        target = _load_tokens(targets_ptr, b, ts, rows_inner, t_so, t_si, in_seq)
        m = tl.where(target != ignore_index, m, 0.0)
    counted = m != 0
    logp = _load_tokens(logp_ptr, b, ts, rows_inner, logp_so, logp_si, in_seq).to(ACC)
    logp = tl.where(counted, logp, 0.0)
    old = logp
    if HAS_OLD:
        old_raw = _load_tokens(old_ptr, b, ts, rows_inner, old_so, old_si, in_seq).to(ACC)
        old = tl.where(counted, old_raw, logp)
    ref = logp
    if HAS_REF:
        ref_raw = _load_tokens(ref_ptr, b, ts, rows_inner, ref_so, ref_si, in_seq).to(ACC)
        ref = tl.where(counted, ref_raw, logp)
    adv = _load_tokens(adv_ptr, b, ts, rows_inner, adv_so, adv_si, in_seq).to(ACC)
    adv = tl.where(counted, adv, 0.0)
    return m, logp, old, ref, adv, tl.zeros_like(logp)


@triton.jit(
    do_not_specialize=[
        "rows_inner",
        "ignore_index",
        "logp_stride_outer",
        "logp_stride_inner",
        "ent_stride_outer",
        "ent_stride_inner",
        "t_stride_outer",
        "t_stride_inner",
        "adv_stride_outer",
        "adv_stride_inner",
        "old_stride_outer",
        "old_stride_inner",
        "ref_stride_outer",
        "ref_stride_inner",
        "mask_stride_outer",
        "mask_stride_inner",
        "is_stride_outer",
        "is_stride_inner",
        "keep_stride_outer",
        "keep_stride_inner",
    ]
)
def _policy_token_fwd_kernel(
    logp_ptr,
    entropy_ptr,
    targets_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    mask_ptr,
    is_ptr,
    keep_ptr,
    g_ptr,
    h_ptr,
    part_ptr,
    ent_scale_ptr,
    rows_inner,
    logp_stride_outer,
    logp_stride_inner,
    ent_stride_outer,
    ent_stride_inner,
    t_stride_outer,
    t_stride_inner,
    adv_stride_outer,
    adv_stride_inner,
    old_stride_outer,
    old_stride_inner,
    ref_stride_outer,
    ref_stride_inner,
    mask_stride_outer,
    mask_stride_inner,
    is_stride_outer,
    is_stride_inner,
    keep_stride_outer,
    keep_stride_inner,
    ignore_index,
    hyper,
    SURROGATE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_IS: tl.constexpr,
    HAS_KEEP: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    BIAS_KL: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
    SEQUENCE: tl.constexpr,
    SEQ_TOKEN: tl.constexpr,
    SEQ_SUM: tl.constexpr,
    HAS_ENT_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per sequence ``b`` of ``(B, rows_inner)`` strided inputs; ``g``, ``h``
    contiguous ``(B * rows_inner,)``, partials ``(N_COLS, B * rows_inner)``.

    ``SEQUENCE``: GSPO, one ratio per sequence ``exp(sum m (logp - old) / sum m)``; the
    surrogate's gradient then reaches every token through that mean (a third pass writes
    ``g`` once the sequence's total is known). ``SEQ_TOKEN`` (GSPO-token): the value of the
    sequence ratio, the gradient through each token's own log-prob (``sg(s) r_t / sg(r_t)``):
    ``g`` is written per token, as at token level. ``SEQ_SUM`` (with ``SEQUENCE``; RLOO's):
    the ratio ``exp(sum m (logp - old))`` of the summed log-ratio, ``d r / d logp_t = r m_t``.
    ``HAS_KEEP``: ``keep`` ``(B, T)`` bytes, 0 where a token-selection mask drops the token's
    policy term (``policy_token_loss``).
    Bytes: reads the inputs once (twice with ``SEQUENCE``), writes ~14 floats per token.
    """
    b = tl.program_id(0).to(tl.int64)
    # hyper: the policy options' fp32 pairs (kernels/modes.py POLICY_PARAMS), read by ``param``
    eps_low = param(hyper, P_EPS_LOW, ACC)
    eps_high = param(hyper, P_EPS_HIGH, ACC)
    beta = param(hyper, P_BETA, ACC)
    entropy_coef = param(hyper, P_ENTROPY_COEF, ACC)
    n_rows = tl.num_programs(0).to(tl.int64) * rows_inner
    offs = tl.arange(0, BLOCK_T)
    seq_lr = tl.zeros((), ACC)
    seq_n = tl.zeros((), ACC)
    if SEQUENCE:
        acc_lr = tl.zeros((BLOCK_T,), ACC)
        acc_n = tl.zeros((BLOCK_T,), ACC)
        for t0 in range(0, rows_inner, BLOCK_T):
            ts = t0 + offs
            in_seq = ts < rows_inner
            m, logp, old, _, adv, _ = _token_inputs(
                logp_ptr, targets_ptr, adv_ptr, old_ptr, ref_ptr, mask_ptr, b, ts, in_seq,
                rows_inner, logp_stride_outer, logp_stride_inner, t_stride_outer,
                t_stride_inner, adv_stride_outer, adv_stride_inner, old_stride_outer,
                old_stride_inner, ref_stride_outer, ref_stride_inner, mask_stride_outer,
                mask_stride_inner, ignore_index, HAS_TARGETS, HAS_OLD, HAS_REF, HAS_MASK, ACC,
            )  # fmt: skip
            token_lr, _ = token_log_ratio(logp, old, hyper, ACC)
            if SURROGATE == SURROGATE_GMPO:  # the geometric mean of log-space-clipped ratios
                token_lr, _ = gmpo_log_ratio(token_lr, adv, eps_low, eps_high)
            if SURROGATE == SURROGATE_VESPO:  # the clamped log-weight SUM, rollout IS folded in
                token_lr = clamp(token_lr, -20.0, 20.0)
            acc_lr += tl.where(m != 0, m * token_lr, 0.0)
            if SURROGATE == SURROGATE_VESPO and HAS_IS:
                is_raw = _load_tokens(is_ptr, b, ts, rows_inner, is_stride_outer,
                                      is_stride_inner, in_seq).to(ACC)  # fmt: skip
                acc_lr += tl.where(m != 0, clamp(tl.log(is_raw), LN_1E_8, 20.0), 0.0)
            acc_n += m
        seq_n = tl.sum(acc_n, 0)
        seq_lr = tl.where(seq_n != 0, tl.sum(acc_lr, 0) / tl.where(seq_n != 0, seq_n, 1.0), 0.0)
        if SURROGATE == SURROGATE_VESPO or SEQ_SUM:
            seq_lr = tl.sum(acc_lr, 0)
    acc_g = tl.zeros((BLOCK_T,), ACC)
    for t0 in range(0, rows_inner, BLOCK_T):
        ts = t0 + offs
        in_seq = ts < rows_inner
        rows = b * rows_inner + ts
        m, logp, old, ref, adv, entropy = _token_inputs(
            logp_ptr, targets_ptr, adv_ptr, old_ptr, ref_ptr, mask_ptr, b, ts, in_seq,
            rows_inner, logp_stride_outer, logp_stride_inner, t_stride_outer, t_stride_inner,
            adv_stride_outer, adv_stride_inner, old_stride_outer, old_stride_inner,
            ref_stride_outer, ref_stride_inner, mask_stride_outer, mask_stride_inner,
            ignore_index, HAS_TARGETS, HAS_OLD, HAS_REF, HAS_MASK, ACC,
        )  # fmt: skip
        if HAS_ENTROPY:
            ent = _load_tokens(entropy_ptr, b, ts, rows_inner, ent_stride_outer,
                               ent_stride_inner, in_seq).to(ACC)  # fmt: skip
            entropy = tl.where(m != 0, ent, 0.0)
        token_lr, inside = token_log_ratio(logp, old, hyper, ACC)
        if SEQUENCE:
            log_ratio = tl.zeros_like(logp) + seq_lr
        else:
            log_ratio = token_lr
        is_weight = tl.zeros_like(logp) + 1.0
        if HAS_IS:
            is_raw = _load_tokens(is_ptr, b, ts, rows_inner, is_stride_outer, is_stride_inner,
                                  in_seq).to(ACC)  # fmt: skip
            is_weight = tl.where(m != 0, is_raw, 1.0)
        keep = tl.zeros_like(logp) + 1.0
        if HAS_KEEP:
            keep_raw = _load_tokens(keep_ptr, b, ts, rows_inner, keep_stride_outer,
                                    keep_stride_inner, in_seq).to(ACC)  # fmt: skip
            keep = tl.where(m != 0, keep_raw, 1.0)
        ent_scale = tl.zeros_like(logp) + 1.0
        if HAS_ENT_SCALE:  # the bonus as a token mean whatever loss_agg (contiguous (B*T,))
            ent_scale = _load_tokens(ent_scale_ptr, b, ts, rows_inner, rows_inner, 1,
                                     in_seq).to(ACC)  # fmt: skip
        loss, d_ratio, d_direct, ratio, code, aux, kl = policy_token_loss(
            logp, entropy, log_ratio, token_lr, adv, ref, is_weight, keep, hyper, ent_scale,
            SURROGATE, HAS_REF, ADD_KL, KL_KIND, BIAS_KL, ENTROPY_BONUS, USE_DUAL, USE_DELTA,
            ACC,
        )  # fmt: skip
        counted = m != 0
        if SEQUENCE and not SEQ_TOKEN:  # the ratio part reaches every token; the direct
            acc_g += tl.where(counted, m * d_ratio, 0.0)  # part is written below
        else:  # token level, or GSPO-token: the sequence ratio's value, each token's gradient
            g = tl.where(inside, d_ratio, 0.0) + d_direct
            tl.store(g_ptr + rows, tl.where(counted, m * g, 0.0), mask=in_seq)
        if ENTROPY_BONUS:
            tl.store(h_ptr + rows, -entropy_coef * ent_scale * m, mask=in_seq)
        store_policy_partials(
            part_ptr, n_rows, rows, in_seq, m, loss, code, aux, ratio, old - logp, kl, entropy,
            is_weight, HAS_IS,
        )  # fmt: skip
    if SEQUENCE and not SEQ_TOKEN:
        # d ratio_b / d logp_t = ratio_b * m_t / sum m (SEQ_SUM: ratio_b * m_t): every token
        # shares the sequence's total
        per_token = tl.sum(acc_g, 0)
        if not SEQ_SUM:
            per_token = per_token / tl.where(seq_n != 0, seq_n, 1.0)
        for t0 in range(0, rows_inner, BLOCK_T):
            ts = t0 + offs
            in_seq = ts < rows_inner
            m, logp, old, ref, adv, _ = _token_inputs(
                logp_ptr, targets_ptr, adv_ptr, old_ptr, ref_ptr, mask_ptr, b, ts, in_seq,
                rows_inner, logp_stride_outer, logp_stride_inner, t_stride_outer,
                t_stride_inner, adv_stride_outer, adv_stride_inner, old_stride_outer,
                old_stride_inner, ref_stride_outer, ref_stride_inner, mask_stride_outer,
                mask_stride_inner, ignore_index, HAS_TARGETS, HAS_OLD, HAS_REF, HAS_MASK, ACC,
            )  # fmt: skip
            token_lr, inside = token_log_ratio(logp, old, hyper, ACC)
            g = tl.where(inside, per_token, 0.0) + tl.zeros_like(logp)
            if SURROGATE == SURROGATE_GMPO:  # a token frozen by the log-space clip gets none
                _, d_token = gmpo_log_ratio(token_lr, adv, eps_low, eps_high)
                g = g * d_token
            if ADD_KL:  # the direct part: the KL's (the surrogates here act through the ratio)
                if KL_KIND != KL_FULL:  # the exact KL reaches the logits, not logp
                    _, dkl = kl_and_grad(logp, ref, KL_KIND)
                    if BIAS_KL:
                        dkl = dkl * tl.exp(seq_lr)
                    g += beta * dkl
            tl.store(g_ptr + b * rows_inner + ts, tl.where(m != 0, m * g, 0.0), mask=in_seq)
