"""Step norms: what one armed ``step()`` saw and did, per param and layer, in one all-reduce.

:class:`StepMeasurement` runs around one ``step()`` of the wrapped optimizer: the adapter's
:func:`~norm_optim._megatron.optimizers.step_state.run_step` calls it back once the grads are ready
(unscaled, before Megatron clips them in place) and when the step is taken (a skipped step never
is). The updates are read in the step as the difference it stores (torch's Adam / SGD run chunk by
chunk, Muon's per-param hooks: :mod:`norm_optim._megatron.optimizers.in_step`) or derived from the
optimizer's state by each leaf's rule (:mod:`norm_optim._megatron.optimizers.rules`); after the
step, the weights and the Adam moments are summed over the same slots, and the five vectors travel
as one packet.

What is known before any step (which tensor each counted record is, its rule, the reader of
each torch optimizer's updates and its scratch layout) is a :class:`StepPlan`, built once per registry from its
descriptor and reused by every armed step. An unarmed step never reaches this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Mapping, Optional

import torch

from .._comm import Done, Work
from .bound_grads import BoundGrads
from .._errors import NormOptimError, UnsupportedOptimizerError
from .._kernels import SumOfSquaresPlan
from .._megatron.optimizers.descriptor import clip_group_of, separate_clip_groups
from .._megatron.optimizers.in_step import StepReader
from .._megatron.optimizers.update_rule import Counted, Stepped
from .._megatron.optimizers.step_state import run_step
from .._norms.reducer import NamedNorms, NormReducer, ParamNorms, PendingNorms
from .watch import Watch
from .watch_signals import JudgedStep


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
        clip_groups: the grads' norm of each group Megatron clips on its own (megatron-core
            >= 0.19: ``"mtp"``, multi-token prediction with ``mtp_detach_heads``), where some
            rank holds one, and of the ``"main"`` group: every other param, the grad norm
            ``step()`` returns. ``grads`` is over every param.
        momentum: the momentum buffer of Muon (and AdaptiveMuon) after the step, over the params
            they step (zero for the others, whose Adam moments are ``exp_avg``, ``exp_avg_sq``);
            None when no leaf keeps one.
    """

    weights: ParamNorms
    grads: ParamNorms
    updates: ParamNorms
    exp_avg: Optional[ParamNorms]
    exp_avg_sq: Optional[ParamNorms]
    update_to_weight: Optional[NamedNorms]
    skipped: bool
    clip_groups: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    momentum: Optional[ParamNorms] = None

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
        has_momentum: bool = False,
        clip_groups: Sequence[str] = (),
    ) -> None:
        self._packet, self._work, self._reducer = packet, work, reducer
        self._per_param, self._has_moments, self._skipped = per_param, has_moments, skipped
        self._has_momentum = has_momentum
        self._clip_groups = tuple(clip_groups)
        self._result: Optional[StepNorms] = None

    def wait(self) -> StepNorms:
        if self._result is None:
            self._work.wait()
            slots = self._reducer.per_param_slots if self._per_param else None
            n = self._reducer.num_slots(self._per_param)
            k = len(self._clip_groups)
            quantities, groups = self._packet[: len(self._packet) - k], self._packet[-k:]
            norms = [PendingNorms(part, Done(), slots).wait() for part in quantities.split(n)]
            weights, grads, updates = norms[:3]
            exp_avg, exp_avg_sq = norms[3:5] if self._has_moments else (None, None)
            momentum = norms[-1] if self._has_momentum else None
            ratio = None
            if weights.per_layer is not None and updates.per_layer is not None:
                w, u = weights.per_layer, updates.per_layer
                assert isinstance(w, NamedNorms) and isinstance(u, NamedNorms)
                ratio = w.with_vector(u.vector / w.vector)
            clip_groups = {}
            if k:
                # main² = all² − Σ separate², in float64 (≥ 0 up to its rounding).
                main = (grads.total.square() - groups.sum()).clamp_(min=0).sqrt()
                clip_groups = {"main": main, **dict(zip(self._clip_groups, groups.sqrt()))}
            self._result = StepNorms(
                weights,
                grads,
                updates,
                exp_avg,
                exp_avg_sq,
                ratio,
                self._skipped,
                clip_groups,
                momentum=momentum,
            )
        return self._result


