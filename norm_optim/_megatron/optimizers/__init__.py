"""The optimizers: what each optimizer kind holds for each model param, one descriptor per leaf
optimizer, and the update rules (torch / apex / TE / orthogonalized / precision-aware) with the
reads they take inside a step.

- :mod:`.kinds` — what each optimizer kind holds; kinds it cannot read refused by class and version.
- :mod:`.holdings` — ``Holding``: what a leaf optimizer holds for a model param, and over which
  group.
- :mod:`.descriptor` — one descriptor per leaf optimizer: kind, holdings, grads, update rule,
  moments, copy groups.
- :mod:`.update_rule` — ``UpdateRule``, ``Stepped``, ``Refused``; ``UpdateReader``, which runs a
  torch step chunk by chunk.
- :mod:`.torch_rules` — torch's ``Adam`` / ``AdamW`` and ``SGD`` update rules.
- :mod:`.fused_adam` — apex's and TE's ``FusedAdam`` in fp32 use: the flags read, the rule, its
  builder.
- :mod:`.rules` — the update rules' builders, by optimizer class (``RULES``); Muon's rule.
- :mod:`.in_step` — updates read as the difference a step stored, a chunk at a time
  (``StoredDifferences``).
- :mod:`.step_state` — ``run_step``: grads ready, veto and step taken, inside one ``step()``.
- :mod:`.precision_aware` — TE's ``FusedAdam`` with master weights: its update derived from what its
  step reads.
- :mod:`.orthogonalized` — Muon and the emerging optimizers: the update read during the step.
"""
