"""Drop-in adapters: the public functions of DI-engine, torchtune, TRL, verl and Liger-Kernel
with the same signatures, defaults, return types and numerics (their documented quirks
included), running on fused_rl's kernels. Adopt fused_rl by changing one import:

* ``fused_rl.compat.ding``: ``ding.rl_utils`` PPO / GRPO losses and namedtuples (DI-engine main);
* ``fused_rl.compat.ding_v053``: the same with DI-engine 0.5.3's tuple layout (the PyPI release);
* ``fused_rl.compat.torchtune``: ``torchtune.rlhf`` (``PPOLoss``, GAE, rewards, whitening,
  ``logits_to_logprobs``);
* ``fused_rl.compat.trl``: ``selective_log_softmax``, ``entropy_from_logits``;
* ``fused_rl.compat.verl``: ``verl`` ``core_algos`` (the policy-loss registry included) /
  ``torch_functional`` and the fused lm_head ops (``FusedLinearForPPO``,
  ``linear_cross_entropy``): a package laid out like verl's modules, every name also at its
  top level;
* ``fused_rl.compat.liger``: Liger-Kernel's ``triton_grpo_loss``.

None of these libraries is imported or needed. The submodules are not imported here. The
label checks they share are in ``fused_rl.compat._checks``.

Half precision: by default the math runs in fp32 and each output is rounded once, which is at
least as accurate as the originals; ``half_precision("original")`` reproduces the originals'
own fp16 / bf16 roundings bit for bit (``fused_rl.compat._precision``).
"""

from ._precision import half_precision, half_precision_mode, set_half_precision

__all__ = ["half_precision", "half_precision_mode", "set_half_precision"]
