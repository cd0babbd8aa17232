"""Log-probs under a sampler's top-k / top-p truncation: ``truncated_logprobs``.

The log-prob of each target under the distribution vLLM's sampler draws from (temperature,
then top-k, then top-p over the renormalised top-k set), streamed: on the Triton backend a
forward is ONE kernel (``kernels/vocab/truncated.py``; one pass over each row for top-k
with ``k <= MAX_STREAMED_K``, more for top-p alone, stated there) and a backward is one
kernel that reads each row once and writes its gradient. No row is sorted in memory and
nothing of size ``(N, V)`` is allocated but the gradient. Both are
:class:`fused_rl._ops.FusedOp` (``torch.library`` custom ops for ``torch.compile``, a
direct call in eager mode). The ``reference`` backend sorts (``fused_rl.reference.truncated``).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import NO_CAP, f32_pair, stats_dtype, triton_acc, vocab_launch
from ._ops import FusedOp
from ._shapes import as_rows3d
from .distributed import is_dtensor
from .reference import truncated as ref

# top-k with k up to this is kept in registers in one pass (kernels/vocab/truncated.py KS)
MAX_STREAMED_K = 64
N_CAND = 16  # candidate thresholds per search pass: the key range shrinks 16-fold a pass
SEARCH_BLOCK = 128  # logits per step of a search pass (a (128, 16) comparison tile)
# search passes at most (kernels/vocab/truncated.py ``_search``): up to 3 on evenly spaced
# values, then 4 bits of the key a pass: fp32 keys 32 bits (8), fp64 keys 64 bits (16, plus
# ~3 for the halving that keeps int64 from overflowing)
MAX_SEARCH_PASSES = {torch.float32: 11, torch.float64: 22}
# one warp per row, as the read-only vocab streams (fused_rl._launch.READ_BLOCK_V): the
# per-insertion reductions over the 64 held values are warp shuffles, no shared memory and
# barrier (untuned: no GPU has run this kernel yet)
NUM_WARPS = 1


def _block(vocab: int) -> int:
    """Pass A's block: the read-stream block, at least 64 (one value per group)."""
    return max(MAX_STREAMED_K, vocab_launch(vocab, writes=False)["BLOCK_V"])


# ----------------------------------------------------------------------------- forward


