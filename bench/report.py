"""Results: ``results.json``, ``results.md`` (tables) and PNG plots (the console's table is
``bench/console.py``)."""

from __future__ import annotations

import json
import os

from .cases import DISTILL_OPS, FULL_KL_VARIANTS, TRUNCATED_VARIANTS
from .measure import CPU_TIME_LABEL
from .providers import BASELINE

# (op, variant, mode) groups that get a time/memory-vs-vocab plot
PLOTTED = (
    ("token_logprobs", "logp", "fwd_nograd"),
    ("token_logprobs", "logp+entropy", "fwd_bwd"),
    ("policy_loss", "grpo", "fwd_bwd"),
    ("policy_loss", "grpo+entropy", "fwd_bwd"),
    ("policy_loss", "gspo", "fwd_bwd"),
)


def case_key(r: dict) -> tuple:
    return (r["op"], r["variant"], r["mode"], r["batch"], r["seqlen"], r["vocab"], r["dtype"])


def memory_of(r: dict) -> float | None:
    """Measured peak (GPU) or else the modelled one."""
    return r.get("peak_mb") if r.get("peak_mb") is not None else r.get("model_mb")


def add_ratios(records: list[dict], gpu: bool) -> None:
    """In each fused_rl record: how many times slower (``speedup_vs``) and how much more
    memory (``memory_ratio_vs``) every other provider of the same case needed. Times are
    compared on GPUs only (CPU times are the interpreter's)."""
    by_case: dict = {}
    for r in records:
        by_case.setdefault(case_key(r), []).append(r)
    for rows in by_case.values():
        fused = next((r for r in rows if r["provider"] == BASELINE and r["ms"]), None)
        if fused is None:
            continue
        fused["speedup_vs"], fused["memory_ratio_vs"] = {}, {}
        for r in rows:
            if r is fused or r["ms"] is None:
                continue
            if gpu:
                fused["speedup_vs"][r["provider"]] = r["ms"] / fused["ms"]
            mine, theirs = memory_of(fused), memory_of(r)
            if mine and theirs is not None:
                fused["memory_ratio_vs"][r["provider"]] = theirs / mine


def write_json(path: str, meta: dict, records: list[dict], skipped: list[dict]) -> None:
    doc = dict(meta)
    doc["records"] = records
    doc["skipped"] = skipped
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def load_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _f(x, fmt="{:.3g}", none="-") -> str:
    if x is None:
        return none
    return "inf" if x == float("inf") else fmt.format(x)


def _mb(x) -> str:
    """Megabytes: 3 significant digits below 100, whole numbers above."""
    if x is None:
        return "-"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"


def _shape(r: dict) -> str:
    shape = f"{r['batch']}x{r['seqlen']}" + (f"x{r['vocab']}" if r["vocab"] else "")
    return shape + (f" H{r['hidden']}" if r.get("hidden") else "")


def _errors(r: dict) -> str:
    """Each output's RMS relative error against float64, e.g. ``loss 3e-08, grad_logits 2e-03``."""
    errs = r.get("err")
    if not errs:
        return "-"
    return ", ".join(f"{k} {_f(v, '{:.1e}')}" for k, v in errs.items())


def _targets(records: list[dict], meta: dict) -> list[str]:
    """Issue 6's targets, evaluated from GPU records (bf16)."""
    copy = meta["device"].get("copy_gbps")
    out = []

    def rows(op, variant, mode, provider):
        return [
            r
            for r in records
            if (r["op"], r["variant"], r["mode"], r["provider"]) == (op, variant, mode, provider)
            and r["dtype"] == "bf16"
            and r["ms"]
        ]

    for r in rows("token_logprobs", "logp", "fwd_nograd", BASELINE):
        if r["vocab"] >= 128000 and r["pct_copy"] is not None:
            verdict = "met" if r["pct_copy"] >= 85 else "MISSED"
            out.append(
                f"- token_logprobs no-grad fwd {_shape(r)}: {r['pct_copy']:.0f}% of copy "
                f"bandwidth ({copy:.0f} GB/s) -- target >= 85%: {verdict}"
            )
    for r in rows("policy_loss", "grpo", "fwd_bwd", BASELINE):
        parts = []
        if r["pct_copy"] is not None:
            v = "met" if r["pct_copy"] >= 75 else "MISSED"
            parts.append(f"{r['pct_copy']:.0f}% of the 3-pass roofline (>= 75%: {v})")
        for prov, goal in (("eager", 5.0), ("liger", 1.5)):
            s = r.get("speedup_vs", {}).get(prov)
            if s is not None:
                parts.append(f"{s:.2f}x vs {prov} (>= {goal}x: {'met' if s >= goal else 'MISSED'})")
        if r["peak_mb"] is not None:
            grad_mb = r["tokens"] * r["vocab"] * 2 / 2**20
            v = "met" if r["peak_mb"] <= grad_mb * 1.01 else "MISSED"
            parts.append(f"peak {r['peak_mb']:,.0f} MB vs gradient {grad_mb:,.0f} MB (<= +1%: {v})")
        out.append(f"- policy_loss fwd+bwd {_shape(r)}: " + "; ".join(parts))
    for r in records:
        if r["op"] == "gae" and r["provider"] == BASELINE and r["seqlen"] == 1024:
            s = r.get("speedup_vs", {}).get("eager")
            if s is not None:
                v = "met" if s >= 100 else "MISSED"
                out.append(f"- gae {_shape(r)}: {s:.0f}x vs the seed's loop (>= 100x: {v})")
    return out


