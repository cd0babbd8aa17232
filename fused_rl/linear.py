"""Log-probs straight from hidden states: the ``(N, V)`` logits are never materialised whole.

``linear_token_logprobs(hidden, weight, targets)`` returns what
``token_logprobs(F.linear(hidden, weight, bias), targets)`` returns, but works through the
tokens in chunks of ``chunk_tokens`` rows. Per chunk:

* forward: ``z = h_c W^T (+ b)`` through ``torch.nn.functional.linear`` (cuBLAS on a GPU:
  the GEMM is never hand-written), then the layer-1 kernel reads ``z`` once for the
  per-token ``logp`` / entropy and the softmax normaliser (row max, log-sum, 8 bytes a
  token kept for the backward); ``z`` is dropped.
* backward: ``z`` is recomputed (one more GEMM, as verl's ``FusedLinearForPPO`` does),
  the layer-3 kernel overwrites it IN PLACE with ``dz`` from the
  upstream ``dL/dlogp``, ``dL/dH`` and the saved normaliser, then ``dH_c = dz W`` and
  ``dW += dz^T h_c`` (``dW`` and ``db`` accumulate in fp32, fp64 for fp64 inputs, and
  are cast once at the end).

``linear_policy_loss`` (Triton backend, gradients on, token-level importance sampling) does
better: its output is one scalar, so the chunk's gradients are formed in the FORWARD
(:class:`_LinearPolicyLoss`: one vocab kernel per chunk computes the loss terms and
overwrites ``z`` with ``dz``, then ``dH_c``, ``dW``) and the backward only scales them in
place by the upstream gradient (one launch that touches none of them when it is exactly 1; a
second backward through the same call forms them again): three GEMMs per chunk instead of
four. In eager mode it runs on the counted rows only (``config.skip_padding_rows``: mask
weight != 0, target != ``ignore_index``; one host sync for their count, as TRL's
GRPOTrainer), so padding costs no GEMM work; skipped rows get the partials of an uncounted
token (``uncounted_partials``) and a zero ``dH``, what their programs would write.

Peak memory above the inputs: one chunk's logits, ``dW`` in fp32 (the GEMM accumulates into
it directly on CUDA; elsewhere through fp32 copies of the chunk) and ``dH``.

Vocabulary parallelism (``process_group=``, a Megatron ``ColumnParallelLinear`` lm_head:
each rank its ``(V_local, H)`` weight shard, ``hidden`` replicated): the chunks' layer-1
partials on the local shard merge ONCE per call through
:func:`fused_rl.distributed.merge_partials` (two all-reduces however many chunks); the
backward is local (layer 3 with the global statistics, the shard's ``dW``) but for one
all-reduce of ``dH`` (``reduce_hidden_grad=True``, the default), so that every rank's
``hidden`` gradient is the unsharded one.

``chunk_tokens=None`` picks the chunk of :func:`chunk_rows`: the rows whose logits fit in
``CHUNK_BYTES`` (256 MiB), or up to 2048 rows under ``2 V H`` bytes, since every chunk
reads and writes the whole fp32 ``dW`` once: at V = 151936, H = 4096 in bf16, 2048 rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _validation as V
from . import config
from ._agg import poison_empty, sequence_scale
from ._backend import resolve_backend
from ._launch import stats_dtype
from ._ops import FusedOp, _serialised_when_interpreting, _tracing
from ._policy_inputs import (
    RolloutInputs,
    advantages_2d,
    check_call,
    check_full_kl_route,
    check_token_tensors,
    counted_mask,
    entropy_scale,
    is_weights_2d,
    num_items_args,
    per_row,
    rollout_constants,
    weights_of,
)
from ._policy_ops import (
    N_COLS,
    N_OUTPUTS,
    metrics_dict,
    policy_finalize_op,
    policy_rows_grad_fwd_op,
    policy_rows_grad_into,
    scale_rows_unless_one_launch,
    uncounted_partials,
)
from ._truncated_ops import (
    truncated_bwd_into,
    truncated_logprobs_bwd_op,
    truncated_logprobs_fwd_op,
)
from ._vocab_ops import (
    token_extras_fwd_op,
    token_stats_bwd_into,
    token_stats_bwd_op,
    token_stats_fwd_op,
)
from ._whole_rows import whole_rows
from ._wide_gemm import addmm_wide, mm_wide
from .distill import N_STATS, Transforms, divergence_grad, divergence_stats
from .distributed import (
    MAX_VOCAB,
    check_layout_keywords,
    check_local,
    check_vocab_limit,
    group_shard,
    shard_args,
    shard_of,
)
from .logprobs import TokenStats
from .losses import loss_from_token_stats, loss_with_exact_kl, policy_loss
from .policy_config import PolicyConfig, takes_policy_options
from .reference import logprobs as ref
from .reference import truncated as ref_truncated
from .reference.logprobs import differentiable_once
from .truncated import check_options, cuts

# layer 3 writing over its input: a raw launcher (no custom op, it mutates), serialised and
# with NumPy's masked-lane warnings silenced under the interpreter as every FusedOp is
_stats_bwd_into = _serialised_when_interpreting(token_stats_bwd_into)
_policy_rows_grad_into = _serialised_when_interpreting(policy_rows_grad_into)

CHUNK_BYTES = 256 * 2**20  # a chunk's logits may always take this much
HEAD_CHUNK_ROWS = 2048  # ... and up to this many rows while they stay under 2 V H bytes
MAX_DEFAULT_CHUNK = 4096  # rows: a small vocabulary's chunk (and its padding) stays small


def chunk_rows(vocab: int, logit_bytes: int, hidden_size: int | None = None) -> int:
    """Rows per chunk of a chunked lm_head op whose chunk holds ``logit_bytes`` bytes of
    logits per vocabulary column (2 for one bf16 model, 4 for a bf16 student and teacher):
    as many as fit in :data:`CHUNK_BYTES`, or, where ``hidden_size`` (the lm_head's ``H``)
    allows more, up to :data:`HEAD_CHUNK_ROWS` rows whose logits take at most ``2 V H``
    bytes (a 16-bit lm_head's own size, half its fp32 gradient accumulator); at most
    :data:`MAX_DEFAULT_CHUNK` rows.

    Why the second bound: each chunk's ``dW += dz^T h_c`` reads and writes the whole fp32
    ``dW`` (``8 V H`` bytes), against ``2 rows H V`` flops per GEMM of the chunk; at a GPU's
    ~200 flops a byte (an H100 / H200's bf16 GEMM rate over its copy bandwidth) the
    accumulator costs about ``270 / rows`` of the three GEMMs a chunk of
    ``linear_policy_loss`` runs: 30 % at 883 rows, 13 % at 2048. The rule depends on
    ``V``, ``H`` and the dtypes only, never on the batch or on the grad mode, so a no-grad
    call's GEMMs have the training call's shapes (batch invariance)."""
    per_row = max(1, vocab * logit_bytes)
    rows = CHUNK_BYTES // per_row
    if hidden_size:
        rows = max(rows, min(HEAD_CHUNK_ROWS, 2 * hidden_size // logit_bytes))
    return max(1, min(MAX_DEFAULT_CHUNK, rows))


def default_chunk_tokens(vocab: int, dtype: torch.dtype, hidden_size: int | None = None) -> int:
    """Rows per chunk of the ops from hidden states with ``dtype`` logits (:func:`chunk_rows`):
    at V = 151936, H = 4096 in bf16, 2048 rows (622 MB of logits); without ``hidden_size``
    the :data:`CHUNK_BYTES` bound alone (883 rows)."""
    return chunk_rows(vocab, dtype.itemsize, hidden_size)


def _gemm_rows(rows: Tensor, chunk: int) -> Tensor:
    """``rows`` (``n <= chunk`` of them) as the operand of a GEMM of exactly ``chunk`` rows:
    zero rows appended (``config.batch_invariant``). Every GEMM a row goes through then has
    a shape fixed by the vocabulary, the dtype and ``chunk_tokens``, never by how many rows
    the call holds, so the kernel the BLAS library picks for it, and the row's result, do
    not depend on the batch (a result row depends only on its operand row)."""
    n = rows.shape[0]
    if n == chunk or not config.batch_invariant:
        return rows
    padded = rows.new_zeros((chunk, rows.shape[1]))
    padded[:n] = rows
    return padded


def _chunk_logits(rows: Tensor, weight: Tensor, bias: Tensor | None, chunk: int,
                  dtype: torch.dtype | None = None):  # fmt: skip
    """``(z, z_full)``: the ``(n, V)`` logits of ``rows`` and the GEMM's whole output, of
    which ``z`` is the first ``n`` rows (``_gemm_rows``). ``dtype`` wider than the head's:
    the GEMM's accumulator kept in it (``mm_wide``), the bias added in it."""
    full = _gemm_rows(rows, chunk)
    if dtype is None or dtype == weight.dtype:
        z_full = F.linear(full, weight, bias)
    else:
        z_full = mm_wide(full, weight.t(), dtype)
        if bias is not None:
            z_full.add_(bias)
    return z_full[: rows.shape[0]], z_full


def _hidden_grad(dz: Tensor, weight: Tensor, chunk: int, dz_full: Tensor | None = None,
                 dtype: torch.dtype | None = None) -> Tensor:  # fmt: skip
    """``dz W`` for the chunk's ``n`` rows through a GEMM of ``chunk`` rows: ``dz_full``, the
    buffer ``dz`` is the head of (its other rows hold finite values no result row reads), or
    ``dz`` padded (``_gemm_rows``); ``dtype`` wider than the head's: the GEMM's accumulator
    kept in it (``mm_wide``)."""
    n = dz.shape[0]
    full = dz_full if dz_full is not None and config.batch_invariant else _gemm_rows(dz, chunk)
    if dtype is None or dtype == weight.dtype:
        return (full @ weight)[:n]
    return mm_wide(full, weight, dtype)[:n]


def _chunk_stats(z: Tensor, targets: Tensor, temperature, softcap, ignore_index, which,
                 extras: bool = False):  # fmt: skip
    """``(logp, entropy, row_max, log_sum)`` of one chunk's ``(n, V)`` logits; ``extras``:
    then ``(mean_logit, log_sum_sq_probs, is_top1, raw_max)`` from the same read."""
    args = (z[None], targets[None], temperature, softcap, ignore_index)
    if which == "triton":
        out = token_extras_fwd_op(*args) if extras else token_stats_fwd_op(*args, True)
    else:
        out = ref.row_stats(z[None], targets[None], temperature, ignore_index, softcap)
        if extras:
            out += ref.row_extras(z[None], targets[None], temperature, ignore_index, softcap)
    return tuple(x[0] for x in out)


def _chunk_grad(z, targets, row_max, log_sum, entropy, g, h, temperature, softcap, ignore_index,
                which):  # fmt: skip
    """``(dz, in_place)``: ``dL/dz`` of one chunk's ``(n, V)`` logits from per-token
    ``(n,)`` statistics and ``g``/``h``: layer 3, written over ``z`` (``in_place``) on the
    Triton path (a fresh buffer where the loop itself is traced, e.g. by a bare ``make_fx``:
    a traced op cannot mutate its input; under ``torch.compile`` the loops run inside
    opaque ops)."""
    col = lambda t: None if t is None else t.reshape(-1, 1)  # noqa: E731
    args = (col(targets), col(row_max), col(log_sum), col(entropy), col(g), col(h))
    z3 = z[:, None]
    if which == "reference":
        return ref.grad_logits(z3, *args, temperature, ignore_index, softcap)[:, 0], False
    rest = (None, None, temperature, softcap, ignore_index)
    if torch.compiler.is_compiling() or _tracing():  # a traced op may not mutate its input
        return token_stats_bwd_op(z3, *args, *rest)[:, 0], False
    return _stats_bwd_into(z3, z3, *args, *rest)[:, 0], True


class _LinearTokenStats(torch.autograd.Function):
    """``(logp, entropy)`` of ``F.linear(hidden, weight, bias)`` for ``(N, H)`` hidden rows
    and ``(N,)`` targets, chunk by chunk (see the module docstring); ``extras``: then
    ``(logp, entropy, mean_logit, log_sum_sq_probs, is_top1)``, the last three not
    differentiable (:func:`linear_token_stats`).

    ``tp`` (:class:`_TensorParallel`, None when unsharded): ``weight`` / ``bias`` are this
    rank's vocabulary shard. Forward: each chunk's local logits through layer 1 on the
    shard (local target ids, as ``fused_rl.distributed``), the per-token partials of all
    chunks merged at the end by ONE :func:`fused_rl.distributed.merge_partials` (two
    all-reduces per call, whatever the number of chunks). Backward: the chunk's local logits
    recomputed, layer 3 with the global statistics (no collective), ``dW_local += dz^T h``,
    ``dH_local = dz W_local``, then (``tp.reduce_hidden``) one SUM all-reduce of the
    ``(N, H)`` ``dH`` so every rank holds the unsharded hidden gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk,
                which, tp=None, extras=False):  # fmt: skip
        ctx.tp = tp
        ctx.set_materialize_grads(False)
        if tp is not None:
            return _LinearTokenStats._sharded_forward(ctx, hidden, weight, bias, targets, chunk)
        # logp, entropy, row max, log-sum (and with extras: the diagnostics)
        out = _stats_chunks(hidden, weight, bias, targets, temperature, softcap, ignore_index,
                            chunk, which, extras)  # fmt: skip
        logp, entropy, row_max, log_sum = out[:4]
        ctx.save_for_backward(hidden, weight, bias, targets, row_max, log_sum, entropy)
        ctx.config = (temperature, softcap, ignore_index, chunk, which)
        if not extras:
            return logp, entropy
        diagnostics = out[4:7]  # the raw max only serves the vocabulary-parallel merge
        ctx.mark_non_differentiable(*diagnostics)
        return (logp, entropy, *diagnostics)

    @staticmethod
    def _sharded_forward(ctx, hidden, weight, bias, targets, chunk):
        spec = ctx.tp.spec
        logp, entropy, t_local, m, log_s, extras = _sharded_stats_chunks(
            hidden, weight, bias, targets, chunk, spec
        )
        ctx.save_for_backward(hidden, weight, bias, t_local, m, log_s, entropy)
        ctx.config = (spec.temperature, spec.softcap, spec.ignore_index, chunk, spec.which)
        out = logp, (entropy if entropy is not None else m.new_empty((0,)))
        if not extras:
            return out
        ctx.mark_non_differentiable(*extras)
        return out + extras

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_grad_diagnostics):
        return _once_differentiable_grads(ctx, _LinearTokenStats._grads, grad_logp, grad_entropy)

    @staticmethod
    def _grads(ctx, grad_logp, grad_entropy):
        grads = _stats_grads(ctx.needs_input_grad[:3], *ctx.saved_tensors, grad_logp,
                             grad_entropy, ctx.config, ctx.tp)  # fmt: skip
        return grads + (None,) * 8


def _sharded_stats_chunks(hidden, weight, bias, targets, chunk, spec) -> tuple:
    """Layer 1 on each chunk's local logits of this rank's shard, then ONE merge of every
    chunk's partials over the ranks: ``(logp, entropy, t_local, row max, log-sum,
    diagnostics)``, the entropy None when not asked for, the diagnostics a tuple of three
    (empty without ``spec.with_extras``)."""
    from .distributed import _local_stats, _local_targets, merge_partials

    n_rows = hidden.shape[0]
    t_local, ignored = _local_targets(targets, spec.shard, spec.ignore_index)
    # this rank's partials (logp, entropy, row max, log-sum, diagnostics) of every token
    local = _stat_buffers(hidden, spec.with_extras)
    w_valid, b_valid = _valid_rows(weight, bias, spec.shard.valid)  # padding: unread
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        z = _chunk_logits(hidden[rows], w_valid, b_valid, chunk)[0]
        stats = _local_stats(z[None], t_local[None, rows], spec, z.shape[0])
        for buf, part in zip(local, stats):
            if part.numel():  # entropy: empty when not asked for (Triton)
                buf[rows] = part[0]
        del z
    logp, entropy, m, log_s, *extras = merge_partials(local, targets, t_local, ignored, spec)
    return logp, entropy, t_local, m, log_s, (extras[0] if extras else ())


def _stats_chunks(hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk,
                  which, extras) -> list[Tensor]:  # fmt: skip
    """Layer 1 over each chunk's logits in turn: :func:`_stat_buffers`' per-token buffers of
    the ``(N, H)`` rows, filled."""
    out = _stat_buffers(hidden, extras)
    n_rows = hidden.shape[0]
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        z = _chunk_logits(hidden[rows], weight, bias, chunk)[0]
        stats = _chunk_stats(z, targets[rows], temperature, softcap, ignore_index, which, extras)
        for buf, part in zip(out, stats):
            buf[rows] = part
        del z
    return out


def _stats_grads(needs, hidden, weight, bias, targets, row_max, log_sum, entropy, grad_logp,
                 grad_entropy, config, tp=None) -> tuple:  # fmt: skip
    """``(d_hidden, d_weight, d_bias)`` of :class:`_LinearTokenStats` (None where not
    needed, or with no upstream gradient): layer 3 over each chunk's recomputed logits with
    the forward's statistics, then the head's GEMMs (:func:`_head_grads`)."""
    temperature, softcap, ignore_index, chunk, which = config
    if entropy is None:  # not computed (sharded, no entropy): its output is empty, and
        # a compiled backward's zero tangent for it must not reach the kernel as ``h``
        grad_entropy = None
    if grad_logp is None and grad_entropy is None:
        return (None,) * 3
    if grad_logp is None:
        grad_logp = torch.zeros_like(row_max)
    grad_logp, grad_entropy = whole_rows(grad_logp), whole_rows(grad_entropy)

    def dz_of(rows, z):
        stats = (targets[rows], row_max[rows], log_sum[rows], _rows_of(entropy, rows),
                 grad_logp[rows], _rows_of(grad_entropy, rows))  # fmt: skip
        if tp is None:
            return _chunk_grad(z, *stats, temperature, softcap, ignore_index, which)
        return _shard_chunk_grad(z, *stats, tp.spec)  # local target ids, global stats

    return _head_grads(needs, hidden, weight, bias, chunk, dz_of, tp)


# Traced (torch.compile), the statistics run as two custom ops (unsharded, or on a
# vocabulary shard: sharded_linear_stats_*), the chunk loops inside: Dynamo would unroll a
# loop over the token count, which fixes that count in the graph (a recompile for each new
# one); opaque, the graph takes any count.


def linear_stats_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                     temperature: float, softcap: float | None, ignore_index: int, chunk: int,
                     which: str, extras: bool) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                        Tensor, Tensor, Tensor]:  # fmt: skip
    """:class:`_LinearTokenStats`' forward, unsharded: ``(logp, entropy, row max, log-sum,
    mean logit, log sum p^2, top-1)``, ``(N,)`` each, the last three empty without
    ``extras``."""
    out = _stats_chunks(hidden, weight, bias, targets, temperature, softcap, ignore_index,
                        chunk, which, extras)  # fmt: skip
    return _with_diagnostics(out, extras)


def _with_diagnostics(out: list[Tensor], extras: bool) -> tuple:
    """:func:`_stat_buffers`' first seven, three empty ones for the diagnostics without
    ``extras`` (a custom op's outputs are a fixed number)."""
    if extras:
        return tuple(out[:7])
    empty = [out[0].new_empty((0,), dtype=dt) for dt in (out[0].dtype, out[0].dtype, torch.bool)]
    return (*out[:4], *empty)


def linear_stats_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                     row_max: Tensor, log_sum: Tensor, entropy: Tensor,
                     grad_logp: Tensor | None, grad_entropy: Tensor | None, need_h: bool,
                     need_w: bool, need_b: bool, temperature: float, softcap: float | None,
                     ignore_index: int, chunk: int, which: str) -> list[Tensor]:  # fmt: skip
    """:func:`_stats_grads` of :func:`linear_stats_fwd`: ``[d_hidden, d_weight, d_bias]``,
    empty where not needed."""
    config = (temperature, softcap, ignore_index, chunk, which)
    grads = _stats_grads((need_h, need_w, need_b), hidden, weight, bias, targets, row_max,
                         log_sum, entropy, grad_logp, grad_entropy, config)  # fmt: skip
    return [hidden.new_empty((0,)) if g is None else g for g in grads]


def _head_grads_fake(hidden, weight, bias, need_h, need_w, need_b) -> list[Tensor]:
    """``(d_hidden, d_weight, d_bias)`` of a chunked head op as fake tensors (empty where
    not needed: each its own tensor, as the real op's, since outputs may not alias)."""
    return [hidden.new_empty(hidden.shape) if need_h else hidden.new_empty((0,)),
            weight.new_empty(weight.shape) if need_w else hidden.new_empty((0,)),
            bias.new_empty(bias.shape) if need_b and bias is not None
            else hidden.new_empty((0,))]  # fmt: skip


def head_bwd_op(name: str, launcher, needs_at: int) -> FusedOp:
    """The backward op of a chunked head op, ``launcher(hidden, weight, bias, *args)``
    returning ``[d_hidden, d_weight, d_bias]``, whose three ``need_*`` flags are
    ``args[needs_at : needs_at + 3]``; its fake gives those gradients' shapes."""
    op = FusedOp(name, launcher)
    op.register_fake(
        lambda hidden, weight, bias, *args: _head_grads_fake(
            hidden, weight, bias, *args[needs_at : needs_at + 3]
        )
    )
    return op


def _linear_stats_setup(ctx, inputs, output):
    """Saves what ``linear_stats_bwd`` takes before the upstream gradients, in its order
    (``(hidden, weight, bias, targets, row max, log-sum, entropy)``), and its options."""
    hidden, weight, bias, targets, *options = inputs
    _, entropy, row_max, log_sum, *diagnostics = output
    ctx.save_for_backward(hidden, weight, bias, targets, row_max, log_sum, entropy)
    ctx.options = options[:5]  # temperature, softcap, ignore_index, chunk, which
    ctx.mark_non_differentiable(row_max, log_sum, *diagnostics)
    ctx.set_materialize_grads(False)


def head_op_backward(bwd_op, n_grads: int = 1):
    """The backward of a traced chunked head op: ``bwd_op(*saved, *grads, need_h, need_w,
    need_b, *options)`` (its ``[d_hidden, d_weight, d_bias]``, empty where not needed) on
    the upstream gradients of the forward's first ``n_grads`` outputs, nothing when they are
    all None."""

    def backward(ctx, *grad_outputs):
        n_inputs = len(ctx.needs_input_grad)
        grads = grad_outputs[:n_grads]
        if all(g is None for g in grads):
            return (None,) * n_inputs
        needs = ctx.needs_input_grad[:3]
        out = bwd_op(*ctx.saved_tensors, *grads, *needs, *ctx.options)
        out = tuple(g if need else None for g, need in zip(out, needs, strict=True))
        return out + (None,) * (n_inputs - 3)

    return backward


linear_stats_bwd_op = head_bwd_op("linear_stats_bwd", linear_stats_bwd, 6)
linear_stats_fwd_op = FusedOp("linear_stats_fwd", linear_stats_fwd)
linear_stats_fwd_op.register_fake(
    lambda hidden, *args: _with_diagnostics(_stat_buffers(hidden, args[-1]), args[-1])
)
linear_stats_fwd_op.register_autograd(
    head_op_backward(linear_stats_bwd_op, 2), setup_context=_linear_stats_setup
)


def sharded_linear_stats_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             targets: Tensor, chunk: int, reduce_hidden: bool, group_name: str,
                             start: int, vocab_size: int, explicit: bool, temperature: float,
                             softcap: float | None, ignore_index: int, which: str, check: bool,
                             with_entropy: bool, extras: bool) -> tuple[
                                 Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                 Tensor]:  # fmt: skip
    """:func:`linear_stats_fwd` on this rank's vocabulary shard (``weight`` / ``bias``; the
    layout as :func:`_tp_args`' primitive arguments): its seven outputs (the entropy empty
    without ``with_entropy``), then the local targets."""
    tp = _tp_of(weight, reduce_hidden, group_name, start, vocab_size, explicit, temperature,
                softcap, ignore_index, which, check, with_entropy, extras)  # fmt: skip
    logp, entropy, t_local, m, log_s, diagnostics = _sharded_stats_chunks(
        hidden, weight, bias, targets, chunk, tp.spec
    )
    entropy = m.new_empty((0,)) if entropy is None else entropy
    return (*_with_diagnostics([logp, entropy, m, log_s, *diagnostics], extras), t_local)


