"""fused_rl.compat.trl against independent transcriptions of TRL's ``selective_log_softmax``
and ``entropy_from_logits`` (``trl/trainer/utils.py``, TRL >= 1.14; 1.16 checked live by
``scripts/test-compat-live.sh trl``): a float64 oracle for the values and gradients, and, for
``half_precision("original")``, TRL's half-precision PyTorch path written out here."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import gradcheck, rel_err

import fused_rl
import fused_rl.compat as compat
import fused_rl.compat._checks as compat_checks
import fused_rl.compat.trl as trl_compat
from fused_rl.compat.trl import entropy_from_logits, selective_log_softmax
from fused_rl.profiling import LaunchCounter

# ----------------------------------------------------------------------------- oracles


def selective_log_softmax_oracle(logits, index, temperature=1.0, row_mask=None):
    """float64: ``log_softmax(logits / T)`` at ``index`` (``(...)`` or ``(..., K)``), 0 where
    ``row_mask == 0``."""
    squeeze = index.dim() == logits.dim() - 1
    idx = index.long().unsqueeze(-1) if squeeze else index.long()
    out = torch.gather(F.log_softmax(logits / temperature, dim=-1), -1, idx)
    out = out.squeeze(-1) if squeeze else out
    if row_mask is not None:
        out = torch.where(row_mask == 0, torch.zeros_like(out), out)
    return out


def entropy_oracle(logits, chunk_size=128):
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(logp) * logp).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


# TRL's PyTorch path for logits that are neither fp32 nor fp64, as the live check found it in
# TRL 1.16 (bit for bit on CPU): the division by the temperature and the log-softmax happen in
# the logits' dtype, one leading row at a time; the entropy rounds ``exp`` and the products to
# that dtype too, ``chunk_size`` flattened rows at a time.


def trl_half_selective(logits, index, temperature=1.0, row_mask=None):
    if temperature != 1.0:
        logits = logits / temperature
    one_id = index.dim() == logits.dim() - 1
    ids = index.unsqueeze(-1) if one_id else index
    per_row = [F.log_softmax(logits[b], dim=-1).gather(-1, ids[b]) for b in range(len(logits))]
    out = torch.stack(per_row)
    if one_id:
        out = out[..., 0]
    return out if row_mask is None else out.masked_fill(row_mask == 0, 0.0)


def trl_half_entropy(logits, chunk_size=128):
    rows = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, rows.shape[0], chunk_size):
        logp = F.log_softmax(rows[start : start + chunk_size], dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def trl_output_dtype(logits, index=None, row_mask=None):
    """The dtype TRL 1.16 returns: fp32 where its own Triton kernel runs (CUDA / XPU; fp16 /
    bf16 / fp32 logits of 1-3 dims, last stride 1; an index of shape ``logits.shape[:-1]``;
    ``row_mask`` None or of index's exact shape, bool / int32 / int64), else the logits'."""
    kernel = logits.device.type in ("cuda", "xpu") and logits.dim() in (1, 2, 3)
    kernel = kernel and logits.dtype != torch.float64 and logits.stride(-1) == 1
    if index is not None:
        kernel = kernel and index.shape == logits.shape[:-1]
    if row_mask is not None:
        kernel = kernel and row_mask.shape == index.shape
        kernel = kernel and row_mask.dtype in (torch.bool, torch.int32, torch.int64)
    return torch.float32 if kernel else logits.dtype


def tolerance(dtype, eager_err):
    if dtype in (torch.float32, torch.float64):
        return 1e-5
    return max(2 * eager_err, 1e-3)


def grad_tolerance(dtype, eager_err, backend, device):
    """:func:`tolerance` for a gradient; a bf16 one written by the Triton interpreter (CPU) may
    be one bf16 ulp (2^-7 relative) off: Triton 3.9's interpreter converts fp32 to bf16 by
    truncation, where compiled kernels round to nearest."""
    tol = tolerance(dtype, eager_err)
    if dtype == torch.bfloat16 and backend == "triton" and torch.device(device).type == "cpu":
        tol = max(tol, 2.0**-7)
    return tol


def make_logits(shape, dtype, device, *, sliced=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(shape[0], shape[1] + 1, shape[2], generator=gen, dtype=torch.float64) * 2
    base = full[:, :-1] if sliced else full[:, 1:].contiguous()  # the ``logits[:, :-1]`` view
    return base.to(device=device, dtype=dtype).detach().requires_grad_(), gen


def bit_equal(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(((a == b) | (a.isnan() & b.isnan())).all())
    )


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    """The adapter has no ``backend`` argument: force its dispatch to fused_rl's reference."""
    if request.param == "reference":
        force = lambda _backend, *t: "reference"
        monkeypatch.setattr(trl_compat, "resolve_backend", force)  # entropy_from_logits
        monkeypatch.setattr(compat_checks, "resolve_backend", force)  # the shared gather
    return request.param


SHAPES = [(2, 3, 11), (1, 1, 1), (3, 5, 97)]

# ----------------------------------------------------------------------------- TRL 1.16 API


def test_signatures_are_trl_1_16():
    kinds = lambda fn: [
        (p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()
    ]
    pos, empty = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty
    assert kinds(selective_log_softmax) == [
        ("logits", pos, empty), ("index", pos, empty), ("temperature", pos, 1.0),
        ("row_mask", pos, None),
    ]  # fmt: skip
    assert kinds(entropy_from_logits) == [("logits", pos, empty), ("chunk_size", pos, 128)]


@pytest.mark.parametrize(
    "shape, dtype, k",
    [(s, d, None) for s in SHAPES for d in (torch.float32, torch.bfloat16, torch.float16)]
    + [(s, torch.float32, 3) for s in SHAPES],  # a (..., K) index: K ids per position
)
def test_selective_log_softmax_matches_trl(shape, dtype, k, device, backend):
    logits, gen = make_logits(shape, dtype, device, sliced=True, seed=sum(shape))
    index_shape = shape[:-1] if k is None else (*shape[:-1], k)
    index = torch.randint(0, shape[-1], index_shape, generator=gen).to(device)
    out = selective_log_softmax(logits, index)
    assert out.dtype == trl_output_dtype(logits, index) and out.shape == index.shape

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
    tol = grad_tolerance(dtype, rel_err(eager_leaf.grad, z64.grad), backend, device)
    assert rel_err(logits.grad, z64.grad) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("k", [None, 2])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "broadcast"])
