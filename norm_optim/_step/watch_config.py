"""How the watch decides that a value is a spike: :class:`WatchConfig` (what ``watch()`` and
``install(watch=...)`` take; the watch itself is :mod:`norm_optim._step.watch`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass(frozen=True)
class WatchConfig:
    """How the watch decides that a value is a spike.

    Attributes:
        k: a value more than ``k`` rolling standard deviations above the rolling mean of the
            values before it is a spike (OLMo-core: 6).
        window: how many past values the mean and σ are taken over (OLMo-core: 128).
        warmup: no verdict before this many values were seen (OLMo-core: half the window).
        min_rel_std: σ is taken as at least this fraction of the mean, so that a signal that
            has been almost constant does not alarm on a tiny move: with the defaults a value
            must also be 6 % above its mean.
        skip: do not apply a step with a spike (or a non-finite grad): the weights, moments
            and the optimizer's step count stay as they were, and Megatron counts a skipped
            iteration. Off by default: watching alone never changes a training bit.
        arm_after_alarm: measure the step after an alarm per param
            (:meth:`~norm_optim.NormAwareOptimizer.measure_next_step`), so that the spike's
            aftermath is recorded in full.
        max_names: at most this many param names in one alarm (non-finite grads), then a count.
    """

    k: float = 6.0
    window: int = 128
    warmup: int = 64
    min_rel_std: float = 0.01
    skip: bool = False
    arm_after_alarm: bool = True
    max_names: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.k, (int, float)) and self.k > 0):
            raise ValueError(f"WatchConfig.k must be a number > 0, got {self.k!r}")
        if not (isinstance(self.window, int) and self.window >= 2):
            raise ValueError(f"WatchConfig.window must be an int >= 2, got {self.window!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 2):
            raise ValueError(f"WatchConfig.warmup must be an int >= 2, got {self.warmup!r}")
        if self.min_rel_std < 0:
            raise ValueError(f"WatchConfig.min_rel_std must be >= 0, got {self.min_rel_std!r}")

    @classmethod
    def of(cls, value: "bool | dict[str, Any] | WatchConfig | None") -> Optional["WatchConfig"]:
        """``install(watch=...)``'s value as a config: True (defaults), a dict of fields, a
        config, or False / None (no watch)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(
                    f"watch: unknown options {unknown}; WatchConfig takes "
                    f"{[f.name for f in dataclasses.fields(cls)]}"
                )
            return cls(**value)
        raise TypeError(f"watch must be True, a dict or a WatchConfig, got {type(value).__name__}")
