"""Label checks the adapters share (TRL, torchtune, DI-engine, Liger, verl), and the gathers
built on them.

The originals have no ignore index: their ``gather`` raises on a label outside ``[0, V)``
(and their kernels read garbage). The adapters check the range once, in eager mode, with
one message naming the argument and what to do, then run fused_rl's kernels with
:data:`NO_IGNORE` as the ignore index, so a bad label that gets past the check (value
checks off, ``torch.compile``) gives NaN, never a silent 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as V
from .._backend import resolve_backend
from .._shapes import as_rows3d
from .._vocab_ops import MultiTargetLogprobs, token_stats_nocheck
from ..reference.logprobs import multi_target_logprobs

# Passed as ``ignore_index``: these helpers have no ignore index in the originals, and an
# out-of-range label must not become a 0 log-prob. A label equal to this value is itself out
# of range: the eager range check rejects it, and without that check (``check_values=False``,
# ``torch.compile``) ``checked_logprobs`` turns its row into NaN like any other bad label.
# Entries that a row mask masks are replaced by it, so the kernels skip them.
NO_IGNORE = -(2**31)

# What an out-of-range label's message tells the caller to do, by default.
RELABEL = "replace ignored labels (e.g. -100) by a valid id and mask them out"


def check_index_range(
    index: Tensor,
    vocab: int,
    name: str,
    original: str,
    keep: Tensor | None = None,
    fix: str = RELABEL,
) -> None:
    """Eager-mode check that ``index`` lies in ``[0, vocab)`` where ``keep`` is True (all of
    it when None); one host sync. ``fix``: what the message tells the caller to do."""
    if not V.value_checks_enabled(index):
        return
    bad = (index < 0) | (index >= vocab)
    if keep is not None:
        bad = bad & keep
    if bool(bad.any()):
        first = index[bad].reshape(-1)[0].item()
        raise ValueError(
            f"{name} holds {first}, outside [0, V) = [0, {vocab}); {original} has no ignore "
            f"index: {fix}"
        )


def checked_logprobs(
    logits: Tensor,
    index: Tensor,
    *,
    temperature: float = 1.0,
    keep: Tensor | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`fused_rl.token_logprobs` with no ignore index (and 0 where ``keep`` is False),
    for an ``index`` that has passed :func:`check_index_range` (so the eager range check,
    a host sync, runs once, not twice). fp32 results (fp64 for fp64 logits)."""
    V.check_positive(temperature, "temperature")
    which = resolve_backend("auto", logits, index)
    targets = index if keep is None else torch.where(keep, index, NO_IGNORE)
    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, NO_IGNORE, return_entropy, which
    )
    if not V.value_checks_enabled(index):  # the sentinel label went through unchecked
        sentinel = index == NO_IGNORE
        if keep is not None:
            sentinel = sentinel & keep
        logp = torch.where(sentinel, float("nan"), logp)
        if return_entropy:
            entropy = torch.where(sentinel, float("nan"), entropy)
    return (logp, entropy) if return_entropy else logp


def checked_logprobs_k(
    logits: Tensor, index: Tensor, *, temperature: float = 1.0, keep: Tensor | None = None
) -> Tensor:
    """:func:`checked_logprobs` for ``K`` ids a position: ``index`` ``(..., K)`` beside
    ``(..., V)`` logits, one read of each row forward and one read and write backward
    whatever ``K`` (``fused_rl._vocab_ops.MultiTargetLogprobs``). 0 where ``keep`` is False
    (a row with no id kept is not read); an id outside ``[0, V)`` that counts (value checks
    off) gives NaN. fp32 results (fp64 for fp64 logits)."""
    V.check_positive(temperature, "temperature")
    which = resolve_backend("auto", logits, index)
    vocab = logits.shape[-1]
    in_range = (index >= 0) & (index < vocab)
    counted = in_range if keep is None else keep & in_range
    safe = torch.where(counted, index, 0).long()
    rows = counted.any(-1) if keep is None else keep.any(-1)
    if which == "reference":
        logp = multi_target_logprobs(logits, safe, rows, float(temperature))
    else:
        logits3d = as_rows3d(logits)
        lead = logits3d.shape[:2]
        first = torch.where(rows, safe[..., 0], NO_IGNORE)
        logp = MultiTargetLogprobs.apply(
            logits3d, safe.reshape(*lead, index.shape[-1]), first.reshape(lead), float(temperature),
            NO_IGNORE,
        ).reshape(index.shape)  # fmt: skip
    logp = torch.where(in_range, logp, float("nan"))
    return logp if keep is None else torch.where(keep, logp, 0.0)


def gather_logprobs(
    logits: Tensor, index: Tensor, *, temperature: float, name: str, original: str
) -> Tensor:
    """``log_softmax(logits / T).gather(-1, index[..., None])[..., 0]`` in ``logits.dtype``
    (the verl and torchtune adapters' gather)."""
    V.check_logits(logits)
    V.check_targets(index, logits, name)
    check_index_range(index, logits.shape[-1], name, original)
    logp = checked_logprobs(logits, index, temperature=temperature)
    return logp.to(logits.dtype)
