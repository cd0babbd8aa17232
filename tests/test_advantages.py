"""Tests for ``fused_rl.advantages``: ``gae``, ``kl_penalized_rewards``, ``group_advantages``,
``rloo_advantages``.

Both backends are compared with float64 oracles written here (seed 004's Python loop for GAE,
explicit per-group loops for the baselines). On CPU the Triton path runs the real kernels
through the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (
    F64_TOL,
    FP32_TOL,
    assert_rel,
    clamp_in,
    compiled_scalar_abi,
    seed_gae_loop,
)

from fused_rl import config
from fused_rl.advantages import gae, group_advantages, kl_penalized_rewards, rloo_advantages

BACKENDS = ("triton", "reference")


# ----------------------------------------------------------------------------- oracles


def gae_loop(rewards, values, gamma, lam, mask=None):
    """Seed 004's loop in float64; masked steps count as zero reward / value, output 0."""
    r, v = rewards.double(), values.double()
    if mask is not None:
        m = mask.bool()
        r = torch.where(m, r, torch.zeros_like(r))
        v = torch.where(m, v, torch.zeros_like(v))
    adv, ret = seed_gae_loop(r, v, gamma, lam)
    if mask is not None:
        adv = torch.where(m, adv, torch.zeros_like(adv))
        ret = torch.where(m, ret, torch.zeros_like(ret))
    return adv, ret


def kl_oracle(logp, ref, kind):
    d = logp.double() - ref.double()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) + d - 1.0
    if kind == "low_var_kl":
        neg = clamp_in(-d, -20.0, 20.0)
        return clamp_in(torch.exp(neg) - neg - 1.0, -10.0, 10.0)
    return d.abs()


def rewards_oracle(scores, logp, ref, kl_coef, mask, kind, score_index):
    out = -kl_coef * kl_oracle(logp, ref, kind)
    n_rows, length = out.shape
    if mask is not None:
        out = torch.where(mask.bool(), out, torch.zeros_like(out))
    for b in range(n_rows):
        if score_index is not None:
            where = int(score_index[b])
        elif mask is not None:
            hits = mask[b].bool().nonzero()
            where = int(hits[-1]) if len(hits) else None
        else:
            where = length - 1
        if where is not None:
            out[b, where] += float(scores[b])
    return out


def group_oracle(scores, n, normalize, eps):
    s = scores.double().reshape(-1, n)
    out = torch.empty_like(s)
    for g in range(s.shape[0]):
        centred = s[g] - s[g].mean()
        if normalize == "std":
            std = s[g].std() if n > 1 else torch.tensor(0.0, dtype=torch.float64)
            centred = centred / (std + eps)
        out[g] = centred
    return out.reshape(-1)


def rloo_oracle(scores, n):
    s = scores.double().reshape(-1, n)
    out = torch.empty_like(s)
    for g in range(s.shape[0]):
        for i in range(n):
            others = torch.cat([s[g, :i], s[g, i + 1 :]])
            out[g, i] = s[g, i] - others.mean()
    return out.reshape(-1)


