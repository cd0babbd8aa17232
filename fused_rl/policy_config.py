"""``PolicyConfig``: every option of the policy losses that is not a tensor, checked once.

:func:`fused_rl.policy_loss`, :func:`fused_rl.policy_loss_from_logprobs`,
:func:`fused_rl.linear_policy_loss` and :class:`fused_rl.nn.PolicyLoss` take these options
as keywords (``eps_high=0.28``); :func:`takes_policy_options` builds the config from them on
the way in, so everything below the public function works on one validated object, and the
kernels get their hyper-parameters from ONE table (:meth:`PolicyConfig.kernel_params`, in the
order of ``kernels/modes.py``). A config can also be built once and passed whole
(``policy_config=``), as a trainer holding its options would.

Example:
    >>> import torch, fused_rl
    >>> cfg = fused_rl.PolicyConfig(eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean")
    >>> logits = torch.randn(2, 6, 50, requires_grad=True)
    >>> targets = torch.randint(0, 50, (2, 6))
    >>> loss, metrics = fused_rl.policy_loss(logits, targets, torch.randn(2), policy_config=cfg)
    >>> same, _ = fused_rl.policy_loss(logits, targets, torch.randn(2), eps_high=0.28,
    ...                                loss_agg="seq-mean-token-mean")
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _validation as V
from ._agg import check_loss_agg
from .kernels.modes import IMPORTANCE_SAMPLING, KL_KINDS, LOSS_AGG_MODES, POLICY_PARAMS, SURROGATES

__all__ = ["PolicyConfig", "takes_policy_options"]


@dataclass(frozen=True)
class PolicyConfig:
    """The options of the policy losses (PPO / GRPO / DAPO / Dr. GRPO / GSPO / CISPO / SAPO /
    GPG / GMPO / VESPO). Every field is checked at construction; a bad one raises
    ``TypeError`` / ``ValueError`` naming it.

    Per token, with ``r = exp(logp - old_logprobs)`` and ``A`` the advantage, the default
    (``surrogate="ppo"``) is
    ``L = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta kl(logp, ref) - entropy_coef H``,
    aggregated over counted tokens by ``loss_agg``.

    Attributes:
        eps_low, eps_high: clip band ``[1 - eps_low, 1 + eps_high]``; ``eps_high=None`` =
            ``eps_low`` (DAPO's clip-higher: ``eps_high > eps_low``).
        dual_clip: ``c > 1``: where ``A < 0`` the loss is capped at ``-c A`` (arXiv 1912.09729).
        delta: TRL's two-sided clip: the unclipped ratio is capped at ``delta`` first.
        beta, kl_estimator: KL penalty ``beta * kl`` per token, ``kl`` estimated by
            ``kl_estimator`` in ``k1``, ``k2``, ``k3``, ``low_var_kl``, ``abs`` with
            ``log_ratio = logp - ref`` (:func:`fused_rl.kl_estimate`; ``beta != 0`` needs
            ``ref_logprobs``), or ``full``: the exact ``KL(pi || pi_ref)`` over the whole
            vocabulary from the reference's logits (``ref_logits=`` of
            :func:`fused_rl.policy_loss`, ``ref_hidden=`` / ``ref_weight=`` of
            :func:`fused_rl.linear_policy_loss`; always needed, the metric alone at
            ``beta = 0``; not from log-probs). ``kl=`` is a deprecated alias of
            ``kl_estimator=``.
        entropy_coef: entropy bonus ``-entropy_coef * H`` (H differentiable, same pass).
        importance_sampling: ``"token"``, ``"sequence"`` (GSPO: one ratio per sequence,
            ``exp(masked mean of logp - old)``, differentiable through every token; with
            ``surrogate="ppo"`` or ``"sapo"``), ``"sequence-token"`` (GSPO-token, TRL's
            ``sequence_token`` and verl's ``gspo``: the sequence ratio's value with each
            token's own gradient, ``sg(s) r_t / sg(r_t)``) or ``"sequence-sum"`` (RLOO, TRL's
            ``RLOOTrainer``: one ratio per sequence of its summed log-ratio,
            ``exp(sum m (logp - old))``, the product of the token ratios, differentiable
            through every token; with the ratio surrogates, as ``"sequence"``).
        surrogate: the policy term per token: ``"ppo"`` (default) the clipped surrogate
            above; ``"cispo"`` (MiniMax-M1) ``-sg(clamp(r, 1 - eps_low, 1 + eps_high)) A logp``,
            verl's two-sided band (TRL's and Liger's absolute cap ``C``, ``sg(min(r, C))``, is
            ``eps_low=1, eps_high=C - 1``); ``"sapo"`` ``-A sigmoid(tau (r - 1)) 4 / tau`` with
            ``tau = sapo_tau_pos`` where ``A > 0``, else ``sapo_tau_neg`` (the soft gate; its
            gradient at ``r = 1`` is PPO's); ``"gpg"`` ``-A logp`` (GPG / REINFORCE);
            ``"gmpo"`` (geometric-mean policy optimisation; with
            ``importance_sampling="sequence"``): ``-A r_seq`` with ``r_seq`` the geometric mean
            of the token ratios, each clipped in log space to ``[-eps_low, eps_high]`` on its
            advantage's side (a token the clip froze gets no gradient; use
            ``loss_agg="seq-mean-token-mean"`` for GMPO's mean over sequences); ``"vespo"``
            ``-sg(phi) A logp``, ``phi = exp(lam + k ln w - lam w)`` of the sequence's clamped
            log-weight sum ``ln w`` (its log-ratios and the ``is_weights``' logs, which then
            weigh nothing else), ``(k, lam)`` by the sign of ``A``. ``delta`` and
            ``dual_clip`` apply to ``"ppo"`` only.
        sapo_tau_pos, sapo_tau_neg: SAPO's temperatures (> 0; TRL's and verl's defaults).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's shape
            parameters for ``A >= 0`` and ``A < 0`` (TRL's and Liger's defaults).
        kl_bias_correction: multiply the KL term by the ratio ``r``, NOT detached
            (DeepSeek-V3.2, TRL's ``use_bias_correction_kl``); with
            ``importance_sampling="sequence"`` by the sequence ratio, with its exact gradient.
            The ``kl`` metric stays the uncorrected estimate; ``kl_bias_corrected`` is the
            corrected one, the mean of ``kl * r`` (what TRL logs as ``kl`` then).
        top_entropy_quantile: ``rho < 1`` keeps the policy term only at the counted tokens
            whose entropy is at or above the ``1 - rho`` quantile of this call's counted
            tokens (TRL's "20% high-entropy tokens" recipe, ``rho = 0.2``; threshold as
            ``torch.quantile``, linear); the KL and the normaliser still count every token.
            Needs the entropy first: log-probs and entropy in one vocabulary pass, then the
            token layer (as GSPO). The quantile is per call (per rank): TRL gathers the
            entropies of every data-parallel rank first.
        off_policy_mask_threshold: ``delta``: DeepSeek-V3.2's off-policy sequence mask (TRL's
            ``off_policy_mask_threshold``). The policy term of a token is dropped where its
            advantage is negative and its sequence's mean ``rollout_logprobs - logp`` (the
            current log-probs, detached; over the counted tokens, a NaN term as 0) is above
            ``delta``; ``rollout_logprobs`` defaults to ``old_logprobs`` (on-policy: the
            current log-probs, so nothing is dropped for ``delta >= 0``). The KL, the
            entropy bonus, the normaliser and the metrics still count every token;
            ``off_policy_masked_frac`` is the masked mean of the dropped tokens. Needs the
            log-probs first, as ``top_entropy_quantile``. None: no mask.
        loss_agg: ``"token-mean"`` | ``"seq-mean-token-mean"`` | ``"seq-mean-token-sum"`` |
            ``"seq-mean-token-sum-norm"`` (``fused_rl._agg.token_weights``); a sequence with no
            counted token contributes 0, never NaN.
        max_length: the ``seq-mean-token-sum-norm`` constant (default T).
        log_ratio_clamp: ``c > 0``: each token's log-ratio ``logp - old_logprobs`` is clamped
            to ``[-c, c]`` before anything is built from it (the ratio, a GSPO sequence mean,
            GMPO's clip, VESPO's weight), with no gradient where the clamp is active (its
            bounds pass it); verl clamps at 20 in its vanilla, SAPO and CISPO losses. The
            ``approx_kl`` metric stays the unclamped ``mean(old - logp)``. None: no clamp.
        entropy_agg: how the entropy bonus is aggregated. None: with ``loss_agg``, as every
            other term; ``"token-mean"``: ``-entropy_coef`` times the mean entropy over the
            counted tokens whatever ``loss_agg`` (TRL's ``entropy_coef``; the same under
            ``token-mean``). Under ``num_items`` the mean is still over this call's tokens.
    """

    eps_low: float = 0.2
    eps_high: float | None = None
    dual_clip: float | None = None
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    importance_sampling: str = "token"
    surrogate: str = "ppo"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_bias_correction: bool = False
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    loss_agg: str = "token-mean"
    max_length: int | None = None
    log_ratio_clamp: float | None = None
    entropy_agg: str | None = None

    if TYPE_CHECKING:  # derived by __post_init__: attributes, not fields (no repr, no eq)
        uses_entropy: bool
        selects_tokens: bool
        token_level: bool
        kernel_params: tuple[float, ...]
        kernel_modes: tuple[int, ...]

    def __post_init__(self) -> None:
        V.check_nonnegative(self.eps_low, "eps_low")
        V.check_nonnegative(self.eps_high, "eps_high", allow_none=True)
        V.check_number(self.dual_clip, "dual_clip", allow_none=True)
        V.check_number(self.delta, "delta", allow_none=True)
        V.check_number(self.beta, "beta")
        V.check_number(self.entropy_coef, "entropy_coef")
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(
                f"dual_clip must be > 1 (arXiv 1912.09729) or None, got {self.dual_clip}"
            )
        if self.delta is not None and not self.delta > 1.0 + self.clip_high:
            raise ValueError(
                f"delta must be > 1 + eps_high = {1.0 + self.clip_high}, got {self.delta}"
            )
        V.check_choice(self.kl_estimator, KL_KINDS, "kl_estimator")
        V.check_choice(self.importance_sampling, IMPORTANCE_SAMPLING, "importance_sampling")
        self._check_surrogate()
        for name in ("vespo_k_pos", "vespo_k_neg"):
            V.check_number(getattr(self, name), name)
        V.check_nonnegative(self.vespo_lambda_pos, "vespo_lambda_pos")
        V.check_nonnegative(self.vespo_lambda_neg, "vespo_lambda_neg")
        if not isinstance(self.kl_bias_correction, bool):
            raise TypeError(f"kl_bias_correction must be a bool, got {self.kl_bias_correction!r}")
        V.check_number(self.top_entropy_quantile, "top_entropy_quantile")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}"
            )
        V.check_number(self.off_policy_mask_threshold, "off_policy_mask_threshold", allow_none=True)
        check_loss_agg(self.loss_agg, max_length=self.max_length, num_items=None)
        V.check_positive(self.log_ratio_clamp, "log_ratio_clamp", allow_none=True)
        if self.entropy_agg is not None:
            V.check_choice(self.entropy_agg, ("token-mean",), "entropy_agg")
        # derived once, read per call as plain attributes (not fields: no repr, no eq)
        for name in ("uses_entropy", "selects_tokens", "token_level", "kernel_params",
                     "kernel_modes"):  # fmt: skip
            object.__setattr__(self, name, getattr(self, f"_{name}")())

    def _check_surrogate(self) -> None:
        surrogate, level = self.surrogate, self.importance_sampling
        V.check_choice(surrogate, SURROGATES, "surrogate")
        if surrogate in ("cispo", "gpg") and level in ("sequence", "sequence-sum"):
            raise ValueError(
                f"importance_sampling={level!r} works with the ratio surrogates ('ppo', "
                f"'sapo'); surrogate={surrogate!r} weighs each token's own log-prob, so "
                "use importance_sampling='token' or 'sequence-token'"
            )
        if surrogate == "vespo" and level != "token":
            raise ValueError(
                "surrogate='vespo' weighs each token by its sequence's phi, already a "
                f"sequence-level weight: pass importance_sampling='token' (as Liger), got "
                f"{level!r}"
            )
        if surrogate == "gmpo" and level != "sequence":
            raise ValueError(
                "surrogate='gmpo' is sequence-level (one geometric-mean ratio per sequence): "
                f"pass importance_sampling='sequence', got {level!r}"
            )
        if surrogate != "ppo":
            for name in ("delta", "dual_clip"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} caps PPO's clipped surrogate; it does not apply to "
                        f"surrogate={surrogate!r} (pass {name}=None)"
                    )
        V.check_positive(self.sapo_tau_pos, "sapo_tau_pos")
        V.check_positive(self.sapo_tau_neg, "sapo_tau_neg")

    # ------------------------------------------------------------------ derived values
    # (attributes set by __post_init__ from these: ``uses_entropy``, ``selects_tokens``,
    # ``token_level``, ``kernel_params``, ``kernel_modes``)

    @property
    def clip_high(self) -> float:
        """``eps_high``, or ``eps_low`` when it is None."""
        return self.eps_low if self.eps_high is None else self.eps_high

    def _uses_entropy(self) -> bool:
        """The loss needs the per-token entropy (a bonus, or the top-entropy selection)."""
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0

    def _token_level(self) -> bool:
        """Every token's gradient is known from its own row: token-level importance sampling,
        no top-entropy selection or off-policy mask (which need every entropy / log-prob
        first), not VESPO (whose weight needs the sequence's total)."""
        return (
            self.importance_sampling == "token"
            and not self._selects_tokens()
            and self.surrogate != "vespo"
        )

    def _selects_tokens(self) -> bool:
        """A mask on the policy term built from this call's own log-probs or entropies (the
        top-entropy selection, the off-policy sequence mask): the log-probs come first."""
        return self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None

    def surrogate_params(self) -> tuple[float, float, float, float]:
        """The surrogate's own parameters, the kernels' ``sp0 ... sp3``."""
        if self.surrogate == "sapo":
            return float(self.sapo_tau_pos), float(self.sapo_tau_neg), 0.0, 0.0
        if self.surrogate == "vespo":
            return (float(self.vespo_k_pos), float(self.vespo_lambda_pos),
                    float(self.vespo_k_neg), float(self.vespo_lambda_neg))  # fmt: skip
        return 0.0, 0.0, 0.0, 0.0

    def _kernel_params(self) -> tuple[float, ...]:
        """The kernels' runtime hyper-parameters, in ``kernels/modes.py`` ``POLICY_PARAMS``
        order (0 for an option that is off; ``log_ratio_clamp`` off is ``+inf``)."""
        sp = self.surrogate_params()
        no_clamp = self.log_ratio_clamp is None
        values = {
            "eps_low": self.eps_low,
            "eps_high": self.clip_high,
            "dual_clip": self.dual_clip or 0.0,
            "delta": self.delta or 0.0,
            "beta": self.beta,
            "entropy_coef": self.entropy_coef,
            "sp0": sp[0],
            "sp1": sp[1],
            "sp2": sp[2],
            "sp3": sp[3],
            "log_ratio_clamp": float("inf") if no_clamp else self.log_ratio_clamp,
        }  # fmt: skip
        return tuple(float(values[name]) for name in POLICY_PARAMS)

    def _kernel_modes(self) -> tuple[int, ...]:
        """The kernels' mode switches ``[surrogate, kl_kind, bias_kl, sequence, agg]``
        (``sequence``: 0 token, 1 GSPO, 2 a per-token gradient after a sequence total:
        GSPO-token, and VESPO, which runs the sequence pass for its phi; 3 RLOO's summed
        sequence log-ratio)."""
        level = IMPORTANCE_SAMPLING.index(self.importance_sampling)
        return (
            SURROGATES.index(self.surrogate),
            KL_KINDS.index(self.kl_estimator),
            int(self.kl_bias_correction),
            2 if self.surrogate == "vespo" else level,
            LOSS_AGG_MODES.index(self.loss_agg),
        )

    def replace(self, **changes) -> PolicyConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PolicyConfig))


