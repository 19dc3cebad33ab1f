"""What the audit needs to know of megatron: the process groups in which copies live, the tied
weights, the weights whose all-gather may be in flight, and the layouts it cannot audit.

The counting rule says *which* copies a rank skips
(:class:`~norm_optim._counting.ownership.Copies`); the audit (:mod:`norm_optim._audit.run`) compares
them, and for that it needs the groups themselves (the rule only needs this rank's coordinates in
them). Everything megatron-specific about that is read here, as plain data.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional, Sequence

import torch

from .._comm import Communicator, ProcessGroup
from .._errors import UnsupportedOptimizerError
from .dtensor import is_dtensor
from .fsdp import is_megatron_fsdp, weight_shards
from .optimizers.descriptor import OptimizerDescriptor
from .model import describe
from .parallel_state import _gtp_group, _without_gtp_remat


@dataclasses.dataclass(frozen=True)
class AuditLayout:
    """The groups whose ranks hold copies of the same elements, and what cannot be compared.

    Attributes:
        dense_replicas: the full data×context-parallel group (every optimizer instance,
            without GTP): its ranks hold the same dense weights.
        expert_replicas: the full expert-data-parallel group: the same expert weights.
        dense_tp, expert_tp: the (expert) tensor-parallel group: copies of what TP does not
            split.
        dense_gtp, expert_gtp: the (expert) GTP weight-remat group (megatron-core >= 0.19):
            copies of what GTP does not shard.
        shard_replicas: the group of the ranks that hold the same distributed-optimizer shard
            (one per optimizer instance; None with one instance). megatron builds one such
            group for dense and expert params alike, inside both replica groups.
        tied: the embedding group when this rank is in it (first and last pipeline stage:
            the word embeddings and the output weight they are tied to), else None.
        tied_params: ids of this rank's params that are tied copies of each other across the
            embedding group (``shared_embedding`` / ``shared``).
        placed: ids of DTensor params (torch FSDP2): their copies are the ``Replicate`` axes
            of their placements, not megatron's DP group (whose ranks hold other shards).
        mesh_replicas: per ``Replicate`` mesh axis group (in model order of first use), the ids
            of the DTensor params replicated over it.
        local: the local tensor of each DTensor param (what this rank's weight is).
        gathering: ids of params whose all-gather may be in flight or not yet started
            (overlap-param-gather with the distributed optimizer): their full weights are not
            comparable across copies now; only this rank's own shard of them is current.
        single: True in one process without ``torch.distributed`` (nothing to compare).
    """

    dense_replicas: ProcessGroup = None
    expert_replicas: ProcessGroup = None
    dense_tp: ProcessGroup = None
    expert_tp: ProcessGroup = None
    dense_gtp: ProcessGroup = None
    expert_gtp: ProcessGroup = None
    shard_replicas: ProcessGroup = None
    tied: ProcessGroup = None
    tied_params: frozenset[int] = frozenset()
    placed: frozenset[int] = frozenset()
    mesh_replicas: tuple[tuple[ProcessGroup, frozenset[int]], ...] = ()
    local: Optional[dict[int, torch.Tensor]] = None
    gathering: frozenset[int] = frozenset()
    single: bool = False


def audit_layout(
    comm: Communicator,
    optimizer: Any,
    chunks: Optional[Sequence[torch.nn.Module]],
    params: Sequence[torch.nn.Parameter],
    pg_collection: Any = None,
    descriptor: Optional[OptimizerDescriptor] = None,
) -> AuditLayout:
    """This rank's :class:`AuditLayout`; O(params), no collective.

    Raises :class:`~norm_optim.UnsupportedOptimizerError` naming a layout whose copies it
    cannot compare yet (MIMO, Megatron-FSDP v2: the optimizer's descriptor says which; built
    here when not given).
    """
    if descriptor is None:
        descriptor = describe(optimizer, comm)
    refuse_unaudited(descriptor)
    gathering = frozenset(_gathering(chunks or []))
    tied_params = frozenset(
        id(p)
        for p in params
        if getattr(p, "shared_embedding", False) or getattr(p, "shared", False)
    )
    placed = _placements(params)
    if is_megatron_fsdp(optimizer):
        # Megatron-FSDP: each rank's bf16 weight shard and fp32 main shard of the same elements;
        # its DP ranks hold other shards, so only the TP / GTP / tied checks see copies.
        shards = weight_shards(optimizer)
        placed = dict(placed, placed=frozenset(shards), local=shards)
    if not comm.is_distributed():
        return AuditLayout(tied_params=tied_params, gathering=gathering, single=True, **placed)
    if pg_collection is not None:
        group = lambda name: getattr(pg_collection, name, None)  # noqa: E731
        return AuditLayout(
            dense_replicas=group("dp_cp"),
            expert_replicas=group("expt_dp") or group("dp_cp"),
            dense_tp=group("tp"),
            expert_tp=group("expt_tp") or group("tp"),
            dense_gtp=group("gtp_remat"),
            expert_gtp=group("expt_gtp_remat"),
            shard_replicas=group("inter_dist_opt"),
            tied=group("embd") if tied_params else None,
            tied_params=tied_params if group("embd") is not None else frozenset(),
            gathering=gathering,
            **placed,
        )
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        if placed["placed"] == frozenset(id(p) for p in params):
            return AuditLayout(gathering=gathering, **placed)  # torch-native: placements only
        raise UnsupportedOptimizerError(
            "audit() needs megatron's parallel state (or pg_collection=...) to know which "
            "ranks hold copies of each weight"
        )
    replicate = _without_gtp_remat(ps)
    in_embedding = ps.is_rank_in_embedding_group(ignore_virtual=True)
    return AuditLayout(
        dense_replicas=ps.get_data_parallel_group(with_context_parallel=True, **replicate),
        expert_replicas=ps.get_expert_data_parallel_group(check_initialized=False, **replicate),
        dense_tp=ps.get_tensor_model_parallel_group(check_initialized=False),
        expert_tp=ps.get_expert_tensor_parallel_group(check_initialized=False),
        dense_gtp=_gtp_group(ps, "get_gtp_weight_remat_group"),
        expert_gtp=_gtp_group(ps, "get_expert_gtp_weight_remat_group"),
        shard_replicas=_inter_instance_group(ps),
        tied=ps.get_embedding_group(check_initialized=False) if in_embedding else None,
        tied_params=tied_params if in_embedding else frozenset(),
        gathering=gathering,
        **placed,
    )


def _inter_instance_group(ps: Any) -> ProcessGroup:
    """megatron's inter-distributed-optimizer-instance group, or None (one instance)."""
    get_group = getattr(ps, "get_inter_distributed_optimizer_instance_group", None)
    if get_group is None:
        return None
    # 0.15+ take check_initialized; 0.14's asserts the group exists (one instance: it does not).
    takes = "check_initialized" in inspect.signature(get_group).parameters
    try:
        return get_group(check_initialized=False) if takes else get_group()
    except (AssertionError, AttributeError):
        return None


def refuse_unaudited(descriptor: OptimizerDescriptor) -> None:
    """Refuse, by name, a layout whose copies the audit does not compare yet (its descriptor
    says which)."""
    why = descriptor.audit_refusal
    if why is not None:
        raise UnsupportedOptimizerError(
            f"audit() does not compare the copies of {why} yet: param_l2_norm() works there; "
            "audit a DDP / distributed-optimizer layout"
        )


def _placements(params: Sequence[Any]) -> dict[str, Any]:
    """The :class:`AuditLayout` fields of DTensor params: which they are, their local tensors,
    and the groups of their ``Replicate`` mesh axes (the placements state the copies)."""
    from torch.distributed.tensor import Replicate

    placed: set[int] = set()
    local: dict[int, torch.Tensor] = {}
    by_group: dict[int, tuple[ProcessGroup, set[int]]] = {}  # insertion order: model order
    for param in params:
        if not is_dtensor(param):
            continue
        placed.add(id(param))
        # DTensor._local_tensor: torch/distributed/tensor/_api.py (torch 2.4-2.13)
        local[id(param)] = param._local_tensor
        for axis, placement in enumerate(param.placements):
            if type(placement) is Replicate:
                group = param.device_mesh.get_group(axis)
                by_group.setdefault(id(group), (group, set()))[1].add(id(param))
    return dict(
        placed=frozenset(placed),
        local=local,
        mesh_replicas=tuple((group, frozenset(ids)) for group, ids in by_group.values()),
    )


def _gathering(chunks: Sequence[torch.nn.Module]) -> list[int]:
    """Params whose all-gather megatron overlaps with the next forward (distributed optimizer
    with ``overlap_param_gather``): after ``step()`` only this rank's shard of them is current
    until the forward pre-hook has waited for the gather, and megatron's flags do not tell
    "gathered" from "not yet dispatched" (``param_gather_dispatched`` is reset in
    ``finish_grad_sync``), so all of them are left out of the cross-copy comparison."""
    ids: list[int] = []
    for chunk in chunks:
        config = getattr(chunk, "ddp_config", None)
        if not (
            getattr(config, "use_distributed_optimizer", False)
            and getattr(config, "overlap_param_gather", False)
        ):
            continue
        # megatron DDP's buffer lists (Megatron-FSDP has none: ``buffers`` is then the
        # torch Module method, and its gathers are its own).
        buffers = [
            buffer
            for name in ("buffers", "expert_parallel_buffers")
            if isinstance(getattr(chunk, name, None), (list, tuple))
            for buffer in getattr(chunk, name)
        ]
        for buffer in buffers:
            ids.extend(id(p) for p in buffer.params)
    return ids
