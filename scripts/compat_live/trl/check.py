"""Live check of ``fused_rl.compat.trl`` against the installed TRL (``trl.trainer.utils``).

Run by ``scripts/test-compat-live.sh trl`` in a venv where ``scripts/compat_live/trl/install.sh``
installed TRL. Two parts:

1. A differential comparison of every adapter function with TRL's: values, gradients under a
   random upstream gradient, dtypes and shapes, over random shapes (odd V, one row, 2-D to
   4-D logits, sliced and strided logits), fp64 / fp32 / bf16 / fp16, temperatures, every
   kind of ``row_mask``, ``(..., K)`` indices, both fused_rl backends and both
   half-precision modes, plus edge cases (huge logits, ``-inf`` and NaN entries, bad
   arguments). Errors are RMS relative errors against a float64 oracle written here; under
   ``half_precision("original")`` fp16 / bf16 results must equal TRL's bit for bit.
2. TRL's own unit tests of these functions, run as released and with the functions
   monkeypatched to fused_rl's (in ``"original"`` mode, and in the default mode for the
   record). The wheel ships no tests: they come from ``--trl-tests`` / ``$TRL_TESTS`` (a
   ``tests/test_utils.py`` of TRL's repository) or are downloaded from GitHub at the
   installed version's tag.

Writes the JSON that ``scripts/compat_live/summary.py`` renders; exits 1 when a row fails.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import inspect
import json
import math
import os
import pathlib
import platform
import random
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
import xml.etree.ElementTree as ET

import torch

if not torch.cuda.is_available():  # run fused_rl's Triton kernels on CPU, as the tests do
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import trl  # noqa: E402
import trl.trainer.utils as U  # noqa: E402

import fused_rl.compat as compat  # noqa: E402
import fused_rl.compat._checks as ours_checks  # noqa: E402
import fused_rl.compat.trl as ours  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
NAMES = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
FUNCTIONS = ("selective_log_softmax", "entropy_from_logits")


# ----------------------------------------------------------------------------- helpers


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS relative error ``||out - ref|| / ||ref||`` over the finite entries of ``ref``
    (``inf`` where ``out`` is not finite there, or non-finite where ``ref`` is not)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    fin = torch.isfinite(ref)
    same_nonfinite = torch.equal(out[~fin].nan_to_num(), ref[~fin].nan_to_num())
    if not same_nonfinite or not torch.isfinite(out[fin]).all():
        return math.inf
    if fin.sum() == 0:
        return 0.0
    diff, scale = (out[fin] - ref[fin]).norm().item(), ref[fin].norm().item()
    return diff / scale if scale > 1e-12 else diff


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and values, NaN where the other is NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


# Triton 3.9's interpreter (kernels on CPU) converts fp32 to bf16 by truncation, not to the
# nearest value as compiled kernels do: a bf16 gradient written by an interpreted kernel can
# be one bf16 ulp (2^-7 relative) off where the fp32 value lies just above a midpoint.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BF16_TRUNCATION = 2.0**-7


def tolerance(dtype: torch.dtype, trl_err: float, *, kernel_bf16: bool = False) -> float:
    """The project's tolerance policy (CONTRIBUTING.md) against the float64 oracle;
    ``kernel_bf16``: a bf16 tensor written by an interpreted Triton kernel (see above)."""
    if dtype == torch.float64:
        return 1e-12
    if dtype == torch.float32:
        return 1e-5
    tol = max(2 * trl_err, 1e-3)
    if kernel_bf16 and INTERPRETED and dtype == torch.bfloat16:
        tol = max(tol, BF16_TRUNCATION)
    return tol


@contextlib.contextmanager
def backend(name: str):
    """Run the adapter on fused_rl's Triton kernels or on its plain-PyTorch reference: both
    modules that resolve it (the entropy's and the shared gather's) are forced."""
    modules = (ours, ours_checks)
    real = [m.resolve_backend for m in modules]
    if name == "reference":
        for m in modules:
            m.resolve_backend = lambda _backend, *tensors: "reference"
    try:
        yield
    finally:
        for m, fn in zip(modules, real):
            m.resolve_backend = fn


def trl_took_kernel(logits, index=None, row_mask=None) -> bool:
    """Whether TRL ran its own Triton kernel for these arguments (fp32 outputs, no half-
    precision path to reproduce), by TRL's own predicate."""
    supports = getattr(U, "_supports_trl_loss_kernel", None)
    available = getattr(U, "is_triton_available", lambda: False)
    return bool(supports and available() and supports(logits, index, row_mask))


