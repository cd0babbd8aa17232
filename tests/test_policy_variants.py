"""The surrogate axis of the policy losses (``surrogate=``: ppo, cispo, sapo, gpg), the
rollout importance-sampling weights (``is_weights=``) and the bias-corrected KL
(``kl_bias_correction=``).

Oracle: float64 autograd, written in this file from the per-token math of the RL libraries
(verl b178a3cd, TRL f2cd5771, Liger ead96b61), independently of ``fused_rl.reference``:

* cispo: ``L = -sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp`` (verl's two-sided band;
  TRL's absolute cap ``C`` is ``eps_low = 1, eps_high = C - 1``);
* sapo: ``L = -A sigmoid(tau (r - 1)) 4 / tau``, ``tau = tau_pos`` where ``A > 0`` else
  ``tau_neg``;
* gpg: ``L = -A logp``;
* rollout IS weights multiply the policy term only, before the KL is added;
* bias-corrected KL: ``beta k3 r`` with the ratio NOT detached (exact autograd, also for a
  sequence-level ratio).

Every variant on both backends, from logits, from log-probs and from hidden states: the
loss, each metric and the gradients under a random upstream scalar; masks with padding,
negative and zero advantages, ratios far from 1.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from helpers import FP32_TOL, assert_rel, clamp_in

import fused_rl
from fused_rl.nn import PolicyLoss

BACKENDS = ("triton", "reference")
B, T, V, H = 3, 6, 23, 8


def _rollout(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 4] = -100
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[2, :] = False  # a fully masked sequence
    mask[1, 0] = True
    # advantages with both signs and an exact zero
    adv = torch.tensor([1.3, -0.7, 0.0])[:B]
    with torch.no_grad():
        logp = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp(min=0)[..., None])
        logp = logp[..., 0]
    # ratios far from 1 on both sides, away from the clip bounds (no fp32/fp64 tie flips)
    log_r = torch.tensor([-1.2, -0.4, -0.05, 0.02, 0.5, 1.6]).repeat(B, 1)[:, :T]
    old = (logp - log_r).float()
    old[~mask] = float("nan")  # padding may hold anything
    ref = (logp - torch.randn(B, T, generator=g) * 0.5).float()
    is_w = torch.rand(B, T, generator=g) * 1.5 + 0.25
    r = dict(logits=logits, targets=targets, mask=mask, adv=adv, old=old, ref=ref, is_w=is_w)
    return {k: v.to(DEVICE) for k, v in r.items()}


def _oracle(r, logits, **kw):
    """float64 loss and metrics from ``logits`` (a float64 leaf), per the libraries' math."""
    logp = torch.log_softmax(logits, -1).gather(-1, r["targets"].clamp(min=0)[..., None])
    return _oracle_logp(r, logp[..., 0], **kw)


