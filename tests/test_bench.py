"""The benchmark suite (bench/): CLI + JSON shape on a tiny quick run, a provider that
disagrees with the float64 oracle, byte counts, the memory model, and pytest-benchmark
timings of the reference paths (run once each under ``--benchmark-disable`` in CI, fully
with ``pytest --benchmark-only``). The oracle, the verdicts and the console table:
``tests/test_bench_accuracy.py``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import DEVICE
from helpers import FP32_TOL

# an integration test (subprocess / CLI / compile): `pytest -m 'not integration'` skips it
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fused_rl  # noqa: E402
from bench import measure as M  # noqa: E402
from bench import providers as P  # noqa: E402
from bench import run as bench_run  # noqa: E402
from bench.cases import TOPK_CLAMP, Case, full_cases, make_inputs, select_cases  # noqa: E402
from bench.memory_profile import model_peak  # noqa: E402
from bench.oracle import rel_err, worst_row_err  # noqa: E402
from bench.run import main, run_case  # noqa: E402

try:
    import pytest_benchmark  # noqa: F401
except ImportError:  # without the plugin the benchmark tests still run once

    @pytest.fixture
    def benchmark():
        return lambda fn, *args, **kwargs: fn(*args, **kwargs)


RECORD_KEYS = {"op", "provider", "mode", "tokens", "vocab", "dtype", "ms", "peak_mb", "gbps",
               "err", "err_row", "err_max", "err_worst_row", "tol", "verdict"}  # fmt: skip
CASE_FIELDS = ("op", "variant", "mode", "batch", "seqlen", "vocab", "dtype")


def _args(**kw):
    base = dict(providers=["fused_rl", "fused_rl_ref", "eager", "trl"], seed=0, reps=1)
    base.update(compile_cpu=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.no_poison
def test_cli_quick_suite_writes_results(tmp_path):
    """A CPU run (``--device=cpu``) of the providers every machine has (Liger and
    torch.compile depend on the machine): every one within fused_rl's tolerance of float64 in
    fp32, the table and its key on the console.

    fused_rl's Triton path on CPU tensors is the Triton interpreter, which this process runs
    only on a machine without CUDA (conftest); on a CUDA machine (Triton compiled, the
    interpreter not under test: triton 3.6's fails under NumPy >= 2.4, ``int()`` of a
    one-element array in its ``__index__``) the CPU run measures fused_rl's reference backend
    (``fused_rl_ref``) and the other providers, and fused_rl's CUDA path is measured by
    ``test_wrong_math_is_a_failure`` and ``test_new_policy_variants_meet_the_oracle``."""
    triton_on_cpu = fused_rl._backend.interpreter_enabled()
    providers = (["fused_rl"] if triton_on_cpu else []) + ["fused_rl_ref", "eager", "trl"]
    out = tmp_path / "res"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "bench", "run.py"),
        "--suite=quick",
        "--device=cpu",
        "--providers=" + ",".join(providers),
        "--op=policy_loss,gae",
        "--tokens=4",
        "--vocab=64",
        "--dtype=fp32",
        "--reps=1",
        "--no-plots",
        f"--out={out}",
    ]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not a performance figure" in proc.stdout
    for words in ("err vs fp64", "worst row", "verdict", "Columns:", "Tolerance:"):
        assert words in proc.stdout, words
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["device"]) >= {"name", "copy_gbps"}
    assert doc["device"]["name"] == "cpu" and doc["device"]["copy_gbps"] is None
    assert set(doc["versions"]) >= {"torch", "triton", "fused_rl"}
    assert doc["date"]
    records = doc["records"]
    assert {r["op"] for r in records} == {"policy_loss", "gae"}
    assert {r["mode"] for r in records} == {"fwd_nograd", "fwd_bwd"}
    assert {r["variant"] for r in records if r["op"] == "policy_loss"} == {
        "grpo",
        "grpo+entropy",
        "gspo",
        "cispo",
        "gmpo",
        "grpo+is",
    }
    for r in records:
        assert RECORD_KEYS <= set(r), set(r) ^ RECORD_KEYS
        assert r["status"] == "ok" and r["verdict"] == "ok", r
        assert r["ms"] > 0 and r["peak_mb"] is None and r["gbps"] is None  # CPU: no claims
        assert set(r["err"]) == set(P.output_names(Case(**{k: r[k] for k in CASE_FIELDS})))
        assert r["err_max"] <= r["tol"] == 1e-4, r  # every provider, fused_rl included
    assert set(providers) <= {r["provider"] for r in records if r["op"] == "policy_loss"}
    assert (out / "results.md").read_text().count(f"| {providers[0]} |") == 7


NEW_POLICY = ("cispo", "gmpo", "grpo+is")


def _verdicts(case: Case, inp: dict, providers) -> dict:
    from bench import accuracy as A
    from bench.oracle import Oracle

    oracle = Oracle(case, inp)
    out = {}
    for provider in providers:
        cmp = oracle.compare_all(P.output_names(case), P.build(provider, case, inp)(), provider)
        out[provider] = A.judge(provider, case.dtype, cmp, case.op)["verdict"]
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", NEW_POLICY)
def test_new_policy_variants_meet_the_oracle(variant, dtype, device):
    """cispo / gmpo / grpo+is through fused_rl's Triton path (CUDA, or the Triton interpreter
    on a CPU-only machine), the reference path, eager and TRL against the float64 oracle
    (TRL's bf16 log_softmax: its declared "less accurate"), on the suite's device."""
    case = Case("policy_loss", variant, "fwd_bwd", 3, 16, 1000, dtype)
    inp = make_inputs(case, device)
    verdicts = _verdicts(case, inp, ("fused_rl", "fused_rl_ref", "eager", "trl"))
    for provider, verdict in verdicts.items():
        allowed = {"ok"} | ({"less accurate"} if provider == "trl" and dtype == "bf16" else set())
        assert verdict.split(":")[0] in allowed, (provider, verdict)


@pytest.mark.parametrize("variant", NEW_POLICY)
def test_new_policy_variants_are_their_own_math(monkeypatch, variant):
    """The variant's keywords matter: fused_rl run as plain GRPO (no surrogate, no IS
    weights, token-mean) fails the oracle of the variant, so neither side can silently fall
    back to GRPO."""
    case = Case("policy_loss", variant, "fwd_bwd", 3, 16, 1000, "fp32")
    inp = make_inputs(case, "cpu")
    original = P._policy_kwargs
    monkeypatch.setattr(P, "_policy_kwargs", lambda inp, v: original(inp, "grpo"))
    assert _verdicts(case, inp, ("fused_rl_ref",))["fused_rl_ref"].startswith("FAIL"), variant


def test_new_policy_inputs():
    """is_weights (B, T) in [0.5, 1.5] for grpo+is only, drawn after grpo's inputs (which it
    shares); every new variant's log-ratios CLIP_MARGIN from its clip boundaries; gmpo's
    inputs have tokens the clip freezes (on both sides of the band) at 8K tokens."""
    from bench.cases import CLIP_MARGIN, clip_bounds

    grpo = make_inputs(Case("policy_loss", "grpo", "fwd_bwd", 4, 64, 333, "bf16"), "cpu")
    for variant in NEW_POLICY:
        inp = make_inputs(Case("policy_loss", variant, "fwd_bwd", 4, 64, 333, "bf16"), "cpu")
        assert ("is_weights" in inp) == (variant == "grpo+is")
        for key in ("buf", "targets", "advantages", "ref_logprobs", "mask"):
            assert torch.equal(inp[key], grpo[key]), key
        logp = P.eager_token_logprobs(inp["logits"].detach(), inp["targets"], False)[0]
        d = logp - inp["old_logprobs"]
        for bound in clip_bounds(variant):
            assert (d - bound).abs().min() > CLIP_MARGIN - 1e-3, (variant, bound)
    # gmpo's log-ratios ~ N(0, 0.1^2) pass its band [-0.2, 0.28] with probability 0.023 below
    # and 2.6e-3 above (2.8 sigma) a token: 256 tokens hold one above only about half the
    # time (a draw-dependent check: torch 2.11's CPU bf16 randn draws another stream than
    # 2.13's, with none above). 8192 tokens: ~21 expected above, none with probability 8e-10.
    inp = make_inputs(Case("policy_loss", "gmpo", "fwd_bwd", 4, 2048, 333, "bf16"), "cpu")
    logp = P.eager_token_logprobs(inp["logits"].detach(), inp["targets"], False)[0]
    d = logp - inp["old_logprobs"]
    low, high = clip_bounds("gmpo")
    assert (d > high).any() and (d < low).any()
    w = make_inputs(Case("policy_loss", "grpo+is", "fwd_bwd", 4, 64, 333, "bf16"), "cpu")
    w = w["is_weights"]
    assert w.shape == (4, 64) and w.dtype == torch.float32
    assert 0.5 <= w.min() and w.max() <= 1.5 and w.std() > 0.2


def test_liger_new_policy_variants_through_its_signature(monkeypatch):
    """Liger's provider for cispo (loss_type='cispo', cap eps_high = 1.28) and grpo+is
    (vllm_is_ratio) meets the oracle, run here on fused_rl.compat.liger.triton_grpo_loss
    (Liger 0.8.5's signature and math, tested against a float64 transcription of Liger's
    kernel in tests/test_compat_liger.py); gmpo is Unavailable (Liger has none)."""
    from fused_rl.compat.liger import triton_grpo_loss

    monkeypatch.setattr(P, "liger_version", lambda: "0.8.5 (fused_rl.compat.liger stand-in)")
    monkeypatch.setattr(P, "_liger_import", lambda module, name: triton_grpo_loss)
    for variant in ("cispo", "grpo+is", "grpo"):
        case = Case("policy_loss", variant, "fwd_bwd", 3, 16, 1000, "fp32")
        inp = make_inputs(case, "cpu")
        assert _verdicts(case, inp, ("liger",))["liger"] == "ok", variant
    case = Case("policy_loss", "gmpo", "fwd_bwd", 3, 16, 1000, "fp32")
    with pytest.raises(P.Unavailable, match="GMPO"):
        P.build("liger", case, make_inputs(case, "cpu"))


def test_wrong_math_is_a_failure(monkeypatch, device):
    """On the suite's device: on a CUDA machine fused_rl's Triton path needs CUDA tensors."""
    case = Case("token_logprobs", "logp", "fwd_bwd", 1, 5, 37, "fp32")
    original = P.eager_token_logprobs
    broken = lambda logits, targets, with_entropy: (  # noqa: E731
        original(logits, targets, with_entropy)[0] + 0.1,
    )
    monkeypatch.setattr(P, "eager_token_logprobs", broken)
    skipped = []
    providers = ["fused_rl", "eager", "liger"]
    recs = run_case(case, _args(providers=providers), device, None, skipped, providers)
    by = {r["provider"]: r for r in recs}
    assert by["eager"]["status"] == "wrong", by["eager"]
    assert by["eager"]["verdict"].startswith("FAIL: logp")
    assert by["eager"]["err"]["logp"] > 1e-3 and by["eager"]["err"]["grad_logits"] < 1e-6
    assert by["fused_rl"]["status"] == "ok" and by["fused_rl"]["err_max"] < 1e-5
    # a note either way: not installed (CI), or no log-prob backward in Liger (GPU image)
    assert any(s["provider"] == "liger" for s in skipped)


def test_a_provider_that_fails_to_build_is_a_note(monkeypatch):
    """An exception while building one provider (e.g. a Liger submodule import) records a
    transient note and the other providers still run; value checks are back on after."""
    case = Case("token_logprobs", "logp", "fwd_nograd", 1, 3, 17, "fp32")
    real = P.build

    def build(provider, *a, **k):
        if provider == "eager":
            raise ImportError("no module named liger_kernel.ops")
        return real(provider, *a, **k)

    monkeypatch.setattr(P, "build", build)
    skipped, providers = [], ["fused_rl_ref", "eager", "trl"]
    recs = run_case(case, _args(providers=providers), "cpu", None, skipped, providers)
    assert [r["provider"] for r in recs] == ["fused_rl_ref", "trl"]
    assert skipped[0]["provider"] == "eager" and skipped[0]["env"]  # retried elsewhere
    assert "build failed: ImportError" in skipped[0]["reason"]
    assert fused_rl.config.check_values


def test_resume_per_case_and_provider():
    """--resume re-runs what is missing or failed: a provider with an 'error' or 'wrong'
    record or a transient note whose machine differed (no Liger then, a wheel now); never a
    provider that cannot run the case (a final note), nor one still missing here. fused_rl
    need not run again: every provider is checked against float64, not against it."""
    cases = [Case("gae", "x", "fwd_nograd", 2, 4, 0, "fp32"),
             Case("gae", "y", "fwd_nograd", 2, 4, 0, "fp32")]  # fmt: skip
    key = lambda c: list(bench_run.R.case_key(vars(c)))  # noqa: E731
    rec = lambda c, p, status: dict(vars(c), provider=p, status=status)  # noqa: E731
    previous = {
        "records": [rec(cases[0], "fused_rl", "ok"), rec(cases[0], "eager", "less_accurate"),
                    rec(cases[1], "fused_rl", "wrong"), rec(cases[1], "eager", "error")],
        "skipped": [{"key": key(cases[0]), "provider": "trl", "env": None},
                    {"key": key(cases[0]), "provider": "liger", "env": "liger_kernel None"},
                    {"key": key(cases[1]), "provider": "trl", "env": None},
                    {"key": key(cases[1]), "provider": "liger", "env": None}],
    }  # fmt: skip
    providers = ["fused_rl", "eager", "trl", "liger"]
    with_wheel = lambda p: "liger_kernel 0.6.2" if p == "liger" else "x"  # noqa: E731
    todo = bench_run._still_to_run(cases, providers, previous, with_wheel)
    assert todo == {cases[0]: ["liger"], cases[1]: ["fused_rl", "eager"]}
    still_none = lambda p: "liger_kernel None"  # noqa: E731
    todo = bench_run._still_to_run(cases, providers, previous, still_none)
    assert list(todo) == [cases[1]]


def test_merge_drops_stale_notes():
    """A case measured again drops its old notes (time budget, a provider missing then)."""
    case = Case("gae", "x", "fwd_nograd", 2, 4, 0, "fp32")
    key = list(bench_run.R.case_key(vars(case)))
    old_note = {"key": key, "provider": "all", "reason": "time budget reached"}
    other = {"key": ["other"], "provider": "all", "reason": "time budget reached"}
    no_liger = {"key": key, "provider": "liger", "reason": "not importable"}
    trl_never = {"key": key, "provider": "trl", "reason": "logits ops only"}  # still true
    previous = {"records": [], "skipped": [old_note, other, no_liger, trl_never]}
    records = [dict(vars(case), provider=p, status="ok") for p in ("fused_rl", "liger")]
    merged, notes = bench_run._merged(previous, records, [])
    assert merged == records and notes == [other, trl_never]


def test_worst_row_err_catches_one_bad_row():
    ref = torch.randn(4096, 33, generator=torch.Generator().manual_seed(0))
    ref[17] *= ref.norm(dim=1).mean() / ref[17].norm()  # a row of typical norm
    out = ref.clone()
    out[17] = -ref[17]  # one token entirely wrong
    assert rel_err(out, ref) < 0.05  # the RMS barely notices
    assert worst_row_err(out, ref) > 1.5
    assert worst_row_err(ref, ref) == 0.0


def test_rel_err():
    a = torch.randn(3, 4, 5)
    assert rel_err(a, a) == 0.0
    assert rel_err(a * (1 + 1e-3), a) == pytest.approx(1e-3, rel=1e-3)
    assert rel_err(torch.full((2,), float("nan")), torch.ones(2)) == float("inf")
    assert rel_err(torch.tensor(0.0), torch.tensor(0.0)) == 0.0
    assert rel_err(torch.ones(2), torch.ones(3)) == float("inf")


def test_byte_counts():
    n, v = 8 * 1024, 151936
    fwd = Case("token_logprobs", "logp", "fwd_nograd", 8, 1024, v, "bf16")
    bwd = Case("policy_loss", "grpo", "fwd_bwd", 8, 1024, v, "bf16")
    assert M.bytes_moved(fwd) == n * v * 2  # read the logits once
    assert M.bytes_moved(bwd) == 3 * n * v * 2  # read, read, write the gradient
    assert M.bytes_moved(Case("gae", "x", "fwd_nograd", 4, 8, None, "fp32")) == 17 * 32


def test_memory_model_counts_materialised_tensors():
    # fake tensors (CUDA ones on a CUDA machine): this shape costs no memory and little time
    b, t, v = 4, 512, 32000
    grad_bytes = b * t * v * 2
    fused = Case("policy_loss", "grpo", "fwd_bwd", b, t, v, "bf16")
    peak, how = model_peak("fused_rl", fused)
    assert how == "modelled" and grad_bytes <= peak <= 1.01 * grad_bytes
    eager = Case("token_logprobs", "logp", "fwd_bwd", b, t, v, "bf16")
    peak, _ = model_peak("eager", eager)
    # fp32 upcast + fp32 log_softmax kept for backward + backward temporaries
    assert peak == pytest.approx(12 * b * t * v, rel=0.01)
    nograd = Case("token_logprobs", "logp", "fwd_nograd", b, t, v, "bf16")
    assert model_peak("fused_rl", nograd)[0] < 1e-3 * grad_bytes  # per-token stats only
    assert model_peak("compile", nograd)[0] is None


def test_memory_command_cpu(capsys):
    """``--device=cpu`` models (a CUDA machine would measure), fused_rl included."""
    argv = ["memory", "--device=cpu", "--vocab=32000", "--tokens=256", "--dtype=bf16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "MODELLED" in out
    assert "policy_loss[grpo] fwd_bwd" in out and "eager" in out and "fused_rl" in out
    fused = [line for line in out.splitlines() if line.split()[2:3] == ["fused_rl"]]
    assert fused and all(line.endswith("modelled") for line in fused), fused


@pytest.mark.no_poison
def test_host_command_prints_every_row(capsys):
    """``bench/run.py host``: a row per call with us/call, x eager, launches, fused_rl
    functions and dispatcher ops (Liger: a row either way, measured or saying why not)."""
    from bench import host

    assert main(["host", "--repeat=2", "--number=2"]) == 0
    out = capsys.readouterr().out
    assert "Host cost per call, B=2 T=8 V=64" in out
    rows = {name: line for line in out.splitlines() for name, label in host.CALLS.items()
            if line.startswith(label)}  # fmt: skip
    assert set(rows) == set(host.CALLS), out
    cells = {name: rows[name][len(host.CALLS[name]) :].split() for name in rows}
    for name in ("policy_loss", "token_logprobs", "eager"):
        us, ratio, launches, frames, ops = cells[name][:5]
        assert float(us) > 0 and float(ratio) > 0 and int(launches) > 0, rows[name]
        assert int(frames) >= 0 and int(ops) > 0, rows[name]
    assert cells["eager"][1] == "1.00" and cells["eager"][3] == "0"  # no fused_rl code
    # the token-local variants cost what PPO-clip costs: the same launches and ops per call
    ppo = cells["policy_loss"]
    for name in ("policy_loss_cispo", "policy_loss_is"):
        assert (cells[name][2], cells[name][4]) == (ppo[2], ppo[4]), (rows[name], ppo)


def test_suites_and_filters():
    full = full_cases()
    logits = {(c.tokens, c.vocab) for c in full if c.op == "policy_loss" and c.dtype == "bf16"}
    for n in (4096, 16384, 32768):
        for v in (32000, 128256, 151936, 262144):
            assert (n, v) in logits
    assert {(c.batch, c.seqlen) for c in full if c.op == "gae"} == {
        (b, t) for b in (64, 512) for t in (1024, 8192)
    }
    assert any(c.seqlen == 4096 for c in full) and any(c.dtype == "fp32" for c in full)
    picked = select_cases("quick", ["policy_loss"], [64], [333], ["fp32"])
    assert picked and all(
        (c.op, c.tokens, c.vocab, c.dtype) == ("policy_loss", 64, 333, "fp32") for c in picked
    )
    with pytest.raises(ValueError, match="--op"):
        select_cases("quick", ["nope"])
    with pytest.raises(ValueError, match="--dtype"):
        select_cases("quick", None, None, None, ["fp8"])


@pytest.mark.parametrize(
    "op, variant", [("token_logprobs", "logp+entropy"), ("policy_loss", "grpo+entropy")]
)
def test_benchmark_reference_path(benchmark, op, variant):
    """CPU timing of fused_rl's reference (CPU fallback) path; parity with eager asserted."""
    case = Case(op, variant, "fwd_bwd", 2, 64, 4096, "fp32")
    inp = make_inputs(case, "cpu")
    run = P.build("fused_rl_ref", case, inp)
    out = benchmark(run)
    expected = P.build("eager", case, inp)()
    for name, a, b in zip(P.output_names(case), out, expected):
        assert rel_err(a, b) < 1e-5, name