def test_temperature_and_row_mask(dtype, k, mask_kind, device, backend):
    """TRL 1.16: ``log_softmax(logits / temperature)``; ``row_mask == 0`` entries give 0 with
    0 gradient (a float mask counts 0.5 and NaN as kept)."""
    logits, gen = make_logits((2, 4, 13), dtype, device, sliced=True, seed=3 + (k or 0))
    shape = (2, 4) if k is None else (2, 4, k)
    index = torch.randint(0, 13, shape, generator=gen).to(device)
    row_mask = None
    if mask_kind == "bool":
        row_mask = torch.rand(shape, generator=gen) > 0.4
    elif mask_kind == "float":
        row_mask = torch.tensor([0.0, 1.0, 0.5, float("nan")])[torch.randint(0, 4, shape)]
    elif mask_kind == "broadcast":
        row_mask = torch.tensor([1, 0, 1, 1] if k is None else [0, 1]).int()
    row_mask = None if row_mask is None else row_mask.to(device)
    out = selective_log_softmax(logits, index, 0.7, row_mask)  # positional, as TRL allows
    keywords = selective_log_softmax(logits, index, row_mask=row_mask, temperature=0.7)
    assert torch.equal(out, keywords) and out.shape == index.shape
    assert out.dtype == trl_output_dtype(logits, index, row_mask)

    z64 = logits.detach().double().requires_grad_()
    want = selective_log_softmax_oracle(z64, index, 0.7, row_mask)
    eager_leaf = logits.detach().clone().requires_grad_()
    eager = selective_log_softmax_oracle(eager_leaf, index, 0.7, row_mask)
    assert rel_err(out, want) <= tolerance(dtype, rel_err(eager, want))
    if row_mask is not None:
        assert bool((out[(row_mask == 0).expand(shape)] == 0).all())
    up = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
    out.backward(up.to(dtype))
    want.backward(up)
    eager.backward(up.to(dtype))
    tol = grad_tolerance(dtype, rel_err(eager_leaf.grad, z64.grad), backend, device)
    assert rel_err(logits.grad, z64.grad) <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_k_ids_rounded_once(dtype, device, backend):
    """A ``(..., K)`` index: values and every element of the gradient are computed in fp32
    and rounded to the logits' dtype once (a sum of K per-id gradients in bf16 rounds K
    times), ids repeated within a row and masked ones included: within the dtype's unit
    roundoff of float64 (twice that for kernels the Triton interpreter runs, which truncate)."""
    logits, gen = make_logits((4, 16, 33), dtype, device, seed=11)
    index = torch.randint(0, 33, (4, 16, 8), generator=gen)
    index[..., 4:] = index[..., :4].flip(-1)  # every id twice in its row
    index = index.to(device)
    mask = torch.rand(4, 16, 8, generator=gen) > 0.2
    mask[..., 4:] = mask[..., :4].flip(-1)  # an id's two slots kept or masked alike
    mask[1, 3] = False  # a row with no id kept: not read
    mask = mask.to(device)
    out = selective_log_softmax(logits, index, 0.7, mask)
    z64 = logits.detach().double().requires_grad_()
    want = selective_log_softmax_oracle(z64, index, 0.7, mask)
    up = torch.randn(index.shape, generator=gen, dtype=torch.float64)
    # upstream gradients of an id's two slots that nearly cancel (as a distillation loss's
    # do): the gradient, sum_k g_k (onehot_k - p) / T, is far smaller than each id's share,
    # which a sum of per-id gradients rounds (the error was 70 units of roundoff in bf16)
    up[..., 4:] = 0.01 * up[..., 4:] - up[..., :4].flip(-1)
    up = up.to(dtype).to(device)  # exact in the dtype: the oracle sees the same numbers
    out.backward(up)
    want.backward(up.double())
    unit = torch.finfo(dtype).eps / 2  # the unit roundoff
    interpreted = backend == "triton" and torch.device(device).type == "cpu"
    assert rel_err(out, want) <= unit
    assert rel_err(logits.grad, z64.grad) <= (2 * unit if interpreted else unit)
    assert bool((logits.grad[1, 3] == 0).all())


