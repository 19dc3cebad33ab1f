"""Who counts which element: the one rule that makes every layout exact.

The global norm is a sum of squares over every element of the model, each counted exactly once
across all ranks. A rank counts a tensor it holds when it is the *canonical holder*:

=========================  ==========================================  =======================
replicated over            canonical holder                            decided by
=========================  ==========================================  =======================
tensor parallelism         TP rank 0 (expert-TP rank 0 for experts)    params without
                           for params that TP does not split            ``tensor_model_parallel``
tied weights               the copy without ``shared=True`` (an output  ``shared`` attribute,
                           weight that tying leaves unused: none)       model structure
data / context parallel    DP×CP rank 0 (expert-DP rank 0 for experts)  ``Holding.replicated``
                           for whole (non-sharded) main params
distributed optimizer      the rank whose shard it is (shards            ``Holding.replicated``
                           partition the param within one instance)      is False
several dist-opt instances the shard group that holds the              ``Holding.
(or experts at EP=1,       replicating group's first rank                shard_group``
sharded over dense DP)
layer-wise optimizer       the DP rank the param was assigned to         ``Holding.replicated``
                                                                          is False
GTP weight remat           GTP rank 0 (expert-GTP rank 0 for experts)  ``gtp_sharded``: params
(megatron-core >= 0.19)    for params GTP does not shard; a sharded     GTP shards on dim 0;
                           param's zero pad rows count as nothing       pads trimmed (registry)
Megatron-FSDP              the rank whose shard of the bucket it is     ``Holding.replicated``
                           (over DP×CP; expert-DP for experts)          is False
Megatron-FSDP v2           the rank whose slice of the group's flat     ``Holding.replicated``
                           buffer it is (its mesh: DP×CP / expert-DP)   is False
MIMO modules               every row above, within the module's own     ``Holding.coords``
                           groups (its grid's TP, DP...)
pipeline / expert parallel nothing to do: each stage / expert rank
                           holds different params
=========================  ==========================================  =======================

A new layout is a new row here, not a new code path elsewhere.
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
