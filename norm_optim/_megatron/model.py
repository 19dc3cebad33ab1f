"""The adapter's one entry point for the registry: every model param joined with what this rank
holds for it, every layout's checks done (:func:`read_model`).

The registry (:mod:`norm_optim._norms.registry`) applies the counting rule to what is returned here
and names no layout: which params torch FSDP2 holds unsharded, which DTensor meshes cannot be
counted, GTP's alignment padding, a module's own process groups (MIMO), the chunks an optimizer was
built for, and a layout megatron itself got wrong are all known here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional, Sequence

import torch

from .._comm import Communicator
from .._errors import ParallelStateError, UnknownParamError
from .._counting.ownership import Copies, RankCoords, mesh_conflict
from .._counting.vocabulary import Source
from .declarations import Declarations
from .dtensor import is_fsdp2_model, local_holding, refuse_partial_meshes
from .fsdp import model_param
from .optimizers.holdings import Holding
from .optimizers.descriptor import OptimizerDescriptor
from .mimo import describe_mimo, is_mimo, mimo_param_coords
from .naming import global_param_names
from .optimizers.kinds import describe_optimizer
from .params import ModelStructure, ParamTraits, param_traits, without_padding


@dataclasses.dataclass(frozen=True)
class HeldParam:
    """One model param and everything the counting rule needs to know of it on this rank.

    Attributes:
        name: its name in the model (chunk-prefixed when there are several chunks); ``param<i>``
            when no model was given.
        global_name: its layout-independent name (the local name without a model).
        holding: what this rank holds for it (``holding.tensor`` without GTP padding rows); a
            frozen param that no optimizer holds is its own :attr:`Source.FROZEN` holding.
        traits: expert, TP-split, GTP-sharded, tied copy.
        coords: this rank's coordinates in the groups that hold it (a MIMO module's own).
    """

    name: str
    global_name: str
    holding: Holding
    traits: ParamTraits
    coords: RankCoords

    @property
    def param(self) -> torch.nn.Parameter:
        return self.holding.param

    @property
    def copies(self) -> Copies:
        """Which groups hold copies of what this rank holds: the counting rule's input."""
        holding, traits = self.holding, self.traits
        return Copies(
            expert=traits.expert,
            tp_split=traits.tp_split,
            replicated=holding.replicated,
            tied_copy=traits.tied_copy,
            shard_group=holding.shard_group,
            gtp_sharded=traits.gtp_sharded,
            replica_coords=holding.replica_coords,
        )


@dataclasses.dataclass(frozen=True)
class ModelReading:
    """What :func:`read_model` returns: the params in model order, and what was read once."""

    params: list[HeldParam]
    chunks: Optional[list[torch.nn.Module]]
    declarations: Declarations
    descriptor: OptimizerDescriptor


def model_chunks(optimizer: Any, model: Any) -> Optional[list[torch.nn.Module]]:
    """The model chunks: ``model`` (a module or a list of them), else the ones the optimizer
    was built for (megatron's optimizers keep ``model_chunks``); None when neither is known."""
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


def describe(optimizer: Any, comm: Communicator) -> OptimizerDescriptor:
    """The :class:`~.optimizers.descriptor.OptimizerDescriptor` of ``optimizer`` (a MIMO
    optimizer's: its modules' leaves, its holdings each with its module's coordinates)."""
    if is_mimo(optimizer):
        return describe_mimo(optimizer, comm)
    return describe_optimizer(optimizer, comm)


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


