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
their launchers' ``torch.empty`` outputs are counted. On real CPU tensors (Triton launches
stubbed) the same count equals the peak of ``torch.profiler``'s memory timeline
(``tests/test_bench.py::test_memory_model_matches_profiler_on_cpu``).

fused_rl's fused-linear ops (``fused_rl/linear.py``) are modelled on the path a GPU takes:
``dW`` made by the first chunk's ``torch.mm(..., out_dtype=fp32)`` and ``dW += dz^T h_c`` as
``torch.addmm(dW, ..., out_dtype=fp32, out=dW)`` for the others, which CUDA has and CPU lacks
(a CPU run upcasts the chunk instead), see ``gemm_out_dtype``. ``linear_policy_loss``
(GRPO, gradients on) then holds, per chunk: the ``(N, H)`` copy of the hidden rows that
predict the targets, ``dH`` (``N*H``, the hidden dtype), ``dW`` in fp32 (``V*H*4``) and the
chunk's ``(chunk, V)`` logits (overwritten in place by their gradient). After the chunks
``dW`` is cast to the weight dtype (``V*H*(4 + e)`` for a moment: the peak at H = 4096,
``2*N*H*e + 6*V*H``) and saved with ``dH`` (and ``d_bias``); the backward scales them in
place (no new storage). ``linear_token_logprobs``
holds the same in its backward, which recomputes each chunk's logits. On fake tensors that
GEMM is answered by the model itself (``FakeAddmmOutDtype``: it writes into ``dW``, no new
storage), not by torch's fake-tensor implementation, which torch 2.11 gets wrong.

Where a provider cannot run on fake tensors (a host sync on data, ``torch.compile`` inside)
Liger-Kernel falls back to a model read from its source (``liger_model_bytes``; for the
fused-linear loss ``liger_linear_model_bytes``, checked against a CPU run of the real code
where ``liger_kernel`` is importable), others to "not modelled". ``torch.compile`` is not
modelled (its fused kernels decide what is materialised; it is measured on GPUs only).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import providers as P
from .cases import (
    FULL_KL_VARIANTS,
    FULL_SEQLEN,
    HIDDEN,
    HIDDEN_OPS,
    LINEAR_OPS,
    OP_VARIANTS,
    Case,
    make_inputs,
)

# the memory-vs-tokens plot of the fused-linear ops (``memory_vs_tokens``): its token counts,
# cases and providers (chunked fused_rl, materialised fused, materialised eager, Liger)
MEMORY_TOKENS = (1024, 2048, 4096, 8192, 16384)
MEMORY_CASES = (
    ("linear_policy_loss", "grpo", "fwd_bwd"),
    ("linear_token_logprobs", "logp", "fwd_bwd"),
)
MEMORY_PROVIDERS = ("fused_rl", "fused_rl_mat", "eager", "liger")


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
    ``LigerFusedLinearGRPOLoss``: ``liger_linear_model_bytes``.
    """
    n = case.tokens
    if case.op == "linear_policy_loss":
        return liger_linear_model_bytes(case) if case.variant == "grpo" else None
    if case.op == "token_logprobs":
        return 4 * n if (case.mode, case.variant) == ("fwd_nograd", "logp") else None
    if case.op != "policy_loss" or case.variant == "grpo+entropy":
        return None
    if case.variant in FULL_KL_VARIANTS:  # no exact KL in Liger: nothing to model
        return None
    per_token = 4 * n * (10 if case.variant == "gspo" else 8)
    grad = case.batch * (case.seqlen + 1) * case.vocab * case.torch_dtype.itemsize
    return per_token + 4 * n + grad


LIGER_SEQ_CHUNK, LIGER_VOCAB_CHUNK = 2048, 4096  # Liger 0.8.5's _SELECTIVE_LOGPROB_*_CHUNK_SIZE


def _liger_blocks_peak(t: int, v: int, h: int, e: int) -> int:
    """The largest bytes of temporaries alive at once in one ``_selective_logprob_backward``
    call of Liger 0.8.5 on ``t`` rows: per ``(n, c)`` block (rows by ``LIGER_SEQ_CHUNK``,
    columns by ``LIGER_VOCAB_CHUNK``) fp32 logits, probabilities and their gradient (12 B an
    element), the previous block's still bound while the next ones are made, and the two
    GEMMs' fp32 copies of a weight block / of the rows and their fp32 products."""
    up = 0 if e == 4 else 4  # `.float()` copies; none for fp32
    prev, peak = 0, 0  # prev: the previous block's elements (its three fp32 tensors live)
    for r0 in range(0, t, LIGER_SEQ_CHUNK):
        n = min(LIGER_SEQ_CHUNK, t - r0)
        for c0 in range(0, v, LIGER_VOCAB_CHUNK):
            c = min(LIGER_VOCAB_CHUNK, v - c0)
            nc = n * c
            peak = max(
                peak,
                12 * prev + (e + up) * nc,  # logits = (h_c @ w_c.T).float()
                8 * prev + 12 * nc,  # probs = exp(logits - log_z): the difference, exp
                4 * prev + 12 * nc,  # grad_logits = -g * probs
                12 * nc + up * c * h + 4 * n * h,  # grad_logits @ w_c.float()
                12 * nc + up * n * h + 4 * c * h,  # grad_logits.T @ h_c.float()
            )
            prev = nc
    return peak


