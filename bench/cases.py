"""Benchmark cases (op, variant, mode, shape, dtype), the suites, and their inputs.

Two families of ops:

* logits ops (``token_logprobs``, ``policy_loss``): inputs are a ``(B, T + 1, V)`` logits
  buffer, as a model returns it, of which every provider reads the slice ``[:, :-1]`` (the
  positions that predict the ``T`` targets) in place; Liger's kernels take the whole buffer.
* token ops (``ppo_loss``, ``value_loss``, ``masked_whiten``, ``gae``): ``(B, T)`` fp32.
* linear ops (``linear_token_logprobs``, ``linear_policy_loss``): the model's final hidden
  states ``(B, T + 1, H)`` and the lm_head ``(V, H)`` in the case dtype, of which rows
  ``[:, :-1]`` predict the ``T`` targets; the ``(N, V)`` logits are the providers' business
  (fused_rl never holds them whole, eager materialises them).
* distillation ops (``distill_loss``, ``linear_distill_loss``): the student's and the
  teacher's ``(B, T, V)`` logits, or both models' ``(B, T, H)`` hidden states and ``(V, H)``
  lm_heads, compared at the same positions (no causal shift), and a ``(B, T)`` mask; the
  variant names the divergence (``DISTILL_BETAS``). ``topk_distill_loss`` (verl's
  ``forward_kl_topk``): the student's ``(B, T, V)`` logits and the teacher's top-K
  log-probs and ids ``(B, T, K)`` (the variant names K, :data:`TOPK`), as a teacher server
  sends them, and the mask.
* ``policy_loss[grpo+fullkl]`` (:data:`FULL_KL_VARIANTS`): the GRPO inputs plus the reference
  model's ``(B, T + 1, V)`` logits buffer, the policy's plus noise (``REF_NOISE``), in the
  case dtype: GRPO with the exact per-token KL to the reference over the vocabulary.
* ``token_logprobs`` under a sampler's top-k / top-p truncation (:data:`TRUNCATED_VARIANTS`):
  the ``token_logprobs`` inputs, every target its row's argmax (kept by every cut).

Inputs are random normal (never zeros: they hide unwritten outputs and can time faster).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

LOGITS_OPS = ("token_logprobs", "policy_loss")
TOKEN_OPS = ("ppo_loss", "value_loss", "masked_whiten", "gae")
LINEAR_OPS = ("linear_token_logprobs", "linear_policy_loss")
DISTILL_OPS = ("distill_loss", "linear_distill_loss", "topk_distill_loss")
OPS = LOGITS_OPS + TOKEN_OPS + LINEAR_OPS + DISTILL_OPS
# the ops with a vocabulary (a case's ``vocab`` is set)
VOCAB_OPS = LOGITS_OPS + LINEAR_OPS + DISTILL_OPS
# the ops from hidden states (a case's ``hidden`` is set)
HIDDEN_OPS = LINEAR_OPS + ("linear_distill_loss",)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
MODES = ("fwd", "fwd_nograd", "fwd_bwd")

# (variant, mode) pairs measured per op
OP_VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    # stats: token_stats, the log-prob and entropy with the diagnostics SFT / DPO trainers
    # log (mean logit, log sum p^2, top-1), no grad (what a trainer's metrics cost)
    "token_logprobs": tuple(
        itertools.product(("logp", "logp+entropy"), ("fwd_nograd", "fwd", "fwd_bwd"))
    )
    + (("stats", "fwd_nograd"),),
    # grpo: token-level ratio, k3 KL (beta 0.04), no entropy bonus (what Liger's loss does);
    # grpo+entropy: the same plus an entropy bonus; gspo: sequence-level ratio (GSPO);
    # cispo: MiniMax-M1's detached capped ratio times log p (CISPO band below); gmpo: the
    # geometric mean of log-space-clipped token ratios per sequence, seq-mean-token-mean
    # (GMPO); grpo+is: grpo with rollout IS weights (``is_weights``) on the policy term
    # (the exact-KL variants, FULL_KL_VARIANTS, are added by the suites that run them)
    "policy_loss": tuple(
        (v, "fwd_bwd") for v in ("grpo", "grpo+entropy", "gspo", "cispo", "gmpo", "grpo+is")
    ),
    "ppo_loss": (("torchtune", "fwd_bwd"),),
    "value_loss": (("clipped", "fwd_bwd"),),
    "masked_whiten": (("zero-mean", "fwd_nograd"),),
    "gae": (("gamma0.99-lam0.95", "fwd_nograd"),),
    # from hidden states: the policy_loss grpo case, log-probs with and without grad, and
    # linear_token_stats (the stats variant above, from the hidden states)
    "linear_token_logprobs": (("logp", "fwd_nograd"), ("logp", "fwd_bwd"), ("stats", "fwd_nograd")),
    "linear_policy_loss": (("grpo", "fwd_bwd"),),
    # on-policy distillation (TRL GKD's generalized_jsd_loss): a variant per beta
    "distill_loss": tuple((v, "fwd_bwd") for v in ("fkl", "jsd", "rkl")),
    "linear_distill_loss": tuple((v, "fwd_bwd") for v in ("fkl", "jsd", "rkl")),
    # verl's top-k distillation (forward_kl_topk) at its default K
    "topk_distill_loss": (("k128", "fwd_bwd"),),
}

# hidden size H of the linear ops' cases: a typical 7-8B model's on GPUs, tiny on CPU
HIDDEN = {"quick": 16, "full": 4096}
# the linear policy case's old log-probs keep every token's log-ratio at least this far from
# a clip boundary: the logits are rounded to bf16 by the GEMM (~2^-9 relative, up to ~0.02 in
# a log-prob), and a token within that of a boundary can land on either side, which changes
# its whole gradient row, and grad_weight (a sum over all tokens) cannot leave a row out
CLIP_MARGIN = 0.05

# the policy variants whose inputs keep every token's log-ratio CLIP_MARGIN away from the
# variant's clip boundaries (the older grpo / grpo+entropy / gspo inputs are kept as they
# were, so earlier results stay comparable: the oracle leaves their boundary tokens out)
NEW_POLICY_VARIANTS = ("cispo", "gmpo", "grpo+is", "grpo+fullkl")
# the policy variants whose KL is the exact KL(pi || pi_ref) over the vocabulary, from the
# reference model's logits (``kl_estimator="full"``), not an estimate from two log-probs:
# grpo+fullkl is grpo with it in place of k3. Not in OP_VARIANTS (a new --tokens / --vocab
# grid of the other suites leaves them out): the quick suite runs them at its shapes, the
# full and peers suites at one shape, the fullkl suite at FULL_KL_SHAPES (and its grids)
FULL_KL_VARIANTS = ("grpo+fullkl",)
# token_logprobs under a sampler's truncation (``token_logprobs(top_k=, top_p=)``, the
# log-prob under the renormalised kept set), the call's keywords by variant: top-k at a
# sampler's usual k (k <= 64: one read of each row, as the plain op), top-k beyond the
# streamed 64 (a radix select of the k-th largest) and top-p alone (a threshold search).
# Not in OP_VARIANTS, as FULL_KL_VARIANTS: the quick suite runs them at its shapes, the
# truncated suite at TRUNCATED_SHAPE beside the plain logp cases
TRUNCATED_VARIANTS: dict[str, dict] = {
    "k50": dict(top_k=50),
    "k1000": dict(top_k=1000),
    "p0.9": dict(top_p=0.9),
}
# (variant, mode) pairs measured: k50 without grad too (what scoring rollouts costs)
TRUNCATED_MODES = (("k50", "fwd_nograd"), ("k50", "fwd_bwd"), ("k1000", "fwd_bwd"),
                   ("p0.9", "fwd_bwd"))  # fmt: skip

# Hyper-parameters shared by every provider of an op (a benchmark compares like with like).
TEMPERATURE = 1.0
POLICY = {
    "eps_low": 0.2,
    "eps_high": 0.28,
    "beta": 0.04,
    "kl_estimator": "k3",
    "entropy_coef": 0.01,
}
# CISPO's band [1 - eps_low, 1 + eps_high] = [0, 1.28]: the one-sided cap min(r, 1.28) of
# MiniMax-M1, TRL and Liger (whose ``eps_high`` is the absolute cap C = 1.28); the lower end
# never binds (r > 0). The weight is detached, so the gradient has no kink at the cap.
CISPO = {"eps_low": 1.0, "eps_high": POLICY["eps_high"]}
# GMPO clips each token's log-ratio to [-eps_low, eps_high] (POLICY's, in log space) on its
# advantage's side, and aggregates seq-mean-token-mean (the mean over sequences of the
# per-sequence objective), in every provider and the oracle
LOSS_AGG = {"gmpo": "seq-mean-token-mean"}  # the others: token-mean
# grpo+is: rollout IS weights uniform in this range, (B, T), drawn after the other inputs
IS_WEIGHTS_RANGE = (0.5, 1.5)
PPO = {"epsilon": 0.1, "value_clip_range": 0.2, "value_coeff": 0.1}
VALUE_CLIP = 0.2
GAE = {"gamma": 0.99, "lam": 0.95}
# the distillation variants' beta, TRL's convention: 0 the forward KL(teacher || student),
# 1 the reverse KL(student || teacher), between them the generalized JSD of the mixture
# (1 - beta) p_student + beta p_teacher
DISTILL_BETAS = {"fkl": 0.0, "jsd": 0.5, "rkl": 1.0}
# topk_distill_loss: K by variant, and verl's default log_prob_min_clamp (both models'
# log-probs clamped below at it)
TOPK = {"k128": 128}
TOPK_CLAMP = -10.0
# the teacher's logits (or hidden states and lm_head) are the student's plus noise of this
# standard deviation relative to theirs: a teacher near the student, as in on-policy
# distillation (either KL about 0.5 nat a token from the logits, 1.1 from hidden states)
TEACHER_NOISE = 0.5
# the reference's logits in the exact-KL variants: the policy's plus noise of this standard
# deviation relative to theirs (0.5 absolute), a reference near the policy as in RLHF: the
# exact KL is then about 0.12 nat a token
REF_NOISE = 0.25


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured configuration; every provider of the op runs it on the same inputs."""

    op: str
    variant: str
    mode: str
    batch: int
    seqlen: int
    vocab: int | None
    dtype: str
    compile_ok: bool = True  # whether the torch.compile provider runs here (compile time)
    hidden: int | None = None  # H of the linear ops (None for the others)

    @property
    def tokens(self) -> int:
        return self.batch * self.seqlen

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def label(self) -> str:
        shape = f"{self.batch}x{self.seqlen}" + (f"x{self.vocab}" if self.vocab else "")
        shape += f" H{self.hidden}" if self.hidden else ""
        return f"{self.op}[{self.variant}] {self.mode} {shape} {self.dtype}"


