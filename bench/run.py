"""fused_rl benchmark suite: time, peak memory, bandwidth and accuracy against float64.

Usage::

    python bench/run.py --suite quick                 # CPU: accuracy demo, ~1 minute
    python bench/run.py --suite full                  # GPU: the issue-6 grid
    python bench/run.py --suite full --op policy_loss --tokens 16384 --vocab 151936
    python bench/run.py --suite full --out bench/results/<gpu>   # figures to commit
    python bench/run.py report --out bench/results/<gpu>         # results.md + plots again
    python bench/run.py memory --vocab 151936 --tokens 16384 --dtype bf16
    python bench/run.py memory --op linear_policy_loss    # its table, memory vs tokens plot
    python bench/run.py --suite distill --providers fused_rl,fused_rl_mat,eager,compile,liger
    python bench/run.py --suite quick --op distill_loss,linear_distill_loss   # the same, CPU
    python bench/run.py memory --op distill_loss --tokens 16384 --seqlen 2048   # its peaks
    python bench/run.py --suite fullkl --providers fused_rl,fused_rl_k3,eager,compile
    python bench/run.py memory --op policy_loss --tokens 16384 --seqlen 2048   # exact KL too
    python bench/run.py --suite truncated --providers fused_rl,eager,compile   # top-k / top-p
    python bench/run.py host                          # host cost per call, tiny shape

Every case runs each provider (``bench/providers.py``) on the same inputs in this process.
Before timing, each provider's outputs (values and gradients) are compared with a float64
oracle computed from the same inputs (``bench/oracle.py``) and judged (``bench/accuracy.py``):
ok, "less accurate" by a declared design choice (expected), or FAIL (the run exits 1).
Results go to ``--out``, by default ``bench/results/local/<gpu name or cpu>/`` (git-ignored):
``results.json``, ``results.md`` and PNG plots. Committed figures are written explicitly,
``--out bench/results/<gpu>``.

Without CUDA, the Triton kernels run through the Triton interpreter (``TRITON_INTERPRET=1``
is set before anything imports Triton): times are then the interpreter's, not performance.
"""

from __future__ import annotations

import os
import sys
import warnings


def _cpu_requested(argv: list[str]) -> bool:
    """``--device cpu`` / ``--device=cpu`` on the command line."""
    pairs = zip(argv, argv[1:] + [""])
    return any(a == "--device=cpu" or (a == "--device" and b == "cpu") for a, b in pairs)


def _prepare_environment() -> None:
    """Interpreter mode on CPU-only machines, and for ``--device cpu`` on a CUDA machine
    (fused_rl's Triton path runs on CPU tensors only through the interpreter); must run
    before fused_rl / triton imports."""
    import torch

    if not torch.cuda.is_available() or (__name__ == "__main__" and _cpu_requested(sys.argv[1:])):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # the interpreter evaluates masked-out lanes in numpy (log(0), 0 * inf)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")


_prepare_environment()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import argparse  # noqa: E402
import datetime  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import fused_rl  # noqa: E402
from bench import accuracy as A  # noqa: E402
from bench import console as C  # noqa: E402
from bench import measure as M  # noqa: E402
from bench import providers as P  # noqa: E402
from bench import report as R  # noqa: E402
from bench.cases import (  # noqa: E402
    DTYPES,
    HIDDEN_OPS,
    OPS,
    SUITES,
    Case,
    make_inputs,
    select_cases,
)
from bench.memory_profile import (  # noqa: E402
    MEMORY_CASES,
    MEMORY_PROVIDERS,
    MEMORY_TOKENS,
    format_memory_table,
    format_memory_vs_tokens,
    memory_table,
    memory_vs_tokens,
    model_peak_bytes,
)
from bench.oracle import Oracle  # noqa: E402

