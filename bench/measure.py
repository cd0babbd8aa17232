"""Timing, peak memory, byte counts and the copy-bandwidth ceiling.

GPU: ``triton.testing.do_bench`` medians with 20/80% quantiles (CUDA events, L2 flushed
between runs), peak memory from ``torch.cuda.max_memory_allocated`` above what was allocated
before the call (the inputs), achieved GB/s from the explicit byte counts below, as a share
of a device-to-device copy measured at the start of the run.

Linear ops on a GPU: their GEMM work (``gemm_flops``) per second, as a share of the dense
bf16 ``torch.matmul`` rate measured at the start of the run (``matmul_tflops``).

CPU: a ``time.perf_counter`` median of a few runs -- the Triton interpreter and the CPU
references, NOT a performance figure -- and no measured memory (see ``memory_profile``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import torch

from .cases import FULL_KL_VARIANTS, LINEAR_OPS, LOGITS_OPS, Case

CPU_TIME_LABEL = "CPU interpreter, not a performance figure"


def is_gpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def device_name(device: torch.device | str) -> str:
    if is_gpu(device):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3`` (a results folder name)."""
    keep = [c.lower() if c.isalnum() else "-" for c in name]
    return "-".join(part for part in "".join(keep).split("-") if part)


def bytes_moved(case: Case) -> int:
    """The fewest bytes the case must move through memory (the roofline numerator).

    Logits ops, ``E = B*T*V`` elements of ``e`` bytes: forward reads the logits once
    (``E*e``); forward + backward reads them once in each pass and writes the gradient once
    (``3*E*e``). Per-token inputs/outputs (under 0.05% of that at V >= 32000) are left out.

    Token ops, ``N = B*T``, fp32 (4 B) tensors and bool (1 B) masks:
    * ppo_loss fwd+bwd: forward reads 6 fp32 + 2 masks (26N); backward re-reads them (26N)
      and writes the two gradients (8N): 60N.
    * value_loss fwd+bwd: values, old values, returns, mask (13N) in each pass + grad (4N): 30N.
    * masked_whiten: read x and mask once (5N), write the result (4N): 9N.
    * gae: read rewards, values, mask (9N), write advantages and returns (8N): 17N.

    Linear ops, hidden rows ``N*H`` and lm_head ``V*H`` elements of ``e`` bytes: forward
    reads both once (``(N + V)*H*e``); forward + backward reads them again and writes their
    gradients (``3*(N + V)*H*e``). These ops are GEMM-bound (``2*N*V*H`` flops a pass):
    their GB/s is no measure of how well they run.

    ``token_logprobs`` under truncation (``cases.TRUNCATED_VARIANTS``): the plain op's bytes,
    one read forward (``E*e``), read, read, write with the backward (``3*E*e``), what
    fused_rl's top-k with ``k <= 64`` moves. Its top-k > 64 selects the k-th largest by
    radix select (2 reads of a bf16 / fp16 row, 4 fp32) and its top-p searches the
    threshold (typically 3-6 reads of a flat row, one where the row's 64 largest values
    already hold ``p``): their GB/s is then an effective rate, the time to do the plain
    op's job under the cut.

    ``policy_loss`` with the exact KL (``cases.FULL_KL_VARIANTS``): the reference's logits
    are read once in each pass too (``5*E*e``), for every provider of the case (the k3 call
    beside it moves ``3*E*e``: its GB/s is then an effective rate).

    ``distill_loss``, student and teacher logits of ``E`` elements each: forward reads both
    once (``2*E*e``; fused_rl's JSD, 0 < beta < 1, reads them twice: its GB/s is then an
    effective rate); forward + backward reads both again and writes the student's gradient
    (``5*E*e``). ``linear_distill_loss`` (teacher of width H too): forward reads both
    models' rows and heads (``2*(N + V)*H*e``); with gradients the student's again and its
    two gradients written (``4*(N + V)*H*e``); GEMM-bound, as the linear ops.
    ``topk_distill_loss`` (verl's ``compute_forward_kl_topk``): forward reads the student's
    logits twice, the normaliser and the K log-probs, and the top K of its overlap
    diagnostic (``2*E*e``; fused_rl's radix select of the K-th largest reads a 16-bit row
    twice: its GB/s is then an effective rate); forward + backward reads them again and
    writes the gradient (``4*E*e``); the teacher's ``(B, T, K)`` tensors are not counted.
    """
    n = case.tokens
    if case.op == "topk_distill_loss":  # the teacher's (B, T, K) inputs: negligible
        elements = n * case.vocab * case.torch_dtype.itemsize
        return elements * (4 if case.mode == "fwd_bwd" else 2)
    if case.op == "distill_loss":
        elements = n * case.vocab * case.torch_dtype.itemsize
        return elements * (5 if case.mode == "fwd_bwd" else 2)
    if case.op == "linear_distill_loss":
        elements = (n + case.vocab) * case.hidden * case.torch_dtype.itemsize
        return elements * (4 if case.mode == "fwd_bwd" else 2)
    if case.op in LINEAR_OPS:
        elements = (n + case.vocab) * case.hidden * case.torch_dtype.itemsize
        return elements * (3 if case.mode == "fwd_bwd" else 1)
    if case.op in LOGITS_OPS:
        elements = n * case.vocab * case.torch_dtype.itemsize
        if case.variant in FULL_KL_VARIANTS:
            return elements * (5 if case.mode == "fwd_bwd" else 2)
        return elements * (3 if case.mode == "fwd_bwd" else 1)
    per_token = {"ppo_loss": 60, "value_loss": 30, "masked_whiten": 9, "gae": 17}[case.op]
    if case.mode != "fwd_bwd" and case.op in ("ppo_loss", "value_loss"):
        per_token = {"ppo_loss": 26, "value_loss": 13}[case.op]
    return per_token * n


