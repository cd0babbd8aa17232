"""The one reduction every policy-loss forward ends with (layer 2's last step).

``_policy_finalize_kernel`` -- one program per partial column (``layer2.COL_*``), a
fixed-order (deterministic, bit-identical on repeat) two-level sum over ``(B, T)`` tiles:
the metric means, the ratio max, the IS weights' extremes, and the aggregated loss with its
per-sequence backward scale (``AGG``: the ``loss_agg`` mode).
"""

import triton
import triton.language as tl

from ..common import nan_max, nan_min, pair
from ..modes import LOSS_AGG_MODES
from .layer2 import (
    COL_AUX,
    COL_CLIPPED_HIGH,
    COL_CLIPPED_LOW,
    COL_COUNT,
    COL_IS_MAX,
    COL_IS_MIN,
    COL_LOSS,
    COL_RATIO_MAX,
    OUT_AUX_SEQ_MEAN,
    OUT_HIGH_SEQ_MAX,
    OUT_HIGH_SEQ_MEAN,
    OUT_LOW_SEQ_MEAN,
    OUT_LOW_SEQ_MIN,
)

AGG_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES.index("token-mean"))
AGG_SEQ_MEAN_TOKEN_MEAN = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-mean"))
AGG_SEQ_MEAN_TOKEN_SUM = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-sum"))
AGG_SEQ_MEAN_TOKEN_SUM_NORM = tl.constexpr(LOSS_AGG_MODES.index("seq-mean-token-sum-norm"))