def run(fn, logits, *args, upstream_seed: int, view=None, **kwargs):
    """``fn(view(leaf), *args, **kwargs)`` and the gradient of ``view(leaf)`` under a seeded
    random upstream gradient (in the output's dtype), for a fresh leaf holding ``logits``
    (``view``: a strided view of it, so that the function sees a non-contiguous tensor); an
    exception is returned as such."""
    view = view or (lambda t: t)
    leaf = logits.detach().clone().requires_grad_()
    try:
        out = fn(view(leaf), *args, **kwargs)
    except Exception as exc:
        return exc, None, None
    gen = torch.Generator().manual_seed(upstream_seed)
    up = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    if out.requires_grad:
        out.backward(up.to(out.dtype))
    grad = None if leaf.grad is None else view(leaf.grad)
    return out.detach(), grad, up


# ----------------------------------------------------------------------------- oracles


def oracle_selective(logits, index, temperature=1.0, row_mask=None):
    """float64 ``log_softmax(logits / T).gather(index)``, 0 where ``row_mask == 0``."""
    logp = F.log_softmax(logits.double() / temperature, dim=-1)
    squeeze = index.dim() == logits.dim() - 1
    idx = index.long().unsqueeze(-1) if squeeze else index.long()
    out = logp.gather(-1, idx)
    out = out.squeeze(-1) if squeeze else out
    if row_mask is not None:
        out = torch.where(row_mask == 0, torch.zeros_like(out), out)
    return out


def oracle_entropy(logits):
    """float64 ``-sum p log p`` (``p log p = 0`` where ``p = 0``)."""
    logp = F.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    return -torch.where(p == 0, torch.zeros_like(p), p * logp).sum(-1)


def oracle_grad(fn, logits, up, *args, **kwargs):
    leaf = logits.detach().double().requires_grad_()
    fn(leaf, *args, **kwargs).backward(up)
    return leaf.grad


# ----------------------------------------------------------------------------- random cases

V_CHOICES = (1, 2, 7, 33, 100, 257, 1000, 1031)
LEAD_CHOICES = ((1,), (1, 1), (2, 3), (3, 5), (6,), (2, 2, 3))
TEMPERATURES = (1.0, 1.0, 0.7, 2.0, 0.3)


def make_logits(rng: random.Random, dtype: torch.dtype):
    """``(buffer, view, description)``: random logits ``view(buffer)``, contiguous, sliced
    along a leading dim (the model's buffer ``full[:, :-1]``) or strided along V; the scale
    varies from 1 to 20."""
    lead, vocab = rng.choice(LEAD_CHOICES), rng.choice(V_CHOICES)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = rng.choice((1.0, 3.0, 20.0))
    layout = rng.choice(("contiguous", "sliced", "strided"))
    if layout == "sliced" and len(lead) >= 2:
        full = torch.randn(*lead[:-1], lead[-1] + 1, vocab, generator=gen, dtype=torch.float64)
        view = lambda t: t[..., :-1, :]
    elif layout == "strided":
        full = torch.randn(*lead, 2 * vocab, generator=gen, dtype=torch.float64)
        view = lambda t: t[..., ::2]
    else:
        layout = "contiguous"
        full = torch.randn(*lead, vocab, generator=gen, dtype=torch.float64)
        view = lambda t: t
    full = (full * scale).to(dtype).to(DEVICE)
    return full, view, f"{tuple(lead)}x{vocab} {layout} x{scale:g}"


