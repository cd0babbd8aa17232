"""Differential fuzzing of every public op and compat adapter: backend="reference" against
backend="triton" (the Triton interpreter on CPU), with hypothesis.

Every example (a :class:`fuzz_strategies.Case`) checks:

1. **the backends agree**: same output names, shapes and dtypes, NaN / +inf / -inf at the
   same positions, finite values within a tolerance (``RTOL`` of the output's dtype times the
   output's scale, plus 4x the fp32 reference's own distance from an fp64 run of the
   reference and what one rounding of the inputs moves it by, plus ``ROUNDING_SLACK``'s
   rounding of the terms an op's formula cancels, which an fp64 input, its own oracle,
   cannot show: ill-conditioned values get the slack the computation needs, no more), and
   the gradients under a random upstream gradient by the same rules;
2. **NaN in, NaN out**: a NaN in a counted position (unmasked, not ignored) of an input the
   output depends on makes the reduced outputs (loss, means) NaN on both backends, and a
   planted value (NaN, inf, 1e30, ...) at an uncounted position changes no output and no
   gradient (compared with the same inputs with that position set to 0);
3. **no input is mutated**, on either backend, by the forward or the backward (the storage
   of a strided view included);

except for invalid weights, whose NaN layout is documented to differ between the backends
(CONTRIBUTING.md, "NaN, threads and other failure modes"): a negative mask weight raises
``ValueError`` when checked, and unchecked every output and gradient element is NaN or its
value with the weight at 0 (:func:`check_invalid_weights`); with a ``num_items`` tensor <= 0
each gradient element is NaN or 0;

and ``test_bad_input_names_the_argument`` checks that bad arguments raise ``ValueError`` /
``TypeError`` naming the argument.

Profiles: ``ci`` (default; derandomized, bounded examples, no shrinking, ~1-2 minutes on one
core) and ``long`` (``FUSED_RL_FUZZ=long``: 10x the examples, random seeds, shrinking). Both
are registered here and applied per test (no global ``load_profile``, so other hypothesis
tests keep their own settings). ``pytest --hypothesis-show-statistics`` shows the events of
each test; a "fuzz summary" section at the end counts examples per op and those with
NaN / inf inputs.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from unittest import mock

import pytest
import torch
from conftest import DEVICE
from fuzz_strategies import (
    IGNORE_INDICES,
    INF,
    NAN,
    NEW_LOGPROB_SPECIALS,
    OLD_LOGPROB_SPECIALS,
    VOCAB_SIZES,
    Arg,
    Case,
    float_args,
    logits_args,
    mask_args,
    target_args,
)
from hypothesis import HealthCheck, Phase, assume, currently_in_test_context, given, note, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st

import fused_rl
from fused_rl import _backend
from fused_rl._agg import token_weights
from fused_rl.compat import ding, trl, verl
from fused_rl.compat import torchtune as tt

# ----------------------------------------------------------------------------- profiles

_HEALTH = [
    HealthCheck.too_slow,
    HealthCheck.function_scoped_fixture,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,  # known_open rejects whole classes (mixed dtypes) on purpose
]
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=False,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: bounded time even on a failure
    suppress_health_check=_HEALTH,
)
settings.register_profile("long", deadline=None, print_blob=True, suppress_health_check=_HEALTH)
PROFILE = "long" if os.environ.get("FUSED_RL_FUZZ") == "long" else "ci"
LONG_FACTOR = 10


def event(text: str) -> None:
    """``hypothesis.event`` (for ``--hypothesis-show-statistics``), also outside @given."""
    if currently_in_test_context():
        hypothesis_event(text)


def fuzz(n: int):
    """Hypothesis settings for a test worth ``n`` examples in the ci profile."""
    return settings(
        settings.get_profile(PROFILE), max_examples=n * (LONG_FACTOR if PROFILE == "long" else 1)
    )


# ----------------------------------------------------------------------------- statistics

STATS: dict[str, Counter] = defaultdict(Counter)


class _FuzzSummary:
    """Prints the per-op example counts at the end of the session."""

    def pytest_terminal_summary(self, terminalreporter):
        if not STATS:
            return
        tr = terminalreporter
        tr.section(f"fuzz summary (profile {PROFILE})")
        cols = ("examples", "nan_inputs", "inf_inputs", "nan_rule", "invariance", "bf16", "fp64",
                "neg_weight")  # fmt: skip
        tr.write_line(f"{'op':38s}" + "".join(f"{c:>11s}" for c in cols))
        for op in sorted(STATS):
            tr.write_line(f"{op:38s}" + "".join(f"{STATS[op][c]:11d}" for c in cols))
        total = sum(s["examples"] for s in STATS.values())
        tr.write_line(f"{len(STATS)} ops, {total} examples run on both backends")


@pytest.fixture(scope="module", autouse=True)
def _fuzz_summary(request):
    manager = request.config.pluginmanager
    if not manager.has_plugin("fused_rl_fuzz_summary"):
        manager.register(_FuzzSummary(), "fused_rl_fuzz_summary")
    yield


# ----------------------------------------------------------------------------- comparison

# relative tolerance by the dtype a value is rounded to: fp32 is twice the tolerance policy's
# 1e-5 (two backends, each within it of the oracle); bf16 is two ulps
RTOL = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, bool) or x is None:
        return x
    return torch.tensor(float(x), dtype=torch.float64)


def _precision(*dtypes: torch.dtype | None) -> torch.dtype:
    """The least precise of ``dtypes`` (floating only)."""
    present = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(present, key=lambda d: RTOL[d]) if present else torch.float64


def _where_differ(name, ref, tri, bad, oracle=None) -> str:
    idx = bad.nonzero()[:4].tolist()
    lines = [f"{name}: {int(bad.sum())} of {bad.numel()} elements, e.g."]
    for i in idx:
        i = tuple(i)
        line = f"  [{', '.join(map(str, i))}] reference={ref[i].item()!r} triton={tri[i].item()!r}"
        if oracle is not None:
            line += f" fp64-reference={oracle[i].item()!r}"
        lines.append(line)
    return "\n".join(lines)


def assert_backends_agree(
    ref_out, tri_out, dtype=None, *, oracle=None, condition=None, scale=0.0, what=""
):
    """``ref_out`` / ``tri_out``: ``{name: tensor | number | None}``. Same names, shapes and
    dtypes; NaN, +inf and -inf at the same positions; finite values within
    ``RTOL[p] * scale + 4 e + 4 rms(e)`` where ``p`` is the least precise of ``dtype`` and the
    output's dtype, ``scale`` the largest finite magnitude of the reference output (at least
    ``scale``: the inputs' for sums, where the summation order matters), and the
    slack ``e = |ref - oracle| + condition`` the rounding error the problem itself has
    (cancellation, exp of a large argument), elementwise and typical over the output:
    ``oracle`` the reference run in fp64, ``condition`` how far one rounding of the inputs
    moves it (both optional, ``{name: tensor}``). Reports every output that differs."""
    assert set(ref_out) == set(tri_out), f"{what}outputs {sorted(ref_out)} != {sorted(tri_out)}"
    problems = []
    for name in ref_out:
        orc = oracle.get(name) if oracle is not None else None
        cond = condition.get(name) if condition is not None else None
        problem = _compare(what + name, ref_out[name], tri_out[name], dtype, orc, cond, scale)
        if problem:
            problems.append(problem)
    if problems:
        raise AssertionError("backends disagree:\n" + "\n".join(problems))


def _compare(name, ref, tri, dtype, oracle, condition=None, min_scale=0.0) -> str | None:
    """Why ``tri`` is not ``ref`` (see :func:`assert_backends_agree`), or None."""
    ref, tri = _as_tensor(ref), _as_tensor(tri)
    if not isinstance(ref, torch.Tensor) or not isinstance(tri, torch.Tensor):
        return None if ref == tri else f"{name}: reference {ref!r} != triton {tri!r}"
    if ref.shape != tri.shape or ref.dtype != tri.dtype:
        return (
            f"{name}: reference {ref.dtype}{list(ref.shape)}, triton {tri.dtype}{list(tri.shape)}"
        )
    if not ref.is_floating_point():
        bad = ref != tri
        return _where_differ(name, ref, tri, bad) if bad.any() else None
    orc = _as_tensor(oracle).double() if isinstance(oracle, torch.Tensor | float) else None
    r, t = ref.double(), tri.double()
    for label, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        bad = test(r) != test(t)
        if bad.any():
            return f"{label} positions differ: " + _where_differ(name, r, t, bad, orc)
    finite = torch.isfinite(r)
    if not finite.any():
        return None
    scale = max(r[finite].abs().max().item(), min_scale)
    rtol = RTOL[_precision(dtype, ref.dtype)]
    tol = torch.full_like(r, rtol * scale + 4 * torch.finfo(ref.dtype).tiny)
    if orc is not None:  # the rounding error of the problem: elementwise and typical
        slack = (r - orc).abs()
        if condition is not None:
            slack = slack + condition
        slack = torch.where(torch.isfinite(slack), slack, torch.zeros_like(slack))
        tol = tol + 4 * slack + 4 * slack[finite].square().mean().sqrt()
    bad = finite & ((r - t).abs() > tol)
    if bad.any():
        return f"values differ (rtol {rtol:g}, scale {scale:g}): " + _where_differ(
            name, r, t, bad, orc
        )
    return None


def same(a, b) -> bool:
    """NaN-aware exact equality of tensors (dtype, shape and values) or plain values."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


# ----------------------------------------------------------------------------- running a case


@contextlib.contextmanager
def _auto_resolves_to(backend: str):
    """The compat adapters call the ops with ``backend="auto"``: make it pick ``backend``
    (the reference: as if Triton could not run on any device, CUDA included, without the
    warning auto gives for that)."""
    if backend == "reference":
        with (
            mock.patch.object(_backend, "_triton_problem", lambda device: "the test's choice"),
            mock.patch.object(_backend, "_warn_once", lambda message: None),
        ):
            yield
    else:
        yield


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, torch.Tensor | float | int | bool) or obj is None:
        return {prefix or "out": obj}
    if hasattr(obj, "_asdict"):
        items = obj._asdict().items()
    elif isinstance(obj, dict):
        items = obj.items()
    else:
        items = enumerate(obj)
    out = {}
    for key, value in items:
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def upstream_generator(case: Case) -> torch.Generator:
    """The generator of the upstream gradients :func:`run_backend` draws, one
    ``randn(output.shape)`` per differentiable output in the order of their names (offset:
    an upstream equal to an input, drawn with the same seed, is a degenerate direction)."""
    return torch.Generator().manual_seed(case.upstream_seed + 1_000_003)


def run_backend(case: Case, backend: str, *, mask_upstream=False, check_mutation=True):
    """Forward and backward of ``case`` on ``backend`` with its tensors on ``DEVICE``:
    ``{output name: value}`` with the gradients as ``grad.<arg>``. Asserts that no input (nor
    its storage) was modified."""
    leaves = {}
    for name, arg in case.args.items():
        if arg is not None:
            leaves[name] = arg.base.detach().to(DEVICE, copy=True).requires_grad_(name in case.grad)
    inputs = {n: (None if a is None else a.view(leaves[n])) for n, a in case.args.items()}
    with _auto_resolves_to(backend):
        outs = _flatten(case.call(inputs, backend))
    diff = {k: v for k, v in outs.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    wrt = [n for n in case.grad if n in leaves]
    result = {k: _as_tensor(v) for k, v in outs.items()}
    result["differentiable"] = tuple(sorted(diff))
    if diff and wrt:
        gen = upstream_generator(case)
        upstream = []
        for name, value in sorted(diff.items()):
            u = torch.randn(value.shape, generator=gen, dtype=torch.float64)
            if mask_upstream and name in case.local_outputs:
                u = u * case.local_outputs[name].expand(u.shape)
            upstream.append(u.to(value.device, value.dtype))
        # w.r.t. the tensors the op received (not the storage): the sum an expand's backward
        # does afterwards would add rounding the fp64 oracle does not have
        with _auto_resolves_to(backend):
            grads = torch.autograd.grad(
                [diff[k] for k in sorted(diff)], [inputs[n] for n in wrt], upstream,
                allow_unused=True,
            )  # fmt: skip
        for name, g in zip(wrt, grads):
            result[f"grad.{name}"] = torch.zeros_like(inputs[name]) if g is None else g
    if check_mutation:
        for name, leaf in leaves.items():
            assert same(leaf.detach().cpu(), case.args[name].base), (
                f"{backend} modified input {name}"
            )
    return result


def known_open(case: Case) -> str | None:
    """The open findings of this suite (``FOUND`` reproducers marked strict xfail), or None.

    The random tests skip (``assume``) examples of these classes, so that each class fails in
    exactly one place, its reproducer, until it is fixed: then that reproducer XPASSes, the
    strict mark fails the run, and its rule here must go. Findings 9 and 10 (unchecked
    negative mask weights, a ``num_items`` tensor <= 0) are documented behaviour, checked by
    :func:`check_invalid_weights` and :func:`assert_nan_or_clean` (an ignored token's weight
    no longer counts: the half of 9 that was a bug is fixed); 12 (DI-engine continuous, fp32
    reference overflow), 13 (a ``num_items`` tensor read by a mode that ignores it), 14 (the
    student's gradient where ``p == 0`` in a row whose reverse KL / JSD is not finite: 0 on
    Triton, NaN on the reference; now NaN on both, CONTRIBUTING.md "NaN, threads and other
    failure modes"), 15 (``token_kl`` did not check V = 0 / 0-dim logits: ``BAD_FOUND``) and
    16 (a ``num_items`` number reached the finalize kernels as a bare float, fp32 when
    compiled; now an fp32 pair) and 17 (a NaN advantage where the PPO ratio is past both
    clamps: NaN gradient on Triton, 0 on the reference; now 0 on both, the clamps' shares
    through a ``where``) are fixed. Open: none.
    """
    del case
    return None


def _scaled_logit_rounding(case: Case) -> float:
    """The output scale that covers one rounding of the scaled logits ``z / T`` on a GPU.

    Compiled kernels contract ``z * (1 / T) - m`` into one FMA while the row maximum ``m`` is
    the rounded product, so with ``T != 1`` the maximum's own ``d`` is the product's rounding
    residual, up to half an ulp of ``max |z / T|``, instead of exactly 0 (logp of a
    one-column row 4e-6 off at |z / T| = 333, measured on an H200). The interpreter and the
    reference round each step, so on the CPU this slack is 0. Expressed as the ``scale``
    whose ``RTOL`` share is 4 such roundings."""
    logits = case.args.get("logits")
    temperature = case.hyper.get("temperature", 1.0)
    if DEVICE != "cuda" or logits is None or temperature == 1.0:
        return 0.0
    z = logits.value().double()
    finite = z[torch.isfinite(z)]
    if finite.numel() == 0:
        return 0.0
    return 4 * 2.0**-24 * finite.abs().max().item() / temperature / RTOL[torch.float32]


def rounded_once(case: Case) -> Case:
    """``case.upcast()`` with each float element moved by one rounding of its computation
    dtype in a random direction (seeded by ``upstream_seed``): ``2^-24`` relative, ``2^-52``
    for fp64 (one ulp at 1, the smallest step of an fp64 factor): the run whose distance
    from the fp64 oracle is each output's ``condition``. What ``Case.upcast(perturb=)``
    describes; it forms the factor ``1 +- rel`` in fp32, where ``1 + 2^-24`` and ``1 +-
    2^-53`` round to 1, so fp64 inputs never moved and fp32 ones only down (an fp64 student
    next to its own fp32 rounding as the teacher, ``distill_loss`` at ``|z / T| = 333``: a KL
    of 6e-48, ill-conditioned in both inputs, the backends 1.3e-8 and 2.7e-8 relative from
    the exact value and 2.4e-55 apart; that perturbation moved it by 9e-58, this one by
    3.5e-46)."""
    up = case.upcast()
    gen = torch.Generator().manual_seed(case.upstream_seed)
    args = dict(up.args)
    for name, a in up.float_args().items():
        rel = 2.0**-52 if case.args[name].dtype == torch.float64 else 2.0**-24
        sign = torch.randint(0, 2, a.base.shape, generator=gen, dtype=torch.float64) * 2 - 1
        base = a.base * (1 + rel * sign)
        args[name] = Arg(base, a.layout, a.shape, a.planted, a.plants, a.origin)
    return Case(**{**up.__dict__, "args": args})


# {op: fn(case) -> {output: elementwise slack}}: rounding of the computation itself that
# neither the fp32 reference's distance from fp64 nor a rounding of the inputs shows (an fp64
# input makes the reference its own oracle), added to the outputs' ``condition``
ROUNDING_SLACK: dict[str, Callable[[Case], dict[str, torch.Tensor]]] = {}


def check_case(case: Case, precision: torch.dtype | None = None) -> None:
    """Checks 1-3 of the module docstring on one case (``precision``: the least precise dtype
    the computation may round to, see :func:`assert_backends_agree`). Every check runs; one
    ``AssertionError`` lists all that failed."""
    if currently_in_test_context():
        note(repr(case))
    negative = negative_weights(case)
    if negative:  # checked: ValueError; unchecked: the documented NaN-or-clean results
        _record(case)
        if fused_rl.config.check_values:
            assert_negative_weight_raises(case, negative)
        with mock.patch.object(fused_rl.config, "check_values", False):
            check_invalid_weights(case)
        return
    if currently_in_test_context():
        assume(known_open(case) is None)
    _record(case)
    bad_count = invalid_num_items(case)
    uncounted = case.uncounted_plants()
    mask_up = uncounted and bool(case.local_outputs)
    runs = {b: run_backend(case, b, mask_upstream=mask_up) for b in ("reference", "triton")}
    diffable = {b: r.pop("differentiable") for b, r in runs.items()}
    oracle, moved = (
        run_backend(c, "reference", mask_upstream=mask_up, check_mutation=False)
        for c in (case.upcast(), rounded_once(case))
    )
    oracle.pop("differentiable")
    moved.pop("differentiable")
    condition = {  # what one rounding of the inputs moves each output by
        k: (_as_tensor(moved[k]).double() - _as_tensor(v).double()).abs()
        for k, v in oracle.items()
        if isinstance(_as_tensor(v), torch.Tensor) and _as_tensor(v).is_floating_point()
    }
    if case.op in ROUNDING_SLACK:
        for k, slack in ROUNDING_SLACK[case.op](case).items():
            # the slack is computed from the case's (CPU) inputs, the condition on DEVICE
            condition[k] = condition[k] + slack.to(condition[k].device)
    failures = []

    def check(fn, *args):
        try:
            fn(*args)
        except AssertionError as err:
            failures.append(str(err))

    def agree():
        assert diffable["reference"] == diffable["triton"], f"differentiable outputs: {diffable}"
        ref, tri = runs["reference"], runs["triton"]
        if bad_count:  # the gradients' NaN layout differs (documented): NaN or 0, below
            ref, tri = (
                {k: v for k, v in r.items() if not k.startswith("grad.")} for r in runs.values()
            )
        assert_backends_agree(
            ref, tri, precision, oracle=oracle, condition=condition,
            scale=case.input_scale() if case.linear else _scaled_logit_rounding(case),
        )  # fmt: skip

    check(agree)
    if bad_count:
        for backend, out in runs.items():
            grads = {k: v for k, v in out.items() if k.startswith("grad.")}
            zeros = {k: torch.zeros_like(v) for k, v in grads.items()}
            check(assert_nan_or_clean, backend, grads, zeros)
    required = case.nan_rule(case.inputs()) if case.nan_rule is not None else {}
    if required:
        STATS[case.op]["nan_rule"] += 1
        event(f"{case.op}: NaN required in {sorted(required)}")
        for backend, out in runs.items():
            check(assert_nan_where_required, backend, out, required)
    if uncounted:
        STATS[case.op]["invariance"] += 1
        event(f"{case.op}: planted value at an uncounted position")
        clean = case.cleaned()
        for backend, out in runs.items():
            expect = run_backend(clean, backend, mask_upstream=mask_up)
            expect.pop("differentiable")
            check(assert_uncounted_ignored, case, backend, out, expect)
    if failures:
        raise AssertionError(f"{case!r}\n" + "\n".join(failures))


# ops whose float / integer mask is a per-token weight (gae / kl_penalized_rewards: nonzero
# counts); a negative weight raises ValueError in eager mode with check_values on, else NaN
WEIGHT_MASK_OPS = (
    "policy_loss", "policy_loss_from_logprobs", "masked_sum", "masked_mean", "masked_var",
    "masked_whiten", "value_loss", "ppo_loss", "distill_loss",
)  # fmt: skip


def negative_weights(case: Case) -> tuple[str, ...]:
    """The mask arguments of ``case`` that are weights and hold a value < 0."""
    if case.op not in WEIGHT_MASK_OPS:
        return ()
    return tuple(
        name
        for name, a in case.args.items()
        if a is not None and ("mask" in name or name == "m") and a.dtype.is_signed
        and bool((a.value() < 0).any())
    )  # fmt: skip


def assert_negative_weight_raises(case: Case, names) -> None:
    """Checked (eager, ``check_values`` on): both backends raise ``ValueError`` naming a
    negative mask before anything runs."""
    STATS[case.op]["neg_weight"] += 1
    event(f"{case.op}: negative mask weight raises")
    pattern = rf"^({'|'.join(map(re.escape, names))}) has a negative weight .* must be >= 0$"
    inputs = {k: None if a is None else a.view(a.base.to(DEVICE)) for k, a in case.args.items()}
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=pattern):
            case.call(inputs, backend)


