"""The fused policy-loss ops (private): launchers, autograd, and the metric columns.

Every forward writes per-token backward coefficients and one ``(N_COLS, B*T)`` block of
per-token partial sums; ``_policy_finalize_kernel`` reduces those into the loss and every
metric in ONE launch (deterministic: a fixed-order tiled sum). Launches per call:

* token-level importance sampling from logits: the fused vocab-stream kernel + finalize;
* sequence-level (GSPO) from logits: layer 1 + the token-layer kernel + finalize;
* from per-token log-probs: the token-layer kernel + finalize;
* every backward: one kernel (layer 3 for logits; two elementwise ops for log-probs).

The loss aggregation's normaliser is applied after the per-token pass: ``w_t = m_t *
seq_scale[b]`` (``seq_scale`` one value per sequence for ``seq-mean-token-mean``, else one
for all), so the forward kernels need no mask totals before they run and the backward
scales ``g``, ``h`` by ``seq_scale[b]`` and the upstream gradient, both read on device.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ._launch import (
    COMPILE_OPTIONS,
    NO_CAP,
    NO_NUM_ITEMS,
    f32_pair,
    stats_dtype,
    triton_acc,
    vocab_launch,
)
from ._ops import FusedOp, _differentiable_once, _serialised_when_interpreting
from ._vocab_ops import (
    hand_back,
    keep_for_inplace,
    position_shift,
    scale_rows_unless_one,
    take_for_inplace,
    token_stats_bwd_into,
    token_stats_bwd_op,
    token_stats_fwd,
)
from .kernels.modes import (
    KL_KINDS,
    N_BASE_COLUMNS,
    POLICY_COLUMNS,
    POLICY_PARAMS,
    SEQUENCE_METRICS,
    SURROGATES,
)
from .reference.logprobs import differentiable_once

# the partial columns (kernels/modes.py POLICY_COLUMNS), by name: the metrics every call
# reports, the optional ones, the IS weights' (written and reduced only with weights)
COLUMN = {name: k for k, name in enumerate(POLICY_COLUMNS)}
_ALWAYS = ("clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max", "approx_kl")
METRIC_COLUMNS = {name: COLUMN[name] for name in _ALWAYS}
IS_COLUMNS = {name: COLUMN[name] for name in ("is_weight_mean", "is_weight_min", "is_weight_max")}
N_BASE_COLS, N_COLS = N_BASE_COLUMNS, len(POLICY_COLUMNS)
# the finalize kernel's output: one value per column, then the per-sequence extremes
SEQUENCE_OUTPUTS = {name: N_COLS + i for i, name in enumerate(SEQUENCE_METRICS)}
N_OUTPUTS = N_COLS + len(SEQUENCE_METRICS)
_REPORTED = (  # every call's metrics
    *METRIC_COLUMNS.items(),
    *((name, k) for name, k in SEQUENCE_OUTPUTS.items() if name != "aux_seq_mean"),
)
# what the COL_AUX column holds, per surrogate (in kernels/modes.py SURROGATES order), and
# the name of its mean over sequences where that is a metric of its own (VESPO's ``phi`` is
# one value per sequence: TRL's ``vespo/phi_seq_mean`` weighs sequences, not tokens)
_AUX_BY_NAME = {"ppo": "dual_clip_frac", "cispo": "cispo_clip_frac", "sapo": "sapo_gate_mean",
                "vespo": "vespo_phi_mean"}  # fmt: skip
AUX_METRIC = tuple(_AUX_BY_NAME.get(name) for name in SURROGATES)
AUX_SEQ_METRIC = tuple("vespo_phi_seq_mean" if name == "vespo" else None for name in SURROGATES)
FINALIZE_BLOCK_B, FINALIZE_BLOCK_T, TOKEN_BLOCK_T = 16, 128, 256


def uncounted_partials(n_rows: int, dtype: torch.dtype, device) -> Tensor:
    """``(N_COLS, n_rows)``: the partial columns a token with weight 0 writes (the kernels'
    epilogue): 0 in every column but the IS weights' minimum, +inf there."""
    part = torch.zeros((N_COLS, n_rows), dtype=dtype, device=device)
    part[IS_COLUMNS["is_weight_min"]] = float("inf")
    return part


def metrics_dict(
    metrics: Tensor, *, has_kl: bool, has_entropy: bool, surrogate: int = 0,
    has_is: bool = False, bias_kl: bool = False,
) -> dict[str, Tensor]:  # fmt: skip
    """Name the finalize kernel's ``(N_OUTPUTS,)`` output (0-dim views, no copies)."""
    cols = metrics.unbind()
    out = {}
    for name, k in _REPORTED:  # a loop, not a comprehension: no Python frame per call
        out[name] = cols[k]
    if has_is:
        for name, k in IS_COLUMNS.items():
            out[name] = cols[k]
    if AUX_METRIC[surrogate] is not None:
        out[AUX_METRIC[surrogate]] = cols[COLUMN["aux"]]
    if AUX_SEQ_METRIC[surrogate] is not None:
        out[AUX_SEQ_METRIC[surrogate]] = cols[SEQUENCE_OUTPUTS["aux_seq_mean"]]
    if has_kl:
        out["kl"] = cols[COLUMN["kl"]]
        if bias_kl:
            out["kl_bias_corrected"] = cols[COLUMN["kl_bias_corrected"]]
    if has_entropy:
        out["entropy"] = cols[COLUMN["entropy"]]
    return out


