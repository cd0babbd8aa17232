"""fused_rl.compat.verl.policy_loss: verl's policy-loss registry (``get_policy_loss_fn``,
``register_policy_loss``) and the entries that map onto one fused surrogate (vanilla, gspo,
sapo, gpg, cispo) against a float64 transcription of verl 0.9.1's ``core_algos`` formulas,
written here from the math (verl's ``agg_loss``, the GSPO-token ratio clamped at 10, the +-20
log-ratio clamp, SAPO's gate, CISPO's two-sided band, the rollout IS weights, the metrics):
values, gradients w.r.t. ``log_prob`` under a random upstream gradient, metrics, errors. The
other entries: tests/test_compat_verl_policy_loss_composed.py."""

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, clamp_in, rel_err

from fused_rl.compat import verl

# ----------------------------------------------------------------------------- the oracle


def o_masked_sum(x, m, axis=None):
    return (torch.where(m.bool(), x, 0.0) * m).sum(axis=axis)


def o_masked_mean(x, m):
    return o_masked_sum(x, m) / (m.sum() + 1e-8)


def o_agg(L, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
          loss_scale_factor=None):  # fmt: skip
    """verl 0.9.1's agg_loss."""
    if mode == "token-mean":
        n = m.sum() if batch_num_tokens is None else batch_num_tokens
        return o_masked_sum(L, m) / n * dp_size
    if mode == "token-sum":
        return o_masked_sum(L, m) * dp_size
    counts = m.sum(-1)
    per_seq = (L * m).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / (counts + 1e-8)
    present = (counts > 0).float()  # verl: .float()
    g = present.sum() if global_batch_size is None else global_batch_size
    loss = o_masked_sum(per_seq, present) / g * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (m.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def o_policy(name, old, lp, adv, m, mode, cfg, w):
    """verl 0.9.1's compute_policy_loss_<name>: (loss, metrics as floats)."""
    low = cfg.get("clip_ratio_low", 0.2)
    high = cfg.get("clip_ratio_high", 0.2)
    ratio_cfg = cfg.get("clip_ratio", 0.2)
    low, high = (ratio_cfg if low is None else low), (ratio_cfg if high is None else high)
    info = cfg.get("global_batch_info", {})
    d = lp - old
    metrics = {}
    if name == "vanilla":
        c = cfg.get("clip_ratio_c", 3.0)
        dc = clamp_in(d, -20.0, 20.0)
        r = torch.exp(dc)
        L1, L2 = -adv * r, -adv * clamp_in(r, 1 - low, 1 + high)
        Lc = torch.maximum(L1, L2)
        L3 = -adv * c
        L = torch.where(adv < 0, torch.min(L3, Lc), Lc)
        metrics = {
            "actor/pg_clipfrac": o_masked_mean((L2 > L1).double(), m),
            "actor/ppo_kl": o_masked_mean(-dc, m),
            "actor/pg_clipfrac_lower": o_masked_mean((Lc > L3).double() * (adv < 0), m),
        }
    elif name == "gspo":
        seq = (d * m).sum(-1) / m.sum(-1).clamp(min=1)
        log_s = clamp_in(lp - lp.detach() + seq.detach()[:, None], hi=10.0)
        s = torch.exp(log_s)
        L1, L2 = -adv * s, -adv * clamp_in(s, 1 - low, 1 + high)
        L = torch.maximum(L1, L2)
        metrics = {
            "actor/pg_clipfrac": o_masked_mean((L2 > L1).double(), m),
            "actor/ppo_kl": o_masked_mean(-d, m),
            "actor/pg_clipfrac_lower": 0.0,
        }
    elif name == "sapo":
        mode = "seq-mean-token-mean"
        dc = clamp_in(d, -20.0, 20.0)
        r = torch.exp(dc)
        as_adv = lambda v: torch.as_tensor(v, dtype=adv.dtype)  # noqa: E731  (verl's taus)
        tau = torch.where(
            adv > 0, as_adv(cfg.get("tau_pos", 1.0)), as_adv(cfg.get("tau_neg", 1.05))
        )
        L = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv
        metrics = {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": o_masked_mean(-dc, m),
                   "actor/pg_clipfrac_lower": 0.0}  # fmt: skip
    elif name == "cispo":
        dc = clamp_in(d, -20.0, 20.0)
        r = torch.exp(dc)
        rc = clamp_in(r, 1 - low, 1 + high)
        L = -rc.detach() * adv * lp
        metrics = {
            "actor/pg_clipfrac": o_masked_mean((r != rc).double(), m),
            "actor/ppo_kl": o_masked_mean(-dc, m),
            "actor/pg_clipfrac_lower": 0.0,
        }
    else:  # gpg
        L = -lp * adv
    if w is not None:
        L = L * w
    loss = o_agg(L, m, mode, **info)
    return loss, {k: float(v.detach()) if torch.is_tensor(v) else v for k, v in metrics.items()}


# ----------------------------------------------------------------------------- inputs

B, T = 3, 6


def make_case(seed=0, dtype=torch.float64, far=True, gspo_clamp=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    if far:  # ratios far from 1, past verl's +-20 log-ratio clamp
        old[0, 1] = lp[0, 1] - 25.0  # log-ratio +25
        old[1, 2] = lp[1, 2] + 30.0  # log-ratio -30
        old[2, 0] = lp[2, 0] + 2.0
        lp[0, 4], old[0, 4] = -21.0, -1.0  # exactly at the bound -20: the gradient passes
    if gspo_clamp:  # a sequence whose mean log-ratio passes GSPO's clamp at 10
        old[0] = lp[0] - 12.0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[1] = -adv[1].abs()
    adv[2, :3] = 0.0  # zero advantages
    adv[2, 3:] = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)  # per-token
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 4:] = 0.0  # padding
    mask[2, 1] = 0.0  # a hole
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 1.5 + 0.25
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(old), cast(lp), cast(adv), cast(mask), cast(w)


