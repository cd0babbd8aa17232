"""The truncated log-prob launchers (``fused_rl.truncated``'s ops layer): the forward and
backward of ``kernels/vocab/truncated.py`` as :class:`fused_rl._ops.FusedOp` custom ops, their
launch constants, and the raw backward launcher that may write over its input. The public
API, its rules and its cost are in ``fused_rl.truncated``; the vocabulary-parallel route in
``fused_rl.truncated_parallel``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._launch import COMPILE_OPTIONS, NO_CAP, f32_pair, stats_dtype, triton_acc, vocab_launch
from ._ops import FusedOp, _serialised_when_interpreting

# top-k with k up to this is kept in registers in one pass (kernels/vocab/truncated.py KS)
MAX_STREAMED_K = 64
N_CAND = 16  # candidate thresholds per search pass: the key range shrinks 16-fold a pass
# a search pass's step: 16 candidates against SEARCH_BLOCK columns of 16 bytes each (8 bf16 /
# fp16 logits, 4 fp32, 2 fp64; kernels/vocab/truncated.py ``_bracket_sums``): 1 KiB a step
# of 16-bit logits; 32 columns for wider ones, whose fp32 / fp64 values take more registers,
# and 16 with the soft cap (its tanh's temporaries): the largest steps whose forward as
# launched keeps every value in registers (Triton 3.9's sm_90 cubins: at 64 columns an fp64
# row's forward spilled to an 80-byte stack, at 32 a soft-capped bf16 row's to 16 bytes)
SEARCH_BLOCK = {16: 64, 32: 32, 64: 32}
SOFTCAP_SEARCH_BLOCK = 16


def search_block(dtype: torch.dtype, softcap: float | None) -> int:
    """The search pass's ``SEARCH_BLOCK`` for ``dtype`` logits (with ``softcap`` or not)."""
    return SEARCH_BLOCK[torch.finfo(dtype).bits] if softcap is None else SOFTCAP_SEARCH_BLOCK


# search passes at most (kernels/vocab/truncated.py ``_search``): up to 3 on evenly spaced
# values, then 4 bits of the key a pass: fp32 keys 32 bits (8), fp64 keys 64 bits (16, plus
# ~3 for the halving that keeps int64 from overflowing); bf16 / fp16 logits without the soft
# cap are searched on their own 16-bit keys (4): :func:`max_search_passes`
MAX_SEARCH_PASSES = {torch.float32: 11, torch.float64: 22}
MAX_SEARCH_PASSES_16BIT = 7


def max_search_passes(dtype: torch.dtype, softcap: float | None) -> int:
    """The most search passes a row of ``dtype`` logits takes (the loop's bound; the
    vocabulary-parallel route runs them all where it cannot stop early)."""
    if torch.finfo(dtype).bits == 16 and softcap is None:
        return MAX_SEARCH_PASSES_16BIT
    return MAX_SEARCH_PASSES[stats_dtype(dtype)]


# one warp per row, as the read-only vocab streams (fused_rl._launch.READ_BLOCK_V): the
# per-insertion reductions over the 64 held values are warp shuffles, no shared memory and
# barrier (on an H200, 2026-11-28: top-k 50 without grad 2.2x the plain pass's time at
# 8 x 2048 x 151936 bf16, at its bytes: the upkeep is arithmetic; not tuned further)
NUM_WARPS = 1


def scale_args(temperature: float, softcap: float | None) -> tuple[float, float, float, float]:
    """The truncated kernels' ``(inv_t_hi, inv_t_lo, inv_cap_hi, inv_cap_lo)``: ``1 / T``, or
    ``c / T`` and ``1 / c`` with the soft cap (``kernels/vocab/layer1.py`` ``scaled_logits``;
    ``fused_rl._launch.NO_CAP`` without one)."""
    inv_t = f32_pair(1.0 / temperature if softcap is None else softcap / temperature)
    return (*inv_t, *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)))


def _block(vocab: int) -> int:
    """Pass A's block: a heavy read stream's (``fused_rl._launch.HEAVY_READ_BLOCK_V``), at
    least 64 (one value per group)."""
    return max(MAX_STREAMED_K, vocab_launch(vocab, writes=False, heavy=True)["BLOCK_V"])


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
        *targets.stride(), *scale_args(temperature, softcap), *f32_pair(top_p),
        *f32_pair(math.log1p(-top_p) if has_p else 0.0), top_k, ignore_index,
        TOPK_REG=0 < top_k <= MAX_STREAMED_K, SEARCH_K=top_k > MAX_STREAMED_K, TOP_P=has_p,
        HAS_SOFTCAP=softcap is not None,
        BLOCK_V=block, SEARCH_BLOCK=search_block(logits3d.dtype, softcap), N_CAND=N_CAND,
        MAX_SEARCH_PASSES=max_search_passes(logits3d.dtype, softcap),
        ACC=triton_acc(logits3d.dtype),
        num_warps=NUM_WARPS, **COMPILE_OPTIONS,
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
        *scale_args(temperature, softcap), ignore_index,
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


# the backward writing over its input (a raw launcher, not a custom op: it mutates), its
# interpreted launches serialised (fused_rl._ops)
truncated_bwd_into = _serialised_when_interpreting(truncated_logprobs_bwd_into)
