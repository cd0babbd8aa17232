"""Token space, rollout correction: behaviour-policy (vLLM) importance-sampling weights.

``_rollout_is_weights_fwd_kernel`` on ``(B, T)`` strided inputs, one launch for every level
and mode (``fused_rl.rollout.rollout_is_weights`` documents the semantics):

* token level: grid ``(B, cdiv(T, BLOCK_T))``, one block of one sequence per program;
* sequence / geometric level: grid ``(B, 1)``, one program per sequence (as
  ``policy/token_pass._policy_token_fwd_kernel`` is organised): a first pass sums the counted
  log-ratios (and counts the tokens for the mean) in a fixed order, a second writes the
  sequence's weight to its tokens. Reads the inputs once, the mask twice.

Tokens that do not count read as log-ratio 0 through a ``where`` (NaN / inf padding never
reaches a sum) and get weight 1, ``keep`` False. Bounds arrive as fp32 pairs (``pair``):
``clip_min`` None is 0, ``clip_max`` None is +inf. No atomics: bit-identical on repeat.
"""

import triton
import triton.language as tl

from ..common import clamp, pair


@triton.jit
def _counted(mask_ptr, b, ts, in_seq, stride_mb, stride_mt, HAS_MASK: tl.constexpr):
    """Tokens that count: inside the sequence and (with a mask) where the mask is nonzero."""
    if HAS_MASK:
        m = tl.load(mask_ptr + b * stride_mb + ts * stride_mt, mask=in_seq, other=0)
        return in_seq & (m != 0)
    else:
        return in_seq


@triton.jit
def _log_ratio(old_ptr, roll_ptr, b, ts, counted, stride_ob, stride_ot, stride_rb, stride_rt,
               ACC: tl.constexpr):  # fmt: skip
    """``old - rollout`` where counted, exactly 0 elsewhere (only counted tokens are read)."""
    old = tl.load(old_ptr + b * stride_ob + ts * stride_ot, mask=counted, other=0.0).to(ACC)
    roll = tl.load(roll_ptr + b * stride_rb + ts * stride_rt, mask=counted, other=0.0).to(ACC)
    return tl.where(counted, old - roll, 0.0)


@triton.jit(
    do_not_specialize=[
        "T", "stride_ob", "stride_ot", "stride_rb", "stride_rt", "stride_mb", "stride_mt",
    ]
)  # fmt: skip
def _rollout_is_weights_fwd_kernel(
    old_ptr,
    roll_ptr,
    mask_ptr,
    w_ptr,
    keep_ptr,
    T,
    stride_ob,
    stride_ot,
    stride_rb,
    stride_rt,
    stride_mb,
    stride_mt,
    lo_hi,
    lo_lo,
    hi_hi,
    hi_lo,
    HAS_MASK: tl.constexpr,
    SEQUENCE: tl.constexpr,
    MEAN: tl.constexpr,
    REJECT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """Weights into a contiguous ``(B, T)`` buffer of ``ACC``; with ``REJECT`` also the bool
    ``keep``. ``SEQUENCE``: one log-weight per sequence, the sum of its counted log-ratios
    (``MEAN``: their mean, 0 for an empty row). ``REJECT``: ``mode="mask"`` (weight 0 and
    ``keep`` False outside ``[lo, hi]``, the raw ratio inside), else ``mode="truncate"``
    (``clamp(ratio, lo, hi)``)."""
    b = tl.program_id(0).to(tl.int64)
    lo = pair(lo_hi, lo_lo, ACC)
    hi = pair(hi_hi, hi_lo, ACC)
    offs = tl.arange(0, BLOCK_T).to(tl.int64)
    seq_log_w = tl.zeros((), ACC)
    if SEQUENCE:
        acc = tl.zeros((BLOCK_T,), ACC)
        acc_n = tl.zeros((BLOCK_T,), ACC)
        for t0 in range(0, T, BLOCK_T):
            ts = t0 + offs
            in_seq = ts < T
            counted = _counted(mask_ptr, b, ts, in_seq, stride_mb, stride_mt, HAS_MASK)
            acc += _log_ratio(old_ptr, roll_ptr, b, ts, counted, stride_ob, stride_ot,
                              stride_rb, stride_rt, ACC)  # fmt: skip
            acc_n += tl.where(counted, 1.0, 0.0).to(ACC)
        seq_log_w = tl.sum(acc, 0)
        if MEAN:
            n = tl.sum(acc_n, 0)
            seq_log_w = tl.where(n > 0, seq_log_w / tl.where(n > 0, n, 1.0), 0.0)
        start = 0
        stop = T
    else:
        start = tl.program_id(1) * BLOCK_T
        stop = start + BLOCK_T
    for t0 in range(start, stop, BLOCK_T):
        ts = t0 + offs
        in_seq = ts < T
        counted = _counted(mask_ptr, b, ts, in_seq, stride_mb, stride_mt, HAS_MASK)
        if SEQUENCE:
            log_w = tl.where(counted, seq_log_w, 0.0)
        else:
            log_w = _log_ratio(old_ptr, roll_ptr, b, ts, counted, stride_ob, stride_ot,
                               stride_rb, stride_rt, ACC)  # fmt: skip
        w = tl.exp(log_w)
        if REJECT:
            # a NaN ratio is never rejected: it stays NaN and counted (NaN in, NaN out)
            rejected = (w < lo) | (w > hi)
            w = tl.where(rejected, 0.0, w)
            tl.store(keep_ptr + b * T + ts, counted & (rejected == 0), mask=in_seq)
        else:
            w = clamp(w, lo, hi)
        tl.store(w_ptr + b * T + ts, tl.where(counted, w, 1.0), mask=in_seq)
