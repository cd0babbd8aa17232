"""Backend dispatch: ``available_backends``, ``resolve_backend``, the ``backend=`` argument of
the public ops, and ``import fused_rl`` without Triton."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
import torch

import fused_rl
import fused_rl._backend as B
from fused_rl import available_backends, token_entropy, token_logprobs
from fused_rl._backend import resolve_backend
from fused_rl._compile_marks import assume_constant_result


@pytest.fixture
def interpreter(monkeypatch):
    """Set ``TRITON_INTERPRET`` for one test: ``interpreter(True)`` / ``interpreter(False)``,
    as if Triton had been imported in that mode (the real mismatch case is tested in
    tests/test_failure_modes.py)."""
    monkeypatch.setattr(B, "_interpreter_mismatch", lambda: None)
    return lambda on: monkeypatch.setenv("TRITON_INTERPRET", "1" if on else "0")


def _pair(device="cpu"):
    return torch.randn(2, 3, 7, device=device), torch.randint(0, 7, (2, 3), device=device)


def test_version():
    assert isinstance(fused_rl.__version__, str)
    assert fused_rl.__version__ == importlib.metadata.version("fused_rl")


def test_available_backends_cpu(interpreter):
    interpreter(True)
    assert available_backends("cpu") == ("triton", "reference")
    assert available_backends(torch.device("cpu")) == ("triton", "reference")
    assert available_backends() == ("triton", "reference")  # cpu is the default
    interpreter(False)
    assert available_backends("cpu") == ("reference",)


def test_available_backends_other_devices(interpreter):
    interpreter(False)
    assert available_backends("cuda") == ("triton", "reference")
    assert available_backends("cuda:0") == ("triton", "reference")
    assert available_backends("meta") == ("reference",)


def test_resolve_backend_cpu(interpreter):
    x, y = _pair()
    interpreter(True)
    assert resolve_backend("auto", x, y) == "triton"
    assert resolve_backend("triton", x, y) == "triton"
    assert resolve_backend("reference", x, y) == "reference"
    assert resolve_backend("auto", x, None) == "triton"  # None (an absent tensor) is skipped
    interpreter(False)
    assert resolve_backend("auto", x, y) == "reference"
    assert resolve_backend("reference", x) == "reference"
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here: .*TRITON_INTERPRET"):
        resolve_backend("triton", x, y)


def test_resolve_backend_meta():
    x = torch.empty(2, 3, 7, device="meta")
    assert resolve_backend("auto", x) == "reference"
    assert resolve_backend("reference", x) == "reference"
    with pytest.raises(RuntimeError, match="do not run on device type 'meta'"):
        resolve_backend("triton", x)


def test_resolve_backend_errors():
    x, y = _pair()
    with pytest.raises(
        ValueError, match=r"backend must be one of \('auto', 'triton', 'reference'\)"
    ):
        resolve_backend("Triton", x)
    with pytest.raises(ValueError, match="at least one tensor"):
        resolve_backend("auto")
    with pytest.raises(ValueError, match="at least one tensor"):
        resolve_backend("auto", None)
    with pytest.raises(ValueError, match="all tensors must be on one device, got cpu and meta"):
        resolve_backend("auto", x, torch.empty(1, device="meta"))


def test_triton_refused_when_it_cannot_run(monkeypatch):
    """``backend="triton"`` raises a clear error; ``"auto"`` falls back to the reference."""
    monkeypatch.setattr(B, "interpreter_enabled", lambda: False)
    x, y = _pair()
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here"):
        token_logprobs(x, y, backend="triton")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run here"):
        token_entropy(x, backend="triton")
    auto = token_logprobs(x, y, return_entropy=True, backend="auto")
    ref = token_logprobs(x, y, return_entropy=True, backend="reference")
    assert torch.equal(auto[0], ref[0]) and torch.equal(auto[1], ref[1])


def test_triton_missing(monkeypatch, interpreter):
    interpreter(True)
    monkeypatch.setattr(B, "triton_installed", lambda: False)
    x, y = _pair()
    assert available_backends("cpu") == ("reference",)
    assert available_backends("cuda") == ("reference",)
    assert resolve_backend("auto", x, y) == "reference"
    with pytest.raises(RuntimeError, match="the `triton` package is not installed"):
        token_logprobs(x, y, backend="triton")


_NO_TRITON = """
import json, sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch, fused_rl
x = torch.randn(2, 3, 7, requires_grad=True)
y = torch.tensor([[0, 6, -100], [3, 3, 1]])
logp, ent = fused_rl.token_logprobs(x, y, return_entropy=True)
ref = fused_rl.token_logprobs(x, y, return_entropy=True, backend="reference")
(logp.sum() + ent.sum()).backward()
try:
    fused_rl.token_entropy(x, backend="triton")
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({
    "backends": fused_rl.available_backends("cpu"),
    "same_as_reference": torch.equal(logp, ref[0]) and torch.equal(ent, ref[1]),
    "grad_finite": bool(torch.isfinite(x.grad).all()),
    "triton_error": error,
    "kernels_imported": sorted(m for m in sys.modules if m.startswith("fused_rl.kernels.")
                               and m != "fused_rl.kernels.modes"),
}))
"""


@pytest.mark.integration
def test_import_without_triton():
    """With Triton unimportable, ``import fused_rl`` works and every op runs the reference,
    even with ``TRITON_INTERPRET=1`` set."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backends"] == ["reference"]
    assert result["same_as_reference"] and result["grad_finite"]
    assert "the `triton` package is not installed" in result["triton_error"]
    assert result["kernels_imported"] == []  # the plain tables of kernels/modes.py only


