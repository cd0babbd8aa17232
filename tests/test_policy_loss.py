"""Tests for ``fused_rl.policy_loss`` / ``fused_rl.policy_loss_from_logprobs``.

Both backends (the Triton kernels, through the interpreter on CPU, and the reference) are
compared with the independent float64 oracle in ``policy_oracle.py`` on the loss, every
metric and the gradient w.r.t. the logits under a random upstream gradient. Old log-probs
are built from the true log-probs and a chosen set of ratios that keeps every token clear
of the clip bounds, ``delta`` and the dual-clip cap (no tie can flip between fp32 and fp64).
"""

from __future__ import annotations

import pytest
import torch
from helpers import FP32_TOL, assert_rel, bf16_tol, gradcheck
from policy_oracle import oracle_policy_loss

import fused_rl
from fused_rl import policy_loss, policy_loss_from_logprobs, token_logprobs
from fused_rl._agg import LOSS_AGG_MODES
from fused_rl.reference.kl import KL_KINDS  # every estimator, so a new one is tested

BACKENDS = ("triton", "reference")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# ratios clear of 1 - eps in {0.8, 0.9, 1}, 1 + eps in {1.2, 1.28, 1.3}, delta 2, dual clip 3
SAFE_RATIOS = (0.4, 0.6, 0.75, 0.87, 0.95, 1.05, 1.15, 1.24, 1.4, 1.7, 2.5, 3.6, 5.0)
# ref - logp offsets; 3.0 pushes low_var_kl past its clamp at 10
REF_OFFSETS = (-2.5, -0.5, 0.3, 1.5, 3.0)
METRICS = (
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "dual_clip_frac",
    "ratio_mean",
    "ratio_max",
    "approx_kl",
)


# ----------------------------------------------------------------------------- inputs


def _pick(values, shape, gen):
    idx = torch.randint(0, len(values), shape, generator=gen)
    return torch.tensor(values, dtype=torch.float64)[idx]


