"""DI-engine 0.5.3's PPO interface (the DI-engine release on PyPI), fused.

Change ``from ding.rl_utils import ppo_data, ppo_error, ...`` (DI-engine 0.5.3) to
``from fused_rl.compat.ding_v053 import ppo_data, ppo_error, ...``. DI-engine is not imported
(nor needed).

DI-engine 0.5.3 (``ding/rl_utils/ppo.py`` at tag ``v0.5.3``) predates the KL-to-pretrained
terms and GRPO of DI-engine main, which :mod:`fused_rl.compat.ding` mirrors. What differs:

* ``ppo_data`` / ``ppo_data_continuous`` have 8 fields and ``ppo_policy_data`` /
  ``ppo_policy_data_continuous`` 5 (no ``logit_pretrained``);
* ``ppo_loss`` is ``(policy_loss, value_loss, entropy_loss)`` and ``ppo_policy_loss``
  ``(policy_loss, entropy_loss)`` (no ``kl_div``);
* ``ppo_error`` / ``ppo_policy_error`` / the continuous pair take no ``kl_type``, and
  ``ppo_policy_error`` no ``entropy_bonus`` (the entropy is always computed);
* there is no ``calculate_kl_div`` and no GRPO.

Everything else (the math, its quirks, dtypes, ``"original"`` half precision, the
continuous dual-clip defect and the ``fix_dual_clip`` keyword) is :mod:`fused_rl.compat.ding`'s,
which each function here calls: 0.5.3's losses are main's with ``logit_pretrained=None``.
``ppo_value_data``, ``ppo_info`` and ``ppo_value_error`` are the same in both.
"""

from __future__ import annotations

from collections import namedtuple

from . import ding as _main
from .ding import ppo_info, ppo_value_data, ppo_value_error

__all__ = [
    "ppo_data",
    "ppo_data_continuous",
    "ppo_error",
    "ppo_error_continuous",
    "ppo_info",
    "ppo_loss",
    "ppo_policy_data",
    "ppo_policy_data_continuous",
    "ppo_policy_error",
    "ppo_policy_error_continuous",
    "ppo_policy_loss",
    "ppo_value_data",
    "ppo_value_error",
]

ppo_data = namedtuple(
    "ppo_data",
    ["logit_new", "logit_old", "action", "value_new", "value_old", "adv", "return_", "weight"],
)
ppo_data_continuous = namedtuple(
    "ppo_data_continuous",
    ["mu_sigma_new", "mu_sigma_old", "action", "value_new", "value_old", "adv", "return_",
     "weight"],
)  # fmt: skip
ppo_policy_data = namedtuple(
    "ppo_policy_data", ["logit_new", "logit_old", "action", "adv", "weight"]
)
ppo_policy_data_continuous = namedtuple(
    "ppo_policy_data_continuous", ["mu_sigma_new", "mu_sigma_old", "action", "adv", "weight"]
)
ppo_loss = namedtuple("ppo_loss", ["policy_loss", "value_loss", "entropy_loss"])
ppo_policy_loss = namedtuple("ppo_policy_loss", ["policy_loss", "entropy_loss"])


def ppo_policy_error(
    data: ppo_policy_data, clip_ratio: float = 0.2, dual_clip: float | None = None
) -> tuple[ppo_policy_loss, ppo_info]:
    """Mirrors DI-engine 0.5.3's ``ding.rl_utils.ppo_policy_error``.

    :func:`fused_rl.compat.ding.ppo_policy_error` on the 5-field :data:`ppo_policy_data`
    ``(logit_new, logit_old, action, adv, weight)``, entropy always on.

    Returns:
        ``(ppo_policy_loss(policy_loss, entropy_loss), ppo_info(approx_kl, clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding_v053 import ppo_policy_data, ppo_policy_error
        >>> logits = torch.randn(4, 6, requires_grad=True)
        >>> data = ppo_policy_data(logits, logits.detach(), torch.randint(0, 6, (4,)),
        ...                        torch.randn(4), None)
        >>> loss, info = ppo_policy_error(data)
        >>> loss._fields
        ('policy_loss', 'entropy_loss')
        >>> (loss.policy_loss - 0.01 * loss.entropy_loss).backward()
    """
    logit_new, logit_old, action, adv, weight = data
    out, info = _main.ppo_policy_error(
        _main.ppo_policy_data(logit_new, logit_old, action, adv, weight, None),
        clip_ratio,
        dual_clip,
    )
    return ppo_policy_loss(out.policy_loss, out.entropy_loss), info


