"""``policy_loss(..., ref_logits=, kl_estimator="full")``: the exact per-token
``KL(pi || pi_ref)`` over the whole vocabulary inside the policy loss.

Values, every metric and the logits' gradient under a random upstream gradient against the
float64 oracle (``tests/policy_oracle.py``, ``ref_logits=``: both log-softmaxes written out);
both backends; fp32 and bf16; awkward shapes and layouts (odd V, V below a block, T = 1, the
model's whole buffer, a strided reference in another dtype, masked and ignored tokens,
fully masked rows); near-equal and identical references (no cancellation: the KL of a model
with itself is exactly 0); NaN in means NaN out; ``grad_in_forward`` and ``inplace``
bitwise equal to the default; ``torch.compile(fullgraph=True)``; ``gradcheck``; the launch
count of a k3 call; every bad input raising an error that names the argument.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import FP32_TOL, U32, assert_rel, bf16_tol, gradcheck
from policy_oracle import oracle_policy_loss

import fused_rl
import fused_rl.nn
from fused_rl.profiling import LaunchCounter

BACKENDS = ("triton", "reference")
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _inputs(B=2, T=5, V=37, S=None, S_ref=None, spread=0.7, seed=0, dtype=torch.float32,
            ref_dtype=None, mask=True, ignore=True):  # fmt: skip
    """A rollout whose reference differs from the policy by ``spread`` per logit, on the
    suite's device (drawn on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    S_ref = S if S_ref is None else S_ref
    logits = (2.0 * torch.randn(B, S, V, generator=g)).to(dtype)
    ref = logits.float()[:, -S_ref:] if S_ref <= S else torch.randn(B, S_ref, V, generator=g)
    if S_ref > S:
        ref[:, -S:] = logits.float()
    ref = (ref + spread * torch.randn(ref.shape, generator=g)).to(ref_dtype or dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    if ignore:
        targets[0, -1] = -100
    kw = dict(
        ref_logits=ref,
        old_logprobs=torch.randn(B, T, generator=g) * 0.3 - 3.0,
        mask=(torch.rand(B, T, generator=g) > 0.25) if mask else None,
    )
    kw = {k: None if v is None else v.to(DEVICE) for k, v in kw.items()}
    return logits.to(DEVICE), targets.to(DEVICE), torch.randn(B, generator=g).to(DEVICE), kw


def _windowed(ref, T):
    """The reference positions that predict ``T`` targets (the oracle's view)."""
    S = ref.shape[1]
    return ref[:, S - T - 1 : S - 1] if S > T else ref


def _run(fn, base, targets, adv, upstream, **kw):
    leaf = base.detach().clone().requires_grad_(True)
    loss, metrics = fn(leaf, targets, adv, **kw)
    (grad,) = torch.autograd.grad(loss * upstream, leaf)
    return loss.detach(), metrics, grad


def _oracle(logits, targets, adv, upstream, softcap=None, **kw):
    """The float64 oracle on both models' logits (soft-capped in float64 with ``softcap``)."""
    T = targets.shape[1]
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * torch.tanh(x / softcap))
    kw = dict(kw, ref_logits=cap(_windowed(kw["ref_logits"], T).double()))
    if "old_logprobs" in kw and kw["old_logprobs"] is not None:
        kw["old_logprobs"] = kw["old_logprobs"].double()

    def fn(x, targets, adv, **rest):
        return oracle_policy_loss(cap(_windowed(x, T)), targets, adv, **rest)

    return _run(fn, logits.double(), targets, adv, upstream, **kw)


