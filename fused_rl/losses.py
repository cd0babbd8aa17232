"""Policy losses straight from the logits: PPO / GRPO / DAPO / Dr. GRPO / GSPO in one vocab
pass forward and one backward.

On the Triton backend a call is a handful of launches (``fused_rl._policy_ops``):
token-level importance sampling runs ONE vocab-stream kernel with the loss as epilogue, then
one reduction that finishes the loss and every metric; sequence-level importance sampling
(GSPO) needs every token's log-prob before any token's loss, so it runs layer 1, a
token-layer kernel over whole sequences, and the same reduction. The backward is one
vocab-stream kernel. The ``reference`` backend is the same math in plain PyTorch.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import _validation as V
from ._agg import masked_mean_all, poison_empty, token_weights
from ._backend import resolve_backend
from ._launch import stats_dtype
from ._ops import _tracing
from ._policy_inputs import (
    RolloutInputs,
    advantages_2d,
    check_call,
    check_full_kl_route,
    check_ref_logits,
    check_token_tensors,
    counted_mask,
    entropy_scale,
    is_weights_2d,
    not_token_level,
    num_items_args,
    per_row,
    rollout_constants,
    weights_of,
)
from ._policy_ops import (
    AUX_METRIC,
    AUX_SEQ_METRIC,
    GradInForward,
    PolicyLossInplace,
    aggregation_scale_launch,
    metrics_dict,
    policy_logprobs_fwd_op,
    policy_loss_fwd_op,
    policy_loss_grad_fwd_launch,
    scale_rows_unless_one_launch,
)
from ._vocab_ops import check_inplace, check_targets_window, token_stats_nocheck, window
from .distributed import check_layout_keywords, is_dtensor
from .exact_kl import token_kl
from .kernels.modes import IMPORTANCE_SAMPLING, LOSS_AGG_MODES, SURROGATES  # noqa: F401
from .logprobs import token_logprobs
from .policy_config import PolicyConfig, takes_policy_options
from .reference.distill import capped_rows, token_divergences
from .reference.kl import refuse_full
from .reference.policy import policy_token_terms

# ----------------------------------------------------------------------------- helpers


def _masked_max(x: Tensor, mask_f: Tensor) -> Tensor:
    """Max of a non-negative ``x`` over counted tokens; 0 when none (or the batch is empty)."""
    if x.numel() == 0:  # static shape: no sync, traceable
        return x.new_zeros(())
    return torch.where(mask_f != 0, x, torch.zeros_like(x)).amax()


def _sequence_extreme(flags: Tensor, mask_f: Tensor, which) -> Tensor:
    """The min / max over sequences with a counted token of each sequence's weighted mean of
    ``flags`` (TRL's ``clip_ratio/low_min`` / ``high_max``); 0 when none counts. No sync."""
    counted = mask_f != 0
    weighted = torch.where(counted, flags.to(mask_f.dtype) * mask_f, torch.zeros_like(mask_f))
    n = mask_f.sum(-1)
    has = n != 0
    per_seq = weighted.sum(-1) / torch.where(has, n, torch.ones_like(n))
    if per_seq.numel() == 0:  # static shape: no sync, traceable
        return per_seq.new_zeros(()).float()
    fill = float("inf") if which is min else float("-inf")
    ext = torch.where(has, per_seq, fill)
    ext = ext.amin() if which is min else ext.amax()
    return torch.where(ext.abs() == float("inf"), torch.zeros_like(ext), ext).float()


def _sequence_mean(x: Tensor, mask_f: Tensor) -> Tensor:
    """The mean over sequences with a counted token of each sequence's weighted mean of
    ``x`` (every such sequence weighs 1); 0 when none counts. No sync."""
    counted = mask_f != 0
    weighted = torch.where(counted, x.to(mask_f.dtype) * mask_f, torch.zeros_like(mask_f))
    n = mask_f.sum(-1)
    has = n != 0
    per_seq = torch.where(has, weighted.sum(-1) / torch.where(has, n, torch.ones_like(n)), 0.0)
    n_seq = has.sum().to(per_seq.dtype)
    return (per_seq.sum() / torch.where(n_seq != 0, n_seq, torch.ones_like(n_seq))).float()


def _metrics(terms: dict[str, Tensor], mask_f: Tensor, surrogate: str = "ppo") -> dict[str, Tensor]:
    """Masked means over counted tokens, detached fp32 0-dim tensors (no host sync)."""
    with torch.no_grad():
        mean = lambda x: masked_mean_all(x.detach(), mask_f)
        ratio = terms["ratio"].detach().float()
        out = {
            "clip_frac": mean(terms["clipped"]),
            "clip_frac_low": mean(terms["clipped_low"]),
            "clip_frac_high": mean(terms["clipped_high"]),
            "ratio_mean": mean(ratio),
            "ratio_max": _masked_max(ratio, mask_f),
            "approx_kl": mean(terms["neg_log_ratio"]),
            "clip_frac_low_seq_min": _sequence_extreme(terms["clipped_low"], mask_f, min),
            "clip_frac_high_seq_max": _sequence_extreme(terms["clipped_high"], mask_f, max),
            "clip_frac_low_seq_mean": _sequence_mean(terms["clipped_low"], mask_f),
            "clip_frac_high_seq_mean": _sequence_mean(terms["clipped_high"], mask_f),
        }
        aux = AUX_METRIC[SURROGATES.index(surrogate)]
        if aux is not None:
            out[aux] = mean(terms["aux"])
        aux_seq = AUX_SEQ_METRIC[SURROGATES.index(surrogate)]
        if aux_seq is not None:
            out[aux_seq] = _sequence_mean(terms["aux"].detach(), mask_f)
        for name in ("kl", "kl_bias_corrected", "entropy"):
            if name in terms:
                out[name] = mean(terms[name])
    return out


def _is_metrics(is_w: Tensor, mask_f: Tensor) -> dict[str, Tensor]:
    """Min / mean / max of the IS weights over counted tokens (0 with none), no sync."""
    with torch.no_grad():
        w = is_w.detach().to(mask_f.dtype)
        counted = mask_f != 0
        if w.numel() == 0:  # static shape: no sync, traceable
            zero = w.new_zeros(()).float()
            return {"is_weight_mean": zero, "is_weight_min": zero, "is_weight_max": zero}
        any_counted = counted.any()
        low = torch.where(counted, w, float("inf")).amin()
        high = torch.where(counted, w, float("-inf")).amax()
        return {
            "is_weight_mean": masked_mean_all(w, mask_f),
            "is_weight_min": low.where(any_counted, 0.0).float(),
            "is_weight_max": high.where(any_counted, 0.0).float(),
        }  # fmt: skip


def top_entropy_tokens(entropy: Tensor, mask: Tensor | None, *, quantile: float) -> Tensor:
    """``(B, T)`` bool: the counted tokens whose entropy is at or above the
    ``1 - quantile`` quantile of the counted tokens' entropies (TRL's
    ``top_entropy_quantile``: ``torch.quantile``, linear interpolation; no counted token:
    all False). A sort with the uncounted tokens pushed to the end, so no host sync (TRL's
    boolean indexing would sync). Per call: under data parallelism each rank's threshold
    is its own, where TRL gathers the entropies of all ranks first."""
    with torch.no_grad():
        h = entropy.detach().float()
        counted = torch.ones_like(h, dtype=torch.bool) if mask is None else mask.detach() != 0
        if h.numel() == 0:
            return counted
        ordered = torch.where(counted, h, float("inf")).flatten().sort().values
        n = counted.sum()
        pos = (1.0 - quantile) * (n - 1).clamp(min=0).to(torch.float64)
        lo = pos.floor().long()
        hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
        frac = (pos - lo).float()
        # gathers, not ordered[lo]: a tensor index is data-dependent under torch.compile
        below, above = ordered.gather(0, lo.reshape(1)), ordered.gather(0, hi.reshape(1))
        threshold = torch.lerp(below, above, frac)  # as torch.quantile interpolates
        return counted & (h >= threshold) & (n > 0)


def off_policy_sequence_mask(
    logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, mask: Tensor | None, *,
    threshold: float,
) -> Tensor:  # fmt: skip
    """``(B, T)`` bool: the tokens whose policy term DeepSeek-V3.2's off-policy sequence mask
    keeps (TRL's ``off_policy_mask_threshold``): a token with advantage ``>= 0``, and every
    token of a sequence whose mean ``rollout_logprobs - logprobs`` (``logprobs`` the current
    policy's, detached; over the counted tokens, weighted by ``mask``; a NaN term counts 0,
    as TRL's ``nan_to_num``) is at most ``threshold``. ``advantages`` ``(B, T)``. No host
    sync."""
    with torch.no_grad():
        acc = stats_dtype(logprobs.dtype)
        d = torch.nan_to_num(rollout_logprobs.detach().to(acc) - logprobs.detach().to(acc), nan=0.0)
        m = weights_of(mask, d, acc)
        n = m.sum(-1, keepdim=True)
        mean = torch.where(m != 0, m * d, 0.0).sum(-1, keepdim=True) / torch.where(n > 0, n, 1.0)
        return (advantages.detach() >= 0) | (mean <= threshold)


def _policy_term_keep(
    policy: PolicyConfig, logprobs: Tensor, entropy: Tensor | None, adv2d: Tensor,
    old_logprobs: Tensor | None, rollout_logprobs: Tensor | None, mask: Tensor | None,
) -> tuple[Tensor | None, dict[str, Tensor]]:  # fmt: skip
    """The ``(B, T)`` bool mask of the tokens whose policy term stays (the top-entropy
    selection and / or the off-policy sequence mask; None: every token) and the metric of
    the latter (``off_policy_masked_frac``)."""
    keep, metrics = None, {}
    if policy.top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy tensor")
        keep = top_entropy_tokens(entropy, mask, quantile=policy.top_entropy_quantile)
    if policy.off_policy_mask_threshold is not None:
        sampled = rollout_logprobs if rollout_logprobs is not None else old_logprobs
        off = off_policy_sequence_mask(
            logprobs, logprobs if sampled is None else sampled, adv2d, mask,
            threshold=policy.off_policy_mask_threshold,
        )  # fmt: skip
        m = weights_of(mask, off, torch.float32)
        metrics["off_policy_masked_frac"] = masked_mean_all((~off).float(), m)
        keep = off if keep is None else keep & off
    return keep, metrics


def _logits_rank_message(logits: Tensor) -> str:
    """What ``policy_loss`` says about logits that are not 3-D (packed ``(N, V)`` ones get a
    way out)."""
    msg = (
        f"logits must be (B, T, V), or the model's (B, S, V) buffer with S > T, got shape "
        f"{tuple(logits.shape)}"
    )
    if logits.dim() == 2:
        msg += (
            ". For packed (N, V) logits either take logp = fused_rl.token_logprobs(logits, "
            "targets) and call fused_rl.policy_loss_from_logprobs(logp.unsqueeze(0), ...), or "
            "pass logits.unsqueeze(0) with (1, N) targets (and (1,) or (1, N) advantages, "
            "(1, N) mask and log-probs): exact for loss_agg='token-mean', while the seq-mean "
            "modes and importance_sampling='sequence' would treat the pack as one sequence"
        )
    return msg


def _loss_from_logprobs(logp, entropy, adv2d, mask_f, weights, num_items, rollout_is, policy,
                        **tensors):  # fmt: skip
    """The reference path's loss and metrics from per-token log-probs (``tensors``:
    ``old_logp``, ``ref_logp``, ``is_weights``, ``full_kl``, ``keep`` for
    :func:`policy_token_terms`)."""
    ent = entropy_scale(mask_f, policy, num_items)
    terms = policy_token_terms(logp, adv2d, mask_f, entropy=entropy, config=policy,
                               entropy_scale=ent, **tensors)  # fmt: skip
    loss = (terms["loss"] * weights).where(weights != 0, torch.zeros_like(weights)).sum()
    metrics = _metrics(terms, mask_f, policy.surrogate)
    if rollout_is is not None:
        metrics.update(_is_metrics(rollout_is, mask_f))
    per_count = num_items if policy.loss_agg == "token-mean" else None  # no other mode reads it
    return poison_empty(loss, per_count, weights.numel()), metrics


# ----------------------------------------------------------------------------- public API


@V.deprecated_keyword("kl", "kl_estimator")
@takes_policy_options
def policy_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    ref_logits: Tensor | None = None,
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
    inplace: bool = False,
    grad_in_forward: bool = False,
    loss_scale: float | None = None,
    policy: PolicyConfig,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO clipped-surrogate loss from the policy logits, fused over the vocabulary.

    Per token, with ``logp = log_softmax(logits / T)[target]`` and
    ``r = exp(logp - old_logprobs)``:
    ``L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta kl(logp, ref) - entropy_coef H``,
    aggregated over counted tokens by ``loss_agg``.

    Args:
        logits: ``(B, T, V)``, or the model's whole ``(B, S, V)`` buffer with ``S > T``
            (positions ``S - T - 1 ... S - 2`` predict the targets; the backward writes the
            buffer's gradient itself, zero elsewhere); fp32/bf16/fp16, any strides. A slice
            such as ``logits[:, :-1]`` is read in place, but autograd's slice backward then
            costs a second full-size gradient buffer and a copy: pass the buffer.
        targets: ``(B, T)`` int64/int32, any strides; ``ignore_index`` tokens never count.
        advantages: ``(B,)`` one per sequence (GRPO) or ``(B, T)`` per token (PPO).
        old_logprobs: ``(B, T)`` log-probs of the sampling policy; None = on-policy
            (``old = logp.detach()``: ratio 1, gradient = the policy gradient).
        rollout_logprobs: ``(B, T)`` log-probs of the rollout engine that sampled the
            tokens (vLLM's; TRL's ``sampling_per_token_logps``), read only by the off-policy
            sequence mask (``off_policy_mask_threshold``); None: ``old_logprobs``.
        ref_logprobs: ``(B, T)`` reference-policy log-probs (KL penalty / metric).
            ``advantages``, ``old_logprobs``, ``rollout_logprobs``, ``ref_logprobs`` and
            ``mask`` are rollout constants: no gradient reaches them, on every backend.
        ref_logits: the reference model's logits ``(B, S_r, V)`` (``S_r >= T``, the last
            ``T + 1`` positions used as for ``logits``; the same vocabulary; any float
            dtype and strides), for ``kl_estimator="full"``: the exact per-token
            ``KL(pi || pi_ref) = sum_v p_v (log p_v - log q_v)`` over the whole vocabulary,
            both softmaxes at ``temperature``, streamed in the same pass that reads
            ``logits`` (one more read of the reference's row; never written, no
            gradient), its gradient ``beta p_v (log p_v - log q_v - KL)`` in the same
            backward (one more read of the row). Where the loss is composed (GSPO / VESPO,
            the top-entropy selection, vocabulary parallelism with ``ref_logits`` sharded
            as ``logits``) the KL is :func:`fused_rl.token_kl`'s, added with the
            aggregation's token weights (there without ``kl_bias_correction`` or
            ``inplace``). ``softcap`` caps both models' logits alike.
        mask: ``(B, T)`` bool, integer or float; None = every token counts. A bool mask
            selects tokens (True counts). A float (or integer) mask is a per-token weight
            ``m_t >= 0``: ``token-mean`` gives ``sum_t m_t L_t / sum_t m_t``, every other
            ``loss_agg`` mode and every metric weighs token ``t`` by ``m_t`` the same way (GSPO's
            sequence log-ratio is the ``m``-weighted mean, ``sequence-sum``'s the
            ``m``-weighted sum), and ``m_t = 0`` drops the token
            (a 0/1 mask is a padding mask). A negative weight raises ``ValueError`` in eager
            mode (one host sync, with the target check below); unchecked (``torch.compile``,
            ``fused_rl.config.check_values = False``) it makes the loss NaN.
        temperature: logits are divided by it.
        softcap: Gemma-style logit soft-capping (a finite ``c > 0``; None = none):
            ``logp = log_softmax(c tanh(logits / c) / T)[target]``, the cap before the
            temperature, its gradient included (as :func:`fused_rl.token_logprobs`).
        with_entropy: report the mean entropy as a metric even when ``entropy_coef == 0``.
        is_weights: rollout (behaviour-policy, e.g. vLLM) importance-sampling weights,
            ``(B, T)``, ``(B, 1)`` or ``(B,)`` constants (see
            :func:`fused_rl.rollout_is_weights`): they multiply the per-token policy term
            only, before the KL is added, as verl, TRL and Liger do. Adds the metrics
            ``is_weight_mean`` / ``_min`` / ``_max`` over counted tokens.
        num_items: replaces the token count of ``token-mean`` (global count across
            micro-batches / ranks, e.g. ``fused_rl.distributed.global_token_count(mask)``).
            A tensor value is not checked (no host sync).
        process_group: vocabulary (tensor) parallelism: each rank's ``logits`` hold the
            equal slice ``[r V_local, (r + 1) V_local)`` of the vocabulary, ``targets`` are
            global ids; a ``DTensor`` placed ``Shard(-1)`` needs none. Every rank gets the
            unsharded loss and metrics, and its shard of the gradient: the vocab-parallel
            :func:`fused_rl.token_logprobs` (two all-reduces, 12 or 16 bytes per token)
            feeding :func:`policy_loss_from_logprobs` (``fused_rl.distributed``).
        vocab_start, vocab_size: the layout, with ``process_group``, as for
            :func:`fused_rl.token_logprobs`: ``vocab_size`` alone a padded vocabulary
            (Megatron's; the padding columns never read, their gradient 0), both ragged
            shards; ``ref_logits`` sharded alike.
        inplace: the backward writes the gradient w.r.t. ``logits`` INTO ``logits`` and
            hands that buffer on as the gradient (Liger's ``inplace=True``): the loss step
            allocates no ``(N, V)`` gradient (with the model's whole ``(B, S, V)`` buffer,
            zero at the positions that predict no target). Same kernels, same values and
            gradients as the default, bit for bit; on the reference backend the gradient
            is computed apart and copied in. **The logits' values are destroyed by the
            backward**: nothing may read them afterwards, and they must feed no other op
            whose backward reads them (a second loss or metric on the same logits with
            grad); an op that saved them for its backward raises autograd's "modified by an
            inplace operation" when its backward runs after this one (the write advances
            their version). A leaf's ``.grad`` then shares the logits' memory. Raises
            ``ValueError`` (naming ``inplace`` and ``logits``) when the logits do not
            require grad, or are a view the kernel cannot write whole (vocabulary stride
            not 1, overlapping elements; a slice such as ``logits[:, :-1]`` is fine, the
            kernel writes exactly the rows it reads, but autograd's slice backward then
            allocates the full-size gradient anyway: pass the buffer), ``RuntimeError``
            when they were modified between the forward and the backward, and under
            ``torch.compile`` (eager only; without ``fullgraph`` the call graph-breaks and
            runs eagerly); ``NotImplementedError`` with ``process_group`` or DTensor
            logits.
        grad_in_forward: two passes over the logits instead of three. The loss is one
            scalar, so its gradient w.r.t. the logits is known in the forward up to the
            upstream factor: the forward's one kernel reads each row, runs the token layer
            and at once writes the row's gradient (already times its token's
            ``loss_agg`` weight, computed from the mask before the pass, and
            ``loss_scale``) into a new buffer, or into the logits with ``inplace=True``;
            the backward only multiplies it by the upstream gradient, deciding ON THE
            DEVICE (one small launch, no host sync) to do nothing when that is exactly 1.
            HBM bytes of the logits stream, ``e`` bytes an element: ``2·N·V·e`` (one read,
            its re-read served from L2 right after, one write) where the default moves
            ``3·N·V·e`` (read forward; read and write backward). With an upstream gradient
            of 1 the loss, metrics and gradient are the default call's bit for bit; with
            another the gradient is rounded twice (to the logits' dtype, then times the
            factor), where the default rounds once: about one unit in the last place
            (RMS within 2 eps of the dtype, each element within 4 eps of its row's
            largest). The logits are
            not needed by the backward (without ``inplace`` the caller may drop them after
            the forward), but the gradient is held from the forward on. Needs every token's
            gradient from its own row (``PolicyConfig.token_level``): with
            ``importance_sampling`` other than ``"token"``, ``surrogate="vespo"``
            or ``top_entropy_quantile < 1`` it raises ``ValueError`` naming the option.
            Without a gradient to form (``no_grad``, logits that do not require grad) it is
            the ordinary forward. One backward per forward (a second one, with
            ``retain_graph=True``, raises); eager only (raises under ``torch.compile``);
            ``NotImplementedError`` with ``process_group`` or DTensor logits. (The name
            says when the gradient is formed, as the fused-linear losses of Liger and
            fused_rl form theirs; peers call the same trick "gradient in forward".)
        loss_scale: a real constant multiplying the loss and its gradient (the loss is
            ``loss_scale`` times the aggregated loss; the metrics are not scaled):
            ``loss_scale=1 / k`` then ``loss.backward()`` is gradient accumulation over
            ``k`` micro-batches, ``(loss / k).backward()``, while the upstream gradient
            stays 1 so ``grad_in_forward`` keeps its two passes. Without
            ``grad_in_forward`` it multiplies the returned loss (the backward then scales
            as for any upstream factor).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.
        eps_low, eps_high, dual_clip, delta, beta, kl_estimator, entropy_coef,
            importance_sampling, surrogate, sapo_tau_*, vespo_*, kl_bias_correction,
            top_entropy_quantile, off_policy_mask_threshold, loss_agg, max_length,
            log_ratio_clamp, entropy_agg: the policy options,
            documented once on :class:`fused_rl.PolicyConfig` (checked before any work);
            or ``policy_config=`` a whole :class:`fused_rl.PolicyConfig`.

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-dim fp32 tensor, differentiable w.r.t. ``logits``;
        ``metrics`` detached fp32 0-dim tensors, masked means over counted tokens:
        ``clip_frac`` (clipped branch strictly chosen), ``clip_frac_low``,
        ``clip_frac_high`` (and over sequences, ``clip_frac_low_seq_min`` /
        ``clip_frac_high_seq_max``: the min / max of a sequence's share of such tokens,
        TRL's ``clip_ratio/low_min`` / ``high_max``; ``clip_frac_low_seq_mean`` /
        ``clip_frac_high_seq_mean``: their mean, each such sequence weighing 1; 0 when no
        sequence counts),
        ``dual_clip_frac``, ``ratio_mean``, ``ratio_max``,
        ``approx_kl`` (``mean(old - logp)``), ``kl`` (when ``ref_logprobs`` is given;
        with ``kl_bias_correction`` also ``kl_bias_corrected``, the mean of ``kl * r``),
        ``entropy`` (when computed); per surrogate ``dual_clip_frac`` (ppo),
        ``cispo_clip_frac`` (cispo: ``r > 1 + eps_high`` where ``A > 0``, TRL's and Liger's
        ``clip_ratio``; ``clip_frac`` is then verl's two-sided ``r`` outside the band),
        ``sapo_gate_mean`` (sapo), ``vespo_phi_mean`` (vespo: token-weighted) and
        ``vespo_phi_seq_mean`` (each sequence with a counted token weighs 1, TRL's
        ``vespo/phi_seq_mean``); ``is_weight_*`` with ``is_weights``;
        ``off_policy_masked_frac`` with ``off_policy_mask_threshold`` (the counted tokens
        whose policy term the mask dropped). The
        computation never syncs with the host; in eager mode the check that targets lie in
        ``[0, V)`` syncs once, and the one that a float / integer ``mask`` holds no negative
        weight once more (switch both off with ``fused_rl.config.check_values = False``;
        under ``torch.compile`` they never run).

    Example:
        >>> import torch, fused_rl
        >>> logits = torch.randn(2, 6, 50, requires_grad=True)
        >>> targets = torch.randint(0, 50, (2, 6))
        >>> old = torch.randn(2, 6) - 4.0
        >>> loss, metrics = fused_rl.policy_loss(
        ...     logits, targets, torch.tensor([1.0, -1.0]), old_logprobs=old, eps_high=0.28)
        >>> loss.backward()
        >>> sorted(metrics)[:3]
        ['approx_kl', 'clip_frac', 'clip_frac_high']
    """
    V.check_float(logits, "logits")
    if logits.dim() != 3:
        raise ValueError(_logits_rank_message(logits))
    # a vocabulary shard may hold no column (a bad layout: the first collective's error)
    V.check_logits(logits, empty_ok=process_group is not None)
    check_targets_window(targets, logits)
    V.check_positive(temperature, "temperature")
    if softcap is not None:  # no call without a cap: a frame costs host time on every step
        V.check_positive(softcap, "softcap")
        softcap = float(softcap)
    batch, length = targets.shape
    adv2d = advantages_2d(advantages, batch, length)
    check_token_tensors(
        batch, length, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs, mask=mask,
    )  # fmt: skip
    V.check_same_device(
        logits=logits, advantages=advantages, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, mask=mask,
        is_weights=is_weights,
    )  # fmt: skip
    check_call(policy, ref_logprobs, num_items, ref_logits, rollout_logprobs=rollout_logprobs)
    layout = {}
    if vocab_start is not None or vocab_size is not None:
        if not is_dtensor(logits):  # (a DTensor's layout: its own error)
            check_layout_keywords(process_group, vocab_start, vocab_size)
        layout = dict(vocab_start=vocab_start, vocab_size=vocab_size)
    if ref_logits is not None:
        check_ref_logits(ref_logits, logits, length, "logits")
        check_full_kl_route(policy, process_group is not None or is_dtensor(logits))
        ref_logits = ref_logits.detach()  # a constant, as ref_logprobs
    need_entropy = with_entropy or policy.uses_entropy
    if inplace is not False:
        if process_group is not None or is_dtensor(logits):
            raise NotImplementedError(
                "inplace=True is not implemented for vocabulary-parallel logits "
                "(process_group= or DTensor logits): call without it"
            )
        check_inplace(logits, "policy_loss", inplace)
    inputs = RolloutInputs(
        advantages=advantages, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs, mask=mask, is_weights=is_weights, num_items=num_items,
    )  # fmt: skip
    if grad_in_forward is not False or loss_scale is not None:
        return _formed_in_forward(
            logits, targets, inputs, ref_logits=ref_logits, temperature=temperature,
            softcap=softcap, with_entropy=with_entropy, ignore_index=ignore_index,
            process_group=process_group, layout=layout, inplace=inplace,
            grad_in_forward=grad_in_forward, loss_scale=loss_scale, need_entropy=need_entropy,
            policy=policy, backend=backend,
        )  # fmt: skip
    # by composition (log-probs and entropy first, then the token layer): vocabulary-sharded
    # logits, the top-entropy selection and the off-policy mask, which need every token's
    # entropy / log-prob, and the exact KL beside a loss that is not token-level (GSPO, VESPO)
    if (
        process_group is not None
        or is_dtensor(logits)
        or policy.selects_tokens
        or (ref_logits is not None and not policy.token_level)
    ):
        return _composed_policy_loss(
            logits, targets, inputs, temperature=temperature, softcap=softcap,
            ignore_index=ignore_index, need_entropy=need_entropy, process_group=process_group,
            policy=policy, backend=backend, inplace=inplace, ref_logits=ref_logits,
            layout=layout,
        )  # fmt: skip
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    V.check_mask_weights(mask, "mask")
    which = resolve_backend(backend, logits, targets)
    is_w = is_weights_2d(is_weights, batch, length)

    if which == "triton":
        n_items, n_items_t = num_items_args(num_items, logits.device)
        ent = None
        if policy.entropy_agg is not None and policy.entropy_coef != 0.0:
            m = weights_of(mask, targets, stats_dtype(logits.dtype), targets, ignore_index)
            ent = per_row(entropy_scale(m, policy, num_items), (batch, length))
        op = PolicyLossInplace.apply if inplace else policy_loss_fwd_op
        loss, metrics, *_ = op(
            logits, targets, adv2d, old_logprobs,
            ref_logprobs if ref_logits is None else ref_logits, mask, is_w, n_items_t, ent,
            float(temperature), softcap, int(ignore_index), bool(need_entropy),
            policy.kernel_params, policy.kernel_modes, policy.max_length or length,
            n_items,
        )  # fmt: skip
        has_kl = ref_logprobs is not None or ref_logits is not None
        out = metrics_dict(metrics, has_kl=has_kl, has_entropy=need_entropy,
                           surrogate=SURROGATES.index(policy.surrogate),
                           has_is=is_w is not None,
                           bias_kl=policy.kl_bias_correction)  # fmt: skip
        return loss, out

    acc = stats_dtype(logits.dtype)
    adv2d, old_logprobs, ref_logprobs = rollout_constants(acc, adv2d, old_logprobs, ref_logprobs)
    mask_f = weights_of(mask, targets, acc, targets, ignore_index)
    weights = token_weights(mask_f, policy.loss_agg, max_length=policy.max_length,
                            num_items=num_items, dtype=acc)  # fmt: skip
    if length != logits.shape[1] and not inplace:  # inplace: windowed inside, after the copy
        logits = window(logits, length)
    full_kl = None
    if ref_logits is not None:
        if inplace:
            raise NotImplementedError(
                "inplace=True with kl_estimator='full' runs on the Triton backend only"
            )
        x, r = window(logits, length), window(ref_logits, length)
        counted = mask_f != 0  # both models' logits capped before the temperature
        x, r = capped_rows(x, counted, softcap), capped_rows(r, counted, softcap)
        full_kl = token_divergences(
            x, r, beta=1.0, temperature=float(temperature), counted=mask_f != 0
        )["d"]
    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, ignore_index, need_entropy, which, softcap, inplace
    )
    return _loss_from_logprobs(
        logp, entropy, adv2d, mask_f, weights, num_items, is_w, policy, old_logp=old_logprobs,
        ref_logp=ref_logprobs, is_weights=None if is_w is None else is_w.detach().to(acc),
        full_kl=full_kl,
    )  # fmt: skip


def _formed_in_forward(
    logits, targets, inputs: RolloutInputs, *, ref_logits, temperature, softcap, with_entropy,
    ignore_index, process_group, layout, inplace, grad_in_forward, loss_scale, need_entropy,
    policy: PolicyConfig, backend,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`policy_loss` with ``grad_in_forward`` and / or ``loss_scale`` (checked here):
    the two-pass path (:class:`fused_rl._policy_ops.GradInForward`), or the ordinary call
    times ``loss_scale``."""
    if not isinstance(grad_in_forward, bool):
        raise TypeError(f"grad_in_forward must be a bool, got {grad_in_forward!r}")
    if loss_scale is not None:
        if isinstance(loss_scale, Tensor):
            raise TypeError(
                "loss_scale must be a Python number (a tensor would be read on the host); "
                "for a tensor factor multiply the loss: (loss * factor).backward()"
            )
        V.check_number(loss_scale, "loss_scale")  # finite
        loss_scale = float(loss_scale)
    if grad_in_forward:
        if process_group is not None or is_dtensor(logits):
            raise NotImplementedError(
                "grad_in_forward=True is not implemented for vocabulary-parallel logits "
                "(process_group= or DTensor logits): call without it"
            )
        option = not_token_level(policy)
        if option is not None:
            raise ValueError(
                f"grad_in_forward=True forms each token's gradient from its own logits row "
                f"in the forward, but {option} is needed before any token's gradient is "
                "known: call without grad_in_forward=True (the default path runs it)"
            )
        if torch.compiler.is_compiling() or _tracing():
            raise RuntimeError(
                "policy_loss(grad_in_forward=True) is eager-only: its backward decides on the "
                "device whether to scale the gradient formed in the forward, a mutation a "
                "traced graph cannot hold. Call without grad_in_forward=True inside a "
                "compiled region"
            )
    advantages, mask = inputs.advantages, inputs.mask
    options = dict(ref_logits=ref_logits, temperature=temperature, softcap=softcap,
                   with_entropy=with_entropy, ignore_index=ignore_index,
                   policy_config=policy)  # fmt: skip
    if not (grad_in_forward and torch.is_grad_enabled() and logits.requires_grad):
        loss, metrics = policy_loss(
            logits, targets, advantages, process_group=process_group, inplace=inplace, **layout,
            backend=backend, **inputs.keywords(), **options,
        )  # fmt: skip
        return (loss if loss_scale is None else loss * loss_scale), metrics
    V.check_target_range(targets, logits.shape[-1], ignore_index, "targets")
    V.check_mask_weights(mask, "mask")
    which = resolve_backend(backend, logits, targets)
    found: dict[str, object] = {}

    if which == "reference":  # autograd's gradient, formed in the forward

        def run():
            x = logits.detach().requires_grad_()
            with torch.enable_grad():
                loss, found["metrics"] = policy_loss(
                    x, targets, advantages, backend="reference", **inputs.keywords(), **options
                )
                up = None if loss_scale is None else torch.full_like(loss, loss_scale)
                (grad,) = torch.autograd.grad(loss, x, up)
            if inplace:
                logits.detach().copy_(grad)
                grad = logits
            loss = loss.detach()
            return (loss if loss_scale is None else loss * loss_scale), grad

        loss = GradInForward.apply(logits, run, bool(inplace), _scale_in_place)
        return loss, found["metrics"]

    batch, length = targets.shape
    adv2d = advantages_2d(advantages, batch, length)
    is_w = is_weights_2d(inputs.is_weights, batch, length)
    num_items = inputs.num_items
    n_items, n_items_t = num_items_args(num_items, logits.device)
    max_length = policy.max_length or length
    seq_scale, m = aggregation_scale_launch(
        mask, targets, int(ignore_index), stats_dtype(logits.dtype), policy.kernel_modes[4],
        max_length, n_items, n_items_t,
    )  # fmt: skip
    ent = None
    if policy.entropy_agg is not None and policy.entropy_coef != 0.0:
        ent = per_row(entropy_scale(m, policy, num_items), (batch, length))

    def run():
        grad = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype,
                                                  device=logits.device)  # fmt: skip
        loss, found["metrics"] = policy_loss_grad_fwd_launch(
            grad, logits, targets, adv2d, inputs.old_logprobs,
            inputs.ref_logprobs if ref_logits is None else ref_logits, mask, is_w, n_items_t,
            ent, seq_scale, float(temperature), softcap, int(ignore_index), bool(need_entropy),
            policy.kernel_params, policy.kernel_modes, max_length, n_items, loss_scale,
        )  # fmt: skip
        return loss, grad

    loss = GradInForward.apply(logits, run, bool(inplace), scale_rows_unless_one_launch)
    has_kl = inputs.ref_logprobs is not None or ref_logits is not None
    out = metrics_dict(found["metrics"], has_kl=has_kl,
                       has_entropy=need_entropy, surrogate=SURROGATES.index(policy.surrogate),
                       has_is=is_w is not None, bias_kl=policy.kl_bias_correction)  # fmt: skip
    return loss, out