def invalid_num_items(case: Case) -> bool:
    """``num_items`` a tensor holding a value <= 0 (or NaN) with ``token-mean``, the mode it
    enters: the loss is NaN on both backends (``nan_rule``), and so is the aggregation's
    normaliser, which makes each gradient element NaN or 0; which ones are NaN differs
    between backends (documented, CONTRIBUTING.md "NaN, threads and other failure modes")."""
    n = case.hyper.get("num_items")
    return (
        isinstance(n, torch.Tensor) and not bool(n > 0)
        and case.hyper.get("loss_agg", "token-mean") == "token-mean"
    )  # fmt: skip


def zero_negative_weights(case: Case) -> Case:
    """``case`` with every negative mask weight set to 0 (what the unchecked results are
    compared with)."""
    args = dict(case.args)
    for name in negative_weights(case):
        a = case.args[name]
        base = torch.where(a.base < 0, torch.zeros_like(a.base), a.base)
        args[name] = Arg(base, a.layout, a.shape, a.planted, a.plants, a.origin + " (< 0 -> 0)")
    return Case(**{**case.__dict__, "args": args})


def check_invalid_weights(case: Case) -> None:
    """Unchecked negative mask weights (``check_values`` off, ``torch.compile``), as
    documented in CONTRIBUTING.md ("NaN, threads and other failure modes"): a negative weight
    is a NaN weight that counts its token. On each backend the loss (the reduction) is NaN
    (``nan_rule``) and every output and gradient element is NaN or its value with those
    weights set to 0 (:func:`assert_nan_or_clean`; a max / min metric, such as
    ``ratio_max``, also takes the negative-weight tokens); which elements are NaN differs
    between backends and ops. Inputs are not mutated."""
    clean = zero_negative_weights(case)
    mask_up = case.uncounted_plants() and bool(case.local_outputs)
    required = case.nan_rule(case.inputs()) if case.nan_rule is not None else {}
    failures = []
    for backend in ("reference", "triton"):
        out = run_backend(case, backend, mask_upstream=mask_up)
        want = run_backend(clean, backend, mask_upstream=mask_up, check_mutation=False)
        try:
            assert out.pop("differentiable") == want.pop("differentiable"), "differentiable"
            assert_nan_where_required(backend, out, required)
            assert_nan_or_clean(backend, out, want)
        except AssertionError as err:
            failures.append(str(err))
    if failures:
        raise AssertionError(f"{case!r}\n" + "\n".join(failures))


def assert_nan_or_clean(backend, out, want) -> None:
    """Each element of ``out`` is NaN or equal to ``want``'s (the same call with the invalid
    weight set to 0; for an invalid ``num_items``, 0); an output named ``*_max`` (``*_min``)
    may also be larger (smaller): a max over more tokens."""
    wrong = []
    for name, value in out.items():
        value, clean = _as_tensor(value), _as_tensor(want[name])
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            if not same(value, clean):
                wrong.append(f"  {name}: {_short(value)} (with the weights at 0: {_short(clean)})")
            continue
        v, c = value.double(), clean.to(value.device).double()
        ok = torch.isnan(v) | (v == c)
        if name.endswith("_max"):
            ok |= v >= c
        elif name.endswith("_min"):
            ok |= v <= c
        if not bool(ok.all()):
            wrong.append(_where_differ(f"  {name}", c, v, ~ok).replace("triton=", "got="))
    if wrong:
        raise AssertionError(
            f"{backend}: neither NaN nor the value with the weights at 0 (reference= that "
            "value)\n" + "\n".join(wrong)
        )


def _record(case: Case) -> None:
    stats = STATS[case.op]
    stats["examples"] += 1
    dtypes = {a.dtype for a in case.float_args().values()}
    stats["bf16"] += torch.bfloat16 in dtypes
    stats["fp64"] += torch.float64 in dtypes
    has_nan, has_inf = case.has(torch.isnan), case.has(torch.isinf)
    stats["nan_inputs"] += has_nan
    stats["inf_inputs"] += has_inf
    event(f"{case.op}: NaN input" if has_nan else f"{case.op}: no NaN input")
    if has_inf:
        event(f"{case.op}: inf input")
    for arg in case.args.values():
        if arg is not None and arg.layout != "contiguous":
            event(f"layout {arg.layout}")


def assert_nan_where_required(backend, out, required) -> None:
    """``required``: ``{output: bool tensor | bool}``, where NaN must show (``Case.nan_rule``)."""
    for name, where in required.items():
        value = out[name]
        where = torch.as_tensor(where, device=value.device).expand(value.shape)
        missing = where & ~torch.isnan(value)
        if missing.any():
            raise AssertionError(
                f"{backend}: {name} should be NaN (a NaN in a counted input, a negative mask "
                f"weight or num_items <= 0) at {missing.nonzero()[:4].tolist()}, "
                f"got {value[missing][:4].tolist()}"
            )


def assert_uncounted_ignored(case, backend, out, expect) -> None:
    """Outputs with planted values at uncounted positions equal those with 0 there."""
    changed = []
    for name, value in out.items():
        if name in case.invariant_skip:
            continue
        want = expect[name]
        if name in case.local_outputs:  # compare the counted positions only
            keep = case.local_outputs[name].to(value.device).expand(value.shape)
            value, want = value[keep], want[keep]
        if not same(value, want):
            changed.append(f"  {name}: {_short(value)} (with 0 there: {_short(want)})")
    if changed:
        raise AssertionError(
            f"{backend}: a value at an uncounted position changed the result\n" + "\n".join(changed)
        )


def _short(x) -> str:
    if isinstance(x, torch.Tensor) and x.numel() > 8:
        return f"{x.dtype} {list(x.shape)} {x.flatten()[:8].tolist()}..."
    return repr(x.tolist() if isinstance(x, torch.Tensor) else x)


# ----------------------------------------------------------------------------- shared draws

dtypes = st.sampled_from((torch.float32, torch.float32, torch.bfloat16, torch.float64))
upstream_seeds = st.integers(0, 2**16)
TEMPERATURES = (1.0, 1.0, 0.7, 1e-4, 0.01, 3.0, 1e4)


def _nonzero(mask: Arg | None, shape) -> torch.Tensor:
    return torch.ones(shape, dtype=torch.bool) if mask is None else mask.value() != 0


def _negative(mask: Arg | None, shape) -> torch.Tensor:
    """Negative mask weights: every op that takes weights makes what they reach NaN."""
    if mask is None or not mask.base.is_floating_point():
        return torch.zeros(shape, dtype=torch.bool)
    return mask.value() < 0


def row_poisoned(logits: torch.Tensor) -> torch.Tensor:
    """Rows whose log-softmax is NaN: a NaN or +inf anywhere, or every entry -inf."""
    return (
        torch.isnan(logits).any(-1)
        | torch.isposinf(logits).any(-1)
        | torch.isneginf(logits).all(-1)
    )


def _isnan(x: torch.Tensor | None, shape) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.bool) if x is None else torch.isnan(x).expand(shape)


def _window_rows(n_pos: int, n_tok: int) -> slice:
    shift = n_pos - n_tok - 1 if n_pos > n_tok else 0
    return slice(shift, shift + n_tok)


def _window_counted(counted_tok: torch.Tensor, n_pos: int) -> torch.Tensor:
    """``(..., S, 1)`` bool: the logits positions that predict a counted target."""
    out = torch.zeros((*counted_tok.shape[:-1], n_pos, 1), dtype=torch.bool)
    out[..., _window_rows(n_pos, counted_tok.shape[-1]), 0] = counted_tok
    return out


# ----------------------------------------------------------------------------- token stats


@st.composite
def token_stats_cases(draw, op):
    dtype, vocab = draw(dtypes), draw(st.sampled_from(VOCAB_SIZES))
    ndim = draw(st.sampled_from((1, 2, 3, 3, 3, 4)))
    lead = [draw(st.integers(0, 3)) for _ in range(ndim - 1)]
    n_tok = lead[-1] if lead else None
    if ndim >= 3 and draw(st.booleans()):  # the model's (B, S, V) buffer, S > T
        lead[-1] += draw(st.integers(1, 2))
    logits = draw(logits_args((*lead, vocab), dtype))
    temperature = draw(st.sampled_from(TEMPERATURES))
    upstream_seed = draw(upstream_seeds)
    if op == "token_entropy":
        rule = lambda x: {"entropy": row_poisoned(x["logits"])}
        return Case(
            "token_entropy",
            lambda x, b: {
                "entropy": fused_rl.token_entropy(x["logits"], temperature=temperature, backend=b)
            },
            {"logits": logits}, {"temperature": temperature}, grad=("logits",),
            nan_rule=rule, upstream_seed=upstream_seed,
        )  # fmt: skip
    ignore_index = draw(st.sampled_from(IGNORE_INDICES))
    tshape = (*lead[:-1], n_tok) if lead else ()
    targets = draw(target_args(tshape, vocab, ignore_index))
    with_entropy = draw(st.booleans())
    counted_tok = targets.value() != ignore_index
    if op == "token_stats":
        return _token_stats_case(
            logits, targets, temperature, ignore_index, counted_tok, lead, n_tok, upstream_seed
        )
    counted = _window_counted(counted_tok, lead[-1]) if lead else counted_tok.reshape(1).clone()

    def call(x, backend):
        out = fused_rl.token_logprobs(
            x["logits"], x["targets"], temperature=temperature, ignore_index=ignore_index,
            return_entropy=with_entropy, backend=backend,
        )  # fmt: skip
        return {"logp": out[0], "entropy": out[1]} if with_entropy else {"logp": out}

    def rule(x):
        lg = x["logits"]
        if lg.dim() >= 2:
            lg = lg[..., _window_rows(lg.shape[-2], n_tok), :]
        bad = row_poisoned(lg) & counted_tok
        return {"logp": bad, **({"entropy": bad} if with_entropy else {})}

    hyper = {"temperature": temperature, "ignore_index": ignore_index, "entropy": with_entropy}
    return Case(
        "token_logprobs", call, {"logits": logits, "targets": targets}, hyper, grad=("logits",),
        counted={"logits": counted}, nan_rule=rule, upstream_seed=upstream_seed,
    )  # fmt: skip


def _token_stats_case(logits, targets, temperature, ignore_index, counted_tok, lead, n_tok,
                      upstream_seed):  # fmt: skip
    """``token_stats``: its five outputs (the top-1 flag as 0 / 1), the log-prob's and the
    entropy's NaN rule of ``token_logprobs``; the diagnostics NaN exactly where the
    reference's are (the backends must agree)."""
    counted = _window_counted(counted_tok, lead[-1]) if lead else counted_tok.reshape(1).clone()

    def call(x, backend):
        s = fused_rl.token_stats(x["logits"], x["targets"], temperature=temperature,
                                 ignore_index=ignore_index, backend=backend)  # fmt: skip
        return {"logp": s.logp, "entropy": s.entropy, "mean_logit": s.mean_logit,
                "log_sum_sq_probs": s.log_sum_sq_probs,
                "is_top1": s.is_top1.to(s.logp.dtype)}  # fmt: skip

    def rule(x):
        lg = x["logits"]
        if lg.dim() >= 2:
            lg = lg[..., _window_rows(lg.shape[-2], n_tok), :]
        bad = row_poisoned(lg) & counted_tok
        return {"logp": bad, "entropy": bad}

    hyper = {"temperature": temperature, "ignore_index": ignore_index}
    return Case(
        "token_stats", call, {"logits": logits, "targets": targets}, hyper, grad=("logits",),
        counted={"logits": counted}, nan_rule=rule, upstream_seed=upstream_seed,
    )  # fmt: skip


