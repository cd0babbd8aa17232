"""Layer 2, token space: clipped value loss and torchtune's full PPO loss on ``(R, C)`` views.

Flat, two-stage deterministic kernels (see ``token_ops/reductions.py`` for the conventions): the
forward kernel writes per-block partial sums, one single-program kernel merges them and writes
the scalar outputs, and the backward kernel recomputes every per-token derivative from the
inputs (nothing of size ``B*T`` is saved between forward and backward).

Hyper-parameters that must be exact in fp64 (clip bounds, coefficients) arrive as two fp32
halves ``hi + lo`` (Triton passes Python floats as fp32), recombined in the accumulation type.

Gradients follow PyTorch's subgradient conventions so fp64 parity is exact at ties:
``torch.clamp`` passes the gradient on the closed interval ``[lo, hi]``, and
``torch.maximum(a, b)`` splits it in halves when ``a == b``.
"""

import triton
import triton.language as tl

from ..common import cast_for, clamp, nan_max, pair
from .reductions import flat_rowcol, load_weight, safe, sum_partials, wide


@triton.jit
def max_and_grad(a, b, g_a, g_b):
    """``maximum(a, b)`` and its gradient given the branches' gradients, as torch's
    ``maximum`` backward: a branch gets its gradient unless it is strictly smaller, halved
    at a tie, and whole when the other is NaN (both branches then carry it)."""
    tie = a == b  # selected with where, never multiplied: an unused inf gradient stays out
    part_a = tl.where(a < b, 0.0, tl.where(tie, 0.5 * g_a, g_a))
    part_b = tl.where(b < a, 0.0, tl.where(tie, 0.5 * g_b, g_b))
    return nan_max(a, b), part_a + part_b


@triton.jit
def value_sq_and_grad(v, v_old, ret, clip, HAS_CLIP: tl.constexpr):
    """``(sq, d sq / dv, clipped)`` for ``sq = max((v - R)^2, (clamp(v, v_old - c, v_old + c)
    - R)^2)``; ``clipped`` (0./1.) = the clipped branch is strictly larger."""
    d_u = v - ret
    sq_u = d_u * d_u
    if HAS_CLIP:
        lo = v_old - clip
        hi = v_old + clip
        d_c = clamp(v, lo, hi) - ret
        sq_c = d_c * d_c
        g_c = tl.where((v >= lo) & (v <= hi), 2.0 * d_c, 0.0)
        sq, grad = max_and_grad(sq_u, sq_c, 2.0 * d_u, g_c)
        clipped = tl.where(sq_c > sq_u, 1.0, 0.0)
    else:
        sq = sq_u
        grad = 2.0 * d_u
        clipped = tl.zeros_like(sq_u)
    return sq, grad, clipped


@triton.jit
def ppo_policy_and_grad(logp, old_logp, adv, lo, hi):
    """``(loss, d loss / d logp, ratio, clipped)`` of ``max(-A r, -A clamp(r, lo, hi))``,
    ``r = exp(logp - old_logp)``; ``clipped`` (0./1.) = the clipped branch strictly larger."""
    ratio = tl.exp(logp - old_logp)
    loss_u = -adv * ratio
    loss_c = -adv * clamp(ratio, lo, hi)
    g_c = tl.where((ratio >= lo) & (ratio <= hi), loss_u, 0.0)
    loss, grad = max_and_grad(loss_u, loss_c, loss_u, g_c)
    return loss, grad, ratio, tl.where(loss_c > loss_u, 1.0, 0.0)


@triton.jit
def load_2d(ptr, row, col, stride_r, stride_c, valid, ACC: tl.constexpr):
    return tl.load(ptr + row * stride_r + col * stride_c, mask=valid, other=0.0).to(ACC)


@triton.jit
def masked_term(w, x):
    """``w * x`` with exactly 0 where ``w == 0`` (NaN / inf at padding never leaks)."""
    return tl.where(w != 0, w * x, 0.0)


# ----------------------------------------------------------------------------- value loss


