"""fused_rl.compat.trl against an independent transcription of TRL's ``selective_log_softmax``
and ``entropy_from_logits`` (``trl/trainer/utils.py``), run in float64."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rel_err

from fused_rl.compat.trl import entropy_from_logits, selective_log_softmax


def selective_log_softmax_oracle(logits, index):
    squeeze = index.dim() == logits.dim() - 1
    if squeeze:
        index = index.unsqueeze(-1)
    out = torch.gather(F.log_softmax(logits, dim=-1), -1, index)
    return out.squeeze(-1) if squeeze else out


def entropy_oracle(logits, chunk_size=128):
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(logp) * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def tolerance(dtype, eager_err):
    if dtype in (torch.float32, torch.float64):
        return 1e-5
    return max(2 * eager_err, 1e-3)


def make_logits(shape, dtype, device, *, sliced=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape[0], shape[1] + 1, shape[2], generator=gen, dtype=torch.float64) * 2
    base = full[:, :-1] if sliced else full[:, 1:].contiguous()  # the ``logits[:, :-1]`` view
    return base.to(device=device, dtype=dtype).detach().requires_grad_(), gen


SHAPES = [(2, 3, 11), (1, 1, 1), (3, 5, 97)]


@pytest.mark.parametrize(
    "shape, dtype, k",
    [(s, d, None) for s in SHAPES for d in (torch.float32, torch.bfloat16, torch.float16)]
    + [(s, torch.float32, 3) for s in SHAPES],  # a (..., K) index: K ids per position
)
def test_selective_log_softmax_matches_trl(shape, dtype, k, device):
    logits, gen = make_logits(shape, dtype, device, sliced=True, seed=sum(shape))
    index_shape = shape[:-1] if k is None else (*shape[:-1], k)
    index = torch.randint(0, shape[-1], index_shape, generator=gen).to(device)
    out = selective_log_softmax(logits, index)
    assert out.dtype == dtype and out.shape == index.shape

    z64 = logits.detach().double().requires_grad_()
    want = selective_log_softmax_oracle(z64, index)
    eager_leaf = logits.detach().clone().requires_grad_()
    eager = selective_log_softmax_oracle(eager_leaf, index)
    assert rel_err(out, want) <= tolerance(dtype, rel_err(eager, want))

    up = torch.randn(index.shape, generator=gen, dtype=torch.float64).to(device)
    out.backward(up.to(dtype))
    want.backward(up)
    eager.backward(up.to(dtype))
    assert logits.grad.dtype == dtype
    assert rel_err(logits.grad, z64.grad) <= tolerance(dtype, rel_err(eager_leaf.grad, z64.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_entropy_from_logits_matches_trl(shape, dtype, device):
    logits, gen = make_logits(shape, dtype, device, seed=7 + sum(shape))
    out = entropy_from_logits(logits, chunk_size=2)
    assert out.dtype == dtype and out.shape == shape[:-1]
    z64 = logits.detach().double().requires_grad_()
    want = entropy_oracle(z64, chunk_size=2)
    eager_leaf = logits.detach().clone().requires_grad_()
    eager = entropy_oracle(eager_leaf)
    assert rel_err(out, want) <= tolerance(dtype, rel_err(eager, want))
    up = torch.randn(shape[:-1], generator=gen, dtype=torch.float64).to(device)
    out.backward(up.to(dtype))
    want.backward(up)
    eager.backward(up.to(dtype))
    assert rel_err(logits.grad, z64.grad) <= tolerance(dtype, rel_err(eager_leaf.grad, z64.grad))


def test_two_dim_logits_and_int32_index(device):
    logits = torch.randn(6, 9, device=device)
    index = torch.randint(0, 9, (6,), device=device)
    want = selective_log_softmax_oracle(logits.double(), index)
    assert rel_err(selective_log_softmax(logits, index.int()), want) <= 1e-6
    assert rel_err(entropy_from_logits(logits), entropy_oracle(logits.double())) <= 1e-6


def test_neg_inf_logits_give_finite_entropy(device):
    logits = torch.randn(2, 3, 8, device=device)
    logits[..., 5:] = float("-inf")
    out = entropy_from_logits(logits)
    assert torch.isfinite(out).all()  # TRL's 0 * -inf gives NaN here
    want = entropy_oracle(logits[..., :5].double())
    assert rel_err(out, want) <= 1e-6


def test_out_of_range_index_raises(device):
    logits = torch.randn(2, 3, 5, device=device)
    for bad in (-100, 5):
        index = torch.zeros(2, 3, dtype=torch.long, device=device)
        index[0, 1] = bad
        with pytest.raises(ValueError, match="index holds"):
            selective_log_softmax(logits, index)
    with pytest.raises(ValueError, match="index must have shape"):
        selective_log_softmax(logits, torch.zeros(2, 4, 1, dtype=torch.long, device=device))


@pytest.mark.no_poison
def test_compiles_fullgraph(device):
    def f(logits, index):
        return selective_log_softmax(logits, index).sum() + entropy_from_logits(logits).sum()

    logits = torch.randn(2, 4, 10, device=device)
    index = torch.randint(0, 10, (2, 4), device=device)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(logits, index), f(logits, index)) <= 1e-6


def test_against_installed_trl(device):
    utils = pytest.importorskip("trl.trainer.utils")
    logits = torch.randn(2, 3, 11, device=device)
    index = torch.randint(0, 11, (2, 3), device=device)
    assert rel_err(selective_log_softmax(logits, index),
                   utils.selective_log_softmax(logits, index)) <= 1e-5  # fmt: skip
    assert rel_err(entropy_from_logits(logits), utils.entropy_from_logits(logits)) <= 1e-5


def test_one_range_check(monkeypatch, device):
    """The adapter's own range check (naming TRL) is the only eager host sync: the fused op
    underneath does not check the same labels again."""
    import fused_rl._validation as V

    calls = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(V, "check_target_range", lambda *a: calls.append("fused_rl"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: calls.append("sync") or real(t))
    logits = torch.randn(2, 3, 11, device=device)
    selective_log_softmax(logits, torch.randint(0, 11, (2, 3), device=device))
    assert calls == ["sync"]
