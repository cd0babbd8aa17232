"""Vocabulary-parallel (tensor-parallel) log-probs and entropy on ``torch.distributed``.

With a process group of ``P`` ranks, each rank's ``logits`` hold a contiguous slice of the
vocabulary (the Megatron ``ColumnParallelLinear`` / ``VocabParallelEmbedding`` layout, or a
``DTensor`` placed ``Shard(-1)``); ``targets`` hold global ids and are the same on every
rank. :func:`fused_rl.token_logprobs` and :func:`fused_rl.token_entropy` with
``process_group=`` (or a ``DTensor``) return on every rank the values of the unsharded call,
and each rank's gradient is its shard of the unsharded gradient.

How (CONTRIBUTING.md, "The three layers"): layer 1 runs on the local shard, unchanged, and
yields per-token partial statistics (shard max ``m_r``, ``log s_r``, entropy ``H_r``, and
the target's ``logp`` on the rank that owns the target). They merge like the kernel merges
blocks of one row (``kernels/vocab/layer1.py``, ``merge_stats``), with two all-reduces:

1. ``MAX`` of the row max, ``(N,)`` floats, plus a fixed header of ``2 P + 4`` floats
   (each rank's ``(vocab_start, columns)``, ``vocab_size`` and the target range) that
   every rank reads to check the layout before the second collective;
2. one packed ``SUM`` of ``a_r = s_r exp(m_r - m)``, the owned target's ``z_y - m`` and
   ``a_r (log a_r - H_r)`` (the entropy's numerator relative to the global max).

Bytes per token per rank (fp32 statistics; twice that for fp64 logits): 4 for the max, 4
for ``a``, 4 for the target logit, 4 for the entropy: 16 for ``logp`` and entropy, 12 for
``logp`` alone or entropy alone. The backward needs no collective: every rank holds the
global ``m``, ``log S`` and ``H``, and layer 3 (``token_stats_bwd_op``) runs on its shard
with local target ids (a target owned elsewhere becomes ``-2``, which matches no column;
ignored tokens become the local ``ignore_index`` ``-1``).

:func:`fused_rl.linear_token_logprobs` / :func:`fused_rl.linear_policy_loss` with
``process_group=`` (an lm_head ``weight`` shard, replicated ``hidden``) run layer 1 on each
chunk of local logits and merge the partials of all chunks with one :func:`merge_partials`
(the same two all-reduces); their backward adds one all-reduce of the hidden gradient.

Layout (see :func:`fused_rl.token_logprobs`): by default rank ``r`` of ``P`` holds global ids
``[r V_local, (r + 1) V_local)`` and ``V = P V_local``. ``vocab_size=V`` alone: the same equal
shards with the last rank(s) padded (Megatron pads the vocabulary to a multiple of the
tensor-parallel size); columns at global id ``>= V`` are excluded from the softmax and get a
zero gradient. ``vocab_start=`` with ``vocab_size=``: ragged shards, rank ``r`` holding
``[vocab_start, vocab_start + V_local)``, shards contiguous in rank order from 0 (a rank may
hold none). A ``DTensor`` gives its own layout.

Checks: shards that do not tile ``[0, V)`` or a target outside ``[0, V)`` raise
``ValueError`` naming the argument, on every rank, before the second collective (no rank
is left waiting in a collective). The check reads the header on the host: the one host
sync of an eager call, where the unsharded call syncs once to check the targets. With
``fused_rl.config.check_values = False`` (or while compiling) nothing is read and such
inputs give NaN.

Example (one process; with ``torchrun`` each rank passes its own shard):
    >>> import torch, torch.distributed as dist, fused_rl
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> logits = torch.randn(2, 3, 8, requires_grad=True)  # this rank's (B, T, V_local)
    >>> targets = torch.randint(0, 8, (2, 3))              # global ids, same on every rank
    >>> logp, ent = fused_rl.token_logprobs(
    ...     logits, targets, return_entropy=True, process_group=dist.group.WORLD)
    >>> torch.allclose(logp, fused_rl.token_logprobs(logits, targets), atol=1e-6)
    True
    >>> fused_rl.distributed.global_token_count(targets != -100).item()  # summed over ranks
    6
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from . import _validation as V
from ._launch import stats_dtype
from ._select_ops import kth_largest_by_passes
from ._shapes import as_rows3d
from ._vocab_ops import (
    position_shift,
    scatter_exact_id_grads,
    token_extras_fwd_op,
    token_stats_bwd_op,
    token_stats_fwd_op,
)
from .reference import logprobs as ref
from .reference.truncated import kth_largest as kth_largest_reference

__all__ = ["gather_param", "global_token_count", "VocabShard"]

# local target ids handed to layers 1 and 3: an ignored token, and a target another rank owns
LOCAL_IGNORE = -1
NOT_OWNED = -2
# ids and widths travel in the float header: exact below 2^24 (fp32)
MAX_VOCAB = 1 << 24


def _all_reduce_max(t: Tensor, group) -> Tensor:
    """The elementwise max of ``t`` over ``group``, in a new tensor (``t`` unchanged)."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(t, "max", group))


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("process_group= needs torch.distributed, which this torch lacks")
    return dist


