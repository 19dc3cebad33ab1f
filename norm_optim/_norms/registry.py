"""The registry: for each model param, the fp32 tensor this rank holds for it and whether it counts.

Built once, in O(params), from what the Megatron adapter reads (:func:`norm_optim._megatron.read_model`:
every param with its holding, traits and coordinates, every layout checked there) and the counting
rule (:mod:`norm_optim._counting.ownership`). It names no layout: a new one is a change in the
adapter and, at most, a new case of the rule. The hot call only reads :attr:`ParamRegistry.counted`,
already grouped into kernel plans; it never walks params.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch

from .._comm import Communicator
from .._kernels import Summand
from .._megatron import Declarations, HeldParam, OptimizerDescriptor, read_model
from .._counting.ownership import Copies, RankCoords, why_not_counted
from .._counting.vocabulary import NotCounted, Source, SplitFrom


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One model param as this rank sees it.

    Attributes:
        name: the param's name in the model (chunk-prefixed when there are several chunks).
        global_name: its layout-independent name (global layer number, global expert index;
            the keys of ``param_l2_norms(per_param=True).per_param``); the local name when the
            registry has no model.
        param: the model param.
        tensor: what this rank sums for it: the optimizer's fp32 main param, this rank's fp32
            shard of it, the fp32 param itself, the param itself when frozen, a
            :class:`~norm_optim._kernels.RemainderMaster` (an fp32 master shard encoded as a
            16-bit param and its int16 remainder: ``dtype``, ``shape`` and ``numel()`` are those
            of the fp32 master), or None.
        source: how ``tensor`` relates to ``param`` (:class:`~norm_optim.inspection.Source`).
        counted: whether this rank adds ``tensor``'s squares to the global norm (then the
            record is a :class:`CountedRecord`, whose ``tensor`` is never None).
        reason: why it is not counted (:class:`~norm_optim.inspection.NotCounted`), or None.
        copies: which groups hold copies of what this rank holds (the counting rule's input;
            the audit compares those copies). ``expert`` and ``tp_split`` read it.
        split_from: where ``tp_split`` was taken from
            (:class:`~norm_optim._counting.vocabulary.SplitFrom`): the model's checkpoint
            declaration (``sharded_state_dict``) or megatron's marker (no declaration; models that
            are not megatron modules).
        note: for a megatron model's param, how megatron's marker disagrees with its
            declaration (the declaration counts), or why there is no declaration; else None.
        offset: where ``tensor`` starts in the flattened param (a shard's start, else 0).
    """

    name: str
    global_name: str
    param: torch.nn.Parameter
    tensor: Optional[Summand]
    source: Source
    counted: bool
    reason: Optional[NotCounted]
    copies: Copies
    split_from: SplitFrom = SplitFrom.MARKER
    note: Optional[str] = None
    offset: int = 0

    # What the counting rule read is kept once, in ``copies``; these read it.
    @property
    def expert(self) -> bool:
        """Whether it is an expert param (reduced with the expert layout)."""
        return self.copies.expert

    @property
    def tp_split(self) -> bool:
        """Whether the (expert-)TP group splits it (if not, TP ranks > 0 hold copies)."""
        return self.copies.tp_split

    @property
    def numel(self) -> int:
        """Elements this rank sums for the param (0 when it does not count it)."""
        return self.tensor.numel() if self.counted and self.tensor is not None else 0

    def __repr__(self) -> str:
        held = (
            "none"
            if self.tensor is None
            else (f"{self.tensor.dtype} {tuple(self.tensor.shape)} of {tuple(self.param.shape)}")
        )
        return (
            f"ParamRecord({self.name!r}, {self.source}, {held}, "
            f"{'expert' if self.expert else 'dense'}, "
            f"{'counted' if self.counted else 'not counted: ' + str(self.reason)}, "
            f"{'tp-split' if self.tp_split else 'tp-replicated'} by {self.split_from}"
            + (f": {self.note}" if self.note else "")
            + ")"
        )


@dataclasses.dataclass(frozen=True, repr=False)
class CountedRecord(ParamRecord):
    """A record this rank counts: ``counted`` is True, ``reason`` None, and it holds a ``tensor``.

    :attr:`ParamRegistry.counted` lists these (they are in :attr:`ParamRegistry.records` too),
    so code that sums them needs no check for a missing tensor.

    Raises:
        ValueError: built with no tensor, or not counted.
    """

    tensor: Summand

    def __post_init__(self) -> None:
        if self.tensor is None or not self.counted or self.reason is not None:
            raise ValueError(
                f"a CountedRecord is counted and holds a tensor; {self.name!r} has "
                f"tensor={'None' if self.tensor is None else 'a tensor'}, "
                f"counted={self.counted}, reason={self.reason}"
            )


