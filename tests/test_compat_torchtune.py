"""fused_rl.compat.torchtune against an independent transcription of torchtune's
``rlhf`` utilities and ``PPOLoss`` (0.6.1 and main bd2a0fc7c314, see seeds/ORIGINALS.md
section 2), with torchtune's own unit-test fixtures, and the rules the live check
(``scripts/compat_live/torchtune/check.py``, docs/compat.md) established against the real
library: every output dtype, ``masked_sum``, gradients, ``half_precision("original")``."""

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
    clipfrac = (pl_c > pl_u).to(new.dtype)  # torchtune 0.6.1 / main: pi_logprobs' dtype
    clipfrac = clipfrac.mean() if pm is None else o_masked_mean(clipfrac, pm)
    policy = torch.maximum(pl_c, pl_u)
    policy = policy.mean() if pm is None else o_masked_mean(policy, pm)
    v_clipped = torch.clamp(v, v_old - vclip, v_old + vclip)
    value = torch.maximum((v - ret) ** 2, (v_clipped - ret) ** 2)
    value = 0.5 * value.mean() if vm is None else 0.5 * o_masked_mean(value, vm)
    loss = policy + value * vcoef
    return loss, policy.detach(), value.detach(), ratios.mean().detach(), clipfrac.detach()


def o_masked_sum(x, mask, dim=None):
    return (x * mask).sum(dim=dim)


def o_logits_to_logprobs(logits, sequences, temperature=1.0):
    return torch.gather(F.log_softmax(logits / temperature, dim=-1), 2,
                        sequences.unsqueeze(-1)).squeeze(-1)  # fmt: skip


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


def test_ppo_loss_negative_mask_weight_is_torchtunes(device):
    """A negative float mask weight: torchtune weighs by it, so the adapter does too (where
    ``fused_rl.ppo_loss`` raises it runs torchtune's math eagerly), not an error."""
    gen = torch.Generator().manual_seed(11)
    ins = [torch.randn(2, 5, generator=gen, dtype=torch.float64).to(device) for _ in range(6)]
    pm = torch.rand(2, 5, generator=gen, dtype=torch.float64).to(device)
    pm[1, 3] = -0.5
    new = ins[1].clone().requires_grad_()
    got = rlhf.PPOLoss(0.2)(ins[0], new, *ins[2:], pm, pm.abs())
    new64 = ins[1].clone().requires_grad_()
    want = o_ppo_loss(ins[0], new64, *ins[2:], pm, pm.abs(), 0.2)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 1e-12, i
    got[0].backward()
    want[0].backward()
    assert rel_err(new.grad, new64.grad) <= 1e-12


# ----------------------------------------------------------------------------- live-check rules


BF, F32, F64 = torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize("mask_dtype", [None, torch.bool, F32, BF, F64, torch.int64])
@pytest.mark.parametrize(
    "dtypes",
    [(BF,) * 6, (F32,) * 6, (F64,) * 6, (F32, BF, F32, F32, BF, F32), (BF, BF, F32, BF, BF, F64),
     (F64, F32, F32, BF, F32, F32)],
    ids=lambda d: "-".join(str(x)[6:] for x in d) if isinstance(d, tuple) else str(d),
)  # fmt: skip
def test_ppo_loss_output_dtypes_are_torchtunes(dtypes, mask_dtype, device):
    """Every output dtype, as torchtune 0.6.1 / main give it (checked by the live check over
    the same grid): clipfrac is cast to ``pi_logprobs.dtype`` before its (masked) mean, and a
    masked mean divides by ``mask.sum() + 1e-8`` (fp32 for a bool / integer mask)."""
    gen = torch.Generator().manual_seed(7)
    ins = [torch.randn(2, 5, generator=gen, dtype=F64).to(device, d) for d in dtypes]
    mask = None
    if mask_dtype is not None:
        mask = (torch.rand(2, 5, generator=gen) > 0.3).to(device, mask_dtype)
    got = rlhf.PPOLoss(0.2)(*ins, mask, mask)
    want = o_ppo_loss(*ins, mask, mask, 0.2)  # torchtune's chain in these dtypes
    assert [t.dtype for t in got] == [t.dtype for t in want]
    exact = o_ppo_loss(*(t.double() for t in ins), mask, mask, 0.2)
    for a, b in zip(got, exact):  # fp32 math, rounded once to the output dtype
        assert rel_err(a, b) <= max(1e-5, torch.finfo(a.dtype).eps)


