"""The vocab-stream ops shared by every public op that reads logits (private).

* ``token_stats_fwd`` -- layer 1: per-token ``logp``, ``entropy`` and the softmax normaliser
  (row max ``m`` and ``log s``, ``lse = m + log s``), one read of the logits;
  ``token_extras_fwd`` the same kernel with the per-token diagnostics (mean logit,
  ``log sum p^2``, target is the argmax) from that read;
* ``token_stats_bwd`` -- layer 3: ``dL/dlogits`` from per-token ``g = dL/dlogp`` and
  ``h = dL/dH``, one read of the logits and one write of the gradient.

Each is a :class:`fused_rl._ops.FusedOp` (a ``torch.library`` custom op for
``torch.compile``, a direct call in eager mode).

Positions: the logits may carry more positions than there are targets, ``(B, S, V)`` for
``(B, T)`` targets with ``S > T``: position ``S - T - 1 + t`` predicts target ``t`` (the
causal-LM shift: the last position predicts past the sequence, earlier ones belong to the
prompt). The backward then writes the gradient of the whole buffer, zero outside the
window, so no slice backward (a second full-size gradient plus a copy) ever runs.

Scaling: every op takes ``temperature`` and ``softcap`` (None: no cap): the softmax is over
``z = x / T``, or ``z = c tanh(x / c) / T`` with the soft cap ``c`` (Gemma's logit
soft-capping, applied before the temperature).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._launch import NO_CAP, f32_pair, stats_dtype, triton_acc, vocab_launch
from ._ops import FusedOp, _differentiable_once, _serialised_when_interpreting, _tracing
from ._shapes import as_rows3d
from .reference import logprobs as ref
from .reference.logprobs import check_inplace_version, differentiable_once


def position_shift(positions: int, n_targets: int) -> int:
    """Offset of the logits position that predicts target 0: ``S - T - 1`` when ``S > T``."""
    return positions - n_targets - 1 if positions > n_targets else 0


def check_targets_window(targets: Tensor, logits: Tensor, name: str = "targets") -> None:
    """``targets`` of shape ``logits.shape[:-1]``, or ``(..., T)`` for ``(..., S, V)`` logits
    with ``S > T`` (the model's whole buffer; see the module docstring)."""
    V.check_tensor(targets, name)
    if targets.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"{name} must be an int64 or int32 tensor, got {targets.dtype}")
    shape, lshape = tuple(targets.shape), tuple(logits.shape)
    windowed = (
        len(shape) >= 1
        and len(lshape) == len(shape) + 1
        and lshape[:-2] == shape[:-1]
        and lshape[-2] > shape[-1]
    )
    if shape != lshape[:-1] and not windowed:
        raise ValueError(
            f"{name} must have shape logits.shape[:-1] = {lshape[:-1]}, or (..., T) with "
            f"T < S for logits (..., S, V) carrying the model's whole sequence; got {shape}"
        )
    V.check_same_device(logits=logits, **{name: targets})


def window(logits: Tensor, n_targets: int) -> Tensor:
    """The ``(..., T, V)`` positions that predict ``T`` targets (a view, for the reference)."""
    shift = position_shift(logits.shape[-2], n_targets)
    return logits.narrow(-2, shift, n_targets)


# ----------------------------------------------------------------------------- layer 1