@fuzz(30)
@given(token_stats_cases("token_logprobs"))
def test_token_logprobs(case):
    check_case(case)


@fuzz(10)
@given(token_stats_cases("token_stats"))
def test_token_stats(case):
    check_case(case)


@fuzz(15)
@given(token_stats_cases("token_entropy"))
def test_token_entropy(case):
    check_case(case)


# ----------------------------------------------------------------------------- policy losses

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")


@st.composite
def clip_hyper(draw):
    """Clip / KL / entropy / aggregation hyper-parameters, at the edges of their ranges."""
    eps_low = draw(st.sampled_from((0.2, 0.0, 0.999, 1.0, 5.0)))
    eps_high = draw(st.sampled_from((None, None, 0.0, 0.28, 10.0)))
    high = eps_low if eps_high is None else eps_high
    hyper = {
        "eps_low": eps_low,
        "eps_high": eps_high,
        "dual_clip": draw(st.sampled_from((None, None, 1.0 + 1e-6, 3.0, 1e6))),
        "delta": draw(st.sampled_from((None, None, 1.0 + high + 1e-6, 1.0 + high + 2.0))),
        "kl_estimator": draw(st.sampled_from(KL_KINDS)),
        "entropy_coef": draw(st.sampled_from((0.0, 0.0, 0.01, -0.01, 10.0))),
        "importance_sampling": draw(
            st.sampled_from(("token", "token", "sequence", "sequence-sum"))
        ),
        "off_policy_mask_threshold": draw(st.sampled_from((None, None, None, 0.0, -0.5, 1e3))),
        "loss_agg": draw(st.sampled_from(LOSS_AGGS)),
        "max_length": draw(st.sampled_from((None, None, 1, 1000))),
        "num_items": draw(
            st.sampled_from((None, None, None, 1, 7.5, 1e-3, "tensor", "zero-tensor"))
        ),
    }
    if hyper["num_items"] == "tensor":
        hyper["num_items"] = torch.tensor(3.0, device=DEVICE)
    elif hyper["num_items"] == "zero-tensor":
        hyper["num_items"] = torch.tensor(0.0, device=DEVICE)
    return hyper


def _zero_num_items(hyper) -> bool:
    """``num_items=tensor(0)`` with ``token-mean`` (the only mode it enters): a NaN loss."""
    n = hyper.get("num_items")
    zero = isinstance(n, torch.Tensor) and n.item() == 0
    return zero and hyper["loss_agg"] == "token-mean"


def _policy_nan_rule(counted, hyper, logp_bad, x, negative):
    """NaN-in-NaN-out of the policy losses, from ``logp_bad`` (B, T): tokens whose log-prob
    (or entropy) is NaN. A NaN at a counted token in the log-prob, the old log-prob or the
    advantage makes the loss NaN (and the ratio / approx-KL means); in the reference log-prob
    the KL mean (and the loss when ``beta != 0``); in the entropy the entropy mean (and the
    loss when ``entropy_coef != 0``); a ``negative`` mask weight at a counted token the loss.
    The clip fractions are means of comparisons (False for NaN): no rule."""
    shape = counted.shape
    bad_ratio = counted & (logp_bad | _isnan(x.get("old_logprobs"), shape))
    adv = x["advantages"]
    adv_nan = _isnan(adv[:, None] if adv.dim() == 1 else adv, shape)
    ref_nan = counted & (logp_bad | _isnan(x.get("ref_logprobs"), shape))
    ent = x.get("entropy")
    ent_bad = counted & (logp_bad if ent is None else _isnan(ent, shape))
    need_entropy = hyper.get("with_entropy") or hyper["entropy_coef"] != 0 or ent is not None
    loss_bad = bad_ratio | (counted & adv_nan) | (counted & negative)
    if x.get("ref_logprobs") is not None and hyper["beta"] != 0:
        loss_bad |= ref_nan
    if hyper["entropy_coef"] != 0:
        loss_bad |= ent_bad
    out = {}
    if loss_bad.any() or _zero_num_items(hyper):  # a count <= 0 gives NaN too
        out["loss"] = True
    if bad_ratio.any():
        out["metrics.ratio_mean"] = out["metrics.approx_kl"] = True
    if x.get("ref_logprobs") is not None and ref_nan.any():
        out["metrics.kl"] = True
    if need_entropy and ent_bad.any():
        out["metrics.entropy"] = True
    return out


def _policy_outputs(loss, metrics):
    return {"loss": loss, **{f"metrics.{k}": v for k, v in metrics.items()}}


@st.composite
def policy_tensors(draw, batch, length, dtype, counted_tok):
    """Advantages ((B,) or (B, T)), old / reference log-probs and the beta that goes with
    them, each counted where ``counted_tok`` is."""
    per_token = draw(st.booleans())
    adv_dtype = draw(st.sampled_from((torch.float32, dtype)))
    adv_shape = (batch, length) if per_token else (batch,)
    args = {"advantages": draw(float_args(adv_shape, adv_dtype))}
    counted = {"advantages": counted_tok if per_token else counted_tok.any(-1)}
    for name, specials in (("old_logprobs", OLD_LOGPROB_SPECIALS), ("ref_logprobs", None)):
        args[name] = None
        if draw(st.booleans()):
            kwargs = {"specials": specials} if specials else {}
            args[name] = draw(float_args((batch, length), draw(dtypes), kind="logprob", **kwargs))
            counted[name] = counted_tok
    beta = 0.0
    if args["ref_logprobs"] is not None:
        beta = draw(st.sampled_from((0.0, 0.04, -0.1, 1e3)))
    return args, counted, beta


