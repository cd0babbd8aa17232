"""Vocabulary-parallel truncated log-probs: the kernels each rank runs on its own shard
(``fused_rl.truncated_parallel`` merges their outputs across the ranks).

``_shard_partials_kernel`` (one read of each shard row, as pass A of
``kernels/vocab/truncated.py``): per row, the shard's ``kk`` largest tempered logits in
``KS = 64`` slots (unordered, ``-inf`` where empty), the count of values tied at the
``kk``-th that hold no slot, and the shard's max, ``sum exp(z - max)`` (``NEED_SUM``), NaN
test (0 iff none) and target logit (when it owns the target): one ``PART`` row of ``KS + 7``
floats (the sum 0 without its flag); for top-k > 64 also the histogram of the top digit of
its logits' keys (``HIST``, the radix select's first pass). The union
of every rank's slots holds, with multiplicity, every value of the row at or above the
largest of the ranks' ``kk``-th values, so top-k with ``k <= 64`` and most top-p cuts are
read off the gathered slots.

``_shard_digit_kernel`` and ``_shard_kth_kernel`` run the rest of the top-k radix select of
``kernels/vocab/truncated.py`` (``_kth_by_digits``) one pass per launch, the histograms summed
over the ranks between them (fp32 counts, exact below ``2^24``), and its end: the k-th's
``tau`` and the kept mass from the last pass's sums (with the soft cap one more read).

``_shard_search_kernel`` runs the threshold search of ``kernels/vocab/truncated.py``
``_search`` one pass per launch on a bracket every rank holds alike: a launch first narrows
the bracket with the previous pass's counts and masses summed over the ranks (``NARROW``),
then streams the shard for the next pass's 16 candidates (``STREAM``), or gathers the (at
most 64) values left in the bracket (``COLLECT``). The bracket arithmetic is
``_search_candidates`` / ``_narrow`` / ``_one_value_left`` / ``_bracket_sums`` /
``_collect``, shared with the single-device kernel, so both search the same candidates
(bf16 / fp16 logits without the soft cap on their own 16-bit keys).

Bytes per row (``E`` bytes per logit, ``V_r`` the shard's width): the partials read ``V_r E``
once; each radix pass after it and each search pass reads ``V_r E`` (a row that needs none
reads nothing), the collect pass the same.
"""

import triton
import triton.language as tl

from ..common import pair, row_pointer, token_offset
from .layer1 import scaled_logits
from .select import BINS, DIGIT_BITS, _digit_histogram
from .truncated import (
    KS,
    _bracket_sums,
    _collect,
    _kept_mass,
    _last_digit,
    _mass_at_or_above,
    _mass_fraction,
    _narrow,
    _one_value_left,
    _pass_a,
    _search_candidates,
    _ties_not_held,
    _z_of_key,
)

# the PART row after the KS slots, and the search state row: fields by offset (constexpr for
# the kernels; fused_rl.truncated_parallel reads ``.value``)
P_EXTRA, P_THR, P_MAX, P_SUM, P_NAN, P_Y, P_OWN = (tl.constexpr(i) for i in range(7))
PART_EXTRA = tl.constexpr(7)
S_LO, S_HI, S_CHI, S_FHI, S_FLO, S_GOAL, S_M, S_PASSES, S_DONE, S_SINGLE, S_ON = (
    tl.constexpr(i) for i in range(11)
)
STATE = tl.constexpr(11)


@triton.jit(do_not_specialize=["rows_inner", "t_stride_outer", "t_stride_inner", "kk"])
def _shard_partials_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    hist_ptr,
    rows_inner,
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
    kk,
    ignore_index,
    NEED_SUM: tl.constexpr,
    HIST: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row of ``(outer, rows_inner, V)`` shard logits (``V`` the valid
    columns) with local targets (``ignore_index``: read nothing; outside ``[0, V)``: owned by
    another rank): its ``PART`` row of ``part`` ``(n_rows, KS + 7)`` and (``HIST``) the
    histogram of its logits' top key digit, the radix select's first pass, in ``hist``
    ``(n_rows, 256)`` int32."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    target = tl.load(targets_ptr + token_offset(row, rows_inner, t_stride_outer, t_stride_inner))
    target = target.to(tl.int64)
    active = target != ignore_index
    m, s, n_nan, top, thr, eqcnt, hist = _pass_a(
        row_ptr, tl.where(active, V, 0), stride_v, inv_t, inv_cap, kk, NEED_SUM, True, BLOCK_V,
        HAS_SOFTCAP, ACC, HIST,
    )  # fmt: skip
    if HIST:
        tl.store(hist_ptr + row * BINS + tl.arange(0, BINS), hist)
    if not NEED_SUM:
        m = tl.max(top, 0)
    # thr = -inf: fewer than kk values, all held (the -inf ones carry no mass)
    extra = tl.where(thr == float("-inf"), 0, _ties_not_held(top, thr, eqcnt, kk))
    owned = active & (target >= 0) & (target < V)
    x_y = tl.load(row_ptr + tl.where(owned, target, 0) * stride_v, mask=owned, other=0.0)
    z_y = scaled_logits(x_y.to(ACC), inv_t, inv_cap, HAS_SOFTCAP)
    out = part_ptr + row * (KS + PART_EXTRA)
    tl.store(out + tl.arange(0, KS), top)
    tl.store(out + KS + P_EXTRA, extra.to(ACC))
    tl.store(out + KS + P_THR, thr)
    tl.store(out + KS + P_MAX, m)
    tl.store(out + KS + P_SUM, s)
    tl.store(out + KS + P_NAN, n_nan.to(ACC))
    tl.store(out + KS + P_Y, tl.where(owned, z_y, 0.0))
    tl.store(out + KS + P_OWN, owned.to(ACC))


