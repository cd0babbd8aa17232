"""fused_rl inside TRL's trainers under FSDP2 (2 gloo ranks on CPU; skipped without
TRL >= 1.16): GRPO, RLOO, distillation, DPO, KTO, SFT.

accelerate enables FSDP for accelerator devices only, so each rank runs accelerate's own
FSDP code (``Accelerator.prepare``: ``fully_shard`` of every decoder layer and of the
root, TRL's ``prepare_fsdp`` of the reference model) with the one line accelerate runs on
a GPU to choose it (:func:`_fsdp_on_cpu`). Each configuration trains 3 optimizer steps
(``num_iterations=2``, gradient accumulation 2) from the same seed and weights, as
the single-process tests do: TRL's trainer and fused_rl's (for GRPO its head, the training
loss through fused_rl and the exact KL to the reference model). The exact KL and the
distillation trainer also run under plain data parallelism (DDP), which they must match:
the reference's head is freed by FSDP2 when the reference's forward returns and has to be
gathered again, and the distillation heads are gathered from their DTensors. A second
wrapping makes the LM head an FSDP2 unit of its own, whose gradient fused_rl reduces
itself: those runs must match the runs with the head in the root unit.
"""

from __future__ import annotations

import math
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from test_integration_trl import (
    _dataset,
    _tiny_config,
    _tiny_model,
    _tokenizer,
    compare_logs,
    compare_params,
    reward_w5,
    trl_at_least,
)
from test_integration_trl_distill import _tiny

pytestmark = [
    pytest.mark.skipif(not trl_at_least(1, 16), reason="needs TRL >= 1.16"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed gloo",
    ),
]

WORLD = 2
# name -> (TRL trainer, fused_rl's options: None, or "trl": True, for TRL's own trainer;
# "tied": the tied model; "bf16": the trainer's mixed precision)
RUNS = {
    "grpo/trl": ("GRPOTrainer", None),
    "grpo/head": ("GRPOTrainer", {}),
    "grpo/loss": ("GRPOTrainer", {"fused_rl_loss": True}),
    "grpo/exact_kl": ("GRPOTrainer", {"fused_rl_loss": True, "fused_rl_kl_estimator": "full"}),
    # the reference is the policy with its LoRA adapter off
    "grpo/exact_kl_lora": (
        "GRPOTrainer",
        {"fused_rl_loss": True, "fused_rl_kl_estimator": "full", "peft_config": "lora"},
    ),
    # bf16 mixed precision: FSDP2 gathers bf16 copies of the fp32 parameters for a forward
    "grpo/exact_kl_bf16": (
        "GRPOTrainer",
        {"fused_rl_loss": True, "fused_rl_kl_estimator": "full", "bf16": True},
    ),
    # tied input and output embeddings (the LM head's weight is the embedding's)
    "grpo/trl_tied": ("GRPOTrainer", {"tied": True, "trl": True}),
    "grpo/head_tied": ("GRPOTrainer", {"tied": True}),
    "grpo/exact_kl_tied": (
        "GRPOTrainer",
        {"fused_rl_loss": True, "fused_rl_kl_estimator": "full", "tied": True},
    ),
    "rloo/trl": ("RLOOTrainer", None),
    "rloo/loss": ("RLOOTrainer", {"fused_rl_loss": True}),
    "distill/trl": ("DistillationTrainer", None),
    "distill/fused": ("DistillationTrainer", {}),
    "dpo/trl": ("DPOTrainer", None),
    "dpo/fused": ("DPOTrainer", {}),
    "kto/trl": ("KTOTrainer", None),
    "kto/fused": ("KTOTrainer", {}),
    "sft/trl": ("SFTTrainer", None),
    "sft/fused": ("SFTTrainer", {}),
}


def _fsdp_on_cpu() -> None:
    """What accelerate does on a GPU when an FSDP plugin is given (its state's
    ``distributed_type = FSDP``, the plugin kept), done for the CPU ranks too."""
    import accelerate.state as state

    init = state.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None:
            self.fsdp_plugin = fsdp_plugin
        if self.__dict__.get("fsdp_plugin") is not None:
            self.distributed_type = state.DistributedType.FSDP

    state.AcceleratorState.__init__ = patched


