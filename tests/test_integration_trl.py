"""fused_rl.integrations.trl against the installed TRL (>= 1.15; skipped without it).

The integration is proven by training: a tiny Qwen2 model built from a config, a word-level
tokenizer built in code, an in-memory prompt dataset and a simple reward, trained for 3
optimizer steps (``num_iterations=2``, so the second pass over each generation is
off-policy) by ``trl.GRPOTrainer`` and by the integrated trainer from the same seed and
weights. Every logged metric must agree per step (1e-5 absolute + 1e-4 relative in fp32)
and so must the final parameters; TRL's chunked head must never run in the integrated
trainer, fused_rl's linear op on every fused forward. Cheaper tests check the head alone
against TRL's head (values and gradients), the errors raised at construction, and
``patch()`` / ``unpatch()``.
"""

from __future__ import annotations

import copy
import math
import sys
import time

import pytest
import torch

import fused_rl.integrations.trl as fused_trl
import fused_rl.linear as fused_linear


def trl_at_least(major: int, minor: int) -> bool:
    """Whether TRL is installed at ``major.minor`` or later."""
    try:
        import trl
        from packaging.version import Version
    except ImportError:
        return False
    return Version(trl.__version__).release[:2] >= (major, minor)


needs_trl = pytest.mark.skipif(not trl_at_least(1, 15), reason="needs TRL >= 1.15")

VOCAB = 509
EOS = 1
ATOL, RTOL = 1e-5, 1e-4  # every logged metric, fp32
PARAM_ATOL = 1e-5
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def test_clear_error_without_trl(monkeypatch):
    """Runs everywhere: without TRL the module imports, and using it names the install."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    monkeypatch.delitem(vars(fused_trl), "GRPOTrainer", raising=False)  # built by a test before
    with pytest.raises(ImportError, match=r"pip install 'trl>=1.15'"):
        fused_trl.GRPOTrainer  # noqa: B018
    with pytest.raises(ImportError, match=r"pip install 'trl>=1.15'"):
        fused_trl.patch()
    with pytest.raises(AttributeError):
        fused_trl.NoSuchName  # noqa: B018


def test_kept_gathers_a_freed_head_again(monkeypatch):
    """Runs everywhere: the reference's head after its forward (``HeadInputs.kept``). Kept
    as it is while its storage is there; freed (FSDP2 resizes it to 0 bytes), gathered again
    from the DTensor at rest (``gather_param``; here a stand-in: a DTensor needs a process
    group, which tests/test_integration_trl_fsdp.py has), in the dtype the forward used;
    freed with no DTensor to gather from, a ``RuntimeError`` naming FSDP2."""
    used = torch.randn(5, 3, dtype=torch.bfloat16)
    whole = torch.randn(5, 3)

    class AtRest:  # stands in for a DTensor parameter
        pass

    monkeypatch.setattr(fused_trl, "is_dtensor", lambda p: isinstance(p, AtRest))
    monkeypatch.setattr(fused_trl, "gather_param", lambda p: whole)

    assert fused_trl._kept(None, AtRest()) is None
    assert fused_trl._kept(used, AtRest()) is used and not fused_trl.freed(used)
    empty = torch.empty(0, 3)
    assert fused_trl._kept(empty, AtRest()) is empty  # nothing to free: kept
    used.untyped_storage().resize_(0)
    assert fused_trl.freed(used)
    again = fused_trl._kept(used, AtRest())
    assert again.dtype == torch.bfloat16 and torch.equal(again, whole.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="FSDP2"):
        fused_trl._kept(used, torch.nn.Parameter(torch.randn(5, 3)))


# ----------------------------------------------------------------------------- the setup


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": EOS, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _tiny_config(**extra):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=EOS,
        bos_token_id=EOS, tie_word_embeddings=False, **extra,
    )  # fmt: skip


def _tiny_model(seed=0, **extra):
    """A random tiny Qwen2 whose completions end early often enough to be padded: one
    embedding dimension is a large constant, so the final hidden states share a direction,
    along which the EOS row of the head points."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_tiny_config(**extra))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[EOS, 0] = 0.6
    return model


