"""Megatron-FSDP v2: where its fp32 main weights live, and which rank counts each element.

Megatron-FSDP v2 (``DistributedDataParallelConfig(megatron_fsdp_version=2)``, megatron-core
main: ``FullyShardedDataParallel`` returns a ``FullyShardedDataParallelV2``) attaches an FSDP
mixin to each unit module (transformer layers, the experts of each MoE layer, the root). Each
unit keeps ``parameter_groups``: per (dtype, requires_grad), an ``FsdpParameterGroup`` whose
``main_weight`` is a ``DBuffer``, one flat fp32 buffer of the group's params, of which this rank
holds the slice ``[offset, offset + local_buffer.numel())`` chosen by its ``Flat`` placement (a
``Shard(0)`` over the flat buffer: every axis of the group's mesh shards it, so each element is
in exactly one rank's slice of the mesh). The dense units' mesh is DP×CP; the experts' mesh is
expert-DP (it has no EP axis: EP ranks hold different experts).

``FullyShardedOptimizer`` steps one ``nn.Parameter(DTensor)`` per trainable param whose local
tensor is a view of that slice (params with an empty slice on this rank are left out of its
param groups); the DTensor does not point back at the model param, nor carry megatron's markers
(``allreduce=False`` for experts). Its group's ``fsdp_parameters`` pair it with the original
param (``unsharded``), which keeps them: :func:`model_param` maps one to the other, and the
registry keys everything by the original. Frozen params are in no optimizer: their group's
``model_weight`` (the weights the forward pass gathers) holds this rank's slice of them.

So a v2 shard is a :class:`~norm_optim._megatron.optimizers.holdings.Holding` that is not
replicated, whose ``shard_group`` is the mesh's ranks, and :mod:`norm_optim._counting.ownership`'s
one rule does the rest (v2 refuses TP / PP / CP > 1 itself). Shapes v2 may build but this module
cannot read exactly (a non-``Flat`` placement, non-fp32 main weights) are refused, naming v2.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

from .._errors import UnknownParamError, UnsupportedOptimizerError
from .._counting.vocabulary import Source
from .optimizers.holdings import Holding, fp32_view_in, leaves, model_chunks_of

# megatron/core/distributed/fsdp/src/megatron_fsdp/experimental/parameter_group.py (0.20.dev):
# the weak back-reference from both the sharded and the original param to their group.
_GROUP_ATTR = "_mfsdp_parameter_group"


def is_megatron_fsdp_v2(optimizer: Any) -> bool:
    """Whether the optimizer (or any leaf of it) was built for a Megatron-FSDP v2 model."""
    return any(
        getattr(config, "use_megatron_fsdp", False)
        and getattr(config, "megatron_fsdp_version", 1) == 2
        for config in (getattr(leaf, "ddp_config", None) for leaf in leaves(optimizer))
    )


def v2_model_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The model param that a v2 sharded param (the optimizer's DTensor) stands for; any other
    param is returned as it is."""
    group = _containing_group(param)
    if group is not None:
        for fsdp_param in group.fsdp_parameters:
            if fsdp_param.sharded is param:
                return fsdp_param.unsharded
    return param


def read_megatron_fsdp_v2(
    optimizer: Any, group_ranks: Callable[[Any], frozenset[int]]
) -> Iterator[Holding]:
    """One :class:`Holding` per param of the optimizer's Megatron-FSDP v2 model chunks.

    Trainable params: the fp32 main-weight slice the optimizer steps (the DTensor's local
    tensor, a view of the group's ``main_weight``, source ``main-shard``), or none where this
    rank's slice of the param is empty. Frozen params: this rank's slice of the group's
    ``model_weight`` (source ``frozen-shard``).
    """
    stepped = _stepped_params(optimizer)
    for group in _parameter_groups(optimizer):
        shard_group = _mesh_ranks(group)
        for index, fsdp_param in enumerate(group.fsdp_parameters):
            param = fsdp_param.unsharded
            if group.requires_grad:
                tensor, leaf = _main_shard(group, index, fsdp_param, stepped)
                source = Source.MAIN_SHARD if tensor is not None else Source.NO_LOCAL_SHARD
                buffer = group.main_weight
            else:
                buffer = _sharded(group.model_weight, "model_weight (frozen params)")
                tensor, leaf, source = _frozen_shard(buffer, index), "", Source.FROZEN_SHARD
            offset = _offset_in_param(buffer, index, tensor)
            yield Holding(
                param, tensor, source, False, shard_group, leaf or "MegatronFSDPv2", offset
            )
    if stepped:
        shapes = [tuple(p.shape) for p, _ in list(stepped.values())[:3]]
        raise UnknownParamError(
            f"the optimizer steps {len(stepped)} params that are in none of its Megatron-FSDP v2 "
            f"model chunks' parameter groups (first shapes: {shapes}): pass the chunks it was "
            "built for"
        )