def _oracle_logp(r, logp, *, surrogate, eps_low=0.2, eps_high=0.28, tau_pos=1.0, tau_neg=1.05,
                 k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0, beta=0.0,
                 is_weights=None, bias=False, sequence=False, loss_agg="token-mean",
                 keep=None):  # fmt: skip
    """float64 loss and metrics from per-token ``logp`` (float64, with grad); ``keep``: a
    ``(B, T)`` bool mask multiplying the policy term (TRL's ``per_token_loss * mask`` of the
    top-entropy selection and the off-policy sequence mask)."""
    m = (r["mask"] & (r["targets"] != -100)).double()
    logp = torch.where(m > 0, logp, torch.zeros_like(logp))
    old = torch.where(m > 0, r["old"].double(), logp.detach())
    ref = torch.where(m > 0, r["ref"].double(), logp.detach())
    adv = r["adv"].double()
    adv = adv if adv.dim() == 2 else adv[:, None].expand(B, T)
    delta = token_delta = logp - old
    if surrogate == "gmpo":  # verl geo_mean: sign(A) * min(sign(A) d, sign(A) clamp(d))
        sign = torch.sign(adv)
        delta = sign * torch.minimum(sign * delta, sign * clamp_in(delta, -eps_low, eps_high))
    if sequence:
        n = m.sum(1, keepdim=True)
        seq = (delta * m).sum(1, keepdim=True) / n.clamp(min=1)
        if sequence == "sum":  # RLOO (TRL's RLOOTrainer): the summed log-ratio
            seq = (delta * m).sum(1, keepdim=True)
        if sequence == "token":  # GSPO-token: sg(s) * r_t / sg(r_t)
            seq = seq.detach() + (logp - logp.detach())
        delta = seq.expand(B, T)
    ratio = torch.exp(delta)
    lo, hi = 1 - eps_low, 1 + eps_high
    aux = torch.zeros_like(ratio)
    clipped = torch.zeros_like(ratio, dtype=torch.bool)
    if surrogate == "ppo":
        pol = -torch.minimum(ratio * adv, clamp_in(ratio, lo, hi) * adv)
        clipped = clamp_in(ratio, lo, hi) * adv < ratio * adv
    elif surrogate == "cispo":
        pol = -ratio.clamp(lo, hi).detach() * adv * logp
        clipped = (ratio < lo) | (ratio > hi)
        aux = ((ratio > hi) & (adv > 0)).double()
    elif surrogate == "sapo":
        tau = torch.where(adv > 0, tau_pos, tau_neg).double()
        aux = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
        pol = -aux * adv
    elif surrogate == "gpg":
        pol = -adv * logp
    elif surrogate == "vespo":  # TRL get_gamma_weights: everything under no_grad
        with torch.no_grad():
            total = (token_delta.clamp(-20, 20) * m).sum(1, keepdim=True)
            if is_weights is not None:
                w_is = is_weights.double().reshape(B, -1).expand(B, T)
                total = total + (w_is.log().clamp(math.log(1e-8), 20) * m).sum(1, keepdim=True)
            log_w = total.clamp(math.log(1e-8), 20)
            k = torch.where(adv >= 0, k_pos, k_neg).double()
            lam = torch.where(adv >= 0, lambda_pos, lambda_neg).double().clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * log_w.exp())
            phi = torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))
        pol = -phi * adv * logp
        aux = phi
        ratio = torch.exp(token_delta)
        is_weights_for_metrics, is_weights = is_weights, None  # folded into phi
    else:  # gmpo: -A times the geometric mean of the clipped ratios
        pol = -adv * ratio
        d = token_delta.detach()
        clipped = ((adv > 0) & (d > eps_high)) | ((adv < 0) & (d < -eps_low))
    is_weights_for_metrics = locals().get("is_weights_for_metrics", is_weights)
    if is_weights is not None:
        is_weights = is_weights.double().reshape(B, -1).expand(B, T)
        pol = pol * is_weights
    if keep is not None:
        pol = pol * keep.double()
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = pol + beta * (k3 * ratio if bias else k3)
    if loss_agg == "token-mean":
        loss = (per_token * m).sum() / m.sum()
    else:  # seq-mean-token-mean, an empty sequence weighs 0
        n = m.sum(1)
        loss = ((per_token * m).sum(1) / n.clamp(min=1)).sum() / B
    mean = lambda x: (x.double() * m).sum() / m.sum()  # noqa: E731
    metrics = {"clip_frac": mean(clipped), "ratio_mean": mean(ratio.detach())}
    names = {"cispo": "cispo_clip_frac", "sapo": "sapo_gate_mean", "vespo": "vespo_phi_mean"}
    name = names.get(surrogate)
    if name:
        metrics[name] = mean(aux.detach())
    if surrogate == "vespo":  # one phi per sequence, each counted sequence weighs 1
        counted = m.sum(1) > 0
        metrics["vespo_phi_seq_mean"] = aux.detach().expand(B, T)[counted, 0].mean()
    if beta and bias:  # TRL's kl metric under bias correction: the mean of k3 * r
        metrics["kl_bias_corrected"] = mean((k3 * ratio).detach())
    if is_weights_for_metrics is not None:
        w = is_weights_for_metrics.double().reshape(B, -1).expand(B, T)[m > 0]
        metrics.update(is_weight_mean=w.mean(), is_weight_min=w.min(), is_weight_max=w.max())
    return loss, metrics


