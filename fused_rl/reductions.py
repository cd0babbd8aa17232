"""Masked reductions on token tensors: ``masked_sum``, ``masked_mean``, ``masked_var``,
``masked_whiten``.

Triton path (``kernels/token_ops/reductions.py``), deterministic, no host sync, fp32 accumulation
(fp64 for fp64 inputs):

* whole-tensor statistics: one flat launch writing per-block moments ``(n, sum, M2)`` plus one
  single-program launch merging them (Chan's update: the variance is one pass over the data);
* along one axis: one launch, one program per output element looping over the reduced axis;
* ``masked_whiten``: the two statistics launches, then one elementwise launch (the input is
  read twice: the minimum without a grid-wide barrier).

Backward: sum / mean / var have the closed form ``dx = w (g_sum + g_mean / n + g_var * 2 (x -
mean) / (n - c))``, one elementwise launch; whitening needs two sums of the upstream gradient
first (one flat launch plus a ``torch.sum`` over the per-block partials) and one elementwise
launch.

Each launcher is a :class:`fused_rl._ops.FusedOp` (``fused_rl::masked_moments_fwd``,
``fused_rl::masked_whiten_fwd`` and their ``*_bwd``): a ``torch.library`` custom op with fake and
autograd registrations for ``torch.compile``, a direct call in eager mode.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import COMPILE_OPTIONS, f32_pair, triton_acc
from ._ops import FusedOp
from .reference import reductions as ref
from .reference.logprobs import differentiable_once
from .reference.reductions import acc_dtype

BLOCK = 1024  # elements per program of the flat token-space kernels
BLOCK_P = 512  # partial columns per step of the single-program merge kernels
NUM_WARPS = 4

# ----------------------------------------------------------------------------- shared helpers
# (also used by fused_rl.values and fused_rl.kl)


def as_rows2d(x: Tensor) -> Tensor:
    """``x`` as a 2-D ``(R, C)`` tensor: a view for 0-, 1- and 2-D tensors (any strides), a
    reshape (a view when the leading dims merge, else a copy) for 3-D and more."""
    if x.dim() == 0:
        return x.reshape(1, 1)
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() == 2:
        return x
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def kernel_mask(mask: Tensor | None) -> Tensor | None:
    """Bool masks are read as uint8 (a free reinterpretation, strides kept)."""
    if mask is not None and mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    return mask


def mask_strides(mask: Tensor | None) -> tuple[int, int]:
    return (mask.stride(0), mask.stride(1)) if mask is not None else (0, 0)


def n_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


# ----------------------------------------------------------------------------- launchers


def masked_moments_fwd(
    x2d: Tensor, mask2d: Tensor | None, per_row: bool, with_var: bool, correction: float
) -> Tensor:
    """``(4, R)`` (``per_row``) or ``(4, 1)`` stats ``(n, sum, mean, var)`` of a 2-D view."""
    from .kernels.token_ops.reductions import (
        _masked_moments_finalize_kernel,
        _masked_moments_fwd_kernel,
        _masked_row_moments_fwd_kernel,
    )

    n_rows, n_cols = x2d.shape
    dtype = acc_dtype(x2d)
    acc = triton_acc(dtype)
    mask2d = kernel_mask(mask2d)
    m_arg = mask2d if mask2d is not None else x2d
    smr, smc = mask_strides(mask2d)
    if per_row:
        stats = torch.empty((4, n_rows), dtype=dtype, device=x2d.device)
        if n_rows > 0:
            _masked_row_moments_fwd_kernel[(n_rows,)](
                x2d, m_arg, stats, n_rows, n_cols, x2d.stride(0), x2d.stride(1), smr, smc,
                float(correction), HAS_MASK=mask2d is not None, WITH_VAR=with_var,
                BLOCK=BLOCK, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS,
            )  # fmt: skip
        return stats
    n_prog = n_blocks(x2d.numel())
    partials = torch.empty((3, n_prog), dtype=dtype, device=x2d.device)
    if n_prog > 0:
        _masked_moments_fwd_kernel[(n_prog,)](
            x2d, m_arg, partials, x2d.numel(), n_cols, x2d.stride(0), x2d.stride(1), smr, smc,
            HAS_MASK=mask2d is not None, WITH_VAR=with_var, BLOCK=BLOCK, ACC=acc,
            num_warps=NUM_WARPS, **COMPILE_OPTIONS,
        )  # fmt: skip
    stats = torch.empty((4, 1), dtype=dtype, device=x2d.device)
    _masked_moments_finalize_kernel[(1,)](
        partials, stats, n_prog, float(correction), BLOCK_P=BLOCK_P, ACC=acc, num_warps=NUM_WARPS,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return stats


def masked_moments_bwd(
    x2d: Tensor,
    mask2d: Tensor | None,
    stats: Tensor,
    grad_stats: Tensor,
    per_row: bool,
    with_var: bool,
    correction: float,
) -> Tensor:
    """Gradient w.r.t. ``x2d`` (contiguous, ``x2d.dtype``) of the stats under ``grad_stats``."""
    from .kernels.token_ops.reductions import _masked_moments_bwd_kernel

    grad = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
    if x2d.numel() == 0:
        return grad
    mask2d = kernel_mask(mask2d)
    smr, smc = mask_strides(mask2d)
    grad_stats = grad_stats.to(stats.dtype).contiguous()
    _masked_moments_bwd_kernel[(n_blocks(x2d.numel()),)](
        x2d, mask2d if mask2d is not None else x2d, stats, grad_stats, grad, x2d.numel(),
        x2d.shape[1], x2d.stride(0), x2d.stride(1), smr, smc, stats.stride(0),
        1 if per_row else 0, float(correction), HAS_MASK=mask2d is not None, WITH_VAR=with_var,
        BLOCK=BLOCK, ACC=triton_acc(stats.dtype), num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return grad


def masked_whiten_fwd(
    x2d: Tensor, mask2d: Tensor | None, keep_mean: bool, eps: float
) -> tuple[Tensor, Tensor]:
    """``(y, stats)``: whitened ``(R, C)`` tensor (contiguous) and the ``(4, 1)`` stats used."""
    from .kernels.token_ops.reductions import _masked_whiten_fwd_kernel

    stats = masked_moments_fwd(x2d, mask2d, False, True, 1.0)
    y = torch.empty(x2d.shape, dtype=stats.dtype, device=x2d.device)
    if x2d.numel() > 0:
        _masked_whiten_fwd_kernel[(n_blocks(x2d.numel()),)](
            x2d, stats, y, x2d.numel(), x2d.shape[1], x2d.stride(0), x2d.stride(1), *f32_pair(eps),
            KEEP_MEAN=keep_mean, BLOCK=BLOCK, ACC=triton_acc(stats.dtype), num_warps=NUM_WARPS,
            **COMPILE_OPTIONS,
        )  # fmt: skip
    return y, stats


def masked_whiten_bwd(
    x2d: Tensor, mask2d: Tensor | None, stats: Tensor, grad_y: Tensor, keep_mean: bool, eps: float
) -> Tensor:
    """Gradient of :func:`masked_whiten_fwd` w.r.t. ``x2d`` (contiguous, ``x2d.dtype``)."""
    from .kernels.token_ops.reductions import (
        _masked_whiten_bwd_kernel,
        _masked_whiten_bwd_partials_kernel,
    )

    grad = torch.empty(x2d.shape, dtype=x2d.dtype, device=x2d.device)
    n_prog = n_blocks(x2d.numel())
    if n_prog == 0:
        return grad
    acc = triton_acc(stats.dtype)
    partials = torch.empty((2, n_prog), dtype=stats.dtype, device=x2d.device)
    _masked_whiten_bwd_partials_kernel[(n_prog,)](
        x2d, grad_y, stats, partials, x2d.numel(), x2d.shape[1], x2d.stride(0), x2d.stride(1),
        grad_y.stride(0), grad_y.stride(1), BLOCK=BLOCK, ACC=acc, num_warps=NUM_WARPS,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    sums = partials.sum(dim=1)  # (2,): deterministic, tiny
    mask2d = kernel_mask(mask2d)
    smr, smc = mask_strides(mask2d)
    _masked_whiten_bwd_kernel[(n_prog,)](
        x2d, mask2d if mask2d is not None else x2d, grad_y, stats, sums, grad, x2d.numel(),
        x2d.shape[1], x2d.stride(0), x2d.stride(1), smr, smc, grad_y.stride(0),
        grad_y.stride(1), *f32_pair(eps), 1.0, KEEP_MEAN=keep_mean, HAS_MASK=mask2d is not None,
        BLOCK=BLOCK, ACC=acc, num_warps=NUM_WARPS, **COMPILE_OPTIONS,
    )  # fmt: skip
    return grad


# ----------------------------------------------------------------------------- fused ops


def _moments_fake(x2d, mask2d, per_row, with_var, correction):
    return x2d.new_empty((4, x2d.shape[0] if per_row else 1), dtype=acc_dtype(x2d))


def _grad_x_fake(x2d, *_args):
    return x2d.new_empty(x2d.shape)


def _moments_setup(ctx, inputs, output):
    x2d, mask2d, per_row, with_var, correction = inputs
    ctx.save_for_backward(x2d, mask2d, output)
    ctx.args = (per_row, with_var, correction)


def _moments_backward(ctx, grad_stats):
    x2d, mask2d, stats = ctx.saved_tensors
    grad = _masked_moments_bwd_op(x2d, mask2d, stats, grad_stats, *ctx.args)
    # the kernel takes the saved stats as constants, so a double backward must raise; a sum's
    # or mean's gradient does not depend on x (their Hessian is 0): only through grad_stats
    with_var = ctx.args[1]
    grad = differentiable_once(grad, grad_stats, *((x2d,) if with_var else ()))
    return (grad,) + (None,) * (len(ctx.needs_input_grad) - 1)


_masked_moments_bwd_op = FusedOp("masked_moments_bwd", masked_moments_bwd)
_masked_moments_bwd_op.register_fake(_grad_x_fake)
_masked_moments_op = FusedOp("masked_moments_fwd", masked_moments_fwd)
_masked_moments_op.register_fake(_moments_fake)
_masked_moments_op.register_autograd(_moments_backward, setup_context=_moments_setup, once=False)


def _whiten_fake(x2d, mask2d, keep_mean, eps):
    dtype = acc_dtype(x2d)
    return x2d.new_empty(x2d.shape, dtype=dtype), x2d.new_empty((4, 1), dtype=dtype)


def _whiten_setup(ctx, inputs, output):
    x2d, mask2d, keep_mean, eps = inputs
    _, stats = output
    ctx.save_for_backward(x2d, mask2d, stats)
    ctx.args = (keep_mean, eps)
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the unused stats


def _whiten_backward(ctx, grad_y, _grad_stats):
    n_inputs = len(ctx.needs_input_grad)
    if grad_y is None:
        return (None,) * n_inputs
    x2d, mask2d, stats = ctx.saved_tensors
    grad = _masked_whiten_bwd_op(x2d, mask2d, stats, grad_y, *ctx.args)
    grad = differentiable_once(grad, x2d, grad_y)  # as in _moments_backward
    return (grad,) + (None,) * (n_inputs - 1)


_masked_whiten_bwd_op = FusedOp("masked_whiten_bwd", masked_whiten_bwd)
_masked_whiten_bwd_op.register_fake(_grad_x_fake)
_masked_whiten_op = FusedOp("masked_whiten_fwd", masked_whiten_fwd)
_masked_whiten_op.register_fake(_whiten_fake)
_masked_whiten_op.register_autograd(_whiten_backward, setup_context=_whiten_setup, once=False)


# ----------------------------------------------------------------------------- public API


def _check_x(x: Tensor, mask: Tensor | None) -> None:
    V.check_float(x, "x")
    V.check_mask(mask, "mask", x.shape, "x.shape")
    V.check_same_device(x=x, mask=mask)


def _normalize_dim(dim, x: Tensor) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be None or a single int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D x")
    return dim % x.dim()


def _upcast(x: Tensor) -> Tensor:
    return x.to(acc_dtype(x))


def _rows(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else as_rows2d(mask)


def _stats(x: Tensor, mask: Tensor | None, dim: int | None, with_var: bool, correction: float):
    """Triton stats ``(n, sum, mean, var)``: four 0-dim tensors (``dim=None``) or four tensors
    of ``x``'s shape without ``dim``."""
    if dim is None:
        stats = _masked_moments_op(as_rows2d(x), _rows(mask), False, with_var, correction)
        return stats[:, 0]
    x_moved = x.movedim(dim, -1)
    x2d = as_rows2d(x_moved)
    m2d = None if mask is None else as_rows2d(mask.movedim(dim, -1))
    stats = _masked_moments_op(x2d, m2d, True, with_var, correction)
    return stats.reshape(4, *x_moved.shape[:-1])


