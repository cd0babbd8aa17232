"""fused_rl.compat.ding against an independent transcription of DI-engine's documented
behaviour (``ding.rl_utils.ppo`` / ``grpo`` at d0b21d065b2d, see seeds/ORIGINALS.md section 1),
written here with ``torch.distributions`` exactly as DI-engine computes, run in float64."""

import math
import zlib

import pytest
import torch
from helpers import rel_err
from torch.distributions import Categorical, Independent, Normal

from fused_rl.compat import ding

# ----------------------------------------------------------------------------- the oracle


def kl_div_oracle(log_ratio, kl_type):
    if kl_type == "k1":
        return log_ratio.mean()
    if kl_type == "k2":
        return (log_ratio**2 / 2).mean()
    if kl_type == "k3":
        return (torch.exp(-log_ratio) - 1 + log_ratio).mean()
    raise ValueError(kl_type)


def policy_oracle(data, clip_ratio=0.2, dual_clip=None, entropy_bonus=True, kl_type="k1"):
    logit_new, logit_old, action, adv, weight, logit_pretrained = data
    if weight is None:
        weight = torch.ones_like(adv)
    dist_new, dist_old = Categorical(logits=logit_new), Categorical(logits=logit_old)
    logp_new, logp_old = dist_new.log_prob(action), dist_old.log_prob(action)
    if entropy_bonus:
        entropy = dist_new.entropy()
        if entropy.shape != weight.shape:
            entropy = dist_new.entropy().mean(dim=1)
        entropy_loss = (entropy * weight).mean()
    else:
        entropy_loss = torch.tensor(0.0)
    ratio = torch.exp(logp_new - logp_old)
    if ratio.shape != adv.shape:
        ratio = ratio.mean(dim=1)
    surr1, surr2 = ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv
    if dual_clip is None:
        policy_loss = (-torch.min(surr1, surr2) * weight).mean()
    else:
        clip1 = torch.min(surr1, surr2)
        clip2 = torch.max(clip1, dual_clip * adv)
        policy_loss = -(torch.where(adv < 0, clip2, clip1) * weight).mean()
    with torch.no_grad():
        approx_kl = (logp_old - logp_new).mean().item()
        clipfrac = (ratio.gt(1 + clip_ratio) | ratio.lt(1 - clip_ratio)).float().mean().item()
    if logit_pretrained is not None:
        log_ratio = logp_new - Categorical(logits=logit_pretrained).log_prob(action)
        kl = kl_div_oracle(log_ratio, kl_type)
    else:
        kl = torch.tensor(0.0, dtype=policy_loss.dtype, device=policy_loss.device)
    return (policy_loss, entropy_loss, kl), (approx_kl, clipfrac)


def value_oracle(data, clip_ratio=0.2, use_value_clip=True):
    value_new, value_old, return_, weight = data
    if weight is None:
        weight = torch.ones_like(value_old)
    if use_value_clip:
        value_clip = value_old + (value_new - value_old).clamp(-clip_ratio, clip_ratio)
        v1, v2 = (return_ - value_new).pow(2), (return_ - value_clip).pow(2)
        return 0.5 * (torch.max(v1, v2) * weight).mean()
    return 0.5 * ((return_ - value_new).pow(2) * weight).mean()


def continuous_oracle(data, clip_ratio=0.2, dual_clip=None, kl_type="k1", gated=False):
    """DI-engine's continuous policy error; ``gated=True`` is the corrected dual clip."""
    mu_sigma_new, mu_sigma_old, action, adv, weight, pretrained = data
    if weight is None:
        weight = torch.ones_like(adv)
    old_mu, old_sigma = mu_sigma_old["mu"], mu_sigma_old["sigma"]
    if old_mu.dim() == 1:
        old_mu, old_sigma = old_mu.unsqueeze(-1), old_sigma.unsqueeze(-1)
    dist_new = Independent(Normal(mu_sigma_new["mu"], mu_sigma_new["sigma"]), 1)
    dist_old = Independent(Normal(old_mu, old_sigma), 1)
    logp_new, logp_old = dist_new.log_prob(action), dist_old.log_prob(action)
    entropy_loss = (dist_new.entropy() * weight).mean()
    ratio = torch.exp(logp_new - logp_old)
    surr1, surr2 = ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv
    if dual_clip is None:
        policy_loss = (-torch.min(surr1, surr2) * weight).mean()
    else:
        capped = torch.max(torch.min(surr1, surr2), dual_clip * adv)
        if gated:
            capped = torch.where(adv < 0, capped, torch.min(surr1, surr2))
        policy_loss = (-capped * weight).mean()
    with torch.no_grad():
        approx_kl = (logp_old - logp_new).mean().item()
        clipfrac = (ratio.gt(1 + clip_ratio) | ratio.lt(1 - clip_ratio)).float().mean().item()
    kl = None
    if pretrained is not None:
        dist_pre = Independent(Normal(pretrained["mu"], pretrained["sigma"]), 1)
        kl = kl_div_oracle(logp_new - dist_pre.log_prob(action), kl_type)
    return (policy_loss, entropy_loss, kl), (approx_kl, clipfrac)


def grpo_oracle(data, clip_ratio=0.2, beta=0.1):
    logit_new, logit_old, logit_ref, action, adv, weight = data
    lp = lambda z: torch.log_softmax(z, -1).gather(-1, action[..., None])[..., 0]
    pn, pr, po = lp(logit_new), lp(logit_ref), lp(logit_old)
    per_token_kl = torch.exp(pr - pn) - (pr - pn) - 1
    ratio = torch.exp(pn - po)
    rc = torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    a = adv.unsqueeze(1)
    per_token_loss = -torch.min(ratio * a, rc * a) + beta * per_token_kl
    if weight is None:
        weight = torch.ones_like(per_token_loss)
    loss = ((per_token_loss * weight).sum(1) / weight.sum(1)).mean()
    with torch.no_grad():
        approx_kl = (po - pn).mean().item()
        clipfrac = (ratio.gt(1 + clip_ratio) | ratio.lt(1 - clip_ratio)).float().mean().item()
    return loss, (approx_kl, clipfrac)


# ----------------------------------------------------------------------------- helpers