CASES = {
    "ppo+is+bias_kl": dict(surrogate="ppo", is_weights="BT", beta=0.1, bias=True),
    "cispo": dict(surrogate="cispo"),
    "cispo-trl-cap": dict(surrogate="cispo", eps_low=1.0, eps_high=4.0, is_weights="B"),
    "cispo+kl+seq-mean": dict(surrogate="cispo", beta=0.05, loss_agg="seq-mean-token-mean"),
    "sapo": dict(surrogate="sapo", tau_pos=1.3, tau_neg=0.7),
    "sapo+is+bias_kl": dict(surrogate="sapo", is_weights="BT", beta=0.2, bias=True),
    "gpg": dict(surrogate="gpg", is_weights="B1"),
    "gspo+bias_kl": dict(surrogate="ppo", sequence=True, beta=0.1, bias=True, is_weights="BT"),
    "sapo-sequence": dict(surrogate="sapo", sequence=True, eps_low=0.2),
    "gspo-token+bias_kl": dict(surrogate="ppo", sequence="token", beta=0.1, bias=True),
    "cispo-sequence-token": dict(surrogate="cispo", sequence="token", is_weights="BT"),
    "rloo": dict(surrogate="ppo", sequence="sum", eps_low=0.2, loss_agg="seq-mean-token-mean"),
    "rloo+is+bias_kl": dict(
        surrogate="ppo", sequence="sum", beta=0.1, bias=True, is_weights="B1"
    ),  # fmt: skip
    "sapo-sequence-sum": dict(surrogate="sapo", sequence="sum", tau_pos=0.6, tau_neg=0.9),
    "vespo": dict(surrogate="vespo"),
    "vespo+is+kl": dict(
        surrogate="vespo",
        k_pos=1.5,
        lambda_pos=2.5,
        k_neg=2.0,
        lambda_neg=0.0,
        is_weights="BT",
        beta=0.05,
    ),
    "gmpo": dict(  # clipped in log space: bounds away from the log-ratios (-0.4 is one)
        surrogate="gmpo", sequence=True, eps_low=0.3, eps_high=0.4, loss_agg="seq-mean-token-mean"
    ),
    "gmpo+is+bias_kl": dict(
        surrogate="gmpo",
        sequence=True,
        eps_low=0.3,
        eps_high=0.5,
        is_weights="B1",
        beta=0.1,
        bias=True,
    ),
}


def _is_weights(r, kind):
    return {None: None, "BT": r["is_w"], "B": r["is_w"][:, 0], "B1": r["is_w"][:, :1]}[kind]


def _kwargs(r, case):
    kw = dict(case)
    seq = kw.pop("sequence", False)
    is_kind = kw.pop("is_weights", None)
    bias = kw.pop("bias", False)
    level = {False: "token", True: "sequence", "token": "sequence-token", "sum": "sequence-sum"}[
        seq
    ]
    ours = dict(kw, importance_sampling=level,
                kl_bias_correction=bias, is_weights=_is_weights(r, is_kind))  # fmt: skip
    ours.setdefault("eps_high", 0.28)
    if "tau_pos" in ours:
        ours["sapo_tau_pos"] = ours.pop("tau_pos")
        ours["sapo_tau_neg"] = ours.pop("tau_neg")
    for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
        if name in ours:
            ours[f"vespo_{name}"] = ours.pop(name)
    oracle = dict(kw, sequence=seq, bias=bias, is_weights=_is_weights(r, is_kind))
    return ours, oracle


def _check(loss, metrics, want, want_metrics, grads, exact):
    assert_rel(loss, want, FP32_TOL, "loss")
    for name, value in want_metrics.items():
        torch.testing.assert_close(metrics[name].double(), value, rtol=1e-5, atol=1e-6,
                                   msg=name)  # fmt: skip
    for a, e in zip(grads, exact):
        assert_rel(a, e, FP32_TOL, "gradient")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_variant_matches_oracle(case, backend):
    r = _rollout()
    ours, oracle = _kwargs(r, CASES[case])
    logits = r["logits"].clone().requires_grad_()
    loss, metrics = fused_rl.policy_loss(
        logits, r["targets"], r["adv"], old_logprobs=r["old"], ref_logprobs=r["ref"],
        mask=r["mask"], backend=backend, **ours,
    )  # fmt: skip
    leaf = r["logits"].double().requires_grad_()
    want, want_metrics = _oracle(r, leaf, **oracle)
    up = torch.tensor(0.61, device=DEVICE)
    grads = torch.autograd.grad(loss, logits, up)
    exact = torch.autograd.grad(want, leaf, up.double())
    _check(loss, metrics, want, want_metrics, grads, exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case",
    ["cispo", "sapo+is+bias_kl", "gpg", "gspo+bias_kl", "gspo-token+bias_kl", "gmpo", "rloo"],
)
def test_from_logprobs_variant_matches_oracle(case, backend):
    r = _rollout(seed=1)
    ours, oracle = _kwargs(r, CASES[case])
    logp = fused_rl.token_logprobs(r["logits"], r["targets"]).requires_grad_()
    loss, metrics = fused_rl.policy_loss_from_logprobs(
        logp, r["adv"], old_logprobs=r["old"], ref_logprobs=r["ref"],
        mask=r["mask"] & (r["targets"] != -100), backend=backend, **ours,
    )  # fmt: skip
    leaf = logp.detach().double().requires_grad_()
    want, want_metrics = _oracle_logp(r, leaf, **oracle)
    (grad,) = torch.autograd.grad(loss, logp)
    (exact,) = torch.autograd.grad(want, leaf)
    _check(loss, metrics, want, want_metrics, [grad], [exact])