def is_dtensor(x) -> bool:
    """``x`` is a ``torch.distributed.tensor.DTensor`` (without importing that module)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, getattr(mod, "DTensor", ()))


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logits columns sit in the global vocabulary.

    ``start``: global id of local column 0; ``columns``: local width ``V_local``; ``valid``:
    the leading columns that are real ids (``< vocab_size``; the rest is padding);
    ``explicit``: ``vocab_start`` was given (ragged shards allowed)."""

    group: object
    rank: int
    world: int
    start: int
    columns: int
    vocab_size: int
    explicit: bool
    name: str = "logits"  # the sharded argument, for messages ("weight" for the linear ops)

    @property
    def valid(self) -> int:
        return max(0, min(self.columns, self.vocab_size - self.start))

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1


def _check_int(value, name: str, minimum: int) -> None:
    V.check_positive_int(value, name, allow_none=True, minimum=minimum)


def resolve_shard(
    logits: Tensor,
    targets: Tensor | None,
    process_group,
    vocab_start: int | None,
    vocab_size: int | None,
) -> tuple[Tensor, Tensor | None, VocabShard | None]:
    """``(local logits, local targets, shard)``; ``shard`` None: not vocab-parallel.

    A ``DTensor`` sharded on its last dim gives the group of that mesh dimension and its
    own offsets; ``targets`` may be a ``DTensor`` too (its local tensor is used). Checks here
    depend only on arguments that every rank passes alike (no shard width), so they raise on
    every rank or on none, before any collective."""
    if is_dtensor(targets):
        targets = targets.to_local()
    if is_dtensor(logits):
        if process_group is not None or vocab_start is not None or vocab_size is not None:
            raise ValueError(
                "process_group, vocab_start and vocab_size must be None for DTensor logits: "
                "the group and the layout come from the DTensor's mesh and placements"
            )
        return _from_dtensor(logits, targets)
    if process_group is None:
        check_layout_keywords(None, vocab_start, vocab_size)
        return logits, targets, None
    V.check_float(logits, "logits")
    columns = logits.shape[-1] if logits.dim() >= 1 else 0
    return logits, targets, group_shard(process_group, columns, vocab_start, vocab_size)


def check_layout_keywords(process_group, vocab_start, vocab_size) -> None:
    """``vocab_start`` / ``vocab_size`` describe a vocabulary shard: given without
    ``process_group`` they raise ``ValueError``."""
    if process_group is None and (vocab_start is not None or vocab_size is not None):
        raise ValueError(
            "vocab_start / vocab_size describe a vocabulary shard: they need process_group"
        )


def group_shard(
    process_group, columns: int, vocab_start: int | None, vocab_size: int | None,
    name: str = "logits",
) -> VocabShard:  # fmt: skip
    """This rank's :class:`VocabShard` of ``columns`` vocabulary entries in ``process_group``
    from the ``vocab_start`` / ``vocab_size`` keywords (checked here, locally: they raise on
    every rank or on none); the layout across ranks is checked by the first collective."""
    _check_int(vocab_start, "vocab_start", 0)
    _check_int(vocab_size, "vocab_size", 1)
    if vocab_start is not None and vocab_size is None:
        raise ValueError(
            "vocab_start needs vocab_size (the global vocabulary size) for ragged shards"
        )
    dist = _dist()
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup (dist.group.WORLD, "
            f"dist.new_group(...)), got {type(process_group).__name__}"
        )
    world = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    start = rank * columns if vocab_start is None else vocab_start
    vocab = world * columns if vocab_size is None else vocab_size
    return VocabShard(
        process_group, rank, world, start, columns, vocab, vocab_start is not None, name
    )


def shard_args(shard: VocabShard | None) -> tuple:
    """``shard`` as a custom op's primitive arguments, :func:`shard_of`'s: ``(group name,
    start, columns, vocab_size, explicit)``, or ``(None, 0, 0, 0, False)`` for no shard. A
    custom op takes no process group: it travels by name and is resolved where the op runs
    (as ``torch.distributed``'s functional collectives do)."""
    if shard is None:
        return (None, 0, 0, 0, False)
    return (shard.group.group_name, shard.start, shard.columns, shard.vocab_size, shard.explicit)


def shard_of(group_name: str | None, start: int, columns: int, vocab_size: int,
             explicit: bool, name: str = "logits") -> VocabShard | None:  # fmt: skip
    """The :class:`VocabShard` of :func:`shard_args`' arguments (None for no group): this
    rank's place in the group resolved from its name."""
    if group_name is None:
        return None
    from torch.distributed import distributed_c10d

    group = distributed_c10d._resolve_process_group(group_name)
    dist = _dist()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return VocabShard(group, rank, world, start, columns, vocab_size, explicit, name)


def _from_dtensor(logits, targets):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    ndim = logits.dim()
    placements = tuple(logits.placements)
    vocab_dims = []
    for mesh_dim, p in enumerate(placements):
        if p.is_partial():
            raise ValueError(
                f"logits: a DTensor with a Partial placement ({placements}) holds unreduced "
                "values; redistribute it to Shard(-1) or Replicate first"
            )
        if p.is_shard() and p.dim % ndim == ndim - 1:
            vocab_dims.append(mesh_dim)
    if len(vocab_dims) > 1:
        raise ValueError(
            f"logits: the vocabulary dim is sharded over mesh dims {vocab_dims}; shard it over "
            "one mesh dimension"
        )
    local = logits.to_local()
    if not vocab_dims:  # the whole vocabulary on every rank: nothing to merge
        return local, targets, None
    mesh = logits.device_mesh
    group = mesh.get_group(vocab_dims[0])
    _, offset = compute_local_shape_and_global_offset(logits.shape, mesh, placements)
    dist = _dist()
    shard = VocabShard(
        group, dist.get_rank(group), dist.get_world_size(group), int(offset[-1]),
        local.shape[-1], logits.shape[-1], True,
    )  # fmt: skip
    return local, targets, shard