def masked_sum(
    x: Tensor, mask: Tensor | None = None, *, dim: int | None = None, backend: str = "auto"
) -> Tensor:
    """``sum(mask * x)`` over all elements (``dim=None``) or along one ``dim``.

    Args:
        x: floating tensor of any shape and strides (the kernels read 0/1/2-D tensors in place;
            3-D+ tensors are reshaped, which copies only when their leading dims cannot merge).
        mask: None (every element counts), or a tensor of ``x``'s shape: bool (True counts)
            or float / integer per-token weights ``w >= 0`` (``sum(w * x)``; the mean is
            ``sum(w * x) / sum(w)``). Positions with ``w = 0`` contribute exactly 0 (even NaN /
            inf ones) and get 0 gradient. A negative weight raises ``ValueError`` in eager
            mode (one host sync; ``fused_rl.config.check_values = False`` turns it off) and
            makes the result NaN when unchecked (``torch.compile``). Not differentiable.
        dim: keyword-only, None or one int (any axis of any ndim; ``0``, ``1``, ``-1`` for
            ``(B, T)``).

    Returns:
        fp32 (fp64 for fp64 ``x``): 0-dim, or ``x``'s shape without ``dim``. Differentiable
        w.r.t. ``x`` (gradient in ``x``'s dtype).

    Example:
        >>> import torch, fused_rl
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> m = torch.tensor([[True, True, False], [True, False, False]])
        >>> fused_rl.masked_sum(x, m).item(), fused_rl.masked_sum(x, m, dim=1).tolist()
        (7.0, [3.0, 4.0])
    """
    _check_x(x, mask)
    mask = None if mask is None else mask.detach()  # not differentiable, on every backend
    dim = _normalize_dim(dim, x)
    if resolve_backend(backend, x, mask) == "reference":
        return ref.masked_sum(_upcast(x), mask, dim)
    return _stats(x, mask, dim, False, 0.0)[1]