def liger_linear_model_bytes(case: Case) -> int:
    """``LigerFusedLinearGRPOLoss`` (Liger-Kernel 0.8.5, ``chunked_loss/fused_linear_ppo.py``)
    as the benchmark calls it (``chunk_size=1``: one sequence of ``T`` rows per chunk; token
    importance sampling; no bias), from its source. ``e``: the dtype's bytes.

    Its forward runs a forward + backward per chunk: ``grad_weight = zeros_like(weight)``
    (``V*H*e``) accumulates the chunks' weight gradients and a list their ``(T, H)`` input
    gradients. Each chunk's backward (``_selective_logprob_backward``) holds fp32
    ``grad_weight`` (``V*H*4``) and ``grad_hidden`` (``T*H*4``) and recomputes the logits in
    blocks of 2048 x 4096 (``_liger_blocks_peak``), then returns both cast to the dtype
    (``(V + T)*H*e`` more, with the fp32 ones alive: at H = 4096 the peak, ``8*V*H`` and
    the input gradients). After the chunks, ``torch.cat`` of the list (``N*H*e``, the list
    alive); the backward returns the saved gradients as they are (the upstream gradient is
    1), and the benchmark pads the input gradient to the ``(B, T+1, H)`` window
    (``B*(T+1)*H*e``). Per-token tensors (``B*T`` floats) are left out. Checked against the
    real code on CPU by ``tests/test_bench.py::test_liger_linear_model_matches_its_code``.
    """
    b, t, v, h, e = case.batch, case.seqlen, case.vocab, case.hidden, case.torch_dtype.itemsize
    copy = 0 if e == 4 else e  # `.to(dtype)` of the fp32 gradients: none for fp32
    acc = v * h * e + (b - 1) * t * h * e  # grad_weight and the earlier chunks' input grads
    fp32 = v * h * 4 + t * h * 4  # the chunk backward's fp32 grad_weight, grad_hidden
    loop = acc + fp32 + _liger_blocks_peak(t, v, h, e)
    cast = acc + fp32 + copy * (v + t) * h
    concat = v * h * e + 2 * b * t * h * e
    end = v * h * e + b * t * h * e + b * (t + 1) * h * e
    return max(loop, cast, concat, end)


_ADDMM_DTYPE_OUT = (
    torch.ops.aten.addmm.dtype_out if "dtype_out" in torch.ops.aten.addmm.overloads() else None
)


