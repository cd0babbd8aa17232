"""fused_rl.compat.verl against an independent transcription of verl v0.5's
``core_algos`` / ``torch_functional`` (loops and all), run in float64."""

from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from fused_rl.compat import verl

# ----------------------------------------------------------------------------- the oracle


def o_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def o_masked_mean(values, mask, axis=None):
    return o_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def o_masked_var(values, mask, unbiased=True):
    mean = o_masked_mean(values, mask)
    var = o_masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        var = var * (n / (n - 1))
    return var


def o_masked_whiten(values, mask, shift_mean=True):
    mean, var = o_masked_mean(values, mask), o_masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


def o_agg_loss(loss_mat, loss_mask, mode):
    if mode == "token-mean":
        return o_masked_mean(loss_mat, loss_mask)
    seq = torch.sum(loss_mat * loss_mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / torch.sum(loss_mask, dim=-1)).mean()
    return seq.sum() / loss_mask.shape[-1]


def o_policy_loss(old, new, adv, mask, cliprange, low, high, c, mode):
    low = cliprange if low is None else low
    high = cliprange if high is None else high
    nkl = torch.clamp(new - old, min=-20.0, max=20.0)
    ratio = torch.exp(nkl)
    ppo_kl = o_masked_mean(-nkl, mask)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    c1 = torch.maximum(l1, l2)
    clipfrac = o_masked_mean(torch.gt(l2, l1).float(), mask)
    l3 = -adv * c
    c2 = torch.min(l3, c1)
    lower = o_masked_mean(torch.gt(c1, l3) * (adv < 0).float(), mask)
    losses = torch.where(adv < 0, c2, c1)
    return o_agg_loss(losses, mask, mode), clipfrac, ppo_kl, lower


def o_value_loss(vpreds, returns, values, mask, c, mode):
    clipped = torch.max(torch.min(vpreds, values + c), values - c)
    v1, v2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * o_agg_loss(torch.max(v1, v2), mask, mode)
    return loss, o_masked_mean(torch.gt(v2, v1).float(), mask)


def o_kl_penalty(lp, ref, kind):
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (lp - ref).square()
    kl = torch.clamp(ref - lp, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def o_gae(rewards, values, mask, gamma, lam):
    nextvalues, lastgaelam, rev = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        new_gaelam = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = new_gaelam * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    returns = adv + values
    return o_masked_whiten(adv, mask), returns


def o_grpo(rewards, mask, index, epsilon=1e-6, norm=True):
    scores = rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    for k, group in id2score.items():
        if len(group) == 1:
            id2mean[k], id2std[k] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[k], id2std[k] = torch.stack(group).mean(), torch.stack(group).std()
    out = scores.clone()
    for i in range(scores.shape[0]):
        centred = scores[i] - id2mean[index[i]]
        out[i] = centred / (id2std[index[i]] + epsilon) if norm else centred
    return out.unsqueeze(-1) * mask


def masks(b, t, gen, kind):
    if kind == "ones":
        return torch.ones(b, t, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    m = (torch.arange(t)[None] < lengths[:, None]).double()
    if kind == "holes":  # multi-turn: observation tokens in the middle
        m[:, 1] = 0.0
        m[:, 0] = 1.0
    return m


def tolerance(dtype, eager_err=0.0):
    if dtype in (torch.float32, torch.float64):
        return 1e-5
    return max(2 * eager_err, 1e-3)


# ----------------------------------------------------------------------------- vocab-sized ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_from_logits(dtype, device):
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(3, 6, 37, generator=gen, dtype=torch.float64) * 2
    logits = full.to(device, dtype)[:, :-1].detach().requires_grad_()  # a strided slice
    labels = torch.randint(0, 37, (3, 5), generator=gen).to(device)
    z64 = logits.detach().double().requires_grad_()
    eager_leaf = logits.detach().clone().requires_grad_()
    up1, up2 = (torch.randn(3, 5, generator=gen, dtype=torch.float64).to(device) for _ in "ab")

    def oracle(z):
        lp = F.log_softmax(z, dim=-1).gather(-1, labels[..., None])[..., 0]
        ent = torch.logsumexp(z, -1) - (F.softmax(z, -1) * z).sum(-1)
        return lp, ent

    got = (verl.logprobs_from_logits(logits, labels), verl.entropy_from_logits(logits))
    want, eager = oracle(z64), oracle(eager_leaf)
    for g, w, e in zip(got, want, eager):
        assert g.dtype == dtype and rel_err(g, w) <= tolerance(dtype, rel_err(e, w))
    for outs, cast in ((got, dtype), (want, torch.float64), (eager, dtype)):
        (outs[0] * up1.to(cast) + outs[1] * up2.to(cast)).sum().backward()
    tol = tolerance(dtype, rel_err(eager_leaf.grad, z64.grad))
    assert rel_err(logits.grad, z64.grad) <= tol

    mask = masks(3, 5, gen, "padded").to(device)
    ent_loss = verl.compute_entropy_loss(logits, mask)
    assert rel_err(ent_loss, o_masked_mean(want[1], mask)) <= tolerance(dtype, 1e-3)
    with pytest.raises(ValueError, match="labels"):
        verl.logprobs_from_logits(logits, torch.full_like(labels, -100))


# ----------------------------------------------------------------------------- torch_functional


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("axis", [None, 0, 1])
def test_masked_sum_and_mean(mask_dtype, axis, device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=gen).to(device)
    m = masks(4, 6, gen, "padded").to(device, mask_dtype)
    x = torch.where(m.bool(), x, torch.full_like(x, float("nan")))  # NaN outside the mask
    for fn, oracle in ((verl.masked_sum, o_masked_sum), (verl.masked_mean, o_masked_mean)):
        got, want = fn(x, m, axis), oracle(x.double(), m.double(), axis)
        assert torch.isfinite(got).all() and rel_err(got, want) <= 1e-6
    empty = torch.zeros_like(m)
    assert verl.masked_mean(x, empty).item() == 0.0  # the + 1e-8: 0, not NaN


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_var_and_whiten(shift_mean, device):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 7, generator=gen) * 3 + 1).to(device)
    m = masks(3, 7, gen, "padded").to(device)
    for unbiased in (True, False):
        assert rel_err(verl.masked_var(x, m, unbiased),
                       o_masked_var(x.double(), m.double(), unbiased)) <= 1e-6  # fmt: skip
    got = verl.masked_whiten(x, m, shift_mean=shift_mean)
    assert rel_err(got, o_masked_whiten(x.double(), m.double(), shift_mean)) <= 1e-5
    if shift_mean:  # verl's default: zero masked mean (the opposite of torchtune's whiten)
        assert abs(o_masked_mean(got.double(), m.double()).item()) < 1e-5
    with pytest.raises(ValueError, match="At least one"):
        verl.masked_var(x, torch.zeros_like(m))
    one = torch.zeros_like(m)
    one[0, 0] = 1
    with pytest.raises(ValueError, match="sum of the mask is one"):
        verl.masked_whiten(x, one)


