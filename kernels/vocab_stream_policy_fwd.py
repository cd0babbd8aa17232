"""Layer 1 + layer 2 fused: one pass over each logits row, with the policy loss as epilogue.

Per token the kernel streams the row once (``row_moments``), then computes the clipped
surrogate, KL and entropy bonus on the resulting scalars and writes only per-token numbers:
the weighted loss ``w * L`` (summed afterwards, deterministically), the backward
coefficients ``g = w * dL/dlogp`` and ``h = w * dL/dH``, and the terms the metrics need.
The backward is ``vocab_stream_bwd._token_stats_bwd_kernel`` with ``g``, ``h`` and the
upstream gradient as ``scale``.
"""

import triton
import triton.language as tl

from .token_layer import clipped_surrogate, kl_and_grad, pair
from .vocab_stream_fwd import row_moments, row_pointer, target_logit


# advantages' strides vary with T ((B, T): T; (B,): 0) -- never a reason to recompile
@triton.jit(
    do_not_specialize=["rows_inner", "ignore_index", "adv_stride_outer", "adv_stride_inner"]
)
def _policy_loss_fwd_kernel(
    logits_ptr,
    targets_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    weight_ptr,
    logp_ptr,
    entropy_ptr,
    max_ptr,
    log_sum_ptr,
    ratio_ptr,
    kl_ptr,
    code_ptr,
    loss_ptr,
    g_ptr,
    h_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    adv_stride_outer,
    adv_stride_inner,
    inv_t_hi,
    inv_t_lo,
    ignore_index,
    eps_low,
    eps_high,
    dual_clip,
    delta,
    beta,
    entropy_coef,
    HAS_OLD: tl.constexpr,
    HAS_REF: tl.constexpr,
    ADD_KL: tl.constexpr,
    KL_KIND: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    ENTROPY_BONUS: tl.constexpr,
    USE_DUAL: tl.constexpr,
    USE_DELTA: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per token row of ``(outer, inner, V)`` logits; per-token inputs/outputs
    are contiguous ``(outer * inner,)`` except ``adv`` (strided: ``(B,)`` is broadcast with
    a zero inner stride)."""
    row = tl.program_id(0).to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # 1 / T, fp64-exact for fp64 logits
    outer = row // rows_inner
    inner = row - outer * rows_inner
    row_ptr = row_pointer(logits_ptr, row, rows_inner, stride_outer, stride_inner)
    target = tl.load(targets_ptr + row).to(tl.int64)
    weight = tl.load(weight_ptr + row).to(ACC)
    valid = target != ignore_index
    counted = weight != 0
    # padding (weight 0) costs no bandwidth: its logp / entropy are never used
    active = valid & counted

    # layer 1: the only pass over the logits
    m, log_s, entropy = row_moments(
        row_ptr, V, stride_v, inv_temperature, active, WITH_ENTROPY, BLOCK_V, ACC
    )
    z_y = target_logit(row_ptr, target, V, stride_v, inv_temperature, active, ACC)
    logp = tl.where(active, (z_y - m) - log_s, 0.0)
    entropy = tl.where(active, entropy, 0.0)

    # layer 2: token loss math on scalars
    adv = tl.load(adv_ptr + outer * adv_stride_outer + inner * adv_stride_inner).to(ACC)
    if HAS_OLD:
        log_ratio = logp - tl.load(old_ptr + row).to(ACC)
    else:
        log_ratio = logp * 0.0  # on-policy: ratio 1, d ratio / d logp = 1
    ratio = tl.exp(log_ratio)
    loss, dloss_dratio, code = clipped_surrogate(
        ratio, adv, eps_low, eps_high, dual_clip, delta, USE_DUAL, USE_DELTA
    )
    dloss_dlogp = dloss_dratio * ratio
    if HAS_REF:
        kl, dkl = kl_and_grad(logp, tl.load(ref_ptr + row).to(ACC), KL_KIND)
        tl.store(kl_ptr + row, kl)
        if ADD_KL:
            loss += beta * kl
            dloss_dlogp += beta * dkl
    if ENTROPY_BONUS:
        loss -= entropy_coef * entropy
    # tokens that do not count contribute exactly 0 even where their loss is inf/NaN
    tl.store(loss_ptr + row, tl.where(counted, weight * loss, 0.0))
    tl.store(g_ptr + row, tl.where(counted, weight * dloss_dlogp, 0.0))
    if ENTROPY_BONUS:
        tl.store(h_ptr + row, tl.where(counted, -entropy_coef * weight, 0.0))
    tl.store(logp_ptr + row, logp)
    tl.store(max_ptr + row, tl.where(active, m, 0.0))
    tl.store(log_sum_ptr + row, tl.where(active, log_s, 0.0))
    tl.store(ratio_ptr + row, ratio)
    tl.store(code_ptr + row, code.to(tl.int8))
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)