def masked_mean(
    x: Tensor, mask: Tensor | None = None, *, dim: int | None = None, backend: str = "auto"
) -> Tensor:
    """``sum(mask * x) / sum(mask)`` over all elements or along ``dim``: the mean of the
    counted elements for a bool mask, the weighted mean for float / integer weights ``>= 0``.
    An empty mask (or an empty row along ``dim``, or weights summing to 0) gives 0, not NaN.

    Exact division, no ``+ 1e-8`` (torchtune's ``masked_mean`` adds it to the denominator;
    ``fused_rl.ppo_loss`` reproduces that where torchtune's PPO needs it). Arguments and
    returns as :func:`masked_sum`.

    Example:
        >>> import torch, fused_rl
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> m = torch.tensor([[True, True, False], [False, False, False]])
        >>> fused_rl.masked_mean(x, m).item(), fused_rl.masked_mean(x, m, dim=1).tolist()
        (1.5, [1.5, 0.0])
    """
    _check_x(x, mask)
    mask = None if mask is None else mask.detach()  # not differentiable, on every backend
    dim = _normalize_dim(dim, x)
    if resolve_backend(backend, x, mask) == "reference":
        return ref.masked_mean(_upcast(x), mask, dim)
    return _stats(x, mask, dim, False, 0.0)[2]


