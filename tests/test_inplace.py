"""``inplace=True`` on ``policy_loss`` and ``token_logprobs``: the backward writes the
gradient w.r.t. the logits into the logits buffer (Triton: layer 3 with the logits as its
output; reference: the gradient computed apart, then copied in).

* the same values, metrics and gradients as the default call, bit for bit (``torch.equal``),
  fp32 and bf16, both backends, the model's ``(B, S, V)`` buffer and exact windows, the
  token-level fused pass, GSPO, the composed top-entropy path, soft-capping, slices;
* no tensor of ``N * V`` elements allocated by the backward (the default allocates one);
* the launches are the default's;
* every case it cannot do safely raises, naming ``inplace`` (and ``logits``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fused_rl
from fused_rl.profiling import AllocationTracker, LaunchCounter

BACKENDS = ("triton", "reference")
DTYPES = (torch.float32, torch.bfloat16)


def _inputs(B=2, T=5, V=37, extra=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = (2 * torch.randn(B, T + extra, V, generator=g)).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[1, 0] = -100
    return dict(
        buf=buf,
        targets=targets,
        advantages=torch.randn(B, generator=g),
        old_logprobs=torch.randn(B, T, generator=g) - 3,
        ref_logprobs=torch.randn(B, T, generator=g) - 3,
        mask=torch.rand(B, T, generator=g) > 0.2,
        up=torch.tensor(1.7),
    )


POLICY_OPTIONS = {
    "grpo_kl_entropy": dict(beta=0.04, entropy_coef=0.01, eps_high=0.28),
    "seq_mean_token_mean": dict(loss_agg="seq-mean-token-mean", beta=0.1, kl_estimator="k1"),
    "gspo": dict(importance_sampling="sequence", entropy_coef=0.02),
    "top_entropy": dict(top_entropy_quantile=0.5),  # the composed path: token_logprobs
    "softcap": dict(softcap=3.0, temperature=0.7, beta=0.04),
}


def _policy_run(r, logits, backend, inplace, **options):
    loss, metrics = fused_rl.policy_loss(
        logits, r["targets"], r["advantages"], old_logprobs=r["old_logprobs"],
        ref_logprobs=r["ref_logprobs"], mask=r["mask"], inplace=inplace, backend=backend,
        **options,
    )  # fmt: skip
    return loss, metrics


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("extra", (0, 1, 3))
@pytest.mark.parametrize("case", list(POLICY_OPTIONS))
def test_policy_loss_bitwise_equal(case, extra, dtype, backend, device):
    """Loss, metrics and gradient of ``inplace=True`` are the default call's, bit for bit; the
    buffer holds that gradient (zeros outside the window) and is the leaf's ``.grad``."""
    r = _inputs(extra=extra, dtype=dtype, seed=extra)
    options = POLICY_OPTIONS[case]
    out = {}
    for inplace in (False, True):
        x = r["buf"].to(device, copy=True).requires_grad_()
        loss, metrics = _policy_run({k: v.to(device) for k, v in r.items()}, x, backend,
                                    inplace, **options)  # fmt: skip
        loss.backward(r["up"].to(device))
        out[inplace] = (loss.detach(), metrics, x.grad.clone(), x.detach().clone(), x)
    (loss0, m0, g0, _, x0), (loss1, m1, g1, buf1, x1) = out[False], out[True]
    assert torch.equal(loss0, loss1)
    assert m0.keys() == m1.keys() and all(torch.equal(m0[k], m1[k]) for k in m0)
    assert torch.equal(g0, g1)
    assert torch.equal(buf1, g1), "the logits buffer holds the gradient"
    assert x1.grad.data_ptr() == x1.data_ptr(), "the leaf's .grad is the logits' memory"
    assert x0.grad.data_ptr() != x0.data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ("2d", "3d", "3d_window", "4d"))
