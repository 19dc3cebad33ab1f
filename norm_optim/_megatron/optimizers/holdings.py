"""What an optimizer leaf holds for a model param (:class:`Holding`), the leaves, and the model
chunks they were built for.

Shared by the optimizer readers (:mod:`.kinds`) and Megatron-FSDP's
(:mod:`~norm_optim._megatron.fsdp`), so that neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch

from ..._errors import UnsupportedOptimizerError
from ..._kernels import Summand
from ..._counting.ownership import RankCoords
from ..._counting.vocabulary import Source


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one optimizer leaf holds on this rank for one model param.

    Attributes:
        param: the model param.
        tensor: the tensor whose squares this rank would sum: fp32 main param, fp32 main shard,
            the param itself when it is fp32, a remainder-encoded fp32 master shard, or None when
            this rank holds nothing of it.
        source: how ``tensor`` relates to the param (for inspection and error messages).
        replicated: True if every rank of the (expert) data-parallel group holds the same whole
            tensor; False if the tensor is a part (or an assignment) that only this rank holds.
        shard_group: for distributed-optimizer shards, the global ranks of the group the param
            is sharded over. When it is smaller than the group that replicates the param (several
            distributed-optimizer instances; or experts at EP=1, which the dense optimizer shards
            over dense DP while expert-DP replicates them), each such group holds a full set of
            shards, and only the one holding the replicating group's first rank counts.
        optimizer: class name of the leaf optimizer that holds it.
        offset: where ``tensor`` starts in the flattened param (a shard's start; 0 otherwise).
        replica_coords: for a DTensor (torch FSDP2), this rank's coordinate on each mesh axis
            whose ``Replicate`` placement copies it; its ``Shard`` axes partition it and need no
            rule. Empty for other tensors.
        mesh: for a DTensor, the global ranks of its device mesh (None for other tensors).
        coords: this rank's coordinates in the groups of the module that holds the param, where
            they are the module's own (MIMO); None: the model's (the wrapper's) coordinates.
    """

    param: torch.nn.Parameter
    tensor: Optional[Summand]
    source: Source
    replicated: bool
    shard_group: Optional[frozenset[int]] = None
    optimizer: str = ""
    offset: int = 0
    replica_coords: tuple[int, ...] = ()
    mesh: Optional[frozenset[int]] = None
    coords: Optional[RankCoords] = None


def local(tensor: Any) -> Any:
    """A DTensor's local shard (the same object the registry holds); any other value as is."""
    # DTensor._local_tensor: torch/distributed/tensor/_api.py (torch 2.5-2.14)
    return getattr(tensor, "_local_tensor", tensor)


def qualified_name(obj: Any) -> str:
    """``module.QualName`` of an object's class: how kinds, rules and refusals name it."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def is_precision_aware(leaf: Any) -> bool:
    """Whether a leaf is megatron's precision-aware optimizer (TE's FusedAdam keeps its fp32
    masters in its state, its grads are ``decoupled_grad``), from the leaf's config."""
    config = getattr(leaf, "config", None)
    return bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def leaves(optimizer: Any) -> Iterator[Any]:
    """The optimizers that own tensors (a chained optimizer's members, recursively)."""
    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is None:
        yield optimizer
        return
    for member in inner:
        yield from leaves(member)


def model_chunks_of(optimizer: Any, kind: str) -> list[Any]:
    """The model chunks the optimizer's leaves were built for, each once.

    Megatron-FSDP's readers (v1 and v2) find its buffers through them; ``kind`` names the
    optimizer in the error when it knows none.
    """
    chunks: dict[int, Any] = {}
    for leaf in leaves(optimizer):
        for chunk in getattr(leaf, "model_chunks", None) or []:
            chunks.setdefault(id(chunk), chunk)
    if not chunks:
        raise UnsupportedOptimizerError(
            f"the {kind} optimizer knows no model chunks; build it with "
            "get_megatron_optimizer(config, model_chunks)"
        )
    return list(chunks.values())


def fp32_view_in(stepped: torch.Tensor, buffer: torch.Tensor) -> Optional[torch.Tensor]:
    """The local tensor of ``stepped`` (a DTensor's local shard, or the tensor itself) when it
    is an fp32 view inside ``buffer``, else None.

    Megatron-FSDP (v1 and v2) steps DTensors whose local shards view its fp32 main-weight
    buffers; anything else is a layout the readers do not know.
    """
    shard = local(stepped)
    start = shard.storage_offset() - buffer.storage_offset()
    inside = (
        shard.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and shard.dtype == torch.float32
        and 0 <= start <= start + shard.numel() <= buffer.numel()
    )
    return shard if inside else None
