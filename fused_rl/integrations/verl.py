"""fused_rl inside verl's actor (verl 0.9.x; 0.9.1 checked).

verl 0.9's actor (the FSDP engine's ``forward_step``, then ``verl.workers.utils.losses.ppo_loss``)
computes the per-token log-probs and entropy from the hidden states when
``actor_rollout_ref.model.use_fused_kernels=True``: ``apply_monkey_patch`` gives the model a
forward that calls ``FusedLinearForPPO`` (``fused_kernels_backend`` ``"torch"`` or
``"liger"``) or the Triton ``linear_cross_entropy`` (``"triton"``), each looked up in its
module at every call; the loss takes the policy loss from ``core_algos``' registry
(``get_policy_loss_fn``) and aggregates with ``agg_loss``, the KL loss with ``kl_penalty``.
The function-level drop-ins of :mod:`fused_rl.compat.verl` are never reached there on their
own. :func:`patch` points those names at them::

    import fused_rl.integrations.verl as fused_verl
    fused_verl.patch()          # before verl builds its workers; or: with fused_verl.patched():

What it replaces (:data:`ROUTES`; :func:`routes` lists what a call replaced):

* ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` and
  ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (and that name in the
  Megatron forward modules already imported, which bind it at import): every
  ``use_fused_kernels`` forward, all three backends, runs
  :func:`fused_rl.linear_token_logprobs` (no ``(N, V)`` logits);
* in ``verl.trainer.ppo.core_algos``: each registered policy loss fused_rl has (``vanilla``,
  ``gspo``, ``sapo``, ``gpg``, ``cispo``, ``clip_cov``, ``kl_cov``, ``geo_mean``,
  ``dppo_tv``, ``dppo_kl``, ``dro``; verl's ``bypass_mode`` stays verl's), ``agg_loss``,
  ``kl_penalty``, ``compute_value_loss``, ``compute_entropy_loss``; and the names
  ``verl.workers.utils.losses`` imported from it;
* ``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk`` (verl >= 0.9.1, the
  FSDP / VeOmni top-k distillation, ``distillation_loss.loss_mode="forward_kl_topk"``):
  the student's log-probs at the teacher's top-k ids without its ``(N, V)`` log-softmax;
  and ``verl.trainer.distillation.megatron.losses.compute_forward_kl_topk`` (where
  Megatron-Core imports: the student's logits split over the vocabulary across the
  tensor-parallel ranks) by ``compute_forward_kl_topk_megatron``, each shard streamed.

Semantics are verl's, with the departures :mod:`fused_rl.compat.verl` documents
(``docs/compat.md``, "verl"). :func:`unpatch` restores every name exactly; patching again
is a no-op. Patch before verl's workers run (with Ray, in each worker process: e.g. from a
``worker_extension`` / the module that builds the trainer); the class-level forward
``apply_monkey_patch`` installs needs nothing more.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator

__all__ = ["MIN_VERL_VERSION", "ROUTES", "is_patched", "patch", "patched", "routes", "unpatch"]

MIN_VERL_VERSION = (0, 9)
INSTALL_HINT = "pip install 'verl>=0.9'"

# (verl module, attribute, fused_rl.compat.verl attribute); ``optional``: patched only
# where the module is importable (the Megatron forwards need Megatron-Core; the distillation
# losses came with verl 0.9.1)
_CORE = "verl.trainer.ppo.core_algos"
_LOSSES = "verl.workers.utils.losses"
ROUTES: tuple[tuple[str, str, str, bool], ...] = (
    ("verl.utils.experimental.torch_functional", "FusedLinearForPPO", "FusedLinearForPPO", False),
    ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy", "linear_cross_entropy",
     False),
    ("verl.models.mcore.model_forward_fused", "linear_cross_entropy", "linear_cross_entropy",
     True),
    ("verl.models.mcore.model_forward_1f1b_overlap", "linear_cross_entropy",
     "linear_cross_entropy", True),
    ("verl.trainer.distillation.fsdp.losses", "compute_forward_kl_topk",
     "compute_forward_kl_topk", True),
    ("verl.trainer.distillation.megatron.losses", "compute_forward_kl_topk",
     "compute_forward_kl_topk_megatron", True),
    (_CORE, "agg_loss", "agg_loss", False),
    (_CORE, "kl_penalty", "kl_penalty", False),
    (_CORE, "compute_value_loss", "compute_value_loss", False),
    (_CORE, "compute_entropy_loss", "compute_entropy_loss", False),
    (_LOSSES, "agg_loss", "agg_loss", False),
    (_LOSSES, "kl_penalty", "kl_penalty", False),
    (_LOSSES, "compute_value_loss", "compute_value_loss", False),
)  # fmt: skip

_LOCK = threading.RLock()
_SAVED: dict = {}  # while patched: (module, attribute) -> original; ("registry", name) -> fn


def _verl():
    """``verl``, or an ImportError that says what to install."""
    try:
        import verl
    except ImportError as exc:
        raise ImportError(
            f"fused_rl.integrations.verl needs verl >= 0.9 ({INSTALL_HINT}): {exc}"
        ) from exc
    from packaging.version import Version

    version = Version(getattr(verl, "__version__", "0"))
    if version.release[:2] < MIN_VERL_VERSION:
        raise ImportError(
            f"fused_rl.integrations.verl follows verl 0.9's actor; found verl {verl.__version__} "
            f"({INSTALL_HINT}); for verl 0.5 use fused_rl.compat.verl.legacy_v05's functions"
        )
    return verl


def _module(name: str, optional: bool):
    if optional and name not in sys.modules:
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001  (Megatron-Core absent: nothing binds the name there)
            return None
    return importlib.import_module(name)


def patch() -> None:
    """Route verl's fused-kernel log-probs and its loss functions to fused_rl (module
    docstring). Idempotent; :func:`unpatch` undoes it."""
    _verl()
    from ..compat import verl as compat

    with _LOCK:
        if _SAVED:
            return
        saved = {}
        try:
            for module_name, attribute, ours, optional in ROUTES:
                module = _module(module_name, optional)
                if module is None:
                    continue
                if not hasattr(module, attribute):
                    raise ImportError(
                        f"{module_name} has no {attribute}: fused_rl.integrations.verl follows "
                        "verl 0.9.x"
                    )
                saved[(module, attribute)] = getattr(module, attribute)
                setattr(module, attribute, getattr(compat, ours))
            registry = importlib.import_module(_CORE).POLICY_LOSS_REGISTRY
            for name in sorted(set(registry) & set(compat.POLICY_LOSS_REGISTRY)):
                saved[("registry", name)] = registry[name]
                registry[name] = compat.POLICY_LOSS_REGISTRY[name]
        except BaseException:
            _restore(saved)
            raise
        _SAVED.update(saved)


def _restore(saved: dict) -> None:
    registry = None
    for (where, name), original in saved.items():
        if where == "registry":
            if registry is None:
                registry = importlib.import_module(_CORE).POLICY_LOSS_REGISTRY
            registry[name] = original
        else:
            setattr(where, name, original)


def unpatch() -> None:
    """Undo :func:`patch` (nothing to do if not patched)."""
    with _LOCK:
        _restore(_SAVED)
        _SAVED.clear()


def is_patched() -> bool:
    return bool(_SAVED)


def routes() -> list[str]:
    """What the current patch replaced: ``"module.attribute"`` and
    ``"POLICY_LOSS_REGISTRY[name]"`` (empty when not patched)."""
    with _LOCK:
        return [f"POLICY_LOSS_REGISTRY[{name!r}]" if where == "registry"
                else f"{where.__name__}.{name}" for where, name in _SAVED]  # fmt: skip


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """:func:`patch` for the block; on exit the state before it comes back."""
    with _LOCK:
        was = is_patched()
        patch()
    try:
        yield
    finally:
        if not was:
            unpatch()