def _mask(n_rows, length, device, seed=0):
    """Right padding of random lengths, one hole, one empty row (when B >= 3)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n_rows,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    if n_rows >= 3:
        mask[1] = False
    if length >= 4:
        mask[0, length // 2] = False
    return mask.to(device)


# ----------------------------------------------------------------------------- gae


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("length", [1, 2048])
@pytest.mark.parametrize("gamma", [0.0, 0.95, 1.0])
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_matches_seed_loop(device, backend, length, gamma, lam):
    torch.manual_seed(length)
    rewards = torch.randn(3, length, device=device)
    values = torch.randn(3, length, device=device)
    mask = _mask(3, length, device)
    for m in (None, mask):
        adv, ret = gae(rewards, values, gamma=gamma, lam=lam, mask=m, backend=backend)
        o_adv, o_ret = gae_loop(rewards, values, gamma, lam, m)
        assert adv.dtype == ret.dtype == torch.float32
        assert_rel(adv, o_adv, FP32_TOL, f"{backend} advantages (mask={m is not None})")
        assert_rel(ret, o_ret, FP32_TOL, f"{backend} returns (mask={m is not None})")
        if m is not None:
            assert (adv[~m] == 0).all() and (ret[~m] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_float64_and_padding_is_inert(device, backend):
    """fp64 stays fp64 end to end; NaN in masked steps never reaches the output."""
    torch.manual_seed(1)
    rewards = torch.randn(4, 1500, dtype=torch.float64, device=device)
    values = torch.randn(4, 1500, dtype=torch.float64, device=device)
    mask = _mask(4, 1500, device, seed=3)
    rewards_nan = rewards.masked_fill(~mask, float("nan"))
    values_nan = values.masked_fill(~mask, float("inf"))
    adv, ret = gae(rewards_nan, values_nan, gamma=0.99, lam=0.97, mask=mask, backend=backend)
    o_adv, o_ret = gae_loop(rewards, values, 0.99, 0.97, mask)
    assert adv.dtype == torch.float64
    assert_rel(adv, o_adv, F64_TOL, f"{backend} fp64 advantages")
    assert_rel(ret, o_ret, F64_TOL, f"{backend} fp64 returns")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_layouts_and_dtypes(device, backend):
    """Strided slices, a transposed view, bf16 values, an int 0/1 mask, odd T."""
    torch.manual_seed(2)
    big = torch.randn(5, 2 * 37 + 1, device=device)
    rewards = big[:, 1::2]  # stride 2 along time
    values = torch.randn(37, 5, device=device).t().to(torch.bfloat16)  # time-major storage
    mask = _mask(5, 37, device, seed=4).to(torch.int64)
    adv, ret = gae(rewards, values, gamma=0.9, lam=0.8, mask=mask, backend=backend)
    o_adv, o_ret = gae_loop(rewards, values, 0.9, 0.8, mask)
    assert adv.dtype == torch.float32
    assert_rel(adv, o_adv, FP32_TOL, f"{backend} advantages")
    assert_rel(ret, o_ret, FP32_TOL, f"{backend} returns")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_torchtune_fixture(device, backend):
    """torchtune's estimate_advantages fixture: returns = [g^3 l^2, g^2 l, g, 1]."""
    gamma, lam = 0.9, 0.95
    x = torch.tensor([[0.0, 0.0, 0.0, 1.0]], device=device)
    _, ret = gae(x, x, gamma=gamma, lam=lam, backend=backend)
    expected = torch.tensor([[gamma**3 * lam**2, gamma**2 * lam, gamma, 1.0]])
    torch.testing.assert_close(ret.cpu(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_gae_empty(device, backend, shape):
    x = torch.randn(shape, device=device)
    adv, ret = gae(x, x, gamma=0.9, lam=0.9, backend=backend)
    assert adv.shape == ret.shape == shape


def test_gae_deterministic_and_detached(device):
    torch.manual_seed(5)
    rewards = torch.randn(3, 1100, device=device, requires_grad=True)
    values = torch.randn(3, 1100, device=device)
    runs = [gae(rewards, values, gamma=0.99, lam=0.95, backend="triton") for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not runs[0][0].requires_grad


@pytest.mark.no_poison
def test_gae_torch_compile(device):
    torch.manual_seed(6)
    rewards = torch.randn(3, 40, device=device)
    values = torch.randn(3, 40, device=device)
    mask = _mask(3, 40, device)

    def fn(r, v, m):
        adv, ret = gae(r, v, gamma=0.99, lam=0.95, mask=m)
        return adv * 2.0, ret

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(rewards, values, mask), fn(rewards, values, mask)):
        torch.testing.assert_close(got, want)


def test_gae_bad_arguments(device):
    x = torch.randn(2, 5, device=device)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="gamma"):
            gae(x, x, gamma=bad, lam=0.9)
        with pytest.raises(ValueError, match="lam"):
            gae(x, x, gamma=0.9, lam=bad)
    with pytest.raises(TypeError, match="gamma"):
        gae(x, x, gamma=torch.tensor(0.9), lam=0.9)
    with pytest.raises(ValueError, match="values"):
        gae(x, torch.randn(2, 6, device=device), gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="rewards"):
        gae(x[0], x[0], gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="mask"):
        gae(x, x, gamma=0.9, lam=0.9, mask=torch.ones(2, 4, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="rewards"):
        gae(x.long(), x, gamma=0.9, lam=0.9)
    with pytest.raises(ValueError, match="device"):
        gae(x, x.to("meta"), gamma=0.9, lam=0.9)


# ----------------------------------------------------------------------------- kl rewards


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_penalized_rewards(device, backend, kind):
    torch.manual_seed(7)
    n_rows, length = 5, 37
    scores = torch.randn(n_rows, device=device)
    big = torch.randn(n_rows, length + 1, device=device)
    logp = big[:, :-1]  # the usual shifted slice, read in place
    ref = logp + 0.5 * torch.randn(n_rows, length, device=device)
    mask = _mask(n_rows, length, device, seed=8)
    index = torch.randint(0, length, (n_rows,), device=device)
    for m in (None, mask):
        for idx in (None, index):
            out = kl_penalized_rewards(
                scores,
                logp,
                ref,
                kl_coef=0.05,
                mask=m,
                kl_estimator=kind,
                score_index=idx,
                backend=backend,
            )
            want = rewards_oracle(scores, logp, ref, 0.05, m, kind, idx)
            what = f"{backend} {kind} mask={m is not None} index={idx is not None}"
            assert out.dtype == torch.float32 and out.shape == (n_rows, length)
            assert_rel(out, want, FP32_TOL, what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalized_rewards_extremes(device, backend):
    """log-ratio 0 gives exactly the score; +-30 stays finite; an empty row gets no score."""
    length = 6
    logp = torch.full((3, length), -2.0, device=device)
    ref = logp.clone()
    ref[1] = logp[1] + 30.0
    ref[2] = logp[2] - 30.0
    scores = torch.tensor([1.5, -1.0, 2.0], device=device)
    for kind in ("k1", "k2", "k3", "low_var_kl", "abs"):
        out = kl_penalized_rewards(
            scores, logp, ref, kl_coef=0.1, kl_estimator=kind, backend=backend
        )
        assert torch.isfinite(out).all(), kind
        expected_row0 = torch.zeros(length, device=device)
        expected_row0[-1] = 1.5
        assert torch.equal(out[0], expected_row0), kind
    empty = torch.zeros(3, length, dtype=torch.bool, device=device)
    out = kl_penalized_rewards(scores, logp, ref, kl_coef=0.1, mask=empty, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_penalized_rewards_float64_long(device, backend):
    """T > one block: the last counted step is found across blocks; fp64 throughout."""
    torch.manual_seed(9)
    n_rows, length = 3, 1500
    scores = torch.randn(n_rows, dtype=torch.float64, device=device)
    logp = torch.randn(n_rows, length, dtype=torch.float64, device=device)
    ref = torch.randn(n_rows, length, dtype=torch.float64, device=device)
    mask = torch.zeros(n_rows, length, dtype=torch.bool, device=device)
    mask[0, :1200] = True  # last counted step in the first block of the reverse sweep
    mask[1, :300] = True  # ... in the second
    mask[2, 5] = True
    out = kl_penalized_rewards(
        scores, logp, ref, kl_coef=0.2, mask=mask, kl_estimator="k3", backend=backend
    )
    assert out.dtype == torch.float64
    want = rewards_oracle(scores, logp, ref, 0.2, mask, "k3", None)
    assert_rel(out, want, F64_TOL, backend)


def test_kl_penalized_rewards_bad_arguments(device):
    lp = torch.randn(2, 5, device=device)
    s = torch.randn(2, device=device)
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalized_rewards(s, lp, lp, kl_coef=0.1, kl_estimator="k4")
    with pytest.raises(ValueError, match="kl_coef"):
        kl_penalized_rewards(s, lp, lp, kl_coef=-0.1)
    with pytest.raises(ValueError, match="scores"):
        kl_penalized_rewards(torch.randn(3, device=device), lp, lp, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalized_rewards(s, lp, lp[:, :4], kl_coef=0.1)
    with pytest.raises(TypeError, match="score_index"):
        kl_penalized_rewards(s, lp, lp, kl_coef=0.1, score_index=torch.zeros(2, device=device))
    with pytest.raises(ValueError, match="score_index"):
        kl_penalized_rewards(s, lp, lp, kl_coef=0.1, score_index=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="device"):
        kl_penalized_rewards(s.to("meta"), lp, lp, kl_coef=0.1)


def test_kl_penalized_rewards_unchecked_index_drops_score(device, monkeypatch):
    """With value checks off, an out-of-range score_index is never a wild write."""
    monkeypatch.setattr(config, "check_values", False)
    lp = torch.zeros(2, 4, device=device)
    s = torch.tensor([1.0, 2.0], device=device)
    idx = torch.tensor([-1, 9], device=device)
    for backend in BACKENDS:
        out = kl_penalized_rewards(s, lp, lp, kl_coef=0.1, score_index=idx, backend=backend)
        assert torch.equal(out, torch.zeros_like(out)), backend


# ----------------------------------------------------------------------------- groups


def _scores_with_constant_group(n_groups, n, device, dtype=torch.float32):
    torch.manual_seed(10 + n)
    scores = torch.randn(n_groups * n, dtype=dtype, device=device)
    scores[n : 2 * n] = 0.1  # zero variance, not exactly representable
    return scores


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", ["std", "none"])
@pytest.mark.parametrize("n", [1, 3, 8, 1100])
def test_group_advantages(device, backend, normalize, n):
    n_groups = 2 if n == 1100 else 5
    scores = _scores_with_constant_group(n_groups, n, device)
    out = group_advantages(scores, group_size=n, normalize=normalize, backend=backend)
    assert out.dtype == torch.float32 and out.shape == scores.shape
    assert not torch.isnan(out).any()
    assert (out[n : 2 * n] == 0).all(), "a constant group must give exactly 0"
    assert_rel(out, group_oracle(scores, n, normalize, 1e-6), FP32_TOL, f"{backend} {normalize}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_advantages_constant_group_eps_zero(device, backend):
    """eps = 0 is allowed: a constant group still gives 0, not 0 / 0."""
    scores = torch.tensor([1.0, 1.0, 2.0, 3.0, 0.1, 0.1], device=device)
    out = group_advantages(scores, group_size=2, eps=0.0, backend=backend)
    assert out[0] == 0 and out[1] == 0 and out[4] == 0 and out[5] == 0
    assert_rel(out[2:4], torch.tensor([-1.0, 1.0], device=device) / math.sqrt(2), FP32_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_advantages_strided_float64(device, backend):
    """fp64 scores: fp64 results, ``eps`` included. Python floats reach compiled kernels as
    fp32 (7.1e-11 here on an H100 with a bare ``eps``): the interpreter is made to do the
    same, so a CPU run sees what a GPU run sees."""
    torch.manual_seed(11)
    base = torch.randn(48, dtype=torch.float64, device=device)
    scores = base[::2]  # stride 2
    with compiled_scalar_abi():
        out = group_advantages(scores, group_size=4, eps=1e-3, backend=backend)
    assert out.dtype == torch.float64
    assert_rel(out, group_oracle(scores, 4, "std", 1e-3), F64_TOL, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [2, 5, 1100])
def test_rloo_advantages(device, backend, n):
    n_groups = 2 if n == 1100 else 4
    scores = _scores_with_constant_group(n_groups, n, device)
    out = rloo_advantages(scores, group_size=n, backend=backend)
    assert out.dtype == torch.float32
    assert (out[n : 2 * n] == 0).all()
    assert_rel(out, rloo_oracle(scores, n), FP32_TOL, backend)


def test_group_ops_deterministic(device):
    scores = _scores_with_constant_group(7, 6, device)
    for fn in (
        lambda s: group_advantages(s, group_size=6),
        lambda s: rloo_advantages(s, group_size=6),
    ):
        assert torch.equal(fn(scores), fn(scores))


def test_group_bad_arguments(device):
    s = torch.randn(12, device=device)
    with pytest.raises(ValueError, match="divide"):
        group_advantages(s, group_size=5)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(s, group_size=0)
    with pytest.raises(TypeError, match="group_size"):
        group_advantages(s, group_size=4.0)
    with pytest.raises(ValueError, match="normalize"):
        group_advantages(s, group_size=4, normalize="mad")
    with pytest.raises(ValueError, match="eps"):
        group_advantages(s, group_size=4, eps=-1.0)
    with pytest.raises(ValueError, match="scores"):
        group_advantages(s.view(3, 4), group_size=4)
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(s, group_size=1)
    with pytest.raises(ValueError, match="divide"):
        rloo_advantages(s, group_size=5)
    with pytest.raises(TypeError, match="scores"):
        rloo_advantages(s.long(), group_size=4)


def test_group_empty(device):
    s = torch.randn(0, device=device)
    for backend in BACKENDS:
        assert group_advantages(s, group_size=4, backend=backend).shape == (0,)
        assert rloo_advantages(s, group_size=4, backend=backend).shape == (0,)


def test_docstring_examples():
    """The examples in the docstrings hold (they double as the simplest fixtures)."""
    adv, _ = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), gamma=1.0, lam=0.5)
    assert adv.tolist() == [[0.25, 0.5, 1.0]]
    s = torch.tensor([3.0, 1.0, 2.0])
    assert rloo_advantages(s, group_size=3).tolist() == [1.5, -1.5, 0.0]
    assert math.isclose(
        group_advantages(s, group_size=3)[0].item(), 1.0 / (1.0 + 1e-6), rel_tol=1e-6
    )
