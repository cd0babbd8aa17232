"""On-policy distillation, vocab-stream: divergences between a student's and a teacher's
softmax, streamed over both logits rows at once (``fused_rl.distill_loss``).

Notation, per row (token): ``z = x / T`` the student's scaled logits, ``u = y / T`` the
teacher's, ``p = softmax(z)``, ``q = softmax(u)``. Every statistic is kept relative to the
row's running maximum (``a = z - M_z``, ``b = u - M_u``), so no large logit offset ever
cancels (as ``kernels/vocab/layer1.py`` keeps the entropy):

* ``S_z = sum e^a``, ``S_u = sum e^b``, so ``log p = a - log S_z``, ``log q = b - log S_u``;
* ``W_z = sum e^a a``, ``W_u = sum e^b b``: entropies ``H(p) = log S_z - W_z / S_z``, ``H(q)``;
* ``F = sum e^b (b - a)``: forward KL ``KL(q || p) = F / S_u + log(S_z / S_u)``;
* ``R = sum e^a (a - b)``: reverse KL ``KL(p || q) = R / S_z - log(S_z / S_u)``.

Near-cancellation (CONTRIBUTING.md): when the student is near the teacher every divergence is
of order ``delta^2`` (``delta = log q - log p``) while ``a``, ``b``, ``log S`` are of order
``log V``, so nothing of size ``log V`` may be rounded into them. ``b - a`` comes from the
logits' own difference ``(y - x) / T - (M_u - M_z)`` (``logit_gap``; exact for near-equal
logits); ``log(S_z / S_u) = -log1p(G / S_z)`` with ``G = S_u - S_z`` summed from its own
per-column terms ``e^a expm1(b - a)`` (``_log_ratio``; two separately rounded sums of size
``V`` would leave ``ulp`` each). Per column ``delta = (b - a) + log(S_z / S_u)``: a row
constant's rounding moves every ``delta`` alike, a first-order change of 0 in every
divergence.

When a block raises a maximum by ``-d`` (``d = M_old - M_new <= 0``), the running sums are
rescaled online: ``S <- e^d S``, ``W <- e^d (W + d S)``, and ``F`` / ``R`` also shift by the
other stream's ``d`` (``F <- e^{d_u} (F + (d_u - d_z) S_u)``, ``R`` likewise). A term whose
weight ``e^a`` (``e^b``) is exactly 0 contributes 0 (``0 * -inf`` guarded with a ``where`` that
keeps NaN as NaN), so ``-inf`` logits give the finite limit; a NaN logit makes the row NaN.

The divergence ``d_t`` of a token (``MODE``, TRL's ``generalized_jsd_loss``):

* ``MODE_FORWARD_KL`` (``beta = 0``): ``KL(q || p)``, ONE pass over both rows;
* ``MODE_REVERSE_KL`` (``beta = 1``): ``KL(p || q)``, ONE pass;
* ``MODE_JSD`` (``0 < beta < 1``): with ``m = (1 - beta) p + beta q``,
  ``beta KL(q || m) + (1 - beta) KL(p || m)``. The mixture needs both normalisers, so a
  second pass over both rows forms, per column, ``delta`` (above), ``L = log(m / p)`` and
  the column's term ``f = beta q log(q / m) + (1 - beta) p log(p / m) >= 0``
  (``mixture_terms``): for ``|delta| <= 1`` ``L = log1p(beta expm1(delta))`` and
  ``f = p (beta g1(delta) - g2(beta expm1(delta)))`` with the non-negative ``O(delta^2)``
  ``g1(d) = d e^d - expm1(d)``, ``g2(x) = (1 + x) log1p(x) - x`` (Taylor series for small
  arguments), so no ``O(p delta)`` terms cancel into the ``O(p delta^2)`` JSD; beyond (and
  for infinities) ``L = logaddexp(log(1 - beta), log(beta) + delta)`` and
  ``f = beta q (delta - L) - (1 - beta) p L``, ``delta - L = log(q / m)`` formed without
  cancelling at ``delta = +inf``. Pass 1 is the one-pass statistics above (the metrics).

Gradients (student only; ``dL/dx = w_t c dD/dz / T`` with the token weight ``w_t``, the
aggregation's scale and the upstream gradient ``c``):

* forward KL: ``dD/dz_v = p_v - q_v`` (``-p_v expm1(delta_v)`` for ``|delta_v| <= 1``);
* reverse KL: ``dD/dz_v = p_v (-delta_v - KL(p || q))``;
* JSD: ``dD/dp_v = (1 - beta) log(p_v / m_v) = -(1 - beta) L_v`` (the ``q / m`` and ``p / m``
  terms cancel), so through the softmax ``dD/dz_v = -(1 - beta) p_v (L_v - sum_w p_w L_w)``,
  i.e. ``p_v (g_v - (1 - beta) KL(p || m))`` with ``g_v = (1 - beta) log(p_v / m_v)``.

With ``FREE`` (``fused_rl.compat.liger.liger_jsd``: log-probability inputs taken as free
coordinates, Liger's ``dX``) the per-row constant is dropped: ``-q_v``,
``p_v ((log p_v - log q_v) + 1)``, ``(1 - beta) p_v log(p_v / m_v)``.

From hidden states (``fused_rl.linear_distill_loss``) the same two vocab kernels run on each
chunk's logits: the forward kernel on the chunk's rows, then the backward kernel with the
aggregation's per-row scale (known from the mask alone) writing ``dz`` over the student's
chunk in place.

What the forward saves per row for the backward (``stats``, ``(N_STATS, N)``, fp32 / fp64):
``M_z``, ``log S_z``, ``M_u``, ``log(S_z / S_u)`` (``log S_u`` is ``log S_z`` less it) and
``c``: ``KL(p || q)`` (reverse KL) or
``sum_w p_w L_w`` (JSD; unused for forward KL). The token's weight is the partial column
``COL_COUNT``. O(N) floats in all; no ``(N, V)`` temporary.

Bytes per row (``V`` columns; ``b_z``, ``b_u`` bytes per student / teacher element):

* forward, ``beta`` in {0, 1}: reads ``V (b_z + b_u)`` once, writes 11 floats
  (6 partial columns + 5 statistics); general ``beta``: reads ``2 V (b_z + b_u)`` (the second
  pass re-reads both rows, from L2 where they still fit), writes the same 11 floats;
* finalize: one launch, 6 programs, each reading its partial column and the weight column
  (``12 N`` floats, a fixed-order sum);
* backward: reads ``V (b_z + b_u)`` and writes ``V b_z`` (the student's gradient), plus 8
  floats read (the 5 statistics, the weight, the aggregation's scale, the upstream
  gradient); a row of weight 0 reads no logit and writes zeros.

In bf16 that is 4 bytes per vocabulary entry forward for ``beta`` in {0, 1} (8 for the
general ``beta``) and 6 backward, against eager PyTorch's materialised fp32 log-softmaxes,
mixture and elementwise terms (TRL's ``generalized_jsd_loss``: several ``(N, V)`` fp32
tensors written and read each way). Launch options: ``vocab_launch(V, writes=True)`` for both
vocab kernels (two streams per program).
"""