@functools.lru_cache(maxsize=256)
def _hyper(hyper: tuple[float, ...]) -> tuple[float, ...]:
    """``PolicyConfig.kernel_params`` as the kernels' ``hyper`` tuple: each value an fp32
    ``(hi, lo)`` pair (``f32_pair``), recombined in the accumulation dtype by the kernels'
    ``param``, so fp64 inputs see fp64 hyper-parameters. Cached: a config's table is the
    same every step."""
    return tuple(half for v in hyper for half in f32_pair(v))


_BETA, _ENTROPY_COEF = POLICY_PARAMS.index("beta"), POLICY_PARAMS.index("entropy_coef")
_DUAL_CLIP, _DELTA = POLICY_PARAMS.index("dual_clip"), POLICY_PARAMS.index("delta")
_KL_FULL = KL_KINDS.index("full")
N_KL_STATS = 4  # kernels/vocab/layer3.py KLS_*: the exact KL's per-token statistics


# With the exact KL (``kl_estimator="full"``: ``modes[1] == _KL_FULL``, ``ref`` the
# reference's logits ``(outer, S_r, V)``, not ``(outer, T)`` log-probs) the forward's ``h``
# output is packed ``(1 + N_KL_STATS, outer, T)``: ``h`` (written with an entropy bonus) and
# the KL's statistics for layer 3, one allocation (the default call allocates what it did).


def _without_full_kl(modes: list[int]) -> list[int]:
    """``modes`` with the KL kind of the exact KL replaced (no reference logits given, so
    no kernel branch may read them; the checked entry points never get here)."""
    return [modes[0], 0, *modes[2:]]


def _h_buffer(bonus: bool, full: bool, outer: int, inner: int, like: Tensor, dtype) -> Tensor:
    """``h`` ``(outer, T)`` (``(0,)`` without a bonus), or packed with the KL's statistics."""
    shape = (1 + N_KL_STATS, outer, inner) if full else ((outer, inner) if bonus else (0,))
    return like.new_empty(shape, dtype=dtype)


def _policy_switches(hyper: list[float], modes: list[int], has_ref: bool) -> dict:
    """The constexpr switches both policy kernels take, from ``PolicyConfig.kernel_params``
    / ``kernel_modes``: one place, so the two kernels never see different variants."""
    surrogate, kl_kind, bias_kl, _sequence, _agg = modes
    return dict(
        SURROGATE=surrogate, KL_KIND=kl_kind, BIAS_KL=bool(bias_kl),
        ADD_KL=has_ref and hyper[_BETA] != 0.0, ENTROPY_BONUS=hyper[_ENTROPY_COEF] != 0.0,
        USE_DUAL=hyper[_DUAL_CLIP] != 0.0, USE_DELTA=hyper[_DELTA] != 0.0,
    )  # fmt: skip


def _strides(t: Tensor | None) -> tuple[int, int]:
    return t.stride() if t is not None else (0, 0)


def _mask_arg(mask: Tensor | None) -> Tensor | None:
    # bool masks are read as bytes (a view: no copy)
    return mask.view(torch.uint8) if mask is not None and mask.dtype == torch.bool else mask


def _finalize(part, n_outer, inner, dtype, agg, max_length, num_items, num_items_t, has_is):
    """Launch the reduction: ``(loss, metrics, seq_scale)``."""
    from .kernels.policy.finalize import _policy_finalize_kernel

    dev = part.device
    loss = torch.empty((), dtype=dtype, device=dev)
    metrics = torch.empty(N_OUTPUTS, dtype=torch.float32, device=dev)
    per_seq = agg == 1  # seq-mean-token-mean
    seq_scale = torch.empty(max(n_outer, 1) if per_seq else 1, dtype=dtype, device=dev)
    _policy_finalize_kernel[(N_COLS if has_is else N_BASE_COLS,)](
        part, loss, metrics, seq_scale, num_items_t if num_items_t is not None else part,
        n_outer, inner, *(f32_pair(num_items) if num_items > 0 else NO_NUM_ITEMS),
        float(max(n_outer, 1)), float(max_length),
        AGG=agg, NUM_ITEMS_TENSOR=num_items_t is not None, BLOCK_B=FINALIZE_BLOCK_B,
        BLOCK_T=FINALIZE_BLOCK_T, ACC=triton_acc(dtype), **COMPILE_OPTIONS,
    )  # fmt: skip
    return loss, metrics, seq_scale


