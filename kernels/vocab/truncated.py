"""Log-probs under a sampler's top-k / top-p truncation, streamed (``fused_rl.truncated``).

The distribution is vLLM's sampler's: ``z = x / T`` (``c tanh(x / c) / T`` with the soft cap
``HAS_SOFTCAP``, ``kernels/vocab/layer1.py`` ``scaled_logits``); top-k keeps ``{z >= tau_k}``,
``tau_k`` the k-th largest ``z`` of the row (every token tied AT ``tau_k`` is kept, so more
than k may be); top-p then keeps, of those, ``{z >= v*}``: ``v*`` the largest kept value whose
kept mass ``F(v) = sum_{kept z >= v} exp(z - m)`` reaches ``p`` times the kept total (the token that
crosses ``p`` is kept, with every token tied with it: a threshold, independent of any sort's
order among ties). The target's log-prob is ``z_y - lse_kept`` for ``z_y >= tau`` (``tau``
the final threshold), ``-inf`` otherwise. No row is ever sorted in memory; nothing of size
``(N, V)`` is allocated.

Forward, one program per row (``_truncated_logprobs_fwd_kernel``):

* **Pass A** (always; the only pass for top-k with ``k <= MAX_STREAMED_K`` = 64, with or
  without top-p): the row's ``KK`` largest values are kept in registers (``KK = k``, or 64
  for top-p alone / top-k > 64; ``KS = 64`` slots, the unused ones ``-inf``), unordered,
  with ``thr`` their smallest. Each block of ``BLOCK_V`` logits is viewed as 64 groups; a
  round takes the groups' maxima and inserts those above ``thr``, largest first, each
  replacing the smallest held value (O(64) register work, no sort); the inserted maxima are
  struck from their groups and the next round takes the new maxima, until no group holds a
  value above ``thr`` (one or two rounds per block once the set is full: a block rarely
  holds many of the row's largest values). The count of values seen equal to ``thr`` is
  kept exactly (``eqcnt``: a larger ``thr`` than the block's previous one was held whole,
  an unchanged one carries its count), so the tokens tied AT the k-th value that did not
  fit a slot are counted and kept. Also per row: the online max and ``sum exp(z - m)``
  (top-p alone / no truncation), a NaN test (``n_nan``: how many of ``_absorb``'s groups
  hold one), and for top-k > 64 the histogram of the top 8-bit digit of the logits' keys
  (the radix select's first pass, below). With ``k <=
  64`` the kept set's mass is summed from the registers (plus ``extra * exp(tau_k - m)``
  for the uncounted ties) and the top-p cut is a 64 x 64 comparison of the same registers
  (the mass at or above each held value).
* **Top-k > 64** (``k < V``; ``_kth_by_digits``): unless the ties at the 64th held value
  reach ``k``, the k-th largest by **radix select on the logits' own bits**
  (``kernels/vocab/select.py``'s digit histograms: 8 bits a pass, most significant first,
  the first from pass A). ``z`` is a non-decreasing function of ``x``, so the k-th largest
  ``z`` is the image of the k-th largest ``x``. The last pass also gives the kept mass:
  the values above the chosen prefix summed, those sharing it one value per last digit
  (the histogram's counts times that value's ``exp(z - m)``), and the smaller logits the
  scaling rounds onto the k-th's ``z`` (``-0.0`` beside ``+0.0``, neighbours at ``T !=
  1``) counted. **Reads: 2 for bf16 / fp16 logits, 4 fp32, 8 fp64** (pass A included),
  whatever the data; with the soft cap one more, which sums ``{z >= tau_k}`` (its
  ``tanh`` is not exactly monotone on a GPU). A row whose 64 largest values already
  settle the k-th (ties at the 64th) takes pass A alone.
* **Top-p without top-k, or after top-k > 64**: if the row's 64 largest values (and
  the ties at the 64th) already hold ``p`` of the mass (a peaked row), the cut is read off
  the registers: still one pass. Otherwise a bracket ``[lo, hi)`` on the value holding the
  answer is narrowed by **search passes**: each streams the row once and, for ``N_CAND =
  16`` candidate thresholds in the bracket, sums the count and the mass of the values at or
  above each (a 16-wide comparison per logit); the bracket becomes the candidate interval
  holding the answer. Candidates are spread evenly over the values while the bracket spans
  more than an octave or crosses 0 (the first passes, at most 3), else evenly over the
  floats' order-preserving integer keys (their bits), which shrinks the key range 16-fold a
  pass: at most 3 + 8 = 11 search passes in fp32 (3 + 19 in fp64) whatever the data. A
  bracket of 17 - 128 keys takes half its candidates evenly and half at consecutive keys
  around the cut estimated from its masses (``_toward_estimate``): two passes close it
  either way, one where the estimate holds (a flat bf16 row at p = 0.9: 3 reads, not 4). For
  bf16 / fp16 logits without the soft cap the keys are the LOGITS' own 16 bits
  (``_input_candidates``: each candidate the ``z`` of a logit value; ``z = x / T`` is
  non-decreasing in ``x``), at most 3 + 4 passes: a bf16 value near the cut often holds
  more than 64 tied logits, and on fp32 keys the bracket closed on it one 16-fold step at
  a time. It stops when the bracket holds at most 64 values (then one **collect pass**
  gathers them into registers as pass A does, and the answer is read off exactly) or a
  single value (a tie group at the boundary: no collect pass). For top-p the bracket starts at
  ``[max(tau_k, m + log((1 - p) F / V) - 1), v_64)`` (below its ``lo`` lies less than ``1 -
  p`` of the mass).

Bytes per row (``E`` bytes per logit, ``V`` the vocabulary), forward:

* no truncation; top-k <= 64 with or without top-p; top-p alone when the 64 largest hold
  ``p``: ONE read, ``V E`` (as ``token_logprobs``), plus the target
  logit and 16-20 bytes written (``logp``, ``tau``, ``m``, ``log F``, the pass count);
* top-p otherwise: ``(1 + s + c) V E`` with ``s`` search passes and ``c <= 1`` collect pass.
  Measured here (CPU interpreter, same arithmetic): Gaussian logits, ``p`` in 0.9 - 0.99,
  ``V`` = 32768 and 151936: 5-6 reads in fp32, 3-4 in bf16 (3 at p = 0.9, deviation 2);
  at most 13 in any case;
* top-k > 64: ``B / 8`` reads of a ``B``-bit row (2 bf16 / fp16, 4 fp32, 8 fp64; one more
  with the soft cap), then top-p on top of it as above.
  Measured here (CPU interpreter), Gaussian rows at ``V`` = 151936: ``k`` = 200 and 1000, 2
  reads in bf16, 4 in fp32; ``k`` = 5000 with ``p`` = 0.95, 8 in bf16, 7 in fp32.

A search pass is compute-heavier than pass A (16 compares, adds and multiply-adds per
logit: ~1.7 sm_90 instructions a logit per warp, ``_bracket_sums``; a step reads 16
contiguous bytes a thread, so a one-warp row keeps 1 KiB of bf16 in flight); the search and
its bracket bounds are in ``_search``. A radix pass is light (a key, a digit and a
shared-memory histogram increment per logit). ``passes_ptr`` records each row's reads
(``tests/test_truncated.py`` checks them).

Backward (``_truncated_logprobs_bwd_kernel``): ONE pass, reads the row, writes
``dL/dx = (onehot_y - p) g / T`` on ``{z >= tau}`` (``p = exp((z - m) - log F)``) and 0
elsewhere, from the three saved floats per row: ``V E`` read + ``V E`` written per row;
rows with a zero coefficient (ignored, target cut, ``g == 0``) write zeros without reading.
A row with a NaN / ``+inf`` logit, or all ``-inf``, gives a NaN ``logp`` and a NaN gradient
row.
"""