def tolerance(dtype, eager_err=0.0):
    """fp32: 1e-5; bf16: no worse than twice the eager bf16 error, one bf16 ulp, or 1e-3."""
    if dtype in (torch.float32, torch.float64):
        return 1e-5
    return max(2 * eager_err, 1e-3, torch.finfo(dtype).eps)


def leaf(x, dtype, device):
    return x.to(device=device, dtype=dtype).detach().requires_grad_()


def as_oracle(x):
    """The oracle's copy of a fused input: the same (rounded) values, in float64."""
    return None if x is None else x.detach().double().requires_grad_(x.requires_grad)


def seed_of(*key):
    """A generator seeded from ``key`` (stable across processes, unlike ``hash``)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def logits_case(shape, *, gen, scale=1.5):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def policy_data(shape, adv_shape, weight_kind, *, pretrained, gen, negative_adv=False):
    """Float64 ``ppo_policy_data`` pieces with an old policy far enough to clip (and to
    make a dual clip of 1.5 or 3 bind)."""
    logit_new = logits_case(shape, gen=gen)
    logit_old = logit_new + logits_case(shape, gen=gen, scale=1.2)
    action = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    adv = torch.randn(*adv_shape, generator=gen, dtype=torch.float64)
    if negative_adv:
        adv = -adv.abs() - 0.5
    weight = {
        "none": None,
        "mask": (torch.rand(*adv_shape, generator=gen) > 0.3).double(),
        "fractional": torch.rand(*adv_shape, generator=gen, dtype=torch.float64),
        "zero": torch.zeros(*adv_shape, dtype=torch.float64),
    }[weight_kind]
    pre = logits_case(shape, gen=gen) if pretrained else None
    return logit_new, logit_old, action, adv, weight, pre


POLICY_CASES = [
    # shape, adv shape, weight, dual_clip, all adv < 0, entropy_bonus, kl_type (None = none)
    ((2, 3, 11), (2, 3), "none", None, False, True, None),
    ((4, 3, 11), (4, 3), "mask", 1.5, False, True, "k1"),
    ((2, 3, 11), (2, 3), "fractional", 3.0, True, False, "k2"),
    ((2, 3, 11), (2, 3), "zero", 3.0, True, True, "k3"),
    ((5, 7), (5,), "fractional", None, False, True, "k3"),
    ((6, 2, 5), (6,), "mask", 1.5, False, True, "k1"),  # MARL: ratio / entropy mean over dim 1
    ((6, 2, 13), (6,), "none", 1.5, False, True, "k2"),  # (B,) adv with (B, S) actions
]
BF16_CASES = [c for c in POLICY_CASES if c[2] in ("none", "mask")]


@pytest.mark.parametrize(
    "case, dtype",
    [(c, torch.float32) for c in POLICY_CASES] + [(c, torch.bfloat16) for c in BF16_CASES],
    ids=lambda x: str(x).replace("torch.", "").replace(" ", ""),
)
def test_ppo_policy_error_matches_original(case, dtype, device):
    shape, adv_shape, weight_kind, dual_clip, negative, entropy_bonus, kl_type = case
    gen = seed_of(case)
    raw = policy_data(
        shape, adv_shape, weight_kind, pretrained=kl_type is not None, gen=gen,
        negative_adv=negative,
    )  # fmt: skip
    logit_new = leaf(raw[0], dtype, device)
    others = [None if t is None else t.to(device) for t in raw[1:]]
    logit_old = others[0].to(dtype)
    pre = None if others[4] is None else others[4].to(dtype)
    data = ding.ppo_policy_data(logit_new, logit_old, others[1], others[2], others[3], pre)
    kw = dict(dual_clip=dual_clip, entropy_bonus=entropy_bonus, kl_type=kl_type or "k1")
    out, info = ding.ppo_policy_error(data, **kw)

    oracle_data = ding.ppo_policy_data(
        *(as_oracle(t) if t is not None and t.is_floating_point() else t for t in data)
    )
    ref_out, ref_info = policy_oracle(oracle_data, **kw)
    if dual_clip is not None and weight_kind != "zero":  # the case exercises the dual clip
        assert policy_oracle(oracle_data, **dict(kw, dual_clip=None))[0][0] != ref_out[0]
    # the original run in the input dtype: the bf16 error budget
    eager_leaf = logit_new.detach().clone().requires_grad_()
    eager_out, _ = policy_oracle(data._replace(logit_new=eager_leaf), **kw)

    names = ("policy_loss", "entropy_loss", "kl_div")
    for name, got, want, eager in zip(names, out, ref_out, eager_out):
        assert got.shape == () and torch.isfinite(got)
        if weight_kind == "zero" and name != "kl_div":
            assert got.item() == 0.0, name  # numel-mean of zeros: 0, not NaN
        else:
            tol = tolerance(dtype, rel_err(eager, want))
            assert rel_err(got, want) <= tol, (name, got.item(), want.item())
    assert isinstance(info.approx_kl, float) and isinstance(info.clipfrac, float)
    assert info.approx_kl == pytest.approx(ref_info[0], rel=1e-5, abs=1e-6)
    assert info.clipfrac == pytest.approx(ref_info[1], abs=1e-6)

    # gradient under a random combination of the differentiable outputs
    coef = torch.randn(3, generator=gen, dtype=torch.float64).tolist()
    live = [i for i in range(3) if out[i].requires_grad]
    for outputs in (out, ref_out, eager_out):
        sum(coef[i] * outputs[i] for i in live).backward()
    want_grad = oracle_data.logit_new.grad
    assert logit_new.grad.dtype == dtype
    tol = tolerance(dtype, rel_err(eager_leaf.grad, want_grad))
    assert rel_err(logit_new.grad, want_grad) <= tol


def test_ppo_policy_error_output_dtypes_follow_promotion(device):
    gen = torch.Generator().manual_seed(1)
    logit_new, logit_old, action, adv, _, pre = policy_data(
        (2, 3, 7), (2, 3), "none", pretrained=True, gen=gen
    )
    bf = lambda t: t.to(device=device, dtype=torch.bfloat16)
    mixed = ding.ppo_policy_data(bf(logit_new), bf(logit_old), action.to(device),
                                 adv.float().to(device), torch.ones(2, 3, device=device),
                                 bf(pre))  # fmt: skip
    out, _ = ding.ppo_policy_error(mixed)
    assert (out.policy_loss.dtype, out.entropy_loss.dtype, out.kl_div.dtype) == (
        torch.float32, torch.float32, torch.bfloat16,
    )  # fmt: skip
    all_bf = mixed._replace(adv=bf(adv), weight=None)
    out, _ = ding.ppo_policy_error(all_bf)
    assert {t.dtype for t in out} == {torch.bfloat16}


def test_entropy_bonus_off_and_no_pretrained_give_original_zeros(device):
    gen = torch.Generator().manual_seed(2)
    raw = policy_data((2, 3, 7), (2, 3), "none", pretrained=False, gen=gen)
    f = lambda t: None if t is None else (t.float() if t.is_floating_point() else t).to(device)
    data = ding.ppo_policy_data(*(f(t) for t in raw))
    out, _ = ding.ppo_policy_error(data, entropy_bonus=False, kl_type="bogus")
    assert out.entropy_loss.device.type == "cpu" and out.entropy_loss.dtype == torch.float32
    assert out.entropy_loss.item() == 0.0 and not out.entropy_loss.requires_grad
    assert out.kl_div.item() == 0.0 and out.kl_div.dtype == out.policy_loss.dtype
    assert out.kl_div.device == out.policy_loss.device and out.kl_div.shape == ()
    with pytest.raises(ValueError, match="kl_type"):  # checked only with pretrained logits
        ding.ppo_policy_error(data._replace(logit_pretrained=data.logit_new), kl_type="bogus")


def test_dual_clip_bounds_negative_advantages_only(device):
    gen = torch.Generator().manual_seed(3)
    logit_new, logit_old, action, _, _, _ = policy_data((3, 4, 9), (3, 4), "none",
                                                        pretrained=False, gen=gen)  # fmt: skip
    logit_new = (logit_new * 4).float().to(device)  # ratios far outside the band
    logit_old = logit_old.float().to(device)
    action = action.to(device)
    pos = torch.rand(3, 4, generator=gen).to(device) + 0.1
    for adv, changes in ((pos, False), (-pos, True)):
        data = ding.ppo_policy_data(logit_new, logit_old, action, adv, None, None)
        plain = ding.ppo_policy_error(data)[0].policy_loss
        dual = ding.ppo_policy_error(data, dual_clip=1.5)[0].policy_loss
        assert (plain != dual).item() == changes
        if changes:  # the c * A bound caps the loss of large-ratio negative advantages
            assert dual < plain


def test_ratio_one_tie_gives_the_policy_gradient(device):
    gen = torch.Generator().manual_seed(4)
    z, _, action, adv, weight, _ = policy_data((2, 5, 11), (2, 5), "fractional",
                                               pretrained=False, gen=gen)  # fmt: skip
    logit_new = leaf(z, torch.float32, device)
    adv, weight, action = adv.float().to(device), weight.float().to(device), action.to(device)
    data = ding.ppo_policy_data(logit_new, logit_new.detach(), action, adv, weight, None)
    ding.ppo_policy_error(data, entropy_bonus=False)[0].policy_loss.backward()
    z64 = as_oracle(logit_new)
    lp = torch.log_softmax(z64, -1).gather(-1, action[..., None])[..., 0]
    (-(adv.double() * lp * weight.double()).mean()).backward()
    assert rel_err(logit_new.grad, z64.grad) <= 1e-5


def test_attached_old_logits_get_gradient_like_the_original(device):
    gen = torch.Generator().manual_seed(5)
    z, _, action, adv, _, pre = policy_data((2, 3, 8), (2, 3), "none", pretrained=True, gen=gen)
    noise = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64).to(device) * 0.3
    base = leaf(z, torch.float32, device)
    base64 = as_oracle(base)
    grads = []
    for root, fn, cast in ((base, ding.ppo_policy_error, torch.float32),
                           (base64, policy_oracle, torch.float64)):  # fmt: skip
        logit_old = root + noise.to(cast)  # NOT detached, as in DI-engine's own RLHF tests
        data = ding.ppo_policy_data(root * 1.0, logit_old, action.to(device),
                                    adv.to(device, cast), None, pre.to(device, cast))  # fmt: skip
        out = fn(data, kl_type="k3")[0]
        (out[0] + 0.1 * out[1] + 0.3 * out[2]).backward()
        grads.append(root.grad)
    assert rel_err(grads[0], grads[1]) <= 1e-5


def test_neg_inf_logits_give_a_finite_entropy(device):
    logits = torch.randn(2, 3, 6, dtype=torch.float64)
    logits[..., 4:] = float("-inf")
    action = torch.randint(0, 4, (2, 3))
    adv = torch.randn(2, 3, dtype=torch.float64)
    data = ding.ppo_policy_data(logits.float().to(device), logits.float().to(device),
                                action.to(device), adv.float().to(device), None, None)  # fmt: skip
    out, _ = ding.ppo_policy_error(data)
    want, _ = policy_oracle(ding.ppo_policy_data(logits, logits, action, adv, None, None))
    assert torch.isfinite(out.entropy_loss)
    assert rel_err(out.entropy_loss, want[1]) <= 1e-5


def test_invalid_actions_raise_value_error(device):
    logits = torch.randn(2, 3, 5, device=device)
    adv = torch.randn(2, 3, device=device)
    for bad in (-100, 5):
        action = torch.zeros(2, 3, dtype=torch.long, device=device)
        action[1, 2] = bad
        with pytest.raises(ValueError, match="action"):
            ding.ppo_policy_error(ding.ppo_policy_data(logits, logits, action, adv, None, None))
    action32 = torch.randint(0, 5, (2, 3), dtype=torch.int32, device=device)
    data32 = ding.ppo_policy_data(logits, logits, action32, adv, None, None)
    out32 = ding.ppo_policy_error(data32)[0]
    out64 = ding.ppo_policy_error(data32._replace(action=action32.long()))[0]
    assert torch.equal(out32.policy_loss, out64.policy_loss)


@pytest.mark.parametrize("use_value_clip", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_ppo_value_error_matches_original(use_value_clip, weighted, device):
    gen = torch.Generator().manual_seed(6)
    value_old = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    # |new - old| beyond the clip range for some tokens: zero gradient on the clipped branch
    value_new = value_old + torch.randn(4, 5, generator=gen, dtype=torch.float64) * 0.4
    value_new[0, 0] = value_old[0, 0]
    ret = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    weight = torch.rand(4, 5, generator=gen, dtype=torch.float64) if weighted else None
    v = leaf(value_new, torch.float32, device)
    f = lambda t: None if t is None else t.float().to(device)
    got = ding.ppo_value_error(ding.ppo_value_data(v, f(value_old), f(ret), f(weight)),
                               clip_ratio=0.2, use_value_clip=use_value_clip)  # fmt: skip
    v64 = as_oracle(v)
    want = value_oracle(ding.ppo_value_data(v64, value_old.to(device), ret.to(device),
                                            None if weight is None else weight.to(device)),
                        0.2, use_value_clip)  # fmt: skip
    assert got.shape == () and rel_err(got, want) <= 1e-5
    got.backward()
    want.backward()
    assert rel_err(v.grad, v64.grad) <= 1e-5


def test_ppo_error_combines_policy_and_value_and_asserts_dual_clip(device):
    gen = torch.Generator().manual_seed(7)
    z, z_old, action, adv, weight, pre = policy_data((2, 4, 9), (2, 4), "mask", pretrained=True,
                                                     gen=gen)  # fmt: skip
    f = lambda t: t.float().to(device)
    value_new, value_old, ret = (f(torch.randn(2, 4, generator=gen)) for _ in range(3))
    data = ding.ppo_data(f(z), f(z_old), action.to(device), value_new, value_old, f(adv), ret,
                         f(weight), f(pre))  # fmt: skip
    out, info = ding.ppo_error(data, dual_clip=2.0, kl_type="k2")
    policy, pinfo = ding.ppo_policy_error(
        ding.ppo_policy_data(f(z), f(z_old), action.to(device), f(adv), f(weight), f(pre)),
        dual_clip=2.0, kl_type="k2",
    )  # fmt: skip
    value = ding.ppo_value_error(ding.ppo_value_data(value_new, value_old, ret, f(weight)))
    assert out._fields == ("policy_loss", "value_loss", "entropy_loss", "kl_div")
    assert torch.equal(out.policy_loss, policy.policy_loss)
    assert torch.equal(out.entropy_loss, policy.entropy_loss)
    assert torch.equal(out.kl_div, policy.kl_div) and torch.equal(out.value_loss, value)
    assert info == pinfo
    with pytest.raises(AssertionError):
        ding.ppo_error(data, dual_clip=1.0)
    # ppo_policy_error itself does not check dual_clip (as in DI-engine)
    policy_data_ = ding.ppo_policy_data(f(z), f(z_old), action.to(device), f(adv), None, None)
    assert torch.isfinite(ding.ppo_policy_error(policy_data_, dual_clip=1.0)[0].policy_loss)


def test_namedtuple_fields_match_the_original():
    assert ding.ppo_data._fields == ("logit_new", "logit_old", "action", "value_new",
                                     "value_old", "adv", "return_", "weight",
                                     "logit_pretrained")  # fmt: skip
    assert ding.ppo_policy_data._fields == (
        "logit_new", "logit_old", "action", "adv", "weight", "logit_pretrained",
    )  # fmt: skip
    assert ding.ppo_value_data._fields == ("value_new", "value_old", "return_", "weight")
    assert ding.ppo_data_continuous._fields[:2] == ("mu_sigma_new", "mu_sigma_old")
    assert ding.ppo_policy_data_continuous._fields[:2] == ("mu_sigma_new", "mu_sigma_old")
    assert ding.grpo_policy_data._fields == (
        "logit_new", "logit_old", "logit_ref", "action", "adv", "weight",
    )  # fmt: skip
    assert ding.ppo_loss._fields == ("policy_loss", "value_loss", "entropy_loss", "kl_div")
    assert ding.ppo_policy_loss._fields == ("policy_loss", "entropy_loss", "kl_div")
    assert ding.ppo_info._fields == ding.grpo_info._fields == ("approx_kl", "clipfrac")
    # DI-engine main gives no field a default: logit_pretrained must be passed (None included)
    tuples = (
        ding.ppo_data,
        ding.ppo_data_continuous,
        ding.ppo_policy_data,
        ding.ppo_policy_data_continuous,
        ding.ppo_value_data,
        ding.grpo_policy_data,
    )
    for nt in tuples:
        assert nt._field_defaults == {}, nt.__name__
        with pytest.raises(TypeError):
            nt(*range(len(nt._fields) - 1))


# ----------------------------------------------------------------------------- calculate_kl_div


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_calculate_kl_div(kl_type, device):
    assert ding.calculate_kl_div(torch.zeros(5, device=device), kl_type).item() == 0.0
    r = torch.randn(3, 4, dtype=torch.float64, device=device, requires_grad=True)
    got = ding.calculate_kl_div(r, kl_type)
    want = kl_div_oracle(r, kl_type)
    assert rel_err(got, want) <= 1e-12
    (g1,) = torch.autograd.grad(got, r)
    (g2,) = torch.autograd.grad(want, r)
    assert rel_err(g1, g2) <= 1e-12
    with pytest.raises(ValueError):
        ding.calculate_kl_div(r, "k4")


# ----------------------------------------------------------------------------- continuous


def continuous_data(n_act, *, gen, adv_sign=0, one_d_old=False, pretrained=False, weight=False):
    b = 5
    g = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    shape = (b,) if one_d_old else (b, n_act)
    mu_new, sigma_new = g(*shape), g(*shape).abs() + 0.3
    old = {"mu": mu_new + 0.3 * g(*shape), "sigma": sigma_new * (1 + 0.2 * g(*shape).abs())}
    if one_d_old:
        mu_new, sigma_new = mu_new[:, None], sigma_new[:, None]
    action = g(b, mu_new.shape[-1])
    adv = g(b)
    if adv_sign:
        adv = adv_sign * (adv.abs() + 0.2)
    pre = {"mu": g(*mu_new.shape), "sigma": g(*mu_new.shape).abs() + 0.5} if pretrained else None
    w = torch.rand(b, generator=gen, dtype=torch.float64) if weight else None
    return {"mu": mu_new, "sigma": sigma_new}, old, action, adv, w, pre


def _to(x, dtype, device, grad=False):
    if x is None:
        return None
    if isinstance(x, dict):
        return {k: _to(v, dtype, device, grad) for k, v in x.items()}
    t = x.to(device=device, dtype=dtype).detach()
    return t.requires_grad_() if grad else t


CONT_CASES = [
    # n_act, adv sign, dual_clip, fix, one_d_old, kl_type, weight
    (6, 0, None, False, False, None, False),
    (6, -1, 3.0, False, False, "k1", True),
    (6, 1, 3.0, False, False, "k2", False),  # the defect: constant loss, zero policy gradient
    (6, 1, 3.0, True, False, "k3", True),
    (1, 0, 1.5, False, True, None, True),  # 1-D old mu / sigma are unsqueezed
    (1, 0, 1.5, True, False, "k3", False),
]


@pytest.mark.parametrize("case", CONT_CASES)
def test_ppo_policy_error_continuous_matches_original(case, device):
    n_act, sign, dual_clip, fix, one_d_old, kl_type, weighted = case
    gen = seed_of(case)
    raw = continuous_data(n_act, gen=gen, adv_sign=sign, one_d_old=one_d_old,
                          pretrained=kl_type is not None, weight=weighted)  # fmt: skip
    new = _to(raw[0], torch.float32, device, grad=True)
    rest = [_to(x, torch.float32, device) for x in raw[1:]]
    data = ding.ppo_policy_data_continuous(new, *rest)
    kw = dict(dual_clip=dual_clip, kl_type=kl_type or "k1")
    out, info = ding.ppo_policy_error_continuous(data, fix_dual_clip=fix, **kw)
    new64 = {k: as_oracle(v) for k, v in new.items()}
    ref, ref_info = continuous_oracle(
        ding.ppo_policy_data_continuous(new64, *[_to(x, torch.float64, device) for x in raw[1:]]),
        gated=fix, **kw,
    )  # fmt: skip
    assert rel_err(out.policy_loss, ref[0]) <= 1e-5
    assert rel_err(out.entropy_loss, ref[1]) <= 1e-5
    if kl_type is None:
        assert out.kl_div == 0 and type(out.kl_div) is int  # DI-engine's int 0
    else:
        assert rel_err(out.kl_div, ref[2]) <= 1e-5
    assert info.approx_kl == pytest.approx(ref_info[0], rel=1e-5, abs=1e-7)
    assert info.clipfrac == pytest.approx(ref_info[1], abs=1e-6)
    coef = torch.randn(3, generator=gen).tolist()
    got = coef[0] * out.policy_loss + coef[1] * out.entropy_loss
    want = coef[0] * ref[0] + coef[1] * ref[1]
    if kl_type is not None:
        got, want = got + coef[2] * out.kl_div, want + coef[2] * ref[2]
    got.backward()
    want.backward()
    for k in ("mu", "sigma"):
        assert rel_err(new[k].grad, new64[k].grad) <= 1e-5, k
    if sign > 0 and dual_clip is not None and not fix:
        # DI-engine's defect, reproduced: -dual_clip * adv for every sample
        w = torch.ones_like(rest[2]) if rest[3] is None else rest[3]
        assert out.policy_loss.item() == pytest.approx((-dual_clip * rest[2] * w).mean().item())
        again, _ = ding.ppo_policy_error_continuous(data, fix_dual_clip=fix, **kw)
        grads = torch.autograd.grad(again.policy_loss, [new["mu"], new["sigma"]])
        assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_ppo_error_continuous_value_loss_and_tensor_kl(device):
    gen = torch.Generator().manual_seed(8)
    new, old, action, adv, weight, _ = continuous_data(3, gen=gen, weight=True)
    f = lambda x: _to(x, torch.float32, device)
    value_new, value_old, ret = (f(torch.randn(5, generator=gen)) for _ in range(3))
    data = ding.ppo_data_continuous(f(new), f(old), f(action), value_new, value_old, f(adv),
                                    ret, f(weight), None)  # fmt: skip
    out, info = ding.ppo_error_continuous(data, dual_clip=2.0)
    policy, pinfo = ding.ppo_policy_error_continuous(
        ding.ppo_policy_data_continuous(f(new), f(old), f(action), f(adv), f(weight), None),
        dual_clip=2.0,
    )
    assert torch.equal(out.policy_loss, policy.policy_loss) and info == pinfo
    want_value = value_oracle(ding.ppo_value_data(value_new, value_old, ret, f(weight)))
    assert rel_err(out.value_loss, want_value) <= 1e-6
    assert isinstance(out.kl_div, torch.Tensor) and out.kl_div.item() == 0.0
    data_policy = ding.ppo_policy_data_continuous(f(new), f(old), f(action), f(adv), None, None)
    with pytest.raises(AssertionError):
        ding.ppo_policy_error_continuous(data_policy, dual_clip=1.0)
    bad = dict(f(new), sigma=-f(new)["sigma"])
    with pytest.raises(ValueError, match="sigma"):
        ding.ppo_policy_error_continuous(data_policy._replace(mu_sigma_new=bad))


# ----------------------------------------------------------------------------- GRPO


def grpo_data(*, gen, weight_kind="none", ref_equals_new=False, shape=(3, 5, 13)):
    logit_new = logits_case(shape, gen=gen)
    logit_old = logit_new + logits_case(shape, gen=gen, scale=0.5)
    logit_ref = logit_new.clone() if ref_equals_new else logits_case(shape, gen=gen)
    action = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    adv = torch.randn(shape[0], generator=gen, dtype=torch.float64)
    weight = None
    if weight_kind != "none":
        lengths = torch.tensor([shape[1], 2, 1])[: shape[0]]
        weight = (torch.arange(shape[1])[None] < lengths[:, None]).double()
        if weight_kind == "empty_row":
            weight[-1] = 0.0
    return logit_new, logit_old, logit_ref, action, adv, weight


@pytest.mark.parametrize(
    "weight_kind, beta, dtype",
    [(w, beta, torch.float32) for w in ("none", "padded") for beta in (0.0, 0.04, 0.1)]
    + [(w, 0.04, torch.bfloat16) for w in ("none", "padded")],
)
def test_grpo_policy_error_matches_original(weight_kind, beta, dtype, device):
    gen = seed_of(weight_kind, beta, dtype)
    raw = grpo_data(gen=gen, weight_kind=weight_kind)
    logit_new = leaf(raw[0], dtype, device)
    old, ref_l = raw[1].to(device, dtype), raw[2].to(device, dtype)
    weight = None if raw[5] is None else raw[5].float().to(device)
    data = ding.grpo_policy_data(logit_new, old, ref_l, raw[3].to(device),
                                 raw[4].float().to(device), weight)  # fmt: skip
    loss, info = ding.grpo_policy_error(data, log_prob_fn=None, clip_ratio=0.2, beta=beta)
    z64 = as_oracle(logit_new)
    data64 = ding.grpo_policy_data(z64, old.double(), ref_l.double(), raw[3].to(device),
                                   raw[4].to(device),
                                   None if weight is None else weight.double())  # fmt: skip
    want, want_info = grpo_oracle(data64, 0.2, beta)
    eager_err = 0.0
    if dtype != torch.float32:
        eager_leaf = logit_new.detach().clone().requires_grad_()
        eager, _ = grpo_oracle(data._replace(logit_new=eager_leaf), 0.2, beta)
        eager_err = rel_err(eager, want)
    assert loss.shape == () and rel_err(loss, want) <= tolerance(dtype, eager_err)
    assert isinstance(info.approx_kl, float) and isinstance(info.clipfrac, float)
    assert info.approx_kl == pytest.approx(want_info[0], rel=1e-2, abs=1e-3 if dtype !=
                                           torch.float32 else 1e-6)  # fmt: skip
    g = torch.randn((), generator=gen).item()
    (g * loss).backward()
    (g * want).backward()
    grad_tol = 1e-5
    if dtype != torch.float32:
        (g * eager).backward()
        grad_tol = tolerance(dtype, rel_err(eager_leaf.grad, z64.grad))
    assert rel_err(logit_new.grad, z64.grad) <= grad_tol


def test_grpo_quirks(device):
    gen = torch.Generator().manual_seed(9)
    raw = grpo_data(gen=gen, weight_kind="empty_row", ref_equals_new=True)
    f = lambda t: None if t is None else t.float().to(device)
    data = ding.grpo_policy_data(f(raw[0]), f(raw[1]), f(raw[2]), raw[3].to(device), f(raw[4]),
                                 f(raw[5]))  # fmt: skip
    loss, _ = ding.grpo_policy_error(data)
    assert torch.isnan(loss)  # an all-zero weight row: 0 / 0, no epsilon (as DI-engine)
    full = data._replace(weight=None)

    def ding_naive_method(*args):  # stands for DI-engine's own method object
        raise AssertionError("DI-engine's methods are replaced by the fused pass")

    ding_naive_method.__module__ = "ding.rl_utils.log_prob_utils"
    ding_naive_method.__name__ = "naive_method"
    # logit_ref == logit_new: the k3 term is exactly 0, whatever beta
    with_kl = ding.grpo_policy_error(full, log_prob_fn=ding_naive_method, beta=0.1)[0]
    assert torch.equal(with_kl, ding.grpo_policy_error(full, beta=0.0)[0])
    with pytest.raises(ValueError, match=r"\(B,\)"):
        ding.grpo_policy_error(full._replace(adv=full.adv[:, None]))


def test_grpo_attached_old_and_ref_get_gradient(device):
    gen = torch.Generator().manual_seed(10)
    raw = grpo_data(gen=gen, weight_kind="padded")
    base = leaf(raw[0], torch.float32, device)
    base64 = as_oracle(base)
    noise_old, noise_ref = (torch.randn(raw[0].shape, generator=gen, dtype=torch.float64)
                            .to(device) * 0.3 for _ in range(2))  # fmt: skip
    grads = []
    for root, fn, cast in ((base, ding.grpo_policy_error, torch.float32),
                           (base64, grpo_oracle, torch.float64)):  # fmt: skip
        data = ding.grpo_policy_data(root * 1.0, root + noise_old.to(cast),
                                     root + noise_ref.to(cast), raw[3].to(device),
                                     raw[4].to(device, cast), raw[5].to(device, cast))  # fmt: skip
        fn(data, beta=0.1)[0].backward()
        grads.append(root.grad)
    assert rel_err(grads[0], grads[1]) <= 1e-5


# ----------------------------------------------------------------------------- live-check rules


def test_module_exports_what_ding_spreads_over_three_paths():
    """DI-engine: ``ding.rl_utils`` (PPO), ``ding.rl_utils.ppo`` (``calculate_kl_div``),
    ``ding.rl_utils.grpo`` (GRPO and the three log-prob methods); here one module."""
    ppo = ["ppo_data", "ppo_data_continuous", "ppo_policy_data", "ppo_policy_data_continuous",
           "ppo_value_data", "ppo_loss", "ppo_policy_loss", "ppo_info", "ppo_error",
           "ppo_policy_error", "ppo_value_error", "ppo_error_continuous",
           "ppo_policy_error_continuous", "calculate_kl_div"]  # fmt: skip
    grpo = ["grpo_policy_data", "grpo_info", "grpo_policy_error", "efficient_method",
            "naive_method", "less_efficient_method"]  # fmt: skip
    assert set(ppo + grpo) <= set(ding.__all__)
    assert all(hasattr(ding, name) for name in ding.__all__)


@pytest.mark.parametrize("method", ["efficient_method", "naive_method", "less_efficient_method"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_log_prob_methods(method, dtype, device):
    """DI-engine's three methods compute the same log-probs, in the logits' dtype."""
    gen = torch.Generator().manual_seed(20)
    z = logits_case((2, 3, 17), gen=gen).to(device, dtype).requires_grad_()
    index = torch.randint(0, 17, (2, 3), generator=gen).to(device)
    got = getattr(ding, method)(z, index)
    z64 = as_oracle(z)
    want = torch.log_softmax(z64, -1).gather(-1, index[..., None])[..., 0]
    assert got.dtype == dtype and rel_err(got, want) <= tolerance(dtype)
    up = torch.randn(2, 3, generator=gen, dtype=torch.float64).to(device)
    got.backward(up.to(dtype))
    want.backward(up)
    assert rel_err(z.grad, z64.grad) <= tolerance(dtype)
    with pytest.raises(ValueError, match="index"):
        getattr(ding, method)(z, torch.full_like(index, 17))


def test_grpo_own_log_prob_fn_is_called(device):
    """A caller's own ``log_prob_fn`` is called as given (DI-engine's behaviour), the rest of
    the loss computed as DI-engine does."""
    gen = torch.Generator().manual_seed(21)
    raw = grpo_data(gen=gen, weight_kind="padded")
    calls = []

    def tempered(logits, index):
        calls.append(logits.shape)
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        return logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)

    f = lambda t: None if t is None else t.float().to(device)
    data = ding.grpo_policy_data(f(raw[0]), f(raw[1]), f(raw[2]), raw[3].to(device), f(raw[4]),
                                 f(raw[5]))  # fmt: skip
    loss, info = ding.grpo_policy_error(data, tempered, 0.2, 0.1)
    assert len(calls) == 3
    scaled = ding.grpo_policy_data(*(t / 0.7 if i < 3 else t for i, t in enumerate(raw)))
    want, want_info = grpo_oracle(scaled, 0.2, 0.1)
    assert rel_err(loss, want) <= 1e-5
    assert info.clipfrac == pytest.approx(want_info[1], abs=1e-6)


def test_grpo_beta_zero_gives_an_attached_ref_a_zero_gradient(device):
    """DI-engine adds ``0 * k3``: an attached ``logit_ref`` gets a zero gradient, not None
    (here without reading it)."""
    gen = torch.Generator().manual_seed(22)
    raw = grpo_data(gen=gen)
    ref = raw[2].float().to(device).requires_grad_()
    data = ding.grpo_policy_data(raw[0].float().to(device).requires_grad_(),
                                 raw[1].float().to(device), ref, raw[3].to(device),
                                 raw[4].float().to(device), None)  # fmt: skip
    loss, _ = ding.grpo_policy_error(data, beta=0.0)
    loss.backward()
    assert ref.grad is not None and torch.count_nonzero(ref.grad) == 0
    assert loss.dtype == torch.float32


def test_half_precision_original_is_di_engine_bit_for_bit(device):
    """``half_precision("original")``: bf16 inputs go through DI-engine's own arithmetic
    (``torch.distributions``, the chosen log-prob method): losses, the ``approx_kl`` /
    ``clipfrac`` floats and gradients equal the transcription's exactly."""
    import fused_rl.compat as compat

    gen = torch.Generator().manual_seed(23)
    bf = torch.bfloat16
    raw = policy_data((2, 3, 11), (2, 3), "mask", pretrained=True, gen=gen)
    cont = continuous_data(3, gen=gen, pretrained=True, weight=True)
    graw = grpo_data(gen=gen, weight_kind="padded")

    def discrete(impl, z):
        data = ding.ppo_policy_data(z, raw[1].to(device, bf), raw[2].to(device),
                                    raw[3].float().to(device), raw[4].float().to(device),
                                    raw[5].to(device, bf))  # fmt: skip
        return impl(data, dual_clip=2.0, kl_type="k3")

    def continuous(impl, mu):
        new = {"mu": mu, "sigma": cont[0]["sigma"].to(device, bf)}
        rest = [_to(x, bf, device) for x in cont[1:]]
        return impl(ding.ppo_policy_data_continuous(new, *rest), dual_clip=3.0, kl_type="k2")

    def grpo(impl, z):
        data = ding.grpo_policy_data(z, graw[1].to(device, bf), graw[2].to(device, bf),
                                     graw[3].to(device), graw[4].float().to(device),
                                     graw[5].float().to(device))  # fmt: skip
        return impl(data, clip_ratio=0.2, beta=0.1)

    cases = [
        (discrete, ding.ppo_policy_error, policy_oracle, raw[0].to(device, bf)),
        (continuous, ding.ppo_policy_error_continuous, continuous_oracle,
         cont[0]["mu"].to(device, bf)),
        (grpo, ding.grpo_policy_error, grpo_oracle, graw[0].to(device, bf)),
    ]  # fmt: skip
    for build, fused, oracle, x in cases:
        a, b = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with compat.half_precision("original"):
            got, got_info = build(fused, a)
        want, want_info = build(oracle, b)
        got = [got] if torch.is_tensor(got) else list(got)
        want = [want] if torch.is_tensor(want) else list(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)
        assert tuple(got_info) == tuple(want_info)
        sum(g for g in got if g.requires_grad).backward()
        sum(w for w in want if w.requires_grad).backward()
        assert torch.equal(a.grad, b.grad)


