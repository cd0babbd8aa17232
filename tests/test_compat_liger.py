"""fused_rl.compat.liger.triton_grpo_loss against a float64 transcription of Liger-Kernel
0.8.5's ``triton_grpo_loss`` (``liger_kernel/transformers/grpo_loss.py`` and the op in
``liger_kernel/ops/grpo_loss.py``), written here from the math: the ``(B, L + 1, V)`` logits
layout and temperature, the PPO / CISPO / SAPO per-token losses, ``delta``, token and
sequence importance sampling, ``vllm_is_ratio`` before the KL, k3 (bias-corrected), the six
reductions and the ``[kl_mean, clip_ratio]`` metrics; values, gradients w.r.t. the logits
under a random upstream gradient, and the errors Liger raises."""

import inspect
import math

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err

from fused_rl.compat.liger import LOSS_TYPES, triton_grpo_loss

# ----------------------------------------------------------------------------- the oracle


def o_liger(logits, old, ref, ids, adv, mask=None, temperature=0.9, beta=0.04, eps_low=0.2,
            eps_high=0.4, loss_type="dapo", max_completion_length=None,
            importance_sampling_level="token", reduce=False, sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05, vllm_is_ratio=None, delta=None,
            use_bias_correction_kl=False, num_items_in_batch=None, vespo_k_pos=2.0,
            vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0):  # fmt: skip
    """Liger's GRPO loss in float64 with autograd (its gradients are the exact ones); LUSPO
    reduced by TRL's formula (``o_trl_luspo``), Liger's Triton reduction being defective
    under padding."""
    B, L = ids.shape
    m = torch.ones(B, L, dtype=torch.float64) if mask is None else mask.double()
    safe_ids = torch.where(m != 0, ids, 0)  # Liger never reads masked ids
    logp = torch.log_softmax(logits[:, :-1].double() / temperature, -1)
    logp = logp.gather(-1, safe_ids[..., None])[..., 0]
    old = logp.detach() if old is None else old.double()
    A = adv.double()[:, None]
    log_ratio = logp - old
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
    coef_1 = torch.exp(log_ratio)
    if loss_type == "cispo":
        coef_2 = torch.clamp(coef_1, max=eps_high).detach()
        loss = -coef_2 * A * logp
        clipped = (coef_1 > eps_high) & (A > 0)
    elif loss_type == "sapo":
        tau = torch.where(A > 0, sapo_temperature_pos, sapo_temperature_neg).double()
        loss = -torch.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau * A
        clipped = torch.zeros_like(coef_1, dtype=torch.bool)
    elif loss_type == "vespo":  # Liger's get_gamma_weights, then -phi A logp
        with torch.no_grad():
            seq = (torch.clamp(logp - old, -20.0, 20.0) * m).sum(-1, keepdim=True)
            if vllm_is_ratio is not None:
                v = vllm_is_ratio.double()
                v = v[:, None] if v.dim() == 1 else v
                log_v = torch.clamp(torch.log(v), math.log(1e-8), 20.0)
                seq = seq + log_v.sum(-1, keepdim=True)  # every position, unmasked
            log_w = torch.clamp(seq, math.log(1e-8), 20.0)
            nonneg = A >= 0
            k = torch.where(nonneg, vespo_k_pos, vespo_k_neg)
            lam = torch.where(nonneg, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
            phi = phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        loss = -phi * A * logp
        clipped = torch.zeros_like(loss, dtype=torch.bool)
        vllm_is_ratio = None  # folded into phi
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        clipped = ((coef_1 < 1 - eps_low) & (A < 0)) | ((coef_1 > 1 + eps_high) & (A > 0))
        c1 = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
        loss = -torch.minimum(c1 * A, coef_2 * A)
    policy = loss  # (B, 1) at sequence level
    loss = loss.expand(B, L)
    clipped = clipped.expand(B, L).double()
    if vllm_is_ratio is not None:
        w = vllm_is_ratio.double()
        w = w[:, None] if w.dim() == 1 else w
        loss, policy = loss * w, policy * w
    kl = None
    if beta != 0.0:
        neg = ref.double() - logp
        kl = torch.exp(neg) - neg - 1
        if use_bias_correction_kl:
            kl = kl * coef_1
        loss = loss + beta * kl
    if not reduce:
        return loss * m, None if kl is None else kl * m, clipped * m
    if loss_type == "luspo":
        red = o_trl_luspo(policy, None if kl is None else beta * kl, m)
    elif loss_type in ("grpo", "sapo"):
        red = ((loss * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        red = (loss * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        red = (loss * m).sum() / (B * (max_completion_length or L))
    else:
        n = m.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch))
        red = (loss * m).sum() / n.clamp(min=1)
    count = m.sum().clamp(min=1)
    metrics = [] if kl is None else [(kl.detach() * m).sum() / count]
    metrics.append((clipped * m).sum() / count)
    return red, metrics


def o_trl_luspo(policy, kl_term, m):
    """TRL's LUSPO reduction ``mean(L * n)`` (``n`` the row's token count), ``L`` the loss
    tensor as TRL builds it: ``(B, 1)`` when the policy term is per sequence and nothing
    token-shaped is added, else ``(B, L)``, the mean then running over every position. The
    token-shaped terms are zeroed at padding (where TRL adds whatever sits there: the
    documented departure; with an all-ones mask this is TRL's formula exactly)."""
    n = m.sum(-1, keepdim=True)
    if policy.shape[-1] == 1 and kl_term is None:
        return (policy * n).mean()
    per_seq = policy if policy.shape[-1] == 1 else 0.0
    tokens = 0.0 if policy.shape[-1] == 1 else policy * m
    if kl_term is not None:
        tokens = tokens + kl_term * m
    return ((per_seq + tokens) * n).expand(m.shape).mean()


# ----------------------------------------------------------------------------- inputs

B, L, V = 3, 5, 32


def make_case(seed=0, far=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L + 1, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, L), generator=g)
    with torch.no_grad():
        logp = torch.log_softmax(logits[:, :-1] / 0.9, -1).gather(-1, ids[..., None])[..., 0]
    old = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    if far:  # ratios far from 1
        old[0, 1] = logp[0, 1] - 3.0
        old[1, 0] = logp[1, 0] + 4.0
    ref = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.5
    adv = torch.tensor([0.8, -1.3, 0.0], dtype=torch.float64)  # positive, negative, zero
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 3:] = 0  # padding
    mask[2, 0] = 0
    ids[1, 4] = -100  # a padding id Liger never reads
    vllm = torch.rand(B, L, generator=g, dtype=torch.float64) + 0.5
    return logits, old, ref, ids, adv, mask, vllm


