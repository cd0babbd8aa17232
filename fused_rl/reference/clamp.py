"""``clamp`` whose gradient passes on its bounds, whatever torch's version.

torch 2.14 changed ``torch.clamp``'s gradient where the input sits exactly on a bound: 0 for
a Python-number bound, half for a tensor bound (torch 2.13 passes it whole), and made it pass
where a tensor bound is NaN (0 up to torch 2.13). The kernels pass it whole on the bounds:
a ratio of exactly 1 on a clip band of width 0 (an on-policy step with ``eps = 0``) gets the
policy gradient. The reference says so here instead of inheriting the version's choice, so
both backends agree on every torch.

Example:
    >>> import torch
    >>> from fused_rl.reference.clamp import clamp
    >>> r = torch.ones(2, requires_grad=True)
    >>> clamp(r, 1.0, 1.0).sum().backward(); r.grad.tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import torch
from torch import Tensor


def clamp(x: Tensor, lo: float | Tensor | None = None,
          hi: float | Tensor | None = None) -> Tensor:  # fmt: skip
    """``torch.clamp(x, lo, hi)`` (numbers or constant tensors; None: no bound) with gradient
    1 where ``lo <= x <= hi``, bounds included, and 0 elsewhere, a NaN bound's position
    included (the value is NaN there either way)."""
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return torch.where(inside, x, torch.clamp(x.detach(), lo, hi))