def token_stats_fwd(
    logits3d: Tensor,
    targets: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the layer-1 kernel on ``(outer, S, V)`` logits (any strides) for ``(outer, T)``
    targets (any strides; None: every position, ``T = S``).

    Returns ``(logp, entropy, row_max, log_sum)``, each ``(outer, T)``; ``logp`` /
    ``entropy`` are empty when not asked for (no targets / ``with_entropy=False``).
    """
    return _layer1(logits3d, targets, temperature, softcap, ignore_index, with_entropy, False)


def token_extras_fwd(
    logits3d: Tensor, targets: Tensor, temperature: float, softcap: float | None,
    ignore_index: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`token_stats_fwd` with the entropy and, from the same read of each row, the
    per-token diagnostics: ``(logp, entropy, row_max, log_sum, mean_logit,
    log_sum_sq_probs, is_top1, raw_max)``, each ``(outer, T)`` (``is_top1`` bool;
    ``raw_max``: the max of the logits as stored, NaN for a row holding a NaN, for the
    vocabulary-parallel merge). ``logp`` and ``entropy`` are differentiable (layer 3, the
    op's autograd), the rest not."""
    return _layer1(logits3d, targets, temperature, softcap, ignore_index, True, True)


def _layer1(logits3d, targets, temperature, softcap, ignore_index, with_entropy, extras):
    from .kernels.vocab.layer1 import _token_stats_fwd_kernel

    outer, positions, vocab = logits3d.shape
    inner = positions if targets is None else targets.shape[1]
    dtype = stats_dtype(logits3d.dtype)
    dev = logits3d.device
    shape, none = (outer, inner), (0,)
    logp = torch.empty(shape if targets is not None else none, dtype=dtype, device=dev)
    entropy = torch.empty(shape if with_entropy else none, dtype=dtype, device=dev)
    row_max = torch.empty(shape, dtype=dtype, device=dev)
    log_sum = torch.empty(shape, dtype=dtype, device=dev)
    more = ()
    if extras:  # mean logit, log sum p^2, top-1, raw max
        more = tuple(torch.empty(shape, dtype=dt, device=dev)
                     for dt in (dtype, dtype, torch.bool, dtype))  # fmt: skip
    if outer * inner == 0:
        return (logp, entropy, row_max, log_sum) + more
    tgt = targets if targets is not None else row_max
    mean, log_sq, top1, raw_max = more if extras else (row_max,) * 4
    _token_stats_fwd_kernel[(outer * inner,)](
        logits3d, tgt, logp, entropy, row_max, log_sum, mean, log_sq,
        top1.view(torch.uint8) if extras else top1, raw_max,
        inner, position_shift(positions, inner), vocab, *logits3d.stride(), *tgt.stride(),
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)), ignore_index,
        HAS_TARGETS=targets is not None, WITH_ENTROPY=with_entropy, WITH_EXTRAS=extras,
        HAS_SOFTCAP=softcap is not None, ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=False),
    )  # fmt: skip
    return (logp, entropy, row_max, log_sum) + more


def _fwd_fake(logits3d, targets, temperature, softcap, ignore_index, with_entropy):
    outer, positions, _ = logits3d.shape
    inner = positions if targets is None else targets.shape[1]
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    return new(targets is not None), new(with_entropy), new(True), new(True)


def _extras_fake(logits3d, targets, temperature, softcap, ignore_index):
    logp, entropy, row_max, log_sum = _fwd_fake(
        logits3d, targets, temperature, softcap, ignore_index, True
    )
    return (logp, entropy, row_max, log_sum, torch.empty_like(logp), torch.empty_like(logp),
            torch.empty_like(logp, dtype=torch.bool), torch.empty_like(logp))  # fmt: skip


# ----------------------------------------------------------------------------- layer 3


