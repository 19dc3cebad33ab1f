"""The registry: for each model param, the fp32 tensor this rank holds for it and whether it counts.

Built once, in O(params), from the optimizer (:mod:`norm_optim.sources`) and the counting rule
(:mod:`norm_optim.ownership`). The hot call only reads :attr:`ParamRegistry.counted`, already
grouped into kernel plans; it never walks params.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from .comm import Communicator
from .errors import ParallelStateError, UnknownParamError
from .kernels import Summand
from .megatron_fsdp import model_param
from .naming import expert_param_ids, tensor_parallel_split_ids
from .ownership import RankCoords, why_not_counted
from .sources import Holding, read_holdings

DENSE, EXPERT = 0, 1
"""Slots of the dense and expert sums of squares in every reduced vector."""


@dataclasses.dataclass(frozen=True)
class ParamRecord:
    """One model param as this rank sees it.

    Attributes:
        name: the param's name in the model (chunk-prefixed when there are several chunks).
        param: the model param.
        tensor: what this rank sums for it: the optimizer's fp32 main param, this rank's fp32
            shard of it, the fp32 param itself, the param itself when frozen, a
            :class:`~norm_optim.kernels.RemainderMaster` (TE's bf16 + int16 encoding of an fp32
            master shard: ``dtype``, ``shape`` and ``numel()`` are those of the fp32 master), or
            None.
        source: how ``tensor`` relates to ``param`` (``main``, ``main-shard``, ``fp32-param``,
            ``fp32-param-shard``, ``master-param-shard``, ``master-remainder-shard``, ``frozen``,
            ``no-local-shard``...).
        expert: whether it is an expert param (reduced with the expert layout).
        sharded: whether ``tensor`` is a part of the param rather than all of it.
        counted: whether this rank adds ``tensor``'s squares to the global norm.
        reason: why it is not counted (``tp-duplicate``, ``shared``, ``dp-replica``,
            ``other-instance``, ``held-elsewhere``, ``frozen-excluded``), or None.
    """

    name: str
    param: torch.nn.Parameter
    tensor: Optional[Summand]
    source: str
    expert: bool
    sharded: bool
    counted: bool
    reason: Optional[str]

    @property
    def numel(self) -> int:
        """Elements this rank sums for the param (0 when it does not count it)."""
        return self.tensor.numel() if self.counted and self.tensor is not None else 0

    def __repr__(self) -> str:
        held = "none" if self.tensor is None else (
            f"{self.tensor.dtype} {tuple(self.tensor.shape)} of {tuple(self.param.shape)}"
        )
        return (
            f"ParamRecord({self.name!r}, {self.source}, {held}, "
            f"{'expert' if self.expert else 'dense'}, "
            f"{'counted' if self.counted else 'not counted: ' + str(self.reason)})"
        )


class ParamRegistry:
    """Every model param of one optimizer (and model), and what this rank counts of each.

    Args:
        optimizer: the (unwrapped) megatron-core or torch optimizer.
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
        chunks = _model_chunks(optimizer, model)
        holdings = read_holdings(optimizer, comm)
        self.sees_frozen_params = chunks is not None
        self.records: list[ParamRecord] = _build_records(
            holdings, chunks, coords=coords, count_frozen=count_frozen
        )
        self.counted: list[ParamRecord] = [r for r in self.records if r.counted]
        self.chunks: Optional[list[torch.nn.Module]] = chunks
        frozen = [r.param for r in self.counted if r.source == "frozen"]
        self.watched: tuple[torch.Tensor, ...] = tuple(frozen[:1] + frozen[-1:])
        """Tensors held by no optimizer whose data a rebuild must follow (see ``fingerprint``)."""

    def __iter__(self) -> Iterator[ParamRecord]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, name: str) -> ParamRecord:
        for record in self.records:
            if record.name == name:
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
        return (
            f"{len(self.records)} params, {len(self.counted)} counted here "
            f"({self.counted_numel} elements); not counted: {skipped}"
        )


def _model_chunks(optimizer: Any, model: Any) -> Optional[list[torch.nn.Module]]:
    if model is None:
        chunks = list(getattr(optimizer, "model_chunks", None) or [])
        return chunks or None
    if isinstance(model, torch.nn.Module):
        return [model]
    chunks = list(model)
    if not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError(
            f"model must be a torch.nn.Module or a list of them (model chunks), got {type(model)}"
        )
    return chunks


