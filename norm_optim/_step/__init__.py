"""The step: the armed measurement of one ``step()`` (its update's and grads' norms) and the watch,
which judges every step's reduced grads.

- :mod:`.measurement` — step norms: ``StepPlan`` (built once per registry), ``StepMeasurement``,
  ``StepNorms``; the watch's per-step reads (``WatchedGrads``).
- :mod:`.watch` — the watch: ``Watch``, ``Alarm``.
- :mod:`.watch_config` — ``WatchConfig``: how the watch decides that a value is a spike.
- :mod:`.watch_signals` — the watch's signals on the device: ``RollingStats``, the grads signals
  judged in buffers made once.
- :mod:`.bound_grads` — ``BoundGrads``: a watched step's grads read through views of the buffers
  they live in, bound once.
"""