def sharded_linear_stats_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                             t_local: Tensor, row_max: Tensor, log_sum: Tensor,
                             entropy: Tensor, grad_logp: Tensor | None,
                             grad_entropy: Tensor | None, need_h: bool, need_w: bool,
                             need_b: bool, chunk: int, reduce_hidden: bool, group_name: str,
                             start: int, vocab_size: int, explicit: bool, temperature: float,
                             softcap: float | None, ignore_index: int, which: str, check: bool,
                             with_entropy: bool, extras: bool) -> list[Tensor]:  # fmt: skip
    """:func:`_stats_grads` of :func:`sharded_linear_stats_fwd` (no collective but the
    hidden gradient's SUM with ``reduce_hidden``): ``[d_hidden, d_weight, d_bias]``, empty
    where not needed."""
    tp = _tp_of(weight, reduce_hidden, group_name, start, vocab_size, explicit, temperature,
                softcap, ignore_index, which, check, with_entropy, extras)  # fmt: skip
    config = (temperature, softcap, ignore_index, chunk, which)
    grads = _stats_grads((need_h, need_w, need_b), hidden, weight, bias, t_local, row_max,
                         log_sum, entropy if with_entropy else None, grad_logp, grad_entropy,
                         config, tp)  # fmt: skip
    return [hidden.new_empty((0,)) if g is None else g for g in grads]


def _sharded_linear_stats_fake(hidden, weight, bias, targets, *args):
    """:func:`sharded_linear_stats_fwd`'s outputs as fake tensors."""
    with_entropy, extras = args[-2:]
    out = list(_with_diagnostics(_stat_buffers(hidden, extras), extras))
    if not with_entropy:
        out[1] = hidden.new_empty((0,), dtype=out[1].dtype)
    return (*out, targets.new_empty(targets.shape))


def _sharded_linear_stats_setup(ctx, inputs, output):
    """Saves what ``sharded_linear_stats_bwd`` takes before the upstream gradients (the
    local targets where the unsharded op has the global ones) and every option."""
    hidden, weight, bias, _, *options = inputs
    _, entropy, row_max, log_sum, *diagnostics, t_local = output
    ctx.save_for_backward(hidden, weight, bias, t_local, row_max, log_sum, entropy)
    ctx.options = options
    ctx.mark_non_differentiable(row_max, log_sum, *diagnostics, t_local)
    ctx.set_materialize_grads(False)


sharded_linear_stats_bwd_op = head_bwd_op("sharded_linear_stats_bwd", sharded_linear_stats_bwd, 6)
sharded_linear_stats_fwd_op = FusedOp("sharded_linear_stats_fwd", sharded_linear_stats_fwd)
sharded_linear_stats_fwd_op.register_fake(_sharded_linear_stats_fake)
sharded_linear_stats_fwd_op.register_autograd(
    head_op_backward(sharded_linear_stats_bwd_op, 2), setup_context=_sharded_linear_stats_setup
)


def _stat_buffers(hidden: Tensor, extras: bool) -> list[Tensor]:
    """Per-token buffers for layer 1's outputs over all chunks: ``(logp, entropy, row max,
    log-sum)`` in the statistics dtype, and with ``extras`` the diagnostics ``(mean logit,
    log sum p^2, top-1 (bool), raw max)`` (``token_extras_fwd``'s order)."""
    n_rows, acc = hidden.shape[0], stats_dtype(hidden.dtype)
    dtypes = (acc,) * 4 + ((acc, acc, torch.bool, acc) if extras else ())
    return [hidden.new_empty((n_rows,), dtype=dt) for dt in dtypes]


def _truncated_chunk_grad(z, targets, stats, g, top_k, top_p, temperature, softcap,
                          ignore_index, which):  # fmt: skip
    """``(dz, in_place)``: ``dL/dz`` of one chunk's ``(n, V)`` logits under the truncation
    from ``(n,)`` targets and upstream ``g`` and the forward's ``(3, n)`` ``stats``: the
    truncated backward kernel written over ``z`` in eager mode (a fresh buffer when traced,
    as :func:`_chunk_grad`); the reference backend differentiates its own chunk forward
    (its kept set recomputed from the same logits)."""
    if which == "reference":
        chunk_logp = lambda x: ref_truncated.truncated_logprobs(  # noqa: E731
            x, targets, top_k=top_k or None, top_p=top_p, temperature=temperature,
            ignore_index=ignore_index, softcap=softcap,
        )  # fmt: skip
        logp, vjp = torch.func.vjp(chunk_logp, z)
        return vjp(g.to(logp.dtype))[0], False
    args = (targets[None], stats, g[None], temperature, softcap, ignore_index)
    if torch.compiler.is_compiling() or _tracing():  # a traced op may not mutate its input
        return truncated_logprobs_bwd_op(z[None], *args)[0], False
    return truncated_bwd_into(z[None], z[None], *args)[0], True