@pytest.mark.parametrize("entropy", (False, True))
def test_token_logprobs_bitwise_equal(entropy, shape, dtype, backend, device):
    g = torch.Generator().manual_seed(1)
    logits_shape, t_shape = {
        "2d": ((7, 29), (7,)), "3d": ((2, 5, 29), (2, 5)), "3d_window": ((2, 6, 29), (2, 4)),
        "4d": ((2, 3, 4, 29), (2, 3, 4)),
    }[shape]  # fmt: skip
    base = (2 * torch.randn(logits_shape, generator=g)).to(dtype).to(device)
    targets = torch.randint(0, 29, t_shape, generator=g).to(device)
    ups = [torch.randn(t_shape, generator=g).to(device) for _ in range(2)]
    out = {}
    for inplace in (False, True):
        x = base.clone().requires_grad_()
        res = fused_rl.token_logprobs(x, targets, return_entropy=entropy, temperature=0.9,
                                      inplace=inplace, backend=backend)  # fmt: skip
        res = res if entropy else (res,)
        torch.autograd.backward(res, ups[: len(res)])
        out[inplace] = ([t.detach() for t in res], x.grad.clone(), x.detach().clone())
    (v0, g0, _), (v1, g1, buf1) = out[False], out[True]
    assert all(torch.equal(a, b) for a, b in zip(v0, v1))
    assert torch.equal(g0, g1) and torch.equal(buf1, g1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_leaf_logits_from_a_linear_head(backend, device):
    """The usual case: the logits are ``F.linear``'s output; the gradient written into them
    flows on into the head's backward, and ``hidden`` / ``weight`` get the default's."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 6, 8, generator=g).to(device)
    weight = torch.randn(40, 8, generator=g).to(device)
    r = _inputs(T=5, V=40, extra=1, seed=3)
    r = {k: v.to(device) for k, v in r.items()}
    grads = {}
    for inplace in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = _policy_run(r, F.linear(h, w), backend, inplace, beta=0.04, entropy_coef=0.01)
        loss.backward()
        grads[inplace] = (h.grad, w.grad)
    assert torch.equal(grads[False][0], grads[True][0])
    assert torch.equal(grads[False][1], grads[True][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_slice_writes_only_its_rows(backend, device):
    """A ``logits[:, :-1]`` slice: the kernel writes exactly the rows it reads; the buffer's
    last position keeps its values, and the gradient is the default's."""
    r = _inputs(T=5, extra=0, seed=4)
    r = {k: v.to(device) for k, v in r.items()}
    full = torch.randn(2, 6, 37, generator=torch.Generator().manual_seed(5)).to(device)
    out = {}
    for inplace in (False, True):
        buf = full.clone().requires_grad_()
        loss, _ = _policy_run(r, buf[:, :-1], backend, inplace, beta=0.04)
        loss.backward()
        out[inplace] = (buf.grad, buf.detach())
    assert torch.equal(out[False][0], out[True][0])
    assert torch.equal(out[True][1][:, -1], full[:, -1])  # untouched
    assert torch.equal(out[True][1][:, :-1], out[True][0][:, :-1])


def test_gradient_accumulates_into_an_existing_grad(device):
    """A leaf whose ``.grad`` exists (micro-batches): ``.grad += buffer``, as the default."""
    r = {k: v.to(device) for k, v in _inputs(seed=6).items()}
    grads = {}
    for inplace in (False, True):
        x = r["buf"].clone().requires_grad_()
        x.grad = torch.ones_like(x)
        _policy_run(r, x, "triton", inplace, beta=0.04)[0].backward()
        grads[inplace] = x.grad
    assert torch.equal(grads[False], grads[True])


# ----------------------------------------------------------------------------- allocations


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
@pytest.mark.parametrize("op", ("policy_loss", "token_logprobs"))
@pytest.mark.parametrize("extra", (0, 1))
def test_backward_allocates_no_gradient(op, extra, device):
    """The Triton backward of ``inplace=True`` allocates no tensor of ``N * V`` elements (the
    gradient is the logits buffer); the default's allocates exactly one (its gradient). The
    forward allocates none either way."""
    r = {k: v.to(device) for k, v in _inputs(T=6, V=500, extra=extra).items()}
    B, T = r["targets"].shape
    nv_bytes = B * T * 500 * 4
    counts = {}
    for inplace in (False, True):
        x = r["buf"].clone().requires_grad_()
        with AllocationTracker() as fwd:
            if op == "policy_loss":
                loss = _policy_run(r, x, "triton", inplace, beta=0.04, entropy_coef=0.01)[0]
            else:
                logp, ent = fused_rl.token_logprobs(
                    x, r["targets"], return_entropy=True, inplace=inplace, backend="triton"
                )
                loss = logp.sum() + ent.sum()
        with AllocationTracker() as bwd:
            loss.backward()
        counts[inplace] = (fwd.count_at_least(nv_bytes), bwd.count_at_least(nv_bytes))
    assert counts == {False: (0, 1), True: (0, 0)}, counts


@pytest.mark.no_poison
@pytest.mark.parametrize("importance_sampling", ("token", "sequence"))
def test_same_launches_as_the_default(importance_sampling, device):
    r = {k: v.to(device) for k, v in _inputs().items()}
    seen = {}
    for inplace in (False, True):
        x = r["buf"].clone().requires_grad_()
        with LaunchCounter() as c:
            loss, _ = _policy_run(r, x, "triton", inplace, beta=0.04, entropy_coef=0.01,
                                  importance_sampling=importance_sampling)  # fmt: skip
            loss.backward()
        seen[inplace] = (c.kernels, c.total)
    assert seen[False] == seen[True], seen


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ("policy_loss", "token_logprobs"))
def test_rejects_logits_without_a_backward(op, backend):
    r = _inputs()

    def call(x):
        if op == "policy_loss":
            return _policy_run(r, x, backend, True)
        return fused_rl.token_logprobs(x, r["targets"], inplace=True, backend=backend)

    with pytest.raises(ValueError, match=r"inplace=True.*logits do not require grad"):
        call(r["buf"])
    with torch.no_grad(), pytest.raises(ValueError, match=r"inplace=True.*grad mode is off"):
        call(r["buf"].clone().requires_grad_())