# accelerate's fsdp_config per wrapping (None: DDP)
WRAPS = {
    None: None,
    # every decoder layer a unit; the embeddings, the final norm and the LM head in the root's
    "layers": {
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"], "reshard_after_forward": True,
    },
    # every decoder layer and every Linear a unit: the LM head among them, so its weight is a
    # DTensor in the model's forward (fused_rl gathers it there)
    "linear": {
        "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer", "Linear"],
        "reshard_after_forward": True,
    },
}  # fmt: skip


def _trainer(name: str, cls, out_dir: str, models: dict, wrap: str | None, options: dict):
    """The trainer of run ``name`` (its class ``cls``) as the single-process tests build it."""
    import test_integration_trl_distill as distill
    import test_integration_trl_preference as pref
    import trl

    kind, options = name.split("/")[0], dict(options)
    bf16 = options.pop("bf16", False)  # the trainer's mixed precision, not fused_rl's option
    policy = models["tied" if options.pop("tied", False) else "policy"]
    common = dict(report_to=[], use_cpu=True, seed=0, logging_steps=1,
                  save_strategy="no", disable_tqdm=True, bf16=bf16, max_steps=3,
                  gradient_accumulation_steps=2, learning_rate=1e-3,
                  **(dict(fsdp=True, fsdp_config=WRAPS[wrap]) if wrap else {}))  # fmt: skip
    if options.get("peft_config") == "lora":
        from peft import LoraConfig

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        options = {**options, "peft_config": lora}
    if kind in ("grpo", "rloo"):
        config = trl.GRPOConfig if kind == "grpo" else trl.RLOOConfig
        args = config(output_dir=out_dir, **common, num_generations=2,
                      per_device_train_batch_size=4, max_completion_length=8, num_iterations=2,
                      beta=0.04)  # fmt: skip
        return cls(model=policy, reward_funcs=reward_w5, args=args,
                   train_dataset=_dataset(), processing_class=_tokenizer(), **options)  # fmt: skip
    if kind == "distill":
        args = distill._config(out_dir, **common)
        return cls(model=policy, teacher_model=models["teacher"], args=args,
                   train_dataset=_dataset(), processing_class=_tokenizer(), **options)  # fmt: skip
    trainer_name = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "sft": "SFTTrainer"}[kind]
    args = pref._args(trainer_name, out_dir, **common)
    return cls(model=policy, args=args, train_dataset=pref._dataset(trainer_name),
               processing_class=_tokenizer(), **options)  # fmt: skip


def _worker(rank: int, port: int, models: dict, out_dir: str, wrap, names) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # fmt: skip
    import trl
    import trl.trainer.utils as trl_utils

    import fused_rl.integrations.trl as fused_trl
    import fused_rl.linear as fused_linear

    if wrap:
        _fsdp_on_cpu()
    regathered = []  # one entry per reference head read after its forward: was it freed?
    kept = fused_trl._kept

    def counted(used, param):
        if used is not None:
            regathered.append(fused_trl.freed(used))
        return kept(used, param)

    fused_trl._kept = counted
    heads = {"trl": 0, "fused_rl": 0}  # the fused heads' calls (log-probs from hidden states)
    trl_head = trl_utils._ChunkedLogProbFunction
    fused_head = fused_linear._LinearTokenStats
    trl_apply, fused_apply = trl_head.apply, fused_head.apply

    def count(who, apply):
        def counted_apply(*args):
            heads[who] += 1
            return apply(*args)

        return counted_apply

    trl_head.apply = count("trl", trl_apply)
    fused_head.apply = count("fused_rl", fused_apply)
    results = {}
    for name in names:
        trainer_name, options = RUNS[name]
        options = None if options is None else dict(options)
        own = options is None or options.pop("trl", False)  # TRL's own trainer
        cls = getattr(trl if own else fused_trl, trainer_name)
        regathered.clear()
        heads.update(trl=0, fused_rl=0)
        out = f"{out_dir}/{name.replace('/', '-')}"
        trainer = _trainer(name, cls, out, models, wrap, options or {})
        trainer.train()
        params = {}
        for key, p in trainer.model.named_parameters():  # every rank joins the gathers
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[key] = whole.detach().clone()
        results[name] = dict(
            log=trainer.state.log_history, params=params, regathered=list(regathered),
            wrapped=type(trainer.model_wrapped).__name__, heads=dict(heads),
        )  # fmt: skip
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


