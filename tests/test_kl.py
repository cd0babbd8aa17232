"""Tests for ``fused_rl.kl.kl_estimate`` (k1, k2, k3, low_var_kl, abs).

Both backends are compared with a float64 oracle written here, on values and on the
gradients of both arguments under random upstream gradients. On CPU the Triton path runs the
real kernels through the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, assert_rel, bf16_tol, clamp_in, fp32_exp_tol, gradcheck

from fused_rl.kl import kl_estimate

BACKENDS = ("triton", "reference")
KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")


def oracle(logp, ref, kind):
    """float64 estimate of KL(pi || pi_ref) with ``r = pi_ref / pi = exp(ref - logp)``."""
    logp, ref = logp.double(), ref.double()
    log_r = ref - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return log_r**2 / 2
    if kind == "k3":
        return torch.exp(log_r) - 1 - log_r
    if kind == "low_var_kl":
        c = clamp_in(log_r, -20.0, 20.0)
        return clamp_in(torch.exp(c) - 1 - c, -10.0, 10.0)
    return log_r.abs()


def _inputs(device, dtype=torch.float32, seed=0):
    """Strided (5, 7) views; a few tokens with log-ratio exactly 0 and beyond the clamps."""
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(5, 15, generator=g) - 2)[:, 1::2]
    ref = (logp + torch.randn(5, 7, generator=g)).t().contiguous().t()  # column-major
    ref[0, :3] = logp[0, :3]  # log-ratio 0
    ref[1, 0], ref[1, 1] = logp[1, 0] + 25.0, logp[1, 1] - 25.0  # beyond low_var_kl's clamp
    return logp.to(device=device, dtype=dtype), ref.to(device=device, dtype=dtype)


def k3_small_oracle(log_r):
    """float64 ``exp(x) - 1 - x`` summed term by term (no cancellation), for |x| < 0.1."""
    term, total = log_r.double(), torch.zeros_like(log_r, dtype=torch.float64)
    for k in range(2, 16):
        term = term * log_r / k
        total = total + term
    return total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k3", "low_var_kl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spread", [1e-5, 1e-3, 3e-2])
def test_k3_small_log_ratios(backend, kind, dtype, spread, device):
    """Log-ratios near 0 (a policy close to its reference): the direct formula cancels
    (fp32 lost ~6% of k3 at 1e-3, all of it at 1e-5); values and gradients stay at the
    dtype's tolerance against a cancellation-free float64 oracle."""
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(4, 33, generator=g, dtype=torch.float64) - 2).to(dtype)
    ref = (logp.double() + spread * torch.randn(4, 33, generator=g, dtype=torch.float64)).to(dtype)
    log_r = ref.double() - logp.double()  # exact: the inputs as the op sees them
    logp = logp.to(device).requires_grad_(True)
    out = kl_estimate(logp, ref.to(device), kl_estimator=kind, backend=backend)
    (grad,) = torch.autograd.grad(out.sum(), logp)
    tol = FP32_TOL if dtype == torch.float32 else F64_TOL
    assert_rel(out, k3_small_oracle(log_r).to(device), tol, f"{kind} value")
    assert_rel(grad, -torch.expm1(log_r).to(device), tol, f"{kind} d logprobs")  # 1 - r