@st.composite
def policy_loss_cases(draw):
    dtype, vocab = draw(dtypes), draw(st.sampled_from(VOCAB_SIZES))
    batch, length = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    positions = length + draw(st.sampled_from((0, 0, 0, 1, 2)))  # (B, S, V) buffer, S > T
    logits = draw(logits_args((batch, positions, vocab), dtype))
    ignore_index = draw(st.sampled_from(IGNORE_INDICES))
    targets = draw(target_args((batch, length), vocab, ignore_index))
    mask = draw(mask_args((batch, length)))
    counted_tok = (targets.value() != ignore_index) & _nonzero(mask, (batch, length))
    negative = _negative(mask, (batch, length))
    args, counted, beta = draw(policy_tensors(batch, length, dtype, counted_tok))
    hyper = draw(clip_hyper())
    hyper.update(
        beta=beta,
        temperature=draw(st.sampled_from(TEMPERATURES)),
        with_entropy=draw(st.booleans()),
        ignore_index=ignore_index,
    )
    counted["logits"] = _window_counted(counted_tok, positions)

    def call(x, backend):
        loss, metrics = fused_rl.policy_loss(
            x["logits"], x["targets"], x["advantages"], old_logprobs=x["old_logprobs"],
            ref_logprobs=x["ref_logprobs"], mask=x["mask"], backend=backend, **hyper,
        )  # fmt: skip
        return _policy_outputs(loss, metrics)

    def rule(x):
        logp_bad = row_poisoned(x["logits"][:, _window_rows(positions, length)])
        return _policy_nan_rule(counted_tok, hyper, logp_bad, x, negative)

    return Case(
        "policy_loss", call, {"logits": logits, "targets": targets, "mask": mask, **args},
        hyper, grad=("logits",), counted=counted, nan_rule=rule,
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(30)
@given(policy_loss_cases())
def test_policy_loss(case):
    check_case(case)


@st.composite
def policy_from_logprobs_cases(draw):
    dtype = draw(dtypes)
    batch, length = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    logprobs = draw(
        float_args((batch, length), dtype, kind="logprob", specials=NEW_LOGPROB_SPECIALS)
    )
    mask = draw(mask_args((batch, length)))
    counted_tok = _nonzero(mask, (batch, length))
    args, counted, beta = draw(policy_tensors(batch, length, dtype, counted_tok))
    entropy = None
    if draw(st.booleans()):
        entropy = draw(float_args((batch, length), draw(dtypes), kind="positive"))
        counted["entropy"] = counted_tok
    hyper = draw(clip_hyper())
    if entropy is None:
        hyper["entropy_coef"] = 0.0
    hyper["beta"] = beta
    counted["logprobs"] = counted_tok
    grad = ("logprobs", "entropy") if entropy is not None else ("logprobs",)

    def call(x, backend):
        loss, metrics = fused_rl.policy_loss_from_logprobs(
            x["logprobs"], x["advantages"], old_logprobs=x["old_logprobs"],
            ref_logprobs=x["ref_logprobs"], mask=x["mask"], entropy=x["entropy"],
            backend=backend, **hyper,
        )  # fmt: skip
        return _policy_outputs(loss, metrics)

    negative = _negative(mask, (batch, length))

    def rule(x):
        return _policy_nan_rule(counted_tok, hyper, torch.isnan(x["logprobs"]), x, negative)

    return Case(
        "policy_loss_from_logprobs", call,
        {"logprobs": logprobs, "mask": mask, "entropy": entropy, **args}, hyper, grad=grad,
        counted=counted, nan_rule=rule, upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(25)
@given(policy_from_logprobs_cases())
def test_policy_loss_from_logprobs(case):
    check_case(case)


# ----------------------------------------------------------------------------- distillation

DISTILL_BETAS = (0.0, 1.0, 0.5, 1e-3, 0.999)  # the exact KLs at 0 / 1, the JSD near both
DISTILL_METRICS = ("jsd", "forward_kl", "reverse_kl", "student_entropy", "teacher_entropy")
NUM_ITEMS = (None, None, None, 1, 7.5, 1e-3, "tensor", "zero-tensor")


def _num_items(choice):
    """A drawn ``num_items``: a number, or a 0-dim tensor on ``DEVICE`` (3 or 0)."""
    if choice in ("tensor", "zero-tensor"):
        return torch.tensor(3.0 if choice == "tensor" else 0.0, device=DEVICE)
    return choice


def _distill_nan_rule(counted, negative, hyper, x):
    """NaN-in-NaN-out of ``distill_loss`` (its docstring): a poisoned row (:func:`row_poisoned`:
    a NaN or +inf logit, or every logit -inf) in a counted token makes the loss and the three
    divergence metrics NaN, and the entropy of the model whose row it is; a negative weight
    at a counted token (unchecked: a NaN weight) every weighted mean and the loss; a
    ``num_items`` tensor <= 0 with ``token-mean`` the loss only."""
    student = row_poisoned(x["logits"]) & counted
    teacher = row_poisoned(x["teacher_logits"]) & counted
    out = {}
    if (student | teacher | negative).any() or _zero_num_items(hyper):
        out["loss"] = True
    if (student | teacher | negative).any():
        out.update({f"metrics.{k}": True for k in ("jsd", "forward_kl", "reverse_kl")})
    if (student | negative).any():
        out["metrics.student_entropy"] = True
    if (teacher | negative).any():
        out["metrics.teacher_entropy"] = True
    return out


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, 0.0)


def _pair_rounding(case: Case, coef, weights, loss_weights=None) -> dict[str, torch.Tensor]:
    """``ROUNDING_SLACK`` of the two-row divergences (``distill_loss``, ``token_kl``): the
    rounding their formulas carry however much it cancels, one ulp (of the accumulation
    dtype) of each term that cancels. ``coef``, ``weights``, ``loss_weights``:
    ``logits.shape[:-1]``, each token's upstream gradient, its weight in the metrics' means
    (``token_kl``: whether it counts) and in the loss (``distill_loss``).

    Values (with ``a``, ``b`` the scaled logits relative to their rows' maxima, ``delta =
    log q - log p = (b - a) + log(S_z / S_u)``): the KLs are formed from first-order terms
    that cancel to second order near ``p = q`` (``R / S_z - log(S_z / S_u)``, the library's
    documented relative error ``~ eps / |delta|``: ``tests/test_full_kl.py``
    ``test_near_equal_reference_keeps_relative_accuracy``), of size ``X = E_p |b - a| +
    |log(S_z / S_u)|`` (reverse; ``E_q`` forward): ``token_kl`` at ``T = 1e4``, a KL of
    3.1e-7 from ``|delta| ~ 1e-3``, is 2.5e-4 relative off on Triton, 2.8e-5 on the fp32
    reference. The JSD sums per-column terms of size ``(p + q) min(delta^2, |delta|)``.

    The student's gradient: ``coef_t / T`` times ``g_v - p_v sum_w g_w`` with ``g_v`` of size
    ``p_v (1 + |delta_v|)`` (reverse KL), ``p_v (1 + |log beta| + |log(1 - beta)| + max(0,
    delta_v))`` (the JSD's ``log(m / p)``), ``p_v + q_v`` (forward: ``p - q``): at equal fp64
    rows the reference's autograd gives ``-2.8e-17`` (0.99 ulp of ``|coef| p / T``) where
    Triton's is exactly 0; with an fp64 teacher logit of 1e30 the reverse KL's ``delta ~
    1e30`` cancels to an exact 0 on Triton, 1.8e13 on the reference.

    Non-finite (rows whose divergence is): 0, so the other slack stays."""
    other = {"distill_loss": "teacher_logits", "token_kl": "ref_logits"}[case.op]
    wide = any(a.dtype == torch.float64 for a in case.float_args().values())
    eps = torch.finfo(torch.float64 if wide else torch.float32).eps
    temperature, beta = case.hyper.get("temperature", 1.0), case.hyper.get("beta", 1.0)
    zs, us = (case.args[k].value().double() / temperature for k in ("logits", other))
    a, b = (x - x.amax(-1, keepdim=True) for x in (zs, us))
    log_zu = torch.logsumexp(a, -1, keepdim=True) - torch.logsumexp(b, -1, keepdim=True)
    log_p, log_q = torch.log_softmax(zs, dim=-1), torch.log_softmax(us, dim=-1)
    p, q = log_p.exp(), log_q.exp()
    delta = log_q - log_p

    def weighted(weight, x):  # sum_v weight_v x_v, 0 where the weight is
        return torch.where(weight > 0, weight * x, 0.0).sum(-1)

    gap = (b - a).abs()
    size = {
        "forward_kl": weighted(q, gap) + log_zu[..., 0].abs(),
        "reverse_kl": weighted(p, gap) + log_zu[..., 0].abs(),
        "jsd": weighted(p + q, torch.minimum(delta.square(), delta.abs())),
    }
    size["d"] = size["forward_kl" if beta == 0 else "reverse_kl" if beta == 1 else "jsd"]
    if beta == 0:
        g = p
    elif beta == 1:
        g = torch.where(p > 0, p * (1 + delta.abs()), 0.0)
    else:
        mix = 1 + abs(math.log(beta)) + abs(math.log1p(-beta))
        g = torch.where(p > 0, p * (mix + delta.clamp(min=0)), 0.0)
    terms = g + p * g.sum(-1, keepdim=True) + q
    out = {"grad.logits": _finite(eps * coef.abs()[..., None] * terms / temperature)}
    if case.op == "token_kl":
        out["out"] = _finite(eps * torch.where(weights != 0, size["d"], 0.0))
        return out
    out["loss"] = _finite(eps * (loss_weights.abs() * _finite(size["d"])).sum())
    total = weights.abs().sum()
    for name in ("forward_kl", "reverse_kl", "jsd"):
        part = (weights.abs() * _finite(size["d" if name == "jsd" else name])).sum()
        out[f"metrics.{name}"] = _finite(eps * part / total)
    return out


def _distill_rounding(case: Case) -> dict[str, torch.Tensor]:
    """:func:`_pair_rounding` with ``coef_t = u w_t``: the upstream ``u`` of the loss (its
    one differentiable output) times the aggregation's weight ``w_t`` of the token."""
    x, hyper = case.inputs(), case.hyper
    lead = x["logits"].shape[:-1]
    mask, targets = x.get("mask"), x.get("targets")
    m = torch.ones(lead, dtype=torch.float64) if mask is None else mask.double()
    if targets is not None:
        m = torch.where(targets != hyper.get("ignore_index", -100), m, 0.0)
    rows = (1, *lead) if len(lead) == 1 else lead
    w = token_weights(
        m.reshape(rows), hyper.get("loss_agg", "token-mean"),
        max_length=hyper.get("max_length"), num_items=hyper.get("num_items"),
        dtype=torch.float64,
    ).reshape(lead)  # fmt: skip
    u = torch.randn((), generator=upstream_generator(case), dtype=torch.float64)
    return _pair_rounding(case, u * w, m, w)


def _token_kl_rounding(case: Case) -> dict[str, torch.Tensor]:
    """:func:`_pair_rounding` with the upstream of each counted token's KL."""
    x = case.inputs()
    lead = x["logits"].shape[:-1]
    u = torch.randn(lead, generator=upstream_generator(case), dtype=torch.float64)
    mask = x.get("mask")
    counted = torch.ones(lead) if mask is None else (mask != 0).double()
    return _pair_rounding(case, u * counted, counted)


ROUNDING_SLACK.update(distill_loss=_distill_rounding, token_kl=_token_kl_rounding)


@st.composite
def distill_cases(draw):
    """``distill_loss``: student ``(B, T, V)`` or packed ``(N, V)`` logits, the teacher's of
    the same shape in any dtype, an optional per-token weight mask and optional targets
    (a token counts where its weight is nonzero and its target is not ``ignore_index``),
    every ``loss_agg``, an optional ``num_items``; the loss and every metric, the gradient
    w.r.t. the student's logits (the teacher gets none)."""
    dtype, vocab = draw(dtypes), draw(st.sampled_from(VOCAB_SIZES))
    if draw(st.booleans()):
        lead: tuple[int, ...] = (draw(st.integers(0, 3)), draw(st.integers(0, 4)))
    else:
        lead = (draw(st.integers(0, 6)),)
    logits = draw(logits_args((*lead, vocab), dtype))
    teacher = draw(logits_args((*lead, vocab), draw(dtypes)))
    ignore_index = draw(st.sampled_from(IGNORE_INDICES))
    targets = draw(target_args(lead, vocab, ignore_index)) if draw(st.booleans()) else None
    mask = draw(mask_args(lead))
    counted_tok = _nonzero(mask, lead)
    if targets is not None:
        counted_tok = counted_tok & (targets.value() != ignore_index)
    negative = _negative(mask, lead) & counted_tok  # an ignored token never counts
    hyper = {
        "beta": draw(st.sampled_from(DISTILL_BETAS)),
        "temperature": draw(st.sampled_from(TEMPERATURES)),
        "ignore_index": ignore_index,
        "loss_agg": draw(st.sampled_from(LOSS_AGGS)),
        "max_length": draw(st.sampled_from((None, None, 1, 1000))),
        "num_items": _num_items(draw(st.sampled_from(NUM_ITEMS))),
    }
    counted = counted_tok[..., None]

    def call(x, backend):
        loss, metrics = fused_rl.distill_loss(
            x["logits"], x["teacher_logits"], mask=x["mask"], targets=x["targets"],
            backend=backend, **hyper,
        )  # fmt: skip
        assert sorted(metrics) == sorted(DISTILL_METRICS), sorted(metrics)
        return _policy_outputs(loss, metrics)

    return Case(
        "distill_loss", call,
        {"logits": logits, "teacher_logits": teacher, "mask": mask, "targets": targets},
        hyper, grad=("logits",), counted={"logits": counted, "teacher_logits": counted},
        nan_rule=lambda x: _distill_nan_rule(counted_tok, negative, hyper, x),
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(30)
@given(distill_cases())
def test_distill_loss(case):
    check_case(case)


@st.composite
def token_kl_cases(draw):
    """``token_kl``: ``(..., V)`` logits (1 to 4 dims), the reference's of the same shape in
    any dtype, an optional indicator mask (nonzero counts, a negative value too); per-token
    outputs, 0 with a zero gradient outside the mask."""
    dtype, vocab = draw(dtypes), draw(st.sampled_from(VOCAB_SIZES))
    ndim = draw(st.sampled_from((1, 2, 3, 3, 4)))
    lead = tuple(draw(st.integers(0, 3)) for _ in range(ndim - 1))
    logits = draw(logits_args((*lead, vocab), dtype))
    ref = draw(logits_args((*lead, vocab), draw(dtypes)))
    mask = draw(mask_args(lead))
    counted_tok = _nonzero(mask, lead)
    temperature = draw(st.sampled_from(TEMPERATURES))

    def call(x, backend):
        return fused_rl.token_kl(
            x["logits"], x["ref_logits"], temperature=temperature, mask=x["mask"], backend=backend
        )

    def rule(x):
        """A poisoned row of either model at a counted token: NaN there."""
        bad = (row_poisoned(x["logits"]) | row_poisoned(x["ref_logits"])) & counted_tok
        return {"out": bad} if bad.any() else {}

    counted = counted_tok[..., None]
    return Case(
        "token_kl", call, {"logits": logits, "ref_logits": ref, "mask": mask},
        {"temperature": temperature}, grad=("logits",),
        counted={"logits": counted, "ref_logits": counted}, nan_rule=rule,
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(25)
@given(token_kl_cases())
def test_token_kl(case):
    check_case(case)


# ----------------------------------------------------------------------------- token-space ops

token_shapes = st.sampled_from(((3, 4), (2, 5), (1, 1), (4, 3), (0, 3), (3, 0), (5,), (2, 2, 3)))


@st.composite
def kl_estimate_cases(draw):
    shape = draw(token_shapes)
    logprobs = draw(float_args(shape, draw(dtypes), kind="logprob"))
    ref = draw(float_args(shape, draw(dtypes), kind="logprob"))
    kind = draw(st.sampled_from(KL_KINDS))
    grad = ("logprobs", "ref_logprobs") if draw(st.booleans()) else ("logprobs",)

    def call(x, backend):
        return fused_rl.kl_estimate(
            x["logprobs"], x["ref_logprobs"], kl_estimator=kind, backend=backend
        )

    def rule(x):
        return {"out": torch.isnan(x["logprobs"]) | torch.isnan(x["ref_logprobs"])}

    return Case(
        "kl_estimate", call, {"logprobs": logprobs, "ref_logprobs": ref}, {"kl_estimator": kind},
        grad=grad, nan_rule=rule, upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(30)
@given(kl_estimate_cases())
def test_kl_estimate(case):
    check_case(case)


REDUCTIONS = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")


@st.composite
def reduction_cases(draw, op):
    shape = draw(st.sampled_from(((3, 4), (2, 5), (1, 1), (0, 3), (3, 0), (7,), (), (2, 2, 3))))
    x = draw(float_args(shape, draw(dtypes)))
    mask = draw(mask_args(shape))
    counted = _nonzero(mask, shape)
    hyper: dict = {}
    if op in ("masked_sum", "masked_mean") and shape and draw(st.booleans()):
        hyper["dim"] = draw(st.integers(-len(shape), len(shape) - 1))
    if op == "masked_var":
        hyper["unbiased"] = draw(st.booleans())
    if op == "masked_whiten":
        hyper["keep_mean"] = draw(st.booleans())
        hyper["eps"] = draw(st.sampled_from((1e-8, 0.0, 1.0)))
    weights = counted.double() if mask is None else mask.value().double()
    negative = _negative(mask, shape)

    def call(x, backend):
        return getattr(fused_rl, op)(x["x"], x["mask"], backend=backend, **hyper)

    def rule(x):
        """A counted NaN (with a degree of freedom left, for the variance) or a negative
        weight: NaN (per slice along ``dim``)."""
        bad = torch.isnan(x["x"]) & counted
        if op == "masked_var":
            dof = weights.sum() - (1.0 if hyper["unbiased"] else 0.0)
            nan = (bad.any() and dof > 0) or negative.any()
            return {"out": True} if nan else {}
        bad = bad | negative
        if "dim" in hyper:
            return {"out": bad.any(hyper["dim"])}
        return {"out": True} if bad.any() else {}

    local = {"out": counted} if op == "masked_whiten" else {}
    return Case(
        op, call, {"x": x, "mask": mask}, hyper, grad=("x",), counted={"x": counted},
        nan_rule=rule, local_outputs=local, linear=op in ("masked_sum", "masked_mean"),
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@pytest.mark.parametrize("op", REDUCTIONS)
@fuzz(15)
@given(data=st.data())
def test_masked_reductions(op, data):
    check_case(data.draw(reduction_cases(op)))


GAMMAS = (0.0, 1.0, 0.5, 0.99, 1e-9)


@st.composite
def gae_cases(draw):
    batch, length = draw(st.sampled_from(((3, 4), (2, 7), (1, 1), (0, 3), (3, 0), (2, 20))))
    rewards = draw(float_args((batch, length), draw(dtypes)))
    values = draw(float_args((batch, length), draw(dtypes)))
    mask = draw(mask_args((batch, length), kinds=("none", "bool", "int", "float")))
    gamma, lam = draw(st.sampled_from(GAMMAS)), draw(st.sampled_from(GAMMAS))
    counted = _nonzero(mask, (batch, length))

    def call(x, backend):
        adv, ret = fused_rl.gae(
            x["rewards"], x["values"], gamma=gamma, lam=lam, mask=x["mask"], backend=backend
        )
        return {"advantages": adv, "returns": ret}

    def rule(x):
        """A NaN reward or value at a counted step t is NaN in A_t and R_t; with
        gamma * lam > 0 also in every earlier counted step's advantage and return; a NaN value
        with gamma > 0 is NaN in A_{t-1} and R_{t-1} (counted t-1)."""
        r_nan, v_nan = torch.isnan(x["rewards"]) & counted, torch.isnan(x["values"]) & counted
        bad = r_nan | v_nan
        if gamma > 0:
            bad = bad | (torch.nn.functional.pad(v_nan[:, 1:], (0, 1)) & counted)
        if gamma * lam > 0:  # reverse cumulative "or" over time
            bad = bad.flip(1).cummax(1).values.flip(1) & counted
        return {"advantages": bad, "returns": bad} if bad.any() else {}

    return Case(
        "gae", call, {"rewards": rewards, "values": values, "mask": mask},
        {"gamma": gamma, "lam": lam}, counted={"rewards": counted, "values": counted},
        nan_rule=rule, linear=True,
    )  # fmt: skip


@fuzz(30)
@given(gae_cases())
def test_gae(case):
    check_case(case)


@st.composite
def kl_rewards_cases(draw):
    batch, length = draw(st.sampled_from(((3, 4), (2, 7), (1, 1), (0, 3), (3, 0))))
    scores = draw(float_args((batch,), draw(dtypes)))
    logprobs = draw(float_args((batch, length), draw(dtypes), kind="logprob"))
    ref = draw(float_args((batch, length), draw(dtypes), kind="logprob"))
    mask = draw(mask_args((batch, length), kinds=("none", "bool", "int", "float")))
    score_index = None
    if length > 0 and draw(st.booleans()):
        gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        idx = torch.randint(0, length, (batch,), generator=gen)
        score_index = Arg(
            idx.to(draw(st.sampled_from((torch.int64, torch.int32)))), "contiguous", (batch,)
        )
    kind = draw(st.sampled_from(KL_KINDS))
    kl_coef = draw(st.sampled_from((0.1, 0.0, 1e3)))
    counted = _nonzero(mask, (batch, length))

    def call(x, backend):
        return fused_rl.kl_penalized_rewards(
            x["scores"], x["logprobs"], x["ref_logprobs"], kl_coef=kl_coef, mask=x["mask"],
            kl_estimator=kind, score_index=x["score_index"], backend=backend,
        )  # fmt: skip

    def rule(x):
        bad = torch.zeros((batch, length), dtype=torch.bool)
        if kl_coef > 0:
            bad |= (torch.isnan(x["logprobs"]) | torch.isnan(x["ref_logprobs"])) & counted
        if length > 0:  # the score lands on score_index, else the last counted step
            steps = torch.arange(length)
            if x["score_index"] is not None:
                where = x["score_index"].long()
            else:
                where = torch.where(counted, steps, -1).amax(1)
            bad |= (steps[None] == where[:, None]) & torch.isnan(x["scores"])[:, None]
        return {"out": bad} if bad.any() else {}

    return Case(
        "kl_penalized_rewards", call,
        {"scores": scores, "logprobs": logprobs, "ref_logprobs": ref, "mask": mask,
         "score_index": score_index},
        {"kl_estimator": kind, "kl_coef": kl_coef},
        counted={"logprobs": counted, "ref_logprobs": counted}, nan_rule=rule,
    )  # fmt: skip


@fuzz(30)
@given(kl_rewards_cases())
def test_kl_penalized_rewards(case):
    check_case(case)


@st.composite
def group_cases(draw, op):
    rloo = op == "rloo_advantages"
    group_size = draw(st.sampled_from((2, 3, 5) if rloo else (1, 2, 3, 5)))
    n_groups = draw(st.sampled_from((0, 1, 2, 3)))
    scores = draw(float_args((group_size * n_groups,), draw(dtypes)))
    if rloo:
        hyper = {}
        fn = lambda x, b: fused_rl.rloo_advantages(x["scores"], group_size=group_size, backend=b)
    else:
        hyper = {
            "normalize": draw(st.sampled_from(("std", "none"))),
            "eps": draw(st.sampled_from((1e-6, 0.0, 1.0))),
        }
        fn = lambda x, b: fused_rl.group_advantages(
            x["scores"], group_size=group_size, backend=b, **hyper
        )

    def rule(x):
        bad = torch.isnan(x["scores"]).reshape(-1, group_size).any(1, keepdim=True)
        bad = bad.expand(-1, group_size).reshape(-1)
        return {"out": bad} if bad.any() else {}

    return Case(
        "rloo_advantages" if rloo else "group_advantages", fn, {"scores": scores},
        {"group_size": group_size, **hyper}, nan_rule=rule,
    )  # fmt: skip


@pytest.mark.parametrize("op", ("group_advantages", "rloo_advantages"))
@fuzz(15)
@given(data=st.data())
def test_group_advantages(op, data):
    check_case(data.draw(group_cases(op)))


@st.composite
def value_loss_cases(draw):
    batch, length = draw(st.sampled_from(((3, 4), (2, 5), (1, 1), (0, 3), (3, 0))))
    args = {
        name: draw(float_args((batch, length), draw(dtypes)))
        for name in ("values", "old_values", "returns")
    }
    args["mask"] = draw(mask_args((batch, length)))
    counted = _nonzero(args["mask"], (batch, length))
    negative = _negative(args["mask"], (batch, length))
    hyper = {
        "clip": draw(st.sampled_from((0.2, None, 0.0, 1e30))),
        "loss_agg": draw(st.sampled_from(LOSS_AGGS)),
        "max_length": draw(st.sampled_from((None, None, 1, 1000))),
        "num_items": draw(st.sampled_from((None, None, 2, 0.5, "tensor", "zero-tensor"))),
    }
    if hyper["num_items"] in ("tensor", "zero-tensor"):
        n = 3.0 if hyper["num_items"] == "tensor" else 0.0
        hyper["num_items"] = torch.tensor(n, device=DEVICE)

    def call(x, backend):
        loss, metrics = fused_rl.value_loss(
            x["values"], x["old_values"], x["returns"], mask=x["mask"], backend=backend, **hyper
        )
        return _policy_outputs(loss, metrics)

    def rule(x):
        loss_bad = torch.isnan(x["values"]) | torch.isnan(x["returns"])
        if hyper["clip"] is not None:
            loss_bad = loss_bad | torch.isnan(x["old_values"])
        out = {}
        if (loss_bad & counted).any() or negative.any() or _zero_num_items(hyper):
            out["loss"] = True
        if (torch.isnan(x["values"]) & counted).any():
            out["metrics.value_mean"] = True
        return out

    return Case(
        "value_loss", call, args, hyper, grad=("values",),
        counted={k: counted for k in ("values", "old_values", "returns")}, nan_rule=rule,
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(30)
@given(value_loss_cases())
def test_value_loss(case):
    check_case(case)


PPO_TENSORS = (
    "pi_old_logprobs",
    "pi_logprobs",
    "advantages",
    "phi_old_values",
    "phi_values",
    "returns",
)


@st.composite
def ppo_hyper(draw):
    return {
        "epsilon": draw(st.sampled_from((0.1, 0.0, 0.2, 1.0, 2.0))),
        "value_clip_range": draw(st.sampled_from((0.2, 0.0, 1e30))),
        "value_coeff": draw(st.sampled_from((0.1, 0.0, 1e3))),
    }


@st.composite
def ppo_args(draw, shape, mask_kinds=None):
    kinds = ("logprob", "logprob", "normal", "normal", "normal", "normal")
    specials = {"pi_old_logprobs": OLD_LOGPROB_SPECIALS, "pi_logprobs": NEW_LOGPROB_SPECIALS}
    args = {
        n: draw(
            float_args(
                shape, draw(dtypes), kind=k, **({"specials": specials[n]} if n in specials else {})
            )
        )
        for n, k in zip(PPO_TENSORS, kinds)
    }
    kinds = {} if mask_kinds is None else {"kinds": mask_kinds}
    args["padding_masks"] = draw(mask_args(shape, **kinds))
    args["value_padding_masks"] = draw(mask_args(shape, **kinds))
    pc = _nonzero(args["padding_masks"], shape)
    vc = _nonzero(args["value_padding_masks"], shape)
    counted = {n: (pc if i < 3 else vc) for i, n in enumerate(PPO_TENSORS)}
    return args, counted


def _ppo_rule(x, counted, hyper, names):
    """Policy inputs NaN where counted (or a negative padding weight): the policy loss (and the
    loss); value inputs: the value loss (and the loss unless value_coeff == 0);
    ``ratios_mean`` is unmasked."""

    def negative(name):
        m = x[name]
        return m is not None and m.is_floating_point() and bool((m < 0).any())

    pol = negative("padding_masks")
    pol = pol or any((torch.isnan(x[n]) & counted[n]).any() for n in PPO_TENSORS[:3])
    val = negative("value_padding_masks")
    val = val or any((torch.isnan(x[n]) & counted[n]).any() for n in PPO_TENSORS[3:])
    out = {}
    if pol:
        out[names[1]] = out[names[0]] = True
    if val:
        out[names[2]] = True
        if hyper["value_coeff"] != 0:
            out[names[0]] = True
    if torch.isnan(x["pi_logprobs"]).any() or torch.isnan(x["pi_old_logprobs"]).any():
        out[names[3]] = True
    return out


@st.composite
def ppo_loss_cases(draw):
    shape = draw(st.sampled_from(((3, 4), (2, 5), (1, 1), (0, 3), (3, 0), (7,), (2, 2, 2))))
    args, counted = draw(ppo_args(shape))
    hyper = draw(ppo_hyper())
    names = ("loss", "policy_loss", "value_loss", "ratios_mean", "clipfrac")

    def call(x, backend):
        out = fused_rl.ppo_loss(
            *(x[n] for n in PPO_TENSORS), x["padding_masks"], x["value_padding_masks"],
            backend=backend, **hyper,
        )  # fmt: skip
        return dict(zip(names, out))

    return Case(
        "ppo_loss", call, args, hyper, grad=("pi_logprobs", "phi_values"), counted=counted,
        nan_rule=lambda x: _ppo_rule(x, counted, hyper, names), invariant_skip=("ratios_mean",),
        upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@fuzz(30)
@given(ppo_loss_cases())
def test_ppo_loss(case):
    check_case(case)


POSITIVE_SPECIALS = (INF, 1e30, 1e-30)


@st.composite
def gaussian_cases(draw, op):
    shape = draw(st.sampled_from(((3, 4), (5, 1), (1, 3), (0, 2), (2, 3, 2), (4,))))

    def broadcast_shape():  # a full, trailing or size-1 broadcastable shape
        options = [shape, shape[-1:], (*[1] * (len(shape) - 1), shape[-1])]
        return draw(st.sampled_from(options))

    sigma = draw(
        float_args(broadcast_shape(), draw(dtypes), kind="positive", specials=POSITIVE_SPECIALS)
    )
    if op == "gaussian_entropy":
        return Case(
            "gaussian_entropy", lambda x, b: fused_rl.gaussian_entropy(x["sigma"], backend=b),
            {"sigma": sigma}, grad=("sigma",), upstream_seed=draw(upstream_seeds),
        )  # fmt: skip
    mu = draw(float_args(broadcast_shape(), draw(dtypes)))
    actions = draw(float_args(broadcast_shape(), draw(dtypes)))
    grad = ("mu", "sigma", "actions") if draw(st.booleans()) else ("mu", "sigma")

    def call(x, backend):
        return fused_rl.gaussian_logprob(x["mu"], x["sigma"], x["actions"], backend=backend)

    def rule(x):
        full = torch.broadcast_shapes(x["mu"].shape, x["sigma"].shape, x["actions"].shape)
        bad = (torch.isnan(x["mu"]).expand(full) | torch.isnan(x["actions"]).expand(full)).any(-1)
        return {"out": bad} if bad.any() else {}

    return Case(
        "gaussian_logprob", call, {"mu": mu, "sigma": sigma, "actions": actions}, grad=grad,
        nan_rule=rule, upstream_seed=draw(upstream_seeds),
    )  # fmt: skip


@pytest.mark.parametrize("op", ("gaussian_logprob", "gaussian_entropy"))
@fuzz(15)
@given(data=st.data())
def test_gaussian(op, data):
    check_case(data.draw(gaussian_cases(op)))


# ----------------------------------------------------------------------------- compat adapters
# The adapters have no backend argument: they call the ops with backend="auto", which
# ``run_backend`` points at each backend in turn (``_auto_resolves_to``).


def _adapter_precision(case: Case) -> torch.dtype:
    """Adapters round to their inputs' dtypes (and report Python floats computed in fp32)."""
    return _precision(torch.float32, *(a.dtype for a in case.float_args().values()))


def _row_rule(name):
    """``name`` is NaN wherever its logits row is poisoned."""

    def rule(x):
        bad = row_poisoned(x["logits"])
        return {name: bad} if bad.any() else {}

    return rule


@st.composite
def trl_cases(draw, op):
    dtype, vocab = draw(dtypes), draw(st.sampled_from(VOCAB_SIZES))
    lead = tuple(draw(st.integers(0, 3)) for _ in range(draw(st.sampled_from((1, 2, 2)))))
    logits = draw(logits_args((*lead, vocab), dtype))
    seed = draw(upstream_seeds)
    if op == "entropy_from_logits":
        return Case(
            "trl.entropy_from_logits", lambda x, b: trl.entropy_from_logits(x["logits"]),
            {"logits": logits}, grad=("logits",), nan_rule=_row_rule("out"), upstream_seed=seed,
        )  # fmt: skip
    top_k = draw(st.sampled_from((None, None, 1, 3)))
    index = draw(target_args(lead if top_k is None else (*lead, top_k), vocab, None))

    def rule(x):
        bad = row_poisoned(x["logits"])
        bad = bad if top_k is None else bad[..., None].expand(*lead, top_k)
        return {"out": bad} if bad.any() else {}

    def call(x, backend):
        return trl.selective_log_softmax(x["logits"], x["index"])

    return Case(
        "trl.selective_log_softmax", call, {"logits": logits, "index": index}, {"top_k": top_k},
        grad=("logits",), nan_rule=rule, upstream_seed=seed,
    )  # fmt: skip


@pytest.mark.parametrize("op", ("selective_log_softmax", "entropy_from_logits"))
@fuzz(10)
@given(data=st.data())
def test_compat_trl(op, data):
    case = data.draw(trl_cases(op))
    check_case(case, _adapter_precision(case))


VERL_KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@st.composite
def verl_cases(draw, op):
    dtype, seed = draw(dtypes), draw(upstream_seeds)
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = (batch, length)
    if op in ("logprobs_from_logits", "entropy_from_logits", "compute_entropy_loss"):
        vocab = draw(st.sampled_from(VOCAB_SIZES))
        logits = draw(logits_args((batch, length, vocab), dtype))
        if op == "logprobs_from_logits":
            labels = draw(target_args(shape, vocab, None))
            return Case(
                "verl.logprobs_from_logits",
                lambda x, b: verl.logprobs_from_logits(x["logits"], x["labels"]),
                {"logits": logits, "labels": labels}, grad=("logits",),
                nan_rule=_row_rule("out"), upstream_seed=seed,
            )  # fmt: skip
        if op == "entropy_from_logits":
            return Case(
                "verl.entropy_from_logits", lambda x, b: verl.entropy_from_logits(x["logits"]),
                {"logits": logits}, grad=("logits",), nan_rule=_row_rule("out"),
                upstream_seed=seed,
            )  # fmt: skip
        mask = draw(mask_args(shape, kinds=("int", "float"), patterns=("random", "all_true")))
        mode = draw(st.sampled_from(verl.LOSS_AGG_MODES))
        counted = mask.value() != 0

        def entropy_rule(x):
            return {"out": True} if (row_poisoned(x["logits"]) & counted).any() else {}

        return Case(
            "verl.compute_entropy_loss",
            lambda x, b: verl.compute_entropy_loss(x["logits"], x["mask"], mode),
            {"logits": logits, "mask": mask}, {"loss_agg_mode": mode}, grad=("logits",),
            nan_rule=entropy_rule, upstream_seed=seed,
        )  # fmt: skip
    if op == "compute_forward_kl_topk":  # verl 0.9.1's top-k distillation
        vocab, k = draw(st.sampled_from(VOCAB_SIZES)), draw(st.sampled_from((1, 3, 8)))
        assume(k <= vocab)  # more ids than the vocabulary: ValueError (test_compat_verl_...)
        logits = draw(logits_args((batch, length, vocab), dtype))
        ids = draw(target_args((batch, length, k), vocab, None))
        lt = draw(float_args((batch, length, k), draw(dtypes), kind="logprob",
                             specials=(NAN, -1e30, 0.0)))  # fmt: skip
        clamp = draw(st.sampled_from((-10.0, -2.0, None)))
        config = {"distillation_loss": {"log_prob_min_clamp": clamp}}

        def topk(x, b):  # the overlap diagnostics (a top-K ranking) left out: ties
            out = verl.compute_forward_kl_topk(x["logits"], x["lt"], x["ids"], config)
            return out["distillation_losses"], out["student_mass"], out["teacher_mass"]

        def topk_rule(x):
            poisoned, teacher_nan = row_poisoned(x["logits"]), torch.isnan(x["lt"]).any(-1)
            rule = {"0": poisoned | teacher_nan, "1": poisoned, "2": teacher_nan}
            return {name: bad for name, bad in rule.items() if bad.any()}

        return Case(
            "verl.compute_forward_kl_topk", topk, {"logits": logits, "lt": lt, "ids": ids},
            {"log_prob_min_clamp": clamp}, grad=("logits",), nan_rule=topk_rule,
            upstream_seed=seed,
        )  # fmt: skip
    if op == "kl_penalty":
        name = draw(st.sampled_from(VERL_KL_NAMES))
        lp = draw(float_args(shape, dtype, kind="logprob"))
        ref = draw(float_args(shape, draw(dtypes), kind="logprob"))
        return Case(
            "verl.kl_penalty", lambda x, b: verl.kl_penalty(x["lp"], x["ref"], name),
            {"lp": lp, "ref": ref}, {"kl_penalty": name}, grad=("lp", "ref"),
            nan_rule=lambda x: {"out": torch.isnan(x["lp"]) | torch.isnan(x["ref"])},
            upstream_seed=seed,
        )  # fmt: skip
    mask = draw(mask_args(shape, kinds=("int", "float", "bool"), patterns=("random", "all_true")))
    valid = mask.value() != 0
    if op == "compute_gae_advantage_return":
        assume(int(valid.sum()) >= 2)  # verl's masked_var raises below 2 tokens
        gamma, lam = draw(st.sampled_from(GAMMAS)), draw(st.sampled_from(GAMMAS))
        rewards, values = (draw(float_args(shape, dtype)) for _ in range(2))

        def gae_rule(x):
            """Every advantage is whitened by the masked mean: one NaN anywhere valid makes
            them all NaN."""
            bad = (torch.isnan(x["rewards"]) | torch.isnan(x["values"])) & valid
            return {"0": True} if bad.any() else {}

        return Case(
            "verl.compute_gae_advantage_return",
            lambda x, b: verl.compute_gae_advantage_return(
                x["rewards"], x["values"], x["mask"], gamma, lam
            ),
            {"rewards": rewards, "values": values, "mask": mask}, {"gamma": gamma, "lam": lam},
            nan_rule=gae_rule, linear=True,
        )  # fmt: skip
    # the pure-PyTorch ones: no backend inside, run for the mutation and NaN checks
    mode = draw(st.sampled_from(verl.LOSS_AGG_MODES))
    a, b_, c = (draw(float_args(shape, dtype)) for _ in range(3))
    if op == "compute_policy_loss":
        lp_old = draw(float_args(shape, dtype, kind="logprob", specials=OLD_LOGPROB_SPECIALS))
        lp = draw(float_args(shape, dtype, kind="logprob", specials=NEW_LOGPROB_SPECIALS))
        cliprange = draw(st.sampled_from((0.2, 0.0, 1.0)))

        def fn(x, b):
            with warnings.catch_warnings():  # verl's own deprecation, mirrored on purpose
                warnings.filterwarnings("ignore", "Warning: Function .*", FutureWarning)
                return verl.compute_policy_loss(
                    x["old"], x["lp"], x["adv"], x["mask"], cliprange=cliprange,
                    loss_agg_mode=mode,
                )  # fmt: skip

        args, grad = {"old": lp_old, "lp": lp, "adv": a, "mask": mask}, ("lp",)
    elif op == "compute_value_loss":
        clip = draw(st.sampled_from((0.5, 0.0, 1e30)))
        fn = lambda x, b: verl.compute_value_loss(
            x["v"], x["ret"], x["old"], x["mask"], clip, loss_agg_mode=mode
        )
        args, grad = {"v": a, "ret": b_, "old": c, "mask": mask}, ("v",)
    elif op == "agg_loss":
        fn = lambda x, b: verl.agg_loss(x["loss"], x["mask"], mode)
        args, grad = {"loss": a, "mask": mask}, ("loss",)
    elif op == "masked_whiten":
        assume(int(valid.sum()) >= 2)
        fn = lambda x, b: verl.masked_whiten(x["x"], x["mask"])
        args, grad = {"x": a, "mask": mask}, ("x",)
    else:
        ids = draw(st.lists(st.sampled_from("abc"), min_size=batch, max_size=batch))
        fn = lambda x, b: verl.compute_grpo_outcome_advantage(x["r"], x["mask"], ids)
        args, grad = {"r": a, "mask": mask}, ()
    return Case(f"verl.{op}", fn, args, {"loss_agg_mode": mode}, grad=grad, upstream_seed=seed)


VERL_OPS = (
    "logprobs_from_logits", "entropy_from_logits", "compute_entropy_loss", "kl_penalty",
    "compute_forward_kl_topk",
    "compute_gae_advantage_return", "compute_policy_loss", "compute_value_loss", "agg_loss",
    "masked_whiten", "compute_grpo_outcome_advantage",
)  # fmt: skip
FUSED_VERL_OPS = VERL_OPS[:6]  # those that call fused_rl; the rest are pure PyTorch


@pytest.mark.parametrize("op", FUSED_VERL_OPS)
@fuzz(8)
@given(data=st.data())
def test_compat_verl(op, data):
    case = data.draw(verl_cases(op))
    check_case(case, _adapter_precision(case))


@pytest.mark.parametrize("op", VERL_OPS[len(FUSED_VERL_OPS) :])
@fuzz(4)
@given(data=st.data())
def test_compat_verl_pure(op, data):
    case = data.draw(verl_cases(op))
    check_case(case, _adapter_precision(case))


@st.composite
def torchtune_cases(draw, op):
    dtype, seed = draw(dtypes), draw(upstream_seeds)
    shape = draw(st.sampled_from(((2, 3), (1, 1), (3, 4), (2, 5))))
    if op == "PPOLoss":  # torchtune's masks are bool (no weights)
        args, counted = draw(ppo_args(shape, mask_kinds=("none", "bool", "int", "float")))
        hyper = draw(ppo_hyper())
        names = ("loss", "policy_loss", "value_loss", "ratios_mean", "clipfrac")
        module = tt.PPOLoss(**hyper)

        def call(x, backend):
            out = module(*(x[n] for n in PPO_TENSORS), x["padding_masks"], x["value_padding_masks"])
            return dict(zip(names, out))

        return Case(
            "torchtune.PPOLoss", call, args, hyper, grad=("pi_logprobs", "phi_values"),
            counted=counted, nan_rule=lambda x: _ppo_rule(x, counted, hyper, names),
            invariant_skip=("ratios_mean",), upstream_seed=seed,
        )  # fmt: skip
    if op in ("logits_to_logprobs", "batched_logits_to_logprobs"):
        vocab = draw(st.sampled_from(VOCAB_SIZES))
        logits = draw(logits_args((*shape, vocab), dtype))
        sequences = draw(target_args(shape, vocab, None))
        temperature = draw(st.sampled_from(TEMPERATURES))
        fn = getattr(tt, op)
        return Case(
            f"torchtune.{op}",
            lambda x, b: fn(x["logits"], x["sequences"], temperature=temperature),
            {"logits": logits, "sequences": sequences}, {"temperature": temperature},
            grad=("logits",), nan_rule=_row_rule("out"), upstream_seed=seed,
        )  # fmt: skip
    masks = draw(mask_args(shape, kinds=("none", "bool"), patterns=("random", "all_true")))
    values, rewards = (draw(float_args(shape, dtype)) for _ in range(2))
    if op == "estimate_advantages":
        gamma, lam = draw(st.sampled_from(GAMMAS)), draw(st.sampled_from(GAMMAS))
        valid = _nonzero(masks, shape)

        def rule(x):
            """GAE ignores the mask (NaN at t reaches A_s, s <= t when gamma * lam > 0, and
            A_{t-1} through a NaN value when gamma > 0); whitening spreads a NaN advantage at
            a valid step to every valid step."""
            r_nan, v_nan = torch.isnan(x["rewards"]), torch.isnan(x["values"])
            bad = r_nan | v_nan
            if gamma > 0:
                bad = bad | torch.nn.functional.pad(v_nan[:, 1:], (0, 1))
            if gamma * lam > 0:
                bad = bad.flip(1).cummax(1).values.flip(1)
            return {"0": valid} if (bad & valid).any() else {}

        return Case(
            "torchtune.estimate_advantages",
            lambda x, b: tt.estimate_advantages(x["values"], x["rewards"], gamma, lam, x["masks"]),
            {"values": values, "rewards": rewards, "masks": masks}, {"gamma": gamma, "lmbda": lam},
            grad=("values",), nan_rule=rule, linear=True, upstream_seed=seed,
        )  # fmt: skip
    # pure PyTorch mirrors: mutation / determinism only
    bool_mask = masks if masks is not None else draw(mask_args(shape, kinds=("bool",)))
    if op == "whiten":
        fn = lambda x, b: tt.whiten(x["values"], x["masks"])
    elif op == "masked_mean":
        fn = lambda x, b: tt.masked_mean(x["values"], x["bool_mask"])
    elif op == "masked_var":
        fn = lambda x, b: tt.masked_var(x["values"], x["bool_mask"])
    else:
        fn = lambda x, b: tt.get_rewards_ppo(x["rewards"][:, 0], x["values"], x["rewards"], 0.1)
    return Case(
        f"torchtune.{op}", fn,
        {"values": values, "rewards": rewards, "masks": masks, "bool_mask": bool_mask},
        grad=("values",), upstream_seed=seed,
    )  # fmt: skip


TORCHTUNE_OPS = (
    "PPOLoss", "estimate_advantages", "logits_to_logprobs", "batched_logits_to_logprobs",
    "whiten", "masked_mean", "masked_var", "get_rewards_ppo",
)  # fmt: skip


@pytest.mark.parametrize("op", TORCHTUNE_OPS[:4])
@fuzz(8)
@given(data=st.data())
def test_compat_torchtune(op, data):
    case = data.draw(torchtune_cases(op))
    check_case(case, _adapter_precision(case))


@pytest.mark.parametrize("op", TORCHTUNE_OPS[4:])
@fuzz(4)
@given(data=st.data())
def test_compat_torchtune_pure(op, data):
    case = data.draw(torchtune_cases(op))
    check_case(case, _adapter_precision(case))


@st.composite
def ding_discrete_args(draw, dtype, with_pretrained: bool):
    """``(logit_new, logit_old, action, adv, weight[, logit_pretrained])`` of DI-engine's
    discrete PPO: ``(B, V)`` logits with ``(B,)`` actions or ``(B, S, V)`` with ``(B, S)``."""
    vocab = draw(st.sampled_from(VOCAB_SIZES))
    lead = draw(st.sampled_from(((3,), (1,), (2, 3), (3, 2))))
    args = {
        "logit_new": draw(logits_args((*lead, vocab), dtype)),
        "logit_old": draw(logits_args((*lead, vocab), draw(dtypes))),
        "action": draw(target_args(lead, vocab, None)),
        "adv": draw(float_args(lead, draw(dtypes))),
        "weight": draw(mask_args(lead, kinds=("none", "float", "weights"))),
        "logit_pretrained": None,
    }
    if with_pretrained:
        args["logit_pretrained"] = draw(logits_args((*lead, vocab), draw(dtypes)))
    return args


def _ding_policy_rule(x, value=False):
    """DI-engine weighs by ``(x * weight).mean()``: a NaN anywhere is NaN, even at weight 0."""
    lp_bad = row_poisoned(x["logit_new"]) | row_poisoned(x["logit_old"])
    out = {}
    if (lp_bad | torch.isnan(x["adv"])).any():
        out["0.policy_loss"] = True
    if lp_bad.any():
        out["1.approx_kl"] = True
    if row_poisoned(x["logit_new"]).any():
        out["0.entropy_loss"] = True
    if x.get("logit_pretrained") is not None:
        if (row_poisoned(x["logit_new"]) | row_poisoned(x["logit_pretrained"])).any():
            out["0.kl_div"] = True
    if value and any(torch.isnan(x[n]).any() for n in ("value_new", "return_")):
        out["0.value_loss"] = True
    return out


@st.composite
def ding_cases(draw, op):
    dtype, seed = draw(dtypes), draw(upstream_seeds)
    clip_ratio = draw(st.sampled_from((0.2, 0.0, 1.0)))
    dual_clip = draw(st.sampled_from((None, 3.0, 1.0 + 1e-6)))
    kl_type = draw(st.sampled_from(ding.KL_TYPES))
    hyper = {"clip_ratio": clip_ratio, "dual_clip": dual_clip, "kl_type": kl_type}
    if op in ("ppo_policy_error", "ppo_error"):
        args = draw(ding_discrete_args(dtype, draw(st.booleans())))
        if op == "ppo_policy_error":
            entropy_bonus = draw(st.booleans())
            hyper["entropy_bonus"] = entropy_bonus

            def call(x, backend):
                data = ding.ppo_policy_data(*(x[n] for n in ding.ppo_policy_data._fields))
                return ding.ppo_policy_error(data, **hyper)

            def rule(x):
                out = _ding_policy_rule(x)
                return (
                    out if entropy_bonus else {k: v for k, v in out.items() if "entropy" not in k}
                )

        else:
            shape = args["adv"].shape
            args["value_new"] = draw(float_args(shape, draw(dtypes)))
            args["value_old"] = draw(float_args(shape, draw(dtypes)))
            args["return_"] = draw(float_args(shape, draw(dtypes)))
            hyper["use_value_clip"] = draw(st.booleans())

            def call(x, backend):
                data = ding.ppo_data(*(x[n] for n in ding.ppo_data._fields))
                return ding.ppo_error(data, **hyper)

            rule = lambda x: _ding_policy_rule(x, value=True)

        return Case(
            f"ding.{op}", call, args, hyper, grad=("logit_new", "value_new"), nan_rule=rule,
            upstream_seed=seed,
        )  # fmt: skip
    if op == "grpo_policy_error":
        vocab = draw(st.sampled_from(VOCAB_SIZES))
        batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 4))
        args = {
            "logit_new": draw(logits_args((batch, length, vocab), dtype)),
            "logit_old": draw(logits_args((batch, length, vocab), draw(dtypes))),
            "logit_ref": draw(logits_args((batch, length, vocab), draw(dtypes))),
            "action": draw(target_args((batch, length), vocab, None)),
            "adv": draw(float_args((batch,), draw(dtypes))),
            "weight": draw(mask_args((batch, length), kinds=("none", "float", "weights"))),
        }
        beta = draw(st.sampled_from((0.1, 0.0, 1e3)))
        grpo_hyper = {"clip_ratio": clip_ratio, "beta": beta}

        def call(x, backend):
            data = ding.grpo_policy_data(*(x[n] for n in ding.grpo_policy_data._fields))
            return ding.grpo_policy_error(data, **grpo_hyper)

        def grpo_rule(x):
            bad = row_poisoned(x["logit_new"]) | row_poisoned(x["logit_old"])
            loss_bad = bad.any() or torch.isnan(x["adv"]).any()
            if beta != 0:
                loss_bad = loss_bad or row_poisoned(x["logit_ref"]).any()
            return {"0": True} if loss_bad else {}

        return Case(
            "ding.grpo_policy_error", call, args, grpo_hyper, grad=("logit_new",),
            nan_rule=grpo_rule, upstream_seed=seed,
        )  # fmt: skip
    # continuous: Independent(Normal) policies
    batch, n_act = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    pos = {"kind": "positive", "specials": POSITIVE_SPECIALS}
    args = {
        "mu_new": draw(float_args((batch, n_act), dtype)),
        "sigma_new": draw(float_args((batch, n_act), dtype, **pos)),
        "mu_old": draw(float_args((batch, n_act), draw(dtypes))),
        "sigma_old": draw(float_args((batch, n_act), draw(dtypes), **pos)),
        "action": draw(float_args((batch, n_act), draw(dtypes))),
        "adv": draw(float_args((batch,), draw(dtypes))),
        "weight": draw(mask_args((batch,), kinds=("none", "float", "weights"))),
    }
    if draw(st.booleans()):  # logit_pretrained: a reference policy for kl_div
        args["mu_pre"] = draw(float_args((batch, n_act), draw(dtypes)))
        args["sigma_pre"] = draw(float_args((batch, n_act), draw(dtypes), **pos))
    hyper["fix_dual_clip"] = draw(st.booleans())
    value = op == "ppo_error_continuous"
    if value:
        for name in ("value_new", "value_old", "return_"):
            args[name] = draw(float_args((batch,), draw(dtypes)))
        hyper["use_value_clip"] = draw(st.booleans())

    def call(x, backend):
        new = {"mu": x["mu_new"], "sigma": x["sigma_new"]}
        old = {"mu": x["mu_old"], "sigma": x["sigma_old"]}
        pre = {"mu": x["mu_pre"], "sigma": x["sigma_pre"]} if "mu_pre" in x else None
        if value:
            data = ding.ppo_data_continuous(
                new, old, x["action"], x["value_new"], x["value_old"], x["adv"], x["return_"],
                x["weight"], pre,
            )  # fmt: skip
            return ding.ppo_error_continuous(data, **hyper)
        data = ding.ppo_policy_data_continuous(new, old, x["action"], x["adv"], x["weight"], pre)
        return ding.ppo_policy_error_continuous(data, **hyper)

    def cont_rule(x):
        bad = any(torch.isnan(x[n]).any() for n in ("mu_new", "mu_old", "action", "adv"))
        out = {"0.policy_loss": True} if bad else {}
        if value and any(torch.isnan(x[n]).any() for n in ("value_new", "return_")):
            out["0.value_loss"] = True
        return out

    return Case(
        f"ding.{op}", call, args, hyper, grad=("mu_new", "sigma_new"), nan_rule=cont_rule,
        upstream_seed=seed,
    )  # fmt: skip


DING_OPS = (
    "ppo_policy_error", "ppo_error", "grpo_policy_error", "ppo_policy_error_continuous",
    "ppo_error_continuous",
)  # fmt: skip


@pytest.mark.parametrize("op", DING_OPS)
@fuzz(8)
@given(data=st.data())
def test_compat_ding(op, data):
    case = data.draw(ding_cases(op))
    check_case(case, _adapter_precision(case))


# ----------------------------------------------------------------------------- bad inputs
# Each spec: ``valid(B, T, V, dtype, gen)`` -> keyword arguments that work, and the arguments
# by what they are. A bad case replaces one argument and expects ValueError / TypeError whose
# message names that argument, on every backend (validation runs before dispatch).


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _logprobs(gen, *shape, dtype=torch.float32):
    return (-_randn(gen, *shape).abs() - 0.1).to(dtype)


def _ids(gen, vocab, *shape):
    return torch.randint(0, vocab, shape, generator=gen)


def _spec(call, valid, *, floats=(), shaped=(), masks=(), weights=True, indices=None, **hyper):
    """``floats``: float tensor arguments; ``shaped``: those whose wrong shape is reported under
    their own name; ``masks``: mask arguments, per-token weights unless ``weights=False``
    (indicator masks: nonzero counts) so a negative value is a ``ValueError`` (eager, value
    checks on); ``indices``: ``{name: range}`` index tensors (range ``"V"`` or ``"T"``; None:
    only compared with ``ignore_index``, never read as an index, so any value is valid);
    ``hyper``: ``{name: kind}`` of the scalar arguments."""
    return {
        "call": call, "valid": valid, "floats": floats, "shaped": shaped, "masks": masks,
        "indices": indices or {}, "hyper": hyper, "weights": weights,
    }  # fmt: skip


def _op(name):
    return lambda backend, **kw: getattr(fused_rl, name)(**kw, backend=backend)


def _adapter(fn):
    def call(backend, **kw):
        with _auto_resolves_to(backend):
            return fn(**kw)

    return call


def _policy_valid(b, t, v, dt, g):
    return dict(
        logits=_randn(g, b, t, v, dtype=dt), targets=_ids(g, v, b, t),
        advantages=_randn(g, b), old_logprobs=_logprobs(g, b, t), ref_logprobs=_logprobs(g, b, t),
        mask=torch.rand(b, t, generator=g) > 0.3,
    )  # fmt: skip


def _from_logprobs_valid(b, t, v, dt, g):
    return dict(
        logprobs=_logprobs(g, b, t, dtype=dt), advantages=_randn(g, b, t),
        old_logprobs=_logprobs(g, b, t), ref_logprobs=_logprobs(g, b, t),
        mask=torch.rand(b, t, generator=g), entropy=_randn(g, b, t).abs(),
    )  # fmt: skip


def _ppo_valid(b, t, v, dt, g):
    out = {n: _randn(g, b, t, dtype=dt) for n in PPO_TENSORS}
    out["padding_masks"] = torch.rand(b, t, generator=g) > 0.3
    out["value_padding_masks"] = torch.rand(b, t, generator=g)
    return out


POLICY_HYPER = dict(
    temperature="positive", eps_low="nonneg", eps_high="nonneg", dual_clip="above_one",
    delta="above_one", beta="number", kl_estimator="choice", entropy_coef="number",
    importance_sampling="choice", loss_agg="choice", max_length="count", num_items="positive",
)  # fmt: skip
TOKEN = ("advantages", "old_logprobs", "ref_logprobs")


def _logits_targets_spec(name: str):
    """An op of ``(logits, targets)`` and a temperature (``token_logprobs``, ``token_stats``)."""
    return _spec(
        _op(name),
        lambda b, t, v, dt, g: dict(logits=_randn(g, b, t, v, dtype=dt), targets=_ids(g, v, b, t)),
        floats=("logits",),
        indices={"targets": "V"},
        temperature="positive",
    )


BAD_SPECS = {
    "token_logprobs": _logits_targets_spec("token_logprobs"),
    "token_stats": _logits_targets_spec("token_stats"),
    "token_entropy": _spec(
        _op("token_entropy"),
        lambda b, t, v, dt, g: dict(logits=_randn(g, b, t, v, dtype=dt)),
        floats=("logits",),
        temperature="positive",
    ),
    "policy_loss": _spec(
        _op("policy_loss"),
        _policy_valid,
        floats=("logits", *TOKEN),
        shaped=TOKEN,
        masks=("mask",),
        indices={"targets": "V"},
        **POLICY_HYPER,
    ),
    "policy_loss_from_logprobs": _spec(
        _op("policy_loss_from_logprobs"),
        _from_logprobs_valid,
        floats=("logprobs", *TOKEN, "entropy"),
        shaped=(*TOKEN, "entropy"),
        masks=("mask",),
        **{k: v for k, v in POLICY_HYPER.items() if k != "temperature"},
    ),
    "kl_estimate": _spec(
        _op("kl_estimate"),
        lambda b, t, v, dt, g: dict(
            logprobs=_logprobs(g, b, t, dtype=dt), ref_logprobs=_logprobs(g, b, t)
        ),
        floats=("logprobs", "ref_logprobs"),
        shaped=("ref_logprobs",),
        kl_estimator="choice",
    ),
    **{
        op: _spec(
            _op(op),
            lambda b, t, v, dt, g: dict(
                x=_randn(g, b, t, dtype=dt), mask=torch.rand(b, t, generator=g)
            ),
            floats=("x",),
            masks=("mask",),
            **({"eps": "nonneg"} if op == "masked_whiten" else {}),
            **({"dim": "dim"} if op in ("masked_sum", "masked_mean") else {}),
        )
        for op in REDUCTIONS
    },
    "distill_loss": _spec(
        _op("distill_loss"),
        lambda b, t, v, dt, g: dict(
            logits=_randn(g, b, t, v, dtype=dt),
            teacher_logits=_randn(g, b, t, v),
            mask=torch.rand(b, t, generator=g),
            targets=_ids(g, v, b, t),
        ),
        floats=("logits", "teacher_logits"),
        shaped=("teacher_logits",),
        masks=("mask",),
        indices={"targets": None},
        beta="unit",
        temperature="positive",
        ignore_index="integer",
        loss_agg="choice",
        max_length="count",
        num_items="positive",
    ),
    "token_kl": _spec(
        _op("token_kl"),
        lambda b, t, v, dt, g: dict(
            logits=_randn(g, b, t, v, dtype=dt),
            ref_logits=_randn(g, b, t, v),
            mask=torch.rand(b, t, generator=g) > 0.3,
        ),
        floats=("logits", "ref_logits"),
        shaped=("ref_logits",),
        masks=("mask",),
        weights=False,
        temperature="positive",
    ),
    "gae": _spec(
        _op("gae"),
        lambda b, t, v, dt, g: dict(
            rewards=_randn(g, b, t, dtype=dt),
            values=_randn(g, b, t),
            gamma=0.99,
            lam=0.95,
            mask=torch.rand(b, t, generator=g) > 0.3,
        ),
        floats=("rewards", "values"),
        shaped=("values",),
        masks=("mask",),
        weights=False,
        gamma="unit",
        lam="unit",
    ),
    "kl_penalized_rewards": _spec(
        _op("kl_penalized_rewards"),
        lambda b, t, v, dt, g: dict(
            scores=_randn(g, b),
            logprobs=_logprobs(g, b, t, dtype=dt),
            ref_logprobs=_logprobs(g, b, t),
            kl_coef=0.1,
            mask=torch.rand(b, t, generator=g) > 0.3,
            score_index=_ids(g, t, b),
        ),
        floats=("scores", "logprobs", "ref_logprobs"),
        shaped=("scores", "ref_logprobs"),
        masks=("mask",),
        weights=False,
        indices={"score_index": "T"},
        kl_coef="nonneg",
        kl_estimator="choice",
    ),
    "group_advantages": _spec(
        _op("group_advantages"),
        lambda b, t, v, dt, g: dict(scores=_randn(g, b * t, dtype=dt), group_size=t),
        floats=("scores",),
        group_size="group_size",
        normalize="choice",
        eps="nonneg",
    ),
    "rloo_advantages": _spec(
        _op("rloo_advantages"),
        lambda b, t, v, dt, g: dict(scores=_randn(g, b * t, dtype=dt), group_size=t),
        floats=("scores",),
        group_size="group_size",
    ),
    "value_loss": _spec(
        _op("value_loss"),
        lambda b, t, v, dt, g: dict(
            values=_randn(g, b, t, dtype=dt),
            old_values=_randn(g, b, t),
            returns=_randn(g, b, t),
            mask=torch.rand(b, t, generator=g),
        ),
        floats=("values", "old_values", "returns"),
        shaped=("old_values", "returns"),
        masks=("mask",),
        clip="nonneg",
        loss_agg="choice",
        max_length="count",
        num_items="positive",
    ),
    "ppo_loss": _spec(
        _op("ppo_loss"),
        _ppo_valid,
        floats=PPO_TENSORS,
        shaped=tuple(n for n in PPO_TENSORS if n != "pi_logprobs"),
        masks=("padding_masks", "value_padding_masks"),
        epsilon="nonneg",
        value_clip_range="nonneg",
        value_coeff="nonneg",
    ),
    "gaussian_logprob": _spec(
        _op("gaussian_logprob"),
        lambda b, t, v, dt, g: dict(
            mu=_randn(g, b, t, dtype=dt), sigma=_randn(g, b, t).exp(), actions=_randn(g, b, t)
        ),
        floats=("mu", "sigma", "actions"),
        sigma_values="sigma",
    ),
    "gaussian_entropy": _spec(
        _op("gaussian_entropy"),
        lambda b, t, v, dt, g: dict(sigma=_randn(g, b, t, dtype=dt).exp()),
        floats=("sigma",),
        sigma_values="sigma",
    ),
    "trl.selective_log_softmax": _spec(
        _adapter(trl.selective_log_softmax),
        lambda b, t, v, dt, g: dict(logits=_randn(g, b, t, v, dtype=dt), index=_ids(g, v, b, t)),
        floats=("logits",),
        indices={"index": "V"},
    ),
    "verl.logprobs_from_logits": _spec(
        _adapter(verl.logprobs_from_logits),
        lambda b, t, v, dt, g: dict(logits=_randn(g, b, t, v, dtype=dt), labels=_ids(g, v, b, t)),
        floats=("logits",),
        indices={"labels": "V"},
    ),
    "torchtune.logits_to_logprobs": _spec(
        _adapter(tt.logits_to_logprobs),
        lambda b, t, v, dt, g: dict(
            logits=_randn(g, b, t, v, dtype=dt), sequences=_ids(g, v, b, t)
        ),
        floats=("logits",),
        indices={"sequences": "V"},
        temperature="positive",
    ),
}

CHOICES = {
    "kl_estimator": KL_KINDS, "importance_sampling": ("token", "sequence"),
    "loss_agg": LOSS_AGGS, "normalize": ("std", "none"),
}  # fmt: skip
# bad scalar values by kind: (value, exception)
BAD_SCALARS = {
    "positive": ((0.0, ValueError), (-1.0, ValueError), (NAN, ValueError), (INF, ValueError),
                 (True, TypeError), ("1", TypeError)),
    "nonneg": ((-1e-3, ValueError), (NAN, ValueError), (INF, ValueError), (True, TypeError),
               (torch.tensor(0.1), TypeError)),
    "number": ((NAN, ValueError), (-INF, ValueError), ("0.1", TypeError), (False, TypeError)),
    "above_one": ((1.0, ValueError), (0.5, ValueError), (NAN, ValueError)),
    "unit": ((1.5, ValueError), (-0.1, ValueError), (NAN, ValueError), (True, TypeError)),
    "count": ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)),
    "group_size": ((0, ValueError), (2.0, TypeError), (True, TypeError)),
    "integer": ((1.5, TypeError), (True, TypeError), ("-100", TypeError), (None, TypeError)),
    "choice": (("bogus", ValueError), (None, ValueError)),
    "dim": ((5, ValueError), (-5, ValueError), (1.0, TypeError)),
}  # fmt: skip


@st.composite
def bad_inputs(draw):
    """``(op, argument, call, expected exception)`` with one argument made bad."""
    op = draw(st.sampled_from(sorted(BAD_SPECS)))
    spec = BAD_SPECS[op]
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(2, 4)), draw(st.sampled_from((3, 17)))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float64)))
    kwargs = spec["valid"](b, t, v, dtype, torch.Generator().manual_seed(draw(st.integers(0, 99))))
    kwargs = {k: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for k, x in kwargs.items()}
    options = []  # (argument, bad value, exception, name the message must hold)
    for name in spec["floats"]:
        x = kwargs[name]
        options += [(name, x.to(torch.int64), TypeError), (name, x.tolist(), TypeError)]
        if name in spec["shaped"]:
            options.append((name, x[..., :1].expand(*x.shape[:-1], x.shape[-1] + 1), ValueError))
    for name in spec["masks"]:
        m = kwargs[name]
        options += [(name, m.to(torch.complex64), TypeError), (name, m[..., 1:], ValueError)]
        if spec["weights"]:  # a negative weight somewhere: a float mask, or an integer one
            neg = m.float().clone()
            neg.view(-1)[draw(st.integers(0, neg.numel() - 1))] = -0.25
            if draw(st.booleans()):
                neg = neg.floor().to(torch.int64)  # -1 there
            options.append((name, neg, ValueError))
    for name, bound in spec["indices"].items():
        idx = kwargs[name]
        options += [(name, idx.float(), TypeError), (name, torch.cat([idx, idx[:1]]), ValueError)]
        if bound is None:  # compared with ignore_index only: no value is out of range
            continue
        options.append((name, torch.full_like(idx, v if bound == "V" else t), ValueError))
        if name != "targets":  # targets may hold ignore_index (-100); these have none
            options.append((name, torch.full_like(idx, -100), ValueError))
    for name, kind in spec["hyper"].items():
        if kind == "sigma":
            sigma = kwargs["sigma"].clone()
            sigma.view(-1)[0] = draw(st.sampled_from((0.0, -1.0, NAN)))  # eager value check
            options.append(("sigma", sigma, ValueError))
        elif kind == "choice":
            options += [(name, value, exc) for value, exc in BAD_SCALARS["choice"]]
        else:
            options += [(name, value, exc) for value, exc in BAD_SCALARS[kind]]
    if op == "policy_loss":  # a KL penalty needs reference log-probs
        options.append(("ref_logprobs", None, ValueError))
        kwargs["beta"] = 0.1
    if op in ("policy_loss", "policy_loss_from_logprobs"):
        shape = kwargs["advantages"].shape
        options.append(("advantages", torch.zeros(shape[0], 1, device=DEVICE), ValueError))
    if op == "policy_loss_from_logprobs":
        options.append(("entropy", None, ValueError))
        kwargs["entropy_coef"] = 0.01
    # too few dims (token ops: a (0,) row, V = 0; token_kl: was finding 15, BAD_FOUND)
    if op.startswith(("policy", "token", "trl", "verl", "torchtune")):
        first = "logits" if "logits" in kwargs else "logprobs"
        too_few_dims = _randn(None, 3 if op.startswith("policy") else 0).to(DEVICE)
        options.append((first, too_few_dims, ValueError))
    if op == "distill_loss":  # (B, T, V) or (N, V) only; the teacher gets no gradient
        options += [
            ("logits", _randn(None, v).to(DEVICE), ValueError),
            ("logits", _randn(None, 1, b, t, v).to(DEVICE), ValueError),
            ("teacher_logits", kwargs["teacher_logits"].clone().requires_grad_(), ValueError),
        ]  # fmt: skip
    name, value, exc = draw(st.sampled_from(options))
    kwargs[name] = value
    backend = draw(st.sampled_from(("auto", "triton", "reference")))
    return BadCall(op, name, value, exc, backend, kwargs)