def make_selective_case(rng: random.Random, dtype: torch.dtype):
    full, view, desc = make_logits(rng, dtype)
    logits = view(full)
    lead, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    k = rng.choice((None, None, 1, 4))
    shape = lead if k is None else (*lead, k)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    index = torch.randint(0, vocab, shape, generator=gen)
    index = index.to(rng.choice((torch.int64, torch.int32))).to(DEVICE)
    kind = rng.choice(("none", "none", "bool", "int", "float", "broadcast"))
    row_mask = None
    if kind == "bool":
        row_mask = torch.rand(shape, generator=gen) > 0.3
    elif kind == "int":
        row_mask = (torch.rand(shape, generator=gen) > 0.3).long()
    elif kind == "float":  # TRL masks ``row_mask == 0``: 0.5 and NaN count
        choices = torch.tensor([0.0, 1.0, 0.5, float("nan")])
        row_mask = choices[torch.randint(0, 4, shape, generator=gen)]
    elif kind == "broadcast":
        row_mask = (torch.rand((1,) * (len(shape) - 1) + shape[-1:], generator=gen) > 0.3).int()
    if row_mask is not None:
        row_mask = row_mask.to(DEVICE)
    temperature = rng.choice(TEMPERATURES)
    kwargs = {}
    if temperature != 1.0 or rng.random() < 0.5:
        kwargs["temperature"] = temperature
    if row_mask is not None:
        kwargs["row_mask"] = row_mask
    desc += f" index {tuple(shape)} {str(index.dtype)[6:]} T={temperature:g} mask={kind}"
    return full, view, (index,), kwargs, desc


def make_entropy_case(rng: random.Random, dtype: torch.dtype):
    full, view, desc = make_logits(rng, dtype)
    kwargs = {"chunk_size": rng.choice((1, 2, 16, 128))} if rng.random() < 0.7 else {}
    return full, view, (), kwargs, desc + f" {kwargs}"


class Tally:
    """Worst errors and failures of one (function, dtype, mode) group of cases."""

    def __init__(self):
        self.cases = self.failures = self.bitwise = self.bitwise_ok = 0
        self.ours_err = self.trl_err = self.ours_gerr = self.trl_gerr = 0.0
        self.max_diff = 0.0
        self.messages: list[str] = []

    def fail(self, msg: str) -> None:
        self.failures += 1
        if len(self.messages) < 3:
            self.messages.append(msg)


def compare_case(tally, fn_name, case, mode, which, seed):
    full, view, args, kwargs, desc = case
    logits = view(full)
    fn_ours, fn_trl = getattr(ours, fn_name), getattr(U, fn_name)
    tally.cases += 1
    with compat.half_precision(mode), backend(which):
        got, got_grad, up = run(fn_ours, full, *args, upstream_seed=seed, view=view, **kwargs)
    want, want_grad, _ = run(fn_trl, full, *args, upstream_seed=seed, view=view, **kwargs)
    where = f"{desc} [{which}, {mode}]"
    if isinstance(want, Exception) or isinstance(got, Exception):
        tally.fail(f"{where}: ours {got!r}, TRL {want!r}")
        return
    if got.dtype != want.dtype or got.shape != want.shape:
        tally.fail(
            f"{where}: ours {got.dtype} {tuple(got.shape)}, TRL {want.dtype} {tuple(want.shape)}"
        )
        return
    if got_grad.dtype != want_grad.dtype or got_grad.shape != want_grad.shape:
        tally.fail(f"{where}: gradient dtype/shape {got_grad.dtype} vs {want_grad.dtype}")
        return
    if fn_name == "selective_log_softmax":
        oracle = lambda z: oracle_selective(z, *args, **kwargs)
    else:
        oracle = oracle_entropy
    ref = oracle(logits)
    ref_grad = oracle_grad(oracle, logits, up)
    errs = (
        rel_err(got, ref),
        rel_err(want, ref),
        rel_err(got_grad, ref_grad),
        rel_err(want_grad, ref_grad),
    )
    tally.ours_err, tally.trl_err = max(tally.ours_err, errs[0]), max(tally.trl_err, errs[1])
    tally.ours_gerr, tally.trl_gerr = max(tally.ours_gerr, errs[2]), max(tally.trl_gerr, errs[3])
    fin = torch.isfinite(want)
    if fin.any():
        diff = (got.double() - want.double())[fin].abs().max().item()
        tally.max_diff = max(tally.max_diff, diff)
    bitwise = mode == "original" and logits.dtype in HALF
    bitwise = bitwise and not trl_took_kernel(logits, *args, kwargs.get("row_mask"))
    if bitwise:
        tally.bitwise += 1
        if bit_equal(got, want) and bit_equal(got_grad, want_grad):
            tally.bitwise_ok += 1
        else:
            tally.fail(
                f"{where}: not bit-equal to TRL (value err {errs[0]:.2g}, TRL {errs[1]:.2g})"
            )
        return
    grad_tol = tolerance(logits.dtype, errs[3], kernel_bf16=which == "triton")
    if errs[0] > tolerance(logits.dtype, errs[1]) or errs[2] > grad_tol:
        tally.fail(
            f"{where}: error {errs[0]:.3g} / grad {errs[2]:.3g} against float64 "
            f"(TRL {errs[1]:.3g} / {errs[3]:.3g})"
        )