def _tied_model():
    """The tiny Qwen2 with its LM head tied to its input embeddings."""
    from transformers import Qwen2ForCausalLM

    config = _tiny_config()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict = {}


def _run(tmp_path_factory, wrap: str | None, names) -> dict:
    """Each of ``names`` trained on ``WORLD`` ranks (FSDP2 wrapped as ``wrap`` names, or
    DDP), once per module."""
    key = (wrap, tuple(names))
    if key not in _RESULTS:
        root = tmp_path_factory.mktemp(f"fsdp-{wrap}" if wrap else "ddp")
        models = {who: str(root / who) for who in ("policy", "tied", "teacher")}
        _tiny_model().save_pretrained(models["policy"])
        _tied_model().save_pretrained(models["tied"])
        _tiny(96, 1).save_pretrained(models["teacher"])  # a wider teacher, as in distillation
        for path in models.values():
            _tokenizer().save_pretrained(path)
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        if tests_dir not in sys.path:
            sys.path.insert(0, tests_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [tests_dir, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        mp.spawn(_worker, args=(_free_port(), models, str(root), wrap, names), nprocs=WORLD)
        _RESULTS[key] = torch.load(root / "results.pt", weights_only=False)
    return _RESULTS[key]


def test_grpo_under_fsdp2_matches_trl(tmp_path_factory):
    """Under FSDP2, fused_rl's head and fused_rl's loss train as TRL's own GRPO trainer does:
    every logged metric (1e-5 absolute + 1e-4 relative) and the final parameters
    (gathered whole, 1e-5)."""
    got = _run(tmp_path_factory, "layers", list(RUNS))
    want = got["grpo/trl"]
    assert want["wrapped"].startswith("FSDP")  # accelerate's fully_shard ran
    assert want["heads"]["trl"] > 0 and want["heads"]["fused_rl"] == 0
    for name in ("grpo/head", "grpo/loss"):
        assert got[name]["heads"]["trl"] == 0 and got[name]["heads"]["fused_rl"] > 0
        compare_logs(want["log"], got[name]["log"])
        compare_params(want["params"], got[name]["params"])


def test_tied_head_under_fsdp2_matches_trl(tmp_path_factory):
    """A tied LM head (its weight the input embeddings') under FSDP2: fused_rl's head trains
    as TRL's, its gradient from the head and from the embedding lookup summed once."""
    got = _run(tmp_path_factory, "layers", list(RUNS))
    want = got["grpo/trl_tied"]
    assert want["heads"]["trl"] > 0 and got["grpo/head_tied"]["heads"]["trl"] == 0
    compare_logs(want["log"], got["grpo/head_tied"]["log"])
    compare_params(want["params"], got["grpo/head_tied"]["params"])


@pytest.mark.parametrize("run", ["rloo/loss", "distill/fused", "dpo/fused", "kto/fused",
                                 "sft/fused"])  # fmt: skip
def test_under_fsdp2_matches_trl(tmp_path_factory, run):
    """TRL's RLOO (fused_rl's loss, with the reference model's KL in the reward),
    distillation (the student's and the teacher's heads gathered from their DTensors), DPO
    (with its reference model), KTO and SFT trainers under FSDP2: fused_rl's trainer as
    TRL's, on every logged metric and the final parameters."""
    got = _run(tmp_path_factory, "layers", list(RUNS))
    want = got[run.split("/")[0] + "/trl"]
    assert want["wrapped"].startswith("FSDP")
    compare_logs(want["log"], got[run]["log"])
    compare_params(want["params"], got[run]["params"])


def test_exact_kl_under_fsdp2_bf16(tmp_path_factory):
    """Under FSDP2's bf16 mixed precision the reference's head is gathered again from its
    fp32 shards and cast to the bf16 its forward used: at the first step, where the policy
    is the reference, the exact KL is exactly 0 (the two heads equal to the bit), then
    positive; every logged number finite."""
    got = _run(tmp_path_factory, "layers", list(RUNS))["grpo/exact_kl_bf16"]
    assert got["regathered"] and all(got["regathered"])
    kls = [entry["kl"] for entry in got["log"] if "kl" in entry]
    assert len(kls) == 3 and kls[0] == 0.0 and kls[-1] > 0
    numbers = [v for entry in got["log"] for v in entry.values() if isinstance(v, float)]
    assert all(math.isfinite(v) for v in numbers)


DDP_RUNS = ["grpo/exact_kl", "grpo/exact_kl_lora", "grpo/exact_kl_tied", "distill/fused"]


def test_distill_under_fsdp2_matches_ddp(tmp_path_factory):
    """fused_rl's distillation trainer under FSDP2 trains as under DDP: the heads it gathers
    from their DTensors take their gradients as DDP's do."""
    fsdp = _run(tmp_path_factory, "layers", list(RUNS))["distill/fused"]
    ddp = _run(tmp_path_factory, None, DDP_RUNS)["distill/fused"]
    compare_logs(ddp["log"], fsdp["log"])
    compare_params(ddp["params"], fsdp["params"])


@pytest.mark.parametrize("run", ["grpo/exact_kl", "grpo/exact_kl_lora", "grpo/exact_kl_tied"])
def test_exact_kl_under_fsdp2_matches_ddp(tmp_path_factory, run):
    """``fused_rl_kl_estimator="full"`` under FSDP2 trains as under DDP (every metric, the
    final parameters), with a reference model and under LoRA (the policy with its adapter
    off); FSDP2 freed the reference model's head (TRL's ``prepare_fsdp``) after each of its
    forwards and fused_rl gathered it again, which DDP never needs (under LoRA the
    reference's head is the policy's, which accelerate's FSDP2 keeps); the exact KL is 0 at
    the first step (the policy is the reference) and positive after."""
    if "lora" in run:
        pytest.importorskip("peft")
    fsdp = _run(tmp_path_factory, "layers", list(RUNS))[run]
    ddp = _run(tmp_path_factory, None, DDP_RUNS)[run]
    assert fsdp["wrapped"].startswith("FSDP") and not ddp["wrapped"].startswith("FSDP")
    if run == "grpo/exact_kl":  # TRL's prepare_fsdp of the reference frees it (not the policy)
        assert fsdp["regathered"] and all(fsdp["regathered"])
    assert ddp["regathered"] and not any(ddp["regathered"])
    compare_logs(ddp["log"], fsdp["log"])
    compare_params(ddp["params"], fsdp["params"])
    kls = [entry["kl"] for entry in fsdp["log"] if "kl" in entry]
    assert len(kls) == 3 and kls[0] == 0.0 and kls[-1] > 0


LINEAR_RUNS = ["grpo/head", "grpo/loss", "grpo/exact_kl", "distill/fused"]


@pytest.mark.parametrize("run", LINEAR_RUNS)
def test_head_its_own_fsdp2_unit(tmp_path_factory, run):
    """The LM head an FSDP2 unit of its own (as every Linear): FSDP2 never gathers it (its
    forward never runs), so it is a DTensor in the model's forward, and its gradient is
    reduced by fused_rl (``fused_rl.distributed.gather_param``), not by FSDP2. Every logged
    metric and the final parameters as with the head in the root unit (where FSDP2 reduces
    it, and which the tests above hold to TRL's trainer and DDP)."""
    got = _run(tmp_path_factory, "linear", LINEAR_RUNS)[run]
    want = _run(tmp_path_factory, "layers", list(RUNS))[run]
    compare_logs(want["log"], got["log"])
    compare_params(want["params"], got["params"])