# ----------------------------------------------------------------------------- suites


def _split(tokens: int, seqlen: int) -> tuple[int, int]:
    """``(B, T)`` with ``B * T == tokens`` and ``T <= seqlen``."""
    t = min(seqlen, tokens)
    if tokens % t:
        raise ValueError(f"--tokens {tokens} is not a multiple of the sequence length {t}")
    return tokens // t, t


def _logits_cases(op, shapes, compile_shapes=None, modes=MODES, hidden=None) -> list[Case]:
    """``shapes``: iterable of ``(B, T, V, dtype)``; ``hidden``: H of a linear op."""
    out = []
    for b, t, v, dt in shapes:
        for variant, mode in OP_VARIANTS[op]:
            if mode not in modes:
                continue
            ok = compile_shapes is None or (b * t, v, dt) in compile_shapes
            out.append(Case(op, variant, mode, b, t, v, dt, compile_ok=ok, hidden=hidden))
    return out


def _token_cases(op, shapes, compile_shapes=None) -> list[Case]:
    out = []
    for b, t in shapes:
        for variant, mode in OP_VARIANTS[op]:
            ok = compile_shapes is None or (b, t) in compile_shapes
            out.append(Case(op, variant, mode, b, t, None, "fp32", compile_ok=ok))
    return out