@triton.jit(do_not_specialize=["N", "C"])
def _value_loss_fwd_kernel(
    v_ptr,
    vo_ptr,
    ret_ptr,
    w_ptr,
    m_ptr,
    part_ptr,
    N,
    C,
    stride_vr,
    stride_vc,
    stride_or,
    stride_oc,
    stride_rr,
    stride_rc,
    stride_mr,
    stride_mc,
    clip_hi,
    clip_lo,
    HAS_MASK: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Partials ``(4, P)``: ``sum w * 0.5 sq``, ``sum m * clipped``, ``sum m * v``, ``sum m``.
    ``w`` (the loss_agg weights) is contiguous ``(R, C)``."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    v = load_2d(v_ptr, row, col, stride_vr, stride_vc, valid, ACC)
    v_old = load_2d(vo_ptr, row, col, stride_or, stride_oc, valid, ACC)
    ret = load_2d(ret_ptr, row, col, stride_rr, stride_rc, valid, ACC)
    w = tl.load(w_ptr + row * C + col, mask=valid, other=0.0).to(ACC)
    m = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
    sq, _, clipped = value_sq_and_grad(v, v_old, ret, pair(clip_hi, clip_lo, ACC), HAS_CLIP)
    P = tl.num_programs(0)
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, tl.sum(masked_term(w, 0.5 * sq), 0))
    tl.store(part_ptr + wide(P) + pid, tl.sum(masked_term(m, clipped), 0))
    tl.store(part_ptr + 2 * wide(P) + pid, tl.sum(masked_term(m, v), 0))
    tl.store(part_ptr + 3 * wide(P) + pid, tl.sum(m, 0))


