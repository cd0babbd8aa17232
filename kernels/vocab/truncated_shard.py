"""Vocabulary-parallel truncated log-probs: the kernels each rank runs on its own shard
(``fused_rl.truncated_parallel`` merges their outputs across the ranks).

``_shard_partials_kernel`` (one read of each shard row, as pass A of
``kernels/vocab/truncated.py``): per row, the shard's ``kk`` largest tempered logits in
``KS = 64`` slots (unordered, ``-inf`` where empty), the count of values tied at the
``kk``-th that hold no slot, and the shard's max, ``sum exp(z - max)`` (``NEED_SUM``), NaN
count, minimum (``NEED_MIN``) and target logit (when it owns the target): one ``PART`` row of
``KS + 8`` floats (the sum / minimum fields 0 / ``+inf`` without their flags). The union
of every rank's slots holds, with multiplicity, every value of the row at or above the
largest of the ranks' ``kk``-th values, so top-k with ``k <= 64`` and most top-p cuts are
read off the gathered slots.

``_shard_search_kernel`` runs the threshold search of ``kernels/vocab/truncated.py``
``_search`` one pass per launch on a bracket every rank holds alike: a launch first narrows
the bracket with the previous pass's counts and masses summed over the ranks (``NARROW``),
then streams the shard for the next pass's 16 candidates (``STREAM``), or gathers the (at
most 64) values left in the bracket (``COLLECT``). The bracket arithmetic is
``_candidates`` / ``_narrow`` / ``_bracket_sums`` / ``_collect``, shared with the
single-device kernel, so both search the same candidates.

Bytes per row (``E`` bytes per logit, ``V_r`` the shard's width): the partials read ``V_r E``
once; each search pass reads ``V_r E`` (a row whose search is over reads nothing), the
collect pass the same.
"""

import triton
import triton.language as tl

from ..common import pair, row_pointer, token_offset
from .layer1 import scaled_logits
from .truncated import (
    KS,
    _bracket_sums,
    _candidates,
    _collect,
    _key,
    _narrow,
    _pass_a,
    _ties_not_held,
)

# the PART row after the KS slots, and the search state row: fields by offset (constexpr for
# the kernels; fused_rl.truncated_parallel reads ``.value``)
P_EXTRA, P_THR, P_MAX, P_SUM, P_NAN, P_MIN, P_Y, P_OWN = (tl.constexpr(i) for i in range(8))
PART_EXTRA = tl.constexpr(8)
S_LO, S_HI, S_CHI, S_FHI, S_FLO, S_GOAL, S_M, S_PASSES, S_DONE, S_SINGLE, S_ON = (
    tl.constexpr(i) for i in range(11)
)
STATE = tl.constexpr(11)


@triton.jit(do_not_specialize=["rows_inner", "t_stride_outer", "t_stride_inner", "kk"])
def _shard_partials_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
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
    NEED_MIN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row of ``(outer, rows_inner, V)`` shard logits (``V`` the valid
    columns) with local targets (``ignore_index``: read nothing; outside ``[0, V)``: owned by
    another rank): its ``PART`` row of ``part`` ``(n_rows, KS + 8)``."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = pair(inv_t_hi, inv_t_lo, ACC)
    inv_cap = pair(inv_cap_hi, inv_cap_lo, ACC)
    row_ptr = row_pointer(logits_ptr, row, rows_inner, 0, stride_outer, stride_inner)
    target = tl.load(targets_ptr + token_offset(row, rows_inner, t_stride_outer, t_stride_inner))
    target = target.to(tl.int64)
    active = target != ignore_index
    m, s, z_min, n_nan, top, thr, eqcnt, _ = _pass_a(
        row_ptr, tl.where(active, V, 0), stride_v, inv_t, inv_cap, kk, NEED_SUM, NEED_MIN, True,
        BLOCK_V, HAS_SOFTCAP, ACC,
    )  # fmt: skip
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
    tl.store(out + KS + P_MIN, z_min)
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
    BY_COUNT: tl.constexpr,
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
    st = state_ptr + row * STATE
    lo = tl.load(st + S_LO)
    hi = tl.load(st + S_HI)
    c_hi = tl.load(st + S_CHI)
    f_hi = tl.load(st + S_FHI)
    m = tl.load(st + S_M)
    passes = tl.load(st + S_PASSES).to(tl.int32)
    done = tl.load(st + S_DONE) != 0.0
    j = tl.arange(0, N_CAND)
    sums = sums_ptr + row * (2 * N_CAND)
    if NARROW:  # the pass the ranks just summed: the same new bracket on every rank
        goal = tl.load(st + S_GOAL)
        cand = _candidates(lo, hi, passes - 1, N_CAND, ACC)
        cnt = tl.load(sums + j).to(tl.int64)
        mass = tl.load(sums + N_CAND + j)
        if BY_COUNT:
            n_lo, n_hi, n_chi, n_fhi, n_flo, n_in = _narrow(
                cand, cnt, mass, hi, c_hi.to(tl.int64), f_hi, goal.to(tl.int64), True, N_CAND
            )
        else:
            n_lo, n_hi, n_chi, n_fhi, n_flo, n_in = _narrow(
                cand, cnt, mass, hi, c_hi.to(tl.int64), f_hi, goal, False, N_CAND
            )
        lo = tl.where(done, lo, n_lo)
        hi = tl.where(done, hi, n_hi)
        c_hi = tl.where(done, c_hi, n_chi.to(ACC))
        f_hi = tl.where(done, f_hi, n_fhi)
        single = (_key(hi, ACC) - _key(lo, ACC)) <= 1
        tl.store(st + S_FLO, n_flo, mask=done == 0)  # a row done already keeps its own
        tl.store(st + S_SINGLE, single.to(ACC), mask=done == 0)
        done = done | single | (n_in <= KS) | (passes >= MAX_SEARCH_PASSES)
        tl.store(st + S_LO, lo)
        tl.store(st + S_HI, hi)
        tl.store(st + S_CHI, c_hi)
        tl.store(st + S_FHI, f_hi)
        tl.store(st + S_DONE, done.to(ACC))
    if STREAM:
        cand = _candidates(lo, hi, passes, N_CAND, ACC)
        cnt, mass = _bracket_sums(
            row_ptr, tl.where(done, 0, V), stride_v, inv_t, inv_cap, m, lo, hi, cand, N_CAND,
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