def masked_var(
    x: Tensor, mask: Tensor | None = None, *, unbiased: bool = True, backend: str = "auto"
) -> Tensor:
    """Variance of the masked elements, centred on their mean internally (TRL's convention;
    torchtune's ``masked_var`` expects centred input).

    ``sum(mask (x - mean)^2) / (n - 1)`` with ``mean`` the masked (weighted) mean and ``n =
    sum(mask)`` (``/ n`` when not ``unbiased``): float / integer weights ``>= 0`` act as
    frequency weights. With no degree of freedom left (``n <= 1`` unbiased, ``n = 0`` biased)
    it is 0, never NaN or an error (TRL raises / returns inf there). Whole-tensor only.
    Arguments (a negative weight included) and returns as :func:`masked_sum` (0-dim).

    Example:
        >>> import torch, fused_rl
        >>> fused_rl.masked_var(torch.tensor([1.0, 2.0, 3.0, 100.0]),
        ...                     torch.tensor([True, True, True, False])).item()
        1.0
    """
    _check_x(x, mask)
    mask = None if mask is None else mask.detach()  # not differentiable, on every backend
    correction = 1.0 if unbiased else 0.0
    if resolve_backend(backend, x, mask) == "reference":
        return ref.masked_var(_upcast(x), mask, unbiased=unbiased)
    return _stats(x, mask, None, True, correction)[3]


