"""Two logits rows streamed together: the statistics of ``p = softmax(z)`` and
``q = softmax(u)`` (``z = x / T``, ``u = y / T``; soft-capped ``z = c tanh(s x / c) / T``, a
logit scale ``s`` folded into the constants) in one pass, kept relative to each row's
running maximum, and the divergences between them without cancellation. Both rows share
one transform, except under ``SPLIT`` (distillation between models with their own logit
scale or soft cap): each row then has its own (``split_values``).

Used by on-policy distillation (``kernels/vocab/distill.py``: student and teacher) and by
the exact KL of the policy loss (``kernels/vocab/policy_fused.py``, ``kl_estimator="full"``:
policy and reference, gradient in ``kernels/vocab/layer3.py``).

Notation, per row: ``a = z - M_z``, ``b = u - M_u`` (``M`` the running maxima),
``S_z = sum e^a``, ``S_u = sum e^b``, ``W_z = sum e^a a``, ``W_u = sum e^b b``,
``F = sum e^b (b - a)``, ``R = sum e^a (a - b)``. Then ``H(p) = log S_z - W_z / S_z``,
``KL(q || p) = F / S_u + log(S_z / S_u)``, ``KL(p || q) = R / S_z - log(S_z / S_u)``.

Near-cancellation: when ``p`` is near ``q`` every divergence is of order ``delta^2``
(``delta = log q - log p``) while ``a``, ``b``, ``log S`` are of order ``log V``, so nothing of
size ``log V`` may be rounded into them. ``b - a`` comes from the logits' own difference
(``logit_gap``; with the soft cap ``capped_gap``, the two tanh's difference as ``sinh(d)
sech(v) sech(w)``); ``log(S_z / S_u) = -log1p(G / S_z)`` with ``G = S_u - S_z`` summed from its
own per-column terms ``e^a expm1(b - a)`` (``log_ratio_of_sums``). Per column
``delta = (b - a) + log(S_z / S_u)`` (``near_delta``): a row constant's rounding moves every
``delta`` alike, a first-order change of 0 in every divergence.

When a block raises a maximum by ``-d`` (``d = M_old - M_new <= 0``) the running sums are
rescaled online, in that block only: ``S <- e^d S``, ``W <- e^d (W + d S)``, and ``F`` /
``R`` also shift by the other stream's ``d``. The branch is uniform: each lane's maxima
(no cross-lane traffic) give one integer flag a lane, reduced across the warp by one
instruction (``REDUX``); the block's maxima across the lanes (two shuffle trees) are taken
inside it, by the few blocks that raise one (3 to 22 of the 297 of a row of 151936
Gaussian or Gumbel logits, by a NumPy model).

A term whose weight ``e^a`` (``e^b``) is exactly 0 contributes 0 (``0 * -inf`` guarded with
a ``where`` that keeps NaN as NaN), so ``-inf`` logits give the finite limit; a NaN logit
makes the row NaN.

Gradient of the reverse KL through the softmax (``reverse_kl_grad``):
``dKL(p || q)/dz_v = p_v (log p_v - log q_v - KL(p || q)) = p_v (-delta_v - KL)``; 0 where
``p_v == 0`` unless the row's KL is not finite (NaN, or ``+inf``: ``q = 0`` where ``p > 0``),
which makes every column's gradient non-finite, those columns NaN.
"""

import triton
import triton.language as tl

from ..common import (
    exp,
    lane_maxima,
    lane_sums,
    lift_neg_inf,
    nan_max,
    tanh_and_sech2,
    widen,
)
from .layer1 import scaled_logits


@triton.jit
def _expm1_by_log(v):
    """``e^v - 1`` as ``(w - 1) * v / log w``, ``w = e^v`` (accurate for small ``v``; one
    exp, one log and a division: the fp64 form)."""
    w = exp(v)
    lw = tl.log(w)
    small = (w == 1.0) | (lw == 0)
    big = (v > 0.5) | (v < -0.5)
    return tl.where(big, w - 1.0, tl.where(small, v, (w - 1.0) * v / tl.where(small, 1.0, lw)))