class FakeAddmmOutDtype(TorchDispatchMode):
    """``torch.addmm(c, a, b, out_dtype=, out=)`` (``aten.addmm.dtype_out``, fused_rl's dW
    GEMM on a GPU) on fake tensors: checks the shapes and dtypes and returns ``out``, which the
    op writes in place (no new storage: what cuBLAS does on CUDA, workspaces aside as for
    every op here). Fake tensors hold no data, so nothing else about the op can matter to the
    model.

    Why not torch's own fake implementation: torch 2.11 registers ``aten.addmm``'s
    decomposition for every overload of ``addmm``, so ``dtype_out`` runs it with
    ``beta=out_dtype`` and fails on ``beta * self`` ("unsupported operand type(s) for *:
    'torch.dtype' and 'FakeTensor'"; torch 2.13 has a decomposition of its own for it). The
    model then counted memory a GPU never allocates: fused_rl's ``addmm_wide`` reads that
    TypeError as "no out_dtype here" and takes the CPU's path (fp32 copies of each chunk),
    and the fake-tensor mode logs the error with its traceback, whose frames (pinned by any
    handler that keeps records, pytest's log capture) keep the first chunk's tensors alive.
    The H200 run (torch 2.11) modelled 5,650,741,576 bytes at issue 14's shape, where this
    path gives 4,003,545,156 and the H200 measured 3,818 MB (4.00e9 bytes) on real tensors;
    ``tests/test_bench.py::test_linear_memory_model_with_torch_211_addmm`` replays it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ADDMM_DTYPE_OUT:
            return _addmm_dtype_out_fake(*args, **kwargs)
        return func(*args, **kwargs)


def _addmm_dtype_out_fake(bias, mat1, mat2, out_dtype, *, out, beta=1, alpha=1):
    """The checks of ``aten.addmm.dtype_out`` that a fake tensor can make; returns ``out``."""
    del beta, alpha  # scalars: no memory
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"addmm: mat1 {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)}")
    shape = (mat1.shape[0], mat2.shape[1])
    if tuple(out.shape) != shape or out.dtype != out_dtype:
        raise RuntimeError(
            f"addmm: out {tuple(out.shape)} {out.dtype}, expected {shape} {out_dtype}"
        )
    torch.broadcast_shapes(bias.shape, shape)  # raises when self does not broadcast
    return out


def model_device() -> str:
    """Where the model's fake tensors live: where fused_rl's Triton path runs. On a CUDA
    machine that is ``cuda`` (fake CUDA tensors allocate nothing); on CPU tensors it needs the
    Triton interpreter, which a CUDA machine does not enable (``backend="triton"`` raises)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


_UNSET = object()


@contextlib.contextmanager
def gemm_out_dtype(supported: bool | None = True):
    """Which path fused_rl's wide GEMMs take (``fused_rl._wide_gemm``: ``addmm_wide`` for
    ``dW += dz^T h_c`` in 16 bits, ``mm_wide`` for fp32 logits or gradients of 16-bit
    operands): ``True`` (the default of the model) as on CUDA, ``torch.addmm`` /
    ``torch.mm`` with ``out_dtype=fp32`` (``dW`` accumulated in place); ``False`` as on CPU,
    which has no ``out_dtype``: fp32 copies of the operands (the chunk's ``dz`` and rows);
    ``None``: what this process found out (a real CPU run before the model would otherwise
    switch the model to the CPU path). Fake CPU tensors take either path."""
    try:
        from fused_rl import _wide_gemm

        table = _wide_gemm._MM_OUT_DTYPE
    except (ImportError, AttributeError):  # an older or reworked fused_rl: nothing to pin
        yield
        return
    if supported is None:
        yield
        return
    # the table is keyed by (device type, GEMM): pin every key the model can meet
    keys = [(device, gemm) for device in ("cpu", "cuda") for gemm in ("mm", "addmm")]
    saved = {key: table.get(key, _UNSET) for key in keys}
    table.update(dict.fromkeys(keys, supported))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is _UNSET:
                table.pop(key, None)
            else:
                table[key] = value


def model_peak(
    provider: str, case: Case, device=None, gemm_out_dtype_path: bool | None = True
) -> tuple[int | None, str]:
    """``(bytes, how)``: modelled peak bytes above the inputs of one run of ``case`` by
    ``provider``, or ``(None, why not)``; on fake tensors of ``device`` (default
    ``model_device()``), fused_rl's fused-linear dW GEMM on the path ``gemm_out_dtype``
    names (default: a GPU's)."""
    device = model_device() if device is None else device
    if provider == "compile":
        return None, "torch.compile is not modelled (measured on GPUs)"
    if provider == "liger" and (not P.liger_version() or case.op in LINEAR_OPS):
        # the fused-linear loss compiles its loss math and syncs on the upstream gradient:
        # no fake-tensor run; without liger_kernel, its source read once (0.8.5) stands in
        peak = liger_model_bytes(case)
        if peak is not None:
            return peak, "modelled from Liger 0.8.5's source"
        if case.op == "linear_token_logprobs":
            return None, "n/a: Liger has no public fused-linear per-token log-prob op"
        if case.variant in FULL_KL_VARIANTS:
            return None, "n/a: Liger's GRPO loss has no exact KL"
        if not P.liger_version():
            return None, "liger_kernel is not importable"
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fused_rl

    saved_check = fused_rl.config.check_values
    fused_rl.config.check_values = False  # value checks read data: none on fake tensors
    try:
        with (
            FakeTensorMode(),
            FakeAddmmOutDtype(),
            skip_triton_launches(),
            gemm_out_dtype(gemm_out_dtype_path),
        ):
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
                return peak, "modelled from Liger 0.8.5's source"
        return None, f"not modelled ({type(exc).__name__})"
    finally:
        fused_rl.config.check_values = saved_check


