"""fused_rl's head inside TRL 1.16's ``DPOTrainer``, ``KTOTrainer`` and ``SFTTrainer``
(skipped without TRL >= 1.16).

Those trainers compute their log-probs with TRL's fused head and ask it for per-token
statistics beside them: ``mean_logits`` (DPO's and KTO's ``logits/*`` metrics), ``is_top1``
(DPO's and SFT's ``mean_token_accuracy``) and ``log_sum_sq_probs`` (DPO's WPO weights,
``use_weighting=True``). fused_rl's head computes all of them from one read of each chunk's
logits (``fused_rl.linear_token_stats``).

Proven by training: a tiny Qwen2 built from a config, a word-level tokenizer built in code,
in-memory datasets, 3 optimizer steps by TRL's trainer and by fused_rl's (the subclass, or
TRL's class under ``patched()``) from the same seed and weights: every logged metric per
step within 1e-5 absolute + 1e-4 relative, the parameters within 1e-5; TRL's chunked head
never runs in fused_rl's trainer, fused_rl's op on every call TRL made in its own run. Also
the head alone against TRL's head on every output (values, gradients)."""

from __future__ import annotations

import pytest
import torch
from test_integration_trl import (
    Calls,
    _assert_heads_agree,
    _head_pair,
    _inputs,
    _tiny_model,
    _tokenizer,
    check_against_trl,
    run_integrated,
    trained,
    trl_at_least,
)

import fused_rl.integrations.trl as fused_trl

pytestmark = pytest.mark.skipif(not trl_at_least(1, 16), reason="needs TRL >= 1.16")

TRAINERS = ("DPOTrainer", "KTOTrainer", "SFTTrainer")


def _words(i, n):
    return " ".join(f"w{(5 * i + 3 * j) % 200 + 2}" for j in range(n))


def _dataset(name):
    from datasets import Dataset

    rows = range(8)
    if name == "SFTTrainer":  # prompt-completion: the loss on the completion only
        completions = [_words(i + 9, 2 + i % 4) for i in rows]
        return Dataset.from_dict({"prompt": [_words(i, 3 + i % 3) for i in rows],
                                  "completion": completions})  # fmt: skip
    if name == "KTOTrainer":  # unpaired: desirable and undesirable completions
        return Dataset.from_dict({"prompt": [_words(i, 3 + i % 2) for i in rows],
                                  "completion": [_words(i + 7, 2 + i % 3) for i in rows],
                                  "label": [i % 2 == 0 for i in rows]})  # fmt: skip
    return Dataset.from_dict({"prompt": [_words(i, 3 + i % 2) for i in rows],
                              "chosen": [_words(i + 4, 2 + i % 3) for i in rows],
                              "rejected": [_words(i + 11, 3 + i % 2) for i in rows]})  # fmt: skip


def _args(name, out_dir, **extra):
    import trl

    # Adam's epsilon 1e-6, not 1e-8: its step's sensitivity to a gradient entry, at most
    # lr / eps, peaks where the entry is near eps. With 1e-8, an lm_head entry of 2.4e-9
    # whose two runs' fp32 sums differed by 2.2e-10 (9% of it, 2.4e-9 of the largest entry)
    # ended 1.5e-5 apart after 3 steps (DPO, WPO + IPO); docs/compat.md has the numbers.
    common = dict(
        output_dir=out_dir, max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
        report_to=[], use_cpu=True, seed=0, logging_steps=1, save_strategy="no",
        disable_tqdm=True, bf16=False, gradient_accumulation_steps=2, max_length=32,
        adam_epsilon=1e-6,
    )  # fmt: skip
    return getattr(trl, name.replace("Trainer", "Config"))(**{**common, **extra})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_pref")
    _tiny_model().save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _train(cls, name, model_dir, tmp_path, monkeypatch, case, **trainer_kwargs):

    with monkeypatch.context() as ctx:
        calls = Calls(ctx)
        trainer = cls(
            model=model_dir, args=_args(name, str(tmp_path / "out"), **case),
            train_dataset=_dataset(name), processing_class=_tokenizer(), **trainer_kwargs,
        )  # fmt: skip
        return trained(trainer, calls)


CASES = [
    pytest.param("DPOTrainer", dict(beta=0.1), "subclass", "auto", id="dpo"),
    # WPO's weights read log sum p^2; an IPO loss; patch() on TRL's own class
    pytest.param(
        "DPOTrainer",
        dict(use_weighting=True, loss_type=["ipo"]),
        "patch",
        "auto",
        id="dpo-wpo-ipo-patch",
    ),  # fmt: skip
    pytest.param("DPOTrainer", dict(beta=0.1), "subclass", "reference", id="dpo-reference"),
    pytest.param("KTOTrainer", dict(beta=0.1), "subclass", "auto", id="kto"),
    pytest.param("KTOTrainer", dict(beta=0.1), "patch", "reference", id="kto-patch-reference"),
    pytest.param("SFTTrainer", dict(), "subclass", "auto", id="sft"),
    pytest.param("SFTTrainer", dict(loss_type="dft"), "patch", "auto", id="sft-dft-patch"),
]


