"""Live check of ``fused_rl.compat.liger`` against the real Liger-Kernel.

Run by ``scripts/test-compat-live.sh liger`` in a venv where ``install.sh`` installed
Liger-Kernel 0.8.5; writes the JSON that ``scripts/compat_live/summary.py`` renders::

    python scripts/compat_live/liger/check.py --out compat-live/liger.json

A differential comparison of every adapter with the original, Liger's Triton kernels and
fused_rl's both run as they run here (the Triton interpreter on a CPU-only machine):

* ``triton_grpo_loss``: every loss type, token and sequence importance sampling, with and
  without padding, ``delta``, the vLLM ratio and the bias-corrected KL, ``reduce`` True and
  False; the loss (per token or reduced), the metrics and the gradient on the logits under
  a random upstream gradient, fp32. LUSPO reduced is a documented difference: Liger's
  backward is 1/L of its own forward's gradient, and under padding its forward sums
  ``n_i^2`` (docs/compat.md; fused_rl reduces as TRL does); raising where Liger raises
  (sequence-level IS for CISPO, SAPO, VESPO) with the same error is a pass.
* ``liger_jsd`` / ``LigerJSD`` and ``liger_fused_linear_jsd`` / ``LigerFusedLinearJSD``:
  ``beta`` 0, 0.5, 0.9999 and 1, with and without labels, fp32 and bf16; the loss and the
  gradients (``dX`` on the log-probabilities; the student's hidden states and head).
* The errors Liger raises for a ``shift_labels`` of the wrong shape and a zero temperature.

Each value and gradient lies no further (RMS relative) from a float64 run of fused_rl's (its
fp64 path; tests/test_compat_liger.py checks that against a float64 transcription of Liger's
math) than twice Liger's own error or a floor, 1e-5 in fp32 and 1e-3 in bf16 (the project's
tolerance policy): where Liger is the less accurate (the JSD at ``beta = 0.9999`` in fp32)
the row says by how much. Liger-Kernel ships no tests in its wheel, so none of its own run
here.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata as md
import json
import math
import os
import pathlib
import platform
import time
import warnings

import numpy
import torch

if not torch.cuda.is_available():  # run both libraries' Triton kernels on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import liger_kernel.transformers.functional as lf  # noqa: E402
from liger_kernel.transformers import LigerFusedLinearJSD as TheirFusedLinearJSD  # noqa: E402
from liger_kernel.transformers import LigerJSD as TheirJSD  # noqa: E402
from liger_kernel.transformers.grpo_loss import triton_grpo_loss as their_grpo  # noqa: E402

import fused_rl.compat.liger as ours  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BETAS = (0.0, 0.5, 0.9999, 1.0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS relative error ``||out - ref|| / ||ref||``; a scalar below 1 (a reduced loss whose
    terms cancel: its rounding is relative to the terms, not to the sum) compared absolutely,
    as the other libraries' checks do; ``inf`` where either is not finite."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return math.inf
    diff, scale = (out - ref).norm().item(), ref.norm().item()
    return diff / scale if scale >= 1 or (ref.numel() > 1 and scale > 1e-12) else diff


def quiet(fn, *args, **kwargs):
    """A call with NumPy's and the interpreter's warnings on masked lanes silenced."""
    with numpy.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def backward(out, leaves, up):
    """The leaves' gradients of ``out`` (its loss: the first of a tuple) under ``up``."""
    loss = out[0] if isinstance(out, tuple) else out
    quiet(torch.autograd.backward, [loss], [up.to(loss.dtype)])
    return [x.grad for x in leaves]


def leaf(x):
    return x.detach().clone().requires_grad_()


def verdict(rows, check, errors: dict[str, float], bound: float, extra: str = ""):
    worst = max(errors.values())
    detail = ", ".join(f"{k} {v:.2g}" for k, v in errors.items()) + f" (bound {bound:.2g})"
    rows.append({"check": check, "result": "pass" if worst <= bound else "fail",
                 "detail": detail + extra})  # fmt: skip


# ----------------------------------------------------------------------------- GRPO


def grpo_case(g, padded, batch=3, length=6, vocab=37):
    """``(logits, old, ref, ids, advantages, mask, vllm_ratio)``, two rows padded."""
    logits = torch.randn(batch, length + 1, vocab, generator=g) * 2
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length)
    if padded:
        mask[0, 4:] = 0
        mask[2, 2:] = 0
    old = torch.randn(batch, length, generator=g) * 0.3 - 3
    ref = torch.randn(batch, length, generator=g) * 0.3 - 3
    adv = torch.randn(batch, generator=g)
    vllm = torch.rand(batch, length, generator=g) + 0.5
    return logits, old, ref, ids, adv, mask, vllm


def run_grpo(fn, case, kw, up):
    """``fn``'s output and its gradient on the logits."""
    logits, old, ref, ids, adv, mask, _ = case
    x = leaf(logits)
    out = quiet(fn, x, old, ref, ids, adv, mask, **kw)
    return out, backward(out, [x], up)[0]