def run(kwargs, case=None, seed=1, float_mask=False):
    """The adapter and the oracle, both differentiated under one random upstream gradient."""
    logits, old, ref, ids, adv, mask, vllm = case or make_case()
    if float_mask:
        mask = mask.double()
    args = dict(old=old, ref=ref, ids=ids, adv=adv, mask=mask)
    kwargs = dict(kwargs)
    if kwargs.pop("with_vllm", False):
        kwargs["vllm_is_ratio"] = vllm
    if kwargs.pop("on_policy", False):
        args["old"] = None
    g = torch.Generator().manual_seed(seed)
    x = logits.clone().requires_grad_()
    y = logits.clone().requires_grad_()
    ours = triton_grpo_loss(x, args["old"], args["ref"], ids, adv, mask, **kwargs)
    theirs = o_liger(y, args["old"], args["ref"], ids, adv, mask, **kwargs)
    if kwargs.get("reduce", False):
        up = torch.randn((), generator=g, dtype=torch.float64)
        ours[0].backward(up.float())
        theirs[0].backward(up)
    else:
        up = torch.randn(B, L, generator=g, dtype=torch.float64)
        ours[0].backward(up.float())
        theirs[0].backward(up)
    return ours, theirs, x.grad, y.grad


FP32_OUT = 2e-7  # the outputs are fp32 (as Liger's), computed in fp64 and rounded once


def check_reduced(ours, theirs, grad, ref_grad):
    (loss, metrics), (ref_loss, ref_metrics) = ours, theirs
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_err(loss, ref_loss) <= FP32_OUT, (loss.item(), ref_loss.item())
    assert rel_err(grad, ref_grad) <= 1e-6, "gradient"  # the upstream scalar was fp32
    assert isinstance(metrics, list) and len(metrics) == len(ref_metrics)
    for got, want in zip(metrics, ref_metrics):
        assert got.dtype == torch.float32 and got.dim() == 0 and not got.requires_grad
        assert abs(got.item() - want.item()) <= 1e-6 * max(1.0, abs(want.item())), (got, want)
    assert (grad[:, -1] == 0).all()