# issue 14's targets for linear_policy_loss (GRPO, bf16, forward + backward) on a GPU
LINEAR_TIME_VS_MATERIALISED = 1.1  # time <= 1.1x the materialised fused path's
LINEAR_MEMORY_FRACTION = 1 / 8  # peak <= 1/8 of the materialised fused path's, at 16K tokens
LINEAR_MEMORY_TOKENS = 16384
LINEAR_SPEEDUP_VS_LIGER = 1.5  # >= 1.5x faster than LigerFusedLinearGRPOLoss
LINEAR_PCT_MATMUL = 70.0  # GEMM work at >= 70% of torch.matmul's bf16 rate


def _linear_targets(records: list[dict], meta: dict) -> list[str]:
    """Issue 14's targets, evaluated from GPU records of linear_policy_loss[grpo] in bf16
    (``fused_rl_mat``: F.linear + fused_rl on the materialised logits)."""
    matmul = meta["device"].get("matmul_tflops")
    out = []
    for r in records:
        if (r["op"], r["variant"], r["mode"], r["provider"], r["dtype"]) != (
            "linear_policy_loss", "grpo", "fwd_bwd", BASELINE, "bf16"
        ) or not r["ms"]:  # fmt: skip
            continue
        parts = []
        s = r.get("speedup_vs", {}).get("fused_rl_mat")
        if s is not None:
            verdict_ = "met" if 1 / s <= LINEAR_TIME_VS_MATERIALISED else "MISSED"
            parts.append(f"time {1 / s:.2f}x the materialised fused path's "
                         f"(<= {LINEAR_TIME_VS_MATERIALISED}x: {verdict_})")  # fmt: skip
        m = r.get("memory_ratio_vs", {}).get("fused_rl_mat")
        if m is not None:
            text = f"peak 1/{m:.2f} of the materialised fused path's"
            if r["tokens"] == LINEAR_MEMORY_TOKENS:
                ok = 1 / m <= LINEAR_MEMORY_FRACTION
                text += f" (<= 1/8 at 16K tokens: {'met' if ok else 'MISSED'})"
            parts.append(text)
        s = r.get("speedup_vs", {}).get("liger")
        if s is not None:
            ok = s >= LINEAR_SPEEDUP_VS_LIGER
            parts.append(f"{s:.2f}x vs Liger's chunked GRPO (>= {LINEAR_SPEEDUP_VS_LIGER}x: "
                         f"{'met' if ok else 'MISSED'})")  # fmt: skip
        if r.get("pct_matmul") is not None:
            ok = r["pct_matmul"] >= LINEAR_PCT_MATMUL
            parts.append(
                f"GEMM work at {r['pct_matmul']:.0f}% of torch.matmul's bf16 rate "
                f"({r['tflops']:.0f} of {matmul:.0f} TFLOP/s; whole op time, so a lower bound "
                f"on the GEMMs' own rate; >= {LINEAR_PCT_MATMUL:.0f}%: {'met' if ok else 'MISSED'})"
            )
        if parts:
            out.append(f"- linear_policy_loss fwd+bwd {_shape(r)}: " + "; ".join(parts))
    return out


