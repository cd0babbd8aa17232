"""The policy kernels' mode lists and hyper-parameter table, defined once (plain Python).

The kernels turn each name into a ``tl.constexpr`` index (``SURROGATES.index("ppo")``) and
the Python side (``fused_rl.policy_config``) validates and packs options in the same order,
so the two can never drift apart. No Triton here: ``import fused_rl`` reads these tables
without importing Triton.
"""

# ``surrogate=``: the per-token policy term (kernels/policy/layer2.py ``surrogate_loss``)
SURROGATES = ("ppo", "cispo", "sapo", "gpg", "gmpo", "vespo")
# ``importance_sampling=``: one ratio per token, per sequence (GSPO: the mean log-ratio), the
# sequence's value with each token's own gradient (GSPO-token), or per sequence of its summed
# log-ratio (RLOO)
IMPORTANCE_SAMPLING = ("token", "sequence", "sequence-token", "sequence-sum")
# ``kl_estimator=`` (kernels/policy/layer2.py ``kl_and_grad``)
KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs", "full")
# ``loss_agg=`` (the finalize kernel's ``AGG``)
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# The policy kernels' runtime hyper-parameters, in the order of the ``hyper`` tuple they take
# (each as an fp32 ``(hi, lo)`` pair, ``fused_rl._launch.f32_pair``): values come from
# ``PolicyConfig.kernel_params``; the kernels read one with ``param(hyper, P_<NAME>, ACC)``.
# ``sp0 ... sp3`` are the surrogate's own parameters (SAPO's temperatures, VESPO's k / lambda).
POLICY_PARAMS = (
    "eps_low",
    "eps_high",
    "dual_clip",
    "delta",
    "beta",
    "entropy_coef",
    "sp0",
    "sp1",
    "sp2",
    "sp3",
    "log_ratio_clamp",
)

# The per-token partial columns every policy forward writes (an ``(N, rows)`` block: kernels/
# policy/layer2.py ``store_policy_partials``) and the finalize kernel reduces into the loss
# and the metrics; each is named for the metric it gives (``count``: the token weights'
# sum; ``aux``: the surrogate's own metric; ``ratio_max`` a max, ``is_weight_min`` a min,
# the rest masked means). The rollout IS columns come last: written and reduced only with
# IS weights (the first ``N_BASE_COLUMNS`` always).
POLICY_COLUMNS = (
    "count",
    "loss",
    "clip_frac",
    "clip_frac_low",
    "clip_frac_high",
    "aux",
    "ratio_mean",
    "approx_kl",
    "kl",
    "entropy",
    "ratio_max",
    "kl_bias_corrected",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
)
N_BASE_COLUMNS = POLICY_COLUMNS.index("is_weight_mean")
# Metrics the finalize kernel computes past the columns' own (its output holds
# ``len(POLICY_COLUMNS) + len(SEQUENCE_METRICS)`` values), over the sequences with a counted
# token, of a column's per-sequence mean: its extremes (TRL's ``clip_ratio/low_min`` and
# ``clip_ratio/high_max``) and its mean (each sequence weighs 1: TRL's sequence-level clip
# ratios, and VESPO's ``phi`` per sequence from the ``aux`` column).
SEQUENCE_METRICS = (
    "clip_frac_low_seq_min",
    "clip_frac_high_seq_max",
    "clip_frac_low_seq_mean",
    "clip_frac_high_seq_mean",
    "aux_seq_mean",
)

# The generalized JSD's launch constants (kernels/vocab/distill.py ``mix``, packed by
# ``fused_rl.distill.mixture_constants``): ``beta``, ``1 - beta``, ``log beta``,
# ``log(1 - beta)`` as fp32 pairs, then the two near-form polynomials' coefficients (lowest
# degree first) of this degree, fp32
MIX_NEAR_DEGREE = 8
N_MIX = 8 + 2 * (MIX_NEAR_DEGREE + 1)