CONFIG = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
          "tau_pos": 1.0, "tau_neg": 1.05, "global_batch_info": {}}  # fmt: skip


def run_pair(name, case, mode, cfg, with_w=True, seed=1):
    """The adapter and the oracle on the same inputs: ((loss, grad, metrics), (...))."""
    old, lp, adv, mask, w = case
    weights = w if with_w else None
    upstream = torch.randn((), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    fn = verl.get_policy_loss_fn(name)
    x = lp.clone().requires_grad_()
    kwargs = {} if mode is None else {"loss_agg_mode": mode}
    loss, metrics = fn(old, x, adv, mask, config=cfg, rollout_is_weights=weights, **kwargs)
    loss.backward(upstream.to(loss.dtype))
    ref_mode = mode or ("seq-mean-token-mean" if name in ("gspo", "sapo") else "token-mean")
    y = lp.double().clone().requires_grad_()
    plain_cfg = cfg if isinstance(cfg, dict) else vars(cfg)
    ref_loss, ref_metrics = o_policy(
        name, old.double(), y, adv.double(), mask.double(), ref_mode, plain_cfg,
        None if weights is None else weights.double(),
    )  # fmt: skip
    ref_loss.backward(upstream)
    return (loss, x.grad, metrics), (ref_loss, y.grad, ref_metrics)


def check(ours, ref, tol):
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = ours, ref
    # the loss sums O(1) terms of both signs: its error is relative to their scale, not to
    # a sum that may cancel to ~1e-4
    assert abs(loss.item() - ref_loss.item()) <= tol * max(abs(ref_loss.item()), 1.0), (
        loss.item(),
        ref_loss.item(),
    )
    assert rel_err(grad, ref_grad) <= tol, (grad, ref_grad)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in metrics.items():
        assert isinstance(value, float), key
        assert abs(value - ref_metrics[key]) <= 10 * tol, (key, value, ref_metrics[key])


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("name", ["gspo", "sapo", "gpg", "cispo", "vanilla"])
@pytest.mark.parametrize("mode", [None, "token-mean", "seq-mean-token-sum-norm"])
def test_against_the_oracle(name, mode):
    case = make_case(seed=3, gspo_clamp=name == "gspo")
    check(*run_pair(name, case, mode, CONFIG), F64_TOL)


@pytest.mark.parametrize("name", ["gspo", "sapo", "cispo", "gpg"])
def test_global_batch_info_and_modes(name):
    """verl's global-batch arguments (dp_size, batch_num_tokens, global_batch_size,
    loss_scale_factor) and the other modes, without IS weights."""
    case = make_case(seed=4)
    infos = [
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 31}),
        ("token-sum", {"dp_size": 4}),
        ("seq-mean-token-sum", {"dp_size": 2, "global_batch_size": 5}),
        ("seq-mean-token-mean", {"dp_size": 2, "global_batch_size": torch.tensor(7)}),
        ("seq-mean-token-sum-norm", {"dp_size": 2, "global_batch_size": 5, "loss_scale_factor": 9}),
    ]
    for mode, info in infos:
        cfg = {**CONFIG, "global_batch_info": info}
        if name == "sapo" and "global_batch_size" not in info:  # SAPO is always a seq-mean
            with pytest.raises(ValueError, match="global_batch_size is required"):
                run_pair(name, case, mode, cfg, with_w=False)
            continue
        check(*run_pair(name, case, mode, cfg, with_w=False), F64_TOL)


