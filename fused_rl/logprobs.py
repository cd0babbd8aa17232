"""Per-token log-probs and entropy over the vocabulary: ``token_logprobs``, ``token_entropy``,
and ``token_stats`` (both, with the diagnostics SFT / DPO trainers log, in one read).

The Triton path is the two vocab-stream ops of ``fused_rl._vocab_ops`` (one pass over the
logits forward, one backward); they are ``torch.library`` custom ops with fake and autograd
registrations, so ``torch.compile(fullgraph=True)`` traces straight through them, and
eager mode calls them directly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._shapes import as_rows3d
from ._vocab_ops import (
    check_inplace,
    check_targets_window,
    token_extras_fwd_op,
    token_stats_fwd_op,
    token_stats_nocheck,
    window,
)
from .distributed import is_dtensor, resolve_shard, sharded_token_stats
from .reference import logprobs as ref

# ----------------------------------------------------------------------------- public API


def _check_common(logits: Tensor, temperature: float, softcap, sharded: bool = False) -> None:
    if sharded:  # a vocabulary shard may be empty (a DTensor's trailing ranks, ragged)
        V.check_float(logits, "logits")
        if logits.dim() < 1:
            raise ValueError("logits must have at least 1 dim (..., V), got shape ()")
    else:
        V.check_logits(logits)
    V.check_positive(temperature, "temperature")
    if softcap is not None:  # no call without a cap: a frame costs host time on every step
        V.check_positive(softcap, "softcap")


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    inplace: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probability of each target token, ``log_softmax(logits / T)[target]``, fused.

    Args:
        logits: ``(..., V)`` fp32 / bf16 / fp16 (fp64 for gradcheck), any strides. Pass the
            model's whole ``(B, S, V)`` buffer with ``(B, T)`` targets, ``S > T``: positions
            ``S - T - 1 ... S - 2`` predict the targets (the causal-LM shift that TRL, verl
            and torchtune slice out) and the backward writes the buffer's gradient itself,
            zero elsewhere. A slice such as ``logits[:, :-1]`` also works (read in place,
            never copied), but autograd's slice backward then costs a second full-size
            gradient buffer and a copy.
        targets: ``(...)`` = ``logits.shape[:-1]``, or ``(..., T)`` for ``(..., S, V)``
            logits with ``S > T``; int64 or int32, any strides.
        temperature: logits are divided by it (``> 0``), as torchtune / verl do.
        softcap: Gemma-style logit soft-capping (a finite ``c > 0``; None = none): the logits
            become ``c * tanh(logits / c)`` before the division by ``temperature``, and the
            gradient goes through the cap. Every output is then of ``softmax(z)``,
            ``z = c tanh(logits / c) / T`` (the cap applies to the raw logits: a ``-inf``
            logit becomes ``-c``).
        ignore_index: targets equal to it give 0 for every output and exactly 0 gradient.
        return_entropy: also return ``H = -sum p log p`` of ``softmax(z)`` (``z`` the
            scaled logits, ``logits / T`` or with ``softcap`` as above),
            differentiable (an entropy bonus), at no extra pass over the logits.
        process_group: vocabulary (tensor) parallelism: a ``torch.distributed`` group whose
            ranks each hold a slice of the vocabulary, ``logits`` ``(..., V_local)`` (rank
            ``r`` holding global ids ``[r V_local, (r + 1) V_local)``, Megatron's
            ``ColumnParallelLinear`` layout); ``targets`` are global ids, the same on every
            rank. Every rank returns the unsharded call's values, and each rank's logits
            get their shard of the unsharded gradient. Two all-reduces forward (16 bytes
            per token with the entropy, 12 without), none backward (``fused_rl.distributed``).
            A ``DTensor`` ``logits`` placed ``Shard(-1)`` needs no group (its mesh's is
            used); the outputs are plain, replicated-valued tensors.
        vocab_start, vocab_size: the layout, with ``process_group``. ``vocab_size`` alone:
            the global vocabulary size with equal, padded shards (Megatron's padded
            vocabulary: columns at global id ``>= vocab_size`` are padding, excluded and
            given zero gradient). Both: ragged shards, this rank's column 0 being global
            id ``vocab_start``; the shards must be contiguous in rank order from id 0.
            Shards that do not tile ``[0, vocab_size)``, or a target outside it, raise
            ``ValueError`` on every rank (no rank left in a collective).
        inplace: the backward writes the gradient w.r.t. ``logits`` INTO ``logits`` and
            hands that buffer on as the gradient (as Liger's ``inplace=True``): no
            ``(N, V)`` gradient is allocated. The logits' values are destroyed by the
            backward: nothing may read them afterwards, and nothing whose backward reads
            them may use them (see docs/usage.md, "inplace=True"); the rules and what is
            checked are :func:`fused_rl.policy_loss`'s. Same values and gradients as the
            default, bit for bit. Eager only (raises under ``torch.compile``); not with
            vocabulary parallelism (``NotImplementedError``).
        top_k, top_p: the log-prob under the distribution a sampler truncated to the top-k
            tokens, then to the smallest top-p mass of those, renormalised (vLLM's order;
            ties at either cut kept whole): :func:`fused_rl.truncated_logprobs`, whose
            docstring gives the rules and the passes; a target outside the kept set gives
            ``-inf`` and zero gradient. ``targets`` then have ``logits.shape[:-1]``; with
            ``softcap`` the cuts are on the capped logits; vocabulary-parallel too; not with
            ``return_entropy`` or ``inplace`` (``ValueError``).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"`` (see ``fused_rl._backend``).

    Returns:
        ``logp`` fp32 of shape ``targets.shape`` (fp64 for fp64 logits), or ``(logp, entropy)``.
        Gradients w.r.t. ``logits`` have the logits' dtype.

    Out-of-range targets raise ``ValueError`` in eager mode (one host sync, see
    ``fused_rl.config.check_values``); under ``torch.compile`` they yield NaN.

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.randn(2, 5, 11, requires_grad=True)
        >>> targets = torch.randint(0, 11, (2, 5))
        >>> logp, ent = fused_rl.token_logprobs(logits, targets, return_entropy=True)
        >>> (logp.sum() + 0.01 * ent.sum()).backward()
        >>> logp.shape, logits.grad.shape
        (torch.Size([2, 5]), torch.Size([2, 5, 11]))
    """
    if top_k is not None or top_p is not None:
        return _truncated(logits, targets, top_k, top_p, temperature, softcap, ignore_index,
                          return_entropy, process_group, vocab_start, vocab_size, inplace,
                          backend)  # fmt: skip
    if process_group is not None or _vocab_parallel(logits, vocab_start, vocab_size):
        if inplace:
            raise NotImplementedError(
                "inplace=True is not implemented for vocabulary-parallel logits "
                "(process_group=, vocab_start= / vocab_size=, or a DTensor): call without it"
            )
        return _sharded(
            logits, targets, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, with_entropy=return_entropy, process_group=process_group,
            vocab_start=vocab_start, vocab_size=vocab_size, backend=backend,
        )  # fmt: skip
    _check_common(logits, temperature, softcap)
    check_targets_window(targets, logits)
    if inplace is not False:
        check_inplace(logits, "token_logprobs", inplace)
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, ignore_index, return_entropy, which, softcap, inplace
    )
    return (logp, entropy) if return_entropy else logp