def check_per_token(ours, theirs, grad, ref_grad):
    for got, want in zip(ours, theirs):
        if want is None:
            assert got is None
            continue
        assert got.dtype == torch.float32 and got.shape == (B, L)
        assert rel_err(got, want) <= FP32_OUT
    assert not ours[1 if ours[1] is not None else 2].requires_grad
    assert rel_err(grad, ref_grad) <= 1e-6
    assert (grad[:, -1] == 0).all()


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_reduced_against_the_oracle(loss_type):
    """Every loss type, reduced (the fused path): padding, negative / zero advantages, ratios
    far from 1, vLLM IS weights, the KL, the default temperature 0.9."""
    kwargs = dict(loss_type=loss_type, reduce=True, with_vllm=True, beta=0.04,
                  eps_high=5.0 if loss_type == "cispo" else 0.28)  # fmt: skip
    check_reduced(*run(kwargs))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_per_token_against_the_oracle(loss_type):
    """reduce=False (Liger's default): (per_token_loss, per_token_kl, is_clipped)."""
    check_per_token(*run(dict(loss_type=loss_type, with_vllm=True)))


@pytest.mark.parametrize("reduce", [True, False])
def test_sequence_level_delta_bias_corrected_kl(reduce):
    """GSPO (sequence ratio, exact gradient), delta, (B, 1) vLLM weights and the
    bias-corrected KL (exact at sequence level, as TRL and Liger 0.8.5)."""
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=2)
    kwargs = dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5,
                  use_bias_correction_kl=True, beta=0.1, reduce=reduce,
                  vllm_is_ratio=vllm[:, :1])  # fmt: skip
    check = check_reduced if reduce else check_per_token
    check(*run(kwargs, case=(logits, old, ref, ids, adv, mask, vllm)))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bias_corrected_kl_and_delta(level):
    """The bias-corrected KL's metric is the corrected per-token KL (k3 * r), token level."""
    kwargs = dict(loss_type="dapo", importance_sampling_level=level, delta=2.0, beta=0.2,
                  use_bias_correction_kl=True, reduce=True, temperature=1.3)  # fmt: skip
    check_reduced(*run(kwargs, seed=3))


@pytest.mark.parametrize("eps_high", [0.4, 1.0, 5.0])
@pytest.mark.parametrize("on_policy", [False, True])
def test_cispo_caps(eps_high, on_policy):
    """CISPO's absolute cap, below 1 (Liger's default 0.4: TRL's with epsilon_high unset),
    at 1 and above; on-policy (old_logp=None) too."""
    kwargs = dict(loss_type="cispo", eps_high=eps_high, reduce=True, on_policy=on_policy,
                  beta=0.05, use_bias_correction_kl=eps_high == 0.4)  # fmt: skip
    check_reduced(*run(kwargs, seed=4))
    if eps_high == 0.4:
        check_per_token(*run({**kwargs, "reduce": False}, seed=5))


def test_normalisers():
    """dapo's num_items_in_batch (a number or a tensor), dr_grpo's max_completion_length,
    bnpo and grpo with a float mask and an empty row."""
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=6)
    mask[2] = 0  # an empty sequence
    case = (logits, old, ref, ids, adv, mask, vllm)
    for kwargs in (
        dict(loss_type="dapo", num_items_in_batch=40),
        dict(loss_type="dapo", num_items_in_batch=torch.tensor(0.5)),  # clamped to 1
        dict(loss_type="dr_grpo", max_completion_length=16),
        dict(loss_type="bnpo"),
        dict(loss_type="grpo"),
        dict(loss_type="sapo", sapo_temperature_pos=0.7, sapo_temperature_neg=2.0),
    ):
        check_reduced(*run({**kwargs, "reduce": True, "beta": 0.0}, case=case, float_mask=True))


def test_no_mask_and_on_policy():
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=7)
    ids[1, 4] = 3
    case = (logits, old, ref, ids, adv, None, vllm)
    check_reduced(*run(dict(loss_type="grpo", reduce=True, on_policy=True), case=case))
    check_per_token(*run(dict(loss_type="sapo", on_policy=True, beta=0.0), case=case))


def test_inplace_is_a_no_op():
    """Liger's inplace=True writes the gradient over the logits; here they are left alone and
    both settings give the same result."""
    logits, old, ref, ids, adv, mask, _ = make_case(seed=8)
    grads = []
    for inplace in (True, False):
        x = logits.clone().requires_grad_()
        loss, _ = triton_grpo_loss(x, old, ref, ids, adv, mask, inplace=inplace, reduce=True)
        loss.backward()
        assert torch.equal(x.detach(), logits)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_fp32_and_bf16_logits():
    """fp32 logits (Liger's usual input) to fp32 accuracy; bf16 logits give a bf16 gradient."""
    logits, old, ref, ids, adv, mask, _ = make_case(seed=9)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = logits.to(dtype).requires_grad_()
        loss, metrics = triton_grpo_loss(x, old.float(), ref.float(), ids, adv.float(), mask,
                                         reduce=True)  # fmt: skip
        loss.backward()
        ref_loss, _ = o_liger(logits.to(dtype).double(), old, ref, ids, adv, mask, reduce=True)
        assert loss.dtype == torch.float32 and x.grad.dtype == dtype
        assert rel_err(loss, ref_loss) <= tol


