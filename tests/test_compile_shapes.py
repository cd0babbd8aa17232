"""``torch.compile(fullgraph=True)`` across a training run's changing shapes and counts.

An RL batch has a new padded length nearly every step, and a trainer's global token count
(``num_items``) changes every step. Dynamo compiles a call once with constant shapes, then
once more with symbolic ones; a value a fused op takes as a Python ``float`` is a constant
of the graph instead (``torch.library`` specialises floats), so a length or a count passed
that way recompiled the graph every step and, with ``fullgraph=True``, raised at the ninth
(``recompile_limit``). Each logits-level op here runs at three lengths with three counts and
must compile at most twice, with the eager call's values and gradients.

A hyper-parameter that changes (a scheduled ``beta`` or ``eps_low``) recompiles (the kernels
take it as a constant; the ninth distinct value meets the same limit) but its second value
must not fail: the validation compares instead of calling ``math.isfinite``, which Dynamo
cannot trace on a symbolic number. With ``config.scheduled_hyperparameters`` the policy
losses' table reaches the kernels as a tensor: a new value every step compiles twice, a
value turning zero once more.

The ops from hidden states loop over chunks of tokens in Python, which would fix the
graph's token count: on one device they run each loop inside a custom op while compiling,
and are checked over three token counts (docs/usage.md, "torch.compile").
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DEVICE
from helpers import assert_rel

import fused_rl

BACKENDS = ("triton", "reference")
LENGTHS = (5, 6, 9)  # a static graph, a symbolic one, that one again at a longer length
V = 19


def _batch(T: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    d = dict(
        x=torch.randn(2, T, V, generator=g),
        ref=torch.randn(2, T, V, generator=g),
        targets=torch.randint(0, V, (2, T), generator=g),
        mask=torch.rand(2, T, generator=g) > 0.2,
        adv=torch.randn(2, generator=g),
        old=torch.randn(2, T, generator=g) - 3.0,
        up=torch.rand(2, T, generator=g) + 0.5,
    )
    d["targets"][0, 0] = -100
    return {k: v.to(DEVICE) for k, v in d.items()}


def _policy(d, n, be, **kw):
    return fused_rl.policy_loss(d["x"], d["targets"], d["adv"], old_logprobs=d["old"],
                                mask=d["mask"], num_items=n, backend=be, **kw)[0]  # fmt: skip


CASES = {
    "token_logprobs": lambda d, n, be: fused_rl.token_logprobs(d["x"], d["targets"], backend=be),
    "top_p": lambda d, n, be: fused_rl.token_logprobs(
        d["x"], d["targets"].clamp(min=0), top_k=6, top_p=0.8, backend=be),
    "token_kl": lambda d, n, be: fused_rl.token_kl(d["x"], d["ref"], mask=d["mask"], backend=be),
    "ppo": lambda d, n, be: _policy(d, n, be, entropy_coef=0.01),
    "gspo_exact_kl": lambda d, n, be: _policy(
        d, n, be, importance_sampling="sequence", ref_logits=d["ref"], kl_estimator="full",
        beta=0.1),
    "token_sum_norm": lambda d, n, be: _policy(d, None, be, loss_agg="seq-mean-token-sum-norm"),
    "distill": lambda d, n, be: fused_rl.distill_loss(d["x"], d["ref"], beta=0.5,
                                                      mask=d["mask"], num_items=n,
                                                      backend=be)[0],
}  # fmt: skip


def _value_and_grad(fn, d, n, be):
    x = d["x"].clone().requires_grad_()
    out = fn(dict(d, x=x), n, be)
    finite = torch.isfinite(out)  # the truncated log-probs: -inf outside the kept set
    up = d["up"] if out.dim() == 2 else torch.ones_like(out)
    torch.where(finite, out * up, 0.0).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_changing_lengths_and_counts_compile_twice(name, backend):
    fn = CASES[name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for i, T in enumerate(LENGTHS):
        d, n = _batch(T, seed=i), 7 + 3 * i  # the trainer's count: an int, new each step
        got, got_grad = _value_and_grad(compiled, d, n, backend)
        want, want_grad = _value_and_grad(fn, d, n, backend)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)), (name, T)
        assert_rel(got[fin], want[fin], 1e-6, f"{name} T={T}")
        assert_rel(got_grad, want_grad, 1e-6, f"{name} grad T={T}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"{name}: {graphs} graphs for {len(LENGTHS)} lengths"


@pytest.mark.parametrize("backend", BACKENDS)
def test_changing_hyperparameters_do_not_fail(backend):
    """A scheduled ``eps_low``, ``beta``, ``temperature``, ``entropy_coef`` or ``loss_scale``:
    each new value is a recompile at worst, never Dynamo's error on ``math.isfinite``."""

    def fn(d, eps, beta, temp, coef, scale):
        return fused_rl.policy_loss(
            d["x"], d["targets"], d["adv"], old_logprobs=d["old"], ref_logits=d["ref"],
            kl_estimator="full", eps_low=eps, beta=beta, temperature=temp, entropy_coef=coef,
            loss_scale=scale, backend=backend,
        )[0]  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    d = _batch(5, seed=0)
    for i in range(3):
        args = (0.2 - 0.05 * i, 0.1 + 0.1 * i, 1.0 - 0.1 * i, 0.01 * i, 1.0 + i)
        assert_rel(compiled(d, *args), fn(d, *args), 1e-6, f"step {i}")