# the option sets each loss type and IS level runs with: plain (reduced), delta and the
# per-token output, the vLLM ratio with the bias-corrected KL (reduced)
GRPO_OPTIONS = ((True, False, False), (False, True, False), (True, False, True))


def grpo_rows(rows, seed):
    g = torch.Generator().manual_seed(seed)
    for loss_type in ours.LOSS_TYPES:
        for level in ("token", "sequence"):
            errors, own, raised, documented = {}, {}, set(), False
            for padded in (False, True):
                for reduce, with_delta, with_vllm in GRPO_OPTIONS:
                    case = grpo_case(g, padded)
                    kw = dict(temperature=0.9, beta=0.04, loss_type=loss_type, reduce=reduce,
                              importance_sampling_level=level, inplace=False)  # fmt: skip
                    if with_vllm:
                        kw.update(vllm_is_ratio=case[-1], use_bias_correction_kl=True)
                    if with_delta and loss_type not in ("cispo", "sapo", "vespo"):
                        kw["delta"] = 2.0
                    up = torch.randn(() if reduce else case[3].shape, generator=g)
                    mine = outcome(functools.partial(run_grpo, ours.triton_grpo_loss, case, kw, up))
                    theirs = outcome(functools.partial(run_grpo, their_grpo, case, kw, up))
                    if mine[0] != "no error" or theirs[0] != "no error":
                        if mine != theirs:
                            errors[f"raised {mine[0]} where Liger {theirs[0]}"] = math.inf
                        raised.add(mine[0])
                        continue
                    (a, a_grad), (b, b_grad) = mine[1], theirs[1]
                    wide = [t.double() if t.is_floating_point() else t for t in case]
                    exact, exact_grad = run_grpo(ours.triton_grpo_loss, wide, kw, up.double())
                    # LUSPO reduced: Liger's backward is 1/L of its own forward's gradient, and
                    # its forward sums n_i^2 under padding (docs/compat.md): not compared
                    skip = loss_type == "luspo" and reduce
                    pairs = [("dlogits", a_grad, b_grad, exact_grad, skip)]
                    if isinstance(a, tuple):
                        pairs.append(("loss", a[0], b[0], exact[0], skip and padded))
                        metrics = zip(a[1], b[1], exact[1])
                        pairs += [(f"metric {i}", *m, False) for i, m in enumerate(metrics)]
                    else:
                        pairs.append(("loss", a, b, exact, False))
                    for name, x, y, z, liger_differs in pairs:
                        err = rel_err(x, z)
                        errors[name] = max(errors.get(name, 0.0), err)
                        if liger_differs:
                            documented = documented or rel_err(x, y) > 1e-5
                        else:
                            own[name] = max(own.get(name, 0.0), rel_err(y, z))
            extra = f"; Liger's own error vs float64 {max(own.values(), default=0.0):.2g}"
            if documented:
                extra += ("; LUSPO reduced: Liger's gradient (and, under padding, its loss) "
                          "differ as documented")  # fmt: skip
            if raised:
                extra += f"; raised {sorted(raised)} where Liger raises the same"
            bound = max(2 * max(own.values(), default=0.0), 1e-5)
            verdict(rows, f"triton_grpo_loss {loss_type}, {level} IS", errors or {"-": 0.0},
                    bound, extra)  # fmt: skip


# ----------------------------------------------------------------------------- JSD


def run_jsd(fn, x, y, labels, beta, up):
    """``fn(x, y, labels, beta)`` and ``dX``; ``fn`` a module when ``beta`` is None."""
    x = leaf(x)
    out = quiet(fn, x, y, labels) if beta is None else quiet(fn, x, y, labels, beta)
    return out, backward(out, [x], up)[0]


def run_fused(fn, h, w, th, tw, labels, beta, up):
    """``fn``'s loss and the student's ``(dH, dW)``; ``fn`` a module when ``beta`` is None."""
    h, w = leaf(h), leaf(w)
    args = (h, w, th, tw, labels) if beta is None else (h, w, th, tw, labels, beta, -100, 1.3)
    out = quiet(fn, *args)
    return out, backward(out, [h, w], up)


def compare(errors, own, name, ours_value, theirs, exact):
    """fused_rl's and Liger's errors against the float64 run."""
    errors[name] = max(errors.get(name, 0.0), rel_err(ours_value, exact))
    own[name] = max(own.get(name, 0.0), rel_err(theirs, exact))


def finish(rows, check, errors, own, dtype):
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    bound = max(2 * max(own.values()), floor)
    verdict(rows, check, errors, bound, f"; Liger's own error vs float64 {max(own.values()):.2g}")


