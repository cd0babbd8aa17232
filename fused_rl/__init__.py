"""fused_rl: fused Triton kernels for the loss side of large-vocabulary RLHF.

``import fused_rl`` needs neither a GPU nor Triton: without them every op runs its
plain-PyTorch reference. ``print(fused_rl.describe())`` (or ``python -m fused_rl``) says which
backend each device gets and why; ``fused_rl.available_backends(device)`` lists what can run.
"""

from . import config, distributed  # noqa: F401  (distributed: a module, not an op)
from ._backend import available_backends
from ._describe import describe
from ._version import __version__
from .advantages import gae, group_advantages, kl_penalized_rewards, rloo_advantages
from .continuous import gaussian_entropy, gaussian_logprob
from .kl import kl_estimate
from .linear import linear_policy_loss, linear_token_logprobs
from .logprobs import token_entropy, token_logprobs
from .losses import policy_loss, policy_loss_from_logprobs
from .policy_config import PolicyConfig
from .reductions import masked_mean, masked_sum, masked_var, masked_whiten
from .rollout import rollout_is_weights
from .values import ppo_loss, value_loss

__all__ = [
    "__version__",
    "available_backends",
    "config",
    "describe",
    "gae",
    "gaussian_entropy",
    "gaussian_logprob",
    "group_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "linear_policy_loss",
    "linear_token_logprobs",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "PolicyConfig",
    "rloo_advantages",
    "rollout_is_weights",
    "policy_loss",
    "policy_loss_from_logprobs",
    "ppo_loss",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]