@triton.jit
def expm1_near(v):
    """``e^v - 1`` for ``|v| <= 1`` (callers that hold that range: the near-equal columns).
    fp32: ``v P(v)``, ``P`` the degree-8 Chebyshev fit of ``expm1(v) / v`` on ``[-1, 1]``
    (fit error ``1.2e-9``), nine multiply-adds and no exp, log or division (the costliest
    step of a column in the two-row kernels); within about 2 units of fp32 roundoff
    (measured against float64 over ``[-1, 1]``: 1.7 with fused multiply-adds, as compiled,
    2.0 without, as interpreted; the Taylor series to ``v^11 / 11!`` it replaced took
    eleven for 1.5 / 1.8). fp64: :func:`_expm1_by_log`."""
    if v.dtype == tl.float64:
        return _expm1_by_log(v)
    c = 2.819029660786052e-06
    c = c * v + 2.5428861923169574e-05
    c = c * v + 0.0001983571171920322
    c = c * v + 0.0013884166142093628
    c = c * v + 0.008333353218883597
    c = c * v + 0.04166679810795056
    c = c * v + 0.16666666417832698
    c = c * v + 0.4999999901304184
    c = c * v + 1.0000000000498022
    return c * v


@triton.jit
def expm1(v):
    """``e^v - 1``, accurate for small ``v``: :func:`expm1_near` within ``|v| <= 1``, else
    ``e^v - 1`` (fp64: :func:`_expm1_by_log`)."""
    if v.dtype == tl.float64:
        return _expm1_by_log(v)
    near = (v <= 1.0) & (v >= -1.0)
    return tl.where(near, expm1_near(tl.where(near, v, 0.0)), exp(v) - 1.0)


@triton.jit
def log1p(r):
    """``log(1 + r)``, accurate for small ``r`` (``log(w) * r / (w - 1)``, ``w = 1 + r``)."""
    w = 1.0 + r
    return tl.where(w == 1.0, r, tl.log(w) * r / tl.where(w == 1.0, 1.0, w - 1.0))


@triton.jit
def log1p_unit(t):
    """``log(1 + t)`` for ``0 <= t <= 1`` (the ``logaddexp`` forms' ``log1p(e^(lo - hi))``).
    fp32: ``t P(t)``, ``P`` the degree-8 Chebyshev fit of ``log1p(t) / t`` on ``[0, 1]`` (fit
    error ``3.1e-8``), nine multiply-adds where :func:`log1p` takes a ``log`` (a dozen
    multiply-adds of its own), a division and two tests; within 1.2 units of fp32 roundoff
    of float64 with fused multiply-adds (as compiled), 2.9 without (as interpreted). fp64:
    :func:`log1p`. NaN stays NaN."""
    if t.dtype == tl.float64:
        return log1p(t)
    c = 0.005253457797148778
    c = c * t - 0.029588507393192163
    c = c * t + 0.07836166801873298
    c = c * t - 0.13674769705464718
    c = c * t + 0.19111431080497024
    c = c * t - 0.24844369892423512
    c = c * t + 0.3331927134249036
    c = c * t - 0.4999950151678611
    c = c * t + 0.9999999705406566
    return c * t


@triton.jit
def log_ratio_of_sums(s_z, s_u, gap):
    """``log(S_z / S_u) = -log1p(gap / S_z)`` with ``gap = S_u - S_z`` summed from its own
    per-column terms (two separately rounded sums near each other would leave their
    rounding, relative to ``log V``, in a KL of order ``(log q - log p)^2``); the plain logs
    where the ratio is far from 1 or a sum is 0 / inf / NaN."""
    safe_z = tl.where(s_z > 0, s_z, 1.0)
    r = gap / safe_z
    near = (s_z > 0) & (s_z < float("inf")) & (r <= 0.5) & (r >= -0.5)
    return tl.where(near, -log1p(tl.where(near, r, 0.0)), tl.log(s_z) - tl.log(s_u))