@triton.jit(do_not_specialize=["P"])
def _value_loss_finalize_kernel(part_ptr, out_ptr, P, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """``out = (loss, clip_frac, value_mean, 1 / count)``; empty masks give 0 (never NaN)."""
    loss = sum_partials(part_ptr, P, 0, BLOCK_P, ACC)
    n_clipped = sum_partials(part_ptr, P, 1, BLOCK_P, ACC)
    v_sum = sum_partials(part_ptr, P, 2, BLOCK_P, ACC)
    count = sum_partials(part_ptr, P, 3, BLOCK_P, ACC)
    tl.store(out_ptr, loss)
    tl.store(out_ptr + 1, n_clipped / safe(count))
    tl.store(out_ptr + 2, v_sum / safe(count))
    tl.store(out_ptr + 3, tl.where(count != 0, 1.0 / safe(count), 0.0))


@triton.jit(do_not_specialize=["N", "C"])
def _value_loss_bwd_kernel(
    v_ptr,
    vo_ptr,
    ret_ptr,
    w_ptr,
    m_ptr,
    out_ptr,
    gout_ptr,
    gv_ptr,
    N,
    C,
    stride_vr,
    stride_vc,
    stride_or,
    stride_oc,
    stride_rr,
    stride_rc,
    stride_mr,
    stride_mc,
    clip_hi,
    clip_lo,
    HAS_MASK: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """``dv = g_loss * w * 0.5 dsq/dv + g_value_mean * m / count`` (clip_frac is piecewise
    constant) into a contiguous ``(R, C)`` buffer."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    v = load_2d(v_ptr, row, col, stride_vr, stride_vc, valid, ACC)
    v_old = load_2d(vo_ptr, row, col, stride_or, stride_oc, valid, ACC)
    ret = load_2d(ret_ptr, row, col, stride_rr, stride_rc, valid, ACC)
    w = tl.load(w_ptr + row * C + col, mask=valid, other=0.0).to(ACC)
    m = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
    _, dsq, _ = value_sq_and_grad(v, v_old, ret, pair(clip_hi, clip_lo, ACC), HAS_CLIP)
    g_loss = tl.load(gout_ptr).to(ACC)
    g_mean = tl.load(gout_ptr + 2).to(ACC) * tl.load(out_ptr + 3).to(ACC)
    gv = masked_term(w, (0.5 * g_loss) * dsq) + masked_term(m, tl.zeros_like(v) + g_mean)
    tl.store(gv_ptr + row * C + col, cast_for(gv, gv_ptr), mask=valid)


# ----------------------------------------------------------------------------- PPO loss


@triton.jit(do_not_specialize=["N", "C"])
def _ppo_loss_fwd_kernel(
    lpo_ptr,
    lp_ptr,
    adv_ptr,
    vo_ptr,
    v_ptr,
    ret_ptr,
    pm_ptr,
    vm_ptr,
    part_ptr,
    N,
    C,
    s_lpo_r,
    s_lpo_c,
    s_lp_r,
    s_lp_c,
    s_adv_r,
    s_adv_c,
    s_vo_r,
    s_vo_c,
    s_v_r,
    s_v_c,
    s_ret_r,
    s_ret_c,
    s_pm_r,
    s_pm_c,
    s_vm_r,
    s_vm_c,
    lo_hi,
    lo_lo,
    hi_hi,
    hi_lo,
    vclip_hi,
    vclip_lo,
    HAS_PMASK: tl.constexpr,
    HAS_VMASK: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Partials ``(6, P)``: ``sum pm * pl``, ``sum pm``, ``sum pm * clipped``, ``sum vm * sq``,
    ``sum vm``, ``sum ratio`` (unmasked)."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    lp_old = load_2d(lpo_ptr, row, col, s_lpo_r, s_lpo_c, valid, ACC)
    lp = load_2d(lp_ptr, row, col, s_lp_r, s_lp_c, valid, ACC)
    adv = load_2d(adv_ptr, row, col, s_adv_r, s_adv_c, valid, ACC)
    v_old = load_2d(vo_ptr, row, col, s_vo_r, s_vo_c, valid, ACC)
    v = load_2d(v_ptr, row, col, s_v_r, s_v_c, valid, ACC)
    ret = load_2d(ret_ptr, row, col, s_ret_r, s_ret_c, valid, ACC)
    pm = load_weight(pm_ptr, row, col, s_pm_r, s_pm_c, valid, HAS_PMASK, ACC)
    vm = load_weight(vm_ptr, row, col, s_vm_r, s_vm_c, valid, HAS_VMASK, ACC)
    pl, _, ratio, clipped = ppo_policy_and_grad(
        lp, lp_old, adv, pair(lo_hi, lo_lo, ACC), pair(hi_hi, hi_lo, ACC)
    )
    sq, _, _ = value_sq_and_grad(v, v_old, ret, pair(vclip_hi, vclip_lo, ACC), True)
    P = tl.num_programs(0)
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, tl.sum(masked_term(pm, pl), 0))
    tl.store(part_ptr + wide(P) + pid, tl.sum(pm, 0))
    tl.store(part_ptr + 2 * wide(P) + pid, tl.sum(masked_term(pm, clipped), 0))
    tl.store(part_ptr + 3 * wide(P) + pid, tl.sum(masked_term(vm, sq), 0))
    tl.store(part_ptr + 4 * wide(P) + pid, tl.sum(vm, 0))
    tl.store(part_ptr + 5 * wide(P) + pid, tl.sum(tl.where(valid, ratio, 0.0), 0))


@triton.jit(do_not_specialize=["P", "N"])
def _ppo_loss_finalize_kernel(
    part_ptr,
    out_ptr,
    P,
    N,
    coeff_hi,
    coeff_lo,
    HAS_PMASK: tl.constexpr,
    HAS_VMASK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    ACC: tl.constexpr,
):
    """``out = (loss, policy_loss, value_loss, ratios_mean, clipfrac, 1/den_p, 1/den_v,
    1/N)``: torchtune's ``sum(m x) / (sum(m) + 1e-8)`` with a mask, ``sum(x) / N`` without."""
    n_all = N * tl.full((), 1.0, ACC)
    if HAS_PMASK:
        den_p = sum_partials(part_ptr, P, 1, BLOCK_P, ACC) + 1e-8
    else:
        den_p = n_all
    if HAS_VMASK:
        den_v = sum_partials(part_ptr, P, 4, BLOCK_P, ACC) + 1e-8
    else:
        den_v = n_all
    policy_loss = sum_partials(part_ptr, P, 0, BLOCK_P, ACC) / den_p
    value_loss = 0.5 * (sum_partials(part_ptr, P, 3, BLOCK_P, ACC) / den_v)
    tl.store(out_ptr, policy_loss + value_loss * pair(coeff_hi, coeff_lo, ACC))
    tl.store(out_ptr + 1, policy_loss)
    tl.store(out_ptr + 2, value_loss)
    tl.store(out_ptr + 3, sum_partials(part_ptr, P, 5, BLOCK_P, ACC) / n_all)
    tl.store(out_ptr + 4, sum_partials(part_ptr, P, 2, BLOCK_P, ACC) / den_p)
    tl.store(out_ptr + 5, 1.0 / den_p)
    tl.store(out_ptr + 6, 1.0 / den_v)
    tl.store(out_ptr + 7, 1.0 / n_all)


@triton.jit(do_not_specialize=["N", "C"])
def _ppo_loss_bwd_kernel(
    lpo_ptr,
    lp_ptr,
    adv_ptr,
    vo_ptr,
    v_ptr,
    ret_ptr,
    pm_ptr,
    vm_ptr,
    out_ptr,
    gout_ptr,
    glp_ptr,
    gv_ptr,
    N,
    C,
    s_lpo_r,
    s_lpo_c,
    s_lp_r,
    s_lp_c,
    s_adv_r,
    s_adv_c,
    s_vo_r,
    s_vo_c,
    s_v_r,
    s_v_c,
    s_ret_r,
    s_ret_c,
    s_pm_r,
    s_pm_c,
    s_vm_r,
    s_vm_c,
    lo_hi,
    lo_lo,
    hi_hi,
    hi_lo,
    vclip_hi,
    vclip_lo,
    coeff_hi,
    coeff_lo,
    HAS_PMASK: tl.constexpr,
    HAS_VMASK: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Gradients w.r.t. ``pi_logprobs`` and ``phi_values`` (contiguous ``(R, C)``) of all five
    outputs under ``gout`` (clipfrac is piecewise constant)::

        d logp = (g_loss + g_policy) pm dpl / den_p + g_ratio * r / N
        d v    = (coeff g_loss + g_value) * 0.5 vm dsq / den_v
    """
    row, col, valid = flat_rowcol(N, C, BLOCK)
    lp_old = load_2d(lpo_ptr, row, col, s_lpo_r, s_lpo_c, valid, ACC)
    lp = load_2d(lp_ptr, row, col, s_lp_r, s_lp_c, valid, ACC)
    adv = load_2d(adv_ptr, row, col, s_adv_r, s_adv_c, valid, ACC)
    v_old = load_2d(vo_ptr, row, col, s_vo_r, s_vo_c, valid, ACC)
    v = load_2d(v_ptr, row, col, s_v_r, s_v_c, valid, ACC)
    ret = load_2d(ret_ptr, row, col, s_ret_r, s_ret_c, valid, ACC)
    pm = load_weight(pm_ptr, row, col, s_pm_r, s_pm_c, valid, HAS_PMASK, ACC)
    vm = load_weight(vm_ptr, row, col, s_vm_r, s_vm_c, valid, HAS_VMASK, ACC)
    _, dpl, ratio, _ = ppo_policy_and_grad(
        lp, lp_old, adv, pair(lo_hi, lo_lo, ACC), pair(hi_hi, hi_lo, ACC)
    )
    _, dsq, _ = value_sq_and_grad(v, v_old, ret, pair(vclip_hi, vclip_lo, ACC), True)
    g_loss = tl.load(gout_ptr).to(ACC)
    g_pol = (g_loss + tl.load(gout_ptr + 1).to(ACC)) * tl.load(out_ptr + 5).to(ACC)
    g_val = g_loss * pair(coeff_hi, coeff_lo, ACC) + tl.load(gout_ptr + 2).to(ACC)
    g_val = 0.5 * g_val * tl.load(out_ptr + 6).to(ACC)
    g_ratio = tl.load(gout_ptr + 3).to(ACC) * tl.load(out_ptr + 7).to(ACC)
    g_lp = masked_term(pm, g_pol * dpl)
    g_lp += tl.where(g_ratio != 0, g_ratio * ratio, 0.0)  # an unused ratios_mean never adds NaN
    tl.store(glp_ptr + row * C + col, cast_for(g_lp, glp_ptr), mask=valid)
    tl.store(gv_ptr + row * C + col, cast_for(masked_term(vm, g_val * dsq), gv_ptr), mask=valid)
