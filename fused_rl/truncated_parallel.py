"""Vocabulary-parallel truncated log-probs: ``truncated_logprobs(..., process_group=)``.

Each rank holds a slice of the vocabulary (the layouts of ``fused_rl.distributed``); the
kept set of top-k / top-p is a property of the whole row, so the ranks agree on its
threshold ``tau`` and normaliser ``F`` first, then each computes its own columns.

Forward (``kernels/vocab/truncated_shard.py``):

1. one ``MAX`` all-reduce of the layout header (``fused_rl.distributed``'s checks: shards
   that do not tile ``[0, V)``, a target outside it, raise on every rank before any other
   collective);
2. the partials kernel reads each shard row once: its ``kk`` largest values (``kk = k`` for
   top-k ``<= 64``, else 64) with the count of ties at the ``kk``-th, and its max, sum,
   NaN test (0 iff the shard row has none) and the owned target's logit; one
   **all-gather** of ``kk + 7`` floats a token per rank (fp64 logits: 8 bytes a float); for
   top-k > 64 also the histogram of its logits' top key digit (the radix select's first
   pass);
3. every rank merges the gathered rows alike (:func:`_union_cut`, float64): the union of
   the ranks' slots holds every value at or above ``L``, the largest of the ranks' ``kk``-th
   values, so top-k ``<= 64`` (with or without top-p) and any cut at or above ``L`` is read
   off it -- one read of each shard row in all;
4. otherwise, top-k > 64: the k-th largest by the radix select of the single-device kernel
   on the logits' bits (:func:`_kth_by_digits`), its digit histograms **all-reduced** (258
   floats a token a pass, ``B / 8`` passes for ``B``-bit logits: 2 for bf16, 4 fp32, 8
   fp64), each pass after the first one read of the shard; the last pass also sums the
   kept mass (with the soft cap one more read and an all-reduce of one float a token);
   skipped when no row needs it (a host read);
5. top-p on a flat row (alone or after top-k): the threshold search of the single-device
   kernel runs one pass per launch on a bracket ``[lo, L)`` every rank holds alike: each
   pass streams the shard for 16 candidates' counts and masses and **all-reduces** them
   (``2 x 16`` floats a token; bf16 / fp16 logits without the soft cap on their own 16-bit
   keys, at most 3 + 4 passes; ``fused_rl._truncated_ops.max_search_passes`` at most;
   skipped when no row needs it and stopped once every row's search is over, a host read
   each, with the layout checked), then one collect pass gathers the at most 64 values left
   in the bracket (**all-gather**, 64 floats a token per rank).

Every branch that decides a collective depends on the call's options and the gathered
(merged) values only, so every rank runs the same collectives; ``top_k >= V`` is turned off
from the checked header (:func:`agreed_cut`). The route is two custom ops
(``fused_rl::sharded_truncated_fwd`` / ``_bwd``), opaque to ``torch.compile``: its host
reads and collectives run inside them, so ``fullgraph=True`` holds.

On the Triton backend the backward needs no collective: each rank's gradient is
``(onehot - p) g dz/dx`` on its kept columns from the merged ``(tau, m, log F)``
(``kernels/vocab/truncated.py``'s backward kernel, the target's kept flag given). The
``reference`` backend gathers the whole rows and runs ``fused_rl.reference.truncated`` (an
oracle, not a memory saving), its backward the header's all-reduce and the gather again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as V
from . import distributed as D
from ._launch import COMPILE_OPTIONS, stats_dtype, triton_acc
from ._ops import FusedOp, _serialised_when_interpreting
from ._select_ops import BINS, DIGIT_BITS, choose_digit
from ._shapes import as_rows3d
from ._truncated_ops import (
    MAX_STREAMED_K,
    N_CAND,
    NUM_WARPS,
    _block,
    max_search_passes,
    scale_args,
    search_block,
    truncated_bwd_into,
)
from .reference import truncated as ref

KS = MAX_STREAMED_K


def _shard_kernels():
    from .kernels.vocab import truncated_shard as k

    return k


# ----------------------------------------------------------------------------- the merge

# rows of the union handled at once: its float64 temporaries stay near 16 MiB each
UNION_ELEMENTS = 1 << 21


def _row_blocks(n: int, width: int):
    step = max(1, UNION_ELEMENTS // max(1, width))
    return (slice(i, min(i + step, n)) for i in range(0, n, step))


def _union_cut(vals, weights, m, goal, by_count: bool, base_c=None, base_f=None):
    """On rows of values ``vals`` ``(N, M)`` (``-inf``: no entry) with multiplicities
    ``weights``: the largest value ``v`` whose ``G(v)`` -- ``base_c`` plus the count, or
    ``base_f`` plus the mass ``sum w exp(u - m)``, of the entries ``>= v`` -- reaches
    ``goal`` (``(N,)`` each; float64, a block of rows at a time). Returns ``(found, v,
    mass)``: ``mass = G`` by mass at ``v`` (where none is found: ``v = -inf`` and the mass
    of every entry)."""
    n = vals.shape[0]
    found = torch.empty((n,), dtype=torch.bool, device=vals.device)
    v_out = torch.empty((n,), dtype=torch.float64, device=vals.device)
    f_out = torch.empty_like(v_out)
    for rows in _row_blocks(n, vals.shape[1]):
        a, order = vals[rows].double().sort(dim=-1)
        w = torch.where(a > -math.inf, weights[rows].double().gather(-1, order), 0.0)
        e = torch.where(w > 0, w * torch.exp(a - m[rows, None]), 0.0)
        at_c = w.flip(-1).cumsum(-1).flip(-1)  # the entries at or after each position
        at_f = e.flip(-1).cumsum(-1).flip(-1)
        if base_c is not None:
            at_c, at_f = at_c + base_c[rows, None], at_f + base_f[rows, None]
        first = torch.searchsorted(a, a)  # where each value's tie group starts
        ok = (w > 0) & ((at_c if by_count else at_f).gather(-1, first) >= goal[rows, None])
        found[rows] = ok.any(-1)
        v = torch.where(ok, a, -math.inf).amax(-1)
        at = torch.searchsorted(a, v[:, None]).clamp(max=a.shape[-1] - 1)
        v_out[rows] = v
        f_out[rows] = torch.where(found[rows], at_f.gather(-1, at)[:, 0], at_f[:, 0])
    return found, v_out, f_out


def _at_or_above(vals, weights, m, bound):
    """``(count, mass)`` of the entries ``>= bound`` per row, float64."""
    n = vals.shape[0]
    count = torch.empty((n,), dtype=torch.float64, device=vals.device)
    mass = torch.empty_like(count)
    for rows in _row_blocks(n, vals.shape[1]):
        x = vals[rows].double()
        w = torch.where((x >= bound[rows, None]) & (x > -math.inf), weights[rows].double(), 0.0)
        count[rows] = w.sum(-1)
        mass[rows] = torch.where(w > 0, w * torch.exp(x - m[rows, None]), 0.0).sum(-1)
    return count, mass


def _all_gather(t: Tensor, shard) -> Tensor:
    """``(P, *t.shape)``: every rank's ``t`` (same shape on every rank), in rank order."""
    dist = D._dist()
    parts = [torch.empty_like(t) for _ in range(shard.world)]
    dist.all_gather(parts, t.contiguous(), group=shard.group)
    return torch.stack(parts)