def verdict(r: dict) -> str:
    """ok / less accurate: why / FAIL: why (records of older runs: from their status)."""
    if r.get("verdict"):
        return r["verdict"]
    status = r.get("status", "ok")
    if status == "parity_fail":  # an older run, compared with fused_rl, not float64
        return "FAIL: differed from fused_rl (older run)"
    return {"error": "FAIL: error", "oom": "out of memory"}.get(status, status)


def _accuracy_notes(records: list[dict]) -> list[str]:
    from .accuracy import policy_text
    from .providers import less_accurate

    lines = [
        "Accuracy: the float64 oracle (`bench/oracle.py`) computes per-token log-probs and "
        "entropies in float64 over blocks of logits rows, the loss in float64 with autograd "
        "on them, and checks the logits' gradient block by block (0-dim outputs relative to "
        "max(|ref|, 1e-2)). `err vs fp64` is the largest RMS relative error of any output, "
        "`worst row` the worst single row's error over the RMS row norm. Tolerance: "
        + policy_text(),
        "",
    ]
    if any(r["op"] in DISTILL_OPS for r in records):
        lines += [
            "Distillation ops: the oracle computes both models' log-softmaxes in float64 per "
            "block of rows, the divergence of the case's beta and its gradient in closed form. "
            "From 16-bit hidden states a provider is checked against the loss of the exact "
            "logits or of the logits rounded to the heads' dtype (what `F.linear` returns), "
            "whichever it matches: the two differ by 1-2% in the gradients "
            "(`bench/oracle.py` `LOGITS_DEFINITIONS`; results.json's `note` names the match).",
            "",
        ]
    if any(r["variant"] in FULL_KL_VARIANTS for r in records):
        lines += [
            "Exact KL (`policy_loss[grpo+fullkl]`): the oracle adds, per block of rows, the "
            "float64 KL(pi || pi_ref) over the vocabulary from both models' logits, and its "
            "gradient `beta w_t p (log p - log q - KL) / tau` to the logits' gradient. "
            "`fused_rl_k3` (the same call with k3 on the same inputs) is checked against "
            "GRPO's oracle with k3 (results.json's `note` says so); the case's byte count is "
            "the exact KL's five passes, so the k3 row's GB/s is an effective rate.",
            "",
        ]
    if any(r["op"] == "token_logprobs" and r["variant"] in TRUNCATED_VARIANTS for r in records):
        lines += [
            "Truncated log-probs (`token_logprobs[k50]`, `[k1000]`, `[p0.9]`: top-k / top-p "
            "as a sampler cuts, every target its row's argmax, which every cut keeps): the "
            "oracle finds each block of rows' kept set in float64 from the rules' definitions "
            "(top-k: at or above the k-th largest; top-p: at or above the largest value whose "
            "upper set holds mass p, tie groups whole), the log-prob over it and the gradient "
            "`g (onehot - p_kept) / tau` on it, 0 elsewhere. The byte count is the plain "
            "op's (one read forward; read, read, write with the backward): fused_rl's top-k "
            "> 64 (a radix select) and top-p (a threshold search) read a row more than once, "
            "so their GB/s is an effective rate.",
            "",
        ]
    declared = {(r["provider"], r["op"]) for r in records if r.get("status") == "less_accurate"}
    for provider, op in sorted(declared):
        d = less_accurate(provider, op)
        bounds = "; ".join(f"{k}: {a:g} RMS, {b:g} per row" for k, (a, b) in d.bounds.items())
        lines += [f"Less accurate by design, `{provider}` on `{op}`, {d.label}: {d.why} "
                  f"Declared bound: {bounds}.", ""]  # fmt: skip
    lines += [
        "`eager` upcasts the logits to fp32 (as RL trainers do). Liger is called with "
        "`inplace=False` because every provider reuses the logits (its default "
        "`inplace=True` writes the gradient into the logits buffer and saves that buffer). "
        "`-`: not measured or not applicable (no time or error when the provider failed, no "
        "model MB where nothing models its memory, such as torch.compile); a provider that "
        "cannot run a case has no row (see 'Not measured').",
        "",
    ]
    return lines


