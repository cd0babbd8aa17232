"""Shape helpers shared by the Triton launchers and the references."""

from __future__ import annotations

import torch


def as_rows3d(logits: torch.Tensor) -> torch.Tensor:
    """View ``(..., V)`` logits as ``(outer, inner, V)`` without copying.

    Every strided layout of a 2-D or 3-D tensor works as it is (``logits[:, :-1]`` included):
    the kernels take the three strides. Only a 4-D+ tensor whose leading dims cannot be merged
    by a view is copied.
    """
    if logits.dim() == 1:
        return logits.view(1, 1, -1)
    if logits.dim() == 2:
        return logits.unsqueeze(0)
    if logits.dim() == 3:
        return logits
    outer = logits.shape[:-2].numel()  # not -1: ambiguous when a dim is 0
    return logits.reshape(outer, logits.shape[-2], logits.shape[-1])
