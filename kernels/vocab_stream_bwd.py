"""Layer 3, vocab-stream backward: one pass that re-reads each logits row and writes dL/dx.

Any loss that sees the vocabulary only through ``logp_t`` and ``H_t`` has, with
``g_t = dL/dlogp_t``, ``h_t = dL/dH_t``, ``p = softmax(z)``, ``z = x / T``:

    dL/dx_j = (1/T) * [ g (1[j = y] - p_j) - h p_j (z_j - E_p[z]) ]

``p = exp((z - m) - log s)`` is recomputed from the forward's saved row max ``m`` and
``log s`` (never from a rounded ``lse = m + log s``), and ``z - E_p[z] = (z - m) - (log s - H)``.
"""

import triton
import triton.language as tl

from .token_layer import pair
from .vocab_stream_fwd import row_pointer


@triton.jit(do_not_specialize=["rows_inner", "ignore_index"])
def _token_stats_bwd_kernel(
    logits_ptr,
    targets_ptr,
    grad_ptr,
    max_ptr,
    log_sum_ptr,
    entropy_ptr,
    g_ptr,
    h_ptr,
    scale_ptr,
    rows_inner,
    V,
    stride_outer,
    stride_inner,
    stride_v,
    inv_t_hi,
    inv_t_lo,
    ignore_index,
    HAS_TARGETS: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_H: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ACC: tl.constexpr,
):
    """One program per row; ``grad`` is a fresh contiguous ``(rows, V)`` buffer.

    ``scale_ptr`` (optional) points at one fp32 scalar multiplying ``g`` and ``h``: the
    upstream gradient of a fused scalar loss, read on device (no host sync).
    Ignored rows (target == ignore_index) and rows with ``g == h == 0`` (padding of a fused
    loss) read nothing and get exactly zero gradient.
    """
    row = tl.program_id(0).to(tl.int64)
    inv_temperature = pair(inv_t_hi, inv_t_lo, ACC)  # 1 / T, fp64-exact for fp64 logits
    row_ptr = row_pointer(logits_ptr, row, rows_inner, stride_outer, stride_inner)
    grad_row = grad_ptr + row * V
    m = tl.load(max_ptr + row).to(ACC)
    log_s = tl.load(log_sum_ptr + row).to(ACC)
    if HAS_TARGETS:
        target = tl.load(targets_ptr + row).to(tl.int64)
        active = target != ignore_index
    else:
        target = -1
        active = row >= 0
    scale = inv_temperature
    if HAS_SCALE:
        scale = scale * tl.load(scale_ptr).to(ACC)
    g = 0.0
    if HAS_G:
        g = tl.load(g_ptr + row).to(ACC) * scale
    h = 0.0
    if HAS_H:
        h = tl.load(h_ptr + row).to(ACC) * scale
        mean_d = log_s - tl.load(entropy_ptr + row).to(ACC)  # E_p[z] - m
    g = tl.where(active, g, 0.0)
    h = tl.where(active, h, 0.0)
    active = active & ((g != 0) | (h != 0))  # a NaN upstream gradient still reads
    n_read = tl.where(active, V, 0)  # inactive rows read nothing and write zeros
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_row = cols < V
        x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=cols < n_read, other=0.0)
        d = x.to(ACC) * inv_temperature - m
        p = tl.exp(d - log_s)
        grad = -g * p
        if HAS_TARGETS:
            grad += tl.where(cols == target, g, 0.0)
        if HAS_H:
            grad -= h * tl.where(p > 0, p * (d - mean_d), 0.0)  # 0 * -inf guarded
        grad = tl.where(active, grad, 0.0)
        tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=in_row)