@pytest.mark.parametrize("case", ["cispo-trl-cap", "sapo", "gpg", "ppo+is+bias_kl", "vespo+is+kl"])
def test_linear_policy_loss_variant_matches_oracle(case):
    """From hidden states (the fused-linear path: gradients formed in the forward)."""
    r = _rollout(seed=2)
    ours, oracle = _kwargs(r, CASES[case])
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(DEVICE).requires_grad_()
    loss, metrics = fused_rl.linear_policy_loss(
        hidden, weight, r["targets"], r["adv"], old_logprobs=r["old"], ref_logprobs=r["ref"],
        mask=r["mask"], chunk_tokens=4, backend="triton", **ours,
    )  # fmt: skip
    leaves = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    want, want_metrics = _oracle(r, F.linear(*leaves), **oracle)
    grads = torch.autograd.grad(loss, (hidden, weight))
    exact = torch.autograd.grad(want, leaves)
    _check(loss, metrics, want, want_metrics, grads, exact)


def test_every_surrogate_has_an_oracle_case():
    from fused_rl.losses import SURROGATES

    assert {case["surrogate"] for case in CASES.values()} == set(SURROGATES)


def test_surrogate_metric_names():
    r = _rollout()
    names = {}
    for surrogate in ("ppo", "cispo", "sapo", "gpg", "gmpo", "vespo"):
        level = "sequence" if surrogate == "gmpo" else "token"
        _, metrics = fused_rl.policy_loss(
            r["logits"], r["targets"], r["adv"], surrogate=surrogate, importance_sampling=level,
            backend="reference",
        )  # fmt: skip
        names[surrogate] = set(metrics)
    base = {"clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_max",
            "approx_kl", "clip_frac_low_seq_min", "clip_frac_high_seq_max",
            "clip_frac_low_seq_mean", "clip_frac_high_seq_mean"}  # fmt: skip
    assert names["ppo"] == base | {"dual_clip_frac"}
    assert names["cispo"] == base | {"cispo_clip_frac"}
    assert names["sapo"] == base | {"sapo_gate_mean"}
    assert names["gpg"] == base
    assert names["gmpo"] == base
    assert names["vespo"] == base | {"vespo_phi_mean", "vespo_phi_seq_mean"}


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        (dict(surrogate="vespa"), "surrogate"),
        (dict(surrogate="cispo", importance_sampling="sequence"), "importance_sampling"),
        (dict(surrogate="gpg", importance_sampling="sequence"), "importance_sampling"),
        (dict(surrogate="cispo", importance_sampling="sequence-sum"), "importance_sampling"),
        (dict(surrogate="gmpo", importance_sampling="sequence-sum"), "importance_sampling"),
        (dict(surrogate="gmpo"), "importance_sampling"),
        (dict(surrogate="vespo", importance_sampling="sequence"), "importance_sampling"),
        (dict(surrogate="vespo", vespo_lambda_neg=-1.0), "vespo_lambda_neg"),
        (dict(surrogate="cispo", delta=2.0), "delta"),
        (dict(surrogate="sapo", dual_clip=3.0), "dual_clip"),
        (dict(surrogate="sapo", sapo_tau_pos=0.0), "sapo_tau_pos"),
        (dict(surrogate="sapo", sapo_tau_neg=-1.0), "sapo_tau_neg"),
        (dict(is_weights=torch.ones(B, T + 1, device=DEVICE)), "is_weights"),
        (dict(is_weights=torch.ones(B, T, dtype=torch.long, device=DEVICE)), "is_weights"),
    ],
)
def test_invalid_combinations_name_the_argument(options, argument):
    r = _rollout()
    with pytest.raises((ValueError, TypeError), match=argument):
        fused_rl.policy_loss(r["logits"], r["targets"], r["adv"], **options)
    with pytest.raises((ValueError, TypeError), match=argument):
        PolicyLoss(**{k: v for k, v in options.items() if k != "is_weights"})(
            r["logits"],
            r["targets"],
            r["adv"],
            **({"is_weights": options["is_weights"]} if "is_weights" in options else {}),
        )


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
def test_token_local_surrogates_keep_the_single_pass():
    """cispo / sapo / gpg with IS weights (and their metrics) and the bias-corrected KL cost
    what plain PPO costs: the same launches (one fused vocab kernel and one reduction
    forward, one kernel backward)."""
    from fused_rl.profiling import LaunchCounter

    r = _rollout()
    counts = {}
    for surrogate in ("plain ppo", "ppo", "cispo", "sapo", "gpg"):
        logits = r["logits"].clone().requires_grad_()
        plain = surrogate == "plain ppo"
        with LaunchCounter() as c:
            loss, metrics = fused_rl.policy_loss(
                logits, r["targets"], r["adv"], old_logprobs=r["old"], mask=r["mask"],
                ref_logprobs=r["ref"], beta=0.1, kl_bias_correction=not plain,
                is_weights=None if plain else r["is_w"], surrogate=surrogate.split()[-1],
                backend="triton",
            )  # fmt: skip
            loss.backward()
        counts[surrogate] = c.total
        assert plain or "is_weight_max" in metrics  # the IS metrics come from the reduction
    assert len(set(counts.values())) == 1, counts