def _check(backend, logits, targets, adv, tol=FP32_TOL, **kw):
    upstream = 1.37
    kw = dict(kw, kl_estimator="full")
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, upstream,
                               backend=backend, **kw)  # fmt: skip
    o_loss, o_metrics, o_grad = _oracle(logits, targets, adv, upstream, **kw)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert_rel(loss, o_loss, tol, f"{backend} loss")
    assert_rel(grad, o_grad, tol, f"{backend} grad")
    assert "kl" in metrics
    for name, value in o_metrics.items():
        assert_rel(metrics[name], value, tol, f"{backend} metric {name}")
    return loss, metrics, grad


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", AGGS)
def test_parity_fp32(backend, loss_agg):
    logits, targets, adv, kw = _inputs()
    _check(backend, logits, targets, adv, beta=0.3, loss_agg=loss_agg, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    (
        dict(beta=0.0),  # the metric alone: no gradient from the KL
        dict(beta=0.1, entropy_coef=0.01, eps_high=0.28, dual_clip=3.0),
        dict(beta=0.2, kl_bias_correction=True),
        dict(beta=0.2, temperature=0.7),
        dict(beta=0.05, old_logprobs=None),
    ),
)
def test_parity_options(backend, options):
    logits, targets, adv, kw = _inputs(seed=1)
    kw.update(options)
    _check(backend, logits, targets, adv, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape",
    (
        dict(B=1, T=1, V=5),  # T = 1, V below any block
        dict(B=3, T=4, V=1031),  # odd V over several blocks
        dict(B=2, T=3, V=64, S=6),  # the model's whole buffer
        dict(B=2, T=3, V=64, S=6, S_ref=4),  # a reference buffer of another length
        dict(B=2, T=3, V=33, S_ref=7),
    ),
)
def test_parity_shapes(backend, shape):
    logits, targets, adv, kw = _inputs(**shape, seed=2)
    _check(backend, logits, targets, adv, beta=0.25, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_reference_in_another_dtype(backend):
    logits, targets, adv, kw = _inputs(seed=3)
    wide = torch.randn(2, 5, 2 * 37, dtype=torch.float64, device=DEVICE)
    wide[..., ::2] = kw["ref_logits"].double()
    kw["ref_logits"] = wide[..., ::2]  # stride 2 along V, fp64 beside fp32 logits
    _check(backend, logits, targets, adv, beta=0.3, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parity_bf16(backend):
    logits, targets, adv, kw = _inputs(seed=4, dtype=torch.bfloat16, T=6, V=301)
    kw = dict(kw, kl_estimator="full", beta=0.3, entropy_coef=0.01)
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.0,
                               backend=backend, **kw)  # fmt: skip
    o_loss, o_metrics, o_grad = _oracle(logits, targets, adv, 1.0, **kw)
    e_loss, e_metrics, e_grad = _run(oracle_policy_loss, logits, targets, adv, 1.0, **kw)
    assert grad.dtype == torch.bfloat16
    assert_rel(loss, o_loss, bf16_tol(e_loss.double(), o_loss), "loss")
    assert_rel(grad.double(), o_grad, bf16_tol(e_grad.double(), o_grad), "grad")
    kl_tol = bf16_tol(e_metrics["kl"].double(), o_metrics["kl"])
    assert_rel(metrics["kl"].double(), o_metrics["kl"], kl_tol, "kl")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_and_ignored_tokens(backend):
    logits, targets, adv, kw = _inputs(B=3, T=4, V=29, seed=5)
    kw["mask"][1] = False  # a sequence with nothing counted
    targets[2, :2] = -100
    _check(backend, logits, targets, adv, beta=0.3, loss_agg="seq-mean-token-mean", **kw)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_reference_gives_exact_zero(backend):
    """A model against itself: KL exactly 0, and the gradient that of the loss without it
    (the KL's term ``beta p (log p - log q - KL)`` vanishes column by column)."""
    logits, targets, adv, kw = _inputs(seed=6)
    kw["ref_logits"] = logits.clone()
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.0,
                               backend=backend, kl_estimator="full", beta=0.5, **kw)  # fmt: skip
    assert metrics["kl"].item() == 0.0
    no_kl = dict(kw, ref_logits=None)
    loss0, _, grad0 = _run(fused_rl.policy_loss, logits, targets, adv, 1.0, backend=backend,
                           **no_kl)  # fmt: skip
    torch.testing.assert_close(loss, loss0, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad, grad0, rtol=0, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", (None, 2.0))
@pytest.mark.parametrize("spread", (1e-2, 1e-4))
def test_near_equal_reference_keeps_relative_accuracy(backend, spread, softcap):
    """A KL of order ``spread^2``, far below fp32's rounding of ``log V``: each column's
    ``log q - log p`` comes from the logits' own difference (with the soft cap, the two
    tanh's difference as ``sinh(d) sech(v) sech(w)``), so the only cancellation left is
    first order (``E_p[a - b]`` against ``log(S_z / S_u)``, both of order ``spread``): a
    relative error of order ``eps / spread``, never ``eps log V / spread^2``."""
    logits, targets, adv, kw = _inputs(seed=7, spread=spread, V=257)
    kw = dict(kw, kl_estimator="full", beta=0.3, softcap=softcap)
    _, metrics, _ = _run(fused_rl.policy_loss, logits, targets, adv, 1.0, backend=backend,
                         **kw)  # fmt: skip
    _, o_metrics, _ = _oracle(logits, targets, adv, 1.0, **kw)
    assert 0 < o_metrics["kl"] < 10 * spread**2
    tol = max(FP32_TOL, 20 * U32 / spread)
    assert_rel(metrics["kl"].double(), o_metrics["kl"], tol, "kl")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", (1024, 1031))  # whole blocks only; a partial last one
@pytest.mark.parametrize("rising", ("both", "policy", "reference"))
def test_maxima_rising_block_by_block(backend, vocab, rising):
    """The forward streams a row 512 columns a step (the whole blocks unmasked, then the
    partial one) and moves its running sums only in a step that raises a maximum: rows
    whose maximum rises in every block of the policy's row, of the reference's, or of
    both, and a reference ``0.5`` a logit away (columns on both sides of the near-equal
    polynomial's ``|log q - log p| <= 0.35``): the loss, every metric and the gradient
    against the float64 oracle."""
    logits, targets, adv, kw = _inputs(seed=31, V=vocab, spread=0.5)
    ramp = torch.linspace(0.0, 12.0, vocab, device=logits.device)
    ref = kw["ref_logits"]
    if rising in ("both", "policy"):
        logits = logits + ramp
    if rising in ("both", "reference"):
        ref = ref + ramp
    _check(backend, logits, targets, adv, beta=0.3, **dict(kw, ref_logits=ref))


def test_kl_is_the_distill_reverse_kl():
    """The same quantity as ``distill_loss(beta=1)`` (its own kernels and finalize)."""
    logits, targets, adv, kw = _inputs(seed=8, mask=False, ignore=False)
    _, metrics = fused_rl.policy_loss(logits, targets, adv, kl_estimator="full", beta=0.1,
                                      ref_logits=kw["ref_logits"], backend="triton")  # fmt: skip
    _, d_metrics = fused_rl.distill_loss(logits, kw["ref_logits"], beta=1.0, backend="triton")
    assert_rel(metrics["kl"], d_metrics["reverse_kl"], 1e-6, "kl")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ("counted", "not counted"))