def _containing_group(param: Any) -> Any:
    group_ref = getattr(param, _GROUP_ATTR, None)
    return group_ref() if callable(group_ref) else None


def _stepped_params(optimizer: Any) -> dict[int, tuple[torch.Tensor, str]]:
    """``id(sharded param)`` -> (that param, its leaf's class name)."""
    stepped: dict[int, tuple[torch.Tensor, str]] = {}
    for leaf in leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:  # a stub: this rank steps nothing
            continue
        for group in inner.param_groups:
            for dist_param in group["params"]:
                stepped[id(dist_param)] = (dist_param, type(leaf).__name__)
    return stepped


def _main_shard(
    group: Any, index: int, fsdp_param: Any, stepped: dict[int, tuple[torch.Tensor, str]]
) -> tuple[Optional[torch.Tensor], str]:
    """The fp32 slice the optimizer steps for one trainable param (None where it is empty)."""
    mbuf = _sharded(group.main_weight, "main_weight")
    if mbuf.dtype != torch.float32:
        raise UnsupportedOptimizerError(
            f"Megatron-FSDP v2 keeps its main weights as {mbuf.dtype} here: norm_optim reads "
            "fp32 masters: keep the DDP config's default megatron_fsdp_main_params_dtype="
            "torch.float32"
        )
    shape = tuple(fsdp_param.unsharded.shape)
    found = stepped.pop(id(fsdp_param.sharded), None)
    if found is None:
        if mbuf.get_local_tensor(index).numel() == 0:
            # FullyShardedOptimizer leaves out params whose slice on this rank is empty.
            return None, ""
        raise UnknownParamError(
            f"a Megatron-FSDP v2 param of shape {shape} requires grad but the optimizer does not "
            "step it: was the optimizer built for another model, or the param unfrozen after "
            "the optimizer was built?"
        )
    dist_param, leaf = found
    local = fp32_view_in(dist_param, mbuf.local_buffer)
    if local is None:
        raise UnsupportedOptimizerError(
            f"{leaf} steps a tensor for a Megatron-FSDP v2 param of shape {shape} that is not a "
            "view of its group's main_weight buffer: norm_optim does not know this layout"
        )
    return local, leaf


def _frozen_shard(buffer: Any, index: int) -> Optional[torch.Tensor]:
    """This rank's slice of a frozen param (a view of ``model_weight``), None where empty
    (``DBuffer.get_local_tensor`` then makes a new empty tensor, no view)."""
    local = buffer.get_local_tensor(index)
    return local if local.numel() > 0 else None


def _sharded(buffer: Any, what: str) -> Any:
    """``buffer`` if every axis of its mesh shards it (``Flat``); else a clear error."""
    placements = tuple(buffer.placements)
    if any(type(p).__name__ != "Flat" for p in placements):
        raise UnsupportedOptimizerError(
            f"Megatron-FSDP v2 with {what} placements {placements}: norm_optim reads v2 buffers "
            "that every mesh axis shards (Flat, from Shard(0)); replicated or partial axes "
            "(HSDP / ZeRO-1 placements) are not supported yet"
        )
    return buffer


def _mesh_ranks(group: Any) -> frozenset[int]:
    """Global ranks of the group's mesh: the ranks whose slices partition its buffers."""
    return frozenset(int(rank) for rank in group.mesh.mesh.flatten().tolist())


def _offset_in_param(buffer: Any, index: int, tensor: Optional[torch.Tensor]) -> int:
    """Where this rank's slice starts in the flattened param (0 when it holds none)."""
    if tensor is None or tensor.numel() == 0:
        return 0
    # experimental/dbuffer.py: the local buffer starts at global element ``offset``; the
    # layout places tensor ``index`` at ``tensor_to_offset[index]``.
    local_start = tensor.storage_offset() - buffer.local_buffer.storage_offset()
    return buffer.offset + local_start - buffer.layout.tensor_to_offset[index]


def _parameter_groups(optimizer: Any) -> Iterator[Any]:
    """The FSDP parameter groups of the optimizer's v2 chunks, each once."""
    for chunk in model_chunks_of(optimizer, "Megatron-FSDP v2"):
        # experimental/module.py: each fully_shard unit module gets ``parameter_groups``.
        units = [
            m for m in chunk.modules() if hasattr(m, "parameter_groups") and hasattr(m, "context")
        ]
        if not units:
            raise UnsupportedOptimizerError(
                f"the optimizer was built for Megatron-FSDP v2 (megatron_fsdp_version=2) but its "
                f"model chunk is a {type(chunk).__name__} with no v2 parameter groups: wrap the "
                "model with megatron.core.distributed.FullyShardedDataParallel and that DDP config"
            )
        for unit in units:
            yield from unit.parameter_groups
