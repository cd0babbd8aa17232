"""On-policy distillation straight from hidden states: ``linear_distill_loss``.

``linear_distill_loss(hidden, weight, teacher_hidden, teacher_weight)`` returns what
``distill_loss(F.linear(hidden, weight, bias), F.linear(teacher_hidden, teacher_weight,
teacher_bias))`` returns, with neither model's ``(N, V)`` logits ever held whole: the tokens
go through in chunks of ``chunk_tokens`` rows, as in :mod:`fused_rl.linear`.

Per chunk (``h_c`` the student's hidden rows, ``t_c`` the teacher's):

* ``z_s = h_c W^T (+ b)`` and ``z_t = t_c W_t^T (+ b_t)`` through ``F.linear`` (cuBLAS on a
  GPU; the teacher's under no autograd: it gets no gradient), or with
  ``logits_dtype=torch.float32`` a GEMM keeping its fp32 accumulator
  (``fused_rl._wide_gemm.mm_wide``), each of exactly ``chunk`` rows
  (``fused_rl.linear._gemm_rows``: batch invariance);
* the distillation forward kernel (``kernels/vocab/distill.py``) on the chunk's rows writes
  its six partial columns (the divergence, both KLs, both entropies, the token weight) and
  five per-row statistics;
* with gradients on, at once: the distillation backward kernel writes ``dz`` OVER ``z_s``
  in place (Triton; under ``torch.compile`` too, inside the op), scaled by the
  aggregation's per-row factor, which depends on the mask and targets only
  (``fused_rl._agg.sequence_scale``) and so is known before any logit is read; then
  ``dH_c = dz W`` (a GEMM of ``chunk`` rows), ``dW += dz^T h_c`` and ``db += sum dz``, both
  accumulated in fp32 (fp64 for fp64 inputs; ``fused_rl._wide_gemm.addmm_wide``);
* ``z_s``, ``z_t`` are dropped.

One reduction over every chunk's partial columns then gives the loss and the metrics. The
loss is a scalar, so its gradients are formed in the forward (as ``linear_policy_loss`` and
Liger's ``LigerFusedLinearJSD`` do) and the backward only scales ``dH``, ``dW``, ``db`` in
place by the upstream gradient (on the Triton backend one launch that touches none of them
when it is exactly 1; a second backward through the same call forms them again): four GEMMs
per chunk (the two logits, ``dz W``, ``dz^T h``), none recomputed; without gradients
(``torch.no_grad``, nothing requiring grad) two, and no gradient kernel. The ``reference``
backend runs the same chunks and GEMMs with the plain PyTorch math of
:mod:`fused_rl.reference.distill` (``student_grad`` for ``dz``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _validation as V
from ._agg import masked_mean_all, poison_empty, sequence_scale
from ._backend import resolve_backend
from ._ops import FusedOp, _serialised_when_interpreting, _tracing
from ._policy_inputs import num_items_args, per_row, weights_of
from ._whole_rows import whole_rows
from .distill import (
    METRICS,
    NO_TRANSFORMS,
    SAME_AS_STUDENT,
    Transforms,
    _SameAsStudent,
    check_options,
    check_teacher_frozen,
    check_transforms,
    distill_finalize_op,
    distill_rows_fwd_op,
    distill_rows_grad_fwd_op,
    distill_rows_grad_into,
    divergence_grad,
    divergence_stats,
)
from .distributed import (
    _dist,
    check_layout,
    check_layout_keywords,
    check_vocab_limit,
    group_shard,
    shard_args,
    shard_of,
)
from .kernels.modes import LOSS_AGG_MODES
from .linear import (
    HeadGrads,
    _as_params,
    _autocast_inputs,
    _check_linear,
    _chunk_logits,
    _grad_wanted,
    _head_grads_fake,
    _promote_hidden,
    _valid_rows,
    check_second_head,
    chunk_rows,
    formed_grads_backward,
    formed_op_backward,
    formed_op_setup,
    save_formed_grads,
)
from .reference import distill as ref
from .reference.reductions import acc_dtype

# the backward kernel writing over the chunk's logits: a raw launcher (it mutates), serialised
# under the interpreter as every FusedOp is
_rows_grad_into = _serialised_when_interpreting(distill_rows_grad_into)


def default_chunk_tokens(vocab: int, student_dtype: torch.dtype, teacher_dtype: torch.dtype,
                         hidden_size: int | None = None) -> int:  # fmt: skip
    """Rows per chunk holding the student's AND the teacher's logits
    (``fused_rl.linear.chunk_rows``, ``hidden_size`` the student's ``H``): at V = 151936,
    H = 4096 with bf16 logits, 2048 rows (1.24 GB of logits); without ``hidden_size``
    those under 256 MiB alone (441 rows)."""
    return chunk_rows(vocab, student_dtype.itemsize + teacher_dtype.itemsize, hidden_size)


@dataclass(frozen=True)
class _Launch:
    """The non-tensor arguments of a call: the divergence, the aggregation, the chunking."""

    beta: float
    temperature: float
    ignore_index: int
    chunk: int
    outer: int
    inner: int
    agg: int  # index in LOSS_AGG_MODES
    max_length: int  # the seq-mean-token-sum-norm length
    num_items: float  # -1: not a number (None or a tensor)
    which: str  # "triton" | "reference"
    shard: object = None  # fused_rl.distributed.VocabShard of the lm_heads, or None
    reduce_hidden: bool = True  # with a shard: all-reduce the hidden gradient
    tf: Transforms = NO_TRANSFORMS  # each model's logit scale and soft cap
    logits_dtype: torch.dtype | None = None  # the chunk logits' dtype: None, the heads'


def _run(rows, weight, bias, t_rows, t_weight, t_bias, targets, mask, m, row_scale,
         num_items_t, launch, need_h, need_w, need_b, hidden_dtype=None):  # fmt: skip
    """The chunk loop: ``(loss, metrics, d_hidden, d_weight, d_bias)`` with ``metrics`` the
    ``(len(METRICS),)`` fp32 means and the gradients (None where not needed; ``d_hidden`` in
    ``hidden_dtype``, default ``rows``'; ``d_weight``, ``d_bias`` in the fp32 / fp64
    accumulator) of the loss with upstream gradient 1.

    ``targets`` / ``mask``: ``(N,)`` or None (the Triton kernel reads them); ``m``: the
    ``(N,)`` token weights and ``row_scale`` the aggregation's ``(N,)`` factor (None on the
    Triton path without gradients)."""
    n_rows, chunk = rows.shape[0], launch.chunk
    grad = need_h or need_w or need_b
    grads = HeadGrads(rows, weight, (need_h, need_w, need_b), acc_dtype(rows, t_rows),
                      hidden_dtype=hidden_dtype)  # fmt: skip
    acc = grads.acc
    shard = launch.shard
    triton = launch.which == "triton" and shard is None
    if triton:
        part = rows.new_empty((len(METRICS) + 1, n_rows), dtype=acc)
        one = torch.ones((), dtype=acc, device=rows.device) if grad else None
    else:
        terms = rows.new_empty((len(METRICS), n_rows), dtype=acc)
    pick = lambda t, r: None if t is None else t[r]  # noqa: E731
    for start in range(0, n_rows, chunk):
        r = slice(start, min(start + chunk, n_rows))
        h_c = rows[r]
        z, z_full = _chunk_logits(h_c, weight, bias, chunk, launch.logits_dtype)
        zt = _chunk_logits(t_rows[r], t_weight, t_bias, chunk, launch.logits_dtype)[0]
        dz = dz_full = None
        if triton:
            part_c, stats_c = distill_rows_fwd_op(
                z, zt, pick(targets, r), pick(mask, r), launch.beta, launch.temperature,
                launch.ignore_index, *launch.tf,
            )  # fmt: skip
            part[:, r] = part_c
            if grad and (torch.compiler.is_compiling() or _tracing()):  # may not mutate
                dz = distill_rows_grad_fwd_op(z, zt, stats_c, part_c, row_scale[r], one,
                                              launch.beta, launch.temperature,
                                              *launch.tf)  # fmt: skip
            elif grad:  # the chunk's logits become their gradient in place
                dz = _rows_grad_into(z, z, zt, stats_c, part_c, row_scale[r], one,
                                     launch.beta, launch.temperature, *launch.tf)  # fmt: skip
                dz_full = z_full
        elif shard is not None:  # this rank's vocabulary shard, merged across ranks per chunk
            counted = (m[r] != 0)[None]
            d, extra, stats = divergence_stats(
                z[None], zt[None], counted, launch.temperature, launch.which, shard,
                launch.beta, True, launch.tf,
            )  # fmt: skip
            terms[:, r] = torch.cat((d, extra[:, 0]))
            if grad:
                w = (m[r] * row_scale[r])[None]
                dz = divergence_grad(z[None], zt[None], stats, w, launch.temperature,
                                     launch.which, launch.beta, launch.tf,
                                     shard)[0]  # fmt: skip
        else:
            w = (m[r] * row_scale[r])[:, None] if grad else None
            terms[:, r], dz = _reference_chunk(z, zt, m[r] != 0, w, launch)
        # with dz written over z, its GEMM buffer is z's
        grads.add(r, dz, dz_full, h_c, weight, chunk)
        del z, z_full, zt, dz, dz_full, h_c
    d_hidden, d_weight, d_bias = grads.grads()
    if need_h and shard is not None and launch.reduce_hidden:  # dz W_local: a part of dH
        _dist().all_reduce(d_hidden, group=shard.group)
    if triton:
        loss, metrics, _ = distill_finalize_op(
            part, launch.outer, launch.inner, launch.agg, launch.max_length, launch.num_items,
            num_items_t,
        )  # fmt: skip
        metrics = metrics[: len(METRICS)]
    else:
        w = m * row_scale
        d = terms[0]
        loss = torch.where(w != 0, d * w, torch.zeros_like(d)).sum()
        metrics = torch.stack([masked_mean_all(x, m) for x in terms.unbind()])
    return loss, metrics, d_hidden, d_weight, d_bias


def _reference_chunk(z: Tensor, zt: Tensor, counted: Tensor, w: Tensor | None, launch):
    """The ``reference`` backend on one unsharded chunk: ``(terms, dz)``, the chunk's
    ``(len(METRICS), n)`` per-token terms and, with the per-row weights ``w`` ``(n, 1)``,
    ``dL/dz`` in ``z``'s dtype (None without). A function of its own, so that its
    ``(n, V)`` temporaries are gone before the next chunk's GEMMs."""
    tf = launch.tf
    # each model's scale and cap on rows that count (no NaN through the cap)
    zc, slope = ref.capped_rows_and_slope(z, counted, tf.softcap, tf.logit_scale)
    ztc = ref.capped_rows(zt, counted, tf.teacher_softcap, tf.teacher_logit_scale)
    out = ref.token_divergences(zc, ztc, beta=launch.beta, temperature=launch.temperature,
                                counted=counted)  # fmt: skip
    terms = torch.stack([out["d"].detach()] + [out[k] for k in METRICS[1:]])
    if w is None:
        return terms, None
    g = ref.student_grad(zc, ztc, beta=launch.beta, temperature=launch.temperature,
                         counted=counted)  # fmt: skip
    if slope is not None:  # dz/dx of the scale and the cap
        g = g * slope
    return terms, torch.where(w != 0, g * w, torch.zeros_like(g)).to(z.dtype)