def test_k_ids_of_one_equal_one_id(device, backend):
    """An ``(..., 1)`` index gives the one-id route's log-probs and gradients: to the bit on
    the interpreted Triton path (the logits scaled by ``1 / T`` as layer 1 scales them; a
    GPU's compiler fuses that product into the kernel's subtraction, one rounding fewer
    than torch's), to fp32 rounding elsewhere, at any temperature."""
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(4, 16, 100, generator=gen) * 5).to(device)
    index = torch.randint(0, 100, (4, 16), generator=gen).to(device)
    up = torch.randn(4, 16, generator=gen).to(device)
    for temperature in (1.0, 0.7, 0.3):
        one, k = z.clone().requires_grad_(), z.clone().requires_grad_()
        a = selective_log_softmax(one, index, temperature)
        b = selective_log_softmax(k, index[..., None], temperature)[..., 0]
        a.backward(up)
        b.backward(up)
        if backend == "triton" and torch.device(device).type == "cpu":
            assert torch.equal(a, b), temperature
        assert rel_err(a, b) <= 1e-6 and rel_err(one.grad, k.grad) <= 1e-6, temperature


def test_k_ids_gradcheck(device, backend):
    """float64 ``gradcheck`` of a ``(..., K)`` index: ids repeated in a row, a masked id, a
    row with none kept, strided 4-D logits, a temperature."""
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(2, 2, 3, 9, generator=gen, dtype=torch.float64)
    logits = full[..., :7].to(device).requires_grad_()  # strided rows of V = 7
    index = torch.randint(0, 7, (2, 2, 3, 4), generator=gen)
    index[..., 3] = index[..., 0]
    mask = torch.ones(2, 2, 3, 4, dtype=torch.bool)
    mask[0, 1, 2, 1] = False
    mask[1, 0, 0] = False
    index, mask = index.to(device), mask.to(device)
    fn = lambda z: selective_log_softmax(z, index, 0.7, mask)  # noqa: E731
    assert gradcheck(fn, (logits,), eps=1e-6, atol=1e-7)


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
@pytest.mark.parametrize("k", [1, 4, 16])
def test_k_ids_read_the_logits_once(k, device):
    """K ids a position cost one layer-1 read of the logits forward and one layer-3 read and
    write backward, whatever K."""
    logits = torch.randn(2, 3, 50, device=device, requires_grad=True)
    index = torch.randint(0, 50, (2, 3, k), device=device)
    with LaunchCounter() as c:
        selective_log_softmax(logits, index, 0.7).sum().backward()
    assert c.kernels == ["_token_stats_fwd_kernel", "_token_stats_bwd_kernel"], c.kernels


def test_masked_rows_are_skipped(device, backend):
    """Masked entries never reach values or gradients (NaN logits there included) and their
    labels are not range-checked, as in TRL's kernel."""
    logits = torch.randn(2, 3, 9, device=device)
    logits[0, 1] = float("nan")
    logits.requires_grad_()
    index = torch.randint(0, 9, (2, 3), device=device)
    index[0, 1] = -100
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    mask[0, 1] = False
    out = selective_log_softmax(logits, index, row_mask=mask)
    assert out[0, 1].item() == 0.0 and torch.isfinite(out).all()
    out.backward(torch.randn(2, 3, device=device))
    assert torch.equal(logits.grad[0, 1], torch.zeros(9, device=device))
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError, match="index holds -100.*row_mask"):
        selective_log_softmax(logits, index)


def test_unchecked_labels_give_nan_not_skip(device, monkeypatch, backend):
    """Without the eager check an out-of-range label that counts is NaN; a masked one is 0."""
    monkeypatch.setattr(fused_rl.config, "check_values", False)
    logits = torch.randn(2, 3, 9, device=device)
    index = torch.randint(0, 9, (2, 3), device=device)
    index[0, 0], index[1, 2] = 9, compat_checks.NO_IGNORE
    index[1, 1] = -5
    mask = torch.ones(2, 3, device=device)
    mask[1, 1] = 0
    for mode in ("accurate", "original"):
        with compat.half_precision(mode):
            for z in (logits, logits.bfloat16()):
                out = selective_log_softmax(z, index, row_mask=mask)
                assert out[0, 0].isnan() and out[1, 2].isnan() and out[1, 1].item() == 0.0
                assert torch.isfinite(out[0, 1:]).all() and torch.isfinite(out[1, 0])
                # K ids a position: the same, id by id
                out = selective_log_softmax(z, index[..., None].expand(2, 3, 2),
                                            row_mask=mask[..., None])  # fmt: skip
                assert out[0, 0].isnan().all() and out[1, 2].isnan().all()
                assert (out[1, 1] == 0).all() and torch.isfinite(out[0, 1:]).all()


