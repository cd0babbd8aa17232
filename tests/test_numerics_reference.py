"""Non-finite inputs (issue 11): NaN in means NaN out, both backends agree exactly on WHICH
outputs are NaN / inf, masked-out positions never matter, and everything else matches a
float64 oracle written here.

``assert_same_nonfinite`` is the check: identical NaN, +inf and -inf masks, the finite rest
within tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE
from helpers import FP32_TOL, assert_rel, seed_gae_loop

import fused_rl
from fused_rl.compat import trl, verl

BACKENDS = ("reference", "triton")
INF, NAN = float("inf"), float("nan")


def assert_same_nonfinite(out, ref, tol, what=""):
    """``out`` is NaN / +inf / -inf exactly where ``ref`` is; the finite rest within ``tol``."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(out), test(ref)), f"{what}: {name} at {test(out)} != {test(ref)}"
    finite = torch.isfinite(ref)
    if finite.any():
        assert_rel(out[finite], ref[finite], tol, what)


# ----------------------------------------------------------------------------- log-probs

# one row each; the target is column 0 unless given
SPECIAL_ROWS = {
    "nan_at_target": ([NAN, 1, 2, 3, 4], 0),
    "nan_elsewhere": ([0, NAN, 2, 3, 4], 0),
    "pos_inf_at_target": ([INF, 1, 2, 3, 4], 0),
    "pos_inf_elsewhere": ([0, INF, 2, 3, 4], 0),
    "all_neg_inf": ([-INF] * 5, 0),
    "neg_inf_and_nan": ([-INF, NAN, -INF, -INF, -INF], 0),
    "some_neg_inf": ([-INF, 1, -INF, 3, 4], 1),  # finite: p = 0 entries contribute 0
    "some_neg_inf_at_target": ([-INF, 1, -INF, 3, 4], 0),  # logp = -inf, the rest finite
    "one_finite": ([-INF, 2, -INF, -INF, -INF], 1),  # a point mass: logp = H = 0
    "finite": ([0.5, 1, -2, 3, 4], 3),
}


def _special_logits(vocab, dtype):
    """``(rows, vocab)`` logits with the rows above in columns ``vocab - 5 ...`` (a second
    vocab block of the kernel when ``vocab > 4096``) and random finite logits before them
    (-inf in the rows that have -inf entries)."""
    gen = torch.Generator().manual_seed(0)
    rows = list(SPECIAL_ROWS.values())
    logits = torch.randn(len(rows), vocab, generator=gen, dtype=torch.float64)
    targets = torch.tensor([vocab - 5 + t for _, t in rows])
    special = torch.tensor([r for r, _ in rows], dtype=torch.float64)
    logits[:, -5:] = special
    # a row with -inf entries has -inf before them too (all -inf stays all -inf)
    logits[torch.isneginf(special).any(-1), :-5] = -INF
    return logits.to(DEVICE, dtype), targets.to(DEVICE)


