"""Gemma-style logit soft-capping (``softcap=``) in every vocabulary op.

The logits ``x`` (after the lm_head) become ``c tanh(x / c)``, THEN are divided by the
temperature: ``z = c tanh(x / c) / T``. Each op is compared, values and gradients under a
random upstream gradient, with a float64 oracle written here in plain torch (the cap, then
``log_softmax``; the policy loss through ``tests/policy_oracle.py`` on the capped logits),
on both backends, fp32 and bf16, small awkward shapes (odd V, V below a block, T = 1,
ignored tokens, a non-contiguous slice, the model's ``(B, S, V)`` buffer). ``softcap=None``
runs the uncapped kernels (``HAS_SOFTCAP=False``) and gives exactly the uncapped result.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, assert_rel, bf16_tol, gradcheck
from policy_oracle import oracle_policy_loss

import fused_rl
from fused_rl.nn import LinearPolicyLoss, PolicyLoss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_harness import check_registry, failures, needs_gloo, needs_interpreter  # noqa: E402

BACKENDS = ("triton", "reference")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def capped(x, softcap, temperature=1.0):
    """``c tanh(x / c) / T`` (in ``x``'s dtype: float64 for the oracle, bf16 for eager)."""
    return softcap * torch.tanh(x / softcap) / temperature


def oracle_stats(x, targets, softcap, temperature=1.0, ignore_index=-100):
    """``(logp, entropy)`` of ``log_softmax(c tanh(x / c) / T)`` in ``x``'s dtype; the
    ``(..., S, V)`` buffer with ``S > T`` targets uses positions ``S - T - 1 ... S - 2``;
    0 at ignored targets."""
    if x.shape[:-1] != targets.shape:
        shift = x.shape[-2] - targets.shape[-1] - 1
        x = x.narrow(-2, shift, targets.shape[-1])
    lp = torch.log_softmax(capped(x, softcap, temperature), dim=-1)
    entropy = -(lp.exp() * lp).sum(-1)
    keep = targets != ignore_index
    logp = lp.gather(-1, torch.where(keep, targets, 0).long()[..., None])[..., 0]
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero)