@triton.jit
def load_block(row_ptr, cols, V, stride_v, ACC: tl.constexpr, MASKED: tl.constexpr = True):
    """A block of a row in ``ACC`` (``kernels.common.widen``), ``-inf`` past ``V``;
    ``MASKED=False``: a whole block, loaded with no mask (no ``-inf`` written into the
    registers before the load)."""
    if MASKED:
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
    else:
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v)
    return widen(x, ACC)


@triton.jit
def logit_gap(x, y, a, b, inv_temperature, ref_z, ref_u):
    """``b - a`` (``a = x / T - M_z``, ``b = y / T - M_u``): :func:`gap_from` with the
    logits' own difference ``(y - x) / T``."""
    return gap_from((y - x) * inv_temperature, a, b, ref_z, ref_u)


@triton.jit
def gap_from(w, a, b, ref_z, ref_u):
    """``b - a`` (``a = z - M_z``, ``b = u - M_u``) from whichever operands are smaller:
    ``w - (M_u - M_z)`` with ``w = u - z`` formed from the logits themselves (exact for
    near-equal logits, so no ``ulp(a)`` of size ``ulp(log V)`` enters a difference of order
    the student-teacher gap) where ``|M_u - M_z| <= max(|a|, |b|)`` (then ``|w| <= 3
    max(|a|, |b|)``: either form is within a few roundings of that size), else ``b - a``
    (large offsets between the rows' maxima, NaN). One compare a column: a test of ``|w|``
    as well cost three more instructions a column of the exact KL's forward and backward
    (sm_90)."""
    dm = ref_u - ref_z
    big = nan_max(tl.abs(a), tl.abs(b))  # NaN: not direct, b - a (NaN) is taken
    return tl.where(tl.abs(dm) <= big, w - dm, b - a)


@triton.jit
def capped_gap(x, y, inv_temperature, inv_cap):
    """``u - z`` of the soft-capped values ``z = c tanh(x / c) / T``, ``u = c tanh(y / c) / T``
    (``inv_temperature`` carries ``c / T``, ``inv_cap`` ``1 / c``) with no cancellation of
    two tanh near each other: ``tanh v - tanh w = sinh(v - w) sech(v) sech(w)``, ``v - w =
    (y - x) / c`` from the logits themselves, ``sech v = 2 e^-|v| / (1 + e^-2|v|)`` (no
    overflow). Where ``|y - x| / c >= 40`` (sinh near overflow), or at infinities / NaN: the
    plain difference of the two tanh."""
    v = x * inv_cap
    w = y * inv_cap
    d = (y - x) * inv_cap
    ev = exp(-tl.abs(v))
    ew = exp(-tl.abs(w))
    sech_v = 2.0 * ev / (1.0 + ev * ev)
    sech_w = 2.0 * ew / (1.0 + ew * ew)
    exact = 0.5 * (expm1(d) - expm1(-d)) * sech_v * sech_w * inv_temperature
    tx, _ = tanh_and_sech2(v)
    ty, _ = tanh_and_sech2(w)
    return tl.where(tl.abs(d) < 40.0, exact, (ty - tx) * inv_temperature)


@triton.jit
def near_delta(x, y, inv_temperature, m_z, m_u, log_zu):
    """``delta = log q - log p = (b - a) + log(S_z / S_u)`` (``logit_gap``; ``log_zu`` one
    row constant, so its rounding moves every ``delta`` alike)."""
    a = x * inv_temperature - m_z
    b = y * inv_temperature - m_u
    return logit_gap(x, y, a, b, inv_temperature, m_z, m_u) + log_zu


