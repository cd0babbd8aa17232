"""GEMMs of 16-bit operands whose product is kept in a wider (fp32 / fp64) accumulator.

The chunked lm_head ops (``fused_rl.linear``, ``fused_rl.linear_distill``) accumulate
``dW += dz^T h`` over chunks in fp32 for a bf16 / fp16 head, and some of their logits and
hidden-state gradients are fp32 products of 16-bit operands. Rounding each chunk's product
to 16 bits first would lose what the accumulator is there to keep, so:

* :func:`addmm_wide` (``acc += a @ b``) and :func:`mm_wide` (``a @ b`` in a wider dtype)
  take torch's GEMM with ``out_dtype=`` where torch offers it (CUDA, torch >= 2.8: fp16 /
  bf16 operands of one dtype into fp32): the 16-bit GEMM at its full rate, the product
  accumulated straight into the fp32 output, no copy of either operand;
* else the same product on copies of the operands in the wide dtype (an fp32 / fp64 GEMM).
  Which of the two a device type has is found out once, by trying, and remembered
  (``_MM_OUT_DTYPE``).

Traced (a bare ``make_fx`` / ``torch.export`` over a chunk loop; under ``torch.compile``
the ops from hidden states run their chunk loops inside opaque ops, so their GEMMs run
there as in eager mode), the eligible calls record themselves as the
custom ops ``fused_rl::addmm_wide_`` and ``fused_rl::mm_wide``: a traced call cannot try a
GEMM and fall back, and Inductor does not lower ``addmm`` / ``mm`` with ``out_dtype=``
(torch 2.13), so the graph holds the op and the op, run eagerly, makes the same choice as
an eager call. Inductor writes ``addmm_wide_`` in place into its accumulator (no copy of
``dW`` per chunk). The other widenings (an fp64 accumulator, mixed operands), operands
autograd tracks and calls under a functorch transform take the upcast GEMM.

Example:
    >>> import torch
    >>> from fused_rl._wide_gemm import addmm_wide
    >>> acc = torch.zeros(2, 2)
    >>> a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    >>> addmm_wide(acc, a, a); acc.tolist()
    [[7.0, 10.0], [15.0, 22.0]]
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# (device type, GEMM) -> torch offers that GEMM with out_dtype= on that device type
_MM_OUT_DTYPE: dict[tuple[str, str], bool] = {}

# the one widening torch's GEMMs offer with out_dtype= (CUDA, torch >= 2.8): fp16 / bf16
# operands of one dtype into fp32
_WIDE_OPERANDS = (torch.float16, torch.bfloat16)


def _eligible(operands: tuple[torch.dtype, ...], dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and len(set(operands)) == 1 and operands[0] in _WIDE_OPERANDS


def _traced() -> bool:
    """``torch.compile`` tracing, or ``make_fx`` recording (``torch.export``, the AOT trace
    of a compiled backward): the call is recorded, not run."""
    proxy = torch._C._TorchDispatchModeKey.PROXY
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(proxy) is not None


def _upcast_only(*operands: Tensor) -> bool:
    """The product taken on wide copies without trying ``out_dtype=``: under a functorch
    transform (``vmap`` / ``grad``: a failure there says nothing of the device, and must
    not switch the wide GEMM off for the process), or for operands autograd tracks (the
    custom ops have no autograd formula; the upcast GEMM has one)."""
    tracked = torch.is_grad_enabled() and any(t.requires_grad for t in operands)
    return tracked or torch._C._are_functorch_transforms_active()


def _wide_or_upcast(key: tuple[str, str], wide: Callable, upcast: Callable):
    """``wide()`` (a GEMM with ``out_dtype=``) where torch offers it for ``key`` (the device
    type and the GEMM), else ``upcast()`` (the same product on wide copies of the
    operands); the first call on a device type finds out which and records it."""
    if _MM_OUT_DTYPE.get(key, True):
        try:
            out = wide()
            _MM_OUT_DTYPE[key] = True
            return out
        except (TypeError, NotImplementedError, RuntimeError) as exc:
            # "not supported here" ("out_dtype" keyword, "aten::mm.dtype" backend), never
            # another error (out of memory) that would switch the fast path off for good
            if not isinstance(exc, NotImplementedError) and "dtype" not in str(exc):
                raise
            _MM_OUT_DTYPE[key] = False
    return upcast()


def _mm_wide_eager(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    return _wide_or_upcast((a.device.type, "mm"),
                           lambda: torch.mm(a, b, out_dtype=dtype),
                           lambda: a.to(dtype) @ b.to(dtype))  # fmt: skip


def _addmm_wide_eager(acc: Tensor, a: Tensor, b: Tensor) -> None:
    dtype = acc.dtype
    _wide_or_upcast((a.device.type, "addmm"),
                    lambda: torch.addmm(acc, a, b, out_dtype=dtype, out=acc),
                    lambda: acc.addmm_(a.to(dtype), b.to(dtype)))  # fmt: skip


@torch.library.custom_op("fused_rl::mm_wide", mutates_args=())
def _mm_wide_op(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` (16-bit, one dtype) in ``dtype`` (fp32): the recorded form of :func:`mm_wide`."""
    return _mm_wide_eager(a, b, dtype)


@_mm_wide_op.register_fake
def _mm_wide_fake(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "mm_wide: 2-D operands")
    torch._check(a.shape[1] == b.shape[0], lambda: "mm_wide: inner sizes differ")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=dtype)


@torch.library.custom_op("fused_rl::addmm_wide_", mutates_args=("acc",))
def _addmm_wide_op(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (16-bit operands of one dtype, fp32 ``acc``): the recorded form of
    :func:`addmm_wide`."""
    _addmm_wide_eager(acc, a, b)


@_addmm_wide_op.register_fake
def _addmm_wide_fake(acc: Tensor, a: Tensor, b: Tensor) -> None:
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "addmm_wide_: 2-D operands")
    torch._check(
        acc.shape == (a.shape[0], b.shape[1]) and a.shape[1] == b.shape[0],
        lambda: "addmm_wide_: shapes do not chain",
    )


def mm_wide(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a @ b`` ``(m, k) x (k, n)`` in ``dtype`` (wider than the operands'), never rounded
    to the operands' dtype."""
    if not _eligible((a.dtype, b.dtype), dtype) or _upcast_only(a, b):
        return a.to(dtype) @ b.to(dtype)
    if _traced():
        return torch.ops.fused_rl.mm_wide(a, b, dtype)
    return _mm_wide_eager(a, b, dtype)


def addmm_wide(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` (``acc`` ``(m, n)``, ``a`` ``(m, k)``, ``b`` ``(k, n)``) with the
    product itself in ``acc``'s (fp32 / fp64) dtype, not rounded to ``a``'s 16-bit dtype
    first: one GEMM accumulating straight into ``acc`` where torch offers it (CUDA: no
    temporary the size of ``acc``), else on wide copies of ``a`` and ``b``."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif not _eligible((a.dtype, b.dtype), acc.dtype) or _upcast_only(acc, a, b):
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    elif _traced():
        torch.ops.fused_rl.addmm_wide_(acc, a, b)
    else:
        _addmm_wide_eager(acc, a, b)
