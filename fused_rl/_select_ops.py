"""The k-th largest logit of each row, streamed by radix select (``kernels/vocab/select.py``).

Where a caller needs only the value that ranks ``k``-th (verl's top-k overlap diagnostic:
which of the teacher's ids are among the student's own top ``k``), ``torch.topk`` sorts a
``k``-wide selection per row and writes values and indices; this reads each row ``B / 8``
times for ``B``-bit logits (2 reads of a bf16 row), writes 4 bytes a row and allocates
nothing else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _validation as V
from ._backend import resolve_backend
from ._launch import stats_dtype, triton_acc, vocab_launch
from ._ops import FusedOp
from ._shapes import as_rows3d
from .reference.truncated import kth_largest as kth_largest_reference


def _launch(logits3d: Tensor, k: int) -> Tensor:
    """The ``k``-th largest of each row of ``(outer, inner, V)`` logits (any strides), as a
    contiguous ``(outer * inner,)`` fp32 (fp64 for fp64 logits). One launch."""
    from .kernels.vocab.select import _kth_largest_kernel

    outer, inner, vocab = logits3d.shape
    out = torch.empty((outer * inner,), dtype=stats_dtype(logits3d.dtype), device=logits3d.device)
    if out.numel() == 0:
        return out
    _kth_largest_kernel[(outer * inner,)](
        logits3d, out, inner, vocab, *logits3d.stride(), k, ACC=triton_acc(logits3d.dtype),
        **vocab_launch(vocab, writes=False),
    )  # fmt: skip
    return out


kth_largest_op = FusedOp("kth_largest", _launch)
kth_largest_op.register_fake(
    lambda logits3d, k: logits3d.new_empty(
        (logits3d.shape[0] * logits3d.shape[1],), dtype=stats_dtype(logits3d.dtype)
    )
)


def kth_largest(logits: Tensor, k: int, *, backend: str = "auto") -> Tensor:
    """The ``k``-th largest of each row of ``(..., V)`` logits, ties counted with their
    multiplicity (``torch.topk(logits, k).values[..., -1]``), never differentiable.

    Args:
        logits: ``(..., V)`` float (bf16, fp16, fp32 or fp64), any strides.
        k: ``1 <= k <= V``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (``torch.topk``).

    Returns:
        ``(...)`` fp32 (fp64 for fp64 logits): the logit's exact value; NaN for a row holding
        a NaN.

    Cost (Triton): ``B / 8`` reads of the logits for ``B``-bit floats (2 for bf16), one
    launch, ``4`` bytes written a row.

    Example:
        >>> import torch
        >>> from fused_rl._select_ops import kth_largest
        >>> kth_largest(torch.tensor([[3.0, 1.0, 3.0, 2.0]]), 2)
        tensor([3.])
    """
    V.check_logits(logits, "logits")
    V.check_positive_int(k, "k")
    vocab = logits.shape[-1]
    if k > vocab:
        raise ValueError(f"k must be at most the vocabulary size {vocab}, got {k}")
    if resolve_backend(backend, logits) == "reference":
        return kth_largest_reference(logits.detach(), k)
    return kth_largest_op(as_rows3d(logits.detach()), k).reshape(logits.shape[:-1])