class BadCall:
    """One call with one bad argument, and the exception it must raise."""

    def __init__(self, op, name, value, exc, backend, kwargs):
        self.op, self.name, self.value, self.exc = op, name, value, exc
        self.backend, self.kwargs = backend, kwargs

    def __call__(self):
        return BAD_SPECS[self.op]["call"](self.backend, **self.kwargs)

    def __repr__(self):
        v = self.value
        if isinstance(v, torch.Tensor):
            v = f"tensor({str(v.dtype).replace('torch.', '')}{list(v.shape)}, "
            v += f"min={self.value.real.min().item() if self.value.numel() else None})"
        elif isinstance(v, list):
            v = "a list"
        return f"{self.op}({self.name}={v}, backend={self.backend!r}) -> {self.exc.__name__}"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def check_bad_call(bad: BadCall) -> None:
    """``bad()`` raises ``bad.exc`` whose message names ``bad.name``."""
    with pytest.raises((ValueError, TypeError)) as info:
        bad()
    assert isinstance(info.value, bad.exc), f"{bad}: raised {info.value!r}"
    assert re.search(rf"\b{re.escape(bad.name)}\b", str(info.value)), (
        f"{bad}: the message does not name {bad.name}: {info.value}"
    )


@fuzz(150)
@given(bad_inputs())
def test_bad_input_names_the_argument(bad):
    event(f"bad {bad.name}")
    STATS[f"bad input: {bad.op}"]["examples"] += 1
    check_bad_call(bad)


