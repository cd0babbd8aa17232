"""fused_rl inside TRL's ``GRPOTrainer`` under FSDP2 (2 gloo ranks on CPU; skipped without
TRL >= 1.16).

accelerate enables FSDP for accelerator devices only, so each rank runs accelerate's own
FSDP code (``Accelerator.prepare``: ``fully_shard`` of every decoder layer and of the
root, TRL's ``prepare_fsdp`` of the reference model) with the one line accelerate runs on
a GPU to choose it (:func:`_fsdp_on_cpu`). Each configuration trains 3 optimizer steps
(``num_iterations=2``, gradient accumulation 2) from the same seed and weights, as
``tests/test_integration_trl.py`` does in one process: TRL's trainer, fused_rl's head, the
training loss through fused_rl and the exact KL to the reference model; the last also
under plain data parallelism (DDP), which it must match, since its reference head is freed
by FSDP2 when the reference's forward returns and has to be gathered again.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp
from test_integration_trl import (
    _dataset,
    _tiny_model,
    _tokenizer,
    compare_logs,
    compare_params,
    reward_w5,
)


def _trl_ok() -> bool:
    try:
        import trl
        from packaging.version import Version
    except ImportError:
        return False
    return Version(trl.__version__).release[:2] >= (1, 16)


pytestmark = [
    pytest.mark.skipif(not _trl_ok(), reason="needs TRL >= 1.16"),
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed gloo",
    ),
]

WORLD = 2
# name -> fused_rl trainer options (None: TRL's own GRPOTrainer)
RUNS = {
    "trl": None,
    "head": {},
    "loss": {"fused_rl_loss": True},
    "exact_kl": {"fused_rl_loss": True, "fused_rl_kl_estimator": "full"},
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


def _config(out_dir: str, fsdp: bool):
    import trl

    extra = {}
    if fsdp:
        extra = dict(fsdp=True, fsdp_config={
            "version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"], "reshard_after_forward": True,
        })  # fmt: skip
    return trl.GRPOConfig(
        output_dir=out_dir, max_steps=3, num_generations=2, per_device_train_batch_size=4,
        max_completion_length=8, num_iterations=2, gradient_accumulation_steps=2, beta=0.04,
        learning_rate=1e-3, report_to=[], use_cpu=True, seed=0, logging_steps=1,
        save_strategy="no", disable_tqdm=True, bf16=False, **extra,
    )  # fmt: skip


def _worker(rank: int, port: int, model_dir: str, out_dir: str, fsdp: bool, names) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # fmt: skip
    os.environ["TRITON_INTERPRET"] = "1"
    import trl

    import fused_rl.integrations.trl as fused_trl

    if fsdp:
        _fsdp_on_cpu()
    regathered = []  # one entry per reference head read after its forward: was it freed?
    kept = fused_trl._kept

    def counted(used, param):
        if used is not None:
            regathered.append(used.numel() > 0 and used.untyped_storage().nbytes() == 0)
        return kept(used, param)

    fused_trl._kept = counted
    results = {}
    for name in names:
        options = RUNS[name]
        cls = trl.GRPOTrainer if options is None else fused_trl.GRPOTrainer
        regathered.clear()
        trainer = cls(
            model=model_dir, reward_funcs=reward_w5, args=_config(f"{out_dir}/{name}", fsdp),
            train_dataset=_dataset(), processing_class=_tokenizer(), **(options or {}),
        )  # fmt: skip
        trainer.train()
        params = {}
        for key, p in trainer.model.named_parameters():  # every rank joins the gathers
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[key] = whole.detach().clone()
        results[name] = dict(
            log=trainer.state.log_history, params=params, regathered=list(regathered),
            wrapped=type(trainer.model_wrapped).__name__,
        )  # fmt: skip
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RESULTS: dict = {}


def _run(tmp_path_factory, fsdp: bool, names) -> dict:
    """Each of ``names`` trained on ``WORLD`` ranks (FSDP2 or DDP), once per module."""
    key = (fsdp, tuple(names))
    if key not in _RESULTS:
        root = tmp_path_factory.mktemp("fsdp" if fsdp else "ddp")
        model_dir = str(root / "model")
        _tiny_model().save_pretrained(model_dir)
        _tokenizer().save_pretrained(model_dir)
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        if tests_dir not in sys.path:
            sys.path.insert(0, tests_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [tests_dir, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        mp.spawn(_worker, args=(_free_port(), model_dir, str(root), fsdp, names), nprocs=WORLD)
        _RESULTS[key] = torch.load(root / "results.pt", weights_only=False)
    return _RESULTS[key]


def test_grpo_under_fsdp2_matches_trl(tmp_path_factory):
    """Under FSDP2, fused_rl's head and fused_rl's loss train as TRL's own trainer does:
    every logged metric (1e-5 absolute + 1e-4 relative) and the final parameters
    (gathered whole, 1e-5)."""
    got = _run(tmp_path_factory, True, list(RUNS))
    want = got["trl"]
    assert want["wrapped"].startswith("FSDP")  # accelerate's fully_shard ran
    for name in ("head", "loss"):
        compare_logs(want["log"], got[name]["log"])
        compare_params(want["params"], got[name]["params"])


def test_exact_kl_under_fsdp2_matches_ddp(tmp_path_factory):
    """``fused_rl_kl_estimator="full"`` under FSDP2 trains as under DDP (every metric, the
    final parameters); FSDP2 freed the reference's head after each of its forwards and
    fused_rl gathered it again, which DDP never needs; the exact KL is 0 at the first step
    (the policy is the reference) and positive after."""
    fsdp = _run(tmp_path_factory, True, list(RUNS))["exact_kl"]
    ddp = _run(tmp_path_factory, False, ["exact_kl"])["exact_kl"]
    assert fsdp["wrapped"].startswith("FSDP") and not ddp["wrapped"].startswith("FSDP")
    assert fsdp["regathered"] and all(fsdp["regathered"])
    assert ddp["regathered"] and not any(ddp["regathered"])
    compare_logs(ddp["log"], fsdp["log"])
    compare_params(ddp["params"], fsdp["params"])
    kls = [entry["kl"] for entry in fsdp["log"] if "kl" in entry]
    assert len(kls) == 3 and kls[0] == 0.0 and kls[-1] > 0
