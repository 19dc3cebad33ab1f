"""Megatron-FSDP: where its fp32 main weights live, and which rank counts each element.

``megatron.core.distributed.FullyShardedDataParallel`` (``use_megatron_fsdp=True``) keeps, per
bucket (``param_and_grad_buffer.parameter_groups[i]``), a flat fp32 ``main_weight_buffer``
whose ``data`` is this rank's shard of the bucket over the buffer's ``data_parallel_group``
(DP×CP for dense params, expert-DP for experts). The optimizer (a ``DistributedOptimizer`` that
leaves all sharding to Megatron-FSDP) steps ``nn.Parameter(DTensor)`` objects whose
``_local_tensor`` is a view of that shard, often empty, and whose ``orig_param`` is the model's
original param. Frozen params have no main weights: their bucket's bf16 ``model_weight_buffer``
holds this rank's shard of them.

So every element is in exactly one rank's shard within its buffer group, and the shards need no
owner rule of their own: a shard is a :class:`~norm_optim._megatron.optimizers.holdings.Holding`
that is not replicated, whose ``shard_group`` is the buffer's group, and the usual rule of
:mod:`norm_optim._counting.ownership` adds what FSDP does not shard (TP duplicates: TP rank 0,
expert-TP rank 0 for experts; EP ranks hold different experts, and the expert mesh has no EP dim).
Hybrid FSDP (``num_distributed_optimizer_instances > 1``) of dense models follows from the same
rule: with ``outer_dp_sharding_strategy="no_shard"`` each instance holds a full set of shards
over its own group and the instance holding DP rank 0 counts; with ``"optim"`` the main
weights are sharded over the whole DP group. Hybrid FSDP with experts, the other sharding
strategies and PP > 1 (which Megatron-FSDP cannot build) are refused by name.

The model's ``parameters()`` switch between the DTensors (after ``finish_grad_sync`` /
``stop_communication``) and the original params (from ``start_param_sync`` / forward on):
the registry keys everything by the original param (:func:`model_param`), which keeps
megatron's markers (``allreduce=False`` for experts, ``tensor_model_parallel``, ``shared``); the
DTensors do not carry ``allreduce``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from .._errors import UnknownParamError, UnsupportedOptimizerError
from .._counting.vocabulary import Source
from .fsdp_v2 import v2_model_param
from .optimizers.holdings import Holding, fp32_view_in, leaves, model_chunks_of

_SHARDING = "optim_grads_params"


def model_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The model param that ``param`` stands for: Megatron-FSDP swaps a module's params for
    DTensor views of its main weights between steps, each pointing back at the original (v1),
    or paired with it in its parameter group (v2)."""
    original = getattr(param, "orig_param", None)
    return original if original is not None else v2_model_param(param)


def is_megatron_fsdp(optimizer: Any) -> bool:
    """Whether the optimizer (or any leaf of it) was built for a Megatron-FSDP model."""
    return any(
        getattr(getattr(leaf, "ddp_config", None), "use_megatron_fsdp", False)
        for leaf in leaves(optimizer)
    )


def read_megatron_fsdp(
    optimizer: Any, group_ranks: Callable[[Any], frozenset[int]]
) -> Iterator[Holding]:
    """One :class:`Holding` per param of the optimizer's Megatron-FSDP model chunks.

    Trainable params: the fp32 main-weight shard the optimizer steps (the DTensor's local
    tensor, a view of ``main_weight_buffer``, source ``main-shard``). Frozen params: their bf16
    shard in ``model_weight_buffer`` (source ``frozen-shard``).
    """
    stepped = _stepped_params(optimizer)
    for chunk in _model_chunks(optimizer):
        hybrid = getattr(chunk.ddp_config, "num_distributed_optimizer_instances", 1) > 1
        for group in chunk.param_and_grad_buffer.parameter_groups:
            if hybrid and group.is_expert_param:
                # megatron-core 0.16.1 shards experts over dense ranks that hold other experts
                # there, and 0.19 calls the expert path "not tested yet".
                raise UnsupportedOptimizerError(
                    "hybrid Megatron-FSDP (num_distributed_optimizer_instances > 1) of a model "
                    "with experts: not supported by norm_optim (dense models are)"
                )
            for item, param in enumerate(group.params):
                if param.requires_grad:
                    dist_param, leaf = _pop_stepped(stepped, param)
                    yield _main_shard(group, param, dist_param, leaf, group_ranks)
                else:
                    wbuf = group.model_weight_buffer
                    shard = wbuf.get_item(item, only_shard=True)
                    yield Holding(
                        param,
                        shard,
                        Source.FROZEN_SHARD,
                        False,
                        group_ranks(wbuf.data_parallel_group),
                        "MegatronFSDP",
                    )
    if stepped:
        shapes = [tuple(p.shape) for p, _ in list(stepped.values())[:3]]
        raise UnknownParamError(
            f"the optimizer steps {len(stepped)} params that are in none of its Megatron-FSDP "
            f"model chunks' buffers (first shapes: {shapes}): pass the chunks it was built for"
        )


