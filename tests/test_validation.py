"""One bad argument, one answer: every public op that takes an argument rejects the same bad
value with the same exception type, naming the argument (``fused_rl._validation``).

Each op below is called with small valid inputs and one argument replaced. Arguments are
grouped by what they are (a non-negative hyper-parameter, a mask, a KL estimator, ...), so a
group's bad values are tried against every op and every parameter of that group.
"""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
from conftest import DEVICE

import fused_rl
from fused_rl import _validation as V
from fused_rl._agg import check_loss_agg

B, T, V_SIZE = 2, 4, 5
NAN, INF = float("nan"), float("inf")


def _x(*shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


# op -> (positional args, valid keyword args); every op works on (B, T) token tensors
INPUTS = {
    "policy_loss": lambda: (
        (_x(B, T, V_SIZE), torch.zeros(B, T, dtype=torch.long), torch.ones(B)),
        {},
    ),
    "policy_loss_from_logprobs": lambda: ((_x(B, T), torch.ones(B)), {}),
    "value_loss": lambda: ((_x(B, T), _x(B, T), _x(B, T)), {}),
    "ppo_loss": lambda: (tuple(_x(B, T) for _ in range(6)), {}),
    "masked_sum": lambda: ((_x(B, T),), {}),
    "masked_mean": lambda: ((_x(B, T),), {}),
    "masked_var": lambda: ((_x(B, T),), {}),
    "masked_whiten": lambda: ((_x(B, T),), {}),
    "gae": lambda: ((_x(B, T), _x(B, T)), {"gamma": 0.99, "lam": 0.95}),
    "kl_penalized_rewards": lambda: ((_x(B), _x(B, T), _x(B, T)), {"kl_coef": 0.1}),
    "group_advantages": lambda: ((_x(B * T),), {"group_size": T}),
    "rloo_advantages": lambda: ((_x(B * T),), {"group_size": T}),
    "kl_estimate": lambda: ((_x(B, T), _x(B, T)), {}),
    "rollout_is_weights": lambda: ((_x(B, T), _x(B, T)), {}),
    "truncated_logprobs": lambda: ((_x(B, T, V_SIZE), torch.zeros(B, T, dtype=torch.long)), {}),
    "gaussian_logprob": lambda: ((_x(B, T), _x(B, T).exp(), _x(B, T)), {}),
    "gaussian_entropy": lambda: ((_x(B, T).exp(),), {}),
    "token_logprobs": lambda: ((_x(B, T, V_SIZE), torch.zeros(B, T, dtype=torch.long)), {}),
    "token_entropy": lambda: ((_x(B, T, V_SIZE),), {}),
    "token_stats": lambda: ((_x(B, T, V_SIZE), torch.zeros(B, T, dtype=torch.long)), {}),
    "token_kl": lambda: ((_x(B, T, V_SIZE), _x(B, T, V_SIZE) * 0.5), {}),
    "distill_loss": lambda: ((_x(B, T, V_SIZE), _x(B, T, V_SIZE) * 0.5), {}),
    "linear_distill_loss": lambda: ((_x(B, T, 3), _x(V_SIZE, 3), _x(B, T, 4), _x(V_SIZE, 4)), {}),
    "linear_token_logprobs": lambda: (
        (_x(B, T + 1, 3), _x(V_SIZE, 3), torch.zeros(B, T, dtype=torch.long)),
        {},
    ),
    "linear_token_stats": lambda: (
        (_x(B, T + 1, 3), _x(V_SIZE, 3), torch.zeros(B, T, dtype=torch.long)),
        {},
    ),
    "linear_policy_loss": lambda: (
        (_x(B, T + 1, 3), _x(V_SIZE, 3), torch.zeros(B, T, dtype=torch.long), torch.ones(B)),
        {},
    ),
}


def _params(op: str) -> set[str]:
    return set(inspect.signature(getattr(fused_rl, op)).parameters)


def _call(op: str, **change):
    args, kwargs = INPUTS[op]()
    names = list(inspect.signature(getattr(fused_rl, op)).parameters)
    args = list(args)
    for name, value in change.items():
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return getattr(fused_rl, op)(*args, **kwargs)


# group -> (its parameter names, [(id, bad value, expected error)]); a callable bad value is
# built from the (B, T) shape of the op's token tensors
GROUPS = {
    "nonnegative": (
        # hyper-parameters that are finite numbers >= 0
        (
            "eps",
            "clip",
            "epsilon",
            "value_clip_range",
            "value_coeff",
            "kl_coef",
            "eps_low",
            "eps_high",
        ),  # fmt: skip
        [
            ("True", True, TypeError),
            ("-1", -1.0, ValueError),
            ("nan", NAN, ValueError),
            ("inf", INF, ValueError),
            ("str", "0.1", TypeError),
            ("tensor", lambda: torch.tensor(0.1), TypeError),
        ],
    ),
    "max_length": (
        ("max_length",),
        [
            ("True", True, TypeError),
            ("0", 0, ValueError),
            ("-1", -1, ValueError),
            ("1.5", 1.5, TypeError),
            ("4.0", 4.0, TypeError),
        ],
    ),
    "num_items": (
        ("num_items",),
        [
            ("0", 0, ValueError),
            ("-3", -3.0, ValueError),
            ("nan", NAN, ValueError),
            ("inf", INF, ValueError),
            ("True", True, TypeError),
            ("str", "8", TypeError),
            ("tensor-2", lambda: torch.ones(2), ValueError),
            ("tensor-bool", lambda: torch.tensor(True), TypeError),
        ],
    ),
    "loss_agg": (("loss_agg",), [("bogus", "bogus", ValueError), ("None", None, ValueError)]),
    "mask": (
        ("mask", "padding_masks", "value_padding_masks"),
        [
            ("complex", lambda: torch.ones(B, T, dtype=torch.complex64), TypeError),
            ("shape", lambda: torch.ones(B, T + 1, dtype=torch.bool), ValueError),
            ("transposed", lambda: torch.ones(T, B, dtype=torch.bool), ValueError),
            ("list", lambda: [[True] * T] * B, TypeError),
        ],
    ),
    "unit_interval": (
        ("gamma", "lam"),
        [
            ("True", True, TypeError),
            ("-0.1", -0.1, ValueError),
            ("1.5", 1.5, ValueError),
            ("nan", NAN, ValueError),
            ("tensor", lambda: torch.tensor(0.9), TypeError),
        ],
    ),
    "positive": (
        ("temperature",),
        [
            ("True", True, TypeError),
            ("0", 0.0, ValueError),
            ("-1", -1.0, ValueError),
            ("nan", NAN, ValueError),
            ("inf", INF, ValueError),
            ("tensor", lambda: torch.tensor(0.7), TypeError),
        ],
    ),
    "group_size": (
        ("group_size",),
        [("True", True, TypeError), ("0", 0, ValueError), ("2.0", 2.0, TypeError)],
    ),
    "kl_estimator": (("kl_estimator",), [("k4", "k4", ValueError)]),
    "backend": (("backend",), [("bogus", "bogus", ValueError), ("cuda:0", "cuda:0", ValueError)]),
}


def _cases():
    for group, (names, bad_values) in GROUPS.items():
        for op in INPUTS:
            for name in sorted(_params(op) & set(names)):
                for value_id, value, error in bad_values:
                    yield pytest.param(op, name, value, error, id=f"{group}-{op}-{name}={value_id}")


@pytest.mark.parametrize(("op", "name", "value", "error"), list(_cases()))
def test_same_bad_value_same_error(op, name, value, error):
    value = value() if callable(value) else value
    with pytest.raises(error, match=rf"\b{name}\b"):
        _call(op, **{name: value})


# accepted at the boundary, on every op that takes the argument
GOOD = {
    "eps": [0, 0.0, 1e-6],
    "max_length": [None, 1, T + 3],
    "num_items": [None, 1, 2.5, lambda: torch.tensor(3.0), lambda: torch.tensor([3])],
    "loss_agg": ["seq-mean-token-sum-norm"],
    "mask": [lambda: torch.ones(B, T, dtype=torch.int32), lambda: torch.rand(B, T)],
    "kl_coef": [0],
    "clip": [None, 0],
    "gamma": [0, 1],
}


def _good_cases():
    for name, values in GOOD.items():
        for op in INPUTS:
            if name in _params(op):
                for i, value in enumerate(values):
                    yield pytest.param(op, name, value, id=f"{op}-{name}-{i}")


@pytest.mark.parametrize(("op", "name", "value"), list(_good_cases()))
def test_boundary_values_accepted(op, name, value):
    value = value() if callable(value) else value
    out = _call(op, **{name: value}, backend="reference")
    first = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(first).all()


def test_every_group_reaches_an_op():
    """A renamed parameter would silently drop out of the parametrisation."""
    taken = set().union(*(_params(op) for op in INPUTS))
    for group, (names, _) in GROUPS.items():
        assert taken & set(names), group
    for name in GOOD:
        assert name in taken, name


# ----------------------------------------------------------------------------- validators


@pytest.mark.parametrize(
    ("check", "value", "error"),
    [
        (V.check_number, True, TypeError),
        (V.check_number, NAN, ValueError),
        (V.check_nonnegative, -0.0 - 1e-300, ValueError),
        (V.check_nonnegative, torch.tensor(1.0), TypeError),
        (V.check_positive, 0, ValueError),
        (V.check_positive, False, TypeError),
        (V.check_positive_int, True, TypeError),
        (V.check_positive_int, 3.0, TypeError),
        (V.check_positive_int, 0, ValueError),
        (V.check_unit_interval, math.nextafter(1.0, 2.0), ValueError),
    ],
)
def test_validators_reject(check, value, error):
    with pytest.raises(error, match="arg"):
        check(value, "arg")


def test_validators_accept():
    V.check_number(-3, "a")
    V.check_nonnegative(0, "a")
    V.check_nonnegative(None, "a", allow_none=True)
    V.check_positive(1e-30, "a")
    V.check_positive_int(1, "a")
    V.check_positive_int(None, "a", allow_none=True)
    V.check_positive_int(2, "a", minimum=2)
    V.check_unit_interval(0, "a")
    V.check_mask(None, "m", (2, 3), "x.shape")
    V.check_mask(torch.zeros(2, 3, dtype=torch.uint8), "m", (2, 3), "x.shape")
    check_loss_agg("token-mean", max_length=None, num_items=torch.tensor(5))
    with pytest.raises(ValueError, match=r"m must have shape x.shape = \(2, 3\)"):
        V.check_mask(torch.zeros(3, 2), "m", (2, 3), "x.shape")


# ----------------------------------------------------------------------------- renamed keywords

# op -> the deprecated keyword it still accepts for kl_estimator=
KL_ALIASES = {
    "policy_loss": "kl",
    "policy_loss_from_logprobs": "kl",
    "kl_estimate": "kind",
    "kl_penalized_rewards": "kind",
}


def _kl_call(op: str, backend: str, **kw):
    args, kwargs = INPUTS[op]()
    args = tuple(a.to(DEVICE) for a in args)
    if op.startswith("policy"):
        kwargs.update(ref_logprobs=_x(B, T).to(DEVICE) - 2.0, beta=0.1)
    else:  # a reference different from the policy
        args = (*args[:-1], args[-1] * 0.5 - 1.0)
    out = getattr(fused_rl, op)(*args, **kwargs, **kw, backend=backend)
    if isinstance(out, tuple):
        loss, metrics = out
        return torch.stack([loss, metrics["kl"]])
    return out


def test_every_kl_op_takes_kl_estimator():
    """One name for the KL estimator in the whole native API; the old ones are aliases only."""
    for op in INPUTS:
        params = _params(op)
        assert not params & {"kl", "kind"}, op
        if op in KL_ALIASES:
            assert "kl_estimator" in params, op


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", sorted(KL_ALIASES))
def test_deprecated_kl_alias_warns_and_matches(op, backend):
    old = KL_ALIASES[op]
    want = _kl_call(op, backend, kl_estimator="k2")
    with pytest.warns(FutureWarning, match=r"kl_estimator=") as record:
        got = _kl_call(op, backend, **{old: "k2"})
    assert len(record) == 1 and rf"{old}=" in str(record[0].message)
    assert record[0].filename == __file__  # points at the caller's line
    assert torch.equal(got, want)
    assert not torch.equal(want, _kl_call(op, backend))  # the default (k3 / k1) differs


@pytest.mark.parametrize("op", sorted(KL_ALIASES))
def test_deprecated_kl_alias_with_new_name_raises(op):
    old = KL_ALIASES[op]
    with pytest.raises(TypeError, match=rf"kl_estimator=.*\b{old}="):
        _kl_call(op, "reference", kl_estimator="k2", **{old: "k2"})


def test_policy_loss_module_kl_alias():
    from fused_rl.nn import PolicyLoss

    with pytest.warns(FutureWarning, match=r"PolicyLoss\(kl=\.\.\.\) is deprecated.*kl_estimator"):
        module = PolicyLoss(kl="k2", beta=0.1)
    assert module.config == {"kl_estimator": "k2", "beta": 0.1}
    (logits, targets, adv), _ = INPUTS["policy_loss"]()
    ref = _x(B, T) - 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning per forward call
        loss, _ = module(logits, targets, adv, ref_logprobs=ref)
    want, _ = fused_rl.policy_loss(
        logits, targets, adv, ref_logprobs=ref, beta=0.1, kl_estimator="k2"
    )
    assert torch.equal(loss, want)
    with pytest.raises(TypeError, match=r"kl_estimator=.*\bkl="):
        PolicyLoss(kl="k2", kl_estimator="k3")
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        with pytest.warns(FutureWarning):
            PolicyLoss(kl="k9")


# ----------------------------------------------------------------------------- signatures


def _public_ops():
    for name in fused_rl.__all__:
        fn = getattr(fused_rl, name)
        if inspect.isfunction(fn):
            params = inspect.signature(fn).parameters.values()
            if any("Tensor" in str(p.annotation) for p in params):  # an op, not a helper
                yield name


@pytest.mark.parametrize("op", sorted(_public_ops()))
def test_signature_convention(op):
    """CONTRIBUTING's rule: tensors positional, everything else keyword-only, ``backend="auto"``
    last (``policy_loss_from_logprobs`` included)."""
    params = list(inspect.signature(getattr(fused_rl, op)).parameters.values())
    last = params[-1]
    assert (last.name, last.kind, last.default) == ("backend", last.KEYWORD_ONLY, "auto"), op
    for p in params:
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), (op, p.name)
        if p.kind is p.POSITIONAL_OR_KEYWORD:
            assert "Tensor" in str(p.annotation), f"{op}: {p.name} must be keyword-only"