def linear_distill_fwd(rows: Tensor, weight: Tensor, bias: Tensor | None, t_rows: Tensor,
                       t_weight: Tensor, t_bias: Tensor | None, targets: Tensor | None,
                       mask: Tensor | None, m: Tensor | None, row_scale: Tensor | None,
                       num_items_t: Tensor | None, need_h: bool, need_w: bool, need_b: bool,
                       beta: float, temperature: float, ignore_index: int, chunk: int,
                       outer: int, inner: int, agg: int, max_length: int, num_items: float,
                       which: str, softcap: float | None, logit_scale: float,
                       teacher_softcap: float | None, teacher_logit_scale: float,
                       logits_dtype: torch.dtype | None, compute_dtype: torch.dtype | None,
                       reduce_hidden: bool,
                       group_name: str | None, start: int, columns: int, vocab_size: int,
                       explicit: bool) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                Tensor]:  # fmt: skip
    """:class:`_LinearDistill` traced (the chunk loop inside one custom op, as
    ``fused_rl.linear.linear_stats_fwd``; the lm_heads' shard, if any, as
    :func:`fused_rl.distributed.shard_args`' primitive arguments): ``(loss, metrics,
    d_hidden, d_weight, d_bias)``, the gradients formed with upstream gradient 1 in the
    parameters' dtypes, empty where not needed. ``compute_dtype``: the GEMMs on copies of
    ``rows`` / ``weight`` (and ``bias``, but with ``logits_dtype``) in that dtype
    (autocast's), made here, the gradients formed for the given tensors."""
    tf = Transforms(softcap, logit_scale, teacher_softcap, teacher_logit_scale)
    shard = shard_of(group_name, start, columns, vocab_size, explicit, "weight")
    launch = _Launch(beta, temperature, ignore_index, chunk, outer, inner, agg, max_length,
                     num_items, which, shard, reduce_hidden, tf, logits_dtype)  # fmt: skip
    head = _compute_copies(rows, weight, bias, compute_dtype, logits_dtype)
    loss, metrics, *grads = _run(
        *head, t_rows, t_weight, t_bias, targets, mask, m, row_scale, num_items_t, launch,
        need_h, need_w, need_b, rows.dtype,
    )  # fmt: skip
    grads = _as_params(grads, weight, bias)
    return loss, metrics, *(rows.new_empty((0,)) if g is None else g for g in grads)