def differential(rows: list, n_cases: int, seed: int) -> None:
    makers = {
        "selective_log_softmax": make_selective_case,
        "entropy_from_logits": make_entropy_case,
    }
    for fn_name, maker in makers.items():
        for mode in ("accurate", "original"):
            for dtype in DTYPES:
                tally = Tally()
                rng = random.Random(f"{seed}-{fn_name}-{NAMES[dtype]}")
                for i in range(n_cases):
                    case = maker(rng, dtype)
                    for which in ("triton", "reference"):
                        compare_case(tally, fn_name, case, mode, which, seed=1000 * i + 7)
                detail = (
                    f"{tally.cases // 2} random cases x 2 backends; RMS rel. error vs float64: "
                    f"values {tally.ours_err:.2g} (TRL {tally.trl_err:.2g}), gradients "
                    f"{tally.ours_gerr:.2g} (TRL {tally.trl_gerr:.2g}); max |ours - TRL| "
                    f"{tally.max_diff:.2g}"
                )
                if dtype == torch.bfloat16 and mode == "accurate" and INTERPRETED:
                    detail += " (interpreted kernels truncate bf16 gradients: bound 2^-7)"
                if tally.bitwise:
                    detail += "; bit-equal to TRL (values and gradients) in "
                    detail += f"{tally.bitwise_ok}/{tally.bitwise}"
                if tally.messages:
                    detail += "; FAILED: " + " | ".join(tally.messages)
                rows.append(
                    {
                        "check": f"{fn_name} {NAMES[dtype]}, {mode} mode",
                        "result": "fail" if tally.failures else "pass",
                        "detail": detail,
                    }
                )
                print(rows[-1]["check"], rows[-1]["result"], "-", detail, flush=True)


# ----------------------------------------------------------------------------- fixed checks


def signature_rows(rows: list) -> None:
    for name in FUNCTIONS:
        a, b = inspect.signature(getattr(ours, name)), inspect.signature(getattr(U, name))
        pa = [(p.name, p.kind, p.default) for p in a.parameters.values()]
        pb = [(p.name, p.kind, p.default) for p in b.parameters.values()]
        rows.append(
            {
                "check": f"{name} signature",
                "result": "pass" if pa == pb else "fail",
                "detail": f"ours {a}; TRL {b}",
            }
        )