def _from_logprobs(logp, entropy, d, be, **kw):
    return fused_rl.policy_loss_from_logprobs(
        logp, d["adv"], old_logprobs=d["old"], ref_logprobs=d["old"] + 0.1, mask=d["mask"],
        entropy=entropy, backend=be, **kw)[0]  # fmt: skip


SCHEDULED = {
    "ppo_k3": lambda d, be, **kw: _policy(d, None, be, ref_logprobs=d["old"] + 0.1, **kw),
    "gspo_exact_kl": lambda d, be, **kw: _policy(d, None, be, importance_sampling="sequence",
                                                 ref_logits=d["ref"], kl_estimator="full", **kw),
    "from_logprobs": lambda d, be, **kw: _from_logprobs(
        *fused_rl.token_logprobs(d["x"], d["targets"], return_entropy=True, backend=be), d,
        be, **kw),
    "linear_grpo": lambda d, be, **kw: fused_rl.linear_policy_loss(
        d["x"], d["w"], d["targets"], d["adv"], old_logprobs=d["old"],
        ref_logprobs=d["old"] + 0.1, mask=d["mask"], chunk_tokens=4, backend=be, **kw)[0],
}  # fmt: skip


@pytest.fixture
def scheduled_hyperparameters():
    fused_rl.config.scheduled_hyperparameters = True
    try:
        yield
    finally:
        fused_rl.config.scheduled_hyperparameters = False


# Inductor on a GPU: the hyper-parameter table is a CPU tensor made in the CUDA graph
INDUCTOR_ON_GPU = pytest.param("inductor", marks=[pytest.mark.gpu, pytest.mark.no_poison])