def _tiny_moe(router_logits=True):
    """A tiny Qwen2-MoE with the load-balancing loss on (``router_logits``: in every
    forward; else only where the trainer asks for it)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(6)
    config = Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
        eos_token_id=EOS, bos_token_id=EOS, output_router_logits=router_logits,
        router_aux_loss_coef=0.02, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(config)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The policy's weights and tokenizer on disk: TRL builds the reference model from the
    policy's path."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    _tiny_model().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _dataset():
    from datasets import Dataset

    prompts = [" ".join(f"w{(7 * i + j) % 300}" for j in range(3 + i % 3)) for i in range(8)]
    return Dataset.from_dict({"prompt": prompts})


def reward_w5(completions, **kwargs):
    """The fraction of ``w5`` words, plus a little for length."""
    return [c.split().count("w5") / max(1, len(c.split())) + 0.01 * len(c) for c in completions]


class Calls:
    """Counts TRL's chunked head and fused_rl's linear op (with the backend it ran)."""

    def __init__(self, monkeypatch):
        import trl.trainer.utils as trl_utils

        self.trl = 0
        self.fused: list[str] = []
        trl_apply = trl_utils._ChunkedLogProbFunction.apply
        fused_apply = fused_linear._LinearTokenStats.apply

        def counted_trl(*args):
            self.trl += 1
            return trl_apply(*args)

        def counted_fused(*args):
            # the backend it ran: its `which` argument, "triton" or "reference"
            self.fused.append(next(a for a in args if a in ("triton", "reference")))
            return fused_apply(*args)

        monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counted_trl)
        monkeypatch.setattr(fused_linear._LinearTokenStats, "apply", counted_fused)


def _config(out_dir, *, beta, accumulation, config="GRPOConfig", **extra):
    """``trl.GRPOConfig`` (or the ``config`` class named) for 3 optimizer steps on CPU."""
    import trl

    return getattr(trl, config)(
        output_dir=out_dir, max_steps=STEPS, num_generations=2, per_device_train_batch_size=4,
        max_completion_length=8, num_iterations=2, gradient_accumulation_steps=accumulation,
        beta=beta, learning_rate=LR, report_to=[], use_cpu=True, seed=0, logging_steps=1,
        save_strategy="no", disable_tqdm=True, **{"bf16": False, **extra},
    )  # fmt: skip


def _train(trainer_cls, model_dir, tmp_path, monkeypatch, case, **trainer_kwargs):
    """Train one trainer; its log history, final parameters, call counts and seconds."""
    with monkeypatch.context() as patch_ctx:
        calls = Calls(patch_ctx)
        config = trainer_cls.__name__.replace("Trainer", "Config")  # GRPOConfig, RLOOConfig
        args = _config(str(tmp_path / "out"), config=config, **case)
        trainer = trainer_cls(
            model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
            processing_class=_tokenizer(), **trainer_kwargs,
        )  # fmt: skip
        return trained(trainer, calls)


def trained(trainer, calls):
    """``trainer.train()``; its log history, final parameters, ``calls`` and seconds."""
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    params = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return trainer.state.log_history, params, calls, seconds


_BASELINES: dict = {}


def _baseline(model_dir, tmp_path_factory, monkeypatch, case, name="GRPOTrainer"):
    """TRL's own trainer ``name``'s run of ``case`` (once per case in this module)."""
    import trl

    key = (name, *sorted((k, str(v)) for k, v in case.items()))
    if key not in _BASELINES:
        assert not fused_trl.is_patched()
        path = tmp_path_factory.mktemp("baseline")
        _BASELINES[key] = _train(getattr(trl, name), model_dir, path, monkeypatch, case)
    return _BASELINES[key]


def compare_logs(want, got, atol=ATOL, rtol=RTOL, timing=TIMING_KEYS.__contains__):
    """Every logged value per step: equal keys, numbers within ``atol + rtol |want|``
    (``timing(key)``: a wall-clock value, not compared). Returns the worst absolute and
    relative difference of each metric."""
    assert len(want) == len(got)
    worst: dict[str, tuple[float, float]] = {}
    for step, (a, b) in enumerate(zip(want, got)):
        assert sorted(a) == sorted(b), f"step {step}: logged keys differ"
        for key, x in a.items():
            if timing(key):
                continue
            y = b[key]
            if not isinstance(x, (int, float)):
                assert x == y, (step, key)
                continue
            diff = abs(x - y)
            assert diff <= atol + rtol * abs(x), f"step {step} {key}: TRL {x}, fused_rl {y}"
            rel = diff / abs(x) if x else (0.0 if diff == 0 else float("inf"))
            prev = worst.get(key, (0.0, 0.0))
            worst[key] = (max(prev[0], diff), max(prev[1], rel))
    return worst


def compare_params(want, got, atol=PARAM_ATOL, rtol=0.0):
    worst = 0.0
    for name, w in want.items():
        diff = (got[name].float() - w.float()).abs()
        bound = atol + rtol * w.float().abs()
        assert (diff <= bound).all(), f"{name}: max diff {diff.max().item():.3g}"
        worst = max(worst, diff.max().item())
    return worst


# the runs' optimizer: 3 AdamW steps of this learning rate (``_config``; the distillation
# runs' too)
LR, STEPS = 1e-3, 3


def compare_adam_params(want, got, atol=PARAM_ATOL, rtol=0.0, stray=1e-4):
    """:func:`compare_params` for runs whose gradients differ by more than fp32's rounding
    of one sum (bf16 weights, a ratio of summed log-probs): all but ``stray`` of the weights
    (over every tensor) within ``atol + rtol |w|``, and every one within ``2 LR STEPS``, the
    most two runs' AdamW updates can differ by. Adam's step ``lr m / (sqrt(v) + eps)`` is not
    smooth in the gradient where that is of the order of ``eps`` or turns sign between
    steps: there gradients a rounding apart move a weight by different fractions of ``lr``
    (the live check of 2026-11-29: 2 of the distillation's 139,456 bf16 weights 10
    roundings apart, 1.5e-4; a GRPO bf16 projection weight 1.2e-4 off; an fp32 RLOO head
    weight 2.2e-5). Returns the largest difference."""
    worst, far, total = 0.0, 0, 0
    for name, w in want.items():
        diff = (got[name].float() - w.float()).abs()
        far += int((diff > atol + rtol * w.float().abs()).sum())
        total += w.numel()
        assert (diff <= 2 * LR * STEPS).all(), f"{name}: max diff {diff.max().item():.3g}"
        worst = max(worst, diff.max().item())
    assert far <= stray * total, f"{far} of {total} parameters beyond the tolerance"
    return worst


def _report(name, worst, param_diff, calls, seconds):
    """One line per case (pytest -s shows them): the worst differences per metric."""
    parts = [f"{k} {a:.2g}/{r:.2g}" for k, (a, r) in sorted(worst.items()) if a]
    print(
        f"\n[{name}] {seconds:.1f}s, fused_rl calls {len(calls.fused)} "
        f"({sorted(set(calls.fused))}), TRL head calls {calls.trl}; params max |diff| "
        f"{param_diff:.2g}; metrics max abs/rel (nonzero only): {', '.join(parts) or 'none'}"
    )


# ----------------------------------------------------------------------------- training

FULL = dict(beta=0.04, accumulation=2)
CASES = [
    pytest.param(dict(loss_type="grpo", **FULL), "subclass", "auto", id="grpo"),
    pytest.param(dict(loss_type="dapo", **FULL), "subclass", "auto", id="dapo"),
    pytest.param(dict(loss_type="dr_grpo", **FULL), "subclass", "auto", id="dr_grpo"),
    pytest.param(dict(loss_type="bnpo", **FULL), "patch", "auto", id="bnpo-patch"),
    pytest.param(
        dict(loss_type="grpo", beta=0.0, accumulation=1),
        "patch",
        "reference",
        id="grpo-beta0-accum1-patch-reference",
    ),  # fmt: skip
]


@needs_trl
@pytest.mark.parametrize("case, how, backend", CASES)
def test_training_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, case, how,
                              backend):  # fmt: skip
    want_log, want_params, want_calls, want_s = _baseline(
        model_dir, tmp_path_factory, monkeypatch, case
    )
    train = lambda cls, **kw: _train(cls, model_dir, tmp_path, monkeypatch, case, **kw)  # noqa: E731
    got = run_integrated(train, "GRPOTrainer", how, backend, want_calls)
    check_against_trl(got, want_log, want_params, f"{case} {how} {backend}; TRL {want_s:.1f}s")


def run_integrated(train, name: str, how: str, backend: str, want_calls):
    """``train(trainer_class, **kwargs)`` with fused_rl's trainer ``name``: the subclass
    (``how="subclass"``) or TRL's own under ``patched()``. Checks that TRL's kernel never
    ran and fused_rl's op ran every time TRL's ran in its own run, with ``backend``."""
    import trl

    assert want_calls.trl > 0 and want_calls.fused == []
    if how == "subclass":
        got = train(getattr(fused_trl, name), fused_rl_backend=backend)
    else:
        with fused_trl.patched(backend=backend):
            # TRL's own class (the experimental ones are not exported by ``trl``)
            module = trl if hasattr(trl, name) else fused_trl._trainer_module(name)
            got = train(getattr(module, name))
        assert not fused_trl.is_patched()
    calls = got[2]
    assert calls.trl == 0, "TRL's kernel ran in the integrated trainer"
    assert len(calls.fused) == want_calls.trl  # every call TRL made went to fused_rl
    expected = "reference" if backend == "reference" else fused_trl_auto_backend()
    assert set(calls.fused) == {expected}
    return got


def check_against_trl(got, want_log, want_params, name: str, **compare) -> None:
    """Every logged metric and the final parameters against TRL's run; one report line."""
    got_log, got_params, calls, seconds = got
    worst = compare_logs(want_log, got_log, **compare)
    _report(name, worst, compare_params(want_params, got_params), calls, seconds)


def fused_trl_auto_backend() -> str:
    from fused_rl._backend import resolve_backend

    return resolve_backend("auto", torch.empty(0))


@needs_trl
def test_training_bf16_cast_lm_head_to_fp32(model_dir, tmp_path, tmp_path_factory,
                                            monkeypatch):  # fmt: skip
    """A bf16 model with ``cast_lm_head_to_fp32=True``: fused_rl's head gets the hidden
    states in fp32 like TRL's. The backbone runs in bf16, so parameters are compared to
    one bf16 rounding (:func:`compare_adam_params`)."""
    case = dict(loss_type="grpo", beta=0.04, accumulation=2, cast_lm_head_to_fp32=True,
                model_init_kwargs={"dtype": "bfloat16"})  # fmt: skip
    want_log, want_params, want_calls, _ = _baseline(model_dir, tmp_path_factory, monkeypatch, case)
    got_log, got_params, calls, seconds = _train(
        fused_trl.GRPOTrainer, model_dir, tmp_path, monkeypatch, case
    )
    assert calls.trl == 0 and len(calls.fused) == want_calls.trl
    worst = compare_logs(want_log, got_log)
    param_diff = compare_adam_params(want_params, got_params, rtol=2.0**-8)
    _report("bf16 model, cast_lm_head_to_fp32", worst, param_diff, calls, seconds)


# ----------------------------------------------------------------------------- RLOO

RLOO_CASES = [
    pytest.param(dict(beta=0.04, accumulation=2), "subclass", "auto", id="rloo"),
    pytest.param(  # a narrow band, so the off-policy pass clips; advantages normalised
        dict(beta=0.0, accumulation=1, epsilon=1e-3, normalize_advantages=True),
        "patch",
        "reference",
        id="rloo-beta0-clip-patch-reference",
    ),
]