def token_stats_bwd(
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    seq_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    ref_logits: Tensor | None = None,
    kl_stats: Tensor | None = None,
) -> Tensor:
    """Launch the layer-3 kernel: the gradient w.r.t. the whole ``(outer, S, V)`` buffer
    (contiguous, its dtype), zero at positions that predict no target.

    ``row_max``, ``log_sum``: the forward's softmax normaliser ``(outer, T)``; ``entropy``: its
    ``H`` (needed with ``h``); ``g``, ``h``: per-token ``dL/dlogp`` and ``dL/dH``, any strides
    (None = zero); ``scale``: optional 0-dim tensor multiplying both (the upstream gradient of
    a fused scalar loss); ``seq_scale``: optional ``(outer,)`` or ``(1,)`` (one for all)
    multiplying both (the loss aggregation's normaliser). ``ref_logits`` ``(outer, S_r, V)``
    with ``kl_stats`` ``(4, outer * T)`` (the policy forward's, ``kl_estimator="full"``):
    add the exact KL's term ``k p (-delta - KL)`` (``kernels/vocab/layer3.py``).
    """
    grad = torch.empty(logits3d.shape, dtype=logits3d.dtype, device=logits3d.device)
    return token_stats_bwd_into(
        grad, logits3d, targets, row_max, log_sum, entropy, g, h, scale, seq_scale,
        temperature, softcap, ignore_index, ref_logits, kl_stats,
    )  # fmt: skip


def token_stats_bwd_into(
    grad: Tensor,
    logits3d: Tensor,
    targets: Tensor | None,
    row_max: Tensor,
    log_sum: Tensor,
    entropy: Tensor | None,
    g: Tensor | None,
    h: Tensor | None,
    scale: Tensor | None,
    seq_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    ref_logits: Tensor | None = None,
    kl_stats: Tensor | None = None,
) -> Tensor:
    """:func:`token_stats_bwd` writing into ``grad`` (``logits3d``'s shape and dtype, each
    row contiguous: any row strides), which may BE ``logits3d``: each program reads a block
    of its own row and then overwrites exactly that block, so the logits are consumed in
    place (the fused-linear ops turn a chunk's logits into its gradient this way, and
    ``inplace=True`` the model's logits)."""
    from .kernels.vocab.layer3 import _token_stats_bwd_kernel

    outer, positions, vocab = logits3d.shape
    inner = row_max.shape[1]
    if grad.numel() == 0:
        return grad
    dummy = row_max
    strides = lambda t: t.stride() if t is not None else (0, 0)
    seq_stride = 0 if seq_scale is None or seq_scale.numel() == 1 else seq_scale.stride(0)
    has_kl = ref_logits is not None
    _token_stats_bwd_kernel[(outer * positions,)](
        logits3d,
        targets if targets is not None else dummy,
        grad,
        row_max,
        log_sum,
        entropy if h is not None else dummy,
        g if g is not None else dummy,
        h if h is not None else dummy,
        scale if scale is not None else dummy,
        seq_scale if seq_scale is not None else dummy,
        ref_logits if has_kl else dummy,
        kl_stats if has_kl else dummy,
        inner,
        positions,
        position_shift(positions, inner),
        position_shift(ref_logits.shape[1], inner) if has_kl else 0,
        vocab,
        *logits3d.stride(),
        *grad.stride()[:2],
        *strides(targets),
        *strides(g),
        *strides(h),
        seq_stride,
        *(ref_logits.stride() if has_kl else (0, 0, 0)),
        outer * inner,
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)),
        ignore_index,
        HAS_TARGETS=targets is not None,
        HAS_G=g is not None and targets is not None,
        HAS_H=h is not None,
        HAS_SCALE=scale is not None,
        HAS_SEQ_SCALE=seq_scale is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_KL=has_kl,
        ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=True),
    )
    return grad


SCALE_PROGRAMS = 1024  # programs of the grid-stride scaling launch (a few per SM)


def scale_rows_unless_one(grad3d: Tensor, scale: Tensor) -> Tensor:
    """``grad3d *= scale`` in place, ``scale`` a 0-dim tensor read on the device: ONE launch
    whose programs return at once when it is exactly 1 (no byte of ``grad3d`` read or
    written, no host sync), else scale ``grad3d``'s rows (``(outer, S, V)``, each row
    contiguous, any row strides). The backward of a loss whose gradient was formed in the
    forward (``policy_loss(grad_in_forward=True)``)."""
    from .kernels.vocab.layer3 import _scale_rows_unless_one_kernel

    outer, positions, vocab = grad3d.shape
    n_rows = outer * positions
    if n_rows * vocab == 0:
        return grad3d
    _scale_rows_unless_one_kernel[(min(n_rows, SCALE_PROGRAMS),)](
        grad3d, scale, n_rows, positions, vocab, *grad3d.stride()[:2],
        ACC=triton_acc(grad3d.dtype), **vocab_launch(vocab, writes=True),
    )  # fmt: skip
    return grad3d