LOCAL_RESULTS = os.path.join(ROOT, "bench", "results", "local")  # git-ignored


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "command",
        nargs="?",
        default="suite",
        choices=("suite", "memory", "report", "host"),
        help="suite (default): time + memory + accuracy; memory: peak memory per provider "
        "(and the fused-linear ops' memory against tokens: memory_vs_tokens.json and a plot "
        "in --out); "
        "report: rewrite results.md and the plots from --out/results.json; host: "
        "microseconds and launches per call on a tiny shape (bench/host.py)",
    )
    p.add_argument(
        "--suite",
        default="quick",
        choices=tuple(SUITES),
        help="quick (CPU), full (the GPU grid), peers (the side-by-side with the peers' "
        "own paths: TRL's and verl's fused heads, Liger inplace=True, at trainers' shapes), "
        "inplace (the gradient written into the logits), distill (the on-policy "
        "distillation losses at trainers' shapes; on CPU: --suite quick --op "
        "distill_loss,linear_distill_loss), fullkl (policy_loss with the exact KL to the "
        "reference beside the same call with k3; on CPU: --suite quick --op policy_loss) or "
        "truncated (token_logprobs under top-k / top-p beside the plain log-probs; on CPU: "
        "--suite quick --op token_logprobs)",
    )
    p.add_argument("--op", type=_csv(str), default=None, help=f"comma list of: {', '.join(OPS)}")
    p.add_argument("--tokens", type=_csv(int), default=None, help="comma list of B*T values")
    p.add_argument("--vocab", type=_csv(int), default=None, help="comma list of V values")
    p.add_argument("--dtype", type=_csv(str), default=None, help="comma list: bf16,fp32,fp16")
    p.add_argument("--seqlen", type=int, default=None, help="T (default 1024; quick: 4)")
    p.add_argument(
        "--providers",
        type=_csv(str),
        default=None,
        help=f"comma list of: {', '.join(P.PROVIDERS)} (default: all; the full suite leaves "
        "out fused_rl_ref, the CPU fallback)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default bench/results/local/<device>, git-ignored; committed "
        "figures: --out bench/results/<gpu>)",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per case on CPU")
    p.add_argument("--compile-cpu", action="store_true", help="run torch.compile on CPU too")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds; cases not started by then are recorded as skipped",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="merge into an existing results.json in --out (same case+provider replaced)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="--append, and skip the cases that results.json in --out already holds",
    )
    p.add_argument("--repeat", type=int, default=7, help="host: samples per call (median)")
    p.add_argument(
        "--number", type=int, default=None, help="host: calls per sample (default: ~20 ms worth)"
    )
    p.add_argument(
        "--exact-bf16-gemm",
        action="store_true",
        help="turn off cuBLAS's reduced-precision reductions in fp16 / bf16 GEMMs "
        "(torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction) for every "
        "provider; results.json records the setting either way",
    )
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="rows per chunk of fused_rl's ops from hidden states (linear_*; default: the "
        "ops' own, fused_rl.linear.chunk_rows); results.json records it",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.chunk_tokens is not None and args.chunk_tokens < 1:
        p.error(f"--chunk-tokens must be >= 1, got {args.chunk_tokens}")
    if args.providers is None:
        args.providers = [x for x in P.PROVIDERS if args.suite == "quick" or x != "fused_rl_ref"]
    args.append = args.append or args.resume
    unknown = [x for x in args.providers if x not in P.PROVIDERS]
    if unknown:
        p.error(f"--providers: unknown {unknown}; choose from {', '.join(P.PROVIDERS)}")
    return args


# ----------------------------------------------------------------------------- one case