@needs_trl
@pytest.mark.parametrize("case, how, backend", RLOO_CASES)
def test_rloo_training_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, case,
                                   how, backend):  # fmt: skip
    """``trl.RLOOTrainer`` (TRL 1.16 computes its log-probs with the same fused head as
    GRPO): every log-prob from fused_rl (the old policy's, the reference's for the KL in the
    reward, the training step's), every logged metric and the final parameters as TRL's."""
    want_log, want_params, want_calls, want_s = _baseline(
        model_dir, tmp_path_factory, monkeypatch, case, name="RLOOTrainer"
    )
    if case["beta"]:
        assert any(entry.get("kl", 0) != 0 for entry in want_log)
    train = lambda cls, **kw: _train(cls, model_dir, tmp_path, monkeypatch, case, **kw)  # noqa: E731
    got = run_integrated(train, "RLOOTrainer", how, backend, want_calls)
    check_against_trl(got, want_log, want_params, f"RLOO {case} {how} {backend}; TRL {want_s:.1f}s")


def test_rloo_old_logps_on_first_token():
    """Runs everywhere: RLOO's summed old log-probs as per-token ``old_logprobs`` whose
    ``mask``-weighted sum is exactly the sum (a weight, a hole, an empty sequence)."""
    from fused_rl.integrations._trl_rloo import _empty_sequences_loss, _old_on_first_token

    mask = torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old = torch.tensor([-4.0, 0.0, -2.5])
    per_token = _old_on_first_token(old, mask)
    assert torch.equal((per_token * mask).sum(-1), old)
    assert torch.equal(
        per_token != 0, torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]).bool()
    )
    # only the empty sequence contributes TRL's -min(r A, clip(r) A) at r = 1: -A / B
    adv = torch.tensor([0.3, -0.6, 2.0])
    extra = _empty_sequences_loss(old, adv, mask, dict(eps_low=0.2, eps_high=0.28))
    torch.testing.assert_close(extra, torch.tensor(0.6 / 3))


RLOO_LOSS_CASES = [
    pytest.param(dict(beta=0.04, accumulation=2, epsilon=2e-3), "subclass", id="rloo-loss"),
    pytest.param(
        dict(beta=0.0, accumulation=1, epsilon=1e-3, epsilon_high=3e-3, normalize_advantages=True),
        "patch",
        id="rloo-loss-clip-higher-patch",
    ),  # fmt: skip
]


def train_fused_loss(name, how, model_dir, tmp_path, monkeypatch, case):
    """:func:`_train` of fused_rl's trainer ``name`` with ``fused_rl_loss=True``: the
    subclass (``how="subclass"``) or TRL's own under ``patched(loss=True)``."""
    import trl

    if how == "subclass":
        return _train(getattr(fused_trl, name), model_dir, tmp_path, monkeypatch, case,
                      fused_rl_loss=True)  # fmt: skip
    with fused_trl.patched(loss=True):
        got = _train(getattr(trl, name), model_dir, tmp_path, monkeypatch, case)
    assert not fused_trl.is_patched()
    return got


@needs_trl
@pytest.mark.parametrize("case, how", RLOO_LOSS_CASES)
def test_rloo_training_loss_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, case,
                                        how):  # fmt: skip
    """``RLOOTrainer(fused_rl_loss=True)``: TRL's RLOO loss (a clipped ratio per sequence of
    its summed log-probs) from one ``linear_policy_loss`` call per micro-batch
    (``importance_sampling="sequence-sum"``); every logged metric and the final parameters
    as ``trl.RLOOTrainer``'s, and TRL's ``_compute_loss`` never runs."""
    from trl.trainer import rloo_trainer

    want_log, want_params, want_calls, want_s = _baseline(
        model_dir, tmp_path_factory, monkeypatch, case, name="RLOOTrainer"
    )
    assert any(entry.get("clip_ratio/region_mean", 0) > 0 for entry in want_log)
    trl_loss_calls = []
    trl_loss = rloo_trainer.RLOOTrainer._compute_loss

    def counted_loss(*args, **kwargs):
        trl_loss_calls.append(1)
        return trl_loss(*args, **kwargs)

    monkeypatch.setattr(rloo_trainer.RLOOTrainer, "_compute_loss", counted_loss)
    got = train_fused_loss("RLOOTrainer", how, model_dir, tmp_path, monkeypatch, case)
    assert trl_loss_calls == []
    calls = got[2]
    assert calls.trl == 0 and len(calls.fused) == want_calls.trl
    check_against_trl(got, want_log, want_params, f"RLOO loss {case} {how}; TRL {want_s:.1f}s")


@needs_trl
def test_rloo_loss_step_matches_trl(model_dir, tmp_path):
    """One ``_compute_loss`` call of ``trl.RLOOTrainer`` and of the integrated trainer
    (``fused_rl_loss=True``) on the same micro-batch, with padding, a sequence with no
    counted token (TRL's loss counts it as ``-A``) and ratios clipped on both sides: the
    loss, every parameter gradient and every logged metric agree."""
    import trl

    args = _config(str(tmp_path), beta=0.0, accumulation=2, config="RLOOConfig",
                   epsilon=0.02, epsilon_high=0.03)  # fmt: skip
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    theirs = trl.RLOOTrainer(**kwargs)
    ours = fused_trl.RLOOTrainer(**kwargs, fused_rl_loss=True)
    inputs = _step_inputs(theirs.model, "token_truncate", None, 3.0)
    mask = inputs["completion_mask"]
    inputs = {k: inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                     "completion_mask", "advantages")}  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():  # the old policy's summed log-probs, off by up to +-0.1
        logp, _, _ = theirs._get_per_token_logps_and_entropies(
            theirs.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], mask], 1), mask.shape[1],
        )  # fmt: skip
    old = (logp * mask).sum(1) + 0.1 * (2 * torch.rand(5, generator=gen) - 1)
    inputs["old_logps"] = torch.where(mask.sum(1) > 0, old, 0.0)  # TRL's sum over no token
    for trainer in (theirs, ours):
        trainer.model.train()
    want_log = compare_steps(theirs, ours, inputs)
    assert 0 < want_log["clip_ratio/region_mean"][0] < 1  # some sequences clip, not all
    evaluated = []  # evaluation: no gradient, the metrics logged under "eval"
    for trainer in (theirs, ours):
        trainer.model.eval()
        with torch.no_grad():
            evaluated.append(trainer._compute_loss(trainer.model, dict(inputs)))
    torch.testing.assert_close(evaluated[1], evaluated[0], atol=1e-6, rtol=1e-5)
    assert ours._metrics["eval"].keys() == theirs._metrics["eval"].keys()
    for key, values in theirs._metrics["eval"].items():
        torch.testing.assert_close(ours._metrics["eval"][key], values, atol=ATOL, rtol=RTOL)


@needs_trl
def test_rloo_trainer_options(model_dir, tmp_path):
    """The RLOO trainer checks its options as GRPO's (named with the ``fused_rl_`` prefix),
    takes no ``fused_rl_kl_estimator`` (RLOO's KL is in its reward), and refuses a model
    fused_rl cannot serve at construction."""
    import trl
    from transformers import Qwen2ForCausalLM

    assert issubclass(fused_trl.RLOOTrainer, trl.RLOOTrainer)
    assert fused_trl.RLOOTrainer.__module__ == "fused_rl.integrations.trl"
    args = _config(str(tmp_path), beta=0.0, accumulation=1, config="RLOOConfig")
    common = dict(reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match="^fused_rl_chunk_tokens must be"):
        fused_trl.RLOOTrainer(model=model_dir, fused_rl_chunk_tokens=0, **common)
    with pytest.raises(TypeError, match="fused_rl_loss must be a bool"):
        fused_trl.RLOOTrainer(model=model_dir, fused_rl_loss=1, **common)
    with pytest.raises(TypeError, match="fused_rl_kl_estimator"):  # RLOO's KL is in its reward
        fused_trl.RLOOTrainer(model=model_dir, fused_rl_kl_estimator="full", **common)
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    model.config.final_logit_softcapping = 0.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_trl.RLOOTrainer(model=model, **common)
    trainer = fused_trl.RLOOTrainer(model=model_dir, fused_rl_chunk_tokens=5, **common)
    assert trainer.fused_rl_options == fused_trl.Options("auto", 5, False)
    assert fused_trl._MARK in vars(trainer.model)


