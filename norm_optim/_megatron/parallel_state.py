"""This rank's coordinates in the groups that replicate params, from megatron's parallel state
(or an explicit ``ProcessGroupCollection``), and the check that a reduction group holds the model.

Version notes: since 0.19 the DP getters include the GTP weight-remat axis by default (the
optimizers shard over the group without it), and a ``ProcessGroupCollection`` reads its unset
fields as ``None``.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from .._comm import Communicator
from .._errors import ParallelStateError
from .._counting.ownership import RankCoords


def coords_of_rank(comm: Communicator, pg_collection: Any = None) -> RankCoords:
    """This rank's :class:`RankCoords`, from ``pg_collection`` when given, else megatron's
    global parallel state (a MIMO optimizer's are per module: :mod:`.readers`)."""
    if pg_collection is not None:
        return coords_from_pg_collection(pg_collection, comm)
    return coords_from_parallel_state(comm)


def coords_from_parallel_state(comm: Communicator) -> RankCoords:
    """Read the coordinates from megatron's global parallel state.

    In a plain single process (no ``torch.distributed``) every coordinate is 0. With several
    processes and no parallel state, only DTensors can be counted (``parallel_state=False``).
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        # Torch-native (FSDP2) training needs none: its DTensors' placements say it all, and
        # the registry refuses any other tensor when several ranks run.
        return RankCoords(parallel_state=not (comm.is_distributed() and comm.size(None) > 1))
    # Since 0.19 the DP getters include the GTP weight-remat axis by default; the
    # distributed optimizer shards (and replicas are told apart) over the group without it.
    replicate = _without_gtp_remat(ps)
    dp_cp_group = ps.get_data_parallel_group(with_context_parallel=True, **replicate)
    expert_dp_group = ps.get_expert_data_parallel_group(check_initialized=False, **replicate)
    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_group = ps.get_tensor_model_parallel_group(check_initialized=False)
    expert_tp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
    return RankCoords(
        tp=ps.get_tensor_model_parallel_rank(),
        expert_tp=_or_zero(ps.get_expert_tensor_parallel_rank()),
        dp_cp=ps.get_data_parallel_rank(with_context_parallel=True, **replicate),
        expert_dp=ps.get_expert_data_parallel_rank(**replicate),
        dp_cp_first=comm.first_rank(dp_cp_group),
        expert_dp_first=comm.first_rank(expert_dp_group),
        gtp=_gtp_rank(ps, "get_gtp_weight_remat_group", comm),
        expert_gtp=_gtp_rank(ps, "get_expert_gtp_weight_remat_group", comm),
        **_peers(comm, tp_group, expert_tp_group, dp_cp_group, expert_dp_group),
        experts_need_model=ps.get_expert_model_parallel_world_size() == 1
        and (
            (ps.get_expert_tensor_parallel_world_size() or tp_size) != tp_size
            or ps.get_expert_data_parallel_world_size(**replicate)
            != ps.get_data_parallel_world_size(with_context_parallel=True, **replicate)
        ),
    )


def coords_from_pg_collection(pg_collection: object, comm: Communicator) -> RankCoords:
    """Read the coordinates from an explicit megatron ``ProcessGroupCollection``.

    Its ``dp_cp`` / ``expt_dp`` are megatron's replicate groups (without the GTP axis), its
    ``gtp_remat`` / ``expt_gtp_remat`` the GTP weight-remat groups (megatron-core >= 0.19).
    """

    # Since 0.19 a collection reads every declared but unset field as None (a class
    # __getattr__), so presence is a value check, not hasattr.
    def group(name: str) -> Any:
        return getattr(pg_collection, name, None)

    missing = [name for name in ("tp", "dp_cp") if group(name) is None]
    if missing:
        raise ParallelStateError(
            f"pg_collection lacks the process groups {missing}; it needs at least tp and "
            "dp_cp (and expt_tp, expt_dp for MoE models)"
        )
    tp_group, dp_cp_group = group("tp"), group("dp_cp")
    expert_tp_group, expert_dp_group, ep_group = group("expt_tp"), group("expt_dp"), group("ep")
    gtp = _rank_or_zero(comm, group("gtp_remat"))
    expert_gtp = _rank_or_zero(comm, group("expt_gtp_remat"))
    if expert_tp_group is None or expert_dp_group is None:
        return RankCoords(
            tp=comm.rank(tp_group),
            dp_cp=comm.rank(dp_cp_group),
            dp_cp_first=comm.first_rank(dp_cp_group),
            gtp=gtp,
            expert_groups_known=False,
        )
    return RankCoords(
        **_peers(comm, tp_group, expert_tp_group, dp_cp_group, expert_dp_group),
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
        gtp=gtp,
        expert_gtp=expert_gtp,
    )


def _peers(
    comm: Communicator, tp: Any, expert_tp: Any, dp_cp: Any, expert_dp: Any
) -> dict[str, Any]:
    """The ``*_peers`` fields of :class:`RankCoords`: each group's global ranks (empty where
    megatron built no such group)."""
    groups = dict(
        tp_peers=tp, expert_tp_peers=expert_tp, dp_cp_peers=dp_cp, expert_dp_peers=expert_dp
    )
    return {
        name: comm.group_ranks(group) if group is not None else frozenset()
        for name, group in groups.items()
    }


def _without_gtp_remat(ps: Any) -> dict[str, bool]:
    """``with_gtp_remat=False`` where megatron's DP getters take it (0.19+), else nothing."""
    takes = "with_gtp_remat" in inspect.signature(ps.get_data_parallel_rank).parameters
    return {"with_gtp_remat": False} if takes else {}


def _gtp_group(ps: Any, getter: str) -> Any:
    """A GTP weight-remat group (megatron-core >= 0.19), or None where megatron has none."""
    get_group = getattr(ps, getter, None)
    return get_group(check_initialized=False) if get_group is not None else None


def _gtp_rank(ps: Any, getter: str, comm: Communicator) -> int:
    """This rank's place in a GTP weight-remat group (0 where megatron has none)."""
    return _rank_or_zero(comm, _gtp_group(ps, getter))


def _rank_or_zero(comm: Communicator, group: Any) -> int:
    return comm.rank(group) if group is not None else 0


def check_model_ranks_in_group(
    comm: Communicator,
    group: object,
    pg_collection: object = None,
    model_ranks: Optional[frozenset[int]] = None,
) -> None:
    """Refuse a reduction group that misses ranks holding parts of this rank's model.

    Each element is counted on one rank only, so a group without, say, the other TP ranks would
    silently leave their shards out. A local check (no collective): this rank's TP, PP, DP×CP,
    EP and expert-DP groups must all lie inside ``group``; or, without ``pg_collection``, the
    ``model_ranks`` a caller knows hold the model (every MIMO module's grid: :mod:`.readers`).
    """
    if group is None or not comm.is_distributed():
        return
    held: set[int] = set()
    groups: list[Any] = []
    if model_ranks is not None and pg_collection is None:
        held = set(model_ranks)
    elif pg_collection is not None:
        names = ("tp", "pp", "dp_cp", "ep", "expt_dp", "gtp_remat", "expt_gtp_remat")
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
            _gtp_group(ps, "get_gtp_weight_remat_group"),
            _gtp_group(ps, "get_expert_gtp_weight_remat_group"),
        ]
    held |= set().union(*(comm.group_ranks(g) for g in groups if g is not None))
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
