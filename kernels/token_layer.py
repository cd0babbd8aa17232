"""Layer 2, token layer: loss math on per-token numbers (Triton device functions).

Used as the epilogue of the vocab-stream forward (so a token-level loss costs one pass over
the logits) and by the token-space kernels. Each function returns the value and its
derivative w.r.t. ``logp`` so the backward needs only the per-token coefficients.
"""

import triton
import triton.language as tl

# KL estimator codes (order of fused_rl.reference.kl.KL_KINDS)
KL_K1: tl.constexpr = 0
KL_K2: tl.constexpr = 1
KL_K3: tl.constexpr = 2
KL_LOW_VAR: tl.constexpr = 3
KL_ABS: tl.constexpr = 4


@triton.jit
def kl_and_grad(logp, ref_logp, KIND: tl.constexpr):
    """``(kl, d kl / d logp)`` for ``log_ratio = logp - ref_logp``; clamps pass gradient
    inclusively at their bounds, as ``torch.clamp`` does."""
    d = logp - ref_logp
    if KIND == 0:
        kl = d
        grad = d * 0.0 + 1.0
    elif KIND == 1:
        kl = 0.5 * d * d
        grad = d
    elif KIND == 2:
        e = tl.exp(-d)
        kl = e + d - 1.0
        grad = 1.0 - e
    elif KIND == 3:
        neg = tl.minimum(tl.maximum(-d, -20.0), 20.0)
        e = tl.exp(neg)
        raw = e - neg - 1.0
        kl = tl.minimum(tl.maximum(raw, -10.0), 10.0)
        inside = (-d >= -20.0) & (-d <= 20.0) & (raw >= -10.0) & (raw <= 10.0)
        grad = tl.where(inside, 1.0 - e, 0.0)
    else:
        kl = tl.abs(d)
        grad = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return kl, grad
