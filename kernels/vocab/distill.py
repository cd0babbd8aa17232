"""On-policy distillation, vocab-stream: divergences between a student's and a teacher's
softmax, streamed over both logits rows at once (``fused_rl.distill_loss``).

Notation, per row (token): ``z = x / T`` the student's scaled logits, ``u = y / T`` the
teacher's, ``p = softmax(z)``, ``q = softmax(u)``. Each model's logits may carry a scale and a
soft cap, ``z = c tanh(s x / c) / T`` (``z = s x / T`` uncapped), folded into the launch
constants ``inv_t`` (``c / T``, or ``s / T``) and ``inv_cap`` (``s / c``). While both models
share one transform (one scale, one cap) both rows use them, the near-cancellation forms of
``kernels/vocab/pair.py`` included; with ``SPLIT`` the teacher's row has its own
(``t_inv_t``, ``t_inv_cap``, ``TEACHER_SOFTCAP``; ``HAS_SOFTCAP`` is then the student's cap
alone) and ``u - z`` is formed from the two transformed values. Pass 1 over both rows is
``kernels/vocab/pair.py`` ``pair_moments`` (every statistic relative to the running maxima;
the divergences formed without cancelling when the student is near the teacher: see there):
the entropies, ``KL(q || p)`` and ``KL(p || q)``.

The divergence ``d_t`` of a token (``MODE``, TRL's ``generalized_jsd_loss``):

* ``MODE_FORWARD_KL`` (``beta = 0``): ``KL(q || p)``, ONE pass over both rows;
* ``MODE_REVERSE_KL`` (``beta = 1``): ``KL(p || q)``, ONE pass;
* ``MODE_JSD`` (``0 < beta < 1``): with ``m = (1 - beta) p + beta q``,
  ``beta KL(q || m) + (1 - beta) KL(p || m)``. The mixture needs both normalisers, so a
  second pass over both rows forms, per column, ``delta`` (above), ``L = log(m / p)`` and
  the column's term ``f = beta q log(q / m) + (1 - beta) p log(p / m) >= 0``
  (``mixture_terms``): for ``|delta| <= 1`` (``near_mixture``) ``L = log1p(beta
  expm1(delta))`` and ``f = p (beta g1(delta) - g2(beta expm1(delta)))`` with the
  non-negative ``O(delta^2)`` ``g1(d) = d e^d - expm1(d)``, ``g2(x) = (1 + x) log1p(x) - x``,
  so no ``O(p delta)`` terms cancel into the ``O(p delta^2)`` JSD: in fp32 as
  ``delta A(delta)`` and ``p delta^2 H(delta)``, two degree-8 polynomials fitted per
  ``beta`` on the host (``fused_rl._mixture_poly``, passed in the launch's ``mix`` tuple
  with ``beta``, ``1 - beta`` and their logs), in fp64 by Taylor series of ``g1`` and
  ``g2``; beyond (and for infinities, ``far_mixture``) ``L = logaddexp(log(1 - beta),
  log(beta) + delta)`` and ``f = beta q (delta - L) - (1 - beta) p L``, ``delta - L =
  log(q / m)`` formed without cancelling at ``delta = +inf``. Pass 1 is the one-pass
  statistics above (the metrics).

Gradients (student only; ``dL/dx = w_t c dD/dz dz/dx`` with the token weight ``w_t``, the
aggregation's scale and the upstream gradient ``c``; ``dz/dx = s / T``, capped
``s sech^2(s x / c) / T``):

* forward KL: ``dD/dz_v = p_v - q_v`` (``-p_v expm1(delta_v)`` for ``|delta_v| <= 1``);
* reverse KL: ``dD/dz_v = p_v (-delta_v - KL(p || q))``;
* JSD: ``dD/dp_v = (1 - beta) log(p_v / m_v) = -(1 - beta) L_v`` (the ``q / m`` and ``p / m``
  terms cancel), so through the softmax ``dD/dz_v = -(1 - beta) p_v (L_v - sum_w p_w L_w)``,
  i.e. ``p_v (g_v - (1 - beta) KL(p || m))`` with ``g_v = (1 - beta) log(p_v / m_v)``.

Columns where ``p_v == 0`` get 0 (``0 log 0``; whatever ``delta_v``) in a row whose per-row
constant (``KL(p || q)``, ``sum_w p_w L_w``) is finite, NaN where it is not (a NaN teacher
row, a reverse KL of ``+inf``: ``q = 0`` where ``p > 0``): a row whose divergence is not
finite has no finite gradient column, as autograd through the reference's softmax gives.

With ``FREE`` (``fused_rl.compat.liger.liger_jsd``: log-probability inputs taken as free
coordinates, Liger's ``dX``) the per-row constant is dropped: ``-q_v``,
``p_v ((log p_v - log q_v) + 1)``, ``(1 - beta) p_v log(p_v / m_v)``.

From hidden states (``fused_rl.linear_distill_loss``) the same two vocab kernels run on each
chunk's logits: the forward kernel on the chunk's rows, then the backward kernel with the
aggregation's per-row scale (known from the mask alone) writing ``dz`` over the student's
chunk in place.

What the forward saves per row for the backward (``stats``, ``(N_STATS, N)``, fp32 / fp64):
``M_z``, ``log S_z``, ``M_u``, ``log(S_z / S_u)`` (``log S_u`` is ``log S_z`` less it) and
``c``: ``KL(p || q)`` (reverse KL) or ``sum_w p_w L_w`` (JSD; unused for forward KL), and
``log S_u`` (read only by the vocabulary-parallel merge, ``fused_rl.distill.pair_divergence``).
The token's weight is the partial column ``COL_COUNT``. O(N) floats in all; no ``(N, V)`` temporary.

Bytes per row (``V`` columns; ``b_z``, ``b_u`` bytes per student / teacher element):

* forward, ``beta`` in {0, 1}: reads ``V (b_z + b_u)`` once, writes 12 floats
  (6 partial columns + 6 statistics); general ``beta``: reads ``2 V (b_z + b_u)`` (the second
  pass re-reads both rows, from L2 where they still fit), writes the same 12 floats;
* finalize: one launch, 6 programs, each reading its partial column and the weight column
  (``12 N`` floats, a fixed-order sum);
* backward: reads ``V (b_z + b_u)`` and writes ``V b_z`` (the student's gradient), plus 8
  floats read (the 5 statistics, the weight, the aggregation's scale, the upstream
  gradient); a row of weight 0 reads no logit and writes zeros.

In bf16 that is 4 bytes per vocabulary entry forward for ``beta`` in {0, 1} (8 for the
general ``beta``) and 6 backward, against eager PyTorch's materialised fp32 log-softmaxes,
mixture and elementwise terms (TRL's ``generalized_jsd_loss``: several ``(N, V)`` fp32
tensors written and read each way). Launch options: the forward and the JSD's mixture pass
are read-only streams holding many values a column, ``vocab_launch(V, writes=False,
heavy=True)`` (one warp, 512 columns a step: no cross-warp reduction, no spill); the
backward writes the gradient row, ``vocab_launch(V, writes=True)``.

Instructions a column of each loop (compiled for sm_90a and disassembled on the CPU,
Triton 3.9, bf16; not timed): the forward's first pass 42.1 on a step that raises no
maximum (every ``beta``; 44.5 with two shuffle trees a step and bf16 widened by ``.to``,
``kernels.common.widen``; 54 with a rescale every step and a degree-8 ``expm1``, 58 before
its running sums were kept a lane each, ``kernels.common.lane_sums``), the JSD's mixture
pass 72.3 (both kernels; 73.4 with ``.to``; 77.5 with a shuffle tree a block for its two
sums and every block masked), the backward 36 / 24 / 50 (forward KL / reverse KL / JSD; 37
/ 25 / 51 with ``.to``, 40 / 28 / 55 with two compares a column in ``pair.gap_from``).
The JSD's were 135 and 86 with the series forms for the near columns (an ``expm1`` and two
Taylor series a column, and one ``log1p`` shared by the near and far forms:
``pair.log1p_unit`` for the far ones now), 224 and 130 before the two forms shared it; 71,
159, 48 / 30 / 94 before ``kernels.common.exp``. Registers of the JSD's forward kernel at
the launch's one warp: 96 (146 with the series forms). On an H200 (2026-11-27, the code
before these counts) every divergence was compute-bound: a column of two bf16 rows read at
the copy rate leaves about 30 instructions a lane.
"""