def make_inputs(
    B=3,
    T=5,
    V=37,
    *,
    device="cpu",
    dtype=torch.float32,
    seed=0,
    adv="seq",
    old="design",
    ref=None,
    mask="bool",
    empty_row=True,
    ignored=True,
    ignore_index=-100,
    temperature=1.0,
):
    """Logits, targets, advantages and the ``(B, T)`` keyword tensors of one test case.

    ``adv``: "seq" (B,) mixed signs, "token" (B, T) mixed, "neg" / "pos" (B,) one sign.
    ``old``: None (on-policy), "design" (per-token SAFE_RATIOS), "gspo" (per-sequence
    SAFE_RATIOS with zero-mean token noise), "far" (log-ratio +-30).
    ``ref``: None, "design" (REF_OFFSETS), "far" (+-30), "huge" (+-100).
    ``mask``: None, "bool" or "float"; ``empty_row`` masks sequence 1 out entirely.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    if ignored and T > 1:
        targets[0, -1] = ignore_index
        targets[-1, 0] = ignore_index
    counted = targets != ignore_index

    m = torch.ones(B, T, dtype=torch.bool)
    if mask is not None:
        m = torch.rand(B, T, generator=gen) > 0.25
        m[:, 0] = True  # at least one token per sequence, except the emptied one
        if empty_row and B > 1:
            m[1] = False
    mc = (m & counted).double()

    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = lp.gather(-1, torch.where(counted, targets, 0)[..., None])[..., 0]

    a = torch.rand(B, generator=gen, dtype=torch.float64) + 0.5
    sign = torch.where(torch.arange(B) % 2 == 0, 1.0, -1.0).double()
    advantages = {
        "seq": a * sign,
        "token": torch.randn(B, T, generator=gen, dtype=torch.float64),
        "neg": -a,
        "pos": a,
    }[adv].float()

    old_lp = None
    if old == "design":
        old_lp = logp - _pick(SAFE_RATIOS, (B, T), gen).log()
    elif old == "gspo":
        noise = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
        noise -= ((noise * mc).sum(1) / mc.sum(1).clamp(min=1))[:, None]
        old_lp = logp - (_pick(SAFE_RATIOS, (B, 1), gen).log() + noise)
    elif old == "far":
        old_lp = logp + _pick((-30.0, 30.0), (B, T), gen)
    ref_lp = None
    if ref == "design":
        ref_lp = logp + _pick(REF_OFFSETS, (B, T), gen)
    elif ref in ("far", "huge"):
        # "huge": exp(100) overflows fp32, only a clamped estimator survives it
        far = 30.0 if ref == "far" else 100.0
        ref_lp = logp + _pick((-far, far), (B, T), gen)

    kw = {}
    if old_lp is not None:
        kw["old_logprobs"] = old_lp.float().to(device)
    if ref_lp is not None:
        kw["ref_logprobs"] = ref_lp.float().to(device)
    if mask is not None:
        kw["mask"] = (m if mask == "bool" else m.float()).to(device)
    if ignore_index != -100:
        kw["ignore_index"] = ignore_index
    if temperature != 1.0:
        kw["temperature"] = temperature
    return logits.to(device), targets.to(device), advantages.to(device), kw


# ----------------------------------------------------------------------------- checks


def _run(fn, base, targets, adv, upstream, view=lambda x: x, **kw):
    """``fn(view(leaf), ...)`` and ``d(loss * upstream) / d leaf`` with ``leaf = base``."""
    leaf = base.detach().clone().requires_grad_(True)
    loss, metrics = fn(view(leaf), targets, adv, **kw)
    (grad,) = torch.autograd.grad(loss * upstream, leaf)
    return loss.detach(), metrics, grad


def _check_parity(backend, logits, targets, adv, *, view=lambda x: x, tol=FP32_TOL, **kw):
    """Loss, every metric and the logits gradient against the float64 oracle.

    Returns the fused ``(loss, metrics, grad)`` for extra checks."""
    upstream = 0.5 + 2 * torch.rand((), generator=torch.Generator().manual_seed(11)).item()
    loss, metrics, grad = _run(
        policy_loss, logits, targets, adv, upstream, view, backend=backend, **kw
    )
    o_loss, o_metrics, o_grad = _run(
        oracle_policy_loss, logits.double(), targets, adv, upstream, view, **kw
    )
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert_rel(loss, o_loss, tol, f"{backend} loss")
    assert_rel(grad, o_grad, tol, f"{backend} grad")
    assert set(metrics) == set(o_metrics), (sorted(metrics), sorted(o_metrics))
    for name, value in metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32, name
        assert not value.requires_grad, name
        assert_rel(value, o_metrics[name], tol, f"{backend} metric {name}")
    return loss, metrics, grad


# ----------------------------------------------------------------------------- parity


def _case(make=None, **loss_kw):
    name = "-".join(f"{k}={v}" for k, v in {**(make or {}), **loss_kw}.items()) or "default"
    return pytest.param(make or {}, loss_kw, id=name)


CASES = [
    *(_case(loss_agg=agg, eps_high=0.28, entropy_coef=0.01) for agg in AGGS),
    _case(loss_agg="seq-mean-token-sum-norm", max_length=8),
    _case(dict(mask="float"), loss_agg="seq-mean-token-mean"),
    _case(dict(mask=None, empty_row=False), loss_agg="token-mean"),
    _case(dict(old=None)),
    _case(dict(old=None, adv="token"), loss_agg="seq-mean-token-mean", entropy_coef=0.01),
    _case(dict(adv="token"), loss_agg="seq-mean-token-sum"),
    _case(eps_low=0.1, eps_high=0.3),
    _case(eps_low=0.1),
    _case(eps_low=0.0, eps_high=0.28),
    _case(dict(adv="neg"), dual_clip=3.0),
    _case(dict(adv="token", seed=1), dual_clip=3.0, eps_high=0.28),
    _case(dict(adv="pos"), delta=2.0),
    _case(dict(adv="token", seed=2), delta=2.0, dual_clip=3.0, eps_low=0.1, eps_high=0.28),
    *(
        _case(dict(ref="design"), kl_estimator=k, beta=b)
        for k in KL_KINDS
        if k != "full"
        for b in (0.0, 0.04)
    ),  # full: test_full_kl.py
    _case(dict(old=None, ref="design"), beta=0.04, kl_estimator="low_var_kl", entropy_coef=0.01),
    _case(with_entropy=True),
    _case(dict(temperature=0.7, ref="design"), beta=0.04, entropy_coef=0.01),
    _case(dict(ignore_index=3, seed=3)),
    _case(dict(old="gspo"), importance_sampling="sequence"),
    _case(dict(old=None), importance_sampling="sequence"),
    _case(
        dict(old="gspo", adv="token", seed=4),
        importance_sampling="sequence",
        dual_clip=3.0,
        eps_high=0.28,
        loss_agg="seq-mean-token-mean",
    ),
    _case(
        dict(old="gspo", ref="design", mask="float", seed=5),
        importance_sampling="sequence",
        delta=2.0,
        beta=0.04,
        entropy_coef=0.01,
        loss_agg="seq-mean-token-sum",
    ),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("make", "loss_kw"), CASES)
def test_parity_fp32(backend, make, loss_kw, device):
    logits, targets, adv, kw = make_inputs(device=device, **make)
    _check_parity(backend, logits, targets, adv, **kw, **loss_kw)


def test_cases_exercise_every_branch(device):
    """The designed ratios really reach each clip branch (the parity tests are not vacuous)."""
    logits, targets, adv, kw = make_inputs(device=device, adv="token", seed=2)
    _, m = oracle_policy_loss(logits.double(), targets, adv, eps_high=0.28, **kw)
    assert 0 < m["clip_frac_low"] < m["clip_frac"] and 0 < m["clip_frac_high"] < m["clip_frac"]
    logits, targets, adv, kw = make_inputs(device=device, adv="neg")
    _, m = oracle_policy_loss(logits.double(), targets, adv, dual_clip=3.0, **kw)
    assert 0 < m["dual_clip_frac"] < 1 and m["ratio_max"] > 3.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("B", "T", "V"), [(1, 1, 1), (2, 1, 5), (1, 2, 4099), (3, 6, 64), (2, 3, 17)]
)
def test_parity_shapes(backend, B, T, V, device):
    logits, targets, adv, kw = make_inputs(B, T, V, device=device, ref="design", seed=B + T + V)
    _check_parity(backend, logits, targets, adv, eps_high=0.28, beta=0.04, entropy_coef=0.01, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_parity_noncontiguous(backend, importance_sampling, device):
    """``big[:, :-1]`` (the usual next-token slice) and a vocab slice with a wide row stride;
    the gradient of the part of ``big`` outside the view must be exactly 0. The (B, T)
    inputs (per-token advantages, old/ref log-probs, mask, int32 targets) are strided too."""
    logits, targets, adv, kw = make_inputs(
        3, 5, 37, device=device, old="gspo", ref="design", adv="token"
    )

    def strided(t):  # same values, column stride 2
        return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]

    adv, targets = strided(adv), strided(targets.int())
    kw = {k: strided(v) for k, v in kw.items()}
    assert not adv.is_contiguous() and not kw["old_logprobs"].is_contiguous()
    views = (lambda x: x[:, :-1], lambda x: x[:, :-1, :37])
    for extra_v, view in zip((0, 6), views):
        big = torch.randn(3, 6, 37 + extra_v, device=device)
        view(big).copy_(logits)
        assert not view(big).is_contiguous()
        _, _, grad = _check_parity(
            backend,
            big,
            targets,
            adv,
            view=view,
            beta=0.04,
            entropy_coef=0.01,
            importance_sampling=importance_sampling,
            **kw,
        )
        outside = torch.ones_like(grad, dtype=torch.bool)
        view(outside).fill_(False)
        assert torch.equal(grad[outside], torch.zeros_like(grad[outside]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("kl", "ref", "dual_clip", "importance_sampling"),
    [
        ("k3", "far", None, "token"),
        ("low_var_kl", "huge", 3.0, "token"),
        ("k2", "far", None, "sequence"),
        ("low_var_kl", "huge", None, "sequence"),
    ],
)
def test_far_outside_clip_band(backend, kl, ref, dual_clip, importance_sampling, device):
    """log-ratios of +-30 to old (and +-30 / +-100 to ref): finite loss, metrics and gradient,
    equal to the oracle."""
    logits, targets, adv, kw = make_inputs(device=device, old="far", ref=ref, adv="token")
    loss, metrics, _ = _check_parity(
        backend,
        logits,
        targets,
        adv,
        beta=0.04,
        kl_estimator=kl,
        dual_clip=dual_clip,
        importance_sampling=importance_sampling,
        **kw,
    )
    assert all(torch.isfinite(v) for v in metrics.values())
    if importance_sampling == "token":
        assert metrics["clip_frac"] > 0 and metrics["ratio_max"] > 1e12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", ["all-masked", "all-ignored"])
@pytest.mark.parametrize("loss_agg", AGGS)
def test_nothing_counts(backend, what, loss_agg, device):
    """No counted token: loss 0, gradient 0, metrics 0, no NaN anywhere."""
    logits, targets, adv, kw = make_inputs(device=device, ref="design")
    if what == "all-masked":
        kw["mask"] = torch.zeros_like(kw["mask"])
    else:
        targets = torch.full_like(targets, -100)
    loss, metrics, grad = _check_parity(
        backend, logits, targets, adv, loss_agg=loss_agg, beta=0.04, entropy_coef=0.01, **kw
    )
    assert loss == 0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(v == 0 for v in metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("B", "T"), [(2, 0), (0, 3)])
def test_empty_batch(backend, B, T, device):
    """No token at all (T = 0 or B = 0): loss 0, metrics 0, an empty gradient."""
    x = torch.randn(B, T, 5, device=device, requires_grad=True)
    targets = torch.zeros(B, T, dtype=torch.long, device=device)
    old = torch.zeros(B, T, device=device)
    loss, metrics = policy_loss(
        x,
        targets,
        torch.ones(B, device=device),
        old_logprobs=old,
        loss_agg="seq-mean-token-mean",
        backend=backend,
    )
    loss.backward()
    assert loss == 0 and x.grad.shape == x.shape
    assert all(v == 0 for v in metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize(
    ("name", "garbage"),
    [
        ("old_logprobs", float("nan")),
        ("old_logprobs", -float("inf")),
        ("ref_logprobs", float("nan")),
        ("advantages", float("nan")),
        ("logits", float("nan")),  # the fused kernels do not even read these rows
    ],
)
def test_non_counted_values_never_matter(backend, importance_sampling, name, garbage, device):
    """Padding garbage (NaN / -inf) in logits, old/ref log-probs or advantages at tokens that
    do not count (mask False, ignore_index) changes nothing: same finite loss, metrics,
    gradient, and exactly zero gradient on those logits rows."""
    logits, targets, adv, kw = make_inputs(device=device, ref="design", adv="token")
    hyper = dict(beta=0.04, entropy_coef=0.01, importance_sampling=importance_sampling)
    hyper["backend"] = backend
    loss, metrics, grad = _run(policy_loss, logits, targets, adv, 1.0, **kw, **hyper)

    dirty = {"advantages": adv, "logits": logits, **kw}
    off = ~(kw["mask"] & (targets != -100))
    dirty[name] = dirty[name].masked_fill(off[..., None] if name == "logits" else off, garbage)
    d_adv, d_logits = dirty.pop("advantages"), dirty.pop("logits")
    d_loss, d_metrics, d_grad = _run(policy_loss, d_logits, targets, d_adv, 1.0, **dirty, **hyper)
    assert_rel(d_loss, loss, FP32_TOL, "loss")
    assert_rel(d_grad, grad, FP32_TOL, "grad")
    assert (d_grad[off] == 0).all()
    for key in metrics:
        assert_rel(d_metrics[key], metrics[key], FP32_TOL, f"metric {key}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_fractional_mask_weights(backend, importance_sampling, device):
    """A float mask weights tokens (sequence 0 sums to 0.6 < 1): every ``loss_agg`` and the
    GSPO ratio ``exp(sum m lr / sum m)`` use the weights as given."""
    logits, targets, adv, kw = make_inputs(device=device, mask="float", old="gspo", T=5)
    weights = torch.rand(targets.shape, generator=torch.Generator().manual_seed(5))
    weights[0] = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.0])
    kw["mask"] = (kw["mask"] * weights.to(device)).contiguous()
    for loss_agg in LOSS_AGG_MODES:
        _check_parity(backend, logits, targets, adv, importance_sampling=importance_sampling,
                      loss_agg=loss_agg, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("make", "loss_kw"),
    [
        ({}, dict(eps_high=0.28, entropy_coef=0.01)),
        (
            dict(old="gspo", ref="design", adv="neg"),
            dict(importance_sampling="sequence", dual_clip=3.0, beta=0.04),
        ),
    ],
)
def test_parity_bf16(backend, make, loss_kw, device):
    """bf16 logits: no worse than twice the error of the same math run eagerly in bf16."""
    logits, targets, adv, kw = make_inputs(device=device, dtype=torch.bfloat16, **make, T=6)
    upstream = 1.3
    loss, metrics, grad = _run(
        policy_loss, logits, targets, adv, upstream, backend=backend, **kw, **loss_kw
    )
    e_loss, e_metrics, e_grad = _run(
        oracle_policy_loss, logits, targets, adv, upstream, **kw, **loss_kw
    )
    o_loss, o_metrics, o_grad = _run(
        oracle_policy_loss, logits.double(), targets, adv, upstream, **kw, **loss_kw
    )
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert_rel(loss, o_loss, bf16_tol(e_loss, o_loss), f"{backend} bf16 loss")
    assert_rel(grad, o_grad, bf16_tol(e_grad, o_grad), f"{backend} bf16 grad")
    assert set(metrics) == set(o_metrics)
    for name, value in metrics.items():
        tol = bf16_tol(e_metrics[name], o_metrics[name])
        assert_rel(value, o_metrics[name], tol, f"{backend} bf16 metric {name}")


# ----------------------------------------------------------------------------- semantics


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("adv_kind", "hyper"),
    [
        ("seq", {}),
        ("token", dict(delta=2.0, dual_clip=3.0)),
        # the ratio 1 sits on both clip bounds: clamp passes the gradient there
        ("token", dict(eps_low=0.0, eps_high=0.0)),
        ("seq", dict(importance_sampling="sequence", eps_low=0.0, eps_high=0.0)),
    ],
)
def test_on_policy_gradient_is_policy_gradient(backend, adv_kind, hyper, device):
    """old_logprobs=None: ratio 1, loss -mean(A), gradient of -sum(A m logp) / sum(m)."""
    logits, targets, adv, kw = make_inputs(device=device, old=None, adv=adv_kind)
    mask = kw["mask"]
    loss, metrics, grad = _run(
        policy_loss, logits, targets, adv, 1.0, backend=backend, **kw, **hyper
    )

    x = logits.double().requires_grad_()
    counted = (targets != -100) & mask
    logp = torch.log_softmax(x, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    a2d = adv.double()[:, None].expand_as(logp) if adv.dim() == 1 else adv.double()
    pg = -(a2d * logp * counted).sum() / counted.sum()
    pg.backward()
    assert_rel(grad, x.grad, FP32_TOL, "policy gradient")
    assert_rel(loss, -(a2d * counted).sum() / counted.sum(), FP32_TOL, "loss")
    assert metrics["ratio_mean"] == 1 and metrics["ratio_max"] == 1
    assert metrics["clip_frac"] == 0 and metrics["approx_kl"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_advantages_b1_accepted_when_t_is_1(backend, device):
    """With T = 1, (B, 1) is (B, T): one per token, same as (B,)."""
    logits, targets, adv, kw = make_inputs(3, 1, 11, device=device)
    a, _ = policy_loss(logits, targets, adv, backend=backend, **kw)
    b, _ = policy_loss(logits, targets, adv[:, None], backend=backend, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_without_grad(backend, device):
    """Logits that need no gradient (evaluation, metrics only): same loss and metrics."""
    logits, targets, adv, kw = make_inputs(device=device, ref="design")
    with torch.no_grad():
        loss, metrics = policy_loss(logits, targets, adv, backend=backend, beta=0.04, **kw)
    o_loss, o_metrics = oracle_policy_loss(logits.double(), targets, adv, beta=0.04, **kw)
    assert not loss.requires_grad
    assert_rel(loss, o_loss, FP32_TOL, "loss")
    for name in metrics:
        assert_rel(metrics[name], o_metrics[name], FP32_TOL, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items(backend, as_tensor, device):
    """token-mean with a global token count replacing the local one."""
    logits, targets, adv, kw = make_inputs(device=device)
    num_items = torch.tensor(23.0, device=device) if as_tensor else 23
    _check_parity(backend, logits, targets, adv, num_items=num_items, **kw)
    with_n, _ = policy_loss(logits, targets, adv, num_items=num_items, backend=backend, **kw)
    plain, _ = policy_loss(logits, targets, adv, backend=backend, **kw)
    counted = (kw["mask"] & (targets != -100)).sum()
    assert_rel(with_n * 23, plain * counted, FP32_TOL, "num_items rescales the loss")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_matches_policy_loss_from_logprobs(backend, importance_sampling, device):
    """policy_loss(logits) == policy_loss_from_logprobs(token_logprobs(logits)):
    values, metrics and gradients."""
    logits, targets, adv, kw = make_inputs(device=device, old="gspo", ref="design", adv="token")
    hyper = dict(
        eps_high=0.28,
        dual_clip=3.0,
        beta=0.04,
        kl_estimator="k2",
        entropy_coef=0.01,
        importance_sampling=importance_sampling,
        loss_agg="seq-mean-token-mean",
    )
    upstream = 0.8
    loss, metrics, grad = _run(
        policy_loss, logits, targets, adv, upstream, backend=backend, **kw, **hyper
    )

    def via_logprobs(x, targets, adv, mask, **rest):
        logp, ent = token_logprobs(x, targets, return_entropy=True, backend=backend)
        counted = mask & (targets != -100)
        return policy_loss_from_logprobs(logp, adv, mask=counted, entropy=ent, **rest)

    loss2, metrics2, grad2 = _run(via_logprobs, logits, targets, adv, upstream, **kw, **hyper)
    assert_rel(loss, loss2, FP32_TOL, "loss")
    assert_rel(grad, grad2, FP32_TOL, "grad")
    assert set(metrics) == set(metrics2)
    for name in metrics:
        assert_rel(metrics[name], metrics2[name], FP32_TOL, name)


def test_from_logprobs_against_oracle(device):
    """policy_loss_from_logprobs on float64 log-probs equals the oracle's token layer."""
    logits, targets, adv, kw = make_inputs(device=device, old="design", ref="design")
    hyper = dict(
        eps_low=0.1,
        eps_high=0.28,
        delta=2.0,
        beta=0.04,
        kl_estimator="low_var_kl",
        loss_agg="seq-mean-token-sum-norm",
        max_length=7,
    )
    x = logits.double().requires_grad_()
    lp = torch.log_softmax(x, -1)
    logp = lp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    counted = kw["mask"] & (targets != -100)
    loss, metrics = policy_loss_from_logprobs(
        logp,
        adv,
        old_logprobs=kw["old_logprobs"],
        ref_logprobs=kw["ref_logprobs"],
        mask=counted,
        **hyper,
    )
    (grad,) = torch.autograd.grad(loss * 1.7, x)
    o_loss, o_metrics, o_grad = _run(
        oracle_policy_loss, logits.double(), targets, adv, 1.7, **kw, **hyper
    )
    assert_rel(loss, o_loss, FP32_TOL, "loss")
    assert_rel(grad, o_grad, FP32_TOL, "grad")
    for name in METRICS + ("kl",):
        assert_rel(metrics[name], o_metrics[name], FP32_TOL, name)


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_deterministic(importance_sampling, device):
    """Two runs give bit-identical loss, metrics and gradient."""
    logits, targets, adv, kw = make_inputs(3, 6, 64, device=device, old="gspo", ref="design")
    hyper = dict(beta=0.04, entropy_coef=0.01, importance_sampling=importance_sampling)
    runs = [
        _run(policy_loss, logits, targets, adv, 0.9, backend="triton", **kw, **hyper)
        for _ in range(2)
    ]
    (l1, m1, g1), (l2, m2, g2) = runs
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert all(torch.equal(m1[k], m2[k]) for k in m1)