class _LinearTruncated(torch.autograd.Function):
    """``logp`` ``(N,)`` under the sampler's top-k / top-p truncation of ``F.linear(hidden,
    weight, bias)`` for ``(N, H)`` hidden rows and ``(N,)`` targets, chunk by chunk as
    :class:`_LinearTokenStats`: forward the chunk's GEMM and the truncated forward kernel
    (``fused_rl.truncated``), keeping per token its threshold, row max and ``log F`` (the
    kept set's normaliser); backward the logits recomputed, the truncated backward kernel
    writing ``dz`` over them, then ``dH_c = dz W``, ``dW += dz^T h_c``, ``db``. ``top_k``
    0 and ``top_p`` 1.0 turn a cut off (:func:`fused_rl.truncated.cuts`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, top_k, top_p, temperature, softcap,
                ignore_index, chunk, which):  # fmt: skip
        ctx.set_materialize_grads(False)
        logp, stats = _truncated_chunks(
            hidden, weight, bias, targets, top_k, top_p, temperature, softcap, ignore_index,
            chunk, which,
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, targets, stats)
        ctx.config = (top_k, top_p, temperature, softcap, ignore_index, chunk, which)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        return _once_differentiable_grads(ctx, _LinearTruncated._grads, grad_logp)

    @staticmethod
    def _grads(ctx, grad_logp):
        grads = _truncated_grads(ctx.needs_input_grad[:3], *ctx.saved_tensors, grad_logp,
                                 ctx.config)  # fmt: skip
        return grads + (None,) * 8


def _truncated_chunks(hidden, weight, bias, targets, top_k, top_p, temperature, softcap,
                      ignore_index, chunk, which) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The truncated forward over each chunk's logits in turn: ``(logp, stats)``, the
    kernel's ``(3 N)`` statistics (None on the reference backend)."""
    n_rows = hidden.shape[0]
    acc = stats_dtype(hidden.dtype)
    logp = hidden.new_empty((n_rows,), dtype=acc)
    # chunk by chunk the kernel's (3, n) layout: a chunk's statistics are one
    # contiguous slice for its backward launch
    stats = hidden.new_empty((3 * n_rows,), dtype=acc) if which == "triton" else None
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        z = _chunk_logits(hidden[start:stop], weight, bias, chunk)[0]
        t = targets[start:stop]
        if which == "triton":
            lp, st, _ = truncated_logprobs_fwd_op(
                z[None], t[None], top_k, top_p, temperature, softcap, ignore_index
            )
            logp[start:stop] = lp[0]
            stats[3 * start : 3 * stop] = st.reshape(-1)
        else:
            logp[start:stop] = ref_truncated.truncated_logprobs(
                z, t, top_k=top_k or None, top_p=top_p, temperature=temperature,
                ignore_index=ignore_index, softcap=softcap,
            )  # fmt: skip
        del z
    return logp, stats


def _truncated_grads(needs, hidden, weight, bias, targets, stats, grad_logp, config) -> tuple:
    """``(d_hidden, d_weight, d_bias)`` of :class:`_LinearTruncated` (None where not
    needed, or with no upstream gradient)."""
    top_k, top_p, temperature, softcap, ignore_index, chunk, which = config
    if grad_logp is None:
        return (None,) * 3
    grad_logp = whole_rows(grad_logp)

    def dz_of(rows, z):
        st = None if stats is None else stats[3 * rows.start : 3 * rows.stop]
        st = None if st is None else st.view(3, rows.stop - rows.start)
        return _truncated_chunk_grad(z, targets[rows], st, grad_logp[rows], top_k, top_p,
                                     temperature, softcap, ignore_index, which)  # fmt: skip

    return _head_grads(needs, hidden, weight, bias, chunk, dz_of)


def linear_truncated_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         top_k: int, top_p: float, temperature: float, softcap: float | None,
                         ignore_index: int, chunk: int,
                         which: str) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:class:`_LinearTruncated`'s forward traced, unsharded (see ``linear_stats_fwd``):
    ``(logp, stats)``, the statistics empty on the reference backend."""
    logp, stats = _truncated_chunks(hidden, weight, bias, targets, top_k, top_p, temperature,
                                    softcap, ignore_index, chunk, which)  # fmt: skip
    return logp, logp.new_empty((0,)) if stats is None else stats


def linear_truncated_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         stats: Tensor, grad_logp: Tensor, need_h: bool, need_w: bool,
                         need_b: bool, top_k: int, top_p: float, temperature: float,
                         softcap: float | None, ignore_index: int, chunk: int,
                         which: str) -> list[Tensor]:  # fmt: skip
    """:func:`_truncated_grads` of :func:`linear_truncated_fwd`: ``[d_hidden, d_weight,
    d_bias]``, empty where not needed."""
    config = (top_k, top_p, temperature, softcap, ignore_index, chunk, which)
    grads = _truncated_grads((need_h, need_w, need_b), hidden, weight, bias, targets,
                             stats if which == "triton" else None, grad_logp, config)  # fmt: skip
    return [hidden.new_empty((0,)) if g is None else g for g in grads]


def _linear_truncated_setup_unsharded(ctx, inputs, output):
    hidden, weight, bias, targets, *options = inputs
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])
    ctx.options = options
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _linear_truncated_fwd_fake_unsharded(hidden, weight, bias, targets, *args):
    acc, n = stats_dtype(hidden.dtype), hidden.shape[0]
    width = 3 * n if args[-1] == "triton" else 0
    return hidden.new_empty((n,), dtype=acc), hidden.new_empty((width,), dtype=acc)


linear_truncated_bwd_op = head_bwd_op("linear_truncated_bwd", linear_truncated_bwd, 3)
linear_truncated_fwd_op = FusedOp("linear_truncated_fwd", linear_truncated_fwd)
linear_truncated_fwd_op.register_fake(_linear_truncated_fwd_fake_unsharded)
linear_truncated_fwd_op.register_autograd(
    head_op_backward(linear_truncated_bwd_op), setup_context=_linear_truncated_setup_unsharded
)


def sharded_linear_truncated_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    top_k: int,
    top_p: float,
    chunk: int,
    reduce_hidden: bool,
    group_name: str,
    start: int,
    vocab_size: int,
    explicit: bool,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    which: str,
    check: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The truncated log-probs of ``F.linear(hidden, weight, bias)`` (``(N, H)`` rows,
    ``weight`` / ``bias`` this rank's vocabulary shard) for global ``(N,)`` targets: each
    chunk's local logits through ``fused_rl.truncated_parallel`` (the ranks agree on the
    chunk's cut with its collectives, so every rank runs the same chunks: ``chunk`` from the
    global vocabulary; ``reduce_hidden``: the backward's). ``(logp, t_local, stats,
    kept)``: the backward's local targets, ``(3 N)`` statistics and kept flags (zeros on
    the reference backend)."""
    from . import truncated_parallel as TP
    from .distributed import _local_targets

    spec = _tp_of(weight, reduce_hidden, group_name, start, vocab_size, explicit, temperature,
                  softcap, ignore_index, which, check).spec  # fmt: skip
    n_rows = hidden.shape[0]
    acc = stats_dtype(hidden.dtype)
    values, ok = TP.checked_header(targets[None], spec, acc, read=spec.which == "reference")
    top_k, vocab = TP.agreed_cut(values if ok is None else None, spec.shard, top_k)
    t_local, ignored = _local_targets(targets, spec.shard, spec.ignore_index)
    w_valid, b_valid = _valid_rows(weight, bias, spec.shard.valid)  # padding: unread
    logp = hidden.new_empty((n_rows,), dtype=acc)
    stats = hidden.new_zeros((3 * n_rows,), dtype=acc)
    kept = torch.zeros((n_rows,), dtype=torch.bool, device=hidden.device)
    for first in range(0, n_rows, chunk):
        rows = slice(first, min(first + chunk, n_rows))
        z = _chunk_logits(hidden[rows], w_valid, b_valid, chunk)[0]
        if spec.which == "triton":
            lp, st, kp = TP.shard_rows(z[None], t_local[None, rows], ignored[None, rows],
                                       spec, top_k, top_p, vocab, ok)  # fmt: skip
            stats[3 * first : 3 * rows.stop] = st.reshape(-1)
            kept[rows] = kp
        else:
            lp = _reference_shard_chunk(z, targets[rows], spec, values, top_k, top_p, ok)
        logp[rows] = lp.reshape(-1)
        del z
    return logp, t_local, stats, kept


