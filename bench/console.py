"""The console report of a suite: a legend, the table (``rich`` when importable, else plain
aligned text), the tolerance policy, the "less accurate by design" rows explained, the
failures and what was not measured."""

from __future__ import annotations

import io
import math
import sys
import textwrap

from . import accuracy as A
from .providers import BASELINE, less_accurate
from .report import case_key, verdict

DASH = "-"
PLAIN_WIDTH = 160  # rich's width when stdout is not a terminal (a log, a pipe, a test)
WRAP = 100  # the notes under the table


def _f(x, fmt: str) -> str:
    if x is None:
        return DASH
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return fmt.format(x)


def _mb(x) -> str:
    if x is None:
        return DASH
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _shape(r: dict) -> str:
    shape = f"{r['batch']}x{r['seqlen']}" + (f"x{r['vocab']}" if r["vocab"] else "")
    return shape + (f" H{r['hidden']}" if r.get("hidden") else "")


def columns(records: list[dict], gpu: bool) -> list[tuple[str, str]]:
    """``(header, justify)`` of the table's columns."""
    cols = [("case", "left"), ("provider", "left"), ("ms", "right")]
    if gpu:
        cols += [("GB/s", "right"), ("% copy", "right"), ("peak MB", "right")]
        cols += [("x fused", "right")]
    if not gpu or any(r.get("model_mb") is not None for r in records):
        cols += [("model MB", "right")]
    return cols + [("err vs fp64", "right"), ("worst row", "right"), ("verdict", "left")]


def _cells(r: dict, cols, fused_ms) -> list[str]:
    ratio = r["ms"] / fused_ms if r.get("ms") and fused_ms else None
    values = {
        "provider": r["provider"],
        "ms": _f(r.get("ms"), "{:.2f}"),
        "GB/s": _f(r.get("gbps"), "{:.0f}"),
        "% copy": _f(r.get("pct_copy"), "{:.0f}"),
        "peak MB": _mb(r.get("peak_mb")),
        "x fused": _f(ratio, "{:.2f}"),
        "model MB": _mb(r.get("model_mb")),
        "err vs fp64": _f(r.get("err_max"), "{:.1e}"),
        "worst row": _f(r.get("err_worst_row"), "{:.2g}"),
        "verdict": verdict(r),
    }
    return [values.get(name, "") for name, _ in cols]


def sections(records: list[dict], cols) -> list[list[list[str]]]:
    """One section per case, a row per provider; the case's name is spread down the
    first column (``op[variant]``, then ``mode shape dtype``) so the columns stay narrow."""
    by_case: dict = {}
    for r in records:
        by_case.setdefault(case_key(r), []).append(r)
    out = []
    for rows in by_case.values():
        first = rows[0]
        label = [f"{first['op']}[{first['variant']}]",
                 f"{first['mode']} {_shape(first)} {first['dtype']}"]  # fmt: skip
        fused_ms = next((r["ms"] for r in rows if r["provider"] == BASELINE), None)
        section = [_cells(r, cols, fused_ms) for r in rows]
        for i, row in enumerate(section):
            row[0] = label[i] if i < len(label) else ""
        if len(section) < len(label):  # one provider: the rest of the name in its cell
            section[-1][0] = "\n".join(label[len(section) - 1 :])
        out.append(section)
    return out


def legend(records: list[dict], gpu: bool, reps: int | None) -> list[str]:
    """What each column means, and what ``-`` stands for."""
    if gpu:
        key = [
            ("ms", "median time, triton.testing.do_bench (CUDA events, ~100 ms of runs)"),
            ("GB/s, % copy", "bytes the case must move per second; that over a device copy's"),
            ("peak MB", "measured peak memory above the inputs (outputs and gradient included)"),
            ("x fused", "time over fused_rl's time on the same case"),
        ]
    else:
        key = [("ms", f"median of {reps or 'N'} runs; on CPU the Triton interpreter's time, "
                      "not a performance figure")]  # fmt: skip
    dash = ["no time or error when the provider failed before its outputs"]
    if not gpu or any(r.get("model_mb") is not None for r in records):
        key.append(("model MB", "modelled peak memory above the inputs (bench/memory_profile.py)"))
        dash.append("no model MB where nothing models its memory (torch.compile)")
    if gpu:
        dash.append("no x fused without a fused_rl time")
    key += [
        ("err vs fp64", "largest RMS relative error of any output (values, gradients) against "
                        "a float64 oracle on the same inputs"),
        ("worst row", "the worst single row's error over the RMS row norm (one wrong token); "
                      "grad_weight's vocabulary rows over their own norm, at least the RMS"),
        ("verdict", "ok / less accurate: why (expected, explained below) / FAIL: why (exit 1)"),
        (DASH, "not measured or not applicable: " + ", ".join(dash) + "; a provider that "
               "cannot run a case has no row (see 'Not measured')"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in key)
    indent = " " * (width + 4)
    return ["Columns:"] + [
        textwrap.fill(text, WRAP, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent)
        for name, text in key
    ]


def _rich_table(title: str, cols, secs):
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for name, justify in cols:
        table.add_column(name, justify=justify, no_wrap=name != "verdict")
    styles = {"ok": "green", "less": "yellow", "FAIL": "bold red", "out": "yellow"}
    for k, section in enumerate(secs):
        if k:
            table.add_section()
        for row in section:
            cells = [Text(c) for c in row]
            cells[0].stylize("bold")
            cells[-1].stylize(styles.get(row[-1].split(" ")[0].rstrip(":"), ""))
            table.add_row(*cells)
    return table


def plain_table(title: str, cols, secs) -> str:
    """The table as aligned text (no ``rich``)."""
    widths = [len(name) for name, _ in cols]
    for section in secs:
        for row in section:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], *(len(part) for part in cell.split("\n")))
    widths[-1] = len(cols[-1][0])  # the verdict is last: never padded

    def line(cells):
        parts = []
        for (_, justify), width, cell in zip(cols, widths, cells):
            parts.append(cell.ljust(width) if justify == "left" else cell.rjust(width))
        return "  ".join(parts).rstrip()

    head = line([name for name, _ in cols])
    lines = [title, head, "-" * len(head)]
    for k, section in enumerate(secs):
        if k:
            lines.append("")
        for row in section:
            extra = row[0].split("\n")
            lines.append(line([extra[0], *row[1:]]))
            lines += [line([part] + [""] * (len(row) - 1)) for part in extra[1:]]
    return "\n".join(lines)


