"""fused_rl: fused Triton kernels for the loss side of large-vocabulary RLHF.

``import fused_rl`` needs neither a GPU nor Triton: without them every op runs its
plain-PyTorch reference. ``print(fused_rl.describe())`` (or ``python -m fused_rl``) says which
backend each device gets and why; ``fused_rl.available_backends(device)`` lists what can run.
"""

import os as _os

# A source checkout keeps the Triton kernels in kernels/ beside this package (an install maps
# that folder to fused_rl.kernels): look there first, so that a checkout imported from its
# own directory runs its own kernels, not those of whatever fused_rl install is on the path.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "kernels", "modes.py")) and _os.path.isfile(
    _os.path.join(_ROOT, "pyproject.toml")
):
    __path__.append(_ROOT)

from . import config, distributed  # noqa: E402, F401  (distributed: a module, not an op)
from ._backend import available_backends  # noqa: E402
from ._describe import describe  # noqa: E402
from ._version import __version__  # noqa: E402
from .advantages import gae, group_advantages, kl_penalized_rewards, rloo_advantages  # noqa: E402
from .continuous import gaussian_entropy, gaussian_logprob  # noqa: E402
from .distill import distill_loss  # noqa: E402
from .exact_kl import token_kl  # noqa: E402
from .kl import kl_estimate  # noqa: E402
from .linear import linear_policy_loss, linear_token_logprobs, linear_token_stats  # noqa: E402
from .linear_distill import linear_distill_loss  # noqa: E402
from .logprobs import TokenStats, token_entropy, token_logprobs, token_stats  # noqa: E402
from .losses import policy_loss, policy_loss_from_logprobs  # noqa: E402
from .policy_config import PolicyConfig  # noqa: E402
from .reductions import masked_mean, masked_sum, masked_var, masked_whiten  # noqa: E402
from .rollout import rollout_is_weights  # noqa: E402
from .truncated import truncated_logprobs  # noqa: E402
from .values import ppo_loss, value_loss  # noqa: E402

__all__ = [
    "__version__",
    "available_backends",
    "config",
    "describe",
    "distill_loss",
    "gae",
    "gaussian_entropy",
    "gaussian_logprob",
    "group_advantages",
    "kl_estimate",
    "kl_penalized_rewards",
    "linear_distill_loss",
    "linear_policy_loss",
    "linear_token_logprobs",
    "linear_token_stats",
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
    "token_kl",
    "token_logprobs",
    "token_stats",
    "TokenStats",
    "truncated_logprobs",
    "value_loss",
]
