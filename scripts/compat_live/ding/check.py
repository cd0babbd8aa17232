"""Live check of ``fused_rl.compat.ding`` / ``fused_rl.compat.ding_v053`` against the real
DI-engine.

Run by ``scripts/test-compat-live.sh ding`` in a venv where ``install.sh`` installed DI-engine
0.5.3 (the latest release on PyPI); writes the JSON that ``scripts/compat_live/summary.py``
renders::

    python scripts/compat_live/ding/check.py --out compat-live/ding.json

1. Differential comparison of every adapter function with the original:
   ``fused_rl.compat.ding_v053`` against the installed DI-engine 0.5.3, and
   ``fused_rl.compat.ding`` against DI-engine main at ``MAIN_REF`` (``ding/rl_utils/ppo.py``,
   ``grpo.py`` and ``log_prob_utils.py`` from its sources, imported over the installed
   package). Random shapes (single-step, sequence and multi-agent), weights (all-zero
   included), dual clips, KL types, log-prob methods, fp32 / fp64 / bf16 and mixed dtypes;
   outputs (losses and the ``approx_kl`` / ``clipfrac`` floats), gradients under random
   upstream gradients and dtypes. Each output must match the original's type, dtype, shape
   and ``requires_grad``, and lie no further from the original run in float64 than twice the
   original's own error, or than a floor (1e-12 fp64, 1e-5 fp32, one ulp of 1.0 for bf16; a
   gradient's floor times its condition number as a sum over the outputs; scalars below 1
   compared absolutely, see ``rel_err``). DI-engine's eager expressions
   (``ppo_value_error``, ``calculate_kl_div``) must be bit-identical; under
   ``half_precision("original")`` every bf16 case must be.
2. DI-engine's own unit tests for these functions (``ding/rl_utils/tests/test_ppo.py`` at
   ``v0.5.3``; ``test_ppo.py``, ``test_ppo_rlhf.py`` and ``test_grpo_rlhf.py`` at
   ``MAIN_REF``), run twice: against the original functions, and monkeypatched to fused_rl's.

Neither the wheel nor the sdist ships ``ding/rl_utils/tests``, so they and main's sources
come from a DI-engine git repository: ``--upstream-src DIR`` or ``$COMPAT_DING_SRC`` (a
clone, bare or not), else GitHub's tarballs (cached under ``~/.cache/fused_rl-compat-live``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.request
import warnings
import xml.etree.ElementTree as ET

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton / fused_rl are imported
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)  # ding.utils: "Please install pyecharts first"

SLUG = "opendilab/DI-engine"
RELEASE_TAG = "v0.5.3"
MAIN_REF = "d0b21d065b2d80317cc16b28a95301be8871d950"
SRC_ENV = "COMPAT_DING_SRC"
MAIN_SOURCES = {  # module name -> path; loaded in this order
    "ding.rl_utils.log_prob_utils": "ding/rl_utils/log_prob_utils.py",
    "ding.rl_utils.grpo": "ding/rl_utils/grpo.py",
    "ding.rl_utils.ppo": "ding/rl_utils/ppo.py",
}
UNIT_TESTS = {
    RELEASE_TAG: ("ding/rl_utils/tests/test_ppo.py",),
    MAIN_REF: ("ding/rl_utils/tests/test_ppo.py", "ding/rl_utils/tests/test_ppo_rlhf.py",
               "ding/rl_utils/tests/test_grpo_rlhf.py"),
}  # fmt: skip
PPO_NAMES = ("ppo_data", "ppo_data_continuous", "ppo_policy_data", "ppo_policy_data_continuous",
             "ppo_value_data", "ppo_loss", "ppo_policy_loss", "ppo_info", "ppo_error",
             "ppo_policy_error", "ppo_value_error", "ppo_error_continuous",
             "ppo_policy_error_continuous")  # fmt: skip
MAIN_ONLY = ("calculate_kl_div",)
GRPO_NAMES = ("grpo_policy_data", "grpo_info", "grpo_policy_error")
METHODS = ("efficient_method", "naive_method", "less_efficient_method")
HALF = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- upstream files


class Upstream:
    """Files of ``SLUG`` at a git ref: from a local clone, else from GitHub's tarball."""

    def __init__(self, src: str | None):
        self.src = src
        self._tars: dict[str, tarfile.TarFile] = {}

    def read(self, ref: str, path: str) -> str:
        if self.src:
            return subprocess.run(
                ["git", "-C", self.src, "show", f"{ref}:{path}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        tar = self._tars.get(ref) or self._download(ref)
        for member in tar.getmembers():
            if member.name.split("/", 1)[-1] == path:
                return tar.extractfile(member).read().decode()
        raise FileNotFoundError(f"{path} not in {SLUG}@{ref}")

    def _download(self, ref: str) -> tarfile.TarFile:
        cache = pathlib.Path.home() / ".cache" / "fused_rl-compat-live"
        cache.mkdir(parents=True, exist_ok=True)
        path = cache / f"{SLUG.replace('/', '+')}-{ref}.tar.gz"
        if not path.exists():
            url = f"https://codeload.github.com/{SLUG}/tar.gz/{ref}"
            with urllib.request.urlopen(url, timeout=60) as response:
                path.write_bytes(response.read())
        self._tars[ref] = tarfile.open(path)
        return self._tars[ref]

    def describe(self) -> str:
        return "sources from a git clone" if self.src else "sources from GitHub tarballs"


def load_main_modules(upstream: Upstream, workdir: pathlib.Path, replace_ppo: bool = False):
    """DI-engine main's ``log_prob_utils``, ``grpo`` and ``ppo`` modules, imported over the
    installed 0.5.3 package: the first two under their own names (0.5.3 has neither, and
    ``grpo`` imports ``.log_prob_utils``), ``ppo`` as ``ding.rl_utils.ppo`` only when
    ``replace_ppo`` (for DI-engine's unit tests), else as a module of its own."""
    import ding.rl_utils

    modules = {}
    for name, path in MAIN_SOURCES.items():
        file = workdir / f"{name.replace('.', '_')}_main.py"
        file.write_text(upstream.read(MAIN_REF, path))
        module_name = name if name != "ding.rl_utils.ppo" or replace_ppo else "ding_main_ppo"
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        if module_name.startswith("ding.rl_utils."):
            setattr(ding.rl_utils, module_name.rsplit(".", 1)[1], module)
        modules[name.rsplit(".", 1)[1]] = module
    return modules


class Namespace:
    def __init__(self, **items):
        self.__dict__.update(items)


def main_namespace(modules) -> Namespace:
    ppo, grpo, lpu = modules["ppo"], modules["grpo"], modules["log_prob_utils"]
    items = {n: getattr(ppo, n) for n in PPO_NAMES + MAIN_ONLY}
    items.update({n: getattr(grpo, n) for n in GRPO_NAMES})
    items.update({n: getattr(lpu, n) for n in METHODS})
    return Namespace(**items)


def release_namespace() -> Namespace:
    import ding.rl_utils.ppo as ppo

    return Namespace(**{n: getattr(ppo, n) for n in PPO_NAMES})


def fused_namespace(layout: str) -> Namespace:
    from fused_rl.compat import ding, ding_v053

    module = ding if layout == "main" else ding_v053
    names = PPO_NAMES + (MAIN_ONLY + GRPO_NAMES + METHODS if layout == "main" else ())
    return Namespace(**{n: getattr(module, n) for n in names})


# ----------------------------------------------------------------------------- comparison


# fp16 / bf16: CONTRIBUTING's 1e-3, or one ulp of 1.0 if larger (an output rounded once to bf16
# is off by up to 2^-9 relative, RMS ~1.1e-3)
FLOORS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3,
          torch.bfloat16: torch.finfo(torch.bfloat16).eps}  # fmt: skip


def floor_of(dtypes) -> float:
    return max(FLOORS.get(d, 1e-5) for d in dtypes)


def leaves(out):
    if isinstance(out, torch.Tensor | float | int):
        return [out]
    return [x for item in out for x in leaves(item)]


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` over the entries where ``b`` is finite (inf if the NaN / inf
    patterns differ). A scalar (0-dim tensor or Python float) is measured against
    ``max(|b|, 1)``: below 1 in magnitude absolutely, as losses and KL estimates near 0 are
    means of cancelling terms whose own size (not the mean's) sets the rounding error."""
    a, b = torch.as_tensor(a).detach().double().cpu(), torch.as_tensor(b).detach().double().cpu()
    if a.shape != b.shape:
        return math.inf
    finite = torch.isfinite(b)
    same = (torch.isnan(a) == torch.isnan(b)) & (torch.isinf(a) == torch.isinf(b))
    same &= ~torch.isinf(b) | (a == b)
    if not bool(same.all()):
        return math.inf
    diff = (a - b)[finite].norm().item()
    scale = b[finite].norm().item()
    if b.dim() == 0:
        return diff / max(scale, 1.0)
    return diff / scale if scale > 0 else diff


def bit_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return a == b or (math.isnan(a) and math.isnan(b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


class Row:
    """One row of the table: a check over many cases."""

    def __init__(self, check: str, versions: str):
        self.check, self.versions = check, versions
        self.cases, self.failures, self.worst, self.worst_case = 0, [], 0.0, ""
        self.notes: list[str] = []

    def fail(self, case: str, message: str) -> None:
        self.failures.append(f"{case}: {message}")

    def measure(self, what: str, err: float, allowed: float) -> None:
        ratio = err / allowed if allowed else 0.0
        if ratio > self.worst:
            self.worst, self.worst_case = ratio, what
        if not err <= allowed:
            self.fail(what, f"error {err:.3e} > allowed {allowed:.3e}")

    def as_dict(self) -> dict:
        if self.failures:
            detail = f"{len(self.failures)}/{self.cases} cases failed; first: {self.failures[0]}"
            return {"check": self.check, "result": "fail", "detail": detail[:600]}
        detail = f"{self.cases} cases vs {self.versions}"
        if self.worst:
            detail += f"; worst error / allowed {self.worst:.2f}"
        if self.notes:
            detail += "; " + "; ".join(self.notes)
        return {"check": self.check, "result": "pass", "detail": detail,
                "worst_case": self.worst_case}  # fmt: skip


def clone_inputs(inputs: dict, grad: tuple, cast64: bool) -> dict:
    out = {}
    for name, x in inputs.items():
        if isinstance(x, torch.Tensor):
            x = x.detach().clone()
            if cast64 and x.is_floating_point():
                x = x.double()
            if name in grad:
                x.requires_grad_()
        out[name] = x
    return out


def call(fn, inputs: dict, grad: tuple, cast64: bool = False):
    """``fn(**inputs)`` on fresh leaves; returns ``(outputs, leaves, exception)``."""
    args = clone_inputs(inputs, grad, cast64)
    try:
        return fn(**args), args, None
    except Exception as exc:  # compared, not hidden
        return None, args, exc


def backward(outputs, upstream_seed: int, dtypes, inputs=None) -> dict:
    """Seed every differentiable tensor output with a random upstream gradient, rounded to
    ``dtypes`` (the original's output dtypes), so every run sees the same upstream values.

    With ``inputs`` (name -> leaf), also returns, per leaf, the condition number of its
    gradient as a sum over the outputs: ``|| sum_i |g_i| || / || sum_i g_i ||``. Each
    output's contribution ``g_i`` is rounded on its own (to the leaf's dtype, in the
    original as here), so where they cancel, the relative error of the sum grows by it."""
    gen = torch.Generator().manual_seed(upstream_seed)
    terms = []
    for t, dtype in zip(leaves(outputs), dtypes):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            u = torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype)
            terms.append((t * u.to(t.device, t.dtype)).sum())
    if not terms:
        return {}
    cond = {}
    if inputs:
        names = [n for n, x in inputs.items() if x.requires_grad]
        magnitude = {n: 0.0 for n in names}
        for term in terms:
            parts = torch.autograd.grad(term, [inputs[n] for n in names], retain_graph=True,
                                        allow_unused=True)  # fmt: skip
            for n, g in zip(names, parts):
                if g is not None:
                    magnitude[n] = magnitude[n] + g.abs()
        cond = {n: m for n, m in magnitude.items() if isinstance(m, torch.Tensor)}
    sum(terms).backward()
    for n, m in cond.items():
        total = inputs[n].grad.norm().item()
        cond[n] = max(1.0, m.norm().item() / total) if total > 0 else 1.0
    return cond


def compare(row: Row, case: str, ours, orig, inputs: dict, *, grad=(), exact=False,
            seed=0) -> None:  # fmt: skip
    """One differential case: values, dtypes, ``requires_grad`` and (for ``grad``) gradients
    of ``ours`` against ``orig``, each measured against ``orig`` run in float64."""
    row.cases += 1
    got, got_in, got_exc = call(ours, inputs, grad)
    ref, ref_in, ref_exc = call(orig, inputs, grad)
    if got_exc or ref_exc:
        if got_exc and ref_exc:
            return
        exc = got_exc or ref_exc
        who = "fused_rl" if got_exc else "original"
        row.fail(case, f"only {who} raised {type(exc).__name__}: {exc}"[:300])
        return
    want, want_in, _ = call(orig, inputs, grad, cast64=True)
    in_dtypes = [x.dtype for x in inputs.values() if isinstance(x, torch.Tensor)]
    in_dtypes = [d for d in in_dtypes if d.is_floating_point] or [torch.float32]
    floor = floor_of(in_dtypes)
    got_l, ref_l, want_l = leaves(got), leaves(ref), leaves(want)
    if len(got_l) != len(ref_l):
        row.fail(case, f"{len(got_l)} outputs, the original {len(ref_l)}")
        return
    for i, (a, b, w) in enumerate(zip(got_l, ref_l, want_l)):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                row.fail(case, f"output {i} is {type(a).__name__}, the original a tensor")
                continue
            if (a.dtype, a.shape, a.requires_grad) != (b.dtype, b.shape, b.requires_grad):
                row.fail(case, f"output {i}: dtype/shape/requires_grad {a.dtype} "
                               f"{tuple(a.shape)} {a.requires_grad} != original {b.dtype} "
                               f"{tuple(b.shape)} {b.requires_grad}")  # fmt: skip
                continue
            if exact:
                if not bit_equal(a, b):
                    row.fail(case, f"output {i} not bit-identical (err {rel_err(a, b):.2e})")
                continue
            err, allowed = rel_err(a, w), max(2 * rel_err(b, w), floor)
        else:
            if type(a) is not type(b):
                row.fail(case, f"output {i} is {type(a).__name__}, original {type(b).__name__}")
                continue
            if exact:
                if not bit_equal(a, b):
                    row.fail(case, f"output {i} {a!r} != {b!r}")
                continue
            err, allowed = rel_err(a, w), max(2 * rel_err(b, w), floor)
        row.measure(f"{case} output {i}", err, allowed)
    if not grad:
        return
    dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in ref_l]
    backward(got, seed, dtypes)
    backward(ref, seed, dtypes)
    leaves_in = {n: x for n, x in want_in.items() if isinstance(x, torch.Tensor)}
    cond = backward(want, seed, dtypes, leaves_in)
    for name in grad:
        a, b, w = got_in[name].grad, ref_in[name].grad, want_in[name].grad
        if (a is None) != (b is None):
            row.fail(case, f"grad of {name}: {a is None and 'None'} vs original {b is None}")
            continue
        if a is None:
            continue
        if a.dtype != b.dtype:
            row.fail(case, f"grad of {name}: dtype {a.dtype} != original {b.dtype}")
            continue
        if exact:
            if not bit_equal(a, b):
                row.fail(case, f"grad of {name} not bit-identical (err {rel_err(a, b):.2e})")
            continue
        err, allowed = rel_err(a, w), max(2 * rel_err(b, w), floor * cond.get(name, 1.0))
        row.measure(f"{case} grad of {name}", err, allowed)


# ----------------------------------------------------------------------------- case generators


def randn(gen, shape, dtype, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


def weight_of(kind: str, shape, dtype, gen) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "zero":
        return torch.zeros(shape, dtype=dtype)
    if kind == "fractional":
        return torch.rand(shape, generator=gen, dtype=torch.float64).to(dtype)
    return (torch.rand(shape, generator=gen) > 0.3).to(dtype)  # a 0/1 mask


# (logits dtype, everything else)
DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64),
          (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.float32, torch.float64)]  # fmt: skip
# logits shape, adv / weight shape: single step, sequence, multi-agent (ratio mean over dim 1)
SHAPES = [((6, 5), (6,)), ((2, 3, 11), (2, 3)), ((3, 4, 128), (3, 4)), ((5, 2, 7), (5,)),
          ((1, 1, 1000), (1, 1))]  # fmt: skip


def discrete_inputs(gen, i, layout, *, value=False):
    dl, dr = DTYPES[i % len(DTYPES)]
    shape, adv_shape = SHAPES[(i // 2) % len(SHAPES)]
    logit_new = randn(gen, shape, torch.float64, scale=1.5)
    inputs = {
        "logit_new": logit_new.to(dl),
        "logit_old": (logit_new + randn(gen, shape, torch.float64, scale=1.2)).to(dl),
        "action": torch.randint(0, shape[-1], shape[:-1], generator=gen),
        "adv": randn(gen, adv_shape, torch.float64),
        "weight": weight_of(["none", "mask", "fractional", "zero"][i % 4], adv_shape, dr, gen),
    }
    if i % 3 == 1:
        inputs["adv"] = -inputs["adv"].abs() - 0.5  # every advantage < 0: the dual clip binds
    inputs["adv"] = inputs["adv"].to(dr)
    if layout == "main":
        pre = i % 3 != 0
        inputs["logit_pretrained"] = randn(gen, shape, dl, scale=1.5) if pre else None
    if value:
        inputs["value_new"] = randn(gen, adv_shape, dr)
        step = randn(gen, adv_shape, torch.float64, scale=0.4)
        inputs["value_old"] = (inputs["value_new"].double() + step).to(dr)
        inputs["return_"] = randn(gen, adv_shape, dr)
    return inputs


def policy_call(impl, layout, hyper, *, value=False):
    names = ["logit_new", "logit_old", "action"]
    names += ["value_new", "value_old", "adv", "return_", "weight"] if value else ["adv", "weight"]
    if layout == "main":
        names.append("logit_pretrained")
    data = impl.ppo_data if value else impl.ppo_policy_data
    fn = impl.ppo_error if value else impl.ppo_policy_error

    def run(**kw):
        return fn(data(*(kw[n] for n in names)), **hyper)

    return run


def discrete_cases(rows, impls, gen, n):
    for i in range(n):
        for label, (layout, orig, fused) in impls.items():
            inputs = discrete_inputs(gen, i, layout)
            hyper = {"clip_ratio": [0.2, 0.1, 0.3, 0.0][i % 4],
                     "dual_clip": [None, 3.0, 1.5][i % 3]}  # fmt: skip
            if layout == "main":
                hyper["entropy_bonus"] = i % 5 != 4
                hyper["kl_type"] = ["k1", "k2", "k3"][i % 3]
            attached = i % 6 == 5  # old / pretrained logits not detached: they get gradients too
            grad = ("logit_new",) + (("logit_old",) if attached else ())
            if attached and inputs.get("logit_pretrained") is not None:
                grad += ("logit_pretrained",)
            dtypes = sorted({str(t.dtype)[6:] for t in inputs.values()
                             if isinstance(t, torch.Tensor) and t.is_floating_point()})  # fmt: skip
            case = (f"{dtypes} logits {tuple(inputs['logit_new'].shape)} adv "
                    f"{tuple(inputs['adv'].shape)} {hyper} grad={grad}")  # fmt: skip
            row = rows.setdefault(f"policy ({label})", Row("differential: ppo_policy_error", label))
            ours, theirs = policy_call(fused, layout, hyper), policy_call(orig, layout, hyper)
            compare(row, case, ours, theirs, inputs, grad=grad, seed=i)
            check_original(rows, label, case, ours, theirs, inputs, grad)
            # ppo_error: the same plus the value loss (and its dual-clip assertion)
            inputs = discrete_inputs(gen, i, layout, value=True)
            hyper = {k: v for k, v in hyper.items() if k in ("clip_ratio", "dual_clip", "kl_type")}
            hyper["use_value_clip"] = i % 2 == 0
            row = rows.setdefault(f"error ({label})", Row("differential: ppo_error", label))
            ours = policy_call(fused, layout, hyper, value=True)
            theirs = policy_call(orig, layout, hyper, value=True)
            grad = ("logit_new", "value_new") + (("value_old",) if attached else ())
            compare(row, f"{case} {hyper}", ours, theirs, inputs, grad=grad, seed=i)
            check_original(rows, label, case, ours, theirs, inputs, grad)


def value_cases(rows, impls, gen, n):
    for i in range(n):
        dtype = [torch.float32, torch.float64, torch.bfloat16][i % 3]
        shape = [(5,), (3, 4), (2, 3, 2)][i % 3]
        value_old = randn(gen, shape, torch.float64)
        inputs = {
            "value_new": (value_old + randn(gen, shape, torch.float64, scale=0.4)).to(dtype),
            "value_old": value_old.to(dtype),
            "return_": randn(gen, shape, dtype),
            "weight": weight_of(["none", "mask", "fractional", "zero"][i % 4], shape, dtype, gen),
        }
        hyper = {"clip_ratio": [0.2, 0.0, 0.5][i % 3], "use_value_clip": i % 2 == 0}
        for label, (_, orig, fused) in impls.items():

            def call(impl, hyper=hyper):
                return lambda **kw: impl.ppo_value_error(impl.ppo_value_data(**kw), **hyper)

            row = rows.setdefault(f"value ({label})", Row("differential: ppo_value_error", label))
            compare(row, f"{dtype} {shape} {hyper}", call(fused), call(orig), inputs,
                    grad=("value_new", "value_old", "return_"), exact=True, seed=i)  # fmt: skip


def continuous_inputs(gen, i, layout, *, value=False):
    dtype = [torch.float32, torch.float64, torch.bfloat16, torch.float32][i % 4]
    b, n_act = 1 + i % 5, [1, 3, 6][i % 3]
    one_d_old = n_act == 1 and i % 2 == 0  # DI-engine unsqueezes a 1-D old mu / sigma
    shape = (b,) if one_d_old else (b, n_act)
    mu_new = randn(gen, (b, n_act), torch.float64)
    sigma_new = randn(gen, (b, n_act), torch.float64).abs() + 0.3
    inputs = {
        "mu_new": mu_new.to(dtype),
        "sigma_new": sigma_new.to(dtype),
        "mu_old": (mu_new.reshape(shape) + randn(gen, shape, torch.float64, scale=0.3)).to(dtype),
        "sigma_old": (
            sigma_new.reshape(shape) * (1 + 0.2 * randn(gen, shape, torch.float64).abs())
        ).to(dtype),  # fmt: skip
        "action": randn(gen, (b, n_act), dtype),
        "adv": randn(gen, (b,), dtype),
        "weight": weight_of(["none", "fractional", "mask"][i % 3], (b,), dtype, gen),
    }
    sign = [0, -1, 1][(i // 3) % 3]
    if sign:  # one sign for every sample: the (un)gated dual clip binds everywhere
        inputs["adv"] = (sign * (inputs["adv"].double().abs() + 0.2)).to(dtype)
    if layout == "main" and i % 2 == 1:
        inputs["pre_mu"] = randn(gen, (b, n_act), dtype)
        inputs["pre_sigma"] = (randn(gen, (b, n_act), torch.float64).abs() + 0.5).to(dtype)
    if value:
        inputs["value_new"] = randn(gen, (b,), dtype)
        inputs["value_old"] = randn(gen, (b,), dtype)
        inputs["return_"] = randn(gen, (b,), dtype)
    return inputs


def continuous_call(impl, layout, hyper, *, value=False):
    def run(**kw):
        new = {"mu": kw["mu_new"], "sigma": kw["sigma_new"]}
        old = {"mu": kw["mu_old"], "sigma": kw["sigma_old"]}
        fields = [new, old, kw["action"]]
        if value:
            fields += [kw["value_new"], kw["value_old"], kw["adv"], kw["return_"], kw["weight"]]
        else:
            fields += [kw["adv"], kw["weight"]]
        if layout == "main":
            pre = kw.get("pre_mu")
            fields.append(None if pre is None else {"mu": pre, "sigma": kw["pre_sigma"]})
        if value:
            return impl.ppo_error_continuous(impl.ppo_data_continuous(*fields), **hyper)
        return impl.ppo_policy_error_continuous(impl.ppo_policy_data_continuous(*fields), **hyper)

    return run


def continuous_cases(rows, impls, gen, n):
    for i in range(n):
        for label, (layout, orig, fused) in impls.items():
            for value in (False, True):
                inputs = continuous_inputs(gen, i, layout, value=value)
                hyper = {"clip_ratio": [0.2, 0.1][i % 2], "dual_clip": [None, 3.0, 1.5][i % 3]}
                if value:
                    hyper["use_value_clip"] = i % 2 == 0
                if layout == "main":
                    hyper["kl_type"] = ["k1", "k2", "k3"][i % 3]
                grad = ("mu_new", "sigma_new") + (("value_new",) if value else ())
                name = "ppo_error_continuous" if value else "ppo_policy_error_continuous"
                row = rows.setdefault(f"{name} ({label})", Row(f"differential: {name}", label))
                case = (f"{inputs['mu_new'].dtype} mu {tuple(inputs['mu_new'].shape)} old "
                        f"{tuple(inputs['mu_old'].shape)} {hyper}")  # fmt: skip
                ours = continuous_call(fused, layout, hyper, value=value)
                theirs = continuous_call(orig, layout, hyper, value=value)
                compare(row, case, ours, theirs, inputs, grad=grad, seed=i)
                check_original(rows, label, case, ours, theirs, inputs, grad)


def kl_cases(rows, impls, gen, n):
    for i in range(n):
        dtype = [torch.float32, torch.float64, torch.bfloat16][i % 3]
        inputs = {"log_ratio": randn(gen, [(5,), (2, 7), (3, 4, 2)][i % 3], dtype, scale=1.5),
                  "kl_type": ["k1", "k2", "k3"][i % 3]}  # fmt: skip
        for label, (layout, orig, fused) in impls.items():
            if layout != "main":
                continue
            row = rows.setdefault(f"kl ({label})", Row("differential: calculate_kl_div", label))
            compare(row, f"{dtype} {inputs['kl_type']}", fused.calculate_kl_div,
                    orig.calculate_kl_div, inputs, grad=("log_ratio",), exact=True,
                    seed=i)  # fmt: skip


def custom_logprobs(logits, index):
    """A caller's own log-prob function (temperature 0.9, computed in fp32)."""
    logp = torch.log_softmax(logits.float() / 0.9, dim=-1)
    return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def grpo_cases(rows, impls, gen, n):
    for i in range(n):
        for label, (layout, orig, fused) in impls.items():
            if layout != "main":
                continue
            dl, dr = DTYPES[i % 4]  # (fp32 logits, fp64 adv) only in the documented row
            b, s, vocab = 1 + i % 3, 1 + (i * 3) % 7, [13, 128, 1000][i % 3]
            base = randn(gen, (b, s, vocab), torch.float64, scale=1.5)
            lengths = torch.randint(1, s + 1, (b,), generator=gen)
            kind = ["none", "padded", "fractional", "empty_row"][(i // 2) % 4]
            weight = None
            if kind != "none":
                weight = (torch.arange(s) < lengths[:, None]).to(dr)
                if kind == "fractional":
                    weight = weight * torch.rand(b, s, generator=gen).to(dr)
                if kind == "empty_row":
                    weight[-1] = 0.0
            inputs = {
                "logit_new": base.to(dl),
                "logit_old": (base + randn(gen, (b, s, vocab), torch.float64, scale=0.5)).to(dl),
                "logit_ref": (base + randn(gen, (b, s, vocab), torch.float64, scale=0.8)).to(dl),
                "action": torch.randint(0, vocab, (b, s), generator=gen),
                "adv": randn(gen, (b,), dr),
                "weight": weight,
            }
            method = ["default", *METHODS, "custom"][i % 5]
            hyper = {"clip_ratio": [0.2, 0.1][i % 2], "beta": [0.1, 0.04, 0.0][i % 3]}
            if kind == "empty_row" and hyper["beta"] == 0.0:  # a documented row below
                hyper["beta"] = 0.04
            if method == "custom":
                hyper_o = hyper_f = dict(hyper, log_prob_fn=custom_logprobs)
            elif method == "default":
                hyper_o = hyper_f = hyper
            else:  # DI-engine's own method object, passed to both
                hyper_o = hyper_f = dict(hyper, log_prob_fn=getattr(orig, method))
            attached = i % 6 == 5
            grad = ("logit_new",) + (("logit_old", "logit_ref") if attached else ())

            def call(impl, hyper):
                return lambda **kw: impl.grpo_policy_error(impl.grpo_policy_data(**kw), **hyper)

            case = f"{dl}/{dr} ({b}, {s}, {vocab}) weight={kind} {method} {hyper}"
            row = rows.setdefault(f"grpo ({label})", Row("differential: grpo_policy_error", label))
            ours, theirs = call(fused, hyper_f), call(orig, hyper_o)
            compare(row, case, ours, theirs, inputs, grad=grad, seed=i)
            check_original(rows, label, case, ours, theirs, inputs, grad)
            # the three log-prob methods themselves
            name = METHODS[i % 3]
            row = rows.setdefault(f"methods ({label})",
                                  Row("differential: efficient / naive / less_efficient_method",
                                      label))  # fmt: skip
            args = {"logits": inputs["logit_new"], "index": inputs["action"]}
            compare(row, f"{name} {dl} ({b}, {s}, {vocab})", getattr(fused, name),
                    getattr(orig, name), args, grad=("logits",), seed=i)  # fmt: skip
            check_original(rows, label, name, getattr(fused, name), getattr(orig, name), args,
                           ("logits",))  # fmt: skip


def check_original(rows, label, case, ours, theirs, inputs, grad):
    """fp16 / bf16 inputs under ``half_precision("original")``: bit-identical outputs (the
    ``approx_kl`` / ``clipfrac`` floats included) and gradients."""
    if not any(isinstance(t, torch.Tensor) and t.dtype in HALF for t in inputs.values()):
        return
    import fused_rl.compat as compat

    row = rows.setdefault(f"original ({label})",
                          Row('half_precision("original"): bf16 bit for bit', label))  # fmt: skip

    def original(**kw):
        with compat.half_precision("original"):
            return ours(**kw)

    compare(row, case, original, theirs, inputs, grad=grad, exact=True)


# ----------------------------------------------------------------------------- documented


def documented_rows(label, orig) -> list[dict]:
    """The deliberate differences of docs/compat.md, observed."""
    from fused_rl.compat import ding as fused

    def outcome(fn):
        try:
            out = fn()
        except Exception as exc:
            return type(exc).__name__
        loss = out[0] if isinstance(out[0], torch.Tensor) else out[0].policy_loss
        return f"loss {loss.item():.4g}"

    rows = []
    gen = torch.Generator().manual_seed(1)
    z = randn(gen, (2, 3, 5), torch.float32)
    action, adv = torch.randint(0, 5, (2, 3), generator=gen), randn(gen, (2,), torch.float32)

    def grpo(impl, **kw):
        data = dict(logit_new=z, logit_old=z, logit_ref=z, action=action, adv=adv, weight=None)
        data.update(kw)
        return lambda: impl.grpo_policy_error(impl.grpo_policy_data(**data))

    def policy(impl, **kw):
        data = dict(logit_new=z, logit_old=z, action=action, adv=adv[:, None].expand(2, 3),
                    weight=None, logit_pretrained=None)  # fmt: skip
        data.update(kw)
        return lambda: impl.ppo_policy_error(impl.ppo_policy_data(**data))

    cases = [
        ("a (B, 1) adv in grpo_policy_error", "ValueError",
         grpo(orig, adv=adv[:, None]), grpo(fused, adv=adv[:, None]), "broadcast to (B, B, S)"),
        ("action -100 in grpo_policy_error", "ValueError",
         grpo(orig, action=torch.full_like(action, -100)),
         grpo(fused, action=torch.full_like(action, -100)), "ValueError naming `action`"),
        ("NaN logits in ppo_policy_error", "loss nan",
         policy(orig, logit_new=torch.full_like(z, float("nan"))),
         policy(fused, logit_new=torch.full_like(z, float("nan"))), "NaN propagates"),
    ]  # fmt: skip
    rows.append(nan_row_gradients(label, orig, fused))
    for what, expected, theirs, ours, why in cases:
        got, want = outcome(ours), outcome(theirs)
        rows.append({
            "check": f"documented: {what}",
            "result": "documented" if got == expected and got != want else "fail",
            "detail": f"{label}: {want}; fused_rl: {got} ({why})",
        })  # fmt: skip
    return rows


def nan_row_gradients(label, orig, fused) -> dict:
    """``beta == 0`` and an all-zero weight row: the loss is NaN (0 / 0) in both. DI-engine
    still adds ``0 * k3``, which carries the row's NaN to every token's gradient; fused_rl
    skips the KL term, so clipped tokens (no surrogate gradient) get 0."""
    gen = torch.Generator().manual_seed(2)
    z = randn(gen, (2, 4, 9), torch.float32, scale=2.0)
    weight = torch.tensor([[1.0] * 4, [0.0] * 4])  # the second row counts nothing
    data = dict(logit_old=randn(gen, (2, 4, 9), torch.float32, scale=2.0), logit_ref=z,
                action=torch.randint(0, 9, (2, 4), generator=gen),
                adv=torch.tensor([1.0, -1.0]), weight=weight)  # fmt: skip
    counts = []
    for impl in (orig, fused):
        leaf = z.clone().requires_grad_()
        loss, _ = impl.grpo_policy_error(impl.grpo_policy_data(logit_new=leaf, **data), beta=0.0)
        loss.backward()
        counts.append(int(torch.isnan(leaf.grad[1]).any(dim=-1).sum()))
    ok = counts[0] == 4 and counts[1] < 4
    return {
        "check": "documented: beta == 0 with an all-zero weight row (NaN loss): gradients",
        "result": "documented" if ok else "fail",
        "detail": f"NaN gradient at {counts[0]}/4 tokens of the row in {label}, {counts[1]}/4 "
                  "in fused_rl (no 0 * k3 term; clipped tokens get 0)",
    }  # fmt: skip


# ----------------------------------------------------------------------------- unit tests


def patch_ding(mode: str, main_src: str | None, workdir: pathlib.Path) -> None:
    """Point ``ding.rl_utils`` (and ``.ppo`` / ``.grpo``) at DI-engine main's functions
    (``main``), fused_rl's 0.5.3 layout (``fused-v053``) or main layout (``fused-main``)."""
    import ding.rl_utils as rl

    if mode in ("main", "fused-main"):
        modules = load_main_modules(Upstream(main_src), workdir, replace_ppo=True)
        for name in PPO_NAMES:  # the names ding.rl_utils exports
            if hasattr(rl, name):
                setattr(rl, name, getattr(modules["ppo"], name))
    if mode == "release":
        return
    source = fused_namespace("v053" if mode == "fused-v053" else "main")
    targets = [rl, sys.modules["ding.rl_utils.ppo"]]
    for name in PPO_NAMES + MAIN_ONLY:
        for module in targets:
            if hasattr(source, name) and hasattr(module, name):
                setattr(module, name, getattr(source, name))
    if mode == "fused-main":
        for name in GRPO_NAMES + METHODS:
            setattr(sys.modules["ding.rl_utils.grpo"], name, getattr(source, name))


def run_unit_tests_child(mode: str, tests: str, junit: str, main_src: str | None) -> int:
    """In a fresh interpreter: patch, then run DI-engine's tests with pytest."""
    import pytest

    patch_ding(mode, main_src, pathlib.Path(tests))
    return pytest.main([tests, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--rootdir", tests, f"--junitxml={junit}"])  # fmt: skip


def junit_counts(path: pathlib.Path) -> tuple[int, int, int]:
    if not path.exists():
        return 0, 0, 0
    suite = ET.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                             "skipped"))  # fmt: skip
    return total - fail - err - skip, fail + err, skip


def unit_test_rows(upstream: Upstream, workdir: pathlib.Path, main_ok: bool) -> list[dict]:
    rows = []
    runs = [(RELEASE_TAG, "release", "fused-v053", "DI-engine 0.5.3",
             "fused_rl.compat.ding_v053")]  # fmt: skip
    if main_ok:
        runs.append((MAIN_REF, "main", "fused-main", f"DI-engine main {MAIN_REF[:12]}",
                     "fused_rl.compat.ding"))  # fmt: skip
    for ref, original, fused, label, adapter in runs:
        tests = workdir / f"tests-{original}"
        tests.mkdir()
        for path in UNIT_TESTS[ref]:
            (tests / pathlib.Path(path).name).write_text(upstream.read(ref, path))
        counts = {}
        for mode in (original, fused):
            junit = workdir / f"{mode}.xml"
            cmd = [sys.executable, __file__, "--child", mode, str(tests), str(junit),
                   upstream.src or ""]  # fmt: skip
            subprocess.run(cmd, capture_output=True, text=True, check=False)
            counts[mode] = junit_counts(junit)
        released, patched = counts[original], counts[fused]
        ok = patched[1] == 0 and released[1] == 0 and patched[0] == released[0] > 0
        files = ", ".join(pathlib.Path(p).name for p in UNIT_TESTS[ref])
        rows.append({
            "check": f"DI-engine's unit tests ({files} @ {ref[:12]})",
            "result": "pass" if ok else "fail",
            "detail": f"as released ({label}): {released[0]} passed, {released[1]} failed; "
                      f"monkeypatched to {adapter}: {patched[0]} passed, {patched[1]} failed",
        })  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- main


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, tests, junit, src = sys.argv[2:6]
        return run_unit_tests_child(mode, tests, junit, src or None)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--upstream-src", default=os.environ.get(SRC_ENV))
    parser.add_argument("--cases", type=int, default=40, help="random cases per function")
    args = parser.parse_args()

    versions = {"DI-engine": md.version("DI-engine"), "torch": torch.__version__}
    upstream = Upstream(args.upstream_src)
    impls = {f"DI-engine {versions['DI-engine']}": ("v053", release_namespace(),
                                                     fused_namespace("v053"))}  # fmt: skip
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        main_ok, main_label = True, f"DI-engine main {MAIN_REF[:12]}"
        try:
            modules = load_main_modules(upstream, workdir)
            impls[main_label] = ("main", main_namespace(modules), fused_namespace("main"))
            versions["DI-engine main"] = f"{MAIN_REF[:12]} ({upstream.describe()})"
        except Exception as exc:
            main_ok = False
            detail = (f"unavailable ({type(exc).__name__}: {exc}); pass --upstream-src or "
                      f"{SRC_ENV}=<DI-engine clone>")  # fmt: skip
            rows.append({"check": f"{main_label} sources", "result": "fail",
                         "detail": detail[:400]})  # fmt: skip
        table: dict[str, Row] = {}
        gen = torch.Generator().manual_seed(20261123)
        generators = (discrete_cases, value_cases, continuous_cases, kl_cases, grpo_cases)
        for fn in generators:
            start = time.perf_counter()
            try:
                fn(table, impls, gen, args.cases)
                print(f"{fn.__name__}: {time.perf_counter() - start:.1f} s", flush=True)
            except Exception:
                rows.append({"check": f"differential: {fn.__name__}", "result": "fail",
                             "detail": traceback.format_exc()[-500:]})  # fmt: skip
        merged: dict[str, list[Row]] = {}
        for row in table.values():
            merged.setdefault(row.check, []).append(row)
        for check, parts in merged.items():
            total = Row(check, " and ".join(r.versions for r in parts))
            for part in parts:
                total.cases += part.cases
                total.failures += [f"[{part.versions}] {f}" for f in part.failures]
                if part.worst > total.worst:
                    total.worst, total.worst_case = part.worst, part.worst_case
            rows.append(total.as_dict())
        if main_ok:
            rows += documented_rows(main_label, impls[main_label][1])
        try:
            rows += unit_test_rows(upstream, workdir, main_ok)
        except Exception as exc:
            detail = f"could not run: {type(exc).__name__}: {exc}"[:400]
            rows.append({"check": "DI-engine's unit tests", "result": "fail", "detail": detail})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"library": "ding", "versions": versions, "rows": rows},
                                   indent=1))  # fmt: skip
    for row in rows:
        print(f"{row['result']:>10}  {row['check']}: {row['detail']}")
        if row.get("worst_case"):
            print(f"{'':>12}worst: {row['worst_case']}")
    return 0 if all(r["result"] != "fail" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
