"""The benchmark's accuracy check (bench/oracle.py, bench/accuracy.py, bench/console.py): the
float64 oracle against autograd, the verdicts (ok / less accurate / FAIL) and the exit
status of ``bench/run.py``, the console table, and where results go by default.

Fast: the providers here are the plain-PyTorch ones (no Triton interpreter)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

# an integration test (subprocess / CLI / compile): `pytest -m 'not integration'` skips it
pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import accuracy as A  # noqa: E402
from bench import console as C  # noqa: E402
from bench import oracle as O  # noqa: E402
from bench import providers as P  # noqa: E402
from bench import run as bench_run  # noqa: E402
from bench.cases import Case, make_inputs  # noqa: E402

F64_TOL = 1e-12


def _autograd64(case: Case, inp: dict) -> dict:
    """The case's outputs by torch autograd in float64 on the full materialised logits,
    with the eager provider's per-token loss (dtype-agnostic) as the objective."""
    z = inp["logits"].detach().double().requires_grad_()
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, inp["targets"][..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if case.op == "token_logprobs":
        outs, ups = [logp], [inp["g_logp"].double()]
        if case.variant == "logp+entropy":
            outs.append(entropy)
            ups.append(inp["g_entropy"].double())
        (grad,) = torch.autograd.grad(outs, [z], ups)
        return {"logp": logp, "entropy": entropy, "grad_logits": grad}
    args = [inp[k].double() for k in ("advantages", "old_logprobs", "ref_logprobs")]
    with_entropy = entropy if case.variant == "grpo+entropy" else None
    loss = P.token_policy_loss(logp, with_entropy, *args, inp["mask"], case.variant)
    (grad,) = torch.autograd.grad(loss, [z])
    return {"loss": loss, "grad_logits": grad}


@pytest.mark.no_poison
@pytest.mark.parametrize(
    "op, variant",
    [("token_logprobs", "logp+entropy"), ("policy_loss", "grpo"),
     ("policy_loss", "grpo+entropy"), ("policy_loss", "gspo")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_oracle_matches_float64_autograd(monkeypatch, op, variant, dtype):
    """The streamed oracle (blocks of 3 rows here: a remainder block too) equals autograd
    through a float64 log_softmax of the whole logits, to 1e-12; a gradient 10% off is
    measured as 0.1."""
    monkeypatch.setattr(O, "CHUNK", 3 * 37)
    case = Case(op, variant, "fwd_bwd", 2, 5, 37, dtype)
    inp = make_inputs(case, "cpu")
    oracle = O.Oracle(case, inp)
    want = _autograd64(case, inp)
    for name in P.output_names(case):
        got = oracle.compare(name, want[name].detach())
        assert got.err < F64_TOL and got.worst_row < F64_TOL, (name, got)
    off = oracle.compare("grad_logits", 1.1 * want["grad_logits"])
    assert off.err == pytest.approx(0.1, rel=1e-9)


@pytest.mark.no_poison
@pytest.mark.parametrize("op", ["ppo_loss", "value_loss", "masked_whiten", "gae"])
def test_token_op_oracle_matches_eager_in_float64(op):
    """The token ops' oracle against the eager (seed) code run on float64 inputs."""
    case = next(c for c in bench_run.select_cases("quick", [op]))
    inp = make_inputs(case, "cpu")
    oracle = O.Oracle(case, inp)
    inp64 = {k: v.detach().double().requires_grad_(v.requires_grad)
             if isinstance(v, torch.Tensor) and v.is_floating_point() else v
             for k, v in inp.items()}  # fmt: skip
    outs = P.build("eager", case, inp64)()
    for name, out in zip(P.output_names(case), outs):
        tol = 1e-7 if name == "clipfrac" else F64_TOL  # the seed casts clipfrac to fp32
        assert oracle.compare(name, out).err < tol, name


def test_a_token_at_a_clip_boundary_is_left_out():
    """A ratio exactly at 1 + eps_high: its gradient row has two right answers, so the
    oracle leaves it out of the gradient comparison (and counts it)."""
    case = Case("policy_loss", "grpo", "fwd_bwd", 1, 4, 16, "fp32")
    inp = make_inputs(case, "cpu")
    inp["mask"][:] = True
    logp = O.token_stats64(inp["logits"].detach(), inp["targets"])[0]
    inp["old_logprobs"][0, 1] = float(logp[0, 1] - math.log(1.0 + 0.28))
    oracle = O.Oracle(case, inp)
    assert oracle._vocab[-1].tolist() == [[False, True, False, False]]
    assert oracle.compare("grad_logits", torch.zeros(1, 4, 16)).excluded == 1
    kink = torch.tensor([False, True])
    got = O.compare(torch.tensor([1.0, 5.0]), torch.tensor([1.0, 2.0], dtype=torch.float64), kink)
    assert (got.err, got.excluded) == (0.0, 1)


def _cmp(err, row=0.0):
    return O.Comparison(err, row)


def test_verdicts():
    ok = A.judge("eager", "fp32", {"loss": _cmp(1e-6), "grad_logits": _cmp(1e-5, 1e-5)})
    assert (ok["status"], ok["verdict"], ok["err_max"]) == ("ok", "ok", 1e-5)
    over = A.judge("eager", "fp32", {"loss": _cmp(1e-6), "grad_logits": _cmp(2e-3)})
    assert over["status"] == "wrong" and over["verdict"] == "FAIL: grad_logits 2.0e-03 > tol 0.0001"
    row = A.judge("eager", "bf16", {"grad_logits": _cmp(1e-3, 0.5)})
    assert row["status"] == "wrong" and "one grad_logits row off by 0.5" in row["verdict"]
    nan = A.judge("eager", "fp32", {"loss": _cmp(float("inf"))})
    assert nan["status"] == "wrong" and "NaN" in nan["verdict"]
    # TRL declares bf16 log_softmax: over the tolerance, within its bound
    trl = A.judge("trl", "bf16", {"loss": _cmp(4e-3), "grad_logits": _cmp(0.03, 0.5)})
    assert trl["status"] == "less_accurate" and trl["verdict"].startswith("less accurate: ")
    assert trl["bound"] == list(P.LESS_ACCURATE["trl"].bounds["bf16"])
    assert A.judge("trl", "bf16", {"grad_logits": _cmp(0.5)})["status"] == "wrong"
    assert A.judge("trl", "fp32", {"grad_logits": _cmp(0.03)})["status"] == "wrong"
    # fused_rl can declare nothing
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(P.LESS_ACCURATE, "fused_rl", P.LESS_ACCURATE["trl"])
        assert A.judge("fused_rl", "bf16", {"grad_logits": _cmp(0.03)})["status"] == "wrong"
    # a declaration for one op covers that op only: verl's bf16 top-k path, eager elsewhere
    topk = {"loss": _cmp(1e-3), "overlap_count": _cmp(1.3e-2), "grad_logits": _cmp(1.2e-2, 0.13)}
    for provider in ("eager", "compile", "verl"):
        judged = A.judge(provider, "bf16", topk, "topk_distill_loss")
        assert judged["status"] == "less_accurate", (provider, judged["verdict"])
    assert A.judge("eager", "bf16", topk, "distill_loss")["status"] == "wrong"
    assert A.judge("eager", "bf16", topk)["status"] == "wrong"
    assert A.judge("eager", "fp32", topk, "topk_distill_loss")["status"] == "wrong"
    assert A.judge("fused_rl", "bf16", topk, "topk_distill_loss")["status"] == "wrong"


def _scaled(monkeypatch, provider: str, scale: float) -> None:
    """``provider``'s gradients (the outputs after the values) multiplied by ``scale``."""
    real = P.build

    def build(name, case, inp, **kw):
        run = real(name, case, inp, **kw)
        if name != provider:
            return run
        n_values = sum(not k.startswith("grad") for k in P.output_names(case))
        return lambda: tuple(o * scale if i >= n_values else o for i, o in enumerate(run()))

    monkeypatch.setattr(P, "build", build)


def _main(tmp_path, capsys, *extra):
    argv = ["--suite=quick", "--device=cpu", "--op=policy_loss", "--tokens=4", "--vocab=64",
            "--dtype=fp32", "--reps=1", "--no-plots", f"--out={tmp_path}", *extra]  # fmt: skip
    rc = bench_run.main(argv)
    return rc, capsys.readouterr().out


@pytest.mark.no_poison
def test_wrong_gradient_fails_the_run(monkeypatch, tmp_path, capsys):
    """A provider whose gradient is 10% off: FAIL in its rows, named under the table, and
    ``main`` returns 1; the provider that is right stays ok."""
    _scaled(monkeypatch, "eager", 1.1)
    rc, out = _main(tmp_path, capsys, "--providers=fused_rl_ref,eager")
    assert rc == 1, out
    assert "FAIL: grad_logits 1.0e-01 > tol 0.0001" in out
    assert "FAILURES (6; the run exits 1):" in out and "disagrees with the math" in out
    rows = [line for line in out.splitlines() if " eager " in f" {line} "]
    assert rows and all("FAIL" in line for line in rows if "ms" not in line), rows
    assert all("ok" in line for line in out.splitlines() if " fused_rl_ref " in line)


@pytest.mark.no_poison
def test_less_accurate_within_its_bound_passes(monkeypatch, tmp_path, capsys):
    """A provider declared less accurate (a reason and a bound): 1% off is over fp32's
    tolerance but within the bound, so the run passes and prints its reason; 10% off is
    over the bound, a failure."""
    declared = P.LessAccurate(label="rounds on purpose", why="This test rounds the gradient.",
                              bounds={"fp32": (0.05, 0.5)})  # fmt: skip
    monkeypatch.setitem(P.LESS_ACCURATE, "eager", declared)
    _scaled(monkeypatch, "eager", 1.01)
    rc, out = _main(tmp_path, capsys, "--providers=eager")
    assert rc == 0, out
    out = " ".join(out.split())  # the notes are wrapped
    assert "less accurate: rounds on purpose" in out
    assert "Less accurate by design (expected, not failures):" in out
    assert "This test rounds the gradient." in out and "declared bound 0.05 RMS" in out
    assert "FAILURES" not in out and "FAIL: grad" not in out
    # over the bound: a failure
    over = A.judge("eager", "fp32", {"loss": _cmp(1e-7), "grad_logits": _cmp(0.1)})
    assert over["status"] == "wrong" and over["verdict"] == "FAIL: grad_logits 1.0e-01 > bound 0.05"


@pytest.mark.parametrize("use_rich", [False, True])
def test_console_table_explains_its_columns(use_rich):
    """Header, key (what each column and '-' mean), case names down the first column, the
    columns aligned; with rich and with the plain-text fallback."""
    if use_rich and not C.have_rich():
        pytest.skip("rich is not installed")
    rec = lambda case, provider, **kw: bench_run._record(case, provider, **kw)  # noqa: E731
    long = Case("policy_loss", "grpo+entropy", "fwd_bwd", 2, 4, 4099, "bf16")
    gae = Case("gae", "gamma0.99-lam0.95", "fwd_nograd", 4, 64, None, "fp32")
    ok = A.judge("eager", "bf16", {"loss": _cmp(1e-7), "grad_logits": _cmp(2e-3, 4e-3)})
    trl = A.judge("trl", "bf16", {"loss": _cmp(4e-3), "grad_logits": _cmp(2e-2, 0.05)})
    records = [
        rec(long, "fused_rl", ms=500.0, model_mb=0.07, **ok),
        rec(long, "trl", ms=40.0, model_mb=0.4, **trl),
        rec(gae, "fused_rl", status="error", note="RuntimeError: boom", verdict="FAIL: error"),
    ]
    text = C.table_text(records, gpu=False, title="T", reps=3, use_rich=use_rich)
    lines = text.splitlines()
    head = next(line for line in lines if "provider" in line)
    for name in ("case", "provider", "ms", "model MB", "err vs fp64", "worst row", "verdict"):
        assert name in head, name
    assert "median of 3 runs" in text and "interpreter" in text
    assert "not measured or not applicable" in text and "  -  " in text
    assert "policy_loss[grpo+entropy]" in text and "fwd_bwd 2x4x4099 bf16" in text
    assert "less accurate: log_softmax in bf16 (as TRL)" in text and "FAIL: error" in text
    # aligned: each row's provider starts under the header's, its error under its header
    for provider in ("trl", "fused_rl"):
        row = next(line for line in lines if f" {provider} " in line and "e-" in line)
        assert row.index(f" {provider} ") + 1 == head.index("provider"), (row, head)
        assert row.index("e-0") < head.index("err vs fp64") + len("err vs fp64")
    error_row = next(line for line in lines if "FAIL: error" in line)
    assert error_row.split()[1:3] == ["fused_rl", "-"]  # no time: '-'
    summary = "\n".join(C.summary(records, []))
    assert "Tolerance:" in summary and "Why: TRL's selective_log_softmax" in summary
    assert "RuntimeError: boom" in summary


def test_default_output_is_local_and_ignored():
    """A plain run writes under bench/results/local/<device>/ (git-ignored), never over the
    committed bench/results/<gpu>/ figures."""
    out = bench_run.default_out("cpu")
    assert out == os.path.join(ROOT, "bench", "results", "local", "cpu")
    args = bench_run.parse_args(["--suite=quick"])
    assert args.out is None  # so run_suite uses default_out
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    for path in ("bench/results/local/cpu/results.json", "bench/results/local/x/plot.png"):
        check = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert check.returncode == 0, f"{path} is not git-ignored"
    tracked = subprocess.run(["git", "check-ignore", "-q", "bench/results/cpu/results.json"],
                             cwd=ROOT)  # fmt: skip
    assert tracked.returncode == 1  # the committed CPU figures stay tracked


def _linear_autograd64(case: Case, inp: dict) -> dict:
    """The linear case's outputs by torch autograd in float64 through ``F.linear`` and a
    float64 log_softmax of the whole logits."""
    h = inp["hidden"].detach().double().requires_grad_()
    w = inp["weight"].detach().double().requires_grad_()
    logp_all = torch.log_softmax(torch.nn.functional.linear(h[:, :-1], w), dim=-1)
    logp = logp_all.gather(-1, inp["targets"][..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if case.op == "linear_token_logprobs":
        outs, ups = [logp], [inp["g_logp"].double()]
        if case.variant == "logp+entropy":
            outs.append(entropy)
            ups.append(inp["g_entropy"].double())
        grad_h, grad_w = torch.autograd.grad(outs, [h, w], ups)
        return {"logp": logp, "entropy": entropy, "grad_hidden": grad_h, "grad_weight": grad_w}
    args = [inp[k].double() for k in ("advantages", "old_logprobs", "ref_logprobs")]
    loss = P.token_policy_loss(logp, None, *args, inp["mask"], case.variant)
    grad_h, grad_w = torch.autograd.grad(loss, [h, w])
    return {"loss": loss, "grad_hidden": grad_h, "grad_weight": grad_w}


@pytest.mark.no_poison
@pytest.mark.parametrize(
    "op, variant",
    [("linear_token_logprobs", "logp"), ("linear_token_logprobs", "logp+entropy"),
     ("linear_policy_loss", "grpo")],
)  # fmt: skip
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_linear_oracle_matches_float64_autograd(monkeypatch, op, variant, dtype):
    """The linear ops' streamed oracle (z = h W^T in float64 blocks of 3 rows: a remainder
    block too; dH and dW accumulated block by block) equals full float64 autograd through
    F.linear, to 1e-12; a grad_weight 10% off is measured as 0.1, and so is its worst row."""
    monkeypatch.setattr(O, "CHUNK", 3 * 37)
    case = Case(op, variant, "fwd_bwd", 2, 5, 37, dtype, hidden=8)
    inp = make_inputs(case, "cpu")
    oracle = O.Oracle(case, inp)
    want = _linear_autograd64(case, inp)
    names = P.output_names(case) + (["entropy"] if variant == "logp+entropy" else [])
    for name in names:
        got = oracle.compare(name, want[name].detach())
        assert got.err < F64_TOL and got.worst_row < F64_TOL, (name, got)
    assert oracle.values["grad_hidden"][:, -1].abs().max() == 0  # predicts no target
    off = oracle.compare("grad_weight", 1.1 * want["grad_weight"])
    assert off.err == pytest.approx(0.1, rel=1e-9)
    assert off.worst_row == pytest.approx(0.1, rel=1e-9)


@pytest.mark.no_poison
@pytest.mark.parametrize("variant", ["k50", "k1000", "p0.9"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_truncated_oracle_matches_float64_autograd(monkeypatch, variant, dtype):
    """The truncated log-probs' streamed oracle (blocks of 3 rows: a remainder block too;
    the kept set from the rules' definitions, the gradient in closed form) equals float64
    autograd through fused_rl's reference (a sort, another way to find the kept set) on the
    whole logits under the case's upstream gradient, to 1e-12, at V = 1100 (top-k 1000
    truncates); a gradient 10% off is measured as 0.1."""
    from bench.cases import TRUNCATED_VARIANTS
    from fused_rl.reference.truncated import truncated_logprobs

    vocab = 1100
    monkeypatch.setattr(O, "CHUNK", 3 * vocab)
    case = Case("token_logprobs", variant, "fwd_bwd", 2, 5, vocab, dtype)
    inp = make_inputs(case, "cpu")
    oracle = O.Oracle(case, inp)
    z = inp["logits"].detach().double().requires_grad_()
    cuts = TRUNCATED_VARIANTS[variant]
    logp = truncated_logprobs(z, inp["targets"], top_k=cuts.get("top_k"),
                              top_p=cuts.get("top_p"), temperature=1.0,
                              ignore_index=-100)  # fmt: skip
    (grad,) = torch.autograd.grad(logp, [z], inp["g_logp"].double())
    for name, want in (("logp", logp.detach()), ("grad_logits", grad)):
        got = oracle.compare(name, want)
        assert got.err < F64_TOL and got.worst_row < F64_TOL, (name, got)
    off = oracle.compare("grad_logits", 1.1 * grad)
    assert off.err == pytest.approx(0.1, rel=1e-9)
    assert torch.isfinite(oracle.values["logp"]).all()  # every target kept


def test_worst_own_row_err():
    """grad_weight's rows against their own norm, floored at the RMS row norm: a big row 1%
    off reads 0.01 (not ~1% times how much bigger than the typical row it is); a small row
    off by the RMS row norm reads 1."""
    ref = torch.ones(100, 4, dtype=torch.float64) * 1e-3
    ref[7] = 10.0
    out = ref.clone()
    out[7] *= 1.01
    assert O.worst_own_row_err(out, ref) == pytest.approx(0.01, rel=1e-6)
    assert O.worst_row_err(out, ref) > 0.05
    rms = ref.square().sum(-1).mean().sqrt().item()
    out = ref.clone()
    out[3, 0] += rms
    assert O.worst_own_row_err(out, ref) == pytest.approx(1.0, rel=1e-6)
    assert O.worst_own_row_err(ref[:2], ref) == float("inf")


def test_worst_row_is_located():
    """Each comparison says where its worst row is and how big that row is (the record's
    ``err_row_at``): a big row's ordinary rounding and a wrong typical row read apart."""
    ref = torch.ones(100, 4, dtype=torch.float64)
    ref[7] = 20.0
    rms = ref.square().sum(-1).mean().sqrt().item()
    out = ref.clone()
    out[7] *= 1.004  # a big row's rounding
    big = O.compare(out, ref)
    assert big.worst_at[0] == 7 and big.worst_at[1] == pytest.approx(40 / rms, rel=1e-9)
    out = ref.clone()
    out[42, 1] += 1.0  # a typical row off by 1
    assert O.compare(out, ref).worst_at == (42, pytest.approx(2 / rms, rel=1e-9))
    assert O.compare(out, ref, own_rows=True).worst_at[0] == 42
    out[3, 0] = float("nan")
    nan = O.compare(out, ref)
    assert nan.worst_at[0] == 3 and nan.worst_row == float("inf")
    assert O.compare(torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64)).worst_at is None
    judged = A.judge("x", "fp32", {"grad": big, "loss": O.Comparison(0.0, 0.0)})
    assert judged["err_row_at"] == {"grad": [7, big.worst_at[1]]}
