"""The weight norms: the registry (the counting rule applied to what the adapter read), the reducer
(one sum-of-squares plan, one all-reduce), when the registry must be rebuilt, and the per-param
names' exchange.

- :mod:`.registry` — ``ParamRegistry``, ``ParamRecord``, ``CountedRecord``: the counting rule
  applied to what the adapter read.
- :mod:`.reducer` — the reducer: slots, one sum-of-squares plan, one all-reduce; ``ParamNorms``,
  ``NamedNorms``.
- :mod:`.staleness` — when the registry must be rebuilt (the optimizer's fingerprint).
- :mod:`.names` — the per-param names of every rank, in three collectives.
"""