@pytest.mark.parametrize("name", ["gspo", "sapo", "cispo"])
def test_fp32_and_config_objects(name):
    """fp32 inputs (fp32 loss), an attribute config with verl's ActorConfig fields, and a
    config that leaves fields out (ActorConfig's defaults)."""
    case = make_case(seed=5, dtype=torch.float32)

    @dataclass
    class ActorConfig:  # the fields verl's dataclass has, with its defaults
        clip_ratio: float = 0.2
        clip_ratio_low: float | None = 0.15
        clip_ratio_high: float | None = None
        clip_ratio_c: float = 3.0
        tau_pos: float = 1.3
        tau_neg: float = 0.9
        global_batch_info: dict = field(default_factory=dict)

    ours, ref = run_pair(name, case, None, ActorConfig())
    assert ours[0].dtype == torch.float32
    check(ours, ref, FP32_TOL)
    check(*run_pair(name, make_case(seed=6), None, SimpleNamespace(clip_ratio=0.3)), F64_TOL)
    check(*run_pair(name, make_case(seed=6), None, {}), F64_TOL)


def test_cispo_wide_band():
    """verl's example band (clip_ratio_low=10: no lower bound; high 0.2), log-ratios past +-20."""
    cfg = {**CONFIG, "clip_ratio_low": 10.0, "clip_ratio_high": 0.2}
    check(*run_pair("cispo", make_case(seed=7), None, cfg), F64_TOL)


# ----------------------------------------------------------------------------- the clamps


def test_log_ratio_clamp_zeroes_the_gradient():
    """verl clamps log_prob - old_log_prob to [-20, 20]: SAPO's (and vanilla's) gradient is 0
    where the clamp is active, passes at exactly 20; CISPO's weight is detached, so its
    gradient -w A is unchanged there."""
    old, lp, adv, mask, _ = make_case(seed=8)
    adv = adv.abs() + 0.5  # every counted token has a gradient
    for name in ("sapo", "vanilla", "cispo"):
        x = lp.clone().requires_grad_()
        loss, _ = verl.get_policy_loss_fn(name)(old, x, adv, mask, config=CONFIG)
        loss.backward()
        if name == "cispo":
            assert x.grad[0, 1] != 0 and x.grad[1, 2] != 0
        else:
            assert x.grad[0, 1] == 0 and x.grad[1, 2] == 0, name
            if name == "sapo":  # log-ratio exactly -20... +20: inside the closed interval
                assert x.grad[0, 4] != 0


