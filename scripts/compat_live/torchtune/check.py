"""Live check of ``fused_rl.compat.torchtune`` against the real torchtune.

Run by ``scripts/test-compat-live.sh torchtune`` in a venv where ``install.sh`` installed
torchtune 0.6.1; writes the JSON that ``scripts/compat_live/summary.py`` renders::

    python scripts/compat_live/torchtune/check.py --out compat-live/torchtune.json

1. Differential comparison of every adapter function with the original: torchtune 0.6.1 (the
   installed package) and torchtune main at ``MAIN_REF`` (its ``torchtune/rlhf`` sources,
   loaded over the installed package; ``masked_sum`` and ``batched_logits_to_logprobs`` exist
   on main only). Random shapes, masks (all-masked included), fp32 / fp64 / bf16 and mixed
   dtypes, edge values; outputs, gradients under random upstream gradients and dtypes. Each
   output must match the original's dtype, shape and ``requires_grad``, and lie no further
   from the original run in float64 than twice the original's own error, or than a floor
   (1e-12 fp64, 1e-5 fp32, one ulp of 1.0 for bf16; a gradient's floor times its condition
   number as a sum over the outputs; scalars below 1 compared absolutely, see ``rel_err``).
   Functions that are torchtune's eager expressions must be bit-identical; under
   ``half_precision("original")`` every bf16 case must be.
2. torchtune's own unit tests for these functions (``tests/torchtune/rlhf/test_rewards.py``,
   ``tests/torchtune/rlhf/loss/test_ppo_loss.py`` at ``v0.6.1`` and at ``MAIN_REF``), run
   twice: against the original functions, and with them monkeypatched to fused_rl's.

The wheel ships no tests, so they and main's sources come from a torchtune git repository:
``--upstream-src DIR`` or ``$COMPAT_TORCHTUNE_SRC`` (a clone, bare or not), else GitHub's
tarballs (cached under ``~/.cache/fused_rl-compat-live``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
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

SLUG = "pytorch/torchtune"
RELEASE_TAG = "v0.6.1"
MAIN_REF = "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1"
SRC_ENV = "COMPAT_TORCHTUNE_SRC"
MAIN_SOURCES = {
    "rewards": "torchtune/rlhf/rewards.py",
    "sequence_processing": "torchtune/rlhf/sequence_processing.py",
    "ppo": "torchtune/rlhf/loss/ppo.py",
}
UNIT_TESTS = ("tests/torchtune/rlhf/test_rewards.py", "tests/torchtune/rlhf/loss/test_ppo_loss.py")
FUNCTIONS = (
    "masked_mean",
    "masked_sum",
    "masked_var",
    "whiten",
    "estimate_advantages",
    "get_rewards_ppo",
    "logits_to_logprobs",
    "batched_logits_to_logprobs",
)
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


def load_main_modules(upstream: Upstream, workdir: pathlib.Path):
    """torchtune main's rlhf modules, imported over the installed package (they import only
    ``torch`` and ``torchtune``, whose installed modules serve them)."""
    modules = {}
    for key, path in MAIN_SOURCES.items():
        file = workdir / f"torchtune_main_{key}.py"
        file.write_text(upstream.read(MAIN_REF, path))
        spec = importlib.util.spec_from_file_location(f"torchtune_main_{key}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[key] = module
    return modules


class Namespace:
    def __init__(self, **items):
        self.__dict__.update(items)


def main_namespace(modules) -> Namespace:
    items = {name: getattr(modules["rewards"], name, None) for name in FUNCTIONS}
    for name in ("logits_to_logprobs", "batched_logits_to_logprobs"):
        items[name] = getattr(modules["sequence_processing"], name)
    return Namespace(PPOLoss=modules["ppo"].PPOLoss, **items)


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


def mask_of(kind: str, shape, gen) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "empty":
        return torch.zeros(shape, dtype=torch.bool)
    if kind == "full":
        return torch.ones(shape, dtype=torch.bool)
    m = torch.rand(shape, generator=gen) > 0.35
    if kind == "padding":  # right padding, at least one valid token per row
        lengths = torch.randint(1, shape[-1] + 1, shape[:-1], generator=gen)
        m = torch.arange(shape[-1]) < lengths[..., None]
    if kind == "float":
        return m.float()
    return m


def randn(gen, shape, dtype, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)


DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def reductions(rows, impls, gen, n):
    """masked_mean / masked_sum / masked_var / whiten: torchtune's eager expressions,
    bit-identical in every dtype, gradients included."""
    from fused_rl.compat import torchtune as fused

    for i in range(n):
        dtype = DTYPES[i % 3]
        shape = [(5,), (3, 7), (2, 3, 4), (1, 1), (4, 16)][i % 5]
        kind = ["random", "empty", "full", "padding", "float"][(i // 3) % 5]
        x = randn(gen, shape, dtype, scale=3.0, shift=1.0)
        m = mask_of(kind, shape, gen)
        dims = [None] + list(range(-len(shape), len(shape)))
        dim = dims[i % len(dims)]
        case = f"{dtype} {shape} mask={kind} dim={dim}"
        for label, orig in impls.items():
            key = f"masked_mean / masked_sum ({label})"
            mean_row = rows.setdefault(key, Row(f"differential: {key.split(' (')[0]}", label))
            inputs = {"x": x, "mask": m, "dim": dim}
            compare(mean_row, case, fused.masked_mean, orig.masked_mean, inputs, grad=("x",),
                    exact=True, seed=i)  # fmt: skip
            if orig.masked_sum is not None:
                compare(mean_row, case, fused.masked_sum, orig.masked_sum, inputs, grad=("x",),
                        exact=True, seed=i)  # fmt: skip
            var_row = rows.setdefault(f"var ({label})", Row("differential: masked_var", label))
            centred = {"centered_values": x, "mask": m, "unbiased": bool(i % 2)}
            compare(var_row, case, fused.masked_var, orig.masked_var, centred,
                    grad=("centered_values",), exact=True, seed=i)  # fmt: skip
            w_row = rows.setdefault(f"whiten ({label})", Row("differential: whiten", label))
            compare(w_row, case, fused.whiten, orig.whiten,
                    {"x": x, "mask": None if kind == "float" else m, "shift_mean": i % 4 < 2},
                    grad=("x",), exact=True, seed=i)  # fmt: skip


def rewards_cases(rows, impls, gen, n):
    from fused_rl.compat import torchtune as fused

    for i in range(n):
        dtype = DTYPES[i % 3]
        b, length = 1 + i % 4, 1 + (i * 7) % 9
        idx = None if i % 3 == 0 else torch.randint(0, length, (b,), generator=gen)
        inputs = {
            "scores": randn(gen, (b,), dtype),
            "logprobs": randn(gen, (b, length), dtype, shift=-2.0),
            "ref_logprobs": randn(gen, (b, length), dtype, shift=-2.0),
            "kl_coeff": [0.1, 0.0, 0.5, 2.0][i % 4],
            "valid_score_idxs": idx,
        }
        case = f"{dtype} ({b}, {length}) idx={'none' if idx is None else 'given'}"
        for label, orig in impls.items():
            row = rows.setdefault(f"rewards ({label})", Row("differential: get_rewards_ppo", label))
            compare(row, case, fused.get_rewards_ppo, orig.get_rewards_ppo, inputs,
                    grad=("scores", "logprobs", "ref_logprobs"), exact=True, seed=i)  # fmt: skip


def advantages_cases(rows, impls, gen, n):
    from fused_rl.compat import torchtune as fused

    dtype_pairs = [(torch.float32,) * 2, (torch.float64,) * 2, (torch.bfloat16,) * 2,
                   (torch.bfloat16, torch.float32), (torch.int64, torch.float32),
                   (torch.int64, torch.int64)]  # fmt: skip
    hyper = [(0.9, 0.95), (1.0, 1.0), (0.99, 0.0), (0.0, 0.5), (1.0, 0.95)]
    for i in range(n):
        dv, dr = dtype_pairs[i % len(dtype_pairs)]
        gamma, lmbda = hyper[i % len(hyper)]
        b, length = 1 + i % 3, [1, 2, 7, 33, 5][i % 5]
        kind = ["none", "padding", "random", "empty", "full"][(i // 2) % 5]

        def tensor(dtype, shape=(b, length)):
            if dtype == torch.int64:
                return torch.randint(-3, 4, shape, generator=gen)
            return randn(gen, shape, dtype, scale=2.0)

        inputs = {"values": tensor(dv), "rewards": tensor(dr), "gamma": gamma, "lmbda": lmbda,
                  "masks": mask_of(kind, (b, length), gen)}  # fmt: skip
        grad = tuple(k for k in ("values", "rewards") if inputs[k].is_floating_point())
        case = f"{dv}/{dr} ({b}, {length}) gamma={gamma} lmbda={lmbda} masks={kind}"
        for label, orig in impls.items():
            row = rows.setdefault(f"gae ({label})", Row("differential: estimate_advantages", label))
            compare(row, case, fused.estimate_advantages, orig.estimate_advantages, inputs,
                    grad=grad, seed=i)  # fmt: skip
            if dv in HALF or dr in HALF:
                original_mode(rows, label, "estimate_advantages", case, fused, orig, inputs, grad)


def logits_cases(rows, impls, gen, n):
    from fused_rl.compat import torchtune as fused

    for i in range(n):
        dtype = DTYPES[i % 3]
        b, length, vocab = 1 + i % 3, 1 + (i * 5) % 7, [7, 128, 1000, 33][i % 4]
        temperature = [1.0, 0.7, 1.3][(i // 3) % 3]
        ctx = 1 + i % 3
        full = randn(gen, (b, ctx + length, vocab), dtype, scale=[1.0, 4.0, 30.0][i % 3])
        logits = full[:, ctx - 1 : -1]  # torchtune's truncate_sequence_for_logprobs
        seqs = torch.randint(0, vocab, (b, length), generator=gen)
        case = f"{dtype} ({b}, {length}, {vocab}) T={temperature} strided"
        for label, orig in impls.items():
            inputs = {"logits": logits, "sequences": seqs, "temperature": temperature}
            row = rows.setdefault(f"l2l ({label})", Row("differential: logits_to_logprobs", label))
            compare(row, case, fused.logits_to_logprobs, orig.logits_to_logprobs, inputs,
                    grad=("logits",), seed=i)  # fmt: skip
            if dtype in HALF:
                original_mode(rows, label, "logits_to_logprobs", case, fused, orig, inputs,
                              ("logits",))  # fmt: skip
            if orig.batched_logits_to_logprobs is None:
                continue
            inputs = dict(inputs, chunk_size=[4, 1, 2, 5][i % 4])
            check = "differential: batched_logits_to_logprobs"
            row = rows.setdefault(f"batched ({label})", Row(check, label))
            compare(row, case, fused.batched_logits_to_logprobs, orig.batched_logits_to_logprobs,
                    inputs, grad=("logits",), seed=i)  # fmt: skip
            if dtype in HALF:
                original_mode(rows, label, "batched_logits_to_logprobs", case, fused, orig,
                              inputs, ("logits",))  # fmt: skip


PPO_NAMES = ("pi_old_logprobs", "pi_logprobs", "advantages", "phi_old_values", "phi_values",
             "returns")  # fmt: skip


def ppo_inputs(gen, i, dtypes, b, length, mask_kind, value_mask_kind):
    old = randn(gen, (b, length), torch.float64, shift=-2.0)
    new = old + randn(gen, (b, length), torch.float64, scale=[0.05, 0.3, 1.0][i % 3])
    v_old = randn(gen, (b, length), torch.float64)
    v = v_old + randn(gen, (b, length), torch.float64, scale=0.3)
    values = [old, new, randn(gen, (b, length), torch.float64), v_old, v,
              randn(gen, (b, length), torch.float64)]  # fmt: skip
    if i % 5 == 0:
        values[2][..., 0] = 0.0  # adv = 0: never counted as clipped
    inputs = {n: t.to(d) for n, t, d in zip(PPO_NAMES, values, dtypes)}
    pm = mask_of(mask_kind, (b, length), gen)
    vm = pm.clone() if value_mask_kind == "same" and pm is not None else None
    if value_mask_kind == "one_past" and pm is not None:  # values valid one token further
        vm = pm.clone()
        vm[:, 1:] = (vm[:, 1:].bool() | pm[:, :-1].bool()).to(vm.dtype)
    inputs["padding_masks"], inputs["value_padding_masks"] = pm, vm
    return inputs


def ppo_cases(rows, impls, gen, n):
    from fused_rl.compat import torchtune as fused

    uniform = [(d,) * 6 for d in DTYPES]
    mixed = [(torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16,
              torch.float32),
             (torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16,
              torch.float64)]  # fmt: skip
    for i in range(n):
        dtypes = (uniform + mixed)[i % 5]
        b, length = 1 + i % 4, [1, 3, 8, 17][i % 4]
        mask_kind = ["none", "padding", "random", "empty", "float"][(i // 2) % 5]
        value_kind = ["same", "one_past", "none"][i % 3]
        hyper = [(0.2, 0.2, 0.1), (0.1, 0.2, 0.1), (0.0, 0.0, 0.5), (0.3, 0.05, 1.0)][i % 4]
        inputs = ppo_inputs(gen, i, dtypes, b, length, mask_kind, value_kind)
        every = i % 4 == 3  # every input requires grad: fused_rl's eager path
        grad = PPO_NAMES if every else ("pi_logprobs", "phi_values")
        if i % 7 == 6:  # torchtune broadcasts (b, 1) advantages
            inputs["advantages"] = inputs["advantages"][:, :1].contiguous()
        case = (f"{[str(d)[6:] for d in dtypes]} ({b}, {length}) masks={mask_kind}/{value_kind}"
                f" eps,clip,coef={hyper} grad={'all' if every else 'new,v'}")  # fmt: skip
        for label, orig in impls.items():
            ours, theirs = ppo_call(fused, hyper), ppo_call(orig, hyper)
            row = rows.setdefault(f"ppo ({label})", Row("differential: PPOLoss", label))
            compare(row, case, ours, theirs, inputs, grad=grad, seed=i)
            if any(d in HALF for d in dtypes):
                original_mode(rows, label, "PPOLoss", case, Namespace(PPOLoss=ours),
                              Namespace(PPOLoss=theirs), inputs, grad)  # fmt: skip


def ppo_call(impl, hyper):
    """``impl.PPOLoss(*hyper)`` called with keyword inputs."""
    module = impl.PPOLoss(*hyper)

    def run(**kw):
        return module(*(kw[k] for k in PPO_NAMES), kw["padding_masks"], kw["value_padding_masks"])

    return run


def original_mode(rows, label, name, case, fused, orig, inputs, grad):
    """bf16 inputs under ``half_precision("original")``: bit-identical values and grads."""
    import fused_rl.compat as compat

    row = rows.setdefault(f"original ({label})",
                          Row('half_precision("original"): bf16 bit for bit', label))  # fmt: skip

    def ours(**kw):
        with compat.half_precision("original"):
            return getattr(fused, name)(**kw)

    compare(row, f"{name} {case}", ours, getattr(orig, name), inputs, grad=grad, exact=True)


# ----------------------------------------------------------------------------- documented


def documented_rows(orig_label, orig) -> list[dict]:
    """The deliberate differences of docs/compat.md, observed."""
    from fused_rl.compat import torchtune as fused

    out = []
    inputs = [torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.zeros(1, 3),
              torch.zeros(1, 3), torch.zeros(1, 3)]  # fmt: skip
    inputs[1][0, 2] = float("nan")  # a NaN log-prob at a padding position
    mask = torch.tensor([[True, True, False]])
    theirs = orig.PPOLoss()(*inputs, mask, mask)[0]
    mine = fused.PPOLoss()(*inputs, mask, mask)[0]
    ok = bool(torch.isnan(theirs)) and bool(torch.isfinite(mine))
    out.append({
        "check": "documented: PPOLoss NaN at a masked-out position",
        "result": "documented" if ok else "fail",
        "detail": f"{orig_label}: loss {theirs.item()}; fused_rl: {mine.item():.4f} (masked-out"
                  " positions never matter)",
    })  # fmt: skip
    logits, bad = torch.zeros(1, 2, 5), torch.tensor([[1, -100]])
    kinds = []
    for fn in (orig.logits_to_logprobs, fused.logits_to_logprobs):
        try:
            fn(logits, bad)
            kinds.append("no error")
        except Exception as exc:
            kinds.append(type(exc).__name__)
    out.append({
        "check": "documented: token id -100 in sequences",
        "result": "documented" if kinds[1] == "ValueError" else "fail",
        "detail": f"{orig_label}: {kinds[0]}; fused_rl: {kinds[1]} naming `sequences`",
    })  # fmt: skip
    return out


# ----------------------------------------------------------------------------- unit tests


def patch_torchtune(source) -> None:
    """Point torchtune's rlhf names at ``source``'s (where ``source`` has them)."""
    import torchtune.rlhf as rlhf
    import torchtune.rlhf.loss as loss
    import torchtune.rlhf.loss.ppo as ppo
    import torchtune.rlhf.rewards as rewards
    import torchtune.rlhf.sequence_processing as seq

    for name in FUNCTIONS:
        fn = getattr(source, name, None)
        if fn is None:
            continue
        setattr(rlhf, name, fn)
        for module in (rewards, seq):
            if hasattr(module, name):
                setattr(module, name, fn)
    loss.PPOLoss = ppo.PPOLoss = source.PPOLoss


def run_unit_tests_child(mode: str, tests: str, junit: str, main_dir: str | None) -> int:
    """In a fresh interpreter: patch, then run torchtune's tests with pytest."""
    import pytest

    if mode == "main":
        patch_torchtune(main_namespace(load_main_modules(Upstream(main_dir), pathlib.Path(tests))))
    elif mode == "fused":
        from fused_rl.compat import torchtune as fused

        patch_torchtune(fused)
    return pytest.main([tests, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        "-o", "addopts=", "--rootdir", tests, f"--junitxml={junit}"])  # fmt: skip


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
    refs = [(RELEASE_TAG, "release", "torchtune 0.6.1")]
    if main_ok:
        refs.append((MAIN_REF, "main", f"torchtune main {MAIN_REF[:12]}"))
    for ref, mode, label in refs:
        tests = workdir / f"tests-{mode}"
        tests.mkdir()
        for path in UNIT_TESTS:
            (tests / pathlib.Path(path).name).write_text(upstream.read(ref, path))
        counts = {}
        for run_mode in (mode, "fused"):
            junit = workdir / f"{mode}-{run_mode}.xml"
            cmd = [sys.executable, __file__, "--child", run_mode, str(tests), str(junit),
                   upstream.src or ""]  # fmt: skip
            subprocess.run(cmd, capture_output=True, text=True, check=False)
            counts[run_mode] = junit_counts(junit)
        released, fused = counts[mode], counts["fused"]
        ok = fused[1] == 0 and released[1] == 0 and fused[0] == released[0] > 0
        files = ", ".join(pathlib.Path(p).name for p in UNIT_TESTS)
        rows.append({
            "check": f"torchtune's unit tests ({files} @ {ref[:12]})",
            "result": "pass" if ok else "fail",
            "detail": f"as released ({label}): {released[0]} passed, {released[1]} failed; "
                      f"monkeypatched to fused_rl: {fused[0]} passed, {fused[1]} failed",
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
    parser.add_argument("--cases", type=int, default=60, help="random cases per function")
    args = parser.parse_args()

    import torchtune.rlhf as released
    import torchtune.rlhf.loss as released_loss

    versions = {
        "torchtune": md.version("torchtune"),
        "torchao": md.version("torchao"),
        "torch": torch.__version__,
    }
    upstream = Upstream(args.upstream_src)
    release = Namespace(PPOLoss=released_loss.PPOLoss,
                        **{n: getattr(released, n, None) for n in FUNCTIONS})  # fmt: skip
    impls = {f"torchtune {versions['torchtune']}": release}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = pathlib.Path(tmp)
        main_ok = True
        try:
            main_mods = load_main_modules(upstream, workdir)
            impls[f"torchtune main {MAIN_REF[:12]}"] = main_namespace(main_mods)
            versions["torchtune main"] = f"{MAIN_REF[:12]} ({upstream.describe()})"
        except Exception as exc:
            main_ok = False
            detail = (f"unavailable ({type(exc).__name__}: {exc}); pass --upstream-src or "
                      f"{SRC_ENV}=<torchtune clone>")  # fmt: skip
            rows.append({"check": f"torchtune main {MAIN_REF[:12]} sources", "result": "fail",
                         "detail": detail[:400]})  # fmt: skip
        table: dict[str, Row] = {}
        gen = torch.Generator().manual_seed(20261123)
        for fn in (reductions, rewards_cases, advantages_cases, logits_cases, ppo_cases):
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
        rows += documented_rows(f"torchtune {versions['torchtune']}", release)
        try:
            rows += unit_test_rows(upstream, workdir, main_ok)
        except Exception as exc:
            detail = f"could not run: {type(exc).__name__}: {exc}"[:400]
            rows.append({"check": "torchtune's unit tests", "result": "fail", "detail": detail})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"library": "torchtune", "versions": versions, "rows": rows},
                                   indent=1))  # fmt: skip
    for row in rows:
        print(f"{row['result']:>10}  {row['check']}: {row['detail']}")
        if row.get("worst_case"):
            print(f"{'':>12}worst: {row['worst_case']}")
    return 0 if all(r["result"] != "fail" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