@pytest.mark.parametrize("name, case, how, backend", CASES)
def test_training_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, name, case,
                              how, backend):  # fmt: skip
    import trl

    base = tmp_path_factory.mktemp("baseline")
    want_log, want_params, want_calls, want_s = _train(
        getattr(trl, name), name, model_dir, base, monkeypatch, case
    )
    if name != "SFTTrainer":
        assert any(k.startswith("logits/") for k in want_log[0]), sorted(want_log[0])
    if name != "KTOTrainer":
        assert "mean_token_accuracy" in want_log[0], sorted(want_log[0])
    train = lambda cls, **kw: _train(cls, name, model_dir, tmp_path, monkeypatch, case, **kw)  # noqa: E731
    got = run_integrated(train, name, how, backend, want_calls)
    check_against_trl(got, want_log, want_params, f"{name} {case} {how} {backend}; "
                      f"TRL {want_s:.1f}s")  # fmt: skip


# ----------------------------------------------------------------------------- the head


@pytest.mark.parametrize("outputs", [
    ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
    ("log_probs", "is_top1"),
    ("log_probs", "mean_logits"),
], ids=["all", "is_top1", "mean_logits"])  # fmt: skip
@pytest.mark.parametrize("softcap", [None, 7.0], ids=["plain", "softcap"])
def test_head_matches_trl_on_every_output(outputs, softcap):
    """One fused forward of each head on the same batch (padding, ``-100`` labels): every
    field TRL's head returns, fused_rl's returns with the same values (``is_top1`` equal,
    the rest within 1e-5 + 1e-4 rel), gradients of the loss equal; the fields not asked
    for are None in both."""
    extra = {} if softcap is None else dict(final_logit_softcapping=softcap)
    model = _tiny_model(**extra)
    with torch.no_grad():  # ids 7 and 9 tie at the top of most rows: argmax is 7, not 9
        model.lm_head.weight[7, 0] = 2.0
        model.lm_head.weight[9] = model.lm_head.weight[7]
    theirs, ours = _head_pair(model, dict(outputs=outputs))
    ids, attention, labels = _inputs()
    labels[:, 5], labels[:, 6] = 9, 7
    out_t, out_o = _assert_heads_agree(theirs, ours, ids, attention, labels)
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1", "entropy"):
        a, b = getattr(out_t, name), getattr(out_o, name)
        if name not in outputs:
            assert a is None and b is None, name
        elif name == "is_top1":
            assert b.dtype == torch.bool and torch.equal(a, b)
            assert a[:, 4].sum() == 0 and a[:, 5].sum() >= 2  # outputs are shifted by one
        else:
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4, msg=name)


def test_trainers_take_only_the_head_options(model_dir, tmp_path):
    """DPO / KTO / SFT take ``fused_rl_backend`` and ``fused_rl_chunk_tokens``; TRL's loss
    stays (``fused_rl_loss`` is GRPO's and RLOO's); a bad option names itself."""
    for name in TRAINERS:
        cls = getattr(fused_trl, name)
        with pytest.raises(TypeError, match="fused_rl_loss"):
            cls(model=model_dir, args=_args(name, str(tmp_path)), fused_rl_loss=True,
                train_dataset=_dataset(name), processing_class=_tokenizer())  # fmt: skip
        with pytest.raises(ValueError, match="fused_rl_chunk_tokens"):
            cls(model=model_dir, args=_args(name, str(tmp_path)), fused_rl_chunk_tokens=0,
                train_dataset=_dataset(name), processing_class=_tokenizer())  # fmt: skip
    trainer = fused_trl.SFTTrainer(
        model=model_dir, args=_args("SFTTrainer", str(tmp_path)), fused_rl_chunk_tokens=5,
        train_dataset=_dataset("SFTTrainer"), processing_class=_tokenizer(),
    )  # fmt: skip
    assert trainer.fused_rl_options.chunk_tokens == 5
    head = vars(trainer.model)[fused_trl._MARK]
    assert head.diagnostics == ("is_top1",) and head.entropy
    # patch(loss=True) routes GRPO's and RLOO's loss; these trainers keep TRL's
    with fused_trl.patched(loss=True, kl_estimator="full"):
        import trl

        trainer = trl.SFTTrainer(
            model=model_dir, args=_args("SFTTrainer", str(tmp_path)),
            train_dataset=_dataset("SFTTrainer"), processing_class=_tokenizer(),
        )  # fmt: skip
    assert not trainer.fused_rl_options.loss
    assert trainer.fused_rl_options.kl_estimator == "k3"


def test_bench_e2e_parity(tmp_path):
    """``bench/e2e_trl_pref.py`` at its tiny shape: fused_rl's SFT and DPO trainers step
    from the same weights on the same batch to TRL's loss and gradient norm."""
    import json

    from bench import e2e_trl_pref

    out = tmp_path / "e2e.json"
    assert e2e_trl_pref.main(["--device", "cpu", "--tiny", "--out", str(out)]) == 0
    results = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(results) == sorted(e2e_trl_pref.VARIANTS)
    for kind in ("sft", "dpo"):
        want, got = results[f"{kind}_trl"], results[f"{kind}_fused_rl"]
        assert got["tokens"] == want["tokens"] > 0
        assert abs(got["loss"] - want["loss"]) <= 1e-5 + 1e-4 * abs(want["loss"]), kind
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-4 * want["grad_norm"], kind