def _truncated(logits, targets, top_k, top_p, temperature, softcap, ignore_index,
               return_entropy, process_group, vocab_start, vocab_size, inplace,
               backend):  # fmt: skip
    """``token_logprobs`` with ``top_k`` / ``top_p``: :func:`fused_rl.truncated_logprobs`,
    after refusing the options it does not take."""
    from .truncated import truncated_logprobs

    refused = {"return_entropy": return_entropy, "inplace": inplace is not False}
    named = [name for name, given in refused.items() if given]
    if named:
        raise ValueError(
            f"token_logprobs with top_k / top_p (truncated log-probs) does not take "
            f"{', '.join(named)}: call it without them"
        )
    return truncated_logprobs(
        logits, targets, top_k=top_k, top_p=top_p, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, process_group=process_group, vocab_start=vocab_start,
        vocab_size=vocab_size, backend=backend,
    )  # fmt: skip


def token_entropy(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Entropy ``-sum p log p`` of ``softmax(logits / T)`` per row, fp32, differentiable.

    Args:
        logits: ``(..., V)`` float, any strides.
        temperature, softcap: as for :func:`token_logprobs` (the entropy of
            ``softmax(c tanh(logits / c) / T)`` with a soft cap ``c``).
        process_group, vocab_start, vocab_size: vocabulary parallelism, as for
            :func:`token_logprobs` (12 bytes per token over two all-reduces forward,
            nothing backward); a ``DTensor`` placed ``Shard(-1)`` brings its own group.

    Returns:
        ``logits.shape[:-1]`` fp32 tensor (fp64 for fp64 logits).

    Example:
        >>> import torch, fused_rl
        >>> fused_rl.token_entropy(torch.zeros(3, 4)).tolist()  # log(4) each
        [1.3862943649291992, 1.3862943649291992, 1.3862943649291992]
    """
    if process_group is not None or _vocab_parallel(logits, vocab_start, vocab_size):
        return _sharded(
            logits, None, temperature=temperature, softcap=softcap, ignore_index=-100,
            with_entropy=True, process_group=process_group, vocab_start=vocab_start,
            vocab_size=vocab_size, backend=backend,
        )  # fmt: skip
    _check_common(logits, temperature, softcap)
    which = resolve_backend(backend, logits)
    if which == "reference":
        return ref.token_stats(logits, None, temperature=temperature, softcap=softcap)[1]
    logits3d = as_rows3d(logits)
    cap = None if softcap is None else float(softcap)
    _, entropy, _, _ = token_stats_fwd_op(logits3d, None, float(temperature), cap, -100, True)
    return entropy.reshape(logits.shape[:-1])


class TokenStats(NamedTuple):
    """What :func:`token_stats` / :func:`fused_rl.linear_token_stats` return, each of the
    targets' shape: ``logp`` and ``entropy`` differentiable (fp32; fp64 for fp64 inputs),
    the diagnostics not. Ignored tokens hold 0 (``is_top1`` False)."""

    logp: Tensor  # log_softmax(z)[target]
    entropy: Tensor  # -sum_v p_v log p_v
    mean_logit: Tensor  # mean_v z_v over the whole vocabulary (TRL's `logits/*` metrics)
    log_sum_sq_probs: Tensor  # log sum_v p_v^2 (WPO's weights; minus the Renyi-2 entropy)
    is_top1: Tensor  # bool: the target is argmax z (first maximum; token accuracy)


def token_stats(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> TokenStats:
    """Every per-token statistic an SFT / preference-optimisation trainer takes from its
    logits, from ONE read of each row: the target's log-prob and the entropy (both
    differentiable, as :func:`token_logprobs` ``(return_entropy=True)``), and, not
    differentiable, the mean logit, ``log sum p^2`` and whether the target is the top-1
    prediction (TRL's ``mean_logits``, ``log_sum_sq_probs``, ``is_top1``). All are of the
    scaled logits ``z = x / T`` (``c tanh(x / c) / T`` with ``softcap``).

    Args:
        logits, targets, temperature, softcap, ignore_index, backend: as
            :func:`token_logprobs` (the causal-LM window ``(B, S, V)`` with ``(B, T)``
            targets, ``S > T``, included).
        process_group, vocab_start, vocab_size: vocabulary parallelism, as
            :func:`token_logprobs` (or a ``DTensor`` placed ``Shard(-1)``): every rank
            returns the unsharded call's five outputs. Its two all-reduces carry 5 more
            floats a token than :func:`token_logprobs` ``(return_entropy=True)``'s 4: the
            row's raw max (the top-1 flag ranks the logits as given), each shard's ``sum z``
            and ``sum exp(2 (z - m))``, two counts for the top-1 flag; 36 bytes a token per
            rank.

    Returns:
        :class:`TokenStats` ``(logp, entropy, mean_logit, log_sum_sq_probs, is_top1)``, each
        ``targets.shape``. ``is_top1`` is ``torch.argmax`` of the logits as given: on a tie
        the lowest id is the prediction, ranked before the temperature and the cap (which
        keep the order: none of their rounding makes or breaks a tie); a row holding a NaN
        predicts nothing (False), and gives NaN in the other outputs, as
        :func:`token_logprobs`.

    Cost: the kernel of :func:`token_logprobs`, one read of each counted row forward
    (ignored rows are not read), 29 bytes written a token; the backward is layer 3's one
    read and one write.

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.tensor([[[2.0, 0.0, 2.0], [0.0, 1.0, 0.0]]])
        >>> s = fused_rl.token_stats(logits, torch.tensor([[2, 1]]))
        >>> s.is_top1.tolist()  # a tie with an earlier id does not count
        [[False, True]]
        >>> s.mean_logit.tolist()
        [[1.3333333730697632, 0.3333333432674408]]
    """
    if process_group is not None or _vocab_parallel(logits, vocab_start, vocab_size):
        return _sharded(
            logits, targets, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, with_entropy=True, process_group=process_group,
            vocab_start=vocab_start, vocab_size=vocab_size, backend=backend, with_extras=True,
        )  # fmt: skip
    _check_common(logits, temperature, softcap)
    check_targets_window(targets, logits)
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    cap = None if softcap is None else float(softcap)
    if which == "reference":
        logp, entropy = token_stats_nocheck(
            logits, targets, temperature, ignore_index, True, which, softcap
        )
        rows = logits if targets.shape == logits.shape[:-1] else window(logits, targets.shape[-1])
        rows3d = as_rows3d(rows.detach())
        with torch.no_grad():
            extras = ref.row_extras(rows3d, targets.reshape(rows3d.shape[:2]),
                                    float(temperature), int(ignore_index), cap)  # fmt: skip
        return TokenStats(logp, entropy, *(x.reshape(targets.shape) for x in extras[:3]))
    logits3d = as_rows3d(logits)
    n_targets = targets.shape[-1] if targets.dim() > 0 else 1
    t2d = targets.reshape(logits3d.shape[0], n_targets if logits.dim() > 1 else 1)
    out = token_extras_fwd_op(logits3d, t2d, float(temperature), cap, int(ignore_index))
    logp, entropy, _, _, mean, log_sq, top1, _ = out
    return TokenStats(*(x.reshape(targets.shape) for x in (logp, entropy, mean, log_sq, top1)))


def _vocab_parallel(logits, vocab_start, vocab_size) -> bool:
    return is_dtensor(logits) or vocab_start is not None or vocab_size is not None


def _sharded(
    logits, targets, *, temperature, softcap, ignore_index, with_entropy, process_group,
    vocab_start, vocab_size, backend, with_extras=False,
):  # fmt: skip
    """The vocabulary-parallel path (``fused_rl.distributed``): ``logp`` / ``(logp,
    entropy)`` / ``entropy`` (``targets`` None) of the whole vocabulary's softmax;
    ``with_extras``: :func:`token_stats`' :class:`TokenStats`."""
    logits, targets, shard = resolve_shard(logits, targets, process_group, vocab_start, vocab_size)
    if shard is None:  # a DTensor replicated over the vocabulary: an ordinary call
        if with_extras:
            return token_stats(logits, targets, temperature=temperature, softcap=softcap,
                               ignore_index=ignore_index, backend=backend)  # fmt: skip
        if targets is None:
            return token_entropy(logits, temperature=temperature, softcap=softcap, backend=backend)
        return token_logprobs(
            logits, targets, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, return_entropy=with_entropy, backend=backend,
        )  # fmt: skip
    _check_common(logits, temperature, softcap, sharded=True)
    if targets is not None:
        check_targets_window(targets, logits)
    which = resolve_backend(backend, logits, targets)
    out = sharded_token_stats(
        logits, targets, shard, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, with_entropy=with_entropy, which=which,
        with_extras=with_extras,
    )  # fmt: skip
    if with_extras:
        return TokenStats(*out)
    logp, entropy = out
    if targets is None:
        return entropy
    return (logp, entropy) if with_entropy else logp
