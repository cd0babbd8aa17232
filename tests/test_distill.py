"""fused_rl.distill_loss (on-policy distillation: forward KL, reverse KL, generalized JSD)
against a float64 oracle written here from the formulas of TRL's ``generalized_jsd_loss``:
values, metrics and the student's gradient under a random upstream gradient, on both
backends; awkward shapes and strides, masks, NaN, gradcheck, torch.compile, launches."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from helpers import F64_TOL, FP32_TOL, gradcheck, rel_err, sm90_compile_output

import fused_rl
import fused_rl.distill as distill_mod
from fused_rl._agg import LOSS_AGG_MODES
from fused_rl._launch import COMPILE_OPTIONS
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
BETAS = (0.0, 0.3, 0.5, 1.0)
# launches per call (tests/test_call_cost.py's counting): forward = the vocab kernel + the
# finalize reduction; backward = the autograd seed + the one gradient kernel; any beta
DISTILL_FWD_LAUNCHES, DISTILL_BWD_LAUNCHES = 2, 2

# ----------------------------------------------------------------------------- oracle


def oracle_terms(s, t, beta, temperature, dtype=torch.float64):
    """Per-token ``(d, forward_kl, reverse_kl, student_entropy, teacher_entropy)`` in
    ``dtype`` (float64: the oracle; the inputs' own half dtype: eager PyTorch in that dtype,
    as TRL computes), straight from the definitions (the mixture from probabilities)."""
    lp = torch.log_softmax(s.to(dtype) / temperature, -1)
    lq = torch.log_softmax(t.to(dtype) / temperature, -1)
    p, q = lp.exp(), lq.exp()
    fwd = (q * (lq - lp)).sum(-1)
    rev = (p * (lp - lq)).sum(-1)
    if beta == 0:
        d = fwd
    elif beta == 1:
        d = rev
    else:
        lm = ((1 - beta) * p + beta * q).log()
        d = beta * (q * (lq - lm)).sum(-1) + (1 - beta) * (p * (lp - lm)).sum(-1)
    return d, fwd, rev, -(p * lp).sum(-1), -(q * lq).sum(-1)


def oracle_weights(shape, mask, targets, ignore_index=-100, device=None):
    m = torch.ones(shape, dtype=torch.float64, device=device) if mask is None else mask.double()
    if targets is not None:
        m = torch.where(targets != ignore_index, m, 0.0)
    return m


def oracle_aggregate(d, m, loss_agg="token-mean", num_items=None, max_length=None):
    """``loss_agg`` as the policy losses define it, on ``(B, T)`` per-token ``d``."""
    md = torch.where(m != 0, m * d, 0.0)
    n_seq, length = d.shape
    if loss_agg == "token-mean":
        den = m.sum() if num_items is None else torch.as_tensor(float(num_items))
        return md.sum() / den if den != 0 else md.sum() * 0
    if loss_agg == "seq-mean-token-mean":
        per = md.sum(1) / torch.where(m.sum(1) != 0, m.sum(1), 1.0)
        return torch.where(m.sum(1) != 0, per, 0.0).sum() / max(n_seq, 1)
    if loss_agg == "seq-mean-token-sum":
        return md.sum() / max(n_seq, 1)
    return md.sum() / (max(n_seq, 1) * (max_length or length))


def oracle_transform(x, scale, cap, dtype):
    """A model's logits as TRL's ``DistillationTrainer`` transforms them with the model's own
    config before the temperature: times its logit scale ``s``, then its soft cap ``c``:
    ``c tanh(s x / c)`` (``s x`` uncapped), in ``dtype``."""
    x = x.to(dtype) * scale
    return x if cap is None else cap * torch.tanh(x / cap)


def oracle_call(s, t, *, beta, temperature=1.0, mask=None, targets=None, loss_agg="token-mean",
                num_items=None, max_length=None, dtype=torch.float64, softcap=None,
                teacher_softcap="same", logit_scale=1.0, teacher_logit_scale=1.0):  # fmt: skip
    """The loss and metrics of ``distill_loss``'s keywords; each model's logits through its
    own scale and cap first (``teacher_softcap="same"``: ``softcap``)."""
    teacher_softcap = softcap if teacher_softcap == "same" else teacher_softcap
    if (softcap, logit_scale) != (None, 1.0):
        s = oracle_transform(s, logit_scale, softcap, dtype)
    if (teacher_softcap, teacher_logit_scale) != (None, 1.0):
        t = oracle_transform(t, teacher_logit_scale, teacher_softcap, dtype)
    terms = oracle_terms(s, t, beta, temperature, dtype)
    rows = terms[0].shape if s.dim() == 3 else (1, s.shape[0])
    m = oracle_weights(s.shape[:-1], mask, targets, device=s.device).reshape(rows)
    terms = [x.reshape(rows) for x in terms]
    loss = oracle_aggregate(terms[0], m, loss_agg, num_items, max_length)
    count = m.sum()
    mean = lambda x: (
        (torch.where(m != 0, m * x.detach(), 0.0).sum() / count) if count else 0 * count
    )
    names = ("jsd", "forward_kl", "reverse_kl", "student_entropy", "teacher_entropy")
    return loss, {name: mean(x) for name, x in zip(names, terms, strict=True)}


def grad_tol(dtype, eager_err, backend):
    """fp32: FP32_TOL; bf16: twice eager bf16's error (floor 1e-3), and one bf16 ulp for the
    interpreter's truncating fp32 -> bf16 store (tests/test_compat_trl.py)."""
    if dtype in (torch.float32, torch.float64):
        return FP32_TOL
    tol = max(2 * eager_err, 1e-3)
    if backend == "triton" and not torch.cuda.is_available():
        tol = max(tol, 2.0**-7)
    return tol


def run(s, t, up, **kw):
    """``(loss, metrics, d loss / d s)`` under the upstream scalar ``up``."""
    s = s.detach().requires_grad_()
    loss, metrics = fused_rl.distill_loss(s, t, **kw)
    (grad,) = torch.autograd.grad(loss, s, up.to(loss.dtype))
    return loss, metrics, grad