# ----------------------------------------------------------------------------- top entropy


def _trl_high_entropy_mask(entropy, mask, rho):
    """TRL's ``get_high_entropy_mask`` (one process): threshold ``torch.quantile`` of the
    valid tokens' entropies at ``1 - rho``."""
    valid = entropy[mask.bool()].float()
    if valid.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    threshold = torch.quantile(valid, 1.0 - rho)
    return ((entropy * mask.float()) >= threshold) & mask.bool()


@pytest.mark.parametrize("rho", (0.0, 0.2, 0.5, 0.77, 1.0))
def test_top_entropy_tokens_match_trl(rho):
    from fused_rl.losses import top_entropy_tokens

    g = torch.Generator().manual_seed(3)
    for shape in ((3, 7), (1, 1), (4, 2)):
        entropy = torch.rand(shape, generator=g) * 3
        entropy[0, 0] = float("nan") if shape == (3, 7) else entropy[0, 0]  # at padding
        mask = torch.rand(shape, generator=g) > 0.3
        if shape == (3, 7):
            mask[0, 0] = False
            mask[1] = False  # a fully masked row
        got = top_entropy_tokens(entropy, mask, quantile=rho)
        assert torch.equal(got, _trl_high_entropy_mask(entropy, mask, rho)), (shape, rho)
    none = torch.zeros(2, 3, dtype=torch.bool)
    assert not top_entropy_tokens(torch.rand(2, 3), none, quantile=rho).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_entropy_quantile_matches_oracle(backend):
    """The policy term counts only the high-entropy tokens; the KL and the normaliser still
    count every token (TRL's order: entropy mask before IS and KL)."""
    r = _rollout(seed=4)
    rho = 0.4
    logits = r["logits"].clone().requires_grad_()
    loss, metrics = fused_rl.policy_loss(
        logits, r["targets"], r["adv"], old_logprobs=r["old"], ref_logprobs=r["ref"],
        mask=r["mask"], beta=0.1, eps_high=0.28, is_weights=r["is_w"],
        top_entropy_quantile=rho, backend=backend,
    )  # fmt: skip
    leaf = r["logits"].double().requires_grad_()
    with torch.no_grad():
        logsm = torch.log_softmax(leaf, -1)
        entropy = -(logsm.exp() * logsm).sum(-1)
    counted = r["mask"] & (r["targets"] != -100)
    keep = _trl_high_entropy_mask(entropy, counted, rho)
    assert 0 < keep.sum() < counted.sum()
    want, _ = _oracle(r, leaf, surrogate="ppo", beta=0.1, is_weights=r["is_w"] * keep)
    assert_rel(loss, want, FP32_TOL, "loss")
    (grad,) = torch.autograd.grad(loss, logits)
    (exact,) = torch.autograd.grad(want, leaf)
    assert_rel(grad, exact, FP32_TOL, "gradient")
    # from hidden states: the same selection
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(DEVICE)
    kw = dict(old_logprobs=r["old"], mask=r["mask"], top_entropy_quantile=rho, backend=backend)
    lin, _ = fused_rl.linear_policy_loss(hidden, weight, r["targets"], r["adv"], **kw)
    mat, _ = fused_rl.policy_loss(F.linear(hidden, weight), r["targets"], r["adv"], **kw)
    assert_rel(lin, mat, FP32_TOL, "linear")
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        fused_rl.policy_loss(logits, r["targets"], r["adv"], top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="entropy"):
        fused_rl.policy_loss_from_logprobs(
            torch.randn(B, T, device=DEVICE), r["adv"], top_entropy_quantile=0.2
        )