@triton.jit(do_not_specialize=["rows_inner"])
def _shard_search_kernel(
    logits_ptr,
    state_ptr,
    sums_ptr,
    top_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    NARROW: tl.constexpr,
    STREAM: tl.constexpr,
    COLLECT: tl.constexpr,
    N_CAND: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    MAX_SEARCH_PASSES: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row: its search state (a ``STATE``-float row of ``state``: the
    bracket ``[lo, hi)``, the count / mass at or above ``hi``, the mass at or above ``lo``,
    the goal, the global max, the passes run, done, a single value left, searched at all),
    ``sums`` ``(n_rows, 2 N_CAND)`` (this rank's counts then masses of a pass, summed over
    the ranks in place between launches) and ``top`` ``(n_rows, KS)`` (``COLLECT``)."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    DTYPE: tl.constexpr = logits_ptr.dtype.element_ty
    st = state_ptr + row * STATE
    lo = tl.load(st + S_LO)
    hi = tl.load(st + S_HI)
    c_hi = tl.load(st + S_CHI)
    f_hi = tl.load(st + S_FHI)
    f_lo = tl.load(st + S_FLO)
    goal = tl.load(st + S_GOAL)
    m = tl.load(st + S_M)
    passes = tl.load(st + S_PASSES).to(tl.int32)
    done = tl.load(st + S_DONE) != 0.0
    j = tl.arange(0, N_CAND)
    sums = sums_ptr + row * (2 * N_CAND)
    if NARROW:  # the pass the ranks just summed: the same new bracket on every rank
        # the previous pass's candidates, from the bracket's masses before this narrowing
        frac = _mass_fraction(f_lo, f_hi, goal)
        cand = _search_candidates(lo, hi, passes - 1, frac, inv_t, N_CAND, DTYPE, HAS_SOFTCAP,
                                  ACC)  # fmt: skip
        cnt = tl.load(sums + j).to(tl.int64)
        mass = tl.load(sums + N_CAND + j)
        n_lo, n_hi, n_chi, n_fhi, n_flo, n_in = _narrow(
            cand, cnt, mass, hi, c_hi.to(tl.int64), f_hi, goal, ACC
        )
        lo = tl.where(done, lo, n_lo)
        hi = tl.where(done, hi, n_hi)
        c_hi = tl.where(done, c_hi, n_chi.to(ACC))
        f_hi = tl.where(done, f_hi, n_fhi)
        f_lo = tl.where(done, f_lo, n_flo)  # a row done already keeps its own
        single = _one_value_left(lo, hi, inv_t, DTYPE, HAS_SOFTCAP, ACC)
        tl.store(st + S_FLO, f_lo)
        tl.store(st + S_SINGLE, single.to(ACC), mask=done == 0)
        done = done | single | (n_in <= KS) | (passes >= MAX_SEARCH_PASSES)
        tl.store(st + S_LO, lo)
        tl.store(st + S_HI, hi)
        tl.store(st + S_CHI, c_hi)
        tl.store(st + S_FHI, f_hi)
        tl.store(st + S_DONE, done.to(ACC))
    if STREAM:
        frac = _mass_fraction(f_lo, f_hi, goal)  # from registers: NARROW's stores not reread
        cand = _search_candidates(lo, hi, passes, frac, inv_t, N_CAND, DTYPE, HAS_SOFTCAP, ACC)
        cnt, mass = _bracket_sums(
            row_ptr, tl.where(done, 0, V), stride_v, inv_t, inv_cap, m, cand, N_CAND,
            SEARCH_BLOCK, HAS_SOFTCAP, ACC,
        )  # fmt: skip
        tl.store(sums + j, cnt.to(ACC))
        tl.store(sums + N_CAND + j, mass)
        tl.store(st + S_PASSES, (passes + (done == 0).to(tl.int32)).to(ACC))
    if COLLECT:  # the search is over: the values left in a bracket of more than one value
        on = (tl.load(st + S_ON) != 0.0) & (tl.load(st + S_SINGLE) == 0.0)
        top = _collect(row_ptr, tl.where(on, V, 0), stride_v, inv_t, inv_cap, lo, hi, BLOCK_V,
                       HAS_SOFTCAP, ACC)  # fmt: skip
        tl.store(top_ptr + row * KS + tl.arange(0, KS), top)


@triton.jit(do_not_specialize=["rows_inner", "shift"])
def _shard_digit_kernel(
    logits_ptr,
    on_ptr,
    prefix_ptr,
    m_ptr,
    buf_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    shift,
    LAST: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One later pass of the top-k radix select (the first is the partials kernel's
    ``HIST``) on the rows ``on`` (bool, ``(n_rows,)``; the others read nothing): ``buf``
    ``(n_rows, 258)`` in ``ACC`` (summed over the ranks in place next), the histogram of the
    key digit at ``shift`` among the keys whose digits above it equal ``prefix`` (int64),
    then, in the ``LAST`` pass without the soft cap, ``kernels/vocab/truncated.py``
    ``_last_digit``'s mass above the prefix and count of the values below it that the
    scaling rounds onto its smallest key's ``z`` (``m`` the global max); else 0 and 0.
    Counts are exact in ``ACC``: the vocabulary is below ``2^24``."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    DTYPE: tl.constexpr = logits_ptr.dtype.element_ty
    KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
    n_read = tl.where(tl.load(on_ptr + row) != 0, V, 0)
    prefix = tl.load(prefix_ptr + row).to(tl.uint64, bitcast=True).to(KEY)
    above = tl.zeros((), ACC)
    n_low = tl.zeros((), tl.int32)
    if LAST:
        m = tl.load(m_ptr + row)
        z_low = _z_of_key(prefix << DIGIT_BITS, inv_t, inv_cap, DTYPE, HAS_SOFTCAP, ACC)
        hist, above, n_low = _last_digit(
            row_ptr, n_read, stride_v, prefix, z_low, m, inv_t, inv_cap, KEY, BLOCK_V,
            HAS_SOFTCAP, ACC,
        )  # fmt: skip
    else:
        hist, _ = _digit_histogram(row_ptr, n_read, stride_v, prefix, shift, False, KEY, BLOCK_V)
    out = buf_ptr + row * (BINS + 2)
    tl.store(out + tl.arange(0, BINS), hist.to(ACC))
    tl.store(out + BINS, above)
    tl.store(out + BINS + 1, n_low.to(ACC))


@triton.jit(do_not_specialize=["rows_inner"])
def _shard_kth_kernel(
    logits_ptr,
    on_ptr,
    key_ptr,
    m_ptr,
    buf_ptr,
    out_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """The end of the top-k radix select on the rows ``on``: ``out`` ``(2, n_rows)`` in
    ``ACC``, ``tau`` (the ``z`` of the logit whose key is ``key``, int64: the k-th largest)
    and the mass ``exp(z - m)`` of ``{z >= tau}``: without the soft cap the whole row's,
    from the last pass's ``buf`` summed over the ranks (no read); with it this rank's share,
    one read of the shard (its ``tanh`` is not exactly monotone on a GPU: the mass is summed
    over the kept set itself), summed over the ranks next."""
    row = tl.program_id(0).to(tl.int64)
    n_rows = tl.num_programs(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    DTYPE: tl.constexpr = logits_ptr.dtype.element_ty
    KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
    key = tl.load(key_ptr + row).to(tl.uint64, bitcast=True).to(KEY)
    m = tl.load(m_ptr + row)
    tau = _z_of_key(key, inv_t, inv_cap, DTYPE, HAS_SOFTCAP, ACC)
    if HAS_SOFTCAP:
        row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
        n_read = tl.where(tl.load(on_ptr + row) != 0, V, 0)
        mass = _mass_at_or_above(row_ptr, n_read, stride_v, tau, m, inv_t, inv_cap, BLOCK_V,
                                 HAS_SOFTCAP, ACC)  # fmt: skip
    else:
        sums = buf_ptr + row * (BINS + 2)
        hist = tl.load(sums + tl.arange(0, BINS))
        mass = _kept_mass(key, tau, hist, tl.load(sums + BINS), tl.load(sums + BINS + 1), m,
                          inv_t, inv_cap, DTYPE, ACC)  # fmt: skip
    tl.store(out_ptr + row, tau)
    tl.store(out_ptr + n_rows + row, mass)
