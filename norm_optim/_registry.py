"""The registry: for each model param, the fp32 tensor this rank holds for it and whether it counts.

Built once, in O(params), from the optimizer (:mod:`norm_optim._megatron`) and the counting rule
(:mod:`norm_optim._ownership`). The hot call only reads :attr:`ParamRegistry.counted`, already
grouped into kernel plans; it never walks params.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from ._comm import Communicator
from ._errors import ParallelStateError, UnknownParamError
from ._kernels import Summand
from ._megatron import (
    Declarations,
    Holding,
    ModelStructure,
    local_holding,
    mimo_param_coords,
    model_param,
    param_traits,
    read_holdings,
    refuse_partial_meshes,
    is_fsdp2_model,
    without_padding,
)
from ._megatron.naming import global_param_names
from ._ownership import RankCoords, mesh_conflict, why_not_counted
from ._vocabulary import NotCounted, Source, SplitFrom


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
            :class:`~norm_optim._kernels.RemainderMaster` (TE's bf16 + int16 encoding of an fp32
            master shard: ``dtype``, ``shape`` and ``numel()`` are those of the fp32 master), or
            None.
        source: how ``tensor`` relates to ``param`` (:class:`~norm_optim.Source`).
        expert: whether it is an expert param (reduced with the expert layout).
        counted: whether this rank adds ``tensor``'s squares to the global norm.
        reason: why it is not counted (:class:`~norm_optim.NotCounted`), or None.
        tp_split: whether the (expert-)TP group splits it (if not, TP ranks > 0 hold copies).
        split_from: where ``tp_split`` was taken from
            (:class:`~norm_optim._vocabulary.SplitFrom`): the model's checkpoint declaration
            (``sharded_state_dict``) or megatron's marker (no declaration; models that are not
            megatron modules).
        note: for a megatron model's param, how megatron's marker disagrees with its
            declaration (the declaration counts), or why there is no declaration; else None.
    """

    name: str
    global_name: str
    param: torch.nn.Parameter
    tensor: Optional[Summand]
    source: Source
    expert: bool
    counted: bool
    reason: Optional[NotCounted]
    tp_split: bool = False
    split_from: SplitFrom = SplitFrom.MARKER
    note: Optional[str] = None

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
        structure = ModelStructure.of(chunks)
        self.sees_frozen_params = chunks is not None
        # What the model's checkpoint declarations said (read once per build, no collective).
        self.declarations: Declarations = structure.declarations
        self.records: list[ParamRecord] = _build_records(
            holdings, chunks, structure, coords=coords, comm=comm, count_frozen=count_frozen
        )
        self.counted: list[ParamRecord] = [r for r in self.records if r.counted]
        self.chunks: Optional[list[torch.nn.Module]] = chunks

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


def named_model_params(
    chunks: Sequence[torch.nn.Module],
) -> Iterator[tuple[str, torch.nn.Parameter]]:
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
    structure: ModelStructure,
    *,
    coords: RankCoords,
    comm: Communicator,
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
        global_names: dict[int, str] = {}
    else:
        named = named_model_params(chunks)
        global_names = global_param_names(chunks)
    # A MIMO module's params are counted by that module's coords (its own process groups).
    module_coords = mimo_param_coords(chunks, comm)

    records: list[ParamRecord] = []
    used: list[Holding] = []
    for name, param in named:
        holding = by_param.pop(id(param), None)
        if holding is None:
            if param.requires_grad and chunks is not None and is_fsdp2_model(chunks):
                raise UnknownParamError(
                    f"model param {name!r} is not a tensor the optimizer owns, in a torch FSDP2 "
                    "model: FSDP2 holds the params unsharded now (between a forward and its "
                    "backward)? Build or refresh the norm after the backward, or call "
                    "model.reshard() first"
                )
            if param.requires_grad:
                raise UnknownParamError(
                    f"model param {name!r} (shape {tuple(param.shape)}) requires grad but the "
                    "optimizer does not know it: was the optimizer built for another model, or "
                    "was the param unfrozen after the optimizer was built?"
                )
            holding = local_holding(
                Holding(
                    param,
                    param,
                    Source.FROZEN,
                    replicated=True,
                    coords=module_coords.get(id(param)),
                )
            )
        used.append(holding)
        excluded = holding.source.is_frozen and not count_frozen  # also Megatron-FSDP's shards
        records.append(
            _record(
                name,
                global_names.get(id(param), name),
                holding,
                coords,
                structure,
                comm,
                forced_reason=NotCounted.FROZEN_EXCLUDED if excluded else None,
            )
        )

    refuse_partial_meshes(used, [r.name for r in records])
    if by_param:
        shapes = [tuple(h.param.shape) for h in list(by_param.values())[:3]]
        raise UnknownParamError(
            f"the optimizer holds {len(by_param)} params that are not in the given model (first "
            f"shapes: {shapes}): pass the model chunks the optimizer was built for"
        )
    return records