class ParamRegistry:
    """Every model param of one optimizer (and model), and what this rank counts of each.

    Args:
        optimizer: the (unwrapped) optimizer, as the wrapper was given it.
        model: module or list of model chunks; needed to see frozen params and to name params.
            Defaults to the chunks the optimizer knows (``optimizer.model_chunks``).
        coords: this rank's coordinates in the replicating groups.
        comm: the communication seam (to read the optimizer's groups).
        count_frozen: count params no optimizer holds (``requires_grad=False``), as Megatron-LM's
            ``calc_params_l2_norm`` does.
    """

    def __init__(
        self,
        optimizer: Any,
        model: Any = None,
        *,
        coords: RankCoords,
        comm: Communicator,
        count_frozen: bool = True,
    ) -> None:
        reading = read_model(optimizer, model, coords=coords, comm=comm)
        self.sees_frozen_params = reading.chunks is not None
        # What the model's checkpoint declarations said (read once per build, no collective).
        self.declarations: Declarations = reading.declarations
        self.records: list[ParamRecord] = [
            _record(held, count_frozen=count_frozen) for held in reading.params
        ]
        self.counted: list[CountedRecord] = [
            r for r in self.records if isinstance(r, CountedRecord)
        ]
        self.chunks: Optional[list[torch.nn.Module]] = reading.chunks
        # One record per leaf optimizer (kind, holdings, rule, moments, copy groups): what step
        # norms and the audit read, built once with the registry.
        self.descriptor: OptimizerDescriptor = reading.descriptor

    def __iter__(self) -> Iterator[ParamRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, name: str) -> ParamRecord:
        """The record of a param by its local name or its layout-independent (per-param) name."""
        for record in self.records:
            if name in (record.name, record.global_name):
                return record
        raise KeyError(f"no param named {name!r} in the registry")

    def find(self, param: torch.Tensor) -> ParamRecord:
        """The record of a model param."""
        for record in self.records:
            if record.param is param:
                return record
        raise KeyError("that tensor is not a param of the registry's model")

    @property
    def counted_numel(self) -> int:
        """Elements this rank sums per call."""
        return sum(r.numel for r in self.counted)

    def summary(self) -> str:
        """A one-line account of what this rank counts, for logs."""
        by_reason: dict[str, int] = {}
        for r in self.records:
            if not r.counted:
                by_reason[r.reason or "?"] = by_reason.get(r.reason or "?", 0) + 1
        skipped = ", ".join(f"{n} {k}" for k, n in sorted(by_reason.items())) or "none"
        declared = sum(r.split_from == SplitFrom.DECLARATION for r in self.records)
        noted = sum(r.note is not None for r in self.records)
        return (
            f"{len(self.records)} params, {len(self.counted)} counted here "
            f"({self.counted_numel} elements); not counted: {skipped}; TP split from "
            f"declarations for {declared}, markers for {len(self.records) - declared}"
            + (f" ({noted} noted: see the records' note)" if noted else "")
            + (f"; declarations {self.declarations.caveat}" if self.declarations.caveat else "")
        )

    @property
    def noted(self) -> list[ParamRecord]:
        """Records whose marker disagrees with the declaration, or that have no declaration
        although the model is a megatron model (see :attr:`ParamRecord.note`)."""
        return [r for r in self.records if r.note is not None]


def _record(held: HeldParam, *, count_frozen: bool) -> ParamRecord:
    """The counting rule applied to one param the adapter read: a :class:`CountedRecord` when
    this rank counts it."""
    holding, traits, copies = held.holding, held.traits, held.copies
    if holding.source.is_frozen and not count_frozen:  # whole frozen params or their shards
        reason: Optional[NotCounted] = NotCounted.FROZEN_EXCLUDED
    elif holding.tensor is None:
        # A tied copy is no param of its own, whether or not this rank holds a shard of it.
        reason = NotCounted.SHARED if traits.tied_copy else NotCounted.HELD_ELSEWHERE
    else:
        reason = why_not_counted(copies, held.coords)
    # A counted param always has a tensor (no tensor is a reason above): CountedRecord checks
    # that when it is built, which mypy cannot follow through the merged branches.
    kind: type[ParamRecord] = ParamRecord if reason is not None else CountedRecord
    return kind(
        name=held.name,
        global_name=held.global_name,
        param=held.param,
        tensor=holding.tensor,
        source=holding.source,
        counted=reason is None,
        reason=reason,
        copies=copies,
        split_from=traits.split_from,
        note=traits.note,
        offset=holding.offset,
    )