import triton
import triton.language as tl

from ..common import as_weight, cast_for, nan_max, nan_min, pair, row_pointer, token_offset
from ..policy.finalize import AGG_SEQ_MEAN_TOKEN_MEAN, aggregated_loss

# the divergence (``fused_rl.distill.DIVERGENCES`` in this order)
MODE_FORWARD_KL = tl.constexpr(0)
MODE_REVERSE_KL = tl.constexpr(1)
MODE_JSD = tl.constexpr(2)

# the partial columns (``fused_rl.distill.COLUMNS`` in this order): each counted token writes
# ``m_t x_t``, ``m_t`` its weight (0 for a token that does not count)
COL_D = tl.constexpr(0)  # the divergence used (the loss's column)
COL_FORWARD_KL = tl.constexpr(1)
COL_REVERSE_KL = tl.constexpr(2)
COL_STUDENT_ENTROPY = tl.constexpr(3)
COL_TEACHER_ENTROPY = tl.constexpr(4)
COL_COUNT = tl.constexpr(5)
N_COLS = 6

# the per-row statistics saved for the backward
STAT_MAX_Z = tl.constexpr(0)
STAT_LOG_SUM_Z = tl.constexpr(1)
STAT_MAX_U = tl.constexpr(2)
STAT_LOG_RATIO = tl.constexpr(3)  # log(S_z / S_u) (``_log_ratio``); log S_u = log S_z - it
STAT_C = tl.constexpr(4)
N_STATS = 5


@triton.jit
def _log1p_exp(v):
    """``log(1 + e^v)`` for ``v <= 0``, accurate where ``e^v`` is below the rounding of 1
    (``log1p`` by ``log(w) * e / (w - 1)``, ``w = 1 + e``); ``-inf`` gives 0, NaN stays NaN."""
    e = tl.exp(v)
    w = 1.0 + e
    return tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))