def _bwd_fake(logits3d, *_args):
    return logits3d.new_empty(logits3d.shape)


token_stats_bwd_op = FusedOp("token_stats_bwd", token_stats_bwd)
token_stats_bwd_op.register_fake(_bwd_fake)


# ----------------------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    logits3d, targets, temperature, softcap, ignore_index, with_entropy = inputs
    _, entropy, row_max, log_sum = output
    ctx.save_for_backward(logits3d, targets, row_max, log_sum, entropy)
    ctx.temperature, ctx.softcap = temperature, softcap
    ctx.ignore_index, ctx.with_entropy = ignore_index, with_entropy
    ctx.mark_non_differentiable(row_max, log_sum)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_logp, grad_entropy, _grad_max, _grad_log_sum):
    logits3d, targets, row_max, log_sum, entropy = ctx.saved_tensors
    if targets is None:
        grad_logp = None
    if not ctx.with_entropy:
        grad_entropy = None
    grad = token_stats_bwd_op(
        logits3d, targets, row_max, log_sum,
        entropy if grad_entropy is not None else None, grad_logp, grad_entropy, None, None,
        ctx.temperature, ctx.softcap, ctx.ignore_index,
    )  # fmt: skip
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


token_stats_fwd_op = FusedOp("token_stats_fwd", token_stats_fwd)
token_stats_fwd_op.register_fake(_fwd_fake)
token_stats_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def _extras_setup_context(ctx, inputs, output):
    _setup_context(ctx, (*inputs, True), output[:4])
    ctx.mark_non_differentiable(*output[2:])  # the normaliser and the diagnostics


def _extras_backward(ctx, grad_logp, grad_entropy, *_grad_diagnostics):
    return _backward(ctx, grad_logp, grad_entropy, None, None)


# the same kernel with the per-token diagnostics (not differentiable; logp and entropy are)
token_extras_fwd_op = FusedOp("token_extras_fwd", token_extras_fwd)
token_extras_fwd_op.register_fake(_extras_fake)
token_extras_fwd_op.register_autograd(_extras_backward, setup_context=_extras_setup_context)


# ----------------------------------------------------------------------------- inplace=True
#
# The backward writes dL/dlogits INTO the logits buffer (layer 3 with ``grad`` = the logits:
# each program reads a block of its row before it overwrites it) and hands that buffer on as
# the gradient, so the loss step allocates no (N, V) gradient. Eager only: a traced op may
# not write into its input (the functionalised graph would copy the gradient back, the very
# buffer this saves), so the public functions raise under tracing (check_inplace).