@pytest.mark.no_poison
@pytest.mark.parametrize(
    "options",
    [
        dict(importance_sampling="token"),
        dict(importance_sampling="sequence"),
        dict(off_policy_mask_threshold=0.0, top_entropy_quantile=0.5),  # masks from logp, H
    ],
    ids=["token", "sequence", "token-selection"],
)
def test_torch_compile_fullgraph(options, device):
    logits, targets, adv, kw = make_inputs(2, 4, 19, device=device, old="gspo", ref="design")
    hyper = dict(eps_high=0.28, dual_clip=3.0, beta=0.04, entropy_coef=0.01, backend="triton",
                 **options)  # fmt: skip

    def fn(x, targets, adv, **kw):
        return policy_loss(x, targets, adv, **kw, **hyper)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss, metrics, grad = _run(fn, logits, targets, adv, 1.1, **kw)
    c_loss, c_metrics, c_grad = _run(compiled, logits, targets, adv, 1.1, **kw)
    assert_rel(c_loss, loss, 1e-6, "compiled loss")
    assert_rel(c_grad, grad, 1e-6, "compiled grad")
    assert set(c_metrics) == set(metrics)
    for name in metrics:
        assert_rel(c_metrics[name], metrics[name], 1e-6, name)


@pytest.mark.parametrize(
    "hyper",
    [
        dict(eps_high=0.28, dual_clip=3.0, beta=0.04, kl_estimator="k3", entropy_coef=0.01),
        dict(delta=2.0, beta=0.04, kl_estimator="low_var_kl", loss_agg="seq-mean-token-mean"),
        dict(importance_sampling="sequence", entropy_coef=0.01, loss_agg="seq-mean-token-sum"),
        dict(off_policy_mask_threshold=0.0, beta=0.04, kl_estimator="k3"),
    ],
    ids=["token-dual-k3", "token-delta-lowvar", "sequence", "off-policy-mask"],
)
def test_gradcheck_triton_fp64(hyper, device):
    logits, targets, adv, kw = make_inputs(
        2, 3, 5, device=device, dtype=torch.float64, adv="token", ref="design", old="gspo", seed=7
    )
    x = logits.clone().requires_grad_()

    def fn(x):
        return policy_loss(x, targets, adv, backend="triton", **kw, **hyper)[0]

    assert gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


