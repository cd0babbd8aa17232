"""Small device functions shared by every layer (no loss math, no vocabulary streaming)."""

import triton
import triton.language as tl


@triton.jit
def pair(hi, lo, ACC: tl.constexpr):
    """A float passed as two fp32 halves (``fused_rl._launch.f32_pair``), recombined in
    ``ACC``: exact to ~2^-48 in fp64, ``fp32(x)`` in fp32."""
    return (tl.zeros((), ACC) + hi) + lo


@triton.jit
def row_pointer(logits_ptr, row, rows_inner, shift, stride_outer, stride_inner):
    """Pointer to the logits row that predicts token ``row`` of ``(outer, rows_inner)``
    targets: position ``inner + shift`` of a ``(outer, S, V)`` buffer (``shift = S - T - 1``
    when the buffer carries ``S > T`` positions, the causal-LM convention; else 0)."""
    outer = row // rows_inner
    inner = row - outer * rows_inner
    return logits_ptr + outer * stride_outer + (inner + shift) * stride_inner


@triton.jit
def token_offset(row, rows_inner, stride_outer, stride_inner):
    """Element offset of token ``row`` in a strided ``(outer, rows_inner)`` tensor (a slice
    such as ``input_ids[:, 1:]`` or an expanded ``(B,)`` is read in place)."""
    outer = row // rows_inner
    inner = row - outer * rows_inner
    return outer * stride_outer + inner * stride_inner


@triton.jit
def exp(x):
    """``e^x`` as ``2^(x log2 e)`` in fp32 (``tl.exp`` in fp64). On sm_90 ``tl.exp2`` is one
    ``ex2.approx.ftz`` instruction, while ``tl.exp`` multiplies by the same fp32 ``log2 e``
    and calls ``ex2.approx`` without ``ftz``, which ptxas wraps in a denormal fix-up: two
    instructions a value against five, a fifth of a vocab stream's work per logit. The one
    difference: a result below ``2^-126`` (``x < -87.3``, relative to the row's maximum) is
    0 where torch keeps a denormal down to ``x = -103.3``. No sum of a row's terms resolves
    it; a divergence's support test does (``p == 0``): a student probability in between
    where the teacher's or the reference's is 0 counts as 0, a finite KL where torch's is
    ``+inf``."""
    if x.dtype == tl.float32:
        return tl.exp2(x * 1.4426950408889634)
    else:
        return tl.exp(x)


@triton.jit
def target_column(target, V):
    """An int64 target as an int32 column of a row of ``V`` (``-1`` outside ``[0, V)``:
    ignored, or on another rank's shard), for a gradient's one-hot ``cols == column``: a
    64-bit compare there cost ~7 sm_90 instructions a column, a third of a backward's. A
    row of ``2^31`` logits or more (an int64 ``V``, and int64 columns) keeps it int64."""
    column = tl.where((target >= 0) & (target < V), target, -1)
    if V.dtype == tl.int64:
        return column
    return column.to(tl.int32)


@triton.jit
def tanh_and_sech2(u):
    """``(tanh u, 1 - tanh^2 u)`` from one ``e = exp(-2|u|)``: ``tanh |u| = (1 - e) / (1 + e)``
    and ``sech^2 u = 4 e / (1 + e)^2``, neither cancelling for large ``|u|`` (no
    ``1 - tanh^2``); ``u = +-inf`` gives ``(+-1, 0)``, NaN gives NaN."""
    e = exp(-2.0 * tl.abs(u))
    r = 1.0 / (1.0 + e)
    t = (1.0 - e) * r
    return tl.where(u < 0, -t, t), 4.0 * e * r * r


# ``tl.minimum``/``tl.maximum`` default to min/max-num semantics: they return the other operand
# when one is NaN, which would turn a NaN token into a finite loss. These propagate NaN exactly
# as ``torch.minimum``/``torch.maximum``/``torch.clamp`` do; every kernel uses them
# (tests/test_failure_modes.py fails on a bare ``tl.minimum``/``tl.maximum``).


@triton.jit
def as_weight(m):
    """A mask value as a token weight. Weights must be >= 0; a negative one cannot be rejected
    without reading the mask on the host, so it turns into NaN and makes the result loudly
    NaN (the reference does the same: ``fused_rl.reference.reductions.mask_weights``)."""
    return tl.where(m < 0, float("nan"), m)


@triton.jit
def lift_neg_inf(x):
    """``x`` with ``-inf`` raised to the lowest finite fp32, NaN kept: ``e * lift_neg_inf(d)``
    with ``e = exp(d)`` is 0 where ``d = -inf`` (not ``0 * -inf``), one max a column where a
    compare and a select guarded it (an entropy term ``p log p`` per logit)."""
    return nan_max(x, -3.4028234663852886e38)


@triton.jit
def nan_min(a, b):
    """``torch.minimum(a, b)``: NaN if either is NaN."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max(a, b):
    """``torch.maximum(a, b)``: NaN if either is NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def clamp(x, lo, hi):
    """``torch.clamp(x, lo, hi)``: NaN stays NaN (and ``hi`` wins when ``lo > hi``)."""
    return nan_min(nan_max(x, lo), hi)


@triton.jit
def cast_for(x, ptr):
    """``x`` converted to the element type of ``ptr`` for a store. A 16-bit type goes through
    fp32: the Triton interpreter turns a direct fp64 -> bf16 conversion into NaN, and torch
    rounds fp64 -> bf16 / fp16 through fp32 too, so the result is torch's bit for bit. Needed
    wherever an fp64 accumulator (an fp64 input next to a bf16 one) meets a 16-bit output."""
    if ptr.dtype.element_ty == tl.float64:
        return x.to(tl.float64)
    else:
        return x.to(tl.float32).to(ptr.dtype.element_ty)


@triton.jit
def widen(v, ACC: tl.constexpr):
    """``v`` in ``ACC``; bf16 to fp32 as its bits shifted into the top half (exact: a bf16 is
    the top 16 bits of an fp32, NaN and infinities included): one sm_90 instruction a value,
    a shift or, for the high half of a loaded 32-bit pair, an and, where ``.to`` moves the
    high half down first (three a pair, not two)."""
    if v.dtype == tl.bfloat16 and ACC == tl.float32:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return v.to(ACC)


@triton.jit
def lane_maxima(x, LANES: tl.constexpr, VEC: tl.constexpr):
    """A one-warp block's values reduced to ``LANES`` maxima, one a lane, with no cross-lane
    traffic (:func:`lane_sums`' layout)."""
    return tl.max(tl.max(tl.reshape(x, (x.shape[0] // (LANES * VEC), LANES, VEC)), 2), 0)


@triton.jit
def lane_sums(x, LANES: tl.constexpr, VEC: tl.constexpr):
    """A one-warp block's values summed to ``LANES`` partials, one a lane, with no cross-lane
    traffic: a vector load puts ``VEC`` consecutive values in a lane and the next ``VEC`` in
    the next lane, so the sum of ``(BLOCK / (LANES VEC), LANES, VEC)`` over its outer axes
    stays in each lane's registers. A running sum kept as these partials takes one
    cross-lane reduction after the loop instead of a shuffle tree a block."""
    return tl.sum(tl.sum(tl.reshape(x, (x.shape[0] // (LANES * VEC), LANES, VEC)), 2), 0)