# ----------------------------------------------------------------------------- core_algos

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss(mode, device):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(4, 5, generator=gen, dtype=torch.float64).to(device)
    m = masks(4, 5, gen, "padded").to(device)
    assert rel_err(verl.agg_loss(loss.float(), m.float(), mode), o_agg_loss(loss, m, mode)) < 1e-6
    m[2] = 0.0
    got = verl.agg_loss(loss, m, mode)
    if mode == "seq-mean-token-mean":
        assert torch.isnan(got)  # an empty sequence: 0 / 0, as in verl
    else:
        assert rel_err(got, o_agg_loss(loss, m, mode)) <= 1e-12
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        verl.agg_loss(loss, m, "token-sum")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "clip", [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 1.5), (None, 0.2, 0.3, 3.0)]
)
def test_compute_policy_loss(mode, clip, device):
    cliprange, low, high, c = clip
    gen = torch.Generator().manual_seed(4)
    old = torch.randn(4, 6, generator=gen, dtype=torch.float64) - 2
    new = old + torch.randn(4, 6, generator=gen, dtype=torch.float64) * 0.8
    new[0, 0], new[0, 1] = old[0, 0] + 30.0, old[0, 1] - 30.0  # the +-20 log-ratio clamp
    adv = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    m = masks(4, 6, gen, "padded")
    m[:, 0] = 1.0
    lp = new.float().to(device).requires_grad_()
    got = verl.compute_policy_loss(old.float().to(device), lp, adv.float().to(device),
                                   m.to(device), cliprange, low, high, c, mode)  # fmt: skip
    lp64 = lp.detach().double().requires_grad_()
    want = o_policy_loss(old.to(device), lp64, adv.to(device), m.to(device), cliprange, low,
                         high, c, mode)  # fmt: skip
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5
    assert want[3].item() > 0 and want[1].item() > 0  # both clips are exercised
    got[0].backward()
    want[0].backward()
    assert rel_err(lp.grad, lp64.grad) <= 1e-5
    with pytest.raises(AssertionError):
        verl.compute_policy_loss(old, new, adv, m, 0.2, clip_ratio_c=1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_compute_value_loss(mode, device):
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    vpreds = values + torch.randn(3, 5, generator=gen, dtype=torch.float64) * 0.5
    returns = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    m = masks(3, 5, gen, "padded")
    v = vpreds.float().to(device).requires_grad_()
    got = verl.compute_value_loss(v, returns.float().to(device), values.float().to(device),
                                  m.to(device), 0.2, mode)  # fmt: skip
    v64 = v.detach().double().requires_grad_()
    want = o_value_loss(v64, returns.to(device), values.to(device), m.to(device), 0.2, mode)
    assert all(rel_err(g, w) <= 1e-5 for g, w in zip(got, want))
    got[0].backward()
    want[0].backward()
    assert rel_err(v.grad, v64.grad) <= 1e-5


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty(kind, device):
    gen = torch.Generator().manual_seed(6)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64) - 2
    ref = lp + torch.randn(3, 4, generator=gen, dtype=torch.float64)
    ref[0, 0] = lp[0, 0] + 25.0  # beyond low_var_kl's clamps
    a = lp.float().to(device).requires_grad_()
    b = ref.float().to(device).requires_grad_()
    got = verl.kl_penalty(a, b, kind)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    want = o_kl_penalty(a64, b64, kind)
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-5
    up = torch.randn(3, 4, generator=gen, dtype=torch.float64).to(device)
    got.backward(up.float())
    want.backward(up)
    assert rel_err(a.grad, a64.grad) <= 1e-5 and rel_err(b.grad, b64.grad) <= 1e-5
    for bad in ("full", "k4"):
        with pytest.raises(NotImplementedError):
            verl.kl_penalty(a, b, bad)