def _search(x3d: Tensor, spec, on, lo, hi, c_hi, f_hi, goal, m):
    """The vocabulary-parallel threshold search on ``x3d`` (this rank's valid columns): one
    kernel launch and one all-reduce a pass, then a collect pass and its all-gather.
    Returns ``(v, F(v))`` float64 per row: for the rows ``on``, the largest row value in
    ``[lo, hi)`` whose mass ``exp(z - m)`` at or above it reaches ``goal`` (the top-p cut),
    given ``c_hi`` / ``f_hi``, the count / mass of the values ``>= hi``."""
    acc = stats_dtype(x3d.dtype)
    if V.host_sync_allowed(on) and not bool(on.any()):
        return lo, f_hi  # no row to search (every rank alike: on is merged): no collective
    k = _shard_kernels()
    n = on.numel()
    state = torch.zeros((n, k.STATE.value), dtype=acc, device=on.device)
    for field, value in ((k.S_LO, lo), (k.S_HI, hi), (k.S_CHI, c_hi), (k.S_FHI, f_hi),
                         (k.S_FLO, f_hi), (k.S_GOAL, goal), (k.S_M, m),
                         (k.S_DONE, ~on), (k.S_ON, on)):  # fmt: skip
        state[:, field.value] = value.to(acc)
    sums = torch.zeros((n, 2 * N_CAND), dtype=acc, device=on.device)
    top = torch.empty((n, KS), dtype=acc, device=on.device)

    def launch(narrow: bool, stream: bool, collect: bool) -> None:
        _search_step(x3d, state, sums, top, spec, narrow, stream, collect)

    dist = D._dist()
    group = spec.shard.group
    launch(narrow=False, stream=True, collect=False)
    # stop early once every row is done: a host read a pass, only where the layout is
    # checked (an unchecked bad layout may leave the ranks' states apart: all passes)
    early = spec.check and V.host_sync_allowed(on)
    for _ in range(max_search_passes(x3d.dtype, spec.softcap)):
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        launch(narrow=True, stream=True, collect=False)
        if early and bool((state[:, k.S_DONE.value] != 0).all()):
            break  # every rank alike: each holds the same state
    launch(narrow=False, stream=False, collect=True)
    vals = _all_gather(top, spec.shard).permute(1, 0, 2).reshape(n, spec.shard.world * KS)
    s = state.double()
    field = lambda f: s[:, f.value]  # noqa: E731
    found, v, f_v = _union_cut(
        vals, torch.ones_like(vals), field(k.S_M), field(k.S_GOAL), False,
        field(k.S_CHI), field(k.S_FHI),
    )  # fmt: skip
    found = found & on & (field(k.S_SINGLE) == 0)
    # not found: one value left (or rounding): lo, whose mass f_lo was summed
    return torch.where(found, v, field(k.S_LO)), torch.where(found, f_v, field(k.S_FLO))