@triton.jit
def split_values(x, y, valid, inv_temperature, inv_cap, t_inv_temperature, t_inv_cap,
                 HAS_SOFTCAP: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr):  # fmt: skip
    """``(z, u, dx)`` of one block when the two rows have transforms of their own (``SPLIT``):
    the student's ``z`` from ``inv_temperature`` / ``inv_cap`` / ``HAS_SOFTCAP``, the
    teacher's ``u`` from ``t_inv_temperature`` / ``t_inv_cap`` / ``TEACHER_SOFTCAP``
    (``layer1.scaled_logits`` each), ``-inf`` off ``valid``; ``dx`` as :func:`pair_columns`'
    (the student's cap slope times its ``inv_cap``, or 1)."""
    if HAS_SOFTCAP:
        tx, sech2 = tanh_and_sech2(x * inv_cap)
        z = tx * inv_temperature
        dx = sech2 * inv_cap
    else:
        z = x * inv_temperature
        dx = 1.0
    u = scaled_logits(y, t_inv_temperature, t_inv_cap, TEACHER_SOFTCAP)
    return tl.where(valid, z, -float("inf")), tl.where(valid, u, -float("inf")), dx


@triton.jit
def pair_columns(
    s_row, t_row, cols, n_valid, s_stride_v, t_stride_v, inv_temperature, inv_cap, m_z, m_u,
    log_s_z, log_s_u, log_zu, HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
    t_inv_temperature=1.0, t_inv_cap=1.0, SPLIT: tl.constexpr = False,
    TEACHER_SOFTCAP: tl.constexpr = False, MASKED: tl.constexpr = True,
):  # fmt: skip
    """One block of both rows against the row's statistics: ``(log p, log q, delta, dx)``
    with ``delta = log q - log p`` (``near_delta``; with ``HAS_SOFTCAP`` from
    :func:`capped_gap`) and ``dx`` what turns ``dD/dz`` times ``inv_temperature`` into the
    derivative on the raw logit (1; with the cap ``(1 - tanh^2(s x / c)) s / c``, as
    ``inv_temperature`` then carries ``c / T`` and ``inv_cap`` ``s / c``). Columns at or past
    ``n_valid``: ``-inf`` (``MASKED=False``: a block wholly before ``n_valid``, read with no
    mask). ``SPLIT``: the teacher's row has its own transform (:func:`split_values`), and
    ``u - z`` is formed from the two transformed values."""
    x = load_block(s_row, cols, n_valid, s_stride_v, ACC, MASKED)
    y = load_block(t_row, cols, n_valid, t_stride_v, ACC, MASKED)
    if SPLIT:
        z, u, dx = split_values(x, y, cols < n_valid, inv_temperature, inv_cap,
                                t_inv_temperature, t_inv_cap, HAS_SOFTCAP,
                                TEACHER_SOFTCAP)  # fmt: skip
        a = z - m_z
        b = u - m_u
        delta = gap_from(u - z, a, b, m_z, m_u) + log_zu
    elif HAS_SOFTCAP:
        tx, sech2 = tanh_and_sech2(x * inv_cap)
        ty, _ = tanh_and_sech2(y * inv_cap)
        a = tl.where(cols < n_valid, tx * inv_temperature, -float("inf")) - m_z
        b = tl.where(cols < n_valid, ty * inv_temperature, -float("inf")) - m_u
        delta = gap_from(capped_gap(x, y, inv_temperature, inv_cap), a, b, m_z, m_u) + log_zu
        dx = sech2 * inv_cap
    else:
        a = x * inv_temperature - m_z
        b = y * inv_temperature - m_u
        delta = logit_gap(x, y, a, b, inv_temperature, m_z, m_u) + log_zu
        dx = 1.0
    return a - log_s_z, b - log_s_u, delta, dx


