"""torch FSDP2 (``fully_shard``) and other DTensor params: what a DTensor's placements say.

Megatron-LM's ``--use-torch-fsdp2`` (``TorchFullyShardedDataParallel``) and torch-native
``fully_shard`` (1-D FSDP, HSDP on a replicate × shard mesh, TP × FSDP meshes from
``parallelize_module``) turn every param into a ``DTensor``; the optimizer then owns DTensors:
the Float16 optimizer's fp32 main params (``param.main_param``, same placements as the bf16
param), an ``FP32Optimizer``'s or a plain ``torch.optim`` optimizer's params themselves.

A DTensor states how its elements are spread over its device mesh: on a ``Shard`` axis the
ranks hold disjoint parts (summed, no owner needed), on a ``Replicate`` axis they hold the same
part (counted on the axis's coordinate 0). So a DTensor holding becomes its local tensor (a view,
no copy) plus this rank's coordinates on the replicating axes, and the rule of
:mod:`norm_optim._counting.ownership` does the rest; megatron's own TP (outside the FSDP mesh) still
applies through megatron's markers, which ``TorchFullyShardedDataParallel`` copies onto the
DTensors. Anything a sum of local shards would not count exactly once is refused by name: a
``Partial`` (pending-reduction) or unknown placement, a local tensor whose shape is not the one the
placements give (padded or uneven data), a DTensor that is a distributed-optimizer shard, and a
DTensor on a smaller mesh than other params of the same model on this rank (a param left out of
``parallelize_module`` lives on the FSDP sub-mesh while its copies sit on the other TP ranks,
which its placements do not mention).

Without megatron's parallel state (torch-native training) ranks outside every mesh of this
rank's params are taken to hold other params (pipeline stages): a copy of a whole FSDP group kept
outside DTensor (DDP across FSDP groups) is in no placement; describe it as HSDP. With megatron's
parallel state the registry checks each mesh against megatron's groups
(:func:`norm_optim._counting.ownership.mesh_conflict`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from .._errors import UnsupportedOptimizerError
from .optimizers.holdings import Holding


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (an ``nn.Parameter`` of one
    included)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_holding(holding: Holding) -> Holding:
    """``holding`` with a DTensor tensor replaced by its local shard and its mesh facts; any
    other holding unchanged (after refusing torch FSDP params held in a form we cannot read)."""
    tensor = holding.tensor
    if not is_dtensor(tensor):
        if is_dtensor(holding.param) or getattr(holding.param, "__fsdp_param__", False):
            raise UnsupportedOptimizerError(
                f"{holding.optimizer} holds a {_kind(tensor)} for a torch-FSDP-sharded param "
                f"(shape {tuple(holding.param.shape)}): norm_optim reads FSDP2 (DTensor) params "
                "only when the optimizer holds them as DTensors (fully_shard with a torch or "
                "megatron Float16 / FP32 optimizer), not torch FSDP1 flat params"
            )
        return holding
    if not holding.replicated:
        raise UnsupportedOptimizerError(
            f"{holding.optimizer} holds a {holding.source} of a DTensor param (shape "
            f"{tuple(holding.param.shape)}): a distributed-optimizer or layer-wise shard of a "
            "torch FSDP2 param is not a layout norm_optim knows; use FSDP2 without megatron's "
            "distributed optimizer (as Megatron-LM's --use-torch-fsdp2 requires)"
        )
    local, replica_coords, mesh = read_placements(tensor, holding.optimizer)
    return dataclasses.replace(
        holding, tensor=local, replicated=False, replica_coords=replica_coords, mesh=mesh
    )


def read_placements(
    tensor: Any, optimizer: str = ""
) -> tuple[torch.Tensor, tuple[int, ...], frozenset[int]]:
    """A DTensor's local tensor (a view), this rank's coordinate on each ``Replicate`` mesh axis,
    and the global ranks of its mesh.

    Raises:
        UnsupportedOptimizerError: a placement other than ``Shard`` / ``Replicate``, or a local
            tensor that is not exactly the part the placements assign to this rank.
    """
    from torch.distributed.tensor import Replicate, Shard

    # torch/distributed/tensor/placement_types.py (torch 2.13): the shard kind FSDP2 uses on a
    # dim that TP already shards; still a partition of the tensor.
    from torch.distributed.tensor.placement_types import _StridedShard

    # torch/distributed/tensor/_utils.py (torch 2.13): the shape DTensor itself gives each rank.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements
    where = (
        f"{optimizer} holds a DTensor of shape {tuple(tensor.shape)} with placements "
        f"{tuple(placements)} on mesh {mesh.mesh.tolist()}"
    )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedOptimizerError(f"{where}, which does not hold this rank")
    replica_coords: list[int] = []
    for axis, placement in enumerate(placements):
        if type(placement) is Replicate:
            replica_coords.append(coordinate[axis])
        elif type(placement) not in (Shard, _StridedShard):
            raise UnsupportedOptimizerError(
                f"{where}: the {type(placement).__name__} placement on mesh axis {axis} is not "
                "one whose local shards add up to the tensor (Partial means a reduction is still "
                "pending): norm_optim counts Shard and Replicate placements only"
            )
    # DTensor._local_tensor: torch/distributed/tensor/_api.py (torch 2.4-2.13)
    local = tensor._local_tensor  # DTensor.to_local() without autograd: the same view
    expected, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    if tuple(local.shape) != tuple(expected):
        raise UnsupportedOptimizerError(
            f"{where}, but its local tensor has shape {tuple(local.shape)} where the placements "
            f"give {tuple(expected)} (padded or uneven local data): its shards cannot be "
            "counted exactly"
        )
    ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
    return local, tuple(replica_coords), ranks


def refuse_partial_meshes(holdings: Sequence[Holding], names: Sequence[str]) -> None:
    """Refuse a DTensor whose mesh is a strict part of the ranks that this rank's other
    DTensors span: its copies on the other ranks are not in its placements.

    Args:
        holdings: this rank's holdings (after :func:`local_holding`).
        names: the param name of each holding (for the message).
    """
    meshes = [h.mesh for h in holdings if h.mesh is not None]
    if not meshes:
        return
    spanned = frozenset().union(*meshes)
    for holding, name in zip(holdings, names):
        if holding.mesh is not None and holding.mesh != spanned:
            raise UnsupportedOptimizerError(
                f"{name!r} is a DTensor on ranks {sorted(holding.mesh)} while other params of "
                f"the model on this rank span ranks {sorted(spanned)}: its placements do not "
                "say what the other ranks hold of it (a module left out of parallelize_module "
                "keeps a plain copy on every TP rank). Give it placements on the whole mesh "
                "(e.g. Replicate on the TP axis) so that each element is counted once"
            )


def is_fsdp2_model(chunks: Sequence[torch.nn.Module]) -> bool:
    """Whether any module of ``chunks`` is sharded by torch FSDP2 (``fully_shard``)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for chunk in chunks for m in chunk.modules())


def _kind(tensor: Optional[Any]) -> str:
    return "nothing" if tensor is None else f"plain {type(tensor).__name__}"