import triton
import triton.language as tl

from ..common import (
    as_weight,
    cast_for,
    exp,
    lane_sums,
    nan_max,
    nan_min,
    pair,
    row_pointer,
    token_offset,
)
from ..modes import MIX_NEAR_DEGREE as _DEGREE
from ..policy.finalize import AGG_SEQ_MEAN_TOKEN_MEAN, aggregated_loss
from .pair import expm1_near, log1p, log1p_unit, pair_columns, pair_moments, reverse_kl_grad

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
STAT_LOG_RATIO = tl.constexpr(3)  # log(S_z / S_u) (``log_ratio_of_sums``); log S_u = log S_z - it
STAT_C = tl.constexpr(4)
# log S_u itself: not read by the backward; what a vocabulary shard whose student row holds
# no mass (S_z = 0, where log(S_z / S_u) says nothing of S_u) contributes to the merge
STAT_LOG_SUM_U = tl.constexpr(5)
N_STATS = 6

# the launch's ``mix`` tuple (``kernels/modes.py`` ``N_MIX``): four fp32 pairs, then the
# fp32 near form's polynomials ``A`` (``L / delta``) and ``H`` (``f / (p delta^2)``)
MIX_NEAR_DEGREE = tl.constexpr(_DEGREE)
MIX_L = tl.constexpr(8)
MIX_F = tl.constexpr(8 + _DEGREE + 1)


