"""Live check of ``fused_rl.compat.verl`` against the installed verl (0.9.1).

Run in the venv that ``install.sh`` prepared (``bash scripts/test-compat-live.sh verl``):

1. A differential comparison of every adapter function with verl's, over random shapes,
   masks (all-masked rows and batches included), dtypes (fp32, fp64, bf16 and mixed), every
   ``loss_agg_mode`` with and without the global-batch arguments, every KL kind and edge values
   (log-ratios past the clamps, NaN at masked positions). Per case: output dtypes and shapes
   equal verl's; NaN / inf positions equal; values and gradients under a random upstream
   gradient agree (fp64: 1e-12 RMS relative; fp32: 1e-5; or no more than twice verl's own
   error against verl run in float64; bf16: no more than twice verl's bf16 error, floor
   1e-3); an input verl rejects raises the same exception type. bf16 cases also run in
   ``half_precision("original")`` mode, which must equal verl bit for bit. The functions that
   reach fused_rl's kernels run on both backends (the Triton interpreter and the reference)
   on CPU.
2. verl's own CPU unit tests for ``core_algos`` / ``torch_functional`` (from the sdist, see
   ``install.sh``), run as released and with verl's functions replaced by the adapter's
   (``patch_verl.py``).

Writes ``--out`` in the format ``scripts/compat_live/summary.py`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from collections import defaultdict

import torch

if not torch.cuda.is_available():  # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import verl.trainer.ppo.core_algos as VC  # noqa: E402
import verl.utils.torch_functional as VF  # noqa: E402

import fused_rl  # noqa: E402
from fused_rl import compat  # noqa: E402
from fused_rl.compat import verl as FV  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = (torch.float16, torch.bfloat16)
TOL = {"fp64": 1e-12, "fp32": 1e-5, "half": 1e-3}
# One rounding of a correct fp32 result to the output's dtype. The Triton interpreter stores
# fp32 into fp16 / bf16 by truncation (triton/runtime/interpreter.py, cast_impl: no rounding
# mode), a compiled kernel rounds to nearest: on CPU a kernel-written gradient is one
# truncation, up to twice the unit roundoff, away.
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0 ** (-7 if INTERPRETED else -8),
    torch.float16: 2.0 ** (-10 if INTERPRETED else -11),
}
VERL_TESTS = (
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/ppo/test_loss_aggregation_on_cpu.py",
    "tests/trainer/ppo/test_value_loss_normalization_on_cpu.py",
    "tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
    "tests/trainer/ppo/test_reinforce_pp_multiturn_on_cpu.py",
)
FUSED = {
    "logprobs_from_logits",
    "entropy_from_logits",
    "compute_entropy_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "compute_gae_advantage_return",
}

warnings.filterwarnings("ignore", category=FutureWarning)  # verl's compute_policy_loss
warnings.filterwarnings("ignore", message=".*TRITON_INTERPRET.*")  # the backend switch below


# ----------------------------------------------------------------------------- running a case


class Grad:
    """Marks an argument to differentiate."""

    def __init__(self, tensor):
        self.tensor = tensor


def _materialise(x, cast):
    if isinstance(x, Grad):
        t = x.tensor.detach().clone()
        t = t.to(torch.float64) if cast else t
        return t.requires_grad_(), True
    if isinstance(x, torch.Tensor):
        t = x.detach().clone()
        return (t.to(torch.float64) if cast and t.is_floating_point() else t), False
    return x, False


def _outputs(out) -> dict:
    if isinstance(out, torch.Tensor):
        return {"out": out}
    if isinstance(out, dict):
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}
    if isinstance(out, tuple):
        flat = {}
        for i, o in enumerate(out):
            for k, v in _outputs(o).items():
                flat[f"{i}" if k == "out" else f"{i}.{k}"] = v
        return flat
    raise TypeError(type(out))


def run(fn, args, kwargs, seed, cast=False, up_dtypes=None):
    """Call ``fn``; returns ``{name: tensor}`` with ``grad:<i>`` entries, or the exception.
    ``cast``: run on float64 copies of every floating input (the oracle), with the upstream
    gradients rounded to ``up_dtypes`` (the dtypes verl's outputs have) as theirs are."""
    built = [_materialise(a, cast) for a in args]
    values = [b[0] for b in built]
    kw = {k: _materialise(v, cast)[0] for k, v in kwargs.items()}
    try:
        out = _outputs(fn(*values, **kw))
    except Exception as err:  # noqa: BLE001 - compared with verl's
        return err
    wrt = [(i, v) for i, (v, d) in enumerate(built) if d]
    diff = {k: o for k, o in out.items() if o.requires_grad}
    if wrt and diff:
        gen = torch.Generator().manual_seed(seed)
        total = 0
        for key, o in sorted(diff.items()):
            up = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            if up_dtypes and key in up_dtypes:
                up = up.to(up_dtypes[key])
            up = up.to(o.device, o.dtype)
            total = total + (o * up).sum()
        grads = torch.autograd.grad(total, [v for _, v in wrt], allow_unused=True)
        for (i, v), g in zip(wrt, grads):
            out[f"grad:{i}"] = torch.zeros_like(v) if g is None else g
    return {k: v.detach() for k, v in out.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """RMS relative error over the entries finite in both (absolute when ``b`` is ~0)."""
    a, b = a.double().cpu().reshape(-1), b.double().cpu().reshape(-1)
    keep = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[keep], b[keep]
    if a.numel() == 0:
        return 0.0
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff / scale if scale > 1e-30 else diff


def same_specials(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double().cpu(), b.double().cpu()
    return bool(
        torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.equal(torch.isposinf(a), torch.isposinf(b))
        and torch.equal(torch.isneginf(a), torch.isneginf(b))
    )


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    both_nan = torch.isnan(a) & torch.isnan(b) if a.is_floating_point() else None
    if both_nan is None:
        return torch.equal(a, b)
    return bool(torch.equal(torch.where(both_nan, 0, a), torch.where(both_nan, 0, b)))


def precision_class(args, kwargs) -> str:
    dtypes = set()
    for x in (*args, *kwargs.values()):
        t = x.tensor if isinstance(x, Grad) else x
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            dtypes.add(t.dtype)
    if dtypes & set(HALF):
        return "half"
    return "fp32" if torch.float32 in dtypes else "fp64"


@contextlib.contextmanager
def reference_backend():
    """fused_rl's ``auto`` backend picks the reference while TRITON_INTERPRET is unset."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


class Stats:
    def __init__(self):
        self.cases = 0
        self.passed = 0
        self.original = [0, 0]  # bitwise-equal, tried
        self.err = defaultdict(float)  # (class, "ours" | "verl") -> max error where they differ
        self.outputs = defaultdict(int)  # class -> outputs compared
        self.identical = defaultdict(int)  # class -> outputs bitwise equal to verl's
        self.backends = set()
        self.failures: list[str] = []
        self.raises = 0

    def fail(self, what: str) -> None:
        if len(self.failures) < 5:
            self.failures.append(what)


STATS: dict[str, Stats] = defaultdict(Stats)


def compare(name: str, label: str, ours, verl, oracle, cls: str, stats: Stats) -> bool:
    """One run of ours against verl's (and the float64 oracle). True when it passes."""
    if isinstance(verl, Exception) or isinstance(ours, Exception):
        ok = type(ours) is type(verl)
        if not ok:
            stats.fail(f"{label}: verl {type(verl).__name__}: {verl}; ours {ours!r}")
        stats.raises += ok
        return ok
    if set(ours) != set(verl):
        stats.fail(f"{label}: outputs {sorted(ours)} vs verl's {sorted(verl)}")
        return False
    ok = True
    for key in verl:
        o, v = ours[key], verl[key]
        w = oracle[key] if isinstance(oracle, dict) else None
        if o.dtype != v.dtype or o.shape != v.shape:
            stats.fail(
                f"{label} {key}: {o.dtype} {tuple(o.shape)} vs verl {v.dtype} {tuple(v.shape)}"
            )
            ok = False
            continue
        if not same_specials(o, v):
            stats.fail(f"{label} {key}: NaN/inf positions differ ({o.tolist()} vs {v.tolist()})")
            ok = False
            continue
        err_verl = rel_err(o, v)
        err_o = rel_err(o, w) if w is not None else err_verl
        err_v = rel_err(v, w) if w is not None else 0.0
        stats.outputs[cls] += 1
        if bitwise_equal(o, v):  # verl's own result: its error is verl's
            stats.identical[cls] += 1
        else:
            stats.err[(cls, "ours")] = max(stats.err[(cls, "ours")], err_o)
            stats.err[(cls, "verl")] = max(stats.err[(cls, "verl")], err_v)
        # fp16 / bf16 outputs: one rounding (the unit roundoff) is what a correct result has
        tol = max(TOL[cls], UNIT_ROUNDOFF.get(o.dtype, 0.0))
        good = err_o <= max(tol, 2 * err_v)
        if cls != "half":
            good = good or err_verl <= tol
        if not good:
            stats.fail(
                f"{label} {key}: error {err_o:.3g} vs float64 (verl's {err_v:.3g}), "
                f"{err_verl:.3g} vs verl"
            )
            ok = False
    return ok


def check(name: str, ours_fn, verl_fn, args, kwargs=None, seed=0, label="") -> None:
    """One case of ``name``: ours against verl's, on every backend, in both modes."""
    kwargs = kwargs or {}
    stats = STATS[name]
    cls = precision_class(args, kwargs)
    label = f"{name}[{label}]"
    verl = run(verl_fn, args, kwargs, seed)
    up_dtypes = {k: v.dtype for k, v in verl.items()} if isinstance(verl, dict) else None
    oracle = run(verl_fn, args, kwargs, seed, cast=True, up_dtypes=up_dtypes)
    backends = ["triton", "reference"] if name in FUSED and DEVICE == "cpu" else ["auto"]
    ok = True
    for backend in backends:
        with reference_backend() if backend == "reference" else contextlib.nullcontext():
            ours = run(ours_fn, args, kwargs, seed)
        stats.backends.add(backend)
        ok &= compare(name, f"{label} {backend}", ours, verl, oracle, cls, stats)
    if cls == "half":
        with compat.half_precision("original"):
            ours = run(ours_fn, args, kwargs, seed)
        same = (
            type(ours) is type(verl)
            if isinstance(verl, Exception) or isinstance(ours, Exception)
            else set(ours) == set(verl) and all(bitwise_equal(ours[k], verl[k]) for k in verl)
        )
        stats.original[0] += same
        stats.original[1] += 1
        if not same:
            stats.fail(f"{label} original mode: not bitwise equal to verl")
        ok &= same
    stats.cases += 1
    stats.passed += ok


# ----------------------------------------------------------------------------- inputs


GEN = torch.Generator().manual_seed(20260512)
SHAPES = [(1, 1), (2, 5), (3, 7), (4, 12)]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
MASK_KINDS = ["ones", "padded", "holes", "empty_row", "empty"]


def randn(shape, dtype=torch.float64, scale=1.0, shift=0.0):
    return (torch.randn(shape, generator=GEN, dtype=torch.float64) * scale + shift).to(
        DEVICE, dtype
    )


def make_mask(shape, kind, dtype=torch.float32):
    b, t = shape
    if kind == "ones":
        m = torch.ones(b, t)
    elif kind == "empty":
        m = torch.zeros(b, t)
    else:
        lengths = torch.randint(1, t + 1, (b,), generator=GEN)
        m = (torch.arange(t)[None] < lengths[:, None]).float()
        if kind == "holes":  # multi-turn: observation tokens inside the response
            m = m * (torch.rand(b, t, generator=GEN) > 0.3).float()
            m[:, 0] = 1.0
        if kind == "empty_row" and b > 1:
            m[b // 2] = 0.0
    return m.to(DEVICE, dtype)


def mask_dtypes():
    return [torch.float32, torch.int64, torch.bool]


def nan_outside(x, mask):
    """NaN where the mask is 0: values that do not count (verl's masked_sum ignores them)."""
    return torch.where(mask.bool(), x, torch.full_like(x, float("nan")))


def seeds():
    seeds.n += 1
    return seeds.n


seeds.n = 0


# ----------------------------------------------------------------------------- the cases


def case_masked():
    for shape, dtype, kind, mdt in _grid(SHAPES, DTYPES, MASK_KINDS, mask_dtypes()):
        m = make_mask(shape, kind, mdt)
        x = randn(shape, dtype, 2.0, 0.5)
        label = f"{shape} {dtype} {kind} {mdt}"
        for axis in (None, 0, -1):
            check("masked_sum", FV.masked_sum, VF.masked_sum, [Grad(nan_outside(x, m)), m],
                  {"axis": axis}, seeds(), f"{label} axis={axis}")  # fmt: skip
            check("masked_mean", FV.masked_mean, VF.masked_mean, [Grad(x), m], {"axis": axis},
                  seeds(), f"{label} axis={axis}")  # fmt: skip
        for unbiased in (True, False):
            check("masked_var", FV.masked_var, VF.masked_var, [Grad(x), m],
                  {"unbiased": unbiased}, seeds(), f"{label} unbiased={unbiased}")  # fmt: skip
        for shift in (True, False):
            check("masked_whiten", FV.masked_whiten, VF.masked_whiten, [Grad(x), m],
                  {"shift_mean": shift}, seeds(), f"{label} shift_mean={shift}")  # fmt: skip
    for dtype in DTYPES:
        x = randn((3, 4), dtype, 3.0)
        lo, hi = randn((3, 4), dtype) - 1, randn((3, 4), dtype) + 1
        check("clip_by_value", FV.clip_by_value, VF.clip_by_value, [Grad(x), lo, hi],
              {}, seeds(), f"{dtype}")  # fmt: skip
        check("clip_by_value", FV.clip_by_value, VF.clip_by_value,
              [Grad(x), torch.tensor(-0.5, dtype=dtype), torch.tensor(0.5, dtype=dtype)], {},
              seeds(), f"{dtype} scalar bounds")  # fmt: skip


AGG_KWARGS = [
    {},
    {"dp_size": 2, "batch_num_tokens": 37, "global_batch_size": 9},
    {"batch_num_tokens": 5.0, "global_batch_size": 3, "loss_scale_factor": 64},
    {"dp_size": 4, "batch_num_tokens": torch.tensor(21), "global_batch_size": torch.tensor(6)},
    {"loss_scale_factor": 2.5},
    {"dp_size": 3},  # raises for every mode but token-sum
]


def case_agg():
    for shape, dtype, kind, mdt in _grid(SHAPES, DTYPES, MASK_KINDS, mask_dtypes()):
        m = make_mask(shape, kind, mdt)
        loss = randn(shape, dtype, 1.5)
        for mode in FV.LOSS_AGG_MODES:
            for kw in AGG_KWARGS:
                args = [Grad(loss), m, mode]
                check("agg_loss", FV.agg_loss, VC.agg_loss, args, _device(kw), seeds(),
                      f"{shape} {dtype} {kind} {mdt} {mode} {kw}")  # fmt: skip
        # NaN at masked positions: verl's loss_mat * loss_mask keeps them in the seq modes
        for mode in FV.LOSS_AGG_MODES:
            check("agg_loss", FV.agg_loss, VC.agg_loss, [Grad(nan_outside(loss, m)), m, mode],
                  {}, seeds(), f"NaN outside {shape} {dtype} {kind} {mode}")  # fmt: skip
    check("agg_loss", FV.agg_loss, VC.agg_loss, [randn((2, 3)), torch.ones(2, 3), "bogus"])


def _device(kw):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}


def logprob_pair(shape, dtype, ref_dtype=None):
    old = -randn(shape).abs() * 2
    new = old + randn(shape, scale=0.6)
    flat = new.view(-1)
    if flat.numel() >= 3:  # past the +-20 log-ratio clamp, both ways
        flat[0] = old.view(-1)[0] + 30.0
        flat[1] = old.view(-1)[1] - 30.0
    return old.to(ref_dtype or dtype), new.to(dtype)


CLIPS = [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 1.5), (None, 0.2, 0.3, 10.0)]


def case_policy():
    for shape, dtype, kind, mdt in _grid(SHAPES, DTYPES, MASK_KINDS, [torch.float32, torch.bool]):
        m = make_mask(shape, kind, mdt)
        old, new = logprob_pair(shape, dtype)
        adv = randn(shape, dtype)
        for mode in FV.LOSS_AGG_MODES:
            for clip in CLIPS:
                label = f"{shape} {dtype} {kind} {mdt} {mode} {clip}"
                check("compute_policy_loss", FV.compute_policy_loss, VC.compute_policy_loss,
                      [old, Grad(new), adv, m, *clip, mode], {}, seeds(), label)  # fmt: skip
            for info in ({}, {"dp_size": 2, "batch_num_tokens": 11, "global_batch_size": 5}):
                for weights in (None, randn(shape, dtype).abs()):
                    cfg = actor_config(mode, info)
                    check("compute_policy_loss_vanilla", FV.compute_policy_loss_vanilla,
                          VC.compute_policy_loss_vanilla,
                          [old, Grad(new), adv, m, mode, cfg, weights], {}, seeds(),
                          f"{shape} {dtype} {kind} {mode} {info} w={weights is not None}",
                          )  # fmt: skip
    old, new = logprob_pair((2, 3), torch.float32)
    check("compute_policy_loss", FV.compute_policy_loss, VC.compute_policy_loss,
          [old, new, randn((2, 3)), torch.ones(2, 3, device=DEVICE), 0.2, None, None, 1.0],
          {}, seeds(), "clip_ratio_c <= 1")  # fmt: skip
    check("compute_policy_loss_vanilla", FV.compute_policy_loss_vanilla,
          VC.compute_policy_loss_vanilla, [old, new, randn((2, 3)), torch.ones(2, 3)], {},
          seeds(), "config None")  # fmt: skip


_CONFIGS: dict = {}


def actor_config(mode, info):
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    key = (mode, tuple(sorted(info.items())))
    if key in _CONFIGS:
        return _CONFIGS[key]

    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
        clip_ratio_c=2.5,
        loss_agg_mode=mode,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )
    cfg.global_batch_info.update(info)
    _CONFIGS[key] = cfg
    return cfg


def case_value():
    for shape, dtype, kind, mdt in _grid(SHAPES, DTYPES, MASK_KINDS, [torch.float32, torch.int64]):
        m = make_mask(shape, kind, mdt)
        values = randn(shape, dtype)
        vpreds = (values.double() + randn(shape, scale=0.5)).to(dtype)
        returns = randn(shape, dtype)
        for mode in FV.LOSS_AGG_MODES:
            runs = [({}, clip) for clip in (0.0, 1e30)] + [(kw, 0.2) for kw in AGG_KWARGS]
            for kw, clip in runs:
                check("compute_value_loss", FV.compute_value_loss, VC.compute_value_loss,
                      [Grad(vpreds), returns, values, m, clip, mode], _device(kw), seeds(),
                      f"{shape} {dtype} {kind} {mdt} {mode} {kw} clip={clip}")  # fmt: skip


def case_vocab():
    for (b, t), dtype, vocab in _grid([(1, 1), (2, 5), (3, 4)], DTYPES, [7, 33, 128]):
        full = randn((b, t + 1, vocab), dtype, 3.0)
        for logits, what in ((full[:, :-1], "slice"), (full[:, 1:].contiguous(), "contig")):
            labels = torch.randint(0, vocab, (b, t), generator=GEN).to(DEVICE)
            label = f"{(b, t, vocab)} {dtype} {what}"
            check("logprobs_from_logits", FV.logprobs_from_logits, VF.logprobs_from_logits,
                  [Grad(logits), labels], {}, seeds(), label)  # fmt: skip
            check("entropy_from_logits", FV.entropy_from_logits, VF.entropy_from_logits,
                  [Grad(logits)], {}, seeds(), label)  # fmt: skip
            for kind in ("padded", "empty_row") if vocab == 33 else ():
                m = make_mask((b, t), kind)
                for mode in FV.LOSS_AGG_MODES:
                    check("compute_entropy_loss", FV.compute_entropy_loss,
                          VC.compute_entropy_loss, [Grad(logits), m, mode], {}, seeds(),
                          f"{label} {kind} {mode}")  # fmt: skip
        flat = randn((5, vocab), dtype, 2.0, 1e3)  # 2-D, large offset
        labels = torch.randint(0, vocab, (5,), generator=GEN).to(DEVICE)
        check("logprobs_from_logits", FV.logprobs_from_logits, VF.logprobs_from_logits,
              [Grad(flat), labels], {}, seeds(), f"(5, {vocab}) {dtype} offset 1e3")  # fmt: skip
        check("entropy_from_logits", FV.entropy_from_logits, VF.entropy_from_logits,
              [Grad(flat)], {}, seeds(), f"(5, {vocab}) {dtype} offset 1e3")  # fmt: skip


def case_kl():
    pairs = [(d, d) for d in DTYPES] + [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float64),
    ]
    for shape, (da, db) in _grid([(1, 1), (3, 7), (4, 12)], pairs):
        ref, lp = logprob_pair(shape, da, db)
        for name in FV.KL_PENALTIES:
            label = f"{shape} {da}/{db} {name}"
            check("kl_penalty", FV.kl_penalty, VC.kl_penalty, [Grad(lp), Grad(ref), name], {},
                  seeds(), label)  # fmt: skip
            if not name.endswith("+"):
                check("kl_penalty_forward", FV.kl_penalty_forward, VC.kl_penalty_forward,
                      [Grad(lp), Grad(ref), name], {}, seeds(), label)  # fmt: skip
        for name in ("k3+", "k1"):  # broadcasting a (B, 1) reference
            check("kl_penalty", FV.kl_penalty, VC.kl_penalty,
                  [Grad(lp), Grad(ref[:, :1].contiguous()), name], {}, seeds(),
                  f"{shape} broadcast {name}")  # fmt: skip
        lp_nograd = lp.detach()
        check("kl_penalty", FV.kl_penalty, VC.kl_penalty, [lp_nograd, Grad(ref), "low_var_kl+"],
              {}, seeds(), f"{shape} grad w.r.t. ref only")  # fmt: skip
    lp, ref = randn((2, 3)), randn((2, 3))
    for bad in ("full", "full+", "k4", "+", ""):
        check("kl_penalty", FV.kl_penalty, VC.kl_penalty, [lp, ref, bad], {}, seeds(), bad)


