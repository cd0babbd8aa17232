"""Shared test helpers: error metrics and float64 oracles."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FP32_TOL = 1e-5
# fp64 results, on every device (CONTRIBUTING.md, "Tolerance policy"): a GPU's FMA
# contraction and libdevice exp/log (<= 2 ulp) cost ~1e-15; more is an fp32 intermediate
F64_TOL = 1e-12
U32 = 2.0**-24  # fp32 unit roundoff

# The backends whose batch invariance is guaranteed (docs/numerics.md): on a GPU the
# reference backend's torch reductions choose how to split a row by the tensor's shape (the
# batch), and its rows moved by an ulp with the batch on an H200; there the guarantee is the
# Triton kernels'. On the CPU both hold.
BATCH_INVARIANT_BACKENDS = (
    "triton",
    pytest.param(
        "reference",
        marks=pytest.mark.skipif(
            torch.cuda.is_available(), reason="the reference's CUDA reductions vary with the batch"
        ),
    ),
)


# helpers.gradcheck's fast-mode tolerances (float64 central differences: ~1e-10)
FAST_ATOL, FAST_RTOL = 1e-8, 1e-6


def gradcheck(fn, inputs, **kwargs) -> bool:
    """``torch.autograd.gradcheck`` (float64), in its fast mode where the Triton interpreter
    runs the kernels: the finite difference of ``fn`` along one random direction per input
    against the analytic Jacobian projected on it (two calls of ``fn`` per input, where the
    full mode makes two per ELEMENT, each slow through the interpreter). One projection
    sums every element's error, so its tolerance is tightened to ``atol`` 1e-8, ``rtol``
    1e-6 (float64's central differences are good to ~1e-10): then a 1% error in one
    gradient element is caught about as often as by the full mode at its tolerance. The
    full Jacobian is checked on a GPU; every element is also compared with the float64
    oracle by each op's parity tests."""
    from fused_rl._backend import interpreter_enabled

    if not interpreter_enabled():
        return torch.autograd.gradcheck(fn, inputs, **kwargs)
    atol = min(kwargs.pop("atol", FAST_ATOL), FAST_ATOL)
    rtol = min(kwargs.pop("rtol", FAST_RTOL), FAST_RTOL)
    return torch.autograd.gradcheck(fn, inputs, fast_mode=True, atol=atol, rtol=rtol, **kwargs)


def clamp_in(x: torch.Tensor, lo: float | torch.Tensor | None = None,
             hi: float | torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``torch.clamp`` (number or constant tensor bounds) whose gradient passes whole on the
    bounds, for the oracles: torch 2.14 gives ``torch.clamp`` a zero gradient there with
    number bounds and half of it with tensor bounds; torch <= 2.13 and the kernels pass it
    (the oracles put ratios exactly on a bound on purpose). Written apart from the
    reference's ``clamp``: an oracle does not import what it judges."""
    inside = torch.ones_like(x, dtype=torch.bool)
    if lo is not None:
        inside = inside & (x >= lo)
    if hi is not None:
        inside = inside & (x <= hi)
    return torch.where(inside, x, x.detach().clamp(lo, hi))


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """RMS relative error ``||out - ref|| / ||ref||`` (absolute when ``ref`` is ~0)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all() or not torch.isfinite(ref).all(), "non-finite output"
    diff = (out - ref).norm().item()
    scale = ref.norm().item()
    return diff / scale if scale > 1e-12 else diff + floor


def assert_rel(out, ref, tol: float, what: str = "") -> None:
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: RMS relative error {err:.3g} > {tol:.3g}"


def bf16_tol(eager_same_dtype: torch.Tensor, oracle: torch.Tensor, slack: float = 2.0) -> float:
    """Tolerance for a low-precision output: the eager same-dtype error times ``slack``,
    with a floor of 1e-3 (bf16 has an 8-bit mantissa)."""
    return max(slack * rel_err(eager_same_dtype, oracle), 1e-3)


def oracle_token_stats(logits, targets, temperature=1.0, ignore_index=-100):
    """float64 ``(logp, entropy)`` via plain autograd-able ``log_softmax``; zeros where ignored."""
    z = torch.log_softmax(logits.double() / temperature, dim=-1)
    entropy = -(z.exp() * z).nan_to_num(0.0).sum(-1)
    if targets is None:
        return None, entropy
    keep = targets != ignore_index
    logp = z.gather(-1, torch.where(keep, targets, 0).long()[..., None])[..., 0]
    zero = torch.zeros_like(logp)
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero)


def seed_gae_loop(rewards, values, gamma, lam):
    """Seed 004's GAE loop as written there (Python loop over T, in the inputs' dtype):
    ``(advantages, returns = advantages + values)``; the oracle every GAE test builds on."""
    last = 0.0
    reversed_adv = []
    length = rewards.shape[1]
    for t in reversed(range(length)):
        next_values = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    return advantages, advantages + values


def fp32_neighbours_sharing_z(temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_k, below)``: the first fp32 logit from 1.0 up whose lower neighbour (one ulp)
    has the same ``z = x * fp32(1 / T)`` (scalars; all the candidates scaled at once)."""
    inv_t = torch.tensor(1 / temperature, dtype=torch.float32)
    one = int(torch.tensor(1.0).view(torch.int32))
    x = torch.arange(one, one + (1 << 23), dtype=torch.int32).view(torch.float32)  # [1, 2)
    z = x * inv_t
    i = int(torch.nonzero(z[1:] == z[:-1])[0]) + 1
    return x[i].clone(), x[i - 1].clone()


def fp32_exp_tol(max_arg: float, device, floor: float = 1e-6) -> float:
    """Tolerance for an fp32 value computed through ``exp`` of an argument up to
    ``|max_arg|``, checked tighter than ``FP32_TOL``.

    exp's relative condition number is ``|x|``. The interpreter's numpy exp is within 1 ulp
    at any ``x`` (``floor`` covers it); Triton lowers an fp32 ``tl.exp(x)`` on a GPU to
    ``ex2.approx(x * log2(e))`` with the product rounded to fp32, a relative error of up to
    ``|x| * U32`` in the result, plus ~2 ulp of ``ex2.approx``: twice that bound on CUDA.
    """
    if torch.device(device).type != "cuda":
        return floor
    return max(floor, 2.0 * (abs(max_arg) + 2.0) * U32)


@contextlib.contextmanager
def compiled_scalar_abi():
    """Within the block the Triton interpreter passes Python floats to kernels as fp32, as a
    compiled launch does (``triton.runtime.jit.mangle_type(0.1) == "fp32"``); the interpreter
    otherwise keeps them fp64, so a hyper-parameter that reaches an fp64 kernel without
    ``f32_pair`` is exact on CPU and rounded to fp32 on a GPU. No-op without the interpreter
    (compiled kernels already do this)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter._implicit_cvt

    def as_compiled(arg):
        if isinstance(arg, float):
            handle = interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32)
            return tl.tensor(handle, tl.float32)
        return original(arg)

    interpreter._implicit_cvt = as_compiled
    try:
        yield
    finally:
        interpreter._implicit_cvt = original


@contextlib.contextmanager
def pinned_compile_options():
    """Within the block a launch of a fused_rl kernel that does not pass
    ``fused_rl._launch.COMPILE_OPTIONS`` (directly or through ``vocab_launch``) raises: left
    unset, FMA contraction follows Triton's default, which Triton 3.10 turns off. Checked on
    the launch path itself (``run``: what ``kernel[grid](...)`` calls), interpreted or
    compiled. No-op without Triton."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    from fused_rl._launch import COMPILE_OPTIONS

    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def checked(run):
        def launch(self, *args, **kwargs):
            fn = self.fn
            if fn.__module__.startswith("fused_rl.") and any(
                kwargs.get(k) != v for k, v in COMPILE_OPTIONS.items()
            ):
                raise AssertionError(
                    f"{fn.__module__}.{fn.__name__} launched without COMPILE_OPTIONS "
                    f"(fused_rl._launch): {sorted(kwargs)}"
                )
            return run(self, *args, **kwargs)

        return launch

    for cls, run in originals.items():
        cls.run = checked(run)
    try:
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


@contextlib.contextmanager
def helper_calls_patch_once():
    """Within the block the Triton interpreter skips re-patching ``triton.language`` at each
    call of a ``@triton.jit`` helper inside a kernel: the launch has patched it already and
    keeps it patched until the kernel returns, so the re-patch (an ``inspect.getmembers``
    scan of four modules, about a millisecond) changes nothing but costs most of the time of
    kernels that call helpers in loops (the truncated search). No-op without the
    interpreter; nothing a kernel computes changes."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter._patch_lang
    modules: dict = {}  # id(globals) -> the language modules in them (a scan each call cost)

    def once(fn):
        # the modules it would patch (fn's globals: triton.language and / or its core), each
        # already patched (its builtins replaced) by the launch or an earlier helper call
        langs = modules.get(id(fn.__globals__))
        if langs is None:
            langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
            modules[id(fn.__globals__)] = langs
        if langs and not any(tl.core.is_builtin(lang.arange) for lang in langs):
            return interpreter._LangPatchScope()
        return original(fn)

    interpreter._patch_lang = once
    try:
        yield
    finally:
        interpreter._patch_lang = original


@contextlib.contextmanager
def np_dtype_memo():
    """Within the block the Triton interpreter's ``_get_np_dtype`` (the NumPy dtype of a
    Triton type, asked at nearly every interpreted op) answers from a memo: it rebuilds a
    19-entry dict of hashed Triton dtypes on every call, a tenth of an interpreted test's
    time (tests/test_truncated.py). A block type answers as its element type, as the
    original does. No-op without the interpreter; nothing a kernel computes changes."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        yield
        return
    original = interpreter._get_np_dtype
    memo: dict = {}

    def memoised(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):  # unhashable; answered before the dict
            return original(tt_dtype)
        found = memo.get(tt_dtype)
        if found is None:
            found = memo[tt_dtype] = original(tt_dtype)
        return found

    interpreter._get_np_dtype = memoised
    try:
        yield
    finally:
        interpreter._get_np_dtype = original


def sm90_compile_output(script: str) -> str:
    """The stdout of ``script`` -- a program that compiles kernels for sm_90 -- run in a
    fresh interpreter WITHOUT ``TRITON_INTERPRET`` (the interpreter replaces kernels by
    NumPy stand-ins that cannot be compiled), ``tests/`` passed as ``sys.argv[1]``; asserts
    it exited 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)], env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout.strip()