def test_gpu_report_renders(tmp_path):
    """The GPU-only parts of the report (targets, GB/s columns, plots) on synthetic records
    (made-up numbers for a made-up device: a rendering check, not a measurement)."""
    from bench import console as C
    from bench import report as R
    from bench.run import _record

    meta = {
        "device": {"name": "synthetic-device", "copy_gbps": 1000.0},
        "versions": {"torch": "x", "triton": "y", "fused_rl": "z"},
        "date": "today",
        "suite": "full",
    }
    records = []
    for vocab in (128256, 151936):
        for op, variant, mode in (
            ("policy_loss", "grpo", "fwd_bwd"),
            ("token_logprobs", "logp", "fwd_nograd"),
        ):
            case = Case(op, variant, mode, 16, 1024, vocab, "bf16")
            for provider, ms, mb in (("fused_rl", 1.0, 10.0), ("eager", 6.0, 60.0)):
                rec = _record(case, provider, ms=ms, ms_p20=ms, ms_p80=ms, peak_mb=mb)
                rec["gbps"] = rec["bytes"] / (ms * 1e-3) / 1e9
                rec["pct_copy"] = rec["gbps"] / 10.0
                records.append(rec)
    gae = Case("gae", "g", "fwd_nograd", 64, 1024, None, "fp32")
    records += [_record(gae, "fused_rl", ms=1.0), _record(gae, "eager", ms=150.0)]
    R.add_ratios(records, gpu=True)
    fused = next(r for r in records if r["provider"] == "fused_rl" and r["op"] == "policy_loss")
    assert fused["speedup_vs"]["eager"] == 6.0 and fused["memory_ratio_vs"]["eager"] == 6.0
    R.write_markdown(str(tmp_path / "results.md"), meta, records, [])
    text = (tmp_path / "results.md").read_text()
    assert "## Targets (issue 6)" in text and "6.00x vs eager (>= 5.0x: met)" in text
    assert "150x vs the seed's loop (>= 100x: met)" in text
    for use_rich in (False, True) if C.have_rich() else (False,):
        table = C.table_text(records, gpu=True, use_rich=use_rich)
        assert "6.00" in table and "x fused" in table and "GB/s" in table
    assert len(R.write_plots(str(tmp_path), records, meta)) in (0, 2)  # 0 without matplotlib