# ----------------------------------------------------------------------------- off-policy mask


def _trl_off_policy_mask(adv, logp, sampled, mask, threshold):
    """TRL's ``GRPOTrainer.get_off_policy_mask`` (DeepSeek-V3.2's off-policy sequence mask):
    keep where ``A >= 0`` or the sequence's mean ``sampled - logp`` is at most ``threshold``."""
    kl = torch.nan_to_num(sampled - logp.detach(), nan=0.0)
    avg = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return (adv >= 0) | (avg <= threshold)


@pytest.mark.parametrize("threshold", (-0.5, 0.0, 0.3, 2.0))
def test_off_policy_sequence_mask_matches_trl(threshold):
    from fused_rl.losses import off_policy_sequence_mask

    g = torch.Generator().manual_seed(7)
    for shape in ((4, 6), (1, 1), (3, 2)):
        logp = torch.randn(shape, generator=g) - 2
        sampled = logp + torch.randn(shape, generator=g) * 0.6
        mask = torch.rand(shape, generator=g) > 0.3
        adv = torch.randn(shape[0], 1, generator=g)
        if shape == (4, 6):
            sampled[0, 1] = float("nan")  # a token the sampler could not score: counts 0
            mask[0, 1] = True
            sampled[1, 2], mask[1, 2] = float("inf"), False  # padding: never counts
            mask[2] = False  # a fully masked row: mean 0
            adv[3] = 0.0
        want = _trl_off_policy_mask(adv, logp, sampled, mask.float(), threshold)
        got = off_policy_sequence_mask(logp, sampled, adv.expand(shape), mask,
                                       threshold=threshold)  # fmt: skip
        assert torch.equal(got, want.expand(shape)), (shape, threshold)


def _off_policy_inputs(r, seed=6):
    """Rollout log-probs that differ from the old ones, and (B, T) advantages of both signs
    in every sequence, so the mask drops some tokens and keeps others."""
    g = torch.Generator().manual_seed(seed)
    rollout = r["old"] + (torch.randn(B, T, generator=g) * 0.4 + 0.3).to(DEVICE)
    adv = (torch.randn(B, T, generator=g) * 1.2).to(DEVICE)
    return rollout, adv


def _opsm_keep(r, leaf, rollout, adv, threshold):
    with torch.no_grad():
        logp = torch.log_softmax(leaf, -1).gather(-1, r["targets"].clamp(min=0)[..., None])[..., 0]
    counted = (r["mask"] & (r["targets"] != -100)).double()
    return _trl_off_policy_mask(adv.double(), logp, rollout.double(), counted, threshold)


OFF_POLICY_CASES = {
    "ppo+is+kl": (dict(beta=0.1, eps_high=0.28), dict(surrogate="ppo", beta=0.1)),
    "gspo": (dict(importance_sampling="sequence", eps_high=0.28),
             dict(surrogate="ppo", sequence=True)),
    "cispo": (dict(surrogate="cispo", eps_high=0.28), dict(surrogate="cispo")),
    "vespo+is": (dict(surrogate="vespo"), dict(surrogate="vespo")),
}  # fmt: skip