def _record(case: Case, provider: str, **fields) -> dict:
    rec = {
        "op": case.op,
        "variant": case.variant,
        "provider": provider,
        "mode": case.mode,
        "tokens": case.tokens,
        "batch": case.batch,
        "seqlen": case.seqlen,
        "vocab": case.vocab,
        "hidden": case.hidden,
        "dtype": case.dtype,
        "status": "ok",
        "ms": None,
        "ms_p20": None,
        "ms_p80": None,
        "peak_mb": None,
        "model_mb": None,
        "bytes": M.bytes_moved(case),
        "gbps": None,
        "pct_copy": None,
        "tflops": None,  # linear ops on a GPU: GEMM work (measure.gemm_flops) per second
        "pct_matmul": None,  # ... as a share of torch.matmul's bf16 rate on this GPU
        "err": None,  # {output: RMS relative error vs the float64 oracle}
        "err_row": None,  # {output: worst row's error}
        "err_row_at": None,  # {output: [worst row's index, its norm over the RMS row's]}
        "err_max": None,
        "err_worst_row": None,
        "tol": A.TOL[case.dtype],
        "bound": None,  # the provider's declared (RMS, row) bound, if less accurate by design
        "verdict": None,  # ok / less accurate: why / FAIL: why
        "note": "",
    }
    rec.update(fields)
    return rec


class DeviceFailure(RuntimeError):
    """The GPU context is broken (a CUDA error): stop, keep what was measured before."""


def _note(case: Case, provider: str, reason: str, env: str | None = None) -> dict:
    """A 'not measured' entry. ``env`` (what this machine offered the provider, see
    ``providers.environment``) marks it transient: a later ``--resume`` retries it where
    that differs (a Liger wheel carried this time). Without ``env`` it is final (the
    provider cannot do this case), except the "all" notes of cases never started."""
    return {"case": case.label(), "key": list(R.case_key(vars(case))), "op": case.op,
            "provider": provider, "reason": reason, "env": env}  # fmt: skip


def _oracle(case: Case, inp: dict, device):
    """The case's float64 oracle, or ``(None, why)`` when it does not fit."""
    try:
        return Oracle(case, inp), ""
    except Exception as exc:
        if not M.is_oom(exc):
            raise
        M.free_memory(device)
        return None, "not checked: the float64 oracle does not fit in memory"


def run_case(
    case: Case, args, device, copy_gbps, skipped: list, providers, matmul_tflops=None
) -> list[dict]:
    """``providers`` on one case: warm-up run checked against the float64 oracle, timing,
    peak memory (GPU) or the memory model (CPU); a linear op's GEMM rate against
    ``matmul_tflops`` (GPU). Raises ``DeviceFailure`` on a CUDA error, recording nothing of
    the case."""
    records = []
    try:
        inp = make_inputs(case, device, seed=args.seed)
    except Exception as exc:
        if not M.is_oom(exc):
            raise
        M.free_memory(device)
        return [_record(case, p, status="oom", note="inputs do not fit") for p in providers]
    names = P.output_names(case)
    oracle, oracle_note = _oracle(case, inp, device)
    for provider in providers:
        if not P.applies(provider, case):
            continue
        try:
            run = P.build(provider, case, inp, compile_on_cpu=args.compile_cpu)
        except Exception as exc:  # a provider that cannot even be built must not stop the run
            final = isinstance(exc, P.Unavailable) and not exc.transient
            reason = str(exc) if isinstance(exc, P.Unavailable) else f"build failed: {exc!r}"
            env = None if final else P.environment(provider, device, args.compile_cpu)
            skipped.append(_note(case, provider, reason[:300], env))
            continue
        rec = _record(case, provider)
        try:
            out = run()  # warm-up (Triton / torch.compile compile here), checked outputs
            M.sync(device)
            if oracle is not None:
                comps = oracle.compare_all(names, out, provider)
                rec.update(A.judge(provider, case.dtype, comps, case.op))
                if oracle.matched:  # which exact definition (bench/oracle.py)
                    rec["note"] = f"oracle: the loss of {oracle.matched}"
            else:
                rec.update(verdict="ok (not checked)", note=oracle_note)
            del out
            # the inputs are valid: time fused_rl without its eager value checks (a host
            # sync per call that no other provider pays; off in a tuned training loop too)
            fused_rl.config.check_values = False
            try:
                p20, p50, p80 = M.time_ms(run, device, args.reps)
                rec.update(ms=p50, ms_p20=p20, ms_p80=p80)
                rec["peak_mb"] = M.peak_mb(run, device)
            finally:
                fused_rl.config.check_values = True
            if M.is_gpu(device):
                rec["gbps"] = rec["bytes"] / (p50 * 1e-3) / 1e9
                rec["pct_copy"] = 100.0 * rec["gbps"] / copy_gbps if copy_gbps else None
                flops = M.gemm_flops(case)
                if flops is not None:
                    rec["tflops"] = flops / (p50 * 1e-3) / 1e12
                    if matmul_tflops:
                        rec["pct_matmul"] = 100.0 * rec["tflops"] / matmul_tflops
        except Exception as exc:
            if M.is_gpu(device) and M.is_device_fatal(exc):
                raise DeviceFailure(f"{case.label()} {provider}: {exc}"[:300]) from exc
            rec["status"] = "oom" if M.is_oom(exc) else "error"
            rec["note"] = f"{type(exc).__name__}: {exc}"[:300]
            rec["verdict"] = "out of memory" if rec["status"] == "oom" else "FAIL: error"
        M.free_memory(device)
        if not M.is_gpu(device):  # GPUs measure the peak; the model is for CPU runs
            peak = model_peak_bytes(provider, case)  # on fake tensors where Triton runs
            rec["model_mb"] = None if peak is None else peak / 2**20
        records.append(rec)
    del inp, oracle
    M.free_memory(device)
    return records


