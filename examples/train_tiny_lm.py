"""Train a tiny causal LM with GRPO and PPO twice: once with seed-style loss code, once with
fused_rl swapped in by ONE import, and show that both runs agree.

    python examples/train_tiny_lm.py                 # 4 GRPO + 4 PPO steps, < 2 min on CPU
    python examples/train_tiny_lm.py --grpo-steps 2 --ppo-steps 2

The losses are DI-engine main's: ``grpo_policy_error`` for GRPO, ``ppo_error`` (clipped
policy + clipped value + entropy + k3 KL to a frozen reference) for PPO. The training loop
below only ever calls ``rl.<name>``; the two runs differ in what ``rl`` is:

* :class:`SeedStyle` (in this file): the usual eager code, ``log_softmax -> gather -> ratio ->
  clip -> mean``, materialising normalised ``(B, S, V)`` copies of every logits tensor;
* ``fused_rl.compat.ding``: the same functions on fused_rl's kernels (one streaming pass over
  the logits forward, one backward)::

      from fused_rl.compat import ding as rl
      # DI-engine: ppo_data / ppo_error from ding.rl_utils, grpo_policy_data /
      # grpo_policy_error from ding.rl_utils.grpo; fused_rl.compat.ding exports both

Everything else (model, sampling, rewards, advantages, optimiser) is shared. The model is a
2-layer transformer (d=32, V=97) initialised from a seed: no downloads. Without CUDA the script
sets ``TRITON_INTERPRET=1`` before importing fused_rl, so the real Triton kernels run on CPU
through the Triton interpreter. SGD keeps the comparison honest: Adam's per-coordinate
normalisation would turn last-bit differences in near-zero gradients into O(lr) steps.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import namedtuple

import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fused_rl is imported

VOCAB, D_MODEL, N_LAYERS, N_HEADS = 97, 32, 2, 2
PROMPT_LEN, GEN_LEN, GROUP = 4, 8, 4
EOS = 0
TOLERANCE = 1e-4  # fp32 training runs that differ only in summation order stay far below


# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, heads, t, d_head)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """Token + position embeddings, ``N_LAYERS`` blocks, an LM head and a value head."""

    def __init__(self, max_len: int = PROMPT_LEN + GEN_LEN):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(max_len, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, N_HEADS) for _ in range(N_LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB)
        self.value_head = nn.Linear(D_MODEL, 1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        return self.lm_head(x), self.value_head(x)[..., 0]


# ----------------------------------------------------------------------------- seed-style losses


class SeedStyle:
    """DI-engine's GRPO / PPO losses written the usual eager way (the baseline)."""

    grpo_policy_data = namedtuple(
        "grpo_policy_data", ["logit_new", "logit_old", "logit_ref", "action", "adv", "weight"]
    )
    ppo_data = namedtuple(
        "ppo_data",
        ["logit_new", "logit_old", "action", "value_new", "value_old", "adv", "return_",
         "weight", "logit_pretrained"],
    )  # fmt: skip

    @staticmethod
    def _logp(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1).gather(-1, action[..., None])[..., 0]

    @staticmethod
    def grpo_policy_error(data, clip_ratio: float = 0.2, beta: float = 0.1):
        logit_new, logit_old, logit_ref, action, adv, weight = data
        logp_new = SeedStyle._logp(logit_new, action)
        logp_old = SeedStyle._logp(logit_old, action)
        logp_ref = SeedStyle._logp(logit_ref, action)
        ratio = torch.exp(logp_new - logp_old)
        a = adv[:, None]
        surrogate = torch.min(ratio * a, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * a)
        kl = torch.exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1
        per_token = -surrogate + beta * kl
        loss = ((per_token * weight).sum(1) / weight.sum(1)).mean()
        return loss, None

    @staticmethod
    def ppo_error(data, clip_ratio=0.2, use_value_clip=True, dual_clip=None, kl_type="k1"):
        logit_new, logit_old, action, value_new, value_old, adv, return_, weight, pre = data
        log_p = torch.log_softmax(logit_new, dim=-1)
        logp_new = log_p.gather(-1, action[..., None])[..., 0]
        logp_old = SeedStyle._logp(logit_old, action)
        entropy = -(log_p.exp() * log_p).sum(-1)
        ratio = torch.exp(logp_new - logp_old)
        surr1, surr2 = ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv
        clip1 = torch.min(surr1, surr2)
        if dual_clip is not None:
            clip1 = torch.where(adv < 0, torch.max(clip1, dual_clip * adv), clip1)
        policy_loss = (-clip1 * weight).mean()
        value_clip = value_old + (value_new - value_old).clamp(-clip_ratio, clip_ratio)
        v_err = torch.max((return_ - value_new) ** 2, (return_ - value_clip) ** 2)
        value_loss = 0.5 * (v_err * weight).mean()
        log_ratio = logp_new - SeedStyle._logp(pre, action)
        if kl_type == "k1":
            kl_div = log_ratio
        elif kl_type == "k2":
            kl_div = log_ratio**2 / 2
        else:
            kl_div = torch.exp(-log_ratio) - 1 + log_ratio
        losses = namedtuple("ppo_loss", ["policy_loss", "value_loss", "entropy_loss", "kl_div"])
        return losses(policy_loss, value_loss, (entropy * weight).mean(), kl_div.mean()), None


# ----------------------------------------------------------------------------- shared RL plumbing