def test_nan_in_reference(backend, where):
    logits, targets, adv, kw = _inputs(seed=9, mask=False, ignore=False)
    kw["mask"] = torch.ones(2, 5, dtype=torch.bool, device=DEVICE)
    kw["mask"][1, 2] = where == "counted"
    kw["ref_logits"][1, 2, 3] = float("nan")
    loss, metrics = fused_rl.policy_loss(logits, targets, adv, kl_estimator="full", beta=0.2,
                                         backend=backend, **kw)  # fmt: skip
    if where == "counted":
        assert torch.isnan(loss) and torch.isnan(metrics["kl"])
    else:
        assert torch.isfinite(loss) and torch.isfinite(metrics["kl"])


@pytest.mark.parametrize(
    "options",
    (dict(), dict(grad_in_forward=True), dict(importance_sampling="sequence")),
    ids=("default", "grad_in_forward", "composed"),
)
def test_nonfinite_kl_row_has_no_finite_gradient(options):
    """A counted token whose KL is +inf (the reference -inf where the policy has mass) or
    NaN (a NaN reference logit) has no finite gradient column: where the policy's ``p == 0``
    (a -inf logit) NaN, not the ``0 log 0`` zero, on both backends (CONTRIBUTING.md, "NaN,
    threads and other failure modes"); the other tokens keep finite gradients."""
    logits, targets, adv, kw = _inputs(seed=12, mask=False, ignore=False)
    logits[0, 1, 4] = logits[1, 3, 4] = float("-inf")  # p == 0 there
    kw["ref_logits"][0, 1, 6] = float("-inf")  # KL = +inf
    kw["ref_logits"][1, 3, 2] = float("nan")  # KL = NaN
    upstream = torch.tensor(0.7, device=DEVICE)
    grads = {}
    for backend in BACKENDS:
        opts = options if backend == "triton" else {
            k: v for k, v in options.items() if k != "grad_in_forward"
        }  # fmt: skip
        grads[backend] = _run(fused_rl.policy_loss, logits, targets, adv, upstream,
                              kl_estimator="full", beta=0.2, backend=backend, **kw,
                              **opts)[2]  # fmt: skip
    for backend, grad in grads.items():
        bad = torch.zeros(grad.shape[:2], dtype=torch.bool, device=grad.device)
        bad[0, 1] = bad[1, 3] = True
        assert not torch.isfinite(grad[bad]).any(), backend
        assert torch.isnan(grad[0, 1, 4]) and torch.isnan(grad[1, 3, 4]), backend
        assert torch.isfinite(grad[~bad]).all(), backend
    assert torch.equal(grads["triton"].isnan(), grads["reference"].isnan())


# ----------------------------------------------------------------------------- other paths


@pytest.mark.parametrize("vocab", [67, 1031])  # one block; several of the forward's 512
def test_grad_in_forward_and_inplace_are_bitwise_the_default(vocab):
    logits, targets, adv, kw = _inputs(seed=10, V=vocab)
    kw = dict(kw, kl_estimator="full", beta=0.3, entropy_coef=0.01)
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.0,
                               backend="triton", **kw)  # fmt: skip
    for extra in (dict(grad_in_forward=True), dict(inplace=True),
                  dict(grad_in_forward=True, inplace=True)):  # fmt: skip
        x = logits.detach().clone().requires_grad_()
        buf = x * 1.0 if extra.get("inplace") else x  # inplace needs a non-leaf buffer
        loss2, metrics2 = fused_rl.policy_loss(buf, targets, adv, backend="triton", **kw,
                                               **extra)  # fmt: skip
        loss2.backward()
        assert torch.equal(loss2.detach(), loss), extra
        assert torch.equal(x.grad, grad), extra
        for name, value in metrics.items():
            assert torch.equal(metrics2[name], value), (extra, name)


def test_torch_compile_fullgraph():
    logits, targets, adv, kw = _inputs(seed=11, V=19)

    def fn(x, targets, adv, **kw):
        return fused_rl.policy_loss(x, targets, adv, kl_estimator="full", beta=0.2,
                                    backend="triton", **kw)  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss, metrics, grad = _run(fn, logits, targets, adv, 1.1, **kw)
    c_loss, c_metrics, c_grad = _run(compiled, logits, targets, adv, 1.1, **kw)
    assert_rel(c_loss, loss, 1e-6, "compiled loss")
    assert_rel(c_grad, grad, 1e-6, "compiled grad")
    assert set(c_metrics) == set(metrics)


