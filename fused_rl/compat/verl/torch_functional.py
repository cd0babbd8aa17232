"""Mirrors ``verl.utils.torch_functional``: ``logprobs_from_logits`` and
``entropy_from_logits`` (fused: the logits stream through :func:`fused_rl.token_logprobs` /
:func:`fused_rl.token_entropy`, no ``(..., V)`` temporary), ``clip_by_value`` and the masked
statistics (verl's op sequences, run under the half-precision mode by ``_accurate._run``).

``import verl.utils.torch_functional as verl_F`` becomes
``from fused_rl.compat import verl as verl_F`` (the package has every name of this module).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import _validation as V
from ...logprobs import token_entropy
from .._checks import check_index_range, gather_logprobs
from .._precision import original_half_precision
from ._accurate import _run
from ._precision_twins import _entropy_eager, _logprobs_eager

__all__ = [
    "clip_by_value",
    "entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]


def _check_labels(logits: Tensor, labels: Tensor) -> None:
    V.check_logits(logits, "logits")
    V.check_targets(labels, logits, "labels")
    check_index_range(labels, logits.shape[-1], "labels", "verl's logprobs_from_logits")


def logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.logprobs_from_logits``.

    ``log_softmax(logits, -1)`` gathered at ``labels``, fused.

    Args:
        logits: ``(..., V)`` float logits, any strides (``logits[:, -L - 1:-1]`` is not copied).
        labels: ``logits.shape[:-1]`` int64/int32 ids in ``[0, V)`` (out of range raises
            ``ValueError``).
        inplace_backward: accepted for compatibility; the fused backward writes one fresh
            gradient and never keeps a ``(..., V)`` activation.

    Returns:
        ``labels.shape`` log-probs in ``logits.dtype``; differentiable. In ``"original"``
        half-precision mode, fp16 / bf16 logits take verl's PyTorch path (a log-softmax in the
        logits' dtype per leading row).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> labels = torch.zeros(2, 3, dtype=torch.long)
        >>> verl_F.logprobs_from_logits(torch.zeros(2, 3, 4), labels)[0]
        tensor([-1.3863, -1.3863, -1.3863])
    """
    if original_half_precision(logits):
        _check_labels(logits, labels)
        return _logprobs_eager(logits, labels)
    return gather_logprobs(
        logits, labels, temperature=1.0, name="labels", original="verl's logprobs_from_logits"
    )


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.entropy_from_logits``.

    Entropy of ``softmax(logits)`` per position (``logsumexp - sum p z``), fused.

    Args:
        logits: ``(..., V)`` float logits, any strides.

    Returns:
        ``logits.shape[:-1]`` tensor in ``logits.dtype``; differentiable.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.entropy_from_logits(torch.zeros(1, 2))
        tensor([0.6931])
    """
    V.check_logits(logits, "logits")
    if original_half_precision(logits):
        return _entropy_eager(logits)
    return token_entropy(logits).to(logits.dtype)


def clip_by_value(x: Tensor, tensor_min: Tensor, tensor_max: Tensor) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.clip_by_value``: ``max(min(x, hi), lo)`` with
    tensor bounds.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.clip_by_value(torch.tensor([-2.0, 0.5, 3.0]), torch.tensor(-1.0),
        ...                      torch.tensor(1.0))
        tensor([-1.0000,  0.5000,  1.0000])
    """
    return torch.max(torch.min(x, tensor_max), tensor_min)


def _masked_sum(values, mask, axis=None):
    kept = torch.where(mask.bool(), values, 0.0)
    return (kept * mask).sum(axis=axis)


def _masked_mean(values, mask, axis=None):
    return _masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _masked_var(values, mask, unbiased=True):
    mean = _masked_mean(values, mask)
    variance = _masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        # a dtype probe has no values; a traced call cannot branch on them (an empty or
        # one-token mask then gives inf / NaN instead of the error)
        if not (count.is_meta or torch.compiler.is_compiling()):
            if count == 0:
                raise ValueError("At least one element in the mask has to be 1.")
            if count == 1:
                raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        variance = variance * (count / (count - 1))
    return variance


def _masked_whiten(values, mask, shift_mean=True):
    mean, var = _masked_mean(values, mask), _masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def masked_sum(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_sum``.

    ``sum(values * mask)`` where values outside the mask (even NaN) count as 0; ``axis``: an
    int, a tuple of ints or None (all).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_sum(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0]))
        tensor(1.)
    """
    return _run(_masked_sum, values, mask, axis)


def masked_mean(values: Tensor, mask: Tensor, axis=None) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_mean``.

    ``masked_sum / (mask.sum() + 1e-8)``: an empty mask gives 0.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([1, 1, 0]))
        tensor(2.)
    """
    return _run(_masked_mean, values, mask, axis)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_var``.

    Masked variance about the masked mean; ``unbiased`` applies Bessel's correction with the
    mask count and raises ``ValueError`` when that count is 0 or 1 (one host sync, as verl).

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_var(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([1, 1, 1, 0]))
        tensor(1.)
    """
    return _run(_masked_var, values, mask, unbiased)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Mirrors ``verl.utils.torch_functional.masked_whiten``.

    ``(values - mean) * rsqrt(var + 1e-8)`` with masked mean / unbiased variance; the default
    ``shift_mean=True`` gives zero mean, ``False`` adds the mean back (TRL's convention, the
    opposite of torchtune's ``whiten``). Positions outside the mask are transformed too.

    Example:
        >>> import torch
        >>> from fused_rl.compat import verl as verl_F
        >>> verl_F.masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
        tensor([-1.,  0.,  1.])
    """
    return _run(_masked_whiten, values, mask, shift_mean)