def write_markdown(path: str, meta: dict, records: list[dict], skipped: list[dict]) -> None:
    gpu = meta["device"]["name"] != "cpu"
    dev = meta["device"]
    lines = [f"# fused_rl benchmark -- {dev['name']}", ""]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    lines.append(f"Date {meta['date']}; {versions}; suite `{meta['suite']}`.")
    lines.append("")
    if gpu:
        lines.append(
            f"Device-to-device copy bandwidth measured at the start: {dev['copy_gbps']:.0f} GB/s "
            "(bytes read + written). Times: `triton.testing.do_bench` median [20%-80%] in ms. "
            "GB/s from the byte counts of `bench/measure.py::bytes_moved` (logits: forward "
            "1 read, forward+backward 2 reads + 1 gradient write). Peak MB: "
            "`max_memory_allocated` above the inputs (outputs and gradient included)."
        )
    else:
        lines.append(
            f"**CPU run: an accuracy check of every op through the Triton interpreter and the "
            f"references. Times (ms: median of {meta.get('reps', 'N')} runs) are the "
            f"{CPU_TIME_LABEL}.** Memory (model MB) is the model of "
            "`bench/memory_profile.py` (tensors each provider materialises above the inputs, "
            "counted on fake tensors), not a measurement."
        )
    lines.append("")
    lines += _accuracy_notes(records)
    if gpu:
        targets = _targets(records, meta)
        if targets:
            lines += ["## Targets (issue 6)", "", *targets, ""]
        linear = _linear_targets(records, meta)
        if linear:
            lines += ["## Targets (issue 14, fused linear)", "", *linear, ""]
    ops = []
    for r in records:
        if r["op"] not in ops:
            ops.append(r["op"])
    for op in ops:
        lines += [f"## {op}", ""]
        groups = []
        for r in records:
            g = (r["variant"], r["mode"])
            if r["op"] == op and g not in groups:
                groups.append(g)
        for variant, mode in groups:
            lines += [f"### {op}[{variant}] {mode}", ""]
            head = "| shape | dtype | provider | ms | "
            head += "GB/s | % copy | peak MB | " if gpu else ""
            head += (
                "model MB | fused_rl faster by | memory / fused_rl | err vs fp64 | "
                "err vs fp64 per output | worst row | verdict |"
            )
            lines += [head, "|" + "---|" * (head.count("|") - 1)]
            for r in records:
                if (r["op"], r["variant"], r["mode"]) != (op, variant, mode):
                    continue
                fused = next(
                    (
                        f
                        for f in records
                        if f["provider"] == BASELINE and case_key(f) == case_key(r)
                    ),
                    None,
                )
                speed = mem = None
                if fused and r["provider"] != BASELINE:
                    speed = fused.get("speedup_vs", {}).get(r["provider"])
                    mem = fused.get("memory_ratio_vs", {}).get(r["provider"])
                ms = _f(r["ms"], "{:.3f}")
                if gpu and r["ms_p20"] is not None:
                    ms += f" [{r['ms_p20']:.3f}-{r['ms_p80']:.3f}]"
                row = f"| {_shape(r)} | {r['dtype']} | {r['provider']} | {ms} | "
                if gpu:
                    row += (
                        f"{_f(r['gbps'], '{:.0f}')} | {_f(r['pct_copy'], '{:.0f}')} | "
                        f"{_mb(r['peak_mb'])} | "
                    )
                row += (
                    f"{_mb(r.get('model_mb'))} | {_f(speed, '{:.2f}x')} | "
                    f"{_f(mem, '{:.2f}x')} | {_f(r.get('err_max'), '{:.1e}')} | "
                    f"{_errors(r)} | {_f(r.get('err_worst_row'), '{:.2g}')} | "
                    f"{verdict(r)} |"
                )
                lines.append(row)
            lines.append("")
    if skipped:
        lines += ["## Not measured", ""]
        seen = set()
        for s in skipped:
            key = (s.get("op"), s.get("provider"), s["reason"])
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"- {s.get('op', '')} {s.get('provider', '')}: {s['reason']}")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plots(outdir: str, records: list[dict], meta: dict) -> list[str]:
    """Time and memory vs vocabulary size per provider; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plots (pip install matplotlib)")
        return []
    gpu = meta["device"]["name"] != "cpu"
    written = []
    for op, variant, mode in PLOTTED:
        rows = [
            r
            for r in records
            if (r["op"], r["variant"], r["mode"]) == (op, variant, mode) and r["ms"] is not None
        ]
        if not rows:
            continue
        # one line per provider at the (tokens, dtype) with the most vocabulary sizes
        groups: dict = {}
        for r in rows:
            groups.setdefault((r["tokens"], r["seqlen"], r["dtype"]), set()).add(r["vocab"])
        (tokens, seqlen, dtype), vocabs = max(
            groups.items(), key=lambda kv: (len(kv[1]), kv[0][0] == 16384, kv[0][0])
        )
        if len(vocabs) < 2:
            continue
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
        for provider in sorted({r["provider"] for r in rows}):
            pts = sorted(
                (r["vocab"], r["ms"], memory_of(r))
                for r in rows
                if r["provider"] == provider
                and (r["tokens"], r["seqlen"], r["dtype"]) == (tokens, seqlen, dtype)
            )
            if not pts:
                continue
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=provider)
            mem = [(p[0], p[2]) for p in pts if p[2] is not None]
            if mem:
                ax_m.plot([p[0] for p in mem], [p[1] for p in mem], "o-", label=provider)
        where = meta["device"]["name"]
        ax_t.set_title("time (ms)" + ("" if gpu else f" -- {CPU_TIME_LABEL}"), fontsize=9)
        ax_m.set_title(
            "peak memory above inputs (MB)" + ("" if gpu else " -- modelled"), fontsize=9
        )
        for ax in (ax_t, ax_m):
            ys = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
            if ys and max(ys) / min(ys) > 20:  # providers an order of magnitude apart
                ax.set_yscale("log")
            ax.set_xlabel("vocabulary size V")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{op}[{variant}] {mode}, {tokens} tokens (T={seqlen}), {dtype} -- {where}")
        fig.tight_layout()
        name = f"plot_{op}_{variant.replace('+', '_')}_{mode}_{dtype}.png"
        fig.savefig(os.path.join(outdir, name), dpi=90)
        plt.close(fig)
        written.append(name)
    return written


# the memory-vs-tokens plot's legend: what each provider of a fused-linear case runs
MEMORY_LABELS = {
    "fused_rl": "fused_rl (chunked, gradients in the forward)",
    "fused_rl_mat": "materialised fused (F.linear + fused_rl)",
    "eager": "materialised eager (F.linear + fp32 eager)",
    "liger": "Liger LigerFusedLinearGRPOLoss",
}


def memory_plot_name(dtype: str) -> str:
    return f"plot_memory_vs_tokens_linear_{dtype}.png"


def write_memory_vs_tokens(outdir: str, rows: list[dict], meta: dict) -> str | None:
    """Peak memory against tokens of the fused-linear ops (``memory_profile.memory_vs_tokens``
    rows), a panel per case, a line per provider; titled MODELLED or MEASURED by the rows'
    ``how`` (a line modelled from a provider's source says so in its label). Returns the
    file written (None without matplotlib or rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install matplotlib)")
        return None
    rows = [r for r in rows if r["peak_mb"] is not None]
    if not rows:
        return None
    groups = list(dict.fromkeys((r["op"], r["variant"], r["mode"]) for r in rows))
    measured = all(r["how"] == "measured" for r in rows)
    modelled = all(r["how"].startswith("modelled") for r in rows)
    kind = "MEASURED" if measured else "MODELLED" if modelled else "measured and modelled"
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, (op, variant, mode) in zip(axes[0], groups):
        case_rows = [r for r in rows if (r["op"], r["variant"], r["mode"]) == (op, variant, mode)]
        for provider in dict.fromkeys(r["provider"] for r in case_rows):
            pts = sorted((r["tokens"], r["peak_mb"] / 1024, r["how"])
                         for r in case_rows if r["provider"] == provider)  # fmt: skip
            label = MEMORY_LABELS.get(provider, provider)
            hows = {how for _, _, how in pts}
            how = hows.pop() if len(hows) == 1 else None
            if how not in (None, "measured", "modelled"):
                label += f" [{how}]"  # e.g. modelled from Liger's source
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        first = case_rows[0]
        ax.set_title(f"{op}[{variant}] {mode}\nH={first['hidden']} V={first['vocab']} "
                     f"{first['dtype']} (T={first['seqlen']})", fontsize=9)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["tokens"] for r in case_rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("tokens (B*T)")
        ax.set_ylabel("peak memory above the inputs (GiB)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    where = meta["device"]["name"]
    how = {
        "MEASURED": "MEASURED: torch.cuda.max_memory_allocated above the inputs",
        "MODELLED": "MODELLED, not measured: the tensors each provider allocates, counted on "
        "fake tensors (bench/memory_profile.py)",
    }.get(kind, "measured, except the lines marked modelled")
    fig.suptitle(f"Fused-linear ops: peak memory above the inputs vs tokens, on {where}\n{how}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    name = memory_plot_name(rows[0]["dtype"])
    fig.savefig(os.path.join(outdir, name), dpi=90)
    plt.close(fig)
    return name
