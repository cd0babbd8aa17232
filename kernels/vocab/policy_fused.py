"""Layer 1 + layer 2 fused: one pass over each logits row, with the policy loss as epilogue.

Per token the kernel streams the row once (``row_moments``), computes the clipped surrogate,
KL and entropy bonus on the resulting scalars (``layer2.policy_token_loss``) and writes
only per-token numbers:

* the backward coefficients ``g = m * dL/dlogp`` and ``h = m * dL/dH`` (``m`` the token's
  mask weight; the loss aggregation's normaliser is applied later, per sequence, by the
  backward) and the softmax normaliser ``(row max, log s)``;
* one column per metric of ``m * x`` (``layer2.store_policy_partials``), which
  ``policy/finalize._policy_finalize_kernel`` reduces into the loss and every metric.

Bytes per call: reads the logits once (2 per element in bf16; rows that do not count read
nothing), writes ~17 floats per token (the backward coefficients, the row normaliser and
12 partial columns). The backward is ``vocab/layer3``.
"""

import triton
import triton.language as tl

from ..common import as_weight, pair, row_pointer, token_offset
from ..policy.layer2 import (
    KL_FULL,
    P_BETA,
    P_ENTROPY_COEF,
    param,
    policy_token_loss,
    store_policy_partials,
    token_log_ratio,
)
from .layer1 import row_moments, target_logit, target_logp
from .layer3 import KLS_COEF, KLS_KL, KLS_LOG_RATIO, KLS_MAX_U, write_grad_row
from .pair import pair_moments


