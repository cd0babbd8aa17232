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

``batch_invariant``: every GEMM of the fused-linear ops (``linear_token_logprobs``,
``linear_policy_loss``) has exactly ``chunk`` rows, the last chunk's padded with zero rows,
so a row's logits, log-prob, entropy and hidden gradient do not depend on how many rows the
call holds, where the row sits or what surrounds it (docs/numerics.md, "Batch invariance").
It costs at most ``chunk - 1`` padded rows of GEMM work per call (none when the row count
is a multiple of the chunk); False gives the last chunk a GEMM of its own rows only.

``scheduled_hyperparameters``: under ``torch.compile``, the policy losses' hyper-parameters
(``eps_low`` / ``eps_high``, ``beta``, ``entropy_coef``, ``dual_clip``, ``delta``, the
surrogates' own, ``log_ratio_clamp``: ``PolicyConfig.kernel_params``) reach the kernels as
a float64 CPU tensor made in the graph, not as constants of the graph, so a coefficient that
changes every step (an adaptive KL controller, an entropy schedule) compiles twice, not once
per value (``fullgraph=True`` would raise at Dynamo's ninth). A value turning 0 or non-0
compiles again (other kernels run). The cost: a few CPU ops in the graph (Inductor then
skips CUDA graphs for it) and one ``tolist`` of that CPU tensor per call; eager calls are
unchanged. ``temperature`` and ``softcap`` stay constants. Set it before the first compile,
and pass the values as arguments of the compiled function: a ``PolicyLoss`` module's own
``policy_config`` attribute is specialised on by Dynamo (each value recompiles).
"""

check_values: bool = True
skip_padding_rows: bool = True
batch_invariant: bool = True
scheduled_hyperparameters: bool = False