@triton.jit
def expm1_small(v):
    """``e^v - 1`` for ``|v| <= 0.35`` (:func:`pair_moments`' near-equal columns). fp32:
    ``v P(v)``, ``P`` the degree-5 fit of ``expm1(v) / v`` on ``[-0.35, 0.35]`` (relative
    fit error ``1.2e-8``, ``2.3e-8`` with its coefficients rounded to fp32: a bias of that
    size, below the rows' own rounding), six multiply-adds where :func:`expm1_near` takes
    nine; within about 2 units of fp32 roundoff of float64 (2.2 measured, with or without
    fused multiply-adds). fp64: :func:`_expm1_by_log`."""
    if v.dtype == tl.float64:
        return _expm1_by_log(v)
    c = 0.001388127662832549
    c = c * v + 0.008369755452915623
    c = c * v + 0.04166727095405895
    c = c * v + 0.16666500072030996
    c = c * v + 0.4999999765840719
    c = c * v + 1.0000000112290428
    return c * v


@triton.jit
def _pre_scale(x, valid, inv_cap, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """A row's values before its positive scale: ``x``, or with the soft cap ``tanh(x / c)``
    (``MASKED``: ``-inf`` off ``valid``, as the cap maps the padding's ``-inf`` to ``-1``)."""
    if SOFTCAP:
        t, _ = tanh_and_sech2(x * inv_cap)
        if MASKED:
            t = tl.where(valid, t, -float("inf"))
        return t
    return x


@triton.jit
def _reference(m, scale):
    """A row's running maximum ``m`` (before its positive scale) after it: ``M`` of the module
    docstring, 0 while the row has no value (``m = -inf``)."""
    return tl.where(m == float("-inf"), 0.0, m * scale)


@triton.jit
def _pair_step(
    s_row, t_row, start, V, s_stride_v, t_stride_v, inv_temperature, inv_cap, t_scale,
    t_inv_cap, m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap, BLOCK_V: tl.constexpr,
    ACC: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block of :func:`pair_moments`' loop, from ``start``: the running maxima (before
    the scale) and sums after it. ``MASKED``: the block runs past ``V``."""
    cols = start + tl.arange(0, BLOCK_V)
    x = load_block(s_row, cols, V, s_stride_v, ACC, MASKED)
    y = load_block(t_row, cols, V, t_stride_v, ACC, MASKED)
    xs = _pre_scale(x, cols < V, inv_cap, HAS_SOFTCAP, MASKED)
    if SPLIT:
        ys = _pre_scale(y, cols < V, t_inv_cap, TEACHER_SOFTCAP, MASKED)
    else:
        ys = _pre_scale(y, cols < V, inv_cap, HAS_SOFTCAP, MASKED)
    # each lane's maxima, and whether any lane raises a running maximum as one integer
    # flag reduced across the warp (one instruction): the block's maxima across the lanes
    # (two shuffle trees) only in a block that raises one. max(x) s is max(x s) (a positive
    # scale rounds monotonically): a multiply a block, not a value
    lane_x = lane_maxima(xs, LANES, VEC)
    lane_y = lane_maxima(ys, LANES, VEC)
    raised = ((lane_x > m_x) | (lane_y > m_y)).to(tl.int32)
    if tl.max(raised, 0) > 0:
        new_x = nan_max(m_x, tl.max(lane_x, 0))
        new_y = nan_max(m_y, tl.max(lane_y, 0))
        # the running sums move to the new maxima (nothing to move while a stream is empty)
        ref_z = _reference(new_x, inv_temperature)
        ref_u = _reference(new_y, t_scale)
        d_z = tl.where(m_x == float("-inf"), 0.0, m_x * inv_temperature - ref_z)
        d_u = tl.where(m_y == float("-inf"), 0.0, m_y * t_scale - ref_u)
        alpha_z = exp(d_z)
        alpha_u = exp(d_u)
        # alpha_u S_u - alpha_z S_z = alpha_z (gap + expm1(d_u - d_z) S_u) while the two
        # maxima move alike (no cancellation); the plain difference where they part (an
        # expm1 of 1000 would be inf, its product with alpha_z = 0 NaN)
        dd = d_u - d_z
        close = (dd <= 1.0) & (dd >= -1.0)
        gap = tl.where(close, alpha_z * (gap + expm1(dd) * s_u), alpha_u * s_u - alpha_z * s_z)
        w_z = alpha_z * (w_z + d_z * s_z)
        rev = alpha_z * (rev + (d_z - d_u) * s_z)
        s_z = alpha_z * s_z
        w_u = alpha_u * (w_u + d_u * s_u)
        fwd = alpha_u * (fwd + (d_u - d_z) * s_u)
        s_u = alpha_u * s_u
        m_x, m_y = new_x, new_y
    ref_z = _reference(m_x, inv_temperature)
    ref_u = _reference(m_y, t_scale)
    # in the block after the branch, so that each is one multiply-add
    a = xs * inv_temperature - ref_z
    b = ys * t_scale - ref_u
    if SPLIT:
        b_minus_a = gap_from(ys * t_scale - xs * inv_temperature, a, b, ref_z, ref_u)
    elif HAS_SOFTCAP:
        w = capped_gap(x, y, inv_temperature, inv_cap)
        b_minus_a = gap_from(w, a, b, ref_z, ref_u)
    else:
        b_minus_a = logit_gap(x, y, a, b, inv_temperature, ref_z, ref_u)
    e_a = exp(a)
    e_b = exp(b)
    s_z += lane_sums(e_a, LANES, VEC)
    s_u += lane_sums(e_b, LANES, VEC)
    w_z += lane_sums(e_a * lift_neg_inf(a), LANES, VEC)
    w_u += lane_sums(e_b * lift_neg_inf(b), LANES, VEC)
    # the polynomial of a far column's (even infinite or NaN) b - a is computed, not taken
    near = (b_minus_a <= 0.35) & (b_minus_a >= -0.35)
    gap_v = tl.where(near, e_a * expm1_small(b_minus_a), e_b - e_a)
    # e^a == 0 (a < -87.3): a near column's e^b is below 2^-125 too, a far one's is exact
    gap += lane_sums(gap_v, LANES, VEC)
    # e^a (b - a) is 0 where e^a is, whatever b - a: +inf (a = -inf), NaN (both -inf), or
    # -inf where e^a underflows at a finite a opposite b = -inf (a clamp of b - a would make
    # the last NaN, or, two-sided, a KL of +inf finite)
    rev -= lane_sums(tl.where(e_a == 0, 0.0, e_a * b_minus_a), LANES, VEC)
    fwd += lane_sums(tl.where(e_b == 0, 0.0, e_b * b_minus_a), LANES, VEC)
    return m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap


@triton.jit
def pair_moments(
    s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr, inv_cap=1.0, HAS_SOFTCAP: tl.constexpr = False,
    t_inv_temperature=1.0, t_inv_cap=1.0, SPLIT: tl.constexpr = False,
    TEACHER_SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """Pass 1: stream both rows once (``n_cols`` = V, or 0 to read nothing). Returns
    ``(M_z, log S_z, H(p), M_u, log S_u, H(q), KL(q || p), KL(p || q), log(S_z / S_u))``
    (module docstring; ``M`` is 0 for a row that is all ``-inf`` or empty). ``HAS_SOFTCAP``:
    both rows soft-capped, ``z = c tanh(s x / c) / T`` (``layer1.scaled_logits``:
    ``inv_temperature`` carries ``c / T``, ``inv_cap`` ``s / c``, the logit scale ``s``
    folded in); ``b - a`` then from :func:`capped_gap`. ``SPLIT``: the teacher's row has a
    transform of its own (``t_inv_temperature``, ``t_inv_cap``, ``TEACHER_SOFTCAP``; the
    student's keeps ``HAS_SOFTCAP``): each row through its own scale and cap, and ``b - a``
    from the two transformed values' difference ``u - z`` (:func:`gap_from`); the
    near-cancellation forms above need one transform for both rows.

    The running sums move to a new maximum only in a block that raises one (a uniform
    branch, taken by few blocks after a row's first)."""
    # the seven running sums are kept a lane each (``lane_sums``; VEC: the student row's values
    # a 16-byte load) and reduced across lanes after the loop: a shuffle tree a sum a block
    # was 0.1 of the 1.57 sm_90 warp instructions a logit of the exact KL's forward
    VEC: tl.constexpr = 128 // s_row.dtype.element_ty.primitive_bitwidth
    LANES: tl.constexpr = min(32, BLOCK_V // VEC)
    t_scale = inv_temperature
    if SPLIT:
        t_scale = t_inv_temperature
    m_x = tl.full((), float("-inf"), ACC)  # the running maxima before the scale
    m_y = tl.full((), float("-inf"), ACC)
    s_z = tl.zeros((LANES,), ACC)
    # S_u summed, not S_z + gap: a flat row against a peaked one (S_z ~ V, S_u ~ 1) would
    # leave it V times fp32's roundoff off
    s_u = tl.zeros((LANES,), ACC)
    w_z = tl.zeros((LANES,), ACC)
    w_u = tl.zeros((LANES,), ACC)
    fwd = tl.zeros((LANES,), ACC)  # sum e^b (b - a)
    rev = tl.zeros((LANES,), ACC)  # sum e^a (a - b)
    gap = tl.zeros((LANES,), ACC)  # S_u - S_z, summed as its own terms e^b - e^a
    # whole blocks unmasked, then the partial one
    n_whole = n_cols - n_cols % BLOCK_V
    for start in range(0, n_whole, BLOCK_V):
        m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap = _pair_step(
            s_row, t_row, start, V, s_stride_v, t_stride_v, inv_temperature, inv_cap, t_scale,
            t_inv_cap, m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap, BLOCK_V, ACC, LANES, VEC,
            HAS_SOFTCAP, SPLIT, TEACHER_SOFTCAP, False,
        )  # fmt: skip
    if n_whole < n_cols:
        m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap = _pair_step(
            s_row, t_row, n_whole, V, s_stride_v, t_stride_v, inv_temperature, inv_cap, t_scale,
            t_inv_cap, m_x, m_y, s_z, s_u, w_z, w_u, fwd, rev, gap, BLOCK_V, ACC, LANES, VEC,
            HAS_SOFTCAP, SPLIT, TEACHER_SOFTCAP, True,
        )  # fmt: skip
    s_z = tl.sum(s_z, 0)
    s_u = tl.sum(s_u, 0)
    w_z = tl.sum(w_z, 0)
    w_u = tl.sum(w_u, 0)
    fwd = tl.sum(fwd, 0)
    rev = tl.sum(rev, 0)
    gap = tl.sum(gap, 0)
    ref_z = _reference(m_x, inv_temperature)
    ref_u = _reference(m_y, t_scale)
    log_s_z = tl.log(s_z)
    log_s_u = tl.log(s_u)
    h_z = log_s_z - w_z / s_z
    h_u = log_s_u - w_u / s_u
    # log S_z - log S_u as one quantity, log1p of the (exact, Sterbenz) difference's ratio:
    # near-equal rows give a ratio near 1, where two logs of size log V would cancel
    log_zu = log_ratio_of_sums(s_z, s_u, gap)
    kl_fwd = fwd / s_u + log_zu
    kl_rev = rev / s_z - log_zu
    # H >= 0; rounding can leave -1e-8 on a point mass (a where() keeps NaN as NaN)
    h_z = tl.where(h_z < 0, 0.0, h_z)
    h_u = tl.where(h_u < 0, 0.0, h_u)
    return ref_z, log_s_z, h_z, ref_u, log_s_u, h_u, kl_fwd, kl_rev, log_zu


@triton.jit
def reverse_kl_grad(p, delta, kl):
    """``dKL(p || q) / dz`` of one block of columns: ``p (-delta - KL)``; where ``p == 0``
    exactly 0 (whatever ``delta``: a column the student gives no mass moves nothing) while
    the row's ``KL`` is finite, NaN when it is not (``KL - KL``: a NaN or ``+inf`` divergence
    leaves no column of its row's gradient finite, as autograd through a softmax does)."""
    return tl.where(p == 0, kl - kl, p * (-delta - kl))
