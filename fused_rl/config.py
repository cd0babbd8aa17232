"""Process-wide switches.

``check_values``: run the eager-mode checks that read tensor values (that every target lies
in ``[0, V)``, that a float / integer mask holds no negative weight, ...). Each costs one
host sync; set to False in a tuned training loop once the inputs are known to be valid.
They never run under ``torch.compile`` or CUDA-graph capture, where such inputs give NaN
instead.
"""

check_values: bool = True
