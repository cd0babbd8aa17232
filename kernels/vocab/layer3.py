"""Layer 3, vocab-stream backward: one pass that re-reads each logits row and writes dL/dx.

Any loss that sees the vocabulary only through ``logp_t`` and ``H_t`` has, with
``g_t = dL/dlogp_t``, ``h_t = dL/dH_t``, ``p = softmax(z)``, ``z = x / T``:

    dL/dx_j = (1/T) * [ g (1[j = y] - p_j) - h p_j (z_j - E_p[z]) ]

With the soft cap ``z = c tanh(x / c) / T`` the bracket is multiplied by
``dz/dx * T = 1 - tanh^2(x / c)``, recomputed from the same read of ``x`` (no extra bytes).

With the exact KL to a reference ``q = softmax(u)`` in the loss (``kl_estimator="full"``,
``k_t = dL/dKL_t``) each row gains ``k p_j (-delta_j - KL)``, ``delta = log q - log p``
(``kernels/vocab/pair.py``), from one more read of the reference's row.

``p = exp((z - m) - log s)`` is recomputed from the forward's saved row max ``m`` and
``log s`` (never from a rounded ``lse = m + log s``), and ``z - E_p[z] = (z - m) - (log s - H)``.

Bytes per call: reads the logits once and writes their gradient once (2 + 2 per element in
bf16), plus O(1) floats per row; with the exact KL also reads the reference's logits once
(2 more in bf16) and 4 more floats per row.

``_scale_rows_unless_one_kernel`` is the backward of a loss whose gradient was formed in the
forward (``policy_loss(grad_in_forward=True)``): it multiplies that gradient by the upstream
scalar in place, deciding on the device whether there is anything to do.
"""

import triton
import triton.language as tl

from ..common import (
    cast_for,
    exp,
    lift_neg_inf,
    pair,
    row_pointer,
    tanh_and_sech2,
    target_column,
    token_offset,
)
from .pair import capped_gap, gap_from, load_block, near_delta, reverse_kl_grad

# the exact KL's per-token statistics the policy forward saves (``(4, N)``; the fourth is
# ``k = m_t dL/dKL_t`` before the aggregation's scale and the upstream gradient)
KLS_MAX_U = tl.constexpr(0)
KLS_LOG_RATIO = tl.constexpr(1)
KLS_KL = tl.constexpr(2)
KLS_COEF = tl.constexpr(3)
N_KLS = 4