def test_linear_cases_build():
    """The linear ops' cases: quick (H = 16, tiny, an odd V too) and full (H = 4096 on the
    bf16 token x vocab grid of the logits ops); their inputs, outputs and providers."""
    from bench.cases import CLIP_MARGIN, HIDDEN, LINEAR_OPS

    quick = select_cases("quick", list(LINEAR_OPS))
    assert {(c.op, c.variant, c.mode) for c in quick} == {
        ("linear_token_logprobs", "logp", "fwd_nograd"),
        ("linear_token_logprobs", "logp", "fwd_bwd"),
        ("linear_token_logprobs", "stats", "fwd_nograd"),
        ("linear_policy_loss", "grpo", "fwd_bwd"),
    }
    assert {c.hidden for c in quick} == {HIDDEN["quick"]} and any(c.vocab % 2 for c in quick)
    full = [c for c in full_cases() if c.op in LINEAR_OPS]
    grid = {(c.tokens, c.vocab) for c in full_cases() if c.op == "policy_loss" and c.dtype == "bf16"
            and c.seqlen == 1024}  # fmt: skip
    assert {(c.tokens, c.vocab) for c in full if c.dtype == "bf16"} == grid
    assert {c.hidden for c in full} == {4096} and "H4096" in full[0].label()
    for case in quick[:3]:
        inp = make_inputs(case, "cpu")
        b, t, v, h = case.batch, case.seqlen, case.vocab, case.hidden
        assert inp["hidden"].shape == (b, t + 1, h) and inp["weight"].shape == (v, h)
        assert inp["hidden"].dtype == case.torch_dtype == inp["weight"].dtype
        assert inp["hidden"].requires_grad == (case.mode == "fwd_bwd")
        for provider in ("fused_rl_ref", "eager"):
            out = P.build(provider, case, inp)()
            names = P.output_names(case)
            assert len(out) == len(names) and out[0].shape == (() if "loss" in names else (b, t))
            if case.mode == "fwd_bwd":
                assert out[-2].shape == (b, t + 1, h) and out[-1].shape == (v, h)
        # TRL's and verl's fused heads: measured where the package is installed (on the
        # tests' device: TRL's head is Triton)
        for provider, module in (("trl", "trl.kernels.chunked_logprob"), ("verl", "verl")):
            if importlib.util.find_spec(module.split(".")[0]) is None:
                with pytest.raises(P.Unavailable, match=module):
                    P.build(provider, case, inp)
            else:
                got = P.build(provider, case, make_inputs(case, DEVICE))()
                assert got[0].shape == out[0].shape
        if P.liger_version() is None:
            with pytest.raises(P.Unavailable):
                P.build("liger", case, inp)
    # the policy case's log-ratios stay CLIP_MARGIN away from the clip boundaries
    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 8, 64, 50, "fp32", hidden=8)
    inp = make_inputs(case, "cpu")
    logp = fused_rl.linear_token_logprobs(inp["hidden"].detach(), inp["weight"].detach(),
                                          inp["targets"], backend="reference")  # fmt: skip
    log_ratio = logp - inp["old_logprobs"]
    for bound in (math.log(0.8), math.log(1.28)):
        assert (log_ratio - bound).abs().min() > 0.99 * CLIP_MARGIN


def test_linear_memory_model():
    """fused_rl's linear ops never hold the (N, V) logits (one chunk of them, and on
    CPU an fp32 copy of its gradient for dW); eager materialises them in fp32, more than
    twice over."""
    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 32, 1024, 32000, "bf16", hidden=256)
    logits = case.tokens * case.vocab * 2
    fused, how = model_peak("fused_rl", case)
    assert how == "modelled" and fused < 0.5 * logits
    assert model_peak("eager", case)[0] > 2 * logits
    assert M.bytes_moved(case) == 3 * (case.tokens + 32000) * 256 * 2
    assert M.gemm_flops(case) == 3 * 2 * case.tokens * 32000 * 256


def test_linear_memory_model_with_torch_211_addmm(monkeypatch):
    """The model of fused_rl's dW GEMM (``addmm(out_dtype=fp32, out=dW)``) does not rest on
    torch's fake-tensor implementation of that op: torch 2.11's, replayed here (``aten.addmm``'s
    decomposition, which takes ``out_dtype`` for ``beta``), fails, and the model is unchanged
    (on the H200, torch 2.11, it had switched fused_rl to the CPU's path: 1,146,542,084 bytes
    for this case; ``bench/memory_profile.py::FakeAddmmOutDtype``)."""
    from torch._decomp import decomposition_table, decompositions
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 32, 1024, 32000, "bf16", hidden=256)
    want = model_peak("fused_rl", case)
    monkeypatch.setitem(decomposition_table, torch.ops.aten.addmm.dtype_out, decompositions.addmm)
    with FakeTensorMode():
        acc = torch.zeros(5, 3)
        a, b = torch.ones(5, 2, dtype=torch.bfloat16), torch.ones(2, 3, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="torch.dtype"):
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    assert model_peak("fused_rl", case) == want


def test_memory_model_pins_the_gemm_path():
    """The modelled path of fused_rl's wide GEMMs is the one asked for (``gemm_out_dtype``),
    whatever this process found out before about ``out_dtype`` (``_wide_gemm._MM_OUT_DTYPE``,
    keyed by device type and GEMM); the CPU's path (fp32 copies of the operands) costs
    more than the GPU's at this shape; the process's table is left as it was."""
    from fused_rl import _wide_gemm

    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 2, 256, 4099, "bf16", hidden=64)
    keys = [(device, gemm) for device in ("cpu", "cuda") for gemm in ("mm", "addmm")]
    table, saved = _wide_gemm._MM_OUT_DTYPE, dict(_wide_gemm._MM_OUT_DTYPE)
    try:
        peaks = set()
        for found in (None, False, True):  # nothing found out yet, no out_dtype, out_dtype
            table.clear()
            if found is not None:
                table.update(dict.fromkeys(keys, found))
            before = dict(table)
            peaks.add((model_peak("fused_rl", case)[0],
                       model_peak("fused_rl", case, gemm_out_dtype_path=False)[0]))  # fmt: skip
            assert table == before
        ((gpu, cpu),) = peaks
        assert cpu > gpu
    finally:
        table.clear()
        table.update(saved)


@pytest.mark.parametrize(
    ("op", "variant", "per_token"),
    [("linear_policy_loss", "grpo", 8), ("linear_token_logprobs", "logp", 16)],
)
def test_linear_memory_flat_in_sequence_length(op, variant, per_token):
    """One sequence of 4K, 16K and 64K tokens x 151936 x H = 4096, bf16, forward and
    backward, modelled (fake tensors: no memory): the peak is ``6 V H`` (``dW`` in fp32, and
    its bf16 cast for a moment) plus, per token, ``dH`` (``2 H`` bytes) and a few fp32
    per-token statistics (the policy loss's partials are freed before the cast: two
    floats a token left); nothing else grows with the sequence (no chunk of the logits
    scales with it). At 65536 tokens: 4.27 GB for the policy loss."""
    vocab, hidden = 151936, 4096
    peaks = {}
    for tokens in (4096, 16384, 65536):
        case = Case(op, variant, "fwd_bwd", 1, tokens, vocab, "bf16", hidden=hidden)
        peaks[tokens], how = model_peak("fused_rl", case)
        assert how == "modelled"
    for tokens, peak in peaks.items():
        fixed = peak - tokens * (2 * hidden + per_token)
        assert 0 <= fixed - 6 * vocab * hidden < 4096, (tokens, fixed)


# issue 14's shape: H = 4096, V = 151936, 16384 tokens (16 x 1024), bf16
BIG = dict(batch=16, seqlen=1024, vocab=151936, dtype="bf16", hidden=4096)


def test_linear_memory_model_at_issue_14_shape():
    """The fused-linear memory model at H = 4096, V = 151936, 16K tokens, term by term
    (``bench/memory_profile.py``'s docstring): the chunked op holds the hidden rows' copy and
    dH (N*H each), dW in fp32 and, on a GPU, the fp32 (V, H) product of one chunk's
    ``dz^T h`` (8*V*H together) and one chunk's logits; the materialised fused path the
    (B, T+1, V) logits and their gradient; Liger its source model; the README's modelled
    figures are these."""
    from bench.memory_profile import liger_linear_model_bytes
    from fused_rl.linear import default_chunk_tokens

    case = Case("linear_policy_loss", "grpo", "fwd_bwd", **BIG)
    n, v, h, b, t = case.tokens, case.vocab, case.hidden, case.batch, case.seqlen
    chunk = default_chunk_tokens(v, torch.bfloat16, h)
    # the GPU's dW path (torch.mm / addmm(out_dtype=fp32): no (V, H) temporary): the peak is
    # dW in fp32 with its cast to bf16; the CPU's (fp32 copies of the chunk's dz and rows):
    # dW in fp32 beside the chunk's bf16 logits, their fp32 copy and the rows' fp32 copy
    gpu, how = model_peak("fused_rl", case)
    assert how == "modelled"
    assert gpu == pytest.approx(2 * n * h * 2 + 6 * v * h, rel=2e-3)
    cpu = model_peak("fused_rl", case, gemm_out_dtype_path=False)[0]
    assert cpu == pytest.approx(2 * n * h * 2 + 4 * v * h + chunk * (6 * v + 4 * h), rel=1e-3)
    # one chunk's logits (2048 rows): under a bf16 head's size, so not the peak
    assert chunk == 2048 and chunk * v * 2 <= 2 * v * h
    mat, how = model_peak("fused_rl_mat", case)
    assert how == "modelled" and mat == pytest.approx(2 * b * (t + 1) * v * 2, rel=2e-3)
    liger, how = model_peak("liger", case)
    assert how.startswith("modelled from Liger") and liger == liger_linear_model_bytes(case)
    assert liger == pytest.approx(8 * v * h + n * h * 2, rel=2e-2)
    token = Case("linear_token_logprobs", "logp", "fwd_bwd", **BIG)
    assert model_peak("fused_rl", token)[0] == pytest.approx(gpu, rel=2e-3)
    assert model_peak("liger", token)[0] is None
    # what README.md states as the model's (GiB, one decimal; the ratio to two); its Liger
    # and eager figures are the H200's measurements (MB), not the model's
    stated = f"{mat / gpu:.2f}× less ({gpu / 2**30:.1f} GiB against {mat / 2**30:.1f} GiB"
    assert stated in " ".join(_readme_bench_section().split()), stated


def _readme_bench_section() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    start = text.index("## Benchmarks")
    end = text.find("\n## ", start + 1)  # the last section: to the end of the file
    return text[start:] if end < 0 else text[start:end]