def sharded_linear_truncated_bwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    t_local: Tensor,
    stats: Tensor,
    kept: Tensor,
    grad_logp: Tensor,
    need_h: bool,
    need_w: bool,
    need_b: bool,
    top_k: int,
    top_p: float,
    chunk: int,
    reduce_hidden: bool,
    group_name: str,
    start: int,
    vocab_size: int,
    explicit: bool,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    which: str,
    check: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(d_hidden, d_weight, d_bias)`` of :func:`sharded_linear_truncated_fwd` (empty where
    not needed): each chunk's logits recomputed, the truncated backward kernel with the
    target's kept flag written over them (the reference backend: the rows gathered and
    differentiated again), the head's GEMMs; with ``reduce_hidden`` one SUM all-reduce of
    ``dH``."""
    from . import truncated_parallel as TP

    tp = _tp_of(weight, reduce_hidden, group_name, start, vocab_size, explicit, temperature,
                softcap, ignore_index, which, check)  # fmt: skip
    values = None
    if which == "reference":  # the layout again (the forward's host read)
        values, _ = TP.checked_header(targets[None], tp.spec, stats.dtype, read=True)
        top_k, _ = TP.agreed_cut(values, tp.spec.shard, top_k)

    def dz_of(rows, z):
        st = stats[3 * rows.start : 3 * rows.stop].view(3, rows.stop - rows.start)
        return _truncated_shard_chunk_grad(
            z, t_local[rows], targets[rows], st, kept[rows], grad_logp[rows], tp.spec, values,
            top_k, top_p,
        )  # fmt: skip

    grads = _head_grads((need_h, need_w, need_b), hidden, weight, bias, chunk, dz_of, tp)
    return tuple(hidden.new_empty((0,)) if g is None else g for g in grads)


def _linear_truncated_fwd_fake(hidden, _weight, _bias, targets, *_args):
    acc = stats_dtype(hidden.dtype)
    n = hidden.shape[0]
    flags = hidden.new_empty((n,), dtype=torch.bool)
    return (hidden.new_empty((n,), dtype=acc), targets.new_empty(targets.shape),
            hidden.new_empty((3 * n,), dtype=acc), flags)  # fmt: skip


def _linear_truncated_setup(ctx, inputs, output):
    hidden, weight, bias, targets, *options = inputs
    _, t_local, stats, kept = output
    ctx.save_for_backward(hidden, weight, bias, targets, t_local, stats, kept)
    ctx.options = options
    ctx.mark_non_differentiable(t_local, stats, kept)
    ctx.set_materialize_grads(False)


sharded_linear_truncated_bwd_op = head_bwd_op("sharded_linear_truncated_bwd",
                                              sharded_linear_truncated_bwd, 5)  # fmt: skip
sharded_linear_truncated_fwd_op = FusedOp("sharded_linear_truncated_fwd",
                                          sharded_linear_truncated_fwd)  # fmt: skip
sharded_linear_truncated_fwd_op.register_fake(_linear_truncated_fwd_fake)
sharded_linear_truncated_fwd_op.register_autograd(
    head_op_backward(sharded_linear_truncated_bwd_op), setup_context=_linear_truncated_setup
)


def _once_differentiable_grads(ctx, grads_fn, *grad_outputs):
    """A chunked op's backward, as :class:`_LinearTokenStats`'s: ``grads_fn(ctx,
    *grad_outputs)`` under ``no_grad`` (the saved statistics are constants, and the kernels
    write over the recomputed logits), made differentiable once (a double backward raises)."""
    create_graph = torch.is_grad_enabled()
    with torch.no_grad():
        grads = grads_fn(ctx, *grad_outputs)
    if not create_graph:
        return grads
    with torch.enable_grad():
        sources = (*ctx.saved_tensors, *grad_outputs)
        return tuple(differentiable_once(g, *sources) for g in grads)


def _head_grads(needs, hidden, weight, bias, chunk, dz_of, tp=None, group=None):
    """``(d_hidden, d_weight, d_bias)`` of a chunked lm_head op (None where not needed:
    ``needs``, three flags, as ``ctx.needs_input_grad[:3]``): each chunk's logits
    recomputed (the forward kept none), ``dz_of(rows, z)`` gives ``(dz, in_place)`` (``dz``
    written over ``z`` when ``in_place``), then ``dH = dz W``, ``dW += dz^T h``, ``db +=
    sum dz`` (fp32 / fp64 accumulators). ``tp``: a vocabulary shard, its padding rows unread
    (zero gradient) and, with ``tp.reduce_hidden``, ``dH`` summed over the ranks (one
    all-reduce); ``group``: that all-reduce without a shard (:class:`_LinearTokenKL`)."""
    valid = None
    if tp is not None:  # padding rows of the shard: unread, their gradient stays zero
        valid = tp.spec.shard.valid
        group = tp.spec.shard.group if tp.reduce_hidden else None
    out_dtype = weight.dtype
    grads = HeadGrads(hidden, weight, needs, valid=valid)
    weight, bias = _valid_rows(weight, bias, grads.valid)
    n_rows = hidden.shape[0]
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(start + chunk, n_rows))
        z, z_full = _chunk_logits(hidden[rows], weight, bias, chunk)
        dz, in_place = dz_of(rows, z)
        # dz written over z: its GEMM buffer is z's
        grads.add(rows, dz, z_full if in_place else None, hidden[rows], weight, chunk)
        del z, z_full, dz
    if grads.d_hidden is not None and group is not None:  # hidden is replicated: its
        _all_reduce_sum(grads.d_hidden, group)  # gradient sums the ranks'
    return grads.grads(out_dtype)


def _reference_shard_chunk(z, targets, spec, values, top_k, top_p, ok=None, g=None):
    """The ``reference`` backend on one chunk's local logits ``z`` ``(n, V_r)``: the whole
    rows gathered from every rank (``fused_rl.truncated_parallel.gather_rows``) through
    ``fused_rl.reference.truncated``. Without ``g``: the ``(n,)`` log-probs (NaN for an
    unchecked bad layout, ``ok`` False); with it: ``dL/dz`` of ``sum(logp * g)``."""
    from . import truncated_parallel as TP

    valids = TP.layout(values, spec.shard)
    full = TP.gather_rows(z[None], spec.shard, valids)[0]
    chunk_logp = lambda x: ref_truncated.truncated_logprobs(  # noqa: E731
        x, targets, top_k=top_k or None, top_p=top_p, temperature=spec.temperature,
        ignore_index=spec.ignore_index, softcap=spec.softcap,
    )  # fmt: skip
    if g is None:
        logp = chunk_logp(full)
        return logp if ok is None else torch.where(ok, logp, math.nan)
    # no autograd inside a custom op (the route's): a functorch transform
    logp, vjp = torch.func.vjp(chunk_logp, full)
    (grad,) = vjp(g.to(logp.dtype))
    rank = spec.shard.rank
    return grad.narrow(-1, sum(valids[:rank]), valids[rank])  # where gather_rows put them


def _truncated_shard_chunk_grad(z, t_local, targets, stats, kept, g, spec, values, top_k, top_p):
    """``(dz, in_place)``: ``dL/dz`` of one chunk's ``(n, V_r)`` local logits under the
    truncation of the whole rows: the truncated backward kernel with the target's kept flag,
    written over ``z`` (inside the route's custom op: eager); the reference backend gathers
    the rows again."""
    from . import truncated_parallel as TP

    if spec.which == "reference":
        return _reference_shard_chunk(z, targets, spec, values, top_k, top_p, g=g), False
    TP.shard_rows_grad_into(z[None], z[None], t_local[None], stats, kept, g[None], spec)
    return z, True


def _all_reduce_sum(t: Tensor, group) -> None:
    """``t`` summed over ``group`` in place (the replicated hidden's gradient)."""
    from .distributed import _dist

    dist = _dist()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)


class HeadGrads:
    """The gradients of a chunked lm_head op's inputs, gathered chunk by chunk from each
    chunk's ``dz`` ``(n, V)``: ``hidden``'s by rows (``dz W``), the lm_head's as
    ``dW = sum dz^T h_c`` in fp32 (fp64 for fp64 inputs) and the bias's as ``sum dz``.

    ``dW``'s accumulator is made by the FIRST chunk's GEMM (``mm_wide``) and added to by
    the others (``addmm_wide``): no zero fill and no read of zeros, ``8 V H`` bytes a call
    fewer than a zeroed accumulator. A head in the accumulator's dtype (fp32 / fp64) on a
    padded vocabulary shard (``valid`` < its rows): the accumulator is zeroed over every
    row and the chunks add to its first ``valid``, so the gradient is returned as it is
    (zeros written and read, ``8 V H`` bytes), where a ``valid``-row accumulator copied into
    a zeroed whole would move ``12 V H`` and hold two ``(V, H)`` buffers at once. A 16-bit
    head's gradient is a cast copy anyway: its padding is zero-filled in the head's dtype.

    ``needs``: which of the three are wanted (as ``ctx.needs_input_grad[:3]``);
    ``zero_rows``: ``hidden``'s gradient zeroed first, for calls that skip rows;
    ``hidden_dtype``: its dtype (default ``rows``'); ``valid``: the lm_head rows the chunks
    cover (a vocabulary shard's real ids), the others' gradient zero."""

    def __init__(self, rows: Tensor, weight: Tensor, needs, acc: torch.dtype | None = None,
                 zero_rows: bool = False, hidden_dtype: torch.dtype | None = None,
                 valid: int | None = None):  # fmt: skip
        need_h, need_w, need_b = needs
        self.acc = acc or (torch.float64 if rows.dtype == torch.float64 else torch.float32)
        self.shape, self.valid = weight.shape, weight.shape[0] if valid is None else valid
        self.need_w, self.device = need_w, weight.device
        self.d_hidden = None
        if need_h:
            make = rows.new_zeros if zero_rows else rows.new_empty
            self.d_hidden = make(rows.shape, dtype=hidden_dtype or rows.dtype)
        self.d_weight = None  # the first chunk's GEMM makes it; zeroed whole for a padded
        # shard of a head in the accumulator's dtype, the chunks adding to its valid rows
        if need_w and self.valid < self.shape[0] and weight.dtype == self.acc:
            self.d_weight = torch.zeros(self.shape, dtype=self.acc, device=self.device)
        self.d_bias = None
        if need_b:
            self.d_bias = torch.zeros(self.shape[0], dtype=self.acc, device=self.device)

    def add(self, r, dz: Tensor | None, dz_full: Tensor | None, h_c: Tensor, weight: Tensor,
            chunk: int) -> None:  # fmt: skip
        """One chunk's share from its ``dz`` (the rows ``r`` of ``hidden``, whose chunk is
        ``h_c``; ``dz_full``: the GEMM buffer ``dz`` heads, or None; ``weight`` the covered
        lm_head rows): ``d_hidden[r] = dz W``, ``dW += dz^T h_c``, ``db += sum dz``. A
        ``dz`` wider than the head (fp32 chunk logits of a 16-bit head) is summed for the
        bias as it is, then rounded to the head's dtype for the GEMMs."""
        if dz is None:
            return
        if self.d_bias is not None:
            self.d_bias[: self.valid].add_(dz.sum(0, dtype=self.acc))
        if dz.dtype != weight.dtype:
            dz_full = None if dz_full is None else dz_full.to(weight.dtype)
            dz = dz.to(weight.dtype) if dz_full is None else dz_full[: dz.shape[0]]
        if self.d_hidden is not None:  # in its own dtype: wider than the head's under autocast
            self.d_hidden[r] = _hidden_grad(dz, weight, chunk, dz_full, self.d_hidden.dtype)
        if not self.need_w:
            return
        if self.d_weight is None:
            self.d_weight = mm_wide(dz.t(), h_c, self.acc)
        else:
            addmm_wide(self.d_weight[: self.valid], dz.t(), h_c)

    def grads(self, dtype: torch.dtype | None = None):
        """``(d_hidden, d_weight, d_bias)`` (None where not wanted), the lm_head's and the
        bias's in ``dtype`` (default: the accumulator's) over every lm_head row."""
        dtype = dtype or self.acc
        d_weight = d_bias = None
        if self.need_w:
            d_weight = self._whole(self.d_weight, self.shape, dtype)
        if self.d_bias is not None:
            d_bias = self._whole(self.d_bias, self.shape[:1], dtype)
        return self.d_hidden, d_weight, d_bias

    def _whole(self, acc: Tensor | None, shape, dtype: torch.dtype) -> Tensor:
        """``acc`` (None: no chunk ran) in ``dtype`` over ``shape``, the rows it lacks
        zero."""
        if acc is not None and acc.shape[0] == shape[0]:
            return acc.to(dtype)
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        if acc is not None:
            out[: acc.shape[0]] = acc
        return out


def _rows_of(t: Tensor | None, rows: slice) -> Tensor | None:
    return None if t is None else t[rows]


def _valid_rows(weight: Tensor, bias: Tensor | None, valid: int):
    """The shard's first ``valid`` rows (its real vocabulary ids; the rest is padding)."""
    if valid == weight.shape[0]:
        return weight, bias
    return weight[:valid], (bias[:valid] if bias is not None else None)


def _shard_chunk_grad(z, t_local, row_max, log_sum, entropy, g, h, spec):
    """``(dz, in_place)``: ``dL/dz`` of one chunk's ``(n, V_local)`` local logits: layer 3
    on the shard's valid columns with the global statistics (a target owned elsewhere
    matches no column), written over ``z`` where it can be (Triton, eager, no padding
    column); otherwise ``fused_rl.distributed``'s local backward (the reference backend,
    padding columns zeroed, an empty shard)."""
    from .distributed import LOCAL_IGNORE, _backward_local

    if spec.which == "triton" and spec.shard.valid == z.shape[1] > 0:
        return _chunk_grad(z, t_local, row_max, log_sum, entropy, g, h, spec.temperature,
                           spec.softcap, LOCAL_IGNORE, "triton")  # fmt: skip
    row = lambda t: None if t is None else t[None]  # noqa: E731
    return _backward_local(
        z[None], t_local[None], row_max[None], log_sum[None], row(entropy), g[None], row(h),
        spec, z.shape[0],
    )[0], False  # fmt: skip


@dataclass(frozen=True)
class _TensorParallel:
    """The vocab-parallel configuration of a linear op: the distributed spec (shard, layer
    options, value checks) and whether the backward all-reduces the hidden gradient."""

    spec: object  # fused_rl.distributed._Spec
    reduce_hidden: bool


def _tp_args(tp: _TensorParallel) -> tuple:
    """``tp`` as a custom op's primitive arguments (:func:`_tp_of`'s, after the shard's
    ``weight``): ``(reduce_hidden, group name, start, vocab_size, explicit, temperature,
    softcap, ignore_index, which, check)``."""
    spec, shard = tp.spec, tp.spec.shard
    return (bool(tp.reduce_hidden), shard.group.group_name, shard.start, shard.vocab_size,
            shard.explicit, spec.temperature, spec.softcap, spec.ignore_index, spec.which,
            spec.check)  # fmt: skip


def _tp_of(weight: Tensor, reduce_hidden: bool, group_name: str, start: int, vocab_size: int,
           explicit: bool, temperature: float, softcap: float | None, ignore_index: int,
           which: str, check: bool, with_entropy: bool = False,
           with_extras: bool = False) -> _TensorParallel:  # fmt: skip
    """The :class:`_TensorParallel` of :func:`_tp_args` for the lm_head shard ``weight``,
    inside a custom op (the group resolved from its name)."""
    from .truncated_parallel import spec_of

    spec = spec_of(group_name, start, weight.shape[0], vocab_size, explicit, temperature,
                   softcap, ignore_index, which, check, "weight", with_entropy,
                   with_extras)  # fmt: skip
    return _TensorParallel(spec, reduce_hidden)


@dataclass(frozen=True)
class _LinearLaunch:
    """The non-tensor arguments of :class:`_LinearPolicyLoss`: the vocabulary options, the
    chunking, and the config's kernel table (``PolicyConfig.kernel_params`` / ``modes``)."""

    temperature: float
    softcap: float | None
    ignore_index: int
    with_entropy: bool
    chunk: int
    shape: tuple[int, int]
    max_length: int
    num_items: float
    hyper: list[float]
    modes: list[int]


def _policy_chunks(needs, rows, weight, bias, launch, targets, adv, old, ref, mask, is_w,
                   row_scale, ent_scale, num_items_t, kept, ref_rows, ref_weight,
                   ref_bias):  # fmt: skip
    """The chunk loop of :class:`_LinearPolicyLoss`: ``(loss, metrics, (d_hidden, d_weight,
    d_bias))``, the gradients (``needs``: which) of the loss with upstream gradient 1, the
    lm_head's and the bias's in the fp32 / fp64 accumulator."""
    temperature, ignore_index = launch.temperature, launch.ignore_index
    softcap, with_entropy = launch.softcap, launch.with_entropy
    n_rows = rows.shape[0]
    # kept: the counted rows' indices (None: every row). A skipped row gets the partials
    # and the zero hidden gradient its kernel program would write.
    grads = HeadGrads(rows, weight, needs, stats_dtype(rows.dtype),
                      zero_rows=kept is not None)  # fmt: skip
    acc = grads.acc
    if kept is None:
        part = rows.new_empty((N_COLS, n_rows), dtype=acc)
    else:
        part = uncounted_partials(n_rows, acc, rows.device)
    col = lambda t, c: None if t is None else t[c, None]  # noqa: E731  (n, 1) per chunk
    n_work = n_rows
    if kept is not None:  # the counted rows' per-token inputs, gathered once
        pick = lambda t: None if t is None else t[kept]  # noqa: E731
        targets, adv, old, ref, mask, is_w, row_scale, ent_scale, ref_rows = map(
            pick, (targets, adv, old, ref, mask, is_w, row_scale, ent_scale, ref_rows)
        )
        n_work = kept.numel()
    for start in range(0, n_work, launch.chunk):
        c = slice(start, min(start + launch.chunk, n_work))  # into the per-token inputs
        r = c if kept is None else kept[c]  # into rows, part and d_hidden
        h_c = rows[r]  # a view, or a gather of the counted rows
        z, z_full = _chunk_logits(h_c, weight, bias, launch.chunk)
        ref_c = col(ref, c)
        if ref_rows is not None:  # the exact KL: the reference's chunk of logits, read only
            ref_c = _chunk_logits(ref_rows[c], ref_weight, ref_bias, launch.chunk)[0][:, None]
        args = (col(targets, c), col(adv, c), col(old, c), ref_c, col(mask, c),
                col(is_w, c), row_scale[c], None if ent_scale is None else ent_scale[c],
                temperature, softcap, ignore_index, with_entropy, launch.hyper,
                launch.modes)  # fmt: skip
        if torch.compiler.is_compiling() or _tracing():  # a traced op may not mutate
            part[:, r], dz3 = policy_rows_grad_fwd_op(z[:, None], *args)
            dz, dz_full = dz3[:, 0], None
        else:  # the chunk's logits become their gradient in place
            part[:, r] = _policy_rows_grad_into(z[:, None], z[:, None], *args)
            dz, dz_full = z, z_full
        grads.add(r, dz, dz_full, h_c, weight, launch.chunk)
        del z, z_full, dz, dz_full, h_c, ref_c, args  # args holds ref_c
    loss, metrics, _ = policy_finalize_op(
        part, *launch.shape, launch.modes[4], launch.max_length, launch.num_items,
        num_items_t, is_w is not None,
    )  # fmt: skip
    return loss, metrics, grads.grads()


class _LinearPolicyLoss(torch.autograd.Function):
    """The token-level policy loss of ``F.linear(rows, weight, bias)`` with its gradients
    formed in the forward (one GEMM per chunk for the logits, two for the gradients) and
    scaled by the upstream scalar in the backward; Triton backend only. With ``kept``
    (``config.skip_padding_rows``) only the counted rows go through the GEMMs.

    Per chunk: ``z = h_c W^T (+ b)``; ONE vocab kernel (``policy_rows_grad_into``: layer 1,
    the token layer as epilogue, then layer 3 on the row it just reduced, whose second read
    comes from L2) writes the chunk's metric partials and turns ``z`` IN PLACE into ``dz``
    (``g``/``h`` times the aggregation's per-row scale, known from the mask alone);
    ``dH_c = dz W``, ``dW += dz^T h_c``, ``db += sum dz``. One reduction then finishes the
    loss and every metric from all chunks' partials.

    ``ref_rows`` / ``ref_weight`` / ``ref_bias`` (``kl_estimator="full"``, detached): the
    reference model's hidden rows and lm_head; per chunk one more GEMM (no gradient) gives
    the reference's logits, which the same vocab kernel streams beside the policy's.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, adv, old, ref, mask, is_w, row_scale,
                ent_scale, num_items_t, kept, launch, ref_rows=None, ref_weight=None,
                ref_bias=None):  # fmt: skip
        needs = ctx.needs_input_grad[:3]
        rest = (targets, adv, old, ref, mask, is_w, row_scale, ent_scale, num_items_t, kept,
                ref_rows, ref_weight, ref_bias)  # fmt: skip
        loss, metrics, grads = _policy_chunks(needs, rows, weight, bias, launch, *rest)
        save_formed_grads(ctx, (rows, weight, bias), grads, "triton", rest,
                          lambda *saved: _policy_chunks(needs, *saved[:3], launch,
                                                        *saved[3:])[2])  # fmt: skip
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        return formed_grads_backward(ctx, grad_loss)


def linear_policy_fwd(rows: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                      adv: Tensor | None, old: Tensor | None, ref: Tensor | None,
                      mask: Tensor | None, is_w: Tensor | None, row_scale: Tensor,
                      ent_scale: Tensor | None, num_items_t: Tensor | None,
                      ref_rows: Tensor | None, ref_weight: Tensor | None,
                      ref_bias: Tensor | None, need_h: bool, need_w: bool, need_b: bool,
                      temperature: float, softcap: float | None, ignore_index: int,
                      with_entropy: bool, chunk: int, batch: int, length: int,
                      max_length: int, num_items: float, hyper: list[float],
                      modes: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                 Tensor]:  # fmt: skip
    """:class:`_LinearPolicyLoss` traced (every row; the chunk loop inside one custom op, as
    ``linear_stats_fwd``): ``(loss, metrics, d_hidden, d_weight, d_bias)``, the gradients
    formed with upstream gradient 1 in the parameters' dtypes, empty where not needed."""
    launch = _LinearLaunch(temperature, softcap, ignore_index, with_entropy, chunk,
                           (batch, length), max_length, num_items, hyper, modes)  # fmt: skip
    loss, metrics, grads = _policy_chunks(
        (need_h, need_w, need_b), rows, weight, bias, launch, targets, adv, old, ref, mask,
        is_w, row_scale, ent_scale, num_items_t, None, ref_rows, ref_weight, ref_bias,
    )  # fmt: skip
    grads = _as_params(grads, weight, bias)
    return loss, metrics, *(rows.new_empty((0,)) if g is None else g for g in grads)


def _linear_policy_fwd_fake(rows, weight, bias, *args):
    acc = stats_dtype(rows.dtype)
    loss, metrics = rows.new_empty((), dtype=acc), rows.new_empty(N_OUTPUTS, dtype=torch.float32)
    return loss, metrics, *_head_grads_fake(rows, weight, bias, *args[12:15])


def formed_op_setup(first_need: int):
    """The ``setup_context`` of a traced op returning ``(loss, metrics, d_hidden, d_weight,
    d_bias)``, the gradients formed in its forward (:func:`formed_op_backward`), whose
    three ``need_*`` flags are its inputs from ``first_need`` on."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*output[2:])
        ctx.needs = inputs[first_need : first_need + 3]
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    return setup


def formed_op_backward(ctx, grad_loss, *_unused):
    """The formed gradients times the upstream scalar, out of place (:func:`_scaled_copy`)."""
    n_inputs = len(ctx.needs_input_grad)
    needs = ctx.needs_input_grad[:3]
    if grad_loss is None:
        return (None,) * n_inputs
    saved = zip(ctx.saved_tensors, needs, ctx.needs, strict=True)
    grads = tuple(_scaled_copy(d, grad_loss) if need and formed else None
                  for d, need, formed in saved)  # fmt: skip
    return grads + (None,) * (n_inputs - 3)


linear_policy_fwd_op = FusedOp("linear_policy_fwd", linear_policy_fwd)
linear_policy_fwd_op.register_fake(_linear_policy_fwd_fake)
linear_policy_fwd_op.register_autograd(formed_op_backward, setup_context=formed_op_setup(15))


def save_formed_grads(ctx, inputs, grads, which, rest, reform) -> None:
    """Keep ``grads`` = ``(d_hidden, d_weight, d_bias)``, the gradients of a loss of
    ``F.linear(*inputs)`` (``inputs``: ``(rows, weight, bias)``) formed in its forward
    (None: not wanted; the fp32 ``d_weight`` / ``d_bias`` accumulators cast to the
    parameters' dtypes here), for :func:`formed_grads_backward`. ``which``: the backend
    ("triton": the backward scales with a Triton launch); ``reform(*inputs, *rest)``: the
    same gradients formed again (the forward's chunk loop on its other tensors ``rest``),
    for a second backward through the call. Eager, the gradients are kept on ``ctx`` to be
    handed over by the first backward, and ``inputs`` and ``rest`` saved: what ``rest``
    holds of a second model (the teacher's or the reference's rows and lm_head, and the
    copies the call made of them, e.g. a 16-bit cast of an fp32 head under autocast, ``2 V
    H`` bytes) lives until the backward, which frees it unless ``retain_graph``; traced
    (``torch.compile``), the gradients are saved beside ``inputs``."""
    grads = _as_params(grads, *inputs[1:])
    ctx.set_materialize_grads(False)
    if torch.compiler.is_compiling() or _tracing():
        ctx.save_for_backward(*inputs, *grads)
        return
    ctx.save_for_backward(*inputs, *rest)
    ctx.formed, ctx.reform, ctx.which = grads, reform, which


def _as_params(grads, weight: Tensor, bias: Tensor | None) -> tuple:
    """``(d_hidden, d_weight, d_bias)`` with the lm_head's and the bias's in their dtypes."""
    d_hidden, d_weight, d_bias = grads
    return (
        d_hidden,
        None if d_weight is None else d_weight.to(weight.dtype),
        None if d_bias is None else d_bias.to(bias.dtype),
    )


_SCALE_ELEMENTS = 1 << 24  # a 16-bit gradient scaled through fp32 this many elements at a time


def _scale_formed(d: Tensor, grad_loss: Tensor, which: str) -> Tensor:
    """``d *= grad_loss`` in place (``grad_loss`` a 0-dim tensor on ``d``'s device), computed
    in fp32 (fp64) with the exact factor and rounded once: on the Triton backend one launch
    that returns at once when it is exactly 1 (no byte of ``d`` read or written, no host
    sync; ``scale_rows_unless_one``); else a 16-bit ``d`` through fp32 slices of at most
    ``_SCALE_ELEMENTS`` (torch's 16-bit ``mul_`` on a GPU rounds the factor to 16 bits
    first), a wider one by ``mul_``."""
    if which == "triton" and d.is_contiguous() and d.numel():
        scale_rows_unless_one_launch(d.view(1, -1, d.shape[-1]), grad_loss)
    elif d.dtype in (torch.float16, torch.bfloat16) and d.numel():
        factor = grad_loss.float()
        rows = d if d.dim() else d[None]
        step = max(1, _SCALE_ELEMENTS // max(rows[0].numel(), 1))
        for part in rows.split(step):  # views of d: written in place
            part.copy_(part.float().mul_(factor))
    else:
        d.mul_(grad_loss)
    return d


def _scaled_copy(d: Tensor, grad_loss: Tensor) -> Tensor:
    """``d * grad_loss`` out of place, in fp32 (fp64) with the exact factor, rounded once to
    ``d``'s dtype (torch's 16-bit ``d * grad_loss`` on a GPU rounds the 0-dim factor to 16
    bits first): the traced backward's, which Inductor fuses into one pass."""
    acc = torch.float64 if d.dtype == torch.float64 else torch.float32
    return (d.to(acc) * grad_loss.to(acc)).to(d.dtype)


def formed_grads_backward(ctx, grad_loss: Tensor | None) -> tuple:
    """The backward of a chunked loss whose gradients were formed in the forward
    (:func:`save_formed_grads`): each times the upstream scalar, rounded once. Eager, they
    are scaled IN PLACE and handed to autograd as they are (on the Triton backend one
    launch each, reading and writing ``N H``, ``V H`` and ``V`` elements, none when the
    upstream gradient is exactly 1; no copy of its own, though autograd's casts back to a
    wider ``weight`` / ``hidden`` under autocast make theirs); a second backward through
    the same call (``retain_graph=True``, ``gradcheck``) forms them again (one more run of
    the forward's chunks, autocast off as in the forward). Traced (``torch.compile``): a
    multiply out of place. They came from statistics taken as constants: a double backward
    raises (as every fused op here)."""
    n_inputs = len(ctx.needs_input_grad)
    if grad_loss is None:
        return (None,) * n_inputs
    saved = ctx.saved_tensors  # raises if an input was modified in place since the forward
    with torch.no_grad():
        if not hasattr(ctx, "reform"):  # traced: saved beside the inputs
            grads = tuple(None if d is None else _scaled_copy(d, grad_loss) for d in saved[3:])
        else:
            grads = ctx.__dict__.pop("formed", None)  # handed over once
            if grads is None:  # a second backward: formed again from the saved tensors
                with torch.autocast(saved[0].device.type, enabled=False):
                    grads = _as_params(ctx.reform(*saved), *saved[1:3])
            grads = tuple(
                None if d is None else _scale_formed(d, grad_loss, ctx.which) for d in grads
            )
    if torch.is_grad_enabled():  # create_graph
        with torch.enable_grad():
            sources = (*saved[:3], grad_loss)
            grads = tuple(differentiable_once(g, *sources) for g in grads)
    return grads + (None,) * (n_inputs - 3)


def _check_linear(hidden: Tensor, weight: Tensor, bias: Tensor | None, sharded=False) -> None:
    for name, x in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        check_local(x, name)
    V.check_float(hidden, "hidden")
    V.check_float(weight, "weight")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (B, S, H) or (N, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be the lm_head's (V, H) with H = hidden.shape[-1] = "
            f"{hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0 and not sharded:  # a vocabulary shard may be empty (ragged)
        raise ValueError("weight must have at least one row (V >= 1)")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight ({weight.dtype}) and hidden ({hidden.dtype}) must share a dtype, as "
            "torch.nn.functional.linear needs (a wider weight, an fp32 head, is fine: the "
            "hidden states are cast up to it; cast a narrower weight up yourself)"
        )
    if bias is not None:
        V.check_float(bias, "bias")
        if tuple(bias.shape) != (weight.shape[0],) or bias.dtype != weight.dtype:
            raise ValueError(
                f"bias must be ({weight.shape[0]},) in {weight.dtype}, got shape "
                f"{tuple(bias.shape)} in {bias.dtype}"
            )
    V.check_same_device(hidden=hidden, weight=weight, bias=bias)


def _autocast_inputs(hidden: Tensor, weight: Tensor, bias: Tensor | None):
    """Under ``torch.autocast``, ``hidden``/``weight``/``bias`` in the autocast dtype (what
    ``F.linear`` would compute in); the chunked op then runs with autocast off, so its
    backward recomputes exactly the forward's logits."""
    if not isinstance(hidden, Tensor) or not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(hidden.device.type)
    cast = lambda t: t if t is None or not t.is_floating_point() else t.to(dtype)  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)


def _promote_hidden(hidden: Tensor, weight: Tensor) -> Tensor:
    """A wider lm_head than the hidden states (an fp32 head with a bf16 / fp16 model, TRL's
    ``cast_lm_head_to_fp32``): the hidden states cast up to the head's dtype, so the logits
    and their softmax are computed in it (an ``(N, H)`` copy; the gradient reaches
    ``hidden`` in its own dtype). Any other mismatch is left to :func:`_check_linear`."""
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor):
        return hidden
    if hidden.dtype == weight.dtype or not (
        hidden.is_floating_point() and weight.is_floating_point()
    ):
        return hidden
    if torch.finfo(weight.dtype).bits > torch.finfo(hidden.dtype).bits:
        return hidden.to(weight.dtype)
    return hidden


def _window_rows(hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``(N, H)`` hidden rows and ``(N,)`` targets; with ``(B, S, H)`` hidden and ``(B, T)``
    targets, ``S > T``, rows ``S-T-1 ... S-2`` predict the targets (the causal-LM shift)."""
    if hidden.dim() == 2:
        if tuple(targets.shape) != hidden.shape[:1]:
            raise ValueError(
                f"targets must be (N,) = {tuple(hidden.shape[:1])} for (N, H) hidden, "
                f"got {tuple(targets.shape)}"
            )
        return hidden, targets
    batch, positions, _ = hidden.shape
    if targets.dim() != 2 or targets.shape[0] != batch or targets.shape[1] > positions:
        raise ValueError(
            f"targets must be (B, T) with B = {batch} and T <= S = {positions} for (B, S, H) "
            f"hidden, got {tuple(targets.shape)}"
        )
    length = targets.shape[1]
    if length < positions:
        hidden = hidden[:, positions - length - 1 : positions - 1]
    return hidden.reshape(batch * length, hidden.shape[-1]), targets.reshape(-1)


def _prepare(hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk_tokens,
             backend, sharded=False):  # fmt: skip
    """Checked inputs of a linear op: ``(rows, weight, bias, flat_targets, chunk, which)``
    with ``rows`` the ``(N, H)`` hidden rows that predict the ``(N,)`` targets, in the
    autocast dtype under ``torch.autocast``. ``sharded``: ``weight`` is a vocabulary shard
    (possibly empty) and ``targets`` global ids, range-checked by the merge's collective."""
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    hidden = _promote_hidden(hidden, weight)
    _check_linear(hidden, weight, bias, sharded)
    V.check_tensor(targets, "targets")
    if targets.dtype not in V.INDEX_DTYPES:
        raise TypeError(f"targets must be an int64 or int32 tensor, got {targets.dtype}")
    V.check_positive(temperature, "temperature")
    if softcap is not None:
        V.check_positive(softcap, "softcap")
    V.check_same_device(hidden=hidden, targets=targets)
    if chunk_tokens is not None:
        V.check_number(chunk_tokens, "chunk_tokens")
        if int(chunk_tokens) != chunk_tokens or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    rows, flat_targets = _window_rows(hidden, targets)
    vocab = weight.shape[0]
    if not sharded:
        V.check_target_range(flat_targets, vocab, ignore_index, "targets")
    which = resolve_backend(backend, hidden, weight, bias, targets)
    chunk = (
        int(chunk_tokens)
        if chunk_tokens
        else default_chunk_tokens(vocab, hidden.dtype, hidden.shape[-1])
    )
    return rows, weight, bias, whole_rows(flat_targets), chunk, which


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_tokens: int | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token ``log_softmax((hidden @ weight.T + bias) / temperature)[target]`` (and the
    entropy) without ever holding the whole ``(N, V)`` logits: exactly what
    ``token_logprobs(F.linear(hidden, weight, bias), targets, ...)`` returns, with gradients
    for ``hidden``, ``weight`` and ``bias`` (a ``weight`` tied to the input embedding
    accumulates its gradient like any other use). With ``top_k`` / ``top_p``, the log-probs
    under a sampler's truncation, as ``token_logprobs(..., top_k=, top_p=)`` returns them.

    Args:
        hidden: ``(B, S, H)`` or ``(N, H)`` final hidden states (any strides).
        weight: the lm_head ``(V, H)``, ``hidden``'s dtype or a wider one (an fp32 head with
            bf16 / fp16 hidden states, TRL's ``cast_lm_head_to_fp32``: ``hidden`` is cast up,
            the logits computed in fp32, ``hidden``'s gradient returned in its dtype).
        targets: ``(B, T)`` with ``T <= S`` (``T < S``: rows ``S-T-1 ... S-2`` predict them,
            the causal-LM shift; other rows get a zero gradient) or ``(N,)``; int64 / int32.
        bias: optional ``(V,)``.
        temperature, ignore_index, return_entropy, backend: as :func:`token_logprobs`.
        softcap: Gemma-style soft cap ``c`` of the logits, as :func:`token_logprobs`: each
            chunk's ``z = hidden @ weight.T + bias`` becomes ``c tanh(z / c)``, then ``/ T``.
        top_k, top_p: the log-prob under the distribution a sampler truncated to the top-k
            tokens, then to the smallest top-p mass of those, renormalised (vLLM's order, ties
            at either cut kept whole): :func:`token_logprobs` ``(top_k=, top_p=)``, i.e.
            :func:`fused_rl.truncated_logprobs` (its docstring gives the rules), of
            ``F.linear(hidden, weight, bias)``; a target outside the kept set gives ``-inf``
            and zero gradient. ``top_k`` None or an int ``>= 1``, ``top_p`` None or a real
            number in ``(0, 1]``; with ``softcap`` the cuts are on the capped logits;
            vocabulary-parallel too (each chunk's cut agreed by the ranks:
            ``fused_rl.truncated_parallel``); not with ``return_entropy`` (``ValueError``, as
            :func:`token_logprobs`).
        chunk_tokens: rows per chunk; None: as many as keep a chunk's logits under 256
            MiB, or up to 2048 rows under ``2 V H`` bytes (the lm_head's own size in 16
            bits; fewer chunks, fewer read-writes of the fp32 ``dW``), at most 4096
            (:func:`default_chunk_tokens`: 2048 rows at V = 151936, H = 4096 in bf16).
        process_group: vocabulary (tensor) parallelism, the Megatron ``ColumnParallelLinear``
            lm_head: ``weight`` (and ``bias``) are this rank's ``(V_local, H)`` shard,
            ``hidden`` is the same on every rank, ``targets`` hold global ids. Every rank
            returns the unsharded call's values; ``weight`` / ``bias`` get their shard of the
            unsharded gradient; ``hidden`` gets the WHOLE unsharded gradient on every rank
            (see ``reduce_hidden_grad``). Collectives per call: the two all-reduces of
            :func:`token_logprobs` ``(process_group=)`` once for all chunks (12 bytes a token,
            16 with the entropy, plus a ``2 P + 4``-float header) forward; one all-reduce of
            the ``(N, H)`` hidden gradient (hidden's dtype) backward.
        vocab_start, vocab_size: the shard layout (padded or ragged vocabulary), with
            ``process_group``, as :func:`token_logprobs`; shards of different widths, a
            gap or a target outside ``[0, V)`` raise ``ValueError`` on every rank.
        reduce_hidden_grad: with ``process_group``: True (default) all-reduces (SUM) the
            hidden gradient over the group, as the op replaces the lm_head and its input's
            ``copy_to_tensor_model_parallel_region``; False leaves each rank its partial
            ``dz W_local`` (they sum to the unsharded gradient) for a framework that reduces
            it itself: Megatron's sequence parallelism (``gather_from_sequence_parallel_region``,
            whose backward reduce-scatters) or verl's ``linear_cross_entropy``. No effect
            without a process group.

    Returns:
        ``logp`` ``targets.shape`` (fp32; fp64 for fp64 inputs), 0 at ignored tokens (and
        ``-inf`` at targets cut by ``top_k`` / ``top_p``); with ``return_entropy``,
        ``(logp, entropy)``.

    Cost: one GEMM per chunk forward, two more backward (the logits are recomputed, as in
    verl's ``FusedLinearForPPO``); the vocab kernels read each chunk's logits once
    forward and once backward. Vocab-parallel: the same on each rank's shard. With
    ``top_k`` / ``top_p`` the same GEMMs, and the truncated kernels on each chunk's logits:
    forward one read of a row for top-k ``<= 64`` (more for top-p alone or a larger k: the
    threshold search of :func:`fused_rl.truncated_logprobs`), backward one read and one
    write (over the chunk's logits); per token 3 floats kept for the backward (threshold,
    row max, the kept set's log-normaliser), never an ``(N, V)`` tensor.

    Example:
        >>> import torch, fused_rl
        >>> h, w = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> t = torch.randint(0, 11, (2, 4))
        >>> lp = fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=3)
        >>> ref = fused_rl.token_logprobs(h @ w.T, t)
        >>> torch.allclose(lp, ref, atol=1e-5)
        True
        >>> lp = fused_rl.linear_token_logprobs(h, w, t, top_k=3, top_p=0.9, chunk_tokens=3)
        >>> ref = fused_rl.token_logprobs((h @ w.T)[:, :-1], t, top_k=3, top_p=0.9)
        >>> torch.allclose(lp, ref, atol=1e-5)  # -inf where a target is cut
        True
    """
    if not isinstance(reduce_hidden_grad, bool):
        raise TypeError(f"reduce_hidden_grad must be a bool, got {type(reduce_hidden_grad)}")
    if top_k is not None or top_p is not None:
        return _linear_truncated(
            hidden, weight, targets, bias, top_k, top_p, temperature, softcap, ignore_index,
            return_entropy, chunk_tokens, process_group, vocab_start, vocab_size,
            reduce_hidden_grad, backend,
        )  # fmt: skip
    logp, entropy = _linear_stats(
        hidden, weight, targets, bias, temperature, softcap, ignore_index, chunk_tokens,
        process_group, vocab_start, vocab_size, reduce_hidden_grad, backend, return_entropy,
    )  # fmt: skip
    return (logp, entropy) if return_entropy else logp


def _linear_stats(hidden, weight, targets, bias, temperature, softcap, ignore_index,
                  chunk_tokens, process_group, vocab_start, vocab_size, reduce_hidden_grad,
                  backend, with_entropy, extras=False) -> tuple[Tensor, ...]:  # fmt: skip
    """:class:`_LinearTokenStats` on checked inputs, unsharded or on this rank's shard:
    ``(logp, entropy)`` (``extras``: and the three diagnostics), each ``targets.shape``
    (the entropy None where not asked for)."""
    sharded = process_group is not None
    check_layout_keywords(process_group, vocab_start, vocab_size)
    rows, weight, bias, flat_targets, chunk, which = _prepare(
        hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk_tokens,
        backend, sharded,
    )  # fmt: skip
    cap = None if softcap is None else float(softcap)
    tp = None
    if sharded:
        tp = _tensor_parallel(
            process_group, weight, vocab_start, vocab_size, temperature, cap, ignore_index,
            with_entropy, which, reduce_hidden_grad, rows, with_extras=extras,
        )  # fmt: skip
    args = (rows, weight, bias, flat_targets, float(temperature), cap, int(ignore_index),
            chunk, which)  # fmt: skip
    with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
        if torch.compiler.is_compiling():  # one op: any token count
            if tp is None:
                logp, entropy, _, _, *diagnostics = linear_stats_fwd_op(*args, extras)
            else:
                logp, entropy, _, _, *diagnostics, _ = sharded_linear_stats_fwd_op(
                    rows, weight, bias, flat_targets, chunk, *_tp_args(tp),
                    bool(with_entropy), extras,
                )  # fmt: skip
            out = (logp, entropy, *(diagnostics if extras else ()))
        else:
            out = _LinearTokenStats.apply(*args, tp, extras)
    logp, entropy, *diagnostics = out  # the entropy: empty where not asked for (sharded)
    entropy = entropy.view(targets.shape) if with_entropy else None
    return (logp.view(targets.shape), entropy, *(x.view(targets.shape) for x in diagnostics))


def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    backend: str = "auto",
) -> TokenStats:
    """:func:`fused_rl.token_stats` of ``F.linear(hidden, weight, bias)`` without the whole
    ``(N, V)`` logits: the target's log-prob and the entropy (differentiable for ``hidden``,
    ``weight`` and ``bias``) and the mean logit, ``log sum p^2`` and whether the target is
    the top-1 prediction (not differentiable), every one from one read of each chunk's
    logits: what SFT / DPO / KTO trainers log beside their loss (TRL's fused head's
    ``mean_logits``, ``log_sum_sq_probs``, ``is_top1``).

    Args:
        hidden, weight, targets, bias, temperature, softcap, ignore_index, chunk_tokens,
            backend: as :func:`linear_token_logprobs` (the causal-LM shift of ``(B, T)``
            targets with ``T < S`` included).
        process_group, vocab_start, vocab_size, reduce_hidden_grad: vocabulary
            parallelism, as :func:`linear_token_logprobs` (``weight`` / ``bias`` this rank's
            shard, ``hidden`` replicated): every rank returns the unsharded call's five
            outputs; the two all-reduces of all chunks' partials carry 36 bytes a token
            (:func:`fused_rl.token_stats` ``(process_group=)``).

    Returns:
        :class:`fused_rl.logprobs.TokenStats`, each ``targets.shape``; 0 (False) at ignored
        tokens.

    Cost: :func:`linear_token_logprobs` ``(return_entropy=True)``'s: one GEMM per chunk and
    one read of its logits forward (13 more bytes written a token), two GEMMs and one read
    and write backward.

    Example:
        >>> import torch, fused_rl
        >>> h, w = torch.randn(2, 5, 8), torch.randn(11, 8)
        >>> t = torch.randint(0, 11, (2, 4))
        >>> s = fused_rl.linear_token_stats(h, w, t, chunk_tokens=3)
        >>> z = (h @ w.T)[:, :-1]
        >>> bool((s.is_top1 == (z.argmax(-1) == t)).all())
        True
        >>> torch.allclose(s.mean_logit, z.mean(-1), atol=1e-5)
        True
    """
    if not isinstance(reduce_hidden_grad, bool):
        raise TypeError(f"reduce_hidden_grad must be a bool, got {type(reduce_hidden_grad)}")
    return TokenStats(*_linear_stats(
        hidden, weight, targets, bias, temperature, softcap, ignore_index, chunk_tokens,
        process_group, vocab_start, vocab_size, reduce_hidden_grad, backend, True, extras=True,
    ))  # fmt: skip


def _linear_truncated(hidden, weight, targets, bias, top_k, top_p, temperature, softcap,
                      ignore_index, return_entropy, chunk_tokens, process_group, vocab_start,
                      vocab_size, reduce_hidden_grad, backend) -> Tensor:  # fmt: skip
    """``linear_token_logprobs`` with ``top_k`` / ``top_p``: ``return_entropy`` refused as
    ``token_logprobs`` refuses it, then :class:`_LinearTruncated` (vocabulary-parallel with
    ``process_group``)."""
    if return_entropy:
        raise ValueError(
            "linear_token_logprobs with top_k / top_p (truncated log-probs) does not take "
            "return_entropy: call it without it"
        )
    sharded = process_group is not None
    check_layout_keywords(process_group, vocab_start, vocab_size)
    check_options(top_k, top_p, temperature, softcap, ignore_index)
    rows, weight, bias, flat_targets, chunk, which = _prepare(
        hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk_tokens,
        backend, sharded,
    )  # fmt: skip
    cap = None if softcap is None else float(softcap)
    if not sharded:
        k, p = cuts(top_k, top_p, weight.shape[0])
        args = (rows, weight, bias, flat_targets, k, p, float(temperature), cap,
                int(ignore_index), chunk, which)  # fmt: skip
        with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
            if torch.compiler.is_compiling():  # one op: any token count
                logp = linear_truncated_fwd_op(*args)[0]
            else:
                logp = _LinearTruncated.apply(*args)
        return logp.view(targets.shape)
    tp = _tensor_parallel(
        process_group, weight, vocab_start, vocab_size, temperature, cap, ignore_index, False,
        which, reduce_hidden_grad, rows,
    )  # fmt: skip
    shard = tp.spec.shard
    if not chunk_tokens:  # the same chunks on every rank: each chunk's cut is collective
        # (a checked layout agrees on vocab_size before any chunk; unchecked, the ranks
        # must pass the same one)
        chunk = default_chunk_tokens(-(-shard.vocab_size // shard.world), rows.dtype,
                                     rows.shape[1])  # fmt: skip
    # top_k as given: the ranks agree on turning it off at V (truncated_parallel.agreed_cut)
    k, p = cuts(top_k, top_p, MAX_VOCAB)
    logp = _sharded_truncated(rows, weight, bias, flat_targets, k, p, chunk, tp)
    return logp.view(targets.shape)


def _sharded_truncated(rows, weight, bias, flat_targets, k, p, chunk, tp) -> Tensor:
    """``sharded_linear_truncated_fwd_op`` (the options in ``tp``): one custom op each way,
    opaque to ``torch.compile`` (its host reads and collectives run inside)."""
    with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
        logp, *_ = sharded_linear_truncated_fwd_op(
            rows, weight, bias, flat_targets, int(k), float(p), int(chunk), *_tp_args(tp)
        )
    return logp


def _tensor_parallel(group, weight, vocab_start, vocab_size, temperature, softcap,
                     ignore_index, with_entropy, which, reduce_hidden, rows,
                     with_extras=False) -> _TensorParallel:  # fmt: skip
    """This rank's shard of the lm_head (``weight``'s rows) in ``group``, as a
    :class:`_TensorParallel` for :class:`_LinearTokenStats` (``with_extras``: the
    diagnostics of :func:`linear_token_stats` too)."""
    from .distributed import _Spec, check_vocab_limit, group_shard

    shard = group_shard(group, weight.shape[0], vocab_start, vocab_size, name="weight")
    check_vocab_limit(shard)
    spec = _Spec(
        shard, float(temperature), int(ignore_index), True, bool(with_entropy), which,
        V.value_checks_enabled(rows), softcap, with_extras,
    )  # fmt: skip
    return _TensorParallel(spec, reduce_hidden)


@V.deprecated_keyword("kl", "kl_estimator")
@takes_policy_options
def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_tokens: int | None = None,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    is_weights: Tensor | None = None,
    num_items: int | float | Tensor | None = None,
    ignore_index: int = -100,
    process_group=None,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    reduce_hidden_grad: bool = True,
    policy: PolicyConfig,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`fused_rl.policy_loss` straight from hidden states: the same loss, gradients
    (for ``hidden``, ``weight``, ``bias``) and metrics as
    ``policy_loss(F.linear(hidden, weight, bias), targets, advantages, ...)``, with the
    ``(N, V)`` logits never held whole.

    Shapes and ``chunk_tokens`` as :func:`linear_token_logprobs` (``hidden`` ``(B, S, H)``
    with ``(B, T)`` targets, ``S >= T``); every other keyword as :func:`policy_loss`
    (the policy options: :class:`fused_rl.PolicyConfig`, or ``policy_config=``);
    ``softcap``: the soft cap ``c`` of the logits, ``c tanh(z / c) / T`` with
    ``z = hidden @ weight.T + bias`` (as :func:`linear_token_logprobs`).

    How (module docstring): with gradients on and ``importance_sampling="token"`` on the
    Triton backend, one pass over the chunks computes the loss, the metrics and the
    gradients (GEMM, one vocab kernel writing ``dz`` over the logits, the two gradient
    GEMMs), and the backward scales ``dH``/``dW``/``db`` in place by the upstream scalar
    (nothing read when it is 1; a second backward of the same call forms them again): three
    GEMMs per chunk. Otherwise (GSPO, ``top_entropy_quantile < 1``, the off-policy mask,
    ``no_grad``, the reference backend) it is :func:`linear_token_logprobs` feeding
    :func:`policy_loss_from_logprobs`, whose backward recomputes each chunk's logits (GSPO's
    sequence totals must exist before any token's gradient): four GEMMs per chunk with
    gradients, one without.

    The exact KL (``kl_estimator="full"``, as :func:`policy_loss`'s ``ref_logits``) from
    the reference model's hidden states: ``ref_hidden`` (shaped as ``hidden``, its own width
    ``H_ref``), ``ref_weight`` ``(V, H_ref)`` (the same vocabulary) and ``ref_bias``; per
    chunk one more GEMM (no gradient, a second chunk-sized logits buffer) gives the
    reference's logits, streamed beside the policy's in the same vocab kernel: no ``(N, V)``
    tensor of either model (``softcap`` caps both models' logits alike). GSPO, VESPO, the
    top-entropy selection and ``process_group`` (both lm_heads sharded alike, any layout of
    ``vocab_start`` / ``vocab_size``) compose it: the log-probs, then each chunk's exact KL
    (:func:`fused_rl.token_kl`'s, on the chunk's two logits; its row statistics, 24 bytes a
    token in fp32, kept for the backward, which recomputes both chunks' logits and writes ``dz``
    from them with no collective; sharded, merged over the ranks chunk by chunk, so without
    ``chunk_tokens`` the chunk is sized from ``ceil(vocab_size / P)`` on every rank), added
    with the aggregation's token weights; ``kl_bias_correction`` raises there.

    Vocabulary parallelism (``process_group``, ``vocab_start``, ``vocab_size``,
    ``reduce_hidden_grad``: as :func:`linear_token_logprobs`, ``weight`` / ``bias`` this
    rank's lm_head shard, ``hidden`` replicated): always the composition, the vocab-parallel
    :func:`linear_token_logprobs` feeding :func:`policy_loss_from_logprobs`; every rank
    computes the same loss and metrics (not reduced), the shard's ``weight`` gradient and
    (all-reduced by default) the whole ``hidden`` gradient.

    Example:
        >>> import torch, fused_rl
        >>> h = torch.randn(2, 6, 8, requires_grad=True)
        >>> w = torch.randn(32, 8, requires_grad=True)
        >>> t = torch.randint(0, 32, (2, 5))
        >>> loss, m = fused_rl.linear_policy_loss(h, w, t, torch.tensor([1.0, -1.0]))
        >>> loss.backward()
    """
    ref_name, ref_given = next(
        ((n, t) for n, t in (("ref_weight", ref_weight), ("ref_hidden", ref_hidden),
                             ("ref_bias", ref_bias)) if t is not None),
        ("ref_weight", None),
    )  # fmt: skip
    inputs = RolloutInputs(
        advantages=advantages, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs, mask=mask, is_weights=is_weights, num_items=num_items,
    )  # fmt: skip
    _check_policy_tensors(targets, inputs, policy, ref_given, ref_name)
    need_entropy = with_entropy or policy.uses_entropy
    if ref_given is not None:
        return _full_kl_policy_loss(
            hidden, weight, targets, inputs, bias=bias, chunk_tokens=chunk_tokens,
            ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
            temperature=temperature, softcap=softcap, with_entropy=need_entropy,
            ignore_index=ignore_index, process_group=process_group, vocab_start=vocab_start,
            vocab_size=vocab_size, reduce_hidden_grad=reduce_hidden_grad, policy=policy,
            backend=backend,
        )  # fmt: skip
    # one pass when every token's gradient is known from its own row (VESPO's phi needs the
    # sequence's total first, GSPO its ratio, the entropy selection every entropy)
    if policy.token_level and process_group is None and _grad_wanted(hidden, weight, bias):
        rows, weight_c, bias_c, flat_targets, chunk, which = _prepare(
            hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk_tokens,
            backend,
        )  # fmt: skip
        if which == "triton":
            return _fused_policy_loss(
                rows, weight_c, bias_c, flat_targets, targets.shape, inputs, chunk,
                temperature=temperature, softcap=softcap, ignore_index=ignore_index,
                with_entropy=need_entropy, policy=policy,
            )  # fmt: skip
    out = linear_token_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, return_entropy=need_entropy, chunk_tokens=chunk_tokens,
        process_group=process_group, vocab_start=vocab_start, vocab_size=vocab_size,
        reduce_hidden_grad=reduce_hidden_grad, backend=backend,
    )  # fmt: skip
    logp, entropy = out if need_entropy else (out, None)
    return loss_from_token_stats(logp, entropy, targets, inputs, ignore_index=ignore_index,
                                 policy=policy, backend=backend)  # fmt: skip