@torch.no_grad()
def rollout(model: TinyCausalLM, prompts: torch.Tensor, gen: torch.Generator):
    """Sample ``GEN_LEN`` tokens per prompt; returns ``(ids, action, weight)`` where
    ``weight`` is 1 up to and including the first EOS."""
    ids = prompts
    for _ in range(GEN_LEN):
        logits, _ = model(ids)
        probs = torch.softmax(logits[:, -1].double(), dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=gen).to(ids.device)
        ids = torch.cat([ids, nxt], dim=1)
    action = ids[:, PROMPT_LEN:]
    eos_before = torch.cumsum((action == EOS).long(), dim=1) - (action == EOS).long()
    return ids, action, (eos_before == 0).float()


def reward(action: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Toy task: the fraction of generated tokens (up to EOS) below 20."""
    return ((action < 20).float() * weight).sum(1) / weight.sum(1)


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float = 1.0, lam: float = 0.95):
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        nxt = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        last = rewards[:, t] + gamma * nxt - values[:, t] + gamma * lam * last
        adv[:, t] = last
    return adv, adv + values


def policy_logits(model: TinyCausalLM, ids: torch.Tensor):
    """Logits predicting the generated tokens, as a strided view ``logits[:, P-1:-1]``."""
    logits, values = model(ids)
    return logits[:, PROMPT_LEN - 1 : -1], values[:, PROMPT_LEN - 1 : -1]


def run(rl, grpo_steps: int, ppo_steps: int, epochs: int = 2, seed: int = 0, device="cpu"):
    """Train with the losses of ``rl``; returns ``(losses, final_state_dict)``, ``losses`` a
    list of ``(algo, step, epoch, loss, mean reward of the step's rollout)``."""
    torch.manual_seed(seed)
    model = TinyCausalLM().to(device)
    ref_model = TinyCausalLM().to(device)
    ref_model.load_state_dict(model.state_dict())
    ref_model.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []

    for step in range(grpo_steps + ppo_steps):
        grpo = step < grpo_steps
        n_prompts = 4 if grpo else 8
        prompts = torch.randint(1, VOCAB, (n_prompts, PROMPT_LEN), generator=gen).to(device)
        if grpo:
            prompts = prompts.repeat_interleave(GROUP, dim=0)
        ids, action, weight = rollout(model, prompts, gen)
        score = reward(action, weight)
        with torch.no_grad():
            logit_old, value_old = policy_logits(model, ids)
            logit_ref, _ = policy_logits(ref_model, ids)
        if grpo:  # group-normalised outcome advantages (GRPO)
            groups = score.view(-1, GROUP)
            adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
            adv = adv.reshape(-1)
        else:  # score on the last counted token, GAE, normalised advantages (PPO)
            last = weight.sum(1).long() - 1
            token_reward = torch.zeros_like(weight).scatter(1, last[:, None], score[:, None])
            adv, returns = gae(token_reward, value_old * weight)
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        for epoch in range(epochs):
            logit_new, value_new = policy_logits(model, ids)
            if grpo:
                data = rl.grpo_policy_data(logit_new, logit_old, logit_ref, action, adv, weight)
                loss, _ = rl.grpo_policy_error(data, clip_ratio=0.2, beta=0.04)
            else:
                data = rl.ppo_data(logit_new, logit_old, action, value_new, value_old, adv,
                                   returns, weight, logit_ref)  # fmt: skip
                out, _ = rl.ppo_error(data, clip_ratio=0.2, dual_clip=3.0, kl_type="k3")
                loss = (out.policy_loss + 0.5 * out.value_loss - 0.01 * out.entropy_loss
                        + 0.05 * out.kl_div)  # fmt: skip
            opt.zero_grad()
            loss.backward()
            opt.step()
            algo = "GRPO" if grpo else "PPO"
            losses.append((algo, step, epoch, loss.item(), score.mean().item()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_param_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in a)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--ppo-steps", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2, help="optimiser steps per rollout")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    from fused_rl.compat import ding as fused  # <- the one-line swap

    results = {}
    for name, rl in (("seed-style", SeedStyle), ("fused_rl", fused)):
        start = time.perf_counter()
        results[name] = run(rl, args.grpo_steps, args.ppo_steps, args.epochs, device=device)
        print(f"{name:>10} run: {time.perf_counter() - start:6.1f} s")
    (ref_losses, ref_params), (fused_losses, fused_params) = results.values()

    print(
        "\nEach row is one optimiser step: rollout `step`, pass `epoch` over it; `reward` is the"
        "\nrollout's mean reward (the same in both runs); `rel diff` is"
        "\n|fused_rl - seed-style| / max(|seed-style|, 1e-6)."
    )
    header = ("algo", "step", "epoch", "reward", "seed-style loss", "fused_rl loss", "rel diff")
    print(f"{header[0]:>5} {header[1]:>4} {header[2]:>5} {header[3]:>7} {header[4]:>16} "
          f"{header[5]:>16} {header[6]:>9}")  # fmt: skip
    worst = 0.0
    for (algo, step, epoch, loss_a, score), (*_, loss_b, _) in zip(ref_losses, fused_losses):
        diff = abs(loss_a - loss_b) / max(abs(loss_a), 1e-6)
        worst = max(worst, diff)
        print(f"{algo:>5} {step:>4} {epoch:>5} {score:7.3f} {loss_a:16.8f} {loss_b:16.8f} "
              f"{diff:9.1e}")  # fmt: skip
    param_diff = max_param_rel_diff(fused_params, ref_params)
    ok = worst < TOLERANCE and param_diff < TOLERANCE
    print(f"\nmax relative loss difference: {worst:.2e}")
    print(f"max relative parameter difference after training: {param_diff:.2e}")
    print(
        f"{'agree' if ok else 'DISAGREE'}: both must stay below {TOLERANCE:g} "
        "(exit status 0 when they do)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