def ppo_error(
    data: ppo_data,
    clip_ratio: float = 0.2,
    use_value_clip: bool = True,
    dual_clip: float | None = None,
) -> tuple[ppo_loss, ppo_info]:
    """Mirrors DI-engine 0.5.3's ``ding.rl_utils.ppo_error``.

    :func:`fused_rl.compat.ding.ppo_error` on the 8-field :data:`ppo_data` ``(logit_new,
    logit_old, action, value_new, value_old, adv, return_, weight)``; asserts ``dual_clip is
    None or dual_clip > 1``.

    Returns:
        ``(ppo_loss(policy_loss, value_loss, entropy_loss), ppo_info(approx_kl, clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding_v053 import ppo_data, ppo_error
        >>> logits, value = torch.randn(3, 5, requires_grad=True), torch.randn(3)
        >>> data = ppo_data(logits, logits.detach(), torch.randint(0, 5, (3,)), value, value,
        ...                 torch.randn(3), torch.randn(3), None)
        >>> loss, info = ppo_error(data, dual_clip=3.0)
        >>> loss._fields
        ('policy_loss', 'value_loss', 'entropy_loss')
    """
    logit_new, logit_old, action, value_new, value_old, adv, return_, weight = data
    out, info = _main.ppo_error(
        _main.ppo_data(logit_new, logit_old, action, value_new, value_old, adv, return_, weight,
                       None),
        clip_ratio,
        use_value_clip,
        dual_clip,
    )  # fmt: skip
    return ppo_loss(out.policy_loss, out.value_loss, out.entropy_loss), info


def ppo_policy_error_continuous(
    data: ppo_policy_data_continuous,
    clip_ratio: float = 0.2,
    dual_clip: float | None = None,
    *,
    fix_dual_clip: bool = False,
) -> tuple[ppo_policy_loss, ppo_info]:
    """Mirrors DI-engine 0.5.3's ``ding.rl_utils.ppo_policy_error_continuous``.

    :func:`fused_rl.compat.ding.ppo_policy_error_continuous` (its dual-clip defect and
    ``fix_dual_clip`` keyword included) on the 5-field :data:`ppo_policy_data_continuous`
    ``(mu_sigma_new, mu_sigma_old, action, adv, weight)``.

    Returns:
        ``(ppo_policy_loss(policy_loss, entropy_loss), ppo_info(approx_kl, clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding_v053 import (ppo_policy_data_continuous,
        ...                                        ppo_policy_error_continuous)
        >>> new = {"mu": torch.zeros(3, 2, requires_grad=True), "sigma": torch.ones(3, 2)}
        >>> old = {"mu": torch.zeros(3, 2), "sigma": torch.ones(3, 2)}
        >>> data = ppo_policy_data_continuous(new, old, torch.randn(3, 2), torch.randn(3), None)
        >>> loss, info = ppo_policy_error_continuous(data)
        >>> loss.policy_loss.backward()
    """
    mu_sigma_new, mu_sigma_old, action, adv, weight = data
    out, info = _main.ppo_policy_error_continuous(
        _main.ppo_policy_data_continuous(mu_sigma_new, mu_sigma_old, action, adv, weight, None),
        clip_ratio,
        dual_clip,
        fix_dual_clip=fix_dual_clip,
    )
    return ppo_policy_loss(out.policy_loss, out.entropy_loss), info


def ppo_error_continuous(
    data: ppo_data_continuous,
    clip_ratio: float = 0.2,
    use_value_clip: bool = True,
    dual_clip: float | None = None,
    *,
    fix_dual_clip: bool = False,
) -> tuple[ppo_loss, ppo_info]:
    """Mirrors DI-engine 0.5.3's ``ding.rl_utils.ppo_error_continuous``.

    :func:`fused_rl.compat.ding.ppo_error_continuous` on the 8-field
    :data:`ppo_data_continuous` ``(mu_sigma_new, mu_sigma_old, action, value_new, value_old,
    adv, return_, weight)``.

    Returns:
        ``(ppo_loss(policy_loss, value_loss, entropy_loss), ppo_info(approx_kl, clipfrac))``.

    Example:
        >>> import torch
        >>> from fused_rl.compat.ding_v053 import ppo_data_continuous, ppo_error_continuous
        >>> new = {"mu": torch.zeros(3, 2, requires_grad=True), "sigma": torch.ones(3, 2)}
        >>> old = {"mu": torch.zeros(3, 2), "sigma": torch.ones(3, 2)}
        >>> v = torch.zeros(3)
        >>> data = ppo_data_continuous(new, old, torch.randn(3, 2), v, v, torch.randn(3),
        ...                            torch.randn(3), None)
        >>> len(ppo_error_continuous(data, dual_clip=2.0)[0])
        3
    """
    mu_sigma_new, mu_sigma_old, action, value_new, value_old, adv, return_, weight = data
    out, info = _main.ppo_error_continuous(
        _main.ppo_data_continuous(mu_sigma_new, mu_sigma_old, action, value_new, value_old, adv,
                                  return_, weight, None),
        clip_ratio,
        use_value_clip,
        dual_clip,
        fix_dual_clip=fix_dual_clip,
    )  # fmt: skip
    return ppo_loss(out.policy_loss, out.value_loss, out.entropy_loss), info