@pytest.mark.parametrize("op", ("policy_loss", "token_logprobs"))
def test_rejects_views_it_cannot_write(op):
    r = _inputs(extra=0)
    B, T, V = r["buf"].shape
    transposed = r["buf"].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    expanded = torch.randn(B, 1, V).expand(B, T, V).requires_grad_()
    overlapping = torch.randn(B * T * V).as_strided((B, T, V), (T * V, V // 2, 1))
    overlapping.requires_grad_()

    def call(x):
        if op == "policy_loss":
            return _policy_run(r, x, "triton", True)
        return fused_rl.token_logprobs(x, r["targets"], inplace=True, backend="triton")

    with pytest.raises(ValueError, match=r"inplace=True needs logits whose vocabulary"):
        call(transposed)
    for x in (expanded, overlapping):
        with pytest.raises(ValueError, match=r"inplace=True needs logits whose elements"):
            call(x)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        fused_rl.token_logprobs(r["buf"], r["targets"], inplace=1)


def test_rejects_leading_dims_that_would_be_copied():
    x = torch.randn(3, 2, 4, 11).permute(1, 0, 2, 3).requires_grad_()  # (2, 3, 4, 11)
    with pytest.raises(ValueError, match="inplace=True needs logits whose leading"):
        fused_rl.token_logprobs(x, torch.zeros(2, 3, 4, dtype=torch.long), inplace=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ("policy_loss", "token_logprobs"))
def test_modified_between_forward_and_backward(op, backend, device):
    r = {k: v.to(device) for k, v in _inputs().items()}
    x = r["buf"].clone().requires_grad_()
    if op == "policy_loss":
        loss = _policy_run(r, x, backend, True, beta=0.04)[0]
    else:
        loss = fused_rl.token_logprobs(x, r["targets"], inplace=True, backend=backend).sum()
    with torch.no_grad():
        x.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"inplace=True: the logits were modified"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_raises(backend, device):
    """``retain_graph=True`` then a second backward: the first one's gradient is in the
    buffer now, and the version check says so."""
    r = {k: v.to(device) for k, v in _inputs().items()}
    x = r["buf"].clone().requires_grad_()
    loss = _policy_run(r, x, backend, True)[0]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"inplace=True: the logits were modified"):
        loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_op_that_saved_the_logits_raises(backend, device):
    """The documented rule: nothing whose backward reads the logits may use them. An op
    that saved them (here ``x * x``) and runs its backward after this one meets autograd's
    own version check: the write advanced the logits' version."""
    r = {k: v.to(device) for k, v in _inputs().items()}
    x = r["buf"].clone().requires_grad_()
    other = (x * x).mean()
    loss = _policy_run(r, x, backend, True)[0]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


def test_compile_raises_at_trace_time():
    """Eager only: ``torch.compile(fullgraph=True)`` fails at trace time with the reason."""
    r = _inputs()

    def step(x):
        return _policy_run(r, x, "triton", True)[0]

    x = r["buf"].clone().requires_grad_()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"policy_loss\(inplace=True\) is eager-only"):
        compiled(x)
    from torch.fx.experimental.proxy_tensor import make_fx

    def logprobs(x):
        return fused_rl.token_logprobs(x, r["targets"], inplace=True, backend="triton")

    with pytest.raises(RuntimeError, match=r"token_logprobs\(inplace=True\) is eager-only"):
        make_fx(logprobs)(x)