# ----------------------------------------------------------------------------- progress


class _Progress:
    """tqdm when installed, else a printed counter."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="case", dynamic_ncols=True)
        except ImportError:
            self.bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description(label[:60])
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- main


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "triton": triton_version,
        "fused_rl": fused_rl.__version__,
        "liger_kernel": P.liger_version(),
        "trl": P.package_version("trl"),
        "verl": P.package_version("verl"),
    }


def default_out(device) -> str:
    """``bench/results/local/<device slug>``: git-ignored, so a run never rewrites the
    committed figures (those are written with an explicit ``--out bench/results/<gpu>``)."""
    return os.path.join(LOCAL_RESULTS, M.slug(M.device_name(device)))


def _merged(previous: dict | None, records: list[dict], skipped: list[dict]):
    """``previous``' records and notes, with this run's replacing the same case+provider.

    A previous note is dropped when this run has a record or a note for the same case and
    provider, and a previous "all" note (time budget) when this run reached the case."""
    if not previous:
        return records, skipped
    mine = {(*R.case_key(r), r["provider"]) for r in records}
    kept = [r for r in previous["records"] if (*R.case_key(r), r["provider"]) not in mine]
    new = {(R.case_key(r), r["provider"]) for r in records}
    new |= {(tuple(n["key"]), n["provider"]) for n in skipped if "key" in n}
    new_cases = {key for key, _ in new}

    def stale(note: dict) -> bool:
        key = tuple(note.get("key", ()))
        return (key, note["provider"]) in new or (note["provider"] == "all" and key in new_cases)

    old = [n for n in previous.get("skipped", []) if not stale(n) and n not in skipped]
    return kept + records, old + skipped


FINAL_STATUSES = ("ok", "oom", "less_accurate")  # "wrong", "error" (and old runs'
# "parity_fail", measured against fused_rl rather than float64) are measured again


def _still_to_run(cases, providers, previous: dict, env_now) -> dict:
    """``{case: providers}`` still to measure: a provider is done for a case when it has a
    final record there (not a failure), or a note that it cannot run it that still holds
    (final, or transient with this machine offering it the same, ``env_now(provider)``)."""
    final = {(*R.case_key(r), r["provider"]) for r in previous["records"]
             if r["status"] in FINAL_STATUSES}  # fmt: skip
    for n in previous.get("skipped", []):
        if "key" in n and n["provider"] != "all" and n.get("env") in (None, env_now(n["provider"])):
            final.add((*n["key"], n["provider"]))
    todo = {}
    for case in cases:
        key = R.case_key(vars(case))
        left = [p for p in providers if (*key, p) not in final and P.applies(p, case)]
        if left:
            todo[case] = left
    return todo


def write_reports(out_dir: str, meta: dict, records, skipped, plots: bool) -> list[str]:
    R.write_markdown(os.path.join(out_dir, "results.md"), meta, records, skipped)
    return R.write_plots(out_dir, records, meta) if plots else []


def run_report(args) -> None:
    """Rewrite results.md and the plots from results.json (e.g. after a GPU session), and
    the memory-vs-tokens plot from memory_vs_tokens.json where there is one."""
    out_dir = args.out or default_out(args.device or "cpu")
    doc = R.load_json(os.path.join(out_dir, "results.json"))
    memory = R.load_json(os.path.join(out_dir, "memory_vs_tokens.json"))
    if doc is None and memory is None:
        raise SystemExit(f"no results.json or memory_vs_tokens.json in {out_dir}")
    if doc is not None:
        records, skipped = doc.pop("records"), doc.pop("skipped", [])
        # ratios are added at the end of a suite: a run killed mid-way has none yet
        gpu = not str(doc.get("time_kind", "")).startswith(M.CPU_TIME_LABEL)
        R.add_ratios(records, gpu=gpu)
        plots = write_reports(out_dir, doc, records, skipped, plots=not args.no_plots)
        print(f"{out_dir}: results.md and {len(plots)} plot(s) from {len(records)} records")
    if memory is not None and not args.no_plots:  # e.g. from a GPU without matplotlib
        name = R.write_memory_vs_tokens(out_dir, memory.pop("records"), memory)
        print(f"{out_dir}: {name} from memory_vs_tokens.json")


def _shown(path: str) -> str:
    """``path`` relative to the working directory when inside it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def gemm_reductions(exact: bool) -> dict:
    """Set (``exact``: off) and return cuBLAS's reduced-precision reductions of fp16 / bf16
    GEMMs (split sums kept in the operands' dtype), the same for every provider."""
    matmul = torch.backends.cuda.matmul
    if exact:
        matmul.allow_bf16_reduced_precision_reduction = False
        matmul.allow_fp16_reduced_precision_reduction = False
    return {
        "bf16": bool(matmul.allow_bf16_reduced_precision_reduction),
        "fp16": bool(matmul.allow_fp16_reduced_precision_reduction),
    }