def test_gradcheck_fp64():
    logits, targets, adv, kw = _inputs(B=2, T=3, V=7, seed=12, dtype=torch.float64)

    def fn(x):
        return fused_rl.policy_loss(x, targets, adv, kl_estimator="full", beta=0.7,
                                    entropy_coef=0.1, backend="triton", **kw)[0]  # fmt: skip

    assert gradcheck(fn, (logits.clone().requires_grad_(),), eps=1e-6, atol=1e-8)


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
def test_launches_are_those_of_k3(monkeypatch):
    """The exact KL adds no launch: the reference's row is read inside the same kernels."""
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    logits, targets, adv, kw = _inputs(seed=13)
    ref = kw.pop("ref_logits")
    counts = {}
    for name, extra in (("k3", dict(ref_logprobs=torch.randn(2, 5, device=DEVICE) - 3)),
                        ("full", dict(ref_logits=ref, kl_estimator="full"))):  # fmt: skip
        x = logits.clone().requires_grad_()
        with LaunchCounter() as c:
            loss, _ = fused_rl.policy_loss(x, targets, adv, beta=0.1, backend="triton", **kw,
                                           **extra)  # fmt: skip
            loss.backward()
        counts[name] = (c.total, sorted(c.kernels))
    assert counts["full"] == counts["k3"], counts