@triton.jit(
    do_not_specialize=[
        "rows_inner",
        "shift",
        "ignore_index",
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
        "rs_stride_outer",
        "rs_stride_inner",
        "r_shift",
    ]
)
def _policy_loss_fwd_kernel(
    logits_ptr,
    targets_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    mask_ptr,
    is_ptr,
    max_ptr,
    log_sum_ptr,
    entropy_ptr,
    g_ptr,
    h_ptr,
    part_ptr,
    grad_ptr,
    row_scale_ptr,
    ent_scale_ptr,
    rl_ptr,
    kls_ptr,
    rows_inner,
    shift,
    r_shift,
    V,
    stride_outer,
    stride_inner,
    stride_v,
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
    grad_stride_outer,
    grad_stride_inner,
    rs_stride_outer,
    rs_stride_inner,
    r_stride_outer,
    r_stride_inner,
    r_stride_v,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    grad_scale_hi,
    grad_scale_lo,
    ignore_index,
    hyper,
    SURROGATE: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_IS: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    BIAS_KL: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    HAS_ENT_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per target token of ``(outer, rows_inner)``. Logits: ``(outer, S, V)``
    strided, position ``inner + shift`` predicts target ``inner``. Per-token inputs are
    strided ``(outer, rows_inner)`` (``(B,)`` advantages: a zero inner stride); outputs are
    contiguous ``(outer * rows_inner,)``, partials ``(N_COLS, outer * rows_inner)``.

    ``WRITE_GRAD`` (the fused-linear loss, ``policy_loss(grad_in_forward=True)``): also
    write the row's gradient ``dL/dlogits`` to ``grad_ptr``, a buffer shaped as the logits
    with contiguous rows (``grad_stride_outer`` / ``grad_stride_inner`` apart, the same
    position as the row read; may BE the logits: written in place), with ``g``/``h`` times
    ``grad_scale * row_scale[row]`` (``row_scale`` strided ``(outer, rows_inner)``: the loss
    aggregation's normaliser, known from the mask alone; ``grad_scale``: a constant factor
    of the loss, ``loss_scale``), multiplied in the order layer 3 multiplies the upstream
    gradient and the normaliser. Bytes: one more read of the row (from L2 right after the
    first) and one write. ``inv_t``: ``1 / T`` (``c / T`` with ``HAS_SOFTCAP``, the soft
    cap ``c``), ``inv_cap``: ``1 / c``.

    ``KL_KIND == KL_FULL`` (``kl_estimator="full"``; soft-capped alike): ``rl_ptr`` holds the
    reference's logits ``(outer, S_r, V)`` (position ``inner + r_shift`` for token
    ``inner``), streamed with the policy's row in the same pass (``pair.pair_moments``), and
    the token's exact ``KL(p || q)`` is the KL term; ``kls_ptr`` receives the ``(4,
    outer * rows_inner)`` statistics layer 3 needs (``layer3.KLS_*``). Bytes: one more
    read of the reference row (and with ``WRITE_GRAD`` a second, from L2), 4 more floats
    written per token."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0).to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # 1 / T, fp64-exact for fp64 logits
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: 1 / c, and the above c / T
    # hyper: the policy options' fp32 pairs (kernels/modes.py POLICY_PARAMS), read by ``param``
    entropy_coef = param(hyper, P_ENTROPY_COEF, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, shift, stride_outer, stride_inner)
    target = tl.load(targets_ptr + token_offset(row, rows_inner, t_stride_outer, t_stride_inner))
    target = target.to(tl.int64)
    m = tl.zeros((), ACC) + 1.0
    if HAS_MASK:
        mask_off = token_offset(row, rows_inner, mask_stride_outer, mask_stride_inner)
        m = as_weight(tl.load(mask_ptr + mask_off).to(ACC))
    m = tl.where(target != ignore_index, m, 0.0)  # after the weight: an ignored token never counts
    # padding (m == 0) costs no bandwidth: its logp / entropy are never used
    active = m != 0

    # layer 1: the only pass over the logits
    r_row = row_ptr
    r_max = 0.0
    log_zu = 0.0
    kl_full = 0.0
    if KL_KIND == KL_FULL:  # the reference's row streamed beside the policy's
        r_row = row_pointer(rl_ptr, row, rows_inner, r_shift, r_stride_outer, r_stride_inner)
        row_max, log_s, entropy, r_max, _, _, _, kl_full, log_zu = pair_moments(
            row_ptr, r_row, V, stride_v, r_stride_v, inv_temperature, tl.where(active, V, 0),
            BLOCK_V, ACC, inv_cap, HAS_SOFTCAP,
        )  # fmt: skip
    else:
        row_max, log_s, entropy = row_moments(
            row_ptr, V, stride_v, inv_temperature, inv_cap, active, WITH_ENTROPY, HAS_SOFTCAP,
            BLOCK_V, ACC,
        )  # fmt: skip
    z_y = target_logit(
        row_ptr, target, V, stride_v, inv_temperature, inv_cap, active, HAS_SOFTCAP, ACC
    )
    logp = tl.where(active, target_logp(z_y, row_max, log_s), 0.0)
    entropy = tl.where(active, entropy, 0.0)

    # layer 2: token loss math on scalars
    adv = tl.load(adv_ptr + token_offset(row, rows_inner, adv_stride_outer, adv_stride_inner))
    if HAS_OLD:
        old_off = token_offset(row, rows_inner, old_stride_outer, old_stride_inner)
        old = tl.where(active, tl.load(old_ptr + old_off).to(ACC), logp)
    else:
        old = logp  # on-policy: ratio 1, d ratio / d logp = 1
    ref = logp
    if HAS_REF:
        if KL_KIND == KL_FULL:  # the token's exact KL takes the reference log-prob's place
            ref = tl.where(active, kl_full, 0.0)
        else:
            ref_off = token_offset(row, rows_inner, ref_stride_outer, ref_stride_inner)
            ref = tl.where(active, tl.load(ref_ptr + ref_off).to(ACC), logp)
    adv = tl.where(active, adv.to(ACC), 0.0)
    is_weight = 1.0
    if HAS_IS:
        is_off = token_offset(row, rows_inner, is_stride_outer, is_stride_inner)
        is_weight = tl.where(active, tl.load(is_ptr + is_off).to(ACC), 1.0)
    ent_scale = 1.0
    if HAS_ENT_SCALE:  # the bonus as a token mean whatever loss_agg (per row, contiguous)
        ent_scale = tl.load(ent_scale_ptr + row).to(ACC)
    bonus = entropy_coef * ent_scale
    log_ratio, inside = token_log_ratio(logp, old, hyper, ACC)
    loss, d_ratio, d_direct, ratio, code, aux, kl = policy_token_loss(
        logp, entropy, log_ratio, log_ratio, adv, ref, is_weight, 1.0, hyper, ent_scale, SURROGATE,
        HAS_REF, ADD_KL, KL_KIND, BIAS_KL, ENTROPY_BONUS, USE_DUAL, USE_DELTA, ACC,
    )  # fmt: skip
    # token level: the ratio moves with this logp only (where the log-ratio is not clamped)
    dloss_dlogp = tl.where(inside, d_ratio, 0.0) + d_direct
    # tokens that do not count contribute exactly 0 even where their loss is inf/NaN
    tl.store(g_ptr + row, tl.where(active, m * dloss_dlogp, 0.0))
    if ENTROPY_BONUS:
        tl.store(h_ptr + row, -bonus * m)
    tl.store(max_ptr + row, tl.where(active, row_max, 0.0))
    tl.store(log_sum_ptr + row, tl.where(active, log_s, 0.0))
    if ENTROPY_BONUS:
        tl.store(entropy_ptr + row, entropy)
    store_policy_partials(
        part_ptr, n_rows, row, row >= 0, m, loss, code, aux, ratio, old - logp, kl, entropy,
        is_weight, HAS_IS,
    )  # fmt: skip
    k = 0.0
    if KL_KIND == KL_FULL:  # what layer 3 needs: k = m dL/dKL and the pair's statistics
        if ADD_KL:
            k = param(hyper, P_BETA, ACC)
            if BIAS_KL:
                k = k * ratio
        k = tl.where(active, m * k, 0.0)
        kls = kls_ptr + row
        tl.store(kls + KLS_MAX_U * n_rows, tl.where(active, r_max, 0.0))
        tl.store(kls + KLS_LOG_RATIO * n_rows, tl.where(active, log_zu, 0.0))
        tl.store(kls + KLS_KL * n_rows, ref)
        tl.store(kls + KLS_COEF * n_rows, k)
    if WRITE_GRAD:  # layer 3 on the row just reduced (its second read comes from L2)
        rs_off = token_offset(row, rows_inner, rs_stride_outer, rs_stride_inner)
        scale = inv_temperature * pair(grad_scale_hi, grad_scale_lo, ACC)
        scale = scale * tl.load(row_scale_ptr + rs_off).to(ACC)
        g = tl.where(active, m * dloss_dlogp, 0.0) * scale
        h = 0.0
        if ENTROPY_BONUS:
            h = tl.where(active, -bonus * m, 0.0) * scale
        k = k * scale
        grad_row = row_pointer(grad_ptr, row, rows_inner, shift, grad_stride_outer,
                               grad_stride_inner)  # fmt: skip
        write_grad_row(
            row_ptr, grad_row, V, stride_v, inv_temperature, inv_cap, row_max, log_s,
            log_s - entropy, g, h, target, active & ((g != 0) | (h != 0) | (k != 0)), r_row,
            r_stride_v, r_max, log_zu, ref, k, True, ENTROPY_BONUS, HAS_SOFTCAP,
            KL_KIND == KL_FULL, BLOCK_V, ACC,
        )  # fmt: skip
