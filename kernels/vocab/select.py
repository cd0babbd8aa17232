"""The k-th largest logit of each row by radix select, streamed (``fused_rl._select_ops``).

No row is sorted or copied: each float's bits are mapped to an order-preserving unsigned key
(``_key``: ``a < b`` iff ``key(a) < key(b)``, ``-0.0`` just below ``+0.0``) and the key of the
k-th largest is found 8 bits at a time, most significant first. A **pass** streams the row
once and builds a 256-bin histogram (``tl.histogram``) of the next 8-bit digit of the keys
that share the digits already chosen; the chosen digit is the largest whose bin, counted
with every bin above it, reaches the number of values still to pass over. A row of ``B``-bit
floats takes ``B / 8`` passes: **2 reads** of a bf16 / fp16 row, 4 of fp32, 8 of fp64, each
``V E`` bytes (``E`` bytes a logit); 4 bytes written a row (8 for fp64). Ties count with their
multiplicity (the k-th largest of ``[3, 3, 1]`` for ``k = 2`` is 3), as ``torch.topk``'s
values. A row holding a NaN gives NaN (counted in the first pass; the histograms leave NaN
out); ``+-inf`` are values like any other.

A vocabulary split across ranks runs the passes one launch each
(``_digit_histogram_kernel``): each rank's histograms are summed over the ranks between them.

One program per row, one warp (a read-only stream, ``fused_rl._launch.vocab_launch``); the
histogram is the hardware's shared-memory increment (``ATOMS.POPC.INC`` on sm_90: lanes on
the same bin add once), 1 KB of shared memory.
"""

import triton
import triton.language as tl

from ..common import row_pointer

DIGIT_BITS = tl.constexpr(8)
BINS = tl.constexpr(256)


@triton.jit
def _key(x, KEY: tl.constexpr):
    """The order-preserving unsigned key of ``x`` (its own width: ``KEY`` is ``tl.uint16``,
    ``tl.uint32`` or ``tl.uint64``): a negative float's bits inverted, a positive one's with
    the sign bit set."""
    bits = x.to(KEY, bitcast=True)
    TOP: tl.constexpr = KEY.primitive_bitwidth - 1
    sign = tl.full((), 1, KEY) << TOP
    # ``^ ones`` where ``~`` would do: Triton 3.8's interpreter builds ``~``'s all-ones
    # operand as a signed -1, which NumPy refuses for an unsigned type (OverflowError)
    return tl.where((bits >> TOP) == 1, bits ^ (sign | (sign - 1)), bits | sign)


@triton.jit
def _is_nan(x, KEY: tl.constexpr):
    """NaN from the bits (exponent all ones, mantissa not zero): the interpreter compares
    bf16 as raw bits, where ``x != x`` never holds."""
    bits = x.to(KEY, bitcast=True)
    magnitude = bits & ((tl.full((), 1, KEY) << (KEY.primitive_bitwidth - 1)) - 1)
    # +inf's bits written out: Triton 3.8's interpreter cannot make a bf16 constant
    if x.dtype == tl.bfloat16:
        inf = tl.full((), 0x7F80, KEY)
    elif x.dtype == tl.float16:
        inf = tl.full((), 0x7C00, KEY)
    elif x.dtype == tl.float32:
        inf = tl.full((), 0x7F800000, KEY)
    else:
        inf = tl.full((), 0x7FF0000000000000, KEY)
    return magnitude > inf


@triton.jit
def _value(key, KEY: tl.constexpr, DTYPE: tl.constexpr, ACC: tl.constexpr,
           AS_LOADED: tl.constexpr = False):  # fmt: skip
    """The float of a key (``_key``'s inverse), a ``DTYPE`` value returned in ``ACC``. A bf16
    value is widened by its bits (fp32's upper half), exact for subnormals too (the
    interpreter's bf16 -> fp32 cast flushes them to 0), unless ``AS_LOADED``: then cast as a
    kernel casts the logits it loads (``x.to(ACC)``), for a value compared with theirs."""
    TOP: tl.constexpr = KEY.primitive_bitwidth - 1
    sign = tl.full((), 1, KEY) << TOP
    bits = tl.where((key >> TOP) == 1, key ^ sign, key ^ (sign | (sign - 1)))  # not ``~``
    if DTYPE == tl.bfloat16 and not AS_LOADED:
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True).to(ACC)
    return bits.to(DTYPE, bitcast=True).to(ACC)