# ----------------------------------------------------------------------------- validation


def _bad(match, error=ValueError, **change):
    ident = f"{error.__name__}-{match.split()[0]}-" + "-".join(change)
    return pytest.param(error, match, change, id=ident)


@pytest.mark.parametrize(
    ("error", "match", "change"),
    [
        _bad("targets", targets=torch.zeros(2, 4, dtype=torch.long)),
        _bad("old_logprobs", old_logprobs=torch.zeros(2, 4)),
        _bad("ref_logprobs", ref_logprobs=torch.zeros(3, 3)),
        _bad("mask", mask=torch.ones(2, 3, 1, dtype=torch.bool)),
        _bad("ambiguous", advantages=torch.ones(2, 1)),
        _bad("advantages", advantages=torch.ones(2, 3, 1)),
        _bad("advantages", advantages=torch.ones(3)),
        _bad("advantages", advantages=torch.ones(())),
        _bad("kl_estimator", kl_estimator="k4", ref_logprobs=torch.zeros(2, 3)),
        _bad("loss_agg", loss_agg="sum"),
        _bad("importance_sampling", importance_sampling="tokens"),
        _bad("eps_low", eps_low=-0.1),
        _bad("eps_high", eps_high=-0.1),
        _bad("dual_clip", dual_clip=1.0),
        _bad("dual_clip", dual_clip=0.5),
        _bad("delta", delta=1.2),
        _bad("delta", delta=1.25, eps_high=0.28),
        _bad("ref_logprobs", beta=0.04),
        _bad("temperature", temperature=0.0),
        _bad("temperature", temperature=-1.0),
        _bad("logits", logits=torch.zeros(2, 3)),
        _bad("logits", logits=torch.zeros(2, 3, 4, 5)),
        _bad("num_items", num_items=0),
        _bad("max_length", max_length=0, loss_agg="seq-mean-token-sum-norm"),
        # a NaN clip bound would silently drop the clip in the kernel's min / max
        _bad("eps_low", eps_low=float("nan")),
        _bad("eps_high", eps_high=float("inf")),
        _bad("dual_clip", dual_clip=float("inf")),
        _bad("delta", delta=float("nan")),
        _bad("beta", beta=float("nan"), ref_logprobs=torch.zeros(2, 3)),
        _bad("entropy_coef", entropy_coef=float("inf")),
        _bad("num_items", num_items=float("nan")),
        _bad("old_logprobs", TypeError, old_logprobs=torch.zeros(2, 3, dtype=torch.long)),
        _bad("ref_logprobs", TypeError, ref_logprobs=torch.zeros(2, 3, dtype=torch.bool)),
        _bad("mask", TypeError, mask=torch.zeros(2, 3, dtype=torch.complex64)),
        _bad("advantages", TypeError, advantages=torch.ones(2, dtype=torch.long)),
        _bad("eps_low", TypeError, eps_low=torch.tensor(0.2)),
        _bad("beta", TypeError, beta="0.04"),
        _bad("targets", TypeError, targets=torch.zeros(2, 3)),
        _bad("need process_group", vocab_size=9),
        _bad("need process_group", vocab_start=0, vocab_size=5),
        _bad("rollout_logprobs", rollout_logprobs=torch.zeros(2, 3)),
        _bad("rollout_logprobs", rollout_logprobs=torch.zeros(2, 4), off_policy_mask_threshold=0.1),
        _bad("off_policy_mask_threshold", off_policy_mask_threshold=float("nan")),
    ],
)
def test_policy_loss_rejects(error, match, change):
    args = dict(
        logits=torch.zeros(2, 3, 5),
        targets=torch.zeros(2, 3, dtype=torch.long),
        advantages=torch.ones(2),
    )
    args.update(change)
    with pytest.raises(error, match=match):
        policy_loss(args.pop("logits"), args.pop("targets"), args.pop("advantages"), **args)