@triton.jit
def mixture_scalars(mix, ACC: tl.constexpr):
    """``(beta, 1 - beta, log beta, log(1 - beta))`` from the launch's ``mix`` tuple (fp32
    pairs: ``1 - beta`` formed on the host, as ``fp32(1 - fp32(beta))`` is off by up to
    ``2^-24 / (1 - beta)`` relative, 1.7e-4 at ``beta = 0.9999``)."""
    beta = pair(mix[0], mix[1], ACC)
    one_m_beta = pair(mix[2], mix[3], ACC)
    return beta, one_m_beta, pair(mix[4], mix[5], ACC), pair(mix[6], mix[7], ACC)


@triton.jit
def _near_polynomial(mix, FIRST: tl.constexpr, v):
    """``sum_k mix[FIRST + k] v^k`` for ``k <= MIX_NEAR_DEGREE`` (Horner, fp32)."""
    h = mix[FIRST + MIX_NEAR_DEGREE] + 0.0 * v
    for i in tl.static_range(MIX_NEAR_DEGREE):
        h = h * v + mix[FIRST + MIX_NEAR_DEGREE - 1 - i]
    return h


@triton.jit
def _bregman_exp(d, e):
    """``g1(d) = d e^d - expm1(d) >= 0`` (``KL(q || p) = sum_v p_v g1(delta_v)``) in fp64 for
    ``|d| <= 1``, ``e = expm1(d)``: below ``|d| = 1/4`` its Taylor series
    ``sum_k (k - 1) d^k / k!`` to ``d^13``, nested as ``d^2 / 2 (1 + d / 3 (2 + d / 4 (3 +
    ...)))`` (small-integer constants, exact); the direct form ``d (1 + e) - e`` above
    (cancelling by at most ``2 / |d| <= 8``)."""
    h = 12.0 + 0.0 * d  # (k - 1) at k = 13
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
    direct = d * (1.0 + e) - e
    return tl.where((d <= 0.25) & (d >= -0.25), series, direct)


@triton.jit
def _bregman_log(x, l1):
    """``g2(x) = (1 + x) log1p(x) - x >= 0`` in fp64, ``l1 = log1p(x)``: for ``|x| <= 1/16``
    its Taylor series to ``x^13``, ``sum_k (-1)^k x^k / (k (k - 1))``; the direct form above
    (cancelling by at most 32)."""
    h = -1.0 / 156 + 0.0 * x  # (-1)^k / (k (k - 1)) at k = 13
    h = 1.0 / 132 + x * h
    h = -1.0 / 110 + x * h
    h = 1.0 / 90 + x * h
    h = -1.0 / 72 + x * h
    h = 1.0 / 56 + x * h
    h = -1.0 / 42 + x * h
    h = 1.0 / 30 + x * h
    h = -1.0 / 20 + x * h
    h = 1.0 / 12 + x * h
    h = -1.0 / 6 + x * h
    h = 1.0 / 2 + x * h
    series = x * x * h
    direct = (1.0 + x) * l1 - x
    return tl.where((x <= 0.0625) & (x >= -0.0625), series, direct)


