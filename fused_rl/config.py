"""Process-wide switches.

``check_values``: run the eager-mode checks that read tensor values (that every target lies
in ``[0, V)``, that a float / integer mask holds no negative weight, ...). Each costs one
host sync; set to False in a tuned training loop once the inputs are known to be valid.
They never run under ``torch.compile`` or CUDA-graph capture, where such inputs give NaN
instead.

``skip_padding_rows``: the fused-linear policy loss (``linear_policy_loss``) runs its GEMMs
on the counted rows only (mask weight != 0, target != ignore_index), as TRL's GRPOTrainer
does: one host sync for their count, in eager mode only (never under ``torch.compile`` or
CUDA-graph capture, which run every row). The loss, metrics and gradients are the same
(padding rows get a zero gradient either way); with 25% padding the GEMMs do 25% less.
"""

check_values: bool = True
skip_padding_rows: bool = True