@pytest.mark.parametrize(
    ("error", "match", "change"),
    [
        _bad("entropy", entropy_coef=0.01),
        _bad("logprobs", logprobs=torch.zeros(2, 3, 1)),
        _bad("old_logprobs", old_logprobs=torch.zeros(2, 4)),
        _bad("entropy", entropy=torch.zeros(3, 3)),
        _bad("ambiguous", advantages=torch.ones(2, 1)),
        _bad("dual_clip", dual_clip=1.0),
        _bad("ref_logprobs", beta=0.1),
        _bad("loss_agg", loss_agg="mean"),
    ],
)
def test_policy_loss_from_logprobs_rejects(error, match, change):
    args = dict(logprobs=torch.zeros(2, 3), advantages=torch.ones(2))
    args.update(change)
    with pytest.raises(error, match=match):
        policy_loss_from_logprobs(args.pop("logprobs"), args.pop("advantages"), **args)


@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_eager_range_check_runs_once(monkeypatch, importance_sampling, device):
    """The only host sync of a policy_loss call is its one eager target-range check."""
    import fused_rl._validation as V

    calls = []
    real = V.check_target_range
    monkeypatch.setattr(V, "check_target_range", lambda *a: calls.append(1) or real(*a))
    logits, targets, adv, kw = make_inputs(device=device, old="gspo", T=3)
    policy_loss(logits, targets, adv, importance_sampling=importance_sampling, **kw)
    assert len(calls) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