def _token_layer(logp, entropy, targets, adv, old, ref, mask, is_w, ignore_index, hyper, modes,
                 g, h, part, ent_scale=None, keep=None):  # fmt: skip
    """Launch the token-layer kernel (one program per sequence) on ``(B, T)`` inputs
    (``keep``: a ``(B, T)`` bool mask on the policy term, read as bytes)."""
    from .kernels.policy.token_pass import _policy_token_fwd_kernel

    outer, inner = logp.shape
    if outer * inner == 0:
        return
    sequence = modes[3]
    dummy = g
    _policy_token_fwd_kernel[(outer,)](
        logp, entropy if entropy is not None else dummy,
        targets if targets is not None else dummy, adv, old if old is not None else dummy,
        ref if ref is not None else dummy, mask if mask is not None else dummy,
        is_w if is_w is not None else dummy, keep if keep is not None else dummy, g, h, part,
        ent_scale if ent_scale is not None else dummy, inner, *logp.stride(),
        *_strides(entropy), *_strides(targets), *adv.stride(),
        *_strides(old), *_strides(ref), *_strides(mask), *_strides(is_w), *_strides(keep),
        ignore_index, _hyper(tuple(hyper)), HAS_ENTROPY=entropy is not None,
        HAS_TARGETS=targets is not None, HAS_OLD=old is not None, HAS_REF=ref is not None,
        HAS_MASK=mask is not None, HAS_IS=is_w is not None, HAS_KEEP=keep is not None,
        SEQUENCE=sequence != 0, SEQ_TOKEN=sequence == 2, SEQ_SUM=sequence == 3,
        HAS_ENT_SCALE=ent_scale is not None,
        BLOCK_T=TOKEN_BLOCK_T, ACC=triton_acc(g.dtype),
        **_policy_switches(hyper, modes, ref is not None), **COMPILE_OPTIONS,
    )  # fmt: skip


# ----------------------------------------------------------------------------- from logits


_NO_GRAD_ARGS = (0, 0, 0, 0, 1.0, 0.0)  # grad and row-scale strides, the grad_scale pair


def _grad_args(grad, row_scale, inner, grad_scale) -> tuple:
    """The fused kernel's ``WRITE_GRAD`` arguments: the gradient's row strides, the row
    scale's strides as ``(outer, inner)`` (a 1-D one is per token, contiguous), and
    ``grad_scale`` as an fp32 pair."""
    if row_scale.dim() == 1:
        rs = (inner * row_scale.stride(0), row_scale.stride(0))
    else:
        rs = row_scale.stride()
    return (*grad.stride()[:2], *rs, *f32_pair(grad_scale))


def _fused_rows(logits3d, targets, adv, old, ref, mask, is_w, temperature, softcap,
                ignore_index, hyper, modes, with_entropy, row_max, log_sum, entropy, g, h, part,
                grad=None, row_scale=None, ent_scale=None, grad_scale=1.0,
                read_layout=False):  # fmt: skip
    """Launch the fused vocab-stream kernel (layer 1 + the token layer as epilogue), one
    program per target token, writing the per-token outputs and partial columns (and, with
    ``grad``/``row_scale``, each row's gradient times ``grad_scale``: layer 3 in the same
    program). ``read_layout``: the block size and warps of the forward without ``grad``
    (the reductions in the same order: the same row statistics, bit for bit, on a GPU too),
    else a writing kernel's. With the exact KL ``ref`` is the reference's logits, streamed
    beside the policy's, and ``h`` is packed (:func:`_h_buffer`)."""
    from .kernels.vocab.policy_fused import _policy_loss_fwd_kernel

    outer, positions, vocab = logits3d.shape
    inner = targets.shape[1]
    if outer * inner == 0:
        return
    full = ref is not None and modes[1] == _KL_FULL
    if modes[1] == _KL_FULL and not full:  # no reference logits: no branch may read them
        modes = _without_full_kl(modes)
    rl, ref = (ref, None) if full else (None, ref)
    kls = g
    if full:
        h, kls = h[0], h[1:]
    write = grad is not None
    wargs = _grad_args(grad, row_scale, inner, grad_scale) if write else _NO_GRAD_ARGS
    _policy_loss_fwd_kernel[(outer * inner,)](
        logits3d, targets, adv, old if old is not None else g, ref if ref is not None else g,
        mask if mask is not None else g, is_w if is_w is not None else g, row_max, log_sum,
        entropy, g, h, part,
        grad if write else g, row_scale if row_scale is not None else g,
        ent_scale if ent_scale is not None else g, rl if full else g, kls,
        inner, position_shift(positions, inner),
        position_shift(rl.shape[1], inner) if full else 0, vocab, *logits3d.stride(),
        *targets.stride(), *adv.stride(), *_strides(old), *_strides(ref), *_strides(mask),
        *_strides(is_w), *wargs[:4], *(rl.stride() if full else (0, 0, 0)),
        *f32_pair(1.0 / temperature if softcap is None else softcap / temperature),
        *(NO_CAP if softcap is None else f32_pair(1.0 / softcap)), *wargs[4:], ignore_index,
        _hyper(tuple(hyper)),
        HAS_OLD=old is not None, HAS_REF=full or ref is not None, HAS_MASK=mask is not None,
        HAS_IS=is_w is not None, WITH_ENTROPY=with_entropy, WRITE_GRAD=write,
        HAS_ENT_SCALE=ent_scale is not None, HAS_SOFTCAP=softcap is not None,
        ACC=triton_acc(logits3d.dtype),
        **_policy_switches(hyper, modes, full or ref is not None),
        **vocab_launch(vocab, writes=write and not read_layout, heavy=full),
    )  # fmt: skip