def test_sigma_check_in_both_modes():
    import fused_rl.compat as compat

    ms = {"mu": torch.zeros(3, 2, dtype=torch.bfloat16),
          "sigma": -torch.ones(3, 2, dtype=torch.bfloat16)}  # fmt: skip
    data = ding.ppo_policy_data_continuous(ms, ms, torch.zeros(3, 2), torch.ones(3), None, None)
    for mode in ("accurate", "original"):
        with compat.half_precision(mode), pytest.raises(ValueError, match="sigma"):
            ding.ppo_policy_error_continuous(data)


def test_continuous_ratio_is_not_averaged():
    """DI-engine's continuous errors never average the ratio over dim 1 (only the discrete
    one does): an adv that does not broadcast against the ratio fails as there."""
    mu = torch.zeros(4, 2, 3)
    ms = {"mu": mu, "sigma": torch.ones(4, 2, 3)}
    data = ding.ppo_policy_data_continuous(ms, ms, torch.zeros(4, 2, 3), torch.ones(3), None,
                                           None)  # fmt: skip
    with pytest.raises(RuntimeError):
        ding.ppo_policy_error_continuous(data)


# ----------------------------------------------------------------------------- DI-engine 0.5.3


def test_v053_layout():
    """DI-engine 0.5.3 (the release on PyPI): 8- / 5-field data, 3- / 2-field losses, no
    kl_type / entropy_bonus, no defaults; ppo_value_data / ppo_info unchanged."""
    import inspect

    from fused_rl.compat import ding_v053 as v053

    assert v053.ppo_data._fields == ("logit_new", "logit_old", "action", "value_new",
                                     "value_old", "adv", "return_", "weight")  # fmt: skip
    assert v053.ppo_data_continuous._fields[:2] == ("mu_sigma_new", "mu_sigma_old")
    assert len(v053.ppo_data_continuous._fields) == 8
    assert v053.ppo_policy_data._fields == ("logit_new", "logit_old", "action", "adv", "weight")
    assert v053.ppo_policy_data_continuous._fields == ("mu_sigma_new", "mu_sigma_old",
                                                       "action", "adv", "weight")  # fmt: skip
    assert v053.ppo_loss._fields == ("policy_loss", "value_loss", "entropy_loss")
    assert v053.ppo_policy_loss._fields == ("policy_loss", "entropy_loss")
    assert v053.ppo_value_data is ding.ppo_value_data and v053.ppo_info is ding.ppo_info
    for nt in (v053.ppo_data, v053.ppo_data_continuous, v053.ppo_policy_data,
               v053.ppo_policy_data_continuous):  # fmt: skip
        assert nt._field_defaults == {}
    params = lambda fn: list(inspect.signature(fn).parameters)
    assert params(v053.ppo_policy_error) == ["data", "clip_ratio", "dual_clip"]
    assert params(v053.ppo_error) == ["data", "clip_ratio", "use_value_clip", "dual_clip"]
    assert params(v053.ppo_error_continuous)[:4] == params(v053.ppo_error)
    assert not hasattr(v053, "calculate_kl_div") and not hasattr(v053, "grpo_policy_error")