# ----------------------------------------------------------------------------- contract


def test_signature_is_ligers():
    """Liger-Kernel 0.8.5's parameters, order and defaults."""
    expected = [
        ("logits", inspect.Parameter.empty), ("old_logp", inspect.Parameter.empty),
        ("ref_logp", inspect.Parameter.empty), ("completion_ids", inspect.Parameter.empty),
        ("advantages", inspect.Parameter.empty), ("completion_mask", None),
        ("temperature", 0.9), ("beta", 0.04), ("eps_low", 0.2), ("eps_high", 0.4),
        ("inplace", True), ("loss_type", "dapo"), ("max_completion_length", None),
        ("importance_sampling_level", "token"), ("reduce", False),
        ("sapo_temperature_pos", 1.0), ("sapo_temperature_neg", 1.05),
        ("vllm_is_ratio", None), ("delta", None), ("use_bias_correction_kl", False),
        ("num_items_in_batch", None), ("vespo_k_pos", 2.0), ("vespo_lambda_pos", 3.0),
        ("vespo_k_neg", 3.0), ("vespo_lambda_neg", 2.0),
    ]  # fmt: skip
    params = inspect.signature(triton_grpo_loss).parameters
    assert [(n, p.default) for n, p in params.items()] == expected


def test_errors():
    logits, old, ref, ids, adv, mask, _ = make_case(seed=10)
    call = lambda **kw: triton_grpo_loss(  # noqa: E731
        kw.pop("logits", logits), old, kw.pop("ref", ref), kw.pop("ids", ids),
        kw.pop("adv", adv), mask, **kw)  # fmt: skip
    with pytest.raises(
        ValueError, match=r"^loss_type='vespo' requires importance_sampling_level='token'\.$"
    ):
        call(loss_type="vespo", importance_sampling_level="sequence", delta=2.0)
    with pytest.raises(ValueError, match=r"delta .*loss_type='vespo'"):
        call(loss_type="vespo", delta=2.0)
    with pytest.raises(ValueError, match=r"Unknown loss_type 'ppo'\. Supported types: ") as e:
        call(loss_type="ppo")
    assert all(repr(t) in str(e.value) for t in LOSS_TYPES)
    for loss_type in ("cispo", "sapo"):
        with pytest.raises(ValueError, match=rf"delta .*loss_type='{loss_type}'"):
            call(loss_type=loss_type, delta=2.0)
        with pytest.raises(ValueError, match="Sequence-level importance sampling"):
            call(loss_type=loss_type, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="sapo_temperature_neg must be positive"):
        call(loss_type="sapo", sapo_temperature_neg=0.0)
    with pytest.raises(AssertionError, match="ref_logp"):
        call(ref=None)
    with pytest.raises(AssertionError, match="importance_sampling_level"):
        call(importance_sampling_level="sequence_token")
    with pytest.raises(AssertionError, match="must provide"):
        call(adv=None)
    with pytest.raises(ValueError, match=r"\(B, L \+ 1, V\)"):
        call(logits=logits[:, :-1])
    with pytest.raises(ValueError, match="advantages"):
        call(adv=adv[:, None].expand(B, L))
    with pytest.raises(ValueError, match="delta"):
        call(delta=1.2)  # not above 1 + eps_high
    with pytest.raises(ValueError, match="eps_high"):
        call(loss_type="cispo", eps_high=0.0)
    bad = ids.clone()
    bad[0, 0] = V
    with pytest.raises(ValueError, match="completion_ids"):
        call(ids=bad)
    triton_grpo_loss(logits, old, ref, ids, adv, mask)  # -100 at a masked token: never read


# ----------------------------------------------------------------------------- luspo, vespo


@pytest.mark.parametrize("level", ["sequence", "token"])
@pytest.mark.parametrize("reduce", [True, False])
def test_luspo(level, reduce):
    """LUSPO reduced by TRL's mean(L * n): padding, negative / zero advantages, far ratios;
    sequence level with no / (B, 1) / (B,) vLLM ratios and beta = 0 is TRL's (B, 1) loss,
    the rest (KL, token-level, a (B, L) ratio) TRL's mean over (B, L); delta too.
    reduce=False: Liger's per-token outputs (the GRPO ones)."""
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=40)
    case = (logits, old, ref, ids, adv, mask, vllm)
    check = check_reduced if reduce else check_per_token
    for extra in (
        dict(beta=0.0),
        dict(beta=0.0, vllm_is_ratio=vllm[:, :1]),
        dict(beta=0.0, vllm_is_ratio=vllm[:, 0], delta=1.5),
        dict(beta=0.07, with_vllm=True),
        dict(beta=0.07, use_bias_correction_kl=True, vllm_is_ratio=vllm[:, :1]),
    ):
        kwargs = dict(loss_type="luspo", importance_sampling_level=level, reduce=reduce, **extra)
        check(*run(kwargs, case=case))