import triton
import triton.language as tl

from ..common import (
    cast_for,
    exp,
    nan_max,
    pair,
    row_pointer,
    tanh_and_sech2,
    target_column,
    token_offset,
    widen,
)
from .layer1 import scaled_logits, target_logp
from .select import BINS, DIGIT_BITS, _digit_histogram, _is_nan, _value
from .select import _key as _bits_key

KS = tl.constexpr(64)  # register slots: fused_rl.truncated.MAX_STREAMED_K


@triton.jit
def _key(z, ACC: tl.constexpr):
    """Order-preserving int64 key of a float (non-NaN): ``a < b`` iff ``key(a) < key(b)``
    (``-0.0`` just below ``+0.0``); fp32 bits sign-extended, fp64 bits as they are."""
    if ACC == tl.float64:
        b = z.to(tl.int64, bitcast=True)
        return b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF)
    else:
        b = z.to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _unkey(key, ACC: tl.constexpr):
    """The float of a key (:func:`_key`'s inverse)."""
    if ACC == tl.float64:
        b = key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)
        return b.to(tl.float64, bitcast=True)
    else:
        k = key.to(tl.int32)
        b = k ^ ((k >> 31) & 0x7FFFFFFF)
        return b.to(tl.float32, bitcast=True)


@triton.jit
def _absorb(zs, top, thr, eqcnt, kk, BLOCK: tl.constexpr):
    """Merge one block ``zs`` (``-inf`` where not a candidate) into the running set ``top``
    of the ``kk`` largest values seen (unordered, in slots ``< kk``; ``-inf`` in the others
    and in slots not filled yet), ``thr`` = the smallest held (the ``kk``-th largest seen),
    ``eqcnt`` = how many values seen equal ``thr`` (held or not). Returns them and how many
    of the block's groups hold a NaN (0 iff the block has none): such a group's values are
    not held in the first round (the row's result is NaN whatever is held).

    The block is viewed as ``KS`` groups of ``BLOCK / KS``; each round takes the groups'
    maxima, inserts those above ``thr`` largest first (each replaces the smallest held value,
    O(KS)), strikes them from their groups and takes the next maxima; it ends when no
    group holds a value above ``thr``. Every value above the returned ``thr`` is held."""
    G: tl.constexpr = BLOCK // KS
    slot = tl.arange(0, KS)
    live = slot < kk
    lane = tl.arange(0, G)
    top_old = top
    thr_old = thr
    work = tl.reshape(zs, (KS, G))
    # the groups' maxima, NaN where one holds a NaN: the block's NaN test for the price of
    # its maxima, where a compare and a count a value cost two more instructions
    gm = tl.reduce(work, 1, nan_max)
    nan_groups = tl.sum((gm != gm).to(tl.int32), 0)
    gm = tl.where(gm == gm, gm, float("-inf"))
    block_max = tl.max(gm, 0)
    round_max = block_max
    while round_max > thr:  # each round strikes >= 1 value: terminates
        cand = gm
        struck = slot < 0
        best = tl.max(cand, 0)
        while best > thr:  # insert the round's maxima, largest first
            group = tl.min(tl.where(cand == best, slot, KS), 0)
            held = tl.min(tl.where(live & (top == thr), slot, KS), 0)
            top = tl.where(slot == held, best, top)
            thr = tl.min(tl.where(live, top, float("inf")), 0)
            cand = tl.where(slot == group, float("-inf"), cand)
            struck = struck | (slot == group)
            best = tl.max(cand, 0)
        # strike each inserted maximum from its group (its first lane, should it repeat)
        first = tl.min(tl.where(work == gm[:, None], lane[None, :], G), 1)
        work = tl.where(struck[:, None] & (lane[None, :] == first[:, None]), float("-inf"), work)
        gm = tl.max(work, 1)
        round_max = tl.max(gm, 0)
    # values equal to the new thr: a larger thr than before was held whole; an unchanged
    # one carries its count; plus this block's own, counted only where its maximum reaches
    # thr (once the set is full, a block rarely does)
    held = tl.sum((live & (top_old == thr)).to(tl.int32), 0)
    ties = tl.zeros((), tl.int32)
    if block_max >= thr:
        ties = tl.sum((zs == thr).to(tl.int32), 0)
    eqcnt = tl.where(thr == thr_old, eqcnt, held) + ties
    return top, thr, eqcnt, nan_groups


