"""fused_rl.integrations.trl's ``AsyncGRPOTrainer`` against TRL's own (TRL 1.16's
experimental ``trl.experimental.async_grpo``; skipped without it).

Proven by training: TRL's trainer takes its rollouts from a ``rollout_worker`` and syncs
weights through a ``weight_transfer`` (both protocols it documents for custom backends), so
here an in-process worker hands it a fixed stream of scored completions (groups sharing a
prompt, so the packed rows are prefix trees) and a no-op sync stands in for the vLLM server.
Its tree attention calls FlashAttention-3 from the hub, which a CPU cannot run: the test
puts a plain-PyTorch varlen attention (bottom-right causal, as FlashAttention's) in its place
for both runs. The tiny Qwen2 model and the tokenizer are built in code (no download). TRL's
trainer and fused_rl's (the subclass, and TRL's own under ``patch()``) train 3 optimizer
steps from the same weights and rollouts: every logged metric but the wall-clock ones and
the final parameters must agree; TRL's chunked head must never run in fused_rl's, fused_rl's
linear op on every fused forward."""

from __future__ import annotations

import math
import queue
import types

import pytest
import torch
import torch.nn.functional as F
from test_integration_trl import (
    TIMING_KEYS,
    VOCAB,
    Calls,
    _tiny_model,
    _tokenizer,
    check_against_trl,
    needs_trl,
    run_integrated,
    trained,
)

import fused_rl.integrations.trl as fused_trl


def _async_module():
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's notice that the API is experimental
            from trl.experimental.async_grpo import async_grpo_trainer
    except ImportError:
        return None
    return async_grpo_trainer if hasattr(async_grpo_trainer, "add_fused_lm_head") else None


needs_async = pytest.mark.skipif(
    _async_module() is None, reason="needs TRL's trl.experimental.async_grpo (TRL >= 1.16)"
)
PROMPT, GROUPS, PER_GROUP = 5, 12, 4  # enough rollouts for 3 steps of 64-token rows


def _varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=True,
                      window_size=(-1, -1), **_):  # fmt: skip
    """FlashAttention's ``flash_attn_varlen_func`` in plain PyTorch: segment ``i``'s queries
    ``q[cu_q[i]:cu_q[i+1]]`` against its keys ``k[cu_k[i]:cu_k[i+1]]`` (grouped-query heads
    repeated), causal aligned bottom-right (the last query sees every key)."""
    assert causal and tuple(window_size) == (-1, -1)
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
        ks, vs = (x[cu_k[i] : cu_k[i + 1]].repeat_interleave(rep, 1).transpose(0, 1)
                  for x in (k, v))  # fmt: skip
        n_q, n_k = qs.shape[1], ks.shape[1]
        seen = torch.arange(n_k)[None] <= torch.arange(n_q)[:, None] + (n_k - n_q)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, scale=softmax_scale)
        out[cu_q[i] : cu_q[i + 1]] = o.transpose(0, 1)
    return out


class _Rollouts:
    """TRL's ``RolloutWorkerProtocol`` in process: a queue holding every rollout from the
    start (advantages and generator log-probs drawn once, the same for both runs)."""

    def __init__(self):
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        self.rollout_buffer, self.metrics_queue = queue.Queue(), queue.Queue()
        g = torch.Generator().manual_seed(0)
        for group in range(GROUPS):
            prompt = torch.randint(2, VOCAB, (PROMPT,), generator=g).tolist()
            for _ in range(PER_GROUP):
                n = int(torch.randint(3, 9, (1,), generator=g))
                ids = prompt + torch.randint(2, VOCAB, (n,), generator=g).tolist()
                old = torch.randn(len(ids), generator=g) * 0.1 - math.log(VOCAB)
                self.rollout_buffer.put(RolloutSample(
                    prompt=[{"role": "user", "content": ""}],
                    completion=[{"role": "assistant", "content": ""}],
                    input_ids=torch.tensor(ids).numpy(),
                    completion_mask=torch.tensor([0] * PROMPT + [1] * n).numpy(),
                    old_log_probs=old.numpy(), advantage=float(torch.randn((), generator=g)),
                    model_version=0, group_id=group, metrics={},
                ))  # fmt: skip

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, model_version):
        pass

    def check_health(self, stale_after_s):
        if self.rollout_buffer.empty():
            raise RuntimeError("the test's rollouts ran out")


class _NoSync:
    """TRL's ``WeightTransferProtocol`` with no server to send the weights to."""

    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def _wall_clock(key: str) -> bool:
    return key.startswith("perf/") or key in TIMING_KEYS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_async")
    _tiny_model().save_pretrained(path)
    return str(path)