# ----------------------------------------------------------------------------- the head


def _head_pair(model, trl_kwargs, fused_kwargs=None):
    """Two copies of ``model``: TRL's fused head on one, fused_rl's on the other."""
    from trl.trainer.utils import add_fused_lm_head

    theirs, ours = model, copy.deepcopy(model)
    add_fused_lm_head(theirs, **trl_kwargs)
    fused_trl.add_fused_lm_head(ours, **trl_kwargs, **(fused_kwargs or {}))
    return theirs, ours


def _inputs(batch=3, length=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    attention = torch.ones_like(ids)
    attention[0, :3] = 0  # left padding
    attention[2, -2:] = 0  # right padding
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :4] = -100  # the prompt
    return ids, attention, labels


def _run_head(model, ids, attention, labels, **kwargs):
    out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True,
                **kwargs)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    total = out.loss * 0.3 + (out.log_probs * torch.randn(out.log_probs.shape, generator=gen)).sum()
    if out.entropy is not None:
        total = total + (out.entropy * torch.randn(out.entropy.shape, generator=gen)).sum()
    model.zero_grad()
    total.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_heads_agree(theirs, ours, *call, atol=1e-5, rtol=1e-4, **kwargs):
    want, want_grads = _run_head(theirs, *call, **kwargs)
    got, got_grads = _run_head(ours, *call, **kwargs)
    for field in ("loss", "log_probs", "entropy", "label_mask", "aux_loss"):
        a, b = getattr(want, field), getattr(got, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, field
            torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=field)
    assert sorted(want_grads) == sorted(got_grads)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, atol=atol, rtol=rtol, msg=name)
    return want, got


@needs_trl
@pytest.mark.parametrize("shifted", [False, True], ids=["labels", "shift_labels"])
def test_head_matches_trl(shifted):
    """Values and gradients of TRL's head and fused_rl's, with a biased head, a temperature,
    a logit scale from the config, padding and ``num_items_in_batch``."""
    model = _tiny_model(seed=3, logit_scale=0.5)
    with torch.no_grad():  # a biased head, as some models have
        head = torch.nn.Linear(64, VOCAB, bias=True)
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0, 0.5)
        model.lm_head = head
    kwargs = dict(temperature=0.7, outputs=("log_probs", "entropy"))
    theirs, ours = _head_pair(model, kwargs)
    ids, attention, labels = _inputs()
    if shifted:  # pre-shifted labels: every position scored as is
        shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
        extra = dict(labels=None, shift_labels=shift)
        _assert_heads_agree(theirs, ours, ids, attention, **extra)
    else:
        _assert_heads_agree(theirs, ours, ids, attention, labels)
        _assert_heads_agree(theirs, ours, ids, attention, labels, num_items_in_batch=7)


@needs_trl
@pytest.mark.parametrize("scale", [None, 1.6], ids=["softcap", "softcap-logit-scale"])
def test_head_softcap_matches_trl(scale):
    """Gemma 2 / 3's ``final_logit_softcapping`` (TRL: ``c tanh(s z / c) / T``), alone and
    with a logit scale, a cap small enough to bend the tiny model's logits."""
    extra = {} if scale is None else {"logit_scale": scale}
    model = _tiny_model(seed=5, final_logit_softcapping=1.5, **extra)
    theirs, ours = _head_pair(model, dict(temperature=0.8, outputs=("log_probs", "entropy")))
    ids, attention, labels = _inputs()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    assert logits.abs().max() > 1.5 * (scale or 1.0)  # the cap binds
    _assert_heads_agree(theirs, ours, ids, attention, labels)


@needs_trl
def test_head_no_counted_label_and_outputs():
    """No label counts: loss 0, zeros, and a backward that runs; without ``entropy`` in
    ``outputs`` there is none; without ``fused_lm_head`` the original forward runs."""
    theirs, ours = _head_pair(_tiny_model(seed=4), {})
    ids, attention, labels = _inputs()
    none = torch.full_like(labels, -100)
    want, got = _assert_heads_agree(theirs, ours, ids, attention, none)
    assert got.entropy is None and got.loss.item() == 0.0 and not got.log_probs.any()
    plain = ours(input_ids=ids, attention_mask=attention)
    torch.testing.assert_close(plain.logits, theirs(input_ids=ids, attention_mask=attention).logits)


@needs_trl
def test_head_cast_lm_head_to_fp32_bf16_model():
    model = _tiny_model(seed=5).to(torch.bfloat16)
    theirs, ours = _head_pair(
        model, dict(cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    )
    ids, attention, labels = _inputs()
    want, got = _assert_heads_agree(theirs, ours, ids, attention, labels, atol=1e-2, rtol=1e-2)
    assert got.log_probs.dtype == torch.float32


@needs_trl
def test_head_moe_aux_loss():
    """A Qwen2-MoE asking for router logits: the load-balancing loss in ``aux_loss`` and in
    ``loss``, as TRL's head."""
    theirs, ours = _head_pair(_tiny_moe(), dict(outputs=("log_probs", "entropy")))
    ids, attention, labels = _inputs()
    want, got = _assert_heads_agree(theirs, ours, ids, attention, labels)
    assert got.aux_loss is not None and float(got.aux_loss) > 0


# ----------------------------------------------------------------------------- what raises


@needs_trl
@pytest.mark.parametrize(
    "config, outputs, match",
    [
        (dict(final_logit_softcapping=0.0), ("log_probs",), "final_logit_softcapping"),
        (dict(logit_scale=-1.0), ("log_probs",), "logit_scale"),
        (dict(logits_scaling=0.0), ("log_probs",), "logits_scaling"),
        ({}, ("log_probs", "top_k_ids"), "top_k_ids"),
    ],
)
def test_head_raises_for_what_fused_rl_cannot_do(config, outputs, match):
    model = _tiny_model(**config)
    with pytest.raises(ValueError, match=match):
        fused_trl.add_fused_lm_head(model, outputs=outputs)
    assert "forward" not in vars(model)  # nothing patched
    with pytest.raises(ValueError, match="fused_rl_backend"):
        fused_trl.GRPOTrainer(model=model, fused_rl_backend="cuda")


@needs_trl
def test_trainer_raises_at_construction(model_dir, tmp_path):
    """A soft-cap fused_rl cannot apply (0.0, which TRL reads as 1.0): the trainer refuses
    at construction, it never falls back to TRL's head."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    model.config.final_logit_softcapping = 0.0
    args = _config(str(tmp_path), loss_type="grpo", beta=0.0, accumulation=1)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_trl.GRPOTrainer(model=model, reward_funcs=reward_w5, args=args,
                              train_dataset=_dataset(), processing_class=_tokenizer())  # fmt: skip


@needs_trl
def test_trainer_refuses_a_trl_head(model_dir, tmp_path, monkeypatch):
    """A TRL that added its head some other way than the function fused_rl replaces: a
    RuntimeError, never TRL's head running silently."""
    import contextlib

    monkeypatch.setattr(fused_trl, "_fused_heads", lambda *args: contextlib.nullcontext())
    args = _config(str(tmp_path), loss_type="grpo", beta=0.0, accumulation=1)
    with pytest.raises(RuntimeError, match="did not add its fused LM head"):
        fused_trl.GRPOTrainer(model=model_dir, reward_funcs=reward_w5, args=args,
                              train_dataset=_dataset(), processing_class=_tokenizer())  # fmt: skip


# ----------------------------------------------------------------------------- patch()


@needs_trl
def test_patch_unpatch_restore_exactly():
    """``patch()`` wraps every head trainer of the installed TRL (and the distillation
    trainer); ``unpatch()`` restores each ``__init__`` and each module's
    ``add_fused_lm_head`` exactly."""
    import importlib

    import trl

    modules = {}
    for name in fused_trl.HEAD_TRAINERS:
        try:
            modules[name] = fused_trl._trainer_module(name)
        except ImportError:  # a TRL whose trainer has no fused head (TRL 1.15's RLOO)
            assert name != "GRPOTrainer"
    inits = {name: getattr(m, name).__dict__["__init__"] for name, m in modules.items()}
    heads = {name: m.add_fused_lm_head for name, m in modules.items()}
    with pytest.raises(ValueError, match="^backend must be one of"):
        fused_trl.patch(backend="cuda")
    with pytest.raises(ValueError, match="^chunk_tokens must be"):
        fused_trl.patch(chunk_tokens=0)
    assert not fused_trl.is_patched()
    fused_trl.patch()
    try:
        fused_trl.patch(backend="reference")  # again: only the options change
        assert fused_trl.is_patched()
        for name, m in modules.items():
            assert getattr(m, name).__init__ is not inits[name], name
        with fused_trl.patched(backend="triton"):
            assert fused_trl._PATCH["options"].backend == "triton"
        assert fused_trl.is_patched() and fused_trl._PATCH["options"].backend == "reference"
    finally:
        fused_trl.unpatch()
    fused_trl.unpatch()  # again: nothing to do
    assert not fused_trl.is_patched()
    for name, m in modules.items():
        assert getattr(m, name).__dict__["__init__"] is inits[name], name
        assert m.add_fused_lm_head is heads[name], name
        assert importlib.import_module(m.__name__) is m
    with fused_trl.patched():
        assert fused_trl.is_patched()
    assert trl.GRPOTrainer.__dict__["__init__"] is inits["GRPOTrainer"]
    assert issubclass(fused_trl.GRPOTrainer, trl.GRPOTrainer)
    assert fused_trl.GRPOTrainer.__module__ == "fused_rl.integrations.trl"


@needs_trl
def test_subclass_under_patch_keeps_its_options(model_dir, tmp_path):
    """fused_rl's subclass built while ``patch()`` wraps TRL's ``__init__``: the subclass's
    own options route its loss, once; the patch's options never reach it."""
    import trl

    args = _config(str(tmp_path), loss_type="grpo", beta=0.04, accumulation=1)
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    with fused_trl.patched(loss=True, kl_estimator="full"):
        plain = fused_trl.GRPOTrainer(**kwargs)
        exact = fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True, fused_rl_kl_estimator="full")
        k3 = fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True)
    assert plain.fused_rl_options == fused_trl.Options()
    assert plain._compute_loss.__func__ is trl.GRPOTrainer._compute_loss
    assert "_generate_and_score_completions" not in vars(plain)
    assert exact.fused_rl_policy_options["kl_estimator"] == "full"
    assert "_generate_and_score_completions" in vars(exact)  # the reference forward skipped
    assert k3.fused_rl_policy_options["kl_estimator"] == "k3"
    assert "_generate_and_score_completions" not in vars(k3)


