"""Layer 2, token space: masked reductions on ``(R, C)`` views (sum, mean, variance, whiten).

Conventions shared by the token-space kernels (``values.py``, ``kl.py`` import
the helpers below):

* every input is a 2-D view ``(R, C)`` with its own strides; element ``(r, c)`` lives at
  ``r * stride_r + c * stride_c``, so slices and transposes are read in place;
* every offset is int64: lengths and strides arrive as i32 when they fit, and ``3 * R`` or
  ``2 * P`` need not (``wide``; ``tests/hopper_compile.py`` checks the TTIR for i32 products);
* *flat* kernels: program ``p`` covers the row-major flat indices ``[p * BLOCK, (p + 1) * BLOCK)``
  of the ``R * C`` elements, so every aspect ratio fills its blocks;
* reductions are two-stage and deterministic: program ``p`` writes its partial sums to
  column ``p`` of a ``(K, P)`` buffer and one single-program kernel merges the columns in a
  fixed order (no float atomics, bit-identical on repeat);
* masks are loaded as weights ``w`` (bool masks as uint8); a position with ``w == 0``
  contributes exactly 0, whatever its value (NaN / inf at padding included).

Moments are kept as ``(n, s, q)`` = (sum of weights, weighted sum, weighted sum of squared
deviations from the mean) and merged with Chan et al.'s pairwise update, so the variance is a
single pass over the data with no cancellation between two large sums.
"""

import triton
import triton.language as tl

from ..common import as_weight, cast_for, pair


@triton.jit
def wide(n):
    """``n`` (an i32 argument, or a constexpr such as 1) as an int64 scalar, so that products
    such as ``3 * n`` are computed in 64 bits."""
    return tl.zeros((), tl.int64) + n


