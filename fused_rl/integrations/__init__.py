"""fused_rl inside other libraries' trainers, where a function-level drop-in is never called.

* ``fused_rl.integrations.trl``: TRL >= 1.15 (1.16 current). Its ``GRPOTrainer`` computes
  every log-prob through its own fused LM head, so ``fused_rl.compat.trl``'s functions are
  never reached there; ``from fused_rl.integrations.trl import GRPOTrainer`` (or
  ``fused_rl.integrations.trl.patch()``) puts fused_rl's head in its place.
* ``fused_rl.integrations.verl``: verl 0.9.x. Its actor's ``use_fused_kernels`` forward and
  its loss look verl's functions up by name; ``patch()`` points them at
  ``fused_rl.compat.verl``'s.

Unlike ``fused_rl.compat``, an integration needs its library installed, imported only when
the integration is used. The submodules are not imported here.
"""
