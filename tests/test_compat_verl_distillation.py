"""fused_rl.compat.verl's ``compute_forward_kl_topk`` (verl 0.9.1's top-k distillation loss,
``verl/trainer/distillation/fsdp/losses.py``) against a float64 transcription of verl's math
with the student's log-softmax whole: the loss and its gradient under a random upstream
gradient, the masses and the overlap diagnostics, verl's dtypes, nested inputs, the cost (one
read of the logits forward, one backward, whatever K), and the argument errors. Where verl is
installed (the live check's venv), against verl's own function."""

import pytest
import torch
from helpers import FP32_TOL, rel_err

import fused_rl._select_ops as select_ops
import fused_rl.compat._checks as compat_checks
from fused_rl.compat.verl import compute_forward_kl_topk
from fused_rl.profiling import LaunchCounter

V = 53  # not a power of two: the vocab kernels' masked tail runs


@pytest.fixture(params=["triton", "reference"])
def backend(request, monkeypatch):
    """The adapter takes no backend (as verl's): force the shared gather's dispatch."""
    if request.param == "reference":
        for module in (compat_checks, select_ops):
            monkeypatch.setattr(module, "resolve_backend", lambda _b, *t: "reference")
    return request.param


def verl_math(logits, teacher, ids, clamp):
    """verl's per-token math in the inputs' precision (float64 for the oracle): the student's
    log-softmax gathered at the teacher's ids, both clamped below, ``sum p_t (lt - ls)``; the
    masses; the overlap with the student's top K by ``torch.topk`` ids."""
    student = torch.log_softmax(logits, dim=-1).gather(-1, ids.long())
    own = torch.topk(logits.detach(), k=ids.shape[-1], dim=-1).indices
    masses = student.exp().sum(-1), teacher.exp().sum(-1)
    if clamp is not None:
        student, teacher = student.clamp_min(clamp), teacher.clamp_min(clamp)
    token_kl = teacher.exp() * (teacher - student)
    overlap = (ids.unsqueeze(-1) == own.unsqueeze(-2)).any(-1)
    count = overlap.sum(-1)
    adv = (-token_kl.detach() * overlap).sum(-1) / count.clamp_min(1)
    adv = torch.where(count > 0, adv, torch.zeros_like(adv))
    return token_kl.sum(-1), *masses, count, adv


def case(gen, n, k, dtype, device):
    """Student logits ``(1, n, V)`` (distinct values: no top-K tie), the teacher's top-k
    log-probs and ids of a random distribution."""
    logits = torch.randn(1, n, V, generator=gen, dtype=torch.float64) * 2
    teacher = torch.log_softmax(torch.randn(1, n, V, generator=gen, dtype=torch.float64) * 2, -1)
    lt, ids = teacher.topk(k, dim=-1)
    leaf = logits.to(device, dtype).requires_grad_()
    return leaf, lt.float().to(device), ids.to(device)


def cfg(clamp):
    return {"distillation_loss": {"log_prob_min_clamp": clamp}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp", [-10.0, -2.0, None])
@pytest.mark.parametrize("k", [1, 8])
def test_matches_verl_math(dtype, clamp, k, device, backend):
    gen = torch.Generator().manual_seed(k + int(clamp or 0) * 7)
    logits, teacher, ids = case(gen, 19, k, dtype, device)
    out = compute_forward_kl_topk(logits, teacher, ids, cfg(clamp), "thd")
    z64 = logits.detach().double().requires_grad_()
    want = verl_math(z64, teacher.double(), ids, clamp)
    names = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count",
             "overlap_token_advantage")  # fmt: skip
    assert list(out) == list(names)
    dtypes = (torch.float32, dtype, torch.float32, torch.int64, torch.float32)
    for name, dt in zip(names, dtypes):
        assert out[name].shape == (1, 19) and out[name].dtype == dt, name
    tol = FP32_TOL if dtype == torch.float32 else 2.0**-7  # bf16 outputs / logits rounded
    assert rel_err(out["distillation_losses"], want[0]) <= tol
    assert rel_err(out["student_mass"], want[1]) <= tol
    assert torch.equal(out["teacher_mass"], teacher.exp().sum(-1))  # verl's ops, its dtype
    if dtype == torch.float32:  # bf16 rounding may reorder the student's top K
        assert torch.equal(out["overlap_count"], want[3])
        assert rel_err(out["overlap_token_advantage"], want[4]) <= FP32_TOL
    up = torch.randn(1, 19, generator=gen, dtype=torch.float64).to(device)
    out["distillation_losses"].backward(up.float())
    want[0].backward(up)
    assert logits.grad.dtype == dtype
    grad_tol = FP32_TOL if dtype == torch.float32 else 2.0**-7
    assert rel_err(logits.grad, z64.grad) <= grad_tol


def test_nested_inputs_as_verl_sends_them(device, backend):
    """verl passes the teacher's tensors nested (jagged, one row a sequence): their values
    are the ``(1, total_nnz, K)`` rows of the packed logits."""
    gen = torch.Generator().manual_seed(3)
    logits, teacher, ids = case(gen, 9, 4, torch.float32, device)
    offsets = torch.tensor([0, 4, 9], device=device)
    nested = [torch.nested.nested_tensor_from_jagged(t[0], offsets=offsets)
              for t in (teacher, ids)]  # fmt: skip
    got = compute_forward_kl_topk(logits, *nested, cfg(-10.0))
    want = compute_forward_kl_topk(logits, teacher, ids, cfg(-10.0))
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_clamped_tokens_get_no_gradient(device, backend):
    """Below ``log_prob_min_clamp`` a student log-prob is a constant (``clamp_min``)."""
    logits = torch.zeros(1, 1, V, device=device)
    logits[0, 0, 0] = -30.0  # log q = -30 - log(52 + e^-30): far below the clamp
    logits.requires_grad_()
    teacher = torch.log(torch.tensor([[[0.7, 0.2]]], device=device))
    ids = torch.tensor([[[0, 1]]], device=device)
    out = compute_forward_kl_topk(logits, teacher, ids, cfg(-10.0))
    out["distillation_losses"].sum().backward()
    q = torch.softmax(logits.detach()[0, 0].double(), -1)
    # only id 1 (weight 0.2) is differentiable: d/dz of -0.2 log q_1 = -0.2 (onehot_1 - q)
    want = -0.2 * (torch.nn.functional.one_hot(torch.tensor(1), V).double() - q.cpu())
    assert rel_err(logits.grad[0, 0], want.to(device)) <= FP32_TOL


