"""fused_rl.compat.verl's fused lm_head adapters, ``FusedLinearForPPO`` and
``linear_cross_entropy``, against a float64 transcription of verl's math with the logits
whole (``z = hidden @ W.T / temperature``, log-softmax gathered at the already-shifted ids,
entropy ``logsumexp(z) - sum(softmax(z) z)``): values, gradients for the hidden states and
the weight under a random upstream gradient on both outputs, verl's output dtypes and
shapes, and the argument errors. verl's sources: ``verl/utils/experimental/torch_functional.py``
(``FusedLinearForPPO``) and ``verl/utils/kernel/linear_cross_entropy.py`` /
``verl/utils/kernel/kernels.py`` (``linear_cross_entropy``)."""

import pytest
import torch
from helpers import FP32_TOL, bf16_tol, rel_err

from fused_rl import config
from fused_rl.compat import verl

V, H = 37, 16  # V not a power of two: the vocab kernels' masked tail runs

# the "reference" parameter unsets TRITON_INTERPRET after Triton's import: auto says so, once
pytestmark = pytest.mark.filterwarnings("ignore:backend='auto' runs the reference")


@pytest.fixture(params=["triton", "reference"])
def backend_device(request, monkeypatch, device):
    """The device to run on, with fused_rl's ``auto`` backend picking ``request.param`` (the
    adapters take no backend, as verl's do): the reference through CPU tensors while
    ``TRITON_INTERPRET`` is unset."""
    if request.param == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        return "cpu"
    return device


# ----------------------------------------------------------------------------- the oracle


def verl_math(hidden, weight, ids, temperature, out_dtype=None):
    """verl's per-token math with the logits whole: in float64 (the oracle) for float64
    inputs; for others verl's own precision (logits in the inputs' dtype, softmax in fp32,
    outputs cast to ``out_dtype``), the same-dtype baseline of the bf16 tolerance."""
    z = (hidden @ weight.T) / temperature
    z = z.double() if z.dtype == torch.float64 else z.float()
    logp = torch.log_softmax(z, dim=-1).gather(-1, ids.long()[..., None])[..., 0]
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    if out_dtype is not None:
        logp, entropy = logp.to(out_dtype), entropy.to(out_dtype)
    return logp, entropy


def inputs(gen, lead, dtype, device, strided=False):
    """``hidden`` ``(*lead, H)`` (a strided slice when ``strided``), ``weight`` ``(V, H)``
    (logits of a few units) and ids in ``[0, V)``, as leaves in ``dtype``."""
    full = torch.randn(*lead[:-1], lead[-1] + 1, H, generator=gen, dtype=torch.float64)
    hidden = full[..., :-1, :] if strided else full[..., 1:, :].contiguous()
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.6
    ids = torch.randint(0, V, lead, generator=gen)
    leaf = lambda t: t.to(device, dtype).detach().requires_grad_()  # noqa: E731
    return leaf(hidden), leaf(weight), ids.to(device)


def check_against_oracle(run, hidden, weight, ids, temperature, shape, out_dtype, post, gen):
    """``run(h, w)`` -> ``(logp, entropy)``: values and both gradients against the float64
    oracle (fp32: ``FP32_TOL``; 16-bit: twice the error of verl's math in that dtype).
    ``post``: what the adapter does to the per-token ``(logp, entropy)`` (flatten, reduce)."""
    dtype = hidden.dtype
    h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
    hs, ws = (t.detach().clone().requires_grad_() for t in (hidden, weight))
    got = run(hidden, weight)
    want = [f(x) for f, x in zip(post, verl_math(h64, w64, ids, temperature))]
    same = [f(x) for f, x in zip(post, verl_math(hs, ws, ids, temperature, out_dtype))]
    assert [x.dtype for x in got] == [out_dtype, out_dtype]
    assert [tuple(x.shape) for x in got] == [tuple(x.shape) for x in want]
    assert tuple(got[0].shape) == shape
    ups = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device) for x in want]
    for outs, cast in ((got, out_dtype), (want, torch.float64), (same, out_dtype)):
        sum((o * u.to(cast)).sum() for o, u in zip(outs, ups)).backward()
    pairs = [(got[0], want[0], same[0]), (got[1], want[1], same[1]),
             (hidden.grad, h64.grad, hs.grad), (weight.grad, w64.grad, ws.grad)]  # fmt: skip
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    assert hidden.grad.shape == hidden.shape
    for what, (g, w, s) in zip(("logp", "entropy", "d_hidden", "d_weight"), pairs):
        tol = FP32_TOL if dtype in (torch.float32, torch.float64) else bf16_tol(s, w)
        err = rel_err(g, w)
        assert err <= tol, f"{what}: RMS relative error {err:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------- FusedLinearForPPO


