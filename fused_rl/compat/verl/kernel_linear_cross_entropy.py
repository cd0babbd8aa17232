"""Mirrors ``verl.utils.kernel.linear_cross_entropy``: :func:`linear_cross_entropy`, verl's
Triton fused lm_head op (hidden states -> per-token log-prob and entropy, the ``(N, V)``
logits never whole, fp32 outputs; vocab-parallel with ``dist_process_group``), and the checks
it shares with :class:`~fused_rl.compat.verl.experimental_torch_functional.FusedLinearForPPO`.
Both run :func:`fused_rl.linear_token_logprobs`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from .._checks import check_index_range

__all__ = ["LINEAR_CE_REDUCTIONS", "linear_cross_entropy"]

_RELABEL_IDS = "replace ignored ids (e.g. -100) by a valid id and mask them out"

LINEAR_CE_REDUCTIONS = ("none", "sum", "mean")


def _token_ids(ids, name: str) -> Tensor:
    """verl's token ids as the kernels take them: int64 / int32 as they come, any other
    integer dtype as int64 (verl casts to int64); bool / floating ids raise ``TypeError``."""
    V.check_tensor(ids, name)
    if ids.dtype in V.INDEX_DTYPES:
        return ids
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must be an integer tensor of token ids, got {ids.dtype}")
    return ids.long()


def _check_lm_head(hidden, weight, hidden_name: str, weight_name: str) -> None:
    """``hidden`` ``(..., H)`` and ``weight`` ``(V, H)``, floating, one dtype (unless autocast
    casts them, as ``hidden @ weight.T`` would), one device; messages name verl's arguments."""
    V.check_float(hidden, hidden_name)
    V.check_float(weight, weight_name)
    if hidden.dim() < 2:
        raise ValueError(
            f"{hidden_name} must be (..., H) hidden states, got shape {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(
            f"{weight_name} must be the lm_head's (V, H) with V >= 1 and H = "
            f"{hidden_name}.shape[-1] = {hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise TypeError(
            f"{weight_name} ({weight.dtype}) and {hidden_name} ({hidden.dtype}) must share a "
            "dtype (verl's hidden @ weight.T needs it outside autocast)"
        )
    V.check_same_device(**{hidden_name: hidden, weight_name: weight})


def _check_token_range(ids: Tensor, vocab: int, name: str, original: str) -> None:
    """Eager check (one host sync; off with ``fused_rl.config.check_values``) that every id
    is in ``[0, V)``: verl has no ignore index (its gather raises, its kernel reads garbage)."""
    check_index_range(ids, vocab, name, f"verl's {original}", fix=_RELABEL_IDS)


