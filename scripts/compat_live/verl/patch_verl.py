"""pytest plugin (``-p patch_verl``): replace verl's functions by fused_rl.compat.verl's before
verl's own tests import them, so those tests run against the adapter.

Patched: the module attributes of ``verl.trainer.ppo.core_algos`` and
``verl.utils.torch_functional`` that the adapter mirrors (verl's other functions call them
through those modules, so they see the adapter too) and the registry entries ``"gae"`` /
``"grpo"`` (advantage estimators) and ``"vanilla"`` (policy loss).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the kernels through the Triton interpreter, as in CI
    os.environ.setdefault("TRITON_INTERPRET", "1")

import verl.trainer.ppo.core_algos as core_algos  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402

from fused_rl.compat import verl as fused  # noqa: E402

CORE_ALGOS = (
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_value_loss",
    "compute_entropy_loss",
    "kl_penalty",
    "kl_penalty_forward",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
)
TORCH_FUNCTIONAL = (
    "logprobs_from_logits",
    "entropy_from_logits",
    "clip_by_value",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
)
PATCHED = [f"core_algos.{n}" for n in CORE_ALGOS] + [f"verl_F.{n}" for n in TORCH_FUNCTIONAL]

for _name in CORE_ALGOS:
    setattr(core_algos, _name, getattr(fused, _name))
for _name in TORCH_FUNCTIONAL:
    setattr(verl_F, _name, getattr(fused, _name))
core_algos.ADV_ESTIMATOR_REGISTRY["gae"] = fused.compute_gae_advantage_return
core_algos.ADV_ESTIMATOR_REGISTRY["grpo"] = fused.compute_grpo_outcome_advantage
core_algos.POLICY_LOSS_REGISTRY["vanilla"] = fused.compute_policy_loss_vanilla


def pytest_report_header(config):
    return f"fused_rl.compat.verl patched into verl: {', '.join(PATCHED)}"