def quick_cases() -> list[Case]:
    """Small shapes: every op through the Triton interpreter on CPU (a few minutes on two
    cores: 435 s measured with the truncated variants, the machine shared)."""
    # the interpreter runs one program per row at a time: few rows, awkward V
    logits_shapes = [(2, 4, 1000, "bf16"), (2, 4, 4099, "bf16"), (2, 4, 1000, "fp32")]
    token_shapes = [(4, 64)]
    cases = []
    for op in LOGITS_OPS:
        cases += _logits_cases(op, logits_shapes)
    cases += _full_kl_cases(logits_shapes)
    # the truncated variants cost the interpreter seconds a call (the threshold search, the
    # radix select): each at one shape, the first its top-k truncates (k1000: V = 4099)
    cases += _truncated_cases(logits_shapes, first_cut=True)
    for op in TOKEN_OPS:
        cases += _token_cases(op, token_shapes)
    for op in LINEAR_OPS:  # the GEMMs are torch's: the same tiny grid, H = 16
        cases += _logits_cases(op, logits_shapes, hidden=HIDDEN["quick"])
    # the distillation ops: the odd V in bf16 and fp32's tolerance (the interpreter's time)
    cases += _distill_cases(logits_shapes[1:], HIDDEN["quick"])
    return cases


def _full_kl_cases(shapes, compile_shapes=None) -> list[Case]:
    """``policy_loss`` forward + backward with the exact KL (every ``FULL_KL_VARIANTS``) at
    ``shapes``, iterable of ``(B, T, V, dtype)``."""
    return [Case("policy_loss", variant, "fwd_bwd", b, t, v, dt,
                 compile_ok=compile_shapes is None or (b * t, v, dt) in compile_shapes)
            for b, t, v, dt in shapes for variant in FULL_KL_VARIANTS]  # fmt: skip


def _truncated_cases(shapes, compile_shapes=None, plain: bool = False,
                     first_cut: bool = False) -> list[Case]:  # fmt: skip
    """``token_logprobs`` under truncation (every ``TRUNCATED_MODES`` pair) at ``shapes``,
    iterable of ``(B, T, V, dtype)``; ``plain``: the plain ``token_logprobs[logp]`` in the
    same modes first at each shape and mode (what truncation costs over it, in one run);
    ``first_cut``: each pair at the first of ``shapes`` whose vocabulary its top-k
    truncates (``k < V``) only."""
    pairs = []
    for mode in dict.fromkeys(m for _, m in TRUNCATED_MODES):  # the no-grad cases first
        pairs += [("logp", mode)] if plain else []
        pairs += [(v, m) for v, m in TRUNCATED_MODES if m == mode]
    out, placed = [], set()
    for b, t, v, dt in shapes:
        for variant, mode in pairs:
            top_k = TRUNCATED_VARIANTS.get(variant, {}).get("top_k")
            if first_cut and ((variant, mode) in placed or (top_k or 0) >= v):
                continue
            placed.add((variant, mode))
            ok = compile_shapes is None or (b * t, v, dt) in compile_shapes
            out.append(Case("token_logprobs", variant, mode, b, t, v, dt, compile_ok=ok))
    return out


def _distill_cases(shapes, hidden: int, compile_shapes=None) -> list[Case]:
    """The distillation ops at ``shapes``, every variant; from hidden states H = ``hidden``."""
    cases = _logits_cases("distill_loss", shapes, compile_shapes)
    cases += _logits_cases("linear_distill_loss", shapes, compile_shapes, hidden=hidden)
    return cases + _logits_cases("topk_distill_loss", shapes, compile_shapes)


FULL_TOKENS = (4096, 16384, 32768)
FULL_VOCABS = (32000, 128256, 151936, 262144)
FULL_SEQLEN = 1024


