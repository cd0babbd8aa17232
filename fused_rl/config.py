"""Process-wide switches.

``check_values``: run the eager-mode checks that read tensor values (for example that every
target lies in ``[0, V)``). They cost one host sync per call; set to False in a tuned
training loop once the inputs are known to be valid. They never run under ``torch.compile``
or CUDA-graph capture, where out-of-range targets give NaN instead.
"""

check_values: bool = True