def check_against_oracle(s, t, *, backend, dtype=torch.float32, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    up = torch.randn((), generator=gen, dtype=torch.float64).to(s.device)
    loss, metrics, grad = run(s, t, up, backend=backend, **kw)
    s64 = s.detach().double().requires_grad_()
    want, want_metrics = oracle_call(s64, t.detach().double(), **kw)
    (want_grad,) = torch.autograd.grad(want, s64, up)
    assert loss.dtype == (torch.float64 if torch.float64 in (s.dtype, t.dtype) else torch.float32)
    assert grad.dtype == s.dtype and grad.shape == s.shape
    tol = FP32_TOL if dtype != torch.float64 else F64_TOL
    assert rel_err(loss, want) <= tol, (rel_err(loss, want), float(loss), float(want))
    for name, value in want_metrics.items():
        assert metrics[name].dtype == torch.float32 and metrics[name].shape == ()
        assert not metrics[name].requires_grad
        assert rel_err(metrics[name], value) <= max(tol, 1e-6), name
    eager_err = 0.0
    if dtype in (torch.float16, torch.bfloat16):
        leaf = s.detach().clone().requires_grad_()
        eager, _ = oracle_call(leaf, t.detach(), dtype=dtype, **kw)
        (eager_grad,) = torch.autograd.grad(eager, leaf, up.to(dtype))
        eager_err = rel_err(eager_grad, want_grad)
    assert rel_err(grad, want_grad) <= grad_tol(dtype, eager_err, backend), rel_err(grad, want_grad)
    return loss, metrics, grad


def make(shape, dtype=torch.float32, *, seed=0, scale=2.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)
    return s, t, gen


# ----------------------------------------------------------------------------- values, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_oracle(beta, temperature, dtype, backend, device):
    """Strided student (the model's ``[:, :-1]`` slice) and teacher (a transposed buffer),
    a float mask and ignored targets."""
    gen = torch.Generator().manual_seed(int(beta * 10) + int(temperature * 10))
    B, T, V = 2, 5, 37
    buf = (torch.randn(B, T + 1, V, generator=gen) * 2).to(device, dtype)
    s = buf[:, :-1]
    t = (torch.randn(T, B, V, generator=gen) * 2).to(device, dtype).transpose(0, 1)
    mask = torch.rand(B, T, generator=gen).to(device)
    mask[0, 1] = 0.0
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    targets[1, :2] = -100
    check_against_oracle(s, t, backend=backend, dtype=dtype, beta=beta,
                         temperature=temperature, mask=mask, targets=targets)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
@pytest.mark.parametrize("cap", (2.0, 30.0))
def test_softcap(backend, beta, cap, device):
    """Gemma's cap on both models' logits, ``c tanh(x / c)`` before the temperature: the
    float64 oracle on the capped logits, differentiated through the cap; a masked NaN row
    never matters (the reference zeroes it before the cap)."""
    s, t, _ = make((2, 5, 37), seed=3, scale=4.0, device=device)
    mask = (torch.rand(2, 5, generator=torch.Generator().manual_seed(4)) > 0.3).to(device)
    s[0, 0], t[1, 1] = float("nan"), float("nan")
    mask[0, 0] = mask[1, 1] = False
    up = torch.tensor(1.3, dtype=torch.float64, device=device)
    loss, metrics, grad = run(s, t, up, beta=beta, temperature=0.8, mask=mask, softcap=cap,
                              backend=backend)  # fmt: skip
    s64 = torch.where(mask[..., None], s.double(), 0.0).requires_grad_()
    t64 = torch.where(mask[..., None], t.double(), 0.0)
    want, want_metrics = oracle_call(cap * torch.tanh(s64 / cap), cap * torch.tanh(t64 / cap),
                                     beta=beta, temperature=0.8, mask=mask)  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, s64, up)
    assert rel_err(loss, want) <= FP32_TOL
    assert rel_err(grad, want_grad) <= FP32_TOL and torch.isfinite(grad).all()
    for name, value in want_metrics.items():
        assert rel_err(metrics[name], value) <= 1e-5, name
    with pytest.raises(ValueError, match="softcap"):
        fused_rl.distill_loss(s, t, softcap=0.0)