# ----------------------------------------------------------------------------- checks


def _layout_error(hdr: list[float], shard: VocabShard) -> str | None:
    """The message for a header (gathered by the MAX all-reduce) that describes no tiling of
    ``[0, V)``, else None. Every rank holds the same header, so every rank decides alike."""
    world = shard.world
    starts = [int(hdr[2 * r]) for r in range(world)]
    widths = [int(hdr[2 * r + 1]) for r in range(world)]
    v_max, v_min = hdr[2 * world], -hdr[2 * world + 1]
    if not shard.explicit and len(set(widths)) > 1:
        return (
            f"{shard.name}: the vocabulary shards differ in width across the process group "
            f"(V_local per rank: {widths}); rank r must hold global ids [r*V_local, "
            f"(r+1)*V_local): pad the last shard and pass vocab_size= (as Megatron pads), "
            f"or pass vocab_start= and vocab_size= for ragged shards"
        )
    if v_max != v_min:
        return (
            f"vocab_size differs across the process group (from {int(v_min)} to "
            f"{int(v_max)}); pass the same global vocabulary size on every rank"
        )
    vocab = int(v_max)
    expected = 0
    for r in range(world):
        if starts[r] != expected:
            return (
                f"vocab_start: the shards must be contiguous in rank order from id 0 (rank r "
                f"starts where rank r-1 ends); got (vocab_start, V_local) per rank "
                f"{list(zip(starts, widths))}"
            )
        expected += widths[r]
    if expected < vocab:
        return (
            f"vocab_size = {vocab}, but the shards cover ids [0, {expected}) only "
            f"(V_local per rank: {widths})"
        )
    return None


def _target_error(hdr: list[float], shard: VocabShard, ignore_index: int) -> str | None:
    t_max, t_min = hdr[2 * shard.world + 2], -hdr[2 * shard.world + 3]
    if t_max == -math.inf:  # no counted target
        return None
    bad = t_max if t_max >= shard.vocab_size else t_min if t_min < 0 else None
    if bad is None:
        return None
    return (
        f"targets holds {int(bad)}, outside [0, V) = [0, {shard.vocab_size}) and not "
        f"ignore_index ({ignore_index})"
    )


def check_layout(shard: VocabShard, device) -> None:
    """One MAX all-reduce of this rank's layout header, ``ValueError`` on every rank when the
    shards do not tile ``[0, V)``: for a chunk loop whose chunk count follows the layout
    (eager calls with value checks on; one host sync)."""
    dist = _dist()
    hdr = _header(shard, torch.float32, device)
    dist.all_reduce(hdr, op=dist.ReduceOp.MAX, group=shard.group)
    message = _layout_error(hdr.tolist(), shard)
    if message is not None:
        raise ValueError(message)


def _layout_ok(hdr: Tensor, shard: VocabShard) -> Tensor:
    """:func:`_layout_error` on device, as a 0-dim bool (no host sync): the unchecked path
    poisons every output with NaN when it is False."""
    world = shard.world
    starts, widths = hdr[0 : 2 * world : 2], hdr[1 : 2 * world : 2]
    ends = torch.cumsum(widths, 0)
    ok = (starts[0] == 0) & (starts[1:] == ends[:-1]).all() & (ends[-1] >= hdr[2 * world])
    ok = ok & (hdr[2 * world] == -hdr[2 * world + 1])
    if not shard.explicit:
        ok = ok & (widths == widths[0]).all()
    return ok


# ----------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class _Spec:
    shard: VocabShard
    temperature: float
    ignore_index: int
    with_targets: bool
    with_entropy: bool
    which: str
    check: bool
    softcap: float | None = None  # the logit soft cap (None: none), applied before 1 / T
    with_extras: bool = False  # token_stats' diagnostics too (mean logit, sum p^2, top-1)


def _local_targets(targets: Tensor, shard: VocabShard, ignore_index: int):
    """``(local ids, ignored)``: ids into this rank's valid columns for the targets it owns;
    ``LOCAL_IGNORE`` where ignored; ``NOT_OWNED`` (matches no column) where another rank
    owns the target. A target outside ``[0, V)`` is "owned" by the first rank (below 0) or
    the last (at or above V) as an id at or past its last valid column, so layer 1 gives
    NaN there and the merged ``logp`` is NaN, never a finite value nobody computed."""
    ignored = targets == ignore_index
    local = targets - shard.start
    if shard.first and shard.last:
        owned = None
    elif shard.first:
        owned = local < shard.valid
    elif shard.last:
        owned = local >= 0
    else:
        owned = (local >= 0) & (local < shard.valid)
    if shard.first:  # a negative target: out of range upwards (never a sentinel)
        local = torch.where(local < 0, shard.valid, local)
    if owned is not None:
        local = torch.where(owned, local, NOT_OWNED)
    local = torch.where(ignored, LOCAL_IGNORE, local)
    return local, ignored