def _profiled_peak(run) -> int:
    """Peak bytes of one ``run()`` on real CPU tensors by torch.profiler's memory timeline
    (allocations and frees the CPU allocator saw), independent of the model's storage
    count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # fmt: skip
        out = run()
        del out
    if not hasattr(prof, "_memory_profile"):
        pytest.skip("this torch.profiler has no memory timeline")
    from torch.profiler._memory_profiler import Action

    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


@pytest.mark.no_poison
@pytest.mark.parametrize("op, variant", [("linear_policy_loss", "grpo"),
                                         ("linear_token_logprobs", "logp")])  # fmt: skip
def test_memory_model_matches_profiler_on_cpu(op, variant):
    """The model (fake tensors) against a measurement: the same providers on real CPU
    tensors, Triton launches stubbed (they allocate nothing), peak from torch.profiler's
    memory timeline. fused_rl's dW GEMM is modelled on the CPU's path here (no
    ``addmm(out_dtype=)`` on CPU); forward + backward, outputs included."""
    from fused_rl.profiling import stub_kernels

    if not fused_rl._backend.interpreter_enabled():
        pytest.skip(
            "measures fused_rl's Triton path (its launchers' allocations, kernels stubbed) on "
            "CPU tensors, which backend='triton' accepts only with the Triton interpreter on; "
            "this process runs Triton compiled (a CUDA machine)"
        )
    case = Case(op, variant, "fwd_bwd", 2, 256, 4099, "bf16", hidden=16)
    saved = fused_rl.config.check_values, fused_rl.config.skip_padding_rows
    fused_rl.config.check_values = False
    try:
        for provider in ("fused_rl", "fused_rl_mat", "eager"):
            modelled, how = model_peak(provider, case, gemm_out_dtype_path=False)
            assert how == "modelled"
            # the model runs every row (which rows count is data, absent from fake tensors):
            # exact for the run over all rows, an upper bound when padding rows are skipped
            for skip in (False, True):
                fused_rl.config.skip_padding_rows = skip
                inp = make_inputs(case, "cpu")
                run = P.build(provider, case, inp)
                with stub_kernels():
                    run()  # warm-up: lazy one-time state out of the measured call
                    measured = _profiled_peak(run)
                if skip:
                    assert measured <= modelled, provider
                else:
                    assert modelled == pytest.approx(measured, rel=1e-3, abs=4096), provider
    finally:
        fused_rl.config.check_values, fused_rl.config.skip_padding_rows = saved


@pytest.mark.no_poison
def test_liger_linear_model_matches_its_code(monkeypatch):
    """``liger_linear_model_bytes`` (read from Liger 0.8.5's source) against Liger's real
    ``LigerFusedLinearGRPOLoss`` on CPU tensors, peak from torch.profiler; shapes that make
    the logits blocks (two vocab blocks, the last narrow), then the fp32 weight gradient's
    cast, the peak. Its loss math is not compiled here (a per-token expression: no memory
    that counts, and minutes of compile on CPU)."""
    if P.liger_version() is None:
        pytest.skip("liger_kernel is not importable")
    import functools

    from liger_kernel import chunked_loss

    from bench.memory_profile import liger_linear_model_bytes

    init = chunked_loss.LigerFusedLinearGRPOLoss.__init__

    @functools.wraps(init)
    def uncompiled(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "compiled": False})

    monkeypatch.setattr(chunked_loss.LigerFusedLinearGRPOLoss, "__init__", uncompiled)
    for shape in ((2, 300, 5000, 64), (3, 256, 8000, 512)):
        b, t, v, h = shape
        case = Case("linear_policy_loss", "grpo", "fwd_bwd", b, t, v, "bf16", hidden=h)
        inp = make_inputs(case, "cpu")
        run = P.build("liger", case, inp)
        run()
        measured = _profiled_peak(run)
        assert liger_linear_model_bytes(case) == pytest.approx(measured, rel=5e-3), shape


def test_memory_vs_tokens_plot_cpu(tmp_path, capsys):
    """``bench/run.py memory``: the fused-linear ops' peak memory against tokens, MODELLED
    on CPU (a CUDA machine measures), a line per provider (chunked fused_rl, materialised
    fused, materialised eager, Liger from its source), as JSON and a plot in ``--out``;
    ``report`` draws the plot again from the JSON."""
    out = tmp_path / "mem"
    argv = ["memory", "--device=cpu", "--op=linear_policy_loss", "--vocab=151936",
            "--tokens=1024,2048", "--dtype=bf16", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "MODELLED" in text and "memory_vs_tokens.json" in text
    doc = json.loads((out / "memory_vs_tokens.json").read_text())
    assert "modelled" in doc["memory_kind"] and doc["device"]["name"] == "cpu"
    rows = doc["records"]
    assert {(r["tokens"], r["provider"]) for r in rows} == {
        (n, p) for n in (1024, 2048) for p in ("fused_rl", "fused_rl_mat", "eager", "liger")
    }
    assert {(r["op"], r["hidden"]) for r in rows} == {("linear_policy_loss", 4096)}
    assert all(r["peak_mb"] > 0 and r["how"].startswith("modelled") for r in rows)
    peak = {(r["tokens"], r["provider"]): r["peak_mb"] for r in rows}
    assert peak[2048, "eager"] > 1.9 * peak[1024, "eager"]  # it grows with the logits
    assert peak[2048, "fused_rl"] < 1.05 * peak[1024, "fused_rl"]  # it does not
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: no plot")
    from bench.report import memory_plot_name

    png = out / memory_plot_name("bf16")
    assert png.stat().st_size > 10_000
    png.unlink()
    assert main(["report", "--out", str(out)]) == 0
    assert png.exists()


@pytest.mark.no_poison
def test_fused_materialised_provider(device):
    """``fused_rl_mat`` (F.linear to the whole logits buffer, then fused_rl's logits op, its
    Triton path: on the suite's device): the linear ops only (no note elsewhere), within
    fused_rl's tolerance of float64."""
    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 2, 4, 1000, "bf16", hidden=16)
    skipped: list = []
    recs = run_case(case, _args(providers=["fused_rl_mat"]), device, None, skipped,
                    ["fused_rl_mat"])  # fmt: skip
    assert [r["verdict"] for r in recs] == ["ok"] and not skipped
    tokens = Case("linear_token_logprobs", "logp", "fwd_bwd", 2, 4, 4099, "bf16", hidden=16)
    recs = run_case(tokens, _args(providers=["fused_rl_mat"]), device, None, skipped,
                    ["fused_rl_mat"])  # fmt: skip
    assert [r["verdict"] for r in recs] == ["ok"] and not skipped
    logits = Case("policy_loss", "grpo", "fwd_bwd", 2, 4, 1000, "bf16")
    assert not P.applies("fused_rl_mat", logits)
    assert run_case(logits, _args(providers=["fused_rl_mat"]), "cpu", None, skipped,
                    ["fused_rl_mat"]) == [] and not skipped  # fmt: skip


def test_linear_targets_render(tmp_path):
    """Issue 14's targets in results.md from synthetic GPU records (made-up numbers for a
    made-up device: a rendering check, not a measurement)."""
    from bench import report as R
    from bench.run import _record

    meta = {
        "device": {"name": "synthetic-device", "copy_gbps": 1000.0, "matmul_tflops": 800.0},
        "versions": {"torch": "x"},
        "date": "today",
        "suite": "full",
    }
    case = Case("linear_policy_loss", "grpo", "fwd_bwd", **BIG)
    records = []
    for provider, ms, mb in (("fused_rl", 10.0, 1000.0), ("fused_rl_mat", 10.0, 9000.0),
                             ("liger", 20.0, 5000.0)):  # fmt: skip
        rec = _record(case, provider, ms=ms, ms_p20=ms, ms_p80=ms, peak_mb=mb)
        rec["tflops"] = M.gemm_flops(case) / (ms * 1e-3) / 1e12
        rec["pct_matmul"] = 100 * rec["tflops"] / 800.0
        records.append(rec)
    R.add_ratios(records, gpu=True)
    R.write_markdown(str(tmp_path / "results.md"), meta, records, [])
    text = (tmp_path / "results.md").read_text()
    assert "## Targets (issue 14, fused linear)" in text
    assert "time 1.00x the materialised fused path's (<= 1.1x: met)" in text
    assert "peak 1/9.00 of the materialised fused path's (<= 1/8 at 16K tokens: met)" in text
    assert "2.00x vs Liger's chunked GRPO (>= 1.5x: met)" in text
    pct = records[0]["pct_matmul"]
    verdict = "met" if pct >= 70 else "MISSED"
    assert f"GEMM work at {pct:.0f}% of torch.matmul's bf16 rate" in text and verdict in text


# ----------------------------------------------------------------------------- distillation

BETAS = ("fkl", "jsd", "rkl")
# the trainers' shape of the distill suite: 8 x 2048 tokens x 151936 (Qwen's vocabulary)
DISTILL_BIG = dict(batch=8, seqlen=2048, vocab=151936, dtype="bf16")


def test_distill_suite_and_cases():
    """``--suite distill``: both GKD ops, every beta, and verl's top-k forward KL (K = 128),
    bf16 forward + backward, 8 x 2048 x 151936 first (H = 4096 from hidden states),
    torch.compile on that shape of the logits ops only; the quick suite holds the ops on CPU
    shapes; a new grid keeps to the suite's ops; the byte and GEMM counts of
    bench/measure.py."""
    from bench.cases import DISTILL_OPS, DISTILL_PROVIDERS

    cases = select_cases("distill")
    want = {(op, v) for op in DISTILL_OPS[:2] for v in BETAS} | {("topk_distill_loss", "k128")}
    assert {(c.op, c.variant) for c in cases} == want
    assert {(c.mode, c.dtype) for c in cases} == {("fwd_bwd", "bf16")}
    big = {(c.op, c.batch, c.seqlen, c.vocab) for c in cases}
    assert {(op, 8, 2048, 151936) for op in DISTILL_OPS} <= big
    assert (cases[0].batch, cases[0].seqlen, cases[0].vocab) == (8, 2048, 151936)
    assert {c.hidden for c in cases if c.op == "linear_distill_loss"} == {4096}
    assert {(c.op, c.tokens, c.vocab) for c in cases if c.compile_ok} == {
        ("distill_loss", 16384, 151936),
        ("topk_distill_loss", 16384, 151936),
    }
    quick = select_cases("quick", list(DISTILL_OPS))
    assert {(c.op, c.variant) for c in quick} == want
    assert {c.dtype for c in quick} == {"bf16", "fp32"} and max(c.tokens for c in quick) <= 8
    grid = select_cases("distill", tokens=[4096], vocabs=[32000])
    assert {c.op for c in grid} == set(DISTILL_OPS) and {c.tokens for c in grid} == {4096}
    assert set(DISTILL_PROVIDERS) <= set(P.PROVIDERS)
    assert not P.applies("trl", cases[0]) and not P.applies("verl", cases[0])
    topk = next(c for c in cases if c.op == "topk_distill_loss")
    assert P.applies("verl", topk) and not P.applies("trl", topk)
    assert M.bytes_moved(topk) == 4 * topk.tokens * topk.vocab * 2
    linear = next(c for c in cases if c.op == "linear_distill_loss")
    assert P.applies("fused_rl_mat", linear) and not P.applies("fused_rl_mat", cases[0])
    n, v, h = linear.tokens, linear.vocab, linear.hidden
    assert M.bytes_moved(cases[0]) == 5 * cases[0].tokens * cases[0].vocab * 2
    assert M.bytes_moved(linear) == 4 * (n + v) * h * 2
    assert M.gemm_flops(linear) == 4 * 2 * n * v * h and M.gemm_flops(cases[0]) is None


def _liger_stand_in(monkeypatch):
    """Liger's JSD modules, or where ``liger_kernel`` is not importable fused_rl.compat.liger's
    (Liger 0.8.5's signatures and math, tested against Liger in tests/test_compat_liger.py)."""
    if P.liger_version() is not None:
        return
    from fused_rl.compat import liger

    monkeypatch.setattr(P, "liger_version", lambda: "0.8.5 (fused_rl.compat.liger stand-in)")
    monkeypatch.setattr(P, "_liger_import", lambda module, name: getattr(liger, name))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("op", ["distill_loss", "linear_distill_loss"])
def test_distill_providers_meet_the_oracle(op, dtype, device, monkeypatch):
    """Every beta through fused_rl's Triton path (CUDA, or the interpreter on a CPU-only
    machine), its reference, eager (TRL's computation), the materialised path (from hidden
    states) and Liger's JSD modules, against the float64 oracle, on the suite's device."""
    _liger_stand_in(monkeypatch)
    providers = ["fused_rl", "fused_rl_ref", "eager", "liger"]
    providers += ["fused_rl_mat"] if op == "linear_distill_loss" else []
    hidden = 16 if op == "linear_distill_loss" else None
    for variant in BETAS:
        case = Case(op, variant, "fwd_bwd", 2, 8, 1000, dtype, hidden=hidden)
        verdicts = _verdicts(case, make_inputs(case, device), providers)
        assert set(verdicts.values()) == {"ok"}, (variant, verdicts)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trl_linear_distill_meets_the_oracle(dtype, device):
    """TRL's chunked divergence from hidden states (``DistillationTrainer``'s, TRL >= 1.16)
    as the ``trl`` provider of ``linear_distill_loss``: every beta against the float64
    oracle where TRL imports, else ``Unavailable`` naming the module; never beside the
    distillation ops from logits."""
    for variant in BETAS:
        case = Case("linear_distill_loss", variant, "fwd_bwd", 2, 8, 1000, dtype, hidden=16)
        assert P.applies("trl", case)
        inp = make_inputs(case, device)
        if importlib.util.find_spec("trl") is None:
            with pytest.raises(P.Unavailable, match="trl.kernels.chunked_divergence"):
                P.build("trl", case, inp)
            continue
        assert _verdicts(case, inp, ("trl",)) == {"trl": "ok"}, variant
    assert not P.applies("trl", Case("distill_loss", "jsd", "fwd_bwd", 2, 8, 1000, dtype))


def test_distill_beta_is_its_own_math(monkeypatch):
    """The variant's beta matters: fused_rl run with the JSD's beta fails the oracle of the
    forward and of the reverse KL, so neither side can fall back to one divergence."""
    original = P._distill_kwargs
    monkeypatch.setattr(P, "_distill_kwargs", lambda inp, variant: original(inp, "jsd"))
    for op, hidden in (("distill_loss", None), ("linear_distill_loss", 16)):
        for variant in ("fkl", "rkl"):
            case = Case(op, variant, "fwd_bwd", 2, 8, 1000, "fp32", hidden=hidden)
            verdict = _verdicts(case, make_inputs(case, "cpu"), ("fused_rl_ref",))["fused_rl_ref"]
            assert verdict.startswith("FAIL"), (op, variant, verdict)


def test_linear_distill_oracle_definitions():
    """From bf16 hidden states the oracle holds the loss of the exact logits and of the logits
    rounded to bf16 (``bench/oracle.py`` ``LOGITS_DEFINITIONS``). fused_rl's reference (bf16
    logits from ``F.linear``, by the op's definition) matches the second; the same loss on
    fp32 logits (what Liger's fused JSD forms on a GPU) matches the first; each fails the
    other's, so neither definition alone could judge both. fp32 heads: one definition."""
    from bench import accuracy as A
    from bench.oracle import Oracle

    case = Case("linear_distill_loss", "jsd", "fwd_bwd", 2, 8, 1000, "bf16", hidden=16)
    inp = make_inputs(case, "cpu")
    oracle = Oracle(case, inp)
    names = P.output_names(case)
    (exact_label, exact), (rounded_label, rounded) = oracle.definitions
    rounded_out = P.build("fused_rl_ref", case, inp)()

    def fp32_logits():
        hidden, weight = inp["hidden"], inp["weight"]
        logits = torch.nn.functional.linear(hidden.float(), weight.float())
        teacher = torch.nn.functional.linear(inp["teacher_hidden"].float(),
                                             inp["teacher_weight"].float())  # fmt: skip
        loss = P.eager_distill_loss(logits, teacher, inp["mask"], "jsd")[0]
        return (loss.detach(), *torch.autograd.grad(loss, [hidden, weight]))

    exact_out = fp32_logits()
    for out, label in ((rounded_out, rounded_label), (exact_out, exact_label)):
        judged = A.judge("x", "bf16", oracle.compare_all(names, out))
        assert judged["verdict"] == "ok" and oracle.matched == label, (label, judged)
    for out, values in ((rounded_out, exact), (exact_out, rounded)):
        oracle.values = values
        comps = {name: oracle.compare(name, o) for name, o in zip(names, out)}
        assert A.judge("x", "bf16", comps)["status"] == "wrong"
    fp32 = Case("linear_distill_loss", "jsd", "fwd_bwd", 2, 8, 1000, "fp32", hidden=16)
    single = Oracle(fp32, make_inputs(fp32, "cpu"))
    assert [label for label, _ in single.definitions] == [exact_label]


def test_linear_policy_oracle_definitions():
    """The policy loss from bf16 hidden states has the two definitions too: a target logit's
    rounding to bf16 moves its log-prob and so scales the token's whole gradient row through
    the ratio (on an H200: one row 2.2% off its own norm at 16384 tokens, a FAIL for every
    provider against the exact logits). With logits of deviation ~16, where that rounding is
    large, fused_rl's reference (bf16 logits from ``F.linear``) matches the rounded logits
    and fails the exact ones' row check; a token whose target logit would round either way
    in an fp32-accumulating GEMM (``rounding_ambiguous64``) is left out of the hidden rows."""
    from bench import accuracy as A
    from bench.cases import _away_from_clip, _linear_logprobs
    from bench.oracle import Oracle, rounding_ambiguous64

    case = Case("linear_policy_loss", "grpo", "fwd_bwd", 2, 24, 300, "bf16", hidden=16)
    inp = make_inputs(case, "cpu")
    with torch.no_grad():
        inp["weight"].mul_(8.0)
    logp = _linear_logprobs(inp["hidden"].detach(), inp["weight"].detach(), inp["targets"])
    noise = 0.1 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    inp["old_logprobs"] = logp - _away_from_clip(noise)
    oracle = Oracle(case, inp)
    names = P.output_names(case)
    (exact_label, exact), (rounded_label, _) = oracle.definitions
    out = P.build("fused_rl_ref", case, inp)()
    judged = A.judge("x", "bf16", oracle.compare_all(names, out))
    assert judged["verdict"] == "ok" and oracle.matched == rounded_label, judged
    oracle.values = exact
    comps = {name: oracle.compare(name, o) for name, o in zip(names, out)}
    assert A.judge("x", "bf16", comps)["status"] == "wrong"
    # the ambiguity test: a logit at a bf16 midpoint (1 + 2^-8) is, one 4 fp32 spreads
    # off it is not, and below |z| = 1 none is
    hidden = torch.zeros(1, 2, 4, dtype=torch.float64)
    hidden[0, 0, 0] = 1.0
    weight = torch.zeros(3, 4, dtype=torch.float64)
    weight[0, 0], weight[1, 0], weight[2, 0] = 1 + 2**-8, 1 + 2**-8 + 2**-17, 0.5 + 2**-9
    spread = 4 * 2.0**-24 * 2  # sqrt(H) = 2, ||h * w|| ~ 1
    assert 2**-17 > spread
    got = [rounding_ambiguous64(hidden, weight, torch.tensor([[y]]), torch.bfloat16).item()
           for y in range(3)]  # fmt: skip
    assert got == [True, False, False]


def test_distill_quick_cli(tmp_path, device):
    """``bench/run.py --suite quick --op distill_loss,linear_distill_loss`` on a new grid
    (4 tokens x V 64, bf16): every beta and provider within the tolerance, the 16-bit
    linear rows naming the definition they matched."""
    out = tmp_path / "res"
    providers = "fused_rl,fused_rl_ref,eager,fused_rl_mat"
    argv = ["--suite=quick", f"--device={device}", "--op=distill_loss,linear_distill_loss",
            "--tokens=4", "--vocab=64", f"--providers={providers}", "--reps=1", "--no-plots",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    got = {(r["op"], r["variant"], r["provider"]) for r in records}
    want = {(op, v, p) for op in ("distill_loss", "linear_distill_loss") for v in BETAS
            for p in ("fused_rl", "fused_rl_ref", "eager")}  # fmt: skip
    want |= {("linear_distill_loss", v, "fused_rl_mat") for v in BETAS}
    assert got == want
    for r in records:
        assert r["verdict"] == "ok" and set(r["err"]) == set(P.output_names(Case(
            **{k: r[k] for k in CASE_FIELDS}, hidden=r["hidden"]))), r  # fmt: skip
        linear = r["op"] == "linear_distill_loss"
        assert ("bf16" in r["note"]) == linear, r


@pytest.mark.parametrize("variant", BETAS)
def test_distill_memory_model(variant):
    """distill_loss at 8 x 2048 x 151936 bf16, forward + backward, modelled (fake tensors):
    fused_rl holds the student's bf16 gradient (N V 2 bytes) and, per token, 4 bytes for
    each of its forward's partial columns and row statistics (``fused_rl.distill.COLUMNS``,
    ``N_STATS``), nothing else of size N V. The eager TRL-style loss holds fp32 (N, V)
    tensors: for a KL (beta 0, 1) five when the product ``exp(target) * (target - input)``
    is formed: both log-softmaxes, the exp of the target and the difference (what the
    product's backward keeps, or the operand being consumed) and the product; for the JSD
    thirteen: both log-softmaxes, the stacked (2, N, V) input of the mixture's logsumexp
    (kept for its backward) and the mixture, per KL term the exp of its target and the
    product (the student's term its difference too: both of its factors need grad), the two
    scaled terms and their sum. Per-token floats aside (at most 16 bytes a token)."""
    from fused_rl.distill import COLUMNS, N_STATS

    case = Case("distill_loss", variant, "fwd_bwd", **DISTILL_BIG)
    n, nv = case.tokens, case.tokens * case.vocab
    fused, how = model_peak("fused_rl", case)
    assert how == "modelled"
    assert 0 <= fused - (2 * nv + 4 * (len(COLUMNS) + N_STATS) * n) < 4096, fused
    eager, how = model_peak("eager", case)
    fp32_tensors = 13 if variant == "jsd" else 5
    assert how == "modelled" and 0 <= eager - fp32_tensors * 4 * nv < 16 * n, eager
    assert model_peak("compile", case)[0] is None  # measured on GPUs only


def _topk_inputs(dtype: str, device):
    """A small ``topk_distill_loss`` case whose student log-probs at the teacher's ids lie on
    both sides of the clamp (at V = 1000 none falls below -10 by chance): the student's logits
    at the last 32 of each row's 128 ids pushed 12 lower."""
    case = Case("topk_distill_loss", "k128", "fwd_bwd", 2, 8, 1000, dtype)
    inp = make_inputs(case, device)
    with torch.no_grad():
        inp["logits"].scatter_add_(-1, inp["teacher_topk_ids"][..., 96:],
                                   torch.full((2, 8, 32), -12.0, device=device,
                                              dtype=inp["logits"].dtype))  # fmt: skip
    student = torch.log_softmax(inp["logits"].detach().double(), -1)
    ls = student.gather(-1, inp["teacher_topk_ids"])
    assert bool((ls < TOPK_CLAMP).any()) and bool((ls > TOPK_CLAMP).any())
    return case, inp


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_topk_distill_providers_meet_the_oracle(dtype, device):
    """verl's top-k forward KL through fused_rl's adapter (Triton, or the interpreter on a
    CPU-only machine), the eager transcription of verl's default path and, where verl is
    installed, verl's own function, against the float64 oracle, with student log-probs on
    both sides of the clamp."""
    providers = ["fused_rl", "eager"]
    try:
        import verl.trainer.distillation.fsdp.losses  # noqa: F401

        providers.append("verl")
    except Exception:  # noqa: BLE001  (verl absent: its provider is the live check's)
        pass
    case, inp = _topk_inputs(dtype, device)
    verdicts = _verdicts(case, inp, providers)
    assert set(verdicts.values()) == {"ok"}, verdicts
    with pytest.raises(P.Unavailable, match="takes no backend"):
        P.build("fused_rl_ref", case, inp)
    with pytest.raises(P.Unavailable, match="no top-k distillation"):
        P.build("liger", case, inp)


def test_topk_distill_clamp_is_its_own_math(monkeypatch):
    """The oracle sees the clamp: fused_rl run with another ``log_prob_min_clamp`` (or none)
    fails it."""
    from types import SimpleNamespace

    case, inp = _topk_inputs("fp32", "cpu")
    for clamp in (-3.0, None):
        config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=clamp))
        monkeypatch.setattr(P, "_topk_config", lambda c=config: c)
        verdict = _verdicts(case, inp, ("fused_rl",))["fused_rl"]
        assert verdict.startswith("FAIL"), (clamp, verdict)


