"""Who counts which element: the one rule that makes every layout exact.

The global norm is a sum of squares over every element of the model, each counted exactly once
across all ranks. A rank counts a tensor it holds when it is the *canonical holder*:

=========================  ==========================================  =======================
replicated over            canonical holder                            decided by
=========================  ==========================================  =======================
tensor parallelism         TP rank 0 (expert-TP rank 0 for experts)    params without
                           for params that TP does not split            ``tensor_model_parallel``
tied weights               the copy without ``shared=True``             ``shared`` attribute
data / context parallel    DP×CP rank 0 (expert-DP rank 0 for experts)  ``Holding.replicated``
                           for whole (non-sharded) main params
distributed optimizer      the rank whose shard it is (shards            ``Holding.replicated``
                           partition the param within one instance)      is False
several dist-opt instances the shard group that holds the              ``Holding.
(or experts at EP=1,       replicating group's first rank                shard_group``
sharded over dense DP)
layer-wise optimizer       the DP rank the param was assigned to         ``Holding.replicated``
                                                                          is False
Megatron-FSDP              the rank whose shard of the bucket it is     ``Holding.replicated``
                           (over DP×CP; expert-DP for experts)          is False
pipeline / expert parallel nothing to do: each stage / expert rank
                           holds different params
=========================  ==========================================  =======================

A new layout is a new row here, not a new code path elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .comm import Communicator
from .errors import ParallelStateError


@dataclasses.dataclass(frozen=True)
class RankCoords:
    """This rank's position in the groups that replicate params.

    Attributes:
        tp: rank in the tensor-parallel group.
        expert_tp: rank in the expert-tensor-parallel group.
        dp_cp: rank in the full data×context-parallel group (all optimizer instances).
        expert_dp: rank in the full expert-data-parallel group (all optimizer instances).
        dp_cp_first, expert_dp_first: global rank of rank 0 of those groups (the replica that
            counts a param sharded over a smaller group).
        expert_groups_known: False when an explicit ``pg_collection`` lacks ``expt_tp`` or
            ``expt_dp``: expert params then cannot be counted.
        experts_need_model: True at EP = 1 with expert-TP / expert-DP groups that differ from
            the dense ones: megatron marks expert params only at EP > 1, so only the model's
            structure can tell them apart.
    """

    tp: int = 0
    expert_tp: int = 0
    dp_cp: int = 0
    expert_dp: int = 0
    dp_cp_first: int = 0
    expert_dp_first: int = 0
    expert_groups_known: bool = True
    experts_need_model: bool = False

    @classmethod
    def from_parallel_state(cls, comm: Communicator) -> "RankCoords":
        """Read the coordinates from megatron's global parallel state.

        In a plain single process (no ``torch.distributed``) every coordinate is 0. With several
        processes and no parallel state, counting would be a guess, so it is an error.
        """
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            if comm.is_distributed() and comm.size(None) > 1:
                raise ParallelStateError(
                    "megatron's parallel state is not initialized but torch.distributed runs "
                    f"{comm.size(None)} ranks: call parallel_state.initialize_model_parallel(...) "
                    "before wrapping the optimizer, or pass pg_collection=..."
                )
            return cls()
        dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True)
        expert_dp_group = ps.get_expert_data_parallel_group(check_initialized=False)
        tp_size = ps.get_tensor_model_parallel_world_size()
        return cls(
            tp=ps.get_tensor_model_parallel_rank(),
            expert_tp=_or_zero(ps.get_expert_tensor_parallel_rank()),
            dp_cp=ps.get_data_parallel_rank(with_context_parallel=True),
            expert_dp=ps.get_expert_data_parallel_rank(),
            dp_cp_first=comm.first_rank(dp_cp_group),
            expert_dp_first=comm.first_rank(expert_dp_group),
            experts_need_model=ps.get_expert_model_parallel_world_size() == 1
            and (
                (ps.get_expert_tensor_parallel_world_size() or tp_size) != tp_size
                or ps.get_expert_data_parallel_world_size()
                != ps.get_data_parallel_world_size(with_context_parallel=True)
            ),
        )

    @classmethod
    def from_pg_collection(cls, pg_collection: object, comm: Communicator) -> "RankCoords":
        """Read the coordinates from an explicit megatron ``ProcessGroupCollection``."""
        missing = [name for name in ("tp", "dp_cp") if not hasattr(pg_collection, name)]
        if missing:
            raise ParallelStateError(
                f"pg_collection lacks the process groups {missing}; it needs at least tp and "
                "dp_cp (and expt_tp, expt_dp for MoE models)"
            )
        tp_group = pg_collection.tp  # type: ignore[attr-defined]
        dp_cp_group = pg_collection.dp_cp  # type: ignore[attr-defined]
        expert_tp_group = getattr(pg_collection, "expt_tp", None)
        expert_dp_group = getattr(pg_collection, "expt_dp", None)
        ep_group = getattr(pg_collection, "ep", None)
        if expert_tp_group is None or expert_dp_group is None:
            return cls(
                tp=comm.rank(tp_group),
                dp_cp=comm.rank(dp_cp_group),
                dp_cp_first=comm.first_rank(dp_cp_group),
                expert_groups_known=False,
            )
        return cls(
            tp=comm.rank(tp_group),
            expert_tp=comm.rank(expert_tp_group),
            dp_cp=comm.rank(dp_cp_group),
            expert_dp=comm.rank(expert_dp_group),
            dp_cp_first=comm.first_rank(dp_cp_group),
            expert_dp_first=comm.first_rank(expert_dp_group),
            experts_need_model=(ep_group is None or comm.size(ep_group) == 1)
            and (
                comm.size(expert_tp_group) != comm.size(tp_group)
                or comm.size(expert_dp_group) != comm.size(dp_cp_group)
            ),
        )


def check_reduce_group(comm: Communicator, group: object, pg_collection: object = None) -> None:
    """Refuse a reduction group that misses ranks holding parts of this rank's model.

    Each element is counted on one rank only, so a group without, say, the other TP ranks would
    silently leave their shards out. A local check (no collective): this rank's TP, PP, DP×CP,
    EP and expert-DP groups must all lie inside ``group``.
    """
    if group is None or not comm.is_distributed():
        return
    if pg_collection is not None:
        names = ("tp", "pp", "dp_cp", "ep", "expt_dp")
        groups = [getattr(pg_collection, name, None) for name in names]
    else:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return
        groups = [
            ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_expert_model_parallel_group(check_initialized=False),
            ps.get_expert_data_parallel_group(check_initialized=False),
        ]
    held = set().union(*(comm.group_ranks(g) for g in groups if g is not None))
    missing = sorted(held - comm.group_ranks(group))
    if missing:
        raise ParallelStateError(
            f"group= lacks ranks {missing[:8]} that hold parts of the model (this rank's TP / PP / "
            "DP / EP groups): reduce over a group that contains the whole model, e.g. the "
            "default group (group=None)"
        )


def _or_zero(rank: Optional[int]) -> int:
    # megatron returns None for the expert-TP rank when no expert-TP group was built.
    return 0 if rank is None else int(rank)


def why_not_counted(
    param: torch.Tensor,
    *,
    expert: bool,
    tp_split: bool,
    replicated: bool,
    coords: RankCoords,
    shard_group: Optional[frozenset[int]] = None,
) -> Optional[str]:
    """The reason this rank must not count ``param``'s tensor, or None if it counts it.

    Args:
        param: the model param (its TP and ``shared`` attributes decide duplicates).
        expert: whether the param lives in an expert layer (split by expert-TP, replicated over
            expert-DP), whichever optimizer holds it.
        tp_split: whether the (expert-)TP group splits the param; if not, TP ranks other than 0
            hold duplicates.
        replicated: whether the tensor this rank holds is a whole copy that every rank of the
            (expert) data-parallel group holds too, rather than a part only this rank holds.
        coords: this rank's coordinates.
        shard_group: for a distributed-optimizer shard, the global ranks of the group the param
            is sharded over. Groups like it partition the replicating (expert) data-parallel
            group, each holding a full set of shards; the one holding its first rank counts.
    """
    if getattr(param, "shared", False):
        return "shared"
    tp_rank = coords.expert_tp if expert else coords.tp
    if not tp_split and tp_rank != 0:
        return "tp-duplicate"
    dp_rank = coords.expert_dp if expert else coords.dp_cp
    if replicated and dp_rank != 0:
        return "dp-replica"
    first = coords.expert_dp_first if expert else coords.dp_cp_first
    if shard_group is not None and first not in shard_group:
        return "other-instance"
    return None