def _compute_copies(rows, weight, bias, compute_dtype, logits_dtype) -> tuple:
    """``(rows, weight, bias)`` as the GEMMs take them: copies in ``compute_dtype`` (None:
    the tensors themselves), the bias as given with fp32 ``logits_dtype``."""
    if compute_dtype is None:
        return rows, weight, bias
    keep_bias = bias is None or logits_dtype is not None
    return (
        rows.to(compute_dtype),
        weight.to(compute_dtype),
        bias if keep_bias else bias.to(compute_dtype),
    )


def _linear_distill_fwd_fake(rows, weight, bias, t_rows, *args):
    compute_dtype = args[-7]
    acc = acc_dtype(rows if compute_dtype is None else rows.to(compute_dtype), t_rows)
    loss = rows.new_empty((), dtype=acc)
    metrics = rows.new_empty(len(METRICS), dtype=torch.float32)
    return loss, metrics, *_head_grads_fake(rows, weight, bias, *args[7:10])


linear_distill_fwd_op = FusedOp("linear_distill_fwd", linear_distill_fwd)
linear_distill_fwd_op.register_fake(_linear_distill_fwd_fake)
linear_distill_fwd_op.register_autograd(formed_op_backward, setup_context=formed_op_setup(11))


class _LinearDistill(torch.autograd.Function):
    """The distillation loss of ``F.linear(rows, weight, bias)`` against the teacher's
    ``F.linear(t_rows, t_weight, t_bias)``, its gradients (``rows``, ``weight``, ``bias``)
    formed in the forward chunk by chunk and scaled by the upstream scalar in the backward
    (module docstring). ``compute``: the ``(rows, weight, bias)`` the GEMMs use, detached
    copies in the autocast dtype under ``torch.autocast`` (the gradients of the wider
    ``rows``, ``weight``, ``bias`` themselves then come from fp32 accumulators, not rounded
    to that dtype first), or None: the inputs."""

    @staticmethod
    def forward(ctx, rows, weight, bias, t_rows, t_weight, t_bias, targets, mask, m, row_scale,
                num_items_t, launch, compute):  # fmt: skip
        needs = ctx.needs_input_grad[:3]
        rest = (t_rows, t_weight, t_bias, targets, mask, m, row_scale, num_items_t)
        loss, metrics, *grads = _run(*(compute or (rows, weight, bias)), *rest, launch, *needs,
                                     rows.dtype)  # fmt: skip
        dtypes = None if compute is None else [None if c is None else c.dtype for c in compute]

        def reform(rows, weight, bias, *rest):  # the autocast copies made again
            head = (rows, weight, bias)
            if dtypes is not None:
                head = [None if x is None else x.detach().to(d) for x, d in zip(head, dtypes)]
            return _run(*head, *rest, launch, *needs, rows.dtype)[2:]

        save_formed_grads(ctx, (rows, weight, bias), grads, launch.which, rest, reform)
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        return formed_grads_backward(ctx, grad_loss)