def _local_stats(x3d: Tensor, t_local: Tensor | None, spec: _Spec, inner: int):
    """Layer 1 on this rank's valid columns: ``(logp, entropy, row_max, log_sum)``, each
    ``(outer, inner)`` in the statistics dtype (``logp`` / ``entropy`` may be empty)."""
    outer = x3d.shape[0]
    valid = spec.shard.valid
    dtype = stats_dtype(x3d.dtype)
    if valid == 0:  # an empty shard: an empty partial (-inf, 0, 0); a target here is bad
        full = lambda v: torch.full((outer, inner), v, dtype=dtype, device=x3d.device)
        extras = ()
        if spec.with_extras:  # mean, log sum p^2, top-1, raw max
            extras = (full(0.0), full(-math.inf), full(0.0).bool(), full(-math.inf))
        return (full(math.nan), full(0.0), full(-math.inf), full(-math.inf)) + extras
    x = x3d if valid == x3d.shape[-1] else x3d.narrow(-1, 0, valid)
    if spec.which == "reference":
        if inner != x.shape[1]:
            x = x.narrow(1, position_shift(x.shape[1], inner), inner)
        args = (x, t_local, spec.temperature, LOCAL_IGNORE, spec.softcap)
        stats = ref.row_stats(*args)
        return stats + ref.row_extras(*args) if spec.with_extras else stats
    if spec.with_extras:
        return token_extras_fwd_op(x, t_local, spec.temperature, spec.softcap, LOCAL_IGNORE)
    return token_stats_fwd_op(
        x, t_local, spec.temperature, spec.softcap, LOCAL_IGNORE, spec.with_entropy
    )


def _target_part(targets: Tensor, ignore_index: int, dtype) -> Tensor:
    """``(max, -min)`` of the counted targets (``-inf`` when none) for the header."""
    flat = targets.reshape(-1)
    if flat.numel() == 0:
        return torch.full((2,), -math.inf, dtype=dtype, device=targets.device)
    t = flat.to(dtype)
    both = torch.where(flat != ignore_index, torch.stack((t, -t)), -math.inf)
    return both.amax(1)


def _header(shard: VocabShard, dtype, device) -> Tensor:
    hdr = torch.full((2 * shard.world + 2,), -math.inf, dtype=dtype, device=device)
    hdr[2 * shard.rank] = shard.start
    hdr[2 * shard.rank + 1] = shard.columns
    hdr[2 * shard.world] = shard.vocab_size
    hdr[2 * shard.world + 1] = -shard.vocab_size
    return hdr


def _merge(x3d, targets, t_local, ignored, spec: _Spec, inner: int):
    """Layer 1 locally, the two all-reduces, the merge. Returns ``(logp, entropy, m, log_S)``
    ``(outer, inner)`` (``logp`` / ``entropy`` None when not asked for)."""
    return merge_partials(_local_stats(x3d, t_local, spec, inner), targets, t_local, ignored, spec)


def merge_partials(local, targets, t_local, ignored, spec: _Spec):
    """The two all-reduces and the merge of this rank's layer-1 partials ``local = (logp,
    entropy, row_max, log_sum)`` (any one shape; ``logp`` / ``entropy`` unread when not
    asked for) into ``(logp, entropy, m, log_S)`` of the whole vocabulary, that shape.
    ``spec.with_extras``: ``local`` also holds this shard's ``(mean_logit,
    log_sum_sq_probs, is_top1, raw_max)`` and the merge returns a fifth item, the whole
    vocabulary's first three (:func:`_merge_extras`: the raw max rides the first all-reduce,
    four more floats the second: 20 bytes a token more).

    Shared by :func:`_merge` (one call's logits) and the vocab-parallel
    :func:`fused_rl.linear_token_logprobs` (the partials of all its chunks, merged once)."""
    dist = _dist()
    shard = spec.shard
    logp_l, ent_l, m_l, log_s_l = local[:4]
    dtype, dev = m_l.dtype, m_l.device
    n = m_l.numel()
    if spec.check and spec.with_targets:
        tpart = _target_part(targets, spec.ignore_index, dtype)
    else:
        tpart = torch.full((2,), -math.inf, dtype=dtype, device=dev)
    # collective 1: the row max (and, for the diagnostics, the raw logits' max) and the
    # layout header
    maxima = (m_l.reshape(-1), local[7].reshape(-1)) if spec.with_extras else (m_l.reshape(-1),)
    local_max = torch.cat((*maxima, _header(shard, dtype, dev), tpart))
    # out of place, and the local maxima read from its input below: Inductor writes m_l
    # straight into the concatenation, so an in-place all-reduce (which it reinplaces onto
    # the concatenation however the call is written) would hand the code after it the
    # global max in place of m_l
    buf = _all_reduce_max(local_max, shard.group)
    m_l = local_max[:n].view(m_l.shape)
    hdr = buf[n * len(maxima) :]
    ok = None
    if spec.check:
        values = hdr.tolist()  # the call's one host sync, as the unsharded target check
        message = _layout_error(values, shard) or _target_error(values, shard, spec.ignore_index)
        if message is not None:
            raise ValueError(message)
    else:
        ok = _layout_ok(hdr, shard)
    m = buf[:n].view(m_l.shape)
    # collective 2: every partial rescaled to the global max, packed into one SUM
    # log(s_r exp(m_r - m)); -inf for an empty partial (the shard's row all -inf, where the
    # reference's log s is NaN); a NaN max stays NaN
    log_a = torch.where(m_l == -math.inf, -math.inf, (m_l - m) + log_s_l)
    a = log_a.exp()
    parts = [a]
    if spec.with_targets:
        owned = t_local >= 0  # this rank's target (or an out-of-range one: NaN)
        parts.append(torch.where(owned, logp_l + log_a, 0.0))  # z_y - m
    if spec.with_entropy:
        parts.append(torch.where(a == 0, 0.0, a * (log_a - ent_l)))  # sum_j e^(z_j-m)(z_j-m)
    n_parts = len(parts)
    if spec.with_extras:
        raw_max = buf[n : 2 * n].view(m_l.shape)
        parts += _extras_parts(local[4:], m_l, raw_max, log_a, targets, t_local, shard)
    packed = torch.stack(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=shard.group)
    total = packed[0]
    log_total = total.log()
    logp = entropy = None
    k = 1
    if spec.with_targets:
        logp = packed[k] - log_total
        k += 1
    if spec.with_entropy:
        entropy = log_total - packed[k] / total
        entropy = torch.where(entropy < 0, 0.0, entropy)  # rounding on a point mass
    if ok is not None:
        log_total = torch.where(ok, log_total, math.nan)
    if ignored is not None:  # ignored tokens: exactly 0, as the unsharded call
        logp = torch.where(ignored, 0.0, logp) if logp is not None else None
        entropy = torch.where(ignored, 0.0, entropy) if entropy is not None else None
    if ok is not None:
        logp = torch.where(ok, logp, math.nan) if logp is not None else None
        entropy = torch.where(ok, entropy, math.nan) if entropy is not None else None
    if spec.with_extras:
        extras = _merge_extras(packed[n_parts:], log_total, ignored, ok, shard.vocab_size)
        return logp, entropy, m, log_total, extras
    return logp, entropy, m, log_total