@triton.jit
def _digit_histogram(
    row_ptr, V, stride_v, prefix, shift, FIRST: tl.constexpr, KEY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One pass over the row: the histogram of the digit ``(key >> shift) & 255`` over the
    non-NaN values whose key above the digit equals ``prefix`` (every value in the ``FIRST``
    pass), and the row's NaN count (``FIRST`` only; else 0)."""
    hist = tl.zeros((BINS,), tl.int32)
    n_nan = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=valid, other=0.0)
        key = _key(x, KEY)
        nan = _is_nan(x, KEY)
        counted = valid & (nan == 0)
        if FIRST:
            n_nan += tl.sum((valid & nan).to(tl.int32), 0)
        else:
            counted = counted & ((key >> (shift + DIGIT_BITS)) == prefix)
        digit = ((key >> shift) & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=counted)
    return hist, n_nan


@triton.jit(do_not_specialize=["rows_inner", "k"])
def _kth_largest_kernel(
    logits_ptr,
    out_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    k,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """``out[row]`` = the ``k``-th largest of row ``row`` of ``(outer, rows_inner, V)``
    logits (any strides; ``1 <= k <= V``), in ``ACC`` (exact: the logit's own value); NaN
    for a row holding a NaN. ``out`` contiguous ``(outer * rows_inner,)``."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    DTYPE: tl.constexpr = logits_ptr.dtype.element_ty
    BITS: tl.constexpr = DTYPE.primitive_bitwidth
    KEY: tl.constexpr = tl.core.get_int_dtype(BITS, False)
    bins = tl.arange(0, BINS)
    prefix = tl.zeros((), KEY)
    need = k  # values of the current prefix still to pass over, the k-th included
    n_nan = tl.zeros((), tl.int32)
    for p in tl.static_range(BITS // DIGIT_BITS):
        hist, nans = _digit_histogram(
            row_ptr, V, stride_v, prefix, BITS - DIGIT_BITS * (p + 1), p == 0, KEY, BLOCK_V
        )
        n_nan += nans
        at_or_above = tl.cumsum(hist, 0, reverse=True)  # per bin: that bin and every bin above
        digit = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
        prefix = (prefix << DIGIT_BITS) | digit.to(KEY)
    value = _value(prefix, KEY, DTYPE, ACC)
    tl.store(out_ptr + row, tl.where(n_nan > 0, float("nan"), value))


@triton.jit(do_not_specialize=["rows_inner", "shift"])
def _digit_histogram_kernel(
    logits_ptr,
    prefix_ptr,
    hist_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    shift,
    FIRST: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One pass of the radix select for a row split across ranks (the vocabulary-parallel
    caller sums the histograms over the ranks and chooses the digit): ``hist[row, :256]``
    the histogram of the digit at ``shift`` of the row's keys whose digits above it equal
    ``prefix[row]`` (int64, the key's bits; unread in the ``FIRST`` pass), ``hist[row, 256]``
    the row's NaN count (``FIRST``; else 0). ``hist`` contiguous ``(n_rows, 257)`` int32."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    BITS: tl.constexpr = logits_ptr.dtype.element_ty.primitive_bitwidth
    KEY: tl.constexpr = tl.core.get_int_dtype(BITS, False)
    if FIRST:
        prefix = tl.zeros((), KEY)
    else:
        prefix = tl.load(prefix_ptr + row).to(tl.uint64, bitcast=True).to(KEY)
    hist, n_nan = _digit_histogram(row_ptr, V, stride_v, prefix, shift, FIRST, KEY, BLOCK_V)
    out = hist_ptr + row * (BINS + 1)
    tl.store(out + tl.arange(0, BINS), hist)
    tl.store(out + BINS, n_nan)