@triton.jit
def mixture_log_ratios(delta, log_beta, log_1m_beta):
    """For ``delta = log q - log p``: ``(L, delta - L)`` with ``L = log(m / p) =
    logaddexp(log(1 - beta), log(beta) + delta)`` and ``delta - L = log(q / m)``, both
    without cancellation (``delta = +inf`` gives ``L = inf``, ``delta - L = -log beta``;
    ``delta = -inf`` gives ``L = log(1 - beta)``, ``delta - L = -inf``)."""
    k = log_beta + delta
    hi = nan_max(log_1m_beta, k)
    lo = nan_min(log_1m_beta, k)
    soft = _log1p_exp(lo - hi)
    excess = hi + soft
    log_q_over_m = tl.where(k > log_1m_beta, -log_beta - soft, (delta - log_1m_beta) - soft)
    return excess, log_q_over_m


@triton.jit
def _log_ratio(s_z, s_u, gap):
    """``log(S_z / S_u) = -log1p(gap / S_z)`` with ``gap = S_u - S_z`` summed from its own
    per-column terms (two separately rounded sums near each other would leave their
    rounding, relative to ``log V``, in a KL of order ``(log q - log p)^2``); the plain logs
    where the ratio is far from 1 or a sum is 0 / inf / NaN."""
    safe_z = tl.where(s_z > 0, s_z, 1.0)
    r = gap / safe_z
    near = (s_z > 0) & (s_z < float("inf")) & (r <= 0.5) & (r >= -0.5)
    return tl.where(near, -_log1p(tl.where(near, r, 0.0)), tl.log(s_z) - tl.log(s_u))


@triton.jit
def _expm1(v):
    """``e^v - 1``, accurate for small ``v`` (``(w - 1) * v / log w``, ``w = e^v``)."""
    w = tl.exp(v)
    lw = tl.log(w)
    small = (w == 1.0) | (lw == 0)
    big = (v > 0.5) | (v < -0.5)
    return tl.where(big, w - 1.0, tl.where(small, v, (w - 1.0) * v / tl.where(small, 1.0, lw)))


@triton.jit
def _log1p(r):
    """``log(1 + r)``, accurate for small ``r`` (``log(w) * r / (w - 1)``, ``w = 1 + r``)."""
    w = 1.0 + r
    return tl.where(w == 1.0, r, tl.log(w) * r / tl.where(w == 1.0, 1.0, w - 1.0))


@triton.jit
def _bregman_exp(d, ACC: tl.constexpr):
    """``g1(d) = d e^d - expm1(d) >= 0`` (``KL(q || p) = sum_v p_v g1(delta_v)``): below
    ``|d| = 1/4`` its Taylor series to ``d^13``, ``sum_k (k - 1) d^k / k!`` nested as
    ``d^2 / 2 (1 + d / 3 (2 + d / 4 (3 + ...)))`` (small-integer constants, exact in any
    ``ACC``); the direct form above (cancelling by at most ``2 / |d| <= 8``)."""
    h = tl.full((), 12.0, ACC) + 0.0 * d  # (k - 1) at k = 13
    h = 11.0 + d * h / 13.0
    h = 10.0 + d * h / 12.0
    h = 9.0 + d * h / 11.0
    h = 8.0 + d * h / 10.0
    h = 7.0 + d * h / 9.0
    h = 6.0 + d * h / 8.0
    h = 5.0 + d * h / 7.0
    h = 4.0 + d * h / 6.0
    h = 3.0 + d * h / 5.0
    h = 2.0 + d * h / 4.0
    h = 1.0 + d * h / 3.0
    series = 0.5 * d * d * h
    direct = d * tl.exp(d) - _expm1(d)
    return tl.where((d <= 0.25) & (d >= -0.25), series, direct)


@triton.jit
def _bregman_log(x, SMALL: tl.constexpr, ACC: tl.constexpr):
    """``g2(x) = (1 + x) log1p(x) - x >= 0``: for ``|x| <= SMALL`` its Taylor series to
    ``x^13``, ``sum_k (-1)^k x^k / (k (k - 1))`` (coefficients divided out in ``ACC``); the
    direct form above (cancelling by at most ``2 / SMALL``)."""
    one = tl.full((), 1.0, ACC)
    h = -one / 156 + 0.0 * x  # (-1)^k / (k (k - 1)) at k = 13
    h = one / 132 + x * h
    h = -one / 110 + x * h
    h = one / 90 + x * h
    h = -one / 72 + x * h
    h = one / 56 + x * h
    h = -one / 42 + x * h
    h = one / 30 + x * h
    h = -one / 20 + x * h
    h = one / 12 + x * h
    h = -one / 6 + x * h
    h = one / 2 + x * h
    series = x * x * h
    direct = (1.0 + x) * _log1p(x) - x
    return tl.where((x <= SMALL) & (x >= -SMALL), series, direct)