def masked_whiten(
    x: Tensor,
    mask: Tensor | None = None,
    *,
    keep_mean: bool = False,
    eps: float = 1e-8,
    backend: str = "auto",
) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with the masked mean and the unbiased masked
    variance (:func:`masked_var`); ``keep_mean=True`` adds the mean back.

    Every position is transformed, masked ones included (with the statistics of the counted
    ones), as TRL's and torchtune's whiten do; zero the padding afterwards if needed. The
    default zero-mean output is TRL's ``masked_whiten(shift_mean=True)``; torchtune's
    ``whiten(shift_mean=True)`` is ``keep_mean=True``.

    A NaN / inf at a masked position never reaches the statistics (only its own output),
    nor any gradient when its upstream gradient is 0 (padding zeroed downstream). A nonzero
    gradient fed into such a NaN output gives NaN gradients: every output depends on the
    variance.

    Args:
        x, mask: as :func:`masked_sum` (float / integer masks weigh the mean and variance,
            :func:`masked_var`).
        keep_mean: add the masked mean back after scaling.
        eps: added to the variance, ``>= 0``.

    Returns:
        fp32 tensor of ``x``'s shape (fp64 for fp64 ``x``), differentiable w.r.t. ``x``.

    Example:
        >>> import torch, fused_rl
        >>> fused_rl.masked_whiten(torch.tensor([1.0, 2.0, 3.0]), eps=0.0).tolist()
        [-1.0, 0.0, 1.0]
    """
    _check_x(x, mask)
    mask = None if mask is None else mask.detach()  # not differentiable, on every backend
    V.check_nonnegative(eps, "eps")
    if resolve_backend(backend, x, mask) == "reference":
        return ref.masked_whiten(_upcast(x), mask, keep_mean=keep_mean, eps=eps)
    y, _ = _masked_whiten_op(as_rows2d(x), _rows(mask), bool(keep_mean), float(eps))
    return y.reshape(x.shape)