def test_ppo_loss_clipfrac_follows_pi_logprobs_dtype(device):
    """The rule the earlier fp32-always clipfrac got wrong: fp64 in, fp64 out; bf16 without a
    mask, bf16; bf16 with a bool mask, fp32 (the masked mean's fp32 denominator)."""
    for dtype, masked, want in ((F64, False, F64), (F64, True, F64), (BF, False, BF),
                                (BF, True, F32), (F32, True, F32)):  # fmt: skip
        ins = [torch.zeros(2, 3, device=device, dtype=dtype) for _ in range(6)]
        ins[1] = ins[1] + 0.5  # ratio e^0.5: clipped where adv > 0
        ins[2] = torch.tensor([[1.0, -1.0, 0.0]] * 2, device=device, dtype=dtype)
        mask = torch.ones(2, 3, dtype=torch.bool, device=device) if masked else None
        clipfrac = rlhf.PPOLoss(0.2)(*ins, mask, mask)[4]
        assert clipfrac.dtype == want and clipfrac.item() == pytest.approx(1 / 3, rel=1e-2)


@pytest.mark.parametrize("every_input", [False, True])
def test_ppo_loss_gradients_of_every_input(every_input, device):
    """torchtune differentiates through every input: with the rollout tensors attached too
    the adapter computes eagerly (fp32) and gives each its gradient; (b, 1) advantages
    broadcast as in torchtune."""
    gen = torch.Generator().manual_seed(8)
    raw = [torch.randn(3, 4, generator=gen, dtype=F64) for _ in range(6)]
    raw[2] = raw[2][:, :1]  # broadcast advantages
    mask = (torch.rand(3, 4, generator=gen) > 0.3).to(device)
    grads = (0, 1, 2, 3, 4, 5) if every_input else (1, 4)
    ins = [t.float().to(device).requires_grad_(i in grads) for i, t in enumerate(raw)]
    ins64 = [t.detach().double().requires_grad_(i in grads) for i, t in enumerate(ins)]
    got = rlhf.PPOLoss(0.2)(*ins, mask, mask)
    want = o_ppo_loss(*ins64, mask, mask, 0.2)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6
    up = torch.randn(5, generator=gen).tolist()
    sum(u * t for u, t in zip(up, got) if t.requires_grad).backward()
    sum(u * t for u, t in zip(up, want) if t.requires_grad).backward()
    for i in grads:
        assert rel_err(ins[i].grad, ins64[i].grad) <= 1e-5, i