def _record(
    name: str,
    global_name: str,
    holding: Holding,
    coords: RankCoords,
    structure: ModelStructure,
    comm: Communicator,
    forced_reason: Optional[NotCounted] = None,
) -> ParamRecord:
    param = holding.param
    traits = param_traits(param, structure, comm)
    coords = holding.coords if holding.coords is not None else coords
    if traits.expert and not coords.expert_groups_known:
        raise ParallelStateError(
            "the model has expert params but pg_collection has no expt_tp / expt_dp groups: "
            "pass a ProcessGroupCollection with the expert groups too"
        )
    if holding.shard_group is not None and len(holding.shard_group & traits.gtp_peers) > 1:
        # Megatron's own layout is inconsistent: seen with expert GTP at EP > 1 on the local spec
        # (0.19.2), where the GTP weights lose allreduce=False and land in the dense optimizer.
        raise ParallelStateError(
            f"{holding.optimizer} shards {name!r} over ranks {sorted(holding.shard_group)}, "
            f"which hold different GTP shards of it (GTP group {sorted(traits.gtp_peers)}): its "
            "fp32 shards do not cover the weight, so no norm of it is exact. Is the param missing "
            "megatron's allreduce=False expert marker?"
        )
    conflict = (
        mesh_conflict(holding.mesh, expert=traits.expert, coords=coords)
        if holding.mesh is not None
        else None
    )
    if conflict is not None:
        raise ParallelStateError(f"{name!r} is a DTensor that norm_optim cannot count: {conflict}")
    tensor = holding.tensor
    if not coords.parallel_state and tensor is not None and holding.mesh is None:
        raise ParallelStateError(
            "megatron's parallel state is not initialized but torch.distributed runs several "
            f"ranks, and {name!r} is not a DTensor whose placements say who holds it: call "
            "parallel_state.initialize_model_parallel(...) before wrapping the optimizer, or "
            "pass pg_collection=..."
        )
    if tensor is not None:
        tensor = without_padding(tensor, holding.offset, param, traits.padding)
    if forced_reason is not None:
        reason: Optional[NotCounted] = forced_reason
    elif tensor is None:
        # A tied copy is no param of its own, whether or not this rank holds a shard of it.
        reason = NotCounted.SHARED if traits.tied_copy else NotCounted.HELD_ELSEWHERE
    else:
        reason = why_not_counted(
            expert=traits.expert,
            tp_split=traits.tp_split,
            replicated=holding.replicated,
            coords=coords,
            shard_group=holding.shard_group,
            gtp_sharded=traits.gtp_sharded,
            tied_copy=traits.tied_copy,
            replica_coords=holding.replica_coords,
        )
    return ParamRecord(
        name=name,
        global_name=global_name,
        param=param,
        tensor=tensor,
        source=holding.source,
        expert=traits.expert,
        counted=reason is None,
        reason=reason,
        tp_split=traits.tp_split,
        split_from=traits.split_from,
        note=traits.note,
    )
