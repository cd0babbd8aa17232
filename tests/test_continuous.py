"""Tests for ``fused_rl.continuous``: ``gaussian_logprob`` and ``gaussian_entropy``.

The oracle is ``torch.distributions.Independent(Normal(mu, sigma), 1)`` in float64; values and
gradients (under a random upstream gradient) of both backends are compared with it. On CPU the
Triton path runs the real kernels through the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import FP32_TOL, assert_rel, bf16_tol, gradcheck
from torch.distributions import Independent, Normal

from fused_rl import config
from fused_rl.continuous import gaussian_entropy, gaussian_logprob

BACKENDS = ("triton", "reference")


def _oracle(mu, sigma, actions):
    dist = Independent(Normal(mu.double(), sigma.double()), 1)
    return dist.log_prob(actions.double()), dist.entropy()


def _inputs(mu_shape, sigma_shape, act_shape, device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(mu_shape, generator=gen, dtype=torch.float64)
    sigma = torch.rand(sigma_shape, generator=gen, dtype=torch.float64) * 1.5 + 0.2
    actions = torch.randn(act_shape, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (mu, sigma, actions)]


def _value_and_grads(fn, leaves, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_outputs=upstream)
    return out.detach(), grads


SHAPES = [
    ((5, 3), (5, 3), (5, 3)),  # DI-engine (B, N)
    ((2, 7, 6), (6,), (2, 7, 6)),  # state-independent sigma, broadcast through stride 0
    ((4, 1), (4, 1), (4, 1)),  # N = 1
    ((3, 100), (1, 100), (3, 100)),  # N > one column block
    ((6,), (6,), (4, 6)),  # one mu for a batch of actions
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + f"-s{s[1]}")
def test_logprob_and_entropy_match_distributions(device, backend, shapes):
    mu, sigma, actions = _inputs(*shapes, device)
    o_lp, _ = _oracle(mu, sigma, actions)
    up = torch.randn(o_lp.shape, device=device)
    lp, grads = _value_and_grads(
        lambda m, s, a: gaussian_logprob(m, s, a, backend=backend), (mu, sigma, actions), up
    )
    _, o_grads = _value_and_grads(
        lambda m, s, a: _oracle(m, s, a)[0], (mu, sigma, actions), up.double()
    )
    assert lp.dtype == torch.float32 and lp.shape == o_lp.shape
    assert_rel(lp, o_lp, FP32_TOL, f"{backend} logprob")
    for name, g, o_g in zip(("mu", "sigma", "actions"), grads, o_grads):
        assert g.shape == o_g.shape and g.dtype == torch.float32
        assert_rel(g, o_g, FP32_TOL, f"{backend} d logprob / d {name}")

    sigma_full = sigma.expand(o_lp.shape + sigma.shape[-1:])
    ent_up = torch.randn(o_lp.shape, device=device)
    ent, (g_sigma,) = _value_and_grads(
        lambda s: gaussian_entropy(s, backend=backend), (sigma_full,), ent_up
    )
    o_ent, (o_g_sigma,) = _value_and_grads(
        lambda s: Independent(Normal(torch.zeros_like(s), s), 1).entropy(),
        (sigma_full.double(),),
        ent_up.double(),
    )
    assert_rel(ent, o_ent, FP32_TOL, f"{backend} entropy")
    assert_rel(g_sigma, o_g_sigma, FP32_TOL, f"{backend} d entropy / d sigma")


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_bf16(device, backend):
    """Non-contiguous slices of bf16 inputs; the error is within the eager-bf16 bound."""
    mu_big, sigma, actions = _inputs((6, 13), (6, 5), (5, 6), device, dtype=torch.bfloat16)
    mu = mu_big[:, 1::2][:, :5]  # column stride 2
    actions = actions.t()  # transposed
    o_lp, o_ent = _oracle(mu, sigma, actions)
    eager = Independent(Normal(mu, sigma), 1)
    lp = gaussian_logprob(mu, sigma, actions, backend=backend)
    ent = gaussian_entropy(sigma, backend=backend)
    assert lp.dtype == ent.dtype == torch.float32
    assert_rel(lp, o_lp, bf16_tol(eager.log_prob(actions), o_lp), f"{backend} bf16 logprob")
    assert_rel(ent, o_ent, bf16_tol(eager.entropy(), o_ent), f"{backend} bf16 entropy")
    # seeded: the global RNG's state depends on which tests ran before (an unlucky draw once
    # failed the full serial run)
    up = torch.randn(o_lp.shape, generator=torch.Generator().manual_seed(7)).to(device)
    _, grads = _value_and_grads(
        lambda m, s: gaussian_logprob(m, s, actions, backend=backend), (mu, sigma), up
    )
    _, o_grads = _value_and_grads(lambda m, s: _oracle(m, s, actions)[0], (mu, sigma), up.double())
    _, e_grads = _value_and_grads(
        lambda m, s: Independent(Normal(m, s), 1).log_prob(actions),
        (mu, sigma),
        up.to(torch.bfloat16),
    )
    for name, g, o_g, e_g in zip(("mu", "sigma"), grads, o_grads, e_grads):
        assert g.dtype == torch.bfloat16
        # the Triton 3.9 interpreter truncates fp32 -> bf16 stores (compiled kernels round to
        # nearest): up to one more bf16 step, 2^-7 relative, on CPU only
        truncation = 2.0**-7 if backend == "triton" and device == "cpu" else 0.0
        assert_rel(g, o_g, bf16_tol(e_g, o_g) + truncation, f"{backend} bf16 d/d{name}")


def test_gradcheck_triton_float64(device):
    mu, sigma, actions = _inputs((3, 4), (4,), (3, 4), device, dtype=torch.float64, seed=1)
    leaves = [x.requires_grad_(True) for x in (mu, sigma, actions)]
    assert gradcheck(lambda m, s, a: gaussian_logprob(m, s, a, backend="triton"), leaves)
    sigma2 = (torch.rand(2, 3, 5, dtype=torch.float64, device=device) + 0.5).requires_grad_(True)
    assert gradcheck(lambda s: gaussian_entropy(s, backend="triton"), (sigma2,))


def test_deterministic(device):
    mu, sigma, actions = _inputs((9, 7), (9, 7), (9, 7), device, seed=2)
    up = torch.randn(9, device=device)
    fn = lambda m, s: gaussian_logprob(m, s, actions, backend="triton")
    (lp1, g1), (lp2, g2) = [_value_and_grads(fn, (mu, sigma), up) for _ in range(2)]
    assert torch.equal(lp1, lp2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.no_poison
def test_torch_compile(device):
    mu, sigma, actions = _inputs((4, 3), (3,), (4, 3), device, seed=3)
    up = torch.randn(4, device=device)

    def fn(m, s, a):
        return gaussian_logprob(m, s, a) + 0.01 * gaussian_entropy(s.expand_as(m))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, got_grads = _value_and_grads(lambda m, s: compiled(m, s, actions), (mu, sigma), up)
    want, want_grads = _value_and_grads(lambda m, s: fn(m, s, actions), (mu, sigma), up)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(device, backend):
    mu = torch.randn(0, 3, device=device, requires_grad=True)
    lp = gaussian_logprob(
        mu, torch.ones(3, device=device), torch.zeros(0, 3, device=device), backend=backend
    )
    assert lp.shape == (0,)
    lp.sum().backward()
    assert mu.grad.shape == (0, 3)
    no_dims = gaussian_logprob(torch.zeros(2, 0), torch.ones(2, 0), torch.zeros(2, 0))
    assert torch.equal(no_dims, torch.zeros(2))


def test_sigma_checks(device, monkeypatch):
    mu, sigma, actions = _inputs((2, 3), (2, 3), (2, 3), device)
    bad = sigma.clone()
    bad[1, 2] = 0.0
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="sigma"):
            gaussian_logprob(mu, bad, actions, backend=backend)
        with pytest.raises(ValueError, match="sigma"):
            gaussian_entropy(-sigma, backend=backend)
    # without the (syncing) check, sigma <= 0 gives non-finite values instead of an error
    monkeypatch.setattr(config, "check_values", False)
    for backend in BACKENDS:
        assert not torch.isfinite(gaussian_logprob(mu, bad, actions, backend=backend)[1])
        assert torch.isfinite(gaussian_logprob(mu, bad, actions, backend=backend)[0])
        assert torch.isnan(gaussian_entropy(-sigma, backend=backend)).all()


def test_bad_arguments(device):
    mu, sigma, actions = _inputs((2, 3), (2, 3), (2, 3), device)
    with pytest.raises(ValueError, match="broadcast"):
        gaussian_logprob(mu, sigma, torch.randn(2, 4, device=device))
    with pytest.raises(TypeError, match="actions"):
        gaussian_logprob(mu, sigma, actions.long())
    with pytest.raises(TypeError, match="sigma"):
        gaussian_entropy(sigma.long())
    with pytest.raises(ValueError, match="device"):
        gaussian_logprob(mu, sigma.to("meta"), actions)
    with pytest.raises(ValueError, match="action dimension"):
        gaussian_entropy(torch.tensor(1.0, device=device))


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_sigma_gradients_do_not_overflow(device, backend):
    """Fuzz finding 12: the fp32 reference differentiated ``(a - mu) / sigma`` by autograd,
    whose ``(a - mu) / sigma^2`` passes 3.4e38 at ``sigma = 1e-20``: ``-inf`` where the
    gradient is finite, and NaN (``0 * inf``) under a zero upstream (DI-engine's ratio
    ``exp(-inf) = 0``). Both backends now give the float64 gradient rounded once, and a zero
    upstream gives exact zeros, also where ``z`` itself overflows (``mu = 1e30``)."""
    mu = torch.tensor([[0.3], [0.3], [0.3], [1e30], [0.3]], device=device)
    sigma = torch.tensor([[1e-20], [1e-20], [1e-30], [1e-30], [1e-12]], device=device)
    actions = torch.tensor([[1.2], [1.2], [1.2], [0.0], [0.3 + 2e-12]], device=device)
    up = torch.tensor([0.0, -1e-30, 0.0, 0.0, 0.5], device=device)
    lp, grads = _value_and_grads(
        lambda m, s, a: gaussian_logprob(m, s, a, backend=backend), (mu, sigma, actions), up
    )
    _, o_grads = _value_and_grads(
        lambda m, s, a: _oracle(m, s, a)[0], (mu, sigma, actions), up.double()
    )
    assert torch.isneginf(lp[:4]).all() and torch.isfinite(lp[4])  # -(a - mu)^2 / 2 sigma^2
    for name, g, o_g in zip(("mu", "sigma", "actions"), grads, o_grads):
        assert not torch.isnan(g).any(), f"{backend} d/d{name}: {g.flatten().tolist()}"
        zero = up == 0
        assert (g[zero] == 0).all(), f"{backend} d/d{name} under a zero upstream"
        assert torch.isfinite(o_g).all()
        torch.testing.assert_close(g, o_g.float(), rtol=4 * FP32_TOL, atol=0.0)


def test_reference_backward_is_differentiable():
    """The reference's written-out backward (finding 12) is plain PyTorch: a Hessian-vector
    product through it is right (``gradgradcheck``), unlike the Triton path's, which raises."""
    mu, sigma, actions = _inputs((3, 4), (4,), (3, 4), "cpu", dtype=torch.float64, seed=4)
    leaves = [x.requires_grad_(True) for x in (mu, sigma, actions)]
    fn = lambda m, s, a: gaussian_logprob(m, s, a, backend="reference")  # noqa: E731
    assert gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_gradient_summed_wide(device, backend):
    """A broadcast input narrower than the accumulation has its gradient summed over the
    broadcast rows in the accumulation dtype and rounded once (fuzz: the Triton path rounded
    each row's share to the input's dtype first: a ``(1,)`` bf16 ``mu`` lost 14% of a sum with
    cancellation; an fp32 ``sigma`` next to fp64 actions summed ``+inf`` and ``-inf`` shares
    to NaN)."""
    mu = torch.tensor([-2.171875], dtype=torch.bfloat16, device=device)
    sigma = torch.tensor([0.11317846], device=device)
    actions = torch.tensor([[-0.21787894], [0.04033468], [-0.05966354]], device=device)
    up = torch.tensor([1.2, -0.8, -1.5], device=device)
    _, (g_mu, g_sigma) = _value_and_grads(
        lambda m, s: gaussian_logprob(m, s, actions, backend=backend), (mu, sigma), up
    )
    _, (o_mu, o_sigma) = _value_and_grads(
        lambda m, s: _oracle(m, s, actions)[0], (mu, sigma), up.double()
    )
    assert g_mu.dtype == torch.bfloat16 and g_sigma.dtype == torch.float32
    assert torch.equal(g_mu, o_mu.to(torch.bfloat16))  # one rounding of the sum
    torch.testing.assert_close(g_sigma, o_sigma.float(), rtol=FP32_TOL, atol=0.0)

    huge = torch.tensor([[1e30]], dtype=torch.float64, device=device)  # z^2 / sigma: 8e60
    up2 = torch.tensor([1.0, -0.5], device=device)
    _, (g_sigma,) = _value_and_grads(
        lambda s: gaussian_logprob(torch.zeros(2, 1, device=device), s, huge, backend=backend),
        (torch.tensor([0.5], device=device),),
        up2,
    )
    assert torch.equal(g_sigma, torch.tensor([float("inf")], device=device))  # +4e60, not NaN