def read_model(
    optimizer: Any, model: Any, *, coords: RankCoords, comm: Communicator
) -> ModelReading:
    """Every model param (or, without a model, every param the optimizer holds) with this
    rank's holding, traits and coordinates; O(params), no collective.

    Raises :class:`~norm_optim.UnknownParamError` for a param held twice, a trainable model
    param the optimizer does not know, or an optimizer param outside the model; and
    :class:`~norm_optim.ParallelStateError` / :class:`~norm_optim.UnsupportedOptimizerError` for
    a layout whose copies no rule can count exactly, each naming the param and the reason.
    """
    chunks = model_chunks(optimizer, model)
    descriptor = describe(optimizer, comm)
    holdings = descriptor.holdings
    by_param = _by_param(holdings)
    structure = ModelStructure.of(chunks)
    if chunks is None:
        if coords.experts_need_model:
            raise ParallelStateError(
                "with expert parallelism 1 and expert TP/DP groups that differ from the dense "
                "ones, megatron leaves expert params unmarked: pass model=<the model chunks> "
                "so that norm_optim can recognise them from the model's structure"
            )
        named: Iterator[tuple[str, torch.nn.Parameter]] = iter(
            [(f"param{i}", h.param) for i, h in enumerate(holdings)]
        )
        global_names: dict[int, str] = {}
    else:
        named = named_model_params(chunks)
        global_names = global_param_names(chunks)
    # A MIMO module's params are counted by that module's coords (its own process groups).
    module_coords = mimo_param_coords(chunks, comm)

    params: list[HeldParam] = []
    for name, param in named:
        holding = by_param.pop(id(param), None)
        if holding is None:
            holding = _frozen_holding(name, param, chunks, module_coords.get(id(param)))
        params.append(
            _held_param(name, global_names.get(id(param), name), holding, coords, structure, comm)
        )
    refuse_partial_meshes([p.holding for p in params], [p.name for p in params])
    if by_param:
        shapes = [tuple(h.param.shape) for h in list(by_param.values())[:3]]
        raise UnknownParamError(
            f"the optimizer holds {len(by_param)} params that are not in the given model (first "
            f"shapes: {shapes}): pass the model chunks the optimizer was built for"
        )
    return ModelReading(params, chunks, structure.declarations, descriptor)


def _by_param(holdings: Sequence[Holding]) -> dict[int, Holding]:
    by_param: dict[int, Holding] = {}
    for held in holdings:
        # A param held twice would be counted twice: megatron never does this, so say so.
        if id(held.param) in by_param:
            raise UnknownParamError(
                f"a param of shape {tuple(held.param.shape)} is held by two optimizer leaves "
                f"({by_param[id(held.param)].optimizer} and {held.optimizer})"
            )
        by_param[id(held.param)] = held
    return by_param


def _frozen_holding(
    name: str,
    param: torch.nn.Parameter,
    chunks: Optional[Sequence[torch.nn.Module]],
    coords: Optional[RankCoords],
) -> Holding:
    """The holding of a model param no optimizer holds: a frozen param is its own copy on every
    replica; a trainable one is a param the optimizer does not know."""
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
    return local_holding(Holding(param, param, Source.FROZEN, replicated=True, coords=coords))


def _held_param(
    name: str,
    global_name: str,
    holding: Holding,
    coords: RankCoords,
    structure: ModelStructure,
    comm: Communicator,
) -> HeldParam:
    """One param's :class:`HeldParam`, after the checks that no exact count is possible."""
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
    if holding.mesh is not None:
        conflict = mesh_conflict(holding.mesh, expert=traits.expert, coords=coords)
        if conflict is not None:
            raise ParallelStateError(
                f"{name!r} is a DTensor that norm_optim cannot count: {conflict}"
            )
    tensor = holding.tensor
    if tensor is None:
        return HeldParam(name, global_name, holding, traits, coords)
    if not coords.parallel_state and holding.mesh is None:
        raise ParallelStateError(
            "megatron's parallel state is not initialized but torch.distributed runs several "
            f"ranks, and {name!r} is not a DTensor whose placements say who holds it: call "
            "parallel_state.initialize_model_parallel(...) before wrapping the optimizer, or "
            "pass pg_collection=..."
        )
    trimmed = without_padding(tensor, holding.offset, param, traits.padding)
    return HeldParam(
        name, global_name, dataclasses.replace(holding, tensor=trimmed), traits, coords
    )
