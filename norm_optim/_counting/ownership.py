"""Who counts which element: the one rule that makes every layout exact.

The global norm is a sum of squares over every element of the model, each counted exactly once
across all ranks. A rank counts a tensor it holds when it is the *canonical holder*: not a
(expert-)TP or GTP duplicate, not a tied copy, and the one replica (or shard group) among those
that hold the same elements that counts them (:func:`why_not_counted`).

Which holder that is on each layout, and which fact of the adapter decides it, is the counting
table in ``docs/counting.md``: the one text of the rule, and the specification of this module
(``tests/test_counting_rule.py`` holds a case for each of its rows). A new layout is a new row
there and a new case here, not a new code path elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .vocabulary import NotCounted


@dataclasses.dataclass(frozen=True)
class RankCoords:
    """This rank's position in the groups that replicate params.

    Attributes:
        tp: rank in the tensor-parallel group.
        expert_tp: rank in the expert-tensor-parallel group.
        dp_cp: rank in the full data×context-parallel group (all optimizer instances), without
            the GTP weight-remat axis (megatron's replicate group, ``with_gtp_remat=False``).
        expert_dp: rank in the full expert-data-parallel group (all optimizer instances),
            without the expert GTP axis.
        dp_cp_first, expert_dp_first: global rank of rank 0 of those groups (the replica that
            counts a param sharded over a smaller group).
        gtp, expert_gtp: rank in the (expert) GTP weight-remat group (megatron-core >= 0.19),
            whose peers hold different dim-0 shards of the weights it shards and copies of
            every other param.
        expert_groups_known: False when an explicit ``pg_collection`` lacks ``expt_tp`` or
            ``expt_dp``: expert params then cannot be counted.
        experts_need_model: True at EP = 1 with expert-TP / expert-DP groups that differ from
            the dense ones: megatron marks expert params only at EP > 1, so only the model's
            structure can tell them apart.
        parallel_state: False when several ranks run without megatron's parallel state
            (torch-native training): only DTensors, whose placements say which rank holds what,
            can be counted then.
        tp_peers, expert_tp_peers, dp_cp_peers, expert_dp_peers: global ranks of this rank's
            (expert) TP group and (expert) DP×CP group, without GTP; empty when unknown. A
            DTensor's mesh is checked against them (:func:`mesh_conflict`).
    """

    tp: int = 0
    expert_tp: int = 0
    dp_cp: int = 0
    expert_dp: int = 0
    dp_cp_first: int = 0
    expert_dp_first: int = 0
    gtp: int = 0
    expert_gtp: int = 0
    expert_groups_known: bool = True
    experts_need_model: bool = False
    parallel_state: bool = True
    tp_peers: frozenset[int] = frozenset()
    expert_tp_peers: frozenset[int] = frozenset()
    dp_cp_peers: frozenset[int] = frozenset()
    expert_dp_peers: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True)
class Copies:
    """What the rule needs to know of one tensor a rank holds for a model param: which groups
    hold copies of the same elements (the adapter reads it from the optimizer and the model).

    Attributes:
        expert: whether the param lives in an expert layer (split by expert-TP, replicated over
            expert-DP), whichever optimizer holds it.
        tp_split: whether the (expert-)TP group splits the param; if not, TP ranks other than 0
            hold duplicates.
        replicated: whether the tensor this rank holds is a whole copy that every rank of the
            (expert) data-parallel group holds too, rather than a part only this rank holds.
        tied_copy: whether the param is a copy of a tied weight counted elsewhere (megatron's
            ``shared``, or an output weight tying leaves unused).
        shard_group: for a distributed-optimizer shard, the global ranks of the group the param
            is sharded over. Groups like it partition the replicating (expert) data-parallel
            group, each holding a full set of shards; the one holding its first rank counts.
        gtp_sharded: whether the (expert) GTP weight-remat group shards the param; if not, GTP
            ranks other than 0 hold copies.
        replica_coords: for a DTensor, this rank's coordinate on each mesh axis that
            replicates it; only the ranks at 0 on all of them count it.
    """

    expert: bool
    tp_split: bool
    replicated: bool
    tied_copy: bool = False
    shard_group: Optional[frozenset[int]] = None
    gtp_sharded: bool = False
    replica_coords: tuple[int, ...] = ()


def why_not_counted(copies: Copies, coords: RankCoords) -> Optional[NotCounted]:
    """The reason this rank must not count the tensor ``copies`` describes, or None if it
    counts it (``coords``: this rank's coordinates in the groups that hold it)."""
    if copies.tied_copy:
        return NotCounted.SHARED
    expert = copies.expert
    tp_rank = coords.expert_tp if expert else coords.tp
    if not copies.tp_split and tp_rank != 0:
        return NotCounted.TP_DUPLICATE
    gtp_rank = coords.expert_gtp if expert else coords.gtp
    if not copies.gtp_sharded and gtp_rank != 0:
        return NotCounted.GTP_DUPLICATE
    dp_rank = coords.expert_dp if expert else coords.dp_cp
    if copies.replicated and dp_rank != 0:
        return NotCounted.DP_REPLICA
    if any(copies.replica_coords):
        return NotCounted.MESH_REPLICA
    first = coords.expert_dp_first if expert else coords.dp_cp_first
    if copies.shard_group is not None and first not in copies.shard_group:
        return NotCounted.OTHER_INSTANCE
    return None


def mesh_conflict(mesh: frozenset[int], *, expert: bool, coords: RankCoords) -> Optional[str]:
    """Why a DTensor on ``mesh`` (its global ranks) cannot be counted by its placements together
    with megatron's rules, or None.

    Its placements describe its mesh only. Megatron's TP rule applies on top of them, so the mesh
    must not span megatron TP peers (they would be dropped as duplicates although the mesh
    shards over them); and every rank that megatron's (expert) DP×CP group says replicates the
    param must be in the mesh (a copy outside it would be counted again).
    """
    tp = coords.expert_tp_peers if expert else coords.tp_peers
    if len(mesh & tp) > 1:
        return (
            f"its mesh spans ranks {sorted(mesh & tp)} of one megatron tensor-parallel group, "
            "whose rule would drop their parts as TP duplicates"
        )
    dp = coords.expert_dp_peers if expert else coords.dp_cp_peers
    if dp and not dp <= mesh:
        return (
            f"megatron's data-parallel group {sorted(dp)} replicates it, but its mesh holds "
            f"ranks {sorted(mesh)} only: the copies on ranks {sorted(dp - mesh)} are in no "
            "placement (shard over the whole DP×CP group, or describe the replication in the "
            "mesh, e.g. HSDP)"
        )
    return None