def named_model_params(chunks: Sequence[torch.nn.Module]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, param) over the chunks, each param once, chunk-prefixed if there are several."""
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        prefix = f"chunk{index}." if len(chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            param = model_param(param)  # Megatron-FSDP's DTensor stand-ins -> the model param
            if id(param) not in seen:
                seen.add(id(param))
                yield prefix + name, param


def _build_records(
    holdings: Sequence[Holding],
    chunks: Optional[Sequence[torch.nn.Module]],
    *,
    coords: RankCoords,
    count_frozen: bool,
) -> list[ParamRecord]:
    by_param: dict[int, Holding] = {}
    for held in holdings:
        # A param held twice would be counted twice: megatron never does this, so say so.
        if id(held.param) in by_param:
            raise UnknownParamError(
                f"a param of shape {tuple(held.param.shape)} is held by two optimizer leaves "
                f"({by_param[id(held.param)].optimizer} and {held.optimizer})"
            )
        by_param[id(held.param)] = held

    if chunks is None:
        if coords.experts_need_model:
            raise ParallelStateError(
                "with expert parallelism 1 and expert TP/DP groups that differ from the dense "
                "ones, megatron leaves expert params unmarked: pass model=<the model chunks> "
                "so that norm_optim can recognise them from the model's structure"
            )
        named: Iterable[tuple[str, torch.nn.Parameter]] = (
            (f"param{i}", h.param) for i, h in enumerate(holdings)
        )
        structure = _Structure(experts=set(), tp_split=set())
    else:
        named = named_model_params(chunks)
        structure = _Structure(expert_param_ids(chunks), tensor_parallel_split_ids(chunks))

    records: list[ParamRecord] = []
    for name, param in named:
        holding = by_param.pop(id(param), None)
        if holding is None:
            if param.requires_grad:
                raise UnknownParamError(
                    f"model param {name!r} (shape {tuple(param.shape)}) requires grad but the "
                    "optimizer does not know it: was the optimizer built for another model, or "
                    "was the param unfrozen after the optimizer was built?"
                )
            holding = Holding(param, param, "frozen", replicated=True)
        if holding.source.startswith("frozen"):  # also Megatron-FSDP's frozen-shard
            if not count_frozen:
                records.append(
                    _record(name, holding, coords, structure, forced_reason="frozen-excluded")
                )
                continue
        records.append(_record(name, holding, coords, structure))

    if not coords.expert_groups_known and any(r.expert for r in records):
        raise ParallelStateError(
            "the model has expert params but pg_collection has no expt_tp / expt_dp groups: "
            "pass a ProcessGroupCollection with the expert groups too"
        )
    if by_param:
        shapes = [tuple(h.param.shape) for h in list(by_param.values())[:3]]
        raise UnknownParamError(
            f"the optimizer holds {len(by_param)} params that are not in the given model (first "
            f"shapes: {shapes}): pass the model chunks the optimizer was built for"
        )
    return records


@dataclasses.dataclass(frozen=True)
class _Structure:
    """What the model's module structure says about params (ids), beyond megatron's markers."""

    experts: set[int]
    tp_split: set[int]


def _record(
    name: str,
    holding: Holding,
    coords: RankCoords,
    structure: _Structure,
    forced_reason: Optional[str] = None,
) -> ParamRecord:
    param, tensor = holding.param, holding.tensor
    # Megatron's own marker (EP > 1), or the model's structure (also at EP = 1).
    expert = not getattr(param, "allreduce", True) or id(param) in structure.experts
    # Megatron's marker when the param has one, else the layer type (see naming).
    tp_split = getattr(param, "tensor_model_parallel", None)
    if tp_split is None:
        tp_split = id(param) in structure.tp_split
    if forced_reason is not None:
        reason: Optional[str] = forced_reason
    elif tensor is None:
        reason = "held-elsewhere"
    else:
        reason = why_not_counted(
            param,
            expert=expert,
            tp_split=bool(tp_split),
            replicated=holding.replicated,
            coords=coords,
            shard_group=holding.shard_group,
        )
    sharded = tensor is not None and tensor.numel() != param.numel()
    return ParamRecord(
        name=name,
        param=param,
        tensor=tensor,
        source=holding.source,
        expert=expert,
        sharded=sharded or holding.source.endswith("shard"),
        counted=reason is None,
        reason=reason,
    )