@pytest.mark.parametrize("mask_kind", ["ones", "padded", "holes"])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0)])
def test_compute_gae_advantage_return(mask_kind, gamma, lam, device):
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    m = masks(4, 9, gen, mask_kind)
    m[0] = 1.0
    m[1, 3:] = 0.0
    adv, ret = verl.compute_gae_advantage_return(rewards.float().to(device),
                                                 values.float().to(device),
                                                 m.to(device), gamma, lam)  # fmt: skip
    want_adv, want_ret = o_gae(rewards, values, m, gamma, lam)
    assert adv.dtype == torch.float32
    assert rel_err(ret, want_ret) <= 1e-5 and rel_err(adv, want_adv) <= 1e-5


@pytest.mark.parametrize("norm", [True, False])
def test_compute_grpo_outcome_advantage(norm, device):
    gen = torch.Generator().manual_seed(8)
    rewards = torch.zeros(7, 4, dtype=torch.float64)
    rewards[:, -1] = torch.randint(0, 3, (7,), generator=gen).double()
    rewards[5, -1] = rewards[6, -1] = 1.0  # a constant group
    index = np.array(["b", "a", "b", "c", "a", "d", "d"], dtype=object)  # "c": a group of one
    m = masks(7, 4, gen, "padded")
    adv, ret = verl.compute_grpo_outcome_advantage(
        rewards.float().to(device), m.to(device), index, norm_adv_by_std_in_grpo=norm
    )
    want = o_grpo(rewards, m, index, norm=norm)
    assert adv is ret and rel_err(adv, want) <= 1e-5
    ids = [1, 0, 1, 2, 0, 3, 3]  # a tensor index works too
    as_tensor = verl.compute_grpo_outcome_advantage(rewards, m, torch.tensor(ids))[0]
    assert rel_err(as_tensor, o_grpo(rewards, m, ids)) <= 1e-12


# ----------------------------------------------------------------------------- backends / originals


def test_reference_backend_path_agrees(monkeypatch):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 5, 23, generator=gen)
    labels = torch.randint(0, 23, (2, 5), generator=gen)
    rewards, values = torch.randn(2, 5, generator=gen), torch.randn(2, 5, generator=gen)
    m = masks(2, 5, gen, "holes")
    run = lambda: (verl.logprobs_from_logits(logits, labels), verl.entropy_from_logits(logits),
                   *verl.compute_gae_advantage_return(rewards, values, m, 1.0, 0.95))  # fmt: skip
    fused = run()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for a, b in zip(fused, run()):
        assert rel_err(a, b) <= 1e-5


def test_against_installed_verl(device):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    gen = torch.Generator().manual_seed(10)
    old = torch.randn(3, 5, generator=gen).to(device)
    new = old + 0.5 * torch.randn(3, 5, generator=gen).to(device)
    adv = torch.randn(3, 5, generator=gen).to(device)
    m = torch.ones(3, 5, device=device)
    got = verl.compute_policy_loss(old, new, adv, m, 0.2)
    want = core_algos.compute_policy_loss(old, new, adv, m, 0.2)
    assert all(rel_err(g, w) <= 1e-5 for g, w in zip(got, want))
