"""fused_rl.compat.torchtune against an independent transcription of torchtune's
``rlhf`` utilities and ``PPOLoss`` (bd2a0fc7c314, see seeds/ORIGINALS.md section 2), with
torchtune's own unit-test fixtures."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err, seed_gae_loop

from fused_rl.compat import torchtune as rlhf

# ----------------------------------------------------------------------------- the oracle


def o_masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim=dim) / (mask.sum(dim=dim) + 1e-8)


def o_masked_var(centered, mask, unbiased=True):
    var = o_masked_mean(centered.pow(2), mask)
    if unbiased:
        n = mask.sum() + 1e-8
        var = var * (n / (n - 1))
    return var


def o_whiten(x, mask=None, shift_mean=True):
    if mask is not None:
        mean = o_masked_mean(x, mask)
        var = o_masked_var(x - mean, mask)
    else:
        mean, var = x.mean(), x.var()
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out + mean if shift_mean else out


def o_estimate_advantages(values, rewards, gamma, lmbda, masks=None):
    adv, returns = seed_gae_loop(rewards, values, gamma, lmbda)
    adv = o_whiten(adv, mask=masks)
    if masks is not None:
        adv[~masks] = 0.0
    return adv, returns


def o_ppo_loss(old, new, adv, v_old, v, ret, pm, vm, eps=0.1, vclip=0.2, vcoef=0.1):
    ratios = torch.exp(new - old)
    clipped = torch.clamp(ratios, 1.0 - eps, 1.0 + eps)
    pl_c, pl_u = -adv * clipped, -adv * ratios
    clipfrac = (pl_c > pl_u).float()  # seed 000 / torchtune: always fp32 before the mean
    clipfrac = clipfrac.mean() if pm is None else o_masked_mean(clipfrac, pm)
    policy = torch.maximum(pl_c, pl_u)
    policy = policy.mean() if pm is None else o_masked_mean(policy, pm)
    v_clipped = torch.clamp(v, v_old - vclip, v_old + vclip)
    value = torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2)
    value = 0.5 * value.mean() if vm is None else 0.5 * o_masked_mean(value, vm)
    loss = policy + value * vcoef
    return loss, policy.detach(), value.detach(), ratios.mean().detach(), clipfrac.detach()


def padding(b, t, gen):
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    return torch.arange(t)[None] < lengths[:, None]


# ----------------------------------------------------------------------------- rewards.py


@pytest.mark.parametrize("dim", [None, 0, 1])
@pytest.mark.parametrize("float_mask", [False, True])
def test_masked_mean(dim, float_mask, device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen).to(device)
    m = padding(4, 5, gen).to(device)
    m[2] = False
    mask = m.float() if float_mask else m
    got = rlhf.masked_mean(x, mask, dim)
    assert rel_err(got, o_masked_mean(x.double(), m.double(), dim)) <= 1e-6
    assert rlhf.masked_mean(x, torch.zeros_like(mask)).item() == 0.0  # not NaN
    if dim == 1:
        assert got[2].item() == 0.0


def test_masked_var_and_whiten_fixtures(device):
    # torchtune's masked_var test: [1, 2, 3] valid -> 1.0
    x = torch.tensor([1.0, 2.0, 3.0, 10.0], device=device)
    mask = torch.tensor([True, True, True, False], device=device)
    centred = x - rlhf.masked_mean(x, mask)
    assert rlhf.masked_var(centred, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert rlhf.masked_var(centred, mask, unbiased=False).item() == pytest.approx(2 / 3, rel=1e-6)
    one = torch.tensor([True, False, False, False], device=device)
    assert torch.isnan(rlhf.masked_var(x - x[0], one))  # 0 * inf: one valid element, in fp32

    gen = torch.Generator().manual_seed(1)
    y = (torch.randn(100, generator=gen) * 3 + 5).to(device)
    # shift_mean=True (default) ADDS the mean back: unit variance, original mean
    w = rlhf.whiten(y)
    assert w.mean().item() == pytest.approx(y.mean().item(), rel=1e-5)
    assert w.var().item() == pytest.approx(1.0, rel=1e-4)
    # shift_mean=False: zero mean
    assert abs(rlhf.whiten(y, shift_mean=False).mean().item()) < 1e-5
    assert rel_err(w, o_whiten(y.double())) <= 1e-6


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("with_mask", [False, True])
def test_whiten_matches_original(shift_mean, with_mask, device):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 8, generator=gen) * 2 - 1).to(device)
    mask = padding(3, 8, gen).to(device) if with_mask else None
    got = rlhf.whiten(x, mask=mask, shift_mean=shift_mean)
    want = o_whiten(x.double(), None if mask is None else mask, shift_mean)
    assert rel_err(got, want) <= 1e-5


def test_estimate_advantages_fixture(device):
    values = rewards = torch.tensor([[0, 0, 0, 1]], device=device)
    gamma, lmbda = 0.9, 0.95
    adv, returns = rlhf.estimate_advantages(values, rewards, gamma, lmbda)
    expected = [gamma**3 * lmbda**2, gamma**2 * lmbda, gamma, 1.0]
    assert returns[0].tolist() == pytest.approx(expected, rel=1e-6)
    assert returns.dtype == adv.dtype == torch.float32


@pytest.mark.parametrize("mask_kind", [None, "partial", "empty"])
@pytest.mark.parametrize("gamma, lmbda, length", [(0.9, 0.95, 7), (1.0, 1.0, 7), (1.0, 0.0, 5),
                                                  (0.99, 0.95, 1)])  # fmt: skip
def test_estimate_advantages_matches_original(mask_kind, gamma, lmbda, length, device):
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, length, generator=gen, dtype=torch.float64)
    rewards = torch.randn(4, length, generator=gen, dtype=torch.float64)
    masks = None
    if mask_kind == "partial":
        masks = padding(4, length, gen)
        masks[:, 0] = True
        masks[0] = True
    elif mask_kind == "empty":
        masks = torch.zeros(4, length, dtype=torch.bool)
    f = lambda t: t.float().to(device)
    dev_masks = None if masks is None else masks.to(device)
    adv, returns = rlhf.estimate_advantages(f(values), f(rewards), gamma, lmbda, dev_masks)
    want_adv, want_ret = o_estimate_advantages(values, rewards, gamma, lmbda, masks)
    assert rel_err(returns, want_ret) <= 1e-5  # from the unwhitened advantages
    if mask_kind == "empty":
        assert torch.count_nonzero(adv) == 0
    else:
        assert rel_err(adv, want_adv) <= 1e-5


@pytest.mark.parametrize("where", [None, "first", "last", "mid"])
def test_get_rewards_ppo(where, device):
    # torchtune's fixture: kl_coeff 0.5, kl = -0.1 per token -> rewards 0.05 + score at the end
    scores = torch.tensor([1.0, 2.0, 3.0], device=device)
    logprobs = torch.tensor([[0.1, 0.2, 0.3]] * 3, device=device)
    ref = logprobs + 0.1
    idx = {None: None, "first": [0, 0, 0], "last": [2, 2, 2], "mid": [1, 0, 2]}[where]
    idx_t = None if idx is None else torch.tensor(idx, device=device)
    total, kl, kl_reward = rlhf.get_rewards_ppo(scores, logprobs, ref, 0.5, idx_t)
    assert torch.allclose(kl, torch.full_like(kl, -0.1), atol=1e-6)
    assert torch.allclose(kl_reward, torch.full_like(kl, 0.05), atol=1e-6)
    expected = torch.full_like(kl, 0.05)
    for b, pos in enumerate(idx or [2, 2, 2]):
        expected[b, pos] += scores[b]
    assert torch.allclose(total, expected, atol=1e-6)


# ----------------------------------------------------------------------------- sequence_processing


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_to_logprobs(temperature, dtype, device):
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(2, 7, 29, generator=gen, dtype=torch.float64) * 2
    logits = full.to(device, dtype)[:, 1:-1].detach().requires_grad_()  # logits[:, ctx-1:-1]
    seqs = torch.randint(0, 29, (2, 5), generator=gen).to(device)
    got = rlhf.logits_to_logprobs(logits, seqs, temperature)
    assert got.dtype == dtype

    def oracle(z):
        return torch.gather(F.log_softmax(z / temperature, -1), 2, seqs[..., None]).squeeze(-1)

    z64 = logits.detach().double().requires_grad_()
    eager_leaf = logits.detach().clone().requires_grad_()
    want, eager = oracle(z64), oracle(eager_leaf)
    tol = lambda e: 1e-5 if dtype == torch.float32 else max(2 * e, 1e-3)
    assert rel_err(got, want) <= tol(rel_err(eager, want))
    up = torch.randn(2, 5, generator=gen, dtype=torch.float64).to(device)
    got.backward(up.to(dtype))
    want.backward(up)
    eager.backward(up.to(dtype))
    assert rel_err(logits.grad, z64.grad) <= tol(rel_err(eager_leaf.grad, z64.grad))

    batched = rlhf.batched_logits_to_logprobs(logits.detach(), seqs, temperature, chunk_size=3)
    assert batched.dtype == torch.float32 and rel_err(batched, want) <= 1e-5
    with pytest.raises(ValueError, match="sequences"):
        rlhf.logits_to_logprobs(logits, torch.full_like(seqs, -100))
    with pytest.raises(ValueError, match="temperature"):
        rlhf.logits_to_logprobs(logits, seqs, 0.0)


# ----------------------------------------------------------------------------- PPOLoss


def test_ppo_loss_defaults_and_fixtures(device):
    loss_fn = rlhf.PPOLoss()
    assert (loss_fn.epsilon, loss_fn.value_clip_range, loss_fn.value_coeff) == (0.1, 0.2, 0.1)
    loss_fn = rlhf.PPOLoss(epsilon=0.2)
    zeros = torch.zeros(1, 1, device=device)
    ones = torch.ones(1, 1, device=device)
    for new, adv, expected in ((1.0, 1.0, -1.2), (-1.0, -1.0, 0.8), (0.1, 1.0, -math.exp(0.1))):
        out = loss_fn(zeros, ones * new, ones * adv, zeros, zeros, zeros)
        assert out[1].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("masks", ["none", "same", "value_one_past"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ppo_loss_matches_original(masks, dtype, device):
    gen = torch.Generator().manual_seed(5)
    g = lambda: torch.randn(3, 6, generator=gen, dtype=torch.float64)
    old = g() - 2
    new = old + 0.3 * g()
    adv, v_old, ret = g(), g(), g()
    adv[0, 0] = 0.0  # adv = 0 never counts as clipped
    v = v_old + 0.4 * g()
    pm = vm = None
    if masks != "none":
        pm = padding(3, 6, gen)
        pm[:, 0] = True
        vm = pm.clone()
        if masks == "value_one_past":  # values stay valid one token past the response end
            vm[:, 1:] |= pm[:, :-1]
        pm, vm = pm.to(device), vm.to(device)
    new_l = new.to(device, dtype).requires_grad_()
    v_l = v.to(device, dtype).requires_grad_()
    cast = lambda t: t.to(device, dtype)
    loss_fn = rlhf.PPOLoss(epsilon=0.2, value_clip_range=0.2, value_coeff=0.1)
    got = loss_fn(cast(old), new_l, cast(adv), cast(v_old), v_l, cast(ret), pm, vm)
    new64, v64 = (t.detach().double().requires_grad_() for t in (new_l, v_l))
    d = lambda t: t.to(device, dtype).double()
    want = o_ppo_loss(d(old), new64, d(adv), d(v_old), v64, d(ret), pm, vm, 0.2, 0.2, 0.1)
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    # dtypes as torchtune's own chain leaves them (bf16 + bool mask -> fp32 masked means)
    eager = o_ppo_loss(cast(old), cast(new), cast(adv), cast(v_old), cast(v), cast(ret), pm, vm)
    assert [t.dtype for t in got] == [t.dtype for t in eager]
    if dtype == torch.bfloat16 and masks != "none":
        assert [t.dtype for t in got] == [torch.float32] * 3 + [dtype, torch.float32]
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == () and rel_err(a, b) <= tol, i
        assert a.requires_grad == (i == 0)
    got[0].backward()
    want[0].backward()
    assert rel_err(new_l.grad, new64.grad) <= max(tol, 1e-5)
    assert rel_err(v_l.grad, v64.grad) <= max(tol, 1e-5)


# ----------------------------------------------------------------------------- originals


def test_against_installed_torchtune(device):
    tt = pytest.importorskip("torchtune.rlhf")
    gen = torch.Generator().manual_seed(6)
    values, rewards = (torch.randn(2, 5, generator=gen).to(device) for _ in range(2))
    masks = padding(2, 5, gen).to(device)
    for a, b in zip(rlhf.estimate_advantages(values, rewards, 0.9, 0.95, masks),
                    tt.estimate_advantages(values, rewards, 0.9, 0.95, masks)):  # fmt: skip
        assert rel_err(a, b) <= 1e-5