def policy_rows_grad_into(
    grad: Tensor,
    logits3d: Tensor,
    targets: Tensor,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    mask: Tensor | None,
    is_w: Tensor | None,
    row_scale: Tensor,
    ent_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
    hyper: list[float],
    modes: list[int],
) -> Tensor:
    """The fused forward for token-level importance sampling, without the reduction, and
    with each row's gradient written in the same program: ``(outer, T, V)`` logits (no
    window), ``(outer, T)`` per-token inputs, ``row_scale`` ``(outer * T,)`` multiplying
    each row's ``g``/``h`` (the aggregation normaliser); ``hyper`` / ``modes``:
    ``PolicyConfig.kernel_params`` / ``kernel_modes``. Writes ``dL/dlogits`` to ``grad``
    (contiguous, the logits' shape and dtype; may BE ``logits3d`` when that is contiguous:
    each block of a row is read before it is overwritten) and returns the
    ``(N_COLS, outer * T)`` partial columns that :func:`policy_finalize` reduces. The
    fused-linear loss runs it on each chunk of logits (``fused_rl.linear``)."""
    outer, inner = targets.shape
    if logits3d.shape[1] != inner:
        raise ValueError("policy_rows_grad_into takes (outer, T, V) logits for (outer, T) targets")
    dtype = stats_dtype(logits3d.dtype)
    bonus = hyper[_ENTROPY_COEF] != 0.0
    new = lambda on=True: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    part = logits3d.new_empty((N_COLS, outer * inner), dtype=dtype)
    _fused_rows(
        logits3d, targets, adv, old, ref, _mask_arg(mask), is_w, temperature, softcap,
        ignore_index, hyper, modes, with_entropy or bonus, new(), new(), new(bonus), new(),
        _h_buffer(bonus, ref is not None and modes[1] == _KL_FULL, outer, inner, logits3d,
                  dtype), part, grad, row_scale, ent_scale,
    )  # fmt: skip
    return part


def policy_rows_grad_fwd(
    logits3d: Tensor,
    targets: Tensor,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    mask: Tensor | None,
    is_w: Tensor | None,
    row_scale: Tensor,
    ent_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
    hyper: list[float],
    modes: list[int],
) -> tuple[Tensor, Tensor]:
    """:func:`policy_rows_grad_into` into a fresh gradient buffer: ``(part, grad)`` (the
    form ``torch.compile`` traces, since a custom op may not mutate its input)."""
    grad = torch.empty(logits3d.shape, dtype=logits3d.dtype, device=logits3d.device)
    part = policy_rows_grad_into(
        grad, logits3d, targets, adv, old, ref, mask, is_w, row_scale, ent_scale, temperature,
        softcap, ignore_index, with_entropy, hyper, modes,
    )  # fmt: skip
    return part, grad


def _rows_grad_fake(logits3d, targets, *_args):
    dtype = stats_dtype(logits3d.dtype)
    part = logits3d.new_empty((N_COLS, targets.numel()), dtype=dtype)
    return part, logits3d.new_empty(logits3d.shape)


policy_rows_grad_fwd_op = FusedOp("policy_rows_grad_fwd", policy_rows_grad_fwd)
policy_rows_grad_fwd_op.register_fake(_rows_grad_fake)