# ----------------------------------------------------------------------------- found by fuzzing
# Minimal reproducers of what the fuzzer found, run through the same checks on every CI run
# (the derandomized sample need not hit them again).


def fixed_case(op, call, *, grad=(), nan_rule=None, upstream_seed=0, hyper=None, **tensors) -> Case:
    """A :class:`Case` of concrete contiguous tensors (``hyper``: the scalar arguments the
    checks read, such as ``num_items`` and ``loss_agg``)."""
    args = {
        k: None if v is None else Arg(v, "contiguous", tuple(v.shape)) for k, v in tensors.items()
    }
    return Case(
        op, call, args, hyper or {}, grad=grad, nan_rule=nan_rule, upstream_seed=upstream_seed
    )


def _ding_continuous(x, backend, **hyper):
    """``ding.ppo_policy_error_continuous`` on ``x``'s ``mu_new``, ``sigma_new``, ``mu_old``,
    ``sigma_old``, ``action``, ``adv`` (no weight, no pretrained policy)."""
    new = {"mu": x["mu_new"], "sigma": x["sigma_new"]}
    old = {"mu": x["mu_old"], "sigma": x["sigma_old"]}
    data = ding.ppo_policy_data_continuous(new, old, x["action"], x["adv"], None, None)
    return ding.ppo_policy_error_continuous(data, **hyper)


