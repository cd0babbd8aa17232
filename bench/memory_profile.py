"""Peak memory of each provider: measured on a GPU, modelled anywhere.

The model (``model_peak_bytes``) runs the provider's real code at the real shape on *fake*
tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no data, no memory) under
a dispatch mode that adds up the bytes of every new storage an op returns and subtracts
them when the storage is freed (a weak reference on the storage). Its peak, above the
inputs, counts exactly the tensors the provider materialises -- forward temporaries,
tensors autograd saves for the backward, backward temporaries, the outputs and the
gradient -- with their real lifetimes. It leaves out kernel-internal workspaces and the
CUDA caching allocator's rounding (512-byte blocks), so measured GPU peaks run a little
higher. Triton launches are skipped (``skip_triton_launches``): kernels allocate nothing,
their launchers' ``torch.empty`` outputs are counted. Where a provider cannot run on fake
tensors (a host sync on data), Liger-Kernel falls back to a model read from its source
(``liger_model_bytes``), others to "not modelled". ``torch.compile`` is not modelled (its fused
kernels decide what is materialised; it is measured on GPUs only).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import providers as P
from .cases import HIDDEN, LINEAR_OPS, OP_VARIANTS, Case, make_inputs


class AllocationTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created by ops while the mode is active."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._owned: dict[int, weakref.finalize] = {}
        # storages that exist already (the inputs): views of them are not new memory
        self._existing = {id(t.untyped_storage()): t for t in existing}

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._owned.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._owned or key in self._existing:
                continue
            nbytes = storage.nbytes()
            self._owned[key] = weakref.finalize(storage, self._release, key, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def _noop_launch(self, grid):
    return lambda *args, **kwargs: None


@contextlib.contextmanager
def skip_triton_launches():
    """Make ``kernel[grid](...)`` a no-op: Triton kernels allocate no torch memory (their
    launchers allocate outputs with torch, which the tracker sees) and cannot run on fake
    tensors, so skipping them leaves the allocation count exact."""
    try:
        from triton.runtime import autotuner, jit
    except ImportError:
        yield
        return
    classes = [jit.KernelInterface, jit.JITFunction, autotuner.Autotuner, autotuner.Heuristics]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    saved = [(cls, cls.__dict__["__getitem__"]) for cls in classes if "__getitem__" in cls.__dict__]
    for cls, _ in saved:
        cls.__getitem__ = _noop_launch
    try:
        yield
    finally:
        for cls, original in saved:
            cls.__getitem__ = original


def liger_model_bytes(case: Case) -> int | None:
    """Liger-Kernel (0.8) from its source: ``fused_selective_log_softmax`` allocates one fp32
    (B, T) output; ``triton_grpo_loss`` with ``reduce=False`` allocates per-token fp32 loss,
    lse, is_clipped, kl, the float mask and the three masked outputs (8 x 4 B per token, two
    more for GSPO's per-sequence pre-pass), and its backward ``dloss`` plus ``dlogits`` of the
    whole (B, T+1, V) buffer (``inplace=False``; ``inplace=True`` writes it into the logits).
    """
    n = case.tokens
    if case.op == "token_logprobs":
        return 4 * n if (case.mode, case.variant) == ("fwd_nograd", "logp") else None
    if case.op != "policy_loss" or case.variant == "grpo+entropy":
        return None
    per_token = 4 * n * (10 if case.variant == "gspo" else 8)
    grad = case.batch * (case.seqlen + 1) * case.vocab * case.torch_dtype.itemsize
    return per_token + 4 * n + grad


def model_device() -> str:
    """Where the model's fake tensors live: where fused_rl's Triton path runs. On a CUDA
    machine that is ``cuda`` (fake CUDA tensors allocate nothing); on CPU tensors it needs the
    Triton interpreter, which a CUDA machine does not enable (``backend="triton"`` raises)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_peak(provider: str, case: Case, device=None) -> tuple[int | None, str]:
    """``(bytes, how)``: modelled peak bytes above the inputs of one run of ``case`` by
    ``provider``, or ``(None, why not)``; on fake tensors of ``device`` (default
    ``model_device()``)."""
    device = model_device() if device is None else device
    if provider == "compile":
        return None, "torch.compile is not modelled (measured on GPUs)"
    if provider == "liger" and not P.liger_version():
        return None, "liger_kernel is not importable"
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fused_rl

    saved_check = fused_rl.config.check_values
    fused_rl.config.check_values = False  # value checks read data: none on fake tensors
    try:
        with FakeTensorMode(), skip_triton_launches():
            inp = make_inputs(case, device)
            try:
                run = P.build(provider, case, inp)
            except P.Unavailable as exc:
                return None, str(exc)
            tensors = [v for v in inp.values() if isinstance(v, torch.Tensor)]
            tracker = AllocationTracker(existing=tensors)
            with tracker:
                out = run()
                del out
            return tracker.peak, "modelled"
    except Exception as exc:
        # e.g. a host sync on data (``.item()``), which fake tensors do not have
        if provider == "liger":
            peak = liger_model_bytes(case)
            if peak is not None:
                return peak, "modelled from Liger's source"
        return None, f"not modelled ({type(exc).__name__})"
    finally:
        fused_rl.config.check_values = saved_check


def model_peak_bytes(provider: str, case: Case, device=None) -> int | None:
    """Modelled peak bytes above the inputs (see ``model_peak``); None where not modelled."""
    return model_peak(provider, case, device)[0]


def memory_table(
    tokens: int, vocab: int, dtype: str, seqlen: int, device, measure: bool, ops=None
) -> list[dict]:
    """Rows ``{case, provider, peak_mb, how}`` for the logits ops (default) or ``ops`` at one
    shape (linear ops at H = ``cases.HIDDEN["full"]``)."""
    from . import measure as M

    batch = max(1, tokens // seqlen)
    seqlen = tokens // batch
    rows = []
    for op in ops or ("token_logprobs", "policy_loss"):
        for variant, mode in OP_VARIANTS[op]:
            hidden = HIDDEN["full"] if op in LINEAR_OPS else None
            case = Case(op, variant, mode, batch, seqlen, vocab, dtype, hidden=hidden)
            inp = make_inputs(case, device) if measure else None
            for provider in P.PROVIDERS:
                row = {"case": case, "provider": provider, "peak_mb": None, "how": "modelled"}
                if measure:
                    row["how"] = "measured"
                    try:
                        run = P.build(provider, case, inp)
                        run()  # warm-up (compiles); its memory is not the steady state
                        row["peak_mb"] = M.peak_mb(run, device)
                    except P.Unavailable as exc:
                        row["how"] = f"n/a: {exc}"
                    except Exception as exc:
                        row["how"] = "OOM" if M.is_oom(exc) else f"error: {exc}"[:80]
                    M.free_memory(device)
                else:
                    peak, row["how"] = model_peak(provider, case)
                    row["peak_mb"] = None if peak is None else peak / 2**20
                rows.append(row)
            del inp
            M.free_memory(device)
    return rows


def format_memory_table(rows: list[dict], tokens: int, vocab: int, dtype: str) -> str:
    from .cases import DTYPES

    itemsize = DTYPES[dtype].itemsize
    logits_mb = tokens * vocab * itemsize / 2**20
    lines = [
        f"Peak memory above the inputs, tokens={tokens} vocab={vocab} dtype={dtype}",
        f"(logits {logits_mb:,.0f} MB; a gradient buffer of the logits is {logits_mb:,.0f} MB)",
        "",
        f"{'op[variant] mode':<38} {'provider':<13} {'peak MB':>12} {'x fused_rl':>10}  how",
    ]
    by_case: dict = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    for case, case_rows in by_case.items():
        fused = next((r["peak_mb"] for r in case_rows if r["provider"] == "fused_rl"), None)
        for row in case_rows:
            peak = row["peak_mb"]
            ratio = f"{peak / fused:.2f}" if peak is not None and fused else "-"
            peak_s = f"{peak:,.1f}" if peak is not None else "-"
            name = f"{case.op}[{case.variant}] {case.mode}"
            lines.append(f"{name:<38} {row['provider']:<13} {peak_s:>12} {ratio:>10}  {row['how']}")
    return "\n".join(lines)