def test_ops_in_inputs_cover_the_public_api():
    assert set(_public_ops()) <= set(INPUTS), set(_public_ops()) - set(INPUTS)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda x: fused_rl.masked_sum(x, None, 1), "masked_sum"),
        (lambda x: fused_rl.masked_mean(x, None, 0), "masked_mean"),
        (lambda x: fused_rl.group_advantages(x.reshape(-1), 4), "group_advantages"),
        (lambda x: fused_rl.rloo_advantages(x.reshape(-1), 4), "rloo_advantages"),
    ],
)
def test_keyword_only_arguments(call, name):
    """``dim`` and ``group_size`` are keyword-only: a positional one is a TypeError."""
    with pytest.raises(TypeError, match="positional argument"):
        call(_x(B, T))


# ----------------------------------------------------------------------------- mask weights

MASKS = ("mask", "padding_masks", "value_padding_masks")
INDICATOR_MASK_OPS = ("gae", "kl_penalized_rewards", "rollout_is_weights", "token_kl")


def _mask_cases():
    for op in INPUTS:
        for name in sorted(_params(op) & set(MASKS)):
            yield pytest.param(op, name, id=f"{op}-{name}")


@pytest.mark.parametrize(("op", "name"), list(_mask_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_negative_mask_weight(op, name, dtype, monkeypatch):
    """Every op whose mask is a per-token weight rejects a negative one in eager mode (the
    same validator, the same words); unchecked it gives NaN. Indicator masks accept it."""
    mask = torch.ones(B, T, dtype=dtype)
    mask[0, 1] = -2
    if op in INDICATOR_MASK_OPS:
        out = _call(op, **{name: mask})
        first = out[0] if isinstance(out, tuple) else out
        assert torch.isfinite(first).all()
        return
    with pytest.raises(V.NegativeMaskWeightError, match=rf"^{name} has a negative weight"):
        _call(op, **{name: mask})
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    out = _call(op, **{name: mask})
    assert torch.isnan(out[0] if isinstance(out, tuple) else out).any()