@triton.jit
def near_mixture(dn, beta, mix, ACC: tl.constexpr):
    """``(L, f / p)`` of a near-equal column (``|dn| <= 1``; module docstring): ``L =
    log(m / p)`` exact to rounding relative to itself, and ``f / p = beta g1(dn) - g2(x)``
    (``x = beta expm1(dn)``; both ``g >= 0`` and of order ``dn^2``), so no ``O(p dn)`` terms
    cancel into the ``O(p dn^2)`` JSD. fp32: ``dn A(dn)`` and ``dn^2 H(dn)``, the launch's
    degree-8 polynomials (``fused_rl._mixture_poly``: within fp32 rounding of both on
    ``[-1, 1]``; ``beta g1 - g2`` cancels by up to ``1 / (1 - beta)``, 4e5 units of roundoff
    at ``beta = 0.9999`` in fp32); fp64: ``log1p`` of ``x`` and the two functions' series
    (the same cancellation, 1e-12 relative at ``beta = 0.9999``)."""
    if ACC == tl.float64:
        e = expm1_near(dn)
        x = beta * e
        l1 = log1p(x)
        return l1, beta * _bregman_exp(dn, e) - _bregman_log(x, l1)
    else:
        big_l = dn * _near_polynomial(mix, MIX_L, dn)
        return big_l, dn * dn * _near_polynomial(mix, MIX_F, dn)


@triton.jit
def far_mixture(delta, log_beta, log_1m_beta):
    """``(L, log(q / m))`` by the ``logaddexp`` form, for the columns beyond ``|delta| <= 1``
    (and infinities): ``L = hi + log1p(e^(lo - hi))`` of ``log(1 - beta)`` and ``log(beta) +
    delta`` (``hi`` / ``lo`` the larger / smaller; ``pair.log1p_unit``), ``log(q / m)`` from
    the same ``log1p`` without cancelling (``delta = +inf``: ``L = inf``, ``log(q / m) =
    -log beta``; ``delta = -inf``: ``L = log(1 - beta)``, ``log(q / m) = -inf``)."""
    k = log_beta + delta
    hi = nan_max(log_1m_beta, k)
    lo = nan_min(log_1m_beta, k)
    l1 = log1p_unit(exp(lo - hi))
    return hi + l1, tl.where(k > log_1m_beta, -log_beta - l1, (delta - log_1m_beta) - l1)


@triton.jit
def mixture_log(delta, mix, ACC: tl.constexpr):
    """``L = log(m / p)`` per column (the JSD's backward): :func:`near_mixture`'s for
    ``|delta| <= 1``, :func:`far_mixture`'s beyond."""
    beta, _, log_beta, log_1m_beta = mixture_scalars(mix, ACC)
    near = (delta <= 1.0) & (delta >= -1.0)
    near_l, _ = near_mixture(tl.where(near, delta, 0.0), beta, mix, ACC)
    far_l, _ = far_mixture(delta, log_beta, log_1m_beta)
    return tl.where(near, near_l, far_l)


@triton.jit
def mixture_terms(delta, p, q, mix, ACC: tl.constexpr):
    """Per column: ``(L, f)`` with ``L = log(m / p)`` and ``f = beta q log(q / m) + (1 - beta)
    p log(p / m) >= 0`` (the column's JSD term), for ``delta = log q - log p``: the near
    form for ``|delta| <= 1`` (:func:`near_mixture`), beyond it ``f = beta q log(q / m) -
    (1 - beta) p L`` from :func:`far_mixture` (``0 log 0 = 0``), whose terms no longer
    cancel badly."""
    beta, one_m_beta, log_beta, log_1m_beta = mixture_scalars(mix, ACC)
    near = (delta <= 1.0) & (delta >= -1.0)
    near_l, near_f = near_mixture(tl.where(near, delta, 0.0), beta, mix, ACC)
    far_l, log_q_over_m = far_mixture(delta, log_beta, log_1m_beta)
    term_p = tl.where(p == 0, 0.0, p * far_l)
    term_q = tl.where(q == 0, 0.0, q * log_q_over_m)
    far_f = beta * term_q - one_m_beta * term_p
    return tl.where(near, near_l, far_l), tl.where(near, p * near_f, far_f)