def test_luspo_is_trls_formula_without_padding():
    """With an all-ones mask the adapter is TRL's formula as shipped (mean over (B, L) of
    L * n) and Liger's Triton forward ((1 / (B L)) sum_i n_i sum_t L m); gradient: TRL's
    -rho_i A_i / B per token at sequence level (Liger's Triton backward is 1 / L of it)."""
    logits, old, ref, ids, adv, _, vllm = make_case(seed=41)
    ids[1, 4] = 3
    mask = torch.ones(B, L, dtype=torch.long)
    for kwargs in (dict(beta=0.0), dict(beta=0.05, with_vllm=True)):
        for level in ("sequence", "token"):
            check_reduced(*run(dict(loss_type="luspo", reduce=True,
                                    importance_sampling_level=level, **kwargs),
                               case=(logits, old, ref, ids, adv, mask, vllm)))  # fmt: skip
    # the gradient w.r.t. the log-probs, through the logits: -rho A / B at an unclipped token
    from fused_rl import token_logprobs

    x = logits.clone().requires_grad_()
    loss, _ = triton_grpo_loss(x, old, None, ids, adv, mask, beta=0.0, loss_type="luspo",
                               importance_sampling_level="sequence", reduce=True, eps_low=10.0,
                               eps_high=10.0, temperature=1.0)  # fmt: skip
    loss.backward()
    y = logits.clone().requires_grad_()
    logp = token_logprobs(y[:, :-1], ids)
    rho = torch.exp((logp - old).detach().mean(-1))
    (logp * (-rho * adv / B)[:, None]).sum().backward()
    assert rel_err(x.grad, y.grad) <= 1e-6


@pytest.mark.parametrize("reduce", [True, False])
def test_vespo(reduce):
    """VESPO: phi from the clamped log-ratio sum with the vLLM ratio's logs folded in (every
    position of a (B, L) ratio, a (B, 1) / (B,) one once), -phi A logp, no vLLM factor on
    the loss, dapo's normaliser, clip_ratio 0; the KL (bias-corrected too); on-policy."""
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=42)
    case = (logits, old, ref, ids, adv, mask, vllm)
    check = check_reduced if reduce else check_per_token
    shapes = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=0.0)
    for extra in (
        dict(beta=0.0),
        dict(beta=0.04, with_vllm=True),
        dict(beta=0.1, use_bias_correction_kl=True, vllm_is_ratio=vllm[:, :1], **shapes),
        dict(beta=0.0, vllm_is_ratio=vllm[:, 0], num_items_in_batch=17),
        dict(beta=0.04, on_policy=True, with_vllm=True),
    ):
        check(*run(dict(loss_type="vespo", reduce=reduce, **extra), case=case))


def test_vespo_extremes():
    """Log-weights past VESPO's clamps (a far-off sequence, a zero vLLM ratio at a padding
    position: ln 0 floored at ln 1e-8, over every position as Liger), phi's NaN / inf as 0,
    and phi's gradient scale: -phi A per token."""
    logits, old, ref, ids, adv, mask, vllm = make_case(seed=43)
    old[0] = old[0] - 30.0  # S_0 > 20: w = e^20, phi ~ 0
    vllm = vllm.clone()
    vllm[1, 4] = 0.0  # padding position of row 1: counted in its log-sum, as Liger
    case = (logits, old, ref, ids, adv, mask, vllm)
    for reduce in (True, False):
        check = check_reduced if reduce else check_per_token
        check(*run(dict(loss_type="vespo", reduce=reduce, beta=0.0, with_vllm=True), case=case))


# ----------------------------------------------------------------------------- JSD losses
# liger_jsd / LigerJSD and liger_fused_linear_jsd / LigerFusedLinearJSD against a float64
# transcription of Liger-Kernel 0.8.5's ``_jsd_kernel`` (liger_kernel/ops/jsd.py) and
# ``fused_linear_jsd_forward`` (liger_kernel/ops/fused_linear_jsd.py): the elementwise loss on
# the log-probabilities X (student) and Y (teacher), differentiated with X as free coordinates
# (the kernel's dX), summed over the rows whose label is not ignore_index over their count;
# and, where ``liger_kernel`` imports (it runs on CPU through the Triton interpreter), against
# Liger itself.