_BF, _F64 = torch.bfloat16, torch.float64
FOUND = {
    # 4-D logits with an empty position dim: as_rows3d's reshape(-1, 0, V) raises
    "token_entropy 4-D, S=0": lambda: fixed_case(
        "token_entropy", lambda x, b: fused_rl.token_entropy(x["logits"], backend=b),
        logits=torch.zeros(1, 3, 0, 5),
    ),
    "token_logprobs 4-D window, T=0": lambda: fixed_case(
        "token_logprobs", lambda x, b: fused_rl.token_logprobs(x["logits"], x["t"], backend=b),
        logits=torch.zeros(2, 3, 1, 5), t=torch.zeros(2, 3, 0, dtype=torch.long), grad=("logits",),
    ),
    # was: the loss fp32 on Triton, fp64 on the reference when old / ref log-probs are fp64
    "policy_loss fp64 old_logprobs": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(x["logits"], x["t"], x["adv"], old_logprobs=x["old"], backend=b)
        ),
        logits=torch.linspace(-2, 2, 30).reshape(2, 3, 5), t=torch.zeros(2, 3, dtype=torch.long),
        adv=torch.tensor([1.0, -1.0]), old=torch.full((2, 3), -1.5, dtype=_F64), grad=("logits",),
    ),
    "policy_loss_from_logprobs fp64 ref_logprobs": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(
                x["lp"], x["adv"], ref_logprobs=x["ref"], beta=0.1, backend=b
            )
        ),
        lp=torch.full((2, 3), -1.0), adv=torch.tensor([1.0, -1.0]),
        ref=torch.full((2, 3), -1.5, dtype=_F64), grad=("lp",),
    ),
    # a bf16 input next to an fp64 one (fp64 accumulation): garbage gradients on Triton
    "kl_estimate bf16 + fp64": lambda: fixed_case(
        "kl_estimate",
        lambda x, b: fused_rl.kl_estimate(x["lp"], x["ref"], kl_estimator="k2", backend=b),
        lp=torch.tensor([[-1.25, -3.0]], dtype=_BF), ref=torch.tensor([[-0.5, -0.25]], dtype=_F64),
        grad=("lp",),
    ),
    "value_loss bf16 + fp64": lambda: fixed_case(
        "value_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.value_loss(x["v"], x["old"], x["ret"], clip=None, backend=b)
        ),
        v=torch.tensor([[0.5, -1.0]], dtype=_BF), old=torch.zeros(1, 2),
        ret=torch.ones(1, 2, dtype=_F64), grad=("v",),
    ),
    "ppo_loss bf16 + fp64": lambda: fixed_case(
        "ppo_loss",
        lambda x, b: fused_rl.ppo_loss(
            x["z"], x["lp"], x["z"], x["z"], x["v"], x["ret"], backend=b
        ),
        z=torch.zeros(1, 2), lp=torch.tensor([[-0.5, -0.2]]),
        v=torch.tensor([[0.5, -1.0]], dtype=_BF), ret=torch.ones(1, 2, dtype=_F64),
        grad=("lp", "v"),
    ),
    "gaussian_logprob bf16 + fp64": lambda: fixed_case(
        "gaussian_logprob",
        lambda x, b: fused_rl.gaussian_logprob(x["mu"], x["sigma"], x["a"], backend=b),
        mu=torch.tensor([[0.5, -1.0]], dtype=_BF), sigma=torch.ones(1, 2, dtype=_F64),
        a=torch.zeros(1, 2), grad=("mu", "sigma", "a"),
    ),
    # d/d actions is -d/d mu rounded to mu's dtype (bf16): 0.35% off for fp32 actions
    "gaussian_logprob actions grad, bf16 mu": lambda: fixed_case(
        "gaussian_logprob",
        lambda x, b: fused_rl.gaussian_logprob(x["mu"], x["sigma"], x["a"], backend=b),
        mu=torch.tensor([[0.1]], dtype=_BF), sigma=torch.tensor([[0.3]]),
        a=torch.tensor([[1.2345678]]), grad=("a",),
    ),
    # squares past the fp32 range: the variance is inf on both (Triton's merge with an empty
    # partial made it NaN: inf * 0 in Chan's cross term), the whitened values 0
    "masked_var overflow": lambda: fixed_case(
        "masked_var", lambda x, b: fused_rl.masked_var(x["x"], backend=b),
        x=torch.tensor([1.0, -1e30, -1e30, 2.0]), grad=("x",),
    ),
    "masked_whiten overflow": lambda: fixed_case(
        "masked_whiten", lambda x, b: fused_rl.masked_whiten(x["x"], eps=1.0, backend=b),
        x=torch.tensor([1.0, -1e30, -1e30, 2.0]),
    ),
    # eps reaches the kernel as a bare float (fp32 when compiled): fp64 off by ~3e-9
    "masked_whiten fp64 eps": lambda: fixed_case(
        "masked_whiten",
        lambda x, b: fused_rl.masked_whiten(x["x"], x["m"], eps=1e-8, backend=b),
        x=torch.tensor([1.0, 2.0, 4.0], dtype=_F64), m=torch.zeros(3, dtype=torch.bool),
    ),
    # no token at all with seq-mean-token-sum-norm: reference raises about max_length
    "policy_loss T=0 seq-mean-token-sum-norm": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(
                x["logits"], x["t"], x["adv"], loss_agg="seq-mean-token-sum-norm", backend=b
            )
        ),
        logits=torch.zeros(2, 0, 5), t=torch.zeros(2, 0, dtype=torch.long), adv=torch.ones(2),
        grad=("logits",),
    ),
    "value_loss T=0 seq-mean-token-sum-norm": lambda: fixed_case(
        "value_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.value_loss(
                x["v"], x["v"], x["v"], loss_agg="seq-mean-token-sum-norm", backend=b
            )
        ),
        v=torch.zeros(2, 0), grad=("v",),
    ),
    # was: the reference rounded fp64 advantages to fp32 (looked like dual_clip off by 3e-8)
    "policy_loss_from_logprobs fp64 dual_clip": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(
                x["lp"], x["adv"], old_logprobs=x["old"], dual_clip=1.000001, backend=b
            )
        ),
        lp=torch.tensor([[-0.2, -1.3, -0.7, -2.0]], dtype=_F64),
        adv=torch.tensor([[-1.0, -2.0, 1.5, -0.5]], dtype=_F64),
        old=torch.tensor([[-1.9, -1.0, -0.1, -3.0]], dtype=_F64), grad=("lp",),
    ),
    # a negative mask weight raises ValueError when checked; unchecked (check_values=False,
    # torch.compile) it makes the loss NaN on both backends (issue 11.9), and the rest is the
    # documented NaN-or-clean (check_invalid_weights): the gradients' NaN differ (findings 9,
    # 10: reference 0 at the other tokens, Triton NaN everywhere) and an ignored token with a
    # negative weight counts in ratio_max (reference exp(0 - old) there, Triton NaN: target
    # -100 is outside [0, V)); tests/test_failure_modes.py pins these values
    "policy_loss_from_logprobs negative mask weight": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(
                x["lp"], x["adv"], old_logprobs=x["old"], mask=x["mask"], backend=b
            )
        ),
        lp=torch.tensor([[-0.5, -1.0, -2.0, -0.3]]), adv=torch.ones(1),
        old=torch.full((1, 4), -1.0), mask=torch.tensor([[-0.5, 1.0, 0.0, 2.0]]), grad=("lp",),
        nan_rule=lambda x: {"loss": True},
    ),
    "policy_loss negative mask weight at an ignored token": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(
                x["logits"], x["t"], x["adv"], old_logprobs=x["old"], mask=x["mask"], backend=b
            )
        ),
        logits=torch.linspace(-2, 2, 15).reshape(1, 3, 5), t=torch.tensor([[-100, 1, 2]]),
        adv=torch.ones(1), old=torch.full((1, 3), -1.5), mask=torch.tensor([[-0.5, 1.0, 1.0]]),
        grad=("logits",),
    ),
    # num_items=tensor(0) gives a NaN loss (README), but not for an empty batch: the
    # reference returns 0 (both policy losses and value_loss), Triton NaN (policy losses)
    "policy_loss_from_logprobs num_items=tensor(0), B=0": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(
                x["lp"], x["adv"], num_items=torch.tensor(0.0, device=DEVICE), backend=b
            )
        ),
        lp=torch.zeros(0, 3), adv=torch.zeros(0), grad=("lp",), nan_rule=lambda x: {"loss": True},
    ),
    # and a mode that does not read num_items: 0 on both backends, as a non-empty batch
    "policy_loss_from_logprobs num_items=tensor(0), B=0, seq-mean-token-mean": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(
                x["lp"], x["adv"], num_items=torch.tensor(0.0, device=DEVICE),
                loss_agg="seq-mean-token-mean", backend=b,
            )
        ),
        lp=torch.zeros(0, 3), adv=torch.zeros(0), grad=("lp",),
        hyper={"num_items": torch.tensor(0.0), "loss_agg": "seq-mean-token-mean"},
    ),
    # finding 13 (fixed): the finalize kernel applied a num_items tensor's "den > 0, else
    # NaN" to every mode's normaliser; seq-mean-token-sum-norm's B * T is 0 when T = 0
    "policy_loss_from_logprobs T=0 seq-mean-token-sum-norm num_items=tensor(3)": lambda: (
        fixed_case(
            "policy_loss_from_logprobs",
            lambda x, b: _policy_outputs(
                *fused_rl.policy_loss_from_logprobs(
                    x["lp"], x["adv"], num_items=torch.tensor(3.0, device=DEVICE),
                    loss_agg="seq-mean-token-sum-norm", backend=b,
                )
            ),
            lp=torch.zeros(2, 0), adv=torch.ones(2), grad=("lp",),
            hyper={"num_items": torch.tensor(3.0), "loss_agg": "seq-mean-token-sum-norm"},
        )
    ),
    "value_loss num_items=tensor(0), B=0": lambda: fixed_case(
        "value_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.value_loss(
                x["v"], x["v"], x["v"], num_items=torch.tensor(0.0, device=DEVICE), backend=b
            )
        ),
        v=torch.zeros(0, 3), grad=("v",), nan_rule=lambda x: {"loss": True},
    ),
    # was: a NaN old value gave the full unclipped gradient on the reference (torch.maximum's
    # backward) and half of it on Triton (the tie split); the kernel now follows torch
    "value_loss NaN old value": lambda: fixed_case(
        "value_loss",
        lambda x, b: _policy_outputs(*fused_rl.value_loss(x["v"], x["old"], x["ret"], backend=b)),
        v=torch.tensor([[0.5, -1.0]]), old=torch.tensor([[NAN, 0.0]]), ret=torch.ones(1, 2),
        grad=("v",), nan_rule=lambda x: {"loss": True},
    ),
    # was (finding 12): the fp32 reference differentiated (a - mu) / sigma by autograd, whose
    # (a - mu) / sigma^2 overflows at sigma = 1e-30; the ratio exp(-inf) = 0 gave the log-prob
    # a zero upstream and 0 * inf = NaN in d sigma_new, where the kernel (and fp64) give 0
    "ding.ppo_policy_error_continuous sigma_new 1e-30": lambda: fixed_case(
        "ding.ppo_policy_error_continuous", _ding_continuous,
        mu_new=torch.tensor([[0.15]]), sigma_new=torch.tensor([[1e-30]]),
        mu_old=torch.tensor([[1.5]]), sigma_old=torch.tensor([[4.7]]),
        action=torch.tensor([[1.5]]), adv=torch.tensor([1.5]), grad=("mu_new", "sigma_new"),
    ),
    # was: a broadcast input narrower than the accumulation had its gradient summed over the
    # broadcast rows in its own dtype (autograd's expand backward after the kernel's per-row
    # shares were rounded): a (1,) bf16 mu lost 14% of a sum with cancellation, and an fp32
    # sigma next to fp64 actions summed shares past the fp32 range to inf - inf = NaN
    "gaussian_logprob broadcast bf16 mu": lambda: fixed_case(
        "gaussian_logprob",
        lambda x, b: fused_rl.gaussian_logprob(x["mu"], x["sigma"], x["a"], backend=b),
        mu=torch.tensor([-2.171875], dtype=_BF), sigma=torch.tensor([0.11317846]),
        a=torch.tensor([[-0.21787894], [0.04033468], [-0.05966354]]), grad=("mu", "sigma"),
        upstream_seed=275,
    ),
    "gaussian_logprob broadcast fp32 sigma, fp64 actions": lambda: fixed_case(
        "gaussian_logprob",
        lambda x, b: fused_rl.gaussian_logprob(x["mu"], x["sigma"], x["a"], backend=b),
        mu=torch.zeros(2, 1), sigma=torch.tensor([0.5]),
        a=torch.tensor([[1e30]], dtype=_F64), grad=("mu", "sigma"),
    ),
    # was (finding 14): a counted row whose divergence is not finite gave the student's
    # gradient 0 on Triton and NaN on the reference where p == 0 (now NaN on both: such a row
    # has no finite gradient column): here a reverse KL of +inf (q_1 = 0 where the policy has
    # mass) and p_0 = 0 ...
    "token_kl +inf KL, a -inf logit": lambda: fixed_case(
        "token_kl", lambda x, b: fused_rl.token_kl(x["logits"], x["ref_logits"], backend=b),
        logits=torch.tensor([[-INF, 0.3, 1.0]]), ref_logits=torch.tensor([[0.2, -INF, 0.5]]),
        grad=("logits",), hyper={"temperature": 1.0},
    ),
    # ... and a NaN teacher logit (the JSD; the reverse KL alike, not the forward KL) with a
    # student column 200 below its row's maximum (p underflows to 0 in fp32)
    "distill_loss beta=0.5 NaN teacher, p underflows": lambda: fixed_case(
        "distill_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.distill_loss(x["logits"], x["teacher_logits"], beta=0.5, backend=b)
        ),
        logits=torch.tensor([[0.0, -200.0, 1.0]]),
        teacher_logits=torch.tensor([[0.2, NAN, 0.5]]),
        grad=("logits",), hyper={"beta": 0.5, "temperature": 1.0},
        nan_rule=lambda x: {
            "loss": True, **{f"metrics.{k}": True for k in DISTILL_METRICS[:3]},
            "metrics.teacher_entropy": True,
        },
    ),
    # was (finding 16): num_items=1e-3 reached the finalize kernel as a bare float, fp32 when
    # compiled (and under helpers.compiled_scalar_abi), so the fp64 loss and gradient were
    # 4.7e-8 off on Triton (policy_loss alike); now an fp32 (hi, lo) pair
    "distill_loss fp64 num_items=1e-3": lambda: fixed_case(
        "distill_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.distill_loss(x["logits"], x["teacher_logits"], num_items=1e-3, backend=b)
        ),
        logits=torch.tensor([[0.3, -0.2]], dtype=_F64),
        teacher_logits=torch.tensor([[1.0, -1.0]], dtype=_F64),
        grad=("logits",), hyper={"num_items": 1e-3, "loss_agg": "token-mean"},
    ),
    "policy_loss_from_logprobs fp64 num_items=1e-3": lambda: fixed_case(
        "policy_loss_from_logprobs",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss_from_logprobs(x["lp"], x["adv"], num_items=1e-3, backend=b)
        ),
        lp=torch.tensor([[-0.3, -1.2]], dtype=_F64), adv=torch.tensor([1.0], dtype=_F64),
        grad=("lp",), hyper={"num_items": 1e-3, "loss_agg": "token-mean"},
    ),
    "policy_loss fp64 num_items=1e-3": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(x["logits"], x["t"], x["adv"], num_items=1e-3, backend=b)
        ),
        logits=torch.linspace(-2, 2, 30, dtype=_F64).reshape(2, 3, 5),
        t=torch.tensor([[0, 3, 4], [1, 2, -100]]), adv=torch.tensor([1.0, -1.0], dtype=_F64),
        grad=("logits",), hyper={"num_items": 1e-3, "loss_agg": "token-mean"},
    ),
    "policy_loss grad_in_forward fp64 num_items=1e-3": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(
                x["logits"], x["t"], x["adv"], num_items=1e-3,
                grad_in_forward=b == "triton", backend=b,
            )
        ),
        logits=torch.linspace(-2, 2, 30, dtype=_F64).reshape(2, 3, 5),
        t=torch.tensor([[0, 3, 4], [1, 2, -100]]), adv=torch.tensor([1.0, -1.0], dtype=_F64),
        grad=("logits",), hyper={"num_items": 1e-3, "loss_agg": "token-mean"},
    ),
    # was (finding 17, the long profile, seed 43571926786292736001728092075518388685): a NaN
    # advantage where the ratio is past both clamps; the kernel multiplied each branch's share
    # by its clamp's 0 / 1 derivative (0 * NaN) where autograd's clamp passes exactly 0
    "policy_loss NaN advantage past both clamps": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(
                x["logits"], x["t"], x["adv"], old_logprobs=x["old"], delta=3.2, backend=b
            )
        ),
        logits=torch.linspace(-1, 1, 12).reshape(2, 2, 3), t=torch.tensor([[0, 2], [1, 1]]),
        adv=torch.tensor([[float("nan"), 1.0], [0.5, -1.0]]),
        old=torch.tensor([[-6.0, -1.0], [-0.5, -6.0]]), grad=("logits",),
        nan_rule=lambda x: {"loss": True},
    ),
    "policy_loss sequence IS, NaN advantage past both clamps": lambda: fixed_case(
        "policy_loss",
        lambda x, b: _policy_outputs(
            *fused_rl.policy_loss(
                x["logits"], x["t"], x["adv"], old_logprobs=x["old"], delta=3.2,
                importance_sampling="sequence", loss_agg="seq-mean-token-mean", backend=b,
            )
        ),
        logits=torch.linspace(-1, 1, 12).reshape(2, 2, 3), t=torch.tensor([[0, 2], [1, 1]]),
        adv=torch.tensor([[0.3, float("nan")], [0.5, -1.0]]),
        old=torch.tensor([[-5.0, -4.0], [-0.5, -1.0]]), grad=("logits",),
        nan_rule=lambda x: {"loss": True},
    ),
    # was (caught by the default profile while K ids a position got their one-pass route): an
    # empty leading dimension with a (..., K) index, reshape(0, 3, -1) raised
    "trl.selective_log_softmax K ids, empty batch": lambda: fixed_case(
        "trl.selective_log_softmax",
        lambda x, b: trl.selective_log_softmax(x["logits"], x["index"]),
        logits=torch.zeros(0, 3, 2, dtype=_F64), index=torch.zeros(0, 3, 1, dtype=torch.long),
        grad=("logits",), hyper={"top_k": 1},
    ),
}  # fmt: skip


