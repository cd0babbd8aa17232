"""Triton kernels of fused_rl (installed as ``fused_rl.kernels``). Triton code only, grouped
by role; the file names say which layer of the vocabulary stream each belongs to:

    modes.py                 the mode lists and the hyper-parameter table (plain Python: the
                             Python side imports it without Triton)
    common.py                small device functions shared by every kernel
    vocab/                   one pass over each logits row
      layer1.py                layer 1: max, sum-exp, entropy, the target's logit
      layer3.py                layer 3: dL/dlogits from per-token g and h
      policy_fused.py          layers 1 + 2 in one pass (+ 3 with WRITE_GRAD): the policy loss
    policy/                  layer 2 of the policy losses: math on per-token numbers
      layer2.py                device functions (surrogates, KL, the partial columns)
      token_pass.py            layer 2 as a kernel over (B, T) log-probs (GSPO, from log-probs)
      finalize.py              the one reduction into the loss and every metric
    token_ops/               (B, T) token-space ops, not part of the vocabulary stream:
                             values, reductions, kl, advantages, gaussian, rollout
"""
