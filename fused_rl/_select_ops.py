"""The k-th largest logit of each row, streamed by radix select (``kernels/vocab/select.py``).

Where a caller needs only the value that ranks ``k``-th (verl's top-k overlap diagnostic:
which of the teacher's ids are among the student's own top ``k``), ``torch.topk`` sorts a
``k``-wide selection per row and writes values and indices; this reads each row ``B / 8``
times for ``B``-bit logits (2 reads of a bf16 row), writes 4 bytes a row (8 for fp64) and
allocates nothing else.
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

DIGIT_BITS = 8  # kernels/vocab/select.py: the key is chosen 8 bits a pass
BINS = 1 << DIGIT_BITS


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


def _histogram_launch(logits3d: Tensor, prefix: Tensor, shift: int, first: bool) -> Tensor:
    """One radix-select pass over each row of ``(outer, inner, V)`` logits (any strides,
    ``V`` may be 0): ``(outer * inner, 257)`` int32, per row the 256-bin histogram of the key
    digit at ``shift`` among the keys whose higher digits equal ``prefix`` (``(outer *
    inner,)`` int64; unread when ``first``) and, ``first``, the NaN count (else 0). One
    launch."""
    from .kernels.vocab.select import _digit_histogram_kernel

    outer, inner, vocab = logits3d.shape
    hist = torch.empty((outer * inner, BINS + 1), dtype=torch.int32, device=logits3d.device)
    if hist.numel() == 0:
        return hist
    _digit_histogram_kernel[(outer * inner,)](
        logits3d, prefix, hist, inner, vocab, *logits3d.stride(), shift, FIRST=first,
        **vocab_launch(max(vocab, 1), writes=False),
    )  # fmt: skip
    return hist


digit_histogram_op = FusedOp("kth_digit_histogram", _histogram_launch)
digit_histogram_op.register_fake(
    lambda logits3d, prefix, shift, first: logits3d.new_empty(
        (logits3d.shape[0] * logits3d.shape[1], BINS + 1), dtype=torch.int32
    )
)


def choose_digit(hist: Tensor, need: Tensor, prefix: Tensor) -> tuple[Tensor, Tensor]:
    """The radix select's step from one pass's histograms (``(n_rows, 257)``, summed over
    every rank that holds a part of the rows): the digit is the largest whose bin, counted
    with the bins above it, holds ``need`` (``(n_rows,)`` int64, the values of the current
    prefix still to pass over, the k-th included). Returns the new ``(need, prefix)``."""
    counts = hist[:, :BINS].long()
    at_or_above = counts.flip(-1).cumsum(-1).flip(-1)
    digit = ((at_or_above >= need[:, None]).sum(-1, keepdim=True) - 1).clamp_min(0)
    above = at_or_above.gather(-1, digit) - counts.gather(-1, digit)
    return need - above[:, 0], torch.bitwise_left_shift(prefix, DIGIT_BITS) | digit[:, 0]


def key_value(key: Tensor, dtype: torch.dtype) -> Tensor:
    """The float of ``dtype`` whose order-preserving key (``kernels/vocab/select.py``
    ``_key``, all its bits chosen) is ``key`` (int64; a 64-bit key's bits as they are), in
    fp32 (fp64 for fp64)."""
    bits = torch.finfo(dtype).bits
    if bits == 64:
        sign = torch.iinfo(torch.int64).min
        raw = torch.where(key < 0, key ^ sign, ~key)
        return raw.view(torch.float64)
    full = (1 << bits) - 1
    positive = (key >> (bits - 1)) == 1
    raw = torch.where(positive, key ^ (1 << (bits - 1)), ~key & full)
    signed = {16: torch.int16, 32: torch.int32}[bits]
    return raw.to(signed).view(dtype).to(stats_dtype(dtype))


def kth_largest_by_passes(logits3d: Tensor, k: int, sum_over_parts=None) -> Tensor:
    """The radix select one pass a launch (``digit_histogram_op``, ``choose_digit``,
    ``key_value``): the ``k``-th largest of each row of ``(outer, inner, V)`` logits as
    ``(outer * inner,)`` fp32 (fp64 for fp64), NaN for a row holding a NaN.
    ``sum_over_parts(hist)``: sums each pass's histograms in place over every part of the
    rows (a vocabulary split across ranks: an all-reduce) before the digit is chosen."""
    bits = torch.finfo(logits3d.dtype).bits
    n_rows = logits3d.shape[0] * logits3d.shape[1]
    need = torch.full((n_rows,), k, dtype=torch.int64, device=logits3d.device)
    prefix = torch.zeros_like(need)
    for p in range(bits // DIGIT_BITS):
        hist = digit_histogram_op(logits3d, prefix, bits - DIGIT_BITS * (p + 1), p == 0)
        if sum_over_parts is not None:
            sum_over_parts(hist)
        if p == 0:
            nan_rows = hist[:, -1] > 0
        need, prefix = choose_digit(hist, need, prefix)
    return torch.where(nan_rows, float("nan"), key_value(prefix, logits3d.dtype))


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
    launch, 4 bytes written a row (8 for fp64).

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