def test_constant_mark_is_torchs():
    """``_compile_marks.assume_constant_result`` marks a function as
    ``torch.compiler.assume_constant_result`` does (Dynamo reads the mark; fused_rl sets it
    itself so that ``import fused_rl`` does not import ``torch._dynamo``)."""

    def ours():
        return True

    def torchs():
        return True

    marked = vars(torch.compiler.assume_constant_result(torchs))
    assert marked and vars(assume_constant_result(ours)) == marked


_LIGHT_IMPORT = """
import sys, torch, fused_rl
x = torch.randn(2, 3, 7, requires_grad=True)
t = torch.tensor([[0, 6, -100], [3, 3, 1]])
loss, _ = fused_rl.policy_loss(x, t, torch.randn(2), old_logprobs=torch.randn(2, 3) - 2,
                               ref_logprobs=torch.randn(2, 3) - 2, beta=0.1)
loss.backward()
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


@pytest.mark.integration
def test_import_and_eager_calls_leave_dynamo_unimported():
    """``import fused_rl`` and an eager call (forward and backward) do not import
    ``torch._dynamo``: about 2 s, once most of the package's import time."""
    proc = subprocess.run([sys.executable, "-c", _LIGHT_IMPORT], capture_output=True,
                          text=True, env=os.environ, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_describe_reports_the_auto_backend(interpreter):
    interpreter(True)
    d = fused_rl.describe()
    assert d.devices["cpu"] == ("triton", None)
    assert d.interpreter_requested and d.interpreter_enabled
    assert d.versions["fused_rl"] == fused_rl.__version__
    assert d.versions["torch"] == torch.__version__
    text = str(d)
    assert "Triton interpreter (TRITON_INTERPRET=1): on" in text
    assert "cpu      Triton (interpreted)" in text
    assert repr(d) == text  # a REPL shows the report, not a dataclass dump
    interpreter(False)
    d = fused_rl.describe()
    which, reason = d.devices["cpu"]
    assert which == "reference" and "TRITON_INTERPRET=1" in reason
    assert "cpu      reference: Triton kernels need CUDA tensors" in str(d)
    assert "Triton interpreter (TRITON_INTERPRET=1): off" in str(d)


@pytest.mark.integration
def test_python_m_fused_rl_prints_the_report():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "fused_rl"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"fused_rl {fused_rl.__version__}")
    assert "backend='auto' runs:" in proc.stdout and "cpu      reference" in proc.stdout


def test_first_choice_is_logged(interpreter, monkeypatch, caplog):
    monkeypatch.setattr(B, "_LOGGED", set())
    x, y = _pair()
    interpreter(False)
    with caplog.at_level("INFO", logger="fused_rl"):
        token_logprobs(x, y)
        token_logprobs(x, y)  # logged once per (asked, ran, device type)
        token_logprobs(x, y, backend="reference")
    messages = [r.getMessage() for r in caplog.records if r.name == "fused_rl"]
    assert messages == [
        "backend='auto' on cpu runs the PyTorch reference: " + B._triton_problem(x.device),
        "backend='reference' on cpu runs the PyTorch reference",
    ]


