"""Launch configuration shared by the Triton launchers (block sizes, warps, dtypes)."""

from __future__ import annotations

import math
import struct

import torch

MAX_BLOCK_V = 4096

# Every launch compiles with contracted multiply-adds (FMA). The instruction budgets of the
# vocab streams (tests/hopper_compile.py) and the polynomial error bounds in the kernels'
# docstrings are stated with them; Triton 3.9 enables them by default but warns when a launch
# leaves the choice unset, and Triton 3.10 disables them by default (1.2-1.25x the warp
# instructions of the exact KL's forward and of the log-prob backward). The user's
# ``TRITON_FORCE_DISABLE_FP_FUSION=1`` still wins.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
_F32 = struct.Struct("f")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def vocab_block(vocab: int) -> int:
    """Columns per loop step: the whole row when small, else 4096 (16 B/thread/step in bf16)."""
    return max(16, min(next_power_of_2(vocab), MAX_BLOCK_V))


def vocab_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


# A read-only stream (layer 1, the forward kernels) runs one warp per row: its block
# reductions (max, sum-exp, entropy) are warp shuffles, with no shared-memory round trip and
# barrier per step, and the many one-warp programs on each SM keep the row loads in flight
# (sm_90: 164 registers, no spills, no barrier, against 4 barriers per step at 8 warps). On
# an H200 (2026-11-26) Liger's one-warp 2048-column forward read 8x2048x151936 bf16 logits
# at the copy rate (1.16 ms) where the 8-warp 4096-column one here took 1.50 ms. Kernels that
# also write a gradient row keep ``vocab_block`` / ``vocab_warps``.
READ_BLOCK_V = 2048
# Read-only kernels that hold many values a column run one warp on fewer columns a step:
# at READ_BLOCK_V the exact KL's forward (two rows, ``kernels/vocab/pair.pair_moments``) took
# 255 registers and spilled to a 752-byte stack a thread, the truncated forward (its top-k
# and search passes) to a 120-144-byte one (Triton 3.9's cubins for sm_90a, read on the
# CPU); on an H200 (2026-11-27, Triton 3.6) ``policy_loss(kl_estimator="full")`` ran 4.4x
# the k3 call (15.2 ms against 3.4 at 8 x 2048 x 151936 bf16). At 512 columns: 113-148
# registers, no stack, no barrier (tests/hopper_compile.py, tests/test_truncated.py check
# them as launched); on an H200 (2026-11-28) the exact KL took 8.7 ms, 2.5x the k3 call.
HEAVY_READ_BLOCK_V = 512


def vocab_launch(vocab: int, *, writes: bool, heavy: bool = False) -> dict:
    """``BLOCK_V`` and ``num_warps`` of a vocab-stream kernel (one program per row) over
    ``vocab`` columns, with ``COMPILE_OPTIONS``; ``writes``: the kernel also writes the row's
    gradient; ``heavy``: a read-only kernel holding many values a column
    (``HEAVY_READ_BLOCK_V``)."""
    if writes:
        block = vocab_block(vocab)
        return {"BLOCK_V": block, "num_warps": vocab_warps(block), **COMPILE_OPTIONS}
    cap = HEAVY_READ_BLOCK_V if heavy else READ_BLOCK_V
    return {"BLOCK_V": max(16, min(next_power_of_2(vocab), cap)), "num_warps": 1, **COMPILE_OPTIONS}


def stats_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """Per-token statistics are fp32, or fp64 for fp64 logits (so gradcheck can run)."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def triton_acc(logits_dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if logits_dtype == torch.float64 else tl.float32


def f32_pair(x: float) -> tuple[float, float]:
    """``(hi, lo)``, both fp32-representable, with ``hi + lo == x`` to ~48 bits.

    Triton passes Python floats as fp32; the kernels add the pair back up in their
    accumulation dtype (``pair`` in ``kernels/policy/layer2.py``), so fp64 inputs get
    (nearly) fp64 hyper-parameters and fp32 ones exactly ``fp32(x)``.
    """
    hi = _to_f32(x)
    lo = x - hi if math.isfinite(hi) else 0.0
    return hi, _to_f32(lo)


# the vocab kernels' soft-cap pair ``(inv_cap_hi, inv_cap_lo)`` when there is no cap (unread:
# ``HAS_SOFTCAP=False``). With a cap ``c`` the launchers pass ``f32_pair(c / T)`` where
# ``f32_pair(1 / T)`` goes otherwise, and ``f32_pair(1 / c)`` here (``kernels/vocab/layer1.py``
# ``scaled_logits``), written out at each launch so a call without a cap runs no more Python.
NO_CAP = (0.0, 0.0)

# the finalize kernels' ``num_items`` pair when no number is given (``-1``: off, the total
# weight divides; None or a tensor); a number ``n > 0`` goes as ``f32_pair(n)``, so an fp64
# loss divides by ``n`` in fp64 (a bare float would be rounded to fp32). Written out at
# each launch, as ``NO_CAP``: a call without ``num_items`` runs no more Python.
NO_NUM_ITEMS = (-1.0, 0.0)


def _to_f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (inf beyond its range), on the host, no tensor."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