def jsd_rows(rows, seed):
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        for beta in BETAS:
            errors, own = {}, {}
            for labelled in (False, True):
                x = torch.randn(24, 53, generator=g).log_softmax(-1)
                y = (x + 0.5 * torch.randn(24, 53, generator=g)).log_softmax(-1)
                labels = torch.randint(0, 53, (24,), generator=g)
                labels[::5] = -100
                lab = labels.to(DEVICE) if labelled else None
                up = torch.randn((), generator=g)
                xs, ys = x.to(DEVICE, dtype), y.to(DEVICE, dtype)
                exact, exact_dx = run_jsd(ours.liger_jsd, xs.double(), ys.double(), lab, beta, up)
                a, a_dx = run_jsd(ours.liger_jsd, xs, ys, lab, beta, up)
                b, b_dx = run_jsd(lf.liger_jsd, xs, ys, lab, beta, up)
                m, m_dx = run_jsd(TheirJSD(beta), xs, ys, lab, None, up)
                n, n_dx = run_jsd(ours.LigerJSD(beta), xs, ys, lab, None, up)
                if a.dtype != b.dtype:
                    errors["dtype"] = math.inf
                compare(errors, own, "loss", a, b, exact)
                compare(errors, own, "dX", a_dx, b_dx, exact_dx)
                # each module is its library's function (the same value and gradient)
                module = max(rel_err(n, a), rel_err(n_dx, a_dx), rel_err(m, b), rel_err(m_dx, b_dx))
                errors["module"] = max(errors.get("module", 0.0), module)
            name = "fp32" if dtype == torch.float32 else "bf16"
            finish(rows, f"liger_jsd / LigerJSD {name}, beta {beta}", errors, own, dtype)


def fused_linear_jsd_rows(rows, seed):
    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        for beta in BETAS:
            errors, own = {}, {}
            for labelled in (False, True):
                h, w = torch.randn(20, 16, generator=g), torch.randn(61, 16, generator=g) * 0.3
                th, tw = torch.randn(20, 12, generator=g), torch.randn(61, 12, generator=g) * 0.3
                labels = torch.randint(0, 61, (20,), generator=g)
                labels[::4] = -100
                lab = labels.to(DEVICE) if labelled else None
                up = torch.randn((), generator=g)
                h, w, th, tw = (t.to(DEVICE, dtype) for t in (h, w, th, tw))
                wide = [t.double() for t in (h, w, th, tw)]
                exact, exact_d = run_fused(ours.liger_fused_linear_jsd, *wide, lab, beta, up)
                a, a_d = run_fused(ours.liger_fused_linear_jsd, h, w, th, tw, lab, beta, up)
                b, b_d = run_fused(lf.liger_fused_linear_jsd, h, w, th, tw, lab, beta, up)
                m, _ = run_fused(TheirFusedLinearJSD(beta, -100, 1.3), h, w, th, tw, lab, None, up)
                n, _ = run_fused(ours.LigerFusedLinearJSD(beta, -100, 1.3), h, w, th, tw, lab,
                                 None, up)  # fmt: skip
                if a.dtype != b.dtype:
                    errors["dtype"] = math.inf
                compare(errors, own, "loss", a, b, exact)
                compare(errors, own, "dH", a_d[0], b_d[0], exact_d[0])
                compare(errors, own, "dW", a_d[1], b_d[1], exact_d[1])
                module = max(rel_err(n, a), rel_err(m, b))  # each module is its function
                errors["module"] = max(errors.get("module", 0.0), module)
            name = "fp32" if dtype == torch.float32 else "bf16"
            check = f"liger_fused_linear_jsd / LigerFusedLinearJSD {name}, beta {beta}"
            finish(rows, check, errors, own, dtype)


def outcome(call):
    """``(error type, message)`` of ``call()``, or ``("no error", its result)``."""
    try:
        result = quiet(call)
    except Exception as e:  # noqa: BLE001 -- the error is what is compared
        return type(e).__name__, str(e)
    return "no error", result


def error_rows(rows):
    x = torch.randn(4, 7).log_softmax(-1)
    short = torch.zeros(3, dtype=torch.long)
    cases = {
        "shift_labels of the wrong shape": (
            functools.partial(lf.liger_jsd, x, x, short),
            functools.partial(ours.liger_jsd, x, x, short),
        ),
        "LigerFusedLinearJSD(temperature=0)": (
            functools.partial(TheirFusedLinearJSD, temperature=0),
            functools.partial(ours.LigerFusedLinearJSD, temperature=0),
        ),
    }
    for check, (theirs, mine) in cases.items():
        got = [outcome(call) for call in (theirs, mine)]
        got = [("no error", "") if r[0] == "no error" else r for r in got]
        rows.append({"check": f"error: {check}", "result": "pass" if got[0] == got[1] else "fail",
                     "detail": f"Liger {got[0]}, fused_rl {got[1]}"})  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="JSON file to write")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows: list[dict] = []
    start = time.monotonic()
    for part in (grpo_rows, jsd_rows, fused_linear_jsd_rows):
        part(rows, args.seed)
        print(f"{part.__name__}: {time.monotonic() - start:.0f} s", flush=True)
    error_rows(rows)
    for row in rows:
        print(f"{row['check']} {row['result']} - {row['detail']}", flush=True)
    import triton

    versions = {
        "liger-kernel": md.version("liger-kernel"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "device": DEVICE,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"library": "liger", "versions": versions, "rows": rows}, indent=1) + "\n"
    )
    failed = [r["check"] for r in rows if r["result"] == "fail"]
    print(f"{len(rows)} rows, {len(failed)} failed: {failed}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
