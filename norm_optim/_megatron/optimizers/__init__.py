"""The optimizers: what each optimizer kind holds for each model param, one descriptor per leaf
optimizer, and the update rules (torch / apex / TE / orthogonalized / precision-aware) with the
reads they take inside a step.

- :mod:`.holdings` — :class:`Holding` (what a leaf holds for a model param, and over which group)
  and :func:`leaves`, shared by the adapter's readers.
- :mod:`.descriptor` — one record per leaf optimizer (kind, holdings, where its grads are, its
  update rule or the reason there is none, its moments, its copy group), built once with the
  registry: holdings, step norms and the audit read it.
- :mod:`.rules` — the table of update-rule builders by optimizer class (a new optimizer: one rule,
  one entry), and Muon's rule.
- :mod:`.update_rule` — what a rule is (:class:`UpdateRule`, given ``Stepped`` tensors, or
  ``Refused``) and the reader that runs a torch step chunk by chunk (``UpdateReader``).
- :mod:`.torch_rules` — torch's ``Adam`` / ``AdamW`` and ``SGD`` rules.
- :mod:`.fused_adam` — apex's and Transformer Engine's ``FusedAdam`` in fp32 use: the flags read,
  the rule and its builder.
- :mod:`.in_step` — updates read as the difference a step stored (``θ_after − θ_before``), a chunk
  at a time in one scratch: torch's Adam / SGD run chunk by chunk, Muon's per-param hooks.
- :mod:`.orthogonalized` — Muon and the emerging optimizers: their update read during the step
  (``θ_after − θ_before`` per tensor, at the optimizer's own per-param hooks).
- :mod:`.precision_aware` — Transformer Engine's ``FusedAdam`` with master weights (the
  precision-aware optimizer): its update derived from what its step reads.
- :mod:`.step_state` — :func:`run_step`: inside one ``step()``, when the grads are ready, the
  watch's veto, and whether the step was applied (every release's ``prepare_grads`` /
  ``step_with_ready_grads``).
- :mod:`.kinds` — what each optimizer kind holds for each model param: chained, distributed (incl.
  precision-aware and CPU offload), Float16, FP32, layer-wise, plain torch; kinds it cannot read are
  refused by class, with the version; it builds the descriptors.
"""