# ----------------------------------------------------------------------------- the loss

LOSS_CASES = [
    pytest.param(dict(loss_type="grpo", **FULL), "subclass", id="grpo"),
    pytest.param(dict(loss_type="bnpo", **FULL), "patch", id="bnpo-patch"),
    pytest.param(dict(loss_type="dr_grpo", **FULL), "subclass", id="dr_grpo"),
    pytest.param(dict(loss_type="dapo", **FULL), "subclass", id="dapo"),
    pytest.param(
        # a narrow band, so the second (off-policy) pass clips at both bounds (and delta set)
        dict(
            loss_type="dapo",
            entropy_coef=0.05,
            epsilon=1e-3,
            epsilon_high=2e-3,
            delta=1.004,
            **FULL,
        ),
        "subclass",
        id="dapo-entropy-clip-higher-delta",
    ),
    pytest.param(
        dict(
            loss_type="grpo", entropy_coef=0.05, use_bias_correction_kl=True, epsilon=2e-3, **FULL
        ),
        "subclass",
        id="grpo-entropy-bias-kl",
    ),
    pytest.param(
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=1e-3, **FULL),
        "subclass",
        id="grpo-sequence-level",
    ),
    pytest.param(
        dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=1e-3, **FULL),
        "patch",
        id="luspo-sequence-level-patch",
    ),
    pytest.param(dict(loss_type="cispo", epsilon_high=1.002, **FULL), "subclass", id="cispo"),
    pytest.param(
        dict(loss_type="sapo", sapo_temperature_pos=1.3, sapo_temperature_neg=0.9, **FULL),
        "subclass",
        id="sapo",
    ),
    pytest.param(dict(loss_type="vespo", vespo_k_neg=2.5, **FULL), "subclass", id="vespo"),
    pytest.param(
        dict(loss_type="bnpo", top_entropy_quantile=0.5, **FULL), "subclass", id="bnpo-top-entropy"
    ),
    pytest.param(  # an on-policy micro-batch drifts 0: its negative-advantage tokens drop
        dict(loss_type="grpo", off_policy_mask_threshold=-1e-3, **FULL),
        "patch",
        id="grpo-off-policy-mask-patch",
    ),
    pytest.param(  # the target above the tiny model's entropy: the bonus on, the coef rising
        dict(
            loss_type="dapo",
            use_adaptive_entropy=True,
            entropy_coef=0.01,
            entropy_target=7.0,
            entropy_coef_delta=0.02,
            **FULL,
        ),  # fmt: skip
        "subclass",
        id="dapo-adaptive-entropy",
    ),
]


@needs_trl
@pytest.mark.parametrize("case, how", LOSS_CASES)
def test_training_loss_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, case,
                                   how):  # fmt: skip
    """``fused_rl_loss=True``: the loss and every metric TRL's ``_compute_loss`` logs come
    from one ``fused_rl.linear_policy_loss`` call per micro-batch, the old-policy and
    reference log-probs from fused_rl's head; TRL's head and loss never run."""
    from trl.trainer import grpo_trainer

    import fused_rl.linear as linear

    want_log, want_params, want_calls, want_s = _baseline(
        model_dir, tmp_path_factory, monkeypatch, case
    )
    loss_calls = []
    real_loss = linear.linear_policy_loss

    def counted_loss(*args, **kwargs):
        loss_calls.append(kwargs.get("loss_agg"))
        return real_loss(*args, **kwargs)

    def trl_loss(*args, **kwargs):
        raise AssertionError("TRL's _compute_loss ran")

    monkeypatch.setattr(linear, "linear_policy_loss", counted_loss)
    monkeypatch.setattr(grpo_trainer.GRPOTrainer, "_compute_loss", trl_loss, raising=True)
    got = train_fused_loss("GRPOTrainer", how, model_dir, tmp_path, monkeypatch, case)
    got_log, got_params, calls, seconds = got
    assert calls.trl == 0
    training_forwards = 6  # 3 steps x accumulation 2
    assert len(loss_calls) == training_forwards
    # the other forwards (old policy, reference model) through fused_rl's head; a loss that
    # is not token-level (a sequence's ratio, VESPO's weight, top-entropy tokens) gets its
    # log-probs from the same linear op first, as every loss does on the reference backend
    # (what backend="auto" runs for this CPU trainer's tensors on a machine with a GPU)
    token_level = (
        fused_trl_auto_backend() == "triton"
        and case.get("importance_sampling_level", "token") == "token"
        and case["loss_type"] != "vespo"
        and case.get("top_entropy_quantile", 1) == 1
        and case.get("off_policy_mask_threshold") is None
    )
    heads = want_calls.trl - training_forwards
    assert len(calls.fused) == heads + (0 if token_level else training_forwards)
    worst = compare_logs(want_log, got_log)
    param_diff = compare_params(want_params, got_params)
    if case.get("epsilon", 0.2) < 0.01:  # the narrow band: the clip metrics are exercised
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/high_max"):
            assert max(entry.get(key, 0.0) for entry in got_log) > 0, key
    _report(f"loss {case} {how}; TRL {want_s:.1f}s", worst, param_diff, calls, seconds)


