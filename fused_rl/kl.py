"""Fused per-token KL estimators: ``kl_estimate``.

Triton path (``kernels/token_ops/kl.py``): one elementwise forward launch and one backward launch
writing the gradients of ``logprobs`` and, when it requires grad, ``ref_logprobs``. The math
is the lead's device function ``kernels/policy/layer2.kl_and_grad``, shared with the fused
policy-loss epilogue, so both paths estimate the same KL. Both launchers are
``fused_rl._ops.FusedOp`` objects (``fused_rl::kl_estimate_fwd``, ``fused_rl::kl_estimate_bwd``):
custom ops with fake and autograd registrations for ``torch.compile``, direct calls in eager.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, triton_acc
from ._ops import FusedOp
from .reductions import BLOCK, NUM_WARPS, as_rows2d, n_blocks
from .reference import kl as ref
from .reference.kl import KL_KINDS
from .reference.reductions import acc_dtype

# ----------------------------------------------------------------------------- launchers


def kl_estimate_fwd(logprobs: Tensor, ref_logprobs: Tensor, kind: int) -> Tensor:
    """``kl`` (contiguous ``(R, C)``, fp32 / fp64) of two 2-D views (any strides)."""
    from .kernels.token_ops.kl import _kl_estimate_fwd_kernel

    dtype = acc_dtype(logprobs, ref_logprobs)
    out = torch.empty(logprobs.shape, dtype=dtype, device=logprobs.device)
    if logprobs.numel() > 0:
        _kl_estimate_fwd_kernel[(n_blocks(logprobs.numel()),)](
            logprobs, ref_logprobs, out, logprobs.numel(), logprobs.shape[1],
            logprobs.stride(0), logprobs.stride(1), ref_logprobs.stride(0),
            ref_logprobs.stride(1), KIND=kind, BLOCK=BLOCK, ACC=triton_acc(dtype),
            num_warps=NUM_WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    return out


def kl_estimate_bwd(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    grad: Tensor,
    kind: int,
    want_logp: bool,
    want_ref: bool,
) -> tuple[Tensor, Tensor]:
    """Gradients w.r.t. ``logprobs`` and ``ref_logprobs`` (contiguous, their dtypes); an
    unwanted one is returned empty (shape ``(0,)``)."""
    from .kernels.token_ops.kl import _kl_estimate_bwd_kernel

    def new(t: Tensor, on: bool) -> Tensor:
        return torch.empty(t.shape if on else (0,), dtype=t.dtype, device=t.device)

    g_lp, g_ref = new(logprobs, want_logp), new(ref_logprobs, want_ref)
    if logprobs.numel() > 0 and (want_logp or want_ref):
        _kl_estimate_bwd_kernel[(n_blocks(logprobs.numel()),)](
            logprobs, ref_logprobs, grad, g_lp, g_ref, logprobs.numel(), logprobs.shape[1],
            logprobs.stride(0), logprobs.stride(1), ref_logprobs.stride(0),
            ref_logprobs.stride(1), grad.stride(0), grad.stride(1), KIND=kind,
            WANT_LOGP=want_logp, WANT_REF=want_ref, BLOCK=BLOCK,
            ACC=triton_acc(acc_dtype(logprobs, ref_logprobs)), num_warps=NUM_WARPS,
            **COMPILE_OPTIONS,
        )  # fmt: skip
    return g_lp, g_ref


# ----------------------------------------------------------------------------- fused ops


def _kl_fake(logprobs, ref_logprobs, kind):
    return logprobs.new_empty(logprobs.shape, dtype=acc_dtype(logprobs, ref_logprobs))


def _kl_bwd_fake(logprobs, ref_logprobs, grad, kind, want_logp, want_ref):
    return (
        logprobs.new_empty(logprobs.shape if want_logp else (0,)),
        ref_logprobs.new_empty(ref_logprobs.shape if want_ref else (0,)),
    )


def _kl_setup(ctx, inputs, output):
    logprobs, ref_logprobs, kind = inputs
    ctx.save_for_backward(logprobs, ref_logprobs)
    ctx.kind = kind


def _kl_backward(ctx, grad):
    logprobs, ref_logprobs = ctx.saved_tensors
    want_logp, want_ref, *rest = ctx.needs_input_grad
    g_lp, g_ref = _kl_estimate_bwd_op(logprobs, ref_logprobs, grad, ctx.kind, want_logp, want_ref)
    return (g_lp if want_logp else None, g_ref if want_ref else None) + (None,) * len(rest)


_kl_estimate_bwd_op = FusedOp("kl_estimate_bwd", kl_estimate_bwd)
_kl_estimate_bwd_op.register_fake(_kl_bwd_fake)
_kl_estimate_op = FusedOp("kl_estimate_fwd", kl_estimate_fwd)
_kl_estimate_op.register_fake(_kl_fake)
_kl_estimate_op.register_autograd(_kl_backward, setup_context=_kl_setup)


# ----------------------------------------------------------------------------- public API


@V.deprecated_keyword("kind", "kl_estimator")
def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, *, kl_estimator: str = "k3", backend: str = "auto"
) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, ``d = logprobs -
    ref_logprobs``:

    * ``k1``: ``d`` (unbiased, high variance, can be negative);
    * ``k2``: ``d^2 / 2``;
    * ``k3``: ``exp(-d) - 1 + d`` (unbiased, >= 0; Schulman's estimator, GRPO's);
    * ``low_var_kl``: k3 with ``-d`` clamped to ``[-20, 20]`` and the result to
      ``[-10, 10]`` (verl); clamped tokens get zero gradient, as ``torch.clamp`` gives;
    * ``abs``: ``|d|`` (TRL's legacy ``kl_penalty="abs"``).

    Every estimator is exactly 0 at ``d = 0`` and finite for ``|d| <= 30`` in any input dtype
    (computed in fp32).

    Args:
        logprobs: float tensor of any shape and strides, the sampled policy's log-probs.
        ref_logprobs: float tensor of the same shape, the reference policy's log-probs.
        kl_estimator: one of ``k1``, ``k2``, ``k3``, ``low_var_kl``, ``abs`` (``kind=`` is a
            deprecated alias, ``FutureWarning``).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        fp32 tensor of the inputs' shape (fp64 if either input is fp64). Differentiable
        w.r.t. ``logprobs``, and w.r.t. ``ref_logprobs`` when it requires grad
        (``d kl / d ref = -d kl / d logp``).

    Example:
        >>> import torch, fused_rl
        >>> lp = torch.tensor([[0.0, -1.0]], requires_grad=True)
        >>> fused_rl.kl_estimate(lp, torch.tensor([[0.0, 0.0]]), kl_estimator="k2").tolist()
        [[0.0, 0.5]]
    """
    V.check_float(logprobs, "logprobs")
    V.check_float(ref_logprobs, "ref_logprobs")
    V.check_shape(ref_logprobs, logprobs.shape, "ref_logprobs", "logprobs.shape")
    V.check_same_device(logprobs=logprobs, ref_logprobs=ref_logprobs)
    V.check_choice(kl_estimator, KL_KINDS, "kl_estimator")
    ref.refuse_full(kl_estimator)
    if resolve_backend(backend, logprobs, ref_logprobs) == "reference":
        dtype = acc_dtype(logprobs, ref_logprobs)
        return ref.kl_estimate(logprobs.to(dtype), ref_logprobs.to(dtype), kl_estimator)
    kind = KL_KINDS.index(kl_estimator)
    out = _kl_estimate_op(as_rows2d(logprobs), as_rows2d(ref_logprobs), kind)
    return out.reshape(logprobs.shape)
