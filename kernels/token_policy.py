"""Layer 2 on ``(B, T)`` tensors: the policy loss from per-token log-probs, and the one
reduction that turns every policy-loss forward's per-token partials into the loss and all
its metrics.

* ``_policy_token_fwd_kernel`` -- one program per sequence: the token layer of
  ``policy_loss_from_logprobs`` and of sequence-level importance sampling (GSPO), whose
  ratio needs the whole sequence's log-probs before any token's loss. Writes the same
  ``g``, ``h`` and partials as the fused vocab-stream forward.
* ``_policy_finalize_kernel`` -- one program per partial column, a fixed-order
  (deterministic, bit-identical on repeat) two-level sum over ``(B, T)`` tiles: the metric
  means, the ratio max, and the aggregated loss with its per-sequence backward scale.
"""

import triton
import triton.language as tl

from .common import as_weight, clamp, nan_max, nan_min, token_offset
from .modes import LOSS_AGG_MODES
from .token_layer import (
    COL_COUNT,
    COL_IS_MAX,
    COL_IS_MIN,
    COL_LOSS,
    COL_RATIO_MAX,
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

AGG_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES.index("token-mean"))
AGG_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-mean"))
AGG_SEQ_MEAN_TOKEN_SUM = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-sum"))
AGG_SEQ_MEAN_TOKEN_SUM_NORM = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-sum-norm"))


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
    if HAS_TARGETS:
        target = _load_tokens(targets_ptr, b, ts, rows_inner, t_so, t_si, in_seq)
        m = tl.where(target != ignore_index, m, 0.0)
    if HAS_MASK:
        m = m * as_weight(
            _load_tokens(mask_ptr, b, ts, rows_inner, mask_so, mask_si, in_seq).to(ACC)
        )
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
    g_ptr,
    h_ptr,
    part_ptr,
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
    ignore_index,
    hyper,
    SURROGATE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_IS: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    BIAS_KL: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
    SEQUENCE: tl.constexpr,
    SEQ_TOKEN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per sequence ``b`` of ``(B, rows_inner)`` strided inputs; ``g``, ``h``
    contiguous ``(B * rows_inner,)``, partials ``(N_COLS, B * rows_inner)``.

    ``SEQUENCE``: GSPO, one ratio per sequence ``exp(sum m (logp - old) / sum m)``; the
    surrogate's gradient then reaches every token through that mean (a third pass writes
    ``g`` once the sequence's total is known). ``SEQ_TOKEN`` (GSPO-token): the value of the
    sequence ratio, the gradient through each token's own log-prob (``sg(s) r_t / sg(r_t)``):
    ``g`` is written per token, as at token level. Bytes: reads the inputs once (twice with
    ``SEQUENCE``), writes ~13 floats per token.
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
        if SURROGATE == SURROGATE_VESPO:
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
        loss, d_ratio, d_direct, ratio, code, aux, kl = policy_token_loss(
            logp, entropy, log_ratio, token_lr, adv, ref, is_weight, hyper, SURROGATE, HAS_REF,
            ADD_KL, KL_KIND, BIAS_KL, ENTROPY_BONUS, USE_DUAL, USE_DELTA, ACC,
        )  # fmt: skip
        counted = m != 0
        if SEQUENCE and not SEQ_TOKEN:  # the ratio part reaches every token; the direct
            acc_g += tl.where(counted, m * d_ratio, 0.0)  # part is written below
        else:  # token level, or GSPO-token: the sequence ratio's value, each token's gradient
            g = tl.where(inside, d_ratio, 0.0) + d_direct
            tl.store(g_ptr + rows, tl.where(counted, m * g, 0.0), mask=in_seq)
        if ENTROPY_BONUS:
            tl.store(h_ptr + rows, -entropy_coef * m, mask=in_seq)
        store_policy_partials(
            part_ptr, n_rows, rows, in_seq, m, loss, code, aux, ratio, old - logp, kl, entropy,
            is_weight, HAS_IS,
        )  # fmt: skip
    if SEQUENCE and not SEQ_TOKEN:
        # d ratio_b / d logp_t = ratio_b * m_t / sum m: every token shares the sequence's total
        per_token = tl.sum(acc_g, 0) / tl.where(seq_n != 0, seq_n, 1.0)
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
                _, dkl = kl_and_grad(logp, ref, KL_KIND)
                if BIAS_KL:
                    dkl = dkl * tl.exp(seq_lr)
                g += beta * dkl
            tl.store(g_ptr + b * rows_inner + ts, tl.where(m != 0, m * g, 0.0), mask=in_seq)