# ----------------------------------------------------------------------------- dtype rules


def test_output_dtype_follows_trl(device):
    """The logits' dtype on a CPU (TRL's PyTorch path); fp32 where TRL's kernel runs."""
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        logits = torch.randn(2, 3, 8, device=device, dtype=dtype)
        index = torch.randint(0, 8, (2, 3), device=device)
        mask = torch.ones(2, 3, dtype=torch.bool, device=device)
        want = dtype if device == "cpu" else trl_output_dtype(logits, index, mask)
        assert selective_log_softmax(logits, index, 0.5, mask).dtype == want
        assert entropy_from_logits(logits).dtype == want


def test_fp32_where_trl_runs_its_kernel(monkeypatch, device):
    """TRL 1.16 returns fp32 wherever its own Triton kernel runs (CUDA / XPU, fp16 / bf16 /
    fp32, 1-3 dims, last stride 1, a ``(...)`` int index, ``row_mask`` None or of index's
    exact shape in bool / int32 / int64), ``logits.dtype`` elsewhere; checked here on CPU by
    declaring the CPU such a device."""
    monkeypatch.setattr(trl_compat, "_TRL_KERNEL_DEVICES", ("cuda", "xpu", "cpu"))
    z = torch.randn(2, 3, 8, device=device, dtype=torch.bfloat16)
    i = torch.randint(0, 8, (2, 3), device=device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    fp32 = [
        selective_log_softmax(z, i),
        selective_log_softmax(z, i, 0.7, mask),
        selective_log_softmax(z, i, row_mask=mask.int()),
        selective_log_softmax(z[0], i[0]),
        selective_log_softmax(z[0, 0], i[0, 0]),
        selective_log_softmax(z.half(), i.int()),
        entropy_from_logits(z),
        entropy_from_logits(z[0, 0]),
    ]
    assert all(out.dtype == torch.float32 for out in fp32)
    same = [
        selective_log_softmax(z, i[..., None]),  # (..., K) index
        selective_log_softmax(z, i, row_mask=mask.float()),  # mask dtype
        selective_log_softmax(z, i, row_mask=mask[:1]),  # broadcast mask
        selective_log_softmax(z[None], i[None]),  # 4 dims
        selective_log_softmax(z.transpose(0, 2), i.new_zeros(8, 3)),  # last stride
        entropy_from_logits(z[None]),
        entropy_from_logits(z[..., ::2]),
    ]
    assert all(out.dtype == torch.bfloat16 for out in same)
    assert selective_log_softmax(z.double(), i).dtype == torch.float64
    with compat.half_precision("original"):  # TRL computes in fp32 there: so does fused_rl
        out = selective_log_softmax(z, i)
        assert out.dtype == torch.float32
        want = selective_log_softmax_oracle(z.double(), i)
        assert rel_err(out, want) <= 1e-6


# ----------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape, k, temperature, mask",
    [((2, 3, 37), None, 1.0, False), ((3, 4, 50), None, 0.7, True), ((2, 3, 37), 3, 1.3, True),
     ((1, 1, 5), None, 2.0, False), ((2, 2, 3, 19), None, 0.9, True)],
)  # fmt: skip
def test_original_mode_is_trl_bit_for_bit(dtype, shape, k, temperature, mask, device):
    gen = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=gen) * 4).to(device=device, dtype=dtype)
    index_shape = shape[:-1] if k is None else (*shape[:-1], k)
    index = torch.randint(0, shape[-1], index_shape, generator=gen).to(device)
    row_mask = (torch.rand(index_shape, generator=gen) > 0.3).to(device) if mask else None
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with compat.half_precision("original"):
        out = selective_log_softmax(ours, index, temperature, row_mask)
    want = trl_half_selective(theirs, index, temperature, row_mask)
    if trl_output_dtype(logits, index, row_mask) == torch.float32:  # TRL's fp32 kernel (GPU)
        oracle = selective_log_softmax_oracle(logits.double(), index, temperature, row_mask)
        assert out.dtype == torch.float32 and rel_err(out, oracle) <= 1e-5
        return
    assert bit_equal(out, want)
    up = torch.randn(index_shape, generator=gen).to(device=device, dtype=dtype)
    out.backward(up)
    want.backward(up)
    assert bit_equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape, chunk_size", [((2, 3, 37), 128), ((5, 7, 20), 2), ((33,), 1), ((2, 2, 3, 19), 5)]
)
def test_original_mode_entropy_is_trl_bit_for_bit(dtype, shape, chunk_size, device):
    gen = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=gen) * 4).to(device=device, dtype=dtype)
    if trl_output_dtype(logits) == torch.float32:  # TRL's fp32 kernel (GPU): fused_rl's fp32
        with compat.half_precision("original"):
            out = entropy_from_logits(logits, chunk_size)
        assert out.dtype == torch.float32 and rel_err(out, entropy_oracle(logits.double())) <= 1e-5
        return
    logits[..., :2] = float("-inf")  # TRL's NaN (0 * -inf) is kept in this mode
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with compat.half_precision("original"):
        out = entropy_from_logits(ours, chunk_size)
    want = trl_half_entropy(theirs, chunk_size)
    assert bit_equal(out, want) and bool(out.isnan().all())
    logits = (torch.randn(shape, generator=gen) * 4).to(device=device, dtype=dtype)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    with compat.half_precision("original"):
        out = entropy_from_logits(ours, chunk_size=chunk_size)
    want = trl_half_entropy(theirs, chunk_size)
    assert bit_equal(out, want)
    up = torch.randn(shape[:-1], generator=gen).to(device=device, dtype=dtype)
    out.backward(up)
    want.backward(up)
    assert bit_equal(ours.grad, theirs.grad)