def test_gspo_clamp_at_10():
    """GSPO's log sequence ratio is clamped at 10 (upper only): the clamped sequence's tokens
    get no gradient, the others theirs."""
    old, lp, adv, mask, _ = make_case(seed=9, far=False, gspo_clamp=True)
    adv = -(adv.abs() + 0.5)  # A < 0: the unclipped branch, so only the clamp can zero it
    x = lp.clone().requires_grad_()
    loss, _ = verl.compute_policy_loss_gspo(old, x, adv, mask, config=CONFIG)
    loss.backward()
    assert (x.grad[0] == 0).all()
    assert (x.grad[1:][mask[1:] != 0] != 0).all()
    y = lp.clone().requires_grad_()
    ref, _ = o_policy("gspo", old, y, adv, mask, "seq-mean-token-mean", CONFIG, None)
    ref.backward()
    assert rel_err(loss, ref) <= F64_TOL and rel_err(x.grad, y.grad) <= F64_TOL


def test_gspo_token_weights_not_spread():
    """verl's GSPO-token ratio weighs each token by its own IS weight (TRL's sequence ratio
    would spread their mean over the sequence): the gradient is -A s w_t / (n G)."""
    old, lp, adv, mask, w = make_case(seed=10, far=False)
    x = lp.clone().requires_grad_()
    loss, _ = verl.compute_policy_loss_gspo(old, x, adv, mask, config={"clip_ratio": 100.0},
                                            rollout_is_weights=w)  # fmt: skip
    loss.backward()
    seq = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    s = torch.exp(seq)[:, None]
    expected = -adv * s * w * mask / (mask.sum(-1, keepdim=True) + 1e-8) / B
    assert rel_err(x.grad, expected) <= F64_TOL


def test_is_weight_shapes_and_empty_rows():
    """(B, 1) and (B,) IS weights broadcast like (B, T) ones; a fully masked row neither
    counts in the seq-mean nor gives NaN."""
    old, lp, adv, mask, w = make_case(seed=11)
    mask[2] = 0.0
    per_seq = w[:, :1]
    for name in ("gspo", "sapo", "cispo", "gpg"):
        fn = verl.get_policy_loss_fn(name)
        a, _ = fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=per_seq.expand(B, T))
        b, _ = fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=per_seq)
        c, _ = fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=per_seq[:, 0])
        ref, _ = o_policy(name, old, lp, adv, mask, "seq-mean-token-mean" if name in
                          ("gspo", "sapo") else "token-mean", CONFIG, per_seq)  # fmt: skip
        assert torch.isfinite(a)
        for x in (a, b, c):
            assert rel_err(x, ref) <= F64_TOL, name


def test_bool_mask_and_masked_nan():
    """A bool response_mask; NaN log-probs at masked positions never reach the loss."""
    old, lp, adv, mask, w = make_case(seed=12, far=False)
    poisoned = lp.clone()
    poisoned[mask == 0] = float("nan")
    for name in ("gspo", "sapo", "cispo", "gpg"):
        fn = verl.get_policy_loss_fn(name)
        x = poisoned.clone().requires_grad_()
        loss, metrics = fn(old, x, adv, mask.bool(), config=CONFIG, rollout_is_weights=w)
        loss.backward()
        ref, ref_metrics = o_policy(name, old, lp, adv, mask, "seq-mean-token-mean" if name in
                                    ("gspo", "sapo") else "token-mean", CONFIG, w)  # fmt: skip
        assert rel_err(loss, ref) <= F64_TOL, name
        assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all()


def test_output_dtype_is_verls():
    """bf16 log-probs: the loss comes out in the dtype verl's arithmetic gives (the seq-mean
    modes promote to fp32; token-mean with a bf16 mask stays bf16)."""
    old, lp, adv, mask, _ = make_case(seed=13, far=False)
    bf = lambda x: x.to(torch.bfloat16)  # noqa: E731
    cases = (("gpg", "token-mean", bf(mask)), ("cispo", "token-mean", mask.bool()),
             ("sapo", None, bf(mask)), ("gspo", "token-mean", mask.float()))  # fmt: skip
    for name, mode, m in cases:
        kwargs = {} if mode is None else {"loss_agg_mode": mode}
        loss, _ = verl.get_policy_loss_fn(name)(bf(old), bf(lp), bf(adv), m, config=CONFIG,
                                                **kwargs)  # fmt: skip
        ref, _ = o_policy(name, bf(old), bf(lp), bf(adv), m, mode or "seq-mean-token-mean",
                          CONFIG, None)  # fmt: skip
        assert loss.dtype == ref.dtype, (name, loss.dtype, ref.dtype)
        assert rel_err(loss, ref) <= 2e-2, name