def test_vocab_parallel_raises_not_implemented():
    r = _inputs()
    x = r["buf"].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="inplace=True"):
        _policy_run(r, x, "triton", True, process_group=object())
    with pytest.raises(NotImplementedError, match="inplace=True"):
        fused_rl.token_logprobs(x, r["targets"], vocab_size=37, inplace=True)


def test_policy_loss_module_takes_inplace(device):
    from fused_rl.nn import LinearPolicyLoss, PolicyLoss

    r = {k: v.to(device) for k, v in _inputs().items()}
    x = r["buf"].clone().requires_grad_()
    loss, _ = PolicyLoss(inplace=True, beta=0.04)(
        x, r["targets"], r["advantages"], ref_logprobs=r["ref_logprobs"]
    )
    loss.backward()
    assert x.grad.data_ptr() == x.data_ptr()
    with pytest.raises(TypeError, match="inplace must be a bool"):
        PolicyLoss(inplace="yes")
    with pytest.raises(TypeError, match="unknown options"):
        LinearPolicyLoss(inplace=True)


# ----------------------------------------------------------------------------- benchmark


def test_bench_provider_meets_the_oracle_and_models_no_gradient(device):
    """``bench`` provider ``fused_rl_inplace``: within fused_rl's tolerance of the float64
    oracle (its first run; later runs read the previous gradient as logits), and its
    modelled peak (fake tensors, ``bench/memory_profile.py``) holds no ``(N, V)`` gradient
    where ``fused_rl``'s is one."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench import accuracy as A
    from bench import providers as P
    from bench.cases import Case, make_inputs
    from bench.memory_profile import model_peak
    from bench.oracle import Oracle

    case = Case("policy_loss", "grpo+entropy", "fwd_bwd", 2, 8, 1000, "bf16")
    inp = make_inputs(case, device)
    out = P.build("fused_rl_inplace", case, inp)()
    verdict = A.judge("fused_rl_inplace", case.dtype, Oracle(case, inp).compare_all(
        P.output_names(case), out))["verdict"]  # fmt: skip
    assert verdict == "ok", verdict
    big = Case("policy_loss", "grpo", "fwd_bwd", 4, 512, 32000, "bf16")
    grad_bytes = 4 * 513 * 32000 * 2
    default, how = model_peak("fused_rl", big)
    inplace, how_inplace = model_peak("fused_rl_inplace", big)
    assert how == how_inplace == "modelled"
    assert grad_bytes <= default <= 1.01 * grad_bytes
    assert inplace < grad_bytes / 100, inplace
    assert not P.applies("fused_rl_inplace", Case("token_logprobs", "logp", "fwd_bwd", 1, 2, 9,
                                                  "fp32"))  # fmt: skip