def _grad_wanted(*tensors: Tensor | None) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _check_policy_tensors(targets, inputs: RolloutInputs, policy, ref_given=None,
                          ref_name="ref_weight") -> None:  # fmt: skip
    """The per-token tensors and what the call adds to the config's checks, before any GEMM
    (a bad argument fails before any work); ``ref_given``: the first of the reference's
    ``ref_weight`` / ``ref_hidden`` / ``ref_bias`` given (named ``ref_name``)."""
    check_call(policy, inputs.ref_logprobs, inputs.num_items, ref_given, ref_name=ref_name,
               rollout_logprobs=inputs.rollout_logprobs)  # fmt: skip
    V.check_tensor(targets, "targets")
    if targets.dim() != 2:
        raise ValueError(f"targets must be (B, T), got shape {tuple(targets.shape)}")
    batch, length = targets.shape
    advantages_2d(inputs.advantages, batch, length)
    is_weights_2d(inputs.is_weights, batch, length)
    token_tensors = dict(
        old_logprobs=inputs.old_logprobs,
        rollout_logprobs=inputs.rollout_logprobs,
        ref_logprobs=inputs.ref_logprobs,
        mask=inputs.mask,
    )  # (B, T) ones
    check_token_tensors(batch, length, **token_tensors)
    V.check_same_device(targets=targets, advantages=inputs.advantages,
                        is_weights=inputs.is_weights, **token_tensors)  # fmt: skip
    V.check_mask_weights(inputs.mask, "mask")