def edge_rows(rows: list) -> None:
    def add(check, result, detail):
        rows.append({"check": check, "result": result, "detail": detail})
        print(check, result, "-", detail, flush=True)

    gen = torch.Generator().manual_seed(5)
    sls_o, sls_t = ours.selective_log_softmax, U.selective_log_softmax
    ent_o, ent_t = ours.entropy_from_logits, U.entropy_from_logits

    # the old two-argument call, positional temperature / row_mask
    z = torch.randn(3, 4, 50, generator=gen).to(DEVICE)
    idx = torch.randint(0, 50, (3, 4), generator=gen).to(DEVICE)
    m = (torch.rand(3, 4, generator=gen) > 0.5).to(DEVICE)
    errs = [
        rel_err(sls_o(z, idx), sls_t(z, idx)),
        rel_err(sls_o(z, idx, 0.6, m), sls_t(z, idx, 0.6, m)),
        rel_err(sls_o(z, idx, row_mask=m, temperature=0.6), sls_t(z, idx, 0.6, m)),
    ]
    add(
        "positional and keyword calls (2-arg form, (z, i, T, mask), keywords)",
        "pass" if max(errs) <= 1e-6 else "fail",
        f"max error vs TRL {max(errs):.2g}",
    )

    # huge logits: |z| ~ 1e4 in fp32 (selected - logsumexp cancels in TRL's fp32 path)
    for what, z in (
        ("N(0, 1e4^2)", torch.randn(4, 6, 300, generator=gen) * 1e4),
        ("1e4 + N(0, 1)", 1e4 + torch.randn(4, 6, 300, generator=gen)),
    ):
        z = z.to(DEVICE)
        idx = torch.randint(0, 300, (4, 6), generator=gen).to(DEVICE)
        results = []
        for fn_o, fn_t, oracle, args in (
            (sls_o, sls_t, oracle_selective, (idx,)),
            (ent_o, ent_t, oracle_entropy, ()),
        ):
            got, got_g, up = run(fn_o, z, *args, upstream_seed=3)
            want, want_g, _ = run(fn_t, z, *args, upstream_seed=3)
            ref, ref_g = oracle(z, *args), oracle_grad(oracle, z, up, *args)
            results.append(
                (
                    rel_err(got, ref),
                    rel_err(want, ref),
                    rel_err(got_g, ref_g),
                    rel_err(want_g, ref_g),
                )
            )
        ok = all(r[0] <= 1e-5 and r[2] <= 1e-5 for r in results)
        detail = "; ".join(
            f"{n}: values {r[0]:.2g} (TRL {r[1]:.2g}), gradients {r[2]:.2g} (TRL {r[3]:.2g})"
            for n, r in zip(FUNCTIONS, results)
        )
        add(f"huge fp32 logits {what}", "pass" if ok else "fail", detail)

    # -inf entries (a top-k / top-p filtered vocabulary), both modes, every dtype
    z64 = torch.randn(3, 5, 40, generator=gen, dtype=torch.float64)
    z64[..., 25:] = float("-inf")
    idx = torch.randint(0, 25, (3, 5), generator=gen).to(DEVICE)
    idx[0, 0] = 30  # one target at -inf: log-prob -inf
    bad, finite_entropy = [], True
    for dtype in DTYPES:
        z = z64.to(dtype).to(DEVICE)
        for mode in ("accurate", "original"):
            with compat.half_precision(mode):
                got, got_g, up = run(sls_o, z, idx, upstream_seed=4)
                e_got = ent_o(z)
            want, want_g, _ = run(sls_t, z, idx, upstream_seed=4)
            e_want = ent_t(z)
            exact = mode == "original" and dtype in HALF and not trl_took_kernel(z, idx)
            if exact:
                ok = bit_equal(got, want) and bit_equal(got_g, want_g) and bit_equal(e_got, e_want)
            else:
                ref = oracle_selective(z, idx)
                ref_g = oracle_grad(oracle_selective, z, up, idx)
                ok = got.dtype == want.dtype
                ok = ok and rel_err(got, ref) <= tolerance(dtype, rel_err(want, ref))
                g_tol = tolerance(dtype, rel_err(want_g, ref_g), kernel_bf16=True)
                ok = ok and rel_err(got_g, ref_g) <= g_tol
                finite_entropy &= bool(torch.isfinite(e_got).all())
                # TRL's entropy is NaN here: bound ours by its dtype's rounding instead
                e_tol = torch.finfo(dtype).eps if dtype in HALF else tolerance(dtype, 0.0)
                ok = ok and rel_err(e_got, oracle_entropy(z)) <= e_tol
            if not ok:
                bad.append(f"{NAMES[dtype]} {mode}")
    add(
        "-inf logits: selective_log_softmax values, gradients; entropy",
        "fail" if bad else "pass",
        "every dtype, both modes (original: bit-equal in fp16 / bf16)"
        + (f"; FAILED: {bad}" if bad else ""),
    )
    trl_nan = bool(ent_t(z64.float().to(DEVICE)).isnan().all())
    add(
        "-inf logits: entropy_from_logits value",
        "documented",
        f"fused_rl finite and equal to the float64 oracle ({finite_entropy}); TRL NaN "
        f"({trl_nan}, its 0 * -inf), kept in 'original' mode",
    )

    # NaN logits: NaN out where they count
    z = torch.randn(2, 3, 20, generator=gen).to(DEVICE)
    z[0, 1, 4] = float("nan")
    idx = torch.randint(0, 20, (2, 3), generator=gen).to(DEVICE)
    same = all(
        torch.equal(fo(z, *a).isnan(), ft(z, *a).isnan())
        for fo, ft, a in ((sls_o, sls_t, (idx,)), (ent_o, ent_t, ()))
    )
    add("NaN logit: NaN in the same places", "pass" if same else "fail", "both functions")

    # row_mask over a NaN row and over an out-of-range label
    mask = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    mask[0, 1] = False
    got, got_g, _ = run(sls_o, z, idx, row_mask=mask, upstream_seed=6)
    want, want_g, _ = run(sls_t, z, idx, row_mask=mask, upstream_seed=6)
    add(
        "row_mask over a NaN row",
        "documented",
        f"value: ours {got[0, 1].item()}, TRL {want[0, 1].item()}; gradient of that row: ours "
        f"{'0' if bool((got_g[0, 1] == 0).all()) else 'not 0'}, TRL's PyTorch path "
        f"{'NaN' if bool(want_g[0, 1].isnan().any()) else 'finite'} (its kernel: 0); other "
        f"rows' gradients agree ({rel_err(got_g[1], want_g[1]):.2g})",
    )
    z = torch.randn(2, 3, 20, generator=gen).to(DEVICE)
    bad_idx = idx.clone()
    bad_idx[0, 1] = -100
    got = sls_o(z, bad_idx, row_mask=mask)
    want = run(sls_t, z, bad_idx, row_mask=mask, upstream_seed=0)[0]
    add(
        "masked label -100",
        "documented",
        f"ours: skipped, 0 ({got[0, 1].item()}), like TRL's kernel; TRL's PyTorch path: "
        f"{type(want).__name__ if isinstance(want, Exception) else 'ran'}",
    )

    # argument errors
    def raised(fn, *a, **k):
        try:
            fn(*a, **k)
        except Exception as exc:
            return type(exc).__name__
        return "none"

    z = torch.randn(2, 3, 20, generator=gen).to(DEVICE)
    both = [
        (t, raised(sls_o, z, idx, temperature=t), raised(sls_t, z, idx, temperature=t))
        for t in (0.0, -1.0)
    ]
    ok = all(a == b == "ValueError" for _, a, b in both)
    add("temperature <= 0", "pass" if ok else "fail", f"(T, ours, TRL): {both}")
    diffs = [
        (repr(t), raised(sls_o, z, idx, temperature=t), raised(sls_t, z, idx, temperature=t))
        for t in (float("nan"), float("inf"), torch.tensor(0.5))
    ]
    add(
        "temperature NaN / inf / tensor",
        "documented",
        f"(T, ours, TRL): {diffs}; fused_rl takes finite real numbers only",
    )
    bad_idx = idx.clone()
    bad_idx[1, 2] = -100
    add(
        "unmasked label -100",
        "documented",
        f"ours {raised(sls_o, z, bad_idx)} naming index, TRL {raised(sls_t, z, bad_idx)}",
    )
    add(
        "chunk_size 0",
        "documented",
        f"ours {raised(ent_o, z, 0)} naming chunk_size, TRL {raised(ent_t, z, 0)}",
    )
    add(
        "row_mask that does not broadcast to index",
        "pass" if raised(sls_o, z, idx, row_mask=torch.ones(3, 2)) != "none" else "fail",
        f"ours {raised(sls_o, z, idx, row_mask=torch.ones(3, 2))} naming row_mask, TRL "
        f"{raised(sls_t, z, idx, row_mask=torch.ones(3, 2))}",
    )
    wide = torch.ones(4, 2, 3, device=DEVICE)
    trl_wide = run(sls_t, z, idx, row_mask=wide, upstream_seed=0)[0]
    add(
        "row_mask with more dims than index, (4, 2, 3) for (2, 3)",
        "documented",
        f"ours {raised(sls_o, z, idx, row_mask=wide)} naming row_mask; TRL's PyTorch path: "
        + (
            type(trl_wide).__name__
            if isinstance(trl_wide, Exception)
            else f"a {tuple(trl_wide.shape)} result"
        ),
    )

    # 1-D logits and empty leading dimensions
    z1 = torch.randn(9, generator=gen).to(DEVICE)
    i0 = torch.tensor(4, device=DEVICE)
    got = sls_o(z1, i0)
    ok = got.shape == () and rel_err(got, oracle_selective(z1, i0)) <= 1e-6
    want = [run(sls_t, z1.to(dt), i0, upstream_seed=0)[0] for dt in (torch.float32, torch.bfloat16)]
    desc = [
        type(w).__name__ if isinstance(w, Exception) else f"shape {tuple(w.shape)}" for w in want
    ]
    add(
        "1-D logits (V,), 0-d index",
        "documented" if ok else "fail",
        f"ours 0-d, correct ({ok}); TRL's PyTorch path fp32: {desc[0]}, bf16: {desc[1]} "
        "(its kernel: 0-d)",
    )
    ze = torch.randn(0, 3, 5).to(DEVICE)
    ie = torch.zeros(0, 3, dtype=torch.long, device=DEVICE)
    add(
        "empty leading dimension (0, 3, V)",
        "documented",
        f"ours {tuple(sls_o(ze, ie).shape)}; TRL {raised(sls_t, ze, ie)}",
    )


