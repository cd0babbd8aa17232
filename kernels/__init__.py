"""Triton kernels of fused_rl (installed as ``fused_rl.kernels``). Triton code only.

Layers, visible in the file names:
    vocab_stream_fwd.py  -- layer 1: one pass over each logits row (max, sum-exp, entropy)
    token_layer.py       -- layer 2: loss math on per-token numbers (the forward's epilogue)
    vocab_stream_bwd.py  -- layer 3: one pass writing dL/dlogits from per-token g and h
"""
