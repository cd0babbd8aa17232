"""fused_rl.integrations.verl against the installed verl (>= 0.9; skipped without it).

verl 0.9's actor step is: the FSDP engine's ``forward_step`` calls the model, whose forward
``apply_monkey_patch(..., use_fused_kernels=True)`` replaced (log-probs and entropy from the
hidden states through ``FusedLinearForPPO`` or the Triton ``linear_cross_entropy``), then
``verl.workers.utils.losses.ppo_loss`` (the registered policy loss, ``agg_loss``, the entropy
and KL terms). The engine itself cannot run on a CPU: it is registered for ``cuda`` / ``npu``
devices only and packs sequences for flash-attention's varlen kernels. So the step is run
here from the deepest verl functions that can: verl's own patched model forward on a tiny
Qwen2 (padded, not packed: the same head math), the valid tokens gathered as the engine's
``no_padding`` layout, and verl's ``ppo_loss`` on them; once as released and once after
``fused_rl.integrations.verl.patch()``. The loss, every metric and every parameter gradient
agree, fused_rl's linear op ran on every forward, verl's own head never did.
"""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import FP32_TOL, rel_err

import fused_rl.integrations.verl as fused_verl
import fused_rl.linear as fused_linear


def _verl_ok() -> bool:
    try:
        import verl
        import verl.workers.utils.losses  # noqa: F401  (the actor's loss module imports)
        from packaging.version import Version
    except ImportError:
        return False
    return Version(verl.__version__).release[:2] >= (0, 9)


needs_verl = pytest.mark.skipif(not _verl_ok(), reason="needs verl >= 0.9 (and its loss module)")

VOCAB, PROMPT, RESPONSE, BATCH = 131, 4, 6, 4


def test_clear_error_without_verl(monkeypatch):
    """Runs everywhere: without verl the module imports, and patching names the install."""
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ImportError, match=r"pip install 'verl>=0.9'"):
        fused_verl.patch()
    assert not fused_verl.is_patched() and fused_verl.routes() == []


@needs_verl
def test_patch_unpatch_restore_exactly():
    import importlib

    from verl.trainer.ppo import core_algos

    import fused_rl.compat.verl as compat

    before = {(m, a): getattr(importlib.import_module(m), a)
              for m, a, _, optional in fused_verl.ROUTES if not optional}  # fmt: skip
    registry = dict(core_algos.POLICY_LOSS_REGISTRY)
    with fused_verl.patched():
        assert fused_verl.is_patched()
        for (module, attribute), _ in before.items():
            ours = next(o for m, a, o, _ in fused_verl.ROUTES if (m, a) == (module, attribute))
            assert getattr(importlib.import_module(module), attribute) is getattr(compat, ours)
        for name, fn in core_algos.POLICY_LOSS_REGISTRY.items():
            want = compat.POLICY_LOSS_REGISTRY.get(name, registry[name])  # bypass_mode: verl's
            assert fn is want, name
        assert core_algos.get_policy_loss_fn("vanilla") is compat.POLICY_LOSS_REGISTRY["vanilla"]
        routed = fused_verl.routes()
        fused_verl.patch()  # idempotent
        assert fused_verl.routes() == routed
        assert "POLICY_LOSS_REGISTRY['bypass_mode']" not in routed
    assert not fused_verl.is_patched()
    for (module, attribute), original in before.items():
        assert getattr(importlib.import_module(module), attribute) is original
    assert core_algos.POLICY_LOSS_REGISTRY == registry


