"""Layer 1, vocab-stream forward: one pass over each logits row.

Per row of logits ``x`` (scaled ``z = x / T``, or soft-capped ``z = c tanh(x / c) / T``) the
pass keeps, in fp32:

* ``m``: the running maximum of ``z``;
* ``s``: ``sum exp(z - m)``;
* ``w``: ``sum exp(z - m) * (z - m)`` (kept relative to ``m`` so the entropy
  ``H = log s - w / s`` never cancels two large numbers);

and merges them block by block with :func:`merge_stats` (associative, so the same
statistics can be merged across vocab shards). The target logit is one scalar load.
Outputs are per-row floats only: ``logp = (z_y - m) - log s``, ``entropy``, and ``m`` and
``log s`` kept apart (not summed into ``lse``) so the backward's ``p = exp((z - m) - log s)``
stays exact to fp32 even for logits of magnitude 1e4.
"""

import triton
import triton.language as tl

from ..common import (
    exp,
    lift_neg_inf,
    nan_max,
    pair,
    row_pointer,
    tanh_and_sech2,
    token_offset,
    widen,
)


@triton.jit
def merge_stats(m_a, s_a, w_a, m_b, s_b, w_b):
    """Merge two partial row statistics (max, sum-exp, sum-exp*(z-max)).

    Associative and commutative; an empty partial is ``(-inf, 0, 0)``.
    """
    m = nan_max(m_a, m_b)
    m_ref = tl.where(m == float("-inf"), 0.0, m)  # both empty: keep everything finite
    alpha_a = exp(m_a - m_ref)
    alpha_b = exp(m_b - m_ref)
    # re-centre each partial's w on the merged max: w + (m_part - m) * s
    w_a = tl.where(s_a > 0, w_a + (m_a - m_ref) * s_a, 0.0)
    w_b = tl.where(s_b > 0, w_b + (m_b - m_ref) * s_b, 0.0)
    return m, s_a * alpha_a + s_b * alpha_b, w_a * alpha_a + w_b * alpha_b


@triton.jit
def scaled_logits(x, inv_temperature, inv_cap, HAS_SOFTCAP: tl.constexpr):
    """``z = x / T``; with the soft cap ``c`` (Gemma's ``final_logit_softcapping``),
    ``z = c tanh(x / c) / T``, where ``inv_temperature`` carries ``c / T`` and ``inv_cap``
    ``1 / c`` (the launchers pass them so, ``fused_rl._launch.NO_CAP`` without a cap). A
    model's logit scale ``s`` (the distillation kernels) folds in: ``s / T``, or ``c / T``
    and ``s / c``, for ``z = c tanh(s x / c) / T``."""
    if HAS_SOFTCAP:
        t, _ = tanh_and_sech2(x * inv_cap)
        return t * inv_temperature
    else:
        return x * inv_temperature


@triton.jit
def target_logp(z_y, m, log_s):
    """``log p_y = (z_y - m) - log_s``, at most 0. The compiler may fuse ``z_y = x_y / T``
    into the subtraction (one FMA, ``x_y / T`` unrounded) while ``m`` holds the rounded
    ``z``: on a point mass that left ``+5e-8`` (a GPU, T = 0.7). Only a rounding-sized
    excess is clamped (a larger one is a bug, and shows); the ``where`` keeps NaN."""
    logp = (z_y - m) - log_s
    return tl.where((logp > 0) & (logp <= 1e-6 * (1.0 + tl.abs(m))), 0.0, logp)