def _extras_parts(local, m_l, raw_max, log_a, targets, t_local, shard: VocabShard) -> list:
    """This rank's share of the diagnostics' SUM: the shard's ``sum z``, its
    ``sum exp(2 (z - m))`` on the global max ``m`` (``log_a``: ``log(s_l exp(m_l - m))``),
    and two counts for the top-1 flag, ranked on the raw logits as unsharded: the target
    is the first maximum of the whole row iff its owner holds it as its own first maximum
    at the row's raw max ``raw_max`` (all ranks'), and no shard wholly before the target
    reaches that max. A shard whose row holds a NaN (its raw max NaN) counts as blocking,
    so the flag is False, as unsharded."""
    mean_l, log_sq_l, top1_l, raw_max_l = local
    empty = m_l == -math.inf
    z_sum = torch.where(empty, 0.0, mean_l * shard.valid)  # the kernel's sum / V_local
    # sum exp(2 (z - m)) = exp(log sum p_l^2 + 2 log(s_l exp(m_l - m)))
    sq = torch.where(empty, 0.0, (log_sq_l + 2 * log_a).exp())
    at_max = raw_max_l == raw_max
    owner_first = (top1_l & at_max).to(m_l.dtype)
    before = (t_local == NOT_OWNED) & (targets > shard.start)  # owned by a later shard
    blocks = (before & at_max & (shard.valid > 0)) | raw_max_l.isnan()
    return [z_sum, sq, owner_first, blocks.to(m_l.dtype)]


def _merge_extras(summed, log_total, ignored, ok, vocab_size: int):
    """``(mean_logit, log_sum_sq_probs, is_top1)`` of the whole vocabulary from the summed
    shares of :func:`_extras_parts`; 0 / False at ignored tokens, NaN / False where the
    layout check failed unchecked (``ok``)."""
    z_sum, sq, owner_first, blocks = summed
    mean = z_sum / vocab_size
    log_sq = sq.log() - 2 * log_total
    top1 = (owner_first > 0) & (blocks == 0)
    if ignored is not None:
        mean = torch.where(ignored, 0.0, mean)
        log_sq = torch.where(ignored, 0.0, log_sq)
        top1 = top1 & ~ignored
    if ok is not None:
        mean = torch.where(ok, mean, math.nan)
        log_sq = torch.where(ok, log_sq, math.nan)
        top1 = top1 & ok
    return mean, log_sq, top1


# ----------------------------------------------------------------------------- backward


def _backward_local(x3d, t_local, m, log_s, entropy, g, h, spec: _Spec, inner: int) -> Tensor:
    """The gradient of this rank's whole ``(outer, S, V_local)`` buffer: layer 3 with the
    global statistics, no collective; zero at padding columns and outside the window."""
    valid = spec.shard.valid
    columns = x3d.shape[-1]
    if valid == 0:
        return torch.zeros(x3d.shape, dtype=x3d.dtype, device=x3d.device)
    x = x3d if valid == columns else x3d.narrow(-1, 0, valid)
    if spec.which == "reference":
        positions = x.shape[1]
        if inner != positions:
            window = ref.grad_logits(
                x.narrow(1, position_shift(positions, inner), inner), t_local, m, log_s,
                entropy, g, h, spec.temperature, LOCAL_IGNORE, spec.softcap,
            )  # fmt: skip
            grad = x.new_zeros(x.shape)
            grad.narrow(1, position_shift(positions, inner), inner).copy_(window)
        else:
            grad = ref.grad_logits(
                x, t_local, m, log_s, entropy, g, h, spec.temperature, LOCAL_IGNORE, spec.softcap
            )
    else:
        grad = token_stats_bwd_op(
            x, t_local, m, log_s, entropy if h is not None else None, g, h, None, None,
            spec.temperature, spec.softcap, LOCAL_IGNORE,
        )  # fmt: skip
    if valid != columns:  # padding columns (Megatron's padded vocabulary): zero gradient
        grad = torch.nn.functional.pad(grad, (0, columns - valid))
    return grad


