"""The end-to-end example: GRPO and PPO on a tiny LM with seed-style losses and with
``fused_rl.compat.ding`` swapped in give the same losses and the same trained weights."""

import importlib.util
import pathlib

import pytest
import torch

# an integration test (subprocess / CLI / compile): `pytest -m 'not integration'` skips it
pytestmark = pytest.mark.integration

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_tiny_lm.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fused_run_matches_seed_style_run(example):
    from fused_rl.compat import ding

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref_losses, ref_params = example.run(example.SeedStyle, 2, 2, epochs=1, device=device)
    losses, params = example.run(ding, 2, 2, epochs=1, device=device)

    assert [row[:3] for row in losses] == [
        ("GRPO", 0, 0), ("GRPO", 1, 0), ("PPO", 2, 0), ("PPO", 3, 0)
    ]  # fmt: skip
    # identical rollouts: the sampled rewards agree exactly
    assert [r for *_, r in losses] == [r for *_, r in ref_losses]
    for (_, step, _, loss, _), (*_, ref_loss, _) in zip(losses, ref_losses):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7), step
    assert example.max_param_rel_diff(params, ref_params) < 1e-5
    # training moved the weights: the comparison is not vacuous
    torch.manual_seed(0)
    init = example.TinyCausalLM().state_dict()
    assert example.max_param_rel_diff(params, {k: v.to(device) for k, v in init.items()}) > 1e-3


def test_main_prints_both_curves(example, capsys):
    assert example.main(["--grpo-steps", "1", "--ppo-steps", "1", "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "seed-style loss" in line)
    assert header.split() == [
        "algo", "step", "epoch", "reward", "seed-style", "loss", "fused_rl", "loss", "rel", "diff"
    ]  # fmt: skip
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["GRPO"], ["PPO"])]
    assert [r[:3] for r in rows] == [["GRPO", "0", "0"], ["PPO", "1", "0"]]
    assert all(float(r[-1]) < 1e-4 for r in rows)  # the rel diff column
    assert "agree: both must stay below 0.0001" in out
