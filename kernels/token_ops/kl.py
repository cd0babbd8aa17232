"""Layer 2, token space: elementwise KL estimators on ``(R, C)`` views (see
``layer2.kl_and_grad`` for the formulas and their derivatives).

Flat kernels (conventions in ``token_ops/reductions.py``): the forward writes ``kl`` only; the
backward recomputes ``d kl / d logp`` from the inputs and writes ``g * d kl/d logp`` for
``logprobs`` and its negation for ``ref_logprobs`` (``kl`` depends on ``logp - ref`` only).
"""

import triton
import triton.language as tl

from ..common import cast_for
from ..policy.layer2 import kl_and_grad
from .reductions import flat_rowcol


@triton.jit(do_not_specialize=["N", "C"])
def _kl_estimate_fwd_kernel(
    lp_ptr,
    ref_ptr,
    out_ptr,
    N,
    C,
    stride_lr,
    stride_lc,
    stride_rr,
    stride_rc,
    KIND: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """``out[r, c] = kl(logp[r, c], ref[r, c])`` into a contiguous ``(R, C)`` buffer."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    lp = tl.load(lp_ptr + row * stride_lr + col * stride_lc, mask=valid, other=0.0).to(ACC)
    ref = tl.load(ref_ptr + row * stride_rr + col * stride_rc, mask=valid, other=0.0).to(ACC)
    kl, _ = kl_and_grad(lp, ref, KIND)
    tl.store(out_ptr + row * C + col, kl, mask=valid)


@triton.jit(do_not_specialize=["N", "C"])
def _kl_estimate_bwd_kernel(
    lp_ptr,
    ref_ptr,
    g_ptr,
    glp_ptr,
    gref_ptr,
    N,
    C,
    stride_lr,
    stride_lc,
    stride_rr,
    stride_rc,
    stride_gr,
    stride_gc,
    KIND: tl.constexpr,
    WANT_LOGP: tl.constexpr,
    WANT_REF: tl.constexpr,
    BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):
    """``d logp = g * dkl``, ``d ref = -g * dkl`` into contiguous ``(R, C)`` buffers."""
    row, col, valid = flat_rowcol(N, C, BLOCK)
    lp = tl.load(lp_ptr + row * stride_lr + col * stride_lc, mask=valid, other=0.0).to(ACC)
    ref = tl.load(ref_ptr + row * stride_rr + col * stride_rc, mask=valid, other=0.0).to(ACC)
    g = tl.load(g_ptr + row * stride_gr + col * stride_gc, mask=valid, other=0.0).to(ACC)
    _, dkl = kl_and_grad(lp, ref, KIND)
    grad = g * dkl
    if WANT_LOGP:
        tl.store(glp_ptr + row * C + col, cast_for(grad, glp_ptr), mask=valid)
    if WANT_REF:
        tl.store(gref_ptr + row * C + col, cast_for(-grad, gref_ptr), mask=valid)
