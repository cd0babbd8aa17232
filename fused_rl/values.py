"""Fused value losses on token tensors: ``value_loss`` and torchtune's complete ``ppo_loss``.

Triton path (``kernels/token_ops/values.py``): one flat forward launch writing per-block partial
sums, one single-program launch merging them into the scalar outputs (deterministic, no float
atomics, no host sync), and one backward launch that recomputes every per-token derivative
from the inputs. Each launcher is a :class:`fused_rl._ops.FusedOp` (``fused_rl::value_loss_fwd``,
``fused_rl::ppo_loss_fwd`` and their ``*_bwd``): a ``torch.library`` custom op with fake and
autograd registrations for ``torch.compile(fullgraph=True)``, a direct call in eager mode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._agg import check_loss_agg, poison_empty, token_weights
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, f32_pair, triton_acc
from ._ops import FusedOp
from .reductions import (
    BLOCK,
    BLOCK_P,
    NUM_WARPS,
    as_rows2d,
    kernel_mask,
    mask_strides,
    n_blocks,
)
from .reference import values as ref
from .reference.reductions import acc_dtype


def _strides(*tensors: Tensor | None) -> list[int]:
    out: list[int] = []
    for t in tensors:
        out.extend(mask_strides(t))
    return out


# ----------------------------------------------------------------------------- launchers


def value_loss_fwd(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    weights: Tensor,
    mask: Tensor | None,
    clip: float | None,
) -> Tensor:
    """``(4,)`` = ``(loss, clip_frac, value_mean, 1/count)`` for 2-D inputs (any strides);
    ``weights`` fp32 contiguous ``(R, C)``."""
    from .kernels.token_ops.values import _value_loss_finalize_kernel, _value_loss_fwd_kernel

    dtype = acc_dtype(values, old_values, returns)
    acc = triton_acc(dtype)
    mask = kernel_mask(mask)
    n_prog = n_blocks(values.numel())
    partials = torch.empty((4, n_prog), dtype=dtype, device=values.device)
    if n_prog > 0:
        _value_loss_fwd_kernel[(n_prog,)](
            values, old_values, returns, weights, mask if mask is not None else weights,
            partials, values.numel(), values.shape[1], *_strides(values, old_values, returns, mask),
            *f32_pair(0.0 if clip is None else clip), HAS_MASK=mask is not None,
            HAS_CLIP=clip is not None, BLOCK=BLOCK, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    out = torch.empty((4,), dtype=dtype, device=values.device)
    _value_loss_finalize_kernel[(1,)](
        partials, out, n_prog, BLOCK_P=BLOCK_P, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS
    )
    return out


def value_loss_bwd(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    weights: Tensor,
    mask: Tensor | None,
    out: Tensor,
    grad_out: Tensor,
    clip: float | None,
) -> Tensor:
    """Gradient w.r.t. ``values`` (contiguous, ``values.dtype``) under ``grad_out`` ``(4,)``."""
    from .kernels.token_ops.values import _value_loss_bwd_kernel

    grad = torch.empty(values.shape, dtype=values.dtype, device=values.device)
    if values.numel() == 0:
        return grad
    mask = kernel_mask(mask)
    _value_loss_bwd_kernel[(n_blocks(values.numel()),)](
        values, old_values, returns, weights, mask if mask is not None else weights, out,
        grad_out.to(out.dtype).contiguous(), grad, values.numel(), values.shape[1],
        *_strides(values, old_values, returns, mask), *f32_pair(0.0 if clip is None else clip),
        HAS_MASK=mask is not None, HAS_CLIP=clip is not None, BLOCK=BLOCK,
        ACC=triton_acc(out.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return grad


def _ppo_scalars(epsilon: float, value_clip_range: float) -> list[float]:
    return [*f32_pair(1.0 - epsilon), *f32_pair(1.0 + epsilon), *f32_pair(value_clip_range)]


def ppo_loss_fwd(
    pi_old_logprobs: Tensor,
    pi_logprobs: Tensor,
    advantages: Tensor,
    phi_old_values: Tensor,
    phi_values: Tensor,
    returns: Tensor,
    padding_masks: Tensor | None,
    value_padding_masks: Tensor | None,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
) -> Tensor:
    """``(8,)`` = ``(loss, policy_loss, value_loss, ratios_mean, clipfrac, 1/den_policy,
    1/den_value, 1/N)`` for six 2-D inputs of one shape (any strides)."""
    from .kernels.token_ops.values import _ppo_loss_finalize_kernel, _ppo_loss_fwd_kernel

    tensors = (pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns)
    dtype = acc_dtype(*tensors)
    acc = triton_acc(dtype)
    pm, vm = kernel_mask(padding_masks), kernel_mask(value_padding_masks)
    numel = pi_logprobs.numel()
    n_prog = n_blocks(numel)
    partials = torch.empty((6, n_prog), dtype=dtype, device=pi_logprobs.device)
    if n_prog > 0:
        _ppo_loss_fwd_kernel[(n_prog,)](
            *tensors, pm if pm is not None else pi_logprobs, vm if vm is not None else phi_values,
            partials, numel, pi_logprobs.shape[1], *_strides(*tensors, pm, vm),
            *_ppo_scalars(epsilon, value_clip_range), HAS_PMASK=pm is not None,
            HAS_VMASK=vm is not None, BLOCK=BLOCK, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    out = torch.empty((8,), dtype=dtype, device=pi_logprobs.device)
    _ppo_loss_finalize_kernel[(1,)](
        partials, out, n_prog, numel, *f32_pair(value_coeff), HAS_PMASK=pm is not None,
        HAS_VMASK=vm is not None, BLOCK_P=BLOCK_P, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def ppo_loss_bwd(
    pi_old_logprobs: Tensor,
    pi_logprobs: Tensor,
    advantages: Tensor,
    phi_old_values: Tensor,
    phi_values: Tensor,
    returns: Tensor,
    padding_masks: Tensor | None,
    value_padding_masks: Tensor | None,
    out: Tensor,
    grad_out: Tensor,
    epsilon: float,
    value_clip_range: float,
    value_coeff: float,
) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. ``pi_logprobs`` and ``phi_values`` (contiguous, their dtypes)."""
    from .kernels.token_ops.values import _ppo_loss_bwd_kernel

    tensors = (pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns)
    g_lp = torch.empty(pi_logprobs.shape, dtype=pi_logprobs.dtype, device=pi_logprobs.device)
    g_v = torch.empty(phi_values.shape, dtype=phi_values.dtype, device=phi_values.device)
    numel = pi_logprobs.numel()
    if numel == 0:
        return g_lp, g_v
    pm, vm = kernel_mask(padding_masks), kernel_mask(value_padding_masks)
    _ppo_loss_bwd_kernel[(n_blocks(numel),)](
        *tensors, pm if pm is not None else pi_logprobs, vm if vm is not None else phi_values,
        out, grad_out.to(out.dtype).contiguous(), g_lp, g_v, numel, pi_logprobs.shape[1],
        *_strides(*tensors, pm, vm), *_ppo_scalars(epsilon, value_clip_range),
        *f32_pair(value_coeff), HAS_PMASK=pm is not None, HAS_VMASK=vm is not None,
        BLOCK=BLOCK, ACC=triton_acc(out.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return g_lp, g_v


# ----------------------------------------------------------------------------- fused ops


def _value_fake(values, old_values, returns, weights, mask, clip):
    return values.new_empty((4,), dtype=acc_dtype(values, old_values, returns))


def _value_bwd_fake(values, *_args):
    return values.new_empty(values.shape)


def _value_setup(ctx, inputs, output):
    values, old_values, returns, weights, mask, clip = inputs
    ctx.save_for_backward(values, old_values, returns, weights, mask, output)
    ctx.clip = clip


def _value_backward(ctx, grad_out):
    values, old_values, returns, weights, mask, out = ctx.saved_tensors
    grad = _value_loss_bwd_op(values, old_values, returns, weights, mask, out, grad_out, ctx.clip)
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


_value_loss_bwd_op = FusedOp("value_loss_bwd", value_loss_bwd)
_value_loss_bwd_op.register_fake(_value_bwd_fake)
_value_loss_op = FusedOp("value_loss_fwd", value_loss_fwd)
_value_loss_op.register_fake(_value_fake)
_value_loss_op.register_autograd(_value_backward, setup_context=_value_setup)


def _ppo_fake(pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns, *_):
    dtype = acc_dtype(pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns)
    return pi_logprobs.new_empty((8,), dtype=dtype)


def _ppo_bwd_fake(pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, *_):
    return pi_logprobs.new_empty(pi_logprobs.shape), phi_values.new_empty(phi_values.shape)


def _ppo_setup(ctx, inputs, output):
    (
        pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns,
        padding_masks, value_padding_masks, epsilon, value_clip_range, value_coeff,
    ) = inputs  # fmt: skip
    ctx.save_for_backward(
        pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns,
        padding_masks, value_padding_masks, output,
    )  # fmt: skip
    ctx.hyper = (epsilon, value_clip_range, value_coeff)


# positions of the differentiable inputs of fused_rl::ppo_loss
_PI_LOGPROBS, _PHI_VALUES = 1, 4


def _ppo_backward(ctx, grad_out):
    *tensors, out = ctx.saved_tensors
    g_lp, g_v = _ppo_loss_bwd_op(*tensors, out, grad_out, *ctx.hyper)
    grads: list[Tensor | None] = [None] * len(ctx.needs_input_grad)
    grads[_PI_LOGPROBS], grads[_PHI_VALUES] = g_lp, g_v
    return tuple(grads)


_ppo_loss_bwd_op = FusedOp("ppo_loss_bwd", ppo_loss_bwd)
_ppo_loss_bwd_op.register_fake(_ppo_bwd_fake)
_ppo_loss_op = FusedOp("ppo_loss_fwd", ppo_loss_fwd)
_ppo_loss_op.register_fake(_ppo_fake)
_ppo_loss_op.register_autograd(_ppo_backward, setup_context=_ppo_setup)


# ----------------------------------------------------------------------------- public API


def _check_same(ref_name: str, ref_t: Tensor, **others: Tensor) -> None:
    for name, t in others.items():
        V.check_float(t, name)
        V.check_shape(t, ref_t.shape, name, f"{ref_name}.shape")
        V.check_same_device(**{ref_name: ref_t, name: t})


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    mask: Tensor | None = None,
    clip: float | None = 0.2,
    loss_agg: str = "token-mean",
    max_length: int | None = None,
    num_items: int | float | Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)``
    per token (TRL / torchtune form; ``clip=None``: ``0.5 (v - R)^2``), aggregated with
    ``loss_agg`` exactly as ``fused_rl.policy_loss`` aggregates (see
    ``fused_rl._agg.token_weights``).

    Args:
        values: ``(B, T)`` float, the current value predictions (any strides).
        old_values: ``(B, T)`` values at rollout time (the clip centre); no gradient.
        returns: ``(B, T)`` regression targets; no gradient.
        mask: None, or ``(B, T)`` bool (True counts) or float / integer per-token weights
            ``>= 0`` (``token-mean`` is ``sum(m * L) / sum(m)``); a negative weight raises
            ``ValueError`` in eager mode with ``fused_rl.config.check_values`` on, else gives NaN.
        clip: value clip range ``c >= 0``, or None for the unclipped loss.
        loss_agg: ``"token-mean"`` | ``"seq-mean-token-mean"`` | ``"seq-mean-token-sum"`` |
            ``"seq-mean-token-sum-norm"``; ``max_length`` / ``num_items`` as in
            ``token_weights`` (``num_items``: a global token count for ``"token-mean"``).

    Returns:
        ``(loss, metrics)``: ``loss`` fp32 0-dim (fp64 for fp64 inputs), differentiable
        w.r.t. ``values`` only; ``metrics`` = ``{"clip_frac", "value_mean"}``, detached fp32
        0-dim: the masked fraction of tokens whose clipped branch is strictly larger, and
        the masked mean of ``values`` (0 for an empty mask).

    Example:
        >>> import torch, fused_rl
        >>> v = torch.tensor([[0.0, 1.0, 2.0]], requires_grad=True)
        >>> loss, metrics = fused_rl.value_loss(v, torch.zeros(1, 3), torch.ones(1, 3), clip=0.5)
        >>> round(loss.item(), 4), metrics["clip_frac"].item()
        (0.375, 0.3333333432674408)
        >>> loss.backward()
    """
    V.check_float(values, "values")
    if values.dim() != 2:
        raise ValueError(f"values must be (B, T), got shape {tuple(values.shape)}")
    _check_same("values", values, old_values=old_values, returns=returns)
    V.check_mask(mask, "mask", values.shape, "values.shape")
    V.check_same_device(values=values, mask=mask)
    V.check_nonnegative(clip, "clip", allow_none=True)
    check_loss_agg(loss_agg, max_length=max_length, num_items=num_items)
    which = resolve_backend(backend, values, old_values, returns, mask)
    mask = None if mask is None else mask.detach()  # a constant, as on the Triton path
    counted = mask if mask is not None else torch.ones_like(values, dtype=torch.bool)
    dtype = acc_dtype(values, old_values, returns)  # fp64 weights for fp64 values: exact 1/n
    weights = token_weights(
        counted, loss_agg, max_length=max_length, num_items=num_items, dtype=dtype
    )
    clip = None if clip is None else float(clip)
    if which == "reference":
        loss, clip_frac, value_mean = ref.value_loss(
            values.to(dtype), old_values.detach().to(dtype), returns.detach().to(dtype),
            weights, mask, clip,
        )  # fmt: skip
    else:
        # the kernels index the weights as contiguous (B, T); token_weights keeps the
        # mask's strides, so a transposed mask would be read in the wrong order
        out = _value_loss_op(values, old_values, returns, weights.contiguous(), mask, clip)
        loss, clip_frac, value_mean = out[0], out[1], out[2]
    metrics = {
        "clip_frac": clip_frac.detach().to(torch.float32),
        "value_mean": value_mean.detach().to(torch.float32),
    }
    return poison_empty(loss, num_items, weights.numel()), metrics


def ppo_loss(
    pi_old_logprobs: Tensor,
    pi_logprobs: Tensor,
    advantages: Tensor,
    phi_old_values: Tensor,
    phi_values: Tensor,
    returns: Tensor,
    padding_masks: Tensor | None = None,
    value_padding_masks: Tensor | None = None,
    *,
    epsilon: float = 0.1,
    value_clip_range: float = 0.2,
    value_coeff: float = 0.1,
    backend: str = "auto",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torchtune's ``PPOLoss`` (policy surrogate + clipped value loss) in one forward launch
    (plus a one-program merge) and one backward launch.

    ``ratio = exp(pi_logprobs - pi_old_logprobs)``; ``policy = max(-A r, -A clamp(r, 1 - eps,
    1 + eps))``; ``value = 0.5 * max((v - R)^2, (clamp(v, v_old - c, v_old + c) - R)^2)``;
    each reduced with torchtune's masked mean ``sum(m x) / (sum(m) + 1e-8)`` (so an empty
    mask gives 0), or a plain mean when its mask is None; ``loss = policy + value_coeff *
    value``. Positions whose mask is 0 contribute exactly 0 even when their value is inf /
    NaN (torchtune's ``x * m`` would propagate it).

    Args:
        pi_old_logprobs, pi_logprobs, advantages, phi_old_values, phi_values, returns: float
            tensors of one shape, usually ``(B, T)`` (any shape and strides work), any float
            dtypes (computed in fp32, or fp64 if any is fp64).
        padding_masks: None, or a bool mask (True counts) or float / integer per-token
            weights ``>= 0`` for the policy terms (torchtune's ``sum(m x) / (sum(m) + 1e-8)``);
            a negative weight raises ``ValueError`` in eager mode with value checks on, else
            gives NaN.
        value_padding_masks: None or mask for the value term (may differ from the policy
            mask: torchtune keeps values valid one token past the response end).
        epsilon, value_clip_range, value_coeff: torchtune's module defaults ``0.1, 0.2, 0.1``.

    Returns:
        ``(loss, policy_loss, value_loss, ratios_mean, clipfrac)``, 0-dim fp32 (fp64 for fp64
        inputs). Only ``loss`` is differentiable, w.r.t. ``pi_logprobs`` and ``phi_values``
        (the other inputs are treated as constants). ``ratios_mean`` is unmasked;
        ``clipfrac`` = masked fraction where the clipped policy branch is strictly larger.

    Example:
        >>> import math, torch, fused_rl
        >>> lp = torch.ones(1, 1, requires_grad=True)
        >>> out = fused_rl.ppo_loss(torch.zeros(1, 1), lp, torch.ones(1, 1), torch.zeros(1, 1),
        ...                         torch.zeros(1, 1), torch.zeros(1, 1), epsilon=0.2)
        >>> round(out[1].item(), 5)  # ratio e, clipped to 1.2
        -1.2
        >>> out[0].backward()
    """
    tensors = dict(
        pi_old_logprobs=pi_old_logprobs,
        pi_logprobs=pi_logprobs,
        advantages=advantages,
        phi_old_values=phi_old_values,
        phi_values=phi_values,
        returns=returns,
    )
    V.check_float(pi_logprobs, "pi_logprobs")
    _check_same("pi_logprobs", pi_logprobs, **tensors)
    for name, m in (("padding_masks", padding_masks), ("value_padding_masks", value_padding_masks)):
        V.check_mask(m, name, pi_logprobs.shape, "pi_logprobs.shape")
        V.check_same_device(pi_logprobs=pi_logprobs, **{name: m})
    V.check_nonnegative(epsilon, "epsilon")
    V.check_nonnegative(value_clip_range, "value_clip_range")
    V.check_nonnegative(value_coeff, "value_coeff")
    # masks are constants, as on the Triton path (its backward returns no mask gradient)
    padding_masks, value_padding_masks = (
        None if m is None else m.detach() for m in (padding_masks, value_padding_masks)
    )
    args = (*tensors.values(), padding_masks, value_padding_masks)
    which = resolve_backend(backend, *args)
    hyper = (float(epsilon), float(value_clip_range), float(value_coeff))
    if which == "reference":
        dtype = acc_dtype(*tensors.values())
        up = [t.to(dtype) for t in tensors.values()]
        return ref.ppo_loss(*up, padding_masks, value_padding_masks, *hyper)
    out = _ppo_loss_op(*(None if t is None else as_rows2d(t) for t in args), *hyper)
    return out[0], out[1].detach(), out[2].detach(), out[3].detach(), out[4].detach()