# ----------------------------------------------------------------------------- checks


def _check_targets(targets, lead) -> None:
    if targets is None:
        return
    V.check_tensor(targets, "targets")
    if targets.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"targets must be an int64 or int32 tensor, got {targets.dtype}")
    if tuple(targets.shape) != lead:
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {lead}, got {tuple(targets.shape)}"
        )


def _prepare(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, beta,
             temperature, mask, targets, ignore_index, loss_agg, max_length, num_items,
             chunk_tokens, sharded=False):  # fmt: skip
    """Checked (autocast-cast, promoted) inputs, before any GEMM (``sharded``: the heads are
    vocabulary shards, which may hold no row)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("teacher_hidden", teacher_hidden),
                    ("teacher_weight", teacher_weight)):  # fmt: skip
        V.check_tensor(t, name)
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    teacher_hidden, teacher_weight, teacher_bias = _autocast_inputs(
        teacher_hidden, teacher_weight, teacher_bias
    )
    hidden = _promote_hidden(hidden, weight)
    teacher_hidden = _promote_hidden(teacher_hidden, teacher_weight)
    _check_linear(hidden, weight, bias, sharded)
    V.check_float(teacher_hidden, "teacher_hidden")
    V.check_float(teacher_weight, "teacher_weight")
    check_second_head(
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        hidden,
        weight,
        ("teacher_hidden", "teacher_weight", "teacher_bias"),
        "teacher's",
    )
    check_teacher_frozen(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight,
                         teacher_bias=teacher_bias)  # fmt: skip
    lead = tuple(hidden.shape[:-1])
    _check_targets(targets, lead)
    check_options(lead, "hidden.shape[:-1]", beta, temperature, mask, ignore_index, loss_agg,
                  max_length, num_items)  # fmt: skip
    if chunk_tokens is not None:
        V.check_number(chunk_tokens, "chunk_tokens")
        if int(chunk_tokens) != chunk_tokens or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    V.check_same_device(hidden=hidden, weight=weight, bias=bias, teacher_hidden=teacher_hidden,
                        teacher_weight=teacher_weight, teacher_bias=teacher_bias, mask=mask,
                        targets=targets)  # fmt: skip
    return hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias


def _bias_as_given(given: Tensor | None, cast: Tensor | None) -> Tensor | None:
    """The bias fp32 chunk logits add: the caller's own (detached; its gradient is formed
    apart) where autocast cast it to a narrower dtype, else ``cast``."""
    if given is None or cast is None or given.dtype == cast.dtype:
        return cast
    return given.detach()


def _check_logits_dtype(logits_dtype, weight: Tensor, teacher_weight: Tensor):
    """``logits_dtype`` checked: None or ``torch.float32``, never narrower than a head (fp64
    heads); None where both heads already compute in fp32."""
    if logits_dtype is None:
        return None
    if logits_dtype != torch.float32:
        raise ValueError(f"logits_dtype must be None or torch.float32, got {logits_dtype}")
    if torch.float64 in (weight.dtype, teacher_weight.dtype):
        raise ValueError(
            "logits_dtype=torch.float32 is narrower than the fp64 heads: pass None for fp64"
        )
    if weight.dtype == teacher_weight.dtype == torch.float32:
        return None
    return logits_dtype


# ----------------------------------------------------------------------------- public API


def linear_distill_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
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
    chunk_tokens: int | None = None,
    logits_dtype: torch.dtype | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`fused_rl.distill_loss` straight from both models' final hidden states and
    lm_heads: the same loss, gradients (for ``hidden``, ``weight``, ``bias``) and metrics as
    ``distill_loss(F.linear(hidden, weight, bias), F.linear(teacher_hidden, teacher_weight,
    teacher_bias), ...)``, with neither model's ``(N, V)`` logits ever held whole.

    No causal shift: row ``t`` of ``hidden`` and of ``teacher_hidden`` give the two
    distributions at position ``t`` (the distillation compares the models at the same
    positions), unlike :func:`linear_token_logprobs`, whose ``(B, S, H)`` rows predict
    ``(B, T)`` targets. Slice the positions to distil yourself (``hidden[:, :-1]``: a view,
    read as it is), or leave them in and mask them out.

    Args:
        hidden: the student's ``(B, T, H)`` (or packed ``(N, H)``: one sequence) final hidden
            states, fp32 / bf16 / fp16 (fp64 for gradcheck), any strides.
        weight: the student's lm_head ``(V, H)``, ``hidden``'s dtype or a wider one (an fp32
            head with bf16 hidden states: ``hidden`` is cast up, its gradient returned in its
            own dtype).
        teacher_hidden: the teacher's hidden states, ``hidden``'s leading shape and its own
            width ``H_t``; any float dtype.
        teacher_weight: the teacher's lm_head ``(V, H_t)``: the same vocabulary ``V``
            (``ValueError`` otherwise). The teacher gets no gradient: a teacher tensor that
            requires grad raises ``ValueError`` naming it (pass ``.detach()``, or freeze the
            teacher's parameters with ``requires_grad_(False)``).
        bias, teacher_bias: optional ``(V,)`` biases of the two heads.
        beta, temperature, softcap, teacher_softcap, logit_scale, teacher_logit_scale, mask,
            targets, ignore_index, loss_agg, num_items, max_length: as :func:`distill_loss`,
            over ``hidden.shape[:-1]`` (``targets`` only mark ignored positions, never read
            as an index; each model's chunk logits ``x`` become ``c tanh(s x / c) / T`` with
            its own scale ``s`` and cap ``c``: ``softcap`` caps both unless
            ``teacher_softcap`` is given, ``None`` an uncapped teacher; TRL's
            ``DistillationTrainer`` with models of different ``logit_scale`` /
            ``final_logit_softcapping``).
        chunk_tokens: rows per chunk; None: as many as keep one chunk's student and
            teacher logits together under 256 MiB, or up to 2048 rows under ``2 V H`` bytes
            (the size of a 16-bit lm_head; fewer chunks, fewer read-writes of the fp32
            ``dW``; :func:`default_chunk_tokens`), at most 4096.
        logits_dtype: None (default): each chunk's logits in its head's dtype, what
            ``F.linear`` gives (bf16 heads: logits rounded to bf16 before the divergence);
            ``torch.float32``: the GEMMs' fp32 accumulators kept (``torch.mm(...,
            out_dtype=torch.float32)`` where torch has it, CUDA; elsewhere the GEMM on fp32
            copies of the rows and the head: a ``4 V H``-byte copy of each head per
            chunk), the biases added in fp32 (as given:
            under autocast a wider bias unrounded), ``dz`` formed in fp32 and rounded to the
            head's dtype for its two GEMMs (its bias sum in fp32):
            the numerics of TRL's ``DistillationTrainer``, whose tiles are fp32, at twice the
            chunk bytes (the default chunk holds half the rows). No effect on fp32 heads;
            ``ValueError`` for another dtype or with an fp64 head.
        process_group: vocabulary (tensor) parallelism, the Megatron ``ColumnParallelLinear``
            lm_head: ``weight`` / ``bias`` and ``teacher_weight`` / ``teacher_bias`` are this
            rank's equal-width ``(V_local, H)`` shards of the two heads, the hidden states
            the same on every rank. Every rank returns the unsharded loss and metrics,
            its shard of the heads' gradients and the WHOLE hidden gradient (all-reduced:
            one ``N H`` collective after the chunks). Per chunk the two all-reduces of
            :func:`distill_loss`'s ``process_group`` (a third for the JSD), then each rank
            writes its shard's ``dz`` (a fresh chunk-sized buffer, not over the logits) from
            the merged statistics. The default chunk comes from the global vocabulary
            (``vocab_size``, else ``world * V_local``), so every rank runs the same chunks:
            the layout is checked first (one small all-reduce, ``ValueError`` on every rank)
            in eager mode with ``fused_rl.config.check_values``; unchecked the ranks must
            pass the same ``vocab_size`` (a bad layout then gives NaN).
        vocab_start, vocab_size: the layout of the lm_head shards, with ``process_group``,
            as for :func:`fused_rl.linear_token_logprobs` (``vocab_size`` alone: Megatron's
            padded vocabulary, its padding rows unread and given a zero gradient; both:
            ragged shards).
        reduce_hidden_grad: with ``process_group``: True (default) all-reduces (SUM) the
            hidden gradient over the group; False leaves each rank its partial ``dz W_local``
            (they sum to the unsharded gradient) for a framework that reduces it itself
            (Megatron's sequence parallelism), as :func:`fused_rl.linear_token_logprobs`.
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(loss, metrics)`` as :func:`distill_loss`: ``loss`` a 0-dim fp32 tensor (fp64 when
        an input is fp64); ``metrics`` ``jsd``, ``forward_kl``, ``reverse_kl``,
        ``student_entropy``, ``teacher_entropy`` (detached fp32 0-dim).

    Under ``torch.autocast`` the hidden states and heads compute in the autocast dtype, as
    ``F.linear`` would; the gradients of wider (fp32) hidden states and heads are fp32
    accumulators (``dz W`` with an fp32 output, ``dz^T h`` and ``sum dz`` accumulated in
    fp32), where ``F.linear``'s would be rounded to the autocast dtype first (TRL's
    ``DistillationTrainer`` returns them so too).

    Memory above the inputs (``c`` rows a chunk, ``b_s`` / ``b_t`` bytes per student /
    teacher logit, ``b_h`` per student hidden element): one chunk of student logits
    ``c V b_s`` and one of teacher logits ``c V b_t`` (``dz`` is written over the student's;
    ``b_s = b_t = 4`` with ``logits_dtype=torch.float32``, plus ``dz``'s ``c V`` copy in the
    head's dtype),
    ``dW`` in fp32 ``4 V H`` (plus, off CUDA with 16-bit inputs, fp32 copies of the chunk's
    ``dz`` and rows for the accumulation), ``dH`` ``N H b_h`` and ``db``, and ``4 (6 + 2) N``
    bytes of per-token floats (the six partial columns, the token weight and the
    aggregation's factor). Nothing of size ``N V``. Between the forward and the backward it
    keeps ``dH`` and ``dW``, ``db`` in the heads' dtype.

    Cost per chunk with gradients: four GEMMs (student and teacher logits, ``dz W``,
    ``dz^T h``) and two vocab kernels (the forward kernel reads both logits rows once, twice
    for ``0 < beta < 1``; the backward kernel reads both and writes ``dz``): in bf16, per
    vocabulary entry and row, the GEMMs write ``z_s`` and ``z_t`` (2 + 2 bytes), the kernels
    read 4 (8 for the JSD) + 4 and write 2, the gradient GEMMs read ``dz`` (2 + 2). Then one
    finalize reduction for the loss and the metrics; the backward scales the three gradients
    in place by the upstream scalar (no byte read when it is 1). With ``process_group`` per
    chunk: the forward kernel (and its unused finalize), the JSD's second pass, the backward
    kernel into a fresh buffer, and the collectives above.

    Example:
        >>> import torch, torch.nn.functional as F, fused_rl
        >>> h = torch.randn(2, 5, 8, requires_grad=True)
        >>> w = torch.randn(11, 8, requires_grad=True)
        >>> th, tw = torch.randn(2, 5, 12), torch.randn(11, 12)  # a wider teacher
        >>> loss, metrics = fused_rl.linear_distill_loss(h, w, th, tw, beta=0.5, chunk_tokens=4)
        >>> want, _ = fused_rl.distill_loss(F.linear(h, w), F.linear(th, tw), beta=0.5)
        >>> bool(torch.allclose(loss, want, atol=1e-6))
        True
        >>> loss.backward()
        >>> h.grad.shape, w.grad.shape
        (torch.Size([2, 5, 8]), torch.Size([11, 8]))
    """
    given_hidden, head = hidden, (weight, bias)  # the caller's: what gets the gradients
    given_t_bias = teacher_bias
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias = _prepare(
        hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, beta, temperature,
        mask, targets, ignore_index, loss_agg, max_length, num_items, chunk_tokens,
        process_group is not None,
    )  # fmt: skip
    logits_dtype = _check_logits_dtype(logits_dtype, weight, teacher_weight)
    if logits_dtype is not None:  # fp32 logits: the biases added as given, not autocast's
        # rounded copies (a bias wider than the head's compute dtype enters the fp32 sum)
        bias = _bias_as_given(head[1], bias)
        teacher_bias = _bias_as_given(given_t_bias, teacher_bias)
    tf = check_transforms(softcap, teacher_softcap, logit_scale, teacher_logit_scale)
    if not isinstance(reduce_hidden_grad, bool):
        raise TypeError(f"reduce_hidden_grad must be a bool, got {type(reduce_hidden_grad)}")
    check_layout_keywords(process_group, vocab_start, vocab_size)
    shard = None
    if process_group is not None:
        shard = group_shard(process_group, weight.shape[0], vocab_start, vocab_size,
                            name="weight")  # fmt: skip
        check_vocab_limit(shard)
        if V.value_checks_enabled(hidden):  # before the chunks, whose count follows vocab_size
            check_layout(shard, hidden.device)
        # a padded vocabulary's padding rows: never read (autograd's slice gives them 0)
        weight, bias = _valid_rows(weight, bias, shard.valid)
        head = _valid_rows(*head, shard.valid)
        teacher_weight, teacher_bias = _valid_rows(teacher_weight, teacher_bias, shard.valid)
    which = resolve_backend(backend, hidden, weight, bias, teacher_hidden, teacher_weight,
                            teacher_bias, mask, targets)  # fmt: skip
    lead = tuple(hidden.shape[:-1])
    outer, inner = lead if len(lead) == 2 else (1, lead[0])
    rows = hidden.reshape(-1, hidden.shape[-1])
    t_rows = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])
    vocab = weight.shape[0]
    chunk = (
        int(chunk_tokens)
        if chunk_tokens
        else default_chunk_tokens(
            vocab if shard is None else shard.vocab_size,
            logits_dtype or rows.dtype,
            logits_dtype or t_rows.dtype,
            rows.shape[1],
        )
    )
    grad = _grad_wanted(rows, weight, bias)
    acc = acc_dtype(rows, t_rows)
    m = row_scale = None
    if which == "reference" or grad or shard is not None:  # the factor: from the mask alone
        as2d = lambda t: None if t is None else t.reshape(outer, inner)  # noqa: E731
        m2 = weights_of(as2d(mask), rows.new_empty((outer, inner)), acc, as2d(targets),
                        int(ignore_index))  # fmt: skip
        scale = sequence_scale(m2, loss_agg, max_length=max_length, num_items=num_items)
        row_scale = whole_rows(per_row(scale, (outer, inner)))
        m = whole_rows(m2.reshape(-1))
    flat_mask = None if mask is None else whole_rows(mask.detach().reshape(-1))
    if flat_mask is not None and flat_mask.dtype == torch.bool:
        flat_mask = flat_mask.view(torch.uint8)  # read as bytes, no copy
    flat_targets = None if targets is None else whole_rows(targets.reshape(-1))
    n_items, n_items_t = num_items_args(num_items, rows.device)
    launch = _Launch(
        float(beta), float(temperature), int(ignore_index), chunk, outer, inner,
        LOSS_AGG_MODES.index(loss_agg), max_length or inner, n_items, which, shard,
        bool(reduce_hidden_grad), tf, logits_dtype,
    )  # fmt: skip
    t_args = (t_rows.detach(), teacher_weight.detach(),
              None if teacher_bias is None else teacher_bias.detach(), flat_targets, flat_mask,
              m, row_scale, n_items_t, launch)  # fmt: skip
    narrowed = lambda x, given: x.element_size() < given.element_size()  # noqa: E731
    autocast_copies = grad and (narrowed(weight, head[0]) or narrowed(hidden, given_hidden))
    with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
        if torch.compiler.is_compiling():  # one op: any token count
            # autocast's copies made inside the op, the gradients formed for the given tensors
            compute_dtype = rows.dtype if autocast_copies else None
            given = (given_hidden.reshape(rows.shape), *head) if autocast_copies else (
                rows, weight, bias)  # fmt: skip
            grad_on = torch.is_grad_enabled()
            needs = [grad_on and t is not None and t.requires_grad for t in given]
            loss, metrics, *_ = linear_distill_fwd_op(
                *given, *t_args[:-1], *needs, launch.beta, launch.temperature,
                launch.ignore_index, launch.chunk, launch.outer, launch.inner, launch.agg,
                launch.max_length, launch.num_items, launch.which, *launch.tf,
                launch.logits_dtype, compute_dtype, launch.reduce_hidden, *shard_args(shard),
            )  # fmt: skip
        elif autocast_copies:
            # autocast: the GEMMs on detached copies, the gradients to the caller's tensors
            copies = rows.detach(), weight.detach(), None if bias is None else bias.detach()
            given_rows = given_hidden.reshape(rows.shape)
            loss, metrics = _LinearDistill.apply(given_rows, *head, *t_args, copies)
        elif grad:
            loss, metrics = _LinearDistill.apply(rows, weight, bias, *t_args, None)
        else:
            with torch.no_grad():
                loss, metrics, *_ = _run(rows, weight, bias, *t_args, False, False, False)
    loss = poison_empty(loss, num_items if loss_agg == "token-mean" else None, rows.shape[0])
    values = metrics.unbind()
    out = {}
    for k, name in enumerate(METRICS):
        out[name] = values[k]
    return loss, out


__all__ = ["default_chunk_tokens", "linear_distill_loss"]