def test_v053_equals_main_without_pretrained(device):
    from fused_rl.compat import ding_v053 as v053

    gen = torch.Generator().manual_seed(24)
    z, z_old, action, adv, weight, _ = policy_data((2, 4, 9), (2, 4), "mask", pretrained=False,
                                                   gen=gen)  # fmt: skip
    f = lambda t: t.float().to(device)
    value = [f(torch.randn(2, 4, generator=gen)) for _ in range(3)]
    args = (f(z), f(z_old), action.to(device))
    old, old_info = v053.ppo_error(v053.ppo_data(*args, value[0], value[1], f(adv), value[2],
                                                 f(weight)), dual_clip=2.0)  # fmt: skip
    new, new_info = ding.ppo_error(ding.ppo_data(*args, value[0], value[1], f(adv), value[2],
                                                 f(weight), None), dual_clip=2.0)  # fmt: skip
    assert len(old) == 3 and old_info == new_info
    assert all(torch.equal(a, b) for a, b in zip(old, new[:3]))
    pol, _ = v053.ppo_policy_error(v053.ppo_policy_data(*args, f(adv), None))
    main_pol, _ = ding.ppo_policy_error(ding.ppo_policy_data(*args, f(adv), None, None))
    assert len(pol) == 2 and torch.equal(pol.entropy_loss, main_pol.entropy_loss)
    with pytest.raises(ValueError):  # a main-layout 6-tuple does not unpack, as in 0.5.3
        v053.ppo_policy_error(ding.ppo_policy_data(*args, f(adv), None, None))
    new_c, old_c, act, adv_c, w_c, _ = continuous_data(2, gen=gen, weight=True)
    fields = (new_c, old_c, act, adv_c, adv_c, adv_c, adv_c, w_c)  # values: any (B,) tensors
    cdata = v053.ppo_data_continuous(*(_to(x, torch.float32, device) for x in fields))
    out, _ = v053.ppo_error_continuous(cdata, dual_clip=2.0, fix_dual_clip=True)
    assert out._fields == ("policy_loss", "value_loss", "entropy_loss")
    pdata = v053.ppo_policy_data_continuous(*cdata[:3], cdata.adv, cdata.weight)
    assert torch.equal(v053.ppo_policy_error_continuous(pdata)[0].policy_loss,
                       v053.ppo_error_continuous(cdata)[0].policy_loss)  # fmt: skip