# each model's own logit scale and soft cap (TRL's ``DistillationTrainer``: the student's and
# the teacher's config), as distill_loss / linear_distill_loss keywords
SPLIT_CASES = {
    "student_scaled": dict(logit_scale=2.5),
    "teacher_scaled": dict(teacher_logit_scale=0.4),
    "scaled_alike": dict(logit_scale=1.7, teacher_logit_scale=1.7),  # one transform: not split
    "student_capped": dict(softcap=3.0, teacher_softcap=None),
    "teacher_capped": dict(teacher_softcap=2.0),
    "caps_differ": dict(softcap=3.0, teacher_softcap=5.0),
    "all_differ": dict(logit_scale=1.5, softcap=4.0, teacher_logit_scale=0.6,
                       teacher_softcap=2.5),
}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", (0.0, 0.3, 1.0))
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_each_model_its_own_transform(case, beta, dtype, backend, device):
    """``z = c tanh(s x / c) / T`` with each model's own ``s`` and ``c``: the float64 oracle
    (each model's transform, then TRL's divergence) on a strided student, a transposed
    teacher, a float mask and ignored targets: the loss, all five metrics and the gradient
    through the student's scale and cap under a random upstream gradient."""
    gen = torch.Generator().manual_seed(int(beta * 10) + 3 * list(SPLIT_CASES).index(case))
    B, T, V = 2, 5, 37
    buf = (torch.randn(B, T + 1, V, generator=gen) * 2).to(device, dtype)
    t = (torch.randn(T, B, V, generator=gen) * 2).to(device, dtype).transpose(0, 1)
    mask = torch.rand(B, T, generator=gen).to(device)
    mask[0, 1] = 0.0
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    targets[1, :2] = -100
    check_against_oracle(buf[:, :-1], t, backend=backend, dtype=dtype, beta=beta,
                         temperature=0.8, mask=mask, targets=targets,
                         **SPLIT_CASES[case])  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape", [(3, 1, 11), (2, 3, 5), (1, 2, 1), (7, 13), (1, 3, 5000)], ids=str
)  # T = 1, V below one block, V = 1, packed (N, V), V above one block
def test_own_transforms_awkward_shapes(shape, backend, device):
    """Split transforms on awkward shapes, a masked row holding NaN / inf (never read: an
    exact zero gradient), the float64 oracle on the other rows."""
    for k, (beta, case) in enumerate(((0.0, "all_differ"), (0.3, "teacher_capped"),
                                      (1.0, "student_scaled"))):  # fmt: skip
        s, t, gen = make(shape, seed=k + shape[-1], scale=1.0, device=device)
        mask = torch.ones(shape[:-1], dtype=torch.bool, device=device)
        mask.view(-1)[-1] = False
        s.view(-1, shape[-1])[-1, 0] = float("nan")
        t.view(-1, shape[-1])[-1, -1] = float("inf")
        up = torch.tensor(0.9, dtype=torch.float64, device=device)
        kw = dict(beta=beta, temperature=0.9, mask=mask, **SPLIT_CASES[case])
        loss, metrics, grad = run(s, t, up, backend=backend, **kw)
        keep = mask[..., None]
        s64 = torch.where(keep, s.double(), 0.0).requires_grad_()
        want, want_metrics = oracle_call(s64, torch.where(keep, t.double(), 0.0), **kw)
        (want_grad,) = torch.autograd.grad(want, s64, up)
        assert rel_err(loss, want) <= FP32_TOL, (case, rel_err(loss, want))
        for name, value in want_metrics.items():
            assert rel_err(metrics[name], value) <= 1e-5, (case, name)
        assert rel_err(grad, want_grad) <= FP32_TOL, (case, rel_err(grad, want_grad))
        assert bool((grad.view(-1, shape[-1])[-1] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("cap", (None, 3.0))
def test_equal_transforms_are_the_call_without_them(cap, beta, backend, device):
    """The new keywords at their defaults, spelled out (or the teacher's cap given as the
    student's, a scale as the int 1) run exactly today's code: bit-identical values, metrics
    and gradient."""
    s, t, gen = make((2, 4, 29), device=device, seed=31)
    mask = (torch.rand(2, 4, generator=gen) > 0.2).to(device)
    up = torch.tensor(1.1, device=device)
    want = run(s, t, up, beta=beta, temperature=0.7, softcap=cap, mask=mask, backend=backend)
    for kw in (dict(teacher_softcap=cap), dict(logit_scale=1.0, teacher_logit_scale=1),
               dict(logit_scale=1, teacher_logit_scale=1.0, teacher_softcap=cap)):  # fmt: skip
        got = run(s, t, up, beta=beta, temperature=0.7, softcap=cap, mask=mask,
                  backend=backend, **kw)  # fmt: skip
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), kw
        assert all(torch.equal(got[1][k], want[1][k]) for k in want[1]), kw
    tf = distill_mod.check_transforms(cap, cap, 1, 1.0)
    assert not tf.split and "SPLIT" not in distill_mod._transform_args(0.7, tf)[1]
    assert distill_mod.check_transforms(cap, distill_mod.SAME_AS_STUDENT, 2.0, 2.0).split is False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case, beta",
    [("all_differ", 0.0), ("all_differ", 0.4), ("all_differ", 1.0), ("student_capped", 0.4),
     ("teacher_scaled", 1.0)],
)  # fmt: skip
def test_own_transforms_gradcheck_float64(case, beta, backend, device):
    gen = torch.Generator().manual_seed(19)
    s = (torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 3).to(device)
    t = (torch.randn(2, 2, 5, generator=gen, dtype=torch.float64) * 3).to(device)
    mask = torch.tensor([[1.0, 0.5], [0.0, 2.0]], dtype=torch.float64, device=device)
    fn = lambda x: fused_rl.distill_loss(
        x, t, beta=beta, temperature=0.7, mask=mask, loss_agg="seq-mean-token-mean",
        backend=backend, **SPLIT_CASES[case],
    )[0]  # fmt: skip
    assert gradcheck(fn, (s.requires_grad_(),))


@pytest.mark.parametrize("name", ["logit_scale", "teacher_logit_scale", "teacher_softcap"])
def test_bad_transform_arguments_name_the_argument(name, device):
    s, t, _ = make((2, 3, 7), device=device)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            fused_rl.distill_loss(s, t, **{name: bad})
    for bad in ("2", True, torch.tensor(2.0)):
        with pytest.raises(TypeError, match=rf"\b{name}\b"):
            fused_rl.distill_loss(s, t, **{name: bad})
    assert fused_rl.distill_loss(s, t, **{name: 2})[0].isfinite()  # an int is a real number


def eager_fp32_loss(s, t, beta):
    """TRL's ``generalized_jsd_loss`` math in fp32 (``F.kl_div`` with log targets, the
    mixture from ``logsumexp``), mean over rows: the eager baseline of the near-equal test."""
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    kl = lambda inp, tgt: torch.nn.functional.kl_div(inp, tgt, reduction="none", log_target=True)
    if beta == 0:
        d = kl(ls, lt)
    elif beta == 1:
        d = kl(lt, ls)
    else:
        b = torch.tensor(beta, dtype=ls.dtype)
        lm = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), 0)
        d = b * kl(lm, lt) + (1 - b) * kl(lm, ls)
    return d.sum(-1).mean()


