"""Per-token tensors made whole before a chunk loop slices them, when traced on the CPU.

The ops from hidden states slice their per-token inputs and gradients chunk by chunk. When
such a tensor broadcasts a per-sequence value (an advantage of shape ``(B,)``, a
``seq-mean-token-mean`` weight, the gradient of either), Inductor fuses it into the chunk's
consumer with the index ``row // T``. torch 2.13's C++ backend then splits that loop (its
``try_loop_split``) into ``C // T`` times ``T`` iterations without checking that ``T``
divides the chunk's ``C`` rows: the rows past ``(C // T) T`` are never computed, and the
chunk reads memory nothing wrote (wrong values, or a target id out of bounds). CUDA's
Inductor has no such pass.

:func:`whole_rows` hands such a tensor to an op Inductor cannot see through, so it is
computed whole (``B T`` rows, which ``T`` divides) into its own buffer, and the chunks read
slices of that buffer. It costs one copy of the per-token values, and only while
``torch.compile`` or ``torch.export`` traces a call on CPU tensors; elsewhere (eager, CUDA)
it returns its argument.

Example:
    >>> import torch
    >>> from fused_rl._whole_rows import whole_rows
    >>> x = torch.arange(6.0).view(2, 3)
    >>> whole_rows(x) is x  # eager: nothing to do
    True
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("fused_rl::whole_rows", mutates_args=())
def _whole_rows_op(x: Tensor) -> Tensor:
    return x.new_empty(x.shape).copy_(x)


@_whole_rows_op.register_fake
def _whole_rows_fake(x: Tensor) -> Tensor:
    return x.new_empty(x.shape)


_whole_rows_op.register_autograd(lambda ctx, grad: grad)


def whole_rows(t: Tensor | None) -> Tensor | None:
    """``t`` (any shape), computed into its own contiguous buffer while a call on CPU
    tensors is traced (see the module's docstring); otherwise ``t`` itself. None stays
    None."""
    if t is None or t.device.type != "cpu" or not torch.compiler.is_compiling():
        return t
    return _whole_rows_op(t)