def test_v053_docstring_examples():
    import doctest

    from fused_rl.compat import ding_v053

    result = doctest.testmod(ding_v053, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- backends / originals


def test_reference_backend_path_agrees(monkeypatch):
    """With the Triton interpreter off, ``auto`` runs fused_rl's references: same results."""
    gen = torch.Generator().manual_seed(11)
    raw = policy_data((2, 3, 11), (2, 3), "mask", pretrained=True, gen=gen, negative_adv=True)
    data = ding.ppo_policy_data(*(t.float() if t.is_floating_point() else t for t in raw))
    triton_out, triton_info = ding.ppo_policy_error(data, dual_clip=2.0, kl_type="k3")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_out, ref_info = ding.ppo_policy_error(data, dual_clip=2.0, kl_type="k3")
    for a, b in zip(triton_out, ref_out):
        assert rel_err(a, b) <= 1e-5
    assert triton_info.clipfrac == ref_info.clipfrac


def test_against_installed_di_engine(device):
    """Against the real DI-engine (the live check's venv): 0.5.3, the release on PyPI, has
    the 5-field ``ppo_policy_data`` of :mod:`fused_rl.compat.ding_v053`; main has
    ``fused_rl.compat.ding``'s 6 fields (and ``ding.rl_utils.grpo``)."""
    rl_utils = pytest.importorskip("ding.rl_utils")
    from fused_rl.compat import ding_v053

    gen = torch.Generator().manual_seed(12)
    raw = policy_data((2, 3, 11), (2, 3), "mask", pretrained=True, gen=gen, negative_adv=True)
    data = ding.ppo_policy_data(*(t.float().to(device) if t.is_floating_point() else
                                  t.to(device) for t in raw))  # fmt: skip
    if len(rl_utils.ppo_policy_data._fields) == 5:  # DI-engine 0.5.3
        out, info = ding_v053.ppo_policy_error(ding_v053.ppo_policy_data(*data[:5]), dual_clip=2.0)
        want, want_info = rl_utils.ppo_policy_error(rl_utils.ppo_policy_data(*data[:5]),
                                                    dual_clip=2.0)  # fmt: skip
        assert out._fields == want._fields
    else:
        out, info = ding.ppo_policy_error(data, dual_clip=2.0, kl_type="k3")
        want, want_info = rl_utils.ppo_policy_error(
            rl_utils.ppo_policy_data(*data), dual_clip=2.0, kl_type="k3"
        )
    for a, b in zip(out, want):
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-5
    assert math.isclose(info.clipfrac, want_info.clipfrac, abs_tol=1e-6)
    assert math.isclose(info.approx_kl, want_info.approx_kl, rel_tol=1e-4, abs_tol=1e-6)