def _linear_stats(hidden, weight, ids, temperature, chunk_tokens):
    """``(logp, entropy)`` of ``hidden @ weight.T / temperature`` at ``ids`` (fp32; fp64 for
    fp64 inputs), through :func:`fused_rl.linear_token_logprobs`."""
    from ...linear import linear_token_logprobs

    return linear_token_logprobs(
        hidden, weight, ids, temperature=float(temperature), return_entropy=True,
        chunk_tokens=chunk_tokens,
    )  # fmt: skip


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> tuple[Tensor, Tensor]:
    """Mirrors ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (verl's Triton
    fused lm_head + log-prob / entropy op, vocab-parallel with ``dist_process_group``).

    Per token, with ``z = hidden @ weight.T / temperature``: ``log_softmax(z)[label]`` (the
    log-prob, not its negative, despite the name) and the entropy of ``softmax(z)``. Runs
    :func:`fused_rl.linear_token_logprobs` (chunked; the ``(N, V)`` logits are never whole).

    Args:
        hidden: ``(..., H)`` hidden states, flattened to ``(N, H)`` (typically ``(B, T, H)``;
            any strides, verl needs them contiguous).
        weight: the lm_head ``(V, H)``, ``hidden``'s dtype.
        labels: ``N`` ids in ``[0, V)`` (any shape holding one per hidden row, e.g.
            ``(B, T)``), **already shifted** (verl's callers roll them by -1); any integer
            dtype. An id outside ``[0, V)`` raises ``ValueError`` naming ``labels``.
        temperature: a real number ``> 0`` (verl asserts a Python float; an int is accepted).
        reduction: ``"none"`` (per-token log-probs), ``"sum"`` (their sum) or ``"mean"``
            (their sum over ``N``), case-insensitive as verl's ``reduction.lower()``; anything
            else raises ``ValueError`` naming ``reduction`` (a non-str ``TypeError``). The
            entropy is per token whatever the reduction, as in verl.
        dist_process_group: None, or verl's vocab-parallel form (Megatron's tensor-parallel
            group): ``weight`` is this rank's ``(V_local, H)`` slice, rank ``r`` holding ids
            ``[r V_local, (r + 1) V_local)`` of ``V = P V_local``; ``hidden`` and the global
            ``labels`` are the same on every rank. Every rank gets the unsharded log-probs
            and entropy and its slice of the weight gradient; as in verl, ``hidden``'s
            gradient is this rank's PARTIAL ``dz W_local`` (not all-reduced: verl's callers
            reduce it, Megatron's sequence-parallel gather by its reduce-scatter). Runs
            :func:`fused_rl.linear_token_logprobs` with ``process_group=``,
            ``reduce_hidden_grad=False``: two all-reduces forward, none backward.

    Returns:
        ``(logprobs, entropy)`` in fp32 whatever the inputs' dtype, as verl allocates them:
        ``logprobs`` ``(N,)`` (flat, even for ``(B, T, H)`` hidden) or 0-dim for ``"sum"`` /
        ``"mean"``; ``entropy`` ``(N,)``. Differentiable w.r.t. ``hidden`` (gradient in its
        shape) and ``weight``, gradients in their dtypes.

    Where it departs from verl (docs/compat.md, "verl"): runs on CPU (the reference or the
    Triton interpreter) as well as CUDA, for any ``H`` (verl asserts ``H % 128 == 0``);
    fp64 inputs are computed in fp64 (the outputs are still fp32); each gradient element is
    rounded to the inputs' dtype once (verl's default backward adds ``hidden``'s gradient over
    vocabulary slices of 9504 in that dtype).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl
        >>> h = torch.zeros(2, 3, 8, dtype=torch.bfloat16, requires_grad=True)
        >>> w = torch.randn(16, 8, dtype=torch.bfloat16)
        >>> lp, ent = verl.linear_cross_entropy(h, w, torch.zeros(2, 3, dtype=torch.long))
        >>> lp.shape, lp.dtype, round(lp[0].item(), 4), round(ent[5].item(), 4)
        (torch.Size([6]), torch.float32, -2.7726, 2.7726)
        >>> total, _ = verl.linear_cross_entropy(h, w, torch.zeros(6, dtype=torch.long),
        ...                                      reduction="sum")
        >>> total.shape, round(total.item(), 3)
        (torch.Size([]), -16.636)
    """
    if not isinstance(reduction, str):
        raise TypeError(
            f"reduction must be a str, one of {LINEAR_CE_REDUCTIONS}, got "
            f"{type(reduction).__name__}"
        )
    mode = reduction.lower()
    if mode not in LINEAR_CE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {LINEAR_CE_REDUCTIONS}, got {reduction!r}")
    V.check_positive(temperature, "temperature")
    _check_lm_head(hidden, weight, "hidden", "weight")
    rows = hidden.reshape(-1, hidden.shape[-1])
    ids = _token_ids(labels, "labels")
    if ids.numel() != rows.shape[0]:
        raise ValueError(
            f"labels must hold one id per hidden row, N = {rows.shape[0]} for hidden of shape "
            f"{tuple(hidden.shape)}, got shape {tuple(ids.shape)}"
        )
    ids = ids.reshape(-1)
    V.check_same_device(hidden=hidden, labels=ids)
    if dist_process_group is None:
        _check_token_range(ids, weight.shape[0], "labels", "linear_cross_entropy")
        logp, entropy = _linear_stats(rows, weight, ids, temperature, None)
    else:  # verl's equal slices; the labels are the same on every rank: all raise, or none
        import torch.distributed as dist

        from ...linear import linear_token_logprobs

        if not isinstance(dist_process_group, dist.ProcessGroup):
            raise TypeError(
                "dist_process_group must be None or a torch.distributed ProcessGroup (the "
                f"tensor-parallel group), got {type(dist_process_group).__name__}"
            )
        world = dist.get_world_size(dist_process_group)
        _check_token_range(ids, world * weight.shape[0], "labels", "linear_cross_entropy")
        logp, entropy = linear_token_logprobs(
            rows, weight, ids, temperature=float(temperature), return_entropy=True,
            process_group=dist_process_group, reduce_hidden_grad=False,
        )  # fmt: skip
    logp, entropy = logp.float(), entropy.float()
    if mode == "sum":
        logp = logp.sum()
    elif mode == "mean":
        logp = logp.mean()
    return logp, entropy