def _counted_rows(m: Tensor, rows: Tensor) -> Tensor | None:
    """The indices of the rows with a nonzero weight ``m`` (``(B, T)``; NaN counts), or None
    to run every row: ``config.skip_padding_rows`` off, no row to skip, or no host sync
    allowed here (tracing, CUDA-graph capture, fake tensors)."""
    if not config.skip_padding_rows or not V.host_sync_allowed(m, rows):
        return None
    kept = torch.nonzero(m.reshape(-1) != 0).squeeze(1)  # the one host sync
    return None if kept.numel() == m.numel() else kept


def _full_kl_policy_loss(hidden, weight, targets, inputs: RolloutInputs, *, bias,
                         chunk_tokens, ref_hidden, ref_weight, ref_bias, temperature, softcap,
                         with_entropy, ignore_index, process_group, vocab_start, vocab_size,
                         reduce_hidden_grad, policy, backend):  # fmt: skip
    """:func:`linear_policy_loss` with ``kl_estimator="full"``: token-level importance
    sampling without ``process_group``: the chunked one-pass op on the Triton backend (with
    or without gradients; the reference backend materialises both models' logits and runs
    :func:`fused_rl.policy_loss`'s reference, the oracle's twin); otherwise (GSPO, VESPO, the
    top-entropy selection, vocabulary parallelism) composed on either backend:
    :func:`linear_token_logprobs` and the exact KL of each chunk's logits
    (:class:`_LinearTokenKL`), then ``losses.loss_with_exact_kl``."""
    if ref_hidden is None or ref_weight is None:
        missing = "ref_hidden" if ref_hidden is None else "ref_weight"
        raise ValueError(f"the exact KL from hidden states needs {missing} too")
    sharded = process_group is not None
    check_full_kl_route(policy, sharded)
    check_layout_keywords(process_group, vocab_start, vocab_size)
    rows, weight, bias, flat_targets, chunk, which = _prepare(
        hidden, weight, bias, targets, temperature, softcap, ignore_index, chunk_tokens,
        backend, sharded,
    )  # fmt: skip
    shard = None
    if sharded:  # each chunk's KL merges over the ranks: the same chunks on every rank
        shard = group_shard(process_group, weight.shape[0], vocab_start, vocab_size,
                            name="weight")  # fmt: skip
        check_vocab_limit(shard)
    ref_rows, ref_weight, ref_bias = _prepare_ref(ref_hidden, ref_weight, ref_bias, hidden,
                                                  weight, targets)  # fmt: skip
    if sharded and not chunk_tokens:  # the same chunks on every rank
        chunk = default_chunk_tokens(-(-shard.vocab_size // shard.world), rows.dtype,
                                     rows.shape[1])  # fmt: skip
    if sharded or not policy.token_level:
        return _composed_full_kl_loss(
            hidden, weight, targets, inputs, bias=bias, rows=rows, flat_targets=flat_targets,
            ref_head=(ref_rows, ref_weight, ref_bias), chunk=chunk, chunk_tokens=chunk_tokens,
            temperature=temperature, softcap=softcap, with_entropy=with_entropy,
            ignore_index=ignore_index, shard=shard, reduce_hidden_grad=reduce_hidden_grad,
            policy=policy, which=which,
        )  # fmt: skip
    if which == "triton":
        if not _grad_wanted(hidden, weight, bias):  # the same pass, no gradient formed
            rows, weight = rows.detach(), weight.detach()
            bias = None if bias is None else bias.detach()
        return _fused_policy_loss(
            rows, weight, bias, flat_targets, targets.shape, inputs, chunk,
            temperature=temperature, softcap=softcap, ignore_index=ignore_index,
            with_entropy=with_entropy, policy=policy, ref_head=(ref_rows, ref_weight, ref_bias),
        )  # fmt: skip
    shape = (*targets.shape, weight.shape[0])
    return policy_loss(
        F.linear(rows, weight, bias).view(shape), targets, inputs.advantages,
        ref_logits=F.linear(ref_rows, ref_weight, ref_bias).view(shape),
        temperature=temperature, softcap=softcap, with_entropy=with_entropy,
        ignore_index=ignore_index, process_group=process_group, policy_config=policy,
        backend=which, **inputs.keywords(),
    )  # fmt: skip


def _composed_full_kl_loss(hidden, weight, targets, inputs: RolloutInputs, *, bias, rows,
                           flat_targets, ref_head, chunk, chunk_tokens, temperature, softcap,
                           with_entropy, ignore_index, shard, reduce_hidden_grad, policy,
                           which):  # fmt: skip
    """The composed ``kl_estimator="full"`` from hidden states: the log-probs of
    :func:`linear_token_logprobs`, the exact KL per chunk (:class:`_LinearTokenKL`), then
    ``losses.loss_with_exact_kl``; ``which`` the backend of both, ``shard`` the lm_heads'
    vocabulary shard (None: whole)."""
    layout = {}
    if shard is not None:
        layout = dict(process_group=shard.group, vocab_start=shard.start if shard.explicit
                      else None, vocab_size=shard.vocab_size)  # fmt: skip
    out = linear_token_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature, softcap=softcap,
        ignore_index=ignore_index, return_entropy=with_entropy, chunk_tokens=chunk_tokens,
        reduce_hidden_grad=reduce_hidden_grad, backend=which, **layout,
    )  # fmt: skip
    logp, entropy = out if with_entropy else (out, None)
    counted = counted_mask(inputs.mask, targets, ignore_index)
    counted = (counted if counted.dtype == torch.bool else counted != 0).reshape(-1)
    cap = None if softcap is None else float(softcap)
    ref_rows, ref_weight, ref_bias = ref_head
    if shard is not None:  # a padded vocabulary's padding rows: never read (0 gradient)
        weight, bias = _valid_rows(weight, bias, shard.valid)
        ref_weight, ref_bias = _valid_rows(ref_weight, ref_bias, shard.valid)
    head = (rows, weight, bias, ref_rows, ref_weight, ref_bias)
    with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
        if torch.compiler.is_compiling():  # one op: any token count
            kl = linear_kl_fwd_op(*head, whole_rows(counted), float(temperature), cap, chunk,
                                  which, bool(reduce_hidden_grad),
                                  *shard_args(shard))[0]  # fmt: skip
        else:
            kl = _LinearTokenKL.apply(*head, counted, float(temperature), cap, chunk, shard,
                                      reduce_hidden_grad, which)  # fmt: skip
    return loss_with_exact_kl(logp, entropy, kl.view(targets.shape), targets, inputs,
                              policy=policy, ignore_index=ignore_index, backend=which)  # fmt: skip


