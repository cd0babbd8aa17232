"""Continuous actions: diagonal-Gaussian ``gaussian_logprob`` and ``gaussian_entropy``.

``Independent(Normal(mu, sigma), 1)`` semantics (DI-engine's ``ppo_error_continuous``): one
value per action, summed over the last (action) dimension, so the per-sample log-prob feeds
the clipped surrogate and value loss of the token-space losses unchanged.

The Triton path is four ``fused_rl._ops.FusedOp`` launchers, one launch each:
``fused_rl::gaussian_logprob_fwd`` / ``_bwd`` and ``fused_rl::gaussian_entropy_fwd`` /
``_bwd``: custom ops with fake and autograd registrations (``torch.compile(fullgraph=True)``
traces through them), direct calls in eager mode. Inputs broadcast as in
``torch.distributions``; a broadcast input (say a state-independent ``sigma`` of shape
``(N,)``) is read through stride 0, never copied, and its gradient is summed by autograd's
``expand`` backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, next_power_of_2, triton_acc
from ._ops import FusedOp
from .reference import continuous as ref

MAX_BLOCK_N = 64
TILE = 1024  # elements per (BLOCK_R x BLOCK_N) tile


def _blocks(n_cols: int) -> tuple[int, int]:
    block_n = max(2, min(next_power_of_2(n_cols), MAX_BLOCK_N))
    return TILE // block_n, block_n


def _grid(n_rows: int, block_r: int) -> tuple[int]:
    return (-(-n_rows // block_r),)


# ----------------------------------------------------------------------------- launchers


def gaussian_logprob_fwd(mu: Tensor, sigma: Tensor, actions: Tensor) -> Tensor:
    """Launch the log-prob kernel on ``(R, N)`` views (any strides); ``(R,)`` output."""
    from .kernels.token_ops.gaussian import _gaussian_logprob_fwd_kernel

    n_rows, n_cols = mu.shape
    dtype = ref.acc_dtype(mu, sigma, actions)
    out = torch.empty((n_rows,), dtype=dtype, device=mu.device)
    if n_rows == 0:
        return out
    block_r, block_n = _blocks(n_cols)
    _gaussian_logprob_fwd_kernel[_grid(n_rows, block_r)](
        mu,
        sigma,
        actions,
        out,
        n_rows,
        n_cols,
        mu.stride(0),
        mu.stride(1),
        sigma.stride(0),
        sigma.stride(1),
        actions.stride(0),
        actions.stride(1),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ACC=triton_acc(dtype),
        **COMPILE_OPTIONS,
    )
    return out


def gaussian_logprob_bwd(
    mu: Tensor, sigma: Tensor, actions: Tensor, grad_out: Tensor
) -> tuple[Tensor, Tensor]:
    """Launch the log-prob backward: contiguous ``(R, N)`` grads, d/dmu in the wider of mu's
    and the actions' dtypes (the actions' gradient is its negation), d/dsigma in sigma's."""
    from .kernels.token_ops.gaussian import _gaussian_logprob_bwd_kernel

    n_rows, n_cols = mu.shape
    # d/dmu in the wider of mu's and the actions' dtypes: d/dactions = -d/dmu must not be
    # rounded to a bf16 mu's precision when the actions are fp32
    wide = torch.promote_types(mu.dtype, actions.dtype)
    grad_mu = torch.empty((n_rows, n_cols), dtype=wide, device=mu.device)
    grad_sigma = torch.empty((n_rows, n_cols), dtype=sigma.dtype, device=mu.device)
    if grad_mu.numel() == 0:
        return grad_mu, grad_sigma
    block_r, block_n = _blocks(n_cols)
    _gaussian_logprob_bwd_kernel[_grid(n_rows, block_r)](
        mu,
        sigma,
        actions,
        grad_out,
        grad_mu,
        grad_sigma,
        n_rows,
        n_cols,
        mu.stride(0),
        mu.stride(1),
        sigma.stride(0),
        sigma.stride(1),
        actions.stride(0),
        actions.stride(1),
        grad_out.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ACC=triton_acc(ref.acc_dtype(mu, sigma, actions)),
        **COMPILE_OPTIONS,
    )
    return grad_mu, grad_sigma


def gaussian_entropy_fwd(sigma: Tensor) -> Tensor:
    """Launch the entropy kernel on an ``(R, N)`` view; ``(R,)`` output."""
    from .kernels.token_ops.gaussian import _gaussian_entropy_fwd_kernel

    n_rows, n_cols = sigma.shape
    dtype = ref.acc_dtype(sigma)
    out = torch.empty((n_rows,), dtype=dtype, device=sigma.device)
    if n_rows == 0:
        return out
    block_r, block_n = _blocks(n_cols)
    _gaussian_entropy_fwd_kernel[_grid(n_rows, block_r)](
        sigma,
        out,
        n_rows,
        n_cols,
        sigma.stride(0),
        sigma.stride(1),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ACC=triton_acc(dtype),
        **COMPILE_OPTIONS,
    )
    return out