@_serialised_when_interpreting
def _search_step(x, state, sums, top, spec, narrow, stream, collect):
    """One launch of the search kernel (``kernels/vocab/truncated_shard.py``)."""
    k = _shard_kernels()
    outer, inner, vocab = x.shape
    if outer * inner == 0:
        return
    k._shard_search_kernel[(outer * inner,)](
        x, state, sums, top, inner, vocab, *x.stride(),
        *scale_args(spec.temperature, spec.softcap), NARROW=narrow,
        STREAM=stream, COLLECT=collect, N_CAND=N_CAND,
        SEARCH_BLOCK=search_block(x.dtype, spec.softcap), BLOCK_V=_block(vocab),
        MAX_SEARCH_PASSES=max_search_passes(x.dtype, spec.softcap),
        HAS_SOFTCAP=spec.softcap is not None, ACC=triton_acc(x.dtype), num_warps=NUM_WARPS,
        **COMPILE_OPTIONS,
    )  # fmt: skip


@_serialised_when_interpreting
def _partials(x3d: Tensor, t_local: Tensor, spec, kk: int, need_sum: bool, hist: bool):
    """The partials kernel (``kernels/vocab/truncated_shard.py``): ``(n_rows, KS + 7)`` rows
    and, ``hist`` (top-k > 64), the radix select's first histograms ``(n_rows, 256)`` int32
    (else None)."""
    k = _shard_kernels()
    outer, inner, vocab = x3d.shape
    part = torch.empty((outer * inner, KS + k.PART_EXTRA.value), dtype=stats_dtype(x3d.dtype),
                       device=x3d.device)  # fmt: skip
    counts = x3d.new_empty((outer * inner, BINS), dtype=torch.int32) if hist else None
    if outer * inner:
        k._shard_partials_kernel[(outer * inner,)](
            x3d, t_local, part, part if counts is None else counts, inner, vocab, *x3d.stride(),
            *t_local.stride(), *scale_args(spec.temperature, spec.softcap), kk, D.LOCAL_IGNORE,
            NEED_SUM=need_sum, HIST=hist, HAS_SOFTCAP=spec.softcap is not None,
            BLOCK_V=_block(vocab), ACC=triton_acc(x3d.dtype), num_warps=NUM_WARPS,
            **COMPILE_OPTIONS,
        )  # fmt: skip
    return part, counts


