"""Token space, advantage estimation: GAE, KL-penalised rewards, group (GRPO / RLOO) baselines.

Everything here runs on ``(B, T)`` or ``(B,)`` tensors, one program per sequence or group,
no atomics (bit-identical on repeat). Hyper-parameters arrive as runtime fp32 pairs
``(hi, lo)`` with ``hi + lo`` equal to the Python float, so fp64 inputs keep fp64 constants.
"""

import triton
import triton.language as tl

from ..common import nan_max, pair
from ..policy.layer2 import kl_and_grad


@triton.jit
def _affine_compose(a_prev, b_prev, a_new, b_new):
    """Compose ``x -> a_new * x + b_new`` after ``x -> a_prev * x + b_prev`` (associative)."""
    return a_prev * a_new, b_prev * a_new + b_new


@triton.jit(do_not_specialize=["T"])
def _gae_fwd_kernel(
    rewards_ptr,
    values_ptr,
    mask_ptr,
    adv_ptr,
    ret_ptr,
    T,
    stride_rb,
    stride_rt,
    stride_vb,
    stride_vt,
    stride_mb,
    stride_mt,
    gamma_hi,
    gamma_lo,
    decay_hi,
    decay_lo,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per sequence: ``A_t = delta_t + gamma*lam*A_{t+1}`` as a reverse scan.

    Blocks of ``BLOCK_T`` steps are visited from the end of the sequence; each block is
    loaded in descending time order, so the reverse recurrence is a forward
    ``associative_scan`` of affine maps ``x -> decay * x + delta_t``. The scan's coefficient
    part is ``decay^(k+1)`` (never divided by, so ``decay`` = 0 or 1 is exact), and the
    advantage at the block's earliest step carries into the next block.
    """
    row = tl.program_id(0).to(tl.int64)
    gamma = tl.cast(gamma_hi, ACC) + tl.cast(gamma_lo, ACC)
    decay = tl.cast(decay_hi, ACC) + tl.cast(decay_lo, ACC)
    idx = tl.arange(0, BLOCK_T)
    decay_vec = tl.zeros((BLOCK_T,), ACC) + decay
    carry = tl.zeros((), ACC)
    for start in range(0, T, BLOCK_T):
        t = (T - 1 - start - idx).to(tl.int64)  # descending time steps
        ok = t >= 0
        ok_next = ok & (t + 1 < T)  # next_value = 0 past the end
        r = tl.load(rewards_ptr + row * stride_rb + t * stride_rt, mask=ok, other=0.0).to(ACC)
        v = tl.load(values_ptr + row * stride_vb + t * stride_vt, mask=ok, other=0.0).to(ACC)
        v_next = tl.load(
            values_ptr + row * stride_vb + (t + 1) * stride_vt, mask=ok_next, other=0.0
        ).to(ACC)
        if HAS_MASK:
            m = tl.load(mask_ptr + row * stride_mb + t * stride_mt, mask=ok, other=0) != 0
            m_next = (
                tl.load(mask_ptr + row * stride_mb + (t + 1) * stride_mt, mask=ok_next, other=0)
                != 0
            )
            # masked steps count as zero reward and zero value (a where, so NaN padding is inert)
            r = tl.where(m, r, 0.0)
            v = tl.where(m, v, 0.0)
            v_next = tl.where(m_next, v_next, 0.0)
        delta = tl.where(ok, r + gamma * v_next - v, 0.0)
        power, local = tl.associative_scan((decay_vec, delta), 0, _affine_compose)
        carried = power * carry
        # decay^(k+1) > 0 that underflowed to 0 carries an inf on as the recurrence does
        # (c * inf = inf at every step), not as 0 * inf = NaN; decay = 0 gives NaN, as there
        inf_carry = tl.where(decay > 0, tl.abs(carry) == float("inf"), False)
        adv = local + tl.where((power == 0) & inf_carry, carry, carried)
        carry = tl.sum(tl.where(idx == BLOCK_T - 1, adv, 0.0), 0)
        ret = adv + v
        if HAS_MASK:
            adv = tl.where(m, adv, 0.0)
            ret = tl.where(m, ret, 0.0)
        tl.store(adv_ptr + row * T + t, adv, mask=ok)
        tl.store(ret_ptr + row * T + t, ret, mask=ok)


@triton.jit(do_not_specialize=["T"])
def _kl_penalized_rewards_fwd_kernel(
    scores_ptr,
    logp_ptr,
    ref_ptr,
    mask_ptr,
    index_ptr,
    out_ptr,
    T,
    stride_s,
    stride_lb,
    stride_lt,
    stride_rb,
    stride_rt,
    stride_mb,
    stride_mt,
    stride_i,
    coef_hi,
    coef_lo,
    HAS_MASK: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per sequence: ``-kl_coef * kl_t`` (0 where masked) plus the score at one step.

    Without ``score_index`` the score lands on the last counted step; blocks are visited from
    the end so that step is known (a running max) by the time its block is written.
    """
    row = tl.program_id(0).to(tl.int64)
    coef = tl.cast(coef_hi, ACC) + tl.cast(coef_lo, ACC)
    score = tl.load(scores_ptr + row * stride_s).to(ACC)
    if HAS_INDEX:
        target = tl.load(index_ptr + row * stride_i).to(tl.int64)
    else:
        target = tl.full((), -1, tl.int64)
    idx = tl.arange(0, BLOCK_T)
    for start in range(0, T, BLOCK_T):
        t = (T - 1 - start - idx).to(tl.int64)
        ok = t >= 0
        lp = tl.load(logp_ptr + row * stride_lb + t * stride_lt, mask=ok, other=0.0).to(ACC)
        rf = tl.load(ref_ptr + row * stride_rb + t * stride_rt, mask=ok, other=0.0).to(ACC)
        kl, _ = kl_and_grad(lp, rf, KIND)
        reward = -coef * kl
        if HAS_MASK:
            m = tl.load(mask_ptr + row * stride_mb + t * stride_mt, mask=ok, other=0) != 0
            m = m & ok
            reward = tl.where(m, reward, 0.0)
            if not HAS_INDEX:
                target = nan_max(target, tl.max(tl.where(m, t, -1), 0))
        elif not HAS_INDEX:
            target = (T - 1).to(tl.int64)
        reward = tl.where(t == target, reward + score, reward)
        tl.store(out_ptr + row * T + t, reward, mask=ok)


@triton.jit(do_not_specialize=["group_size"])
def _group_advantages_fwd_kernel(
    scores_ptr,
    out_ptr,
    group_size,
    stride_s,
    eps_hi,
    eps_lo,
    MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per group of ``group_size`` consecutive scores.

    ``MODE``: 0 ``(s - mean) / (std + eps)``, 1 ``s - mean``, 2 RLOO leave-one-out.
    ``eps`` arrives as an fp32 pair (``f32_pair``): fp64-exact for fp64 scores.

    Scores are shifted by the group's first score before summing: a constant group then
    centres to exactly 0 (never ``rounding / eps``), and the variance pass is stable.
    Three short loops (mean, variance, write) re-read the group; it is a few floats.
    """
    eps = pair(eps_hi, eps_lo, ACC)
    group = tl.program_id(0).to(tl.int64)
    base = group * group_size
    shift = tl.load(scores_ptr + base * stride_s).to(ACC)
    idx = tl.arange(0, BLOCK_N)
    n = group_size.to(ACC)
    total = tl.zeros((), ACC)
    for start in range(0, group_size, BLOCK_N):
        j = start + idx
        ok = j < group_size
        x = tl.load(scores_ptr + (base + j) * stride_s, mask=ok, other=0.0).to(ACC)
        total += tl.sum(tl.where(ok, x - shift, 0.0), 0)
    mean = total / n  # relative to the shift
    if MODE == 0:
        sq = tl.zeros((), ACC)
        for start in range(0, group_size, BLOCK_N):
            j = start + idx
            ok = j < group_size
            x = tl.load(scores_ptr + (base + j) * stride_s, mask=ok, other=0.0).to(ACC)
            c = tl.where(ok, (x - shift) - mean, 0.0)
            sq += tl.sum(c * c, 0)
        var = sq / nan_max(n - 1.0, 1.0)  # unbiased; a group of one has std 0
        denom = tl.sqrt(var) + eps
    elif MODE == 1:
        denom = n * 0.0 + 1.0
    else:
        # s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean)
        denom = (n - 1.0) / n
    for start in range(0, group_size, BLOCK_N):
        j = start + idx
        ok = j < group_size
        x = tl.load(scores_ptr + (base + j) * stride_s, mask=ok, other=0.0).to(ACC)
        c = (x - shift) - mean
        # a score equal to its group mean gives 0, even for a constant group with eps = 0
        tl.store(out_ptr + base + j, tl.where(c == 0, 0.0, c / denom), mask=ok)
