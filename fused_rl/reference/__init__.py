"""Plain-PyTorch references: the CPU fallback and the tests' twin of every fused op.

Readable first, fast second; each module mirrors one family of kernels.
"""