def test_nan_row_ranks_nothing(device, backend):
    """A student row holding a NaN: its loss NaN, its overlap count 0 and the overlap's
    mean NaN (NaN in, NaN out); the other rows as without it."""
    gen = torch.Generator().manual_seed(5)
    logits, teacher, ids = case(gen, 4, 3, torch.float32, device)
    clean = compute_forward_kl_topk(logits, teacher, ids, cfg(-10.0))
    poisoned = logits.detach().clone()
    poisoned[0, 2, 7] = float("nan")
    out = compute_forward_kl_topk(poisoned, teacher, ids, cfg(-10.0))
    assert out["distillation_losses"][0, 2].isnan()
    assert out["overlap_count"][0, 2] == 0 and out["overlap_token_advantage"][0, 2].isnan()
    for name in out:
        rest = [0, 1, 3]
        assert torch.equal(out[name][0, rest], clean[name][0, rest].detach()), name


@pytest.mark.no_poison  # the NaN fill of fresh buffers is the test's, not the call's
@pytest.mark.parametrize("k", [2, 32])
def test_one_read_forward_and_one_backward(k, device):
    """The student's K log-probs: one layer-1 read of the logits forward and one layer-3
    read and write backward, whatever K (verl's path writes the ``(N, V)`` log-softmax); the
    overlap diagnostic one radix select of the K-th largest (no ``torch.topk``)."""
    logits = torch.randn(1, 6, 64, device=device, requires_grad=True)
    ids = torch.stack([torch.randperm(64)[:k] for _ in range(6)])[None].to(device)
    teacher = torch.full((1, 6, k), -3.0, device=device)
    with LaunchCounter() as c:
        compute_forward_kl_topk(logits, teacher, ids, cfg(-10.0))["distillation_losses"].sum(
        ).backward()  # fmt: skip
    assert c.kernels == ["_token_stats_fwd_kernel", "_kth_largest_kernel",
                         "_token_stats_bwd_kernel"], c.kernels  # fmt: skip


def test_bad_arguments_name_the_argument(device):
    logits = torch.randn(1, 4, V, device=device)
    ids = torch.randint(0, V, (1, 4, 3), device=device)
    teacher = torch.full((1, 4, 3), -2.0, device=device)
    with pytest.raises(ValueError, match="teacher_topk_ids holds 53, outside"):
        compute_forward_kl_topk(logits, teacher, torch.full_like(ids, V), cfg(None))
    with pytest.raises(ValueError, match="teacher_topk_log_probs"):
        compute_forward_kl_topk(logits, teacher[..., :2], ids, cfg(None))
    with pytest.raises(ValueError, match=r"\(bsz, seqlen, K\) with the same"):
        compute_forward_kl_topk(logits, teacher[:, :3], ids[:, :3], cfg(None))
    with pytest.raises(TypeError, match="teacher_topk_ids must be int64 or int32"):
        compute_forward_kl_topk(logits, teacher, ids.float(), cfg(None))
    with pytest.raises(ValueError, match=r"teacher_topk_ids holds K = 54 ids a position, more"):
        compute_forward_kl_topk(logits, teacher[..., :1].expand(1, 4, 54),
                                ids[..., :1].expand(1, 4, 54), cfg(None))  # fmt: skip
    with pytest.raises(ValueError, match="data_format"):
        compute_forward_kl_topk(logits, teacher, ids, cfg(None), "sbhd")
    with pytest.raises(AttributeError, match="distillation_loss"):
        compute_forward_kl_topk(logits, teacher, ids, {})


def test_against_installed_verl(device):
    """Only where verl >= 0.9.1 is installed (the live check's venv): verl's own function on
    the same nested inputs; fp32 agrees to rounding, gradients included."""
    losses = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    gen = torch.Generator().manual_seed(5)
    logits, teacher, ids = case(gen, 11, 6, torch.float32, device)
    offsets = torch.tensor([0, 5, 11], device=device)
    nested = [torch.nested.nested_tensor_from_jagged(t[0], offsets=offsets)
              for t in (teacher, ids)]  # fmt: skip
    for clamp in (-10.0, -2.0, None):
        config = DistillationConfig(distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=6, log_prob_min_clamp=clamp))  # fmt: skip
        a = logits.detach().clone().requires_grad_()
        b = logits.detach().clone().requires_grad_()
        want = losses.compute_forward_kl_topk(a, *nested, config, "thd")
        got = compute_forward_kl_topk(b, *nested, config, "thd")
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == want[name].dtype, name
            assert rel_err(got[name].float(), want[name].float()) <= FP32_TOL, name
        up = torch.randn(1, 11, generator=gen).to(device)
        want["distillation_losses"].backward(up)
        got["distillation_losses"].backward(up)
        assert rel_err(b.grad, a.grad) <= FP32_TOL