def linear_chunk_tokens(rows: int | None) -> int | None:
    """Set and return the rows per chunk of fused_rl's linear ops (None: their default)."""
    P.LINEAR_CHUNK_TOKENS = rows
    return rows


# the settings of a run that results.json records, which one file never mixes: the flag
# that changes each, and its value in runs from before it was recorded
RUN_SETTINGS = {
    "gemm_reduced_precision_reduction": "--exact-bf16-gemm",
    "linear_chunk_tokens": "--chunk-tokens",
}
SETTING_DEFAULTS = {
    "gemm_reduced_precision_reduction": {"bf16": True, "fp16": True},
    "linear_chunk_tokens": None,
}


def run_suite(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = M.is_gpu(device)
    out_dir = args.out or default_out(device)
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    cases = select_cases(args.suite, args.op, args.tokens, args.vocab, args.dtype, args.seqlen)
    skipped: list[dict] = []
    available = lambda op: hasattr(fused_rl, op) or op in P.ADAPTER_OPS  # noqa: E731
    for op in dict.fromkeys(c.op for c in cases):
        if not available(op):
            note = f"fused_rl.{op} is not available yet: op skipped"
            print(f"note: {note}")
            skipped.append({"op": op, "provider": "all", "reason": note})
    cases = [c for c in cases if available(c.op)]
    if "liger" in args.providers and P.liger_version() is None:
        print("note: liger_kernel is not importable: Liger provider skipped")
    if not gpu:
        print(f"note: no CUDA device -- times below are the {M.CPU_TIME_LABEL}")
        if "compile" in args.providers and not args.compile_cpu:
            print("note: torch.compile skipped on CPU (compile time); --compile-cpu runs it")
    copy = M.copy_gbps(device)
    linear = any(c.op in HIDDEN_OPS for c in cases)
    matmul = M.matmul_tflops(device) if linear else None
    meta = {
        "device": {"name": M.device_name(device), "copy_gbps": copy, "matmul_tflops": matmul},
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "suite": args.suite,
        "argv": sys.argv[1:],
        "time_kind": "triton.testing.do_bench (CUDA events)" if gpu else M.CPU_TIME_LABEL,
        "memory_kind": "torch.cuda.max_memory_allocated above inputs"
        if gpu
        else "modelled (bench/memory_profile.py), not measured",
        "tolerance": A.TOL,
        "row_tolerance_factor": A.ROW_TOL_FACTOR,
        "reps": args.reps,
        "gemm_reduced_precision_reduction": gemm_reductions(args.exact_bf16_gemm),
        "linear_chunk_tokens": linear_chunk_tokens(args.chunk_tokens),
    }
    previous = R.load_json(json_path) if args.append else None
    for key, flag in RUN_SETTINGS.items():
        # runs before a setting was recorded had its default
        before = (previous or {}).get(key, SETTING_DEFAULTS[key])
        if previous and before != meta[key]:
            raise SystemExit(
                f"{json_path} holds results with {key} = {before}, this run has {meta[key]} "
                f"({flag}): give it another --out"
            )
    todo = {c: list(args.providers) for c in cases}
    if previous and args.resume:
        env_now = lambda p: P.environment(p, device, args.compile_cpu)  # noqa: E731
        todo = _still_to_run(cases, args.providers, previous, env_now)
        print(
            f"resume: {len(cases) - len(todo)} case(s) complete in {json_path}, {len(todo)} to go"
        )
        cases = [c for c in cases if c in todo]
    records: list[dict] = []
    start = time.perf_counter()
    slowest = 0.0  # the budget stops before a case that would likely overrun it
    progress = _Progress(len(cases))
    stop_reason = None
    for case in cases:
        elapsed = time.perf_counter() - start
        if stop_reason is None and args.time_budget is not None:
            if elapsed + slowest > args.time_budget:
                stop_reason = "time budget reached"
        if stop_reason is not None:
            skipped.append(_note(case, "all", stop_reason))
            progress.step(f"skipped ({stop_reason}): " + case.label())
            continue
        try:
            records += run_case(case, args, device, copy, skipped, todo[case], matmul)
        except DeviceFailure as exc:
            stop_reason = "not run: the GPU failed on an earlier case"
            print(f"\nDEVICE FAILURE, stopping: {exc}", flush=True)
            skipped.append(_note(case, "all", f"device failure: {exc}"))
        slowest = max(slowest, time.perf_counter() - start - elapsed)
        progress.step(case.label())
        # partial results survive a kill (a GPU lease ends mid-suite)
        R.write_json(json_path, meta, *_merged(previous, records, skipped))
    progress.close()
    records, skipped = _merged(previous, records, skipped)
    R.add_ratios(records, gpu)
    R.write_json(json_path, meta, records, skipped)
    plots = write_reports(out_dir, meta, records, skipped, plots=not args.no_plots)
    n_cases = len({R.case_key(r) for r in records})
    where = meta["device"]["name"] + ("" if gpu else ", Triton interpreter")
    title = f"fused_rl {args.suite} suite on {where}: {n_cases} cases, {len(records)} rows"
    print()
    C.print_table(records, gpu, title, reps=None if gpu else args.reps)
    print("\n".join(C.summary(records, skipped)))
    elapsed = time.perf_counter() - start
    print(
        f"\n{len(records)} rows in {elapsed:.0f} s -> {_shown(json_path)}, "
        f"results.md, {len(plots)} plot(s)"
    )
    failure = stop_reason is not None and stop_reason.startswith("not run")
    return {"records": records, "skipped": skipped, "out": out_dir, "device_failure": failure}


def run_memory(args) -> None:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = M.is_gpu(device)
    tokens = (args.tokens or [16384])[0]
    vocab = (args.vocab or [151936])[0]
    dtype = (args.dtype or ["bf16"])[0]
    seqlen = args.seqlen or min(1024, tokens)
    ops = args.op or None
    if not gpu:
        print(
            "No CUDA device: peaks below are MODELLED (bench/memory_profile.py): every tensor "
            "each provider materialises, at this shape, counted on fake tensors."
        )
    rows = memory_table(tokens, vocab, dtype, seqlen, device, measure=gpu, ops=ops,
                        providers=args.providers)  # fmt: skip
    print(format_memory_table(rows, tokens, vocab, dtype))
    linear = [g for g in MEMORY_CASES if ops is None or g[0] in ops]
    if linear:
        run_memory_vs_tokens(args, device, vocab, dtype, linear)


def run_memory_vs_tokens(args, device, vocab: int, dtype: str, groups) -> list[dict]:
    """The fused-linear ops' peak memory against tokens (``--tokens`` when it lists more
    than one count, else ``MEMORY_TOKENS``) at H = 4096: a table, ``memory_vs_tokens.json``
    and the plot in ``--out`` (default ``bench/results/local/<device>/``)."""
    gpu = M.is_gpu(device)
    tokens = args.tokens if args.tokens and len(args.tokens) > 1 else list(MEMORY_TOKENS)
    providers = [p for p in MEMORY_PROVIDERS if p in args.providers]
    rows = memory_vs_tokens(tokens, vocab, dtype, device, measure=gpu,
                            seqlen=args.seqlen or 1024, providers=providers,
                            groups=groups)  # fmt: skip
    print(format_memory_vs_tokens(rows))
    out_dir = args.out or default_out(device)
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "device": {"name": M.device_name(device)},
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "memory_kind": "torch.cuda.max_memory_allocated above inputs"
        if gpu
        else "modelled (bench/memory_profile.py), not measured",
        "linear_chunk_tokens": P.LINEAR_CHUNK_TOKENS,
    }
    path = os.path.join(out_dir, "memory_vs_tokens.json")
    R.write_json(path, meta, rows, [])
    written = [path]
    if not args.no_plots:
        name = R.write_memory_vs_tokens(out_dir, rows, meta)
        if name:
            written.append(os.path.join(out_dir, name))
    print(f"\n{'measured' if gpu else 'MODELLED'} peaks -> " + ", ".join(map(_shown, written)))
    return rows


def run_host(args) -> dict:
    """Host cost per call on a tiny shape (``bench/host.py``): stubbed kernels on CPU."""
    from bench import host

    batch, seqlen, vocab = host.SHAPE
    seqlen = args.seqlen or seqlen
    batch = max(1, args.tokens[0] // seqlen) if args.tokens else batch
    vocab = args.vocab[0] if args.vocab else vocab
    dtype = DTYPES[(args.dtype or ["fp32"])[0]]
    result = host.measure(
        device=args.device, shape=(batch, seqlen, vocab), dtype=dtype, repeat=args.repeat,
        number=args.number,
    )  # fmt: skip
    print(host.format_table(result))
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    with M.heap_frozen():
        return _run(args)


def _run(args) -> int:
    if args.command == "host":
        run_host(args)
        return 0
    if args.command == "memory":
        linear_chunk_tokens(args.chunk_tokens)
        run_memory(args)
        return 0
    if args.command == "report":
        run_report(args)
        return 0
    result = run_suite(args)
    broken = [r for r in result["records"] if r["status"] in A.FAILURES]
    return 1 if broken or result["device_failure"] else 0


if __name__ == "__main__":
    sys.exit(main())