# ----------------------------------------------------------------------------- soft cap


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", (2.0, 30.0))
def test_softcap(backend, cap):
    """Gemma's cap on both models' logits (``c tanh(x / c)``, then the temperature): the
    oracle differentiates through the cap; a strong cap (2) and the usual one (30)."""
    logits, targets, adv, kw = _inputs(seed=23, S=6)
    logits = logits * 3  # past the cap's linear range
    T = targets.shape[1]
    options = dict(kl_estimator="full", beta=0.3, entropy_coef=0.01, temperature=0.8)
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.3, softcap=cap,
                               backend=backend, **kw, **options)  # fmt: skip

    def oracle(x, targets, adv, **rest):
        capped = cap * torch.tanh(_windowed(x, T) / cap)
        ref = rest.pop("ref_logits")
        return oracle_policy_loss(capped, targets, adv, ref_logits=cap * torch.tanh(ref / cap),
                                  **rest)  # fmt: skip

    okw = dict(kw, ref_logits=_windowed(kw["ref_logits"], T).double(),
               old_logprobs=kw["old_logprobs"].double())  # fmt: skip
    okw.pop("kl_estimator", None)
    o_loss, o_metrics, o_grad = _run(oracle, logits.double(), targets, adv, 1.3, beta=0.3,
                                     entropy_coef=0.01, temperature=0.8, **okw)  # fmt: skip
    assert_rel(loss, o_loss, FP32_TOL, "loss")
    assert_rel(grad, o_grad, FP32_TOL, "grad")
    for name, value in o_metrics.items():
        assert_rel(metrics[name], value, FP32_TOL, f"metric {name}")
    if backend == "triton":  # the two-pass mode: the same bits
        x = logits.clone().requires_grad_()
        loss2, _ = fused_rl.policy_loss(x, targets, adv, softcap=cap, backend=backend,
                                        grad_in_forward=True, **kw, **options)  # fmt: skip
        (loss2 * 1.3).backward()
        assert torch.equal(loss2.detach(), loss)
        assert_rel(x.grad, grad, 1e-6, "grad_in_forward")


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_nan_where_nothing_counts(backend):
    """A NaN row of either model at a masked token never reaches the loss or the gradient,
    through the cap too."""
    logits, targets, adv, kw = _inputs(seed=25)
    kw["mask"][0, 1] = False
    logits[0, 1, 3] = float("nan")
    kw["ref_logits"][0, 1, 5] = float("nan")
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.0, softcap=30.0,
                               backend=backend, kl_estimator="full", beta=0.3, **kw)  # fmt: skip
    assert torch.isfinite(loss) and torch.isfinite(metrics["kl"])
    assert torch.isfinite(grad).all() and torch.equal(grad[0, 1], torch.zeros_like(grad[0, 1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_composed(backend):
    """GSPO with the cap: the composed loss (token_logprobs, token_kl) capped alike."""
    logits, targets, adv, kw = _inputs(seed=26, S=6)
    cap, T = 3.0, targets.shape[1]
    options = dict(kl_estimator="full", beta=0.3, importance_sampling="sequence")
    loss, metrics, grad = _run(fused_rl.policy_loss, logits * 2, targets, adv, 1.0,
                               softcap=cap, backend=backend, **kw, **options)  # fmt: skip

    def oracle(x, targets, adv, **rest):
        ref = rest.pop("ref_logits")
        return oracle_policy_loss(cap * torch.tanh(_windowed(x, T) / cap), targets, adv,
                                  ref_logits=cap * torch.tanh(ref / cap), **rest)  # fmt: skip

    okw = dict(kw, ref_logits=_windowed(kw["ref_logits"], T).double(),
               old_logprobs=kw["old_logprobs"].double())  # fmt: skip
    o_loss, o_metrics, o_grad = _run(oracle, logits.double() * 2, targets, adv, 1.0, beta=0.3,
                                     importance_sampling="sequence", **okw)  # fmt: skip
    assert_rel(loss, o_loss, FP32_TOL, "loss")
    assert_rel(grad, o_grad, FP32_TOL, "grad")
    assert_rel(metrics["kl"], o_metrics["kl"], FP32_TOL, "kl")


def test_softcap_from_hidden_states():
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs(seed=24)
    options = dict(kl_estimator="full", beta=0.3, softcap=3.0)
    out = []
    for backend in BACKENDS:
        h = hidden.clone().requires_grad_()
        loss, metrics = fused_rl.linear_policy_loss(h, weight, targets, adv, bias=bias,
                                                    chunk_tokens=3, backend=backend, **ref, **kw,
                                                    **options)  # fmt: skip
        loss.backward()
        out.append((loss.detach(), metrics["kl"], h.grad))
    for a, b in zip(*out):
        assert_rel(a, b, FP32_TOL, "triton against the reference")


# ----------------------------------------------------------------------------- composed paths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", ("token-mean", "seq-mean-token-mean"))
def test_gspo_against_the_oracle(backend, loss_agg):
    """GSPO's sequence ratio needs every token's log-prob first: the loss is composed from
    per-token statistics and ``token_kl`` (the model's whole buffer, a masked batch)."""
    logits, targets, adv, kw = _inputs(seed=14, S=7)
    _check(backend, logits, targets, adv, beta=0.3, importance_sampling="sequence",
           loss_agg=loss_agg, entropy_coef=0.01, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    (
        dict(surrogate="vespo"),
        dict(importance_sampling="sequence-token"),
        dict(importance_sampling="sequence-sum"),
        dict(top_entropy_quantile=0.5, loss_agg="seq-mean-token-sum"),
    ),
)
def test_other_composed_losses_add_the_oracle_kl(backend, options):
    """Where the oracle has no twin of the surrogate (VESPO, GSPO-token, the top-entropy
    selection), the exact KL must add exactly ``beta`` times the aggregated float64 KL to the
    loss without it, and its gradient to the gradient; ``kl`` is its masked mean."""
    logits, targets, adv, kw = _inputs(seed=15, S=6)
    beta = 0.4
    ref = kw.pop("ref_logits")
    loss, metrics, grad = _run(fused_rl.policy_loss, logits, targets, adv, 1.0,
                               backend=backend, kl_estimator="full", beta=beta, ref_logits=ref,
                               **kw, **options)  # fmt: skip
    loss0, _, grad0 = _run(fused_rl.policy_loss, logits, targets, adv, 1.0, backend=backend,
                           **kw, **options)  # fmt: skip
    T = targets.shape[1]
    x = logits.double().requires_grad_()
    lp = torch.log_softmax(_windowed(x, T), -1)
    lq = torch.log_softmax(_windowed(ref, T).double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    m = (kw["mask"] & (targets != -100)).double()
    if options.get("loss_agg") == "seq-mean-token-sum":
        kl_loss = (m * kl).sum() / targets.shape[0]
    else:
        kl_loss = (m * kl).sum() / m.sum()
    (kl_grad,) = torch.autograd.grad(beta * kl_loss, x)
    assert_rel(loss - loss0, beta * kl_loss, FP32_TOL, "loss")
    assert_rel(grad - grad0, kl_grad, 1e-4, "grad")  # a difference of two fp32 gradients
    assert_rel(metrics["kl"], (m * kl).sum() / m.sum(), FP32_TOL, "kl")


# ----------------------------------------------------------------------------- token_kl


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_token_kl_against_the_oracle(backend, dtype):
    g = torch.Generator().manual_seed(16)
    x = (2 * torch.randn(3, 4, 301, generator=g)).to(dtype)
    r = (x.float() + 0.8 * torch.randn(x.shape, generator=g)).to(dtype)
    mask = torch.rand(3, 4, generator=g) > 0.3
    up = torch.randn(3, 4, generator=g)
    x, r, mask, up = (t.to(DEVICE) for t in (x, r, mask, up))
    leaf = x.clone().requires_grad_()
    kl = fused_rl.token_kl(leaf, r, temperature=0.9, mask=mask, backend=backend)
    (grad,) = torch.autograd.grad((kl * up).sum(), leaf)
    xo = x.double().requires_grad_()
    lp = torch.log_softmax(xo / 0.9, -1)
    lq = torch.log_softmax(r.double() / 0.9, -1)
    kl_o = torch.where(mask, (lp.exp() * (lp - lq)).sum(-1), 0.0)
    (grad_o,) = torch.autograd.grad((kl_o * up).sum(), xo)
    tol = FP32_TOL if dtype == torch.float32 else 1e-2
    assert kl.shape == (3, 4) and grad.dtype == dtype
    assert torch.equal(kl[~mask], torch.zeros_like(kl[~mask]))
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    assert_rel(kl.double(), kl_o, tol, "kl")
    assert_rel(grad.double(), grad_o, tol, "grad")


def test_token_kl_compiles_and_refuses_bad_input():
    x, r = torch.randn(2, 3, 17, device=DEVICE), torch.randn(2, 3, 17, device=DEVICE)

    def fn(x):
        return fused_rl.token_kl(x, r, backend="triton")

    torch._dynamo.reset()
    leaf = x.clone().requires_grad_()
    eager = fn(leaf)
    (g_eager,) = torch.autograd.grad(eager.sum(), leaf)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(leaf)
    (g_compiled,) = torch.autograd.grad(compiled.sum(), leaf)
    assert_rel(compiled, eager, 1e-6, "compiled kl")
    assert_rel(g_compiled, g_eager, 1e-6, "compiled grad")
    with pytest.raises(ValueError, match="ref_logits must have logits' shape"):
        fused_rl.token_kl(x, r[..., :-1])
    with pytest.raises(ValueError, match=r"mask must have shape logits.shape\[:-1\]"):
        fused_rl.token_kl(x, r, mask=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(TypeError, match="ref_logits"):
        fused_rl.token_kl(x, r.long())
    with pytest.raises(ValueError, match="temperature"):
        fused_rl.token_kl(x, r, temperature=0.0)


# ----------------------------------------------------------------------------- bad input


def _bad_calls():
    logits, targets, adv, kw = _inputs()
    ref = kw["ref_logits"]
    base = dict(kl_estimator="full", beta=0.1, ref_logits=ref)
    return logits, targets, adv, [
        (ValueError, r"ref_logits.*vocabulary of 36", dict(base, ref_logits=ref[..., :-1])),
        (ValueError, r"ref_logits must be \(2, S, 37\)", dict(base, ref_logits=ref[:, :3])),
        (ValueError, r"ref_logits must be \(B, S, V\)", dict(base, ref_logits=ref[0])),
        (TypeError, r"ref_logits", dict(base, ref_logits=ref.long())),
        (ValueError, r"needs ref_logits", dict(base, ref_logits=None)),
        (ValueError, r"pass ref_logits=, not ref_logprobs=",
         dict(base, ref_logprobs=torch.zeros(2, 5, device=DEVICE))),
        (ValueError, r"ref_logits is read only by kl_estimator='full'",
         dict(base, kl_estimator="k3")),
        (ValueError, r"temperature", dict(base, temperature=0.0)),
        (NotImplementedError, r"kl_bias_correction=True .* importance_sampling='sequence'",
         dict(base, importance_sampling="sequence", kl_bias_correction=True)),
        (NotImplementedError, r"inplace=True", dict(base, top_entropy_quantile=0.5,
                                                     inplace=True)),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(10))
def test_bad_input_names_the_argument(case):
    logits, targets, adv, calls = _bad_calls()
    error, match, kw = calls[case]
    with pytest.raises(error, match=match):
        x = logits.clone().requires_grad_() * 1.0 if kw.get("inplace") else logits
        fused_rl.policy_loss(x, targets, adv, **kw)


def test_from_logprobs_and_estimate_refuse_full():
    with pytest.raises(ValueError, match="ref_logits"):
        fused_rl.policy_loss_from_logprobs(
            torch.randn(2, 3), torch.randn(2), ref_logprobs=torch.randn(2, 3),
            kl_estimator="full", beta=0.1,
        )  # fmt: skip
    with pytest.raises(ValueError, match="exact KL over the vocabulary"):
        fused_rl.kl_estimate(torch.randn(3), torch.randn(3), kl_estimator="full")


# ----------------------------------------------------------------------------- from hidden states


def _linear_inputs(seed=20, B=2, S=6, T=5, H=8, H_ref=6, V=41):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = 0.5 * torch.randn(V, H, generator=g)
    bias = 0.1 * torch.randn(V, generator=g)
    ref = dict(ref_hidden=torch.randn(B, S, H_ref, generator=g),
               ref_weight=0.5 * torch.randn(V, H_ref, generator=g),
               ref_bias=0.1 * torch.randn(V, generator=g))  # fmt: skip
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[1, 0] = -100
    kw = dict(mask=torch.rand(B, T, generator=g) > 0.3,
              old_logprobs=torch.randn(B, T, generator=g) * 0.3 - 3.0)  # fmt: skip
    adv = torch.randn(B, generator=g)
    hidden, weight, bias, targets, adv = (
        t.to(DEVICE) for t in (hidden, weight, bias, targets, adv)
    )
    ref, kw = ({k: v.to(DEVICE) for k, v in d.items()} for d in (ref, kw))
    return hidden, weight, bias, ref, targets, adv, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ("token", "sequence"))
def test_linear_reference_equal_to_policy_under_autocast(backend, level):
    """Under ``torch.autocast`` both models' logits come from GEMMs in the autocast dtype: a
    reference equal to the policy (fp32 tensors, bf16 autocast, as a trainer's mixed
    precision) gives a KL of exactly 0 and a KL gradient of 0 to rounding, on the one-pass
    (token level) and the composed (sequence level) routes."""
    hidden, weight, bias, _, targets, adv, kw = _linear_inputs(seed=31)
    ref = dict(ref_hidden=hidden.clone(), ref_weight=weight.clone(), ref_bias=bias.clone())
    grads = []
    for beta in (0.0, 0.7):
        h = hidden.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss, metrics = fused_rl.linear_policy_loss(
                h, weight, targets, adv, bias=bias, **ref, **kw, kl_estimator="full",
                beta=beta, importance_sampling=level, chunk_tokens=3, backend=backend,
            )  # fmt: skip
        assert metrics["kl"].item() == 0.0
        grads.append(torch.autograd.grad(loss, h)[0])
    # the softmax backward's p (1 - sum p) rounding: ~1e-9, where bf16 logits against fp32
    # ones give beta (p - q) ~ 1e-3
    torch.testing.assert_close(grads[1], grads[0], atol=1e-7, rtol=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("skip_padding", (True, False))
def test_linear_matches_the_materialised_oracle(backend, skip_padding, monkeypatch):
    """``linear_policy_loss(ref_hidden=, ref_weight=, ref_bias=)`` in chunks of 3 rows: the
    loss, the metrics and the gradients of hidden, weight and bias against the float64
    oracle on both models' materialised logits."""
    monkeypatch.setattr(fused_rl.config, "skip_padding_rows", skip_padding)
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs()
    T, S = targets.shape[1], hidden.shape[1]
    options = dict(kl_estimator="full", beta=0.3, entropy_coef=0.01, eps_high=0.28)
    up = 1.3

    def fused():
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, metrics = fused_rl.linear_policy_loss(
            leaves[0], leaves[1], targets, adv, bias=leaves[2], chunk_tokens=3,
            backend=backend, **ref, **kw, **options,
        )  # fmt: skip
        return loss.detach(), metrics, torch.autograd.grad(loss * up, leaves)

    def oracle():
        leaves = [t.double().requires_grad_() for t in (hidden, weight, bias)]
        z = torch.nn.functional.linear(*leaves)[:, S - T - 1 : S - 1]
        zr = torch.nn.functional.linear(*(t.double() for t in ref.values()))[:, S - T - 1 : S - 1]
        okw = dict(kw, old_logprobs=kw["old_logprobs"].double())
        loss, metrics = oracle_policy_loss(z, targets, adv, ref_logits=zr, **okw, **options)
        return loss.detach(), metrics, torch.autograd.grad(loss * up, leaves)

    (loss, metrics, grads), (o_loss, o_metrics, o_grads) = fused(), oracle()
    assert_rel(loss, o_loss, FP32_TOL, "loss")
    for name, g, o in zip(("hidden", "weight", "bias"), grads, o_grads):
        assert_rel(g, o, FP32_TOL, f"{name} grad")
    for name, value in o_metrics.items():
        assert_rel(metrics[name], value, FP32_TOL, f"metric {name}")
    with torch.no_grad():  # without gradients: the same chunked pass, the same values
        loss_ng, metrics_ng = fused_rl.linear_policy_loss(
            hidden, weight, targets, adv, bias=bias, chunk_tokens=3, backend=backend, **ref,
            **kw, **options,
        )  # fmt: skip
    assert_rel(loss_ng, o_loss, FP32_TOL, "no_grad loss")
    assert_rel(metrics_ng["kl"], o_metrics["kl"], FP32_TOL, "no_grad kl")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    (dict(importance_sampling="sequence"), dict(importance_sampling="sequence-token"),
     dict(importance_sampling="sequence-sum"), dict(surrogate="vespo"),
     dict(top_entropy_quantile=0.5)),
    ids=("gspo", "gspo-token", "rloo", "vespo", "top-entropy"),
)  # fmt: skip
def test_linear_composed_matches_materialised_logits(backend, options):
    """The composed routes from hidden states (GSPO, GSPO-token, VESPO, the top-entropy
    selection: the log-probs, then the exact KL of each chunk's two logits): the loss, the
    metrics and the gradients of hidden, weight and bias as ``policy_loss(ref_logits=)`` on
    both models' materialised logits (checked against the oracle above), in chunks of 3."""
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs(seed=23)
    T, S = targets.shape[1], hidden.shape[1]
    options = dict(options, kl_estimator="full", beta=0.3, entropy_coef=0.01)
    up = 1.3

    def run(materialise):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        if materialise:
            z = torch.nn.functional.linear(*leaves)[:, S - T - 1 : S - 1]
            zr = torch.nn.functional.linear(*ref.values())[:, S - T - 1 : S - 1]
            loss, metrics = fused_rl.policy_loss(z, targets, adv, ref_logits=zr,
                                                  backend=backend, **kw, **options)  # fmt: skip
        else:
            loss, metrics = fused_rl.linear_policy_loss(
                leaves[0], leaves[1], targets, adv, bias=leaves[2], chunk_tokens=3,
                backend=backend, **ref, **kw, **options,
            )  # fmt: skip
        return loss.detach(), metrics, torch.autograd.grad(loss * up, leaves)

    (loss, metrics, grads), (m_loss, m_metrics, m_grads) = run(False), run(True)
    assert_rel(loss, m_loss, 1e-5, "loss")
    for name, g, o in zip(("hidden", "weight", "bias"), grads, m_grads):
        assert_rel(g, o, 1e-5, f"{name} grad")
    for name, value in m_metrics.items():
        assert_rel(metrics[name], value, 1e-5, f"metric {name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", (dict(), dict(importance_sampling="sequence")),
                         ids=("token-level", "gspo"))  # fmt: skip
def test_linear_torch_compile_fullgraph(backend, options):
    """One graph, both ways: the token-level pass and the composed route (the log-probs,
    then the chunks' exact KL, whose backward writes ``dz`` from kept statistics)."""
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs(seed=21)

    def fn(h, w):
        return fused_rl.linear_policy_loss(h, w, targets, adv, chunk_tokens=4, backend=backend,
                                           kl_estimator="full", beta=0.2, **ref, **kw,
                                           **options)  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = []
    for f in (fn, compiled):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, metrics = f(h, w)
        out.append((loss.detach(), metrics["kl"], *torch.autograd.grad(loss, (h, w))))
    for a, b in zip(*out):
        assert_rel(b, a, 1e-6, "compiled")


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
def test_linear_composed_backward_reads_each_chunk_once(monkeypatch):
    """The composed route's exact KL keeps its row statistics: its backward launches the
    gradient kernel once a chunk and no divergence forward (no recomputed statistics, so no
    collective under vocabulary parallelism), and builds no autograd graph."""
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs(seed=24)
    n_chunks = -(-targets.numel() // 3)
    h = hidden.clone().requires_grad_()
    loss, _ = fused_rl.linear_policy_loss(h, weight, targets, adv, chunk_tokens=3,
                                          backend="triton", kl_estimator="full", beta=0.2,
                                          importance_sampling="sequence", **ref, **kw)  # fmt: skip
    with LaunchCounter() as c:
        loss.backward()
    names = [k.split(".")[-1] for k in c.kernels]
    assert names.count("_distill_bwd_kernel") == n_chunks, names
    assert "_distill_fwd_kernel" not in names, names


@pytest.mark.parametrize(
    "change, error, match",
    (
        (dict(ref_weight=torch.randn(40, 6)), ValueError, "ref_weight has a vocabulary of 40"),
        (dict(ref_hidden=torch.randn(2, 5, 6)), ValueError, "ref_hidden must be shaped as hidden"),
        (dict(ref_weight=torch.randn(41, 7)), ValueError, "ref_weight must be the reference"),
        (dict(ref_hidden=None), ValueError, "needs ref_hidden too"),
        (dict(ref_weight=None), ValueError, "needs ref_weight"),
        (dict(ref_bias=torch.randn(40)), ValueError, "ref_bias must be"),
        (dict(ref_weight=torch.randn(41, 6).half(), ref_bias=None), TypeError, "ref_weight"),
        (dict(importance_sampling="sequence", kl_bias_correction=True), NotImplementedError,
         "kl_bias_correction=True .* importance_sampling='sequence'"),
    ),
)  # fmt: skip
def test_linear_bad_input(change, error, match):
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs()
    args = dict(ref, kl_estimator="full", beta=0.2, **kw)
    args.update({k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in change.items()})
    with pytest.raises(error, match=match):
        fused_rl.linear_policy_loss(hidden, weight, targets, adv, **args)


def test_full_without_a_reference_raises_everywhere():
    """``kl_estimator="full"`` reads nothing but the reference's logits: without them every
    entry point raises (never a kernel branch reading a buffer that is not there), even at
    ``beta = 0``; the log-prob entry points refuse it outright."""
    logits, targets, adv, kw = _inputs()
    kw.pop("ref_logits")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="kl_estimator='full' needs ref_logits"):
            fused_rl.policy_loss(logits, targets, adv, kl_estimator="full", backend=backend, **kw)
    with pytest.raises(ValueError, match="kl_estimator='full' needs ref_logits"):
        fused_rl.nn.PolicyLoss(kl_estimator="full")(logits, targets, adv, **kw)
    hidden, weight, bias, ref, targets, adv, kw = _linear_inputs()
    with pytest.raises(ValueError, match="kl_estimator='full' needs ref_weight"):
        fused_rl.linear_policy_loss(hidden, weight, targets, adv, kl_estimator="full", **kw)
    with pytest.raises(ValueError, match="ref_bias is read only by kl_estimator='full'"):
        fused_rl.linear_policy_loss(hidden, weight, targets, adv, ref_bias=ref["ref_bias"],
                                    beta=0.0, **kw)  # fmt: skip
    with pytest.raises(ValueError, match="exact KL over the vocabulary"):
        fused_rl.kl_penalized_rewards(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 3),
                                      kl_coef=0.1, kl_estimator="full")  # fmt: skip


def test_nn_policy_loss_takes_ref_logits():
    logits, targets, adv, kw = _inputs(seed=22)
    module = fused_rl.nn.PolicyLoss(kl_estimator="full", beta=0.2, backend="triton")
    loss, metrics = module(logits, targets, adv, **kw)
    loss0, metrics0 = fused_rl.policy_loss(logits, targets, adv, kl_estimator="full", beta=0.2,
                                           backend="triton", **kw)  # fmt: skip
    assert torch.equal(loss, loss0) and torch.equal(metrics["kl"], metrics0["kl"])