@triton.jit
def mixture_terms(delta, p, q, beta, log_beta, log_1m_beta, ACC: tl.constexpr):
    """Per column: ``(L, f)`` with ``L = log(m / p)`` and ``f = beta q log(q / m) + (1 - beta)
    p log(p / m) >= 0`` (the column's JSD term), for ``delta = log q - log p``.

    For ``|delta| <= 1`` (the near-equal columns): ``L = log1p(beta expm1(delta))``, exact
    to rounding relative to ``L`` itself, and ``f = p (beta g1(delta) - g2(x))`` with
    ``x = beta expm1(delta)`` (``f / p = beta e^delta delta - (1 + x) L``, both ``g >= 0``
    and of order ``delta^2``, cancelling only by ``1 / (1 - beta)``): no ``O(p delta)``
    terms are summed into an ``O(p delta^2)`` result. Beyond, and for infinities, the
    ``logaddexp`` form (``mixture_log_ratios``), whose terms no longer cancel badly."""
    if ACC == tl.float64:
        SMALL: tl.constexpr = 0.0625
    else:
        SMALL: tl.constexpr = 0.25
    near = (delta <= 1.0) & (delta >= -1.0)
    dn = tl.where(near, delta, 0.0)
    x = beta * _expm1(dn)
    far_l, log_q_over_m = mixture_log_ratios(delta, log_beta, log_1m_beta)
    term_p = tl.where(p == 0, 0.0, p * far_l)
    term_q = tl.where(q == 0, 0.0, q * log_q_over_m)
    far_f = beta * term_q - (1.0 - beta) * term_p
    near_f = p * (beta * _bregman_exp(dn, ACC) - _bregman_log(x, SMALL, ACC))
    return tl.where(near, _log1p(x), far_l), tl.where(near, near_f, far_f)


@triton.jit
def _load_raw(row_ptr, cols, V, stride_v, ACC: tl.constexpr):
    x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
    return x.to(ACC)


@triton.jit
def _load_scaled(row_ptr, cols, V, stride_v, inv_temperature, ACC: tl.constexpr):
    x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < V, other=float("-inf"))
    return x.to(ACC) * inv_temperature