import torch.nn.functional as F  # noqa: E402

import fused_rl  # noqa: E402
from fused_rl.compat.liger import (  # noqa: E402
    LigerFusedLinearJSD,
    LigerJSD,
    liger_fused_linear_jsd,
    liger_jsd,
)

JSD_BETAS = (0.0, 0.3, 0.5, 1.0)


def o_liger_jsd(x, y, labels=None, beta=0.5, ignore_index=-100):
    """Liger's JSD of ``(BT, V)`` log-probabilities as its kernel computes it: ``Q = e^X``,
    ``P = e^Y``; forward KL ``P (Y - X)`` at beta 0, reverse ``Q (X - Y)`` at 1, else
    ``beta P (Y - log M) + (1 - beta) Q (X - log M)``, ``M = beta P + (1 - beta) Q``;
    ``sum / n_non_ignore``."""
    q, p = x.exp(), y.exp()
    if beta == 0.0:
        terms = p * (y - x)
    elif beta == 1.0:
        terms = q * (x - y)
    else:
        log_m = (beta * p + (1 - beta) * q).log()
        terms = beta * p * (y - log_m) + (1 - beta) * q * (x - log_m)
    rows = terms.sum(-1)
    if labels is None:
        return rows.sum() / rows.shape[0]
    keep = labels != ignore_index
    return torch.where(keep, rows, 0.0).sum() / keep.sum()


def jsd_case(seed=0, n=6, vocab=19, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    t_logits = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1] = labels[4] = -100
    x = logits.log_softmax(-1).to(dtype)
    y = t_logits.log_softmax(-1).to(dtype)
    return logits, x, y, labels, g


def jsd_grad_tol(dtype):
    """fp32: 1e-5 (Liger's own fp32 tolerance); bf16: the bf16 rounding of the inputs' own
    log-probabilities and of the stored gradient."""
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", JSD_BETAS)
def test_liger_jsd_against_the_oracle(beta, dtype):
    """Values (input's dtype) and Liger's dX w.r.t. leaf log-probabilities, with and without
    labels, under a random upstream gradient; the module form gives the same."""
    _, x, y, labels, g = jsd_case(seed=int(beta * 10), dtype=dtype)
    up = torch.randn((), generator=g, dtype=torch.float64)
    for lab in (None, labels):
        leaf = x.clone().requires_grad_()
        loss = liger_jsd(leaf, y, lab, beta=beta)
        assert loss.dtype == dtype and loss.shape == ()
        (grad,) = torch.autograd.grad(loss, leaf, up.to(dtype))
        x64 = x.double().requires_grad_()
        want = o_liger_jsd(x64, y.double(), lab, beta)
        (want_grad,) = torch.autograd.grad(want, x64, up)
        assert rel_err(loss, want) <= (1e-6 if dtype == torch.float32 else 8e-3)
        assert grad.dtype == dtype and rel_err(grad, want_grad) <= jsd_grad_tol(dtype)
        if lab is not None:
            assert (grad[lab == -100] == 0).all()
        module = LigerJSD(beta=beta)(leaf, y, lab)
        torch.testing.assert_close(module, loss, rtol=0, atol=0)


@pytest.mark.parametrize("beta", JSD_BETAS)
def test_liger_jsd_through_log_softmax_is_distill_loss(beta):
    """From the logits (``input = log_softmax(logits)``, Liger's usage) the gradient is the
    oracle's through the log-softmax, and distill_loss's on the logits: Liger's free-
    coordinate dX and the softmax gradient agree there."""
    logits, _, y, labels, g = jsd_case(seed=20 + int(beta * 10))
    up = torch.randn((), generator=g, dtype=torch.float64)
    leaf = logits.float().requires_grad_()
    loss = liger_jsd(leaf.log_softmax(-1), y, labels, beta=beta)
    (grad,) = torch.autograd.grad(loss, leaf, up.float())
    z64 = logits.clone().requires_grad_()
    want = o_liger_jsd(z64.log_softmax(-1), y.double(), labels, beta)
    (want_grad,) = torch.autograd.grad(want, z64, up)
    assert rel_err(grad, want_grad) <= 1e-5
    z = logits.float().requires_grad_()
    distill, _ = fused_rl.distill_loss(z, y, beta=beta, targets=labels)
    (distill_grad,) = torch.autograd.grad(distill, z, up.float())
    assert rel_err(distill, want) <= 1e-6 and rel_err(distill_grad, want_grad) <= 1e-5