def test_fallback_warned_under_compile(monkeypatch):
    """``backend="auto"`` running the reference where the Triton kernels were expected (here:
    an interpreter setting that came too late) warns once, in eager mode as while
    ``torch.compile`` traces the call."""
    problem = "TRITON_INTERPRET=1 was set after `import triton` (simulated)"
    monkeypatch.setattr(B, "_interpreter_mismatch", lambda: problem)
    x, y = _pair()
    want = torch.log_softmax(x, -1).gather(-1, y[..., None])[..., 0]
    torch._dynamo.reset()
    for run in (torch.compile(token_logprobs, fullgraph=True, backend="aot_eager"),
                token_logprobs):  # fmt: skip
        monkeypatch.setattr(B, "_WARNED", set())
        with pytest.warns(RuntimeWarning, match="backend='auto' runs the reference: TRITON_"):
            got = run(x, y)
        torch.testing.assert_close(got, want)


_LEAKY = """
import sys, warnings
warnings.simplefilter("error")  # any warning, NumPy's included, fails the run
try:  # can this Triton's interpreter run a loop at all (its own warnings not ours)?
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(sys.argv[1])
except Exception as e:
    print("NO LOOPS:", repr(e)[:200])
    raise SystemExit(0)
import torch, fused_rl
assert fused_rl.describe().devices["cpu"][0] == "triton"
x = torch.randn(3, 5, 40, requires_grad=True)
x.data[0, 0] = float("-inf")  # -inf logits: masked-out lanes compute inf - inf in NumPy
t = torch.randint(0, 40, (3, 4))
t[1, 2] = -100
loss, m = fused_rl.policy_loss(x, t, torch.randn(3), old_logprobs=torch.randn(3, 4) - 3,
                               ref_logprobs=torch.randn(3, 4) - 3, beta=0.1,
                               entropy_coef=0.01)
loss.backward()
fused_rl.masked_whiten(torch.randn(4, 7), torch.rand(4, 7) > 0.5)
print("clean")
"""


_RUNTIME_BOUND_LOOP = """
import torch, triton, triton.language as tl

@triton.jit
def copy(src, dst, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(dst + cols, tl.load(src + cols, mask=cols < n), mask=cols < n)

x = torch.arange(5.0)
y = torch.empty(5)
copy[(1,)](x, y, 5, BLOCK=4)
assert torch.equal(x, y)
"""


@pytest.mark.integration
def test_interpreter_numpy_warnings_do_not_reach_the_caller():
    """The interpreter evaluates masked-out lanes in NumPy (log(0), 0 * inf); fused_rl's
    launches silence those floating-point warnings instead of leaking them to user code."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _LEAKY, _RUNTIME_BOUND_LOOP],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("NO LOOPS:"):  # e.g. Triton 3.6's interpreter under NumPy >= 2.4
        pytest.skip("this Triton's interpreter cannot run a plain loop to a runtime bound here: "
                    + proc.stdout.strip()[len("NO LOOPS:") :])  # fmt: skip
    assert proc.stdout.strip().endswith("clean")


def test_choice_logging_does_not_break_compile(monkeypatch, caplog):
    """The first call of a process may be a compiled one: the log line must not stop
    ``torch.compile(fullgraph=True)`` (Dynamo cannot trace logging)."""
    monkeypatch.setattr(B, "_LOGGED", set())
    x, y = _pair()
    fn = torch.compile(lambda a, b: token_logprobs(a, b) * 2, fullgraph=True, backend="eager")
    with caplog.at_level("INFO", logger="fused_rl"):
        torch.testing.assert_close(fn(x, y), token_logprobs(x, y) * 2)


def test_warnings_point_at_the_user_s_line():
    """Deprecation and backend warnings name the caller's file, not a fused_rl layer."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused_rl.kl_estimate(torch.zeros(2, 2), torch.zeros(2, 2), kind="k2")
    assert [w.filename for w in caught] == [__file__]


@pytest.mark.integration
def test_a_checkout_runs_its_own_kernels(tmp_path):
    """A copy of the source tree imported from its own directory finds ITS kernels/ as
    ``fused_rl.kernels``, not those of the fused_rl install on the path (this repository's
    editable install, here)."""
    import shutil
    from pathlib import Path

    root = Path(fused_rl.__file__).resolve().parent.parent
    for name in ("fused_rl", "kernels"):
        shutil.copytree(root / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    code = (
        "import fused_rl, fused_rl.kernels.modes as m; print(fused_rl.__file__); print(m.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    package, modes = proc.stdout.split()
    assert Path(package).is_relative_to(tmp_path) and Path(modes).is_relative_to(tmp_path), (
        package,
        modes,
    )