def policy_finalize(
    part: Tensor,
    outer: int,
    inner: int,
    agg: int,
    max_length: int,
    num_items: float,
    num_items_t: Tensor | None,
    has_is: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss, metrics, seq_scale)`` from the ``(N_COLS, outer * inner)`` partial columns
    (the reduction every policy forward ends with, as an op of its own); ``has_is``: the IS
    columns were written."""
    return _finalize(
        part, outer, inner, part.dtype, agg, max_length, num_items, num_items_t, has_is
    )


def _finalize_fake(part, outer, inner, agg, max_length, num_items, num_items_t, has_is):
    n_scale = max(outer, 1) if agg == 1 else 1
    return (
        part.new_empty(()), part.new_empty(N_OUTPUTS, dtype=torch.float32),
        part.new_empty(n_scale),
    )  # fmt: skip


policy_finalize_op = FusedOp("policy_finalize_fwd", policy_finalize)
policy_finalize_op.register_fake(_finalize_fake)


def policy_loss_fwd(
    logits3d: Tensor,
    targets: Tensor,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    mask: Tensor | None,
    is_w: Tensor | None,
    num_items_t: Tensor | None,
    ent_scale: Tensor | None,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
    hyper: list[float],
    modes: list[int],
    max_length: int,
    num_items: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The policy loss over ``(B, S, V)`` logits for ``(B, T)`` targets / per-token inputs
    (any strides; ``adv`` may be an expanded ``(B,)``). ``hyper`` / ``modes``:
    ``PolicyConfig.kernel_params`` / ``kernel_modes``; ``num_items`` <= 0 means off.

    ``ref``: ``(B, T)`` reference log-probs, or with ``kl_estimator="full"`` the reference's
    logits ``(B, S_r, V)`` (token-level importance sampling only).

    Returns ``(loss, metrics, seq_scale, row_max, log_sum, entropy, g, h)``: ``loss``
    0-dim, ``metrics`` ``(N_COLS,)`` fp32, ``seq_scale`` the aggregation normaliser, and
    ``(B, T)`` per-token tensors for the backward (``entropy``/``h`` empty when not needed;
    with the exact KL ``h`` is packed with its statistics: :func:`_h_buffer`).
    """
    outer, inner = targets.shape
    n_rows = outer * inner
    dtype = stats_dtype(logits3d.dtype)
    dev = logits3d.device
    bonus = hyper[_ENTROPY_COEF] != 0.0
    with_entropy = with_entropy or bonus
    new = lambda on=True: torch.empty((outer, inner) if on else (0,), dtype=dtype, device=dev)
    part = torch.empty((N_COLS, n_rows), dtype=dtype, device=dev)
    g = new()
    if ref is not None and modes[1] == _KL_FULL:
        h = _h_buffer(bonus, True, outer, inner, logits3d, dtype)
    else:
        h = new(bonus)
    mask = _mask_arg(mask)
    if modes[3]:  # GSPO(-token), RLOO, VESPO: layer 1, then the token layer over sequences
        logp, entropy, row_max, log_sum = token_stats_fwd(
            logits3d, targets, temperature, softcap, ignore_index, with_entropy
        )
        _token_layer(
            logp, entropy if with_entropy else None, targets, adv, old, ref, mask, is_w,
            ignore_index, hyper, modes, g, h, part, ent_scale,
        )  # fmt: skip
        if not bonus:
            entropy = new(False)
    else:  # one fused pass: layer 1 with the token layer as epilogue
        row_max, log_sum, entropy = new(), new(), new(bonus)
        _fused_rows(
            logits3d, targets, adv, old, ref, mask, is_w, temperature, softcap, ignore_index,
            hyper, modes, with_entropy, row_max, log_sum, entropy, g, h, part,
            ent_scale=ent_scale,
        )  # fmt: skip
    loss, metrics, seq_scale = _finalize(
        part, outer, inner, dtype, modes[4], max_length, num_items, num_items_t,
        is_w is not None,
    )  # fmt: skip
    return loss, metrics, seq_scale, row_max, log_sum, entropy, g, h


def _fwd_fake(logits3d, targets, adv, old, ref, mask, is_w, num_items_t, ent_scale,
              temperature, softcap, ignore_index, with_entropy, hyper, modes, max_length,
              num_items):  # fmt: skip
    outer, inner = targets.shape
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on=True: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    bonus = hyper[_ENTROPY_COEF] != 0.0
    n_scale = max(outer, 1) if modes[4] == 1 else 1
    return (
        logits3d.new_empty((), dtype=dtype), logits3d.new_empty(N_OUTPUTS, dtype=torch.float32),
        logits3d.new_empty(n_scale, dtype=dtype), new(), new(), new(bonus), new(),
        _h_buffer(bonus, ref is not None and modes[1] == _KL_FULL, outer, inner, logits3d,
                  dtype),
    )  # fmt: skip


def _kl_ref(ref, h, hyper) -> Tensor | None:
    """The reference's logits when the backward reads them: the exact KL (``h`` packed)
    with ``beta != 0``."""
    return ref if h.dim() == 3 and hyper[_BETA] != 0.0 else None