def gemm_flops(case: Case) -> int | None:
    """The GEMM work of a linear case, ``2*N*V*H`` flops a GEMM: the logits, and with
    gradients ``dH`` and ``dW`` (three GEMMs, the materialised path's count; a backward that
    recomputes the logits runs a fourth, not counted: it is overhead). ``linear_distill_loss``:
    the teacher's logits too (four GEMMs with gradients, two without). None for other ops."""
    gemm = 2 * case.tokens * case.vocab * (case.hidden or 0)
    if case.op == "linear_distill_loss":
        return gemm * (4 if case.mode == "fwd_bwd" else 2)
    if case.op not in LINEAR_OPS:
        return None
    return gemm * (3 if case.mode == "fwd_bwd" else 1)


def matmul_tflops(device, dtype=torch.bfloat16, size: int = 8192) -> float | None:
    """The dense ``torch.matmul`` rate on this GPU (TFLOP/s of a ``size``-cubed product in
    ``dtype``, median of ``do_bench``): the ceiling a linear op's GEMM work is compared with
    (issue 14: at least 70% of it). None on CPU."""
    if not is_gpu(device):
        return None
    from triton.testing import do_bench

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = do_bench(lambda: torch.matmul(a, b), warmup=25, rep=200, quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    torch.cuda.empty_cache()
    return 2 * size**3 / (ms * 1e-3) / 1e12


def sync(device) -> None:
    if is_gpu(device):
        torch.cuda.synchronize(torch.device(device))


def time_ms(fn, device, cpu_reps: int = 3) -> tuple[float, float, float]:
    """``(p20, median, p80)`` milliseconds of ``fn()`` (already warmed up by the caller)."""
    if is_gpu(device):
        from triton.testing import do_bench

        p20, p50, p80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.2, 0.5, 0.8])
        return float(p20), float(p50), float(p80)
    times = []
    gc.collect()
    gc.disable()  # the interpreter leaves much garbage: keep collections out of the timings
    try:
        for _ in range(max(1, cpu_reps)):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        gc.enable()
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return pick(0.2), statistics.median(times), pick(0.8)


def peak_mb(fn, device) -> float | None:
    """Peak CUDA memory of one ``fn()`` call above what was allocated before it; None on CPU.

    The call's outputs (the gradient buffer, for fwd+bwd) count: they are part of the cost.
    """
    if not is_gpu(device):
        return None
    gc.collect()
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return peak / 2**20


def _copy_seconds(n: int, device) -> float:
    from triton.testing import do_bench

    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, quantiles=[0.5])
    return (ms[0] if isinstance(ms, (list, tuple)) else ms) * 1e-3


def copy_gbps(device) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9), GPU only."""
    if not is_gpu(device):
        return None
    n = 1 << 28  # 1 GiB of fp32 each way: far larger than L2
    seconds = _copy_seconds(n, device)
    torch.cuda.empty_cache()
    return 2 * n * 4 / seconds / 1e9


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return True
    return "out of memory" in str(exc).lower()


def is_device_fatal(exc: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (illegal address, launch failure...):
    every later case would fail too. An OOM is not one."""
    if is_oom(exc):
        return False
    fatal = tuple(t for t in (getattr(torch, "AcceleratorError", None),) if isinstance(t, type))
    text = str(exc)
    return (fatal and isinstance(exc, fatal)) or "CUDA error" in text or "CUDA_ERROR" in text


@contextlib.contextmanager
def heap_frozen():
    """The objects alive on entry (torch, Triton, the caller's: ~3e5 of them) moved out of
    the collector's reach until exit (``gc.freeze``): the run's collections (before each
    timing, between providers) then walk only what the run made, its providers' garbage,
    ~0.3 s a collection less (garbage from before entry waits until exit)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free_memory(device) -> None:
    gc.collect()
    if is_gpu(device):
        torch.cuda.empty_cache()