def weight_shards(optimizer: Any) -> dict[int, torch.Tensor]:
    """``id(model param)`` -> this rank's bf16 shard of it in its bucket's ``model_weight_buffer``
    (the same elements as its fp32 main-weight shard): the weight the audit compares, since the
    param's own data is the unsharded buffer, current only between a gather and its release."""
    shards: dict[int, torch.Tensor] = {}
    for chunk in _model_chunks(optimizer):
        for group in chunk.param_and_grad_buffer.parameter_groups:
            for item, param in enumerate(group.params):
                shards[id(param)] = group.model_weight_buffer.get_item(item, only_shard=True)
    return shards


def _stepped_params(optimizer: Any) -> dict[int, tuple[torch.Tensor, str]]:
    """``id(original param)`` -> (the DTensor the optimizer steps, its leaf's class name)."""
    stepped: dict[int, tuple[torch.Tensor, str]] = {}
    for leaf in leaves(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is None:  # a stub: this rank has no trainable params in it
            continue
        for group in inner.param_groups:
            for dist_param in group["params"]:
                stepped[id(model_param(dist_param))] = (dist_param, type(leaf).__name__)
    return stepped


def _pop_stepped(
    stepped: dict[int, tuple[torch.Tensor, str]], param: torch.Tensor
) -> tuple[torch.Tensor, str]:
    try:
        return stepped.pop(id(param))
    except KeyError:
        raise UnknownParamError(
            f"a Megatron-FSDP param of shape {tuple(param.shape)} requires grad but the "
            "optimizer does not step it: was the optimizer built for another model, or the "
            "param unfrozen after the optimizer was built?"
        ) from None


def _main_shard(
    group: Any,
    param: torch.nn.Parameter,
    dist_param: torch.Tensor,
    leaf: str,
    group_ranks: Callable[[Any], frozenset[int]],
) -> Holding:
    """The fp32 shard the optimizer steps for ``param``: a view of the bucket's main weights."""
    mbuf = group.main_weight_buffer
    if mbuf is None or mbuf.dtype != torch.float32:
        dtype = None if mbuf is None else mbuf.dtype
        raise UnsupportedOptimizerError(
            f"Megatron-FSDP keeps no fp32 main weights here (main weight dtype {dtype}): "
            "norm_optim reads fp32 masters: keep the DDP config's default "
            "megatron_fsdp_main_params_dtype=torch.float32 (preserve_fp32_weights=True before "
            "megatron-core 0.17)"
        )
    local = fp32_view_in(dist_param, mbuf.data)
    if local is None:
        raise UnsupportedOptimizerError(
            f"{leaf} steps a tensor for a param of shape {tuple(param.shape)} that is not a view "
            "of its Megatron-FSDP main_weight_buffer: norm_optim does not know this layout"
        )
    return Holding(
        param, local, Source.MAIN_SHARD, False, group_ranks(mbuf.data_parallel_group), leaf
    )


def _model_chunks(optimizer: Any) -> list[Any]:
    """The optimizer's Megatron-FSDP chunks, each once; anything else is a clear error."""
    chunks = model_chunks_of(optimizer, "Megatron-FSDP")
    for chunk in chunks:
        _check_chunk(chunk)
    return chunks


def _check_chunk(chunk: Any) -> None:
    buffer = getattr(chunk, "param_and_grad_buffer", None)
    if not hasattr(buffer, "parameter_groups"):
        raise UnsupportedOptimizerError(
            f"the optimizer was built with use_megatron_fsdp=True but its model chunk is a "
            f"{type(chunk).__name__}, which holds ordinary DDP buffers: wrap the model in "
            "megatron.core.distributed.FullyShardedDataParallel (DistributedDataParallel "
            "ignores use_megatron_fsdp)"
        )
    strategy = chunk.ddp_config.data_parallel_sharding_strategy
    if strategy != _SHARDING:
        raise UnsupportedOptimizerError(
            f"Megatron-FSDP with data_parallel_sharding_strategy={strategy!r}: norm_optim "
            f"supports {_SHARDING!r}"
        )
    pipeline = getattr(getattr(chunk, "config", None), "pipeline_model_parallel_size", 1) or 1
    if pipeline > 1:
        raise UnsupportedOptimizerError(
            f"Megatron-FSDP with pipeline parallelism ({pipeline} stages): Megatron-FSDP builds "
            "its device mesh without a pipeline axis, and norm_optim does not support it"
        )