def _fwd_setup(ctx, inputs, output):
    logits3d, targets = inputs[0], inputs[1]
    ctx.temperature, ctx.softcap, ctx.ignore_index = inputs[9], inputs[10], inputs[11]
    ctx.bonus = inputs[13][_ENTROPY_COEF] != 0.0
    _, metrics, seq_scale, row_max, log_sum, entropy, g, h = output
    ref = _kl_ref(inputs[4], h, inputs[13]) if h.dim() == 3 else None  # no frame by default
    ctx.save_for_backward(logits3d, targets, seq_scale, row_max, log_sum, entropy, g, h, ref)
    ctx.mark_non_differentiable(metrics, seq_scale, row_max, log_sum, entropy, g, h)
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, grad_loss, *_unused):
    logits3d, targets, seq_scale, row_max, log_sum, entropy, g, h, ref = ctx.saved_tensors
    grad = None
    if grad_loss is not None:
        kls = None
        if h.dim() == 3:  # packed with the exact KL's statistics (_h_buffer)
            h, kls = (h[0] if ctx.bonus else None), h[1:]
        elif h.numel() == 0:
            h = None
        grad = token_stats_bwd_op(
            logits3d, targets, row_max, log_sum, entropy if h is not None else None, g, h,
            grad_loss, seq_scale, ctx.temperature, ctx.softcap, ctx.ignore_index, ref,
            kls if ref is not None else None,
        )  # fmt: skip
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


policy_loss_fwd_op = FusedOp("policy_loss_fwd", policy_loss_fwd)
policy_loss_fwd_op.register_fake(_fwd_fake)
policy_loss_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)

_policy_loss_fwd = _serialised_when_interpreting(policy_loss_fwd)
_token_stats_bwd_into = _serialised_when_interpreting(token_stats_bwd_into)


def _inplace_backward(ctx, grad_loss, *_unused):
    logits3d = take_for_inplace(ctx)
    targets, seq_scale, row_max, log_sum, entropy, g, h, ref = ctx.saved_tensors
    grad = None
    if grad_loss is not None:
        kls = None
        if h.dim() == 3:  # packed with the exact KL's statistics (_h_buffer)
            h, kls = (h[0] if ctx.bonus else None), h[1:]
        elif h.numel() == 0:
            h = None
        _token_stats_bwd_into(
            logits3d, logits3d, targets, row_max, log_sum, entropy if h is not None else None,
            g, h, grad_loss, seq_scale, ctx.temperature, ctx.softcap, ctx.ignore_index, ref,
            kls if ref is not None else None,
        )  # fmt: skip
        grad = hand_back(logits3d, grad_loss)
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


class PolicyLossInplace(torch.autograd.Function):
    """``policy_loss_fwd_op`` with ``inplace=True`` (eager only; same arguments and outputs):
    the same forward kernels, and the layer-3 backward writes ``dL/dlogits`` into the
    logits buffer and returns it (``_vocab_ops.check_inplace`` / ``hand_back``)."""

    @staticmethod
    def forward(ctx, *args):
        output = _policy_loss_fwd(*args)
        ctx.temperature, ctx.softcap, ctx.ignore_index = args[9], args[10], args[11]
        _, metrics, seq_scale, row_max, log_sum, entropy, g, h = output
        ctx.bonus = args[13][_ENTROPY_COEF] != 0.0
        ref = _kl_ref(args[4], h, args[13]) if h.dim() == 3 else None
        ctx.save_for_backward(args[1], seq_scale, row_max, log_sum, entropy, g, h, ref)
        keep_for_inplace(ctx, args[0])
        ctx.mark_non_differentiable(metrics, seq_scale, row_max, log_sum, entropy, g, h)
        ctx.set_materialize_grads(False)
        return output

    backward = staticmethod(_differentiable_once(_inplace_backward))


# ----------------------------------------------------------------------------- from log-probs


