"""Failure modes a user debugging a diverged run relies on (issue 11): NaN in means NaN out on
every backend, kernels never use NaN-dropping min/max, and the host-side guards (threads,
backend selection, argument checks) fail loudly and early."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest
import torch
from conftest import DEVICE

import fused_rl
from fused_rl import config
from fused_rl.compat import torchtune as tt
from fused_rl.compat import verl

BACKENDS = ("reference", "triton")
NAN = float("nan")
B, T, V = 2, 5, 11


def _gen():
    return torch.Generator().manual_seed(11)


def _policy_inputs(device=DEVICE):
    g = _gen()
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g)
    old = torch.randn(B, T, generator=g) - 2.0
    return tuple(t.to(device) for t in (logits, targets, adv, old))


def _policy(backend, *, logits=None, targets=None, old=None, **kw):
    base_logits, base_targets, adv, base_old = _policy_inputs()
    logits = (base_logits if logits is None else logits).requires_grad_(True)
    loss, metrics = fused_rl.policy_loss(
        logits,
        base_targets if targets is None else targets,
        adv,
        old_logprobs=base_old if old is None else old,
        backend=backend,
        **kw,
    )
    loss.backward()
    return loss, metrics, logits.grad


def _poisoned_logit():
    logits = _policy_inputs()[0]
    logits[0, 1, 3] = NAN
    return logits


def _neg_inf_row():
    logits = _policy_inputs()[0]
    logits[1, 2] = -math.inf
    return logits


def _nan_old():
    old = _policy_inputs()[3]
    old[0, 0] = NAN
    return old


def _out_of_range_target():
    targets = _policy_inputs()[1]
    targets[1, 4] = V + 3
    return targets


POLICY_CASES = {
    "nan_logit": dict(logits=_poisoned_logit),
    "neg_inf_row": dict(logits=_neg_inf_row),
    "nan_old_logprobs": dict(old=_nan_old),
    "nan_old_logprobs_kl": dict(
        old=_nan_old, ref_logprobs=_nan_old, beta=0.1, kl_estimator="low_var_kl"
    ),
    "nan_logit_dual_clip": dict(logits=_poisoned_logit, dual_clip=3.0),
    "nan_logit_delta": dict(logits=_poisoned_logit, delta=1.5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(POLICY_CASES))
def test_policy_loss_nan_in_nan_out(case, backend):
    kwargs = {k: (v() if callable(v) else v) for k, v in POLICY_CASES[case].items()}
    loss, _, grad = _policy(backend, **kwargs)
    assert torch.isnan(loss), f"{case}: a NaN token gave the finite loss {loss.item()}"
    assert torch.isnan(grad).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_out_of_range_target_unchecked_is_nan(backend, monkeypatch):
    """With the eager range check off (as under torch.compile) a bad target is NaN, not 0."""
    monkeypatch.setattr(config, "check_values", False)
    loss, _, _ = _policy(backend, targets=_out_of_range_target())
    assert torch.isnan(loss)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_loss_nan_under_compile(backend):
    logits, targets, adv, old = _policy_inputs()
    targets = _out_of_range_target()

    def step(x):
        return fused_rl.policy_loss(x, targets, adv, old_logprobs=old, backend=backend)[0]

    torch._dynamo.reset()
    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(logits)
    assert torch.isnan(loss)


def _token_inputs(n=3):
    g = _gen()
    return [torch.randn(B, T, generator=g).to(DEVICE) for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_nan_value(backend, clip):
    values, old, returns = _token_inputs()
    values[0, 0] = NAN
    values.requires_grad_(True)
    loss, _ = fused_rl.value_loss(values, returns, old, clip=clip, backend=backend)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(values.grad[0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("poisoned", ["pi_logprobs", "phi_values"])
def test_ppo_loss_nan(backend, poisoned):
    old_lp, lp, adv, old_v, v, ret = _token_inputs(6)
    inputs = dict(pi_logprobs=lp, phi_values=v)
    inputs[poisoned][1, 2] = NAN
    loss, policy, value, ratios, _ = fused_rl.ppo_loss(
        old_lp, lp, adv, old_v, v, ret, backend=backend
    )
    assert torch.isnan(loss)
    assert torch.isnan(policy if poisoned == "pi_logprobs" else value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_estimate_nan(backend, kind):
    lp, ref = _token_inputs(2)
    lp[0, 3] = NAN
    ref[1, 1] = NAN
    kl = fused_rl.kl_estimate(lp, ref, kl_estimator=kind, backend=backend)
    assert torch.isnan(kl[0, 3]) and torch.isnan(kl[1, 1])
    assert torch.isfinite(kl).sum() == kl.numel() - 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalized_rewards_nan(backend):
    lp, ref = _token_inputs(2)
    lp[0, 3] = NAN
    scores = torch.ones(B, device=DEVICE)
    rewards = fused_rl.kl_penalized_rewards(
        scores, lp, ref, kl_coef=0.1, kl_estimator="low_var_kl", backend=backend
    )
    assert torch.isnan(rewards[0, 3]) and torch.isfinite(rewards[1]).all()


def test_compat_adapters_nan():
    old_lp, lp, adv, old_v, v, ret = _token_inputs(6)
    lp[0, 0] = NAN
    assert torch.isnan(tt.PPOLoss()(old_lp, lp, adv, old_v, v, ret)[0])
    assert torch.isnan(verl.kl_penalty(lp, old_lp, "low_var_kl")[0, 0])


KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels"


def test_kernels_propagate_nan_in_min_max():
    """``tl.minimum``/``tl.maximum`` drop NaN by default; kernels must use
    ``kernels.common.nan_min/nan_max/clamp`` (or pass ``propagate_nan`` themselves)."""
    offenders = []
    for path in sorted(KERNELS.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for call in re.finditer(r"tl\.(minimum|maximum|clamp)\(", code):
                if "propagate_nan=tl.PropagateNan.ALL" not in code[call.start() :]:
                    offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, "NaN-dropping min/max in kernels:\n" + "\n".join(offenders)


def test_vocab_streams_exponentiate_with_one_instruction():
    """The vocab-stream kernels call ``kernels.common.exp`` (a multiply and
    ``ex2.approx.ftz``: two sm_90 instructions a value) and not ``tl.exp``, ``tl.math.exp``
    or libdevice's (five, with the denormal fix-up, or more): a stream's exponential per
    logit was a fifth of its work (``tests/hopper_compile.py`` ``STREAM_BUDGETS`` measures
    three of them)."""
    offenders = []
    for path in sorted((KERNELS / "vocab").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b(tl\.(math\.)?exp|libdevice\.exp|fast_expf)\(", line.split("#", 1)[0]):
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, "tl.exp in a vocab stream:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- host side


def test_a_launch_without_the_compile_options_fails_the_suite(monkeypatch):
    """The suite's guard (``helpers.pinned_compile_options``, on for every test) is live on
    the real launch path: a launcher that drops ``COMPILE_OPTIONS`` raises, naming the
    kernel; the same call with them passes."""
    import fused_rl.kl

    x, y = torch.randn(2, 5), torch.randn(2, 5)
    expected = fused_rl.kl_estimate(x, y, kl_estimator="k3", backend="triton")
    monkeypatch.setattr(fused_rl.kl, "COMPILE_OPTIONS", {})
    with pytest.raises(AssertionError, match="_kl_estimate_fwd_kernel launched without"):
        fused_rl.kl_estimate(x, y, kl_estimator="k3", backend="triton")
    monkeypatch.undo()
    torch.testing.assert_close(
        fused_rl.kl_estimate(x, y, kl_estimator="k3", backend="triton"), expected
    )


def test_interpreted_launches_are_thread_safe():
    """The Triton interpreter is not re-entrant across threads; fused_rl serialises its
    interpreted launches, so concurrent calls give exactly the single-threaded results."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter")
    import threading

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(3, 4, 37, generator=g, requires_grad=True)
        targets = torch.randint(0, 37, (3, 4), generator=g)
        adv = torch.randn(3, 4, generator=g)
        logp = fused_rl.token_logprobs(logits, targets, backend="triton")
        loss, _ = fused_rl.policy_loss(logits, targets, adv, backend="triton")
        (loss + logp.sum()).backward()
        return loss.detach(), logp.detach(), logits.grad

    expected = {seed: work(seed) for seed in range(4)}
    results, errors = {}, []

    def thread(seed):
        try:
            for _ in range(3):
                results[seed] = work(seed)
                for got, want in zip(results[seed], expected[seed]):
                    assert torch.equal(got, want)
        except Exception as e:  # collected: an exception in a thread does not fail the test
            errors.append(repr(e))

    threads = [threading.Thread(target=thread, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(results) == list(range(4))


_LATE_INTERPRETER = """
import os, warnings
import triton  # Triton's standard library is compiled for the GPU from here on
os.environ["TRITON_INTERPRET"] = "1"
import torch, fused_rl
x, t = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fused_rl.token_logprobs(x, t)
assert torch.allclose(out, torch.log_softmax(x, -1).gather(-1, t[..., None])[..., 0])
assert any("set TRITON_INTERPRET=1 before" in str(w.message) for w in caught), caught
try:
    fused_rl.token_logprobs(x, t, backend="triton")
except RuntimeError as e:
    assert "TRITON_INTERPRET=1 was set after `import triton`" in str(e), e
else:
    raise AssertionError("backend='triton' ran with a broken interpreter")
print("ok")
"""


@pytest.mark.integration
def test_interpreter_enabled_after_triton_import_is_explained():
    """``TRITON_INTERPRET=1`` set after ``import triton`` cannot work: ``auto`` runs the
    reference with a warning that says what to do, ``triton`` raises the same words."""
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _LATE_INTERPRETER], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scalar", [np.float32, np.float64, np.int64])
def test_numpy_scalar_hyper_parameters(backend, scalar):
    """Any real scalar is a hyper-parameter (configs loaded with NumPy hold ``np.float32``);
    the result is the one the equal Python float gives (every value here is exact in fp32)."""
    logits, targets, adv, old = _policy_inputs()
    x, y = _token_inputs(2)
    calls = {
        "token_logprobs": lambda c: fused_rl.token_logprobs(
            logits, targets, temperature=c(2), backend=backend
        ),
        "policy_loss": lambda c: fused_rl.policy_loss(
            logits,
            targets,
            adv,
            old_logprobs=old,
            eps_low=c(0.25),
            dual_clip=c(3),
            beta=c(0.5),
            ref_logprobs=old,
            temperature=c(2),
            backend=backend,
        )[0],  # fmt: skip
        "gae": lambda c: fused_rl.gae(x, y, gamma=c(1), lam=c(0.5), backend=backend)[0],
        "value_loss": lambda c: fused_rl.value_loss(x, y, x, clip=c(0.25), backend=backend)[0],
        "kl_rewards": lambda c: fused_rl.kl_penalized_rewards(
            torch.ones(B, device=DEVICE), x, y, kl_coef=c(0.5), backend=backend
        ),
        "whiten": lambda c: fused_rl.masked_whiten(x, eps=c(1), backend=backend),
    }
    for name, call in calls.items():
        want = call(float)
        got = call(lambda v: scalar(v) if scalar(v) == v else v)  # int64: the integral ones
        assert torch.equal(got, want), name


def test_policy_loss_module_validates_at_construction():
    from fused_rl.nn import PolicyLoss

    for options, match in [
        (dict(kl_estimator="k9"), "kl_estimator must be one of"),
        (dict(loss_agg="bogus"), "loss_agg must be one of"),
        (dict(eps_low=-0.1), "eps_low must be"),
        (dict(dual_clip=0.5), "dual_clip must be > 1"),
        (dict(temperature=0.0), "temperature must be"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(max_length=0), "max_length must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            PolicyLoss(**options)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        PolicyLoss(ignore_index=1.5)
    PolicyLoss(
        eps_low=np.float32(0.2), beta=0.1, kl_estimator="k3"
    )  # beta needs ref_logprobs only later


def test_meta_tensors():
    """Meta tensors (shape inference, FSDP's deferred init) run: value checks are skipped,
    outputs are meta tensors of the right shape."""
    d = "meta"
    logits = torch.empty(B, T, V, device=d)
    targets = torch.empty(B, T, dtype=torch.long, device=d)
    x, seq = torch.empty(B, T, device=d), torch.empty(B, device=d)
    outs = {
        "token_logprobs": fused_rl.token_logprobs(logits, targets),
        "policy_loss": fused_rl.policy_loss(logits, targets, seq, old_logprobs=x)[0],
        "gaussian_logprob": fused_rl.gaussian_logprob(x, x, x),
        "gaussian_entropy": fused_rl.gaussian_entropy(x),
        "trl": __import__("fused_rl.compat.trl").compat.trl.selective_log_softmax(logits, targets),
        "verl": verl.logprobs_from_logits(logits, targets),
        "kl_rewards": fused_rl.kl_penalized_rewards(seq, x, x, kl_coef=0.1),
    }
    for name, out in outs.items():
        assert out.is_meta, name
    assert outs["token_logprobs"].shape == (B, T)


@pytest.mark.parametrize("backend", BACKENDS)
def test_trl_sentinel_label_unchecked_is_nan(backend, monkeypatch):
    """The adapters' internal 'no ignore index' value is a label like any other bad one."""
    from fused_rl.compat import trl

    monkeypatch.setattr(config, "check_values", False)
    # the patch below steers auto only for CPU tensors (CUDA ones always take Triton)
    logits, targets, _, _ = _policy_inputs(DEVICE if backend == "triton" else "cpu")
    targets[0, 1] = -(2**31)
    targets[1, 2] = -(2**31) + 1
    monkeypatch.setattr(fused_rl._backend, "interpreter_enabled", lambda: backend == "triton")
    logp = trl.selective_log_softmax(logits, targets)
    assert torch.isnan(logp[0, 1]) and torch.isnan(logp[1, 2])
    assert torch.isfinite(logp).sum() == logp.numel() - 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [0.0, -4.0, NAN])
def test_num_items_tensor_not_positive_is_nan(backend, count):
    """A float ``num_items <= 0`` raises; a tensor's value is never read on the host, so one
    that holds 0, a negative count or NaN gives a NaN loss, on both backends."""
    loss, metrics, grad = _policy(backend, num_items=torch.tensor(count, device=DEVICE))
    assert torch.isnan(loss) and torch.isnan(grad).any()
    # the normaliser is NaN: each gradient element NaN or 0, which ones differs by backend
    # (fuzz finding 10, documented in CONTRIBUTING.md)
    assert (torch.isnan(grad) | (grad == 0)).all()
    assert torch.isfinite(metrics["ratio_mean"])  # the metrics do not use the count
    lp = torch.randn(B, T, device=DEVICE, requires_grad=True)
    loss, _ = fused_rl.policy_loss_from_logprobs(
        lp, torch.ones(B, device=DEVICE), old_logprobs=lp.detach(),
        num_items=torch.tensor(count, device=DEVICE),
        backend=backend,
    )  # fmt: skip
    assert torch.isnan(loss)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isnan(grad).any() and (torch.isnan(grad) | (grad == 0)).all()
    with pytest.raises(ValueError, match="num_items must be"):
        _policy(backend, num_items=count if count == count else 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_num_items_not_positive_empty_batch(backend, loss_agg):
    """With no token at all, a ``num_items`` tensor <= 0 makes the policy loss NaN with
    ``token-mean``, the mode that reads it, and 0 otherwise, as for a non-empty batch, on
    both backends; the gradient is empty."""
    lp = torch.zeros(0, T, device=DEVICE, requires_grad=True)
    loss, _ = fused_rl.policy_loss_from_logprobs(
        lp, torch.zeros(0, device=DEVICE), num_items=torch.tensor(0.0, device=DEVICE),
        loss_agg=loss_agg, backend=backend,
    )  # fmt: skip
    if loss_agg == "token-mean":
        assert torch.isnan(loss)
    else:
        assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.shape == (0, T)
    full = torch.zeros(B, T, device=DEVICE, requires_grad=True)  # a non-empty batch: 0
    loss, _ = fused_rl.policy_loss_from_logprobs(
        full, torch.zeros(B, device=DEVICE), num_items=torch.tensor(0.0, device=DEVICE),
        loss_agg=loss_agg, backend=backend,
    )  # fmt: skip
    assert torch.isnan(loss) if loss_agg == "token-mean" else loss.item() == 0.0


def _negative_mask_calls(backend, mask):
    """Every native op whose mask is a per-token weight, called with ``mask``: name -> call."""
    x, y = _token_inputs(2)
    from fused_rl.nn import PolicyLoss

    logits, targets, adv, old = _policy_inputs()
    ppo = (x, x, y, y, x, y)
    return {
        "masked_sum": lambda: fused_rl.masked_sum(x, mask, backend=backend),
        "masked_mean": lambda: fused_rl.masked_mean(x, mask, dim=1, backend=backend),
        "masked_var": lambda: fused_rl.masked_var(x, mask, backend=backend),
        "masked_whiten": lambda: fused_rl.masked_whiten(x, mask, backend=backend),
        "value_loss": lambda: fused_rl.value_loss(x, y, x, mask=mask, backend=backend)[0],
        "ppo_loss padding_masks": lambda: fused_rl.ppo_loss(*ppo, mask, backend=backend)[0],
        "ppo_loss value_padding_masks": lambda: fused_rl.ppo_loss(
            *ppo, None, mask, backend=backend
        )[0],
        "policy_loss": lambda: _policy(backend, mask=mask)[0],
        "policy_loss_from_logprobs": lambda: fused_rl.policy_loss_from_logprobs(
            x, torch.ones(B, device=DEVICE), old_logprobs=y, mask=mask, backend=backend
        )[0],
        "PolicyLoss": lambda: PolicyLoss(backend=backend)(
            logits, targets, adv, old_logprobs=old, mask=mask
        )[0],
    }


def _negative_mask(dtype=torch.float32):
    mask = torch.ones(B, T, dtype=dtype, device=DEVICE)
    mask[1, 2] = -1
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_mask_weight_raises(backend, dtype):
    """A float (or integer) mask is a per-token weight, ``sum(m L) / sum(m)``, so it must be
    >= 0. In eager mode with value checks on (as for target ranges) a negative one raises
    ``ValueError`` naming the mask, on every op whose mask is a weight."""
    for name, call in _negative_mask_calls(backend, _negative_mask(dtype)).items():
        arg = name.split()[-1] if name.startswith("ppo_loss") else "mask"
        kind = "a float" if dtype.is_floating_point else "an integer"
        with pytest.raises(ValueError, match=rf"^{arg} has a negative weight \(-1(\.0)? at "
                           rf"index \(1, 2\)\); {kind} mask is a per-token weight and must "
                           "be >= 0$"):  # fmt: skip
            call()


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_mask_weight_unchecked_is_nan(backend, monkeypatch):
    """Unchecked (``check_values=False``, ``torch.compile``) a negative weight cannot be
    rejected without reading the mask on the host, so it makes every result it reaches NaN,
    the same on both backends (it used to give -1.0 on one and 0.0 on the other)."""
    monkeypatch.setattr(config, "check_values", False)
    for name, call in _negative_mask_calls(backend, _negative_mask()).items():
        out = call()
        assert torch.isnan(out).all() if name == "masked_whiten" else torch.isnan(out).any(), name
    # weights >= 0, fractional ones included, stay finite
    x, _ = _token_inputs(2)
    assert torch.isfinite(fused_rl.masked_mean(x, _negative_mask().abs() * 0.5, backend=backend))


def test_negative_mask_weight_under_compile_is_nan():
    """The same call raises in eager mode; compiled it never reads values on the host: NaN,
    not an error."""
    x, _ = _token_inputs(2)
    call = lambda x, m: fused_rl.masked_mean(x, m, backend="triton")  # noqa: E731
    assert torch.isfinite(call(x, _negative_mask().abs()))
    with pytest.raises(ValueError, match="mask has a negative weight"):
        call(x, _negative_mask())
    fn = torch.compile(call, fullgraph=True, backend="aot_eager")
    assert torch.isnan(fn(x, _negative_mask()))
    assert torch.equal(fn(x, _negative_mask().abs()), call(x, _negative_mask().abs()))


def _nan_or(got: torch.Tensor, clean: torch.Tensor) -> bool:
    """Every element of ``got`` is NaN or equal to ``clean``'s."""
    return bool((torch.isnan(got) | (got == clean)).all())


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_mask_weight_unchecked_gradients(backend, loss_agg, monkeypatch):
    """Fuzz finding 10, documented (CONTRIBUTING.md, "NaN, threads and other failure modes"):
    unchecked, a negative weight is a NaN weight that counts its token: the loss and the
    mean metrics are NaN, ``ratio_max`` takes that token's ratio too, and each gradient
    element is NaN or its value with the weight at 0, with a layout that differs by backend
    and path (Triton: ``g_t`` times the NaN normaliser, the reference: autograd)."""
    monkeypatch.setattr(config, "check_values", False)

    def run(mask):
        lp = torch.tensor([[-0.2, -1.0, -2.0, -0.3]], device=DEVICE, requires_grad=True)
        loss, metrics = fused_rl.policy_loss_from_logprobs(
            lp, torch.ones(1, device=DEVICE), old_logprobs=torch.full((1, 4), -1.0, device=DEVICE),
            mask=mask, loss_agg=loss_agg, backend=backend,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, lp)
        return loss, metrics, grad

    loss, metrics, grad = run(torch.tensor([[-0.5, 1.0, 0.0, 2.0]], device=DEVICE))
    clean_loss, _, clean = run(torch.tensor([[0.0, 1.0, 0.0, 2.0]], device=DEVICE))
    assert torch.isnan(loss) and torch.isfinite(clean_loss)
    for name in ("ratio_mean", "approx_kl", "clip_frac", "clip_frac_high", "dual_clip_frac"):
        assert torch.isnan(metrics[name]), name
    # the negative-weight token's ratio exp(-0.2 + 1) is the largest: a max, not a mean
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(0.8), rel=1e-6)
    assert _nan_or(grad, clean)
    token_mean = loss_agg == "token-mean"  # seq-mean-token-sum's normaliser 1 / B is finite
    nan_at = {  # token 0 is clipped (no gradient), 2 does not count, 3 is clipped
        # token-mean: every g_t times the NaN normaliser 1 / sum(m); seq-mean-token-sum: the
        # NaN weight's own token only (m * 0 is NaN)
        "triton": [True] * 4 if token_mean else [True, False, False, False],
        "reference": [False, token_mean, False, False],  # NaN weight x a nonzero gradient
    }[backend]
    assert torch.isnan(grad[0]).tolist() == nan_at, grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_mask_weight_unchecked_at_an_ignored_token(backend, monkeypatch):
    """Fuzz finding 9, fixed: an ``ignore_index`` token never counts, whatever its weight
    (the ignore mask is applied after the weight, so a negative weight's NaN does not reach
    it): unchecked, the call equals the one with that weight at 0, on both backends."""
    monkeypatch.setattr(config, "check_values", False)

    def run(mask):
        logits = torch.linspace(-2, 2, 15, device=DEVICE).reshape(1, 3, 5).requires_grad_(True)
        loss, metrics = fused_rl.policy_loss(
            logits, torch.tensor([[-100, 1, 2]], device=DEVICE), torch.ones(1, device=DEVICE),
            old_logprobs=torch.full((1, 3), -1.5, device=DEVICE), mask=mask, backend=backend,
        )  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logits)
        return loss, metrics, grad

    loss, metrics, grad = run(torch.tensor([[-0.5, 1.0, 1.0]], device=DEVICE))
    clean_loss, clean_metrics, clean = run(torch.tensor([[0.0, 1.0, 1.0]], device=DEVICE))
    assert torch.isfinite(loss) and torch.equal(loss, clean_loss)
    assert all(torch.equal(metrics[k], clean_metrics[k]) for k in clean_metrics)
    assert torch.equal(grad, clean)
    assert torch.equal(grad[0, 0], torch.zeros(5, device=DEVICE))  # an ignored row: no gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_weight_check_skips_what_cannot_be_negative(backend, monkeypatch):
    """Bool and unsigned masks hold nothing < 0: no host read; indicator masks (``gae``,
    ``kl_penalized_rewards``: nonzero counts) are not weights, so a negative value counts."""
    from fused_rl import _validation as V

    reads = []
    real = V.value_checks_enabled
    monkeypatch.setattr(V, "value_checks_enabled", lambda *t: reads.append(t) or real(*t))
    x, y = _token_inputs(2)
    for mask in (
        torch.ones(B, T, dtype=torch.bool, device=DEVICE),
        torch.ones(B, T, dtype=torch.uint8, device=DEVICE),
    ):
        fused_rl.masked_sum(x, mask, backend=backend)
        fused_rl.policy_loss_from_logprobs(
            x, torch.ones(B, device=DEVICE), mask=mask, backend=backend
        )
    assert not reads
    fused_rl.masked_sum(x, torch.ones(B, T, device=DEVICE), backend=backend)
    assert len(reads) == 1  # a float mask is read (once)
    monkeypatch.undo()
    mask = _negative_mask()
    adv, ret = fused_rl.gae(x, y, gamma=0.9, lam=0.9, mask=mask, backend=backend)
    want = fused_rl.gae(x, y, gamma=0.9, lam=0.9, mask=mask != 0, backend=backend)
    assert torch.equal(adv, want[0]) and torch.equal(ret, want[1])
    rewards = fused_rl.kl_penalized_rewards(
        torch.ones(B, device=DEVICE), x, y, kl_coef=0.1, mask=mask, backend=backend
    )
    assert torch.equal(
        rewards,
        fused_rl.kl_penalized_rewards(
            torch.ones(B, device=DEVICE), x, y, kl_coef=0.1, mask=mask != 0, backend=backend
        ),
    )


def _double_backward(loss, x):
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    torch.autograd.grad((g * torch.randn_like(g)).sum() + x.square().sum(), x)


@pytest.mark.parametrize("op", ["policy_loss", "kl_estimate", "value_loss", "ppo_loss", "gauss"])
def test_triton_double_backward_raises(op):
    """Every Triton backward computes its gradient from saved statistics taken as constants, so
    a Hessian-vector product through it raises (it used to be silently wrong: off by 0.4)."""
    logits = _policy_inputs()[0].double().requires_grad_(True)
    x = torch.randn(B, T, dtype=torch.float64, device=DEVICE, requires_grad=True)
    y = torch.randn(B, T, dtype=torch.float64, device=DEVICE)
    losses = {
        "policy_loss": lambda: (logits, _policy_tensor_loss(logits)),
        "kl_estimate": lambda: (
            x,
            fused_rl.kl_estimate(x, y, kl_estimator="k3", backend="triton").sum(),
        ),
        "value_loss": lambda: (x, fused_rl.value_loss(x, y, y, clip=0.1, backend="triton")[0]),
        "ppo_loss": lambda: (x, fused_rl.ppo_loss(y, x, y, y, x, y, backend="triton")[0]),
        "gauss": lambda: (x, fused_rl.gaussian_logprob(x, y.exp(), y, backend="triton").sum()),
    }
    source, loss = losses[op]()
    with pytest.raises(RuntimeError, match="differentiable once"):
        _double_backward(loss, source)


def _policy_tensor_loss(logits):
    _, targets, adv, old = _policy_inputs()
    return fused_rl.policy_loss(
        logits, targets, adv.double(), old_logprobs=old.double(), backend="triton"
    )[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 0, 5), (2, 0, 3, 5), (0, 2, 3, 5)])
def test_empty_leading_dims(backend, shape):
    """A 4-D logits tensor with an empty leading dim (found by the fuzz suite: ``reshape(-1,
    ...)`` is ambiguous for 0 elements) gives empty outputs and gradients."""
    logits = torch.randn(shape, device=DEVICE, requires_grad=True)
    targets = torch.zeros(shape[:-1], dtype=torch.long, device=DEVICE)
    logp, entropy = fused_rl.token_logprobs(logits, targets, return_entropy=True, backend=backend)
    (logp.sum() + entropy.sum()).backward()
    assert logp.shape == entropy.shape == shape[:-1] and logits.grad.shape == shape
