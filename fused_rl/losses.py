"""Policy losses straight from the logits: PPO / GRPO / DAPO / Dr. GRPO / GSPO in one vocab
pass forward and one backward.

Token-level importance sampling runs as ONE Triton kernel (vocab stream + loss epilogue,
``kernels/vocab_stream_policy_fwd.py``) followed by O(B*T) reductions; its backward is the
shared vocab-stream backward fed with the per-token coefficients the epilogue wrote.
Sequence-level importance sampling (GSPO) needs every token's log-prob before any token's
loss: it runs the layer-1 kernel, a (B, T) barrier in PyTorch, and the same backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._agg import LOSS_AGG_MODES, masked_mean_all, token_weights
from ._backend import resolve_backend
from ._launch import f32_pair, stats_dtype, triton_acc, vocab_block, vocab_warps
from .logprobs import _token_stats_bwd_op, token_stats_nocheck
from .reference.kl import KL_KINDS
from .reference.policy import ClipConfig, policy_token_terms

IMPORTANCE_SAMPLING = ("token", "sequence")
METRIC_NAMES = (
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "ratio_mean",
    "ratio_max",
    "approx_kl",
)

# ----------------------------------------------------------------------------- fused op


def policy_loss_fwd(
    logits3d: Tensor,
    targets: Tensor,
    adv2d: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    weights: Tensor,
    temperature: float,
    ignore_index: int,
    eps_low: float,
    eps_high: float,
    dual_clip: float,
    delta: float,
    beta: float,
    kl_kind: int,
    entropy_coef: float,
    with_entropy: bool,
) -> tuple[Tensor, ...]:
    """Launch the fused kernel. ``dual_clip``/``delta`` of 0 mean off.

    Returns ``(loss, logp, entropy, row_max, log_sum, ratio, kl, code, g, h)``: ``loss`` 0-dim,
    the rest
    per token ``(B*T,)`` (``entropy``/``kl``/``h`` empty when not computed).
    """
    from .kernels.vocab_stream_policy_fwd import _policy_loss_fwd_kernel

    outer, inner, vocab = logits3d.shape
    n_rows = outer * inner
    dtype = stats_dtype(logits3d.dtype)
    dev = logits3d.device
    new = lambda on=True: torch.empty(n_rows if on else 0, dtype=dtype, device=dev)
    entropy_bonus = entropy_coef != 0.0
    with_entropy = with_entropy or entropy_bonus
    logp, row_max, log_sum, ratio, loss_tok, g = new(), new(), new(), new(), new(), new()
    entropy, kl, h = new(with_entropy), new(ref is not None), new(entropy_bonus)
    code = torch.empty(n_rows, dtype=torch.int8, device=dev)
    if n_rows > 0:
        block = vocab_block(vocab)
        _policy_loss_fwd_kernel[(n_rows,)](
            logits3d,
            targets,
            adv2d,
            old if old is not None else weights,
            ref if ref is not None else weights,
            weights,
            logp,
            entropy,
            row_max,
            log_sum,
            ratio,
            kl,
            code,
            loss_tok,
            g,
            h,
            inner,
            vocab,
            logits3d.stride(0),
            logits3d.stride(1),
            logits3d.stride(2),
            adv2d.stride(0),
            adv2d.stride(1),
            *f32_pair(1.0 / temperature),
            ignore_index,
            eps_low,
            eps_high,
            dual_clip,
            delta,
            beta,
            entropy_coef,
            HAS_OLD=old is not None,
            HAS_REF=ref is not None,
            ADD_KL=ref is not None and beta != 0.0,
            KL_KIND=kl_kind,
            WITH_ENTROPY=with_entropy,
            ENTROPY_BONUS=entropy_bonus,
            USE_DUAL=dual_clip != 0.0,
            USE_DELTA=delta != 0.0,
            BLOCK_V=block,
            ACC=triton_acc(logits3d.dtype),
            num_warps=vocab_warps(block),
        )
    loss = loss_tok.sum()  # deterministic second stage over B*T floats
    return loss, logp, entropy, row_max, log_sum, ratio, kl, code, g, h


@torch.library.custom_op("fused_rl::policy_loss_fwd", mutates_args=())
def _policy_loss_fwd_op(
    logits3d: Tensor,
    targets: Tensor,
    adv2d: Tensor,
    old: Tensor | None,
    ref: Tensor | None,
    weights: Tensor,
    temperature: float,
    ignore_index: int,
    eps_low: float,
    eps_high: float,
    dual_clip: float,
    delta: float,
    beta: float,
    kl_kind: int,
    entropy_coef: float,
    with_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return policy_loss_fwd(
        logits3d, targets, adv2d, old, ref, weights, temperature,
        ignore_index, eps_low, eps_high, dual_clip, delta, beta, kl_kind, entropy_coef,
        with_entropy,
    )  # fmt: skip


@_policy_loss_fwd_op.register_fake
def _(logits3d, targets, adv2d, old, ref, weights, temperature, ignore_index, eps_low,
      eps_high, dual_clip, delta, beta, kl_kind, entropy_coef, with_entropy):  # fmt: skip
    outer, inner, _ = logits3d.shape
    n_rows = outer * inner
    dtype = stats_dtype(logits3d.dtype)
    new = lambda on=True: logits3d.new_empty(n_rows if on else 0, dtype=dtype)
    bonus = entropy_coef != 0.0
    return (
        logits3d.new_empty((), dtype=dtype),
        new(), new(with_entropy or bonus), new(), new(), new(), new(ref is not None),
        logits3d.new_empty(n_rows, dtype=torch.int8), new(), new(bonus),
    )  # fmt: skip


def _policy_setup_context(ctx, inputs, output):
    logits3d, targets = inputs[0], inputs[1]
    ctx.temperature, ctx.ignore_index = inputs[6], inputs[7]
    _, logp, entropy, row_max, log_sum, ratio, kl, code, g, h = output
    ctx.save_for_backward(logits3d, targets, row_max, log_sum, entropy, g, h)
    ctx.mark_non_differentiable(logp, entropy, row_max, log_sum, ratio, kl, code, g, h)


def _policy_backward(ctx, grad_loss, *_unused):
    logits3d, targets, row_max, log_sum, entropy, g, h = ctx.saved_tensors
    has_h = h.numel() > 0
    grad = _token_stats_bwd_op(
        logits3d,
        targets.reshape(logits3d.shape[:2]),
        row_max,
        log_sum,
        entropy if has_h else None,
        g,
        h if has_h else None,
        grad_loss.reshape(()).to(row_max.dtype),
        ctx.temperature,
        ctx.ignore_index,
    )
    return (grad,) + (None,) * 15


_policy_loss_fwd_op.register_autograd(_policy_backward, setup_context=_policy_setup_context)


# ----------------------------------------------------------------------------- helpers


def _masked_max(x: Tensor, mask_f: Tensor) -> Tensor:
    """Max of a non-negative ``x`` over counted tokens; 0 when none (or the batch is empty)."""
    if x.numel() == 0:  # static shape: no sync, traceable
        return x.new_zeros(())
    return torch.where(mask_f > 0, x, torch.zeros_like(x)).amax()


def _metrics(terms: dict[str, Tensor], mask_f: Tensor) -> dict[str, Tensor]:
    """Masked means over counted tokens, detached fp32 0-dim tensors (no host sync)."""
    with torch.no_grad():
        mean = lambda x: masked_mean_all(x.detach(), mask_f)
        ratio = terms["ratio"].detach().float()
        out = {
            "clip_frac": mean(terms["clipped"]),
            "clip_frac_low": mean(terms["clipped_low"]),
            "clip_frac_high": mean(terms["clipped_high"]),
            "dual_clip_frac": mean(terms["dual_clipped"]),
            "ratio_mean": mean(ratio),
            "ratio_max": _masked_max(ratio, mask_f),
            "approx_kl": mean(terms["neg_log_ratio"]),
        }
        for name in ("kl", "entropy"):
            if name in terms:
                out[name] = mean(terms[name])
    return out


def _check_policy_args(
    *, eps_low, eps_high, dual_clip, delta, beta, entropy_coef, ref_logprobs, kl,
    importance_sampling, loss_agg, max_length, num_items,
) -> float:  # fmt: skip
    """Validate the hyper-parameters; return the resolved ``eps_high``."""
    V.check_number(eps_low, "eps_low")
    V.check_number(eps_high, "eps_high", allow_none=True)
    V.check_number(dual_clip, "dual_clip", allow_none=True)
    V.check_number(delta, "delta", allow_none=True)
    V.check_number(beta, "beta")
    V.check_number(entropy_coef, "entropy_coef")
    if not isinstance(num_items, torch.Tensor):
        V.check_number(num_items, "num_items", allow_none=True)
    if eps_low < 0:
        raise ValueError(f"eps_low must be >= 0, got {eps_low}")
    eps_high = eps_low if eps_high is None else eps_high
    if eps_high < 0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (arXiv 1912.09729) or None, got {dual_clip}")
    if delta is not None and not delta > 1.0 + eps_high:
        raise ValueError(f"delta must be > 1 + eps_high = {1.0 + eps_high}, got {delta}")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta = {beta} needs ref_logprobs (the reference policy's log-probs)")
    V.check_choice(kl, KL_KINDS, "kl")
    V.check_choice(importance_sampling, IMPORTANCE_SAMPLING, "importance_sampling")
    V.check_choice(loss_agg, LOSS_AGG_MODES, "loss_agg")
    if max_length is not None and not (isinstance(max_length, int) and max_length > 0):
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if isinstance(num_items, (int, float)) and not num_items > 0:
        raise ValueError(f"num_items must be > 0, got {num_items}")
    return eps_high


def _check_token_tensors(batch: int, length: int, **tensors: Tensor | None) -> None:
    """Optional ``(B, T)`` per-token inputs: float tensors (``mask``: bool / int / float)."""
    for name, t in tensors.items():
        if t is None:
            continue
        if name == "mask":
            V.check_mask_dtype(t, name)
        else:
            V.check_float(t, name)
        V.check_shape(t, (batch, length), name, "(B, T)")


def _constants(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Rollout inputs (advantages, old / reference log-probs, the mask) detached: the fused
    kernel never differentiates w.r.t. them, so neither may the reference."""
    return tuple(None if t is None else t.detach() for t in tensors)