@pytest.mark.parametrize("compiler", ["aot_eager", INDUCTOR_ON_GPU])
@pytest.mark.parametrize("name", list(SCHEDULED))
def test_scheduled_hyperparameters_compile_twice(name, compiler, scheduled_hyperparameters):
    """``config.scheduled_hyperparameters``: ``beta``, ``entropy_coef`` and ``eps_low`` new
    at every step (an adaptive KL controller, an entropy schedule) compile twice, the eager
    call's values and gradients at each; ``entropy_coef`` turning 0 (no entropy kernel) once
    more, and back to the symbolic graph after it."""
    fn = SCHEDULED[name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend=compiler)
    d = _batch(5, seed=3)
    d["w"] = torch.randn(V, 3, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    if name == "linear_grpo":  # hidden states (2, T, 3) in place of the logits
        d["x"] = d["x"][..., :3].contiguous()
    coefs = (0.01, 0.02, 0.0, 0.03, 0.05)
    for i, coef in enumerate(coefs):
        kw = dict(beta=0.1 + 0.07 * i, entropy_coef=coef, eps_low=0.2 - 0.01 * i)
        x = d["x"].clone().requires_grad_()
        got = compiled(dict(d, x=x), "triton", **kw)
        got.backward()
        x_e = d["x"].clone().requires_grad_()
        want = fn(dict(d, x=x_e), "triton", **kw)
        want.backward()
        assert_rel(got, want, 1e-6, f"{name} step {i}")
        assert_rel(x.grad, x_e.grad, 1e-6, f"{name} grad step {i}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 3, f"{name}: {graphs} graphs for {len(coefs)} steps"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_changing_lengths(backend):
    """The reference GAE's blocked sums take a fixed block while compiling (``ceil(sqrt(T))``
    of a symbolic ``T`` is no int): equal to the eager call at every length."""

    def fn(r, v):
        return fused_rl.gae(r, v, gamma=0.99, lam=0.95, backend=backend)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for i, T in enumerate((7, 5, 30, 130, 200, 90)):
        g = torch.Generator().manual_seed(i)
        r, v = (torch.randn(2, T, generator=g).to(DEVICE) for _ in range(2))
        for got, want in zip(compiled(r, v), fn(r, v), strict=True):
            assert_rel(got, want, 1e-6, f"gae T={T}")
    # Dynamo specialises a dimension of size 1: one block (T <= 64) and two blocks (a size-1
    # difference) are graphs of their own, every other length shares one
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4


def test_adapters_and_deprecated_aliases_trace():
    """What Dynamo cannot trace stays out of a compiled call: ``torch.result_type`` (verl's
    ``kl_penalty``), a branch on a mask's count (verl's ``masked_whiten``), the deprecation
    warnings (shown by eager calls: ``tests/test_validation.py``)."""
    from fused_rl.compat.verl import core_algos
    from fused_rl.compat.verl import torch_functional as verl_tf

    g = torch.Generator().manual_seed(0)
    old = (torch.randn(2, 5, generator=g) - 3).to(DEVICE)
    values, mask = torch.randn(2, 5, generator=g).to(DEVICE), torch.ones(2, 5, device=DEVICE)
    calls = {
        "kl_penalty": (lambda a, b: core_algos.kl_penalty(a, b, "low_var_kl"), (old, old + 0.1)),
        "masked_whiten": (verl_tf.masked_whiten, (values, mask)),
        "kind alias": (lambda a, b: fused_rl.kl_estimate(a, b, kind="k3"), (old, old + 0.1)),
    }  # fmt: skip
    for name, (fn, args) in calls.items():
        torch._dynamo.reset()
        with pytest.warns(FutureWarning) if name == "kind alias" else contextlib.nullcontext():
            want = fn(*args)
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        assert_rel(got, want, 1e-6, name)


H = 6
LINEAR_CASES = {
    "linear_token_logprobs": lambda d, be: fused_rl.linear_token_logprobs(
        d["h"], d["w"], d["targets"], bias=d["b"], chunk_tokens=4, backend=be),
    "linear_entropy": lambda d, be: torch.stack(fused_rl.linear_token_logprobs(
        d["h"], d["w"], d["targets"], return_entropy=True, temperature=0.9, chunk_tokens=4,
        backend=be)),
    "linear_token_stats": lambda d, be: (lambda s: s.logp + s.entropy + s.mean_logit)(
        fused_rl.linear_token_stats(d["h"], d["w"], d["targets"], chunk_tokens=4, backend=be)),
    "linear_top_p": lambda d, be: fused_rl.linear_token_logprobs(
        d["h"], d["w"], d["targets"], bias=d["b"], top_k=8, top_p=0.9, chunk_tokens=4,
        backend=be).clamp(min=-1e4),  # -inf where a target is cut: a zero gradient there
    "linear_grpo": lambda d, be: _linear_policy(d, be, entropy_coef=0.01, beta=0.05,
                                                ref_logprobs=d["old"] + 0.1),
    "linear_gspo": lambda d, be: _linear_policy(d, be, importance_sampling="sequence"),
    "linear_exact_kl": lambda d, be: _linear_policy(
        d, be, ref_hidden=d["rh"], ref_weight=d["rw"], kl_estimator="full", beta=0.1),
    "linear_gspo_exact_kl": lambda d, be: _linear_policy(
        d, be, importance_sampling="sequence", ref_hidden=d["rh"], ref_weight=d["rw"],
        kl_estimator="full", beta=0.1),
    "linear_distill": lambda d, be: fused_rl.linear_distill_loss(
        d["h"][:, 1:], d["w"], d["rh"][:, 1:], d["rw"], bias=d["b"], beta=0.5, mask=d["mask"],
        num_items=d["n"], chunk_tokens=4, backend=be)[0],
    # autocast's 16-bit copies of the fp32 hidden states and lm_head made inside the op, the
    # gradients formed for the fp32 tensors (the logits fp32 too: the bias added as given)
    "linear_distill_autocast": lambda d, be: _autocast(lambda: fused_rl.linear_distill_loss(
        d["h"][:, 1:], d["w"], d["rh"][:, 1:], d["rw"], bias=d["b"], beta=0.5, mask=d["mask"],
        num_items=d["n"], chunk_tokens=4, backend=be)[0]),
    "linear_distill_autocast_fp32_logits": lambda d, be: _autocast(
        lambda: fused_rl.linear_distill_loss(
            d["h"][:, 1:], d["w"], d["rh"][:, 1:], d["rw"], bias=d["b"], beta=0.5,
            logits_dtype=torch.float32, chunk_tokens=4, backend=be)[0]),
}  # fmt: skip


def _autocast(fn):
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        return fn()


def _linear_policy(d, be, **kw):
    return fused_rl.linear_policy_loss(
        d["h"], d["w"], d["targets"], d["adv"], bias=d["b"], old_logprobs=d["old"],
        mask=d["mask"], num_items=d["n"], chunk_tokens=4, backend=be, **kw,
    )[0]  # fmt: skip


TOKEN_COUNTS = (5, 3, 9)  # the symbolic graph reused at a larger count
# the cases whose traced graph is the same on either backend (one custom op each way, the
# backend one of its arguments): checked on the Triton backend; the reference backend's
# launcher of that op runs compiled in linear_token_stats, linear_grpo (bias, entropy) and
# linear_gspo (bias, no entropy: linear_token_logprobs' arguments)
SAME_GRAPH = ("linear_token_logprobs", "linear_entropy")


@pytest.mark.parametrize(
    "name, backend",
    [(n, b) for n in LINEAR_CASES for b in BACKENDS if b == "triton" or n not in SAME_GRAPH],
)
def test_ops_from_hidden_states_compile_twice(name, backend):
    """The ops from hidden states run their chunk loop inside one custom op each way while
    compiling (the loop over a symbolic token count would fix it): a new token count each
    step (chunks of 4 rows: 3, 2 and 5 chunks, the last one partial) compiles at most twice,
    with the eager call's values and the gradients of the hidden states, the lm_head and
    its bias."""
    fn = LINEAR_CASES[name]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for i, T in enumerate(TOKEN_COUNTS):
        g = torch.Generator().manual_seed(i)
        d = dict(h=torch.randn(2, T + 1, H, generator=g), w=torch.randn(V, H, generator=g),
                 b=torch.randn(V, generator=g), targets=torch.randint(0, V, (2, T), generator=g),
                 up=torch.rand(2, T, generator=g) + 0.5, adv=torch.randn(2, generator=g),
                 old=torch.randn(2, T, generator=g) - 3.0,
                 mask=torch.rand(2, T, generator=g) > 0.2,
                 rh=torch.randn(2, T + 1, H, generator=g),
                 rw=torch.randn(V, H, generator=g))  # fmt: skip
        d["targets"][0, 0] = -100
        d = {k: v.to(DEVICE) for k, v in d.items()}
        d["n"] = 7 + 3 * i  # the trainer's count: an int, new each step
        results = []
        for f in (compiled, fn):
            leaves = {k: d[k].clone().requires_grad_() for k in ("h", "w", "b")}
            out = f(dict(d, **leaves), backend)
            (out * d["up"]).sum().backward()
            results.append((out.detach(), *(leaves[k].grad for k in ("h", "w", "b"))))
        for got, want, what in zip(*results, ("value", "grad h", "grad w", "grad b")):
            if want is None:  # the bias: not an input of every case
                assert got is None, (name, what)
                continue
            assert_rel(got, want, 1e-6, f"{name} {what} T={T}")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"{name}: {graphs} graphs for {len(TOKEN_COUNTS)} token counts"


@pytest.mark.parametrize(
    "needs", [(True, False, False), (False, True, False), (False, False, True)]
)
def test_head_op_fakes_keep_outputs_apart(needs):
    """A traced head op's fake gives each gradient not needed a tensor of its own, as the
    real op does (a custom op's outputs may not alias one another)."""
    from fused_rl import linear as L

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, H, generator=g).to(DEVICE), torch.randn(V, H, generator=g).to(DEVICE)
    b, t = torch.randn(V, generator=g).to(DEVICE), torch.randint(0, V, (6,), generator=g)
    t = t.to(DEVICE)
    logp, entropy, row_max, log_sum, *_ = L.linear_stats_fwd(h, w, b, t, 1.0, None, -100, 4,
                                                             "triton", False)  # fmt: skip
    args = (h, w, b, t, row_max, log_sum, entropy, torch.ones_like(logp), None, *needs, 1.0,
            None, -100, 4, "triton")  # fmt: skip
    torch.library.opcheck(L.linear_stats_bwd_op.op, args, test_utils=("test_faketensor",))