@triton.jit(do_not_specialize=["n_outer", "rows_inner"])
def _policy_finalize_kernel(
    part_ptr,
    loss_ptr,
    metrics_ptr,
    seq_scale_ptr,
    num_items_ptr,
    n_outer,
    rows_inner,
    num_items,
    n_seq,
    max_length,
    AGG: tl.constexpr,
    NUM_ITEMS_TENSOR: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """Program ``k`` reduces partial column ``k`` of ``(N_COLS, n_outer * rows_inner)``.

    ``metrics[k]`` (fp32): ``sum col_k / sum col_COUNT`` (0 when nothing counts), the max for
    ``COL_RATIO_MAX`` (NaN if any counted ratio is NaN), the token count for ``COL_COUNT``,
    and the aggregated loss for ``COL_LOSS``, which also writes ``loss`` (``ACC``) and the
    backward's ``seq_scale``: ``w_t = m_t * seq_scale[b]`` with ``loss = sum_t w_t L_t``, one
    value per sequence for ``seq-mean-token-mean``, else one for all.
    """
    k = tl.program_id(0)
    n_rows = n_outer.to(tl.int64) * rows_inner
    col = part_ptr + k.to(tl.int64) * n_rows
    tot_m = tl.zeros((), ACC)
    tot_x = tl.zeros((), ACC)
    seq_sum = tl.zeros((), ACC)
    x_max = tl.zeros((), ACC)
    x_min = tl.zeros((), ACC) + float("inf")
    n_nan = tl.zeros((), tl.int32)
    for b0 in range(0, n_outer, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        in_b = bs < n_outer
        sum_m = tl.zeros((BLOCK_B,), ACC)
        sum_x = tl.zeros((BLOCK_B,), ACC)
        for t0 in range(0, rows_inner, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            tile = in_b[:, None] & (ts < rows_inner)[None, :]
            rows = bs[:, None] * rows_inner + ts[None, :]
            mm = tl.load(part_ptr + COL_COUNT * n_rows + rows, mask=tile, other=0.0).to(ACC)
            xx = tl.load(col + rows, mask=tile, other=0.0).to(ACC)
            sum_m += tl.sum(mm, 1)
            sum_x += tl.sum(xx, 1)
            if k == COL_RATIO_MAX or k == COL_IS_MAX:
                x_max = nan_max(x_max, tl.max(tl.max(xx, 1), 0))
                n_nan += tl.sum(tl.sum((xx != xx).to(tl.int32), 1), 0)
            if k == COL_IS_MIN:  # uncounted tokens hold +inf (masked lanes load +inf too)
                xx = tl.load(col + rows, mask=tile, other=float("inf")).to(ACC)
                x_min = nan_min(x_min, tl.min(tl.min(xx, 1), 0))
                n_nan += tl.sum(tl.sum((xx != xx).to(tl.int32), 1), 0)
        tot_m += tl.sum(sum_m, 0)
        tot_x += tl.sum(sum_x, 0)
        if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
            nonempty = sum_m != 0
            safe_m = tl.where(nonempty, sum_m, 1.0)
            seq_sum += tl.sum(tl.where(nonempty, sum_x / safe_m, 0.0), 0)
            if k == COL_LOSS:
                scale_b = tl.where(nonempty, 1.0 / (n_seq * safe_m), 0.0)
                tl.store(seq_scale_ptr + bs, scale_b, mask=in_b)
    if k == COL_LOSS:
        if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
            loss = seq_sum / n_seq
        else:
            if AGG == AGG_TOKEN_MEAN:
                if NUM_ITEMS_TENSOR:
                    den = tl.load(num_items_ptr).to(ACC)
                else:
                    den = tot_m * 0.0 + num_items
                    den = tl.where(num_items > 0, den, tot_m)  # num_items <= 0: not given
            elif AGG == AGG_SEQ_MEAN_TOKEN_SUM:
                den = tot_m * 0.0 + n_seq
            else:
                den = (tot_m * 0.0 + n_seq) * max_length  # in ACC: B * L may pass 2^24
            scale = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
            if NUM_ITEMS_TENSOR:  # never read on the host: a count <= 0 gives NaN, loudly
                scale = tl.where(den > 0, 1.0 / den, float("nan"))
            loss = tot_x * scale
            tl.store(seq_scale_ptr, scale)
        tl.store(loss_ptr, loss)
        tl.store(metrics_ptr + k, loss.to(tl.float32))
    elif k == COL_RATIO_MAX or k == COL_IS_MAX:
        tl.store(metrics_ptr + k, tl.where(n_nan > 0, float("nan"), x_max).to(tl.float32))
    elif k == COL_IS_MIN:  # 0 when nothing counts
        x_min = tl.where(x_min == float("inf"), 0.0, x_min)
        tl.store(metrics_ptr + k, tl.where(n_nan > 0, float("nan"), x_min).to(tl.float32))
    elif k == COL_COUNT:
        tl.store(metrics_ptr + k, tot_m.to(tl.float32))
    else:
        mean = tl.where(tot_m != 0, tot_x / tl.where(tot_m != 0, tot_m, 1.0), 0.0)
        tl.store(metrics_ptr + k, mean.to(tl.float32))