GAMMAS = [(1.0, 1.0), (0.99, 0.95), (0.0, 0.0), (1.0, 0.0), (0.9, 1.0), (1.2, 0.9)]


def case_gae():
    kinds = ["ones", "padded", "holes", "empty_row"]
    mdts = [torch.float32, torch.int64, torch.float64]
    for shape, dtype, kind, mdt in _grid([(1, 3), (2, 5), (3, 9), (4, 16)], DTYPES, kinds, mdts):
        m = make_mask(shape, kind, mdt)
        rewards, values = randn(shape, dtype), randn(shape, dtype)
        for gamma, lam in GAMMAS:
            check("compute_gae_advantage_return", FV.compute_gae_advantage_return,
                  VC.compute_gae_advantage_return, [rewards, values, m, gamma, lam], {},
                  seeds(), f"{shape} {dtype} {kind} {mdt} gamma={gamma} lam={lam}")  # fmt: skip
    # gamma / lam as 0-dim tensors (verl's annotation), mixed dtypes, one valid token (raises)
    m = make_mask((3, 6), "holes")
    r, v = randn((3, 6)), randn((3, 6), torch.bfloat16)
    check(
        "compute_gae_advantage_return",
        FV.compute_gae_advantage_return,
        VC.compute_gae_advantage_return,
        [r, v, m, torch.tensor(0.97), torch.tensor(0.9)],
        {},
        seeds(),
        "tensor gamma",
    )
    check(
        "compute_gae_advantage_return",
        FV.compute_gae_advantage_return,
        VC.compute_gae_advantage_return,
        [r.bfloat16(), v, m.double(), 0.9, 0.8],
        {},
        seeds(),
        "bf16 with fp64 mask",
    )
    one = torch.zeros(2, 4, device=DEVICE)
    one[0, 1] = 1
    check("compute_gae_advantage_return", FV.compute_gae_advantage_return,
          VC.compute_gae_advantage_return, [r[:2, :4], r[:2, :4], one, 1.0, 1.0], {}, seeds(),
          "one valid token")  # fmt: skip