@triton.jit(
    do_not_specialize=[
        "rows_inner",
        "positions",
        "shift",
        "ignore_index",
        "t_stride_outer",
        "t_stride_inner",
        "g_stride_outer",
        "g_stride_inner",
        "h_stride_outer",
        "h_stride_inner",
        "seq_scale_stride",
        "r_shift",
        "kls_stride",
    ]
)
def _token_stats_bwd_kernel(
    logits_ptr,
    targets_ptr,
    grad_ptr,
    max_ptr,
    log_sum_ptr,
    entropy_ptr,
    g_ptr,
    h_ptr,
    scale_ptr,
    seq_scale_ptr,
    rl_ptr,
    kls_ptr,
    rows_inner,
    positions,
    shift,
    r_shift,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    grad_stride_outer,
    grad_stride_inner,
    t_stride_outer,
    t_stride_inner,
    g_stride_outer,
    g_stride_inner,
    h_stride_outer,
    h_stride_inner,
    seq_scale_stride,
    r_stride_outer,
    r_stride_inner,
    r_stride_v,
    kls_stride,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    ignore_index,
    HAS_TARGETS: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_H: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SEQ_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_KL: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row of the WHOLE ``(outer, positions, V)`` logits buffer; ``grad`` is
    a buffer of that shape whose rows are contiguous (``grad_stride_outer`` /
    ``grad_stride_inner`` apart): a fresh contiguous one, or the logits themselves
    (``inplace=True``: each block of a row is read before it is overwritten).

    Position ``s`` of each ``outer`` predicts token ``s - shift`` of ``(outer, rows_inner)``
    per-token inputs (``shift = positions - rows_inner - 1`` for a buffer with more positions
    than targets, else 0); positions outside that window get an exact zero gradient, so no
    slice backward (a second full-size buffer and a copy) is ever needed.

    ``scale_ptr`` (optional) points at one scalar multiplying ``g`` and ``h`` (the upstream
    gradient of a fused scalar loss); ``seq_scale_ptr`` (optional) one more per ``outer``
    (stride 0: one for all), the loss aggregation's normaliser. Both are read on device.
    Ignored rows (target == ignore_index) and rows with ``g == h == 0`` (padding of a fused
    loss) read nothing and get exactly zero gradient. ``inv_t``: ``1 / T`` (``c / T`` with
    ``HAS_SOFTCAP``), ``inv_cap``: ``1 / c``.
    """
    prow = tl.program_id(0).to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # 1 / T, fp64-exact for fp64 logits
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)  # HAS_SOFTCAP: 1 / c, and the above c / T
    outer = prow // positions
    pos = prow - outer * positions
    inner = pos - shift
    active = (inner >= 0) & (inner < rows_inner)
    inner = tl.where(active, inner, 0)
    row = outer * rows_inner + inner  # the token this position predicts
    row_ptr = logits_ptr + outer * stride_outer + pos * stride_inner
    m = tl.load(max_ptr + row, mask=active, other=0.0).to(ACC)
    log_s = tl.load(log_sum_ptr + row, mask=active, other=0.0).to(ACC)
    if HAS_TARGETS:
        t_off = token_offset(row, rows_inner, t_stride_outer, t_stride_inner)
        target = tl.load(targets_ptr + t_off, mask=active, other=0).to(tl.int64)
        active = active & (target != ignore_index)
    else:
        target = -1
    scale = inv_temperature
    if HAS_SCALE:
        scale = scale * tl.load(scale_ptr).to(ACC)
    if HAS_SEQ_SCALE:
        scale = scale * tl.load(seq_scale_ptr + outer * seq_scale_stride).to(ACC)
    g = 0.0
    if HAS_G:
        g_off = token_offset(row, rows_inner, g_stride_outer, g_stride_inner)
        g = tl.load(g_ptr + g_off, mask=active, other=0.0).to(ACC) * scale
    h = 0.0
    mean_d = 0.0
    if HAS_H:
        h_off = token_offset(row, rows_inner, h_stride_outer, h_stride_inner)
        h = tl.load(h_ptr + h_off, mask=active, other=0.0).to(ACC) * scale
        mean_d = log_s - tl.load(entropy_ptr + row, mask=active, other=0.0).to(ACC)  # E_p[z]-m
    g = tl.where(active, g, 0.0)
    h = tl.where(active, h, 0.0)
    k = 0.0
    r_max = 0.0
    log_zu = 0.0
    kl = 0.0
    ref_row = row_ptr
    if HAS_KL:
        kls = kls_ptr + row
        kls_stride = kls_stride.to(tl.int64)  # k * N may pass 2^31
        r_max = tl.load(kls + KLS_MAX_U * kls_stride, mask=active, other=0.0).to(ACC)
        log_zu = tl.load(kls + KLS_LOG_RATIO * kls_stride, mask=active, other=0.0).to(ACC)
        kl = tl.load(kls + KLS_KL * kls_stride, mask=active, other=0.0).to(ACC)
        k = tl.load(kls + KLS_COEF * kls_stride, mask=active, other=0.0).to(ACC) * scale
        k = tl.where(active, k, 0.0)
        ref_row = row_pointer(rl_ptr, row, rows_inner, r_shift, r_stride_outer, r_stride_inner)
    active = active & ((g != 0) | (h != 0) | (k != 0))  # a NaN upstream gradient still reads
    grad_row = grad_ptr + outer * grad_stride_outer + pos * grad_stride_inner
    write_grad_row(
        row_ptr, grad_row, V, stride_v, inv_temperature, inv_cap, m, log_s, mean_d,
        g, h, target, active, ref_row, r_stride_v, r_max, log_zu, kl, k, HAS_TARGETS, HAS_H,
        HAS_SOFTCAP, HAS_KL, BLOCK_V, ACC,
    )  # fmt: skip


@triton.jit
def write_grad_row(
    row_ptr, grad_row, V, stride_v, inv_temperature, inv_cap, m, log_s, mean_d, g, h, target,
    active, ref_row, r_stride_v, r_max, log_zu, kl, k, HAS_TARGETS: tl.constexpr,
    HAS_H: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_KL: tl.constexpr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Stream one logits row and write its gradient ``(1/T)[g (1[j=y] - p) - h p (z - E_p z)]``
    to ``grad_row`` (contiguous; may be the row itself: each block is read before it is
    overwritten). ``g``/``h`` already carry ``inv_temperature`` and every scale; ``mean_d``
    is ``E_p[z] - m``. With ``HAS_SOFTCAP`` (``inv_temperature = c / T``, ``inv_cap = 1 / c``)
    each column's term is times ``dz/dx * T / c = (1 - tanh^2(x / c)) / c``. An inactive
    row reads nothing and writes zeros.

    ``HAS_KL``: also ``+ k p (-delta - KL)`` with ``delta = log q - log p`` formed from the
    reference row ``ref_row`` (``kernels/vocab/pair.py``: ``near_delta``; soft-capped like
    the policy's with ``HAS_SOFTCAP``, ``b - a`` then from ``capped_gap``; ``r_max`` its max,
    ``log_zu = log(S_z / S_u)``, ``KL`` the row's); ``k`` carries the same scales as
    ``g``."""
    if HAS_SOFTCAP:
        g = g * inv_cap
        h = h * inv_cap
        k = k * inv_cap
    n_read = tl.where(active, V, 0)
    column = target_column(target, V)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_row = cols < V
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read, other=0.0)
        # .to, not kernels.common.widen: widened by a shift here, the exact KL's backward took
        # 0.93 sm_90 instructions a logit instead of 0.85
        if HAS_SOFTCAP:
            t, sech2 = tanh_and_sech2(x.to(ACC) * inv_cap)
            d = t * inv_temperature - m
        else:
            d = x.to(ACC) * inv_temperature - m
        p = exp(d - log_s)
        grad = -g * p
        if HAS_TARGETS:
            grad += tl.where(cols == column, g, 0.0)
        if HAS_H:
            grad -= h * (p * lift_neg_inf(d - mean_d))  # 0 * -inf guarded
        if HAS_KL:
            y = load_block(ref_row, cols, n_read, r_stride_v, ACC)
            if HAS_SOFTCAP:  # pair_moments' b - a
                u, _ = tanh_and_sech2(y * inv_cap)
                b = u * inv_temperature - r_max
                w = capped_gap(x.to(ACC), y, inv_temperature, inv_cap)
                delta = gap_from(w, d, b, m, r_max) + log_zu
            else:
                delta = near_delta(x.to(ACC), y, inv_temperature, m, r_max, log_zu)
            grad += k * reverse_kl_grad(p, delta, kl)
        if HAS_SOFTCAP:
            grad = grad * sech2
        grad = tl.where(active, grad, 0.0)
        tl.store(grad_row + cols, grad.to(grad_row.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["n_rows", "positions"])
def _scale_rows_unless_one_kernel(
    grad_ptr,
    scale_ptr,
    n_rows,
    positions,
    V,
    stride_outer,
    stride_inner,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """``grad *= scale`` over the ``n_rows = outer * positions`` rows of a ``(outer,
    positions, V)`` buffer with contiguous rows (``stride_outer`` / ``stride_inner`` apart),
    ``scale`` a 0-dim tensor read on the device (no host sync): when it is exactly 1 every
    program returns after reading those 4 bytes, so the launch touches none of the
    buffer; otherwise program ``p`` scales rows ``p, p + n_programs, ...`` (any NaN or other
    value scales, computed in ``ACC`` with the exact scale and rounded once to the buffer's
    dtype; torch's bf16 ``grad * scale`` on a GPU first rounds a 0-dim ``scale`` to bf16)."""
    scale = tl.load(scale_ptr).to(ACC)
    if scale != 1.0:
        for prow in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            p = prow + tl.zeros((), tl.int64)  # int64 offsets (an int in the interpreter)
            outer = p // positions
            row = grad_ptr + outer * stride_outer + (p - outer * positions) * stride_inner
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                x = tl.load(row + cols, mask=cols < V, other=0.0)
                tl.store(row + cols, cast_for(x.to(ACC) * scale, row), mask=cols < V)
