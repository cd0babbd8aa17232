"""fused_rl.integrations.trl's DistillationTrainer against the installed TRL (>= 1.16;
skipped without it).

Proven by training: a tiny Qwen2 student and a wider tiny Qwen2 teacher built from configs
(the same word-level vocabulary, built in code), an in-memory prompt dataset, trained on
the student's own completions for 3 optimizer steps by ``trl.DistillationTrainer`` and by
the integrated trainer from the same seed and weights: every logged metric per step and
the final parameters must agree, TRL's chunked divergence must never run in the integrated
trainer and fused_rl's must run on every loss. A cheaper test compares the loss function
alone with TRL's (values, entropy sum, count, gradients) over the options TRL passes.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import DEVICE
from helpers import rel_err
from test_integration_trl import (
    ATOL,
    EOS,
    LR,
    RTOL,
    STEPS,
    VOCAB,
    _dataset,
    _tokenizer,
    check_against_trl,
    compare_adam_params,
    compare_logs,
    compare_params,
    run_integrated,
    trained,
)

import fused_rl.integrations.trl as fused_trl
import fused_rl.linear_distill as fused_linear_distill
from fused_rl.integrations import _trl_distill


def _trl_distill_ok() -> bool:
    try:
        from trl.trainer import distillation_trainer
    except ImportError:
        return False
    return hasattr(distillation_trainer, "_chunked_divergence_loss")


needs_trl = pytest.mark.skipif(not _trl_distill_ok(), reason="needs TRL >= 1.16")


def test_clear_error_without_trl(monkeypatch):
    """Runs everywhere: without TRL, using the trainer names what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.setitem(sys.modules, "trl.trainer", None)
    monkeypatch.delitem(fused_trl.__dict__, "DistillationTrainer", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'trl>=1.16'"):
        fused_trl.DistillationTrainer  # noqa: B018


# ----------------------------------------------------------------------------- the loss alone

OPTIONS = fused_trl.Options


def _loss_inputs(seed, *, bias, dtype=torch.float32, batch=3, length=5, vocab=37):
    """Drawn on the CPU (the same values everywhere), placed on the tests' device."""
    g = torch.Generator().manual_seed(seed)
    hs, ht = 8, 12  # a wider teacher
    mask = torch.rand(batch, length, generator=g) > 0.3
    mask[1] = False  # a sequence with no completion token
    mask[0, 0] = True
    args = dict(
        student_hidden_states=torch.randn(batch, length, hs, generator=g).to(DEVICE, dtype),
        teacher_hidden_states=torch.randn(batch, length, ht, generator=g).to(DEVICE, dtype),
        student_lm_head_weight=torch.randn(vocab, hs, generator=g).to(DEVICE, dtype),
        teacher_lm_head_weight=torch.randn(vocab, ht, generator=g).to(DEVICE, dtype),
        completion_mask=mask.long().to(DEVICE),
    )
    if bias:
        args["student_lm_head_bias"] = torch.randn(vocab, generator=g).to(DEVICE, dtype)
        args["teacher_lm_head_bias"] = torch.randn(vocab, generator=g).to(DEVICE, dtype)
    return args


def _run(fn, inputs, **kwargs):
    """``fn``'s ``(loss, entropy_sum, n_valid)`` and the gradients of the student's hidden
    states, weight and bias under one upstream gradient."""
    inputs = {k: v.clone() for k, v in inputs.items()}
    leaves = [inputs[k] for k in ("student_hidden_states", "student_lm_head_weight",
                                  "student_lm_head_bias") if k in inputs]  # fmt: skip
    for t in leaves:
        t.requires_grad_(True)
    loss, entropy_sum, n_valid = fn(**inputs, **kwargs)
    (loss * 1.7).backward()
    return loss.detach(), entropy_sum, n_valid, [t.grad for t in leaves]


TRANSFORMS = {
    "plain": {},
    "temperature": dict(temperature=0.7),
    "softcap": dict(
        student_final_logit_softcapping=3.0, teacher_final_logit_softcapping=3.0, temperature=1.3
    ),  # fmt: skip
    "scale": dict(student_logit_scale=0.5, teacher_logit_scale=0.5),
    "split": dict(student_logit_scale=0.5, teacher_logit_scale=1.25, temperature=0.9),
    "split-softcap": dict(
        student_logit_scale=1.5,
        student_final_logit_softcapping=2.0,
        teacher_final_logit_softcapping=4.0,
    ),  # fmt: skip
}


@needs_trl
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_loss_matches_trls(backend, transform, beta):
    """fused_rl's loss function against TRL's ``_chunked_divergence_loss`` in fp32: the
    loss, the entropy sum, the count and every gradient, with biases, a sequence with no
    completion token, each of the per-model transforms TRL passes, ``num_items_in_batch``
    given and not."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss as trl_loss

    for seed, num_items in ((0, None), (1, torch.tensor(11.0))):
        inputs = _loss_inputs(seed, bias=seed == 0)
        kwargs = dict(beta=beta, num_items_in_batch=num_items, **TRANSFORMS[transform])
        want = _run(trl_loss, inputs, **kwargs)
        fused = functools.partial(_trl_distill.divergence_loss, OPTIONS(backend, chunk_tokens=3))
        got = _run(fused, inputs, **kwargs)
        torch.testing.assert_close(got[0], want[0], atol=2e-6, rtol=2e-5)
        torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=2e-5)
        assert got[2].item() == want[2].item()
        for g, w in zip(got[3], want[3]):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


@needs_trl
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", ["bf16", "fp32-under-bf16-autocast"])
def test_loss_matches_trls_in_bf16(case, backend):
    """bf16 inputs, and fp32 inputs under bf16 autocast (what TRL's trainer hands over with
    ``bf16=True`` and fp32 models), with biases: the chunk logits in fp32 (TRL's tiles),
    the biases added unrounded, the fp32 hidden states and heads given fp32-accumulated
    gradients: TRL's loss and entropy to fp32 rounding, its gradients to the rounding of
    ``dz`` to bf16 for the gradient GEMMs (on both sides)."""
    import contextlib

    from trl.trainer.distillation_trainer import _chunked_divergence_loss as trl_loss

    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    inputs = _loss_inputs(4, bias=True, dtype=dtype)
    kwargs = dict(beta=0.4, temperature=0.9)
    ctx = contextlib.nullcontext
    if case != "bf16":
        ctx = functools.partial(torch.autocast, DEVICE, dtype=torch.bfloat16)
    fused = functools.partial(_trl_distill.divergence_loss, OPTIONS(backend, chunk_tokens=3))
    with ctx():
        want = _run(trl_loss, inputs, **kwargs)
    with ctx():
        got = _run(fused, inputs, **kwargs)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[3], want[3], strict=True):
        assert g.dtype == w.dtype == dtype
        # each side rounds its own dz to bf16 for the GEMMs (TRL after the upstream factor,
        # fused_rl before it), so the gradients agree to two bf16 roundings as a whole
        # (measured RMS 1.6e-3 to 3.8e-3), not element by element
        assert rel_err(g, w) <= 2**-7, rel_err(g, w)


@needs_trl
def test_loss_with_no_valid_position_is_zero():
    """A rank whose batch holds no completion token: loss 0 (TRL's clamp), connected to the
    student so the backward runs, entropy 0, count 0."""
    inputs = _loss_inputs(2, bias=False)
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    loss, entropy_sum, n_valid, grads = _run(
        lambda **kw: _trl_distill.divergence_loss(OPTIONS(), **kw), inputs, beta=0.5
    )
    assert loss.item() == 0.0 and entropy_sum.item() == 0.0 and n_valid.item() == 0
    assert all(g is not None and g.eq(0).all() for g in grads)


# ----------------------------------------------------------------------------- training


def _tiny(hidden, seed, **extra):
    """A random tiny Qwen2 of width ``hidden`` whose completions end early often enough to
    be padded (as ``test_integration_trl._tiny_model``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=EOS,
        bos_token_id=EOS, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.lm_head.weight[EOS, 0] = 0.6
    return model


class Calls:
    """Counts TRL's chunked divergence and fused_rl's chunked distillation op (with the
    backend it ran)."""

    def __init__(self, monkeypatch):
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        self.trl = 0
        self.fused: list[str] = []
        trl_apply = ChunkedDivergenceFunction.apply
        fused_apply = fused_linear_distill._LinearDistill.apply

        def counted_trl(*args):
            self.trl += 1
            return trl_apply(*args)

        def counted_fused(*args):
            launch = next(a for a in args if isinstance(a, fused_linear_distill._Launch))
            self.fused.append(launch.which)
            return fused_apply(*args)

        monkeypatch.setattr(ChunkedDivergenceFunction, "apply", counted_trl)
        monkeypatch.setattr(fused_linear_distill._LinearDistill, "apply", counted_fused)


def _config(out_dir, **extra):
    from trl import DistillationConfig

    values = dict(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4,
        max_completion_length=8, gradient_accumulation_steps=2, beta=0.5, temperature=0.9,
        learning_rate=LR,
        report_to=[], use_cpu=True, seed=0, logging_steps=1, bf16=False, save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    values.update(extra)
    return DistillationConfig(**values)


def _train(trainer_cls, paths, tmp_path, monkeypatch, config=None, **trainer_kwargs):

    with monkeypatch.context() as patch_ctx:
        calls = Calls(patch_ctx)
        trainer = trainer_cls(
            model=paths[0], teacher_model=paths[1], args=_config(str(tmp_path), **(config or {})),
            train_dataset=_dataset(), processing_class=_tokenizer(), **trainer_kwargs,
        )  # fmt: skip
        return trained(trainer, calls)


def _models(tmp_path_factory, name, student_extra=None, teacher_extra=None):
    paths = []
    for who, hidden, seed, extra in (("student", 64, 0, student_extra),
                                     ("teacher", 96, 1, teacher_extra)):  # fmt: skip
        path = tmp_path_factory.mktemp(f"{name}_{who}")
        _tiny(hidden, seed, **(extra or {})).save_pretrained(path)
        _tokenizer().save_pretrained(path)
        paths.append(str(path))
    return paths


TRAIN_CASES = [
    pytest.param({}, {}, {}, "subclass", "auto", id="jsd"),
    pytest.param({"beta": 0.0}, {}, {}, "patch", "auto", id="forward-kl-patch"),
    pytest.param({"beta": 1.0}, {}, {}, "subclass", "reference", id="reverse-kl-reference"),
    pytest.param(
        {},
        dict(final_logit_softcapping=2.0, logit_scale=0.8),
        dict(final_logit_softcapping=3.0, logit_scale=1.5),
        "subclass",
        "auto",
        id="per-model-scale-softcap",
    ),  # fmt: skip
]


@needs_trl
@pytest.mark.parametrize("config, student, teacher, how, backend", TRAIN_CASES)
def test_training_matches_trl(tmp_path_factory, monkeypatch, config, student, teacher, how,
                              backend):  # fmt: skip
    import trl

    paths = _models(tmp_path_factory, "distill", student, teacher)
    want_log, want_params, want_calls, want_s = _train(
        trl.DistillationTrainer, paths, tmp_path_factory.mktemp("trl"), monkeypatch, config
    )
    out = tmp_path_factory.mktemp("fused")
    train = lambda cls, **kw: _train(cls, paths, out, monkeypatch, config, **kw)  # noqa: E731
    got = run_integrated(train, "DistillationTrainer", how, backend, want_calls)
    check_against_trl(got, want_log, want_params, f"distill {how} {backend}; TRL {want_s:.1f}s")


@needs_trl
@pytest.mark.parametrize(
    "config, bf16_params",
    [
        pytest.param(dict(model_init_kwargs={"dtype": "bfloat16"},
                          teacher_model_init_kwargs={"dtype": "bfloat16"}), True,
                     id="bf16-models"),
        pytest.param(dict(bf16=True), False, id="fp32-models-bf16-autocast"),
    ],
)  # fmt: skip
def test_training_bf16(tmp_path_factory, monkeypatch, config, bf16_params):
    """bf16 models, and fp32 models under bf16 autocast (the hidden states' and head's
    gradients then fp32 accumulators, as TRL's): fused_rl keeps the chunk logits in fp32
    as TRL's tiles, so the two trainers differ by rounding (the order of fp32 sums, now and
    then ``dz``'s bf16 copy an ulp apart): every logged metric within the fp32 tolerances
    (measured: loss 3e-7 relative); fp32 parameters within 1e-5 (measured 7.8e-7); bf16
    ones within one bf16 rounding, ``2^-7 |w|`` (an update rounding the other way; measured
    1.2e-4 relative), all but 1e-4 of them (``compare_adam_params``)."""
    import trl

    paths = _models(tmp_path_factory, "bf16")
    want_log, want_params, _, _ = _train(
        trl.DistillationTrainer, paths, tmp_path_factory.mktemp("trl"), monkeypatch, config
    )
    out = tmp_path_factory.mktemp("fused")
    got_log, got_params, calls, _ = _train(
        fused_trl.DistillationTrainer, paths, out, monkeypatch, config
    )
    assert calls.trl == 0 and calls.fused
    compare_logs(want_log, got_log)
    if bf16_params:
        compare_adam_params(want_params, got_params, rtol=2**-7)
    else:
        compare_params(want_params, got_params)


@needs_trl
def test_bench_e2e_parity(tmp_path):
    """``bench/e2e_trl_distill.py`` at its tiny shape: TRL's trainer and fused_rl's step from
    the same weights on the same micro-batch to the same loss, entropy and gradient norm."""
    import json

    from bench import e2e_trl_distill

    out = tmp_path / "e2e.json"
    assert e2e_trl_distill.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(results) == sorted(e2e_trl_distill.VARIANTS)
    want, got = results["trl"], results["fused_rl"]
    for key in ("loss", "entropy", "grad_norm"):
        assert abs(got[key] - want[key]) <= ATOL + RTOL * abs(want[key]), key


# ----------------------------------------------------------------------------- errors, patch


@needs_trl
@pytest.mark.parametrize(
    "who, extra, match",
    [
        ("teacher", dict(logit_scale=0.0), "logit scale of 0.0"),
        ("student", dict(final_logit_softcapping=-1.0), "final_logit_softcapping=-1.0"),
    ],
)
def test_trainer_raises_at_construction(tmp_path_factory, who, extra, match):
    paths = _models(tmp_path_factory, f"bad_{who}", **{f"{who}_extra": extra})
    with pytest.raises(ValueError, match=match):
        fused_trl.DistillationTrainer(
            model=paths[0], teacher_model=paths[1], args=_config(str(tmp_path_factory.mktemp("o"))),
            train_dataset=_dataset(), processing_class=_tokenizer(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="fused_rl_backend"):
        fused_trl.DistillationTrainer(model=paths[0], fused_rl_backend="cuda")


@needs_trl
def test_trl_loss_not_routed_raises(tmp_path_factory, monkeypatch):
    """A TRL whose ``_compute_loss`` no longer calls ``_chunked_divergence_loss`` must not
    train with TRL's loss silently."""
    import trl

    paths = _models(tmp_path_factory, "unrouted")
    zero = torch.zeros(())
    monkeypatch.setattr(trl.DistillationTrainer, "_compute_loss", lambda *a: (zero, zero, zero))
    trainer = fused_trl.DistillationTrainer(
        model=paths[0], teacher_model=paths[1], args=_config(str(tmp_path_factory.mktemp("o"))),
        train_dataset=_dataset(), processing_class=_tokenizer(),
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="_chunked_divergence_loss"):
        trainer._compute_loss(trainer.model, {}, None)


@needs_trl
def test_subclass_under_patch_keeps_its_options(tmp_path_factory, monkeypatch):
    """The fused subclass built while ``patch()`` wraps TRL's ``__init__``: routed once, with
    the subclass's options (its backend runs), and it trains."""
    paths = _models(tmp_path_factory, "nested")
    with fused_trl.patched(backend="triton"):
        _, _, calls, _ = _train(fused_trl.DistillationTrainer, paths,
                                tmp_path_factory.mktemp("o"), monkeypatch,
                                fused_rl_backend="reference")  # fmt: skip
    assert calls.trl == 0 and calls.fused and set(calls.fused) == {"reference"}


@needs_trl
def test_own_loss_subclass_is_left_alone(tmp_path_factory):
    """A subclass with its own ``compute_loss`` (TRL's server distillation) under ``patch()``:
    not routed, with a warning; TRL's own trainer class is untouched."""
    import trl

    class OwnLoss(trl.DistillationTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    paths = _models(tmp_path_factory, "own")
    with fused_trl.patched(), pytest.warns(UserWarning, match="does not route"):
        trainer = OwnLoss(
            model=paths[0], teacher_model=paths[1],
            args=_config(str(tmp_path_factory.mktemp("o"))), train_dataset=_dataset(),
            processing_class=_tokenizer(),
        )  # fmt: skip
    assert not hasattr(trainer, "fused_rl_options")
    assert trainer._compute_loss.__func__ is trl.DistillationTrainer._compute_loss


@needs_trl
def test_dispatcher_beside_other_wrappers():
    """A wrapper put over the dispatcher by someone else stays and reaches it (no
    recursion when a fused trainer installs again); the dispatcher keeps TRL's function
    after ``uninstall()``; ``uninstall()`` then leaves the other wrapper in place."""
    from trl.trainer import distillation_trainer as module

    _trl_distill.uninstall()
    trl_loss = module._chunked_divergence_loss
    inputs = _loss_inputs(4, bias=False)
    want = trl_loss(**inputs, beta=0.5)
    _trl_distill.install()
    dispatch = module._chunked_divergence_loss
    seen = []

    def wrapper(*args, **kwargs):
        seen.append(1)
        return dispatch(*args, **kwargs)

    module._chunked_divergence_loss = wrapper
    try:
        _trl_distill.install()
        assert module._chunked_divergence_loss is wrapper
        got = module._chunked_divergence_loss(**inputs, beta=0.5)
        assert seen and all(torch.equal(a, b) for a, b in zip(want, got))
        _trl_distill.uninstall()
        assert module._chunked_divergence_loss is wrapper
        got = dispatch(**inputs, beta=0.5)  # a reference kept to the dispatcher still works
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    finally:
        module._chunked_divergence_loss = trl_loss


@needs_trl
def test_patch_unpatch_restore_exactly():
    import trl
    from trl.trainer import distillation_trainer as module

    _trl_distill.uninstall()  # a fused trainer's loss call earlier left its dispatcher
    init, loss = trl.DistillationTrainer.__dict__["__init__"], module._chunked_divergence_loss
    assert loss.__module__ == module.__name__
    grpo_init = trl.GRPOTrainer.__dict__["__init__"]
    fused_trl.patch(backend="reference")
    try:
        assert trl.DistillationTrainer.__dict__["__init__"] is not init
        assert trl.GRPOTrainer.__dict__["__init__"] is not grpo_init
    finally:
        fused_trl.unpatch()
    assert trl.DistillationTrainer.__dict__["__init__"] is init
    assert trl.GRPOTrainer.__dict__["__init__"] is grpo_init
    assert module._chunked_divergence_loss is loss
    assert issubclass(fused_trl.DistillationTrainer, trl.DistillationTrainer)
    # outside a fused trainer's loss call the installed dispatcher is TRL's function
    _trl_distill.install()
    try:
        inputs = _loss_inputs(3, bias=False)
        want = loss(**inputs, beta=0.5)
        got = module._chunked_divergence_loss(**inputs, beta=0.5)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    finally:
        _trl_distill.uninstall()
    assert module._chunked_divergence_loss is loss