def case_grpo():
    layouts = {
        "pairs": lambda b: [i // 2 for i in range(b)],
        "shuffled": lambda b: list(np.random.default_rng(b).integers(0, max(b // 3, 1), b)),
        "singletons": lambda b: list(range(b)),
        "strings": lambda b: [f"uid-{i % 3}" for i in range(b)],
    }
    for (b, t), dtype, kind, mdt, (lname, layout) in _grid(
        [(1, 3), (4, 5), (7, 4), (12, 6)], DTYPES, ["ones", "padded"],
        [torch.float32, torch.int64, torch.bool], list(layouts.items()),
    ):  # fmt: skip
        rewards = torch.zeros(b, t, dtype=torch.float64)
        rewards[:, -1] = torch.randint(0, 3, (b,), generator=GEN).double()
        rewards[:, 0] = randn((b,)).cpu() * 0.1
        if b >= 4:
            rewards[2:4] = 1.0  # a constant group in the "pairs" layout
        rewards = rewards.to(DEVICE, dtype)
        m = make_mask((b, t), kind, mdt)
        ids = layout(b)
        index = np.array(ids, dtype=object) if lname == "strings" else np.array(ids)
        for norm in (True, False):
            for eps in (1e-6, 0.1):
                check("compute_grpo_outcome_advantage", FV.compute_grpo_outcome_advantage,
                      VC.compute_grpo_outcome_advantage, [rewards, m, index, eps, norm], {},
                      seeds(), f"{(b, t)} {dtype} {kind} {mdt} {lname} norm={norm} eps={eps}",
                      )  # fmt: skip


def _grid(*axes):
    import itertools

    return list(itertools.product(*axes))


# ----------------------------------------------------------------------------- documented


def documented_rows() -> list[dict]:
    rows = []
    r, v = randn((3, 6)), randn((3, 6))
    m = make_mask((3, 6), "holes")
    ours = FV.compute_gae_advantage_return(r, v, m.bool(), 0.9, 0.9)
    want = VC.compute_gae_advantage_return(r, v, m, 0.9, 0.9)
    try:
        VC.compute_gae_advantage_return(r, v, m.bool(), 0.9, 0.9)
        verl_says = "accepted"
    except Exception as err:  # noqa: BLE001
        verl_says = f"{type(err).__name__}"
    err = max(rel_err(a, b) for a, b in zip(ours, want))
    rows.append(row(
        "GAE: bool response_mask", "documented",
        f"verl raises {verl_says} (1 - bool); the adapter accepts it and gives verl's result "
        f"for the same 0/1 float mask (max error {err:.1e})",
    ))  # fmt: skip

    poisoned = v.clone()
    poisoned[~m.bool()] = float("nan")
    ours = FV.compute_gae_advantage_return(r, poisoned, m, 0.9, 0.9)[0]
    want = VC.compute_gae_advantage_return(r, poisoned, m, 0.9, 0.9)[0]
    with compat.half_precision("original"):
        orig = FV.compute_gae_advantage_return(r.bfloat16(), poisoned.bfloat16(), m, 0.9, 0.9)
    verl_bf = VC.compute_gae_advantage_return(r.bfloat16(), poisoned.bfloat16(), m, 0.9, 0.9)
    rows.append(row(
        "GAE: NaN values at masked positions", "documented",
        f"verl: {int(torch.isnan(want).sum())}/{want.numel()} advantages NaN (x * 0 spreads "
        f"them); adapter: {int(torch.isnan(ours).sum())} (values that do not count never "
        f"matter); original mode (bf16) equals verl bitwise: "
        f"{all(bitwise_equal(a, b) for a, b in zip(orig, verl_bf))}",
    ))  # fmt: skip

    logits = randn((2, 3, 11))
    labels = torch.full((2, 3), -100, device=DEVICE)
    names = []
    for fn in (VF.logprobs_from_logits, FV.logprobs_from_logits):
        try:
            fn(logits, labels)
            names.append("no error")
        except Exception as err:  # noqa: BLE001
            names.append(type(err).__name__)
    rows.append(row(
        "logprobs_from_logits: label -100", "documented",
        f"verl raises {names[0]} (gather out of range), the adapter {names[1]} naming labels",
    ))  # fmt: skip

    rewards = torch.tensor([[1.0], [0.0], [3.0], [2.0]], device=DEVICE)
    ones = torch.ones(4, 1, device=DEVICE)
    index = torch.tensor([0, 0, 1, 1])
    ours = FV.compute_grpo_outcome_advantage(rewards, ones, index)[0]
    try:
        VC.compute_grpo_outcome_advantage(rewards, ones, index)
        verl_says = "accepts it"
    except Exception as err:  # noqa: BLE001
        verl_says = f"raises {type(err).__name__}"
    by_value = VC.compute_grpo_outcome_advantage(rewards, ones, index.numpy())[0]
    rows.append(row(
        "GRPO: torch.Tensor index", "documented",
        f"verl {verl_says} (its dict keys are the tensor's elements, hashed by identity); the "
        f"adapter groups by value, as verl does for a numpy index (error vs verl with "
        f"index.numpy(): {rel_err(ours, by_value):.1e})",
    ))  # fmt: skip

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old, new = logprob_pair((2, 3), torch.float32)
        FV.compute_policy_loss(old, new, randn((2, 3)), ones[:2].expand(2, 3), 0.2)
    kinds = {type(w.message).__name__ for w in caught if "deprecated" in str(w.message)}
    rows.append(row(
        "compute_policy_loss deprecation", "pass" if kinds == {"FutureWarning"} else "fail",
        f"the adapter warns {sorted(kinds)} naming compute_policy_loss_vanilla, as verl's "
        "@deprecated does",
    ))  # fmt: skip
    return rows


def row(check_name: str, result: str, detail: str) -> dict:
    return {"check": check_name, "result": result, "detail": detail}


# ----------------------------------------------------------------------------- verl's own tests


def verl_tests(tests_root: pathlib.Path, patched: bool) -> tuple[int, int, dict, list]:
    """Run verl's CPU tests once; ``(passed, total, per-file counts, failed test ids)``."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = pathlib.Path(tmp) / "verl.xml"
        env = dict(os.environ)
        env.pop("PYTEST_ADDOPTS", None)
        if DEVICE == "cpu":
            env["TRITON_INTERPRET"] = "1"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml",
               str(junit), *VERL_TESTS]  # fmt: skip
        if patched:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
            cmd[3:3] = ["-p", "patch_verl"]
        proc = subprocess.run(cmd, cwd=tests_root, env=env, capture_output=True, text=True)
        if not junit.exists():
            raise RuntimeError(f"verl's tests did not run:\n{proc.stdout}\n{proc.stderr}")
        per_file: dict = defaultdict(lambda: [0, 0])
        failed = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("classname", "").split(".")
            module = next((n for n in name if n.startswith("test_")), name[-1])
            bad = case.find("failure") is not None or case.find("error") is not None
            skipped = case.find("skipped") is not None
            per_file[module][1] += 1
            per_file[module][0] += not bad and not skipped
            if bad:
                failed.append(f"{module}::{case.get('name')}")
        total = sum(t for _, t in per_file.values())
        passed = sum(p for p, _ in per_file.values())
        return passed, total, dict(per_file), failed


# ----------------------------------------------------------------------------- main


def versions() -> dict:
    out = {}
    for name in ("verl", "torch", "triton", "numpy"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[name] = md.version(name)
    out["fused_rl"] = fused_rl.__version__
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument(
        "--verl-tests", type=pathlib.Path,
        default=pathlib.Path(sys.prefix) / f"verl-{md.version('verl')}-tests",
        help="directory holding verl's tests/ (install.sh puts the sdist's there)",
    )  # fmt: skip
    parser.add_argument("--skip-verl-tests", action="store_true")
    parser.add_argument("--only", nargs="*", help="case groups to run (default: all)")
    args = parser.parse_args()

    start = time.time()
    for group in (case_masked, case_agg, case_policy, case_value, case_vocab, case_kl,
                  case_gae, case_grpo):  # fmt: skip
        if args.only and group.__name__.removeprefix("case_") not in args.only:
            continue
        t0 = time.time()
        group()
        print(f"{group.__name__}: {time.time() - t0:.0f}s", flush=True)

    rows = []
    for name, st in sorted(STATS.items()):
        parts = []
        for cls in ("fp64", "fp32", "half"):
            if not st.outputs[cls]:
                continue
            part = f"{cls}: {st.identical[cls]}/{st.outputs[cls]} bitwise = verl"
            if (cls, "ours") in st.err:
                part += (
                    f", else error {st.err[(cls, 'ours')]:.1e} (verl's {st.err[(cls, 'verl')]:.1e})"
                )
            parts.append(part)
        detail = (
            f"{st.passed}/{st.cases} cases ({st.raises} raise as verl does); outputs and "
            f"gradients, max RMS rel. error vs float64 -- {'; '.join(parts)}"
        )
        if st.original[1]:
            detail += f"; bf16 original mode bitwise equal {st.original[0]}/{st.original[1]}"
        if len(st.backends) > 1:
            detail += f"; backends {'+'.join(sorted(st.backends))}"
        if st.failures:
            detail += "; FAILED: " + " | ".join(st.failures)
        result = "pass" if st.passed == st.cases else "fail"
        rows.append(row(f"differential: {name}", result, detail))
        print(f"{name}: {result} {detail}", flush=True)

    rows += documented_rows()

    if not args.skip_verl_tests:
        root = args.verl_tests
        if not (root / VERL_TESTS[0]).exists():
            rows.append(row("verl's own tests", "fail", f"not found under {root}"))
        else:
            for patched in (False, True):
                passed, total, per_file, failed = verl_tests(root, patched)
                files = ", ".join(f"{k} {p}/{t}" for k, (p, t) in sorted(per_file.items()))
                what = "patched to fused_rl.compat.verl" if patched else "as released"
                detail = f"{passed}/{total} passed ({files})"
                if failed:
                    detail += "; failed: " + ", ".join(failed[:8])
                result = "pass" if passed == total else "fail"
                rows.append(row(f"verl's CPU tests, {what}", result, detail))
                print(f"verl tests {what}: {detail}", flush=True)

    out = {"library": "verl", "versions": versions(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} in {time.time() - start:.0f}s")
    if any(r["result"] == "fail" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
