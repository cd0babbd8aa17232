"""``fused_rl._wide_gemm``: 16-bit GEMMs kept in an fp32 / fp64 accumulator. Values against a
float64 oracle; which GEMM runs (``out_dtype=`` where torch offers it, found out once per
device type, else wide copies of the operands), emulated here where the CPU build has no
``out_dtype=``; traced calls (``torch.compile(fullgraph=True)``, ``make_fx``) recording the
custom ops, making at run time the choice an eager call makes, and Inductor writing
``addmm_wide_`` in place into its accumulator; the lm_head ops' compiled 16-bit backward and
grad-in-forward taking them."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from torch.fx.experimental.proxy_tensor import make_fx

import fused_rl
from fused_rl import _wide_gemm as W

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture
def fresh_table(monkeypatch):
    """An empty record of which device types offer ``out_dtype=``, restored afterwards."""
    monkeypatch.setattr(W, "_MM_OUT_DTYPE", {})
    return W._MM_OUT_DTYPE


@pytest.fixture
def wide_gemms(monkeypatch, fresh_table):
    """``torch.mm`` / ``torch.addmm`` with ``out_dtype=`` on this device, as CUDA has them
    (the product of the 16-bit operands computed exactly, rounded once to ``out_dtype``);
    returns the list of ``(gemm, operand dtype, out_dtype)`` they ran."""
    real_mm, real_addmm, ran = torch.mm, torch.addmm, []

    def mm(a, b, *, out_dtype=None, **kwargs):
        if out_dtype is None:
            return real_mm(a, b, **kwargs)
        ran.append(("mm", a.dtype, out_dtype))
        return real_mm(a.double(), b.double()).to(out_dtype)

    def addmm(acc, a, b, *, out_dtype=None, out=None, **kwargs):
        if out_dtype is None:
            return real_addmm(acc, a, b, out=out, **kwargs)
        ran.append(("addmm", a.dtype, out_dtype))
        return out.copy_((acc.double() + real_mm(a.double(), b.double())).to(out_dtype))

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    return ran


def _operands(dtype, m=6, k=5, n=7, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(device, dtype)
    b = torch.randn(k, n, generator=g).to(device, dtype)
    return a, b


@pytest.mark.parametrize("dtype", HALF)
def test_values_match_float64(dtype, fresh_table):
    """16-bit operands: their product in fp32 (no rounding to 16 bits), ``addmm_wide``
    accumulating into fp32 and fp64, whichever GEMM this device runs."""
    a, b = _operands(dtype)
    want = a.double() @ b.double()
    got = W.mm_wide(a, b, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (6, 7)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    for acc_dtype in (torch.float32, torch.float64):
        acc = torch.full((6, 7), 0.5, dtype=acc_dtype, device=a.device)
        W.addmm_wide(acc, a, b)
        W.addmm_wide(acc, a, b)
        torch.testing.assert_close(acc.double(), 0.5 + 2 * want, rtol=1e-6, atol=1e-6)
    # a 16-bit accumulator: the plain in-place GEMM of its dtype
    acc = torch.zeros(6, 7, dtype=dtype, device=a.device)
    W.addmm_wide(acc, a, b)
    torch.testing.assert_close(acc, a @ b)


def test_tried_only_where_torch_offers_it(monkeypatch, fresh_table):
    """``out_dtype=`` is tried only for fp16 / bf16 operands of one dtype into fp32, the one
    widening torch's GEMMs offer: an fp64 accumulator (a bf16 student beside an fp64
    teacher) or mixed operands take the upcast without trying, so they never record the wide
    path as missing for the calls that have it."""
    tried = []
    real_addmm = torch.addmm

    def addmm(*args, out_dtype=None, **kwargs):
        if out_dtype is not None:
            tried.append((args[1].dtype, out_dtype))
            raise NotImplementedError("aten::addmm.dtype_out: no kernel here")
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm)
    a, b = _operands(torch.bfloat16, 5, 3, 4, device="cpu")
    for acc, operand in ((torch.zeros(5, 4, dtype=torch.float64), b),
                         (torch.zeros(5, 4), b.half())):  # fmt: skip
        W.addmm_wide(acc, a, operand)
        torch.testing.assert_close(acc, a.to(acc.dtype) @ operand.to(acc.dtype))
    assert tried == [] and fresh_table == {}
    acc = torch.zeros(5, 4)
    W.addmm_wide(acc, a, b)  # tried, missing here: recorded, then the upcast
    torch.testing.assert_close(acc, a.float() @ b.float())
    W.addmm_wide(acc, a, b)  # not tried again
    assert tried == [(torch.bfloat16, torch.float32)]
    assert fresh_table == {("cpu", "addmm"): False}


def test_another_error_is_raised_not_recorded(monkeypatch, fresh_table):
    """An error that does not say "no such GEMM here" (out of memory) propagates and leaves
    the wide path on for the next call."""

    def addmm(*args, out_dtype=None, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "addmm", addmm)
    a, b = _operands(torch.bfloat16, device="cpu")
    with pytest.raises(RuntimeError, match="out of memory"):
        W.addmm_wide(torch.zeros(6, 7), a, b)
    assert fresh_table == {}


def test_the_wide_gemm_runs_where_offered(wide_gemms, fresh_table):
    """Where torch offers ``out_dtype=``, eager calls take it: no wide copy of either
    operand, the product accumulated straight into ``acc``."""
    a, b = _operands(torch.bfloat16, device="cpu")
    acc = torch.zeros(6, 7)
    W.addmm_wide(acc, a, b)
    z = W.mm_wide(a, b, torch.float32)
    assert wide_gemms == [("addmm", torch.bfloat16, torch.float32),
                          ("mm", torch.bfloat16, torch.float32)]  # fmt: skip
    assert fresh_table == {("cpu", "addmm"): True, ("cpu", "mm"): True}
    want = a.double() @ b.double()
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z.double(), want, rtol=1e-6, atol=1e-6)


def _fused_rl_ops(*graphs) -> list[str]:
    """The ``fused_rl`` ops the graphs call, a mutating one by its own name where the
    functionalized graph wraps it (``auto_functionalized``)."""
    names = []
    for graph in graphs:
        for node in graph.graph.nodes:
            target = node.args[0] if "auto_functionalized" in str(node.target) else node.target
            if "fused_rl" in str(target):
                names.append(str(target))
    return names


def _rows(n, vocab, hdim, seed):
    """A chunked backward's 16-bit ``dz`` ``(n, vocab)`` and hidden rows ``(n, hdim)``."""
    g = torch.Generator().manual_seed(seed)
    dz = torch.randn(n, vocab, generator=g).to(torch.bfloat16)
    return dz, torch.randn(n, hdim, generator=g).to(torch.bfloat16)