def test_rollout_inputs_are_constants(backend, importance_sampling, device):
    """advantages / old / ref log-probs / a float mask with requires_grad get no gradient on
    either backend
    (the fused kernel never differentiates w.r.t. them; the reference must agree)."""
    logits, targets, adv, kw = make_inputs(device=device, ref="design", adv="token", mask="float")
    leaves = [adv.requires_grad_(), kw["old_logprobs"].requires_grad_()]
    leaves += [kw["ref_logprobs"].requires_grad_(), kw["mask"].requires_grad_()]
    logits.requires_grad_()
    hyper = dict(beta=0.04, importance_sampling=importance_sampling)
    loss, _ = policy_loss(logits, targets, adv, backend=backend, **kw, **hyper)
    grads = torch.autograd.grad(loss, [logits, *leaves], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])

    logp = token_logprobs(logits, targets, backend=backend)
    loss, _ = policy_loss_from_logprobs(logp, adv, **kw, **hyper)
    grads = torch.autograd.grad(loss, [logits, *leaves], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])


# ----------------------------------------------------------------------------- packed logits


def test_packed_2d_logits_message_names_the_ways_out():
    with pytest.raises(ValueError) as info:
        policy_loss(torch.zeros(6, 5), torch.zeros(6, dtype=torch.long), torch.ones(1))
    msg = str(info.value)
    assert msg.startswith("logits must be (B, T, V)") and "got shape (6, 5)" in msg
    for hint in ("(N, V)", "token_logprobs", "policy_loss_from_logprobs", "unsqueeze(0)",
                 "(1, N) targets", "token-mean"):  # fmt: skip
        assert hint in msg, hint
    for bad in (torch.zeros(5), torch.zeros(1, 2, 3, 5)):  # other ranks: the shape only
        with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)") as info:
            policy_loss(bad, torch.zeros(2, 3, dtype=torch.long), torch.ones(2))
        assert "token_logprobs" not in str(info.value)
    with pytest.raises(ValueError, match=r"logprobs must be \(B, T\).*unsqueeze\(0\)"):
        policy_loss_from_logprobs(torch.zeros(6), torch.ones(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_logits_workarounds_agree(backend, device):
    """Both ways out the message suggests give the batched token-mean loss and gradient."""
    logits, targets, adv, kw = make_inputs(device=device, old="design", adv="token")
    mask = kw["mask"] & (targets != -100)
    old = kw["old_logprobs"]
    keep = mask.reshape(-1)
    packed = logits.reshape(-1, logits.shape[-1])[keep].detach()  # (N, V)
    t, a, o = (x.reshape(-1)[keep] for x in (targets, adv, old))

    def batched(x):
        return policy_loss(x, targets, adv, old_logprobs=old, mask=mask, backend=backend)[0]

    def unsqueezed(x):
        return policy_loss(x.unsqueeze(0), t[None], a[None], old_logprobs=o[None],
                           backend=backend)[0]  # fmt: skip

    def via_logprobs(x):
        logp = token_logprobs(x, t, backend=backend)
        return policy_loss_from_logprobs(logp.unsqueeze(0), a[None], old_logprobs=o[None],
                                         backend=backend)[0]  # fmt: skip

    x = logits.detach().clone().requires_grad_()
    want = batched(x)
    (want_grad,) = torch.autograd.grad(want, x)
    want_grad = want_grad.reshape(-1, logits.shape[-1])[keep]
    for fn in (unsqueezed, via_logprobs):
        xp = packed.clone().requires_grad_()
        got = fn(xp)
        (grad,) = torch.autograd.grad(got, xp)
        assert_rel(got, want, FP32_TOL, fn.__name__)
        assert_rel(grad, want_grad, FP32_TOL, f"{fn.__name__} grad")


def test_reference_keeps_surrogate_parameters_in_float64(device):
    """The reference's surrogate parameters take the inputs' dtype: SAPO's 1.05 rounded to
    fp32 first (a Python float in ``torch.where`` becomes the default dtype) gave float64
    callers a loss 5e-8 off, seen where the GPU run used the reference for CPU tensors."""
    gen = torch.Generator().manual_seed(11)
    lp = torch.randn(3, 6, generator=gen, dtype=torch.float64).to(device)
    old = lp + 0.3 * torch.randn(3, 6, generator=gen, dtype=torch.float64).to(device)
    adv = torch.randn(3, generator=gen, dtype=torch.float64).to(device)
    loss, _ = policy_loss_from_logprobs(lp, adv, old_logprobs=old, surrogate="sapo",
                                        sapo_tau_pos=1.1, sapo_tau_neg=1.05,
                                        backend="reference")  # fmt: skip
    r, a = torch.exp(lp - old), adv[:, None]
    tau = torch.where(a > 0, 1.1, 1.05 + 0.0 * a)  # float64 temperatures
    want = (-a * torch.sigmoid(tau * (r - 1.0)) * 4.0 / tau).mean()
    assert abs(loss.item() - want.item()) <= 1e-14 * max(abs(want.item()), 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance_sampling", ["token", "sequence"])
@pytest.mark.parametrize("clamp", [5.0, 29.5])
def test_log_ratio_clamp(backend, importance_sampling, clamp, device):
    """``log_ratio_clamp`` (verl's +-20): each token's log-ratio clamped before the ratio (and
    before GSPO's sequence mean), no gradient through a clamped one; log-ratios of +-30, so
    the clamp is active at some tokens and not at others."""
    logits, targets, adv, kw = make_inputs(device=device, old="far", adv="token")
    _check_parity(
        backend, logits, targets, adv, importance_sampling=importance_sampling,
        log_ratio_clamp=clamp, **kw,
    )  # fmt: skip


def _token_mean_entropy_oracle(coef):
    """``oracle_policy_loss`` without the bonus, minus ``coef`` times the token-mean entropy
    over counted tokens (TRL's entropy bonus), in the logits' dtype."""

    def fn(logits, targets, adv, *, entropy_agg, entropy_coef, **kw):
        loss, metrics = oracle_policy_loss(logits, targets, adv, with_entropy=True, **kw)
        log_p = torch.log_softmax(logits / kw.get("temperature", 1.0), dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        counted = targets != -100
        m = counted.to(logits.dtype)
        if kw.get("mask") is not None:
            m = torch.where(counted, kw["mask"].to(logits.dtype), 0.0)
        mean_h = torch.where(m != 0, entropy * m, 0.0).sum() / m.sum()
        return loss - coef * mean_h, metrics

    return fn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_entropy_bonus_as_a_token_mean(backend, loss_agg, device):
    """``entropy_agg="token-mean"`` (TRL's ``entropy_coef``): the bonus is ``-coef`` times the
    mean entropy over counted tokens whatever ``loss_agg``, value and gradient, on the fused
    path, from log-probs (GSPO) and from hidden states."""
    coef = 0.03
    logits, targets, adv, kw = make_inputs(device=device, mask="float")
    kw.update(entropy_coef=coef, entropy_agg="token-mean", loss_agg=loss_agg)
    upstream = 1.3
    loss, metrics, grad = _run(policy_loss, logits, targets, adv, upstream, backend=backend, **kw)
    want, _, want_grad = _run(
        _token_mean_entropy_oracle(coef), logits.double(), targets, adv, upstream, **kw
    )
    assert_rel(loss, want, FP32_TOL, f"{backend} loss")
    assert_rel(grad, want_grad, FP32_TOL, f"{backend} grad")
    # the same call with the bonus aggregated by loss_agg differs unless loss_agg is token-mean
    other, _ = policy_loss(logits, targets, adv, backend=backend,
                           **{**kw, "entropy_agg": None})  # fmt: skip
    if loss_agg != "token-mean":
        assert not torch.allclose(other, loss, rtol=1e-4, atol=0.0)
    # GSPO (the token-layer kernel), and from hidden states (the one-pass chunks)
    seq, _, seq_grad = _run(policy_loss, logits, targets, adv, upstream, backend=backend,
                            importance_sampling="sequence", **kw)  # fmt: skip
    want, _, want_grad = _run(
        _token_mean_entropy_oracle(coef), logits.double(), targets, adv, upstream,
        importance_sampling="sequence", **kw,
    )  # fmt: skip
    assert_rel(seq, want, FP32_TOL, f"{backend} GSPO loss")
    assert_rel(seq_grad, want_grad, FP32_TOL, f"{backend} GSPO grad")
    eye = torch.eye(logits.shape[-1], device=device)
    hidden = logits.detach().clone().requires_grad_()  # an identity lm_head: the same loss
    lin, _ = fused_rl.linear_policy_loss(hidden, eye, targets, adv, chunk_tokens=4,
                                         backend=backend, **kw)  # fmt: skip
    (lin_grad,) = torch.autograd.grad(lin * upstream, hidden)
    assert_rel(lin, loss, FP32_TOL, f"{backend} linear loss")
    assert_rel(lin_grad, grad, FP32_TOL, f"{backend} linear grad")


def test_reference_vespo_parameters_stay_float64(device):
    """VESPO's ``k`` / ``lambda`` reach the reference's weight ``phi`` in the inputs' dtype
    (float64 here, parameters that fp32 cannot hold exactly)."""
    from fused_rl.reference.policy import surrogate_terms

    gen = torch.Generator().manual_seed(12)
    ratio = torch.exp(0.5 * torch.randn(3, 4, generator=gen, dtype=torch.float64)).to(device)
    adv = torch.randn(3, 1, generator=gen, dtype=torch.float64).to(device)
    logp = torch.randn(3, 4, generator=gen, dtype=torch.float64).to(device)
    config = fused_rl.PolicyConfig(
        eps_high=0.28, surrogate="vespo", vespo_k_pos=2.1, vespo_lambda_pos=3.3,
        vespo_k_neg=2.9, vespo_lambda_neg=0.7,
    )  # fmt: skip
    *_, phi = surrogate_terms(ratio, logp, adv, config)
    positive = adv >= 0
    k = torch.where(positive, 2.1, 2.9 + 0.0 * adv)
    lam = torch.where(positive, 3.3, 0.7 + 0.0 * adv)
    log_w = torch.log(ratio).clamp(-18.420680743952367, 20.0)
    want = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    assert phi.dtype == torch.float64
    torch.testing.assert_close(phi, want, rtol=1e-14, atol=0.0)