@needs_trl
@pytest.mark.parametrize(
    "extra, match",
    [
        (dict(loss_type="cispo"), "loss_type='cispo' with epsilon_high=0.2"),
        (
            dict(loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence"),
            "importance_sampling_level='sequence' with loss_type='cispo'",
        ),
        (
            dict(top_entropy_quantile=0.2, entropy_coef=0.01),
            "top_entropy_quantile=0.2 with an entropy bonus",
        ),
    ],  # fmt: skip
    ids=["cispo-cap-below-1", "cispo-sequence", "top-entropy-bonus"],
)
def test_loss_raises_for_what_does_not_map(model_dir, tmp_path, extra, match):
    """``fused_rl_loss=True`` with a loss option fused_rl does not map exactly: a
    ``ValueError`` at construction naming it (the same options work without it)."""
    args = _config(str(tmp_path), beta=0.0, accumulation=1, **{"loss_type": "grpo", **extra})
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match=match):
        fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True)
    fused_trl.GRPOTrainer(**kwargs)  # fused_rl_loss=False: fused_rl's head, TRL's loss


@needs_trl
def test_loss_option_checks(model_dir, tmp_path):
    """``fused_rl_loss`` must be a bool; a subclass with its own ``_compute_loss`` raises
    (fused_rl would replace it); ``patch(loss=True)`` reaches ``trl.GRPOTrainer``."""
    import trl

    with pytest.raises(TypeError, match="fused_rl_loss"):
        fused_trl.GRPOTrainer(model=model_dir, fused_rl_loss=1)

    class Custom(fused_trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    args = _config(str(tmp_path), loss_type="grpo", beta=0.0, accumulation=1)
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match="_compute_loss overridden by Custom"):
        Custom(**kwargs, fused_rl_loss=True)
    with fused_trl.patched(loss=True):
        trainer = trl.GRPOTrainer(**kwargs)
    assert trainer.fused_rl_options.loss and "_compute_loss" in vars(trainer)
    assert "_compute_loss" not in vars(fused_trl.GRPOTrainer(**kwargs))


def test_loss_metrics_are_trls_definitions():
    """Runs everywhere (no TRL needed): the fused_rl metrics the integration logs under TRL's
    names equal TRL 1.16's definitions, written out here from its ``_compute_loss``, with
    ``delta`` binding, a zero advantage and a sequence with no counted token:
    ``clip_ratio/low_mean`` = mean of ``r < 1 - eps_low and A < 0``, ``high_mean`` of
    ``r > 1 + eps_high and A > 0``, ``region_mean`` their union, ``low_min`` / ``high_max``
    the NaN-ignoring min / max of the per-sequence means, ``kl`` the mean of
    ``(exp(ref - logp) - (ref - logp) - 1) r`` under ``use_bias_correction_kl``."""
    import fused_rl

    gen = torch.Generator().manual_seed(0)
    batch, length, width, vocab = 6, 7, 16, 40
    hidden = torch.randn(batch, length + 1, width, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, width, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    adv = torch.randn(batch, generator=gen)
    adv[0] = 0.0
    mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
    mask[1] = 0
    with torch.no_grad():
        logits = hidden[:, :-1] @ weight.T
        logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
        probs = torch.softmax(logits, -1)
        entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    old = logp + 0.3 * torch.randn(batch, length, generator=gen)
    ref = logp + 0.2 * torch.randn(batch, length, generator=gen)
    eps_low, eps_high, delta, beta, coef = 0.1, 0.15, 1.3, 0.04, 0.05
    ratio, a, m = torch.exp(logp - old), adv[:, None], mask.float()
    assert ((ratio > delta) & (m > 0)).any()  # delta binds somewhere
    low = ((ratio < 1 - eps_low) & (a < 0)).float()
    high = ((ratio > 1 + eps_high) & (a > 0)).float()
    kl = (torch.exp(ref - logp) - (ref - logp) - 1) * ratio
    mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
    per_seq = lambda x: (x * m).sum(-1) / m.sum(-1)  # noqa: E731  (NaN: no counted token)
    term = -torch.minimum(ratio.clamp(max=delta) * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)
    per_token = term + beta * kl
    want_loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean() - coef * mean(entropy)
    want = {
        "clip_frac_low": mean(low),
        "clip_frac_high": mean(high),
        "clip_frac": mean(((low + high) > 0).float()),
        "clip_frac_low_seq_min": per_seq(low).nan_to_num(2.0).min(),
        "clip_frac_high_seq_max": per_seq(high).nan_to_num(-1.0).max(),
        "kl_bias_corrected": mean(kl),
        "entropy": mean(entropy),
    }
    for backend in ("auto", "reference"):
        loss, metrics = fused_rl.linear_policy_loss(
            hidden, weight, targets, adv, old_logprobs=old, ref_logprobs=ref, mask=mask,
            eps_low=eps_low, eps_high=eps_high, delta=delta, beta=beta, kl_bias_correction=True,
            entropy_coef=coef, entropy_agg="token-mean", with_entropy=True,
            loss_agg="seq-mean-token-mean", backend=backend,
        )  # fmt: skip
        torch.testing.assert_close(loss.detach(), want_loss, atol=1e-6, rtol=1e-5)
        for key, value in want.items():
            torch.testing.assert_close(metrics[key], value.float(), atol=1e-6, rtol=1e-5, msg=key)


# ------------------------------------------------------------------ one loss step, any input

STEP_CASES = {
    "grpo-vllm-token-truncate-bias-kl": dict(
        loss_type="grpo", beta=0.04, use_bias_correction_kl=True, epsilon=0.02,
        vllm_importance_sampling_mode="token_truncate",
    ),
    "bnpo-vllm-sequence-truncate": dict(
        loss_type="bnpo", epsilon=0.02, vllm_importance_sampling_mode="sequence_truncate"
    ),
    "dr_grpo-vllm-token-mask": dict(
        loss_type="dr_grpo", beta=0.04, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1,
    ),
    "dapo-vllm-sequence-mask-entropy": dict(
        loss_type="dapo", entropy_coef=0.03, vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=1.3,
    ),
    "luspo-sequence-level-vllm": dict(
        loss_type="luspo", importance_sampling_level="sequence", epsilon=0.02, beta=0.04,
        use_bias_correction_kl=True, vllm_importance_sampling_mode="token_truncate",
    ),
    "cispo-vllm": dict(loss_type="cispo", epsilon_high=1.03, beta=0.04,
                       vllm_importance_sampling_mode="token_truncate"),
    "sapo-sequence-level-vllm": dict(
        loss_type="sapo", importance_sampling_level="sequence",
        vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.9,
    ),
    "vespo-vllm-token-mask": dict(
        loss_type="vespo", beta=0.04, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1,
    ),
    "grpo-top-entropy": dict(loss_type="grpo", top_entropy_quantile=0.4, epsilon=0.02),
    # the off-policy sequence mask on the sampler's log-probs: sequences 1 and 4 have negative
    # advantages and drifts of 0.055 and 0.017, so 0.03 / 0.02 drop the first only, 0 both
    "grpo-vllm-off-policy-mask": dict(
        loss_type="grpo", beta=0.04, off_policy_mask_threshold=0.03,
        vllm_importance_sampling_mode="token_truncate",
    ),
    "dapo-off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    "vespo-off-policy-mask-top-entropy": dict(
        loss_type="vespo", off_policy_mask_threshold=0.0, top_entropy_quantile=0.5,
        vllm_importance_sampling_mode="token_truncate",
    ),
}  # fmt: skip