def value_and_grads(fn, leaves, upstream):
    """``fn(*leaves)`` (a tuple of tensors) and the gradients of ``sum_i out_i * up_i``
    w.r.t. each leaf (fresh copies that require grad)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in leaves]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    total = sum((o * u.to(o.dtype)).sum() for o, u in zip(outs, upstream))
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(total, present)
    return [o.detach() for o in outs], list(grads)


# ----------------------------------------------------------------------------- token_logprobs

# (logits shape, targets shape, temperature, softcap, view): odd V; V below a block with
# T = 1; the model's (B, S, V) buffer with S > T; a non-contiguous slice
CASES = {
    "odd_V": ((2, 5, 37), (2, 5), 0.7, 5.0, None),
    "tiny_V": ((3, 4, 3), (3, 4), 1.0, 2.0, None),
    "buffer": ((2, 6, 29), (2, 4), 1.3, 8.0, None),
    "slice": ((2, 6, 46), (2, 5), 0.9, 4.0, lambda x: x[:, :-1, ::2]),
}


def _case_inputs(name, device, seed=0):
    shape, tshape, temperature, softcap, view = CASES[name]
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=g) * 3 * softcap).to(device)  # many saturate
    vocab = shape[-1] if view is None else view(base).shape[-1]
    targets = torch.randint(0, vocab, tshape, generator=g).to(device)
    targets[0, 0] = -100
    targets[-1, -1] = vocab - 1
    ups = [torch.randn(tshape, generator=g).to(device) for _ in range(2)]
    return base, targets, ups, temperature, softcap, view or (lambda x: x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_token_logprobs(backend, dtype, case, device):
    base, targets, ups, temperature, softcap, view = _case_inputs(case, device)
    x = base.to(DTYPES[dtype])

    def fused(leaf):
        return fused_rl.token_logprobs(
            view(leaf), targets, temperature=temperature, softcap=softcap,
            return_entropy=True, backend=backend,
        )  # fmt: skip

    (lp, ent), (grad,) = value_and_grads(fused, [x], ups)
    oracle = lambda leaf: oracle_stats(view(leaf), targets, softcap, temperature)  # noqa: E731
    (o_lp, o_ent), (o_grad,) = value_and_grads(oracle, [x.double()], ups)
    assert grad.dtype == x.dtype and grad.shape == x.shape
    assert lp[0, 0] == 0 and ent[0, 0] == 0, "ignored token"
    if dtype == "fp32":
        tols = (FP32_TOL,) * 3
    else:  # no worse than twice the error of the same math in eager bf16
        (e_lp, e_ent), (e_grad,) = value_and_grads(oracle, [x], ups)
        tols = (bf16_tol(e_lp, o_lp), bf16_tol(e_ent, o_ent), bf16_tol(e_grad, o_grad))
    assert_rel(lp, o_lp, tols[0], "logp")
    assert_rel(ent, o_ent, tols[1], "entropy")
    assert_rel(grad, o_grad, tols[2], "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_entropy(backend, device):
    base, targets, ups, temperature, softcap, view = _case_inputs("slice", device, seed=1)
    up = torch.randn(base.shape[:-1], device=device)

    def fused(leaf):
        return fused_rl.token_entropy(
            leaf, temperature=temperature, softcap=softcap, backend=backend
        )

    def oracle(leaf):
        lp = torch.log_softmax(capped(leaf, softcap, temperature), dim=-1)
        return -(lp.exp() * lp).sum(-1)

    (ent,), (grad,) = value_and_grads(fused, [base], [up])
    (o_ent,), (o_grad,) = value_and_grads(oracle, [base.double()], [up])
    assert_rel(ent, o_ent, FP32_TOL, "entropy")
    assert_rel(grad, o_grad, FP32_TOL, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cap_saturates_to_uniform_and_passes_nan(backend, device):
    """``+-inf`` logits become ``+-c`` (finite, zero gradient there); a NaN stays NaN."""
    x = torch.tensor([[[float("-inf"), 0.0, float("inf"), 1.0]]], device=device)
    targets = torch.tensor([[2]], device=device)
    leaf = x.clone().requires_grad_()
    lp = fused_rl.token_logprobs(leaf, targets, softcap=2.0, backend=backend)
    lp.sum().backward()
    want = torch.log_softmax(torch.tensor([-2.0, 0.0, 2.0, 2 * torch.tanh(torch.tensor(0.5))]), -1)
    assert_rel(lp[0, 0], want[2], FP32_TOL, "logp")
    assert leaf.grad[0, 0, 0] == 0 and leaf.grad[0, 0, 2] == 0
    assert torch.isfinite(leaf.grad).all()
    nan = x.clone()
    nan[0, 0, 1] = float("nan")
    assert fused_rl.token_logprobs(nan, targets, softcap=2.0, backend=backend).isnan().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 7, generator=g, dtype=torch.float64) * 3).to(device)
    logits.requires_grad_()
    targets = torch.randint(0, 7, (2, 3), generator=g).to(device)
    targets[0, 1] = -100

    def fn(x):
        return fused_rl.token_logprobs(
            x, targets, temperature=0.8, softcap=2.5, return_entropy=True, backend=backend
        )

    assert gradcheck(fn, (logits,))
    # fp64 logits: fp64-exact statistics (the cap's fp32 (hi, lo) pairs recombined in fp64)
    with torch.no_grad():
        lp, ent = fn(logits)
        o_lp, o_ent = oracle_stats(logits, targets, 2.5, 0.8)
    assert_rel(lp, o_lp, F64_TOL, "fp64 logp")
    assert_rel(ent, o_ent, F64_TOL, "fp64 entropy")


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    base, targets, ups, temperature, softcap, _ = _case_inputs("buffer", device, seed=4)

    def fn(x):
        return fused_rl.token_logprobs(
            x, targets, temperature=temperature, softcap=softcap, return_entropy=True
        )

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs, grads = value_and_grads(fn, [base], ups)
    c_outs, c_grads = value_and_grads(compiled, [base], ups)
    for name, a, b in zip(("logp", "entropy", "grad"), [*outs, *grads], [*c_outs, *c_grads]):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    (o_lp, _), _ = value_and_grads(
        lambda x: oracle_stats(x, targets, softcap, temperature), [base.double()], ups
    )
    assert_rel(c_outs[0], o_lp, FP32_TOL, "compiled logp")


# ----------------------------------------------------------------------------- softcap=None


class _Flags:
    """Records the ``HAS_SOFTCAP`` of every launch of the vocab kernels."""

    def __init__(self, monkeypatch):
        import fused_rl.kernels.vocab.layer1 as l1
        import fused_rl.kernels.vocab.layer3 as l3
        import fused_rl.kernels.vocab.policy_fused as pf

        self.seen = []
        for module, name in ((l1, "_token_stats_fwd_kernel"), (l3, "_token_stats_bwd_kernel"),
                             (pf, "_policy_loss_fwd_kernel")):  # fmt: skip
            monkeypatch.setattr(module, name, self._spy(getattr(module, name)))

    def _spy(self, kernel):
        flags = self

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    flags.seen.append(kw["HAS_SOFTCAP"])
                    return kernel[grid](*args, **kw)

                return launch

        return Spy()


def _calls(device):
    """Every public vocabulary op as ``name -> fn(**softcap_kw) -> tensors``, on inputs with
    gradients (their gradients returned too)."""
    g = torch.Generator().manual_seed(5)
    B, S, T, V, H = 2, 5, 4, 19, 6
    logits = torch.randn(B, S, V, generator=g).to(device) * 4
    hidden = torch.randn(B, S, H, generator=g).to(device)
    weight = torch.randn(V, H, generator=g).to(device)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    targets[1, 0] = -100
    adv = torch.randn(B, generator=g).to(device)
    old = -torch.rand(B, T, generator=g).to(device) * 3
    policy = dict(old_logprobs=old, eps_high=0.28, entropy_coef=0.01)

    def run(fn, *leaves):
        def call(**kw):
            xs = [t.detach().clone().requires_grad_() for t in leaves]
            out = fn(*xs, **kw)
            out = out[0] if isinstance(out, tuple) and isinstance(out[1], dict) else out
            out = out if isinstance(out, tuple) else (out,)
            total = sum(o.sum() for o in out)
            return [*out, *torch.autograd.grad(total, xs)]

        return call

    return {
        "token_logprobs": run(
            lambda x, **kw: fused_rl.token_logprobs(x, targets, return_entropy=True, **kw),
            logits,
        ),
        "token_entropy": run(fused_rl.token_entropy, logits),
        "policy_loss": run(
            lambda x, **kw: fused_rl.policy_loss(x, targets, adv, **policy, **kw), logits
        ),
        "policy_loss_gspo": run(
            lambda x, **kw: fused_rl.policy_loss(
                x, targets, adv, importance_sampling="sequence", **policy, **kw
            ),
            logits,
        ),
        "linear_token_logprobs": run(
            lambda h, w, **kw: fused_rl.linear_token_logprobs(
                h, w, targets, chunk_tokens=3, return_entropy=True, **kw
            ),
            hidden,
            weight,
        ),
        "linear_policy_loss": run(
            lambda h, w, **kw: fused_rl.linear_policy_loss(
                h, w, targets, adv, chunk_tokens=3, **policy, **kw
            ),
            hidden,
            weight,
        ),
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_none_is_the_uncapped_call(backend, device, monkeypatch):
    """``softcap=None`` gives bit for bit the call without the keyword, through kernels
    launched with ``HAS_SOFTCAP=False`` (the variant compiled before the option existed);
    a cap launches the capped variant and changes the result."""
    flags = _Flags(monkeypatch)
    for name, call in _calls(device).items():
        flags.seen.clear()
        plain = call(backend=backend)
        none = call(backend=backend, softcap=None)
        for a, b in zip(plain, none):
            assert torch.equal(a, b), name
        if backend == "triton":
            assert flags.seen and not any(flags.seen), (name, flags.seen)
        flags.seen.clear()
        cap = call(backend=backend, softcap=3.0)
        if backend == "triton":
            assert flags.seen and all(flags.seen), (name, flags.seen)
        assert not torch.allclose(cap[0], plain[0]), name


# ----------------------------------------------------------------------------- policy_loss

POLICY_CASES = {  # the fused kernel; layer 1 + the sequence pass; the composition
    "token": dict(beta=0.04, entropy_coef=0.01),
    "sequence": dict(importance_sampling="sequence"),
    "top_entropy": dict(top_entropy_quantile=0.5),
}


def _top_entropy_oracle(window, targets, adv, old, mask, c, T):
    """TRL's ``top_entropy_quantile=0.5``, token-mean: the clipped surrogate of the counted
    tokens whose entropy is at or above the median (the others count in the mean only)."""
    lp = torch.log_softmax(capped(window, c, T), dim=-1)
    counted = mask & (targets != -100)
    logp = lp.gather(-1, torch.where(counted, targets, 0)[..., None])[..., 0]
    ent = -(lp.exp() * lp).sum(-1).detach()
    keep = fused_rl.losses.top_entropy_tokens(ent, counted, quantile=0.5)
    ratio = torch.exp(logp - old.double())
    a = adv.double()[:, None]
    term = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
    return torch.where(keep, term, 0.0).sum() / counted.sum()


def _policy_inputs(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, S, T, V = 3, 5, 4, 23
    logits = (torch.randn(B, S, V, generator=g) * 12).to(device, dtype)  # the model's buffer
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    targets[0, 1] = -100
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, -1] = False
    adv = torch.randn(B, generator=g).to(device)
    with torch.no_grad():
        logp, _ = oracle_stats(logits.double(), targets, 6.0, 0.8)
    old = (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64).to(device)).float()
    ref = (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64).to(device)).float()
    return logits, targets, adv, dict(old_logprobs=old.to(device), ref_logprobs=ref.to(device),
                                      mask=mask.to(device))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(POLICY_CASES))
def test_policy_loss(backend, dtype, case, device):
    logits, targets, adv, tensors = _policy_inputs(device, DTYPES[dtype], seed=6)
    opts = dict(POLICY_CASES[case], eps_high=0.28)
    T, c = 0.8, 6.0

    def fused(x):
        return fused_rl.policy_loss(
            x, targets, adv, temperature=T, softcap=c, backend=backend, **tensors, **opts
        )

    def oracle(x):
        # the policy math on the capped logits (the oracle divides by T itself)
        window = x[:, -targets.shape[1] - 1 : -1]
        if case == "top_entropy":
            old = tensors["old_logprobs"]
            return _top_entropy_oracle(window, targets, adv, old, tensors["mask"], c, T), {}
        return oracle_policy_loss(capped(window, c), targets, adv, temperature=T, **tensors,
                                  **opts)  # fmt: skip

    up = [torch.randn(()).to(device)]
    (loss,), (grad,) = value_and_grads(lambda x: fused(x)[0], [logits], up)
    (o_loss,), (o_grad,) = value_and_grads(lambda x: oracle(x)[0], [logits.double()], up)
    _, metrics = fused(logits)
    assert grad.dtype == logits.dtype
    if dtype == "fp32":
        tol_loss = tol_grad = FP32_TOL
    else:
        (e_loss,), (e_grad,) = value_and_grads(lambda x: oracle(x)[0], [logits], up)
        tol_loss, tol_grad = bf16_tol(e_loss, o_loss), bf16_tol(e_grad, o_grad)
    assert_rel(loss, o_loss, tol_loss, "loss")
    assert_rel(grad, o_grad, tol_grad, "grad")
    if case == "token":
        _, o_metrics = oracle(logits.double())
        tol = FP32_TOL if dtype == "fp32" else 1e-2
        for name in ("ratio_mean", "approx_kl", "kl", "entropy"):
            assert_rel(metrics[name], o_metrics[name], tol, name)


def test_policy_loss_module(device):
    """``nn.PolicyLoss(softcap=...)`` passes the cap on; a bad one fails at construction."""
    logits, targets, adv, tensors = _policy_inputs(device, torch.float32, seed=7)
    module = PolicyLoss(softcap=6.0, temperature=0.8, eps_high=0.28)
    loss, _ = module(logits, targets, adv, **tensors)
    want, _ = fused_rl.policy_loss(
        logits, targets, adv, softcap=6.0, temperature=0.8, eps_high=0.28, **tensors
    )
    assert torch.equal(loss, want)
    assert "softcap=6.0" in repr(module)
    with pytest.raises(ValueError, match="softcap"):
        PolicyLoss(softcap=0.0)
    with pytest.raises(ValueError, match="softcap"):
        LinearPolicyLoss(softcap=float("inf"))


# ----------------------------------------------------------------------------- linear ops


def _linear_inputs(device, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    B, S, T, H, V = 2, 6, 5, 8, 21
    hidden = (torch.randn(B, S, H, generator=g)).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) * 2).to(device, dtype)
    b = (torch.randn(V, generator=g)).to(device, dtype) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    targets[1, 2] = -100
    return hidden, weight, b, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_linear_token_logprobs(backend, dtype, device):
    hidden, weight, bias, targets = _linear_inputs(device, DTYPES[dtype], seed=8)
    T, c = 0.9, 4.0
    ups = [torch.randn(targets.shape).to(device) for _ in range(2)]

    def fused(h, w, b):
        return fused_rl.linear_token_logprobs(
            h, w, targets, bias=b, temperature=T, softcap=c, chunk_tokens=3,
            return_entropy=True, backend=backend,
        )  # fmt: skip

    def oracle(h, w, b):
        return oracle_stats(h @ w.T + b, targets, c, T)

    outs, grads = value_and_grads(fused, [hidden, weight, bias], ups)
    o_outs, o_grads = value_and_grads(oracle, [hidden.double(), weight.double(),
                                               bias.double()], ups)  # fmt: skip
    if dtype == "fp32":
        tols = [FP32_TOL] * 5
    else:
        e_outs, e_grads = value_and_grads(oracle, [hidden, weight, bias], ups)
        tols = [bf16_tol(e, o) for e, o in zip([*e_outs, *e_grads], [*o_outs, *o_grads])]
    names = ("logp", "entropy", "d_hidden", "d_weight", "d_bias")
    for name, got, want, tol in zip(names, [*outs, *grads], [*o_outs, *o_grads], tols):
        assert_rel(got, want, tol, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", ["token", "sequence"])
def test_linear_policy_loss(backend, dtype, case, device):
    """Token level runs the one-pass fused chunks (Triton, gradients on); sequence level
    (GSPO) the composition; both against the oracle on ``cap(hidden @ weight.T + b)``."""
    hidden, weight, bias, targets = _linear_inputs(device, DTYPES[dtype], seed=9)
    g = torch.Generator().manual_seed(10)
    B, L = targets.shape
    adv = torch.randn(B, generator=g).to(device)
    mask = torch.ones(B, L, dtype=torch.bool, device=device)
    mask[0, 0] = False
    T, c = 0.9, 4.0
    with torch.no_grad():
        z = (hidden.double() @ weight.double().T + bias.double())[:, -L - 1 : -1]
        logp, _ = oracle_stats(z, targets, c, T)
    noise = [torch.randn(B, L, generator=g, dtype=torch.float64).to(device) for _ in range(2)]
    old = (logp + 0.3 * noise[0]).float()
    ref = (logp + 0.2 * noise[1]).float()
    opts = dict(eps_high=0.28, beta=0.04, entropy_coef=0.01, importance_sampling=case)
    tensors = dict(old_logprobs=old, ref_logprobs=ref, mask=mask)

    def fused(h, w, b):
        return fused_rl.linear_policy_loss(
            h, w, targets, adv, bias=b, temperature=T, softcap=c, chunk_tokens=3,
            backend=backend, **tensors, **opts,
        )[0]  # fmt: skip

    def oracle(h, w, b):
        z = (h @ w.T + b)[:, -L - 1 : -1]
        return oracle_policy_loss(capped(z, c), targets, adv, temperature=T, **tensors, **opts)[0]

    up = [torch.randn(()).to(device)]
    (loss,), grads = value_and_grads(fused, [hidden, weight, bias], up)
    (o_loss,), o_grads = value_and_grads(oracle, [hidden.double(), weight.double(),
                                                  bias.double()], up)  # fmt: skip
    if dtype == "fp32":
        tols = [FP32_TOL] * 4
    else:
        (e_loss,), e_grads = value_and_grads(oracle, [hidden, weight, bias], up)
        tols = [bf16_tol(e, o) for e, o in zip([e_loss, *e_grads], [o_loss, *o_grads])]
    for name, got, want, tol in zip(("loss", "d_hidden", "d_weight", "d_bias"),
                                    [loss, *grads], [o_loss, *o_grads], tols):  # fmt: skip
        assert_rel(got, want, tol, name)
    with torch.no_grad():  # no gradients: the composition, the same loss
        plain = fused(hidden, weight, bias)
    assert_rel(plain, o_loss, tols[0], "no_grad loss")


# ----------------------------------------------------------------------------- bad values


def _entry_points(device):
    x = torch.randn(2, 3, 5, device=device)
    t = torch.randint(0, 5, (2, 3), device=device)
    a = torch.randn(2, device=device)
    h, w = torch.randn(2, 3, 4, device=device), torch.randn(5, 4, device=device)
    return {
        "token_logprobs": lambda **kw: fused_rl.token_logprobs(x, t, **kw),
        "token_entropy": lambda **kw: fused_rl.token_entropy(x, **kw),
        "policy_loss": lambda **kw: fused_rl.policy_loss(x, t, a, **kw),
        "linear_token_logprobs": lambda **kw: fused_rl.linear_token_logprobs(h, w, t, **kw),
        "linear_policy_loss": lambda **kw: fused_rl.linear_policy_loss(h, w, t, a, **kw),
        "nn.PolicyLoss": lambda **kw: PolicyLoss(**kw),
    }


@pytest.mark.parametrize(
    "bad, error",
    [
        (0.0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("30", TypeError),
        (True, TypeError),
        (torch.tensor(30.0), TypeError),
    ],
    ids=["zero", "negative", "nan", "inf", "str", "bool", "tensor"],
)
def test_bad_softcap_raises_naming_it(bad, error, device):
    for name, call in _entry_points(device).items():
        with pytest.raises(error, match="softcap"):
            call(softcap=bad)
        assert call(softcap=30) is not None, name  # an int is a real number


def test_signatures():
    """``softcap`` is keyword-only, default None, right after ``temperature``."""
    import inspect

    for fn in (fused_rl.token_logprobs, fused_rl.token_entropy, fused_rl.policy_loss,
               fused_rl.linear_token_logprobs, fused_rl.linear_policy_loss):  # fmt: skip
        params = inspect.signature(fn).parameters
        names = list(params)
        assert names[names.index("temperature") + 1] == "softcap", fn.__name__
        assert params["softcap"].kind is inspect.Parameter.KEYWORD_ONLY
        assert params["softcap"].default is None


# ----------------------------------------------------------------------------- vocab-parallel

CHECKS, check = check_registry()


@check
def vocab_parallel(ctx):
    """``token_logprobs(process_group=)``, a DTensor, ``policy_loss(process_group=)`` and
    ``linear_token_logprobs(process_group=)`` with a cap: each rank caps its own columns
    (elementwise) and gets the unsharded values and its shard of the gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(11)
    w, B, S, L, H = 5, 2, 4, 3, 6
    V = w * ctx.world
    start, stop = ctx.rank * w, (ctx.rank + 1) * w
    full = torch.randn(B, S, V, generator=g) * 10
    targets = torch.randint(0, V, (B, L), generator=g)
    targets[0, 0], targets[1, 1] = V - 1, -100
    gl, gh = torch.randn(B, L, generator=g), torch.randn(B, L, generator=g)
    adv = torch.randn(B, generator=g)
    hidden, weight = torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g) * 3
    T, c = 0.8, 5.0
    (o_lp, o_ent), (o_grad,) = value_and_grads(
        lambda x: oracle_stats(x, targets, c, T), [full.double()], [gl, gh]
    )
    mesh = init_device_mesh("cpu", (ctx.world,))
    for backend in BACKENDS:
        for how in ("process_group", "DTensor"):
            if how == "DTensor":
                local = distribute_tensor(full, mesh, [Shard(-1)]).requires_grad_()
                kw = {}
            else:
                local = full[..., start:stop].clone().requires_grad_()
                kw = dict(process_group=ctx.group)
            lp, ent = fused_rl.token_logprobs(
                local, targets, temperature=T, softcap=c, return_entropy=True, backend=backend,
                **kw,
            )  # fmt: skip
            (lp * gl + ent * gh).sum().backward()
            grad = local.grad.to_local() if how == "DTensor" else local.grad
            assert_rel(lp, o_lp, FP32_TOL, f"logp {backend} {how}")
            assert_rel(ent, o_ent, FP32_TOL, f"entropy {backend} {how}")
            assert_rel(grad, o_grad[..., start:stop], FP32_TOL, f"grad {backend} {how}")
        # the policy loss by composition: equal to the unsharded call
        whole = full.clone().requires_grad_()
        want, _ = fused_rl.policy_loss(whole, targets, adv, temperature=T, softcap=c,
                                       backend="reference")  # fmt: skip
        want.backward()
        local = full[..., start:stop].clone().requires_grad_()
        loss, _ = fused_rl.policy_loss(local, targets, adv, temperature=T, softcap=c,
                                       process_group=ctx.group, backend=backend)  # fmt: skip
        loss.backward()
        assert_rel(loss, want, FP32_TOL, f"policy loss {backend}")
        assert_rel(local.grad, whole.grad[..., start:stop], FP32_TOL, f"policy grad {backend}")
        # the lm_head's vocabulary shard
        h = hidden.clone().requires_grad_()
        w_local = weight[start:stop].clone().requires_grad_()
        lp = fused_rl.linear_token_logprobs(
            h, w_local, targets, temperature=T, softcap=c, process_group=ctx.group,
            chunk_tokens=2, backend=backend,
        )  # fmt: skip
        (lp * gl).sum().backward()
        hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
        o_lp_lin, _ = oracle_stats(hd @ wd.T, targets, c, T)
        (o_lp_lin * gl.double()).sum().backward()
        assert_rel(lp, o_lp_lin, FP32_TOL, f"linear logp {backend}")
        assert_rel(h.grad, hd.grad, FP32_TOL, f"linear d_hidden {backend}")
        assert_rel(w_local.grad, wd.grad[start:stop], FP32_TOL, f"linear d_weight {backend}")
        # the policy loss from the lm_head's shard: the unsharded call's loss
        kw = dict(temperature=T, softcap=c, chunk_tokens=2)
        want, _ = fused_rl.linear_policy_loss(hidden, weight, targets, adv, **kw,
                                              backend="reference")  # fmt: skip
        loss, _ = fused_rl.linear_policy_loss(hidden, weight[start:stop], targets, adv, **kw,
                                              process_group=ctx.group, backend=backend)  # fmt: skip
        assert_rel(loss, want, FP32_TOL, f"linear policy loss {backend}")


@needs_gloo
@needs_interpreter
def test_vocab_parallel():
    failed = failures(__name__, 2, "vocab_parallel")
    assert not failed, "\n".join(failed)