def _train(trainer_cls, model_dir, tmp_path, monkeypatch, **trainer_kwargs):
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, packing

    module = _async_module()
    with monkeypatch.context() as ctx:
        kernels = types.SimpleNamespace(flash_attn_varlen_func=_varlen_attention)
        ctx.setattr(packing, "_flash_attn", lambda: kernels)
        ctx.setattr(module, "get_peak_flops_per_device", lambda *a: None)  # asks CUDA
        calls = Calls(ctx)
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
            token_budget=64, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", seed=0, dtype="float32", bf16=False, disable_tqdm=True,
        )  # fmt: skip
        trainer = trainer_cls(
            model=model_dir, reward_funcs=[], args=args,
            train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * 4}),
            processing_class=_tokenizer(), rollout_worker=_Rollouts(), weight_transfer=_NoSync(),
            **trainer_kwargs,
        )  # fmt: skip
        return trained(trainer, calls)


_BASELINE: list = []


@needs_async
@pytest.mark.parametrize("how, backend", [("subclass", "auto"), ("patch", "reference")])
def test_async_training_matches_trl(model_dir, tmp_path, tmp_path_factory, monkeypatch, how,
                                    backend):  # fmt: skip
    if not _BASELINE:
        path = tmp_path_factory.mktemp("async_baseline")
        _BASELINE.append(_train(_async_module().AsyncGRPOTrainer, model_dir, path, monkeypatch))
    want_log, want_params, want_calls, want_s = _BASELINE[0]
    assert {"kl", "entropy", "clip_ratio/region_mean"} <= set(want_log[0])
    train = lambda cls, **kw: _train(cls, model_dir, tmp_path, monkeypatch, **kw)  # noqa: E731
    got = run_integrated(train, "AsyncGRPOTrainer", how, backend, want_calls)
    # tighter than the other trainers' bound: the largest difference seen is 7e-7 relative
    check_against_trl(got, want_log, want_params, f"async {how} {backend}; TRL {want_s:.1f}s",
                      timing=_wall_clock, atol=1e-6, rtol=1e-5)  # fmt: skip


@needs_trl
def test_a_trl_without_the_trainer(monkeypatch):
    """A TRL without the experimental trainer: naming it raises an ImportError that says
    so; ``patch()`` wraps the trainers it has and skips it."""
    monkeypatch.setitem(fused_trl.HEAD_TRAINERS, "AsyncGRPOTrainer", "trl.experimental.absent")
    with pytest.raises(ImportError, match=r"has no AsyncGRPOTrainer \(trl\.experimental\.absent\)"):
        fused_trl._trainer_module("AsyncGRPOTrainer")
    with fused_trl.patched():
        assert fused_trl.is_patched()
    assert not fused_trl.is_patched()


@needs_async
def test_tree_call_matches_unpacked_forward(monkeypatch):
    """The stand-in attention and fused_rl's head on the packed call: rollouts packed into
    one prefix-tree row (TRL's ``TreeRow``), forwarded once through the tree attention,
    give each trained token the log-prob and entropy of its own sample forwarded alone
    (eager attention, no packing), within 1e-5."""
    from trl.experimental.async_grpo import packing

    kernels = types.SimpleNamespace(flash_attn_varlen_func=_varlen_attention)
    monkeypatch.setattr(packing, "_flash_attn", lambda: kernels)
    packing.register_tree_attention()
    tree, plain = _tiny_model(), _tiny_model()
    tree.set_attn_implementation(packing.TREE_ATTENTION)
    plain.set_attn_implementation("eager")
    for model in (tree, plain):
        fused_trl.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"),
                                    backend="reference")  # fmt: skip
    row, rollouts = packing.TreeRow(), _Rollouts()
    for _ in range(2 * PER_GROUP):  # two prompts, each shared by its completions
        s = rollouts.rollout_buffer.get()
        fields = ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id")
        row.add({name: getattr(s, name) for name in fields})
    p = row.pack()
    assert len(p["input_ids"]) < sum(len(s["input_ids"]) for s in row.samples)  # shared
    with torch.no_grad():
        out = tree(
            input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
            shift_labels=p["shift_labels"][None], fused_lm_head=True,
            tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=p["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(p["tree_max_seqlens"][1]),
        )  # fmt: skip
        want = {"log_probs": [], "entropy": []}
        for sample in row.samples:
            ids = torch.as_tensor(sample["input_ids"])[None]
            labels = ids.masked_fill(~torch.as_tensor(sample["completion_mask"]).bool(), -100)
            alone = plain(input_ids=ids, labels=labels, fused_lm_head=True)
            counted = labels[0, 1:] != -100
            for field, values in want.items():
                values.append(getattr(alone, field)[0][counted])
    for field, values in want.items():
        got = getattr(out, field).flatten()[p["token_index"]]
        torch.testing.assert_close(got, torch.cat(values), atol=1e-5, rtol=1e-5, msg=field)