# reproducers of open findings (see ``known_open``): strict xfail until fixed
OPEN_FOUND: dict[str, str] = {}


def _found_params():
    for name in sorted(FOUND):
        reason = OPEN_FOUND.get(name) or known_open(FOUND[name]())
        marks = () if reason is None else pytest.mark.xfail(strict=True, reason=f"open: {reason}")
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_found_params()))
def test_found_by_fuzzing(name):
    check_case(FOUND[name]())


def _token_kl_logits(shape):
    def bad(backend):
        x = torch.zeros(shape, device=DEVICE)
        return BadCall("token_kl", "logits", x, ValueError, backend, {"logits": x, "ref_logits": x})

    return bad


# bad arguments that no check named, by backend: {name: (BadCall factory, open finding or
# None once fixed)}. Was (finding 15, fixed): token_kl checked only its logits' dtype
# (V.check_float, where every other logits op runs V.check_logits): V = 0 raised IndexError in
# the reference's amax and gave NaN on Triton, 0-dim logits raised IndexError on both;
# neither named logits
BAD_FOUND = {
    "token_kl logits V=0": (_token_kl_logits((2, 3, 0)), None),
    "token_kl 0-dim logits": (_token_kl_logits(()), None),
}


def _bad_found_params():
    for name in sorted(BAD_FOUND):
        reason = BAD_FOUND[name][1]
        for backend in ("reference", "triton"):
            marks = (
                () if reason is None else pytest.mark.xfail(strict=True, reason=f"open: {reason}")
            )
            yield pytest.param(name, backend, marks=marks, id=f"{name}-{backend}")


@pytest.mark.parametrize(("name", "backend"), list(_bad_found_params()))
def test_bad_input_found_by_fuzzing(name, backend):
    check_bad_call(BAD_FOUND[name][0](backend))