def test_ppo_loss_fp64_with_bf16_inputs(device):
    """An fp64 input with bf16 log-probs / values (the rare mix the fused kernel would
    store fp64 -> bf16): correct bf16 gradients."""
    gen = torch.Generator().manual_seed(9)
    dtypes = (F32, BF, F32, F32, BF, F64)
    ins = [torch.randn(2, 3, generator=gen, dtype=F64).to(device, d) for d in dtypes]
    ins = [t.requires_grad_(i in (1, 4)) for i, t in enumerate(ins)]
    ins64 = [t.detach().double().requires_grad_(i in (1, 4)) for i, t in enumerate(ins)]
    rlhf.PPOLoss(0.2)(*ins)[0].backward()
    o_ppo_loss(*ins64, None, None, 0.2)[0].backward()
    for i in (1, 4):
        assert ins[i].grad.dtype == BF and rel_err(ins[i].grad, ins64[i].grad) <= 1e-2


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
@pytest.mark.parametrize("mask_dtype", [torch.bool, F32, BF])
@pytest.mark.parametrize("dtype", [F32, F64, BF])
def test_masked_sum(dim, mask_dtype, dtype, device):
    """torchtune main's ``masked_sum``: ``(x * mask).sum(dim)``, bit for bit, in the dtype
    ``x * mask`` promotes to, with its gradient."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(3, 5, generator=gen, dtype=F64).to(device, dtype).requires_grad_()
    mask = padding(3, 5, gen).to(device, mask_dtype)
    mask[1] = 0
    x0 = x.detach().clone().requires_grad_()
    got, want = rlhf.masked_sum(x, mask, dim), o_masked_sum(x0, mask, dim)
    assert got.dtype == want.dtype == torch.promote_types(dtype, mask_dtype)
    assert torch.equal(got, want)
    up = torch.randn(got.shape, generator=gen, dtype=F64).to(device, got.dtype)
    got.backward(up)
    want.backward(up)
    assert torch.equal(x.grad, x0.grad)
    assert "masked_sum" in rlhf.__all__


@pytest.mark.parametrize(
    "dv, dr, want",
    [(F32, F32, F32), (F64, F64, F64), (BF, BF, BF), (BF, F32, F32), (torch.int64, BF, F32),
     (BF, torch.int64, F32), (torch.int64, torch.int64, F32), (torch.int64, F64, F64)],
)  # fmt: skip
def test_estimate_advantages_dtypes(dv, dr, want, device):
    """torchtune's dtypes: the promoted input dtype, an integer tensor counting as fp32
    (``gamma * values`` makes it fp32 before it meets bf16); the same with masks."""
    gen = torch.Generator().manual_seed(11)

    def make(dtype):
        if dtype == torch.int64:
            return torch.randint(-3, 4, (2, 6), generator=gen).to(device)
        return torch.randn(2, 6, generator=gen).to(device, dtype)

    values, rewards = make(dv), make(dr)
    for masks in (None, padding(2, 6, gen).to(device)):
        adv, ret = rlhf.estimate_advantages(values, rewards, 0.9, 0.95, masks)
        o_adv, o_ret = o_estimate_advantages(values, rewards, 0.9, 0.95, masks)
        assert adv.dtype == ret.dtype == o_adv.dtype == o_ret.dtype == want


@pytest.mark.parametrize("with_mask", [False, True])
def test_estimate_advantages_gradients(with_mask, device):
    """With grad enabled, torchtune's advantages and returns carry the gradient of the GAE
    loop (and of the whitening) back to values and rewards; the adapter's GAE has a backward
    through the same kernel (time reversed)."""
    gen = torch.Generator().manual_seed(12)
    values = torch.randn(3, 9, generator=gen, dtype=F64)
    rewards = torch.randn(3, 9, generator=gen, dtype=F64)
    masks = padding(3, 9, gen).to(device) if with_mask else None
    v, r = (t.float().to(device).requires_grad_() for t in (values, rewards))
    v64, r64 = (t.detach().double().requires_grad_() for t in (v, r))
    adv, ret = rlhf.estimate_advantages(v, r, 0.9, 0.95, masks)
    o_adv, o_ret = o_estimate_advantages(v64, r64, 0.9, 0.95, masks)
    ua, ur = (torch.randn(3, 9, generator=gen, dtype=F64).to(device) for _ in range(2))
    ((adv * ua.float()).sum() + (ret * ur.float()).sum()).backward()
    ((o_adv * ua).sum() + (o_ret * ur).sum()).backward()
    assert rel_err(v.grad, v64.grad) <= 1e-5 and rel_err(r.grad, r64.grad) <= 1e-5
    with torch.no_grad():  # torchtune's recipe: no graph
        adv, ret = rlhf.estimate_advantages(v, r, 0.9, 0.95, masks)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(RuntimeError):  # no double backward through the GAE kernel
        adv, _ = rlhf.estimate_advantages(v, r, 0.9, 0.95)
        (g,) = torch.autograd.grad(adv.sum(), v, create_graph=True)
        g.sum().backward()


def test_batched_logits_to_logprobs_is_fp32_for_every_dtype(device):
    """torchtune main writes the chunks into an fp32 buffer: fp64 logits come back fp32."""
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(5, 3, 11, generator=gen, dtype=F64).to(device)
    seqs = torch.randint(0, 11, (5, 3), generator=gen).to(device)
    got = rlhf.batched_logits_to_logprobs(logits, seqs, 0.8, chunk_size=2)
    assert got.dtype == F32
    assert rel_err(got, o_logits_to_logprobs(logits, seqs, 0.8)) <= 1e-6
    with pytest.raises(ValueError, match="chunk_size"):
        rlhf.batched_logits_to_logprobs(logits, seqs, chunk_size=0)


def test_half_precision_original_is_torchtune_bit_for_bit(device):
    """``half_precision("original")``: bf16 inputs go through torchtune's own bf16
    arithmetic: values and gradients equal the transcription's exactly."""
    import fused_rl.compat as compat

    gen = torch.Generator().manual_seed(14)
    logits = (torch.randn(3, 4, 50, generator=gen) * 3).to(device, BF)
    seqs = torch.randint(0, 50, (3, 4), generator=gen).to(device)
    v, r = (torch.randn(3, 4, generator=gen).to(device, BF) for _ in range(2))
    masks = padding(3, 4, gen).to(device)
    ppo_in = [torch.randn(3, 4, generator=gen).to(device, BF) for _ in range(6)]
    cases = [
        (lambda z: rlhf.logits_to_logprobs(z, seqs, 0.7),
         lambda z: o_logits_to_logprobs(z, seqs, 0.7), logits),
        (lambda z: rlhf.batched_logits_to_logprobs(z, seqs, 0.7, chunk_size=2),
         lambda z: o_logits_to_logprobs(z, seqs, 0.7).float(), logits),
        (lambda x: rlhf.estimate_advantages(x, r, 0.9, 0.95, masks),
         lambda x: o_estimate_advantages(x, r, 0.9, 0.95, masks), v),
        (lambda x: rlhf.PPOLoss(0.2)(ppo_in[0], x, *ppo_in[2:4], x * 2, ppo_in[5], masks),
         lambda x: o_ppo_loss(ppo_in[0], x, *ppo_in[2:4], x * 2, ppo_in[5], masks, None, 0.2),
         ppo_in[1]),
    ]  # fmt: skip
    for fn, oracle, x in cases:
        a, b = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with compat.half_precision("original"):
            got = fn(a)
        want = oracle(b)
        got, want = (
            [got] if torch.is_tensor(got) else got,
            [want] if torch.is_tensor(want) else want,
        )
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
        live = [(g, w) for g, w in zip(got, want) if w.requires_grad]
        ups = [torch.randn(w.shape, generator=gen).to(device, w.dtype) for _, w in live]
        sum((g * u).sum() for (g, _), u in zip(live, ups)).backward()
        sum((w * u).sum() for (_, w), u in zip(live, ups)).backward()
        assert torch.equal(a.grad, b.grad)
    # the default ("accurate") rounds once from fp32: closer to float64 than torchtune's bf16
    exact = o_logits_to_logprobs(logits.double(), seqs, 0.7)
    accurate = rlhf.logits_to_logprobs(logits, seqs, 0.7)
    assert rel_err(accurate, exact) <= rel_err(o_logits_to_logprobs(logits, seqs, 0.7), exact)


