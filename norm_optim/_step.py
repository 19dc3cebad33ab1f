"""Step norms: what one armed ``step()`` saw and did, per param and layer, in one all-reduce.

:class:`StepMeasurement` runs around one ``step()`` of the wrapped optimizer: the adapter's
:func:`~norm_optim._megatron.step_state.run_step` calls it back once the grads are ready
(unscaled, before Megatron clips them in place) and when the step is taken (a skipped step never
is). After the step, the weights, the updates (derived from the optimizer's state:
:mod:`norm_optim._megatron.step_state`) and the Adam moments are summed over the same slots, and
the five vectors travel as one packet.

An unarmed step never reaches this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ._comm import Done, Work
from ._errors import NormOptimError
from ._megatron.step_state import StepState, read_step_state, run_step
from ._kernels import SumOfSquaresPlan
from ._norm import NamedNorms, NormReducer, ParamNorms, PendingNorms
from ._watch import Watch

# Elements of derived updates summed per kernel plan (fp32: 128 KiB alive at once).
UPDATE_BATCH = 1 << 15


@dataclasses.dataclass(frozen=True)
class StepNorms:
    """The global L2 norms of one optimizer step (0-dim float64 tensors, no host sync until read).

    Attributes:
        weights: the fp32 main weights after the step (as ``param_l2_norms()`` then).
        grads: the gradient the step used: after loss-scale unscaling, before clipping.
        updates: the change the step made to the fp32 mains (θ after − θ before; clipping and
            weight decay included), zero for a skipped step.
        exp_avg, exp_avg_sq: Adam's moments after the step; None for an optimizer without them.
        update_to_weight: per layer, ``updates.per_layer / weights.per_layer`` (None without
            ``per_param``).
        skipped: the optimizer skipped the step (fp16 overflow, or a grad-norm threshold).
    """

    weights: ParamNorms
    grads: ParamNorms
    updates: ParamNorms
    exp_avg: Optional[ParamNorms]
    exp_avg_sq: Optional[ParamNorms]
    update_to_weight: Optional[NamedNorms]
    skipped: bool

    @property
    def update_to_weight_total(self) -> torch.Tensor:
        """‖Δθ‖ / ‖θ‖ over the whole model."""
        return self.updates.total / self.weights.total


class PendingStepNorms:
    """A step's packet whose all-reduce may still be in flight; :meth:`wait` gives
    :class:`StepNorms`."""

    def __init__(
        self,
        packet: torch.Tensor,
        work: Work,
        reducer: NormReducer,
        per_param: bool,
        has_moments: bool,
        skipped: bool,
    ) -> None:
        self._packet, self._work, self._reducer = packet, work, reducer
        self._per_param, self._has_moments, self._skipped = per_param, has_moments, skipped
        self._result: Optional[StepNorms] = None

    def wait(self) -> StepNorms:
        if self._result is None:
            self._work.wait()
            slots = self._reducer.per_param_slots if self._per_param else None
            n = self._reducer.num_slots(self._per_param)
            norms = [PendingNorms(part, Done(), slots).wait() for part in self._packet.split(n)]
            weights, grads, updates = norms[:3]
            exp_avg, exp_avg_sq = norms[3:] if self._has_moments else (None, None)
            ratio = None
            if weights.per_layer is not None and updates.per_layer is not None:
                w, u = weights.per_layer, updates.per_layer
                assert isinstance(w, NamedNorms) and isinstance(u, NamedNorms)
                ratio = NamedNorms(w._index, u.vector / w.vector)
            self._result = StepNorms(
                weights, grads, updates, exp_avg, exp_avg_sq, ratio, self._skipped
            )
        return self._result


class StepMeasurement:
    """One armed step: arm (checks, names exchange), run the step with :meth:`grads_ready` and
    :meth:`step_taken` as its hooks, then :meth:`launch` the packet.

    Args:
        reducer: the wrapper's current reducer (records, slots, the weights' plans).
        optimizer: the wrapped optimizer (its instance gets the two hooks for the step).
        per_param: also per-param, per-layer and per-expert norms.
    """

    def __init__(self, reducer: NormReducer, optimizer: Any, per_param: bool) -> None:
        self.reducer, self.optimizer, self.per_param = reducer, optimizer, per_param
        self.state: StepState = read_step_state(optimizer)
        self._counted = reducer.registry.counted
        for record in self._counted:  # refuse now, before the step, not after it
            if not record.source.is_frozen:
                self.state.check(record.tensor, record.name)  # type: ignore[arg-type]
        reducer.num_slots(per_param)  # builds the per-param slots (the names exchange) now
        self._grads: Optional[torch.Tensor] = None
        self._stepped = False

    def grads_ready(self) -> None:
        """The step's grads are on the fp32 mains, unscaled, not clipped yet: sum them."""
        self._grads = self._grad_squares()

    def step_taken(self) -> None:
        self._stepped = True

    def launch(self) -> PendingStepNorms:
        """After the step: the local sums of every quantity, then one all-reduce of them all."""
        if self._grads is None:
            raise NormOptimError(
                f"{type(self.optimizer).__name__}.step() did not call prepare_grads(): the "
                "grads of this step could not be read"
            )
        reducer, per_param, records = self.reducer, self.per_param, self._counted
        state = self.state
        parts = [reducer.local_weight_squares(per_param), self._grads, self._update_squares()]
        if state.has_moments:
            moments = [
                state.moments(r.tensor, r.name) if not r.source.is_frozen else (None, None)  # type: ignore[arg-type]
                for r in records
            ]
            exp_avg, exp_avg_sq = ([m[i] for m in moments] for i in (0, 1))
            parts.append(reducer.local_squares(exp_avg, exp_avg_sq, per_param=per_param))
        packet = torch.cat(parts)
        work = reducer.comm.all_reduce_sum(packet, reducer.group, True)
        return PendingStepNorms(
            packet, work, reducer, per_param, state.has_moments, skipped=not self._stepped
        )

    def _grad_squares(self) -> torch.Tensor:
        grads = [
            self.state.grad(r.tensor, r.name) if not r.source.is_frozen else None  # type: ignore[arg-type]
            for r in self._counted
        ]
        return self.reducer.local_squares(grads, per_param=self.per_param)

    def _update_squares(self) -> torch.Tensor:
        """Sums of squares of the derived updates (zero for a skipped step).

        The pieces the adapter derives are summed by the same kernels as everything else, a
        batch of about ``UPDATE_BATCH`` elements per one-shot plan: the batch is all the update
        memory alive at once, whatever the model size.
        """
        reducer, per_param = self.reducer, self.per_param
        squares = torch.zeros(
            reducer.num_slots(per_param), dtype=torch.float64, device=reducer.device
        )
        if not self._stepped:
            return squares
        pieces: list[torch.Tensor] = []
        slots: list[int] = []

        def flush() -> None:
            plan = SumOfSquaresPlan(pieces, slots, len(squares), out_device=reducer.device)
            squares.add_(plan())
            pieces.clear()
            slots.clear()

        batch = 0
        for record, slot in zip(self._counted, reducer.counted_slots(per_param)):
            if record.source.is_frozen:
                continue
            for piece in self.state.update_pieces(record.tensor, record.name):  # type: ignore[arg-type]
                pieces.append(piece)
                slots.append(slot)
                batch += piece.numel()
                if batch >= UPDATE_BATCH:
                    flush()
                    batch = 0
        if pieces:
            flush()
        return reducer.fold(squares) if per_param else squares