@pytest.mark.parametrize("backend", BACKENDS)
def test_k1_gradient_is_one_even_at_inf(backend, device):
    """Padding often holds -inf log-probs: k1's gradient there is the upstream one (0), not
    NaN (``d * 0 + 1`` would be NaN at d = inf)."""
    logp = torch.tensor([-1.0, -float("inf"), float("inf")], device=device, requires_grad=True)
    out = kl_estimate(logp, torch.zeros(3, device=device), kl_estimator="k1", backend=backend)
    (grad,) = torch.autograd.grad(out, logp, torch.tensor([1.0, 0.0, 0.0], device=device))
    assert grad.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity(backend, kind, dtype, device):
    logp, ref = _inputs(device, dtype)
    logp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_estimate(logp, ref, kl_estimator=kind, backend=backend)
    lp64 = logp.detach().double().requires_grad_(True)
    ref64 = ref.detach().double().requires_grad_(True)
    want = oracle(lp64, ref64, kind)
    tol = FP32_TOL if dtype == torch.float32 else F64_TOL
    assert out.shape == logp.shape and out.dtype == dtype
    assert_rel(out, want, tol, kind)
    up = torch.randn(out.shape, dtype=torch.float64, device=device)
    got = torch.autograd.grad(out, (logp, ref), up.to(dtype))
    exp = torch.autograd.grad(want, (lp64, ref64), up)
    for name, g, e in zip(("d logprobs", "d ref_logprobs"), got, exp):
        assert g.dtype == dtype
        assert_rel(g, e, tol, f"{kind} {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_and_extreme_log_ratios(backend, kind, device):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        lp = torch.tensor([[-3.0, -0.5, 0.0]], device=device, dtype=dtype, requires_grad=True)
        out = kl_estimate(lp, lp.detach().clone(), kl_estimator=kind, backend=backend)
        assert torch.equal(out, torch.zeros_like(out)), f"{kind} {dtype} at log-ratio 0"
        (g,) = torch.autograd.grad(out.sum(), lp)
        slope = 1.0 if kind == "k1" else 0.0  # k1 = d has slope 1; the others are flat at 0
        assert torch.equal(g, torch.full_like(g, slope)), f"{kind} {dtype} gradient at 0"
        base = torch.full((1, 2), -40.0, device=device, dtype=dtype)
        ref = base + torch.tensor([[30.0, -30.0]], device=device, dtype=dtype)
        base.requires_grad_(True)
        out = kl_estimate(base, ref, kl_estimator=kind, backend=backend)
        (g,) = torch.autograd.grad(out.sum(), base)
        want = oracle(base.detach(), ref, kind)
        assert torch.isfinite(out).all(), f"{kind} {dtype} +-30"
        # k3 = exp(30) - 31 in fp32: exp's error grows with its argument on a GPU
        assert_rel(out, want, fp32_exp_tol(30.0, device), f"{kind} {dtype} +-30")
        # k3's slope 1 - e^30 ~ -1e13 exceeds fp16's range: a fp16 gradient cannot hold it
        fits = (1.0 - torch.exp(ref.double() - base.detach().double())).abs() < 6e4
        fits |= torch.tensor(dtype != torch.float16 or kind in ("k1", "k2", "abs"))
        assert torch.isfinite(g[fits]).all(), f"{kind} {dtype} gradient at +-30"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_and_detached_ref(backend, device):
    logp, ref = _inputs(device, torch.bfloat16, seed=1)
    want = oracle(logp, ref, "k3")
    eager = torch.exp(ref - logp) - 1 - (ref - logp)  # bf16 eager
    out = kl_estimate(logp, ref, backend=backend)
    assert out.dtype == torch.float32
    assert_rel(out, want, bf16_tol(eager, want), "bf16 k3")
    # ref without grad: only logprobs receives a gradient
    logp.requires_grad_(True)
    out = kl_estimate(logp, ref, kl_estimator="k2", backend=backend)
    out.backward(torch.randn_like(out))
    assert logp.grad.dtype == torch.bfloat16 and ref.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_shapes(backend, device):
    torch.manual_seed(2)
    for shape in ((), (6,), (2, 3, 4), (0, 5)):
        logp = torch.randn(shape, device=device, dtype=torch.float64)
        ref = torch.randn(shape, device=device, dtype=torch.float64)
        out = kl_estimate(logp, ref, kl_estimator="k3", backend=backend)
        assert out.shape == logp.shape
        assert_rel(out, oracle(logp, ref, "k3"), F64_TOL, str(shape))


def test_gradcheck_float64_triton(device):
    logp, ref = (t.double()[:3, :4] for t in _inputs(device, seed=3))
    logp.requires_grad_(True)
    ref.requires_grad_(True)

    def fn(a, b):
        return tuple(kl_estimate(a, b, kl_estimator=k, backend="triton") for k in KINDS)

    assert gradcheck(fn, (logp, ref))


def test_deterministic(device):
    torch.manual_seed(4)
    logp = torch.randn(3, 900, device=device, requires_grad=True)
    ref = torch.randn(3, 900, device=device)
    up = torch.randn(3, 900, device=device)

    def run():
        out = kl_estimate(logp, ref, kl_estimator="low_var_kl", backend="triton")
        return out, *torch.autograd.grad(out, logp, up)

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


@pytest.mark.no_poison
def test_torch_compile_fullgraph(device):
    logp, ref = _inputs(device, seed=5)

    def f(a, b):
        return (
            kl_estimate(a, b, kl_estimator="k3").sum()
            + kl_estimate(a, b, kl_estimator="abs").square().sum()
        )

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (f, compiled):
        a, b = logp.clone().requires_grad_(True), ref.clone().requires_grad_(True)
        out = fn(a, b)
        results.append((out, *torch.autograd.grad(out, (a, b))))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_errors(device):
    logp = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(logp, logp, kl_estimator="k4")
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(logp, logp[:, :2])
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(logp, logp.to("meta"))
    with pytest.raises(TypeError, match="logprobs"):
        kl_estimate(logp.long(), logp)


@pytest.mark.gpu
def test_no_host_sync_cuda():
    logp, ref = _inputs("cuda", seed=6)
    logp.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kl_estimate(logp, ref, kl_estimator="low_var_kl").sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