PPO_CASES = [  # (leading shape, chunk_size, temperature, strided hidden)
    ((2, 7), 5, 1.0, False),  # (B, T, H), chunk not dividing N = 14
    ((13,), 1, 0.7, True),  # (N, H), one token a chunk
    ((3, 4), 512, 1.6, False),  # verl's default chunk: one chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead, chunk, temperature, strided", PPO_CASES)
def test_fused_linear_for_ppo(lead, chunk, temperature, strided, dtype, backend_device):
    gen = torch.Generator().manual_seed(sum(lead) + chunk)
    hidden, weight, ids = inputs(gen, lead, dtype, backend_device, strided)
    module = verl.FusedLinearForPPO(chunk_size=chunk)

    def run(h, w):
        return module(h, w, ids, temperature=temperature)

    same = (lambda x: x, lambda x: x)
    check_against_oracle(run, hidden, weight, ids, temperature, lead, dtype, same, gen)


def test_fused_linear_for_ppo_module(device):
    module = verl.FusedLinearForPPO()
    assert isinstance(module, torch.nn.Module) and module.chunk_size == 512
    assert "chunk_size=512" in repr(module) and module.impl_backend == "torch"
    assert list(module.parameters()) == []  # the lm_head weight is an argument, as in verl
    assert verl.FusedLinearForPPO(impl_backend="liger").impl_backend == "liger"  # verl 0.9.1
    with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend: triton"):
        verl.FusedLinearForPPO(impl_backend="triton")
    gen = torch.Generator().manual_seed(3)
    hidden, weight, ids = inputs(gen, (2, 5), torch.float32, device)
    # positional temperature, int ids of another dtype (verl casts them to int64)
    lp, ent = module(hidden, weight, ids.to(torch.int32), 0.9)
    lp16, _ = module(hidden, weight, ids.to(torch.int16), 0.9)
    want = verl_math(hidden.detach().double(), weight.detach().double(), ids, 0.9)
    assert rel_err(lp, want[0]) <= FP32_TOL and rel_err(ent, want[1]) <= FP32_TOL
    assert torch.equal(lp, lp16)
    module.chunk_size = 3  # reassigned after construction: the next call uses it
    assert rel_err(module(hidden, weight, ids)[0], verl_math(
        hidden.detach().double(), weight.detach().double(), ids, 1.0)[0]) <= FP32_TOL  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_output_dtypes_are_verls(dtype, device):
    """verl's FusedLinearForPPO returns the hidden states' dtype (fp32 math, cast back);
    its linear_cross_entropy always fp32. Gradients come in the inputs' dtypes."""
    gen = torch.Generator().manual_seed(4)
    hidden, weight, ids = inputs(gen, (2, 3), dtype, device)
    lp, ent = verl.FusedLinearForPPO(chunk_size=4)(hidden, weight, ids)
    assert lp.dtype == ent.dtype == dtype and lp.shape == ent.shape == (2, 3)
    for reduction in verl.LINEAR_CE_REDUCTIONS:
        lp2, ent2 = verl.linear_cross_entropy(hidden, weight, ids, reduction=reduction)
        assert lp2.dtype == ent2.dtype == torch.float32
        assert ent2.shape == (6,) and lp2.shape == ((6,) if reduction == "none" else ())
    (lp.sum() + lp2 + ent2.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == dtype


def test_one_output_used(device):
    """Only the log-probs or only the entropy reaches the loss (the other's gradient is None,
    as verl's backward allows)."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight, ids = inputs(gen, (3, 4), torch.float32, device)
    module = verl.FusedLinearForPPO(chunk_size=5)
    for which in (0, 1):
        h64, w64 = (t.detach().double().requires_grad_() for t in (hidden, weight))
        hidden.grad = weight.grad = None
        module(hidden, weight, ids, 1.2)[which].sum().backward()
        verl_math(h64, w64, ids, 1.2)[which].sum().backward()
        assert rel_err(hidden.grad, h64.grad) <= FP32_TOL
        assert rel_err(weight.grad, w64.grad) <= FP32_TOL
        hidden.grad = weight.grad = None
        verl.linear_cross_entropy(hidden, weight, ids, 1.2)[which].sum().backward()
        assert rel_err(hidden.grad, h64.grad) <= FP32_TOL
        assert rel_err(weight.grad, w64.grad) <= FP32_TOL


# ----------------------------------------------------------------------------- linear_cross_entropy


LCE_CASES = [  # (leading shape, reduction, temperature, strided hidden)
    ((2, 6), "none", 1.0, False),  # (B, T, H) in, flat (N,) out
    ((11,), "sum", 0.7, True),
    ((3, 5), "mean", 1.5, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead, reduction, temperature, strided", LCE_CASES)
def test_linear_cross_entropy(lead, reduction, temperature, strided, dtype, backend_device):
    gen = torch.Generator().manual_seed(sum(lead) + len(reduction))
    hidden, weight, ids = inputs(gen, lead, dtype, backend_device, strided)
    n_rows = hidden.shape[:-1].numel()
    flat = lambda x: x.reshape(-1)  # noqa: E731 - verl returns (N,) for any hidden shape
    post = ({"none": flat, "sum": torch.sum, "mean": torch.mean}[reduction], flat)

    def run(h, w):
        return verl.linear_cross_entropy(h, w, ids, temperature, reduction)

    shape = (n_rows,) if reduction == "none" else ()
    check_against_oracle(run, hidden, weight, ids, temperature, shape, torch.float32, post, gen)


def test_linear_cross_entropy_arguments(device):
    gen = torch.Generator().manual_seed(6)
    hidden, weight, ids = inputs(gen, (2, 4), torch.float32, device)
    lp, ent = verl.linear_cross_entropy(hidden, weight, ids, 0.8, "SUM")  # verl's .lower()
    want = verl_math(hidden.detach().double(), weight.detach().double(), ids, 0.8)
    assert rel_err(lp, want[0].sum()) <= FP32_TOL and rel_err(ent, want[1].reshape(-1)) <= 1e-5
    # keywords, flat labels for (B, T, H) hidden, ids of another integer dtype
    lp2, _ = verl.linear_cross_entropy(hidden=hidden, weight=weight, labels=ids.reshape(-1).int(),
                                       temperature=0.8, reduction="sum")  # fmt: skip
    assert torch.equal(lp, lp2)
    # an int temperature (verl asserts a float) and the mean of the per-token values
    lp_mean, _ = verl.linear_cross_entropy(hidden, weight, ids, 2, "Mean")
    lp_none, _ = verl.linear_cross_entropy(hidden, weight, ids, 2.0)
    assert torch.allclose(lp_mean, lp_none.mean())


# ----------------------------------------------------------------------------- errors


def test_dist_process_group_must_be_a_group(device):
    """Anything but None or a ProcessGroup is a clear error (the vocab-parallel form itself is
    checked across ranks in tests/test_distributed_linear.py)."""
    gen = torch.Generator().manual_seed(7)
    hidden, weight, ids = inputs(gen, (2, 3), torch.float32, device)
    for bad in (object(), "tp-group"):
        with pytest.raises(TypeError, match="dist_process_group"):
            verl.linear_cross_entropy(hidden, weight, ids, 1.0, "none", bad)


@pytest.mark.parametrize("reduction, error", [("avg", ValueError), ("", ValueError),
                                              (None, TypeError), (2, TypeError)])  # fmt: skip
def test_bad_reduction(reduction, error, device):
    gen = torch.Generator().manual_seed(8)
    hidden, weight, ids = inputs(gen, (2, 3), torch.float32, device)
    with pytest.raises(error, match="reduction"):
        verl.linear_cross_entropy(hidden, weight, ids, reduction=reduction)


def test_argument_errors(device, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    hidden, weight, ids = inputs(gen, (2, 3), torch.float32, device)
    ppo = verl.FusedLinearForPPO(chunk_size=2)
    lce = verl.linear_cross_entropy
    bad = ids.clone()
    bad[1, 2] = -100  # verl has no ignore index
    with pytest.raises(ValueError, match="input_ids holds -100"):
        ppo(hidden, weight, bad)
    with pytest.raises(ValueError, match="labels holds -100"):
        lce(hidden, weight, bad)
    with pytest.raises(ValueError, match=f"labels holds {V}"):
        lce(hidden, weight, torch.full_like(ids, V))
    with pytest.raises(ValueError, match="already shifted"):  # no shift inside: (B, T) ids
        ppo(hidden, weight, ids[:, 1:])
    with pytest.raises(ValueError, match="one id per hidden row"):
        lce(hidden, weight, ids[:, 1:])
    with pytest.raises(TypeError, match="input_ids must be an integer"):
        ppo(hidden, weight, ids.float())
    with pytest.raises(TypeError, match="labels must be an integer"):
        lce(hidden, weight, ids.bool())
    with pytest.raises(ValueError, match="temperature"):
        ppo(hidden, weight, ids, 0.0)
    with pytest.raises(TypeError, match="temperature"):
        lce(hidden, weight, ids, torch.tensor(1.0))
    with pytest.raises(TypeError, match="vocab_weights"):
        ppo(hidden, weight.double(), ids)
    with pytest.raises(ValueError, match="vocab_weights must be the lm_head"):
        ppo(hidden, weight[:, 1:], ids)
    with pytest.raises(ValueError, match="hidden_states must be"):
        ppo(hidden[None], weight, ids[None])
    with pytest.raises(ValueError, match="hidden must be"):
        lce(hidden[0, 0], weight, ids[0, :1])
    for chunk, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="chunk_size"):
            verl.FusedLinearForPPO(chunk_size=chunk)
    ppo.chunk_size = -1
    with pytest.raises(ValueError, match="chunk_size"):
        ppo(hidden, weight, ids)
    monkeypatch.setattr(config, "check_values", False)  # the range check is a host sync
    verl.FusedLinearForPPO()(hidden, weight, ids)