@needs_verl
def test_topk_distillation_runs_fused_rl_inside_verl():
    """verl's logits processor for ``loss_mode="forward_kl_topk"`` (``compute_topk_loss``,
    FSDP strategy) looks ``compute_forward_kl_topk`` up in its module at each call: patched,
    it runs fused_rl's, with verl's outputs and the student's gradient (nested teacher
    tensors as verl's batch holds them)."""
    from types import SimpleNamespace

    distill = pytest.importorskip("verl.trainer.distillation.losses")
    fsdp_losses = pytest.importorskip("verl.trainer.distillation.fsdp.losses")
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    import fused_rl.compat.verl as compat

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 9, VOCAB, generator=gen) * 2
    teacher = torch.log_softmax(torch.randn(9, VOCAB, generator=gen) * 2, -1).topk(8, -1)
    offsets = torch.tensor([0, 4, 9])
    pairs = (("teacher_logprobs", teacher.values), ("teacher_ids", teacher.indices))
    data = {name: torch.nested.nested_tensor_from_jagged(t, offsets=offsets)
            for name, t in pairs}  # fmt: skip
    config = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=8, log_prob_min_clamp=-10.0))  # fmt: skip
    actor = SimpleNamespace(strategy="fsdp")
    up = torch.randn(1, 9, generator=gen)

    def run():
        leaf = logits.clone().requires_grad_()
        out = distill.compute_topk_loss(actor, config, data, leaf, "thd")
        out["distillation_losses"].backward(up)
        return out, leaf.grad

    want, want_grad = run()
    with fused_verl.patched():
        assert fsdp_losses.compute_forward_kl_topk is compat.compute_forward_kl_topk
        assert "verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk" in (
            fused_verl.routes()
        )
        got, grad = run()
    assert fsdp_losses.compute_forward_kl_topk is not compat.compute_forward_kl_topk
    for name in want:
        assert got[name].dtype == want[name].dtype
        assert rel_err(got[name].float(), want[name].float()) <= FP32_TOL, name
    assert rel_err(grad, want_grad) <= FP32_TOL