def test_original_mode_leaves_fp32_and_the_default_accurate(device, backend):
    """``"original"`` changes fp16 / bf16 only; the default rounds the fp32 result once."""
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(3, 4, 300, generator=gen) * 3).to(device)
    i = torch.randint(0, 300, (3, 4), generator=gen).to(device)
    with compat.half_precision("original"):
        fp32 = selective_log_softmax(z, i, 0.7), entropy_from_logits(z)
    assert torch.equal(fp32[0], selective_log_softmax(z, i, 0.7))
    assert torch.equal(fp32[1], entropy_from_logits(z))
    zb = z.bfloat16()
    acc = selective_log_softmax(zb, i, 0.7).bfloat16()  # fp32 where TRL's kernel would run
    assert torch.equal(acc, selective_log_softmax(zb.float(), i, 0.7).bfloat16())
    oracle = selective_log_softmax_oracle(zb.double(), i, 0.7)
    assert rel_err(acc, oracle) <= rel_err(trl_half_selective(zb, i, 0.7), oracle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_entropy_from_logits_matches_trl(shape, dtype, device, backend):
    logits, gen = make_logits(shape, dtype, device, seed=7 + sum(shape))
    out = entropy_from_logits(logits, chunk_size=2)
    assert out.dtype == trl_output_dtype(logits) and out.shape == shape[:-1]
    z64 = logits.detach().double().requires_grad_()
    want = entropy_oracle(z64, chunk_size=2)
    eager_leaf = logits.detach().clone().requires_grad_()
    eager = entropy_oracle(eager_leaf)
    assert rel_err(out, want) <= tolerance(dtype, rel_err(eager, want))
    up = torch.randn(shape[:-1], generator=gen, dtype=torch.float64).to(device)
    out.backward(up.to(dtype))
    want.backward(up)
    eager.backward(up.to(dtype))
    tol = grad_tolerance(dtype, rel_err(eager_leaf.grad, z64.grad), backend, device)
    assert rel_err(logits.grad, z64.grad) <= tol


# ----------------------------------------------------------------------------- shapes, errors


def test_two_dim_logits_and_int32_index(device):
    logits = torch.randn(6, 9, device=device)
    index = torch.randint(0, 9, (6,), device=device)
    want = selective_log_softmax_oracle(logits.double(), index)
    assert rel_err(selective_log_softmax(logits, index.int()), want) <= 1e-6
    assert rel_err(entropy_from_logits(logits), entropy_oracle(logits.double())) <= 1e-6


def test_one_dim_logits_and_empty_rows(device):
    """``(V,)`` logits with a 0-d index give a 0-d log-prob, as TRL's kernel does (its
    PyTorch path mishandles them); empty leading dimensions give empty results."""
    for dtype in (torch.float32, torch.bfloat16):
        # seeded: "original" bf16 is TRL's bf16 log-softmax, whose rounding of the normaliser
        # (~2e-3 absolute) is over 1e-2 of a log-prob near 0 for some draws (2 in 300)
        z = torch.randn(9, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        for mode in ("accurate", "original"):
            with compat.half_precision(mode):
                out = selective_log_softmax(z, torch.tensor(4, device=device), 0.5)
                assert out.shape == () and out.dtype == trl_output_dtype(z)
                want = selective_log_softmax_oracle(z.double(), torch.tensor(4, device=device), 0.5)
                assert rel_err(out, want) <= 1e-2
                empty = torch.randn(0, 3, 5, device=device, dtype=dtype)
                index = torch.zeros(0, 3, dtype=torch.long, device=device)
                assert selective_log_softmax(empty, index).shape == (0, 3)
                assert entropy_from_logits(empty).shape == (0, 3)


def test_neg_inf_logits_give_finite_entropy(device, backend):
    logits = torch.randn(2, 3, 8, device=device)
    logits[..., 5:] = float("-inf")
    out = entropy_from_logits(logits)
    assert torch.isfinite(out).all()  # TRL's 0 * -inf gives NaN here
    want = entropy_oracle(logits[..., :5].double())
    assert rel_err(out, want) <= 1e-6


def test_bad_arguments_name_the_argument(device):
    logits = torch.randn(2, 3, 5, device=device)
    index = torch.zeros(2, 3, dtype=torch.long, device=device)
    for bad in (-100, 5):
        bad_index = index.clone()
        bad_index[0, 1] = bad
        with pytest.raises(ValueError, match="index holds"):
            selective_log_softmax(logits, bad_index)
    with pytest.raises(ValueError, match="index must have shape"):
        selective_log_softmax(logits, torch.zeros(2, 4, 1, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="index must be an int64 or int32"):
        selective_log_softmax(logits, index[..., None].short())
    for t in (0.0, -1.0, float("nan"), float("inf")):  # TRL: ValueError for t <= 0
        with pytest.raises(ValueError, match="temperature"):
            selective_log_softmax(logits, index, t)
    with pytest.raises(TypeError, match="temperature"):
        selective_log_softmax(logits, index, torch.tensor(0.5))
    with pytest.raises(ValueError, match="row_mask must have index's shape"):
        selective_log_softmax(logits, index, row_mask=torch.ones(3, 2, device=device))
    with pytest.raises(ValueError, match="row_mask must have index's shape"):
        selective_log_softmax(logits, index, row_mask=torch.ones(4, 2, 3, device=device))
    with pytest.raises(TypeError, match="row_mask"):
        selective_log_softmax(logits, index, row_mask=[[1, 1, 1], [1, 1, 1]])
    for chunk_size in (0, -1, 1.5):
        with pytest.raises((ValueError, TypeError), match="chunk_size"):
            entropy_from_logits(logits, chunk_size)


@pytest.mark.no_poison
def test_compiles_fullgraph(device):
    def f(logits, index, mask):
        return (
            selective_log_softmax(logits, index, 0.7, mask).sum()
            + entropy_from_logits(logits).sum()
        )

    logits = torch.randn(2, 4, 10, device=device)
    index = torch.randint(0, 10, (2, 4), device=device)
    mask = torch.rand(2, 4, device=device) > 0.3
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert rel_err(compiled(logits, index, mask), f(logits, index, mask)) <= 1e-6
    # K ids a position, with the gradient
    index, mask = torch.randint(0, 10, (2, 4, 3), device=device), mask[..., None]
    leaf = logits.clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(leaf, index, mask)
    (grad,) = torch.autograd.grad(got, leaf)
    want = f(logits.clone().requires_grad_(), index, mask)
    assert rel_err(got, want) <= 1e-6
    assert rel_err(grad, torch.autograd.grad(f(leaf, index, mask), leaf)[0]) <= 1e-6


def test_against_installed_trl(device):
    """Only where TRL is installed (the live check's venv): the adapter against the real
    functions, in both modes."""
    utils = pytest.importorskip("trl.trainer.utils")
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(2, 3, 11, generator=gen) * 3).to(device=device, dtype=dtype)
        index = torch.randint(0, 11, (2, 3), generator=gen).to(device)
        mask = (torch.rand(2, 3, generator=gen) > 0.3).to(device)
        for args in ((), (0.7,), (0.7, mask)):
            want = utils.selective_log_softmax(logits, index, *args)
            got = selective_log_softmax(logits, index, *args)
            assert got.dtype == want.dtype
            assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
            with compat.half_precision("original"):
                got = selective_log_softmax(logits, index, *args)
            if dtype != torch.float32 and not trl_compat._trl_kernel_path(logits, index):
                assert bit_equal(got, want)
        want = utils.entropy_from_logits(logits, 2)
        assert entropy_from_logits(logits, 2).dtype == want.dtype
        assert rel_err(entropy_from_logits(logits, 2), want) <= 1e-2
        with compat.half_precision("original"):
            got = entropy_from_logits(logits, 2)
        if dtype != torch.float32 and not trl_compat._trl_kernel_path(logits):
            assert bit_equal(got, want)


def test_one_range_check(monkeypatch, device):
    """The adapter's own range check (naming TRL) is the only eager host sync: the fused op
    underneath does not check the same labels again, with or without a row mask."""
    import fused_rl._validation as V

    calls = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(V, "check_target_range", lambda *a: calls.append("fused_rl"))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: calls.append("sync") or real(t))
    logits = torch.randn(2, 3, 11, device=device)
    selective_log_softmax(logits, torch.randint(0, 11, (2, 3), device=device))
    assert calls == ["sync"]
    calls.clear()
    mask = torch.rand(2, 3, device=device) > 0.5
    selective_log_softmax(
        logits, torch.randint(0, 11, (2, 3, 2), device=device), 0.5, mask[..., None]
    )
    assert calls == ["sync"]


def test_adapters_share_checks_not_private_helpers():
    """The label checks the adapters share live in ``fused_rl.compat._checks``: no adapter
    imports another adapter's private (underscore) names. (The modules of the
    ``fused_rl.compat.verl`` package are one adapter: they may share theirs.)"""
    import ast
    from pathlib import Path

    root = Path(compat.__file__).parent
    adapters = {"trl", "liger", "torchtune", "ding", "ding_v053", "verl"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        inside = path.relative_to(root).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            base = node.module.split(".")[0]
            level_ok = node.level == (2 if path.parent != root else 1)
            if not level_ok or base not in adapters or base == inside:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                offenders.append(f"{path.relative_to(root)}: from .{node.module} {private}")
    assert not offenders, offenders


# ----------------------------------------------------------------------------- GKD loss

from fused_rl.compat.trl import generalized_jsd_loss  # noqa: E402

JSD_REDUCTIONS = ("batchmean", "sum", "mean", "none")


def generalized_jsd_oracle(s, t, labels=None, beta=0.5, temperature=1.0, reduction="batchmean",
                           num_items_in_batch=None):  # fmt: skip
    """A copy of TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` math (run in float64 for the
    oracle, or in the inputs' half dtype as TRL runs it): ``F.kl_div(..., reduction="none")``
    gives ``(..., V)`` elementwise terms, masked to ``jsd[labels != -100]``."""
    ls = F.log_softmax(s / temperature, dim=-1)
    lt = F.log_softmax(t / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(ls, lt, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(lt, ls, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=ls.dtype)
        lm = torch.logsumexp(torch.stack([ls + torch.log1p(-b), lt + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(lm, lt, reduction="none", log_target=True)
        jsd = jsd + (1 - b) * F.kl_div(lm, ls, reduction="none", log_target=True)
    mask = None
    if labels is not None:
        mask = labels != -100
        jsd = jsd[mask]
    if num_items_in_batch is not None:
        return jsd.sum() / num_items_in_batch
    if reduction == "batchmean":
        return jsd.sum() / (mask.sum().clamp_min(1) if labels is not None else max(jsd.size(0), 1))
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.mean()
    return jsd


def _gkd_inputs(shape, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    s = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(device, dtype)
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).to(device, dtype)
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen).to(device)
    if labels.dim():
        labels[..., :2] = -100
    return s, t, labels, gen


def test_generalized_jsd_signature_is_trl_1_16():
    pos, empty = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty
    got = [(p.name, p.kind, p.default)
           for p in inspect.signature(generalized_jsd_loss).parameters.values()]  # fmt: skip
    assert got == [
        ("student_logits", pos, empty), ("teacher_logits", pos, empty), ("labels", pos, None),
        ("beta", pos, 0.5), ("temperature", pos, 1.0), ("reduction", pos, "batchmean"),
        ("num_items_in_batch", pos, None),
    ]  # fmt: skip


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", JSD_REDUCTIONS)
def test_generalized_jsd_loss_matches_trl_math(beta, reduction, device, backend):
    """Every reduction, with and without labels and ``num_items_in_batch``, against the
    float64 copy of TRL's math: value and the student's gradient (random upstream)."""
    s, t, labels, gen = _gkd_inputs((2, 5, 13), torch.float32, device, seed=int(beta * 10))
    for lab in (None, labels):
        for n_items in (None, torch.tensor(3.0)):
            leaf = s.clone().requires_grad_()
            out = generalized_jsd_loss(leaf, t, lab, beta, 0.8, reduction, n_items)
            s64 = s.double().requires_grad_()
            want = generalized_jsd_oracle(s64, t.double(), lab, beta, 0.8, reduction, n_items)
            assert out.shape == want.shape and out.dtype == torch.float32
            assert rel_err(out, want) <= 1e-5, (lab is None, n_items)
            up = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            (g,) = torch.autograd.grad(out, leaf, up.to(device, out.dtype))
            (g64,) = torch.autograd.grad(want, s64, up.to(device))
            assert rel_err(g, g64) <= 1e-5, (lab is None, n_items)


def test_generalized_jsd_loss_edges(device, backend):
    """TRL's denominators: ``batchmean`` without labels divides by ``shape[0]`` (the batch
    size, not the token count), ``mean`` by ``tokens * V``; nothing counted gives 0 for
    ``batchmean`` / ``sum`` and NaN for ``mean`` (an empty mean). (N, V) and 4-D logits."""
    s, t, labels, _ = _gkd_inputs((3, 4, 6), torch.float32, device, seed=5)
    per_token = generalized_jsd_loss(s, t, reduction="sum")
    assert rel_err(generalized_jsd_loss(s, t), per_token / 3) <= 1e-6
    assert rel_err(generalized_jsd_loss(s, t, reduction="mean"), per_token / (12 * 6)) <= 1e-6
    none = torch.full_like(labels, -100)
    assert generalized_jsd_loss(s, t, none).item() == 0.0
    assert generalized_jsd_loss(s, t, none, reduction="sum").item() == 0.0
    assert generalized_jsd_loss(s, t, none, reduction="mean").isnan()
    assert generalized_jsd_loss(s, t, none, reduction="none").shape == (0, 6)
    for shape in [(7, 9), (2, 2, 3, 9), (9,)]:
        s, t, labels, _ = _gkd_inputs(shape, torch.float32, device, seed=len(shape))
        for lab in (None, labels):
            for reduction in JSD_REDUCTIONS:
                out = generalized_jsd_loss(s, t, lab, 0.4, 1.0, reduction)
                want = generalized_jsd_oracle(s.double(), t.double(), lab, 0.4, 1.0, reduction)
                assert out.shape == want.shape and rel_err(out, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_generalized_jsd_loss_half_precision(dtype, device, backend):
    """``"accurate"``: fp32 math rounded once, at least as close to float64 as TRL's own
    half-precision arithmetic; ``"original"``: TRL's arithmetic bit for bit."""
    s, t, labels, gen = _gkd_inputs((2, 4, 37), dtype, device, seed=9)
    for beta in (0.0, 0.5, 1.0):
        for reduction in ("batchmean", "sum"):
            leaf = s.clone().requires_grad_()
            out = generalized_jsd_loss(leaf, t, labels, beta, 0.9, reduction)
            assert out.dtype == dtype
            s64 = s.double().requires_grad_()
            want = generalized_jsd_oracle(s64, t.double(), labels, beta, 0.9, reduction)
            theirs_leaf = s.clone().requires_grad_()
            theirs = generalized_jsd_oracle(theirs_leaf, t, labels, beta, 0.9, reduction)
            assert rel_err(out, want) <= tolerance(dtype, rel_err(theirs, want))
            up = torch.randn((), generator=gen, dtype=torch.float64)
            (g,) = torch.autograd.grad(out, leaf, up.to(device, dtype))
            (g64,) = torch.autograd.grad(want, s64, up.to(device))
            (gt,) = torch.autograd.grad(theirs, theirs_leaf, up.to(device, dtype))
            assert rel_err(g, g64) <= grad_tolerance(dtype, rel_err(gt, g64), backend, device)
            with compat.half_precision("original"):
                ours = generalized_jsd_loss(s, t, labels, beta, 0.9, reduction)
            assert bit_equal(ours, generalized_jsd_oracle(s, t, labels, beta, 0.9, reduction))


def test_generalized_jsd_loss_bad_arguments(device):
    s = torch.randn(2, 3, 5, device=device)
    with pytest.raises(ValueError, match="teacher_logits must have student_logits' shape"):
        generalized_jsd_loss(s, torch.randn(2, 3, 6, device=device))
    with pytest.raises(ValueError, match="teacher_logits requires grad"):
        generalized_jsd_loss(s, s.clone().requires_grad_())
    for beta in (-0.5, 2.0):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd_loss(s, s, beta=beta)
    with pytest.raises(ValueError, match="temperature"):
        generalized_jsd_loss(s, s, temperature=0.0)
    with pytest.raises(ValueError, match="reduction"):
        generalized_jsd_loss(s, s, reduction="avg")
    with pytest.raises(ValueError, match="labels must have shape"):
        generalized_jsd_loss(s, s, torch.zeros(3, 2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="num_items"):
        generalized_jsd_loss(s, s, num_items_in_batch=0)


def test_generalized_jsd_loss_against_installed_trl(device):
    """Only where TRL is installed (its GKD trainer importable): the adapter against TRL's
    own static method, fp32 to 1e-5, half precision in ``"original"`` mode bit for bit."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    trl_loss = gkd.GKDTrainer.generalized_jsd_loss
    for dtype in (torch.float32, torch.bfloat16):
        s, t, labels, gen = _gkd_inputs((2, 5, 13), dtype, device, seed=21)
        for beta in (0.0, 0.3, 1.0):
            for reduction in JSD_REDUCTIONS:
                for lab, n_items in ((None, None), (labels, None), (labels, 6)):
                    args = (lab, beta, 0.8, reduction, n_items)
                    ours_leaf, trl_leaf = s.clone().requires_grad_(), s.clone().requires_grad_()
                    want = trl_loss(trl_leaf, t, *args)
                    if dtype == torch.float32:
                        got = generalized_jsd_loss(ours_leaf, t, *args)
                        assert got.dtype == want.dtype and got.shape == want.shape
                        assert rel_err(got, want) <= 1e-5
                        up = torch.randn(want.shape, generator=gen).to(device)
                        (g,) = torch.autograd.grad(got, ours_leaf, up)
                        (gw,) = torch.autograd.grad(want, trl_leaf, up)
                        assert rel_err(g, gw) <= 1e-5
                    else:
                        with compat.half_precision("original"):
                            got = generalized_jsd_loss(ours_leaf, t, *args)
                        assert bit_equal(got, want)
