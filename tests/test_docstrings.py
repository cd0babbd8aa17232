"""Every docstring example in the public modules runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
    "fused_rl._backend",
    "fused_rl._describe",
    "fused_rl._mixture_poly",
    "fused_rl._ops",
    "fused_rl.logprobs",
    "fused_rl.losses",
    "fused_rl.linear",
    "fused_rl.distill",
    "fused_rl.linear_distill",
    "fused_rl.truncated",
    "fused_rl.nn",
    "fused_rl.values",
    "fused_rl.kl",
    "fused_rl.reductions",
    "fused_rl.advantages",
    "fused_rl.continuous",
    "fused_rl.rollout",
    "fused_rl.compat.ding",
    "fused_rl.compat.ding_v053",
    "fused_rl.compat.torchtune",
    "fused_rl.compat.trl",
    "fused_rl.compat.verl",
    "fused_rl.compat.verl.torch_functional",
    "fused_rl.compat.verl.core_algos",
    "fused_rl.compat.verl.policy_loss",
    "fused_rl.compat.verl.policy_loss_composed",
    "fused_rl.compat.verl.kernel_linear_cross_entropy",
    "fused_rl.compat.verl.experimental_torch_functional",
    "fused_rl.compat.verl.legacy_v05",
    "fused_rl.policy_config",
    "fused_rl.compat.liger",
    "fused_rl.reference.clamp",
]


@pytest.mark.no_poison
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0