@triton.jit
def mixture_pass(
    s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, m_z, log_s_z, m_u,
    log_s_u, log_zu, mix, BLOCK_V: tl.constexpr, ACC: tl.constexpr, inv_cap=1.0,
    HAS_SOFTCAP: tl.constexpr = False, t_inv_temperature=1.0, t_inv_cap=1.0,
    SPLIT: tl.constexpr = False, TEACHER_SOFTCAP: tl.constexpr = False,
):  # fmt: skip
    """Pass 2 of the general ``beta``: ``(JSD, sum_v p_v L_v)`` (module docstring), with
    ``delta = (y - x) / T + (M_z - M_u) + log(S_z / S_u)`` (``log_zu``) per column: the
    logits' own difference plus one row constant, whose rounding only shifts every
    ``delta`` alike (a first-order change of ``0`` in the JSD); ``SPLIT``: the teacher's row
    through its own transform (``pair.pair_columns``)."""
    # the two sums kept a lane each (``lane_sums``), reduced once after the loop; the whole
    # blocks read unmasked, then the partial one
    VEC: tl.constexpr = 128 // s_row.dtype.element_ty.primitive_bitwidth
    LANES: tl.constexpr = min(32, BLOCK_V // VEC)
    jsd = tl.zeros((LANES,), ACC)
    p_excess = tl.zeros((LANES,), ACC)
    n_whole = n_cols - n_cols % BLOCK_V
    for start in range(0, n_whole, BLOCK_V):
        jsd, p_excess = _mixture_step(
            s_row, t_row, start, V, s_stride_v, t_stride_v, inv_temperature, m_z, log_s_z, m_u,
            log_s_u, log_zu, mix, jsd, p_excess, BLOCK_V, ACC, LANES, VEC, inv_cap, HAS_SOFTCAP,
            t_inv_temperature, t_inv_cap, SPLIT, TEACHER_SOFTCAP, False,
        )  # fmt: skip
    if n_whole < n_cols:
        jsd, p_excess = _mixture_step(
            s_row, t_row, n_whole, V, s_stride_v, t_stride_v, inv_temperature, m_z, log_s_z,
            m_u, log_s_u, log_zu, mix, jsd, p_excess, BLOCK_V, ACC, LANES, VEC, inv_cap,
            HAS_SOFTCAP, t_inv_temperature, t_inv_cap, SPLIT, TEACHER_SOFTCAP, True,
        )  # fmt: skip
    return tl.sum(jsd, 0), tl.sum(p_excess, 0)


@triton.jit
def _mixture_step(
    s_row, t_row, start, V, s_stride_v, t_stride_v, inv_temperature, m_z, log_s_z, m_u,
    log_s_u, log_zu, mix, jsd, p_excess, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
    LANES: tl.constexpr, VEC: tl.constexpr, inv_cap, HAS_SOFTCAP: tl.constexpr,
    t_inv_temperature, t_inv_cap, SPLIT: tl.constexpr, TEACHER_SOFTCAP: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """One block of :func:`mixture_pass` from ``start`` (``MASKED``: it runs past ``V``): the
    lanes' running ``JSD`` and ``sum_v p_v L_v`` after it."""
    cols = start + tl.arange(0, BLOCK_V)
    log_p, log_q, delta, _ = pair_columns(
        s_row, t_row, cols, V, s_stride_v, t_stride_v, inv_temperature, inv_cap, m_z, m_u,
        log_s_z, log_s_u, log_zu, HAS_SOFTCAP, ACC, t_inv_temperature, t_inv_cap, SPLIT,
        TEACHER_SOFTCAP, MASKED,
    )  # fmt: skip
    p = exp(log_p)
    q = exp(log_q)
    excess, f = mixture_terms(delta, p, q, mix, ACC)
    p_excess += lane_sums(tl.where(p == 0, 0.0, p * excess), LANES, VEC)
    jsd += lane_sums(f, LANES, VEC)
    return jsd, p_excess


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
    inv_cap_hi,
    inv_cap_lo,
    t_inv_t_hi,
    t_inv_t_lo,
    t_inv_cap_hi,
    t_inv_cap_lo,
    mix,
    ignore_index,
    MODE: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
    TEACHER_SOFTCAP: tl.constexpr = False,
):
    """One program per token of ``(outer, rows_inner)`` rows (``n_rows`` in all); student
    and teacher rows strided independently. Writes the ``(N_COLS, n_rows)`` partial columns
    and the ``(N_STATS, n_rows)`` statistics; a token of weight 0 reads no logit and writes
    zeros. ``inv_t``: ``s / T`` (``c / T`` with a cap; ``inv_cap`` ``s / c``), ``t_inv_t``,
    ``t_inv_cap`` the teacher's (read under ``SPLIT``); ``mix``: the JSD's constants
    (``fused_rl.distill.mixture_constants``: ``beta``, ``1 - beta`` and their logs as fp32
    pairs, then the near form's polynomials), read for ``MODE_JSD`` only."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = n_rows.to(tl.int64)  # the column offsets k * n_rows may pass 2^31
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # s / T (c / T with the soft cap c)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: s / c
    t_inv_temperature = pair(t_inv_t_hi, t_inv_t_lo, ACC)  # SPLIT: the teacher's own
    t_inv_cap = pair(t_inv_cap_hi, t_inv_cap_lo, ACC)
    m = token_weight(
        row, rows_inner, targets_ptr, mask_ptr, y_stride_outer, y_stride_inner, m_stride_outer,
        m_stride_inner, ignore_index, HAS_TARGETS, HAS_MASK, ACC,
    )  # fmt: skip
    active = m != 0  # a NaN weight (a negative mask value) counts, and makes the result NaN
    n_cols = tl.where(active, V, 0)
    s_row = row_pointer(s_ptr, row, rows_inner, 0, s_stride_outer, s_stride_inner)
    t_row = row_pointer(t_ptr, row, rows_inner, 0, t_stride_outer, t_stride_inner)
    m_z, log_s_z, h_z, m_u, log_s_u, h_u, kl_fwd, kl_rev, log_zu = pair_moments(
        s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, BLOCK_V, ACC,
        inv_cap, HAS_SOFTCAP, t_inv_temperature, t_inv_cap, SPLIT, TEACHER_SOFTCAP,
    )  # fmt: skip
    if MODE == MODE_FORWARD_KL:
        d = kl_fwd
        c = tl.zeros((), ACC)
    elif MODE == MODE_REVERSE_KL:
        d = kl_rev
        c = kl_rev
    else:
        d, c = mixture_pass(
            s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, n_cols, m_z, log_s_z,
            m_u, log_s_u, log_zu, mix, BLOCK_V, ACC, inv_cap, HAS_SOFTCAP, t_inv_temperature,
            t_inv_cap, SPLIT, TEACHER_SOFTCAP,
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
    tl.store(st + STAT_LOG_SUM_U * n_rows, tl.where(active, log_s_u, 0.0))


@triton.jit(do_not_specialize=["n_outer", "rows_inner"])
def _distill_finalize_kernel(
    part_ptr,
    loss_ptr,
    metrics_ptr,
    seq_scale_ptr,
    num_items_ptr,
    n_outer,
    rows_inner,
    num_items_hi,
    num_items_lo,
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
    ``num_items`` (> 0; <= 0: not given; the fp32 pair ``num_items_hi + num_items_lo``) or
    the tensor at ``num_items_ptr`` replaces the weight total of ``token-mean`` (a tensor
    <= 0 gives NaN); ``n_seq = max(B, 1)``."""
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
        loss = aggregated_loss(tot_x, tot_m, seq_sum, seq_scale_ptr, num_items_ptr,
                               num_items_hi, num_items_lo, n_seq, max_length, AGG,
                               NUM_ITEMS_TENSOR, ACC)  # fmt: skip
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
    inv_cap_hi,
    inv_cap_lo,
    t_inv_t_hi,
    t_inv_t_lo,
    t_inv_cap_hi,
    t_inv_cap_lo,
    mix,
    MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    FREE: tl.constexpr = False,
    HAS_SOFTCAP: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
    TEACHER_SOFTCAP: tl.constexpr = False,
):
    """One program per token: the student's gradient row, ``grad`` contiguous
    ``(n_rows, V)`` in the student's dtype: ``m_t * seq_scale[b] * scale * dz/dx`` times
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
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # s / T (c / T with the soft cap c)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: s / c
    t_inv_temperature = pair(t_inv_t_hi, t_inv_t_lo, ACC)  # SPLIT: the teacher's own
    t_inv_cap = pair(t_inv_cap_hi, t_inv_cap_lo, ACC)
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
        coef = -coef * mixture_scalars(mix, ACC)[1]  # dD/dz = -(1 - beta) p (L - sum p L)
    if FREE:  # the partial derivatives on log p (docstring): no softmax projection
        if MODE == MODE_REVERSE_KL:
            c = tl.full((), -1.0, ACC)
        else:
            c = tl.zeros((), ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        log_p, log_q, delta, dx = pair_columns(
            s_row, t_row, cols, n_read, s_stride_v, t_stride_v, inv_temperature, inv_cap, m_z,
            m_u, log_s_z, log_s_u, log_zu, HAS_SOFTCAP, ACC, t_inv_temperature, t_inv_cap, SPLIT,
            TEACHER_SOFTCAP,
        )  # fmt: skip
        p = exp(log_p)
        near = (delta <= 1.0) & (delta >= -1.0)
        if MODE == MODE_FORWARD_KL:
            if FREE:
                g = -exp(log_q)
            else:  # p - q = -p expm1(delta), relative to itself where the two are near
                g = tl.where(near, -p * expm1_near(tl.where(near, delta, 0.0)), p - exp(log_q))
        elif MODE == MODE_REVERSE_KL:
            g = reverse_kl_grad(p, delta, c)
        else:
            excess = mixture_log(delta, mix, ACC)
            g = tl.where(p == 0, c - c, p * (excess - c))  # 0, NaN if c is not finite
        g = tl.where(active, coef * g * dx, 0.0)
        tl.store(grad_row + cols, cast_for(g, grad_ptr), mask=cols < V)


@triton.jit(do_not_specialize=["rows_inner", "n_rows"])
def _distill_mixture_kernel(
    s_ptr,
    t_ptr,
    stats_ptr,
    mask_ptr,
    out_ptr,
    rows_inner,
    n_rows,
    V,
    s_stride_outer,
    s_stride_inner,
    s_stride_v,
    t_stride_outer,
    t_stride_inner,
    t_stride_v,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    t_inv_t_hi,
    t_inv_t_lo,
    t_inv_cap_hi,
    t_inv_cap_lo,
    mix,
    HAS_MASK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr = False,
    SPLIT: tl.constexpr = False,
    TEACHER_SOFTCAP: tl.constexpr = False,
):
    """Pass 2 of the generalized JSD on one vocabulary shard, from the WHOLE vocabulary's row
    statistics ``stats`` (``(N_STATS, n_rows)``, merged across shards: ``fused_rl.distill``
    ``pair_divergence``): per row this shard's part of ``JSD`` and of ``sum_v p_v L_v``
    (``mixture_pass``), written to ``out`` ``(2, n_rows)``; a row outside ``mask`` (bool as
    bytes) reads nothing and writes zeros. Bytes: reads ``V (b_z + b_u)`` per row of the
    shard, 5 statistics; writes 2 floats."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = n_rows.to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # s / T (c / T with the soft cap c)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: s / c
    t_inv_temperature = pair(t_inv_t_hi, t_inv_t_lo, ACC)  # SPLIT: the teacher's own
    t_inv_cap = pair(t_inv_cap_hi, t_inv_cap_lo, ACC)
    active = row >= 0
    if HAS_MASK:
        active = tl.load(mask_ptr + row) != 0
    st = stats_ptr + row
    m_z = tl.load(st + STAT_MAX_Z * n_rows).to(ACC)
    log_s_z = tl.load(st + STAT_LOG_SUM_Z * n_rows).to(ACC)
    m_u = tl.load(st + STAT_MAX_U * n_rows).to(ACC)
    log_zu = tl.load(st + STAT_LOG_RATIO * n_rows).to(ACC)
    log_s_u = tl.load(st + STAT_LOG_SUM_U * n_rows).to(ACC)
    s_row = row_pointer(s_ptr, row, rows_inner, 0, s_stride_outer, s_stride_inner)
    t_row = row_pointer(t_ptr, row, rows_inner, 0, t_stride_outer, t_stride_inner)
    jsd, p_excess = mixture_pass(
        s_row, t_row, V, s_stride_v, t_stride_v, inv_temperature, tl.where(active, V, 0), m_z,
        log_s_z, m_u, log_s_u, log_zu, mix, BLOCK_V, ACC, inv_cap, HAS_SOFTCAP,
        t_inv_temperature, t_inv_cap, SPLIT, TEACHER_SOFTCAP,
    )  # fmt: skip
    tl.store(out_ptr + row, tl.where(active, jsd, 0.0))
    tl.store(out_ptr + n_rows + row, tl.where(active, p_excess, 0.0))