def _advantages_2d(advantages: Tensor, batch: int, length: int) -> Tensor:
    """``(B,)`` (one per sequence) or ``(B, T)`` (per token) advantages as a ``(B, T)`` view."""
    V.check_float(advantages, "advantages")
    shape = tuple(advantages.shape)
    if shape == (batch,):
        return advantages[:, None].expand(batch, length)
    if shape == (batch, length):
        return advantages
    if shape == (batch, 1):
        raise ValueError(
            f"advantages of shape (B, 1) = {shape} is ambiguous: pass (B,) for one advantage "
            f"per sequence or (B, T) = ({batch}, {length}) for one per token"
        )
    raise ValueError(
        f"advantages must have shape (B,) = ({batch},) or (B, T) = ({batch}, {length}), got {shape}"
    )


def _loss_from_logprobs(logp, entropy, adv2d, mask_f, weights, **token_kwargs):
    terms = policy_token_terms(logp, adv2d, mask_f, entropy=entropy, **token_kwargs)
    loss = (terms["loss"] * weights).where(weights != 0, torch.zeros_like(weights)).sum()
    return loss, _metrics(terms, mask_f)


# ----------------------------------------------------------------------------- public API


def policy_loss(
    logits: Tensor,
    targets: Tensor,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    temperature: float = 1.0,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    kl: str = "k3",
    entropy_coef: float = 0.0,
    with_entropy: bool = False,
    importance_sampling: str = "token",
    loss_agg: str = "token-mean",
    max_length: int | None = None,
    num_items: int | float | Tensor | None = None,
    ignore_index: int = -100,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO clipped-surrogate loss from the policy logits, fused over the vocabulary.

    Per token, with ``logp = log_softmax(logits / T)[target]`` and
    ``r = exp(logp - old_logprobs)``:
    ``L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta kl(logp, ref) - entropy_coef H``,
    aggregated over counted tokens by ``loss_agg``.

    Args:
        logits: ``(B, T, V)`` fp32/bf16/fp16, any strides (``logits[:, :-1]`` is not copied).
        targets: ``(B, T)`` int64/int32; ``ignore_index`` tokens never count.
        advantages: ``(B,)`` one per sequence (GRPO) or ``(B, T)`` per token (PPO).
        old_logprobs: ``(B, T)`` log-probs of the sampling policy; None = on-policy
            (``old = logp.detach()``: ratio 1, gradient = the policy gradient).
        ref_logprobs: ``(B, T)`` reference-policy log-probs (KL penalty / metric).
            ``advantages``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are rollout
            constants: no gradient reaches them, on every backend.
        mask: ``(B, T)`` bool or float, True/1 = the token counts; None = all count.
        temperature: logits are divided by it.
        eps_low, eps_high: clip band ``[1 - eps_low, 1 + eps_high]``; ``eps_high=None`` =
            ``eps_low`` (DAPO's clip-higher: ``eps_high > eps_low``).
        dual_clip: ``c > 1``: where ``A < 0`` the loss is capped at ``-c A`` (arXiv 1912.09729).
        delta: TRL's two-sided clip: the unclipped ratio is capped at ``delta`` first.
        beta, kl: KL penalty ``beta * kl`` per token; ``kl`` in ``k1``, ``k2``, ``k3``,
            ``low_var_kl``, ``abs`` with ``log_ratio = logp - ref``.
        entropy_coef: entropy bonus ``-entropy_coef * H`` (H differentiable, same pass).
        with_entropy: report the mean entropy as a metric even when ``entropy_coef == 0``.
        importance_sampling: ``"token"`` or ``"sequence"`` (GSPO: one ratio per sequence,
            ``exp(masked mean of logp - old)``, differentiable through every token).
        loss_agg: ``"token-mean"`` | ``"seq-mean-token-mean"`` | ``"seq-mean-token-sum"`` |
            ``"seq-mean-token-sum-norm"`` (see ``fused_rl._agg.token_weights``); a sequence
            with no counted token contributes 0, never NaN.
        max_length: the ``seq-mean-token-sum-norm`` constant (default T).
        num_items: replaces the token count of ``token-mean`` (global count across
            micro-batches / ranks). A tensor value is not checked (no host sync).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-dim fp32 tensor, differentiable w.r.t. ``logits``;
        ``metrics`` detached fp32 0-dim tensors, masked means over counted tokens:
        ``clip_frac`` (clipped branch strictly chosen), ``clip_frac_low``,
        ``clip_frac_high``, ``dual_clip_frac``, ``ratio_mean``, ``ratio_max``,
        ``approx_kl`` (``mean(old - logp)``), ``kl`` (when ``ref_logprobs`` is given),
        ``entropy`` (when computed). The computation never syncs with the host; in eager
        mode the check that targets lie in ``[0, V)`` syncs once (switch it off with
        ``fused_rl.config.check_values = False``; under ``torch.compile`` it never runs).

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
    V.check_logits(logits, min_dim=3)
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    V.check_targets(targets, logits)
    V.check_positive(temperature, "temperature")
    batch, length, vocab = logits.shape
    adv2d = _advantages_2d(advantages, batch, length)
    _check_token_tensors(
        batch, length, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask
    )
    V.check_same_device(
        logits=logits, advantages=advantages, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, mask=mask,
    )  # fmt: skip
    eps_high = _check_policy_args(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, delta=delta, beta=beta,
        entropy_coef=entropy_coef, ref_logprobs=ref_logprobs, kl=kl,
        importance_sampling=importance_sampling, loss_agg=loss_agg, max_length=max_length,
        num_items=num_items,
    )  # fmt: skip
    V.check_target_range(targets, vocab, ignore_index, "targets")
    which = resolve_backend(backend, logits, targets)
    adv2d, old_logprobs, ref_logprobs, mask = _constants(adv2d, old_logprobs, ref_logprobs, mask)

    counted = targets != ignore_index
    mask_f = counted.float() if mask is None else mask.float() * counted
    weights = token_weights(mask_f, loss_agg, max_length=max_length, num_items=num_items)
    need_entropy = with_entropy or entropy_coef != 0.0

    if which == "triton" and importance_sampling == "token":
        out = _policy_loss_fwd_op(
            logits, targets.reshape(-1).contiguous(), adv2d,
            None if old_logprobs is None else old_logprobs.reshape(-1).contiguous(),
            None if ref_logprobs is None else ref_logprobs.reshape(-1).contiguous(),
            weights.reshape(-1), float(temperature), int(ignore_index), float(eps_low),
            float(eps_high), float(dual_clip or 0.0), float(delta or 0.0), float(beta),
            KL_KINDS.index(kl), float(entropy_coef), bool(need_entropy),
        )  # fmt: skip
        loss, logp, entropy, _, _, ratio, kl_tok, code, _, _ = out
        as2d = lambda t: t.reshape(batch, length)
        logp = as2d(logp)
        old = logp.detach() if old_logprobs is None else old_logprobs
        terms = {
            "ratio": as2d(ratio),
            "clipped": as2d(code & 1) != 0,
            "clipped_low": as2d(code & 2) != 0,
            "clipped_high": as2d(code & 4) != 0,
            "dual_clipped": as2d(code & 8) != 0,
            "neg_log_ratio": old - logp,
        }
        if ref_logprobs is not None:
            terms["kl"] = as2d(kl_tok)
        if need_entropy:
            terms["entropy"] = as2d(entropy)
        return loss, _metrics(terms, mask_f)

    logp, entropy = token_stats_nocheck(
        logits, targets, temperature, ignore_index, need_entropy, which
    )
    return _loss_from_logprobs(
        logp, entropy, adv2d.float(), mask_f, weights, old_logp=old_logprobs,
        ref_logp=ref_logprobs, clip=ClipConfig(eps_low, eps_high, dual_clip, delta),
        beta=beta, kl=kl, entropy_coef=entropy_coef, importance_sampling=importance_sampling,
    )  # fmt: skip


def policy_loss_from_logprobs(
    logprobs: Tensor,
    advantages: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    entropy: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    delta: float | None = None,
    beta: float = 0.0,
    kl: str = "k3",
    entropy_coef: float = 0.0,
    importance_sampling: str = "token",
    loss_agg: str = "token-mean",
    max_length: int | None = None,
    num_items: int | float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss` for callers that already hold per-token ``logprobs`` ``(B, T)``
    (and optionally ``entropy`` ``(B, T)``) as tensors with grad.

    Same arguments and outputs minus the vocabulary ones. This is O(B*T) PyTorch math (the
    token layer's reference): the vocabulary work happened where ``logprobs`` came from,
    e.g. :func:`fused_rl.token_logprobs`.

    Example:
        >>> import torch, fused_rl
        >>> logp = (torch.randn(2, 5) - 3).requires_grad_()
        >>> loss, m = fused_rl.policy_loss_from_logprobs(logp, torch.tensor([0.5, -0.5]))
        >>> loss.backward()
    """
    V.check_float(logprobs, "logprobs")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got shape {tuple(logprobs.shape)}")
    batch, length = logprobs.shape
    adv2d = _advantages_2d(advantages, batch, length)
    _check_token_tensors(
        batch, length, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask,
        entropy=entropy,
    )  # fmt: skip
    V.check_same_device(
        logprobs=logprobs, advantages=advantages, old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs, mask=mask, entropy=entropy,
    )  # fmt: skip
    eps_high = _check_policy_args(
        eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, delta=delta, beta=beta,
        entropy_coef=entropy_coef, ref_logprobs=ref_logprobs, kl=kl,
        importance_sampling=importance_sampling, loss_agg=loss_agg, max_length=max_length,
        num_items=num_items,
    )  # fmt: skip
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy tensor")
    adv2d, old_logprobs, ref_logprobs, mask = _constants(adv2d, old_logprobs, ref_logprobs, mask)
    mask_f = torch.ones_like(logprobs, dtype=torch.float32) if mask is None else mask.float()
    weights = token_weights(mask_f, loss_agg, max_length=max_length, num_items=num_items)
    return _loss_from_logprobs(
        logprobs, entropy, adv2d.float(), mask_f, weights, old_logp=old_logprobs,
        ref_logp=ref_logprobs, clip=ClipConfig(eps_low, eps_high, dual_clip, delta),
        beta=beta, kl=kl, entropy_coef=entropy_coef, importance_sampling=importance_sampling,
    )  # fmt: skip