def test_liger_jsd_all_ignored_and_no_teacher_gradient():
    _, x, y, labels, _ = jsd_case(seed=30)
    leaf = x.clone().requires_grad_()
    teacher = y.clone().requires_grad_()
    loss = liger_jsd(leaf, teacher, torch.full_like(labels, -100), beta=0.4)
    loss.backward()
    assert loss.item() == 0.0 and (leaf.grad == 0).all() and teacher.grad is None
    loss = liger_jsd(leaf, teacher, labels, beta=0.4)  # a teacher requiring grad: ignored
    assert teacher.grad is None and loss.requires_grad


def o_liger_fused_linear_jsd(h, w, th, tw, labels=None, beta=0.5, ignore_index=-100,
                             temperature=1.0):  # fmt: skip
    """Liger's fused linear JSD in float64: each model's ``log_softmax(x W^T / T)``, the JSD
    above on them (autograd through the student's log-softmax)."""
    x = torch.log_softmax(F.linear(h, w) / temperature, -1)
    y = torch.log_softmax(F.linear(th, tw) / temperature, -1)
    return o_liger_jsd(x, y, labels, beta, ignore_index)


def fused_linear_case(seed=0, n=11, hdim=8, t_hdim=12, vocab=23, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).to(dtype)
    w = (torch.randn(vocab, hdim, generator=g) * 2 / hdim**0.5).to(dtype)
    th = torch.randn(n, t_hdim, generator=g).to(dtype)
    tw = (torch.randn(vocab, t_hdim, generator=g) * 2 / t_hdim**0.5).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[0] = labels[7] = -100
    return h, w, th, tw, labels, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", JSD_BETAS)
def test_liger_fused_linear_jsd_against_the_oracle(beta, dtype):
    """fp32 loss, gradients of student_input and student_weight in their dtype, a teacher of
    another width, labels, temperature; the module form gives the same."""
    h, w, th, tw, labels, g = fused_linear_case(seed=40 + int(beta * 10), dtype=dtype)
    up = torch.randn((), generator=g, dtype=torch.float64)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = liger_fused_linear_jsd(hl, wl, th, tw, labels, jsd_beta=beta, temperature=1.7)
    assert loss.dtype == torch.float32 and loss.shape == ()
    grads = torch.autograd.grad(loss, (hl, wl), up.float())
    leaves = [x.double().requires_grad_() for x in (h, w)]
    want = o_liger_fused_linear_jsd(*leaves, th.double(), tw.double(), labels, beta,
                                    temperature=1.7)  # fmt: skip
    want_grads = torch.autograd.grad(want, leaves, up)
    # bf16: the heads' logits are rounded to bf16 (Liger's path off CUDA)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(loss, want) <= tol
    for got, exp in zip(grads, want_grads):
        assert got.dtype == dtype and rel_err(got, exp) <= tol
    module = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.7)(hl, wl, th, tw, labels)
    torch.testing.assert_close(module, loss, rtol=0, atol=0)


def test_liger_fused_linear_jsd_no_labels_accum_dtype_and_teacher():
    """No labels (every row counts), accum_dtype accepted (fp32 accumulation whatever it
    is), a teacher requiring grad gets none."""
    h, w, th, tw, _, _ = fused_linear_case(seed=50)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    tl_ = th.clone().requires_grad_()
    loss = liger_fused_linear_jsd(hl, wl, tl_, tw, accum_dtype=torch.float32)
    loss.backward()
    assert tl_.grad is None
    leaves = [x.double().requires_grad_() for x in (h, w)]
    want = o_liger_fused_linear_jsd(*leaves, th.double(), tw.double())
    want.backward()
    assert rel_err(loss, want) <= 1e-5
    assert rel_err(hl.grad, leaves[0].grad) <= 1e-5 and rel_err(wl.grad, leaves[1].grad) <= 1e-5


def test_jsd_signatures_are_ligers():
    """Liger-Kernel 0.8.5's parameters, order and defaults."""
    E = inspect.Parameter.empty

    def sig(fn):
        return [(n, p.default) for n, p in inspect.signature(fn).parameters.items()]

    assert sig(liger_jsd) == [("input", E), ("target", E), ("shift_labels", None),
                              ("beta", 0.5), ("ignore_index", -100)]  # fmt: skip
    assert sig(LigerJSD.__init__)[1:] == [("beta", 0.5), ("ignore_index", -100)]
    assert sig(LigerJSD.forward)[1:] == [("log_q", E), ("log_p", E), ("shift_labels", None)]
    assert sig(liger_fused_linear_jsd) == [
        ("student_input", E), ("student_weight", E), ("teacher_input", E),
        ("teacher_weight", E), ("shift_labels", None), ("jsd_beta", 0.5),
        ("ignore_index", -100), ("temperature", 1.0), ("accum_dtype", None),
    ]  # fmt: skip
    assert sig(LigerFusedLinearJSD.__init__)[1:] == [
        ("jsd_beta", 0.5), ("ignore_index", -100), ("temperature", 1.0), ("accum_dtype", None),
    ]  # fmt: skip
    assert sig(LigerFusedLinearJSD.forward)[1:] == [
        ("student_input", E), ("student_weight", E), ("teacher_input", E),
        ("teacher_weight", E), ("shift_labels", E),
    ]  # fmt: skip