# ----------------------------------------------------------------------------- TRL's tests

TEST_URL = "https://raw.githubusercontent.com/huggingface/trl/v{version}/tests/test_utils.py"
TARGETS = ("selective_log_softmax", "entropy_from_logits")

PATCH_CONFTEST = """
import pytest
import trl.trainer.utils as U
import fused_rl.compat as compat
import fused_rl.compat.trl as ours

MODE = {mode!r}


@pytest.fixture(autouse=True)
def _fused_rl(request, monkeypatch):
    for name in {targets!r}:
        monkeypatch.setattr(U, name, getattr(ours, name))
        if hasattr(request.module, name):
            monkeypatch.setattr(request.module, name, getattr(ours, name))
    with compat.half_precision(MODE):
        yield
"""


def fetch_tests(source: str | None, origin: str | None, version: str) -> tuple[str | None, str]:
    """TRL's ``tests/test_utils.py`` and where it came from."""
    if source:
        return pathlib.Path(source).read_text(), origin or source
    url = TEST_URL.format(version=version)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.read().decode(), url
    except Exception as exc:
        return None, f"{url} ({type(exc).__name__})"


def extract_tests(text: str) -> str:
    """The module's imports and the top-level tests that use the two functions, with the
    names it takes from its own ``tests/testing_utils.py`` replaced by stand-ins and its
    ``from trl... import`` lists cut down to the names those tests use."""
    tree = ast.parse(text)
    lines = text.splitlines()

    def source(node):
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        return "\n".join(lines[first - 1 : node.end_lineno])

    tests = [
        n
        for n in tree.body
        if isinstance(n, (ast.ClassDef, ast.FunctionDef))
        and any(isinstance(x, ast.Name) and x.id in TARGETS for x in ast.walk(n))
    ]
    used = {x.id for n in tests for x in ast.walk(n) if isinstance(x, ast.Name)}
    used |= {
        d.id
        for n in tests
        for d in ast.walk(n)
        if isinstance(d, ast.Attribute)
        for d in [d.value]
        if isinstance(d, ast.Name)
    }
    imports, stubs = [], []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            stubs += [a.asname or a.name for a in node.names if (a.asname or a.name) in used]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl"):
            names = [a for a in node.names if (a.asname or a.name) in used]
            if names:
                imports.append(ast.unparse(ast.ImportFrom(node.module, names, 0)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imports.append(source(node))
    header = ["import pytest", ""]
    for name in stubs:
        if name.startswith("require_"):
            header.append(f"{name} = pytest.mark.skip(reason='stand-in for {name}')")
        else:  # TrlTestCase and the like: a plain base class
            header.append(f"class {name}:\n    pass")
    return "\n\n".join(["\n".join(header), *imports, *map(source, tests)]) + "\n"


def run_pytest(directory: pathlib.Path, label: str) -> tuple[int, int, list[str]]:
    """(passed, total, failing test ids) of ``pytest directory``."""
    xml = directory / f"{label}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={xml}",
        str(directory),
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            filter(
                None,
                [str(pathlib.Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH")],
            )
        ),
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=directory)
    if not xml.exists():
        raise RuntimeError(f"pytest did not run: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    suite = ET.parse(xml).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    failing = [
        f"{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return total - len(failing), total, failing


def trl_test_rows(rows: list, source: str | None, origin: str | None, version: str) -> None:
    text, origin = fetch_tests(source, origin, version)
    if text is None:
        rows.append(
            {
                "check": "TRL's own tests of these functions",
                "result": "fail",
                "detail": f"not run: could not fetch {origin}; pass --trl-tests",
            }
        )
        return
    body = extract_tests(text)
    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        for label, mode in (("released", None), ("original", "original"), ("accurate", "accurate")):
            directory = root / label
            directory.mkdir()
            (directory / "test_trl_upstream.py").write_text(body)
            if mode is not None:
                conftest = PATCH_CONFTEST.format(mode=mode, targets=TARGETS)
                (directory / "conftest.py").write_text(textwrap.dedent(conftest))
            counts[label] = run_pytest(directory, label)
            print(label, counts[label][:2], flush=True)
    released, original, accurate = counts["released"], counts["original"], counts["accurate"]
    where = f"tests/test_utils.py from {origin}"
    rows.append(
        {
            "check": "TRL's own tests, as released",
            "result": "pass" if released[0] == released[1] and released[1] > 0 else "fail",
            "detail": f"{released[0]}/{released[1]} passed ({where})",
        }
    )
    rows.append(
        {
            "check": "TRL's own tests, patched to fused_rl, half_precision('original')",
            "result": "pass" if original[0] == released[0] and original[1] > 0 else "fail",
            "detail": f"{original[0]}/{original[1]} passed"
            + (f"; failing: {original[2][:5]}" if original[2] else ""),
        }
    )
    rows.append(
        {
            "check": "TRL's own tests, patched to fused_rl, default 'accurate' mode",
            "result": "documented",
            "detail": f"{accurate[0]}/{accurate[1]} passed; the others compare fp16 / bf16 "
            "with torch.equal to TRL's half-precision arithmetic, which the default mode "
            "does not reproduce (it is fp32-accurate, rounded once)",
        }
    )


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON file to write")
    parser.add_argument("--cases", type=int, default=12, help="random cases per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-tests",
        default=os.environ.get("TRL_TESTS"),
        help="TRL's tests/test_utils.py (default: download at the version tag)",
    )
    parser.add_argument(
        "--trl-tests-origin",
        default=os.environ.get("TRL_TESTS_ORIGIN"),
        help="where that file comes from (a commit, a tag), for the report",
    )
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    rows: list[dict] = []
    start = time.monotonic()
    signature_rows(rows)
    differential(rows, args.cases, args.seed)
    print(f"differential: {time.monotonic() - start:.0f} s", flush=True)
    edge_rows(rows)
    print(f"edge cases: {time.monotonic() - start:.0f} s", flush=True)
    trl_test_rows(rows, args.trl_tests, args.trl_tests_origin, trl.__version__)
    print(f"TRL's tests: {time.monotonic() - start:.0f} s", flush=True)

    import transformers
    import triton

    versions = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": DEVICE,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"library": "trl", "versions": versions, "rows": rows}, indent=1) + "\n"
    )
    failed = [r["check"] for r in rows if r["result"] == "fail"]
    print(f"{len(rows)} rows, {len(failed)} failed: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