def _step_inputs(model, mode, clip_min, clip_max, seed=3):
    """A micro-batch as TRL's ``_generate_and_score_completions`` leaves it, with old,
    reference and vLLM sampling log-probs near the model's own (so ratios clip on both sides
    and the vLLM ratios are truncated or masked), padding, and a sequence with no counted
    token."""
    gen = torch.Generator().manual_seed(seed)
    batch, prompt, length = 5, 3, 7
    prompt_ids = torch.randint(2, VOCAB, (batch, prompt), generator=gen)
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    mask[3] = 0  # nothing counted
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt_ids, ids], 1)).logits[:, prompt - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(batch, length, generator=gen)  # noqa: E731
    old = logp + noise(0.05)
    sampling = old + noise(0.08)
    diff = (old - sampling) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return {
        "prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": ids, "completion_mask": mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4, 0.9, -1.2]),
        "num_items_in_batch": mask.sum().float() * 2,  # a window of two micro-batches
        "old_per_token_logps": old, "ref_per_token_logps": logp + noise(0.1),
        "sampling_per_token_logps": sampling, "importance_sampling_ratio": ratio,
    }  # fmt: skip


@needs_trl
@pytest.mark.parametrize("name", sorted(STEP_CASES))
def test_loss_step_matches_trl(model_dir, tmp_path, name):
    """One ``_compute_loss`` call of ``trl.GRPOTrainer`` and of the integrated trainer
    (``fused_rl_loss=True``) on the same micro-batch, for every loss type and vLLM's four
    importance-sampling modes (which need vLLM to train, so the ratios are given here as
    TRL builds them): the loss, every parameter's gradient and every logged metric agree."""
    import trl

    from fused_rl.integrations import _trl_loss

    case = dict(STEP_CASES[name])
    mode = case.pop("vllm_importance_sampling_mode", None)
    clip = {k: case.pop(k) for k in list(case) if k.startswith("vllm_importance_sampling_clip")}
    args = _config(str(tmp_path), accumulation=2, **{"beta": 0.0, **case})
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    theirs = trl.GRPOTrainer(**kwargs)
    ours = fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True)
    for trainer in (theirs, ours):
        trainer.current_gradient_accumulation_steps = 2
        trainer.model.train()
        if mode is not None:  # what GRPOTrainer sets from use_vllm=True
            trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
            trainer.vllm_importance_sampling_mode = mode
            trainer.vllm_importance_sampling_clip_min = clip.get(
                "vllm_importance_sampling_clip_min"
            )
            trainer.vllm_importance_sampling_clip_max = clip.get(
                "vllm_importance_sampling_clip_max", 3.0
            )
    ours.fused_rl_policy_options = _trl_loss.policy_options(ours)  # with the vLLM settings
    inputs = _step_inputs(
        theirs.model, mode or "token_truncate",
        theirs.vllm_importance_sampling_clip_min, theirs.vllm_importance_sampling_clip_max,
    )  # fmt: skip
    compare_steps(theirs, ours, inputs)


def compare_steps(theirs, ours, inputs) -> dict:
    """One ``_compute_loss`` call and backward of each trainer on ``inputs``: the loss, every
    parameter gradient and every logged metric agree. Returns TRL's logged metrics."""
    results = []
    for trainer in (theirs, ours):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, dict(inputs))
        loss.backward()
        grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters()
                 if p.grad is not None}  # fmt: skip
        results.append((loss.detach(), grads, dict(trainer._metrics["train"])))
    (want, want_grads, want_log), (got, got_grads, got_log) = results
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert sorted(got_grads) == sorted(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-6, rtol=1e-4, msg=key)
    assert sorted(got_log) == sorted(want_log)
    for key, values in want_log.items():
        assert len(got_log[key]) == len(values), key
        for x, y in zip(values, got_log[key]):
            if math.isnan(x):
                assert math.isnan(y), key
            else:
                assert abs(x - y) <= ATOL + RTOL * abs(x), f"{key}: TRL {x}, fused_rl {y}"
    return want_log