# ----------------------------------------------------------------------------- the actor step


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def _batch(seed=0):
    """A left-right padded micro-batch as verl's trainer holds it: full prompts, responses of
    4 lengths (one of a single token), advantages of both signs, old and reference log-probs
    near the model's, rollout IS weights."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)
    responses = torch.randint(0, VOCAB, (BATCH, RESPONSE), generator=gen)
    lengths = torch.tensor([RESPONSE, 3, 1, 5])
    response_mask = (torch.arange(RESPONSE)[None] < lengths[:, None]).long()
    attention = torch.cat([torch.ones_like(prompts), response_mask], 1)
    noise = lambda scale: scale * torch.randn(BATCH, RESPONSE, generator=gen)  # noqa: E731
    return {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "attention_mask": attention, "input_ids": torch.cat([prompts, responses], 1),
        "advantages": torch.randn(BATCH, 1, generator=gen).expand(BATCH, RESPONSE).clone(),
        "old_noise": noise(0.2), "ref_noise": noise(0.1),
        "rollout_is_weights": (1.0 + noise(0.1)).clamp(min=0.5),
    }  # fmt: skip


def _config(loss_mode, loss_agg_mode, use_kl_loss, entropy_coeff):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig

    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2, clip_ratio_low=0.1,
        clip_ratio_high=0.15, loss_agg_mode=loss_agg_mode, use_kl_loss=use_kl_loss,
        kl_loss_coef=0.05, kl_loss_type="low_var_kl", entropy_coeff=entropy_coeff,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
    )  # fmt: skip


def _actor_step(model, batch, config, backend, with_is):
    """verl's patched model forward, the engine's no-padding layout, verl's ``ppo_loss``,
    backward: the loss, the metrics and the parameter gradients."""
    from tensordict import TensorDict
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                       fused_kernels_backend=backend)  # fmt: skip
    model.zero_grad()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                temperature=0.9, return_dict=True)  # fmt: skip
    valid = batch["attention_mask"].bool()
    # the Triton head returns (B * S,): the engine's packed (1, N) layout, flattened
    log_probs, entropy = (x.reshape(valid.shape) for x in (out.log_probs, out.entropy))
    model_output = {"log_probs": log_probs[valid], "entropy": entropy[valid]}
    with torch.no_grad():  # old and reference log-probs near the model's own
        response_logp = log_probs[:, PROMPT - 1 : -1].detach()
    fields = {
        "prompts": batch["prompts"], "responses": batch["responses"],
        "attention_mask": batch["attention_mask"], "response_mask": batch["response_mask"],
        "advantages": batch["advantages"], "old_log_probs": response_logp + batch["old_noise"],
        "ref_log_prob": response_logp + batch["ref_noise"],
    }  # fmt: skip
    if with_is:
        fields["rollout_is_weights"] = batch["rollout_is_weights"]
    data = TensorDict(fields, batch_size=[BATCH])
    tokens = int(batch["response_mask"].sum())
    for key, value in (("dp_size", 1), ("batch_num_tokens", tokens), ("global_batch_size", BATCH)):
        tu.assign_non_tensor_data(data, key, value)  # as verl's trainer sets them
    loss, metrics = ppo_loss(config, model_output, data)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    values = {}
    for key, metric in metrics.items():
        raw = getattr(metric, "values", [metric])
        values[key] = [float(v) for v in raw]
    return loss.detach(), values, grads


STEP_CASES = [
    ("vanilla", "token-mean", True, 0.01, "torch", True),
    ("vanilla", "seq-mean-token-mean", False, 0.0, "liger", False),
    ("gspo", "seq-mean-token-mean", True, 0.0, "torch", True),
    ("sapo", "seq-mean-token-mean", False, 0.02, "torch", False),
    ("cispo", "token-mean", False, 0.0, "triton", True),
    ("gpg", "seq-mean-token-sum", True, 0.0, "torch", False),
    ("geo_mean", "seq-mean-token-mean", False, 0.0, "torch", False),
    ("dppo_tv", "token-mean", False, 0.0, "torch", True),
]


@needs_verl
@pytest.mark.parametrize(("loss_mode", "agg", "use_kl_loss", "entropy_coeff", "backend", "with_is"),
                         STEP_CASES, ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in STEP_CASES])  # fmt: skip
def test_actor_step_matches_verl(monkeypatch, loss_mode, agg, use_kl_loss, entropy_coeff,
                                 backend, with_is):  # fmt: skip
    """verl's actor step as released (its torch-backend head; the Triton head needs CUDA,
    so that backend's reference is the same math through the torch one) against the step
    after ``patch()``: loss, metrics and gradients agree; fused_rl's linear op ran."""
    from transformers import Qwen2ForCausalLM
    from verl.utils.experimental import torch_functional as verl_tf

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", Qwen2ForCausalLM.forward)  # restored after
    batch = _batch()
    config = _config(loss_mode, agg, use_kl_loss, entropy_coeff)
    want = _actor_step(_tiny_model(), batch, config, "torch", with_is)

    calls = []
    fused_apply = fused_linear._LinearTokenStats.apply

    def counted(*args):
        calls.append(next(a for a in args if a in ("triton", "reference")))
        return fused_apply(*args)

    def verl_head(*args, **kwargs):
        raise AssertionError("verl's FusedLinearForPPO ran after patch()")

    monkeypatch.setattr(fused_linear._LinearTokenStats, "apply", counted)
    monkeypatch.setattr(verl_tf.FusedLinearForPPO, "forward", verl_head)  # verl's own class
    with fused_verl.patched():
        got = _actor_step(_tiny_model(), batch, config, backend, with_is)
    assert len(calls) == 1  # the one training forward
    (want_loss, want_metrics, want_grads), (got_loss, got_metrics, got_grads) = want, got
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-5)
    assert sorted(got_metrics) == sorted(want_metrics)
    for key, values in want_metrics.items():
        torch.testing.assert_close(torch.tensor(got_metrics[key]), torch.tensor(values),
                                   atol=1e-6, rtol=1e-5, msg=key)  # fmt: skip
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4, msg=key)