def test_jsd_errors():
    _, x, y, labels, _ = jsd_case(seed=60)
    with pytest.raises(AssertionError, match=r"the shape of shift_labels must be \(BT,\)"):
        liger_jsd(x, y, labels[:-1])
    with pytest.raises(ValueError, match=r"\binput must be \(BT, V\)"):
        liger_jsd(x[None], y[None])
    with pytest.raises(ValueError, match=r"\btarget must have input's shape"):
        liger_jsd(x, y[:, :-1])
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        liger_jsd(x, y, beta=1.5)
    h, w, th, tw, labels, _ = fused_linear_case(seed=61)
    with pytest.raises(AssertionError, match="temperature cannot be 0"):
        LigerFusedLinearJSD(temperature=0)
    with pytest.raises(ValueError, match=r"\btemperature\b"):
        liger_fused_linear_jsd(h, w, th, tw, temperature=-1.0)
    with pytest.raises(AssertionError, match=r"shift_labels"):
        liger_fused_linear_jsd(h, w, th, tw, labels[:-1])
    with pytest.raises(ValueError, match=r"teacher_weight.*V = 23.*V = 22"):
        liger_fused_linear_jsd(h, w, th, tw[:-1])
    with pytest.raises(ValueError, match=r"teacher_input must have student_input's BT"):
        liger_fused_linear_jsd(h, w, th[:-1], tw)
    with pytest.raises(ValueError, match=r"\bstudent_input must be \(BT, H\)"):
        liger_fused_linear_jsd(h[None], w, th, tw)
    with pytest.raises(ValueError, match=r"\bteacher_weight must be \(V, H'\)"):
        liger_fused_linear_jsd(h, w, th, tw[:, :-1])
    with pytest.raises(TypeError, match=r"\baccum_dtype\b"):
        liger_fused_linear_jsd(h, w, th, tw, accum_dtype="fp32")


def _liger():
    """Liger-Kernel's functional module, or a skip (it is not a dependency)."""
    return pytest.importorskip("liger_kernel.transformers.functional")


def _quiet(fn, *args):
    """Liger's launches under the Triton interpreter, its NumPy warnings on masked lanes
    silenced (fused_rl's own launches do that themselves)."""
    import warnings

    import numpy

    with numpy.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args)


@pytest.mark.no_poison
@pytest.mark.parametrize("beta", JSD_BETAS)
def test_liger_jsd_against_liger(beta):
    """The adapters against Liger-Kernel itself (skipped where it is not installed): values
    and gradients, with and without labels, fp32."""
    lf = _liger()
    _, x, y, labels, g = jsd_case(seed=70 + int(beta * 10))
    up = torch.randn((), generator=g).to(DEVICE)
    x, y, labels = x.to(DEVICE), y.to(DEVICE), labels.to(DEVICE)  # Liger's kernels: CUDA
    for lab in (None, labels):
        ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        a = liger_jsd(ours, y, lab, beta)
        b = _quiet(lf.liger_jsd, theirs, y, lab, beta)
        _quiet(torch.autograd.backward, [a, b], [up, up])
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-5
        assert rel_err(ours.grad, theirs.grad) <= 1e-5
    h, w, th, tw, labels, _ = fused_linear_case(seed=71 + int(beta * 10))
    h, w, th, tw, labels = (x.to(DEVICE) for x in (h, w, th, tw, labels))
    for lab in (None, labels):
        hs = [h.clone().requires_grad_() for _ in range(2)]
        ws = [w.clone().requires_grad_() for _ in range(2)]
        a = liger_fused_linear_jsd(hs[0], ws[0], th, tw, lab, beta, -100, 1.3)
        b = _quiet(lf.liger_fused_linear_jsd, hs[1], ws[1], th, tw, lab, beta, -100, 1.3)
        _quiet(torch.autograd.backward, [a, b], [up, up])
        assert a.dtype == b.dtype and rel_err(a, b) <= 1e-5
        assert rel_err(hs[0].grad, hs[1].grad) <= 1e-5
        assert rel_err(ws[0].grad, ws[1].grad) <= 1e-5