@triton.jit
def _pass_a(
    row_ptr, n_read, stride_v, inv_t, inv_cap, kk, NEED_SUM: tl.constexpr,
    COLLECT: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr, HIST: tl.constexpr = False,
):  # fmt: skip
    """Pass A over the row's first ``n_read`` logits: ``(m, s, n_nan, top, thr, eqcnt,
    hist)``: the online max and ``sum exp(z - m)`` (``NEED_SUM``), ``n_nan`` (0 iff the row
    has no NaN: with ``COLLECT`` the count of :func:`_absorb`'s groups holding one, else of
    the NaNs), (``COLLECT``) the ``kk`` largest values held as :func:`_absorb` holds them,
    and (``HIST``) the first pass of :func:`_kth_by_digits`: the histogram of the top digit
    of the logits' keys. A NaN makes the row NaN; it is never held and left out of
    ``hist``; ``s`` is NaN then."""
    KEY: tl.constexpr = tl.core.get_int_dtype(row_ptr.dtype.element_ty.primitive_bitwidth, False)
    TOP_SHIFT: tl.constexpr = KEY.primitive_bitwidth - DIGIT_BITS
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    n_nan = tl.zeros((), tl.int32)
    top = tl.full((KS,), float("-inf"), ACC)
    thr = tl.full((), float("-inf"), ACC)
    eqcnt = tl.zeros((), tl.int32)
    hist = tl.zeros((BINS,), tl.int32)
    for start in range(0, n_read, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read,
                    other=float("-inf"))  # fmt: skip
        z = scaled_logits(widen(x, ACC), inv_t, inv_cap, HAS_SOFTCAP)
        if HAS_SOFTCAP:  # the cap maps the -inf padding to -c / T: back to -inf
            z = tl.where(cols < n_read, z, float("-inf"))
        if not COLLECT:  # else counted by _absorb (its groups holding a NaN)
            n_nan += tl.sum((z != z).to(tl.int32), 0)
        if NEED_SUM:
            m_new = nan_max(m, tl.max(z, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * exp(m - m_ref) + tl.sum(exp(z - m_ref), 0)
            m = m_new
        if COLLECT:
            top, thr, eqcnt, nan_groups = _absorb(z, top, thr, eqcnt, kk, BLOCK_V)
            n_nan += nan_groups
        if HIST:
            digit = (_bits_key(x, KEY) >> TOP_SHIFT).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=(cols < n_read) & (z == z))
    return m, s, n_nan, top, thr, eqcnt, hist


@triton.jit
def _ties_not_held(top, thr, eqcnt, kk):
    """How many values equal to ``thr`` (the ``kk``-th largest) pass A saw but holds no slot
    for: they are kept with ``thr`` and counted."""
    slot = tl.arange(0, KS)
    ties = tl.sum(((top == thr) & (slot < kk)).to(tl.int32), 0)
    return tl.where(eqcnt > ties, eqcnt - ties, 0)


@triton.jit
def _cut_in_registers(top, e, thr, tie_mass, kk, goal):
    """Top-p on held values: the largest held ``v`` with ``F(v) >= goal``, ``F(v)`` = mass
    of the held values ``>= v`` (``e = exp(top - m)``) plus ``tie_mass`` (values equal to
    ``thr`` not held) when ``v <= thr``. Returns ``(found, v, F(v))``."""
    slot = tl.arange(0, KS)
    live = slot < kk
    at_or_above = (top[None, :] >= top[:, None]) & live[None, :]
    mass = tl.sum(tl.where(at_or_above, e[None, :], 0.0), 1)
    mass += tl.where(top <= thr, tie_mass, 0.0)
    ok = live & (mass >= goal)
    found = tl.sum(ok.to(tl.int32), 0) > 0
    v = tl.max(tl.where(ok, top, float("-inf")), 0)
    f_v = tl.sum(tl.where(live & (top >= v), e, 0.0), 0) + tl.where(v <= thr, tie_mass, 0.0)
    return found, v, f_v


@triton.jit
def _by_value(lo, hi, passes, VALUE_PASSES: tl.constexpr):
    """Whether search pass ``passes`` spreads its candidates evenly over the values: while
    the bracket spans more than an octave or crosses 0 (the first ``VALUE_PASSES`` passes
    at most), where candidates even over the keys would sit on tiny magnitudes."""
    narrow = (lo > 0.0) & (hi <= 2.0 * lo) | (hi <= 0.0) & (lo >= 2.0 * hi)
    return (narrow == 0) & (passes < VALUE_PASSES) & (hi - lo < float("inf"))


@triton.jit
def _mass_fraction(f_lo, f_hi, goal):
    """Where the cut lies in the bracket by its masses (``f_lo`` / ``f_hi`` at or above its
    ends, ``goal`` between): ``(goal - f_hi) / (f_lo - f_hi)``, the fraction of the
    bracket's mass above the cut; NaN before a pass has summed ``f_lo`` (``f_lo == f_hi``)."""
    known = f_lo > f_hi
    return tl.where(known, (goal - f_hi) / tl.where(known, f_lo - f_hi, 1.0), float("nan"))


@triton.jit
def _toward_estimate(ck, k_lo, k_hi, frac, N_CAND: tl.constexpr):
    """Keys ``ck`` spread evenly over a bracket of keys ``[k_lo, k_hi)``, or where that holds
    ``N_CAND < R <= N_CAND^2 / 2`` keys and ``frac`` (:func:`_mass_fraction`) is known: half
    of them evenly over it, which leaves a bracket of at most ``ceil(R / (N_CAND / 2)) <=
    N_CAND`` keys that the next pass resolves (as the even step's ``ceil(R / N_CAND)``
    would: two passes from any such bracket either way), the other half at consecutive keys
    around ``k_est = k_hi - ceil(R frac)`` (from three below to four above, moved inside the
    bracket at its ends), the cut were the mass spread evenly over the keys: where the cut
    is among them this pass resolves it. The mass of a row's values varies slowly over
    a few dozen keys (bf16 logits at the cut of a flat row: ~60 keys to a bracket after the
    first pass), so the estimate is within a key or two there. Within the bracket, the
    smallest ``k_lo``; not sorted (:func:`_narrow` takes them in any order)."""
    j = tl.arange(0, N_CAND)
    HALF: tl.constexpr = N_CAND // 2
    # fp64 keys: a bracket over most of the line overflows int64, to a negative r: not usable
    r = k_hi - k_lo
    usable = (r > N_CAND) & (r <= HALF * N_CAND) & (frac >= 0.0) & (frac <= 1.0)  # NaN: not
    above = tl.math.ceil(tl.where(usable, frac, 0.0) * r.to(tl.float32)).to(r.dtype)
    first = (k_hi - above) - 3  # the window [first, first + HALF) inside (k_lo, k_hi)
    first = tl.where(first > k_lo + 1, first, k_lo + 1)
    first = tl.where(first < k_hi - HALF, first, k_hi - HALF)
    step = (r + HALF - 1) // HALF
    mixed = tl.where(j < HALF, k_lo + step * j, first + (j - HALF))
    return tl.where(usable, mixed, ck)


@triton.jit
def _candidates(
    lo, hi, passes, frac, N_CAND: tl.constexpr, ACC: tl.constexpr,
    VALUE_PASSES: tl.constexpr = 3,
):  # fmt: skip
    """``N_CAND`` thresholds in ``[lo, hi)`` for search pass ``passes`` (0-based), the
    smallest ``lo``: evenly spaced over the floats' keys (the key range shrinks 16-fold a
    pass; near the end clustered toward the cut's estimate from the bracket's masses
    ``frac``, :func:`_toward_estimate`), or over the values while the bracket spans more
    than an octave or crosses 0 (the first ``VALUE_PASSES`` passes at most), where even keys
    would sit on tiny magnitudes."""
    j = tl.arange(0, N_CAND)
    k_lo = _key(lo, ACC)
    k_hi = _key(hi, ACC)
    if ACC == tl.float64:  # halves: no int64 overflow; the range shrinks to R / 16 + 2
        half_range = (k_hi >> 1) - (k_lo >> 1)
        step = (half_range + N_CAND // 2 - 1) // (N_CAND // 2)
    else:  # fp32 keys in int64: exact, the range shrinks to ceil(R / 16)
        step = (k_hi - k_lo + N_CAND - 1) // N_CAND
    step = tl.where(step < 1, 1, step)
    ck = _toward_estimate(k_lo + step * j.to(tl.int64), k_lo, k_hi, frac, N_CAND)
    vk = _key(lo + (hi - lo) * (j.to(ACC) * (1.0 / N_CAND)), ACC)
    ck = tl.where(_by_value(lo, hi, passes, VALUE_PASSES), vk, ck)
    ck = tl.where(ck < k_hi, ck, k_hi - 1)  # the smallest lo; all < hi
    return _unkey(ck, ACC)


@triton.jit
def _column_sums(cnt, mass, z, e, cand, DEPTH: tl.constexpr):
    """Add ``DEPTH`` values a column (``z``, ``e``: ``(SEARCH_BLOCK, 2, ..., 2)``, one 2 a
    halving of ``DEPTH``, all in one thread's registers) one at a time to each candidate's
    per-column count and mass: per value a compare giving 1.0 / 0.0, an add of it to the
    count, a multiply-add of it with the mass -- three instructions a (logit, candidate)
    pair."""
    if DEPTH == 1:
        ge = (z[None, :] >= cand[:, None]).to(tl.float32)
        return cnt + ge, mass + ge.to(mass.dtype) * e[None, :]
    else:
        z0, z1 = tl.split(z)
        e0, e1 = tl.split(e)
        cnt, mass = _column_sums(cnt, mass, z0, e0, cand, DEPTH // 2)
        return _column_sums(cnt, mass, z1, e1, cand, DEPTH // 2)


@triton.jit
def _bracket_sums(
    row_ptr, n_read, stride_v, inv_t, inv_cap, m, cand, N_CAND: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One search pass over the row's first ``n_read`` logits: per candidate, the count and
    the mass ``exp(z - m)`` of the row's values at or above it (a 16-wide comparison per
    logit; every value, not those of the bracket alone: a test of the bracket's bounds
    was two compares, an and and two selects a value, 8 % of the pass).

    The pass is compute-bound (16 candidates a logit), so its inner step is three
    instructions a (logit, candidate) pair (:func:`_column_sums`). Counts and masses
    accumulate per (candidate, column) cell, reduced across the columns once at the end: a
    reduction per step costs cross-lane shuffles for 32 sums (sm_90 SASS of the step,
    2026-11-29: 2.2 instructions a logit at 64 columns, against 6.5 with a reduction per
    step at 128). A step reads 16 contiguous bytes a column (8 bf16 / fp16 logits, 4 fp32,
    2 fp64: one vector load a thread, split into single values in registers), so a
    one-warp row has that many times the bytes in flight as with one logit a column (128
    bytes a step of bf16 left the row waiting on memory, not on its arithmetic) and the
    step's own work is shared by as many logits. A cell's count is an integer below
    ``2**24`` (exact in fp32)."""
    DEPTH: tl.constexpr = 128 // row_ptr.dtype.element_ty.primitive_bitwidth
    STEP: tl.constexpr = SEARCH_BLOCK * DEPTH
    cnt = tl.zeros((N_CAND, SEARCH_BLOCK), tl.float32)
    mass = tl.zeros((N_CAND, SEARCH_BLOCK), ACC)
    tile = tl.reshape(tl.arange(0, STEP), (SEARCH_BLOCK, DEPTH))  # a column's values in a row
    for start in range(0, n_read, STEP):
        cols = start + tile
        # past n_read: -inf, at or above no candidate, of mass 0 (the cap would map it to
        # -c / T: put back). A searched row holds no NaN and no +inf (pass A).
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read,
                    other=float("-inf"))  # fmt: skip
        z = scaled_logits(widen(x, ACC), inv_t, inv_cap, HAS_SOFTCAP)
        if HAS_SOFTCAP:
            z = tl.where(cols < n_read, z, float("-inf"))
        e = exp(z - m)
        cnt, mass = _column_sums(
            cnt, mass, _halved(z, SEARCH_BLOCK, DEPTH), _halved(e, SEARCH_BLOCK, DEPTH), cand,
            DEPTH,
        )  # fmt: skip
    return tl.sum(cnt.to(tl.int32), 1).to(tl.int64), tl.sum(mass, 1)


@triton.jit
def _halved(x, SEARCH_BLOCK: tl.constexpr, DEPTH: tl.constexpr):
    """``(SEARCH_BLOCK, DEPTH)`` as ``(SEARCH_BLOCK, 2, ..., 2)`` for :func:`_column_sums`."""
    if DEPTH == 8:
        return tl.reshape(x, (SEARCH_BLOCK, 2, 2, 2))
    elif DEPTH == 4:
        return tl.reshape(x, (SEARCH_BLOCK, 2, 2))
    else:
        tl.static_assert(DEPTH == 2)
        return x


@triton.jit
def _narrow(cand, cnt, mass, hi, c_hi, f_hi, goal, ACC: tl.constexpr):
    """The bracket after a search pass (``cnt`` / ``mass``: the count / mass of the row's
    values at or above each candidate, :func:`_bracket_sums`): ``[lo, hi)`` becomes the
    candidate interval that holds the answer (the largest candidate whose mass meets
    ``goal``, or ``lo``, the smallest, up to the next larger candidate, or ``hi`` with its
    ``c_hi`` / ``f_hi``). The candidates in any order (a repeated one has repeated sums),
    ordered by their keys (:func:`_key`: ``-0.0`` below ``+0.0``, which compare equal, so a
    bracket closes on a zero's one key). Returns ``(lo, hi, c_hi, f_hi, f_lo, n_in)``: the
    new bounds, the count / mass at or above each (``f_lo`` the mass at or above ``lo``) and
    the count of values inside."""
    kc = _key(cand, ACC)
    k_min = tl.min(kc, 0)  # lo's key
    meets = (mass >= goal) | (kc == k_min)
    k_lo = tl.max(tl.where(meets, kc, k_min), 0)
    new_lo = _unkey(k_lo, ACC)
    k_hi = tl.min(tl.where(kc > k_lo, kc, _key(hi, ACC)), 0)
    new_hi = _unkey(k_hi, ACC)
    f_lo = tl.max(tl.where(kc == k_lo, mass, 0.0), 0)
    c_lo = tl.max(tl.where(kc == k_lo, cnt, 0), 0)
    at_hi = tl.max((kc == k_hi).to(tl.int32), 0) > 0  # not when new_hi == hi
    c_hi = tl.where(at_hi, tl.max(tl.where(kc == k_hi, cnt, 0), 0), c_hi)
    f_hi = tl.where(at_hi, tl.max(tl.where(kc == k_hi, mass, 0.0), 0), f_hi)
    return new_lo, new_hi, c_hi, f_hi, f_lo, c_lo - c_hi


@triton.jit
def _collect(
    row_ptr, n_read, stride_v, inv_t, inv_cap, lo, hi, BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The collect pass: the (at most ``KS``) values of the row's first ``n_read`` logits in
    ``[lo, hi)``, in ``KS`` register slots (``-inf`` in the others)."""
    top = tl.full((KS,), float("-inf"), ACC)
    thr = tl.full((), float("-inf"), ACC)
    eqcnt = tl.zeros((), tl.int32)
    for start in range(0, n_read, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read, other=0.0)
        z = scaled_logits(x.to(ACC), inv_t, inv_cap, HAS_SOFTCAP)
        inside = (cols < n_read) & (z >= lo) & (z < hi)
        top, thr, eqcnt, _ = _absorb(tl.where(inside, z, float("-inf")), top, thr, eqcnt, KS,
                                     BLOCK_V)  # fmt: skip
    return top


@triton.jit
def _input_key_at_or_above(v, inv_t, KEY: tl.constexpr, DTYPE: tl.constexpr, ACC: tl.constexpr):
    """The key of the smallest ``DTYPE`` logit ``x`` with ``x * inv_t >= v`` (``z = x / T``,
    non-decreasing in ``x``): ``v / inv_t`` rounded to ``DTYPE``, then one step up or down
    (its two roundings put it within one value of the answer)."""
    k = _bits_key((v / inv_t).to(DTYPE), KEY)
    k = tl.where(_value(k, KEY, DTYPE, ACC, True) * inv_t < v, k + 1, k)
    return tl.where(_value(k - 1, KEY, DTYPE, ACC, True) * inv_t >= v, k - 1, k)


@triton.jit
def _input_candidates(
    lo, hi, passes, frac, inv_t, N_CAND: tl.constexpr, KEY: tl.constexpr,
    DTYPE: tl.constexpr, ACC: tl.constexpr, VALUE_PASSES: tl.constexpr = 3,
):  # fmt: skip
    """``N_CAND`` thresholds in ``[lo, hi)`` for search pass ``passes`` of a
    16-bit row: evenly over the values as :func:`_candidates` while the bracket is wide
    (``_by_value``), else the ``z`` of logit values spread evenly over the keys between the
    smallest logits scaling to ``lo`` and to ``hi`` (the key range shrinks 16-fold a pass:
    <= 4 such passes from any bracket; near the end clustered toward the cut's estimate,
    :func:`_toward_estimate`). The first partitions the row as ``lo`` does (no logit scales
    into between)."""
    k_lo = _input_key_at_or_above(lo, inv_t, KEY, DTYPE, ACC).to(tl.int32)
    k_hi = _input_key_at_or_above(hi, inv_t, KEY, DTYPE, ACC).to(tl.int32)
    j = tl.arange(0, N_CAND)
    step = (k_hi - k_lo + N_CAND - 1) // N_CAND
    step = tl.where(step < 1, 1, step)
    ck = _toward_estimate(k_lo + step * j, k_lo, k_hi, frac, N_CAND)
    ck = tl.where(ck < k_hi, ck, k_hi - 1)
    ck = tl.where(ck > k_lo, ck, k_lo)  # the smallest: lo's own partition
    keyed = _value(ck.to(KEY), KEY, DTYPE, ACC, True) * inv_t
    spread = lo + (hi - lo) * (j.to(ACC) * (1.0 / N_CAND))
    return tl.where(_by_value(lo, hi, passes, VALUE_PASSES), spread, keyed)


@triton.jit
def _search_candidates(
    lo, hi, passes, frac, inv_t, N_CAND: tl.constexpr, DTYPE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The candidates of search pass ``passes`` on ``DTYPE`` logits (``frac``: the bracket's
    :func:`_mass_fraction`): for 16-bit logits without the soft cap the images of logit
    values spread evenly over their 16-bit keys (:func:`_input_candidates`: a bf16 value
    near the cut holds many tied logits, and on fp32 keys the bracket would close on it one
    16-fold step at a time), else :func:`_candidates`."""
    if (DTYPE.primitive_bitwidth <= 16) and (not HAS_SOFTCAP):
        KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
        return _input_candidates(lo, hi, passes, frac, inv_t, N_CAND, KEY, DTYPE, ACC)
    return _candidates(lo, hi, passes, frac, N_CAND, ACC)


@triton.jit
def _one_value_left(lo, hi, inv_t, DTYPE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    ACC: tl.constexpr):  # fmt: skip
    """Whether at most one value of the row can lie in ``[lo, hi)``: on the logits' own
    16-bit keys where :func:`_search_candidates` uses them (at most one logit value scales
    into it), else on the keys of ``z``."""
    if (DTYPE.primitive_bitwidth <= 16) and (not HAS_SOFTCAP):
        KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
        k_hi = _input_key_at_or_above(hi, inv_t, KEY, DTYPE, ACC).to(tl.int32)
        return (k_hi - _input_key_at_or_above(lo, inv_t, KEY, DTYPE, ACC).to(tl.int32)) <= 1
    return (_key(hi, ACC) - _key(lo, ACC)) <= 1


@triton.jit
def _search(
    row_ptr, V, stride_v, inv_t, inv_cap, m, lo, hi, c_hi, f_hi, goal, enabled,
    N_CAND: tl.constexpr, SEARCH_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
    MAX_SEARCH_PASSES: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The top-p cut: the largest row value ``v`` in ``[lo, hi)`` with ``F(v) >= goal``,
    ``F`` the mass ``exp(z - m)`` of the row values ``>= v``, given ``c_hi`` / ``f_hi`` =
    count / mass of the values ``>= hi`` (``F(hi) < goal <= F(lo)``).

    Returns ``(v, F(v), passes)``: search passes narrow the bracket on the values' keys,
    then one collect pass (<= 64 values left) or none (one value left)."""
    DTYPE: tl.constexpr = row_ptr.dtype.element_ty
    f_lo = f_hi
    n_in = c_hi * 0
    passes = n_in.to(tl.int32)
    done = enabled == 0
    single = done
    while done == 0:
        frac = _mass_fraction(f_lo, f_hi, goal)
        cand = _search_candidates(lo, hi, passes, frac, inv_t, N_CAND, DTYPE, HAS_SOFTCAP, ACC)
        cnt, mass = _bracket_sums(
            row_ptr, V, stride_v, inv_t, inv_cap, m, cand, N_CAND, SEARCH_BLOCK, HAS_SOFTCAP,
            ACC,
        )  # fmt: skip
        passes += 1
        lo, hi, c_hi, f_hi, f_lo, n_in = _narrow(cand, cnt, mass, hi, c_hi, f_hi, goal, ACC)
        single = _one_value_left(lo, hi, inv_t, DTYPE, HAS_SOFTCAP, ACC)
        done = single | (n_in <= KS) | (passes >= MAX_SEARCH_PASSES)
    # <= 64 values left in [lo, hi): gather them and read the answer off
    collect = (enabled != 0) & (single == 0)
    top = _collect(row_ptr, tl.where(collect, V, 0), stride_v, inv_t, inv_cap, lo, hi, BLOCK_V,
                   HAS_SOFTCAP, ACC)  # fmt: skip
    passes += collect.to(tl.int32)
    held = top > float("-inf")
    e = exp(top - m)
    at_or_above = (top[None, :] >= top[:, None]) & held[None, :]
    meets = (f_hi + tl.sum(tl.where(at_or_above, e[None, :], 0.0), 1)) >= goal
    ok = tl.where(collect, held & meets, False)
    found = tl.sum(ok.to(tl.int32), 0) > 0
    v = tl.max(tl.where(ok, top, float("-inf")), 0)
    f_v = f_hi + tl.sum(tl.where(held & (top >= v), e, 0.0), 0)
    # not found: one value left (or rounding): lo, whose mass f_lo was summed
    return tl.where(found, v, lo), tl.where(found, f_v, f_lo), passes


@triton.jit
def _last_digit(
    row_ptr, n_read, stride_v, prefix, z_low, m, inv_t, inv_cap, KEY: tl.constexpr,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The last pass of :func:`_kth_by_digits`: the histogram of the lowest digit of the
    keys whose digits above it equal ``prefix``; without the soft cap also the mass ``exp(z
    - m)`` of the values whose key is above that prefix (all kept, whatever the last digit)
    and the count of the values below it whose ``z`` equals ``z_low``, the ``z`` of the
    prefix's smallest key (kept with the k-th where that is the k-th's ``z``); with it
    (the mass summed by a pass of its own) those two are 0."""
    hist = tl.zeros((BINS,), tl.int32)
    above = tl.zeros((), ACC)
    n_low = tl.zeros((), tl.int32)
    for start in range(0, n_read, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read, other=0.0)
        key = _bits_key(x, KEY)
        counted = (cols < n_read) & (_is_nan(x, KEY) == 0)
        high = key >> DIGIT_BITS
        digit = (key & (BINS - 1)).to(tl.int32)
        hist += tl.histogram(digit, BINS, mask=counted & (high == prefix))
        if not HAS_SOFTCAP:
            z = scaled_logits(x.to(ACC), inv_t, inv_cap, HAS_SOFTCAP)
            above += tl.sum(tl.where(counted & (high > prefix), exp(z - m), 0.0), 0)
            n_low += tl.sum((counted & (high < prefix) & (z == z_low)).to(tl.int32), 0)
    return hist, above, n_low


@triton.jit
def _mass_at_or_above(
    row_ptr, n_read, stride_v, tau, m, inv_t, inv_cap, BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """``sum exp(z - m)`` over the row's values with ``z >= tau`` (one pass)."""
    mass = tl.zeros((), ACC)
    for start in range(0, n_read, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read, other=0.0)
        z = scaled_logits(x.to(ACC), inv_t, inv_cap, HAS_SOFTCAP)
        mass += tl.sum(tl.where((cols < n_read) & (z >= tau), exp(z - m), 0.0), 0)
    return mass


@triton.jit
def _kth_by_digits(
    row_ptr, n_read, stride_v, hist, k, m, inv_t, inv_cap, BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Top-k for ``k > 64``: ``(tau_k, F(tau_k), passes)``, the k-th largest ``z`` of the
    row (ties with their multiplicity) and the mass ``exp(z - m)`` of ``{z >= tau_k}``, by
    radix select on the LOGITS' own bits (``kernels/vocab/select.py``: 8-bit digits, most
    significant first; ``hist``, the first digit's histogram, comes from pass A). ``z = x /
    T`` is a non-decreasing function of ``x`` (one correctly rounded product), so the k-th
    largest ``z`` is the image of the k-th largest ``x``: ``B / 8 - 1`` passes after pass A
    for ``B``-bit logits (1 for bf16 / fp16, 3 fp32, 7 fp64). The last pass also gives
    ``F``: the mass of the values above the chosen prefix, summed; those sharing it hold
    one value per last digit (the histogram's count times that value's ``exp(z - m)``);
    and the smaller logits whose ``z`` the scaling rounds onto ``tau_k`` (signed zeros,
    neighbours at ``T != 1``), kept with it, counted. With the soft cap, whose ``tanh`` is
    not exactly monotone on a GPU (approximate ``exp``), ``F`` is summed over ``{z >=
    tau_k}`` by one more pass instead, so that it always holds the kept set.
    ``n_read = 0``: no pass, ``passes`` 0."""
    DTYPE: tl.constexpr = row_ptr.dtype.element_ty
    BITS: tl.constexpr = DTYPE.primitive_bitwidth
    KEY: tl.constexpr = tl.core.get_int_dtype(BITS, False)
    N_DIGITS: tl.constexpr = BITS // DIGIT_BITS
    bins = tl.arange(0, BINS)
    run = (n_read > 0).to(tl.int32)
    need = k  # values of the current prefix still to pass over, the k-th included
    prefix = tl.zeros((), KEY)
    above = tl.zeros((), ACC)
    n_low = tl.zeros((), tl.int32)
    z_low = tl.zeros((), ACC)
    digit = tl.zeros((), tl.int32)
    for p in tl.static_range(N_DIGITS):
        if p == N_DIGITS - 1:
            z_low = _z_of_key(prefix << DIGIT_BITS, inv_t, inv_cap, DTYPE, HAS_SOFTCAP, ACC)
            hist, above, n_low = _last_digit(
                row_ptr, n_read, stride_v, prefix, z_low, m, inv_t, inv_cap, KEY, BLOCK_V,
                HAS_SOFTCAP, ACC,
            )  # fmt: skip
        elif p > 0:
            hist, _ = _digit_histogram(
                row_ptr, n_read, stride_v, prefix, BITS - DIGIT_BITS * (p + 1), False, KEY,
                BLOCK_V,
            )  # fmt: skip
        at_or_above = tl.cumsum(hist, 0, reverse=True)  # per bin: that bin and every bin above
        digit = tl.max(tl.where(at_or_above >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins == digit, at_or_above - hist, 0), 0)
        if p < N_DIGITS - 1:
            prefix = (prefix << DIGIT_BITS) | digit.to(KEY)
    key_k = (prefix << DIGIT_BITS) | digit.to(KEY)
    tau = _z_of_key(key_k, inv_t, inv_cap, DTYPE, HAS_SOFTCAP, ACC)
    if HAS_SOFTCAP:
        mass = _mass_at_or_above(row_ptr, n_read, stride_v, tau, m, inv_t, inv_cap, BLOCK_V,
                                 HAS_SOFTCAP, ACC)  # fmt: skip
        return tau, mass, run * N_DIGITS
    mass = _kept_mass(key_k, tau, hist, above, n_low, m, inv_t, inv_cap, DTYPE, ACC)
    return tau, mass, run * (N_DIGITS - 1)


@triton.jit
def _z_of_key(key, inv_t, inv_cap, DTYPE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              ACC: tl.constexpr):  # fmt: skip
    """The ``z`` of the ``DTYPE`` logit whose order-preserving key is ``key``, converted as
    the streamed logits are (``tau`` and their ``z`` compare on one conversion)."""
    KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
    return scaled_logits(_value(key, KEY, DTYPE, ACC, True), inv_t, inv_cap, HAS_SOFTCAP)


@triton.jit
def _kept_mass(key_k, tau, hist, above, n_low, m, inv_t, inv_cap, DTYPE: tl.constexpr,
               ACC: tl.constexpr):  # fmt: skip
    """The radix select's kept mass without the soft cap, from its last pass
    (:func:`_last_digit`'s ``hist``, ``above``, ``n_low``, int or float): ``sum exp(z - m)``
    over ``{z >= tau}``, ``tau`` the ``z`` of the k-th largest logit (key ``key_k``). The
    values above the k-th's prefix are summed in ``above``; those sharing it hold one value
    per last digit (kept at or above the k-th's digit, or where the scaling rounds it onto
    ``tau``); ``n_low`` values below the prefix share the ``z`` of its smallest key, kept
    where that is ``tau``."""
    KEY: tl.constexpr = tl.core.get_int_dtype(DTYPE.primitive_bitwidth, False)
    bins = tl.arange(0, BINS)
    prefix = key_k >> DIGIT_BITS
    digit = (key_k & (BINS - 1)).to(tl.int32)
    same = (prefix << DIGIT_BITS) | bins.to(KEY)
    z_bin = _z_of_key(same, inv_t, inv_cap, DTYPE, False, ACC)
    kept = ((bins >= digit) | (z_bin == tau)) & (hist > 0)
    e_bin = tl.where(kept, exp(z_bin - m), 0.0)
    z_low = _z_of_key(prefix << DIGIT_BITS, inv_t, inv_cap, DTYPE, False, ACC)
    merged_low = tl.where(z_low == tau, n_low.to(ACC) * exp(tau - m), 0.0)
    return above + tl.sum(hist.to(ACC) * e_bin, 0) + merged_low


@triton.jit(
    do_not_specialize=[
        "rows_inner", "ignore_index", "t_stride_outer", "t_stride_inner", "top_k",
    ]
)  # fmt: skip
def _truncated_logprobs_fwd_kernel(
    logits_ptr,
    targets_ptr,
    logp_ptr,
    stats_ptr,
    passes_ptr,
    rows_inner,
    n_rows,
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
    p_hi,
    p_lo,
    log1mp_hi,
    log1mp_lo,
    top_k,
    ignore_index,
    TOPK_REG: tl.constexpr,
    SEARCH_K: tl.constexpr,
    TOP_P: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    N_CAND: tl.constexpr,
    MAX_SEARCH_PASSES: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row of ``(outer, rows_inner, V)`` logits: ``logp`` (contiguous), the
    row's ``(tau, m, log F)`` in ``stats`` ``(3, n_rows)`` and its passes over the row.
    ``TOPK_REG``: top-k with ``k <= 64`` (``k < V``); ``SEARCH_K``: top-k with ``64 < k < V``;
    ``TOP_P``: top-p with ``p < 1`` (``p``, ``log(1 - p)`` as fp32 pairs). ``HAS_SOFTCAP``:
    ``z = c tanh(x / c) / T`` (``inv_t`` carries ``c / T``, ``inv_cap`` ``1 / c``;
    ``kernels/vocab/layer1.py`` ``scaled_logits``)."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    target = tl.load(targets_ptr + token_offset(row, rows_inner, t_stride_outer, t_stride_inner))
    target = target.to(tl.int64)
    active = target != ignore_index
    COLLECT: tl.constexpr = TOPK_REG or SEARCH_K or TOP_P
    NEED_SUM: tl.constexpr = not (TOPK_REG or SEARCH_K)
    if TOPK_REG:
        kk = top_k
    else:
        kk = top_k * 0 + KS

    m, s, n_nan, top, thr, eqcnt, hist = _pass_a(
        row_ptr, tl.where(active, V, 0), stride_v, inv_t, inv_cap, kk, NEED_SUM, COLLECT, BLOCK_V,
        HAS_SOFTCAP, ACC, SEARCH_K,
    )  # fmt: skip
    passes = active.to(tl.int32)
    if not NEED_SUM:
        m = tl.max(top, 0)
    ok = active & (n_nan == 0) & (tl.abs(m) < float("inf"))
    m_safe = tl.where(ok, m, 0.0)

    # ---- the kept set: threshold tau, mass f = sum_{z >= tau} exp(z - m)
    tau = tl.full((), float("-inf"), ACC)
    f = s
    if COLLECT:
        slot = tl.arange(0, KS)
        e = exp(top - m_safe)
        extra = _ties_not_held(top, thr, eqcnt, kk)
        tie_mass = extra.to(ACC) * exp(thr - m_safe)
        f_held = tl.sum(tl.where(slot < kk, e, 0.0), 0) + tie_mass  # mass of {z >= thr}
        if TOPK_REG:
            tau = thr
            f = f_held
        if SEARCH_K:
            # count of {z >= thr}: the 64 held and the ties left out (thr = -inf: every value)
            resolved = (thr == float("-inf")) | (extra + KS >= top_k)
            tau_k, f_k, n_pass = _kth_by_digits(
                row_ptr, tl.where(ok & (resolved == 0), V, 0), stride_v, hist, top_k, m_safe,
                inv_t, inv_cap, BLOCK_V, HAS_SOFTCAP, ACC,
            )  # fmt: skip
            tau = tl.where(resolved, thr, tau_k)
            f = tl.where(resolved, f_held, f_k)
            passes += n_pass
        if TOP_P:
            goal = pair(p_hi, p_lo, ACC) * f
            found, v, f_v = _cut_in_registers(top, e, thr, tie_mass, kk, goal)
            if TOPK_REG:  # the k largest are all held: always found but for rounding
                tau = tl.where(found, v, tau)
                f = tl.where(found, f_v, f)
            else:
                # below lo lies less than (1 - p) of the mass: V exp(lo - m) <= (1 - p) f
                log1mp = pair(log1mp_hi, log1mp_lo, ACC)
                bound = m_safe + log1mp + tl.log(f) - tl.log(tl.zeros((), ACC) + V) - 1.0
                lo = nan_max(tau, tl.where(bound < thr, bound, tau))
                v_s, f_s, n_pass = _search(
                    row_ptr, V, stride_v, inv_t, inv_cap, m_safe, lo, thr,
                    (extra + KS).to(tl.int64), f_held, goal, ok & (found == 0), N_CAND,
                    SEARCH_BLOCK, BLOCK_V, MAX_SEARCH_PASSES, HAS_SOFTCAP, ACC,
                )  # fmt: skip
                tau = tl.where(found, v, v_s)
                f = tl.where(found, f_v, f_s)
                passes += n_pass
    log_f = tl.log(f)
    tau = tl.where(ok, tau, float("nan"))
    m = tl.where(ok, m, float("nan"))
    log_f = tl.where(ok, log_f, float("nan"))

    # ---- the target
    in_range = (target >= 0) & (target < V)
    safe = tl.where(in_range, target, 0)
    x_y = tl.load(row_ptr + safe * stride_v, mask=active & in_range, other=0.0)
    z_y = scaled_logits(x_y.to(ACC), inv_t, inv_cap, HAS_SOFTCAP)
    logp = tl.where(z_y >= tau, target_logp(z_y, m, log_f), float("-inf"))
    logp = tl.where(ok, logp, float("nan"))
    logp = tl.where(in_range, logp, float("nan"))
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    tl.store(stats_ptr + row, tl.where(active, tau, 0.0))
    tl.store(stats_ptr + (row + n_rows), tl.where(active, m, 0.0))
    tl.store(stats_ptr + (row + n_rows + n_rows), tl.where(active, log_f, 0.0))  # no i32 product
    tl.store(passes_ptr + row, passes)


@triton.jit(
    do_not_specialize=[
        "rows_inner", "ignore_index", "t_stride_outer", "t_stride_inner", "g_stride_outer",
        "g_stride_inner",
    ]
)  # fmt: skip
def _truncated_logprobs_bwd_kernel(
    logits_ptr,
    targets_ptr,
    stats_ptr,
    g_ptr,
    grad_ptr,
    rows_inner,
    n_rows,
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
    inv_t_hi,
    inv_t_lo,
    inv_cap_hi,
    inv_cap_lo,
    ignore_index,
    HAS_SOFTCAP: tl.constexpr,
    TARGET_KEPT: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row: ``grad = (onehot_y - p) g / T`` on ``{z >= tau}``, 0 elsewhere,
    ``p = exp((z - m) - log F)`` from the forward's ``stats``; a NaN row (NaN ``log F``)
    gets NaN; a zero coefficient (ignored, target cut or out of range, ``g == 0``) writes
    zeros and reads nothing. ``HAS_SOFTCAP`` (``inv_t = c / T``, ``inv_cap = 1 / c``): each
    column's term is times ``dz/dx = (1 - tanh^2(x / c)) / T``. ``TARGET_KEPT``: ``g`` is 0
    where the target is cut, and a target outside ``[0, V)`` lives on another rank (the
    vocabulary-parallel backward): the row is live wherever ``g`` is not 0."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    grad_row = row_pointer(grad_ptr, row, rows_inner, 0, grad_stride_outer, grad_stride_inner)
    target = tl.load(targets_ptr + token_offset(row, rows_inner, t_stride_outer, t_stride_inner))
    target = target.to(tl.int64)
    g = tl.load(g_ptr + token_offset(row, rows_inner, g_stride_outer, g_stride_inner)).to(ACC)
    tau = tl.load(stats_ptr + row).to(ACC)
    m = tl.load(stats_ptr + (row + n_rows)).to(ACC)
    log_f = tl.load(stats_ptr + (row + n_rows + n_rows)).to(ACC)  # int64: no i32 product
    active = target != ignore_index
    in_range = (target >= 0) & (target < V)
    bad = active & (log_f != log_f)
    if TARGET_KEPT:
        coef = tl.where(active & (bad == 0), g * inv_t, 0.0)
    else:
        safe = tl.where(in_range, target, 0)
        x_y = tl.load(row_ptr + safe * stride_v, mask=active & in_range & (bad == 0), other=0.0)
        kept_y = scaled_logits(x_y.to(ACC), inv_t, inv_cap, HAS_SOFTCAP) >= tau
        coef = tl.where(active & in_range & kept_y & (bad == 0), g * inv_t, 0.0)
    if HAS_SOFTCAP:
        coef = coef * inv_cap  # g / T; each column then times sech^2(x / c)
    n_read = tl.where(coef != 0.0, V, 0)  # a NaN g reads too; a bound, so loads vectorise
    column = target_column(target, V)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        live = cols < n_read
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=live, other=0.0)
        if HAS_SOFTCAP:
            t, sech2 = tanh_and_sech2(x.to(ACC) * inv_cap)
            z = t * inv_t
        else:
            z = x.to(ACC) * inv_t
        p = exp((z - m) - log_f)
        onehot = tl.where(cols == column, 1.0, 0.0)
        grad = (onehot - p) * coef
        if HAS_SOFTCAP:
            grad = grad * sech2
        grad = tl.where(live & (z >= tau), grad, 0.0)
        grad = tl.where(bad, float("nan"), grad)
        tl.store(grad_row + cols, cast_for(grad, grad_ptr), mask=valid)