def test_topk_distill_memory_model():
    """topk_distill_loss at 8 x 2048 x 151936 bf16, K = 128, forward + backward, modelled:
    fused_rl holds the student's bf16 gradient (N V 2 bytes) and (N, K) per-id tensors (under
    96 bytes an id: indices, fp32 and fp64 running sums of the repeated-id pass); verl's
    default path (eager) its bf16 log-softmax, kept for the backward, the log-softmax's
    gradient and the logits' (3 N V 2) and per-token floats."""
    case = Case("topk_distill_loss", "k128", "fwd_bwd", **DISTILL_BIG)
    n, nv, k = case.tokens, case.tokens * case.vocab, 128
    fused, how = model_peak("fused_rl", case)
    assert how == "modelled" and 0 <= fused - 2 * nv < 96 * n * k, fused
    eager, how = model_peak("eager", case)
    assert how == "modelled" and 0 <= eager - 3 * nv * 2 < 512 * n, eager
    assert eager > 2.8 * fused


@pytest.mark.parametrize("op", ["linear_token_logprobs", "linear_distill_loss"])
def test_linear_forward_holds_one_chunk(op):
    """Without gradients the ops from hidden states hold ONE chunk's logits at a time (each
    chunk's buffer freed before the next chunk's GEMM), beside their per-token outputs and,
    for the log-probs, the ``(N, H)`` rows; modelled at 8 x 2048 x 151936, H = 4096, bf16."""
    from fused_rl.linear import chunk_rows

    vocab, hidden = 151936, 4096
    variant, logit_bytes = ("logp", 2) if op == "linear_token_logprobs" else ("fkl", 4)
    case = Case(op, variant, "fwd_nograd", 8, 2048, vocab, "bf16", hidden=hidden)
    peak, how = model_peak("fused_rl", case)
    assert how == "modelled"
    chunk = chunk_rows(vocab, logit_bytes, hidden)
    per_token = (peak - chunk * vocab * logit_bytes) / case.tokens
    rows = 2 * hidden if op == "linear_token_logprobs" else 0
    assert 0 <= per_token - rows <= 40, per_token


