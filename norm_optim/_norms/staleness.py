"""When the registry no longer describes the optimizer's tensors, in one place.

The registry (and the plan built from it) holds *views* of the optimizer's fp32 tensors. Megatron
updates them in place while training, but replaces them in ``load_state_dict``,
``reload_model_params``, ``load_parameter_state``, ``offload_to_cpu`` / ``restore_from_cpu``:
the wrapper drops the registry after each of those. Replacements behind its back (the inner
optimizer's own methods, a rebuilt leaf, ``HybridDeviceOptimizer`` re-creating its copies,
``Module.to()`` on frozen params) are caught at each call by a fingerprint that costs O(param
groups), not O(params): per leaf, the optimizer objects, each param group's list and length,
where its first and last tensor (and their precision-aware masters) keep their data, the amount
of optimizer state; and where the first and last frozen param keep theirs. Those replacements
swap every tensor of a group at once, so two per group suffice.

The limit, in one sentence: a tensor replaced in the middle of a param group whose first and last
tensors stay where they are is not noticed; call ``optimizer.refresh()`` after doing that.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .._megatron import fingerprint, where
from .registry import ParamRegistry
from .._counting.vocabulary import Source


@dataclasses.dataclass(frozen=True)
class Check:
    """One look at the optimizer (:meth:`Staleness.check`): whether the registry is stale, and
    the optimizer's fingerprint at that moment, which :meth:`Staleness.record` keeps."""

    stale: bool
    optimizer_print: tuple


class Staleness:
    """Tells, in O(param groups), whether a registry built earlier still matches the optimizer.

    Args:
        optimizer: the (unwrapped) optimizer whose tensors the registry views.
    """

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._watched: tuple[torch.Tensor, ...] = ()
        self._recorded: Optional[tuple] = None  # None: no registry recorded yet

    def check(self) -> Check:
        """Look at the optimizer now: stale when nothing was recorded yet, or the optimizer (or
        a watched frozen param) replaced tensors since :meth:`record`."""
        optimizer_print = fingerprint(self._optimizer)
        stale = self._recorded is None or self._recorded != (
            optimizer_print,
            self._where_watched(),
        )
        return Check(stale, optimizer_print)

    def record(self, registry: ParamRegistry, check: Check) -> None:
        """Remember the state ``registry`` was built from: the optimizer as ``check`` (the
        look that led to the build) saw it, and where its frozen params keep their data now."""
        frozen = [r.param for r in registry.counted if r.source is Source.FROZEN]
        # No optimizer holds frozen params: Module.to() or an offloaded model swaps their data.
        self._watched = tuple(frozen[:1] + frozen[-1:])
        self._recorded = (check.optimizer_print, self._where_watched())

    @property
    def recorded_before(self) -> bool:
        """Whether a registry was ever recorded (False until the first build)."""
        return self._recorded is not None

    def _where_watched(self) -> tuple:
        return tuple(map(where, self._watched))
