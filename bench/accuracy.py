"""Tolerances and verdicts: every provider's error against the float64 oracle (``oracle.py``).

* ``ok``: within the tolerance fused_rl itself must meet (``TOL``, RMS relative error of
  every output; ``ROW_TOL_FACTOR`` times it in any single row).
* ``less_accurate``: over it, but the provider declares in ``providers.LESS_ACCURATE`` why it
  computes in lower precision (TRL: ``log_softmax`` in bf16) and a bound it stays within.
  Expected; explained under the table.
* ``wrong`` (disagrees with the math): over its declared bound, or over the tolerance with
  none declared (fused_rl and fused_rl_ref can declare none), or NaN. A failure: the run
  exits non-zero, as it does on an ``error`` (an exception).
"""

from __future__ import annotations

import math

from .oracle import Comparison
from .providers import MUST_MEET_TOL, less_accurate

TOL = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 5e-3}
ROW_TOL_FACTOR = 4  # a row may be this many times the RMS tolerance off (bf16 rounding)
FAILURES = ("wrong", "error")  # statuses that make the run exit non-zero


def _short(x: float) -> str:
    """``1e-04`` -> ``1e-4``."""
    return f"{x:.0e}".replace("e-0", "e-")


def policy_text() -> str:
    """The tolerance policy in two sentences (console and results.md)."""
    tols = ", ".join(f"{_short(v)} ({k})" for k, v in TOL.items())
    return (
        "every output is compared with a float64 oracle on the same inputs, and fused_rl, "
        "fused_rl_ref and every other provider must stay within an RMS relative error of "
        f"{tols}, {ROW_TOL_FACTOR}x that in any single row. Only a provider that declares in "
        "bench/providers.py why it computes in lower precision may exceed that, within its "
        "declared bound ('less accurate', expected); anything else over its limit, or NaN, is "
        "a FAIL and the run exits 1."
    )


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.1e}"


def judge(provider: str, dtype: str, comps: dict[str, Comparison], op: str | None = None) -> dict:
    """The record fields of one provider's measured errors on ``op``: ``err`` / ``err_row``
    per output, their maxima, the limits, ``status`` and ``verdict`` (words)."""
    tol = TOL[dtype]
    row_tol = ROW_TOL_FACTOR * tol
    declared = None if provider in MUST_MEET_TOL else less_accurate(provider, op)
    bound = declared.bounds.get(dtype) if declared else None
    fields = {
        "err": {n: c.err for n, c in comps.items()},
        "err_row": {n: c.worst_row for n, c in comps.items()},
        # where each output's worst row is: [index, its reference norm over the RMS row's]
        "err_row_at": {n: list(c.worst_at) for n, c in comps.items() if c.worst_at},
        "err_max": max((c.err for c in comps.values()), default=0.0),
        "err_worst_row": max((c.worst_row for c in comps.values()), default=0.0),
        "err_excluded_rows": sum(c.excluded for c in comps.values()),
        "tol": tol,
        "row_tol": row_tol,
        "bound": list(bound) if bound else None,
        "status": "ok",
        "verdict": "ok",
    }
    if not comps:
        return fields
    name, worst = max(comps.items(), key=lambda kv: kv[1].err)
    row_name, worst_row = max(comps.items(), key=lambda kv: kv[1].worst_row)
    if math.isinf(worst.err) or math.isinf(worst_row.worst_row):
        bad = name if math.isinf(worst.err) else row_name
        fields.update(status="wrong", verdict=f"FAIL: NaN/inf (or wrong shape) in {bad}")
    elif worst.err <= tol and worst_row.worst_row <= row_tol:
        pass
    elif bound is not None and worst.err <= bound[0] and worst_row.worst_row <= bound[1]:
        fields.update(status="less_accurate", verdict=f"less accurate: {declared.label}")
    else:
        limit, row_limit, what = (tol, row_tol, "tol") if bound is None else (*bound, "bound")
        if worst.err > limit:
            reason = f"{name} {_fmt(worst.err)} > {what} {limit:.2g}"
        else:
            reason = f"one {row_name} row off by {worst_row.worst_row:.2g} > {row_limit:.2g}"
        fields.update(status="wrong", verdict=f"FAIL: {reason}")
    return fields