@pytest.mark.parametrize("case", OFF_POLICY_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_off_policy_mask_matches_oracle(backend, case):
    """The mask drops the policy term of the negative-advantage tokens of the sequences that
    drifted (the mean of ``rollout_logprobs - logp``); the KL, the normaliser, the IS metrics
    and VESPO's weight still see every token."""
    ours_kw, oracle_kw = OFF_POLICY_CASES[case]
    r = _rollout(seed=8)
    rollout, adv = _off_policy_inputs(r)
    r = {**r, "adv": adv}
    leaf = r["logits"].double().requires_grad_()
    with torch.no_grad():
        logp = torch.log_softmax(leaf, -1).gather(-1, r["targets"].clamp(min=0)[..., None])
    counted = r["mask"] & (r["targets"] != -100)
    drift = torch.where(counted, rollout.double() - logp[..., 0], 0.0).sum(1) / counted.sum(1)
    threshold = float(drift[:2].mean())  # between the two counted sequences' drifts
    keep = _opsm_keep(r, leaf, rollout, adv, threshold)
    assert 0 < (~keep & counted).sum() < counted.sum()
    is_w = r["is_w"]
    want, want_metrics = _oracle_logp_of(r, leaf, is_weights=is_w, keep=keep, **oracle_kw)
    kw = dict(old_logprobs=r["old"], rollout_logprobs=rollout, mask=r["mask"], is_weights=is_w,
              off_policy_mask_threshold=threshold, backend=backend, **ours_kw)  # fmt: skip
    if ours_kw.get("beta"):
        kw["ref_logprobs"] = r["ref"]
    logits = r["logits"].clone().requires_grad_()
    loss, metrics = fused_rl.policy_loss(logits, r["targets"], adv, **kw)
    up = torch.rand(()) + 0.5
    (grad,) = torch.autograd.grad(loss, logits, up.to(DEVICE))
    (exact,) = torch.autograd.grad(want, leaf, up.double().to(DEVICE))
    assert_rel(loss, want, FP32_TOL, "loss")
    assert_rel(grad, exact, FP32_TOL, "gradient")
    for name, value in want_metrics.items():
        if name != "vespo_phi_seq_mean":  # the oracle's: one phi per sequence, (B,) advantages
            assert_rel(metrics[name], value, FP32_TOL, name)
    dropped = (~keep & counted).sum() / counted.sum()
    assert_rel(metrics["off_policy_masked_frac"], dropped, FP32_TOL, "off_policy_masked_frac")
    # from log-probs and from hidden states: the same mask
    lp = logp[..., 0].float().requires_grad_()
    from_lp, _ = fused_rl.policy_loss_from_logprobs(
        lp, adv, **{k: v for k, v in kw.items() if k != "mask"},
        mask=counted,
    )  # fmt: skip
    assert_rel(from_lp, want, FP32_TOL, "from log-probs")
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, H, generator=g).to(DEVICE).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(DEVICE)
    lin, lin_metrics = fused_rl.linear_policy_loss(hidden, weight, r["targets"], adv, **kw)
    mat, mat_metrics = fused_rl.policy_loss(F.linear(hidden, weight), r["targets"], adv, **kw)
    assert_rel(lin, mat, FP32_TOL, "linear")
    assert_rel(lin_metrics["off_policy_masked_frac"], mat_metrics["off_policy_masked_frac"], 0, "")


