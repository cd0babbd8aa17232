"""On-policy distillation losses from student and teacher logits: ``distill_loss``.

The divergence of TRL's ``GKDTrainer.generalized_jsd_loss`` (forward KL, reverse KL or the
generalized Jensen-Shannon divergence of both softmaxes) per token, aggregated over counted
tokens by ``loss_agg``, streamed over the vocabulary: on the Triton backend a forward is the
vocab kernel ``kernels/vocab/distill.py`` (one pass over both rows for ``beta`` in {0, 1},
two for the general ``beta``) and one reduction that finishes the loss and every metric;
a backward is one kernel that reads both rows once and writes the student's gradient.
Nothing of size ``(N, V)`` is allocated beyond the inputs and that gradient. Both are
:class:`fused_rl._ops.FusedOp` (``torch.library`` custom ops for ``torch.compile``, a
direct call in eager mode). The ``reference`` backend is the same math in plain PyTorch.

The same kernels run on chunks of logits for :func:`fused_rl.linear_distill_loss`
(``distill_rows_fwd``, ``distill_rows_grad_into`` / ``distill_rows_grad_fwd``,
``distill_finalize``: "chunk rows" below), and with log-probability inputs taken as free
coordinates (the backward kernel's ``FREE``) for ``fused_rl.compat.liger.liger_jsd``.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from . import _validation as V
from ._agg import check_loss_agg, masked_mean_all, poison_empty, token_weights
from ._backend import resolve_backend
from ._launch import (
    COMPILE_OPTIONS,
    NO_CAP,
    NO_NUM_ITEMS,
    f32_pair,
    stats_dtype,
    triton_acc,
    vocab_launch,
)
from ._mixture_poly import near_polynomials
from ._ops import FusedOp
from ._policy_inputs import num_items_args, weights_of
from ._shapes import as_rows3d
from .distributed import (
    _dist,
    _header,
    _layout_error,
    _layout_ok,
    check_vocab_limit,
    is_dtensor,
    resolve_shard,
)
from .kernels.modes import LOSS_AGG_MODES, MIX_NEAR_DEGREE
from .reference import distill as ref
from .reference.logprobs import differentiable_once
from .reference.reductions import acc_dtype

# the kernels' MODE (kernels/vocab/distill.py MODE_*), by ``beta``: 0, 1, anything between
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
# the partial columns (kernels/vocab/distill.py COL_*) and so the finalize kernel's outputs
COLUMNS = ("jsd", "forward_kl", "reverse_kl", "student_entropy", "teacher_entropy", "count")
METRICS = COLUMNS[:-1]
N_STATS = 6  # per-row statistics saved for the backward (kernels/vocab/distill.py STAT_*)
FINALIZE_BLOCK_B, FINALIZE_BLOCK_T = 16, 128
_SEQ_MEAN_TOKEN_MEAN = LOSS_AGG_MODES.index("seq-mean-token-mean")


def divergence_mode(beta: float) -> int:
    """The kernel's ``MODE`` for ``beta``: forward KL at 0, reverse KL at 1, else the JSD
    (TRL's ``beta == 0`` / ``beta == 1`` tests, exactly)."""
    return 0 if beta == 0 else 1 if beta == 1 else 2


def mixture_constants(beta: float) -> tuple[float, ...]:
    """The distillation kernels' ``mix`` tuple for ``beta``: ``beta``, ``1 - beta``,
    ``log beta``, ``log(1 - beta)`` as fp32 pairs (``f32_pair``), then ``A`` and ``H`` of
    :func:`near_polynomials` (fp32 launch arguments, rounded there: the fp32 kernels' near
    form; fp64 launches use series instead). Outside the JSD (``beta`` 0 or 1) the logs and
    polynomials are 0."""
    if 0.0 < beta < 1.0:
        logs = (math.log(beta), math.log1p(-beta))
        a, h = near_polynomials(beta)
    else:
        logs, a, h = (0.0, 0.0), (0.0,) * (MIX_NEAR_DEGREE + 1), (0.0,) * (MIX_NEAR_DEGREE + 1)
    pairs = (beta, 1.0 - beta, *logs)
    return (*(half for v in pairs for half in f32_pair(v)), *a, *h)


class _SameAsStudent:
    """The type of :data:`SAME_AS_STUDENT` (its ``repr`` shows in the signatures)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SAME_AS_STUDENT"


# ``teacher_softcap``'s default: the teacher's logits capped by ``softcap``, as the student's
# (``teacher_softcap=None`` is an uncapped teacher)
SAME_AS_STUDENT = _SameAsStudent()


class Transforms(NamedTuple):
    """Each model's logits before the softmax: ``z = c tanh(s x / c) / T`` with the model's
    logit scale ``s`` and soft cap ``c`` (``z = s x / T`` without a cap; the temperature
    ``T`` shared, passed apart). The ops take the four fields, in this order, as their last
    arguments; ``split``: the two transforms differ (the kernels' ``SPLIT``)."""

    softcap: float | None = None
    logit_scale: float = 1.0
    teacher_softcap: float | None = None
    teacher_logit_scale: float = 1.0

    @classmethod
    def shared(cls, softcap: float | None) -> Transforms:
        """Both models capped by ``softcap`` (None: neither), unscaled."""
        return cls(softcap, 1.0, softcap, 1.0)

    @property
    def split(self) -> bool:
        return (self.softcap, self.logit_scale) != (self.teacher_softcap, self.teacher_logit_scale)


# both models' logits as they are (no scale, no cap): the internal functions' default
NO_TRANSFORMS = Transforms()


def check_transforms(softcap, teacher_softcap, logit_scale, teacher_logit_scale) -> Transforms:
    """The checked :class:`Transforms` of the public keywords (each a finite number ``> 0``,
    a ``ValueError`` naming it otherwise; ``teacher_softcap`` :data:`SAME_AS_STUDENT`:
    ``softcap``)."""
    if softcap is not None:
        V.check_positive(softcap, "softcap")
        softcap = float(softcap)
    if teacher_softcap is SAME_AS_STUDENT:
        teacher_softcap = softcap
    elif teacher_softcap is not None:
        V.check_positive(teacher_softcap, "teacher_softcap")
        teacher_softcap = float(teacher_softcap)
    V.check_positive(logit_scale, "logit_scale")
    V.check_positive(teacher_logit_scale, "teacher_logit_scale")
    return Transforms(softcap, float(logit_scale), teacher_softcap, float(teacher_logit_scale))


def _temperature_args(temperature: float, softcap: float | None, scale: float = 1.0
                      ) -> tuple[float, ...]:  # fmt: skip
    """The kernels' ``inv_t`` and ``inv_cap`` fp32 pairs of one model: ``s / T`` and none, or
    with the soft cap ``c``, ``c / T`` and ``s / c`` (``kernels/vocab/layer1.py``
    ``scaled_logits``; the logit scale ``s`` folded in)."""
    if softcap is None:
        return (*f32_pair(scale / temperature), *NO_CAP)
    return (*f32_pair(softcap / temperature), *f32_pair(scale / softcap))


def _transform_args(temperature: float, tf: Transforms) -> tuple[tuple[float, ...], dict]:
    """The distill kernels' ``inv_t``, ``inv_cap``, ``t_inv_t``, ``t_inv_cap`` fp32 pairs and
    their switches: ``HAS_SOFTCAP`` (the student's cap, and the teacher's unless ``SPLIT``),
    with split transforms ``SPLIT`` and ``TEACHER_SOFTCAP`` too (the teacher's pairs are
    unread without ``SPLIT``)."""
    student = _temperature_args(temperature, tf.softcap, tf.logit_scale)
    flags = {"HAS_SOFTCAP": tf.softcap is not None}
    if not tf.split:
        return (*student, *student), flags
    teacher = _temperature_args(temperature, tf.teacher_softcap, tf.teacher_logit_scale)
    flags.update(SPLIT=True, TEACHER_SOFTCAP=tf.teacher_softcap is not None)
    return (*student, *teacher), flags


def _acc(student: Tensor, teacher: Tensor) -> torch.dtype:
    return acc_dtype(student, teacher)


# ----------------------------------------------------------------------------- forward


def distill_fwd(
    student3d: Tensor,
    teacher3d: Tensor,
    targets: Tensor | None,
    mask: Tensor | None,
    num_items_t: Tensor | None,
    beta: float,
    temperature: float,
    ignore_index: int,
    agg: int,
    max_length: int,
    num_items: float,
    free: bool,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The distillation loss over ``(outer, inner, V)`` student / teacher logits (any
    strides, each its own) with ``(outer, inner)`` targets / mask (any strides; a bool mask
    passed as uint8). ``agg``: index in ``LOSS_AGG_MODES``; ``num_items`` <= 0 means off;
    ``free``: the backward's gradient form (the kernel's ``FREE``: log-probability inputs
    taken as free coordinates, ``fused_rl.compat.liger.liger_jsd``), unused here;
    ``softcap`` ... ``teacher_logit_scale``: the two models' :class:`Transforms`.

    Returns ``(loss, metrics, seq_scale, stats, part)``: ``loss`` 0-dim (fp32, fp64 for an
    fp64 input), ``metrics`` ``(len(COLUMNS),)`` fp32 (token means of each column, the
    weight total last), ``seq_scale`` the aggregation's normaliser, ``stats``
    ``(N_STATS, N)`` and ``part`` ``(len(COLUMNS), N)`` for the backward. Two launches.
    """
    outer, inner, _ = student3d.shape
    acc = _acc(student3d, teacher3d)
    part = torch.empty((len(COLUMNS), outer * inner), dtype=acc, device=student3d.device)
    stats = torch.empty((N_STATS, outer * inner), dtype=acc, device=student3d.device)
    tf = Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    _launch_rows(student3d, teacher3d, targets, mask, part, stats, beta, temperature,
                 ignore_index, tf)  # fmt: skip
    loss, metrics, seq_scale = _launch_finalize(part, outer, inner, agg, max_length, num_items,
                                                num_items_t)  # fmt: skip
    return loss, metrics, seq_scale, stats, part


def _launch_rows(student3d, teacher3d, targets, mask, part, stats, beta, temperature,
                 ignore_index, tf: Transforms) -> None:  # fmt: skip
    """The forward vocab kernel over every row of ``(outer, inner, V)`` logits: writes the
    ``(len(COLUMNS), N)`` partial columns ``part`` and the ``(N_STATS, N)`` statistics."""
    from .kernels.vocab.distill import _distill_fwd_kernel

    outer, inner, vocab = student3d.shape
    n_rows = outer * inner
    strides = lambda t: t.stride() if t is not None else (0, 0)  # noqa: E731
    if n_rows:
        transform, flags = _transform_args(temperature, tf)
        _distill_fwd_kernel[(n_rows,)](
            student3d, teacher3d, targets if targets is not None else part,
            mask if mask is not None else part, part, stats, inner, n_rows, vocab,
            *student3d.stride(), *teacher3d.stride(), *strides(targets), *strides(mask),
            *transform, mixture_constants(beta), ignore_index,
            MODE=divergence_mode(beta), HAS_TARGETS=targets is not None,
            HAS_MASK=mask is not None, ACC=triton_acc(part.dtype), **flags,
            **vocab_launch(vocab, writes=False, heavy=True),
        )  # fmt: skip


def _launch_finalize(part, outer, inner, agg, max_length, num_items, num_items_t):
    """``(loss, metrics, seq_scale)`` from the ``(len(COLUMNS), outer * inner)`` partial
    columns: one launch (``_distill_finalize_kernel``)."""
    from .kernels.vocab.distill import _distill_finalize_kernel

    acc, dev = part.dtype, part.device
    loss = torch.empty((), dtype=acc, device=dev)
    metrics = torch.empty(len(COLUMNS), dtype=torch.float32, device=dev)
    seq_scale = torch.empty(max(outer, 1) if agg == _SEQ_MEAN_TOKEN_MEAN else 1, dtype=acc,
                            device=dev)  # fmt: skip
    _distill_finalize_kernel[(len(COLUMNS),)](
        part, loss, metrics, seq_scale, num_items_t if num_items_t is not None else part,
        outer, inner, *(f32_pair(num_items) if num_items > 0 else NO_NUM_ITEMS),
        float(max(outer, 1)), float(max_length),
        AGG=agg, NUM_ITEMS_TENSOR=num_items_t is not None, BLOCK_B=FINALIZE_BLOCK_B,
        BLOCK_T=FINALIZE_BLOCK_T, ACC=triton_acc(acc), **COMPILE_OPTIONS,
    )  # fmt: skip
    return loss, metrics, seq_scale


def _fwd_fake(student3d, teacher3d, targets, mask, num_items_t, beta, temperature, ignore_index,
              agg, max_length, num_items, free, *_transforms):  # fmt: skip
    outer, inner, _ = student3d.shape
    acc = _acc(student3d, teacher3d)
    n_scale = max(outer, 1) if agg == _SEQ_MEAN_TOKEN_MEAN else 1
    return (
        student3d.new_empty((), dtype=acc),
        student3d.new_empty(len(COLUMNS), dtype=torch.float32),
        student3d.new_empty(n_scale, dtype=acc),
        student3d.new_empty((N_STATS, outer * inner), dtype=acc),
        student3d.new_empty((len(COLUMNS), outer * inner), dtype=acc),
    )


# ----------------------------------------------------------------------------- backward


def distill_bwd(
    student3d: Tensor,
    teacher3d: Tensor,
    stats: Tensor,
    part: Tensor,
    seq_scale: Tensor,
    grad_loss: Tensor,
    beta: float,
    temperature: float,
    free: bool,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> Tensor:
    """The student's gradient, a fresh contiguous ``(outer, inner, V)`` buffer in its
    dtype, from the forward's ``stats`` / ``part`` / ``seq_scale`` and the upstream
    gradient ``grad_loss`` (0-dim, read on device); ``free``: the kernel's ``FREE``
    form; the last four: the forward's :class:`Transforms`. One launch."""
    from .kernels.vocab.distill import _distill_bwd_kernel

    outer, inner, vocab = student3d.shape
    grad = torch.empty(student3d.shape, dtype=student3d.dtype, device=student3d.device)
    if grad.numel() == 0:
        return grad
    n_rows = outer * inner
    # the kernel reads row i's statistic k at k * n_rows + i: a column slice of a wider
    # buffer would be read with the wrong stride (a no-op for every caller today)
    stats, part = stats.contiguous(), part.contiguous()
    transform, flags = _transform_args(
        temperature, Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    )
    _distill_bwd_kernel[(n_rows,)](
        student3d, teacher3d, grad, stats, part, grad_loss, seq_scale, inner, n_rows, vocab,
        *student3d.stride(), *teacher3d.stride(), 0 if seq_scale.numel() == 1 else 1,
        *transform, mixture_constants(beta), MODE=divergence_mode(beta),
        ACC=triton_acc(stats.dtype), FREE=bool(free), **flags,
        **vocab_launch(vocab, writes=True),
    )  # fmt: skip
    return grad


def _bwd_fake(student3d, *_args):
    return student3d.new_empty(student3d.shape)


distill_bwd_op = FusedOp("distill_bwd", distill_bwd)
distill_bwd_op.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    student3d, teacher3d, *_ = inputs
    ctx.beta, ctx.temperature, ctx.free = inputs[5], inputs[6], inputs[11]
    ctx.tf = Transforms(*inputs[12:])
    _, metrics, seq_scale, stats, part = output
    ctx.save_for_backward(student3d, teacher3d, stats, part, seq_scale)
    ctx.mark_non_differentiable(metrics, seq_scale, stats, part)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, *_unused):
    student3d, teacher3d, stats, part, seq_scale = ctx.saved_tensors
    grad = None
    if grad_loss is not None:
        grad = distill_bwd_op(
            student3d, teacher3d, stats, part, seq_scale, grad_loss, ctx.beta, ctx.temperature,
            ctx.free, *ctx.tf,
        )  # fmt: skip
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


distill_fwd_op = FusedOp("distill_fwd", distill_fwd)
distill_fwd_op.register_fake(_fwd_fake)
distill_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- chunk rows
# The pieces ``fused_rl.linear_distill_loss`` runs on each chunk of logits it computes from
# hidden states: the forward kernel on the chunk's rows, the backward kernel writing ``dz``
# with the aggregation's per-row scale (known from the mask alone), and one finalize over
# every chunk's partial columns.


def distill_rows_fwd(
    student2d: Tensor,
    teacher2d: Tensor,
    targets: Tensor | None,
    mask: Tensor | None,
    beta: float,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(part, stats)``, ``(len(COLUMNS), n)`` / ``(N_STATS, n)``, of ``n`` rows of student
    / teacher logits (``(n, V)`` each, any strides) with ``(n,)`` targets / mask (a bool
    mask as uint8); the last four: the :class:`Transforms`. One launch."""
    n = student2d.shape[0]
    acc = _acc(student2d, teacher2d)
    part = torch.empty((len(COLUMNS), n), dtype=acc, device=student2d.device)
    stats = torch.empty((N_STATS, n), dtype=acc, device=student2d.device)
    row = lambda t: None if t is None else t[None]  # noqa: E731
    tf = Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    _launch_rows(student2d[None], teacher2d[None], row(targets), row(mask), part, stats, beta,
                 temperature, ignore_index, tf)  # fmt: skip
    return part, stats


def _rows_fwd_fake(student2d, teacher2d, *_args):
    n, acc = student2d.shape[0], _acc(student2d, teacher2d)
    return (student2d.new_empty((len(COLUMNS), n), dtype=acc),
            student2d.new_empty((N_STATS, n), dtype=acc))  # fmt: skip


distill_rows_fwd_op = FusedOp("distill_rows_fwd", distill_rows_fwd)
distill_rows_fwd_op.register_fake(_rows_fwd_fake)


def distill_finalize(
    part: Tensor,
    outer: int,
    inner: int,
    agg: int,
    max_length: int,
    num_items: float,
    num_items_t: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, metrics, seq_scale)`` from ``(len(COLUMNS), outer * inner)`` partial columns
    (:func:`distill_fwd`'s reduction as an op of its own). One launch."""
    return _launch_finalize(part, outer, inner, agg, max_length, num_items, num_items_t)


def _finalize_fake(part, outer, inner, agg, *_args):
    n_scale = max(outer, 1) if agg == _SEQ_MEAN_TOKEN_MEAN else 1
    return (part.new_empty(()), part.new_empty(len(COLUMNS), dtype=torch.float32),
            part.new_empty(n_scale))  # fmt: skip


distill_finalize_op = FusedOp("distill_finalize_fwd", distill_finalize)
distill_finalize_op.register_fake(_finalize_fake)


def distill_rows_grad_into(
    grad: Tensor,
    student2d: Tensor,
    teacher2d: Tensor,
    stats: Tensor,
    part: Tensor,
    row_scale: Tensor,
    scale: Tensor,
    beta: float,
    temperature: float,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> Tensor:
    """The student's gradient of ``n`` rows into ``grad`` (contiguous ``(n, V)``, the
    student's dtype; it may be ``student2d`` itself: the kernel reads each block before it
    writes it), from :func:`distill_rows_fwd`'s ``stats`` / ``part`` (``(k, n)`` columns of
    one stride), the ``(n,)`` per-row scale and the 0-dim ``scale``; the last four: the
    :class:`Transforms`. One launch; returns ``grad``. Mutates ``grad``: a raw launcher, not
    a custom op."""
    from .kernels.vocab.distill import _distill_bwd_kernel

    n, vocab = student2d.shape
    if n == 0 or vocab == 0:
        return grad
    if stats.stride(0) != part.stride(0) or stats.stride(1) != 1 or part.stride(1) != 1:
        raise ValueError("distill_rows_grad_into takes stats / part columns of one stride")
    transform, flags = _transform_args(
        temperature, Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    )
    # one row per "sequence" (rows_inner = 1): row r's scale is row_scale[r]
    _distill_bwd_kernel[(n,)](
        student2d, teacher2d, grad, stats, part, scale, row_scale, 1, stats.stride(0), vocab,
        student2d.stride(0), 0, student2d.stride(1), teacher2d.stride(0), 0,
        teacher2d.stride(1), row_scale.stride(0), *transform, mixture_constants(beta),
        MODE=divergence_mode(beta), ACC=triton_acc(stats.dtype), FREE=False,
        **flags, **vocab_launch(vocab, writes=True),
    )  # fmt: skip
    return grad


def distill_rows_grad_fwd(
    student2d: Tensor,
    teacher2d: Tensor,
    stats: Tensor,
    part: Tensor,
    row_scale: Tensor,
    scale: Tensor,
    beta: float,
    temperature: float,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> Tensor:
    """:func:`distill_rows_grad_into` into a fresh buffer (the form ``torch.compile``
    traces: a custom op may not mutate its input)."""
    grad = torch.empty(student2d.shape, dtype=student2d.dtype, device=student2d.device)
    return distill_rows_grad_into(grad, student2d, teacher2d, stats, part, row_scale, scale,
                                  beta, temperature, softcap, logit_scale, teacher_softcap,
                                  teacher_logit_scale)  # fmt: skip


distill_rows_grad_fwd_op = FusedOp("distill_rows_grad_fwd", distill_rows_grad_fwd)
distill_rows_grad_fwd_op.register_fake(lambda student2d, *_args: student2d.new_empty(
    student2d.shape))  # fmt: skip


# ----------------------------------------------------------------------------- per token
# The per-token divergence with its gradient (``fused_rl.token_kl``, the composed policy
# loss's exact KL, and ``distill_loss`` / ``linear_distill_loss`` under vocabulary
# parallelism): the kernels above at ``beta`` 0 or 1 on each row (or shard), their row
# statistics merged across vocabulary shards by two all-reduces (``fused_rl.exact_kl``'s
# module docstring gives the sums and bytes), the generalized JSD then a second pass over
# each shard with the merged normalisers (``_distill_mixture_kernel``) and one more.

_COL_REVERSE = COLUMNS.index("reverse_kl")
_COL_COUNT = COLUMNS.index("count")
# the per-token values each forward reports: forward KL, reverse KL, H(p), H(q)
_EXTRA_COLUMNS = [COLUMNS.index(c) for c in ("forward_kl", "reverse_kl", "student_entropy",
                                             "teacher_entropy")]  # fmt: skip
# kernels/vocab/distill.py STAT_*: max_z, log S_z, max_u, log(S_z / S_u), c (= KL)
_MAX_Z, _LOG_S_Z, _MAX_U, _LOG_RATIO, _C, _LOG_S_U = range(N_STATS)


class _PairDivergence(torch.autograd.Function):
    """``(d, extra)`` of ``(outer, inner, V)`` rows of the policy / student ``x3d`` and the
    reference / teacher ``r3d``: ``d`` ``(outer, inner)`` TRL's divergence at ``beta`` (the
    forward KL ``KL(q || p)`` at 0, the reverse ``KL(p || q)`` at 1, the generalized JSD
    between: a second pass over each shard from the merged normalisers), differentiable
    w.r.t. ``x3d``; with ``with_extra`` the detached ``(4, outer, inner)`` forward KL,
    reverse KL, ``H(p)``, ``H(q)`` (else empty). ``shard`` None: the whole vocabulary here
    (Triton, ``beta`` 0 or 1), else this rank's shard (either backend); ``tf`` the two
    models' :class:`Transforms`."""

    @staticmethod
    def forward(ctx, x3d, r3d, mask, temperature, which, shard, beta, with_extra, tf, check):
        d, extra, stats = divergence_stats(x3d, r3d, mask, temperature, which, shard, beta,
                                           with_extra, tf, check)  # fmt: skip
        ctx.save_for_backward(x3d, r3d, stats, mask)
        ctx.temperature, ctx.which, ctx.beta, ctx.tf = temperature, which, beta, tf
        ctx.shard = shard
        ctx.mark_non_differentiable(extra)
        ctx.set_materialize_grads(False)
        return d, (extra if with_extra else extra.new_empty((0,)))

    @staticmethod
    def backward(ctx, grad_d, _grad_extra):
        x3d, r3d, stats, mask = ctx.saved_tensors
        if grad_d is None:
            return (None,) * 10
        with torch.no_grad():
            g = grad_d if mask is None else torch.where(mask, grad_d, 0.0)  # rows not read
            grad = divergence_grad(x3d, r3d, stats, g, ctx.temperature, ctx.which, ctx.beta,
                                   ctx.tf, ctx.shard)  # fmt: skip
        return (differentiable_once(grad, x3d, grad_d),) + (None,) * 9


def divergence_stats(x3d, r3d, mask, temperature, which, shard, beta, with_extra,
                     tf=NO_TRANSFORMS, check=False):  # fmt: skip
    """:class:`_PairDivergence`'s forward without autograd: ``(d, extra, stats)``, ``stats``
    the whole vocabulary's ``(N_STATS, n)`` statistics the backward (:func:`divergence_grad`)
    reads. With ``shard`` only its valid columns are read (a padded vocabulary's padding
    never), and the layout is checked through the first collective: ``check`` raises
    ``ValueError`` on every rank (one host sync), otherwise a bad layout makes every value
    NaN. ``tf``: the two models' :class:`Transforms`."""
    mode = divergence_mode(beta)
    if shard is not None:
        x3d, r3d = _valid_columns(x3d, shard), _valid_columns(r3d, shard)
    stats, extra = _local_stats(x3d, r3d, mask, temperature, which, mode == 0, tf)
    if shard is not None:
        stats, extra = _merge(stats, extra, shard, full=mode != 1 or with_extra, check=check)
    extra = extra.view(4, *x3d.shape[:2])
    if mask is not None:
        extra = torch.where(mask, extra, 0.0)
    if mode == 2:  # the mixture needs both global normalisers: a second pass, one SUM
        assert shard is not None, "the unsharded JSD runs distill_fwd_op"
        jsd_parts = _mixture_parts(x3d, r3d, stats, mask, temperature, beta, which, tf)
        _dist().all_reduce(jsd_parts, op=_dist().ReduceOp.SUM, group=shard.group)
        stats = torch.cat((stats[:_C], jsd_parts[1:], stats[_LOG_S_U:]))  # c: sum p L
        d = jsd_parts[0].view(x3d.shape[:2])
        if mask is not None:
            d = torch.where(mask, d, 0.0)
    else:
        d = extra[mode].clone()  # forward KL first, reverse second
    return d, extra, stats


def pair_divergence(x3d, r3d, mask, temperature, which, shard, beta=1.0, with_extra=False,
                    softcap=None, check=False, tf=None):  # fmt: skip
    """:class:`_PairDivergence` (checked inputs): ``(d, extra)``; ``softcap``: both models'
    logits capped, ``c tanh(x / c)``, before the temperature, or ``tf``: each model's own
    :class:`Transforms`; ``check``: the layout check of :func:`divergence_stats`."""
    tf = Transforms.shared(softcap) if tf is None else tf
    return _PairDivergence.apply(x3d, r3d, mask, temperature, which, shard, beta, with_extra,
                                 tf, check)  # fmt: skip


def _valid_columns(x3d: Tensor, shard) -> Tensor:
    """This rank's real vocabulary columns of ``x3d`` (a view): all but a padded
    vocabulary's padding (``shard.valid`` of ``shard.columns``; possibly none)."""
    return x3d if shard.valid == x3d.shape[-1] else x3d.narrow(-1, 0, shard.valid)


def _student(x: Tensor, tf: Transforms) -> Tensor:
    """The student's ``c tanh(s x / c)`` (``s x`` uncapped), as the reference forms it."""
    return ref.capped_rows(x, None, tf.softcap, tf.logit_scale)


def _teacher(x: Tensor, tf: Transforms) -> Tensor:
    return ref.capped_rows(x, None, tf.teacher_softcap, tf.teacher_logit_scale)


def distill_mixture_fwd(
    x3d: Tensor,
    r3d: Tensor,
    stats: Tensor,
    mask: Tensor | None,
    temperature: float,
    beta: float,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    teacher_logit_scale: float = 1.0,
) -> Tensor:
    """``(2, outer * inner)`` in ``stats``' dtype: each row's part of the generalized JSD
    and of ``sum_v p_v L_v`` over ``(outer, inner, V)`` shards (``_distill_mixture_kernel``:
    one more read of both rows) from the whole vocabulary's ``stats``; ``mask``: a
    contiguous ``(outer, inner)`` bool (rows left out read nothing); ``softcap`` ...
    ``teacher_logit_scale``: the two models' :class:`Transforms`."""
    from .kernels.vocab.distill import _distill_mixture_kernel

    outer, inner, vocab = x3d.shape
    assert mask is None or mask.is_contiguous(), "the kernel reads the mask by row index"
    stats = stats.contiguous()  # read at k * n_rows + i (a no-op for every caller today)
    out = torch.zeros((2, outer * inner), dtype=stats.dtype, device=x3d.device)
    tf = Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    transform, flags = _transform_args(temperature, tf)
    _distill_mixture_kernel[(outer * inner,)](
        x3d, r3d, stats, mask.view(torch.uint8) if mask is not None else stats, out, inner,
        outer * inner, vocab, *x3d.stride(), *r3d.stride(), *transform, mixture_constants(beta),
        HAS_MASK=mask is not None, ACC=triton_acc(stats.dtype), **flags,
        **vocab_launch(vocab, writes=False, heavy=True),
    )  # fmt: skip
    return out


distill_mixture_fwd_op = FusedOp("distill_mixture_fwd", distill_mixture_fwd)
distill_mixture_fwd_op.register_fake(
    lambda x3d, _r3d, stats, *_args: stats.new_empty((2, x3d.shape[0] * x3d.shape[1]))
)


def _mixture_parts(x3d, r3d, stats, mask, temperature, beta, which, tf) -> Tensor:
    """``(2, n)``: this shard's part of each row's generalized JSD and of ``sum_v p_v L_v``,
    from the whole vocabulary's ``stats`` (the JSD's second pass; Triton:
    ``_distill_mixture_kernel``, reads the shard's rows once more)."""
    outer, inner, vocab = x3d.shape
    n = outer * inner
    if vocab == 0 or n == 0:
        return torch.zeros((2, n), dtype=stats.dtype, device=x3d.device)
    if which == "triton":
        return distill_mixture_fwd_op(x3d, r3d, stats, mask, temperature, beta, *tf)
    st = stats.view(N_STATS, outer, inner, 1)
    z = _student(x3d.to(stats.dtype), tf) / temperature
    u = _teacher(r3d.to(stats.dtype), tf) / temperature
    log_p = (z - st[_MAX_Z]) - st[_LOG_S_Z]
    log_q = (u - st[_MAX_U]) - st[_LOG_S_U]
    delta = ((u - z) - (st[_MAX_U] - st[_MAX_Z])) + st[_LOG_RATIO]  # log q - log p
    near = delta.abs() <= 1.0
    p, q = log_p.exp(), log_q.exp()
    excess, f = ref.mixture_terms(torch.where(near, delta, 0.0), near, p, q, log_p, log_q, beta)
    parts = torch.stack((f.sum(-1), torch.where(p == 0, 0.0, p * excess).sum(-1)))
    if mask is not None:
        parts = torch.where(mask, parts, 0.0)
    return parts.reshape(2, n)


def _local_stats(x3d, r3d, mask, temperature, which, forward_kl, tf):
    """``(stats, extra)``: the ``(N_STATS, outer * inner)`` row statistics of this shard's (or
    the whole vocabulary's) columns in the distill kernels' layout (``c`` the reverse KL), and
    ``(4, outer * inner)`` forward KL, reverse KL, ``H(p)``, ``H(q)`` over those columns."""
    outer, inner, vocab = x3d.shape
    n = outer * inner
    if vocab == 0:  # a shard of padding only: an empty partial (-inf maxima, no mass)
        acc = stats_dtype(torch.promote_types(x3d.dtype, r3d.dtype))
        empty = torch.full((outer, inner), -math.inf, dtype=acc, device=x3d.device)
        zero = torch.zeros_like(empty)
        stats = torch.stack((empty, empty, empty, zero, zero, empty)).reshape(N_STATS, n)
        return stats, torch.zeros((4, n), dtype=acc, device=x3d.device)
    if which == "triton":  # the distillation forward at beta = 1 (or 0; its loss unused)
        m8 = None if mask is None else mask.view(torch.uint8)
        _, _, _, stats, part = distill_fwd_op(
            x3d, r3d, None, m8, None, 0.0 if forward_kl else 1.0, temperature, -100, 0,
            inner, 0.0, False, *tf,
        )  # fmt: skip
        if forward_kl:  # the kernel's c is the reverse KL only at beta = 1
            stats = torch.cat((stats[:_C], part[_COL_REVERSE][None], stats[_LOG_S_U:]))
        return stats, part[_EXTRA_COLUMNS]
    # the reference: the same statistics in plain PyTorch (the shard may be empty: -inf max)
    acc = stats_dtype(torch.promote_types(x3d.dtype, r3d.dtype))
    z, u = x3d.detach().to(acc), r3d.to(acc)
    if mask is not None:
        keep = mask[..., None]
        z, u = torch.where(keep, z, 0.0), torch.where(keep, u, 0.0)
    z, u = _student(z, tf) / temperature, _teacher(u, tf) / temperature
    m_z, m_u = z.amax(-1), u.amax(-1)
    m_z0 = torch.where(torch.isfinite(m_z), m_z, 0.0)
    m_u0 = torch.where(torch.isfinite(m_u), m_u, 0.0)
    a, b = z - m_z0[..., None], u - m_u0[..., None]
    b_minus_a = (u - z) - (m_u0 - m_z0)[..., None]  # the logits' own difference (near-equal)
    e_a, e_b = a.exp(), b.exp()
    s_z, s_u = e_a.sum(-1), e_b.sum(-1)
    log_s_z, log_s_u = s_z.log(), s_u.log()
    r = -torch.where(e_a == 0, 0.0, e_a * b_minus_a).sum(-1) / s_z
    f = torch.where(e_b == 0, 0.0, e_b * b_minus_a).sum(-1) / s_u
    # S_u - S_z as its own terms (the kernel's pair_moments): e^a expm1(b - a) where b is near a
    close = (b_minus_a.abs() <= 1.0) & (e_a != 0)
    gap_v = torch.where(close, e_a * torch.expm1(torch.where(close, b_minus_a, 0.0)), e_b - e_a)
    log_ratio = _log_ratio(s_z, gap_v.sum(-1))
    h_z = log_s_z - torch.where(e_a == 0, 0.0, e_a * a).sum(-1) / s_z
    h_u = log_s_u - torch.where(e_b == 0, 0.0, e_b * b).sum(-1) / s_u
    kl = r - log_ratio
    stats = torch.stack((m_z0, log_s_z, m_u0, log_ratio, kl, log_s_u)).reshape(N_STATS, n)
    extra = torch.stack((f + log_ratio, kl, h_z.clamp_min(0.0), h_u.clamp_min(0.0)))
    return stats, extra.reshape(4, n)


def _log_ratio(s_z: Tensor, gap: Tensor) -> Tensor:
    """``log(S_z / S_u)`` from ``S_z`` and ``gap = S_u - S_z`` summed as its own terms:
    ``-log1p(gap / S_z)`` near 1 (two separately rounded logs would leave an error of
    ``ulp(log V)`` in a KL of order ``delta^2``), the plain logs elsewhere."""
    ratio = gap / s_z
    near = ratio.abs() <= 0.5
    return torch.where(near, -torch.log1p(torch.where(near, ratio, 0.0)),
                       s_z.log() - (s_z + gap).log())  # fmt: skip


def _merge(stats: Tensor, extra: Tensor, shard, full: bool, check: bool = False
           ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The two all-reduces over ``shard.group``: every rank's per-token partials into the
    whole vocabulary's statistics (same layout) and ``(4, n)`` extra values (module
    docstring). ``full``: also the forward KL and both entropies (three more sums). The
    layout header (``fused_rl.distributed``: each rank's start and width, the vocabulary
    size; ``2 world + 2`` floats) rides on the MAX: ``check`` raises on a bad one, else it
    makes every value NaN."""
    dist = _dist()
    n = stats.shape[1]
    m_z_l, log_s_z_l, m_u_l = stats[_MAX_Z], stats[_LOG_S_Z], stats[_MAX_U]
    log_ratio_l, log_s_u_l = stats[_LOG_RATIO], stats[_LOG_S_U]
    # a stream without mass on this shard (an empty shard, a row all -inf there): its max
    # taken as -inf so it never wins, its sums 0; each stream on its own
    empty_z, empty_u = log_s_z_l == -math.inf, log_s_u_l == -math.inf
    maxima = torch.cat((torch.where(empty_z, -math.inf, m_z_l),
                        torch.where(empty_u, -math.inf, m_u_l),
                        _header(shard, stats.dtype, stats.device)))  # fmt: skip
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=shard.group)
    m_z, m_u, hdr = maxima[:n], maxima[n : 2 * n], maxima[2 * n :]
    ok = None
    if check:
        message = _layout_error(hdr.tolist(), shard)  # the call's one host sync
        if message is not None:
            raise ValueError(message)
    else:
        ok = _layout_ok(hdr, shard)
    d_z = torch.where(empty_z, 0.0, m_z_l - m_z)
    d_u = torch.where(empty_u, 0.0, m_u_l - m_u)
    a = torch.where(empty_z, 0.0, (d_z + log_s_z_l).exp())  # S_z,r e^(M_z,r - M_z)
    b = torch.where(empty_u, 0.0, (d_u + log_s_u_l).exp())  # S_u,r e^(M_u,r - M_u)
    # d_z - d_u from the two differences of maxima, each small and exact for near-equal
    # rows (not from d_z and d_u, each rounded at the size of the maxima)
    dd = (m_z_l - m_u_l) - (m_z - m_u)
    # b - a, the shard's part of S_u - S_z: as its own small number where the two are near
    # (a expm1(...)), else directly (an underflowing a, a stream without mass here)
    x = -dd - log_ratio_l
    near = (x.abs() <= 1.0) & ~empty_z & ~empty_u
    gap = torch.where(near, a * torch.expm1(torch.where(near, x, 0.0)), b - a)
    r_l = extra[1] + log_ratio_l  # E_p[(z - M_z) - (u - M_u)] over the shard
    # a shard where one model has mass and the other none: that KL is +inf there (the local
    # value is inf - inf); NaN still propagates (empty_* is False for NaN)
    parts = [a, gap, torch.where(a == 0, 0.0, torch.where(empty_u, math.inf, a * (r_l + dd)))]
    if full:
        f_l = extra[0] - log_ratio_l  # E_q[(u - M_u) - (z - M_z)] over the shard
        parts += [
            torch.where(b == 0, 0.0, torch.where(empty_z, math.inf, b * (f_l - dd))),
            torch.where(a == 0, 0.0, a * ((log_s_z_l - extra[2]) + d_z)),  # W_z
            torch.where(b == 0, 0.0, b * ((log_s_u_l - extra[3]) + d_u)),  # W_u
        ]
    sums = torch.cat(parts)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)
    s_z, gap, big_r = sums[:n], sums[n : 2 * n], sums[2 * n : 3 * n]
    s_u = s_z + gap
    log_ratio = _log_ratio(s_z, gap)
    kl = big_r / s_z - log_ratio
    merged = torch.stack((m_z, s_z.log(), m_u, log_ratio, kl, s_u.log()))
    if ok is not None:  # a bad layout, unchecked: every statistic NaN, so every value
        merged = torch.where(ok, merged, math.nan)
        kl = merged[_C]
    if not full:
        return merged, torch.stack((kl, kl, kl, kl))  # only the reverse KL is read
    big_f, w_z, w_u = sums[3 * n : 4 * n], sums[4 * n : 5 * n], sums[5 * n :]
    h_z = (s_z.log() - w_z / s_z).clamp_min(0.0)
    h_u = (s_u.log() - w_u / s_u).clamp_min(0.0)
    extra = torch.stack((big_f / s_u + log_ratio, kl, h_z, h_u))
    return merged, extra if ok is None else torch.where(ok, extra, math.nan)


def divergence_grad(x3d, r3d, stats, grad_kl, temperature, which, beta=1.0,
                    tf=NO_TRANSFORMS, shard=None) -> Tensor:  # fmt: skip
    """``dL/dlogits`` of this rank's (or the whole) ``(outer, inner, V)`` logits from the
    global statistics, ``g_t / T`` times (``kernels/vocab/distill.py``): ``p_v (-delta_v -
    KL_t)`` at ``beta = 1``, ``p_v - q_v`` at 0, ``-(1 - beta) p_v (L_v - c_t)`` between
    (``c_t = sum_w p_w L_w``, the statistic ``C``); where ``p_v == 0`` 0 (the forward KL:
    ``-q_v``), NaN in a row whose ``KL_t`` / ``c_t`` is not finite, as the kernel. With a
    ``shard`` whose vocabulary is padded, 0 at the padding columns (never read). ``tf``: the
    two models' :class:`Transforms` (``g_t`` then times the student's ``dz/dx``, not ``1 / T``).
    """
    if shard is not None and shard.valid != x3d.shape[-1]:
        grad = divergence_grad(_valid_columns(x3d, shard), _valid_columns(r3d, shard), stats,
                               grad_kl, temperature, which, beta, tf)  # fmt: skip
        return torch.nn.functional.pad(grad, (0, x3d.shape[-1] - shard.valid))
    outer, inner, vocab = x3d.shape
    if vocab == 0:
        return torch.zeros(x3d.shape, dtype=x3d.dtype, device=x3d.device)
    g = grad_kl.reshape(-1).to(stats.dtype)
    if which == "triton":
        part = torch.zeros((len(COLUMNS), outer * inner), dtype=stats.dtype, device=x3d.device)
        part[_COL_COUNT] = g  # the kernel's per-row coefficient: the upstream gradient
        one = torch.ones((1,), dtype=stats.dtype, device=x3d.device)
        return distill_bwd_op(x3d, r3d, stats, part, one, one[0], beta, temperature, False,
                              *tf)  # fmt: skip
    keep = (g != 0).view(outer, inner, 1)  # rows that do not count: exact zeros, never read
    x = torch.where(keep, x3d.to(stats.dtype), 0.0)
    z, slope = ref.capped_rows_and_slope(x, None, tf.softcap, tf.logit_scale)  # slope: dz/dx
    z = z / temperature
    u = _teacher(torch.where(keep, r3d.to(stats.dtype), 0.0), tf) / temperature
    st = stats.view(N_STATS, outer, inner, 1)
    log_p = (z - st[_MAX_Z]) - st[_LOG_S_Z]
    log_q = (u - st[_MAX_U]) - st[_LOG_S_U]
    p = log_p.exp()
    # log q - log p from the logits' own difference (as the kernel's near_delta): exact for
    # a reference near the policy, where two logs of size log V would cancel
    delta = ((u - z) - (st[_MAX_U] - st[_MAX_Z])) + st[_LOG_RATIO]
    mode = divergence_mode(beta)
    if mode == 0:  # p - q = -p expm1(delta)
        terms = torch.where(p == 0, -log_q.exp(), -p * torch.expm1(delta))
    elif mode == 1:
        terms = torch.where(p == 0, st[_C] - st[_C], p * (-delta - st[_C]))
    else:
        near = delta.abs() <= 1.0
        excess, _ = ref.mixture_terms(torch.where(near, delta, 0.0), near, p, log_q.exp(),
                                      log_p, log_q, beta)  # fmt: skip
        terms = torch.where(p == 0, st[_C] - st[_C], (beta - 1.0) * p * (excess - st[_C]))
    if slope is not None:  # the cap's and the scale's dz/dx
        terms = terms * slope
    grad = torch.where(keep, g.view(outer, inner, 1) * terms, 0.0) / temperature
    return grad.to(x3d.dtype)


# ----------------------------------------------------------------------------- public API


def _check(logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
           max_length, num_items, empty_ok=False) -> None:  # fmt: skip
    V.check_logits(logits, "logits", empty_ok=empty_ok)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be (B, T, V) or (N, V), got shape {tuple(logits.shape)}")
    V.check_logits(teacher_logits, "teacher_logits", empty_ok=empty_ok)
    if teacher_logits.shape[-1] != logits.shape[-1]:
        raise ValueError(
            f"teacher_logits must have the student's vocabulary size: logits has "
            f"V = {logits.shape[-1]}, teacher_logits V = {teacher_logits.shape[-1]}"
        )
    if teacher_logits.shape != logits.shape:
        raise ValueError(
            f"teacher_logits must have logits' shape {tuple(logits.shape)}, got "
            f"{tuple(teacher_logits.shape)}"
        )
    check_teacher_frozen(teacher_logits=teacher_logits)
    lead = tuple(logits.shape[:-1])
    if targets is not None:
        V.check_targets(targets, logits, "targets")
    check_options(lead, "logits.shape[:-1]", beta, temperature, mask, ignore_index, loss_agg,
                  max_length, num_items)  # fmt: skip
    V.check_same_device(logits=logits, teacher_logits=teacher_logits, mask=mask, targets=targets)


def check_teacher_frozen(**tensors: Tensor | None) -> None:
    """A teacher tensor that requires grad (with grad mode on) raises ``ValueError`` naming
    it: the teacher gets no gradient from the distillation losses."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise ValueError(
                f"{name} requires grad: the teacher gets no gradient from the distillation "
                f"loss; pass {name}.detach() (or compute it under torch.no_grad(); a teacher "
                "module's parameters: requires_grad_(False))"
            )


def check_options(lead, expected, beta, temperature, mask, ignore_index, loss_agg, max_length,
                  num_items) -> None:  # fmt: skip
    """The distillation losses' non-tensor options and ``mask`` (``lead``-shaped, named
    ``expected`` in the message)."""
    V.check_unit_interval(beta, "beta")
    V.check_positive(temperature, "temperature")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    V.check_mask(mask, "mask", lead, expected)
    check_loss_agg(loss_agg, max_length=max_length, num_items=num_items)


def distill_loss(
    logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    softcap: float | None = None,
    teacher_softcap: float | None | _SameAsStudent = SAME_AS_STUDENT,
    logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    mask: Tensor | None = None,
    targets: Tensor | None = None,
    ignore_index: int = -100,
    loss_agg: str = "token-mean",
    num_items: int | float | Tensor | None = None,
    max_length: int | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """On-policy distillation loss (GKD): a divergence between the student's and the
    teacher's next-token distributions, fused over the vocabulary.

    Per token, with ``p = softmax(logits / T)`` (student) and ``q = softmax(teacher_logits
    / T)`` (teacher; each model's logits first scaled and soft-capped by its own
    ``logit_scale`` / ``softcap`` where given), the divergence of TRL's
    ``GKDTrainer.generalized_jsd_loss``:
    ``beta == 0``: forward KL ``KL(q || p) = sum_v q (log q - log p)``; ``beta == 1``:
    reverse KL ``KL(p || q)``; otherwise the generalized Jensen-Shannon divergence
    ``beta KL(q || m) + (1 - beta) KL(p || m)`` with ``m = (1 - beta) p + beta q``. The
    per-token divergences are aggregated over counted tokens by ``loss_agg``.

    Args:
        logits: the student's ``(B, T, V)`` (or packed ``(N, V)``: one sequence) logits,
            fp32 / bf16 / fp16 (fp64 for gradcheck), any strides (a slice is read in place).
        teacher_logits: the teacher's, the same shape; any float dtype (it may differ from
            the student's) and strides. Read-only: it gets no gradient, and one that
            requires grad raises ``ValueError`` (pass ``.detach()``).
        beta: in ``[0, 1]`` (see above; 0 and 1 are exact tests, as TRL's).
        temperature: both logits are divided by it (``> 0``); the loss is not rescaled.
        softcap: Gemma-style soft cap ``c`` of the student's logits, and of the teacher's
            unless ``teacher_softcap`` says otherwise (a finite ``c > 0``; None = none):
            ``c tanh(x / c)``, then the temperature, its gradient included (as
            :func:`fused_rl.token_logprobs`).
        teacher_softcap: the teacher's own soft cap (a finite ``c > 0``; None: the teacher
            uncapped); by default (``fused_rl.distill.SAME_AS_STUDENT``) ``softcap``.
        logit_scale, teacher_logit_scale: each model's logit scale ``s`` (a finite ``s > 0``,
            default 1: Granite's ``logits_scaling`` is ``1 / s``, Cohere's ``logit_scale``
            ``s``): with them each model's logits become ``z = c tanh(s x / c) / T`` (``s x / T``
            uncapped), as TRL's ``DistillationTrainer`` transforms each model's logits with its
            own config; the student's gradient includes ``dz/dx``. Models whose scale and cap
            agree run the kernels' one-transform code (the keywords at their defaults:
            bit-identical to a call without them); models that differ stream each row
            through its own transform, at the same bytes a row.
        mask: ``logits.shape[:-1]``, bool / integer / float: a token counts where it is
            nonzero; a float (or integer) mask is a per-token weight ``m_t >= 0``, as for
            :func:`fused_rl.policy_loss` (a negative one raises in eager mode with
            ``fused_rl.config.check_values`` on, else makes the loss NaN).
        targets: optional ``logits.shape[:-1]`` int64 / int32 labels: a token counts only
            where ``targets != ignore_index`` (TRL's ``labels == -100`` masking). Only
            compared with ``ignore_index``, never read as an index.
        ignore_index: see ``targets``.
        loss_agg: ``"token-mean"`` (default: the sum over counted tokens over their count,
            0 when nothing counts: TRL's ``"batchmean"`` with labels), ``"seq-mean-token-mean"``,
            ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``: the policy losses'
            modes (``fused_rl.PolicyConfig``); packed ``(N, V)`` logits are one sequence.
        num_items: replaces the token count of ``token-mean`` (a global count across
            micro-batches / ranks); a tensor's value is never read on the host (<= 0: NaN).
        max_length: the ``seq-mean-token-sum-norm`` length (default ``T``).
        process_group: vocabulary (tensor) parallelism: each rank's ``logits`` /
            ``teacher_logits`` are its equal-width shard of the vocabulary (``DTensor``
            inputs sharded on their last dim give their own group); every rank returns the
            unsharded loss and metrics and its shard of the gradient. Two all-reduces
            forward (32 bytes a token per rank in fp32: both row maxima, then the rescaled
            sums of both softmaxes, both KLs and both entropies); the generalized JSD
            (``0 < beta < 1``) then reads each shard's rows once more with the merged
            normalisers and adds a third (8 bytes a token). None backward. The layout
            (``2 world + 2`` floats on the first all-reduce) is checked: a bad one raises
            ``ValueError`` on every rank (eager, ``fused_rl.config.check_values`` on: one
            host sync), else makes every value NaN.
        vocab_start, vocab_size: the layout, with ``process_group``, as for
            :func:`fused_rl.token_logprobs`: ``vocab_size`` alone is a padded vocabulary
            (Megatron's: equal shards, the columns at and past ``vocab_size`` never read,
            their gradient 0); with ``vocab_start`` ragged shards, contiguous in rank order.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-dim fp32 tensor (fp64 for an fp64 input),
        differentiable w.r.t. ``logits`` only; ``metrics`` detached fp32 0-dim tensors,
        weighted means over counted tokens (0 when none counts), all from the same passes:
        ``jsd`` (the divergence used, i.e. the forward KL for ``beta == 0``, the reverse KL
        for ``beta == 1``), ``forward_kl`` (``KL(q || p)``), ``reverse_kl`` (``KL(p ||
        q)``), ``student_entropy``, ``teacher_entropy``.

    A NaN logit in a counted token makes the loss and metrics NaN; tokens that do not count
    never matter (NaN / inf there included) and get an exactly zero gradient. ``-inf``
    logits give the finite limit (``0 log 0 = 0``), where TRL's ``F.kl_div`` gives NaN. A
    counted token whose divergence is not finite (NaN, or a reverse KL of ``+inf``: a
    teacher ``-inf`` where the student has mass) has no finite gradient column: where
    ``p == 0`` NaN, not the ``0 log 0`` zero, on both backends (CONTRIBUTING.md, "NaN,
    threads and other failure modes"; the forward KL's ``p - q`` stays finite).
    Triton cost: forward one vocab kernel (one pass over both rows for ``beta`` in {0, 1},
    two for the general ``beta``) and one reduction; backward one kernel (``2`` reads and
    ``1`` write of a row); O(N) floats saved (``kernels/vocab/distill.py``).

    Example:
        >>> import torch, fused_rl
        >>> student = torch.randn(2, 5, 11, requires_grad=True)
        >>> teacher = torch.randn(2, 5, 11)
        >>> labels = torch.randint(0, 11, (2, 5))
        >>> labels[:, :2] = -100  # the prompt does not count
        >>> loss, metrics = fused_rl.distill_loss(student, teacher, beta=0.5, targets=labels)
        >>> loss.backward()
        >>> sorted(metrics)
        ['forward_kl', 'jsd', 'reverse_kl', 'student_entropy', 'teacher_entropy']
        >>> bool(student.grad[:, :2].eq(0).all())
        True
    """
    tf = check_transforms(softcap, teacher_softcap, logit_scale, teacher_logit_scale)
    if (
        process_group is not None
        or is_dtensor(logits)
        or vocab_start is not None
        or (vocab_size is not None)
    ):
        return _sharded_distill_loss(
            logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
            num_items, max_length, process_group, backend, tf, vocab_start, vocab_size,
        )  # fmt: skip
    return _distill_loss(logits, teacher_logits, beta, temperature, mask, targets, ignore_index,
                         loss_agg, num_items, max_length, backend, False, tf)  # fmt: skip


def _sharded_distill_loss(logits, teacher_logits, beta, temperature, mask, targets,
                          ignore_index, loss_agg, num_items, max_length, process_group,
                          backend, tf=NO_TRANSFORMS, vocab_start=None,
                          vocab_size=None):  # fmt: skip
    """:func:`distill_loss` over a vocabulary split across ranks: the per-token divergence
    (:func:`pair_divergence`, merged across shards), aggregated with ``fused_rl._agg``'s
    token weights, the metrics masked means."""
    if is_dtensor(teacher_logits):
        teacher_logits = teacher_logits.to_local()
    if is_dtensor(targets):
        targets = targets.to_local()
    if is_dtensor(mask):
        mask = mask.to_local()
    logits, _, shard = resolve_shard(logits, None, process_group, vocab_start, vocab_size)
    _check(logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
           max_length, num_items, empty_ok=shard is not None)  # fmt: skip
    if shard is None:  # a DTensor replicated over the vocabulary: an ordinary call
        return _distill_loss(
            logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
            num_items, max_length, backend, False, tf,
        )  # fmt: skip
    which = resolve_backend(backend, logits, teacher_logits, mask, targets)
    x3d, r3d = as_rows3d(logits), as_rows3d(teacher_logits)
    rows = tuple(x3d.shape[:2])
    acc = stats_dtype(torch.promote_types(x3d.dtype, r3d.dtype))
    like = logits.new_empty(logits.shape[:-1])  # the shard may hold no column
    m = weights_of(mask, like, acc, targets, ignore_index).reshape(rows)
    check_vocab_limit(shard)
    d, extra = pair_divergence(x3d, r3d, m != 0, float(temperature), which, shard,
                               beta=float(beta), with_extra=True, tf=tf,
                               check=V.value_checks_enabled(logits))  # fmt: skip
    w = token_weights(m, loss_agg, max_length=max_length, num_items=num_items, dtype=acc)
    loss = torch.where(w != 0, d * w, torch.zeros_like(d)).sum()
    loss = poison_empty(loss, num_items if loss_agg == "token-mean" else None, w.numel())
    metrics = {"jsd": masked_mean_all(d.detach(), m)}
    for k, name in enumerate(METRICS[1:]):
        metrics[name] = masked_mean_all(extra[k], m)
    return loss, metrics


def _distill_loss(logits, teacher_logits, beta, temperature, mask, targets, ignore_index,
                  loss_agg, num_items, max_length, backend, free, tf=NO_TRANSFORMS):  # fmt: skip
    """:func:`distill_loss`; ``free``: the gradient w.r.t. ``logits`` taken as free
    log-probability coordinates (the kernel's ``FREE``: ``fused_rl.compat.liger``), not
    through the softmax. The value is the same. ``tf``: the two models' checked
    :class:`Transforms`."""
    _check(logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
           max_length, num_items)  # fmt: skip
    which = resolve_backend(backend, logits, teacher_logits, mask, targets)
    beta, temperature = float(beta), float(temperature)
    if which == "reference":
        return _reference(logits, teacher_logits, beta, temperature, mask, targets,
                          ignore_index, loss_agg, num_items, max_length, free, tf)  # fmt: skip
    student3d, teacher3d = as_rows3d(logits), as_rows3d(teacher_logits)
    outer, inner = student3d.shape[:2]
    rows = lambda t: None if t is None else t.reshape(outer, inner)  # a view, strides kept
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)  # read as bytes, no copy
    n_items, n_items_t = num_items_args(num_items, student3d.device)
    loss, metrics, *_ = distill_fwd_op(
        student3d, teacher3d, rows(targets), rows(mask), n_items_t, beta, temperature,
        int(ignore_index), LOSS_AGG_MODES.index(loss_agg), max_length or inner, n_items,
        bool(free), *tf,
    )  # fmt: skip
    values = metrics.unbind()
    out = {}
    for k, name in enumerate(METRICS):  # a loop, not a comprehension: no Python frame
        out[name] = values[k]
    return loss, out


def _reference(logits, teacher_logits, beta, temperature, mask, targets, ignore_index, loss_agg,
               num_items, max_length, free=False, tf=NO_TRANSFORMS):  # fmt: skip
    """The reference backend: per-token divergences (``fused_rl.reference.distill``), the
    weights of ``fused_rl._agg``, masked means for the metrics."""
    acc = acc_dtype(logits, teacher_logits)
    lead = logits.shape[:-1]
    rows = (1, lead[0]) if logits.dim() == 2 else tuple(lead)
    m = weights_of(mask, logits[..., 0], acc, targets, ignore_index).reshape(rows)
    counted = (m != 0).reshape(lead)
    # each model's scale and cap, on the rows that count (zeroed first: no NaN through the cap)
    logits = ref.capped_rows(logits, counted, tf.softcap, tf.logit_scale)
    teacher_logits = ref.capped_rows(teacher_logits.detach(), counted, tf.teacher_softcap,
                                     tf.teacher_logit_scale)  # fmt: skip
    terms = ref.token_divergences(
        logits, teacher_logits, beta=beta, temperature=temperature, counted=counted,
        free_logprobs=free,
    )  # fmt: skip
    d = terms["d"].reshape(rows)
    w = token_weights(m, loss_agg, max_length=max_length, num_items=num_items, dtype=acc)
    loss = torch.where(w != 0, d * w, torch.zeros_like(d)).sum()
    loss = poison_empty(loss, num_items if loss_agg == "token-mean" else None, w.numel())
    with torch.no_grad():
        metrics = {"jsd": masked_mean_all(d.detach(), m)}
        for name in METRICS[1:]:
            metrics[name] = masked_mean_all(terms[name].reshape(rows), m)
    return loss, metrics