class WatchedGrads:
    """What a watched step sums: its grads (unscaled, before clipping), per param, in one
    all-reduce of the per-param slot vector, judged by the :class:`~norm_optim._watch.Watch`
    on the device. Built once per reducer (the step state maps the same tensors until the
    registry is rebuilt).

    Args:
        reducer: the wrapper's current reducer (its per-param slots: the names exchange runs
            at the first watched step, on every rank).
        optimizer: the wrapped optimizer.
        watch: the judge.
    """

    def __init__(self, reducer: NormReducer, optimizer: Any, watch: Watch) -> None:
        self.reducer, self.watch = reducer, watch
        self.state: StepState = read_step_state(optimizer)
        self._counted = reducer.registry.counted
        self._verdict: Optional[torch.Tensor] = None
        reducer.num_slots(True)  # the per-param slots (names exchange) before the first step

    def grads_ready(self) -> None:
        """Sum, reduce and judge the grads (on the device: no host sync)."""
        reducer = self.reducer
        grads = [
            self.state.grad(r.tensor, r.name) if not r.source.is_frozen else None  # type: ignore[arg-type]
            for r in self._counted
        ]
        squares = reducer.local_squares(grads, per_param=True)
        reducer.comm.all_reduce_sum(squares, reducer.group, async_op=False).wait()
        self._verdict = self.watch.judge_grads(squares, reducer.per_param_slots, reducer.device)

    def veto(self) -> bool:
        """With ``skip``, whether this step must not be applied: the verdict read on the host
        (the watch's one host read, after the step's own)."""
        if not self.watch.config.skip or self._verdict is None:
            return False
        skip, self._verdict = bool(self._verdict), None
        if skip:
            self.watch.mark_skipped()
        return skip


def observed_step(
    optimizer: Any,
    measurement: Optional[StepMeasurement],
    watched: Optional[WatchedGrads],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with an armed measurement and / or a watch reading
    its grads before clipping; the watch may veto the step (``skip``)."""

    @torch.no_grad()
    def grads_ready() -> None:
        if measurement is not None:
            measurement.grads_ready()
        if watched is not None:
            watched.grads_ready()

    def step_taken() -> None:
        if measurement is not None:
            measurement.step_taken()

    def veto() -> bool:
        return watched is not None and watched.veto()

    return run_step(optimizer, grads_ready, step_taken, veto, *args, **kwargs)