def test_empty_batch_is_nan_as_verl():
    old, lp, adv, mask, _ = make_case(seed=14)
    zero = torch.zeros_like(mask)
    for name in ("gspo", "cispo", "gpg"):
        loss, _ = verl.get_policy_loss_fn(name)(old, lp, adv, zero, config=CONFIG)
        ref, _ = o_policy(name, old, lp, adv, zero, "seq-mean-token-mean" if name == "gspo"
                          else "token-mean", CONFIG, None)  # fmt: skip
        assert torch.isnan(loss) and torch.isnan(ref), name


# ----------------------------------------------------------------------------- the registry


def test_registry():
    assert verl.get_policy_loss_fn("vanilla") is verl.compute_policy_loss_vanilla
    for name in ("gspo", "sapo", "gpg", "cispo"):
        assert verl.get_policy_loss_fn(name) is getattr(verl, f"compute_policy_loss_{name}")

    @verl.register_policy_loss("custom")
    def custom(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
               config=None, rollout_is_weights=None):  # fmt: skip
        return log_prob.sum(), {}

    try:
        assert verl.get_policy_loss_fn("custom") is custom
    finally:
        del verl.POLICY_LOSS_REGISTRY["custom"]


@pytest.mark.parametrize("name", ["bypass_mode"])
def test_not_built_yet(name):
    with pytest.raises(NotImplementedError, match=rf"'{name}'.*not built in fused_rl yet"):
        verl.get_policy_loss_fn(name)


def test_unknown_name():
    with pytest.raises(
        ValueError, match=r"Unsupported loss mode: ppo\. Supported modes are: "
    ) as e:
        verl.get_policy_loss_fn("ppo")
    for name in verl.VERL_POLICY_LOSSES:
        assert repr(name) in str(e.value)


def test_signatures_and_defaults():
    import inspect

    params = ["old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode",
              "config", "rollout_is_weights"]  # fmt: skip
    defaults = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean",
                "gpg": "token-mean", "cispo": "token-mean", "vanilla": "token-mean"}  # fmt: skip
    for name, mode in defaults.items():
        sig = inspect.signature(verl.get_policy_loss_fn(name))
        assert list(sig.parameters) == params, name
        assert sig.parameters["loss_agg_mode"].default == mode
        assert sig.parameters["config"].default is None
        assert sig.parameters["rollout_is_weights"].default is None


def test_errors():
    old, lp, adv, mask, w = make_case(seed=15)
    for name in ("gspo", "sapo", "gpg", "cispo"):
        fn = verl.get_policy_loss_fn(name)
        with pytest.raises(AssertionError, match="config"):
            fn(old, lp, adv, mask)
        with pytest.raises(TypeError, match="global_batch_info"):
            fn(old, lp, adv, mask, config={"global_batch_info": {"dp": 2}})
        with pytest.raises(ValueError, match="rollout_is_weights"):
            fn(old, lp, adv, mask, config=CONFIG, rollout_is_weights=w[:, :2])
        with pytest.raises(ValueError, match="advantages"):
            fn(old, lp, adv[:, :3], mask, config=CONFIG)
    cfg = {"global_batch_info": {"dp_size": 2}}
    with pytest.raises(ValueError, match="batch_num_tokens is required"):
        verl.compute_policy_loss_cispo(old, lp, adv, mask, "token-mean", cfg)
    with pytest.raises(ValueError, match="global_batch_size is required"):
        verl.compute_policy_loss_gspo(old, lp, adv, mask, config=cfg)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        verl.compute_policy_loss_gpg(old, lp, adv, mask, "mean", CONFIG)
    with pytest.raises(ValueError, match="config.tau_neg"):
        verl.compute_policy_loss_sapo(old, lp, adv, mask, config={"tau_neg": 0.0})
    with pytest.raises(ValueError, match="config.clip_ratio_low"):
        verl.compute_policy_loss_cispo(old, lp, adv, mask, config={"clip_ratio_low": -0.1})