def policy_logprobs_fwd(
    logp: Tensor,
    entropy: Tensor | None,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    mask: Tensor | None,
    is_w: Tensor | None,
    keep: Tensor | None,
    num_items_t: Tensor | None,
    ent_scale: Tensor | None,
    hyper: list[float],
    modes: list[int],
    max_length: int,
    num_items: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The policy loss from ``(B, T)`` log-probs (and entropy), any strides; ``keep``: a
    ``(B, T)`` bool mask on the policy term (top-entropy selection, off-policy mask).

    Returns ``(loss, metrics, seq_scale, g, h)``; ``g``/``h`` are the per-token gradients of
    the loss w.r.t. ``logp``/``entropy`` before ``seq_scale`` and the upstream gradient.
    """
    outer, inner = logp.shape
    dtype = stats_dtype(logp.dtype)
    bonus = hyper[_ENTROPY_COEF] != 0.0
    new = lambda on=True: logp.new_empty((outer, inner) if on else (0,), dtype=dtype)
    part = logp.new_empty((N_COLS, outer * inner), dtype=dtype)
    g, h = new(), new(bonus)
    _token_layer(
        logp, entropy, None, adv, old, ref, _mask_arg(mask), is_w, 0, hyper, modes, g, h, part,
        ent_scale, _mask_arg(keep),
    )  # fmt: skip
    loss, metrics, seq_scale = _finalize(
        part, outer, inner, dtype, modes[4], max_length, num_items, num_items_t,
        is_w is not None,
    )  # fmt: skip
    return loss, metrics, seq_scale, g, h


def _logprobs_fake(logp, entropy, adv, old, ref, mask, is_w, keep, num_items_t, ent_scale,
                   hyper, modes, max_length, num_items):  # fmt: skip
    outer, inner = logp.shape
    dtype = stats_dtype(logp.dtype)
    n_scale = max(outer, 1) if modes[4] == 1 else 1
    return (
        logp.new_empty((), dtype=dtype), logp.new_empty(N_OUTPUTS, dtype=torch.float32),
        logp.new_empty(n_scale, dtype=dtype), logp.new_empty((outer, inner), dtype=dtype),
        logp.new_empty((outer, inner) if hyper[_ENTROPY_COEF] != 0.0 else (0,), dtype=dtype),
    )  # fmt: skip


def _logprobs_setup(ctx, inputs, output):
    logp, entropy, *_ = inputs
    _, metrics, seq_scale, g, h = output
    ctx.save_for_backward(seq_scale, g, h)
    ctx.logp_dtype = logp.dtype
    ctx.entropy_dtype = entropy.dtype if entropy is not None else None
    ctx.mark_non_differentiable(metrics, seq_scale, g, h)
    ctx.set_materialize_grads(False)


def _logprobs_backward(ctx, grad_loss, *_unused):
    seq_scale, g, h = ctx.saved_tensors
    grad_logp = grad_entropy = None
    if grad_loss is not None:
        scale = seq_scale[:, None] * grad_loss  # (B, 1) or (1, 1)
        grad_logp = (g * scale).to(ctx.logp_dtype)
        if ctx.entropy_dtype is not None and h.numel() > 0:
            grad_entropy = (h * scale).to(ctx.entropy_dtype)
    return (grad_logp, grad_entropy) + (None,) * (len(ctx.needs_input_grad) - 2)


policy_logprobs_fwd_op = FusedOp("policy_logprobs_fwd", policy_logprobs_fwd)
policy_logprobs_fwd_op.register_fake(_logprobs_fake)
policy_logprobs_fwd_op.register_autograd(_logprobs_backward, setup_context=_logprobs_setup)


# ----------------------------------------------------------------------------- grad_in_forward
#
# policy_loss(grad_in_forward=True): the loss is one scalar, so its gradient w.r.t. the
# logits is known in the forward up to the upstream factor. The fused kernel (WRITE_GRAD)
# reads each row, runs the token layer, and at once writes the row's gradient, already
# times the aggregation's normaliser (known from the mask alone) and the loss's constant
# factor; the backward only multiplies by the upstream gradient, deciding on the device
# whether there is anything to multiply (scale_rows_unless_one).


def aggregation_scale(
    mask: Tensor | None, targets: Tensor, ignore_index: int, dtype: torch.dtype, agg: int,
    max_length: int, num_items: float, num_items_t: Tensor | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(seq_scale, m)``: the loss aggregation's normaliser (``(B,)`` for
    ``seq-mean-token-mean``, else ``(1,)``) from the mask alone, BEFORE the vocabulary pass,
    and the ``(B, T)`` token weights ``m`` (``mask``'s, 0 where the target is
    ``ignore_index``: the fused kernel's, as ``_policy_inputs.weights_of``) it comes from.

    The normaliser is the finalize kernel's, which produces it for the default backward:
    that kernel run on ``m`` alone (its ``count`` column; its ``loss`` column is left
    unwritten and its loss dropped). The same device code on the same weights as the
    default call's finalize, so the same bits on any device (``_agg.sequence_scale``, the
    fused-linear loss's, rounds ``(1 / s) / B`` where the kernel rounds ``1 / (B s)``).
    Three small launches and the finalize, no host sync."""
    from .kernels.policy.finalize import _policy_finalize_kernel

    outer, inner = targets.shape
    dev = targets.device
    part = torch.empty((2, outer * inner), dtype=dtype, device=dev)  # columns count, loss
    m = part[0].view(outer, inner)  # mask_weights(mask), 0 where ignored: weights_of's
    if mask is None:
        m.copy_(targets != ignore_index)
    else:
        m.copy_(mask.detach())
        if mask.dtype != torch.bool:  # a negative weight is NaN (kernels/common.py as_weight)
            m.masked_fill_(m < 0, float("nan"))
        m.masked_fill_(targets == ignore_index, 0.0)
    loss = torch.empty((), dtype=dtype, device=dev)
    metrics = torch.empty(N_OUTPUTS, dtype=torch.float32, device=dev)
    seq_scale = torch.empty(max(outer, 1) if agg == 1 else 1, dtype=dtype, device=dev)
    _policy_finalize_kernel[(2,)](
        part, loss, metrics, seq_scale, num_items_t if num_items_t is not None else part,
        outer, inner, *(f32_pair(num_items) if num_items > 0 else NO_NUM_ITEMS),
        float(max(outer, 1)), float(max_length), AGG=agg,
        NUM_ITEMS_TENSOR=num_items_t is not None, BLOCK_B=FINALIZE_BLOCK_B,
        BLOCK_T=FINALIZE_BLOCK_T, ACC=triton_acc(dtype), **COMPILE_OPTIONS,
    )  # fmt: skip
    return seq_scale, m


aggregation_scale_launch = _serialised_when_interpreting(aggregation_scale)


def policy_loss_grad_fwd(
    grad: Tensor,
    logits3d: Tensor,
    targets: Tensor,
    adv: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    mask: Tensor | None,
    is_w: Tensor | None,
    num_items_t: Tensor | None,
    ent_scale: Tensor | None,
    seq_scale: Tensor,
    temperature: float,
    softcap: float | None,
    ignore_index: int,
    with_entropy: bool,
    hyper: list[float],
    modes: list[int],
    max_length: int,
    num_items: float,
    loss_scale: float | None,
) -> tuple[Tensor, Tensor]:
    """:func:`policy_loss_fwd` (token-level importance sampling) that also writes
    ``dL/dlogits`` into ``grad`` (the logits' shape and dtype, contiguous rows; may BE
    ``logits3d``) in the same program as each row's forward, times ``seq_scale`` (from
    :func:`aggregation_scale`) and ``loss_scale``; positions that predict no target get
    zeros. Returns ``(loss, metrics)``, the loss times ``loss_scale``. The block layout is
    the default forward's, so the loss, the metrics and (upstream gradient 1) the gradient
    are the default call's bit for bit."""
    outer, inner = targets.shape
    positions = logits3d.shape[1]
    dtype = stats_dtype(logits3d.dtype)
    bonus = hyper[_ENTROPY_COEF] != 0.0
    new = lambda on=True: logits3d.new_empty((outer, inner) if on else (0,), dtype=dtype)
    part = logits3d.new_empty((N_COLS, outer * inner), dtype=dtype)
    row_scale = seq_scale.view(-1, 1).expand(outer, inner)  # strides (1, 0) or (0, 0)
    _fused_rows(
        logits3d, targets, adv, old, ref, _mask_arg(mask), is_w, temperature, softcap,
        ignore_index, hyper, modes, with_entropy or bonus, new(), new(), new(bonus), new(),
        _h_buffer(bonus, ref is not None and modes[1] == _KL_FULL, outer, inner, logits3d,
                  dtype), part, grad, row_scale, ent_scale,
        1.0 if loss_scale is None else loss_scale, read_layout=True,
    )  # fmt: skip
    shift = position_shift(positions, inner)
    if positions > inner:  # the positions that predict no target: zero, as layer 3 writes them
        if shift > 0:
            grad[:, :shift].zero_()
        grad[:, shift + inner :].zero_()
    loss, metrics, _ = _finalize(
        part, outer, inner, dtype, modes[4], max_length, num_items, num_items_t,
        is_w is not None,
    )  # fmt: skip
    return (loss if loss_scale is None else loss * loss_scale), metrics


policy_loss_grad_fwd_launch = _serialised_when_interpreting(policy_loss_grad_fwd)
scale_rows_unless_one_launch = _serialised_when_interpreting(scale_rows_unless_one)

SECOND_BACKWARD = (
    "grad_in_forward=True: the gradient was formed by the forward and handed over by the "
    "first backward; a second backward (retain_graph=True) has none left. Call policy_loss "
    "again, or without grad_in_forward=True"
)


class GradInForward(torch.autograd.Function):
    """A loss whose gradient w.r.t. ``logits`` the forward has formed already
    (``policy_loss(grad_in_forward=True)``): ``run()`` returns ``(loss, grad)`` (``grad``:
    the logits themselves with ``inplace``); the backward returns ``grad`` times the
    upstream gradient, multiplied in place by ``scale(grad, grad_loss)`` (Triton:
    :func:`scale_rows_unless_one`, which does nothing when the upstream gradient is 1).
    Eager only; once per forward."""

    @staticmethod
    def forward(ctx, logits, run, inplace, scale):
        loss, grad = run()
        ctx.formed_grad, ctx.scale, ctx.inplace = grad, scale, inplace
        if inplace:  # the forward wrote into the logits: their version moves on
            torch.autograd.graph.increment_version(logits)
            keep_for_inplace(ctx, logits)
        ctx.set_materialize_grads(False)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad = ctx.__dict__.pop("formed_grad", None)  # handed over once
        if grad is None:
            raise RuntimeError(SECOND_BACKWARD)
        if grad_loss is None:
            return None, None, None, None
        if ctx.inplace:
            take_for_inplace(ctx)  # raises if anything wrote into the logits since
        ctx.scale(grad, grad_loss)
        if ctx.inplace:
            return hand_back(grad, grad_loss), None, None, None
        return differentiable_once(grad, grad_loss), None, None, None