def _exact_kl_oracle(model, ref_model, inputs, *, beta, eps, accumulation, level="token"):
    """TRL 1.16's ``grpo`` loss (at ``importance_sampling_level=level``) with its k3
    estimate replaced by the exact per-token KL, from the two models' full logits in
    float64: the loss and the token-mean KL."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    start = inputs["prompt_ids"].shape[1] - 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, start:-1].double()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=attention).logits[:, start:-1].double()
    logp_all, logq_all = logits.log_softmax(-1), ref.log_softmax(-1)
    kl = (logp_all.exp() * (logp_all - logq_all)).sum(-1)
    logp = logp_all.gather(-1, inputs["completion_ids"][..., None])[..., 0]
    mask = inputs["completion_mask"].double()
    adv = inputs["advantages"].double()[:, None]
    log_ratio = logp - inputs["old_per_token_logps"].double()
    if level == "sequence":  # TRL: the masked mean per sequence (denominator clamped to 1)
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
    ratio = log_ratio.exp()
    surrogate = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    per_token = surrogate + beta * kl
    loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean() / accumulation
    return loss, ((kl * mask).sum() / mask.sum()).item()


@needs_trl
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_step_exact_kl(model_dir, tmp_path, level):
    """``fused_rl_kl_estimator="full"``: one ``_compute_loss`` call is TRL's ``grpo`` loss
    with the exact KL to the reference model in place of k3 (a float64 oracle from both
    models' full logits): the loss, every parameter gradient and the logged ``kl``; the
    micro-batch needs no reference log-probs. At the sequence level (GSPO) the loss takes
    the composed route (the log-probs, then each chunk's exact KL)."""
    args = _config(str(tmp_path), loss_type="grpo", beta=0.3, accumulation=2, epsilon=2e-3,
                   importance_sampling_level=level)  # fmt: skip
    trainer = fused_trl.GRPOTrainer(
        model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
        processing_class=_tokenizer(), fused_rl_loss=True, fused_rl_kl_estimator="full",
    )  # fmt: skip
    assert trainer.fused_rl_policy_options["kl_estimator"] == "full"
    trainer.current_gradient_accumulation_steps = 2
    trainer.model.train()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # a reference that differs from the policy
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    inputs = _step_inputs(trainer.model, "token_truncate", None, 3.0)
    del inputs["ref_per_token_logps"]
    from transformers import Qwen2ForCausalLM

    oracle_model = Qwen2ForCausalLM.from_pretrained(model_dir)  # the policy's weights
    oracle_model.train()
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, dict(inputs))
    loss.backward()
    want, want_kl = _exact_kl_oracle(
        oracle_model, trainer.ref_model, inputs, beta=0.3, eps=2e-3, accumulation=2, level=level
    )
    want.backward()
    assert want_kl > 1e-3  # the two models differ
    torch.testing.assert_close(loss.double(), want, atol=1e-6, rtol=1e-5)
    ours = dict(trainer.model.named_parameters())
    for name, p in oracle_model.named_parameters():
        torch.testing.assert_close(ours[name].grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)
    (kl,) = trainer._metrics["train"]["kl"]
    assert abs(kl - want_kl) <= 1e-6 + 1e-5 * want_kl


@needs_trl
def test_loss_step_exact_kl_peft(model_dir, tmp_path):
    """The exact KL under PEFT (LoRA): TRL has no reference model there, the reference is
    the policy with its adapter off; the loss and every LoRA gradient as the float64
    oracle's (the same model, its adapter disabled for the reference logits)."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    args = _config(str(tmp_path), loss_type="grpo", beta=0.3, accumulation=2, epsilon=2e-3)
    trainer = fused_trl.GRPOTrainer(
        model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
        processing_class=_tokenizer(), fused_rl_loss=True, fused_rl_kl_estimator="full",
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    assert trainer.ref_model is None
    trainer.current_gradient_accumulation_steps = 2
    model = trainer.model
    model.train()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # an adapter that moves the policy away from the base model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(2.0 * torch.randn(p.shape, generator=gen))
    inputs = _step_inputs(model, "token_truncate", None, 3.0)
    del inputs["ref_per_token_logps"]
    model.zero_grad()
    loss = trainer._compute_loss(model, dict(inputs))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in k for k in grads)
    model.zero_grad()

    class Base(torch.nn.Module):  # the reference: the same model, its adapter off
        def forward(self, **kwargs):
            with model.disable_adapter():
                return model(**kwargs)

    want, want_kl = _exact_kl_oracle(model, Base(), inputs, beta=0.3, eps=2e-3, accumulation=2)
    want.backward()
    assert want_kl > 1e-3
    torch.testing.assert_close(loss.double(), want, atol=1e-6, rtol=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)


@needs_trl
@pytest.mark.parametrize(
    "bf16, model_dtype",
    [(False, "float32"), (True, "float32"), (True, "bfloat16")],
    ids=["fp32", "fp32-model-bf16-autocast", "bf16-model"],
)
def test_training_exact_kl(model_dir, tmp_path, monkeypatch, bf16, model_dtype):
    """Training with ``fused_rl_kl_estimator="full"`` (3 steps, ``num_iterations=2``): the
    reference model's backbone runs once per loss call, never through TRL's (or fused_rl's)
    log-prob head at generation; the logged ``kl`` is the exact KL (exactly 0 at the first
    step, where the policy is the reference, also under bf16 autocast, then > 0); the
    reference's head reaches the loss in its own dtype (not converted by accelerate)."""
    from fused_rl.integrations import _trl_loss

    heads = []  # what each loss call got from the reference
    reference_hidden = _trl_loss.reference_hidden

    def counted(*args):
        heads.append(reference_hidden(*args))
        return heads[-1]

    monkeypatch.setattr(_trl_loss, "reference_hidden", counted)
    case = dict(loss_type="dapo", beta=0.04, accumulation=2, bf16=bf16,
                model_init_kwargs={"dtype": model_dtype})  # fmt: skip
    log, _, calls, _ = _train(fused_trl.GRPOTrainer, model_dir, tmp_path, monkeypatch, case,
                              fused_rl_loss=True, fused_rl_kl_estimator="full")  # fmt: skip
    want = getattr(torch, model_dtype)
    assert all(h.dtype == w.dtype == want for h, w, _ in heads)
    # 6 loss calls; the fused head ran for the old policy only (4 forwards), never the reference
    assert len(heads) == 6 and len(calls.fused) == 4 and calls.trl == 0
    kls = [entry["kl"] for entry in log if "kl" in entry]
    assert len(kls) == 3 and kls[0] == 0.0 and kls[-1] > 0


@needs_trl
def test_exact_kl_raises_for_what_does_not_map(model_dir, tmp_path):
    args = _config(str(tmp_path), accumulation=1, loss_type="grpo", beta=0.0)
    kwargs = dict(model=model_dir, reward_funcs=reward_w5, args=args, train_dataset=_dataset(),
                  processing_class=_tokenizer())  # fmt: skip
    with pytest.raises(ValueError, match="with beta=0.0"):
        fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True, fused_rl_kl_estimator="full")
    with pytest.raises(ValueError, match="fused_rl_kl_estimator='full' needs fused_rl_loss=True"):
        fused_trl.GRPOTrainer(**kwargs, fused_rl_kl_estimator="full")
    with pytest.raises(ValueError, match="^fused_rl_kl_estimator must be one of"):
        fused_trl.GRPOTrainer(**kwargs, fused_rl_loss=True, fused_rl_kl_estimator="k2")
    # a reference whose logits are scaled otherwise than the policy's (TRL builds the
    # reference from the policy's path, so the check is run on two heads directly)
    policy, ref = _tiny_model(), _tiny_model(logit_scale=2.0)
    fused_trl.add_fused_lm_head(policy, temperature=0.7)
    fused_trl.add_fused_lm_head(ref, temperature=0.7)
    heads = {"policy": vars(policy)[fused_trl._MARK], "reference model": vars(ref)[fused_trl._MARK]}
    fused_trl._check_same_transform({"policy": heads["policy"]})  # no reference model: fine
    with pytest.raises(ValueError, match="logit scale and final_logit_softcapping"):
        fused_trl._check_same_transform(heads)


@needs_trl
@pytest.mark.parametrize("name", ["GRPOTrainer", "RLOOTrainer"])
def test_training_loss_moe_aux_loss(tmp_path_factory, monkeypatch, name):
    """A MoE policy: the load-balancing loss comes from the same backbone forward as
    fused_rl's loss and is added (and logged as ``aux_loss``) as TRL adds it (GRPO divides
    it by the accumulation steps, RLOO leaves that to the Trainer)."""
    import trl

    path = tmp_path_factory.mktemp("tiny_moe")
    # router logits in the loss step only (TRL 1.16's generation fails with them on)
    _tiny_moe(router_logits=False).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    case = dict(loss_type="dapo", **FULL) if name == "GRPOTrainer" else dict(FULL)
    want_log, want_params, _, _ = _train(
        getattr(trl, name), str(path), tmp_path_factory.mktemp("a"), monkeypatch, case
    )
    got_log, got_params, calls, seconds = _train(
        getattr(fused_trl, name), str(path), tmp_path_factory.mktemp("b"), monkeypatch, case,
        fused_rl_loss=True,
    )  # fmt: skip
    assert calls.trl == 0
    assert any(entry.get("aux_loss", 0) > 0 for entry in want_log)
    worst = compare_logs(want_log, got_log)
    # RLOO's ratio of summed log-probs: Adam turns fp32 summation-order differences in
    # near-zero gradient entries into parameter differences up to lr x their relative error
    compare = compare_params if name == "GRPOTrainer" else compare_adam_params
    param_diff = compare(want_params, got_params)
    _report(f"{name} loss, MoE aux loss", worst, param_diff, calls, seconds)


@needs_trl
def test_bench_e2e_parity(tmp_path):
    """``bench/e2e_trl.py`` at its tiny shape: the variants whose loss is TRL's (TRL's head,
    fused_rl's head, fused_rl's loss) step from the same weights on the same micro-batch to
    the same loss and gradient norm; the exact-KL variant (another loss) steps too."""
    import json

    from bench import e2e_trl

    out = tmp_path / "e2e.json"
    assert e2e_trl.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(results) == sorted(e2e_trl.VARIANTS)
    base = results["trl"]
    for name in e2e_trl.SAME_LOSS:
        r = results[name]
        assert abs(r["loss"] - base["loss"]) <= ATOL + RTOL * abs(base["loss"]), name
        assert abs(r["grad_norm"] - base["grad_norm"]) <= RTOL * base["grad_norm"], name
    full = results["fused_rl_full_kl"]
    assert math.isfinite(full["loss"]) and full["grad_norm"] > 0


@needs_trl
def test_training_softcap_matches_trl(tmp_path_factory, monkeypatch):
    """A policy whose config sets ``final_logit_softcapping`` (Gemma 2 / 3): TRL's head and
    fused_rl's both cap every log-prob (old policy, reference, training step), and with
    ``fused_rl_loss=True`` so does the loss's one fused call."""
    import trl

    path = tmp_path_factory.mktemp("tiny_softcap")
    _tiny_model(final_logit_softcapping=2.0).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    case = dict(loss_type="grpo", epsilon=2e-3, **FULL)
    want_log, want_params, want_calls, _ = _train(
        trl.GRPOTrainer, str(path), tmp_path_factory.mktemp("a"), monkeypatch, case
    )
    for loss in (False, True):
        got_log, got_params, calls, seconds = _train(
            fused_trl.GRPOTrainer, str(path), tmp_path_factory.mktemp("b"), monkeypatch, case,
            fused_rl_loss=loss,
        )  # fmt: skip
        # the fused loss's 6 calls take no head call, but on the reference backend (a GPU
        # machine's CPU trainer), which takes its log-probs from the head op first
        fused_loss = loss and fused_trl_auto_backend() == "triton"
        assert calls.trl == 0 and len(calls.fused) == want_calls.trl - (6 if fused_loss else 0)
        worst = compare_logs(want_log, got_log)
        param_diff = compare_params(want_params, got_params)
        _report(f"softcap 2.0, fused_rl_loss={loss}", worst, param_diff, calls, seconds)