class StepPlan:
    """What every armed step of one registry reads, built once from its descriptor.

    Refuses, by name, a layout or a leaf whose step cannot be read (the same on every rank), and
    a counted tensor that no optimizer steps or that is not fp32.

    Args:
        reducer: the wrapper's reducer (records, slots).
        per_param: the slots of per-param norms (else total / dense / expert).
    """

    def __init__(self, reducer: NormReducer, per_param: bool) -> None:
        descriptor = reducer.registry.descriptor
        descriptor.refuse_step()
        self.has_moments = descriptor.has_moments
        self.has_momentum = descriptor.has_momentum
        records = reducer.registry.counted
        self.entries: list[Optional[Stepped]] = []
        for record in records:
            if record.source.is_frozen:
                self.entries.append(None)
                continue
            entry = descriptor.stepped(record.tensor)
            if entry is None:
                raise UnsupportedOptimizerError(
                    f"the fp32 tensor norm_optim holds for {record.name!r} is not a tensor the "
                    "inner optimizer steps (a padded or re-encoded shard?): its step cannot be "
                    "read exactly"
                )
            if entry.held.dtype != torch.float32:
                raise UnsupportedOptimizerError(
                    f"{record.name!r} is stepped as a {entry.held.dtype} tensor: step norms "
                    "derive updates on fp32 tensors only (its rounding would dominate the update)"
                )
            self.entries.append(entry)
        self.names = [r.name for r in records]
        self._indices = reducer.indices
        self._clip_groups(reducer, records)
        slots = reducer.counted_slots(per_param)
        self.num_slots, self.device = reducer.num_slots(per_param), reducer.device
        # One reader per (rule, torch optimizer): its counted tensors' updates, read in its
        # step or derived right after it, into one slot vector of the step.
        by_optimizer: dict[tuple[int, int], tuple[Any, list[Stepped], list[int]]] = {}
        for i, e in enumerate(self.entries):
            if e is not None:
                key = (id(e.rule), id(e.optimizer))
                found = by_optimizer.setdefault(key, (e.optimizer, [], []))
                found[1].append(e)
                found[2].append(slots[i])
        self.readers: list[StepReader] = [
            entries[0].rule.reader(optimizer, Counted(entries, own, self.num_slots, self.device))
            for optimizer, entries, own in by_optimizer.values()
        ]
        self._squares: Optional[torch.Tensor] = None
        # The step's grads, through views of the buffers they live in (as the watch reads them).
        self.bound_grads = BoundGrads(
            self.entries,
            [r.param for r in records],
            slots,
            self.num_slots,
            self.device,
            self._indices,
        )

    def _clip_groups(self, reducer: NormReducer, records: Sequence[Any]) -> None:
        """The separately clipped groups some rank holds a param of (one small all-reduce, here
        once: every rank then reports the same groups), and each counted record's."""
        known = separate_clip_groups()
        tags = [clip_group_of(r.param) for r in records]
        held = torch.tensor([float(g in tags) for g in known], dtype=torch.float64)
        if known:
            held = held.to(reducer.device)
            reducer.comm.all_reduce_sum(held, reducer.group, False).wait()
        self.clip_groups = tuple(g for g, n in zip(known, held.tolist()) if n > 0)
        self.clip_slots = [
            self.clip_groups.index(t) if t in self.clip_groups else None for t in tags
        ]

    def clip_group_squares(self, grads: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
        """The grads' sum of squares of each separately clipped group (empty: none)."""
        kept = [(g, s) for g, s in zip(grads, self.clip_slots) if g is not None and s is not None]
        plan = SumOfSquaresPlan(
            [g for g, _ in kept],
            [s for _, s in kept],
            len(self.clip_groups),
            out_device=self.device,
            indices=self._indices,
        )
        return plan()

    def check(self) -> None:
        """Refuse, before the step, a tensor whose step cannot be read now (its state)."""
        for entry, name in zip(self.entries, self.names):
            if entry is not None:
                why = entry.rule.check(entry)
                if why is not None:
                    raise UnsupportedOptimizerError(f"{name!r}: {why}")

    def grads(self) -> list[Optional[torch.Tensor]]:
        return [None if e is None else e.grad for e in self.entries]

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """The step runs inside: the readers that read in the step do."""
        self._squares = torch.zeros(self.num_slots, dtype=torch.float64, device=self.device)
        with contextlib.ExitStack() as stack:
            for reader in self.readers:
                stack.enter_context(reader.around_step(self._squares))
            yield

    def momentum(self) -> list[Optional[torch.Tensor]]:
        """Each tensor's momentum buffer (Muon's; None for the other rules)."""
        return [
            None if e is None or e.rule.momentum is None else e.state.get(e.rule.momentum)
            for e in self.entries
        ]

    def moments(self) -> tuple[list[Optional[torch.Tensor]], list[Optional[torch.Tensor]]]:
        pairs = [(None, None) if e is None else e.rule.moment_tensors(e) for e in self.entries]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def add_update_squares(self, out: torch.Tensor) -> None:
        """Add the updates' sums of squares into ``out`` (right after a taken step): those
        read in it, and those derived now."""
        if self._squares is None:
            raise NormOptimError("the step did not run inside the step plan's around_step()")
        out += self._squares
        for reader in self.readers:
            reader.after_step(out)


class StepMeasurement:
    """One armed step: arm (checks, names exchange), run the step with :meth:`grads_ready` and
    :meth:`step_taken` as its hooks and the plan's in-step readers around it
    (:func:`observed_step`), then :meth:`launch` the packet.

    Args:
        reducer: the wrapper's current reducer (records, slots, the weights' plans).
        optimizer: the wrapped optimizer (its instance gets the two hooks for the step).
        per_param: also per-param, per-layer and per-expert norms.
    """

    def __init__(self, reducer: NormReducer, optimizer: Any, per_param: bool) -> None:
        self.reducer, self.optimizer, self.per_param = reducer, optimizer, per_param
        self.plan = reducer.step_plan(per_param, StepPlan)
        self.plan.check()  # refuse now, before the step, not after it
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
        reducer, per_param, plan = self.reducer, self.per_param, self.plan
        parts = [reducer.local_weight_squares(per_param), self._grads, self._update_squares()]
        if plan.has_moments:
            parts.append(reducer.local_squares(*plan.moments(), per_param=per_param))
        if plan.has_momentum:
            parts.append(reducer.local_squares(plan.momentum(), per_param=per_param))
        if plan.clip_groups:
            parts.append(self._clip_group_squares)
        packet = torch.cat(parts)
        work = reducer.comm.all_reduce_sum(packet, reducer.group, True)
        return PendingStepNorms(
            packet,
            work,
            reducer,
            per_param,
            plan.has_moments,
            skipped=not self._stepped,
            has_momentum=plan.has_momentum,
            clip_groups=plan.clip_groups,
        )

    def _grad_squares(self) -> torch.Tensor:
        if self.plan.clip_groups:
            self._clip_group_squares = self.plan.clip_group_squares(self.plan.grads())
        squares = self.plan.bound_grads()[: self.plan.num_slots]  # the last: no reader's
        return self.reducer.fold(squares) if self.per_param else squares

    def _update_squares(self) -> torch.Tensor:
        """Sums of squares of the updates (zero for a skipped step): read in the step or
        derived after it, a few list operations per chunk of one scratch of the byte budget
        (:mod:`norm_optim._megatron.optimizers.in_step`): the scratch is all the update memory alive
        at once."""
        reducer, per_param = self.reducer, self.per_param
        squares = torch.zeros(
            reducer.num_slots(per_param), dtype=torch.float64, device=reducer.device
        )
        if not self._stepped:
            return squares
        self.plan.add_update_squares(squares)
        return reducer.fold(squares) if per_param else squares


class WatchedGrads:
    """What a watched step sums: its grads (unscaled, before clipping), per param, in one
    all-reduce of the per-param slot vector, judged by the :class:`~norm_optim._step.watch.Watch`
    on the device. Built once per reducer; the grads are read through views of the buffers
    they live in (:class:`~norm_optim._step.bound_grads.BoundGrads`), bound at the first watched
    step, so a step's ops do not grow with the number of params.

    Args:
        reducer: the wrapper's current reducer (its per-param slots: the names exchange runs
            at the first watched step, on every rank).
        watch: the judge.
    """

    def __init__(self, reducer: NormReducer, watch: Watch) -> None:
        self.reducer, self.watch = reducer, watch
        # Only the grads are read: any leaf whose stepped tensors the descriptor knows serves,
        # whether or not its update rule is one step norms derive.
        descriptor = reducer.registry.descriptor
        entries: list[Optional[Stepped]] = []
        for record in reducer.registry.counted:
            entry = None if record.source.is_frozen else descriptor.stepped(record.tensor)
            if entry is None and not record.source.is_frozen:
                raise UnsupportedOptimizerError(
                    f"the watch reads the grad of each fp32 tensor the optimizer steps; the one "
                    f"norm_optim holds for {record.name!r} is not a tensor any leaf steps"
                )
            entries.append(entry)
        reducer.num_slots(True)  # the per-param slots (names exchange) before the first step
        self.grads = BoundGrads(
            entries,
            [r.param for r in reducer.registry.counted],
            reducer.counted_slots(True),
            reducer.num_slots(True),
            reducer.device,
            reducer.indices,
        )
        self._judged: Optional[JudgedStep] = None

    def grads_ready(self) -> None:
        """Sum, reduce and judge the grads (on the device: no host sync)."""
        reducer = self.reducer
        # The per-param slots and one more (what lies between bound grads), reduced whole: a
        # slice would be one more op, and no reader looks at that slot.
        squares = self.grads()
        reducer.comm.all_reduce_sum(squares, reducer.group, async_op=False).wait()
        self._judged = self.watch.judge_grads(squares, reducer.per_param_slots, reducer.device)

    def veto(self) -> bool:
        """With ``skip``, whether this step must not be applied: the verdict read on the host
        (the watch's one host read, after the step's own)."""
        judged, self._judged = self._judged, None
        if not self.watch.config.skip or judged is None:
            return False
        skip = bool(judged.verdict(self.watch.config.k))
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

    in_step = (
        measurement.plan.around_step() if measurement is not None else contextlib.nullcontext()
    )
    with in_step:  # the in-step rules' readers (Muon's update)
        return run_step(optimizer, grads_ready, step_taken, veto, *args, **kwargs)