def oracle_logprob_stats(logits, targets, g, h):
    """float64 ``(logp, entropy, dL/dlogits)`` for ``L = sum(g logp + h H)``, in closed form
    (autograd of ``log_softmax`` turns the ``0 * -inf`` of a p = 0 entry into NaN):
    ``dlogp_y/dz_j = 1[j = y] - p_j``, ``dH/dz_j = -p_j (log p_j + H)``, p = 0 terms are 0.
    A NaN / +inf logit or an all -inf row makes ``log_softmax`` NaN, so all of it is NaN."""
    z = torch.log_softmax(logits.double(), dim=-1)
    p = z.exp()
    entropy = -torch.where(p == 0, 0.0, p * z).sum(-1)
    logp = z.gather(-1, targets[:, None])[:, 0]
    onehot = torch.nn.functional.one_hot(targets, logits.shape[-1]).double()
    dh = -torch.where(p == 0, 0.0, p * (z + entropy[:, None]))
    grad = g.double()[:, None] * (onehot - p) + h.double()[:, None] * dh
    return logp, entropy, grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [5, 4101], ids=["one_block", "two_blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_nonfinite_rows(backend, vocab, dtype):
    """NaN / +inf logits and all -inf rows give NaN logp, entropy and gradient row on both
    backends (the reference's entropy used to drop the NaN: 0); some -inf entries give
    finite results (a -inf target: logp = -inf)."""
    logits, targets = _special_logits(vocab, dtype)
    gen = torch.Generator().manual_seed(1)
    g, h = torch.randn(2, len(targets), generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    o_lp, o_ent, o_grad = oracle_logprob_stats(logits, targets, g, h)
    tol = FP32_TOL if dtype == torch.float32 else 1e-12
    x = logits.clone().requires_grad_(True)
    lp, ent = fused_rl.token_logprobs(x, targets, return_entropy=True, backend=backend)
    (grad,) = torch.autograd.grad((lp * g).sum() + (ent * h).sum(), x)
    assert_same_nonfinite(lp, o_lp, tol, "logp")
    assert_same_nonfinite(ent, o_ent, tol, "entropy")
    assert_same_nonfinite(grad, o_grad, tol, "grad")
    # each output alone: the entropy's backward has no logp term to carry a NaN p
    x = logits.clone().requires_grad_(True)
    ent_only = fused_rl.token_entropy(x, backend=backend)
    (grad_h,) = torch.autograd.grad((ent_only * h).sum(), x)
    _, _, o_grad_h = oracle_logprob_stats(logits, targets, torch.zeros_like(g), h)
    assert_same_nonfinite(ent_only, o_ent, tol, "token_entropy")
    assert_same_nonfinite(grad_h, o_grad_h, tol, "token_entropy grad")
    x = logits.clone().requires_grad_(True)
    lp_only = fused_rl.token_logprobs(x, targets, backend=backend)
    (grad_g,) = torch.autograd.grad((lp_only * g).sum(), x)
    _, _, o_grad_g = oracle_logprob_stats(logits, targets, g, torch.zeros_like(h))
    assert_same_nonfinite(grad_g, o_grad_g, tol, "token_logprobs grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("module", [trl, verl], ids=["trl", "verl"])
def test_compat_entropy_from_logits_nonfinite(backend, module, monkeypatch):
    """TRL's / verl's ``entropy_from_logits`` reach the same entropy: NaN rows stay NaN."""
    entropy = functools.partial(fused_rl.token_entropy, backend=backend)
    # the module whose entropy_from_logits looks token_entropy up (verl's: torch_functional)
    monkeypatch.setattr(getattr(module, "torch_functional", module), "token_entropy", entropy)
    logits, targets = _special_logits(5, torch.float32)
    zeros = torch.zeros(len(targets), device=DEVICE)
    _, o_ent, _ = oracle_logprob_stats(logits, targets, zeros, zeros)
    out = module.entropy_from_logits(logits.reshape(2, 5, 5))
    assert out.dtype == torch.float32
    assert_same_nonfinite(out.reshape(-1), o_ent, FP32_TOL, f"{module.__name__}")


# ----------------------------------------------------------------------------- reductions

REDUCTIONS = {  # name: (call, float64 oracle: plain torch with the padding selected away)
    "sum": (lambda x, m, b: fused_rl.masked_sum(x, m, backend=b), lambda x, w: _o_sum(x, w)),
    "sum_dim1": (
        lambda x, m, b: fused_rl.masked_sum(x, m, dim=1, backend=b),
        lambda x, w: _o_sum(x, w, 1),
    ),
    "mean_dim0": (
        lambda x, m, b: fused_rl.masked_mean(x, m, dim=0, backend=b),
        lambda x, w: _o_sum(x, w, 0) / w.sum(0),
    ),
    "var": (lambda x, m, b: fused_rl.masked_var(x, m, backend=b), lambda x, w: _o_var(x, w)),
    "whiten": (
        lambda x, m, b: fused_rl.masked_whiten(x, m, eps=0.25, backend=b),
        lambda x, w: _o_whiten(x, w, False),
    ),
    "whiten_keep_mean": (
        lambda x, m, b: fused_rl.masked_whiten(x, m, keep_mean=True, eps=0.25, backend=b),
        lambda x, w: _o_whiten(x, w, True),
    ),
}


def _o_sum(x, w, dim=None):
    terms = torch.where(w != 0, w * x, 0.0)
    return terms.sum() if dim is None else terms.sum(dim)


def _o_var(x, w):
    n = w.sum()
    dev = torch.where(w != 0, x, 0.0) - _o_sum(x, w) / n
    return _o_sum(dev * dev, w) / (n - 1)


def _o_whiten(x, w, keep_mean):
    mean = _o_sum(x, w) / w.sum()
    y = (x - mean) / torch.sqrt(_o_var(x, w) + 0.25)
    return y + mean if keep_mean else y


# (where, value, weights): a poisoned position, masked out (0, 2) or counted (1, 4)
POISONS = {
    "nan_padding": ((0, 2), NAN, False),
    "inf_padding": ((0, 2), INF, False),
    "neg_inf_padding": ((0, 2), -INF, False),
    "nan_padding_weights": ((0, 2), NAN, True),
    "nan_counted": ((1, 4), NAN, False),
    "inf_counted": ((1, 4), INF, False),
}


def _poisoned(case):
    where, value, weights = POISONS[case]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 2] = mask[2, 0] = mask[2, 5] = False
    if weights:
        mask = torch.rand(3, 6, generator=gen, dtype=torch.float64) * mask
    x, mask = x.to(DEVICE), mask.to(DEVICE)
    clean = x.clone()
    x[where] = value
    return x, clean, mask, mask[where] == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(REDUCTIONS))
@pytest.mark.parametrize("case", list(POISONS))
def test_reductions_nonfinite(backend, op, case):
    """NaN / inf where the mask is 0 changes no statistic and no gradient (whiten transforms
    that position itself, and its gradient ignores it when its upstream gradient is 0, as
    for padding zeroed downstream; it used to make every gradient NaN); a counted NaN / inf
    propagates as in float64 autograd of plain PyTorch."""
    call, oracle = REDUCTIONS[op]
    x, clean, mask, padding = _poisoned(case)
    w = mask.double()
    x_in = x.clone().requires_grad_(True)
    out = call(x_in, mask, backend)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    gy = gy.to(DEVICE)
    if op.startswith("whiten"):
        gy = gy * (w != 0)  # the padding's outputs are zeroed downstream
    (grad,) = torch.autograd.grad(out, x_in, gy)
    assert_same_nonfinite(out, oracle(x, w), 1e-12, f"{op} value")
    # a padding position with a zero upstream gradient cannot change the gradient: the
    # oracle differentiates the clean copy (its plain autograd would add 0 * NaN)
    x_o = (clean if padding else x).clone().requires_grad_(True)
    (o_grad,) = torch.autograd.grad(oracle(x_o, w), x_o, gy)
    assert_same_nonfinite(grad, o_grad, 1e-12, f"{op} grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("keep_mean", [False, True])
def test_whiten_nan_padding_with_upstream_gradient(backend, keep_mean):
    """A gradient fed into a NaN output (masked or not) is NaN in, NaN out: every counted
    position's gradient goes through the variance, which that output depends on. The
    masked position's own gradient is ``gy * rsqrt(var + eps)``, finite."""
    x, _, mask, _ = _poisoned("nan_padding")
    x_in = x.clone().requires_grad_(True)
    y = fused_rl.masked_whiten(x_in, mask, keep_mean=keep_mean, eps=0.25, backend=backend)
    (grad,) = torch.autograd.grad(y, x_in, torch.ones_like(y))
    assert torch.isnan(grad[mask]).all() and torch.isfinite(grad[~mask]).all()


# ----------------------------------------------------------------------------- advantages


def o_gae(rewards, values, gamma, lam, mask=None):
    """float64 seed loop (the recurrence, step by step) with masked steps as zero reward and
    zero value, and zero outputs there."""
    r, v = rewards.double(), values.double()
    if mask is not None:
        r, v = torch.where(mask, r, 0.0), torch.where(mask, v, 0.0)
    adv, ret = seed_gae_loop(r, v, gamma, lam)
    if mask is not None:
        adv, ret = torch.where(mask, adv, 0.0), torch.where(mask, ret, 0.0)
    return adv, ret


# (tensor, step, value, gamma, lam, masked)
GAE_CASES = {
    "inf_reward": ("rewards", 10, INF, 0.99, 0.95, False),
    "neg_inf_reward": ("rewards", 10, -INF, 0.99, 0.95, False),
    "nan_reward": ("rewards", 10, NAN, 0.99, 0.95, False),
    "inf_value": ("values", 10, INF, 0.99, 0.95, False),
    "inf_reward_no_discount": ("rewards", 10, INF, 1.0, 1.0, False),
    "inf_reward_decay_0": ("rewards", 10, INF, 0.9, 0.0, False),  # 0 * inf in the loop: NaN
    "inf_reward_masked_out": ("rewards", 10, INF, 0.99, 0.95, True),
    "nan_value_masked_out": ("values", 10, NAN, 0.99, 0.95, True),
    "inf_reward_counted_with_mask": ("rewards", 12, INF, 0.99, 0.95, True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(GAE_CASES))
def test_gae_nonfinite(backend, case):
    """A NaN / inf at step s reaches the advantages at steps t <= s only, as in the recurrence
    (the reference's blocked matmul used to spread it to every later step: 0 * inf); masked-out
    steps reach nothing."""
    tensor, step, value, gamma, lam, masked = GAE_CASES[case]
    gen = torch.Generator().manual_seed(4)
    rewards, values = torch.randn(2, 2, 40, generator=gen).to(DEVICE)
    mask = torch.ones(2, 40, dtype=torch.bool, device=DEVICE)
    mask[:, 10] = mask[1, 30:] = False
    {"rewards": rewards, "values": values}[tensor][0, step] = value
    mask = mask if masked else None
    adv, ret = fused_rl.gae(rewards, values, gamma=gamma, lam=lam, mask=mask, backend=backend)
    o_adv, o_ret = o_gae(rewards, values, gamma, lam, mask)
    assert_same_nonfinite(adv, o_adv, FP32_TOL, "advantages")
    assert_same_nonfinite(ret, o_ret, FP32_TOL, "returns")
    assert torch.isfinite(adv[:, step + 1 :]).all() and torch.isfinite(adv[1]).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gae_inf_beyond_fp32_decay_range(backend):
    """``c^(s - t)`` underflows to 0 in fp32 for ``c = 0.5`` past ~150 steps; the recurrence
    still carries ``c * inf = inf`` to every earlier step (T = 1300: a second kernel block
    of 276 steps, whose carry is the inf)."""
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(2, 1, 1300, generator=gen).to(DEVICE)
    rewards[0, 1290] = INF
    adv, ret = fused_rl.gae(rewards, values, gamma=0.5, lam=1.0, backend=backend)
    o_adv, o_ret = o_gae(rewards, values, 0.5, 1.0)
    assert_same_nonfinite(adv, o_adv, FP32_TOL, "advantages")
    assert_same_nonfinite(ret, o_ret, FP32_TOL, "returns")


def o_group(scores, group_size, mode, eps=1e-6):
    g = scores.double().reshape(-1, group_size)
    c = g - g.mean(1, keepdim=True)
    if mode == "std":
        c = c / (g.std(1, keepdim=True) + eps)
    elif mode == "rloo":
        c = c * group_size / (group_size - 1)
    return c.reshape(-1)


def _group_call(mode):
    if mode == "rloo":
        return lambda s, n, b: fused_rl.rloo_advantages(s, group_size=n, backend=b)
    return lambda s, n, b: fused_rl.group_advantages(s, group_size=n, normalize=mode, backend=b)


@pytest.mark.parametrize("mode", ["std", "none", "rloo"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "neg_inf"])
@pytest.mark.parametrize("pos", [0, 2], ids=["first", "inside"])
def test_group_advantages_nonfinite(mode, value, pos):
    """A NaN / inf score makes its own group non-finite, the first score (the kernel's
    shift) or not, identically on both backends; other groups are untouched. (Both centre on
    the first score, so with an inf first every entry is ``(s - inf) - NaN = NaN`` where the
    plain formula gives -inf: the same positions are non-finite.)"""
    scores = torch.randn(12, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    scores[4 + pos] = value
    ref, tri = (_group_call(mode)(scores, 4, b) for b in ("reference", "triton"))
    assert_same_nonfinite(tri, ref, FP32_TOL, f"{mode}: triton vs reference")
    expected = o_group(scores, 4, mode)
    assert torch.equal(torch.isfinite(ref), torch.isfinite(expected))
    assert_rel(ref[:4], expected[:4], FP32_TOL, mode)
    assert not torch.isfinite(ref[4:8]).any() and torch.isfinite(ref[8:]).all()


def o_kl_rewards(scores, logp, ref, coef, mask):
    """float64 k1 rewards: ``-coef * (logp - ref)`` at counted steps, 0 elsewhere, plus the
    score at the last counted step."""
    reward = torch.where(mask, -coef * (logp.double() - ref.double()), 0.0)
    steps = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask, steps, -1).amax(1)
    hit = steps[None, :] == last[:, None]
    return torch.where(hit, reward + scores.double()[:, None], reward)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", ["logprobs", "ref_logprobs", "scores"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("counted", [True, False], ids=["counted", "masked_out"])
def test_kl_penalized_rewards_nonfinite(backend, target, value, counted):
    """A NaN / inf log-prob reaches its own step when counted and nothing when masked out; a
    NaN / inf score reaches the step it lands on."""
    gen = torch.Generator().manual_seed(7)
    logp, ref = torch.randn(2, 3, 6, generator=gen).to(DEVICE) - 1.0
    scores = torch.randn(3, generator=gen).to(DEVICE)
    mask = torch.ones(3, 6, dtype=torch.bool, device=DEVICE)
    mask[0, 2] = mask[1, 4:] = False
    step = (0, 3) if counted else (0, 2)
    if target == "scores":
        scores[0] = value
    else:
        {"logprobs": logp, "ref_logprobs": ref}[target][step] = value
    out = fused_rl.kl_penalized_rewards(scores, logp, ref, kl_coef=0.1, mask=mask, backend=backend)
    expected = o_kl_rewards(scores, logp, ref, 0.1, mask)
    assert_same_nonfinite(out, expected, FP32_TOL, "rewards")
    assert torch.isfinite(out[1:]).all()