class _ShardedTokenStats(torch.autograd.Function):
    """``(logp, entropy)`` over a vocabulary split across ``spec.shard.group``: two
    all-reduces forward, none backward. Differentiable once."""

    @staticmethod
    def forward(ctx, x3d, targets, t_local, ignored, spec: _Spec):
        inner = x3d.shape[1] if t_local is None else t_local.shape[1]
        logp, entropy, m, log_s, *extras = _merge(x3d, targets, t_local, ignored, spec, inner)
        ctx.save_for_backward(x3d, t_local, m, log_s, entropy)
        ctx.spec, ctx.inner = spec, inner
        ctx.set_materialize_grads(False)
        empty = m.new_empty((0,))
        out = (logp if logp is not None else empty), (entropy if entropy is not None else empty)
        if not extras:
            return out
        ctx.mark_non_differentiable(*extras[0])
        return out + extras[0]  # the diagnostics (with_extras)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_diagnostics):
        x3d, t_local, m, log_s, entropy = ctx.saved_tensors
        spec = ctx.spec
        g = grad_logp if spec.with_targets else None
        h = grad_entropy if spec.with_entropy else None
        grad = None
        if g is not None or h is not None:
            with torch.no_grad():
                grad = _backward_local(x3d, t_local, m, log_s, entropy, g, h, spec, ctx.inner)
            grad = ref.differentiable_once(grad, x3d, grad_logp, grad_entropy)
        return grad, None, None, None, None


class _ShardedLogprobsK(torch.autograd.Function):
    """``(outer, T, K)`` log-probs of ``K`` global ids a row over a vocabulary split across
    ``spec.shard.group`` (:class:`fused_rl._vocab_ops.MultiTargetLogprobs` sharded): layer 1
    on this rank's columns for the row's partial normaliser, the two all-reduces of
    :func:`merge_partials` (without a target: the row max, then the rescaled sum, 4 + 4
    bytes a token in fp32), then a third (``SUM``, ``4 K`` bytes a token) of the ids'
    logits, each read by the rank that owns it; every rank returns all ``K`` log-probs.
    Backward local: layer 3 writes ``-p G / T`` (``G = sum_k g_k``) over this rank's
    columns, then its owned ids' columns get their exact values. Differentiable once.

    ``first``: ``(outer, T)`` ``NOT_OWNED`` where the row counts (read, no column of it
    special), ``LOCAL_IGNORE`` where none of its ids counts (not read; outputs meaningless,
    gradient 0). ``local``: ``(outer, T, K)`` ids into this rank's valid columns (0 where not
    owned); ``owned``: which."""

    @staticmethod
    def forward(ctx, x3d, first, local, owned, bad, spec: _Spec):
        inner = first.shape[1]
        stats = _local_stats(x3d, first, spec, inner)
        _, _, m, log_s = merge_partials(stats, None, None, None, spec)
        if spec.shard.valid == 0:
            z = torch.zeros(local.shape, dtype=m.dtype, device=m.device)
        else:
            z = torch.where(owned, x3d.gather(-1, local).to(m.dtype), 0.0)
        if spec.shard.first:  # an id outside [0, V) (unchecked): NaN, never a finite value
            z = torch.where(bad, math.nan, z)
        _dist().all_reduce(z, op=_dist().ReduceOp.SUM, group=spec.shard.group)
        logp = (z * (1.0 / spec.temperature) - m[..., None]) - log_s[..., None]
        ctx.save_for_backward(x3d, first, local, owned, m, log_s, logp)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(z)
        return logp, z

    @staticmethod
    def backward(ctx, grad_logp, _grad_z):
        if grad_logp is None:
            return (None,) * 6
        x3d, first, local, owned, m, log_s, logp = ctx.saved_tensors
        spec = ctx.spec
        g = grad_logp.to(logp.dtype)
        total = g.sum(-1)
        with torch.no_grad():
            grad = _backward_local(x3d, first, m, log_s, None, total, None, spec, first.shape[1])
            if spec.shard.valid:
                counted = first != LOCAL_IGNORE
                scatter_exact_id_grads(grad, local, owned, g, logp, total, spec.temperature,
                                       counted)  # fmt: skip
        grad = ref.differentiable_once(grad, x3d, grad_logp)
        return grad, None, None, None, None, None