def _accumulate(dz, h, chunk):
    """``dz^T h`` chunk by chunk into fp32 (the first chunk's GEMM makes the accumulator,
    the others add to it), then the chunks' logits in fp32, as the lm_head ops' backward
    and forward do (``fused_rl.linear.HeadGrads``)."""
    acc = W.mm_wide(dz[:chunk].t(), h[:chunk], torch.float32)
    for start in range(chunk, dz.shape[0], chunk):
        W.addmm_wide(acc, dz[start : start + chunk].t(), h[start : start + chunk])
    return acc, W.mm_wide(h, dz[: h.shape[1]], torch.float32)


@pytest.mark.no_poison
@pytest.mark.parametrize("offered", (True, False))
def test_compiled_calls_record_the_ops(offered, monkeypatch, fresh_table, request):
    """Traced by ``torch.compile(fullgraph=True)``, the eligible calls are the custom ops
    (Inductor lowers no ``out_dtype=`` GEMM), and the compiled function makes at run time
    the choice an eager call makes: the wide GEMM where torch offers it, else the upcast."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    ran = request.getfixturevalue("wide_gemms") if offered else None
    dz, h = _rows(12, 9, 5, seed=1)
    backend = AotEagerAndRecordGraphs()
    got = torch.compile(_accumulate, fullgraph=True, backend=backend)(dz, h, 4)
    (graph,) = backend.fw_graphs
    ops = _fused_rl_ops(graph)
    mm, addmm = "fused_rl.mm_wide.default", "fused_rl.addmm_wide_.default"
    assert ops == [mm, addmm, addmm, mm]
    assert not any(str(n.target) == "aten._to_copy.default" for n in graph.graph.nodes)
    want = (dz.double().t() @ h.double(), h.double() @ dz[:5].double())
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6)
    if offered:
        assert [gemm for gemm, *_ in ran] == ["mm", "addmm", "addmm", "mm"]
    assert fresh_table == {("cpu", "addmm"): offered, ("cpu", "mm"): offered}


@pytest.mark.no_poison
def test_inductor_accumulates_in_place():
    """Inductor turns the functionalized ``addmm_wide_`` back into calls on ONE accumulator
    buffer, the first chunk's ``mm_wide`` output: no copy of it per chunk (a ``(V, H)`` fp32
    ``dW`` each)."""
    from torch._inductor.utils import run_and_get_code

    dz, h = _rows(12, 9, 5, seed=2)
    compiled = torch.compile(lambda d, x: _accumulate(d, x, 4)[0], fullgraph=True)
    got, (code,) = run_and_get_code(compiled, dz, h)
    calls = [line.strip() for line in code.splitlines() if "fused_rl.addmm_wide_" in line
             and not line.strip().startswith("#")]  # fmt: skip
    assert len(calls) == 2
    accumulators = {call.split("(", 1)[1].split(",", 1)[0] for call in calls}
    assert len(accumulators) == 1, calls
    assert "clone" not in code
    torch.testing.assert_close(got.double(), dz.double().t() @ h.double(), rtol=1e-6, atol=1e-6)


def test_make_fx_records_the_ops(wide_gemms):
    """``make_fx`` (``torch.export``; the AOT trace of a compiled backward) records the
    custom ops: the wide GEMM is not tried on the tracer's tensors, so a CPU trace never
    records "no ``out_dtype=`` here" for the device it will run on."""
    dz, h = _rows(8, 6, 4, seed=3)
    graph = make_fx(lambda d, x: _accumulate(d, x, 4), tracing_mode="fake")(dz, h)
    ops = _fused_rl_ops(graph)
    assert ops == ["fused_rl.mm_wide.default", "fused_rl.addmm_wide_.default",
                   "fused_rl.mm_wide.default"]  # fmt: skip
    assert wide_gemms == []


def test_vmap_takes_the_upcast(wide_gemms):
    """Under a functorch transform (``vmap``) the product is taken on wide copies without
    trying ``out_dtype=`` (a failure there would say nothing of the device)."""
    a, b = _operands(torch.bfloat16, 3, 4, 2, device="cpu")
    batch = torch.stack([b, -b, 2 * b])
    got = torch.vmap(lambda x: W.mm_wide(a, x, torch.float32))(batch)
    assert got.shape == (3, 3, 2) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), a.double() @ batch.double(), rtol=1e-6, atol=1e-6)
    assert wide_gemms == []


@pytest.mark.no_poison
def test_tracked_operands_stay_differentiable(wide_gemms):
    """Operands autograd tracks take the upcast GEMM, eager or traced (the custom ops have
    no autograd formula): the gradient flows, and no wide GEMM is tried."""
    a, b = _operands(torch.bfloat16, 3, 4, 2, device="cpu")
    a.requires_grad_()

    def f(a, b):
        return W.mm_wide(a, b, torch.float32).sum()

    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        (grad,) = torch.autograd.grad(fn(a, b), a)
        torch.testing.assert_close(grad, b.sum(1).expand(3, 4).to(grad.dtype))
    assert wide_gemms == []


@pytest.mark.no_poison
@pytest.mark.parametrize("op", ("linear_token_logprobs", "linear_policy_loss"))
def test_compiled_lm_head_ops_take_the_wide_gemm(op, wide_gemms):
    """A bf16 lm_head under ``torch.compile(fullgraph=True)``: the chunk loop runs inside
    the op from hidden states (``fused_rl::linear_stats_bwd``, the log-probs' backward;
    ``fused_rl::linear_policy_fwd``, the policy loss's forward, which forms its gradients
    there), where ``dW`` is made by the wide GEMM and accumulates through it, so a compiled
    call runs the 16-bit GEMMs into the fp32 ``dW`` where torch offers them, as an eager call
    does, with the eager call's values."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 6, 8, generator=g).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(37, 8, generator=g) / 3).to(DEVICE, torch.bfloat16).requires_grad_()
    t = torch.randint(0, 37, (2, 6), generator=g).to(DEVICE)
    old = (torch.randn(2, 6, generator=g) * 0.3 - 3).to(DEVICE)
    adv = torch.randn(2, generator=g).to(DEVICE)

    def loss_fn(h, w):
        if op == "linear_token_logprobs":
            return (fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=4) * old).sum()
        return fused_rl.linear_policy_loss(h, w, t, adv, old_logprobs=old, chunk_tokens=4)[0]

    backend = AotEagerAndRecordGraphs()
    got = torch.compile(loss_fn, fullgraph=True, backend=backend)(h, w)
    got_grads = torch.autograd.grad(got, (h, w))
    ops = _fused_rl_ops(*backend.fw_graphs, *backend.bw_graphs)
    head = "linear_stats_bwd" if op == "linear_token_logprobs" else "linear_policy_fwd"
    assert ops.count(f"fused_rl.{head}.default") == 1
    # chunks of 4 rows of 12: the first chunk's GEMM makes dW, the others add to it
    assert [gemm for gemm, *_ in wide_gemms] == ["mm", "addmm", "addmm"]
    wide_gemms.clear()
    want = loss_fn(h, w)
    want_grads = torch.autograd.grad(want, (h, w))
    assert [gemm for gemm, *_ in wide_gemms] == ["mm", "addmm", "addmm"]  # eager: the same
    torch.testing.assert_close(got, want)
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e)


@pytest.mark.no_poison
@pytest.mark.skipif(not torch.cuda.is_available(), reason="out_dtype= GEMMs are CUDA's")
@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 8),
    reason="torch's GEMMs take out_dtype= from 2.8",
)
def test_inductor_runs_the_16_bit_gemm_on_cuda(fresh_table):
    """On CUDA with Inductor, no emulation: the compiled bf16 lm_head backward runs torch's
    ``out_dtype=`` GEMM (recorded as offered) and gives the eager call's gradients."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(300, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(1000, 64, generator=g) / 8).to("cuda", torch.bfloat16).requires_grad_()
    t = torch.randint(0, 1000, (300,), generator=g).to("cuda")

    def loss_fn(h, w):
        return fused_rl.linear_token_logprobs(h, w, t, chunk_tokens=128).sum()

    got = torch.autograd.grad(torch.compile(loss_fn, fullgraph=True)(h, w), (h, w))
    assert fresh_table == {("cuda", "addmm"): True}
    want = torch.autograd.grad(loss_fn(h, w), (h, w))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