@_serialised_when_interpreting
def _digit_pass(x3d: Tensor, on: Tensor, prefix: Tensor, m: Tensor, spec, shift: int,
                last: bool) -> Tensor:  # fmt: skip
    """A later radix-select pass on the rows ``on`` (``m``: the global max, in the
    statistics dtype): ``(n_rows, 258)`` in the statistics dtype, this rank's histograms
    (and, ``last``, mass above the prefix and count rounded onto it;
    ``kernels/vocab/truncated_shard.py`` ``_shard_digit_kernel``)."""
    k = _shard_kernels()
    outer, inner, vocab = x3d.shape
    acc = stats_dtype(x3d.dtype)
    buf = torch.empty((outer * inner, BINS + 2), dtype=acc, device=x3d.device)
    if outer * inner:
        k._shard_digit_kernel[(outer * inner,)](
            x3d, on, prefix, m, buf, inner, vocab, *x3d.stride(),
            *scale_args(spec.temperature, spec.softcap), shift, LAST=last,
            HAS_SOFTCAP=spec.softcap is not None, BLOCK_V=_block(vocab),
            ACC=triton_acc(x3d.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    return buf


@_serialised_when_interpreting
def _kth_end(x3d: Tensor, on: Tensor, key: Tensor, m: Tensor, buf: Tensor, spec) -> Tensor:
    """``(2, n_rows)``: ``tau`` and the kept mass from the k-th largest's ``key`` (``m`` as
    :func:`_digit_pass` takes it; ``_shard_kth_kernel``: with the soft cap this rank's
    share of the mass, one read)."""
    k = _shard_kernels()
    outer, inner, vocab = x3d.shape
    acc = stats_dtype(x3d.dtype)
    out = torch.empty((2, outer * inner), dtype=acc, device=x3d.device)
    if outer * inner:
        k._shard_kth_kernel[(outer * inner,)](
            x3d, on, key, m, buf, out, inner, vocab, *x3d.stride(),
            *scale_args(spec.temperature, spec.softcap), HAS_SOFTCAP=spec.softcap is not None,
            BLOCK_V=_block(vocab), ACC=triton_acc(x3d.dtype), num_warps=NUM_WARPS,
            **COMPILE_OPTIONS,
        )  # fmt: skip
    return out


def _kth_by_digits(x3d: Tensor, spec, on: Tensor, hist: Tensor, k: int, m: Tensor):
    """Top-k for ``k > 64`` on the rows ``on``: ``(tau, F)`` float64 per row (other rows:
    whatever), the k-th largest ``z`` of the whole row and the mass ``exp(z - m)`` of ``{z
    >= tau}``, by the radix select of ``kernels/vocab/truncated.py`` on the logits' bits:
    the first digit's histograms ``hist`` from the partials, then ``B / 8 - 1`` passes of
    one launch and one all-reduce each (summed over the ranks: 258 floats a token, the
    256 counts, then the last pass's mass above the prefix and count rounded onto it), the
    digit chosen on every rank alike (``_select_ops.choose_digit``), then the end (no read;
    with the soft cap one read and an all-reduce of its mass).
    Skipped, with no collective, when no row needs it (a host read where allowed)."""
    n = on.numel()
    if V.host_sync_allowed(on) and not bool(on.any()):
        return torch.full((n,), -math.inf, dtype=torch.float64, device=on.device), m * 0
    dist = D._dist()
    group = spec.shard.group
    bits = torch.finfo(x3d.dtype).bits
    on8 = on.to(torch.int8)
    m_acc = m.to(stats_dtype(x3d.dtype))
    dist.all_reduce(hist, group=group)
    # k beyond the row (top_k >= V where no header was read to turn it off): its smallest
    # value is the k-th, everything kept
    need = torch.minimum(torch.full((n,), k, device=on.device), hist.sum(-1, dtype=torch.int64))
    prefix = torch.zeros_like(need)
    buf = hist
    for p in range(1, bits // DIGIT_BITS):
        need, prefix = choose_digit(hist, need, prefix)
        buf = _digit_pass(x3d, on8, prefix, m_acc, spec, bits - DIGIT_BITS * (p + 1),
                          p == bits // DIGIT_BITS - 1)  # fmt: skip
        dist.all_reduce(buf, group=group)
        hist = buf[:, :BINS]
    _, key = choose_digit(hist, need, prefix)
    tau, mass = _kth_end(x3d, on8, key, m_acc, buf, spec)
    if spec.softcap is not None:
        dist.all_reduce(mass, group=group)
    return tau.double(), mass.double()


def _threshold(x3d, t_local, spec, top_k: int, top_p: float, vocab: int):
    """The merged ``(tau, m, F, z_y, owners, bad)`` per row, float64, on every rank alike:
    the partials, their all-gather, the union cuts and (where they do not decide) the radix
    select (top-k > 64) and the search (top-p). ``top_k``: 0 none; ``top_p``: 1.0 none;
    ``vocab``: the global vocabulary (the top-p bracket's bound). Every branch that decides
    a collective depends on the call's options and the gathered values only, the same on
    every rank."""
    k = _shard_kernels()
    shard = spec.shard
    kk = top_k if 0 < top_k <= KS else KS
    part, hist = _partials(x3d, t_local, spec, kk, top_k == 0, top_k > KS)  # need sum, hist
    send = torch.cat((part[:, :kk], part[:, KS:]), 1)
    g = _all_gather(send, shard)  # (P, n, kk + 7)
    n = g.shape[1]
    field = lambda f: g[..., kk + f.value].double()  # noqa: E731  (P, n)
    thr, m_r = field(k.P_THR), field(k.P_MAX)
    m = m_r.amax(0)
    bad = (field(k.P_NAN).sum(0) > 0) | ~torch.isfinite(m)
    m = torch.where(bad, 0.0, m)
    # the union: every rank's slots, and its ties at the kk-th value that hold none
    slots = g[..., :kk].permute(1, 0, 2).reshape(n, shard.world * kk)
    thr_acc = g[..., kk + k.P_THR.value]
    vals = torch.cat((slots, thr_acc.t()), 1)
    weights = torch.cat((torch.ones((n, shard.world * kk), dtype=g.dtype, device=g.device),
                         g[..., kk + k.P_EXTRA.value].t()), 1)  # fmt: skip
    low = thr.amax(0)  # L: every value >= L is in the union
    on = ~bad  # an ignored row read nothing: its max is -inf, bad
    tau = torch.full_like(m, -math.inf)
    if top_k == 0:
        f = (field(k.P_SUM) * torch.exp(m_r - m)).sum(0)  # an empty shard's m_r = -inf: 0
    else:
        found, v, f = _union_cut(vals, weights, m, torch.full_like(m, top_k), True)
    if 0 < top_k <= KS:  # the union holds every value >= the k-th
        tau = torch.where(found, v, tau)
    elif top_k > KS:
        # L = -inf: every value is in the union (fewer than k: all kept, tau = -inf)
        decided = (found & (v >= low)) | (low == -math.inf)
        v_s, f_s = _kth_by_digits(x3d, spec, on & ~decided, hist, top_k, m)
        tau, f = torch.where(decided, v, v_s), torch.where(decided, f, f_s)
    if top_p < 1.0:
        goal = top_p * f
        kept = vals >= tau[:, None]
        found, v, f_v = _union_cut(torch.where(kept, vals, -math.inf), weights, m, goal, False)
        decided = (found & (v >= low)) | (tau >= low)  # tau >= L: the kept set is all held
        # the single-device kernel's bracket (kernels/vocab/truncated.py, TOP_P): below lo
        # lies less than 1 - p of the mass, V exp(lo - m) <= (1 - p) f
        bound = m + math.log1p(-top_p) + f.log() - math.log(vocab) - 1.0
        lo = torch.maximum(tau, torch.where(bound < low, bound, tau))
        c_l, f_l = _at_or_above(torch.where(kept, vals, -math.inf), weights, m, low)
        searched = on & ~decided
        v_s, f_s = _search(x3d, spec, searched, lo, low, c_l, f_l, goal, m)
        tau = torch.where(searched, v_s, torch.where(found, v, tau))
        f = torch.where(searched, f_s, torch.where(found, f_v, f))
    return tau, m, f, field(k.P_Y).sum(0), field(k.P_OWN).sum(0), bad


# ----------------------------------------------------------------------------- rows


def shard_rows(x3d, t_local, ignored, spec, top_k: int, top_p: float, vocab: int, ok):
    """The forward on this rank's valid columns ``x3d`` ``(outer, inner, V_r)`` with local
    targets: ``(logp, stats, kept)``: ``logp`` ``(outer, inner)`` and ``stats`` ``(3, n)``
    (``tau, m, log F``, the backward kernel's) in the statistics dtype, ``kept`` ``(n,)``
    (the target counts and is kept: where the backward is live). ``top_k`` / ``vocab``
    from :func:`agreed_cut`; ``ok``: None (layout checked) or the unchecked layout's 0-dim
    bool."""
    tau, m, f, z_y, owners, bad = _threshold(x3d, t_local, spec, top_k, top_p, vocab)
    ign = ignored.reshape(-1)
    log_f = f.log()
    kept = (z_y >= tau) & (owners == 1) & ~bad & ~ign
    logp = torch.where(z_y >= tau, (z_y - m) - log_f, -math.inf)
    logp = torch.where(bad | (owners != 1), math.nan, logp)  # a target no rank holds: NaN
    stats = torch.where(bad, math.nan, torch.stack((tau, m, log_f)))
    if ok is not None:  # unchecked layout (no host read): NaN, as fused_rl.distributed
        logp = torch.where(ok, logp, math.nan)
        stats = torch.where(ok, stats, math.nan)
    acc = stats_dtype(x3d.dtype)
    logp = torch.where(ign, 0.0, logp).to(acc).view(t_local.shape)
    return logp, torch.where(ign, 0.0, stats).to(acc), kept


def shard_rows_grad_into(grad, x3d, t_local, stats, kept, grad_logp, spec):
    """This rank's gradient of :func:`shard_rows` into ``grad`` (may be ``x3d``: the logits
    consumed in place), no collective."""
    g = torch.where(kept.view(t_local.shape), grad_logp, 0.0)
    return truncated_bwd_into(
        grad, x3d, t_local, stats, g, spec.temperature, spec.softcap, D.LOCAL_IGNORE, True
    )


def gather_rows(x3d: Tensor, shard, valids) -> Tensor:
    """The whole rows, every rank's valid columns in rank order (the reference's oracle
    path; ``valids`` per rank from the header, :func:`layout`)."""
    mine = x3d.narrow(-1, 0, valids[shard.rank])
    padded = torch.nn.functional.pad(mine, (0, max(valids) - mine.shape[-1]))
    parts = _all_gather(padded, shard)
    return torch.cat([parts[r, ..., : valids[r]] for r in range(shard.world)], -1)


def layout(values: list[float], shard) -> list[int]:
    """Each rank's count of valid columns, from the header values."""
    world = shard.world
    starts = [int(values[2 * r]) for r in range(world)]
    widths = [int(values[2 * r + 1]) for r in range(world)]
    vocab = int(values[2 * world])
    return [max(0, min(w, vocab - s)) for s, w in zip(starts, widths)]


def agreed_cut(values: list[float] | None, shard, top_k: int) -> tuple[int, int]:
    """``(top_k, vocab)`` every rank uses: ``top_k`` as the user gave it (0: none), turned
    off when it reaches the checked header's vocabulary (``values``); unchecked (``values``
    None) it stays as given, so an inconsistent ``vocab_size`` across ranks can never make
    them run different collectives (its result is NaN), and ``vocab`` (the top-p bracket's
    bound) is this rank's."""
    if values is None:
        return top_k, shard.vocab_size
    vocab = int(values[2 * shard.world])
    return (0 if top_k >= vocab else top_k), vocab


# ----------------------------------------------------------------------------- the ops
# The route runs as two custom ops, opaque to ``torch.compile`` (``fullgraph=True`` works):
# its host reads (the checked header, the search's early exit) and collectives run inside
# them at run time. The process group travels by name, the layout as integers.


def spec_of(group_name: str, start: int, columns: int, vocab_size: int, explicit: bool,
            temperature: float, softcap: float | None, ignore_index: int, which: str,
            check: bool, name: str = "logits", with_entropy: bool = False,
            with_extras: bool = False) -> D._Spec:  # fmt: skip
    """The :class:`fused_rl.distributed._Spec` of a custom op's primitive arguments: the
    shard (``columns`` local columns from ``start``, :func:`fused_rl.distributed.shard_of`)
    and the layer options."""
    shard = D.shard_of(group_name, start, columns, vocab_size, explicit, name)
    return D._Spec(shard, temperature, ignore_index, True, with_entropy, which, check, softcap,
                   with_extras)  # fmt: skip


def sharded_truncated_fwd(
    x3d: Tensor,
    t2d: Tensor,
    group_name: str,
    start: int,
    vocab_size: int,
    explicit: bool,
    top_k: int,
    top_p: float,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    which: str,
    check: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward of this rank's ``(outer, inner, V_local)`` shard ``x3d`` and global
    ``(outer, inner)`` targets: ``(logp, stats, kept, t_local)``, ``logp`` in the statistics
    dtype; ``stats`` ``(3, n)``, ``kept`` ``(n,)`` and the local targets for the Triton
    backward (zeros on the reference backend, whose backward recomputes)."""
    spec = spec_of(group_name, start, x3d.shape[-1], vocab_size, explicit, temperature,
                   softcap, ignore_index, which, check)  # fmt: skip
    shard = spec.shard
    acc = stats_dtype(x3d.dtype)
    values, ok = checked_header(t2d, spec, acc, read=which == "reference")
    top_k, vocab = agreed_cut(values if ok is None else None, shard, top_k)
    n = t2d.numel()
    if which == "reference":
        logp = ref.truncated_logprobs(
            gather_rows(x3d, shard, layout(values, shard)), t2d, top_k=top_k or None,
            top_p=top_p, temperature=temperature, ignore_index=ignore_index, softcap=softcap,
        ).to(acc)  # fmt: skip
        logp = logp if ok is None else torch.where(ok, logp, math.nan)
        zeros = torch.zeros((3, n), dtype=acc, device=x3d.device)
        return logp, zeros, zeros[0] != 0, torch.zeros_like(t2d)
    t_local, ignored = D._local_targets(t2d, shard, ignore_index)
    x = x3d.narrow(-1, 0, shard.valid)
    logp, stats, kept = shard_rows(x, t_local, ignored, spec, top_k, top_p, vocab, ok)
    return logp, stats, kept, t_local


def sharded_truncated_bwd(
    x3d: Tensor,
    t2d: Tensor,
    t_local: Tensor,
    stats: Tensor,
    kept: Tensor,
    grad_logp: Tensor,
    group_name: str,
    start: int,
    vocab_size: int,
    explicit: bool,
    top_k: int,
    top_p: float,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    which: str,
    check: bool,
) -> Tensor:
    """This rank's ``(outer, inner, V_local)`` gradient (0 at padding columns): Triton, the
    backward kernel on the shard's valid columns from the forward's ``stats`` / ``kept``, no
    collective; the reference, the forward recomputed through autograd (the rows gathered
    again: the oracle path)."""
    spec = spec_of(group_name, start, x3d.shape[-1], vocab_size, explicit, temperature,
                   softcap, ignore_index, which, check)  # fmt: skip
    shard = spec.shard
    if which == "reference":
        values, _ = checked_header(t2d, spec, stats.dtype, read=True)
        top_k, _ = agreed_cut(values, shard, top_k)
        valids = layout(values, shard)
        _, vjp = torch.func.vjp(  # no autograd inside a custom op: a functorch transform
            lambda full: ref.truncated_logprobs(
                full, t2d, top_k=top_k or None, top_p=top_p, temperature=temperature,
                ignore_index=ignore_index, softcap=softcap,
            ),
            gather_rows(x3d, shard, valids),
        )  # fmt: skip
        (grad_full,) = vjp(grad_logp.to(stats.dtype))
        mine = grad_full.narrow(-1, sum(valids[: shard.rank]), valids[shard.rank])
        return torch.nn.functional.pad(mine, (0, x3d.shape[-1] - mine.shape[-1]))
    valid = shard.valid
    x = x3d.narrow(-1, 0, valid)
    grad = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    shard_rows_grad_into(grad, x, t_local, stats, kept, grad_logp, spec)
    return torch.nn.functional.pad(grad, (0, x3d.shape[-1] - valid))


def _fwd_fake(x3d, t2d, *_args):
    acc = stats_dtype(x3d.dtype)
    n = t2d.numel()
    return (x3d.new_empty(t2d.shape, dtype=acc), x3d.new_empty((3, n), dtype=acc),
            x3d.new_empty((n,), dtype=torch.bool), t2d.new_empty(t2d.shape))  # fmt: skip


def _setup_context(ctx, inputs, output):
    x3d, t2d, *options = inputs
    _, stats, kept, t_local = output
    ctx.save_for_backward(x3d, t2d, t_local, stats, kept)
    ctx.options = options
    ctx.mark_non_differentiable(stats, kept, t_local)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, *_unused):
    if grad_logp is None:
        return (None,) * (len(ctx.needs_input_grad))
    grad = sharded_truncated_bwd_op(*ctx.saved_tensors, grad_logp, *ctx.options)
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


sharded_truncated_bwd_op = FusedOp("sharded_truncated_bwd", sharded_truncated_bwd)
sharded_truncated_bwd_op.register_fake(lambda x3d, *_args: x3d.new_empty(x3d.shape))
sharded_truncated_fwd_op = FusedOp("sharded_truncated_fwd", sharded_truncated_fwd)
sharded_truncated_fwd_op.register_fake(_fwd_fake)
sharded_truncated_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- entry


def checked_header(t2d: Tensor, spec, dtype, *, read: bool = False):
    """The layout header's ``MAX`` all-reduce (``fused_rl.distributed``): ``(values, ok)``.
    Checks on (eager): raises on a bad layout or target on every rank, ``ok`` None. Off:
    ``ok`` a 0-dim bool on device, ``values`` read only if ``read`` (the reference's
    layout), else None."""
    dist = D._dist()
    shard = spec.shard
    dev = t2d.device
    if spec.check:
        tpart = D._target_part(t2d, spec.ignore_index, dtype)
    else:
        tpart = torch.full((2,), -math.inf, dtype=dtype, device=dev)
    buf = torch.cat((D._header(shard, dtype, dev), tpart))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=shard.group)
    if not spec.check:
        return (buf.tolist() if read else None), D._layout_ok(buf, shard)
    values = buf.tolist()  # the call's one host read, as the unsharded target check
    message = D._layout_error(values, shard) or D._target_error(values, shard, spec.ignore_index)
    if message is not None:
        raise ValueError(message)
    return values, None


def sharded_truncated_logprobs(
    logits: Tensor,
    targets: Tensor,
    shard,
    *,
    top_k: int,
    top_p: float,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    which: str,
) -> Tensor:
    """:func:`fused_rl.truncated_logprobs` of this rank's vocabulary shard ``logits`` and
    global ``targets`` (checked locally), ``top_k`` / ``top_p`` as the user gave them (0 /
    1.0: none; ``top_k >= V`` turned off, :func:`agreed_cut`): the unsharded call's values
    on every rank, this rank's columns of its gradient (``sharded_truncated_fwd_op``; under
    ``torch.compile`` one opaque op, no graph break)."""
    D.check_vocab_limit(shard)
    x3d = as_rows3d(logits)
    t2d = targets.reshape(x3d.shape[:2])
    logp, *_ = sharded_truncated_fwd_op(
        x3d, t2d, shard.group.group_name, shard.start, shard.vocab_size, shard.explicit,
        int(top_k), float(top_p), float(temperature), None if softcap is None else float(softcap),
        int(ignore_index), which, V.value_checks_enabled(logits),
    )  # fmt: skip
    return logp.reshape(targets.shape)