def truncated_logprobs_fwd(
    logits3d: Tensor,
    targets: Tensor,
    top_k: int,
    top_p: float,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the forward on ``(outer, inner, V)`` logits (any strides) and ``(outer,
    inner)`` targets (any strides). ``top_k``: 0 = none (else ``1 <= k < V``); ``top_p``:
    1.0 = none; ``softcap``: None = none, else ``z = c tanh(x / c) / T``.

    Returns ``(logp, stats, passes)``: ``logp`` ``(outer, inner)`` fp32 (fp64 for fp64
    logits); ``stats`` ``(3, outer * inner)``: per row the threshold ``tau`` on ``z = x /
    T`` (kept: ``z >= tau``), the row max ``m`` and ``log F``, ``F = sum_{z >= tau} exp(z -
    m)``; ``passes`` ``(outer * inner,)`` int32, the times the row was read. One launch."""
    from .kernels.vocab.truncated import _truncated_logprobs_fwd_kernel

    outer, inner, vocab = logits3d.shape
    n_rows = outer * inner
    dtype = stats_dtype(logits3d.dtype)
    dev = logits3d.device
    logp = torch.empty((outer, inner), dtype=dtype, device=dev)
    stats = torch.empty((3, n_rows), dtype=dtype, device=dev)
    passes = torch.empty((n_rows,), dtype=torch.int32, device=dev)
    if n_rows == 0:
        return logp, stats, passes
    has_p = top_p < 1.0
    block = _block(vocab)
    _truncated_logprobs_fwd_kernel[(n_rows,)](
        logits3d, targets, logp, stats, passes, inner, n_rows, vocab, *logits3d.stride(),
        *targets.stride(),
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)), *f32_pair(top_p),
        *f32_pair(math.log1p(-top_p) if has_p else 0.0), top_k, ignore_index,
        TOPK_REG=0 < top_k <= MAX_STREAMED_K, SEARCH_K=top_k > MAX_STREAMED_K, TOP_P=has_p,
        HAS_SOFTCAP=softcap is not None,
        BLOCK_V=block, SEARCH_BLOCK=min(SEARCH_BLOCK, block), N_CAND=N_CAND,
        MAX_SEARCH_PASSES=MAX_SEARCH_PASSES[dtype], ACC=triton_acc(logits3d.dtype),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return logp, stats, passes


def _fwd_fake(logits3d, targets, top_k, top_p, temperature, softcap, ignore_index):
    outer, inner, _ = logits3d.shape
    dtype = stats_dtype(logits3d.dtype)
    return (
        logits3d.new_empty((outer, inner), dtype=dtype),
        logits3d.new_empty((3, outer * inner), dtype=dtype),
        logits3d.new_empty((outer * inner,), dtype=torch.int32),
    )


# ----------------------------------------------------------------------------- backward


def truncated_logprobs_bwd(
    logits3d: Tensor,
    targets: Tensor,
    stats: Tensor,
    grad_logp: Tensor,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
) -> Tensor:
    """The gradient w.r.t. ``logits3d`` (a fresh contiguous buffer, its dtype) from the
    forward's ``stats`` and the upstream ``grad_logp`` ``(outer, inner)`` (any strides):
    ``(onehot - p_trunc) g dz/dx`` on the kept set, 0 elsewhere. One launch."""
    grad = torch.empty(logits3d.shape, dtype=logits3d.dtype, device=logits3d.device)
    return truncated_logprobs_bwd_into(
        grad, logits3d, targets, stats, grad_logp, temperature, softcap, ignore_index
    )


def truncated_logprobs_bwd_into(
    grad: Tensor,
    logits3d: Tensor,
    targets: Tensor,
    stats: Tensor,
    grad_logp: Tensor,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    target_kept: bool = False,
) -> Tensor:
    """:func:`truncated_logprobs_bwd` writing into ``grad`` (``logits3d``'s shape and dtype,
    each row contiguous), which may BE ``logits3d``: a program reads its row's target logit,
    then each block of the row once before overwriting exactly that block, so the logits
    are consumed in place (``fused_rl.linear`` turns a chunk's logits into their gradient
    this way). ``stats``: the forward's ``(3, outer * inner)``, contiguous. One launch.
    ``target_kept``: ``grad_logp`` is already 0 where the target is cut (the vocabulary-
    parallel caller, whose target may sit on another rank: ``targets`` are local ids, one
    outside ``[0, V)`` matching no column), so no target logit is read."""
    from .kernels.vocab.truncated import _truncated_logprobs_bwd_kernel

    outer, inner, vocab = logits3d.shape
    if grad.numel() == 0:
        return grad
    _truncated_logprobs_bwd_kernel[(outer * inner,)](
        logits3d, targets, stats, grad_logp, grad, inner, outer * inner, vocab,
        *logits3d.stride(), *grad.stride()[:2], *targets.stride(), *grad_logp.stride(),
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)), ignore_index,
        HAS_SOFTCAP=softcap is not None, TARGET_KEPT=target_kept, ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=True),
    )  # fmt: skip
    return grad


def _bwd_fake(logits3d, *_args):
    return logits3d.new_empty(logits3d.shape)


truncated_logprobs_bwd_op = FusedOp("truncated_logprobs_bwd", truncated_logprobs_bwd)
truncated_logprobs_bwd_op.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    logits3d, targets, _top_k, _top_p, temperature, softcap, ignore_index = inputs
    _, stats, passes = output
    ctx.save_for_backward(logits3d, targets, stats)
    ctx.temperature, ctx.softcap, ctx.ignore_index = temperature, softcap, ignore_index
    ctx.mark_non_differentiable(stats, passes)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, _grad_stats, _grad_passes):
    logits3d, targets, stats = ctx.saved_tensors
    grad = None
    if grad_logp is not None:
        grad = truncated_logprobs_bwd_op(
            logits3d, targets, stats, grad_logp, ctx.temperature, ctx.softcap, ctx.ignore_index
        )
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


truncated_logprobs_fwd_op = FusedOp("truncated_logprobs_fwd", truncated_logprobs_fwd)
truncated_logprobs_fwd_op.register_fake(_fwd_fake)
truncated_logprobs_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API


def _check_top_k(top_k) -> None:
    if top_k is None:
        return
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be None or an int >= 1, got {type(top_k).__name__}")
    if top_k < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def _check_top_p(top_p) -> None:
    if top_p is None:
        return
    if isinstance(top_p, (bool, torch.Tensor)) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be None or a real number in (0, 1], got "
                        f"{type(top_p).__name__}")  # fmt: skip
    if not 0.0 < top_p <= 1.0:  # NaN too
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def check_options(top_k, top_p, temperature, softcap, ignore_index) -> None:
    """The checks of :func:`truncated_logprobs`'s non-tensor arguments (messages naming
    them), shared with ``linear_token_logprobs(top_k=, top_p=)``."""
    _check_top_k(top_k)
    _check_top_p(top_p)
    V.check_positive(temperature, "temperature")
    if softcap is not None:
        V.check_positive(softcap, "softcap")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def cuts(top_k: int | None, top_p: float | None, vocab: int) -> tuple[int, float]:
    """The launchers' ``(top_k, top_p)`` for checked options over ``vocab`` tokens: 0 for no
    top-k (None or ``k >= V``), 1.0 for no top-p."""
    k = 0 if top_k is None or top_k >= vocab else int(top_k)
    return k, 1.0 if top_p is None else float(top_p)


def truncated_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> Tensor:
    """Log-prob of each target under the sampler's truncated distribution (vLLM's order:
    temperature, then top-k, then top-p over the renormalised top-k set), fused, streamed.

    With ``z = logits / temperature`` per row (``z = c tanh(logits / c) / temperature`` with
    ``softcap=c``, the sampler's view of a soft-capped model):

    * **top-k** keeps ``{z >= tau_k}``, ``tau_k`` the k-th largest ``z`` (counted with
      multiplicity). Every token tied AT ``tau_k`` is kept, so more than ``k`` tokens may be
      (vLLM's sampler thresholds on the k-th value the same way). ``None`` or ``k >= V``:
      no top-k.
    * **top-p** then keeps, of those, the smallest set of the most probable tokens whose
      probability (renormalised over the top-k set) sums to at least ``top_p``: in
      descending order the token whose cumulative probability reaches ``top_p`` is kept
      (at least one token always is), **and every token tied with it** -- precisely,
      ``{z >= v*}`` with ``v*`` the largest kept ``z`` such that the tokens with ``z >=
      v*`` hold probability ``>= top_p``. This threshold rule never depends on the order a
      sort gives tied tokens. vLLM's sampler cuts at a position of its (ascending) sort
      (it drops a token when the cumulative probability of it and everything below is
      ``<= 1 - top_p``), so of several tokens tied in probability at the boundary it may
      keep some and drop others; without ties at the boundary the two rules keep the same
      set. ``None`` or ``1.0``: no top-p.

    The result is ``z_y - logsumexp(z over the kept set)`` for a kept target and ``-inf``
    (with zero gradient) for a target outside it; the gradient w.r.t. ``logits`` is
    ``(onehot_y - p_trunc) dz/dx`` on the kept set and 0 elsewhere (the kept set is piecewise
    constant in the logits, as autograd of the masked log-softmax gives).

    Args:
        logits: ``(..., V)`` fp32 / bf16 / fp16 (fp64 for gradcheck), any strides.
        targets: ``logits.shape[:-1]``, int64 or int32, any strides.
        top_k: None or an int ``>= 1``.
        top_p: None or a real number in ``(0, 1]``.
        temperature: logits are divided by it (``> 0``) before both cuts.
        softcap: Gemma-style soft cap ``c`` (a finite ``c > 0``; None = none), applied
            before the temperature, as in :func:`fused_rl.token_logprobs`.
        ignore_index: targets equal to it give 0 and exactly 0 gradient.
        process_group, vocab_start, vocab_size: vocabulary parallelism, as
            :func:`fused_rl.token_logprobs` takes it (``logits`` this rank's shard, or a
            ``DTensor`` placed ``Shard(-1)``; ``targets`` global ids, the same on every
            rank): every rank returns the unsharded call's values and gets its columns of
            the gradient (``fused_rl.truncated_parallel`` gives the collectives: one
            all-gather of ``kk + 8`` floats a token per rank, ``kk = min(k, 64)`` or 64 for
            top-p alone; a search pass, where one is needed, one all-reduce of 32 floats a
            token).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"`` (see ``fused_rl._backend``).

    Returns:
        fp32 tensor of ``targets.shape`` (fp64 for fp64 logits). A row with a NaN or ``+inf``
        logit, or only ``-inf`` ones, gives NaN (and a NaN gradient row); an out-of-range
        target gives NaN (eager mode raises first, see ``fused_rl.config.check_values``).

    Cost on the Triton backend (``E`` bytes per logit), one launch each way: top-k with
    ``k <= MAX_STREAMED_K`` (64), with or without top-p: one read of each row (``V E``), as
    ``token_logprobs``; top-p alone, or top-k > 64: one read when the row's 64 largest
    values already hold ``top_p``, else a search on the threshold (typically 4-6 reads of a
    flat row at V = 32K-152K, at most 13 in fp32; ``kernels/vocab/truncated.py``).
    Backward: one read and one write per row.

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]])
        >>> lp = fused_rl.truncated_logprobs(logits, torch.tensor([1]), top_k=2)
        >>> round(lp.item(), 4)  # tokens 1 and 2 tie at the 2nd value: three are kept
        -1.5514
        >>> fused_rl.truncated_logprobs(logits, torch.tensor([3]), top_k=2).item()
        -inf
    """
    if (
        process_group is not None
        or vocab_start is not None
        or vocab_size is not None
        or (is_dtensor(logits))
    ):
        return _sharded(logits, targets, top_k, top_p, temperature, softcap, ignore_index,
                        process_group, vocab_start, vocab_size, backend)  # fmt: skip
    V.check_logits(logits)
    V.check_targets(targets, logits)
    check_options(top_k, top_p, temperature, softcap, ignore_index)
    vocab = logits.shape[-1]
    V.check_target_range(targets, vocab, ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    k, p = cuts(top_k, top_p, vocab)
    cap = None if softcap is None else float(softcap)
    if which == "reference":
        return ref.truncated_logprobs(
            logits, targets, top_k=k or None, top_p=p, temperature=float(temperature),
            softcap=cap, ignore_index=int(ignore_index),
        )  # fmt: skip
    logits3d = as_rows3d(logits)
    t2d = targets.reshape(logits3d.shape[:2])
    logp, _, _ = truncated_logprobs_fwd_op(
        logits3d, t2d, k, p, float(temperature), cap, int(ignore_index)
    )
    return logp.reshape(targets.shape)


def _sharded(logits, targets, top_k, top_p, temperature, softcap, ignore_index, process_group,
             vocab_start, vocab_size, backend) -> Tensor:  # fmt: skip
    """:func:`truncated_logprobs` of a vocabulary shard (``fused_rl.truncated_parallel``)."""
    from .distributed import resolve_shard
    from .truncated_parallel import sharded_truncated_logprobs

    logits, targets, shard = resolve_shard(logits, targets, process_group, vocab_start, vocab_size)
    if shard is None:  # a DTensor replicated over the vocabulary: an ordinary call
        return truncated_logprobs(
            logits, targets, top_k=top_k, top_p=top_p, temperature=temperature,
            softcap=softcap, ignore_index=ignore_index, backend=backend,
        )  # fmt: skip
    if logits.dim() >= 1 and logits.shape[-1] == 0:  # a vocabulary shard may be empty
        V.check_float(logits, "logits")
    else:
        V.check_logits(logits)
    V.check_targets(targets, logits)
    check_options(top_k, top_p, temperature, softcap, ignore_index)
    k, p = cuts(top_k, top_p, shard.vocab_size)
    return sharded_truncated_logprobs(
        logits, targets, shard, top_k=k, top_p=p, temperature=float(temperature),
        softcap=softcap, ignore_index=int(ignore_index),
        which=resolve_backend(backend, logits, targets),
    )  # fmt: skip


__all__ = ["MAX_STREAMED_K", "truncated_logprobs"]