def full_cases() -> list[Case]:
    """The GPU suite of issue 6.

    Logits ops: tokens B*T in {4096, 16384, 32768} x V in {32000, 128256, 151936, 262144}
    in bf16 with T = 1024; an fp32 subset; T = 4096 at 16384 tokens; no-grad forward and
    forward + backward (the grad-enabled forward alone is in the quick suite). Ordered by
    the issue's targets: policy_loss, no-grad token_logprobs, gae first. torch.compile runs on
    the 16384-token bf16 row (one compile per function plus at most one dynamic-shape
    recompile, so the suite fits a GPU lease). Token ops: B in {64, 512} x T in {1024, 8192}.
    The exact-KL policy variants (``FULL_KL_VARIANTS``) run at 16 x 1024 x 151936 bf16 only.
    """
    shapes = [(n // FULL_SEQLEN, FULL_SEQLEN, v, "bf16") for n in FULL_TOKENS for v in FULL_VOCABS]
    shapes += [(n // FULL_SEQLEN, FULL_SEQLEN, v, "fp32") for n in (4096, 16384) for v in (32000,)]
    shapes += [(4096 // FULL_SEQLEN, FULL_SEQLEN, 151936, "fp32")]
    shapes += [(16384 // 4096, 4096, 151936, "bf16")]
    compile_shapes = {(16384, v, "bf16") for v in FULL_VOCABS}
    token_shapes = [(b, t) for b in (64, 512) for t in (1024, 8192)]
    token_compile = {(64, 1024), (512, 8192)}
    cases = []
    for op in LOGITS_OPS:  # the grad-enabled forward alone is left to the quick suite
        cases += _logits_cases(op, shapes, compile_shapes, modes=("fwd_nograd", "fwd_bwd"))
    for op in TOKEN_OPS:
        cases += _token_cases(op, token_shapes, token_compile)
    linear_shapes = [s for s in shapes if s[3] == "bf16" and s[1] == FULL_SEQLEN]
    linear_shapes += [(4096 // FULL_SEQLEN, FULL_SEQLEN, 32000, "fp32")]
    for op in LINEAR_OPS:
        cases += _logits_cases(op, linear_shapes, compile_shapes, hidden=HIDDEN["full"])
    # the exact KL at one shape, beside k3 there (its own suite, fullkl, for more)
    cases += _full_kl_cases([(16384 // FULL_SEQLEN, FULL_SEQLEN, 151936, "bf16")], compile_shapes)
    # the targets first, so a run cut short by a GPU lease measured what matters
    priority = {
        ("policy_loss", "fwd_bwd"): 0,
        ("token_logprobs", "fwd_nograd"): 1,
        ("gae", "fwd_nograd"): 2,
        ("token_logprobs", "fwd_bwd"): 3,
    }
    return sorted(cases, key=lambda c: priority.get((c.op, c.mode), 4))


# the side-by-side with the peers' own paths (what a user would pick instead of fused_rl):
# the GRPO loss on the model's (B, T + 1, V) buffer, the fused heads from hidden states at
# H = 4096, and the no-grad log-probs, each at the shapes RL trainers run
PEER_POLICY_SHAPES = ((4, 1024, 32000), (8, 2048, 151936), (4, 4096, 262144))
PEER_LINEAR_SHAPES = ((16, 1024, 151936), (4, 1024, 151936))
PEER_LOGPROB_SHAPES = ((8, 2048, 151936),)
# the fullkl suite's shapes (B, T, V): the trainers' 8 x 2048 x 151936 first, then a small
# vocabulary; its providers: fused_rl's exact KL, the same call with k3 on the same inputs
# (what the exact KL costs over the estimate), eager and torch.compile of it
FULL_KL_SHAPES = ((8, 2048, 151936), (4, 1024, 32000))
FULL_KL_PROVIDERS = ("fused_rl", "fused_rl_k3", "eager", "compile")
# the truncated suite's shape (B, T, V), a trainer's, and its providers: fused_rl's
# truncated call, eager (a sampler's computation: top-k by torch.topk, top-p over the sorted
# fp32 logits) and torch.compile of it; the plain token_logprobs[logp] cases beside them get
# the same three (the one-pass op's time at the shape, the eager log_softmax's)
TRUNCATED_SHAPE = (8, 2048, 151936)
TRUNCATED_PROVIDERS = ("fused_rl", "eager", "compile")


def peer_cases() -> list[Case]:
    """The ``peers`` suite: bf16, ``policy_loss[grpo]`` forward + backward (torch.compile
    included) at ``PEER_POLICY_SHAPES``, and ``policy_loss[grpo+fullkl]`` (the exact KL) at
    8 x 2048 x 151936; ``linear_policy_loss[grpo]`` and
    ``linear_token_logprobs[logp]`` forward + backward at ``PEER_LINEAR_SHAPES`` (H = 4096),
    ``linear_token_logprobs[stats]`` (no grad) at the first of them;
    ``token_logprobs`` no-grad with and without entropy at ``PEER_LOGPROB_SHAPES``. Ordered
    so that a run cut short by a GPU lease has the fused heads at the largest token count,
    then the logits ops, then the rest."""

    def linear(b, t, v):
        return [Case(op, variant, "fwd_bwd", b, t, v, "bf16", compile_ok=False,
                     hidden=HIDDEN["full"])
                for op, variant in (("linear_policy_loss", "grpo"),
                                    ("linear_token_logprobs", "logp"))]  # fmt: skip

    first, *rest = PEER_LINEAR_SHAPES
    cases = linear(*first)
    # what SFT / DPO trainers' heads log, against TRL's head, which computes the same
    cases.append(Case("linear_token_logprobs", "stats", "fwd_nograd", *first, "bf16",
                      compile_ok=False, hidden=HIDDEN["full"]))  # fmt: skip
    cases += [Case("policy_loss", "grpo", "fwd_bwd", b, t, v, "bf16")
              for b, t, v in PEER_POLICY_SHAPES]  # fmt: skip
    cases += _full_kl_cases([(*FULL_KL_SHAPES[0], "bf16")])
    for b, t, v in PEER_LOGPROB_SHAPES:
        cases += [Case("token_logprobs", variant, "fwd_nograd", b, t, v, "bf16", compile_ok=False)
                  for variant in ("logp", "logp+entropy", "stats")]  # fmt: skip
    for shape in rest:
        cases += linear(*shape)
    return cases


INPLACE_PROVIDERS = ("fused_rl", "fused_rl_inplace", "fused_rl_2pass", "fused_rl_2pass_inplace",
                     "liger", "liger_inplace")  # fmt: skip


def inplace_cases() -> list[Case]:
    """The ``inplace`` suite: ``policy_loss`` forward + backward in bf16 at
    ``PEER_POLICY_SHAPES``, GRPO and GRPO with an entropy bonus (which Liger lacks), for the
    providers that write the gradient into the logits buffer or form it in the forward
    against fused_rl's default and Liger's ``inplace=False`` / ``True``:
    ``python bench/run.py --suite inplace --providers <INPLACE_PROVIDERS, comma-separated>``
    (time, peak memory: the two without a gradient buffer show it)."""
    return [Case("policy_loss", variant, "fwd_bwd", b, t, v, "bf16", compile_ok=False)
            for b, t, v in PEER_POLICY_SHAPES for variant in ("grpo", "grpo+entropy")]  # fmt: skip


# the distill suite's shapes (B, T, V): the trainers' 8 x 2048 x 151936 first (Qwen's
# vocabulary), then a small and a large vocabulary; from hidden states at H = 4096
DISTILL_SHAPES = ((8, 2048, 151936), (4, 1024, 32000), (4, 4096, 262144))
DISTILL_LINEAR_SHAPES = ((8, 2048, 151936), (4, 1024, 151936))
DISTILL_PROVIDERS = ("fused_rl", "fused_rl_mat", "eager", "compile", "liger", "trl", "verl")


def distill_cases() -> list[Case]:
    """The ``distill`` suite (GPU): ``distill_loss`` forward + backward in bf16 at
    ``DISTILL_SHAPES`` and ``linear_distill_loss`` at ``DISTILL_LINEAR_SHAPES`` (H = 4096),
    each with beta 0 (forward KL), 0.5 (JSD) and 1 (reverse KL), and verl's top-k forward KL
    (``topk_distill_loss``, K = 128) at ``DISTILL_SHAPES``' first shape, for
    ``DISTILL_PROVIDERS``:
    ``python bench/run.py --suite distill --providers <DISTILL_PROVIDERS, comma-separated>``.
    torch.compile runs on the first shape of the logits ops only (a compile per variant).
    The first shape of each op comes first, so a run cut short by a GPU lease measured it.
    On CPU the same ops and providers run at the quick suite's shapes:
    ``--suite quick --op distill_loss,linear_distill_loss,topk_distill_loss``."""
    first, *rest = DISTILL_SHAPES
    compile_shapes = {(first[0] * first[1], first[2], "bf16")}
    bf16 = lambda shapes: [(b, t, v, "bf16") for b, t, v in shapes]  # noqa: E731
    lfirst, *lrest = DISTILL_LINEAR_SHAPES
    cases = _logits_cases("distill_loss", bf16([first]), compile_shapes)
    cases += _logits_cases("topk_distill_loss", bf16([first]), compile_shapes)
    cases += _logits_cases("linear_distill_loss", bf16([lfirst]), set(), hidden=HIDDEN["full"])
    cases += _logits_cases("distill_loss", bf16(rest), compile_shapes)
    cases += _logits_cases("linear_distill_loss", bf16(lrest), set(), hidden=HIDDEN["full"])
    return cases


def full_kl_cases() -> list[Case]:
    """The ``fullkl`` suite (GPU): ``policy_loss`` forward + backward in bf16 with the exact
    KL to the reference (:data:`FULL_KL_VARIANTS`) at ``FULL_KL_SHAPES``, the first shape
    first, torch.compile at both, for ``FULL_KL_PROVIDERS``: ``python bench/run.py --suite
    fullkl --providers <FULL_KL_PROVIDERS, comma-separated>`` (a new ``--tokens`` /
    ``--vocab`` grid: the same variants at its shapes). On CPU the same variant runs in the
    quick suite's shapes: ``--suite quick --op policy_loss``."""
    return _full_kl_cases([(b, t, v, "bf16") for b, t, v in FULL_KL_SHAPES])


def truncated_cases() -> list[Case]:
    """The ``truncated`` suite (GPU): ``token_logprobs`` under top-k / top-p
    (:data:`TRUNCATED_MODES`) in bf16 at ``TRUNCATED_SHAPE``, each mode's plain
    ``token_logprobs[logp]`` case first (what truncation costs over the one-pass op, from
    one run), torch.compile included, for ``TRUNCATED_PROVIDERS``: ``python bench/run.py
    --suite truncated --providers <TRUNCATED_PROVIDERS, comma-separated>`` (a new
    ``--tokens`` / ``--vocab`` grid: the same cases at its shapes). On CPU the variants run
    in the quick suite's shapes: ``--suite quick --op token_logprobs``."""
    return _truncated_cases([(*TRUNCATED_SHAPE, "bf16")], plain=True)


SUITES = {"quick": quick_cases, "full": full_cases, "peers": peer_cases, "inplace": inplace_cases,
          "distill": distill_cases, "fullkl": full_kl_cases,
          "truncated": truncated_cases}  # fmt: skip


def select_cases(
    suite: str,
    ops: list[str] | None = None,
    tokens: list[int] | None = None,
    vocabs: list[int] | None = None,
    dtypes: list[str] | None = None,
    seqlen: int | None = None,
) -> list[Case]:
    """The suite's cases, filtered. ``tokens`` / ``vocabs`` given: a new shape grid instead,
    of the ops the suite holds (the ``fullkl`` suite's: its variants, ``FULL_KL_VARIANTS``;
    the ``truncated`` suite's: ``TRUNCATED_MODES`` and the plain logp cases beside them).

    With ``tokens``, logits ops use ``T = min(seqlen or 1024, tokens)`` and token ops use
    ``T = min(seqlen or 1024, tokens)`` too (``B = tokens / T``).
    """
    if suite not in SUITES:
        raise ValueError(f"--suite must be one of {', '.join(SUITES)}, got {suite!r}")
    for op in ops or ():
        if op not in OPS:
            raise ValueError(f"--op {op!r} is not one of {', '.join(OPS)}")
    for dt in dtypes or ():
        if dt not in DTYPES:
            raise ValueError(f"--dtype {dt!r} is not one of {', '.join(DTYPES)}")
    base = SUITES[suite]()
    suite_ops = {c.op for c in base}
    if tokens or vocabs or seqlen:
        default_t = seqlen or (4 if suite == "quick" else FULL_SEQLEN)
        grid_tokens = tokens or sorted({c.tokens for c in base if c.vocab})
        grid_vocabs = vocabs or sorted({c.vocab for c in base if c.vocab})
        grid_dtypes = dtypes or ["bf16"]
        shapes = [
            (*_split(n, default_t), v, dt)
            for n in grid_tokens
            for v in grid_vocabs
            for dt in grid_dtypes
        ]
        tok_tokens = tokens or sorted({c.tokens for c in base if c.vocab is None})
        tok_shapes = [_split(n, seqlen or min(1024, n)) for n in tok_tokens]
        base = []
        for op in LOGITS_OPS:
            base += _logits_cases(op, shapes)
        for op in TOKEN_OPS:
            base += _token_cases(op, tok_shapes)
        hidden = HIDDEN["quick" if suite == "quick" else "full"]
        for op in LINEAR_OPS:
            base += _logits_cases(op, shapes, hidden=hidden)
        base += _distill_cases(shapes, hidden)
        if suite == "fullkl":  # a suite of variants, not of ops
            base = _full_kl_cases(shapes)
        if suite == "truncated":  # the variants and the plain logp cases beside them
            base = _truncated_cases(shapes, plain=True)
    out = []
    for c in base:
        if c.op not in suite_ops:  # a new grid keeps to the suite's own ops
            continue
        if ops and c.op not in ops:
            continue
        if dtypes and c.vocab is not None and c.dtype not in dtypes:
            continue
        out.append(c)
    return out


# ----------------------------------------------------------------------------- inputs


def _lengths_mask(batch: int, seqlen: int, gen: torch.Generator, device) -> torch.Tensor:
    """(B, T) bool: each row keeps a random prefix of at least half its length."""
    low = max(1, seqlen // 2)
    lengths = torch.randint(low, seqlen + 1, (batch,), generator=gen, device=device)
    return torch.arange(seqlen, device=device)[None, :] < lengths[:, None]


def _true_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 log-probs of ``targets``, chunked so the fp32 temporaries stay small."""
    batch, seqlen, vocab = logits.shape
    out = torch.empty(batch, seqlen, dtype=torch.float32, device=logits.device)
    rows = max(1, (1 << 26) // (vocab * max(seqlen, 1)))
    with torch.no_grad():
        for b in range(0, batch, rows):
            z = torch.log_softmax(logits[b : b + rows].float() / TEMPERATURE, dim=-1)
            out[b : b + rows] = z.gather(-1, targets[b : b + rows, :, None])[..., 0]
    return out


def _argmax_targets(logits: torch.Tensor, targets: torch.Tensor, every: int = 2) -> None:
    """Every ``every``-th position's target (``targets[:, ::every]``) set to the argmax of
    its ``(B, T, V)`` logits row (the lowest id of a tie), a block of rows at a time: a
    random target is the argmax with probability 1 / V, so a top-1 flag that never fires
    would pass a check on random targets. (From hidden states the providers' GEMMs round the
    logits differently near a tie, so the linear cases keep random targets.)"""
    batch, seqlen, vocab = logits.shape
    rows = max(1, (1 << 26) // max(vocab * seqlen, 1))
    with torch.no_grad():
        for b in range(0, batch, rows):
            targets[b : b + rows, ::every] = logits[b : b + rows, ::every].argmax(-1)


def _linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """fp32 log-probs of ``targets`` from ``hidden[:, :-1] @ weight.T``, in chunks of rows."""
    batch, seqlen = targets.shape
    rows = hidden[:, :-1].reshape(batch * seqlen, -1)
    flat = targets.reshape(-1)
    out = torch.empty(batch * seqlen, dtype=torch.float32, device=hidden.device)
    step = max(1, (1 << 26) // weight.shape[0])
    w = weight.float()
    with torch.no_grad():
        for r in range(0, rows.shape[0], step):
            z = torch.log_softmax(rows[r : r + step].float() @ w.T / TEMPERATURE, dim=-1)
            out[r : r + step] = z.gather(-1, flat[r : r + step, None])[:, 0]
    return out.view(batch, seqlen)


def clip_bounds(variant: str) -> tuple[float, ...]:
    """The log-ratios (GSPO's: the sequence's; the others': a token's) at which
    ``variant``'s gradient jumps (a branch switches): PPO-clip's ``log(1 - eps_low)``,
    ``log(1 + eps_high)``; GMPO's log-space band ``-eps_low``, ``eps_high``; none for CISPO
    (its detached weight ``min(r, C)`` is continuous in ``r``)."""
    if variant == "cispo":
        return ()
    if variant == "gmpo":
        return (-POLICY["eps_low"], POLICY["eps_high"])
    return (math.log(1.0 - POLICY["eps_low"]), math.log(1.0 + POLICY["eps_high"]))


def _away_from_clip(
    log_ratio: torch.Tensor, margin: float = CLIP_MARGIN, variant: str = "grpo"
) -> torch.Tensor:
    """``log_ratio`` with every value within ``margin`` of a clip boundary of ``variant``
    (:func:`clip_bounds`) moved to ``margin`` from it, on its own side."""
    for bound in clip_bounds(variant):
        gap = log_ratio - bound
        side = torch.where(gap < 0, -1.0, 1.0)
        log_ratio = torch.where(gap.abs() < margin, bound + side * margin, log_ratio)
    return log_ratio


def _linear_inputs(case: Case, inp: dict, randn, gen, device) -> dict:
    """``hidden`` (B, T+1, H) and ``weight`` (V, H) leaves in the case dtype (logits of
    standard deviation ~2, as the logits ops' inputs), ``targets``, and the upstream
    gradient (log-probs) or the policy inputs (as ``policy_loss``'s, with the log-ratios
    kept ``CLIP_MARGIN`` away from the clip boundaries)."""
    b, t, v, h = case.batch, case.seqlen, case.vocab, case.hidden
    grad_needed = case.mode != "fwd_nograd"
    hidden = randn(b, t + 1, h, dtype=case.torch_dtype)
    weight = randn(v, h, scale=2.0 / math.sqrt(h), dtype=case.torch_dtype)
    targets = torch.randint(0, v, (b, t), generator=gen, device=device)
    inp.update(
        hidden=hidden.requires_grad_(grad_needed),
        weight=weight.requires_grad_(grad_needed),
        targets=targets,
    )
    if case.op == "linear_token_logprobs":
        inp["g_logp"] = randn(b, t)
        inp["g_entropy"] = randn(b, t)
        return inp
    logp = _linear_logprobs(hidden.detach(), weight.detach(), targets)
    inp["advantages"] = randn(b)
    inp["old_logprobs"] = logp - _away_from_clip(randn(b, t, scale=0.1))
    inp["ref_logprobs"] = logp + randn(b, t, scale=0.2)
    inp["mask"] = _lengths_mask(b, t, gen, device)
    return inp


def _distill_inputs(case: Case, inp: dict, randn, gen, device) -> dict:
    """``distill_loss``: the student's ``logits`` (B, T, V) leaf (standard deviation 2, as
    the other logits ops' inputs) and ``teacher_logits``, the student's plus noise of
    ``TEACHER_NOISE`` times their deviation, in the case dtype. ``linear_distill_loss``:
    ``hidden`` (B, T, H) and ``weight`` (V, H) leaves (logits of deviation ~2) and the
    teacher's ``teacher_hidden`` / ``teacher_weight``, each the student's plus noise of
    ``TEACHER_NOISE`` times its deviation. ``topk_distill_loss``: the student's ``logits`` as
    ``distill_loss``'s, and the top-K fp32 log-probs ``teacher_topk_logprobs`` and ids
    ``teacher_topk_ids`` of that teacher's logits (which are then dropped). All: a ``mask`` (a
    random prefix of each row) and ``labels``, -100 where the mask is False (Liger's
    ``shift_labels``)."""
    b, t, v = case.batch, case.seqlen, case.vocab
    dt, grad = case.torch_dtype, case.mode != "fwd_nograd"
    if case.op == "topk_distill_loss":
        logits = randn(b, t, v, scale=2.0, dtype=dt)
        teacher = randn(b, t, v, scale=2.0 * TEACHER_NOISE, dtype=dt).add_(logits)
        lt, ids = _teacher_topk(teacher, TOPK[case.variant])
        del teacher  # a teacher server sends its top K only
        inp.update(logits=logits.requires_grad_(grad), teacher_topk_logprobs=lt,
                   teacher_topk_ids=ids)  # fmt: skip
    elif case.op == "distill_loss":
        logits = randn(b, t, v, scale=2.0, dtype=dt)
        # in place in the case dtype: no fp32 temporary of the (B, T, V) size on a GPU
        teacher = randn(b, t, v, scale=2.0 * TEACHER_NOISE, dtype=dt).add_(logits)
        inp.update(logits=logits.requires_grad_(grad), teacher_logits=teacher)
    else:
        h = case.hidden
        hidden = randn(b, t, h, dtype=dt)
        weight = randn(v, h, scale=2.0 / math.sqrt(h), dtype=dt)
        t_hidden = randn(b, t, h, scale=TEACHER_NOISE, dtype=dt).add_(hidden)
        t_weight = randn(v, h, scale=2.0 * TEACHER_NOISE / math.sqrt(h), dtype=dt).add_(weight)
        inp.update(hidden=hidden.requires_grad_(grad), weight=weight.requires_grad_(grad),
                   teacher_hidden=t_hidden, teacher_weight=t_weight)  # fmt: skip
    mask = _lengths_mask(b, t, gen, device)
    labels = torch.randint(0, v, (b, t), generator=gen, device=device)
    inp.update(mask=mask, labels=labels.masked_fill_(~mask, -100))
    return inp


def _teacher_topk(teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-``k`` fp32 log-probs and ids of its ``(B, T, V)`` logits, a block
    of rows at a time (no fp32 temporary of the logits' size on a GPU)."""
    batch, seqlen, vocab = teacher.shape
    rows = teacher.reshape(batch * seqlen, vocab)
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=rows.device)
    ids = torch.empty(rows.shape[0], k, dtype=torch.long, device=rows.device)
    step = max(1, (1 << 26) // vocab)
    for r in range(0, rows.shape[0], step):
        values[r : r + step], ids[r : r + step] = rows[r : r + step].float().log_softmax(-1).topk(k)
    return values.view(batch, seqlen, k), ids.view(batch, seqlen, k)


def _reference_inputs(inp: dict, randn) -> None:
    """The exact-KL variants' reference model: ``ref_buf`` ``(B, T + 1, V)``, the policy's
    buffer plus noise of ``REF_NOISE`` times its deviation in the case dtype (made in place:
    no fp32 temporary of the logits' size on a GPU), and ``ref_logits = ref_buf[:, :-1]``
    (the positions that predict the targets, a view). ``ref_logprobs`` becomes the
    reference's own fp32 log-prob of each target, what a k3 estimate of the same KL reads
    (the ``fused_rl_k3`` provider)."""
    buf = inp["buf"]
    ref = randn(*buf.shape, scale=2.0 * REF_NOISE, dtype=buf.dtype).add_(buf)
    inp.update(ref_buf=ref, ref_logits=ref[:, :-1])
    inp["ref_logprobs"] = _true_logprobs(ref[:, :-1], inp["targets"])


def make_inputs(case: Case, device: str | torch.device, seed: int = 0) -> dict:
    """The inputs of ``case`` on ``device``; tensors that get gradients have requires_grad.

    Logits ops: ``buf`` (B, T+1, V) and ``logits = buf[:, :-1]`` (a leaf view sharing its
    memory, so gradients land in a (B, T, V) buffer and no provider copies the slice).
    ``token_logprobs``: ``targets`` (B, T) and the upstream gradients ``g_logp``,
    ``g_entropy`` (B, T) fp32; the truncated variants (``TRUNCATED_VARIANTS``) draw the same
    numbers as ``logp`` and then take each row's argmax as its target.
    Random numbers are drawn on ``device`` (a GPU fills gigabytes in milliseconds).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t = case.batch, case.seqlen

    def randn(*shape, scale=1.0, dtype=torch.float32):
        x = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
        return x.mul_(scale) if scale != 1.0 else x

    inp: dict = {"case": case}
    if case.op in DISTILL_OPS:
        return _distill_inputs(case, inp, randn, gen, device)
    if case.op in LINEAR_OPS:
        return _linear_inputs(case, inp, randn, gen, device)
    if case.op in LOGITS_OPS:
        v = case.vocab
        buf = randn(b, t + 1, v, scale=2.0, dtype=case.torch_dtype)
        targets = torch.randint(0, v, (b, t), generator=gen, device=device)
        inp.update(buf=buf, targets=targets)
        grad_needed = case.mode != "fwd_nograd"
        inp["logits"] = buf[:, :-1].detach().requires_grad_(grad_needed)
        inp["buf_leaf"] = buf.detach().requires_grad_(grad_needed)
        if case.op == "token_logprobs":
            inp["g_logp"] = randn(b, t)
            inp["g_entropy"] = randn(b, t)
            if case.variant == "stats":  # half the targets the argmax: the flag checked both ways
                _argmax_targets(buf[:, :-1], targets)
            if case.variant in TRUNCATED_VARIANTS:
                # every target its row's argmax, which every cut keeps (top-k keeps the
                # largest value and its ties for any k, top-p at least the most probable
                # token): a target cut off has log-prob -inf and a zero gradient row, which
                # the fused backward skips, so random targets (cut with probability ~1 - k / V)
                # would time an unrepresentatively cheap backward; and a target near a cut
                # could land on either side of it between fp32 and float64 rounding
                _argmax_targets(buf[:, :-1], targets, every=1)
        else:
            logp = _true_logprobs(buf[:, :-1], targets)
            inp["advantages"] = randn(b)  # one per sequence (GRPO / GSPO)
            log_ratio = -randn(b, t, scale=0.1)  # old = logp + N(0, 0.1^2): r ~ 1 +- 10%
            if case.variant in NEW_POLICY_VARIANTS:
                # no token within CLIP_MARGIN of a clip boundary: bf16 log-probs (TRL's)
                # would otherwise flip tokens across it (a whole gradient row each)
                log_ratio = _away_from_clip(log_ratio, variant=case.variant)
            inp["old_logprobs"] = logp - log_ratio
            inp["ref_logprobs"] = logp + randn(b, t, scale=0.2)
            inp["mask"] = _lengths_mask(b, t, gen, device)
            if case.variant == "grpo+is":  # drawn last: the other inputs are grpo's
                low, high = IS_WEIGHTS_RANGE
                u = torch.rand(b, t, generator=gen, device=device)
                inp["is_weights"] = u.mul_(high - low).add_(low)
            if case.variant in FULL_KL_VARIANTS:  # drawn last too
                _reference_inputs(inp, randn)
        return inp

    mask = _lengths_mask(b, t, gen, device)
    if case.op == "ppo_loss":
        old = randn(b, t, scale=0.5) - 2.0
        old_v = randn(b, t)
        inp.update(
            pi_old_logprobs=old,
            pi_logprobs=(old + randn(b, t, scale=0.1)).requires_grad_(case.mode == "fwd_bwd"),
            advantages=randn(b, t),
            phi_old_values=old_v,
            phi_values=(old_v + randn(b, t, scale=0.3)).requires_grad_(case.mode == "fwd_bwd"),
            returns=randn(b, t),
            padding_masks=mask,
            value_padding_masks=mask & _lengths_mask(b, t, gen, device),
        )
    elif case.op == "value_loss":
        old_v = randn(b, t)
        inp.update(
            values=(old_v + randn(b, t, scale=0.3)).requires_grad_(case.mode == "fwd_bwd"),
            old_values=old_v,
            returns=randn(b, t),
            mask=mask,
        )
    elif case.op == "masked_whiten":
        inp.update(x=randn(b, t, scale=3.0) + 1.5, mask=mask)
    elif case.op == "gae":
        inp.update(rewards=randn(b, t, scale=0.1), values=randn(b, t), mask=mask)
    else:
        raise ValueError(f"unknown op {case.op!r}")
    return inp