class _LinearTokenKL(torch.autograd.Function):
    """The exact per-token ``KL(pi || pi_ref)`` ``(N,)`` of ``F.linear(rows, weight, bias)``
    against ``F.linear(ref_rows, ref_weight, ref_bias)`` (a constant), chunk by chunk:
    forward each chunk's two logits made and their KL and row statistics computed
    (:func:`fused_rl.distill.divergence_stats` at ``beta = 1``; rows outside ``counted``
    unread, 0), each chunk's ``(N_STATS, n)`` statistics kept (24 bytes a token in fp32);
    backward each chunk's two logits recomputed and ``dz`` written from its statistics
    (:func:`fused_rl.distill.divergence_grad`: one read of each chunk, no collective, no
    autograd graph, so ``torch.compile(fullgraph=True)`` traces it), then ``dH = dz W``,
    ``dW += dz^T h``, ``db`` (with ``shard`` and ``reduce_hidden`` one SUM all-reduce of
    ``dH``). With a vocabulary ``shard`` each chunk's statistics merge over the ranks (the
    layout was checked by the log-probs' merge before, here a bad one gives NaN), so every
    rank runs the same chunks. Neither model's ``(N, V)`` logits exist whole."""

    @staticmethod
    def forward(ctx, rows, weight, bias, ref_rows, ref_weight, ref_bias, counted, temperature,
                softcap, chunk, shard, reduce_hidden, which):  # fmt: skip
        ctx.set_materialize_grads(False)
        counted = whole_rows(counted)
        kl, stats = _kl_chunks(rows, weight, bias, ref_rows, ref_weight, ref_bias, counted,
                               temperature, softcap, chunk, shard, which)  # fmt: skip
        ctx.save_for_backward(rows, weight, bias, ref_rows, ref_weight, ref_bias, counted,
                              *stats)  # fmt: skip
        ctx.config = (temperature, softcap, chunk, shard, reduce_hidden, which)
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        rows, weight, bias, ref_rows, ref_weight, ref_bias, counted, *stats = ctx.saved_tensors
        temperature, softcap, chunk, shard, reduce_hidden, which = ctx.config
        grads = _kl_grads(ctx.needs_input_grad[:3], rows, weight, bias, ref_rows, ref_weight,
                          ref_bias, counted, lambda r: stats[r.start // chunk], grad_kl,
                          temperature, softcap, chunk, shard, reduce_hidden, which)  # fmt: skip
        return grads + (None,) * 10


def _kl_chunks(rows, weight, bias, ref_rows, ref_weight, ref_bias, counted, temperature,
               softcap, chunk, shard, which, into=None) -> tuple[Tensor, list[Tensor]]:  # fmt: skip
    """:class:`_LinearTokenKL`'s forward: ``(kl, stats)``, each chunk's ``(N_STATS, n)``
    statistics as made (the gradient kernel reads them whole), or written into ``into``
    (flat, chunk by chunk: each chunk's block contiguous) and returned as its views."""
    n_rows = rows.shape[0]
    tf = Transforms.shared(softcap)
    acc = stats_dtype(torch.promote_types(rows.dtype, ref_rows.dtype))
    kl = rows.new_empty((n_rows,), dtype=acc)
    stats = []
    for start in range(0, n_rows, chunk):
        r = slice(start, min(start + chunk, n_rows))
        z = _chunk_logits(rows[r], weight, bias, chunk)[0]
        u = _chunk_logits(ref_rows[r], ref_weight, ref_bias, chunk)[0]
        d, _, stats_r = divergence_stats(
            z[None], u[None], counted[r][None], temperature, which, shard, 1.0, False, tf
        )
        kl[r] = d[0]
        if into is not None:
            stats_r = _kl_stats_block(into, r).copy_(stats_r)
        stats.append(stats_r)
        del z, u, d, stats_r
    return kl, stats


def _kl_stats_block(flat: Tensor, r: slice) -> Tensor:
    """The ``(N_STATS, n)`` block of the chunk ``r`` in a flat statistics buffer."""
    return flat[N_STATS * r.start : N_STATS * r.stop].view(N_STATS, r.stop - r.start)


def _kl_grads(needs, rows, weight, bias, ref_rows, ref_weight, ref_bias, counted, stats_of,
              grad_kl, temperature, softcap, chunk, shard, reduce_hidden,
              which) -> tuple:  # fmt: skip
    """``(d_hidden, d_weight, d_bias)`` of :class:`_LinearTokenKL` (None where not needed,
    or with no upstream gradient): each chunk's two logits recomputed, ``dz`` written from
    its statistics (``stats_of(rows)``), the head's GEMMs."""
    if grad_kl is None:
        return (None,) * 3
    grad_kl = whole_rows(grad_kl)
    tf = Transforms.shared(softcap)

    def dz_of(r, z):
        u = _chunk_logits(ref_rows[r], ref_weight, ref_bias, chunk)[0]
        g = torch.where(counted[r], grad_kl[r], 0.0)[None]  # rows not counted: not read
        dz = divergence_grad(z[None], u[None], stats_of(r), g, temperature, which, 1.0, tf,
                             shard)  # fmt: skip
        return dz[0], False

    reduce = shard.group if shard is not None and reduce_hidden else None
    return _head_grads(needs, rows, weight, bias, chunk, dz_of, group=reduce)


def linear_kl_fwd(rows: Tensor, weight: Tensor, bias: Tensor | None, ref_rows: Tensor,
                  ref_weight: Tensor, ref_bias: Tensor | None, counted: Tensor,
                  temperature: float, softcap: float | None, chunk: int, which: str,
                  reduce_hidden: bool, group_name: str | None, start: int, columns: int,
                  vocab_size: int, explicit: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:class:`_LinearTokenKL` traced (as ``linear_stats_fwd``; the shard, if any, as
    :func:`fused_rl.distributed.shard_args`' primitive arguments): ``(kl, stats)``, the
    statistics flat, each chunk's ``(N_STATS, n)`` block contiguous."""
    shard = shard_of(group_name, start, columns, vocab_size, explicit, "weight")
    acc = stats_dtype(torch.promote_types(rows.dtype, ref_rows.dtype))
    flat = rows.new_empty((N_STATS * rows.shape[0],), dtype=acc)
    kl, _ = _kl_chunks(rows, weight, bias, ref_rows, ref_weight, ref_bias, counted,
                       temperature, softcap, chunk, shard, which, into=flat)  # fmt: skip
    return kl, flat


def linear_kl_bwd(rows: Tensor, weight: Tensor, bias: Tensor | None, ref_rows: Tensor,
                  ref_weight: Tensor, ref_bias: Tensor | None, counted: Tensor, stats: Tensor,
                  grad_kl: Tensor, need_h: bool, need_w: bool, need_b: bool,
                  temperature: float, softcap: float | None, chunk: int, which: str,
                  reduce_hidden: bool, group_name: str | None, start: int, columns: int,
                  vocab_size: int, explicit: bool) -> list[Tensor]:  # fmt: skip
    """:func:`_kl_grads` of :func:`linear_kl_fwd`: ``[d_hidden, d_weight, d_bias]``, empty
    where not needed."""
    shard = shard_of(group_name, start, columns, vocab_size, explicit, "weight")
    grads = _kl_grads((need_h, need_w, need_b), rows, weight, bias, ref_rows, ref_weight,
                      ref_bias, counted, lambda r: _kl_stats_block(stats, r), grad_kl,
                      temperature, softcap, chunk, shard, reduce_hidden, which)  # fmt: skip
    return [rows.new_empty((0,)) if g is None else g for g in grads]


def _linear_kl_fwd_fake(rows, weight, bias, ref_rows, *args):
    acc, n = stats_dtype(torch.promote_types(rows.dtype, ref_rows.dtype)), rows.shape[0]
    return rows.new_empty((n,), dtype=acc), rows.new_empty((N_STATS * n,), dtype=acc)


def _linear_kl_setup(ctx, inputs, output):
    """Saves ``linear_kl_bwd``'s first eight arguments (the seven inputs, the flat
    statistics) and the options after them."""
    ctx.save_for_backward(*inputs[:7], output[1])
    ctx.options = inputs[7:]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


linear_kl_bwd_op = head_bwd_op("linear_kl_bwd", linear_kl_bwd, 6)
linear_kl_fwd_op = FusedOp("linear_kl_fwd", linear_kl_fwd)
linear_kl_fwd_op.register_fake(_linear_kl_fwd_fake)
linear_kl_fwd_op.register_autograd(head_op_backward(linear_kl_bwd_op),
                                   setup_context=_linear_kl_setup)  # fmt: skip


def check_second_head(hidden2, weight2, bias2, hidden, weight, names, whose: str) -> None:
    """A second model's hidden states, lm_head and bias (the reference's, the teacher's:
    ``names`` their argument names, ``whose`` the model in messages) against the policy's
    ``hidden`` / ``weight``: the same tokens, its own width, the same vocabulary, one dtype
    for ``torch.nn.functional.linear``; each error names the argument."""
    n_hidden, n_weight, n_bias = names
    for name, x in zip(names, (hidden2, weight2, bias2)):
        check_local(x, name)
    lead = tuple(hidden.shape[:-1])
    if hidden2.dim() != hidden.dim() or tuple(hidden2.shape[:-1]) != lead:
        raise ValueError(
            f"{n_hidden} must be shaped as hidden {lead} + (H',) (the same tokens), got "
            f"{tuple(hidden2.shape)}"
        )
    if weight2.dim() != 2 or weight2.shape[1] != hidden2.shape[-1]:
        raise ValueError(
            f"{n_weight} must be the {whose} lm_head (V, H') with H' = {n_hidden}.shape[-1] = "
            f"{hidden2.shape[-1]}, got {tuple(weight2.shape)}"
        )
    if weight2.shape[0] != weight.shape[0]:
        raise ValueError(
            f"{n_weight} has a vocabulary of {weight2.shape[0]} but weight has "
            f"{weight.shape[0]}: both models must share the vocabulary"
        )
    if weight2.dtype != hidden2.dtype:
        raise TypeError(
            f"{n_weight} ({weight2.dtype}) and {n_hidden} ({hidden2.dtype}) must share a dtype, "
            f"as torch.nn.functional.linear needs (a wider {n_weight} is fine: {n_hidden} is "
            "cast up to it)"
        )
    if bias2 is not None:
        V.check_float(bias2, n_bias)
        if tuple(bias2.shape) != (weight2.shape[0],) or bias2.dtype != weight2.dtype:
            raise ValueError(
                f"{n_bias} must be ({weight2.shape[0]},) in {weight2.dtype}, got shape "
                f"{tuple(bias2.shape)} in {bias2.dtype}"
            )


def _prepare_ref(ref_hidden, ref_weight, ref_bias, hidden, weight, targets):
    """The reference's ``(N, H_ref)`` rows (windowed as ``hidden``'s), lm_head and bias,
    checked against the policy's and detached (constants, as ``ref_logprobs``); under
    ``torch.autocast`` in the autocast dtype, as the policy's (both logits from the same
    GEMM precision: a reference equal to the policy gives a KL of exactly 0)."""
    V.check_float(ref_hidden, "ref_hidden")
    V.check_float(ref_weight, "ref_weight")
    ref_hidden, ref_weight, ref_bias = _autocast_inputs(ref_hidden, ref_weight, ref_bias)
    V.check_same_device(hidden=hidden, ref_hidden=ref_hidden, ref_weight=ref_weight,
                        ref_bias=ref_bias)  # fmt: skip
    ref_hidden = _promote_hidden(ref_hidden, ref_weight)
    check_second_head(ref_hidden, ref_weight, ref_bias, hidden, weight,
                      ("ref_hidden", "ref_weight", "ref_bias"), "reference's")  # fmt: skip
    if ref_bias is not None:
        ref_bias = ref_bias.detach()
    ref_rows, _ = _window_rows(ref_hidden.detach(), targets)
    return ref_rows, ref_weight.detach(), ref_bias


def _fused_policy_loss(rows, weight, bias, flat_targets, shape, inputs: RolloutInputs, chunk,
                       *, temperature, softcap, ignore_index, with_entropy, policy,
                       ref_head=None):  # fmt: skip
    """The Triton path of :func:`linear_policy_loss` for token-level importance sampling
    (:class:`_LinearPolicyLoss`): per-token inputs flattened to ``(N,)`` and the
    aggregation's per-row scale computed from the mask before the chunk loop."""
    batch, length = shape
    acc = stats_dtype(rows.dtype)
    flat = lambda t: None if t is None else whole_rows(t.reshape(-1))  # noqa: E731
    adv2d = advantages_2d(inputs.advantages, batch, length)
    adv, old, ref = rollout_constants(acc, adv2d, inputs.old_logprobs, inputs.ref_logprobs)
    is_w = is_weights_2d(inputs.is_weights, batch, length)
    mask, num_items = inputs.mask, inputs.num_items
    targets2d = flat_targets.view(batch, length)
    m = weights_of(mask, targets2d, acc, targets2d, ignore_index)
    scale = sequence_scale(m, policy.loss_agg, max_length=policy.max_length, num_items=num_items)
    row_scale = flat(per_row(scale, (batch, length)))  # the kernel reads stride 1
    kept = _counted_rows(m, rows)
    n_items, n_items_t = num_items_args(num_items, rows.device)
    launch = _LinearLaunch(
        float(temperature), None if softcap is None else float(softcap), int(ignore_index),
        bool(with_entropy), chunk, shape,
        policy.max_length or length, n_items, policy.kernel_params,
        policy.kernel_modes,
    )  # fmt: skip
    tensors = (
        flat_targets, flat(adv), flat(old), flat(ref),
        flat(mask.detach()) if mask is not None else None,
        flat(rollout_constants(acc, is_w)[0]), row_scale,
        flat(per_row(entropy_scale(m, policy, num_items), (batch, length))), n_items_t,
    )  # fmt: skip
    with torch.autocast(rows.device.type, enabled=False):  # inputs already cast
        if torch.compiler.is_compiling():  # one op: any token count (kept is None here)
            grad = torch.is_grad_enabled()
            needs = [grad and t is not None and t.requires_grad for t in (rows, weight, bias)]
            loss, metrics, *_ = linear_policy_fwd_op(
                rows, weight, bias, *tensors, *(ref_head or (None,) * 3), *needs,
                launch.temperature, launch.softcap, launch.ignore_index, launch.with_entropy,
                launch.chunk, *launch.shape, launch.max_length, launch.num_items, launch.hyper,
                launch.modes,
            )  # fmt: skip
        else:
            loss, metrics = _LinearPolicyLoss.apply(rows, weight, bias, *tensors, kept, launch,
                                                    *(ref_head or ()))  # fmt: skip
    has_kl = ref is not None or ref_head is not None
    out = metrics_dict(metrics, has_kl=has_kl, has_entropy=with_entropy,
                       surrogate=launch.modes[0], has_is=is_w is not None,
                       bias_kl=policy.kl_bias_correction)  # fmt: skip
    per_count = num_items if policy.loss_agg == "token-mean" else None  # no other mode reads it
    return poison_empty(loss, per_count, batch * length), out