def model_peak_bytes(provider: str, case: Case, device=None) -> int | None:
    """Modelled peak bytes above the inputs (see ``model_peak``); None where not modelled."""
    return model_peak(provider, case, device)[0]


def memory_table(
    tokens: int,
    vocab: int,
    dtype: str,
    seqlen: int,
    device,
    measure: bool,
    ops=None,
    providers=None,
    groups=None,
) -> list[dict]:
    """Rows ``{case, provider, peak_mb, how}`` for the logits ops (default) or ``ops`` at one
    shape (linear ops at H = ``cases.HIDDEN["full"]``); ``providers`` (default: all) and
    ``groups`` (``(op, variant, mode)`` triples; default: every variant of ``ops``)."""
    from . import measure as M

    batch = max(1, tokens // seqlen)
    seqlen = tokens // batch
    rows = []
    for op in ops or ("token_logprobs", "policy_loss"):
        variants = OP_VARIANTS[op]
        if op == "policy_loss":  # the exact-KL variants too (not in OP_VARIANTS)
            variants += tuple((v, "fwd_bwd") for v in FULL_KL_VARIANTS)
        for variant, mode in variants:
            if groups is not None and (op, variant, mode) not in groups:
                continue
            hidden = HIDDEN["full"] if op in HIDDEN_OPS else None
            case = Case(op, variant, mode, batch, seqlen, vocab, dtype, hidden=hidden)
            inp = make_inputs(case, device) if measure else None
            for provider in providers or P.PROVIDERS:
                if not P.applies(provider, case):
                    continue
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


def memory_vs_tokens(
    tokens=MEMORY_TOKENS,
    vocab: int = 151936,
    dtype: str = "bf16",
    device="cpu",
    measure: bool = False,
    seqlen: int = FULL_SEQLEN,
    providers=MEMORY_PROVIDERS,
    groups=MEMORY_CASES,
) -> list[dict]:
    """The fused-linear ops' peak memory against the token count (H = ``HIDDEN["full"]``):
    ``memory_table`` rows at each of ``tokens`` (``T = min(seqlen, tokens)``), flattened to
    JSON-ready dicts ``{op, variant, mode, tokens, batch, seqlen, vocab, hidden, dtype,
    provider, peak_mb, how}``; measured on a GPU (``measure``), modelled otherwise."""
    ops = list(dict.fromkeys(op for op, _, _ in groups))
    out = []
    for n in tokens:
        rows = memory_table(n, vocab, dtype, min(seqlen, n), device, measure, ops=ops,
                            providers=providers, groups=groups)  # fmt: skip
        for row in rows:
            case = row["case"]
            out.append({"op": case.op, "variant": case.variant, "mode": case.mode,
                        "tokens": case.tokens, "batch": case.batch, "seqlen": case.seqlen,
                        "vocab": case.vocab, "hidden": case.hidden, "dtype": case.dtype,
                        "provider": row["provider"], "peak_mb": row["peak_mb"],
                        "how": row["how"]})  # fmt: skip
    return out


def format_memory_vs_tokens(rows: list[dict]) -> str:
    """One block per case: a row per token count, a column per provider (GB = 2^30 B)."""
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    lines = []
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["op"], r["variant"], r["mode"]), []).append(r)
    for (op, variant, mode), case_rows in by_case.items():
        first = case_rows[0]
        lines += ["", f"{op}[{variant}] {mode}, H={first['hidden']} V={first['vocab']} "
                      f"{first['dtype']}: peak GB above the inputs"]  # fmt: skip
        lines.append(f"{'tokens':>8} " + " ".join(f"{p:>13}" for p in providers))
        for n in dict.fromkeys(r["tokens"] for r in case_rows):
            cells = []
            for p in providers:
                r = next((x for x in case_rows if x["tokens"] == n and x["provider"] == p), None)
                mb = None if r is None else r["peak_mb"]
                cells.append(f"{mb / 1024:>13.2f}" if mb is not None else f"{'-':>13}")
            lines.append(f"{n:>8} " + " ".join(cells))
        hows = {r["provider"]: r["how"] for r in case_rows}
        lines += [f"  {p}: {how}" for p, how in hows.items()]
    return "\n".join(lines)


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