def sharded_logprobs_k(
    logits: Tensor, ids: Tensor, counted: Tensor, shard: VocabShard, *, which: str,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(logp, z)``: the fp32 (fp64 for fp64 logits) log-probs ``(..., K)`` of the global ids
    ``ids`` (``(..., K)``, the same on every rank, each in ``[0, V)``: checked by the caller)
    under the full-vocabulary softmax of ``logits / T`` (this rank's ``(..., V_local)``
    shard), and the ids' raw logits (no gradient), from :class:`_ShardedLogprobsK`. A row
    where ``counted`` (``ids.shape[:-1]``, bool) is False is not read: its outputs are
    meaningless (zero them), its gradient 0."""
    check_vocab_limit(shard)
    if tuple(ids.shape[:-1]) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"ids must be logits.shape[:-1] + (K,) = {tuple(logits.shape[:-1])} + (K,), got "
            f"{tuple(ids.shape)}"
        )
    x3d = as_rows3d(logits)
    k = ids.shape[-1]
    ids3d = ids.reshape(x3d.shape[0], -1, k).long()
    rel = ids3d - shard.start
    owned = (rel >= 0) & (rel < shard.valid)
    local = torch.where(owned, rel, 0)
    bad = (ids3d < 0) | (ids3d >= shard.vocab_size)
    first = torch.where(counted.reshape(ids3d.shape[:2]), NOT_OWNED, LOCAL_IGNORE)
    spec = _Spec(shard, float(temperature), LOCAL_IGNORE, False, False, which,
                 V.value_checks_enabled(logits))  # fmt: skip
    logp, z = _ShardedLogprobsK.apply(x3d, first, local, owned, bad, spec)
    return logp.reshape(ids.shape), z.reshape(ids.shape)


@torch.no_grad()
def sharded_kth_largest(logits: Tensor, k: int, shard: VocabShard, *, which: str) -> Tensor:
    """The ``k``-th largest of each row of the whole vocabulary (ties counted with their
    multiplicity; ``1 <= k <=`` the global width), from this rank's
    ``(..., V_local)`` shard (its ``shard.valid`` leading columns): ``(...)`` fp32 (fp64 for
    fp64 logits), the same on every rank, NaN for a row holding a NaN on any rank; never
    differentiable.

    Triton: the radix select of ``kernels/vocab/select.py`` one pass a launch (``B / 8``
    passes for ``B``-bit floats: 2 for bf16), each pass's ``(rows, 257)`` int32 histograms
    summed over the ranks by one all-reduce (1028 bytes a row a pass), no sort and nothing
    of size ``(rows, K)``. Reference: each rank's top ``k`` values (``-inf`` past its width)
    gathered (``4 K`` bytes a row from every rank, ``8 K`` for fp64) and ranked again."""
    if not 1 <= k <= shard.vocab_size:  # every rank raises: the same k and layout everywhere
        raise ValueError(f"k must be in [1, {shard.vocab_size}] (the vocabulary), got {k}")
    dist = _dist()
    x3d = as_rows3d(logits.detach())[..., : shard.valid]  # the padding columns rank nowhere
    if which == "reference":
        width = min(k, x3d.shape[-1])
        local = torch.full((*x3d.shape[:2], k), float("-inf"), dtype=stats_dtype(x3d.dtype),
                           device=x3d.device)  # fmt: skip
        local[..., :width] = x3d.topk(width, dim=-1).values  # k a rank: gathers match
        # a row with a NaN sends only NaN: every rank then sees it (gloo gathers no bf16)
        local = torch.where(x3d.isnan().any(-1, keepdim=True), float("nan"), local)
        gathered = [torch.empty_like(local) for _ in range(shard.world)]
        dist.all_gather(gathered, local.contiguous(), group=shard.group)
        kth = kth_largest_reference(torch.cat(gathered, -1), k)
        return kth.reshape(logits.shape[:-1])
    kth = kth_largest_by_passes(x3d, k, lambda hist: dist.all_reduce(hist, group=shard.group))
    return kth.reshape(logits.shape[:-1])


def check_vocab_limit(shard: VocabShard) -> None:
    """Ids and widths travel in the float header: the vocabulary must stay below 2^24."""
    if shard.vocab_size >= MAX_VOCAB:
        raise ValueError(f"vocab_size must be < 2^24 = {MAX_VOCAB}, got {shard.vocab_size}")


def sharded_token_stats(
    logits: Tensor,
    targets: Tensor | None,
    shard: VocabShard,
    *,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    which: str,
    softcap: float | None = None,
    with_extras: bool = False,
) -> tuple[Tensor | None, ...]:
    """``(logp, entropy)`` (each None when not asked for) of the full-vocabulary softmax
    from this rank's shard; arguments already checked locally (shapes, dtypes, temperature,
    softcap), layout and target range checked here through the first collective. The cap
    is elementwise, so each rank caps its own columns before the merge. ``with_extras``
    (targets and the entropy asked for): then ``(logp, entropy, mean_logit,
    log_sum_sq_probs, is_top1)``, :func:`fused_rl.token_stats`' of the whole vocabulary."""
    check_vocab_limit(shard)
    x3d = as_rows3d(logits)
    t_local = ignored = t2d = None
    if targets is not None:
        n_targets = targets.shape[-1] if targets.dim() > 0 else 1
        t2d = targets.reshape(x3d.shape[0], n_targets if logits.dim() > 1 else 1)
        t_local, ignored = _local_targets(t2d, shard, ignore_index)
    spec = _Spec(
        shard, float(temperature), int(ignore_index), targets is not None, bool(with_entropy),
        which, V.value_checks_enabled(logits), None if softcap is None else float(softcap),
        with_extras,
    )  # fmt: skip
    logp, entropy, *extras = _ShardedTokenStats.apply(x3d, t2d, t_local, ignored, spec)
    shape = targets.shape if targets is not None else logits.shape[:-1]
    if with_extras:
        return tuple(x.reshape(shape) for x in (logp, entropy, *extras))
    logp = logp.reshape(shape) if targets is not None else None
    entropy = entropy.reshape(shape) if with_entropy else None
    return logp, entropy


# ----------------------------------------------------------------------------- data parallel