def _scale_in_place(grad: Tensor, factor: Tensor) -> None:
    """The reference backward of ``grad_in_forward``: ``grad *= factor`` (exact for 1)."""
    with torch.no_grad():
        grad.detach().mul_(factor)


@V.deprecated_keyword("kl", "kl_estimator")
@takes_policy_options
def policy_loss_from_logprobs(
    logprobs: Tensor,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    entropy: Tensor | None = None,
    is_weights: Tensor | None = None,
    num_items: int | float | Tensor | None = None,
    policy: PolicyConfig,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss` for callers that already hold per-token ``logprobs`` ``(B, T)``
    (and optionally ``entropy`` ``(B, T)``) as tensors with grad.

    Same arguments and outputs minus the vocabulary ones; ``mask`` likewise: ``(B, T)``
    bool (True counts) or float / integer per-token weights ``m_t >= 0`` (``token-mean`` is
    ``sum_t m_t L_t / sum_t m_t``; a negative weight raises ``ValueError`` in eager mode with
    ``fused_rl.config.check_values`` on, else makes the loss NaN). Packed ``(N,)``
    log-probs go in as ``logprobs.unsqueeze(0)``. The vocabulary work happened where
    ``logprobs`` came from, e.g. :func:`fused_rl.token_logprobs`; on the Triton backend this
    is one token-layer kernel and one reduction (the loss and every metric), and the backward
    two elementwise ops.

    Example:
        >>> import torch, fused_rl
        >>> logp = (torch.randn(2, 5) - 3).requires_grad_()
        >>> loss, m = fused_rl.policy_loss_from_logprobs(logp, torch.tensor([0.5, -0.5]))
        >>> loss.backward()
    """
    V.check_float(logprobs, "logprobs")
    if logprobs.dim() != 2:
        hint = ""
        if logprobs.dim() == 1:
            hint = (
                "; for packed (N,) log-probs pass logprobs.unsqueeze(0) with (1,) or (1, N) "
                "advantages and (1, N) per-token inputs (exact for loss_agg='token-mean')"
            )
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}{hint}")
    batch, length = logprobs.shape
    adv2d = advantages_2d(advantages, batch, length)
    check_token_tensors(
        batch, length, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs,
        ref_logprobs=ref_logprobs, mask=mask, entropy=entropy,
    )  # fmt: skip
    V.check_same_device(
        logprobs=logprobs, advantages=advantages, old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, mask=mask,
        entropy=entropy, is_weights=is_weights,
    )  # fmt: skip
    refuse_full(policy.kl_estimator, "computable from per-token log-probs")
    check_call(policy, ref_logprobs, num_items, rollout_logprobs=rollout_logprobs)
    if policy.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy tensor")
    V.check_mask_weights(mask, "mask")
    which = resolve_backend(backend, logprobs)
    is_w = is_weights_2d(is_weights, batch, length)
    keep, keep_metrics = _policy_term_keep(
        policy, logprobs, entropy, adv2d, old_logprobs, rollout_logprobs, mask
    )
    if which == "triton":
        n_items, n_items_t = num_items_args(num_items, logprobs.device)
        ent = None
        if policy.entropy_agg is not None and policy.entropy_coef != 0.0:
            m = weights_of(mask, logprobs, stats_dtype(logprobs.dtype))
            ent = per_row(entropy_scale(m, policy, num_items), (batch, length))
        loss, metrics, *_ = policy_logprobs_fwd_op(
            logprobs, entropy, adv2d, old_logprobs, ref_logprobs, mask, is_w, keep, n_items_t,
            ent, policy.kernel_params, policy.kernel_modes, policy.max_length or length,
            n_items,
        )  # fmt: skip
        out = metrics_dict(metrics, has_kl=ref_logprobs is not None,
                           has_entropy=entropy is not None,
                           surrogate=SURROGATES.index(policy.surrogate),
                           has_is=is_w is not None,
                           bias_kl=policy.kl_bias_correction)  # fmt: skip
        return loss, {**out, **keep_metrics}
    acc = stats_dtype(logprobs.dtype)
    adv2d, old_logprobs, ref_logprobs = rollout_constants(acc, adv2d, old_logprobs, ref_logprobs)
    entropy = None if entropy is None else entropy.to(acc)  # as the kernel reads it; keeps grad
    mask_f = weights_of(mask, logprobs, acc)
    weights = token_weights(mask_f, policy.loss_agg, max_length=policy.max_length,
                            num_items=num_items, dtype=acc)  # fmt: skip
    loss, out = _loss_from_logprobs(
        logprobs, entropy, adv2d, mask_f, weights, num_items, is_w, policy,
        old_logp=old_logprobs, ref_logp=ref_logprobs,
        is_weights=None if is_w is None else is_w.detach().to(acc), keep=keep,
    )  # fmt: skip
    return loss, {**out, **keep_metrics}


def _composed_policy_loss(
    logits: Tensor, targets: Tensor, inputs: RolloutInputs, *, temperature, softcap,
    ignore_index, need_entropy: bool, process_group, layout: dict, backend: str,
    inplace: bool = False, ref_logits=None, policy: PolicyConfig,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`fused_rl.policy_loss` by composition: :func:`fused_rl.token_logprobs` (with
    the entropy when the loss or the metrics need it; vocab-parallel with ``process_group``
    (``layout``: its ``vocab_start`` / ``vocab_size`` keywords) or a ``DTensor``), then
    :func:`loss_from_token_stats`. Runs for vocabulary-sharded logits (every rank computes
    the same loss and metrics; the logits' gradient is each rank's shard, no collective
    backward) and for the top-entropy selection and the off-policy mask (they need every
    token's entropy / log-prob). With ``ref_logits`` (``kl_estimator="full"``) the exact KL
    comes from :func:`fused_rl.token_kl` (vocab-parallel alike) and is added to the loss
    with the aggregation's token weights."""
    kl = None
    if ref_logits is not None:
        if inplace:  # token_kl's backward reads the logits that inplace=True overwrites
            raise NotImplementedError(
                "inplace=True with kl_estimator='full' runs on the fused token-level pass "
                "only (not GSPO / VESPO / the top-entropy selection / the off-policy mask)"
            )
        kl = _exact_kl(logits, ref_logits, targets, inputs.mask, temperature, softcap,
                       ignore_index, process_group, backend, layout)  # fmt: skip
    out = token_logprobs(
        logits, targets, temperature=temperature, softcap=softcap, ignore_index=ignore_index,
        return_entropy=need_entropy, process_group=process_group, inplace=inplace,
        backend=backend, **layout,
    )  # fmt: skip
    logp, entropy = out if need_entropy else (out, None)
    if kl is None:
        return loss_from_token_stats(logp, entropy, targets, inputs, ignore_index=ignore_index,
                                     policy=policy, backend=backend)  # fmt: skip
    return loss_with_exact_kl(logp, entropy, kl, targets, inputs, ignore_index=ignore_index,
                              policy=policy, backend=backend)  # fmt: skip


def loss_with_exact_kl(
    logp: Tensor, entropy: Tensor | None, kl: Tensor, targets: Tensor, inputs: RolloutInputs,
    *, policy: PolicyConfig, ignore_index: int, backend: str,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """:func:`loss_from_token_stats` without the config's KL, plus ``beta * sum_t w_t KL_t``
    with the aggregation's token weights ``w`` and the exact per-token ``kl`` ``(B, T)``
    (the ``kl`` metric its masked mean): the composed ``kl_estimator="full"`` of
    :func:`fused_rl.policy_loss` and :func:`fused_rl.linear_policy_loss`."""
    loss, metrics = loss_from_token_stats(
        logp, entropy, targets, inputs, ignore_index=ignore_index, backend=backend,
        policy=dataclasses.replace(policy, beta=0.0, kl_estimator="k3"),
    )  # fmt: skip
    if is_dtensor(targets):
        targets = targets.to_local()
    m = weights_of(inputs.mask, kl, kl.dtype, targets, ignore_index)
    if policy.beta != 0.0:
        w = token_weights(m, policy.loss_agg, max_length=policy.max_length,
                          num_items=inputs.num_items, dtype=kl.dtype)  # fmt: skip
        loss = loss + policy.beta * torch.where(w != 0, w * kl, 0.0).sum().to(loss.dtype)
    metrics["kl"] = masked_mean_all(kl.detach(), m)
    return loss, metrics


def _exact_kl(logits, ref_logits, targets, mask, temperature, softcap, ignore_index,
              process_group, backend, layout) -> Tensor:  # fmt: skip
    """``(B, T)`` exact KL of the positions that predict ``targets``, 0 where nothing counts."""
    length = targets.shape[-1]
    local_targets = targets.to_local() if is_dtensor(targets) else targets
    counted = counted_mask(mask, local_targets, ignore_index)
    if counted.dtype != torch.bool:
        counted = counted != 0
    x = logits if logits.shape[1] == length else window(logits, length)
    r = ref_logits if ref_logits.shape[1] == length else window(ref_logits, length)
    return token_kl(x, r, temperature=temperature, softcap=softcap, mask=counted,
                    process_group=process_group, backend=backend, **layout)  # fmt: skip


def loss_from_token_stats(
    logp: Tensor, entropy: Tensor | None, targets: Tensor, inputs: RolloutInputs, *,
    ignore_index: int, policy: PolicyConfig, backend: str,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """The second half of every composed policy loss (vocabulary-parallel or DTensor
    logits, the top-entropy selection, the off-policy mask, and ``linear_policy_loss``
    whenever it does not run its one-pass chunks): :func:`policy_loss_from_logprobs` on the
    per-token ``logp`` (and ``entropy``), counting a token only where its target is not
    ``ignore_index``, as the fused path does."""
    if is_dtensor(targets):
        targets = targets.to_local()
    counted = inputs._replace(mask=counted_mask(inputs.mask, targets, ignore_index))
    return policy_loss_from_logprobs(
        logp, inputs.advantages, entropy=entropy, policy_config=policy, backend=backend,
        **counted.keywords(),
    )  # fmt: skip
