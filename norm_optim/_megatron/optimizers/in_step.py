"""Updates read as the difference a step stored, ``θ_after − θ_before``, a chunk at a time.

Where an update cannot be derived after the step (Muon's Newton-Schulz result is never stored),
or deriving it would repeat the optimizer's own arithmetic (Adam's ``sqrt`` and division: about
half of a plain step on CPU), the step is watched instead: right before it writes a chunk of
tensors their values are copied into the chunk's places in one scratch buffer, right after it
they are subtracted from the stored values in place, and the chunk is summed by the registry's
row norms (:class:`~norm_optim._kernels.chunks.ChunkedSquares`). The extra memory is that
scratch, ``max(byte budget, largest tensor)``, for the step only; a chunk of the byte budget
stays in cache between the copy, the step and the subtraction on CPU, so the read costs no extra
pass over memory there. Each element of the difference is exact to the fp32 rounding of the
subtraction (≤ 2⁻²⁴ of it).

Who calls :meth:`StoredDifferences.begin` / :meth:`~StoredDifferences.end` is the rule's
business: Muon's per-param hooks (:mod:`.orthogonalized`), or torch's Adam / SGD step run chunk
by chunk (:class:`~norm_optim._megatron.optimizers.update_rule.UpdateReader`). The pairing is
checked as the step runs: a step that breaks it is an error, never a number.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, ContextManager, Optional, Protocol

import torch

from ..._errors import NormOptimError
from ..._kernels.chunks import Chunk, ChunkedSquares


class StepReader(Protocol):
    """How the updates of one torch optimizer's counted tensors are read at an armed step."""

    def around_step(self, out: torch.Tensor) -> ContextManager[None]:
        """The step runs inside; an update read in the step adds its float64 sum of squares
        into ``out[slot]``."""

    def after_step(self, out: torch.Tensor) -> None:
        """Right after a taken step: add the updates not read in it (derived) into ``out``."""


def step_name(optimizer: Any) -> str:
    """``module.qualname`` of the function an optimizer's class runs as ``step`` (under torch's
    hook wrapper and ``no_grad`` / ``_use_grad`` decorators, which keep ``__wrapped__``)."""
    step = getattr(type(optimizer), "step", None)
    unwrapped = inspect.unwrap(step) if callable(step) else step
    return f"{getattr(unwrapped, '__module__', '?')}.{getattr(unwrapped, '__qualname__', '?')}"


class StoredDifferences:
    """``Σ (θ_after − θ_before)²`` of fixed tensors, read around the writes of a step.

    Args:
        optimizer: the torch optimizer whose step is read (for messages).
        tensors: the tensors it writes (a DTensor's local shard), fp32 on ``device``.
        slots, num_slots: where each tensor's sum of squares is added.
        device: where the scratch and the result live.
        budget_bytes: scratch bytes per chunk (:class:`ChunkedSquares`); 0: one tensor per
            chunk.
    """

    def __init__(
        self,
        optimizer: Any,
        tensors: Sequence[torch.Tensor],
        slots: Sequence[int],
        num_slots: int,
        device: torch.device,
        budget_bytes: Optional[int] = None,
    ) -> None:
        self.optimizer = optimizer
        # Flat views, made once (the plan lives as long as the registry, as its tensors do); a
        # non-contiguous tensor is flattened at each read (a copy: its values, read only).
        self._tensors = [t.detach() for t in tensors]
        self._flat = [t.view(-1) if t.is_contiguous() else None for t in self._tensors]
        self.plan = ChunkedSquares(
            [t.numel() for t in tensors], slots, num_slots, device, budget_bytes
        )
        self._scratch: Optional[torch.Tensor] = None
        self._out: Optional[torch.Tensor] = None
        self._pending: Optional[tuple[Hashable, list[torch.Tensor]]] = None
        self._done: set[Hashable] = set()

    def _flats(self, chunk: Chunk) -> list[torch.Tensor]:
        return [
            flat if flat is not None else self._tensors[i].reshape(-1)
            for i, flat in ((i, self._flat[i]) for i in chunk.items)
        ]

    def _error(self, what: str) -> NormOptimError:
        return NormOptimError(
            f"{type(self.optimizer).__name__}.step() {what}: its update cannot be read in-step "
            "(not the step norm_optim read)"
        )

    @contextlib.contextmanager
    def reading(self, out: torch.Tensor) -> Iterator[None]:
        """One step's reads go into ``out`` (float64, one slot each); the scratch lives inside."""
        self._scratch = self.plan.scratch() if self.plan.chunks else None
        self._out, self._pending, self._done = out, None, set()
        try:
            yield
        finally:
            pending = self._pending
            self._scratch = self._out = self._pending = None  # nothing stays after the step
        if pending is not None:
            raise self._error("left a tensor unfinished")

    def begin(self, key: Hashable, chunk: Optional[Chunk]) -> None:
        """The step is about to write ``key`` (a tensor, or a chunk of them); ``chunk``: the
        counted tensors it holds (None: none is counted here, only the pairing is checked)."""
        if self._pending is not None:
            raise self._error("started a tensor before finishing the previous one")
        if key in self._done:
            raise self._error("stepped one tensor twice in one step")
        places: list[torch.Tensor] = []
        if chunk is not None:
            assert self._scratch is not None, "begin() outside reading()"
            places = self.plan.places(chunk, self._scratch)
            torch._foreach_copy_(places, self._flats(chunk))
        self._pending = (key, places)

    def end(self, key: Hashable, chunk: Optional[Chunk]) -> None:
        """The step has written ``key``: subtract and sum (see :meth:`begin`)."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != key:
            raise self._error("finished a tensor it had not started")
        self._done.add(key)
        if chunk is not None:
            assert self._scratch is not None and self._out is not None
            # θ_before − θ_after in place (the update's negative: the same squares).
            torch._foreach_sub_(pending[1], self._flats(chunk))
            self.plan.add(chunk, self._scratch, (), self._out)
