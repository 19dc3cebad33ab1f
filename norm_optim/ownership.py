"""Who counts which element: the one rule that makes every layout exact.

The global norm is a sum of squares over every element of the model, each counted exactly once
across all ranks. A rank counts a tensor it holds when it is the *canonical holder*: not a
(expert-)TP or GTP duplicate, not a tied copy, and the one replica (or shard group) among those
that hold the same elements that counts them (:func:`why_not_counted`).

Which holder that is on each layout, and which fact of the adapter decides it, is the counting
table in ``docs/counting.md``: the specification of this module. A new layout is a new row there
and a new case here, not a new code path elsewhere.
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


def why_not_counted(
    *,
    expert: bool,
    tp_split: bool,
    replicated: bool,
    coords: RankCoords,
    tied_copy: bool,
    shard_group: Optional[frozenset[int]] = None,
    gtp_sharded: bool = False,
) -> Optional[NotCounted]:
    """The reason this rank must not count a param's tensor, or None if it counts it.

    Args:
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
        gtp_sharded: whether the (expert) GTP weight-remat group shards the param; if not, GTP
            ranks other than 0 hold copies.
        tied_copy: whether the param is a copy of a tied weight counted elsewhere (megatron's
            ``shared``, or an output weight tying leaves unused).
    """
    if tied_copy:
        return NotCounted.SHARED
    tp_rank = coords.expert_tp if expert else coords.tp
    if not tp_split and tp_rank != 0:
        return NotCounted.TP_DUPLICATE
    gtp_rank = coords.expert_gtp if expert else coords.gtp
    if not gtp_sharded and gtp_rank != 0:
        return NotCounted.GTP_DUPLICATE
    dp_rank = coords.expert_dp if expert else coords.dp_cp
    if replicated and dp_rank != 0:
        return NotCounted.DP_REPLICA
    first = coords.expert_dp_first if expert else coords.dp_cp_first
    if shard_group is not None and first not in shard_group:
        return NotCounted.OTHER_INSTANCE
    return None
