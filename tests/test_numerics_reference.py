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
from helpers import FP32_TOL, assert_rel

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
    return logits.to(dtype), targets


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
    g, h = torch.randn(2, len(targets), generator=gen, dtype=torch.float64).to(dtype)
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
    monkeypatch.setattr(module, "token_entropy", entropy)
    logits, targets = _special_logits(5, torch.float32)
    zeros = torch.zeros(len(targets))
    _, o_ent, _ = oracle_logprob_stats(logits, targets, zeros, zeros)
    out = module.entropy_from_logits(logits.reshape(2, 5, 5))
    assert out.dtype == torch.float32
    assert_same_nonfinite(out.reshape(-1), o_ent, FP32_TOL, f"{module.__name__}")


# ----------------------------------------------------------------------------- reductions

REDUCTIONS = {  # name: (call, float64 oracle: plain torch with the padding selected away)
    "sum": (lambda x, m, b: fused_rl.masked_sum(x, m, backend=b), lambda x, w: _o_sum(x, w)),
    "sum_dim1": (
        lambda x, m, b: fused_rl.masked_sum(x, m, 1, backend=b),
        lambda x, w: _o_sum(x, w, 1),
    ),
    "mean_dim0": (
        lambda x, m, b: fused_rl.masked_mean(x, m, 0, backend=b),
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