def gaussian_entropy_bwd(sigma: Tensor, grad_out: Tensor) -> Tensor:
    """Launch the entropy backward: contiguous ``(R, N)`` grad in sigma's dtype."""
    from .kernels.token_ops.gaussian import _gaussian_entropy_bwd_kernel

    n_rows, n_cols = sigma.shape
    grad_sigma = torch.empty((n_rows, n_cols), dtype=sigma.dtype, device=sigma.device)
    if grad_sigma.numel() == 0:
        return grad_sigma
    block_r, block_n = _blocks(n_cols)
    _gaussian_entropy_bwd_kernel[_grid(n_rows, block_r)](
        sigma,
        grad_out,
        grad_sigma,
        n_rows,
        n_cols,
        sigma.stride(0),
        sigma.stride(1),
        grad_out.stride(0),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        ACC=triton_acc(ref.acc_dtype(sigma)),
        **COMPILE_OPTIONS,
    )
    return grad_sigma


# ----------------------------------------------------------------------------- fused ops


def _logprob_fake(mu, sigma, actions):
    return mu.new_empty(mu.shape[:1], dtype=ref.acc_dtype(mu, sigma, actions))


def _logprob_bwd_fake(mu, sigma, actions, grad_out):
    wide = torch.promote_types(mu.dtype, actions.dtype)
    return mu.new_empty(mu.shape, dtype=wide), sigma.new_empty(mu.shape)


def _logprob_setup(ctx, inputs, output):
    mu, sigma, actions = inputs
    ctx.save_for_backward(mu, sigma, actions)


def _logprob_backward(ctx, grad_out):
    mu, sigma, actions = ctx.saved_tensors
    grad_wide, grad_sigma = _logprob_bwd_op(mu, sigma, actions, grad_out)
    # d/da = -d/dmu; only sampled-with-reparameterisation actions ever need it
    grad_act = (-grad_wide).to(actions.dtype) if ctx.needs_input_grad[2] else None
    return grad_wide.to(mu.dtype), grad_sigma, grad_act


_logprob_bwd_op = FusedOp("gaussian_logprob_bwd", gaussian_logprob_bwd)
_logprob_bwd_op.register_fake(_logprob_bwd_fake)
_logprob_op = FusedOp("gaussian_logprob_fwd", gaussian_logprob_fwd)
_logprob_op.register_fake(_logprob_fake)
_logprob_op.register_autograd(_logprob_backward, setup_context=_logprob_setup)


def _entropy_fake(sigma):
    return sigma.new_empty(sigma.shape[:1], dtype=ref.acc_dtype(sigma))


def _entropy_bwd_fake(sigma, grad_out):
    return sigma.new_empty(sigma.shape)


def _entropy_setup(ctx, inputs, output):
    (sigma,) = inputs
    ctx.save_for_backward(sigma)


def _entropy_backward(ctx, grad_out):
    (sigma,) = ctx.saved_tensors
    return _entropy_bwd_op(sigma, grad_out)


_entropy_bwd_op = FusedOp("gaussian_entropy_bwd", gaussian_entropy_bwd)
_entropy_bwd_op.register_fake(_entropy_bwd_fake)
_entropy_op = FusedOp("gaussian_entropy_fwd", gaussian_entropy_fwd)
_entropy_op.register_fake(_entropy_fake)
_entropy_op.register_autograd(_entropy_backward, setup_context=_entropy_setup)


# ----------------------------------------------------------------------------- public API


def _check_sigma_positive(sigma: Tensor) -> None:
    """Eager-mode check (one host sync); skipped under compile / graph capture / when
    ``fused_rl.config.check_values`` is False, where sigma <= 0 gives NaN / inf instead."""
    if V.value_checks_enabled(sigma) and not bool((sigma > 0).all()):
        raise ValueError("sigma must be > 0 everywhere (got a value <= 0 or NaN)")


def _broadcast_shape(**tensors: Tensor) -> torch.Size:
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError as err:
        shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in tensors.items())
        raise ValueError(f"shapes do not broadcast: {shapes}") from err
    if len(shape) == 0:
        raise ValueError("expected (..., N) inputs with an action dimension, got 0-dim tensors")
    return shape


def _rows(x: Tensor, shape: torch.Size) -> Tensor:
    """``x`` broadcast to ``shape`` as an ``(R, N)`` view (a copy only when the leading dims
    cannot be merged by a view, e.g. a strided 3-D slice)."""
    return x.expand(shape).reshape(math.prod(shape[:-1]), shape[-1])