def test_linear_distill_memory_model():
    """linear_distill_loss at H = 4096 x 151936, bf16, beta 0, forward + backward, modelled:
    fused_rl's peak is dW in fp32 beside one chunk's logits of both models (2048 rows: as
    many bytes as dW's bf16 cast at the end) and the chunk's ``dz W``, plus per token dH
    (``2 H`` bytes) and a few fp32 (at most the docstring's ``4 (6 + 2)`` bytes), the same
    at 2 x 2048 and 8 x 2048 tokens: no logits chunk grows with them. The materialised path
    holds both models' bf16 logits and the student's gradient (``3 N V 2``), eager both bf16
    logits (one fp32 (N, V) unit) and the five fp32 tensors of the logits loss."""
    vocab, hidden = DISTILL_BIG["vocab"], 4096
    peaks = {}
    for batch in (2, 8):
        case = Case("linear_distill_loss", "fkl", "fwd_bwd", batch, 2048, vocab, "bf16",
                    hidden=hidden)  # fmt: skip
        peaks[case.tokens], how = model_peak("fused_rl", case)
        assert how == "modelled"
    (n1, p1), (n2, p2) = sorted(peaks.items())
    per_token = (p2 - p1) / (n2 - n1) - 2 * hidden
    assert 0 <= per_token <= 32, per_token
    from fused_rl.linear_distill import default_chunk_tokens

    chunk = default_chunk_tokens(vocab, torch.bfloat16, torch.bfloat16, hidden)
    assert chunk * vocab * 4 == 2 * vocab * hidden  # both chunks: dW's bf16 cast's bytes
    held = 4 * vocab * hidden + chunk * vocab * 4 + chunk * hidden * 2
    # and the chunk's per-row statistics and partials (12 fp32 a row)
    assert 0 <= p2 - n2 * (2 * hidden + per_token) - held <= 48 * chunk + 4096
    n, nv = case.tokens, case.tokens * vocab
    mat, how = model_peak("fused_rl_mat", case)
    assert how == "modelled" and 0 <= mat - 3 * nv * 2 < 64 * n, mat
    eager, how = model_peak("eager", case)
    assert how == "modelled" and 0 <= eager - 6 * nv * 4 < 16 * n, eager
    assert p2 < mat / 3


def _doc_section(heading: str) -> str:
    """docs/benchmarks.md's section under ``heading`` (to the next ``## ``)."""
    text = open(os.path.join(ROOT, "docs", "benchmarks.md")).read()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_distill_memory_figures_in_docs():
    """docs/benchmarks.md's Distillation table states the model's peaks at 8 x 2048 x 151936
    bf16 (H = 4096 from hidden states), each cell the model's bytes in GB to two decimals,
    and the exact bytes of what they consist of; it says they are modelled, not measured."""
    section = _doc_section("## Distillation")
    assert "modelled on CPU, not measured on a GPU" in " ".join(section.split())
    labels = {"fused_rl": "fused_rl", "fused_rl_mat": "materialised", "eager": "eager"}
    for op, providers, hidden in (("distill_loss", ("fused_rl", "eager"), None),
                                  ("linear_distill_loss", ("fused_rl", "fused_rl_mat", "eager"),
                                   4096)):  # fmt: skip
        for provider in providers:
            row = next(line for line in section.splitlines()
                       if line.startswith(f"| `{op}` | {labels[provider]} |"))  # fmt: skip
            cells = [c.strip() for c in row.strip("|").split("|")][2:]
            for variant, cell in zip(BETAS, cells, strict=True):
                case = Case(op, variant, "fwd_bwd", **DISTILL_BIG, hidden=hidden)
                peak = model_peak(provider, case)[0]
                assert cell == f"{peak / 1e9:.2f} GB", (op, provider, variant, peak, cell)
    n, v, h = 8 * 2048, DISTILL_BIG["vocab"], 4096
    for term in (2 * n * v, 5 * 4 * n * v, 13 * 4 * n * v, 4 * n * v, 6 * v * h, 2 * n * h,
                 3 * n * v * 2):  # fmt: skip
        assert f"{term:,}" in section, term


# ----------------------------------------------------------------------------- exact KL

FULL_KL = "grpo+fullkl"


def test_full_kl_suites_and_cases(monkeypatch):
    """``policy_loss[grpo+fullkl]``: the ``fullkl`` suite (bf16 forward + backward,
    8 x 2048 x 151936 first, torch.compile included), one case in ``peers`` (8 x 2048 x
    151936) and one in ``full`` (16384 x 151936 bf16), the quick suite's tiny CPU shapes;
    the inputs (the reference's buffer and its target log-probs); which providers apply and
    the byte count (five passes over the logits for every provider)."""
    from bench.cases import FULL_KL_PROVIDERS, REF_NOISE

    cases = select_cases("fullkl")
    assert {(c.op, c.variant, c.mode, c.dtype) for c in cases} == {
        ("policy_loss", FULL_KL, "fwd_bwd", "bf16")
    }
    assert (cases[0].batch, cases[0].seqlen, cases[0].vocab) == (8, 2048, 151936)
    assert len(cases) == 2 and all(c.compile_ok for c in cases)
    peers = [(c.batch, c.seqlen, c.vocab) for c in select_cases("peers") if c.variant == FULL_KL]
    assert peers == [(8, 2048, 151936)]
    full = [(c.batch, c.seqlen, c.vocab, c.dtype) for c in full_cases() if c.variant == FULL_KL]
    assert full == [(16, 1024, 151936, "bf16")]
    quick = [c for c in select_cases("quick", ["policy_loss"]) if c.variant == FULL_KL]
    assert {c.dtype for c in quick} == {"bf16", "fp32"} and max(c.tokens for c in quick) <= 8
    grid = select_cases("fullkl", tokens=[4096], vocabs=[32000])
    assert [(c.variant, c.tokens, c.vocab) for c in grid] == [(FULL_KL, 4096, 32000)]
    assert FULL_KL not in {c.variant for c in select_cases("quick", tokens=[4], vocabs=[64])}
    assert set(FULL_KL_PROVIDERS) <= set(P.PROVIDERS)

    case = Case("policy_loss", FULL_KL, "fwd_bwd", 2, 8, 1000, "bf16")
    inp = make_inputs(case, "cpu")
    ref, buf = inp["ref_buf"], inp["buf"]
    assert ref.shape == buf.shape and ref.dtype == torch.bfloat16
    assert inp["ref_logits"].data_ptr() == ref.data_ptr() and inp["ref_logits"].shape[1] == 8
    noise = (ref.float() - buf.float()).std().item()
    assert noise == pytest.approx(2.0 * REF_NOISE, rel=0.05)
    expected = torch.log_softmax(ref[:, :-1].float(), -1).gather(-1, inp["targets"][..., None])
    torch.testing.assert_close(inp["ref_logprobs"], expected[..., 0])
    grpo_inputs = make_inputs(Case("policy_loss", "grpo+is", "fwd_bwd", 2, 8, 1000, "bf16"), "cpu")
    for key in ("buf", "targets", "advantages", "old_logprobs", "mask"):  # drawn first, alike
        assert torch.equal(inp[key], grpo_inputs[key]), key

    assert P.applies("fused_rl_k3", case)
    assert not P.applies("fused_rl_k3", Case("policy_loss", "grpo", "fwd_bwd", 2, 8, 1000, "bf16"))
    assert P.applies("fused_rl_2pass", case) and P.applies("fused_rl_inplace", case)
    monkeypatch.setattr(P, "liger_version", lambda: "any")  # the reason, installed or not
    for provider in ("trl", "liger", "liger_inplace"):
        with pytest.raises(P.Unavailable, match="no exact KL"):
            P.build(provider, case, inp)
    big = cases[0]
    assert M.bytes_moved(big) == 5 * big.tokens * big.vocab * 2


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_kl_providers_meet_the_oracle(dtype, device):
    """The exact KL through fused_rl's Triton path (CUDA, or the interpreter on a CPU-only
    machine), its in-place and two-pass calls, the reference path and eager against the
    float64 oracle; ``fused_rl_k3`` against its own (GRPO with k3 on the same inputs), on the
    suite's device."""
    case = Case("policy_loss", FULL_KL, "fwd_bwd", 2, 8, 1000, dtype)
    providers = ("fused_rl", "fused_rl_ref", "fused_rl_k3", "eager", "fused_rl_inplace",
                 "fused_rl_2pass")  # fmt: skip
    verdicts = _verdicts(case, make_inputs(case, device), providers)
    assert set(verdicts.values()) == {"ok"}, verdicts