@triton.jit
def block_stats(z, WITH_ENTROPY: tl.constexpr, WITH_SQ: tl.constexpr = False):
    """Statistics of one block of scaled logits (``-inf`` where masked out): ``(m, s, w,
    q)``, ``q = sum exp(2 (z - m))`` with ``WITH_SQ`` (else 0), from the same ``exp``."""
    m = tl.max(z, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    d = z - m_ref
    e = exp(d)
    s = tl.sum(e, 0)
    if WITH_ENTROPY:
        w = tl.sum(e * lift_neg_inf(d), 0)  # 0 * -inf guarded
    else:
        w = s * 0.0
    if WITH_SQ:
        q = tl.sum(e * e, 0)
    else:
        q = s * 0.0
    return m, s, w, q


@triton.jit
def row_moments(
    row_ptr,
    V,
    stride_v,
    inv_temperature,
    inv_cap,
    active,
    WITH_ENTROPY: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """Stream one logits row once; return ``(m, log_s, entropy)`` of ``softmax(z)``,
    ``z`` the scaled logits (:func:`scaled_logits`).

    ``lse = m + log_s``; keeping the two apart lets ``logp = (z_y - m) - log_s`` avoid the
    rounding of a large ``lse`` (|logits| ~ 1e4 in fp32). ``active`` False skips the loads
    (ignored tokens cost no bandwidth).
    """
    m, log_s, entropy, _, _, _, _ = row_pass(
        row_ptr, V, stride_v, inv_temperature, inv_cap, active, -1, 0.0, WITH_ENTROPY, False,
        HAS_SOFTCAP, BLOCK_V, ACC,
    )  # fmt: skip
    return m, log_s, entropy


@triton.jit
def row_pass(
    row_ptr,
    V,
    stride_v,
    inv_temperature,
    inv_cap,
    active,
    target,
    x_target,
    WITH_ENTROPY: tl.constexpr,
    WITH_EXTRAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """:func:`row_moments` and, with ``WITH_EXTRAS``, from the same read of the row:
    ``z_sum = sum z`` (the mean logit is ``z_sum / V``), ``q = sum exp(2 (z - m))`` (so
    ``log sum p^2 = log q - 2 log s``), the raw logits' max ``x_max`` (NaN if the row holds
    a NaN) and ``tied``: an id below ``target`` whose raw logit reaches the target's
    ``x_target``. The target is the first argmax iff ``x_target >= x_max`` and none is
    ``tied``; ranked on the raw logits, which the temperature and the cap keep in order, so
    no rounding of theirs makes or breaks a tie. Returns ``(m, log_s, entropy, z_sum, q,
    x_max, tied)`` (``tied`` a count); the last four are 0 / 0 / -inf / 0 without
    ``WITH_EXTRAS``."""
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    w = tl.zeros((), ACC)
    z_sum = tl.zeros((), ACC)
    q = tl.zeros((), ACC)
    x_max = tl.full((), float("-inf"), ACC)
    n_cols = tl.where(active, V, 0)
    tied = tl.zeros((), tl.int32)  # ids below the target reaching its logit
    nans = tl.zeros((), tl.int32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
        x = widen(x, ACC)
        z = scaled_logits(x, inv_temperature, inv_cap, HAS_SOFTCAP)
        if HAS_SOFTCAP:  # the cap maps the padding lanes' -inf to -c / T: back to -inf
            z = tl.where(cols < V, z, float("-inf"))
        m_b, s_b, w_b, q_b = block_stats(z, WITH_ENTROPY, WITH_EXTRAS)
        if WITH_EXTRAS:
            z_sum += tl.sum(tl.where(cols < V, z, 0.0), 0)
            # q and the block's q_b onto the merged max (as merge_stats moves s)
            m_new = nan_max(m, m_b)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            q = q * exp(2.0 * (m - m_ref)) + q_b * exp(2.0 * (m_b - m_ref))
            x_max = nan_max(x_max, tl.max(x, 0))
            nans += tl.sum((x != x).to(tl.int32), 0)
            tied += tl.sum(((cols < target) & (x >= x_target)).to(tl.int32), 0)
        m, s, w = merge_stats(m, s, w, m_b, s_b, w_b)
    log_s = tl.log(s)
    entropy = log_s - w / s
    # H >= 0 always; rounding can leave -1e-8 on a point mass (a where() keeps NaN as NaN)
    entropy = tl.where(entropy < 0, 0.0, entropy)
    x_max = tl.where(nans > 0, float("nan"), x_max)
    return m, log_s, entropy, z_sum, q, x_max, tied


@triton.jit
def target_logit(
    row_ptr, target, V, stride_v, inv_temperature, inv_cap, active,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Scaled logit of the target, or NaN for a target outside ``[0, V)`` (never a wild read)."""
    x = target_raw(row_ptr, target, V, stride_v, active, ACC)
    return scaled_logits(x, inv_temperature, inv_cap, HAS_SOFTCAP)


@triton.jit
def target_raw(row_ptr, target, V, stride_v, active, ACC: tl.constexpr):
    """The target's logit as stored (in ``ACC``), NaN for a target outside ``[0, V)``."""
    in_range = (target >= 0) & (target < V)
    safe = tl.where(in_range, target, 0).to(tl.int64)
    x = tl.load(row_ptr + safe * stride_v, mask=active & in_range, other=0.0)
    return tl.where(in_range, x.to(ACC), float("nan"))


@triton.jit(
    do_not_specialize=["rows_inner", "shift", "ignore_index", "t_stride_outer", "t_stride_inner"]
)
def _token_stats_fwd_kernel(
    logits_ptr,
    targets_ptr,
    logp_ptr,
    entropy_ptr,
    max_ptr,
    log_sum_ptr,
    mean_ptr,
    log_sq_ptr,
    top1_ptr,
    raw_max_ptr,
    rows_inner,
    shift,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    t_stride_outer,
    t_stride_inner,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    ignore_index,
    HAS_TARGETS: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    WITH_EXTRAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per target row: ``logp`` (if targets), ``entropy`` (if asked), ``m``,
    ``log s``, each written contiguous ``(outer * rows_inner,)``. Logits row ``inner + shift``
    of each ``outer`` predicts target ``inner`` (see ``row_pointer``); targets are strided.
    ``inv_t``: ``1 / T`` (``c / T`` with ``HAS_SOFTCAP``), ``inv_cap``: ``1 / c``.
    ``WITH_EXTRAS`` (with targets), from the same read of the row: the mean scaled logit,
    ``log sum p^2``, whether the target is the first argmax of the row's logits (a byte,
    0 / 1; none where the row holds a NaN) and the raw logits' max (NaN then; what the
    vocabulary-parallel merge compares across shards); ignored rows get 0. Bytes: one read
    of each counted row; 12 bytes written a token (logp, m, log s), 4 more with the
    entropy, 13 more with ``WITH_EXTRAS``; fp64 logits: twice the floats."""
    row = tl.program_id(0).to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # 1 / T, fp64-exact for fp64 logits
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: 1 / c, and the above c / T
    row_ptr = row_pointer(logits_ptr, row, rows_inner, shift, stride_outer, stride_inner)
    if HAS_TARGETS:
        t_off = token_offset(row, rows_inner, t_stride_outer, t_stride_inner)
        target = tl.load(targets_ptr + t_off).to(tl.int64)
        active = target != ignore_index
        x_y = target_raw(row_ptr, target, V, stride_v, active, ACC)
    else:
        target = row * 0 - 1
        active = row >= 0
        x_y = tl.zeros((), ACC)
    m, log_s, entropy, z_sum, q, x_max, tied = row_pass(
        row_ptr, V, stride_v, inv_temperature, inv_cap, active, target, x_y, WITH_ENTROPY,
        WITH_EXTRAS, HAS_SOFTCAP, BLOCK_V, ACC,
    )  # fmt: skip
    tl.store(max_ptr + row, tl.where(active, m, 0.0))
    tl.store(log_sum_ptr + row, tl.where(active, log_s, 0.0))
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, tl.where(active, entropy, 0.0))
    if HAS_TARGETS:
        z_y = scaled_logits(x_y, inv_temperature, inv_cap, HAS_SOFTCAP)
        tl.store(logp_ptr + row, tl.where(active, target_logp(z_y, m, log_s), 0.0))
        if WITH_EXTRAS:
            tl.store(mean_ptr + row, tl.where(active, z_sum / V, 0.0))
            tl.store(log_sq_ptr + row, tl.where(active, tl.log(q) - 2.0 * log_s, 0.0))
            tl.store(raw_max_ptr + row, tl.where(active, x_max, 0.0))
            top1 = active & (x_y >= x_max) & (tied == 0)
            tl.store(top1_ptr + row, top1.to(tl.uint8))