@triton.jit
def aggregated_loss(tot_x, tot_m, seq_sum, seq_scale_ptr, num_items_ptr, num_items_hi,
                    num_items_lo, n_seq, max_length, AGG: tl.constexpr,
                    NUM_ITEMS_TENSOR: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The loss of a finalize kernel from its loss column's totals (``tot_x`` the weighted
    sum, ``tot_m`` the weight total, ``seq_sum`` the sum of per-sequence means), aggregated
    by ``AGG`` (``fused_rl._agg``); outside ``seq-mean-token-mean`` it also stores the
    backward's one ``seq_scale``. ``num_items`` (> 0; <= 0: not given; an fp32 ``(hi, lo)``
    pair, ``fused_rl._launch.f32_pair``, so an fp64 loss divides by the fp64 count) or the
    tensor at ``num_items_ptr`` replaces ``tot_m`` for ``token-mean`` (a tensor <= 0 gives
    NaN)."""
    if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
        loss = seq_sum / n_seq
    else:
        if AGG == AGG_TOKEN_MEAN:
            if NUM_ITEMS_TENSOR:
                den = tl.load(num_items_ptr).to(ACC)
            else:
                num_items = pair(num_items_hi, num_items_lo, ACC)
                den = tot_m * 0.0 + num_items
                den = tl.where(num_items > 0, den, tot_m)  # num_items <= 0: not given
        elif AGG == AGG_SEQ_MEAN_TOKEN_SUM:  # (normalisers that never read a weight)
            den = tl.zeros((), ACC) + n_seq
        else:
            den = (tl.zeros((), ACC) + n_seq) * max_length  # in ACC: B * L may pass 2^24
        scale = tl.where(den != 0, 1.0 / tl.where(den != 0, den, 1.0), 0.0)
        if AGG == AGG_TOKEN_MEAN and NUM_ITEMS_TENSOR:  # never read on the host: a count
            scale = tl.where(den > 0, 1.0 / den, float("nan"))  # <= 0 gives NaN, loudly
        loss = tot_x * scale
        tl.store(seq_scale_ptr, scale)
    return loss


@triton.jit(do_not_specialize=["n_outer", "rows_inner"])
def _policy_finalize_kernel(
    part_ptr,
    loss_ptr,
    metrics_ptr,
    seq_scale_ptr,
    num_items_ptr,
    n_outer,
    rows_inner,
    num_items_hi,
    num_items_lo,
    n_seq,
    max_length,
    AGG: tl.constexpr,
    NUM_ITEMS_TENSOR: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ACC: tl.constexpr,
):
    """Program ``k`` reduces partial column ``k`` of ``(N_COLS, n_outer * rows_inner)``.

    ``metrics[k]`` (fp32): ``sum col_k / sum col_COUNT`` (0 when nothing counts), the max for
    ``COL_RATIO_MAX`` (NaN if any counted ratio is NaN), the token count for ``COL_COUNT``,
    and the aggregated loss for ``COL_LOSS``, which also writes ``loss`` (``ACC``) and the
    backward's ``seq_scale``: ``w_t = m_t * seq_scale[b]`` with ``loss = sum_t w_t L_t``, one
    value per sequence for ``seq-mean-token-mean``, else one for all. The clip columns also
    give the min (low) / max (high) over sequences with a counted token of their
    per-sequence mean, and (with ``COL_AUX``) the mean over those sequences of it
    (``metrics[OUT_*]``; 0 when no sequence counts).
    """
    k = tl.program_id(0)
    n_rows = n_outer.to(tl.int64) * rows_inner
    col = part_ptr + k.to(tl.int64) * n_rows
    tot_m = tl.zeros((), ACC)
    tot_x = tl.zeros((), ACC)
    seq_sum = tl.zeros((), ACC)
    x_max = tl.zeros((), ACC)
    x_min = tl.zeros((), ACC) + float("inf")
    n_nan = tl.zeros((), tl.int32)
    seq_ext = tl.zeros((), ACC) + tl.where(k == COL_CLIPPED_LOW, float("inf"), float("-inf"))
    seq_means = tl.zeros((), ACC)  # the sum over counted sequences of their means
    n_counted = tl.zeros((), ACC)
    for b0 in range(0, n_outer, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B).to(tl.int64)
        in_b = bs < n_outer
        sum_m = tl.zeros((BLOCK_B,), ACC)
        sum_x = tl.zeros((BLOCK_B,), ACC)
        for t0 in range(0, rows_inner, BLOCK_T):
            ts = t0 + tl.arange(0, BLOCK_T)
            tile = in_b[:, None] & (ts < rows_inner)[None, :]
            rows = bs[:, None] * rows_inner + ts[None, :]
            mm = tl.load(part_ptr + COL_COUNT * n_rows + rows, mask=tile, other=0.0).to(ACC)
            xx = tl.load(col + rows, mask=tile, other=0.0).to(ACC)
            sum_m += tl.sum(mm, 1)
            sum_x += tl.sum(xx, 1)
            if k == COL_RATIO_MAX or k == COL_IS_MAX:
                x_max = nan_max(x_max, tl.max(tl.max(xx, 1), 0))
                n_nan += tl.sum(tl.sum((xx != xx).to(tl.int32), 1), 0)
            if k == COL_IS_MIN:  # uncounted tokens hold +inf (masked lanes load +inf too)
                xx = tl.load(col + rows, mask=tile, other=float("inf")).to(ACC)
                x_min = nan_min(x_min, tl.min(tl.min(xx, 1), 0))
                n_nan += tl.sum(tl.sum((xx != xx).to(tl.int32), 1), 0)
        tot_m += tl.sum(sum_m, 0)
        tot_x += tl.sum(sum_x, 0)
        if k == COL_CLIPPED_LOW or k == COL_CLIPPED_HIGH:  # per-sequence means' extremes
            has_tokens = in_b & (sum_m != 0)
            seq_mean = sum_x / tl.where(has_tokens, sum_m, 1.0)
            if k == COL_CLIPPED_LOW:
                seq_ext = nan_min(seq_ext, tl.min(tl.where(has_tokens, seq_mean, float("inf")), 0))
            else:
                seq_ext = nan_max(seq_ext, tl.max(tl.where(has_tokens, seq_mean, float("-inf")), 0))
            n_nan += tl.sum((has_tokens & (seq_mean != seq_mean)).to(tl.int32), 0)  # tl.min
        if k == COL_CLIPPED_LOW or k == COL_CLIPPED_HIGH or k == COL_AUX:
            has_seq = in_b & (sum_m != 0)
            seq_means += tl.sum(tl.where(has_seq, sum_x / tl.where(has_seq, sum_m, 1.0), 0.0), 0)
            n_counted += tl.sum(has_seq.to(ACC), 0)
        if AGG == AGG_SEQ_MEAN_TOKEN_MEAN:
            nonempty = sum_m != 0
            safe_m = tl.where(nonempty, sum_m, 1.0)
            seq_sum += tl.sum(tl.where(nonempty, sum_x / safe_m, 0.0), 0)
            if k == COL_LOSS:
                scale_b = tl.where(nonempty, 1.0 / (n_seq * safe_m), 0.0)
                tl.store(seq_scale_ptr + bs, scale_b, mask=in_b)
    if k == COL_LOSS:
        loss = aggregated_loss(tot_x, tot_m, seq_sum, seq_scale_ptr, num_items_ptr,
                               num_items_hi, num_items_lo, n_seq, max_length, AGG,
                               NUM_ITEMS_TENSOR, ACC)  # fmt: skip
        tl.store(loss_ptr, loss)
        tl.store(metrics_ptr + k, loss.to(tl.float32))
    elif k == COL_RATIO_MAX or k == COL_IS_MAX:
        tl.store(metrics_ptr + k, tl.where(n_nan > 0, float("nan"), x_max).to(tl.float32))
    elif k == COL_IS_MIN:  # 0 when nothing counts
        x_min = tl.where(x_min == float("inf"), 0.0, x_min)
        tl.store(metrics_ptr + k, tl.where(n_nan > 0, float("nan"), x_min).to(tl.float32))
    elif k == COL_COUNT:
        tl.store(metrics_ptr + k, tot_m.to(tl.float32))
    elif k == COL_CLIPPED_LOW or k == COL_CLIPPED_HIGH:
        mean = tl.where(tot_m != 0, tot_x / tl.where(tot_m != 0, tot_m, 1.0), 0.0)
        tl.store(metrics_ptr + k, mean.to(tl.float32))
        seq_ext = tl.where(tl.abs(seq_ext) == float("inf"), 0.0, seq_ext)  # none counted: 0
        seq_ext = tl.where(n_nan > 0, float("nan"), seq_ext)  # (tl.min / tl.max drop NaN)
        out = tl.where(k == COL_CLIPPED_LOW, OUT_LOW_SEQ_MIN, OUT_HIGH_SEQ_MAX)
        tl.store(metrics_ptr + out, seq_ext.to(tl.float32))
        seq_mean_all = seq_means / tl.where(n_counted != 0, n_counted, 1.0)
        out = tl.where(k == COL_CLIPPED_LOW, OUT_LOW_SEQ_MEAN, OUT_HIGH_SEQ_MEAN)
        tl.store(metrics_ptr + out, seq_mean_all.to(tl.float32))
    else:
        mean = tl.where(tot_m != 0, tot_x / tl.where(tot_m != 0, tot_m, 1.0), 0.0)
        tl.store(metrics_ptr + k, mean.to(tl.float32))
        if k == COL_AUX:
            seq_mean_all = seq_means / tl.where(n_counted != 0, n_counted, 1.0)
            tl.store(metrics_ptr + OUT_AUX_SEQ_MEAN, seq_mean_all.to(tl.float32))