def global_token_count(mask: Tensor, group=None) -> Tensor:
    """The number of counted tokens summed over the ranks of ``group``: one all-reduce.

    ``policy_loss(..., loss_agg="token-mean", num_items=global_token_count(mask))`` on each
    data-parallel rank makes the losses add up over the ranks to the loss of the whole
    global batch (and their gradients to its gradient), whatever each rank's share of the
    tokens; DDP averages gradients over ranks, so scale the loss by the data-parallel size
    to train on that global token mean (verl's ``dp_size``).

    Args:
        mask: ``(...)`` bool (True counts), integer or float per-token weights ``>= 0``,
            the mask the loss counts with (``mask & (targets != ignore_index)`` when
            ``ignore_index`` marks tokens too). A negative weight raises ``ValueError`` in
            eager mode (``fused_rl.config.check_values``).
        group: the data-parallel process group; None = the default (world) group.

    Returns:
        A 0-dim tensor on ``mask``'s device, never read on the host: int64 (exact) for
        bool / integer masks, fp32 (fp64 for fp64) for float weights.

    Example: see the module docstring.
    """
    V.check_mask_dtype(mask, "mask")
    if mask is None:
        raise TypeError("mask must be a torch.Tensor, got NoneType")
    V.check_mask_weights(mask, "mask")
    if mask.is_floating_point():
        count = mask.to(stats_dtype(mask.dtype)).sum()
    else:
        count = mask.sum(dtype=torch.int64)
    dist = _dist()
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def gather_param(param):
    """An FSDP2 (``DTensor``) parameter gathered whole for the fused-linear ops, its gradient
    reduced over the ranks as FSDP2 reduces the gradients of what it gathers; anything else
    (a plain tensor, ``None``) as it is.

    FSDP2 gathers a unit's parameters in that unit's forward and reduce-scatters their
    gradients in its backward. An LM head read as a weight in a unit whose forward has not
    run gets neither: a head that is an FSDP2 unit of its own (its forward never runs, only
    its weight is read), or one of a non-root unit read outside that unit's forward. Its
    weight is then a ``DTensor``, and ``full_tensor()``'s own backward would keep each
    rank's slice of that rank's gradient alone. Here the gradient of the gathered weight is
    a partial sum over the ranks of the parameter's mesh, reduce-scattered back to the
    shards and divided by the number of ranks: the mean FSDP2 and DDP take. (A head in the
    root unit is a plain tensor in and after the root's forward, which FSDP2 does not
    reshard, and FSDP2 reduces its gradient: a plain tensor is returned as it is.) Every
    rank of the mesh must call it (an all-gather forward, a reduce-scatter backward). The
    ranks along every mesh dimension must be data parallel (FSDP2, HSDP) or see the same
    data (their gradients then count once each in the mean); a vocabulary-parallel head is
    not gathered: pass its local shard with ``process_group=`` instead
    (``docs/tensor-parallel.md``).

    Limits: the head is gathered in its parameter's dtype (fp32 shards under a bf16
    ``MixedPrecisionPolicy``: twice the bytes of FSDP2's own bf16 gather, and the op then
    runs in fp32 unless autocast casts it); its gradient is reduced at every backward
    (under ``set_requires_gradient_sync(False)`` too, where FSDP2 defers its own), and
    divided by the number of ranks (a custom FSDP2 gradient divide factor is not read).

    Args:
        param: a ``DTensor`` (an FSDP2 parameter at rest), a plain tensor or ``None``.

    Returns:
        The whole parameter as a plain tensor (a new one for a ``DTensor``), or ``param``.

    Example (one process; under FSDP2 every rank passes its sharded parameter):
        >>> import torch, torch.distributed as dist, fused_rl
        >>> from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> mesh = init_device_mesh("cpu", (1,))
        >>> weight = distribute_tensor(torch.randn(11, 4), mesh, [Shard(0)]).requires_grad_()
        >>> hidden, targets = torch.randn(2, 3, 4), torch.randint(0, 11, (2, 3))
        >>> logp = fused_rl.linear_token_logprobs(
        ...     hidden, fused_rl.distributed.gather_param(weight), targets)
        >>> logp.sum().backward()
        >>> type(weight.grad).__name__, tuple(weight.grad.full_tensor().shape)
        ('DTensor', (11, 4))
        >>> dist.destroy_process_group()
    """
    if param is None or not is_dtensor(param):
        return param
    if not (param.requires_grad and torch.is_grad_enabled()):
        return param.full_tensor()
    from torch.distributed.tensor import Partial

    mesh = param.device_mesh
    whole = param.full_tensor(grad_placements=[Partial("sum")] * mesh.ndim)
    return _MeanOverRanks.apply(whole, mesh.size())


class _MeanOverRanks(torch.autograd.Function):
    """The identity forward; backward, the gradient divided by the number of ranks."""

    @staticmethod
    def forward(ctx, x, ranks: int):
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.ranks, None


def check_local(x, name: str) -> None:
    """``TypeError`` for a ``DTensor`` where a fused-linear op takes a plain tensor: an
    FSDP2 parameter (data-parallel shards, to be gathered) and a vocabulary-parallel head
    (a local shard and ``process_group=``) look alike, so the op does not guess."""
    if is_dtensor(x):
        raise TypeError(
            f"{name} is a DTensor ({list(x.placements)}); the fused-linear ops take plain "
            f"tensors. An FSDP2 parameter: pass fused_rl.distributed.gather_param({name}) "
            "(gathered whole, its gradient reduced over the ranks as FSDP2 does); a "
            f"vocabulary-parallel head: pass its local shard ({name}.to_local()) with "
            "process_group="
        )