# ----------------------------------------------------------------------------- originals


def test_against_installed_torchtune(device):
    """Against the real torchtune (the live check's venv): estimate_advantages, PPOLoss (every
    output's dtype included) and, on torchtune main, masked_sum."""
    tt = pytest.importorskip("torchtune.rlhf")
    from torchtune.rlhf.loss import PPOLoss

    gen = torch.Generator().manual_seed(6)
    values, rewards = (torch.randn(2, 5, generator=gen).to(device) for _ in range(2))
    masks = padding(2, 5, gen).to(device)
    for a, b in zip(rlhf.estimate_advantages(values, rewards, 0.9, 0.95, masks),
                    tt.estimate_advantages(values, rewards, 0.9, 0.95, masks)):  # fmt: skip
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-5
    for dtype in (F32, F64, BF):
        ins = [torch.randn(2, 5, generator=gen).to(device, dtype) for _ in range(6)]
        for mask in (None, masks):
            got = rlhf.PPOLoss(0.2)(*ins, mask, mask)
            want = PPOLoss(0.2)(*ins, mask, mask)
            assert [t.dtype for t in got] == [t.dtype for t in want]
            tol = 1e-5 if dtype != BF else 2e-2
            assert all(rel_err(a, b) <= tol for a, b in zip(got, want))
    if hasattr(tt, "masked_sum"):
        x = torch.randn(2, 5, generator=gen).to(device)
        assert torch.equal(rlhf.masked_sum(x, masks, 1), tt.masked_sum(x, masks, 1))