def perturbed_rows(eps: float, beta: float, seed: int):
    """``(s, t, loss, grad)``: 4 fp32 teacher rows ``t`` of 2048 logits, the student ``s = t +
    eps * noise`` (fp32), and the float64 oracle's token-mean divergence and its gradient."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(4, 2048, generator=gen, dtype=torch.float64) * 2
    s = (t + eps * torch.randn(t.shape, generator=gen, dtype=torch.float64)).float()
    t = t.float()
    leaf = s.double().requires_grad_()
    want = oracle_aggregate(oracle_terms(leaf, t.double(), beta, 1.0)[0][None], torch.ones(1, 4))
    (want_grad,) = torch.autograd.grad(want, leaf)
    return s, t, want, want_grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
@pytest.mark.parametrize("eps", (1e-1, 1e-2, 1e-3))
def test_near_equal_student_and_teacher(eps, beta, backend, device):
    """``s = t + eps * noise``: every divergence is of order ``eps^2`` while the
    log-probabilities are of order ``log V``; a per-column rounding of ``ulp(log V)`` would
    cost a relative ``ulp / eps^2`` (CONTRIBUTING.md, near-cancellation). The loss and the
    gradient stay within 2x eager fp32's relative error vs a float64 oracle, and within a
    fixed bound (the kernel's forms leave at most ``O(ulp / eps)``, the forward KL's
    ``E_q[b - a]`` against ``log(S_z / S_u)``: 4e-4 at eps = 1e-3 covers it 20x). At eps =
    0.1 the interpreter's forward-KL loss is 1.7e-6 off, the rounding of fp32 row sums of
    terms ~1/eps times the KL in size; a GPU sums in another order and went past 2e-6 (an
    H200, 2026-11-28): the bound leaves 2x."""
    s, t, want, want_grad = perturbed_rows(eps, beta, seed=7)
    leaf = s.clone().requires_grad_()
    (eager_grad,) = torch.autograd.grad(eager_fp32_loss(leaf, t, beta), leaf)
    eager_err = rel_err(eager_fp32_loss(s, t, beta), want)
    eager_grad_err = rel_err(eager_grad, want_grad)
    up = torch.tensor(1.0, device=device)
    loss, _, grad = run(s.to(device), t.to(device), up, beta=beta, backend=backend)
    bound = 4e-7 / eps
    assert rel_err(loss, want) <= max(2 * eager_err, bound), (rel_err(loss, want), eager_err)
    assert rel_err(grad, want_grad) <= max(2 * eager_grad_err, bound), (
        rel_err(grad, want_grad), eager_grad_err)  # fmt: skip
    if backend == "triton" or beta not in (0.0, 1.0):  # the reference's KL grads are autograd's
        assert rel_err(loss, want) <= bound and rel_err(grad, want_grad) <= bound


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", (0.99, 0.9999))
@pytest.mark.parametrize("eps", (1.0, 1e-2))
def test_beta_near_one(eps, beta, backend, device):
    """A JSD weighted almost all on ``KL(q || m)`` (``m`` near ``q``): fp32 loss and gradient
    within 1e-6 of float64 (measured at most 3.5e-7 on both backends). ``beta g1 - g2`` (the
    near columns' series form), ``1 - beta`` formed from an fp32 ``beta``, and ``log q - log
    m`` of two log-probabilities all cancel by about ``1 / (1 - beta)``: the loss was 8e-4
    off and the gradient 1.7e-4 at 0.9999 before the polynomial near form and the ``log1p``
    far form (``kernels/vocab/distill.py`` ``mixture_terms``)."""
    s, t, want, want_grad = perturbed_rows(eps, beta, seed=3)
    up = torch.tensor(1.0, device=device)
    loss, _, grad = run(s.to(device), t.to(device), up, beta=beta, backend=backend)
    assert rel_err(loss, want) <= 1e-6 and rel_err(grad, want_grad) <= 1e-6, (
        rel_err(loss, want), rel_err(grad, want_grad))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "shape", [(3, 1, 11), (2, 3, 5), (1, 2, 1), (7, 13), (1, 3, 5000), (2, 1024)], ids=str
)  # T = 1, V below one block, V = 1, packed (N, V), V above one block, whole blocks only
def test_awkward_shapes(shape, backend, device):
    for beta in (0.0, 0.4, 1.0):
        s, t, _ = make(shape, seed=len(shape) + shape[-1], device=device)
        if shape[-1] == 5000:  # the row maximum in the second block for one row only
            s[..., 0, 4500] += 12.0
            t[..., 1, 4200] += 12.0
        check_against_oracle(s, t, backend=backend, beta=beta, temperature=0.9)


@pytest.mark.parametrize("beta", BETAS)
def test_online_rescaling_over_many_blocks(beta, device, monkeypatch):
    """Blocks of 16 columns over rows whose maximum rises block after block (and falls, and
    jumps by 1e3): every online rescaling of the running sums is exercised."""
    monkeypatch.setattr(
        distill_mod, "vocab_launch", lambda v, **_: {"BLOCK_V": 16, **COMPILE_OPTIONS}
    )
    V = 100
    ramp = torch.linspace(-3.0, 9.0, V, dtype=torch.float64)
    s = torch.stack([ramp, ramp.flip(0), torch.randn(V, dtype=torch.float64)]).reshape(1, 3, V)
    t = torch.stack([torch.randn(V, dtype=torch.float64), ramp, ramp * 0.5]).reshape(1, 3, V)
    s[0, 2, 70] += 1000.0  # a far larger logit late in the row
    t[0, 0, 50] -= 1000.0
    check_against_oracle(s.float().to(device), t.float().to(device), backend="triton", beta=beta)
    check_against_oracle(s.to(device), t.to(device), backend="triton", beta=beta,
                         dtype=torch.float64, temperature=0.7)  # fmt: skip


@pytest.mark.parametrize("beta", BETAS)
def test_flat_student_peaked_teacher(beta, device):
    """A flat student (``S_z`` near ``V``) against a peaked teacher (``S_u`` of a few): each
    row's sums kept apart (``S_u`` summed, not ``S_z`` plus the difference the stream sums
    term by term, which is ``V`` roundoffs off here), every metric against the oracle."""
    gen = torch.Generator().manual_seed(17)
    s = 0.05 * torch.randn(1, 4, 4096, generator=gen)
    t = 3.0 * torch.randn(1, 4, 4096, generator=gen)
    check_against_oracle(s.to(device), t.to(device), backend="triton", beta=beta)


def _rows_above_the_first_block(kind, vocab, gen):
    """One student and one teacher row of ``vocab`` (four 512-column blocks and a partial
    one at 2051) whose later blocks reach past the first block's maximum."""
    s = torch.randn(1, 1, vocab, generator=gen, dtype=torch.float64)
    t = s + 0.5 * torch.randn(1, 1, vocab, generator=gen, dtype=torch.float64)
    if kind == "a little above":
        s[..., :512] -= 1.3
        t[..., :512] -= 1.2
    elif kind == "one value far above":  # one lane of one block raises each maximum
        s[..., 1500] = s[..., :512].max() + 5.0
        t[..., 700] = t[..., :512].max() + 4.5
    elif kind == "rising by 100 a block":  # e^100 overflows fp32
        s += 100.0 * (torch.arange(vocab) // 512)
        t += 100.0 * (torch.arange(vocab) // 512)
    else:  # "a peak in the last block"
        s[..., -2] += 12.0
        t[..., -1] += 10.0
    return s.float(), t.float()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
@pytest.mark.parametrize("vocab", (2048, 2051))
@pytest.mark.parametrize(
    "kind",
    ("a little above", "one value far above", "rising by 100 a block", "a peak in the last block"),
)
def test_maxima_above_the_first_block(kind, vocab, beta, dtype, device):
    """The forward moves its running sums only in a block one of whose lanes holds a value
    above a running maximum (``kernels/vocab/pair.py``: each lane's maxima, one flag a lane):
    rows whose later blocks pass the first block's maxima a little, in one value of one
    lane, by 100 a block (``e^100`` overflows fp32), in the last column. One row a call, so
    every metric is that row's own, against the float64 oracle."""
    if dtype == torch.bfloat16 and kind == "rising by 100 a block" and 0 < beta < 1:
        pytest.skip("eager bf16's mixture (the bf16 tolerance's yardstick) is NaN on this row")
    s, t = _rows_above_the_first_block(kind, vocab, torch.Generator().manual_seed(23))
    check_against_oracle(s.to(device, dtype), t.to(device, dtype), backend="triton", beta=beta,
                         dtype=dtype)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_weight_underflowing_opposite_neg_inf(beta, backend, device):
    """A probability that underflows to 0 in fp32 at a finite logit (-200 below the row's
    maximum) opposite a -inf logit of the other row: its term is 0 (``0 * -inf`` is not
    summed), so the divergences stay finite, each backend as the other, ``token_kl`` the
    fp32 reverse KL."""
    s = torch.tensor([[[0.0, 1.0, -200.0], [0.0, 1.0, float("-inf")]]], device=device)
    t = torch.tensor([[[0.5, 0.0, float("-inf")], [0.5, 0.0, -200.0]]], device=device)
    up = torch.tensor(0.9, device=device)
    loss, metrics, grad = run(s, t, up, beta=beta, backend=backend)
    want, want_metrics, want_grad = run(s, t, up, beta=beta, backend="reference")
    # in fp32 (float64 keeps e^-201 > 0 against q = 0: +inf)
    p, q = torch.softmax(s, -1).double(), torch.softmax(t, -1).double()
    rev = torch.where(p > 0, p * (p.log() - q.log()), 0.0).sum(-1)  # finite: q > 0 where p is
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert rel_err(loss, want) <= FP32_TOL and rel_err(grad, want_grad) <= FP32_TOL
    for name in ("forward_kl", "reverse_kl", "student_entropy", "teacher_entropy"):
        assert rel_err(metrics[name], want_metrics[name]) <= FP32_TOL, name
    kl = fused_rl.token_kl(s[:, :1], t[:, :1], backend=backend)
    assert rel_err(kl, rev[:, :1]) <= FP32_TOL


@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_no_value_in_the_first_block(beta, device):
    """A first block of ``-inf`` in both rows, then values near ``-1000``: the running maxima
    come from the first values (from 0, every ``e^(z - 0)`` would be 0). Against the oracle on
    the finite columns; the ``-inf`` columns' gradient is 0."""
    gen = torch.Generator().manual_seed(29)
    s = torch.randn(1, 2, 1539, generator=gen) - 1000.0
    t = s + 0.5 * torch.randn(1, 2, 1539, generator=gen)
    s[..., :512] = t[..., :512] = -math.inf
    up = torch.tensor(0.8, device=device)
    loss, metrics, grad = run(s.to(device), t.to(device), up, beta=beta, backend="triton")
    finite = s[..., 512:].to(device, torch.float64).requires_grad_()
    want, want_metrics = oracle_call(finite, t[..., 512:].to(device, torch.float64), beta=beta)
    (want_grad,) = torch.autograd.grad(want, finite, up.double())
    assert rel_err(loss, want) <= FP32_TOL
    for name, value in want_metrics.items():
        assert rel_err(metrics[name], value) <= FP32_TOL, name
    assert rel_err(grad[..., 512:], want_grad) <= FP32_TOL
    assert (grad[..., :512] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_strides_mixed_dtypes_and_large_offsets(backend, device):
    """Last-dim strides, a student and teacher of different dtypes, logits offset by 1e4 (all
    statistics are relative to the row maxima: nothing cancels)."""
    s, t, _ = make((2, 4, 2 * 29), device=device, seed=5)
    check_against_oracle(s[..., ::2], t[..., 1::2], backend=backend, beta=0.5)
    s, t, _ = make((2, 4, 29), device=device, seed=6)
    check_against_oracle(s + 1e4, t - 1e4, backend=backend, beta=0.0)
    check_against_oracle(s + 1e4, t - 1e4, backend=backend, beta=0.7)
    s16, t32 = s.to(torch.bfloat16), t.to(torch.float32)
    check_against_oracle(s16, t32, backend=backend, beta=0.3, dtype=torch.bfloat16)
    check_against_oracle(t32.half(), s16, backend=backend, beta=1.0, dtype=torch.float16)
    loss, _, grad = run(s.double(), t, torch.tensor(1.0, device=device), beta=0.5,
                        backend=backend)  # fmt: skip
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_every_loss_agg_and_num_items(loss_agg, backend, device):
    s, t, gen = make((3, 4, 17), device=device, seed=11)
    mask = (torch.rand(3, 4, generator=gen) > 0.3).to(device)
    mask[2] = False  # an empty sequence
    for kw in ({}, {"num_items": 7}, {"num_items": torch.tensor(4.5, device=device)},
               {"max_length": 9}):  # fmt: skip
        if "num_items" in kw and loss_agg != "token-mean":
            continue
        if "max_length" in kw and loss_agg != "seq-mean-token-sum-norm":
            continue
        check_against_oracle(s, t, backend=backend, beta=0.3, temperature=0.8, mask=mask,
                             loss_agg=loss_agg, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_tensor_not_positive_is_nan(backend, device):
    s, t, _ = make((2, 3, 7), device=device)
    for bad in (0.0, -2.0):
        loss, metrics = fused_rl.distill_loss(
            s, t, num_items=torch.tensor(bad, device=device), backend=backend
        )
        assert loss.isnan() and torch.isfinite(metrics["jsd"])
    empty = torch.zeros(0, 3, 7, device=device)
    loss, _ = fused_rl.distill_loss(empty, empty, num_items=torch.tensor(0.0), backend=backend)
    assert loss.isnan()


# ----------------------------------------------------------------------------- masks, NaN


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_ignored_and_empty(backend, device):
    """Uncounted tokens never matter (NaN / inf logits there included) and get exact zero
    gradients; a batch where nothing counts gives 0 for the loss and every metric."""
    s, t, gen = make((2, 4, 9), device=device, seed=3)
    targets = torch.randint(0, 9, (2, 4), generator=gen).to(device)
    targets[0] = -100  # a whole sequence ignored
    mask = torch.ones(2, 4, dtype=torch.bool, device=device)
    mask[1, 2] = False
    s[0, 1, 3] = t[1, 2, 0] = float("nan")
    s[1, 2, 4] = float("inf")
    for beta in BETAS:
        for agg in LOSS_AGG_MODES:
            loss, metrics, grad = run(
                s, t, torch.tensor(0.8, device=device), beta=beta, mask=mask, targets=targets,
                loss_agg=agg, backend=backend,
            )  # fmt: skip
            assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
            assert torch.isfinite(grad).all()
            assert bool((grad[0] == 0).all()) and bool((grad[1, 2] == 0).all())
    nothing = torch.zeros(2, 4, device=device)
    for agg in LOSS_AGG_MODES:
        loss, metrics, grad = run(s, t, torch.tensor(1.0, device=device), mask=nothing,
                                  loss_agg=agg, backend=backend)  # fmt: skip
        assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
        assert bool((grad == 0).all())
    empty = torch.zeros(0, 4, 9, device=device)
    loss, metrics = fused_rl.distill_loss(empty, empty, backend=backend)
    assert loss.item() == 0.0 and metrics["jsd"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_nan_in_nan_out(beta, backend, device):
    """A NaN logit (student or teacher) or an all ``-inf`` student row in a counted token
    makes the loss and the metrics NaN; the other rows' gradients stay finite."""
    for where in ("student", "teacher", "neg_inf_row"):
        s, t, _ = make((2, 3, 11), device=device, seed=4)
        if where == "student":
            s[1, 1, 5] = float("nan")
        elif where == "teacher":
            t[1, 1, 5] = float("nan")
        else:
            s[1, 1] = float("-inf")
        loss, metrics, grad = run(s, t, torch.tensor(1.0, device=device), beta=beta,
                                  backend=backend)  # fmt: skip
        assert loss.isnan(), where
        assert metrics["jsd"].isnan(), where
        assert torch.isfinite(grad[0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_neg_inf_columns_are_the_smaller_vocabulary(beta, backend, device):
    """Columns that are ``-inf`` in both rows (a padded vocabulary) give exactly the
    divergence over the other columns, and zero gradient there (TRL's ``F.kl_div`` gives
    NaN: ``0 * (-inf - -inf)``)."""
    s, t, _ = make((2, 3, 12), device=device, seed=8)
    keep = torch.ones(12, dtype=torch.bool)
    keep[[2, 7, 11]] = False
    s[..., ~keep] = float("-inf")
    t[..., ~keep] = float("-inf")
    up = torch.tensor(1.3, device=device)
    loss, metrics, grad = run(s, t, up, beta=beta, temperature=0.8, backend=backend)
    want, want_metrics, want_grad = run(s[..., keep], t[..., keep], up, beta=beta,
                                        temperature=0.8, backend=backend)  # fmt: skip
    assert rel_err(loss, want) <= 1e-6
    assert all(rel_err(metrics[k], want_metrics[k]) <= 1e-6 for k in metrics)
    assert bool((grad[..., ~keep] == 0).all())
    assert rel_err(grad[..., keep], want_grad) <= 1e-6


def test_teacher_is_never_written(device):
    s, t, _ = make((2, 3, 11), device=device)
    before = t.clone()
    s.requires_grad_()
    for backend in BACKENDS:
        loss, _ = fused_rl.distill_loss(s, t, beta=0.5, backend=backend)
        loss.backward()
    assert torch.equal(t, before) and t.grad is None
    with torch.no_grad():  # a teacher that requires grad is fine where no gradient flows
        fused_rl.distill_loss(s, t.clone().requires_grad_(), backend="triton")


# ----------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_free_logprob_gradient(beta, backend, device):
    """The kernel's ``FREE`` form (``fused_rl.compat.liger.liger_jsd``): on log-probability
    inputs the same value, and the gradient of the divergence written on ``log p`` with
    ``log p`` free (Liger's dX: ``-q``, ``p (log p - log q + 1)``, ``(1 - beta) p log(p /
    m)``), per counted row times its weight; through a ``log_softmax`` the softmax gradient."""
    from fused_rl.distill import _distill_loss

    gen = torch.Generator().manual_seed(21)
    x = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64).log_softmax(-1).to(device)
    y = torch.randn(2, 3, 13, generator=gen, dtype=torch.float64).log_softmax(-1).to(device)
    mask = torch.tensor([[1.0, 0.0, 2.0], [0.5, 1.0, 1.0]], dtype=torch.float64, device=device)
    up = torch.tensor(0.9, dtype=torch.float64, device=device)
    leaf = x.clone().requires_grad_()
    loss, _ = _distill_loss(leaf, y, beta, 1.0, mask, None, -100, "token-mean", None, None,
                            backend, True)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, leaf, up)
    x64 = x.clone().requires_grad_()
    q, p = x64.exp(), y.exp()  # Liger's notation: Q the student's, P the teacher's
    if beta == 0:
        terms = p * (y - x64)
    elif beta == 1:
        terms = q * (x64 - y)
    else:
        log_m = (beta * p + (1 - beta) * q).log()
        terms = beta * p * (y - log_m) + (1 - beta) * q * (x64 - log_m)
    want = (terms.sum(-1) * mask).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, x64, up)
    assert rel_err(loss, want) <= F64_TOL and rel_err(grad, want_grad) <= F64_TOL
    assert bool((grad[0, 1] == 0).all())
    plain, _, plain_grad = run(x, y, up, beta=beta, mask=mask, backend=backend)
    assert rel_err(plain, want) <= F64_TOL and rel_err(plain_grad, want_grad) > 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradcheck_float64(beta, backend, device):
    gen = torch.Generator().manual_seed(17)
    s = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64).to(device).requires_grad_()
    t = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64).to(device)
    mask = torch.tensor([[1.0, 0.5], [0.0, 2.0]], dtype=torch.float64, device=device)
    fn = lambda x: fused_rl.distill_loss(
        x, t, beta=beta, temperature=0.7, mask=mask, loss_agg="seq-mean-token-mean",
        backend=backend,
    )[0]  # fmt: skip
    assert gradcheck(fn, (s,))


def test_double_backward_raises(device):
    s, t, _ = make((1, 2, 5), torch.float64, device=device)
    s.requires_grad_()
    loss, _ = fused_rl.distill_loss(s, t, backend="triton")
    (g,) = torch.autograd.grad(loss, s, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(g.square().sum(), s)


@pytest.mark.no_poison
@pytest.mark.parametrize("case", [None, "all_differ"])  # each model its own transform
def test_torch_compile_fullgraph(case, device):
    s, t, gen = make((2, 4, 23), device=device, seed=12)
    mask = (torch.rand(2, 4, generator=gen) > 0.2).to(device)
    targets = torch.randint(0, 23, (2, 4), generator=gen).to(device)
    targets[0, 0] = -100

    def f(x, y, m, lab):
        loss, metrics = fused_rl.distill_loss(x[:, 1:], y[:, 1:], beta=0.3, temperature=0.7,
                                              mask=m[:, 1:], targets=lab[:, 1:],
                                              **SPLIT_CASES.get(case, {}))  # fmt: skip
        return loss, metrics["forward_kl"], metrics["teacher_entropy"]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    outs = []
    for fn in (f, compiled):
        x = s.clone().requires_grad_()
        out = fn(x, t, mask, targets)
        (grad,) = torch.autograd.grad(out[0], x, torch.tensor(0.6, device=device))
        outs.append((*out, grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_deterministic(device):
    s, t, _ = make((3, 5, 31), device=device, seed=13)
    a = run(s, t, torch.tensor(1.0, device=device), beta=0.5, backend="triton")
    b = run(s, t, torch.tensor(1.0, device=device), beta=0.5, backend="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------------- cost


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_launches_and_one_nv_allocation(beta, device, monkeypatch):
    """Forward: the vocab kernel and the finalize reduction (any beta: the JSD's second pass
    is inside the kernel); backward: the autograd seed and one gradient kernel. The only
    N*V-sized allocation is the student's gradient (O(N) floats otherwise)."""
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    B, T, V = 2, 6, 500
    s, t, gen = make((B, T, V), device=device)
    s.requires_grad_()
    mask = torch.rand(B, T, generator=gen).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    with LaunchCounter() as fwd:
        loss, metrics = fused_rl.distill_loss(s, t, beta=beta, mask=mask, targets=targets,
                                              backend="triton")  # fmt: skip
    with LaunchCounter() as bwd:
        loss.backward()
    assert fwd.total == DISTILL_FWD_LAUNCHES, (fwd.ops, fwd.kernels)
    assert bwd.total == DISTILL_BWD_LAUNCHES, (bwd.ops, bwd.kernels)
    s.grad = None
    with AllocationTracker() as a:
        loss, _ = fused_rl.distill_loss(s, t, beta=beta, mask=mask, targets=targets,
                                        backend="triton")  # fmt: skip
        loss.backward()
    assert a.count_at_least(B * T * V * s.element_size() // 4) == 1


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_name_the_argument(device):
    s, t, _ = make((2, 3, 7), device=device)
    call = lambda **kw: fused_rl.distill_loss(kw.pop("s", s), kw.pop("t", t), **kw)
    with pytest.raises(ValueError, match=r"teacher_logits.*V = 7.*V = 8"):
        call(t=torch.randn(2, 3, 8, device=device))
    with pytest.raises(ValueError, match=r"teacher_logits must have logits' shape"):
        call(t=torch.randn(3, 2, 7, device=device))
    with pytest.raises(ValueError, match=r"teacher_logits requires grad.*detach"):
        call(t=t.clone().requires_grad_())
    for bad in (-0.1, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"\bbeta\b"):
            call(beta=bad)
    for bad in (True, torch.tensor(0.5), "0.5"):
        with pytest.raises(TypeError, match=r"\bbeta\b"):
            call(beta=bad)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match=r"\btemperature\b"):
            call(temperature=bad)
    with pytest.raises(ValueError, match=r"\blogits\b"):
        call(s=s[0, 0], t=t[0, 0])
    with pytest.raises(ValueError, match=r"\blogits\b"):
        call(s=s[None], t=t[None])
    with pytest.raises(TypeError, match=r"\bteacher_logits\b"):
        call(t=t.long())
    with pytest.raises(ValueError, match=r"\bmask\b"):
        call(mask=torch.ones(3, 2, device=device))
    with pytest.raises(ValueError, match=r"\bmask\b has a negative weight"):
        call(mask=-torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match=r"\btargets\b"):
        call(targets=torch.zeros(2, 4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match=r"\btargets\b"):
        call(targets=torch.zeros(2, 3, device=device))
    with pytest.raises(TypeError, match=r"\bignore_index\b"):
        call(ignore_index=-100.0)
    with pytest.raises(ValueError, match=r"\bloss_agg\b"):
        call(loss_agg="mean")
    with pytest.raises(ValueError, match=r"\bnum_items\b"):
        call(num_items=0)
    with pytest.raises(ValueError, match=r"\bbackend\b"):
        call(backend="cuda")


def test_kernel_tables_match_the_python_names():
    import fused_rl.kernels.vocab.distill as k

    v = lambda x: int(getattr(x, "value", x))

    assert [v(k.MODE_FORWARD_KL), v(k.MODE_REVERSE_KL), v(k.MODE_JSD)] == [
        distill_mod.DIVERGENCES.index(n) for n in ("forward_kl", "reverse_kl", "jsd")
    ]
    cols = [k.COL_D, k.COL_FORWARD_KL, k.COL_REVERSE_KL, k.COL_STUDENT_ENTROPY,
            k.COL_TEACHER_ENTROPY, k.COL_COUNT]  # fmt: skip
    assert [v(c) for c in cols] == list(range(len(distill_mod.COLUMNS)))
    assert k.N_COLS == len(cols)
    assert distill_mod.N_STATS == k.N_STATS
    assert [distill_mod.divergence_mode(b) for b in (0, 0.0, 1e-9, 0.5, 1 - 1e-9, 1)] == [
        0, 0, 2, 2, 2, 1,
    ]  # fmt: skip


@pytest.mark.no_poison
def test_docstring_example():
    result = doctest.testmod(distill_mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- sm_90 compile

# Run in a subprocess without TRITON_INTERPRET (this process interprets): every variant of
# the three distill kernels (the backward's FREE form, each model's own transform: SPLIT,
# too) through Triton's front end, LLVM and ptxas for cuda:90, no GPU needed; the pointer
# offsets 64-bit (``hopper_compile.narrow_offset_products``); the row loads of both vocab
# kernels 128-bit vectors when launched on a bf16 vocabulary, the JSD's loops within their
# instruction ceilings.
_COMPILE_SCRIPT = r"""
import inspect
import sys
sys.path.insert(0, sys.argv[1])
import triton, triton.language as tl
from triton.compiler import ASTSource
from hopper_compile import (SM90, innermost_loops, kernel_signature, narrow_offset_products,
                            sm90_options, stack_bytes)
from fused_rl._launch import vocab_launch
import fused_rl.kernels.vocab.distill as k

FLOATS = {"inv_t_hi", "inv_t_lo", "inv_cap_hi", "inv_cap_lo", "t_inv_t_hi", "t_inv_t_lo",
          "t_inv_cap_hi", "t_inv_cap_lo", "num_items_hi", "num_items_lo", "n_seq",
          "max_length"}

def signature(fn, logits, acc, unit=()):
    pointers = {"targets_ptr": "*i64", "mask_ptr": "*u8", "s_ptr": logits, "t_ptr": logits,
                "grad_ptr": logits}
    return kernel_signature(fn, FLOATS, pointers, acc, unit)

def build(fn, consts, logits, acc, unit=(), attrs=None, warps=8):
    # every constexpr given, its default where the variant leaves it (Triton 3.4 does not
    # fill defaults in here: "constexpr has no attribute _flatten_ir_types")
    defaults = {p.name: p.default for p in fn.params
                if p.is_constexpr and p.default is not inspect.Parameter.empty}
    src = ASTSource(fn=fn, signature=signature(fn, logits, acc, unit),
                    constexprs={**defaults, **consts, **{n: 1 for n in unit}}, attrs=attrs)
    return triton.compile(src, target=SM90, options=sm90_options(warps))

# the launches at V = 151936: the read-only forward and mixture pass, the backward
READS = vocab_launch(151936, writes=False, heavy=True)
WRITES = vocab_launch(151936, writes=True)
LAUNCH = {k._distill_fwd_kernel: READS, k._distill_mixture_kernel: READS,
          k._distill_bwd_kernel: WRITES}
# the JSD's sm_90 instructions a column, largest loop on its common path (the mixture pass;
# measured 72.3 and 50 with Triton 3.9): compute-bound, so their time; a change that brings
# back the series forms (135, 86) or a libdevice log fails here. The forward of the other
# divergences (its two-row pass alone, 42.1; 44.5 with two shuffle trees a step) has its own.
CEILING = {k._distill_fwd_kernel: 75, k._distill_mixture_kernel: 75, k._distill_bwd_kernel: 52}
FIRST_PASS_CEILING = 44

count = 0
for logits, acc, ACC in (("*bf16", "*fp32", tl.float32), ("*fp64", "*fp64", tl.float64)):
    for mode in range(3):
        variants = [(k._distill_bwd_kernel, dict(FREE=free)) for free in (False, True)]
        variants += [(k._distill_bwd_kernel, dict(FREE=False, HAS_SOFTCAP=True))]
        variants += [(k._distill_fwd_kernel, dict(HAS_TARGETS=a, HAS_MASK=b))
                     for a in (False, True) for b in (False, True)]
        variants += [(k._distill_fwd_kernel, dict(HAS_TARGETS=True, HAS_MASK=True,
                                                  HAS_SOFTCAP=True))]
        # each model its own transform: the student's cap only, the teacher's only
        for cap in (True, False):
            split = dict(HAS_SOFTCAP=cap, SPLIT=True, TEACHER_SOFTCAP=not cap)
            variants += [(k._distill_bwd_kernel, dict(FREE=False, **split)),
                         (k._distill_fwd_kernel, dict(HAS_TARGETS=True, HAS_MASK=True, **split))]
        for fn, flags in variants:
            c = build(fn, dict(MODE=mode, BLOCK_V=256, ACC=ACC, **flags), logits, acc)
            narrow = narrow_offset_products(c.asm["ttir"])
            assert not narrow, (fn.__name__, narrow)
            count += 1
    for has_mask, cap, split in ((False, False, False), (True, False, False),
                                 (True, True, False), (True, True, True),
                                 (True, False, True)):  # the JSD's second pass
        c = build(k._distill_mixture_kernel, dict(HAS_MASK=has_mask, HAS_SOFTCAP=cap,
                                                  SPLIT=split, TEACHER_SOFTCAP=split and not cap,
                                                  BLOCK_V=256, ACC=ACC), logits, acc)
        assert not narrow_offset_products(c.asm["ttir"]), "mixture"
        count += 1
    for agg in range(4):
        for tensor in (False, True):
            build(k._distill_finalize_kernel, dict(AGG=agg, NUM_ITEMS_TENSOR=tensor, BLOCK_B=16,
                  BLOCK_T=128, ACC=ACC), logits, acc)
            count += 1
aligned = ("V", "s_stride_outer", "s_stride_inner", "t_stride_outer", "t_stride_inner")
for fn, flags in ((k._distill_fwd_kernel, dict(HAS_TARGETS=True, HAS_MASK=True)),
                  (k._distill_bwd_kernel, dict(FREE=False)),
                  (k._distill_mixture_kernel, dict(HAS_MASK=True))):
    names = [p.name for p in fn.params if not p.is_constexpr]
    unit = ("s_stride_v", "t_stride_v")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in aligned}
    mode = {} if fn is k._distill_mixture_kernel else dict(MODE=2)
    launch = LAUNCH[fn]
    c = build(fn, dict(BLOCK_V=launch["BLOCK_V"], ACC=tl.float32, **mode, **flags), "*bf16",
              "*fp32", unit, attrs, launch["num_warps"])
    assert "ld.global.v4" in c.asm["ptx"] or "ld.global.nc.v4" in c.asm["ptx"], fn.__name__
    # the one-warp read streams reduce with shuffles: no barrier
    assert launch["num_warps"] > 1 or "bar.sync" not in c.asm["ptx"], fn.__name__
    per_column = [n * launch["num_warps"] * 32 / launch["BLOCK_V"]
                  for n in innermost_loops(c.asm["cubin"], common_path=True)]
    assert max(per_column) <= CEILING[fn], (fn.__name__, per_column)
fn, launch = k._distill_fwd_kernel, LAUNCH[k._distill_fwd_kernel]
names = [p.name for p in fn.params if not p.is_constexpr]
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
         if n.endswith("_ptr") or n in aligned}
for mode in (0, 1):
    c = build(fn, dict(BLOCK_V=launch["BLOCK_V"], ACC=tl.float32, MODE=mode, HAS_TARGETS=True,
              HAS_MASK=True), "*bf16", "*fp32", unit, attrs, launch["num_warps"])
    per_column = [n * launch["num_warps"] * 32 / launch["BLOCK_V"]
                  for n in innermost_loops(c.asm["cubin"], common_path=True)]
    assert max(per_column) <= FIRST_PASS_CEILING, ("first pass", mode, per_column)
# as launched at V = 151936, every divergence: no register spilled (no stack in the cubin)
for mode in range(3):
    for fn, flags in ((k._distill_fwd_kernel, dict(HAS_TARGETS=True, HAS_MASK=True)),
                      (k._distill_bwd_kernel, dict(FREE=False))):
        launch = LAUNCH[fn]
        c = build(fn, dict(BLOCK_V=launch["BLOCK_V"], ACC=tl.float32, MODE=mode, **flags),
                  "*bf16", "*fp32", warps=launch["num_warps"])
        assert stack_bytes(c.asm["cubin"]) == 0, (fn.__name__, mode, "registers spilled")
c = build(k._distill_mixture_kernel, dict(BLOCK_V=READS["BLOCK_V"], ACC=tl.float32,
                                          HAS_MASK=True), "*bf16", "*fp32",
          warps=READS["num_warps"])
assert stack_bytes(c.asm["cubin"]) == 0, "mixture: registers spilled"
print("compiled", count)
"""


@pytest.mark.integration
@pytest.mark.timeout(600)  # a subprocess's minutes of compiling (see test_compile_hopper)
@pytest.mark.no_poison
def test_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.compiler")
    assert sm90_compile_output(_COMPILE_SCRIPT).endswith("compiled 98")