def _summed_wide(x: Tensor, shape: torch.Size, acc: torch.dtype) -> Tensor:
    """``x`` in ``acc`` (the accumulation dtype) when it is narrower, broadcasts to ``shape``
    and needs a gradient: autograd's expand backward sums the per-element gradients in the
    input's dtype, so each share was rounded first (fuzz: a ``(N,)`` bf16 ``mu`` for
    ``(R, N)`` actions lost 14% of a sum with cancellation; an fp32 ``sigma`` next to fp64
    actions summed shares past the fp32 range to ``inf - inf = NaN``). One cast of the small
    tensor each way: the sum runs in ``acc`` and is rounded once, as on the reference."""
    wide_sum = x.requires_grad and torch.is_grad_enabled() and x.numel() != math.prod(shape)
    return x.to(acc) if wide_sum and x.dtype != acc else x


def gaussian_logprob(
    mu: Tensor, sigma: Tensor, actions: Tensor, *, backend: str = "auto"
) -> Tensor:
    """Log-density of ``actions`` under ``Independent(Normal(mu, sigma), 1)``.

    ``sum_n [ -(a_n - mu_n)^2 / (2 sigma_n^2) - log sigma_n - 0.5 log(2 pi) ]``.

    Args:
        mu, sigma, actions: float tensors broadcasting to ``(..., N)`` (``N`` = action dims),
            any strides. Differentiable w.r.t. ``mu`` and ``sigma`` (and ``actions``).
        backend: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns:
        ``(...)`` fp32 (fp64 if an input is fp64). Gradients have each input's dtype.

    ``sigma <= 0`` (or NaN) raises ``ValueError`` in eager mode (one host sync, see
    ``fused_rl.config.check_values``); under ``torch.compile``, CUDA-graph capture or with
    the check off it yields NaN / inf, as the formula does.

    Gradients, on both backends: ``d mu = (g z) / sigma``, ``d sigma = d mu z - g / sigma``
    with ``z = (a - mu) / sigma``, in that order, so they are finite wherever the float64
    gradient fits the dtype (a tiny ``sigma`` such as ``1e-20`` included); a sample whose
    upstream gradient ``g`` is 0 (a ratio ``exp(-inf) = 0``, a clipped one) gets exact zeros,
    never ``0 * inf = NaN`` from a log-prob that overflowed to ``-inf``. The gradient of a
    broadcast input is summed in the accumulation dtype and rounded once.

    Example:
        >>> import torch, fused_rl
        >>> mu = torch.zeros(4, 3, requires_grad=True)
        >>> log_std = torch.zeros(3, requires_grad=True)  # state-independent, broadcast
        >>> lp = fused_rl.gaussian_logprob(mu, log_std.exp(), torch.randn(4, 3))
        >>> lp.shape
        torch.Size([4])
        >>> lp.mean().backward()
        >>> log_std.grad.shape
        torch.Size([3])
    """
    for name, t in (("mu", mu), ("sigma", sigma), ("actions", actions)):
        V.check_float(t, name)
    V.check_same_device(mu=mu, sigma=sigma, actions=actions)
    shape = _broadcast_shape(mu=mu, sigma=sigma, actions=actions)
    _check_sigma_positive(sigma)
    which = resolve_backend(backend, mu, sigma, actions)
    if which == "reference":
        return ref.gaussian_logprob(mu, sigma, actions)
    acc = ref.acc_dtype(mu, sigma, actions)
    mu, sigma, actions = (_summed_wide(x, shape, acc) for x in (mu, sigma, actions))
    out = _logprob_op(_rows(mu, shape), _rows(sigma, shape), _rows(actions, shape))
    return out.reshape(shape[:-1])


def gaussian_entropy(sigma: Tensor, *, backend: str = "auto") -> Tensor:
    """Entropy of ``Independent(Normal(mu, sigma), 1)``: ``sum_n 0.5 + 0.5 log(2 pi) +
    log sigma_n`` (independent of ``mu``).

    Args:
        sigma: ``(..., N)`` float tensor, any strides; differentiable.

    Returns:
        ``(...)`` fp32 (fp64 for fp64 sigma). ``sigma <= 0``: as in :func:`gaussian_logprob`.

    Example:
        >>> import torch, fused_rl
        >>> round(fused_rl.gaussian_entropy(torch.ones(1, 2)).item(), 4)  # 2 * 1.4189
        2.8379
    """
    V.check_float(sigma, "sigma")
    shape = _broadcast_shape(sigma=sigma)
    _check_sigma_positive(sigma)
    which = resolve_backend(backend, sigma)
    if which == "reference":
        return ref.gaussian_entropy(sigma)
    return _entropy_op(_rows(sigma, shape)).reshape(shape[:-1])