@triton.jit
def flat_rowcol(N, C, BLOCK: tl.constexpr):
    """``(row, col, valid)`` int64 vectors of this program's block of flat indices."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < N
    row = idx // C
    return row, idx - row * C, valid


@triton.jit
def load_weight(
    m_ptr, row, col, stride_r, stride_c, valid, HAS_MASK: tl.constexpr, ACC: tl.constexpr
):
    """Mask value as a weight in ``ACC``: 0 outside the tensor, 1 everywhere without a mask."""
    if HAS_MASK:
        w = as_weight(tl.load(m_ptr + row * stride_r + col * stride_c, mask=valid, other=0).to(ACC))
    else:
        w = tl.where(valid, 1.0, 0.0).to(ACC)
    return w


@triton.jit
def safe(d):
    """``d`` with zeros replaced by 1 (a denominator whose quotient is discarded when 0)."""
    return tl.where(d != 0, d, 1.0)


@triton.jit
def sum_partials(part_ptr, P, k, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Sum of row ``k`` of a ``(K, P)`` partials buffer, in a fixed order (deterministic)."""
    acc = tl.zeros((BLOCK_P,), ACC)
    for start in range(0, P, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        acc += tl.load(part_ptr + k * wide(P) + cols, mask=cols < P, other=0.0).to(ACC)
    return tl.sum(acc, 0)


@triton.jit
def block_moments(x, w, WITH_VAR: tl.constexpr):
    """``(n, s, q)`` of one block; ``q`` is centred on the block's own mean (two passes over
    registers, one over memory)."""
    n = tl.sum(w, 0)
    s = tl.sum(tl.where(w != 0, w * x, 0.0), 0)
    if WITH_VAR:
        d = x - s / safe(n)
        q = tl.sum(tl.where(w != 0, w * d * d, 0.0), 0)
    else:
        q = s * 0.0
    return n, s, q


@triton.jit
def merge_moments(n_a, s_a, q_a, n_b, s_b, q_b):
    """Chan's pairwise merge of two ``(n, s, q)`` moment triples (an empty one is all zeros)."""
    n = n_a + n_b
    delta = s_b / safe(n_b) - s_a / safe(n_a)
    # no cross term with an empty side: its inf * 0 would turn a variance that overflows fp32
    # (inf, as in float64 autograd) into NaN (a NaN count is not empty: NaN goes through)
    both = (n_a != 0) & (n_b != 0)
    q = q_a + q_b + tl.where(both, delta * delta * (n_a * n_b / safe(n)), 0.0)
    return n, s_a + s_b, q


@triton.jit
def store_stats(stats_ptr, stride_k, n, s, q, correction):
    """Write ``(n, sum, mean, var)`` at ``stats_ptr + k * stride_k``; an empty mean is 0 and a
    variance with ``n - correction <= 0`` degrees of freedom is 0 (never NaN)."""
    dof = n - correction
    stride_k = wide(stride_k)
    tl.store(stats_ptr, n)
    tl.store(stats_ptr + stride_k, s)
    tl.store(stats_ptr + 2 * stride_k, s / safe(n))
    no_dof = dof <= 0  # False for a NaN count (a negative weight): NaN goes through
    tl.store(stats_ptr + 3 * stride_k, tl.where(no_dof, 0.0, q / safe(dof)))


@triton.jit(do_not_specialize=["N", "C"])
def _masked_moments_fwd_kernel(
    x_ptr,
    m_ptr,
    part_ptr,
    N,
    C,
    stride_xr,
    stride_xc,
    stride_mr,
    stride_mc,
    HAS_MASK: tl.constexpr,
    WITH_VAR: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Flat stage 1 of a whole-tensor reduction: ``(n, s, q)`` of this block to ``part[:, p]``
    (a ``(3, P)`` buffer)."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
    w = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
    n, s, q = block_moments(x, w, WITH_VAR)
    P = tl.num_programs(0).to(tl.int64)
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, n)
    tl.store(part_ptr + P + pid, s)
    tl.store(part_ptr + 2 * P + pid, q)


@triton.jit(do_not_specialize=["P"])
def _masked_moments_finalize_kernel(
    part_ptr,
    stats_ptr,
    P,
    correction,
    BLOCK_P: tl.constexpr,
    ACC: tl.constexpr,
):
    """Stage 2 (one program): merge the ``(3, P)`` partials into ``stats = (n, sum, mean,
    var)``, chunk by chunk in a fixed order."""
    n = tl.zeros((), ACC)
    s = tl.zeros((), ACC)
    q = tl.zeros((), ACC)
    row_s = part_ptr + wide(P)
    row_q = part_ptr + 2 * wide(P)
    for start in range(0, P, BLOCK_P):
        cols = start + tl.arange(0, BLOCK_P)
        keep = cols < P
        n_i = tl.load(part_ptr + cols, mask=keep, other=0.0)
        s_i = tl.load(row_s + cols, mask=keep, other=0.0)
        q_i = tl.load(row_q + cols, mask=keep, other=0.0)
        n_b = tl.sum(n_i, 0)
        s_b = tl.sum(s_i, 0)
        dev = s_i / safe(n_i) - s_b / safe(n_b)
        q_b = tl.sum(q_i + n_i * dev * dev, 0)
        n, s, q = merge_moments(n, s, q, n_b, s_b, q_b)
    store_stats(stats_ptr, 1, n, s, q, correction)


@triton.jit(do_not_specialize=["R", "C"])
def _masked_row_moments_fwd_kernel(
    x_ptr,
    m_ptr,
    stats_ptr,
    R,
    C,
    stride_xr,
    stride_xc,
    stride_mr,
    stride_mc,
    correction,
    HAS_MASK: tl.constexpr,
    WITH_VAR: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row: the row's ``(n, sum, mean, var)`` straight into the ``(4, R)``
    stats buffer (a reduction along the last axis needs no second stage)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.zeros((), ACC)
    s = tl.zeros((), ACC)
    q = tl.zeros((), ACC)
    for start in range(0, C, BLOCK):
        col = start + tl.arange(0, BLOCK).to(tl.int64)
        valid = col < C
        x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
        w = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
        n_b, s_b, q_b = block_moments(x, w, WITH_VAR)
        n, s, q = merge_moments(n, s, q, n_b, s_b, q_b)
    store_stats(stats_ptr + row, R, n, s, q, correction)


@triton.jit(do_not_specialize=["N", "C"])
def _masked_moments_bwd_kernel(
    x_ptr,
    m_ptr,
    stats_ptr,
    gstats_ptr,
    gx_ptr,
    N,
    C,
    stride_xr,
    stride_xc,
    stride_mr,
    stride_mc,
    stats_stride_k,
    stats_stride_r,
    correction,
    HAS_MASK: tl.constexpr,
    WITH_VAR: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """``dx = w * (g_sum + g_mean / n + g_var * 2 (x - mean) / (n - correction))`` into a
    contiguous ``(R, C)`` buffer; stats / grads per row (``stats_stride_r = 1``) or shared by
    all rows (``stats_stride_r = 0``). Terms whose forward value was the 0 of an empty mask
    or of too few degrees of freedom get no gradient."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    w = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
    at = row * stats_stride_r
    stats_stride_k = wide(stats_stride_k)
    n = tl.load(stats_ptr + at, mask=valid, other=1.0).to(ACC)
    g_sum = tl.load(gstats_ptr + stats_stride_k + at, mask=valid, other=0.0).to(ACC)
    g_mean = tl.load(gstats_ptr + 2 * stats_stride_k + at, mask=valid, other=0.0).to(ACC)
    coef = g_sum + tl.where(n != 0, g_mean / safe(n), 0.0)
    if WITH_VAR:
        x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
        mean = tl.load(stats_ptr + 2 * stats_stride_k + at, mask=valid, other=0.0).to(ACC)
        g_var = tl.load(gstats_ptr + 3 * stats_stride_k + at, mask=valid, other=0.0).to(ACC)
        dof = n - correction
        # the closed form drops the mean's term (its weighted deviations sum to 0); with a
        # counted inf that sum is inf - inf = NaN in autograd, so a non-finite mean gives NaN
        # here too (mean - mean is 0 for a finite mean)
        dev = (x - mean) + (mean - mean)
        coef += tl.where(dof > 0, 2.0 * g_var / safe(dof), 0.0) * dev
    gx = tl.where(w != 0, w * coef, 0.0)
    tl.store(gx_ptr + row * C + col, cast_for(gx, gx_ptr), mask=valid)


@triton.jit(do_not_specialize=["N", "C"])
def _masked_whiten_fwd_kernel(
    x_ptr,
    stats_ptr,
    y_ptr,
    N,
    C,
    stride_xr,
    stride_xc,
    eps_hi,
    eps_lo,
    KEEP_MEAN: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Stage 3 of whitening: ``y = (x - mean) / sqrt(var + eps)`` (``+ mean`` if KEEP_MEAN) for
    every position, masked or not, with the masked statistics from ``stats``; ``eps`` comes
    as an fp32 pair (fp64-exact for fp64 inputs)."""
    eps = pair(eps_hi, eps_lo, ACC)
    row, col, valid = flat_rowcol(N, C, BLOCK)
    x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
    mean = tl.load(stats_ptr + 2).to(ACC)
    rstd = 1.0 / tl.sqrt(tl.load(stats_ptr + 3).to(ACC) + eps)
    y = (x - mean) * rstd
    if KEEP_MEAN:
        y += mean
    tl.store(y_ptr + row * C + col, cast_for(y, y_ptr), mask=valid)


@triton.jit(do_not_specialize=["N", "C"])
def _masked_whiten_bwd_partials_kernel(
    x_ptr,
    gy_ptr,
    stats_ptr,
    part_ptr,
    N,
    C,
    stride_xr,
    stride_xc,
    stride_gr,
    stride_gc,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Backward stage 1: this block's ``sum(gy)`` and ``sum(gy * (x - mean))`` over every
    position (each output depends on the statistics) into the ``(2, P)`` buffer. A position
    with ``gy == 0`` adds exactly 0 to the second sum, so padding that holds NaN / inf and is
    zeroed downstream cannot turn every gradient into ``0 * NaN``."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
    gy = tl.load(gy_ptr + row * stride_gr + col * stride_gc, mask=valid, other=0.0).to(ACC)
    mean = tl.load(stats_ptr + 2).to(ACC)
    P = tl.num_programs(0).to(tl.int64)
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, tl.sum(gy, 0))
    # gy is 0 outside the tensor too (other=0.0)
    tl.store(part_ptr + P + pid, tl.sum(tl.where(gy != 0, gy * (x - mean), 0.0), 0))


@triton.jit(do_not_specialize=["N", "C"])
def _masked_whiten_bwd_kernel(
    x_ptr,
    m_ptr,
    gy_ptr,
    stats_ptr,
    sums_ptr,
    gx_ptr,
    N,
    C,
    stride_xr,
    stride_xc,
    stride_mr,
    stride_mc,
    stride_gr,
    stride_gc,
    eps_hi,
    eps_lo,
    correction,
    KEEP_MEAN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """Backward stage 2, with ``S1 = sum(gy)``, ``S2 = sum(gy (x - mean))``, ``r = rsqrt(var +
    eps)``, ``k = KEEP_MEAN``::

        dx = r (gy - w S1 / n) + w [k S1 / n - r^3 S2 (x - mean) / (n - c)]
    """
    row, col, valid = flat_rowcol(N, C, BLOCK)
    x = tl.load(x_ptr + row * stride_xr + col * stride_xc, mask=valid, other=0.0).to(ACC)
    gy = tl.load(gy_ptr + row * stride_gr + col * stride_gc, mask=valid, other=0.0).to(ACC)
    w = load_weight(m_ptr, row, col, stride_mr, stride_mc, valid, HAS_MASK, ACC)
    n = tl.load(stats_ptr).to(ACC)
    mean = tl.load(stats_ptr + 2).to(ACC)
    var = tl.load(stats_ptr + 3).to(ACC)
    s1 = tl.load(sums_ptr).to(ACC)
    s2 = tl.load(sums_ptr + 1).to(ACC)
    rstd = 1.0 / tl.sqrt(var + pair(eps_hi, eps_lo, ACC))
    dof = n - correction
    g_mean = tl.where(n != 0, s1 / safe(n), 0.0)
    d_var = tl.where(dof > 0, -rstd * rstd * rstd * s2 / safe(dof), 0.0)
    # centre gy before scaling by rstd: no cancellation of two rstd-sized terms when var ~ 0
    gx = rstd * (gy - tl.where(w != 0, w * g_mean, 0.0))
    if KEEP_MEAN:
        gx += tl.where(w != 0, w * g_mean, 0.0)
    gx += tl.where(w != 0, w * d_var * (x - mean), 0.0)
    tl.store(gx_ptr + row * C + col, cast_for(gx, gx_ptr), mask=valid)