def _oracle_logp_of(r, leaf, **kw):
    logp = torch.log_softmax(leaf, -1).gather(-1, r["targets"].clamp(min=0)[..., None])[..., 0]
    return _oracle_logp(r, logp, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_selection_leaves_vespo_weight_alone(backend):
    """The top-entropy selection multiplies VESPO's policy term (TRL's ``per_token_loss *
    entropy_mask``), never enters its sequence weight ``phi`` (which sees every token)."""
    r = _rollout(seed=9)
    leaf = r["logits"].double().requires_grad_()
    with torch.no_grad():
        logsm = torch.log_softmax(leaf, -1)
        entropy = -(logsm.exp() * logsm).sum(-1)
    counted = r["mask"] & (r["targets"] != -100)
    keep = _trl_high_entropy_mask(entropy, counted, 0.4)
    want, want_metrics = _oracle(r, leaf, surrogate="vespo", is_weights=r["is_w"], keep=keep)
    logits = r["logits"].clone().requires_grad_()
    loss, metrics = fused_rl.policy_loss(
        logits, r["targets"], r["adv"], old_logprobs=r["old"], mask=r["mask"],
        is_weights=r["is_w"], surrogate="vespo", top_entropy_quantile=0.4, backend=backend,
    )  # fmt: skip
    assert_rel(loss, want, FP32_TOL, "loss")
    assert_rel(metrics["vespo_phi_seq_mean"], want_metrics["vespo_phi_seq_mean"], FP32_TOL, "")
    (grad,) = torch.autograd.grad(loss, logits)
    (exact,) = torch.autograd.grad(want, leaf)
    assert_rel(grad, exact, FP32_TOL, "gradient")


def test_off_policy_mask_errors():
    r = _rollout()
    logits, t, adv = r["logits"], r["targets"], r["adv"]
    with pytest.raises(ValueError, match="rollout_logprobs is read only by the off-policy"):
        fused_rl.policy_loss(logits, t, adv, rollout_logprobs=r["old"])
    with pytest.raises(ValueError, match="rollout_logprobs must have shape"):
        fused_rl.policy_loss(logits, t, adv, rollout_logprobs=r["old"][:, :2],
                             off_policy_mask_threshold=0.1)  # fmt: skip
    for bad, err in ((float("nan"), ValueError), ("0.1", TypeError), (True, TypeError)):
        with pytest.raises(err, match="off_policy_mask_threshold"):
            fused_rl.policy_loss(logits, t, adv, off_policy_mask_threshold=bad)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        fused_rl.policy_loss(logits.clone().requires_grad_(), t, adv, grad_in_forward=True,
                             off_policy_mask_threshold=0.1)  # fmt: skip


def test_off_policy_mask_on_policy_keeps_every_token():
    """Without old / rollout log-probs the drift is 0: nothing is dropped for a threshold
    >= 0, every negative-advantage token for one below 0."""
    r = _rollout()
    kw = dict(mask=r["mask"], backend="reference")
    plain, _ = fused_rl.policy_loss(r["logits"], r["targets"], r["adv"], **kw)
    kept, m = fused_rl.policy_loss(r["logits"], r["targets"], r["adv"],
                                   off_policy_mask_threshold=0.0, **kw)  # fmt: skip
    assert_rel(kept, plain, 0, "loss")
    assert m["off_policy_masked_frac"] == 0
    _, m = fused_rl.policy_loss(r["logits"], r["targets"], r["adv"],
                                off_policy_mask_threshold=-1e-3, **kw)  # fmt: skip
    counted = r["mask"] & (r["targets"] != -100)
    negative = (r["adv"][:, None] < 0) & counted
    assert_rel(m["off_policy_masked_frac"], negative.sum() / counted.sum(), FP32_TOL, "")


@pytest.mark.parametrize("backend", BACKENDS)
def test_luspo_is_gspo_with_length_weighted_sequences(backend):
    """TRL's / Liger's LUSPO, ``mean_i(n_i * l_i)`` with ``l_i`` GSPO's sequence loss, is
    ``importance_sampling="sequence", loss_agg="seq-mean-token-sum"``."""
    r = _rollout(seed=5)
    logits = r["logits"].clone().requires_grad_()
    loss, _ = fused_rl.policy_loss(
        logits, r["targets"], r["adv"], old_logprobs=r["old"], mask=r["mask"],
        importance_sampling="sequence", loss_agg="seq-mean-token-sum", eps_low=0.2,
        eps_high=0.28, backend=backend,
    )  # fmt: skip
    leaf = r["logits"].double().requires_grad_()
    m = (r["mask"] & (r["targets"] != -100)).double()
    logp = torch.log_softmax(leaf, -1).gather(-1, r["targets"].clamp(min=0)[..., None])[..., 0]
    old = torch.where(m > 0, r["old"].double(), logp.detach())
    n = m.sum(1)
    rho = torch.exp(((logp - old) * m).sum(1) / n.clamp(min=1))
    adv = r["adv"].double()
    per_seq = -torch.minimum(rho * adv, rho.clamp(0.8, 1.28) * adv)
    want = (n * per_seq).mean()
    assert_rel(loss, want, FP32_TOL, "loss")
    assert_rel(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(want, leaf)[0],
               FP32_TOL, "gradient")  # fmt: skip