@functools.lru_cache(maxsize=256)
def _config(items: tuple, _types: tuple) -> PolicyConfig:
    """The config of these keyword options, built (and checked) once per distinct set: a
    training loop calls with the same options every step, and a cache hit runs no Python.
    ``_types`` keeps ``1`` and ``True`` (equal, same hash) apart, so a check on the type
    still sees each one; a NaN option never hits (NaN != NaN) and raises each time."""
    return PolicyConfig(**dict(items))


def takes_policy_options(fn: Callable) -> Callable:
    """``fn(*args, policy: PolicyConfig, **rest)`` as a public function whose keyword-only
    options are ``fn``'s own plus every :class:`PolicyConfig` field (with its default) and
    ``policy_config=`` (a whole config instead of the fields): the signature and the docs
    of the options are written once, on :class:`PolicyConfig`, and ``help()``,
    ``inspect.signature`` and an editor's completion show every keyword."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "policy"]
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                          annotation=f.type)
        for f in dataclasses.fields(PolicyConfig)
    ]  # fmt: skip
    whole = inspect.Parameter(
        "policy_config", inspect.Parameter.KEYWORD_ONLY, default=None,
        annotation="PolicyConfig | None",
    )  # fmt: skip
    names = [p.name for p in params]
    at = names.index("ignore_index" if "ignore_index" in names else "backend")
    name = fn.__name__

    @functools.wraps(fn)
    def public(*args, policy_config=None, **kwargs):
        options = {k: kwargs.pop(k) for k in OPTION_NAMES if k in kwargs}
        if policy_config is None and torch.compiler.is_compiling():
            policy = PolicyConfig(**options)  # traced once; Dynamo would skip the cache anyway
        elif policy_config is None:
            policy = _config(tuple(options.items()), tuple(map(type, options.values())))
        elif not isinstance(policy_config, PolicyConfig):
            raise TypeError(
                f"policy_config must be a fused_rl.PolicyConfig, got {type(policy_config).__name__}"
            )
        elif options:
            raise TypeError(
                f"{name}() got policy_config= and the options {sorted(options)}: pass the "
                "options inside the config (policy_config.replace(...)) or as keywords, not both"
            )
        else:
            policy = policy_config
        return fn(*args, policy=policy, **kwargs)

    public.__signature__ = inspect.Signature(
        [*params[:at], *fields, whole, *params[at:]],
        return_annotation=inspect.signature(fn).return_annotation,
    )
    del public.__wrapped__  # the signature above, not fn's, is the public one
    return public