def have_rich() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _rich_text(table, width: int) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip().splitlines())


def table_text(records, gpu, title="", reps=None, use_rich=None, width=PLAIN_WIDTH) -> str:
    """The table and its key as text (no colours): ``rich`` when importable, else plain."""
    cols = columns(records, gpu)
    secs = sections(records, cols)
    if use_rich is None:
        use_rich = have_rich()
    if use_rich:
        table = _rich_text(_rich_table(title, cols, secs), width)
    else:
        table = plain_table(title, cols, secs)
    return table + "\n\n" + "\n".join(legend(records, gpu, reps))


def print_table(records, gpu, title="", reps=None, file=None) -> None:
    """The table and its key on ``file`` (stdout): coloured and fitted to a terminal,
    else as :func:`table_text`."""
    file = file or sys.stdout
    if not (have_rich() and hasattr(file, "isatty") and file.isatty()):
        print(table_text(records, gpu, title, reps), file=file)
        return
    from rich.console import Console

    cols = columns(records, gpu)
    console = Console(file=file, highlight=False)
    console.print(_rich_table(title, cols, sections(records, cols)))
    console.print("\n" + "\n".join(legend(records, gpu, reps)), markup=False)


def summary(records: list[dict], skipped: list[dict]) -> list[str]:
    """Under the table: the tolerance policy, each "less accurate" provider with its reason,
    declared bound and measured error, the failures, and what was not measured."""
    lines = ["", textwrap.fill("Tolerance: " + A.policy_text(), WRAP)]
    expected: dict = {}
    for r in records:
        if r.get("status") == "less_accurate":
            expected.setdefault((r["provider"], r["op"], r["dtype"]), []).append(r)
    if expected:
        lines += ["", "Less accurate by design (expected, not failures):"]
    for (provider, op, dtype), rows in expected.items():
        worst = max(rows, key=lambda r: r["err_max"])
        name = max(worst["err"], key=worst["err"].get)
        row = max(r["err_worst_row"] for r in rows)
        rms_bound, row_bound = rows[0]["bound"]
        declared = less_accurate(provider, op)
        text = (
            f"{provider}, {op}, {dtype}, {len(rows)} cases: measured up to {worst['err_max']:.1e} "
            f"vs float64 ({name}), worst row {row:.2g}; declared bound {rms_bound:g} RMS, "
            f"{row_bound:g} per row (tolerance {rows[0]['tol']:g})."
        )
        if declared is not None:
            text += f" Why: {declared.why}"
        lines.append(textwrap.fill(text, WRAP, initial_indent="  ", subsequent_indent="    "))
    failed = [r for r in records if r.get("status") in A.FAILURES]
    if failed:
        lines += ["", f"FAILURES ({len(failed)}; the run exits 1):"]
    for r in failed:
        label = f"{r['op']}[{r['variant']}] {r['mode']} {_shape(r)} {r['dtype']} {r['provider']}"
        if r["status"] == "error":
            lines.append(f"  {label}: error: {r['note']}")
            continue
        errs = ", ".join(f"{k} {_f(v, '{:.1e}')}" for k, v in (r.get("err") or {}).items())
        lines.append(f"  {label}: {verdict(r)} (disagrees with the math; vs float64: {errs})")
    reasons = sorted({f"{s.get('op', '')} / {s['provider']}: {s['reason']}" for s in skipped})
    if reasons:
        lines += ["", "Not measured (no row in the table):"]
        lines += ["  " + line for line in reasons]
    return lines