@triton.jit
def pair_moments(
    s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Pass 1: stream both rows once (``n_cols`` = V, or 0 to read nothing). Returns
    ``(M_z, log S_z, H(p), M_u, log S_u, H(q), KL(q || p), KL(p || q))`` (module docstring;
    ``M`` is 0 for a row that is all ``-inf`` or empty)."""
    m_z = tl.full((), float("-inf"), ACC)
    m_u = tl.full((), float("-inf"), ACC)
    s_z = tl.zeros((), ACC)
    s_u = tl.zeros((), ACC)
    w_z = tl.zeros((), ACC)
    w_u = tl.zeros((), ACC)
    fwd = tl.zeros((), ACC)  # sum e^b (b - a)
    rev = tl.zeros((), ACC)  # sum e^a (a - b)
    gap = tl.zeros((), ACC)  # S_u - S_z, summed as its own terms e^b - e^a
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = _load_raw(s_row, cols, V, s_stride_v, ACC)
        y = _load_raw(t_row, cols, V, t_stride_v, ACC)
        z = x * inv_temperature
        u = y * inv_temperature
        new_z = nan_max(m_z, tl.max(z, 0))
        new_u = nan_max(m_u, tl.max(u, 0))
        ref_z = tl.where(new_z == float("-inf"), 0.0, new_z)
        ref_u = tl.where(new_u == float("-inf"), 0.0, new_u)
        # the running sums move to the new maxima (nothing to move while a stream is empty)
        d_z = tl.where(m_z == float("-inf"), 0.0, m_z - ref_z)
        d_u = tl.where(m_u == float("-inf"), 0.0, m_u - ref_u)
        alpha_z = tl.exp(d_z)
        alpha_u = tl.exp(d_u)
        w_z = alpha_z * (w_z + d_z * s_z)
        rev = alpha_z * (rev + (d_z - d_u) * s_z)
        s_z = alpha_z * s_z
        w_u = alpha_u * (w_u + d_u * s_u)
        fwd = alpha_u * (fwd + (d_u - d_z) * s_u)
        # alpha_u S_u - alpha_z S_z = alpha_z (gap + expm1(d_u - d_z) S_u)
        gap = alpha_z * (gap + _expm1(d_u - d_z) * s_u)
        s_u = alpha_u * s_u
        a = z - ref_z
        b = u - ref_u
        b_minus_a = logit_gap(x, y, a, b, inv_temperature, ref_z, ref_u)
        e_a = tl.exp(a)
        e_b = tl.exp(b)
        s_z += tl.sum(e_a, 0)
        s_u += tl.sum(e_b, 0)
        w_z += tl.sum(tl.where(e_a == 0, 0.0, e_a * a), 0)
        w_u += tl.sum(tl.where(e_b == 0, 0.0, e_b * b), 0)
        near = (b_minus_a <= 1.0) & (b_minus_a >= -1.0)
        gap_v = tl.where(near, e_a * _expm1(b_minus_a), e_b - e_a)
        gap += tl.sum(tl.where(e_a == 0, e_b, gap_v), 0)
        rev -= tl.sum(tl.where(e_a == 0, 0.0, e_a * b_minus_a), 0)
        fwd += tl.sum(tl.where(e_b == 0, 0.0, e_b * b_minus_a), 0)
        m_z = new_z
        m_u = new_u
    ref_z = tl.where(m_z == float("-inf"), 0.0, m_z)
    ref_u = tl.where(m_u == float("-inf"), 0.0, m_u)
    log_s_z = tl.log(s_z)
    log_s_u = tl.log(s_u)
    h_z = log_s_z - w_z / s_z
    h_u = log_s_u - w_u / s_u
    # log S_z - log S_u as one quantity, log1p of the (exact, Sterbenz) difference's ratio:
    # near-equal rows give a ratio near 1, where two logs of size log V would cancel
    log_zu = _log_ratio(s_z, s_u, gap)
    kl_fwd = fwd / s_u + log_zu
    kl_rev = rev / s_z - log_zu
    # H >= 0; rounding can leave -1e-8 on a point mass (a where() keeps NaN as NaN)
    h_z = tl.where(h_z < 0, 0.0, h_z)
    h_u = tl.where(h_u < 0, 0.0, h_u)
    return ref_z, log_s_z, h_z, ref_u, log_s_u, h_u, kl_fwd, kl_rev, log_zu


@triton.jit
def mixture_pass(
    s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, m_z, log_s_z, m_u,
    log_s_u, log_zu, beta, log_beta, log_1m_beta, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Pass 2 of the general ``beta``: ``(JSD, sum_v p_v L_v)`` (module docstring), with
    ``delta = (y - x) / T + (M_z - M_u) + log(S_z / S_u)`` (``log_zu``) per column: the
    logits' own difference plus one row constant, whose rounding only shifts every
    ``delta`` alike (a first-order change of ``0`` in the JSD)."""
    jsd = tl.zeros((), ACC)
    p_excess = tl.zeros((), ACC)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = _load_raw(s_row, cols, V, s_stride_v, ACC)
        y = _load_raw(t_row, cols, V, t_stride_v, ACC)
        log_p = (x * inv_temperature - m_z) - log_s_z
        log_q = (y * inv_temperature - m_u) - log_s_u
        p = tl.exp(log_p)
        q = tl.exp(log_q)
        delta = near_delta(x, y, inv_temperature, m_z, m_u, log_zu)
        excess, f = mixture_terms(delta, p, q, beta, log_beta, log_1m_beta, ACC)
        p_excess += tl.sum(tl.where(p == 0, 0.0, p * excess), 0)
        jsd += tl.sum(f, 0)
    return jsd, p_excess


@triton.jit
def logit_gap(x, y, a, b, inv_temperature, ref_z, ref_u):
    """``b - a`` (``a = x / T - M_z``, ``b = y / T - M_u``) from whichever operands are
    smaller: ``(y - x) / T - (M_u - M_z)`` (the logits' own difference, exact for near-equal
    logits, so no ``ulp(a)`` of size ``ulp(log V)`` enters a difference of order the
    student-teacher gap) where both parts are below ``max(|a|, |b|)``, else ``b - a``
    (large offsets between the rows, infinities, NaN)."""
    w = (y - x) * inv_temperature
    dm = ref_u - ref_z
    big = nan_max(tl.abs(a), tl.abs(b))  # NaN: not direct, b - a (NaN) is taken
    direct = (tl.abs(w) <= big) & (tl.abs(dm) <= big)
    return tl.where(direct, w - dm, b - a)


@triton.jit
def near_delta(x, y, inv_temperature, m_z, m_u, log_zu):
    """``delta = log q - log p = (b - a) + log(S_z / S_u)`` (``logit_gap``; ``log_zu`` one
    row constant, so its rounding moves every ``delta`` alike)."""
    a = x * inv_temperature - m_z
    b = y * inv_temperature - m_u
    return logit_gap(x, y, a, b, inv_temperature, m_z, m_u) + log_zu


@triton.jit
def token_weight(
    row, rows_inner, targets_ptr, mask_ptr, y_stride_outer, y_stride_inner, m_stride_outer,
    m_stride_inner, ignore_index, HAS_TARGETS: tl.constexpr, HAS_MASK: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """The token's weight ``m_t``: the mask's (1 without one; a negative one is NaN), 0 where
    the target is ``ignore_index`` (the ignore mask applied after the weight)."""
    m = tl.full((), 1.0, ACC)
    if HAS_MASK:
        m = as_weight(
            tl.load(mask_ptr + token_offset(row, rows_inner, m_stride_outer, m_stride_inner)).to(
                ACC
            )
        )
    if HAS_TARGETS:
        y_off = token_offset(row, rows_inner, y_stride_outer, y_stride_inner)
        target = tl.load(targets_ptr + y_off).to(tl.int64)
        m = tl.where(target != ignore_index, m, 0.0)
    return m


@triton.jit(
    do_not_specialize=[
        "rows_inner", "n_rows", "ignore_index", "y_stride_outer", "y_stride_inner",
        "m_stride_outer", "m_stride_inner",
    ]
)  # fmt: skip
def _distill_fwd_kernel(
    s_ptr,
    t_ptr,
    targets_ptr,
    mask_ptr,
    part_ptr,
    stats_ptr,
    rows_inner,
    n_rows,
    V,
    s_stride_outer,
    s_stride_inner,
    s_stride_v,
    t_stride_outer,
    t_stride_inner,
    t_stride_v,
    y_stride_outer,
    y_stride_inner,
    m_stride_outer,
    m_stride_inner,
    inv_t_hi,
    inv_t_lo,
    beta_hi,
    beta_lo,
    log_beta_hi,
    log_beta_lo,
    log_1m_beta_hi,
    log_1m_beta_lo,
    ignore_index,
    MODE: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per token of ``(outer, rows_inner)`` rows (``n_rows`` in all); student
    and teacher rows strided independently. Writes the ``(N_COLS, n_rows)`` partial columns
    and the ``(N_STATS, n_rows)`` statistics; a token of weight 0 reads no logit and writes
    zeros. ``inv_t``: ``1 / T``; ``beta``, ``log beta``, ``log(1 - beta)``: fp32 pairs."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = n_rows.to(tl.int64)  # the column offsets k * n_rows may pass 2^31
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)
    m = token_weight(
        row, rows_inner, targets_ptr, mask_ptr, y_stride_outer, y_stride_inner, m_stride_outer,
        m_stride_inner, ignore_index, HAS_TARGETS, HAS_MASK, ACC,
    )  # fmt: skip
    active = m != 0  # a NaN weight (a negative mask value) counts, and makes the result NaN
    n_cols = tl.where(active, V, 0)
    s_row = row_pointer(s_ptr, row, rows_inner, 0, s_stride_outer, s_stride_inner)
    t_row = row_pointer(t_ptr, row, rows_inner, 0, t_stride_outer, t_stride_inner)
    m_z, log_s_z, h_z, m_u, log_s_u, h_u, kl_fwd, kl_rev, log_zu = pair_moments(
        s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, BLOCK_V, ACC
    )
    if MODE == MODE_FORWARD_KL:
        d = kl_fwd
        c = tl.zeros((), ACC)
    elif MODE == MODE_REVERSE_KL:
        d = kl_rev
        c = kl_rev
    else:
        beta = pair(beta_hi, beta_lo, ACC)
        log_beta = pair(log_beta_hi, log_beta_lo, ACC)
        log_1m_beta = pair(log_1m_beta_hi, log_1m_beta_lo, ACC)
        d, c = mixture_pass(
            s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, m_z, log_s_z,
            m_u, log_s_u, log_zu, beta, log_beta, log_1m_beta, BLOCK_V, ACC,
        )  # fmt: skip
        # a row whose normaliser is NaN / inf (NaN logit, all -inf) is NaN, whatever p and q
        d += (log_s_z - log_s_z) + (log_s_u - log_s_u)
    col = part_ptr + row
    tl.store(col + COL_D * n_rows, tl.where(active, m * d, 0.0))
    tl.store(col + COL_FORWARD_KL * n_rows, tl.where(active, m * kl_fwd, 0.0))
    tl.store(col + COL_REVERSE_KL * n_rows, tl.where(active, m * kl_rev, 0.0))
    tl.store(col + COL_STUDENT_ENTROPY * n_rows, tl.where(active, m * h_z, 0.0))
    tl.store(col + COL_TEACHER_ENTROPY * n_rows, tl.where(active, m * h_u, 0.0))
    tl.store(col + COL_COUNT * n_rows, tl.where(active, m, 0.0))
    st = stats_ptr + row
    tl.store(st + STAT_MAX_Z * n_rows, tl.where(active, m_z, 0.0))
    tl.store(st + STAT_LOG_SUM_Z * n_rows, tl.where(active, log_s_z, 0.0))
    tl.store(st + STAT_MAX_U * n_rows, tl.where(active, m_u, 0.0))
    tl.store(st + STAT_LOG_RATIO * n_rows, tl.where(active, log_zu, 0.0))
    tl.store(st + STAT_C * n_rows, tl.where(active, c, 0.0))


@triton.jit(do_not_specialize=["n_outer", "rows_inner"])
def _distill_finalize_kernel(
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
    """Program ``k`` reduces partial column ``k`` of ``(N_COLS, n_outer * rows_inner)`` in a
    fixed order (bit-identical on repeat): ``metrics[k] = sum col_k / sum col_COUNT`` (0 when
    nothing counts; ``metrics[COL_COUNT]`` the weight total). Program ``COL_D`` also writes
    the loss aggregated by ``AGG`` (``fused_rl._agg``: ``loss = sum_t m_t s_b d_t``) and the
    backward's ``seq_scale`` ``s_b`` (one per sequence for ``seq-mean-token-mean``, else one).
    ``num_items`` (> 0; <= 0: not given) or the tensor at ``num_items_ptr`` replaces the
    weight total of ``token-mean`` (a tensor <= 0 gives NaN); ``n_seq = max(B, 1)``."""
    k = tl.program_id(0)
    n_rows = n_outer.to(tl.int64) * rows_inner
    col = part_ptr + k.to(tl.int64) * n_rows
    tot_m = tl.zeros((), ACC)
    tot_x = tl.zeros((), ACC)
    seq_sum = tl.zeros((), ACC)
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
        tot_m += tl.sum(sum_m, 0)
        tot_x += tl.sum(sum_x, 0)
        if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
            nonempty = sum_m != 0
            safe_m = tl.where(nonempty, sum_m, 1.0)
            seq_sum += tl.sum(tl.where(nonempty, sum_x / safe_m, 0.0), 0)
            if k == COL_D:
                scale_b = tl.where(nonempty, 1.0 / (n_seq * safe_m), 0.0)
                tl.store(seq_scale_ptr + bs, scale_b, mask=in_b)
    mean = tl.where(tot_m != 0, tot_x / tl.where(tot_m != 0, tot_m, 1.0), 0.0)
    if k == COL_COUNT:
        mean = tot_m
    tl.store(metrics_ptr + k, mean.to(tl.float32))
    if k == COL_D:
        loss = aggregated_loss(tot_x, tot_m, seq_sum, seq_scale_ptr, num_items_ptr, num_items,
                               n_seq, max_length, AGG, NUM_ITEMS_TENSOR, ACC)  # fmt: skip
        tl.store(loss_ptr, loss)


@triton.jit(do_not_specialize=["rows_inner", "n_rows", "seq_scale_stride"])
def _distill_bwd_kernel(
    s_ptr,
    t_ptr,
    grad_ptr,
    stats_ptr,
    part_ptr,
    scale_ptr,
    seq_scale_ptr,
    rows_inner,
    n_rows,
    V,
    s_stride_outer,
    s_stride_inner,
    s_stride_v,
    t_stride_outer,
    t_stride_inner,
    t_stride_v,
    seq_scale_stride,
    inv_t_hi,
    inv_t_lo,
    beta_hi,
    beta_lo,
    log_beta_hi,
    log_beta_lo,
    log_1m_beta_hi,
    log_1m_beta_lo,
    MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    FREE: tl.constexpr = False,
):
    """One program per token: the student's gradient row, ``grad`` contiguous
    ``(n_rows, V)`` in the student's dtype: ``m_t * seq_scale[b] * scale / T`` times
    ``dD/dz`` (module docstring), from the saved statistics. A row of weight 0 (or whose
    coefficient is 0) reads nothing and writes exact zeros. ``grad`` may be the student's
    own buffer (``s_ptr``, contiguous): each block is read before it is written.

    ``FREE``: the student row is a log-probability vector ``x = log p`` taken as free
    coordinates (Liger's JSD: its ``dX`` is the partial derivative of the divergence written
    on ``log p``, not the gradient through the softmax): forward KL ``-q_v``, reverse KL
    ``p_v ((log p_v - log q_v) + 1)``, JSD ``(1 - beta) p_v log(p_v / m_v)``, i.e. the
    softmax gradient plus ``p_v`` times a per-row constant (``c`` taken as ``-1`` / ``0``).
    Through a ``log_softmax`` the two forms give the same gradient."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = n_rows.to(tl.int64)  # the column offsets k * n_rows may pass 2^31
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)
    outer = row // rows_inner
    m = tl.load(part_ptr + COL_COUNT * n_rows + row).to(ACC)
    coef = m * tl.load(scale_ptr).to(ACC) * inv_temperature
    coef = coef * tl.load(seq_scale_ptr + outer * seq_scale_stride).to(ACC)
    coef = tl.where(m != 0, coef, 0.0)
    active = coef != 0  # a NaN coefficient still reads (and writes NaN)
    n_read = tl.where(active, V, 0)
    st = stats_ptr + row
    m_z = tl.load(st + STAT_MAX_Z * n_rows).to(ACC)
    log_s_z = tl.load(st + STAT_LOG_SUM_Z * n_rows).to(ACC)
    m_u = tl.load(st + STAT_MAX_U * n_rows).to(ACC)
    log_zu = tl.load(st + STAT_LOG_RATIO * n_rows).to(ACC)
    log_s_u = log_s_z - log_zu
    c = tl.load(st + STAT_C * n_rows).to(ACC)
    s_row = row_pointer(s_ptr, row, rows_inner, 0, s_stride_outer, s_stride_inner)
    t_row = row_pointer(t_ptr, row, rows_inner, 0, t_stride_outer, t_stride_inner)
    grad_row = grad_ptr + row * V
    if MODE == MODE_JSD:
        beta = pair(beta_hi, beta_lo, ACC)
        log_beta = pair(log_beta_hi, log_beta_lo, ACC)
        log_1m_beta = pair(log_1m_beta_hi, log_1m_beta_lo, ACC)
        coef = coef * (beta - 1.0)  # dD/dz = -(1 - beta) p (L - sum p L)
    if FREE:  # the partial derivatives on log p (docstring): no softmax projection
        if MODE == MODE_REVERSE_KL:
            c = tl.full((), -1.0, ACC)
        else:
            c = tl.zeros((), ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = _load_raw(s_row, cols, n_read, s_stride_v, ACC)
        y = _load_raw(t_row, cols, n_read, t_stride_v, ACC)
        log_p = (x * inv_temperature - m_z) - log_s_z
        log_q = (y * inv_temperature - m_u) - log_s_u
        p = tl.exp(log_p)
        delta = near_delta(x, y, inv_temperature, m_z, m_u, log_zu)
        near = (delta <= 1.0) & (delta >= -1.0)
        if MODE == MODE_FORWARD_KL:
            if FREE:
                g = -tl.exp(log_q)
            else:  # p - q = -p expm1(delta), relative to itself where the two are near
                g = tl.where(near, -p * _expm1(tl.where(near, delta, 0.0)), p - tl.exp(log_q))
        elif MODE == MODE_REVERSE_KL:
            g = tl.where(p == 0, 0.0, p * (-delta - c))
        else:
            far_l, _ = mixture_log_ratios(delta, log_beta, log_1m_beta)
            excess = tl.where(near, _log1p(beta * _expm1(tl.where(near, delta, 0.0))), far_l)
            g = tl.where(p == 0, 0.0, p * (excess - c))
        g = tl.where(active, coef * g, 0.0)
        tl.store(grad_row + cols, cast_for(g, grad_ptr), mask=cols < V)