def test_full_kl_cli(tmp_path, device):
    """``bench/run.py --suite fullkl`` on a new grid (4 tokens x V 64, bf16): every provider
    of the suite that runs here within the tolerance of its oracle (the k3 row's note names
    its own), the byte count of five passes, a modelled peak per row on CPU."""
    out = tmp_path / "res"
    argv = ["--suite=fullkl", f"--device={device}", "--tokens=4", "--vocab=64",
            "--providers=fused_rl,fused_rl_ref,fused_rl_k3,eager", "--reps=1", "--no-plots",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert {(r["op"], r["variant"], r["provider"]) for r in records} == {
        ("policy_loss", FULL_KL, p) for p in ("fused_rl", "fused_rl_ref", "fused_rl_k3", "eager")
    }
    for r in records:
        assert r["verdict"] == "ok" and r["bytes"] == 5 * 4 * 64 * 2, r
        assert ("k3" in r["note"]) == (r["provider"] == "fused_rl_k3"), r
        assert (r["model_mb"] is not None) == (device == "cpu"), r
    assert "Exact KL (`policy_loss[grpo+fullkl]`)" in (out / "results.md").read_text()


def test_full_kl_is_its_own_math(device):
    """The exact KL matters and each oracle judges its own function: the k3 call's outputs
    fail the exact KL's oracle, the exact KL's fail k3's, and eager with the KL dropped
    fails too (fp32: the KL term is ~8% of the loss here)."""
    from bench import accuracy as A
    from bench.oracle import Oracle

    case = Case("policy_loss", FULL_KL, "fwd_bwd", 2, 8, 1000, "fp32")
    inp = make_inputs(case, device)
    oracle = Oracle(case, inp)
    names = P.output_names(case)
    k3 = P.build("fused_rl_k3", case, inp)()
    exact = P.build("fused_rl_ref", case, inp)()
    for out, provider in ((k3, "fused_rl"), (exact, "fused_rl_k3")):
        judged = A.judge("fused_rl", "fp32", oracle.compare_all(names, out, provider))
        assert judged["status"] == "wrong", (provider, judged["verdict"])
    # its own oracle to fp32 rounding, the 8% KL term apart
    assert oracle.compare_all(names, k3, "fused_rl_k3")["loss"].err < FP32_TOL
    assert "k3" in oracle.matched
    logits = inp["logits"]
    no_kl = P.token_policy_loss(
        torch.log_softmax(logits.float(), -1).gather(-1, inp["targets"][..., None])[..., 0],
        None, inp["advantages"], inp["old_logprobs"], None, inp["mask"], FULL_KL,
        kl=torch.zeros(logits.shape[:2], device=logits.device),
    )  # fmt: skip
    grads = torch.autograd.grad(no_kl, [logits])
    judged = A.judge("eager", "fp32", oracle.compare_all(names, (no_kl.detach(), *grads)))
    assert judged["status"] == "wrong", judged["verdict"]


def test_full_kl_oracle_is_the_formula():
    """The oracle's streamed KL and closed-form gradient term against the formula itself in
    float64 with autograd over the whole (N, V): ``sum_v p (log p - log q)`` of the two
    softmaxes, the PPO-clip surrogate and ``beta * KL``, the masked token mean."""
    from bench.cases import POLICY
    from bench.oracle import Oracle, full_kl64

    case = Case("policy_loss", FULL_KL, "fwd_bwd", 2, 8, 1000, "bf16")
    inp = make_inputs(case, "cpu")
    z = inp["logits"].detach().double().requires_grad_()
    log_p = torch.log_softmax(z, -1)
    log_q = torch.log_softmax(inp["ref_logits"].double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl_streamed, _ = full_kl64(inp["logits"].detach(), inp["ref_logits"])
    torch.testing.assert_close(kl_streamed, kl.detach(), rtol=1e-12, atol=1e-14)
    logp = log_p.gather(-1, inp["targets"][..., None])[..., 0]
    ratio = torch.exp(logp - inp["old_logprobs"].double())
    adv = inp["advantages"].double()[:, None]
    low, high = 1 - POLICY["eps_low"], 1 + POLICY["eps_high"]
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(low, high))
    m = inp["mask"]
    loss = torch.where(m, policy + POLICY["beta"] * kl, 0.0).sum() / m.sum()
    grad = torch.autograd.grad(loss, [z])[0]
    comps = Oracle(case, inp).compare_all(P.output_names(case), (loss.detach(), grad))
    assert comps["loss"].err < 1e-12 and comps["grad_logits"].err < 1e-12, comps


def test_full_kl_memory_model():
    """policy_loss[grpo+fullkl] at 8 x 2048 x 151936 bf16, forward + backward, modelled (fake
    tensors): fused_rl holds the bf16 gradient of the (B, T + 1, V) buffer and O(N) (at most
    64 bytes a token), the k3 call on the same inputs the same gradient and O(N): the exact
    KL adds nothing of size N V. Eager holds six fp32 (N, V) tensors at its peak, in the
    backward: the policy's log-softmax, ``p = exp`` of it and ``logp - logq`` (kept by the
    softmax's, exp's and the product's backward), the product's two gradients and the
    gather's (N, V) scatter; the reference's log-softmax is freed when the forward returns.
    Per-token floats aside (at most 16 bytes a token)."""
    case = Case("policy_loss", FULL_KL, "fwd_bwd", 8, 2048, 151936, "bf16")
    n, nv = case.tokens, case.tokens * case.vocab
    grad = 2 * case.batch * (case.seqlen + 1) * case.vocab
    fused, how = model_peak("fused_rl", case)
    assert how == "modelled" and 0 <= fused - grad < 64 * n, fused
    k3, how = model_peak("fused_rl_k3", case)
    assert how == "modelled" and 0 <= k3 - grad < 64 * n, k3
    assert 0 <= fused - k3 < 32 * n  # the exact KL's per-token statistics
    eager, how = model_peak("eager", case)
    assert how == "modelled" and 0 <= eager - 6 * 4 * nv < 16 * n, eager
    grpo_eager, _ = model_peak("eager", Case("policy_loss", "grpo", "fwd_bwd", 8, 2048, 151936,
                                             "bf16"))  # fmt: skip
    assert 0 <= grpo_eager - 3 * 4 * nv < 16 * n, grpo_eager
    assert model_peak("compile", case)[0] is None  # measured on GPUs only
    peak, how = model_peak("liger", case)
    assert peak is None and "no exact KL" in how, how


def test_full_kl_memory_figures_in_docs():
    """docs/benchmarks.md's Exact KL table states the model's peaks at 8 x 2048 x 151936 bf16,
    each cell the model's bytes in GB to two decimals, and the exact bytes of what they
    consist of; it says they are modelled, not measured."""
    section = _doc_section("## Exact KL")
    assert "modelled on CPU, not measured on a GPU" in " ".join(section.split())
    rows = {
        (FULL_KL, "fused_rl"): "fused_rl, exact KL",
        (FULL_KL, "fused_rl_k3"): "fused_rl_k3, the same call with k3",
        (FULL_KL, "eager"): "eager, exact KL",
        ("grpo", "eager"): "eager, k3",
    }
    peaks = {}
    for (variant, provider), label in rows.items():
        row = next(line for line in section.splitlines()
                   if line.startswith(f"| `policy_loss[{variant}]` | {label} |"))  # fmt: skip
        cell = row.strip("|").split("|")[2].strip()
        case = Case("policy_loss", variant, "fwd_bwd", 8, 2048, 151936, "bf16")
        peak = peaks[variant, provider] = model_peak(provider, case)[0]
        assert cell == f"{peak / 1e9:.2f} GB", (variant, provider, peak, cell)
    n, v = 8 * 2048, 151936
    grad = 2 * 8 * 2049 * v
    fused, k3 = peaks[FULL_KL, "fused_rl"] - grad, peaks[FULL_KL, "fused_rl_k3"] - grad
    for term in (4 * n * v, grad, fused, k3, 6 * 4 * n * v, peaks["grpo", "eager"]):
        assert f"{term:,}" in section, term
    assert f"{peaks[FULL_KL, 'eager'] / peaks[FULL_KL, 'fused_rl']:.1f}×" in section


# ----------------------------------------------------------------------------- truncated

TRUNCATED = ("k50", "k1000", "p0.9")
# the truncated suite's (variant, mode) pairs in its order: the no-grad cases first, the
# plain log-probs first in each mode
TRUNCATED_SUITE = (("logp", "fwd_nograd"), ("k50", "fwd_nograd"), ("logp", "fwd_bwd"),
                   ("k50", "fwd_bwd"), ("k1000", "fwd_bwd"), ("p0.9", "fwd_bwd"))  # fmt: skip


def test_truncated_suites_and_cases(monkeypatch):
    """``token_logprobs`` under top-k / top-p (``TRUNCATED_VARIANTS``): the ``truncated``
    suite (bf16 at 8 x 2048 x 151936, each mode's plain ``token_logprobs[logp]`` case first,
    torch.compile included), the quick suite (each pair once, at the first quick shape its
    top-k truncates), none in the other suites or in a new quick grid; which providers
    apply or say why not; the byte counts (the plain op's)."""
    from bench.cases import TRUNCATED_MODES, TRUNCATED_PROVIDERS, TRUNCATED_VARIANTS

    assert set(TRUNCATED_VARIANTS) == set(TRUNCATED)
    assert set(TRUNCATED_MODES) == {p for p in TRUNCATED_SUITE if p[0] != "logp"}
    cases = select_cases("truncated")
    assert tuple((c.variant, c.mode) for c in cases) == TRUNCATED_SUITE
    assert {(c.op, c.batch, c.seqlen, c.vocab, c.dtype) for c in cases} == {
        ("token_logprobs", 8, 2048, 151936, "bf16")
    }
    assert all(c.compile_ok for c in cases)
    quick = [c for c in select_cases("quick", ["token_logprobs"]) if c.variant in TRUNCATED]
    assert sorted((c.variant, c.mode) for c in quick) == sorted(TRUNCATED_MODES)
    for c in quick:  # every cut truncates there: k1000 at the odd V, the others at the first
        assert TRUNCATED_VARIANTS[c.variant].get("top_k", 0) < c.vocab and c.dtype == "bf16"
        assert c.tokens <= 8 and c.vocab == (4099 if c.variant == "k1000" else 1000), c
    others = [c for s in ("full", "peers", "inplace", "distill", "fullkl") for c in select_cases(s)]
    assert not [c for c in others if c.variant in TRUNCATED]
    assert not [c for c in select_cases("quick", tokens=[4], vocabs=[64]) if c.variant in TRUNCATED]
    grid = select_cases("truncated", tokens=[4096], vocabs=[32000])
    assert [(c.variant, c.mode) for c in grid] == [(c.variant, c.mode) for c in cases]
    assert {(c.tokens, c.vocab) for c in grid} == {(4096, 32000)}
    assert set(TRUNCATED_PROVIDERS) <= set(P.PROVIDERS)

    big = {(c.variant, c.mode): c for c in cases}
    elements = 8 * 2048 * 151936 * 2
    for (_, mode), case in big.items():
        assert M.bytes_moved(case) == elements * (3 if mode == "fwd_bwd" else 1), case
    case = Case("token_logprobs", "k50", "fwd_bwd", 2, 8, 1000, "bf16")
    inp = make_inputs(case, "cpu")
    for provider in ("fused_rl_k3", "fused_rl_mat", "verl", "liger_inplace", "fused_rl_2pass"):
        assert not P.applies(provider, case), provider
    monkeypatch.setattr(P, "liger_version", lambda: "any")  # the reason, installed or not
    for provider in ("trl", "liger"):
        with pytest.raises(P.Unavailable, match="no truncated") as info:
            P.build(provider, case, inp)
        assert not info.value.transient  # never: no --resume retries it


def test_truncated_inputs_keep_every_target():
    """The truncated cases' inputs are the plain ``logp`` case's (the same draws), with every
    target its row's argmax, kept by every cut: the float64 kept set holds each target
    (so no row's log-prob is -inf, nor its gradient 0) where random targets mostly fall
    outside the top-k (V = 1500: top-k 1000 truncates)."""
    from bench.cases import TRUNCATED_VARIANTS
    from bench.oracle import truncated_keep64

    plain = make_inputs(Case("token_logprobs", "logp", "fwd_bwd", 2, 8, 1500, "bf16"), "cpu")
    for variant in TRUNCATED:
        inp = make_inputs(Case("token_logprobs", variant, "fwd_bwd", 2, 8, 1500, "bf16"), "cpu")
        for key in ("buf", "g_logp", "g_entropy"):
            assert torch.equal(inp[key], plain[key]), (variant, key)
        rows = inp["logits"].detach().reshape(-1, 1500)
        targets = inp["targets"].reshape(-1)
        assert torch.equal(targets, rows.argmax(-1)), variant
        keep = truncated_keep64(rows.double(), **TRUNCATED_VARIANTS[variant])
        assert keep.gather(-1, targets[:, None]).all(), variant
        assert keep.sum(-1).max() < 1500 and keep.sum(-1).min() > 1, variant  # real cuts
    rows = plain["logits"].detach().reshape(-1, 1500).double()
    random_kept = truncated_keep64(rows, top_k=50).gather(-1, plain["targets"].reshape(-1, 1))
    assert random_kept.float().mean() < 0.5  # what random targets would measure


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_truncated_providers_meet_the_oracle(dtype, device):
    """fused_rl's truncated call (CUDA, or the Triton interpreter on a CPU-only machine), its
    reference path and the eager sampler-style computation against the float64 oracle, every
    (variant, mode) pair, at V = 1500 (top-k 1000 truncates: the radix select runs), on the
    suite's device."""
    from bench.cases import TRUNCATED_MODES

    for variant, mode in TRUNCATED_MODES:
        case = Case("token_logprobs", variant, mode, 2, 4, 1500, dtype)
        verdicts = _verdicts(case, make_inputs(case, device), ("fused_rl", "fused_rl_ref", "eager"))
        assert set(verdicts.values()) == {"ok"}, (variant, mode, verdicts)


def test_truncated_ties_are_kept_whole():
    """Rows with ties at the cut: top-k 2 of ``[2, 1, 1, -1]`` keeps three tokens (the two
    tied at the 2nd value), top-p 0.5 of the probabilities ``[.4, .2, .2, .1, .1]`` keeps
    the first three (the crossing token's tie whole: mass .8); the eager provider, the
    oracle and fused_rl's reference give the log-probs of that rule, and -inf for a target
    cut off (the oracle's gradient row 0 there)."""
    from bench.oracle import truncated_rows64
    from fused_rl.reference.truncated import truncated_logprobs

    ln = math.log
    rows = [([2.0, 1.0, 1.0, -1.0], dict(top_k=2), [0, 1, 3]),
            ([ln(4), ln(2), ln(2), 0.0, 0.0], dict(top_p=0.5), [0, 2, 3])]  # fmt: skip
    for row, cuts, targets in rows:
        x = torch.tensor([row] * len(targets), dtype=torch.float64)
        t = torch.tensor(targets)
        kept = [i for i, v in enumerate(row) if v >= sorted(row)[-3]]
        lse = torch.logsumexp(x[0, kept], 0)
        want = torch.tensor([x[0, i] - lse if i in kept else -math.inf for i in targets])
        logp, grad = truncated_rows64(x, t, **cuts)
        torch.testing.assert_close(logp, want.double(), rtol=1e-12, atol=1e-12)
        assert (grad[t == 3] == 0).all() and (grad[t != 3] != 0).any()  # a cut target: none
        (eager,) = P.eager_truncated_logprobs(x.float()[None], t[None], **cuts)
        torch.testing.assert_close(eager[0], want.float(), rtol=1e-6, atol=1e-6)
        reference = truncated_logprobs(x, t, top_k=cuts.get("top_k"), top_p=cuts.get("top_p"),
                                       temperature=1.0, ignore_index=-100)  # fmt: skip
        torch.testing.assert_close(reference, want.double(), rtol=1e-12, atol=1e-12)


def test_truncated_is_its_own_math():
    """The cut matters and each variant's oracle judges its own: the untruncated log-probs
    fail top-k 50's oracle, top-k 49 fails it too (one more token cut a row), and top-p 0.8
    fails top-p 0.9's (fp32, the tolerance 1e-4)."""
    from bench import accuracy as A
    from bench.oracle import Oracle

    for variant, wrong in (("k50", {}), ("k50", dict(top_k=49)), ("p0.9", dict(top_p=0.8))):
        case = Case("token_logprobs", variant, "fwd_bwd", 2, 4, 1000, "fp32")
        inp = make_inputs(case, "cpu")
        logp = P.eager_truncated_logprobs(inp["logits"], inp["targets"], **wrong)[0]
        grads = torch.autograd.grad([logp], [inp["logits"]], [inp["g_logp"]])
        comps = Oracle(case, inp).compare_all(P.output_names(case), (logp.detach(), *grads))
        judged = A.judge("eager", "fp32", comps, case.op)
        assert judged["status"] == "wrong", (variant, wrong, judged["verdict"])


def test_truncated_cli(tmp_path, device):
    """``bench/run.py --suite truncated`` on a new grid (4 tokens x V 64, bf16): the plain
    and the truncated cases for every provider that runs here, each within the tolerance of
    float64, the plain op's byte counts, the results.md note on how they are checked, a
    modelled peak per row on CPU."""
    out = tmp_path / "res"
    argv = ["--suite=truncated", f"--device={device}", "--tokens=4", "--vocab=64",
            "--providers=fused_rl,fused_rl_ref,eager,trl", "--reps=1", "--no-plots",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    want = set(TRUNCATED_SUITE)
    for provider in ("fused_rl", "fused_rl_ref", "eager"):
        assert {(r["variant"], r["mode"]) for r in records if r["provider"] == provider} == want
    assert {(r["variant"], r["mode"]) for r in records if r["provider"] == "trl"} == {
        ("logp", "fwd_nograd"),
        ("logp", "fwd_bwd"),
    }
    notes = [n for n in results["skipped"] if n["provider"] == "trl"]
    assert len(notes) == 4 and all("no truncated" in n["reason"] for n in notes), notes
    for r in records:
        assert r["verdict"].startswith(("ok", "less accurate")), r
        assert r["verdict"] == "ok" or r["provider"] == "trl", r
        assert r["bytes"] == 4 * 64 * 2 * (3 if r["mode"] == "fwd_bwd" else 1), r
        assert (r["model_mb"] is not None) == (device == "cpu"), r
    assert "Truncated log-probs (`token_logprobs[k50]`" in (out / "results.md").read_text()


def test_truncated_memory_model():
    """The truncated cases at 8 x 2048 x 151936 bf16, modelled (fake tensors): fused_rl
    holds per-token floats without grad and the bf16 (B, T, V) gradient (the slice's) with
    it, whatever the cut (at most 64 bytes a token besides); eager's peak per logit: the
    plain log-probs 12 bytes (fp32 logits, the log-softmax, the backward's), top-k 13 (the
    masked copy and its bool mask beside the logits and the log-softmax), top-p 29 (the
    sort's fp32 values and int64 indices, the softmax, its cumulative sum, the mask and the
    masked copy beside the logits); 9 and 8 without grad. Per-token floats aside (at most
    16 bytes a token, and top-k's k values and ids)."""
    from bench.cases import TRUNCATED_VARIANTS

    n, v = 8 * 2048, 151936
    nv = n * v
    eager_bytes = dict(zip(TRUNCATED_SUITE, (8, 9, 12, 13, 13, 29), strict=True))
    for (variant, mode), per_logit in eager_bytes.items():
        case = Case("token_logprobs", variant, mode, 8, 2048, v, "bf16")
        # torch.topk's k values and int64 ids a token may be alive at the peak too
        small = (16 + 12 * TRUNCATED_VARIANTS.get(variant, {}).get("top_k", 0)) * n
        fused, how = model_peak("fused_rl", case)
        assert how == "modelled", (variant, mode, how)
        assert 0 <= fused - (2 * nv if mode == "fwd_bwd" else 0) < 64 * n, (variant, mode, fused)
        eager, how = model_peak("eager", case)
        assert how == "modelled" and 0 <= eager - per_logit * nv < small, (variant, mode, eager)
    case = Case("token_logprobs", "k50", "fwd_bwd", 8, 2048, v, "bf16")
    assert model_peak("compile", case)[0] is None  # measured on GPUs only


def test_truncated_memory_figures_in_docs():
    """docs/benchmarks.md's Truncated log-probs table states the model's peaks at 8 x 2048 x
    151936 bf16 for fused_rl and eager, each cell the model's bytes in GB to two decimals,
    the case's byte convention and the command; it says they are modelled. Its GPU table
    quotes the H200 run's records (``bench/results/h200-2026-11-28/gpu.results.json``):
    every provider's median of every truncated case, to the hundredth of a ms."""
    section = _doc_section("## Truncated log-probs")
    flat = " ".join(section.split())
    assert "modelled on CPU, not measured on a GPU" in flat
    from bench.cases import TRUNCATED_VARIANTS

    run = os.path.join(ROOT, "bench", "results", "h200-2026-11-28", "gpu.results.json")
    with open(run) as f:
        records = [r for r in json.load(f)["records"] if r["op"] == "token_logprobs"]
    assert {r["variant"] for r in records} == {"logp", *TRUNCATED_VARIANTS}
    for r in records:
        assert r["verdict"] == "ok" and f"{r['ms']:.2f} ms" in section, r
    assert "bash bench/gpu_session.sh truncated" in flat
    assert "python bench/run.py --suite truncated" in flat
    for variant, mode in TRUNCATED_SUITE:
        row = next(line for line in section.splitlines()
                   if line.startswith(f"| `token_logprobs[{variant}]` {mode} |"))  # fmt: skip
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        case = Case("token_logprobs", variant, mode, 8, 2048, 151936, "bf16")
        for provider, cell in zip(("fused_rl", "eager"), cells, strict=True):
            peak = model_peak(provider, case)[0]
            assert cell == f"{peak / 1e9:.2f} GB", (variant, mode, provider, peak, cell)
    n, v = 8 * 2048, 151936
    assert f"{2 * n * v:,}" in section and f"{4 * n * v:,}" in section
    top_p = Case("token_logprobs", "p0.9", "fwd_bwd", 8, 2048, v, "bf16")
    ratio = model_peak("eager", top_p)[0] / model_peak("fused_rl", top_p)[0]
    assert f"{ratio:.1f}×" in section


def test_chunk_tokens_reach_the_linear_ops_and_are_recorded(tmp_path, monkeypatch):
    """``--chunk-tokens`` gives fused_rl's ops from hidden states (those taking
    ``chunk_tokens=``) that many rows a chunk and nothing else; results.json records it, and
    a run with another setting refuses to merge into it."""
    monkeypatch.setattr(P, "LINEAR_CHUNK_TOKENS", None)
    seen = []

    def linear_op(hidden, weight, targets, *, chunk_tokens=None, backend="auto"):
        seen.append((chunk_tokens, backend))

    def logits_op(logits, targets, *, backend="auto"):
        seen.append(backend)

    monkeypatch.setattr(fused_rl, "linear_token_logprobs", linear_op)
    monkeypatch.setattr(fused_rl, "token_logprobs", logits_op)
    P._fused_fn("linear_token_logprobs", "triton")(1, 2, 3)
    bench_run.linear_chunk_tokens(5)
    P._fused_fn("linear_token_logprobs", "reference")(1, 2, 3)
    P._fused_fn("token_logprobs", "triton")(1, 2)
    assert seen == [(None, "triton"), (5, "reference"), "triton"]
    out = str(tmp_path)
    # the reference backend: fused_rl's Triton path on CPU tensors only runs interpreted
    argv = ["--suite=quick", "--device=cpu", "--op=masked_whiten", "--providers=fused_rl_ref",
            "--no-plots", f"--out={out}"]  # fmt: skip
    assert main([*argv, "--chunk-tokens=7"]) == 0
    with open(tmp_path / "results.json") as f:
        assert json.load(f)["linear_chunk_tokens"] == 7
    with pytest.raises(SystemExit, match="linear_chunk_tokens = 7.*--chunk-tokens"):
        main([*argv, "--append"])
    with pytest.raises(SystemExit):
        main([*argv, "--chunk-tokens=0"])


def test_gemm_reduction_setting_recorded_and_never_mixed(tmp_path):
    """results.json records cuBLAS's reduced-precision reductions of the run; a run with
    ``--exact-bf16-gemm`` refuses to merge into results taken with the default, which would
    put two settings under one header."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_bf16_reduced_precision_reduction,
             matmul.allow_fp16_reduced_precision_reduction)  # fmt: skip
    out = str(tmp_path)
    # the reference backend: fused_rl's Triton path on CPU tensors only runs interpreted
    argv = ["--suite=quick", "--device=cpu", "--op=masked_whiten", "--providers=fused_rl_ref",
            "--no-plots", f"--out={out}"]  # fmt: skip
    try:
        assert main(argv) == 0
        with open(tmp_path / "results.json") as f:
            recorded = json.load(f)["gemm_reduced_precision_reduction"]
        assert recorded == {"bf16": saved[0], "fp16": saved[1]}
        with pytest.raises(SystemExit, match="another --out"):
            main([*argv, "--append", "--exact-bf16-gemm"])
        assert matmul.allow_bf16_reduced_precision_reduction is False  # the flag took effect
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved[0]
        matmul.allow_fp16_reduced_precision_reduction = saved[1]