def check_inplace(logits: Tensor, op: str, inplace=True) -> None:
    """What ``inplace=True`` needs of ``logits`` (raises naming ``inplace`` and ``logits``):
    an eager call (not ``torch.compile`` / ``make_fx`` / ``torch.export``), a backward to
    run (grad mode on, ``logits.requires_grad``), and a buffer the kernel can write whole:
    the vocabulary dimension contiguous (stride 1) and no two elements at one address
    (``logits[:, :-1]`` and other slices are fine: the kernel writes exactly the rows it
    reads; a transposed, ``expand``-ed or overlapping view is not)."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {inplace!r}")
    if torch.compiler.is_compiling() or _tracing():
        raise RuntimeError(
            f"{op}(inplace=True) is eager-only: under torch.compile, make_fx or torch.export a "
            "traced op may not write into its input logits (the graph would copy the "
            "gradient back into them, allocating the (N, V) buffer inplace=True saves). Call "
            "without inplace=True inside a compiled region"
        )
    if not (torch.is_grad_enabled() and logits.requires_grad):
        why = "logits do not require grad" if torch.is_grad_enabled() else "grad mode is off"
        raise ValueError(
            f"{op}(inplace=True) writes the gradient w.r.t. logits into logits in the "
            f"backward, but there is no backward ({why}): drop inplace=True"
        )
    shape, strides = logits.shape, logits.stride()
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"inplace=True needs logits whose vocabulary (last) dimension is contiguous "
            f"(stride 1), got strides {strides} for shape {tuple(shape)}: a transposed or "
            "strided view cannot take its gradient in place (pass a contiguous buffer, or "
            "call without inplace=True)"
        )
    dims = sorted((st, n) for st, n in zip(strides, shape) if n > 1)
    extent = 1
    for st, n in dims:  # each dimension steps past everything the smaller strides span
        if st < extent:
            raise ValueError(
                f"inplace=True needs logits whose elements do not overlap in memory, got "
                f"strides {strides} for shape {tuple(shape)} (an expand()-ed or as_strided "
                "view): the gradient of several elements would land at one address"
            )
        extent = st * n
    if logits.dim() > 3:  # as_rows3d merges the leading dimensions: a view, or a copy
        try:
            logits.view(shape[:-2].numel(), *shape[-2:])
        except RuntimeError:
            raise ValueError(
                f"inplace=True needs logits whose leading dimensions merge into one without "
                f"a copy (shape {tuple(shape)}, strides {strides}): the gradient would be "
                "written into the copy"
            ) from None


def keep_for_inplace(ctx, logits3d: Tensor) -> None:
    """Hold the logits on ``ctx`` (not ``save_for_backward``: the version check is
    :func:`take_for_inplace`'s, naming ``inplace``) with their version now."""
    ctx.inplace_logits, ctx.inplace_version = logits3d, logits3d._version


def take_for_inplace(ctx) -> Tensor:
    """The logits held by :func:`keep_for_inplace`, after checking that nothing wrote into
    them since (raises naming ``inplace``)."""
    logits3d = ctx.inplace_logits
    check_inplace_version(logits3d, ctx.inplace_version)
    return logits3d


def hand_back(logits3d: Tensor, *sources) -> Tensor:
    """The logits, now holding their gradient, as the gradient: their version advanced (an
    op that saved them for a later backward raises instead of reading a gradient as
    logits), a fresh alias (autograd's accumulation into a leaf's ``.grad`` takes it
    as it is, no copy), marked differentiable once."""
    torch.autograd.graph.increment_version(logits3d)
    return differentiable_once(logits3d.detach(), logits3d, *sources)


_token_stats_fwd = _serialised_when_interpreting(token_stats_fwd)
_token_stats_bwd_into = _serialised_when_interpreting(token_stats_bwd_into)


def _inplace_backward(ctx, grad_logp, grad_entropy, _grad_max, _grad_log_sum):
    logits3d = take_for_inplace(ctx)
    targets, row_max, log_sum, entropy = ctx.saved_tensors
    if targets is None:
        grad_logp = None
    if not ctx.with_entropy:
        grad_entropy = None
    _token_stats_bwd_into(
        logits3d, logits3d, targets, row_max, log_sum,
        entropy if grad_entropy is not None else None, grad_logp, grad_entropy, None, None,
        ctx.temperature, ctx.softcap, ctx.ignore_index,
    )  # fmt: skip
    grad = hand_back(logits3d, grad_logp, grad_entropy)
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


class TokenStatsInplace(torch.autograd.Function):
    """``token_stats_fwd_op`` with ``inplace=True``: the same layer-1 forward; the layer-3
    backward writes the gradient into the logits and returns them (eager only)."""

    @staticmethod
    def forward(ctx, logits3d, targets, temperature, softcap, ignore_index, with_entropy):
        output = _token_stats_fwd(
            logits3d, targets, temperature, softcap, ignore_index, with_entropy
        )
        _, entropy, row_max, log_sum = output
        ctx.save_for_backward(targets, row_max, log_sum, entropy)
        keep_for_inplace(ctx, logits3d)
        ctx.temperature, ctx.softcap = temperature, softcap
        ctx.ignore_index, ctx.with_entropy = ignore_index, with_entropy
        ctx.mark_non_differentiable(row_max, log_sum)
        ctx.set_materialize_grads(False)
        return output

    backward = staticmethod(_differentiable_once(_inplace_backward))


# ----------------------------------------------------------------------------- K targets a row


class MultiTargetLogprobs(torch.autograd.Function):
    """``(outer, T, K)`` log-probs of ``K`` ids a row of ``(outer, T, V)`` logits (no soft
    cap, no window), fp32 (fp64 for fp64 logits), from ONE read of each row forward and one
    read and write backward, whatever ``K`` (TRL's ``selective_log_softmax`` with a
    ``(..., K)`` index).

    Forward: layer 1 for the row's normaliser ``lse`` (``row_max + log_sum``), then a gather
    of the ``K`` logits: ``logp_k = z_k / T - lse``. Backward, with ``G = sum_k g_k``: layer 3
    for the first id and upstream ``G`` writes ``-p G / T`` over the row, then the ``K``
    columns are overwritten with their exact values ``(sum_{j: id_j = id_k} g_j - p_k G) / T``
    computed in fp32: every element of the gradient is rounded to the logits' dtype once
    (a sum of ``K`` per-id gradients in bf16 would round ``K`` times).

    ``safe``: ``(outer, T, K)`` int64 ids in ``[0, V)``; ``first``: ``(outer, T)``, ``safe``'s
    first id, or ``ignore_index`` where none of the row's ids counts (the row is not read:
    its outputs are meaningless, its gradient 0). The caller zeroes the outputs that do not
    count, so their upstream gradient is 0."""

    @staticmethod
    def forward(ctx, logits3d, safe, first, temperature, ignore_index):
        _, _, row_max, log_sum = token_stats_fwd_op(
            logits3d, first, temperature, None, ignore_index, False
        )
        z = logits3d.gather(-1, safe).to(row_max.dtype)  # scaled as layer 1 scales them
        logp = (z * (1.0 / temperature) - row_max[..., None]) - log_sum[..., None]
        ctx.save_for_backward(logits3d, safe, first, row_max, log_sum, logp)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.set_materialize_grads(False)
        return logp

    @staticmethod
    @_differentiable_once
    def backward(ctx, grad_logp):
        n_inputs = len(ctx.needs_input_grad)
        if grad_logp is None:
            return (None,) * n_inputs
        logits3d, safe, first, row_max, log_sum, logp = ctx.saved_tensors
        g = grad_logp.to(logp.dtype)
        total = g.sum(-1)
        grad = token_stats_bwd_op(
            logits3d, first, row_max, log_sum, None, total, None, None, None,
            ctx.temperature, None, ctx.ignore_index,
        )  # fmt: skip
        counted = first != ctx.ignore_index
        scatter_exact_id_grads(grad, safe, None, g, logp, total, ctx.temperature, counted)
        return (grad,) + (None,) * (n_inputs - 1)


def scatter_exact_id_grads(grad, ids, owned, g, logp, total, temperature, counted) -> None:
    """Overwrite the ids' columns of ``grad`` (``(..., V)``, holding ``-p G / T``) with their
    exact values ``(sum_{j: id_j = id_k} g_j - p_k G) / T``, computed in fp32 and rounded
    once. ``ids``: ``(..., K)`` column ids; ``owned``: None (every id is a column of
    ``grad``) or a bool ``(..., K)``, the ids that are (a vocabulary shard's): the others
    are not written. ``counted``: ``(...)``, rows whose ids count (0 in the others)."""
    if owned is not None:  # not-owned ids sort last, as one run of their own, never written
        ids = torch.where(owned, ids, grad.shape[-1])
    ids, order = ids.sort(-1)  # an id the row names twice: adjacent slots, one column
    g_id = _segment_sums(ids, g.gather(-1, order))
    exact = (g_id - logp.gather(-1, order).exp() * total[..., None]) * (1.0 / temperature)
    exact = torch.where(counted[..., None], exact, 0.0).to(grad.dtype)
    if owned is not None:
        # a not-owned slot writes what its row's first slot writes: that slot's exact value
        # at its column if it is owned (the smallest owned id), else column 0's own value
        mine = owned.gather(-1, order)
        lead = mine[..., :1]
        col = torch.where(lead, ids[..., :1], 0)
        val = torch.where(lead, exact[..., :1], grad[..., :1])
        ids = torch.where(mine, ids, col)
        exact = torch.where(mine, exact, val)
    grad.scatter_(-1, ids, exact)  # equal values where columns repeat


def _segment_sums(ids: Tensor, g: Tensor) -> Tensor:
    """``(..., K)``: for each slot, the sum of ``g`` over the slots holding its id (``ids``
    sorted along the last dim, so equal ids are adjacent). A segmented scan in
    ``ceil(log2 K)`` steps (each slot adds the partial sum ``s`` slots back when that slot
    holds its id: sorted, so every slot between does too), then each run's total read at
    its last slot: only a run's own values are ever added (no running sum over the other
    ids to subtract), deterministic (no atomics)."""
    k = ids.shape[-1]
    run = g
    step = 1
    while step < k:
        same = ids[..., step:] == ids[..., :-step]
        back = torch.where(same, run[..., :-step], 0.0)
        run = torch.cat((run[..., :step], run[..., step:] + back), -1)
        step *= 2
    ends = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    ends[..., :-1] = ids[..., 1:] != ids[..., :-1]
    pos = torch.arange(k, device=ids.device).expand(ids.shape)
    last = torch.where(ends, pos, k - 1).flip(-1).cummin(-1).values.flip(-1)
    return run.gather(-1, last)


# ----------------------------------------------------------------------------- callers


def token_stats_nocheck(
    logits: Tensor,
    targets: Tensor,
    temperature: float,
    ignore_index: int,
    with_entropy: bool,
    which: str,
    softcap: float | None = None,
    inplace: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy or None)`` on already validated arguments and a resolved backend
    (the fused losses call this so the eager target-range check, a host sync, runs once).
    ``inplace``: the backward writes the gradient into ``logits`` (checked by
    :func:`check_inplace`); the reference computes it apart and copies it in
    (``reference.logprobs.GradIntoInput``)."""
    if which == "reference":
        if inplace:  # around the whole buffer: the window's complement gets its zeros too
            logits = ref.GradIntoInput.apply(logits)
        if targets.shape != logits.shape[:-1]:
            logits = window(logits, targets.shape[-1])
        logp, entropy = ref.token_stats(
            logits, targets, temperature=temperature, ignore_index=ignore_index,
            softcap=softcap, inplace=inplace,
        )  # fmt: skip
        return logp, entropy if with_entropy else None
    logits3d = as_rows3d(logits)
    n_targets = targets.shape[-1] if targets.dim() > 0 else 1
    t2d = targets.reshape(logits3d.shape[0], n_targets if logits.dim() > 1 else 1)
    op = TokenStatsInplace.apply if inplace else token_stats_fwd_op
    logp, entropy, _, _ = op(
        logits3d, t2d, float(temperature), None if softcap is None else float(softcap),
        int(ignore_index), bool(with_entropy),
    )  # fmt: skip
    logp = logp.reshape(targets.shape)
    return logp, entropy.reshape(targets.shape) if with_entropy else None
