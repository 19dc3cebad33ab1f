"""Megatron-FSDP models on CPU gloo ranks: test-only patches, a builder, deterministic weights.

``megatron.core.distributed.FullyShardedDataParallel`` runs on CPU with the CPU shim plus
test-only patches, each named after the megatron code it exists for, which
:func:`build_fsdp_model` installs (internal: ``norm_optim.testing._internal.megatron_fsdp_patches``;
like the shim, never install them outside tests). Build the model with :func:`build_fsdp_model`, the optimizer with
:func:`~norm_optim.testing.models.build_optimizer`, train with
:func:`~norm_optim.testing.models.train_step`.

Megatron-FSDP cannot reload its fp32 main weights from the model
(``DistributedOptimizer.reload_model_params`` raises ``NotImplementedError``), so
:func:`fill_fsdp_deterministic_` writes the oracle's values straight into this rank's shards of
the model-weight and main-weight buffers, at any time (before or after steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from norm_optim.testing._internal.megatron_fsdp_patches import (
    cpu_shim_installed,
    has_megatron_fsdp_v2,
    install_megatron_fsdp_cpu_patches,
)
from norm_optim.testing.values import deterministic_values, named_global_parameters, original_param

__all__ = [
    "build_fsdp_model",
    "fill_fsdp_deterministic_",
    "fill_fsdp_v2_deterministic_",
    "fsdp_v2_parameter_groups",
    "has_megatron_fsdp_v2",
    "original_param",
]


def build_fsdp_model(
    cfg: Any = None,
    *,
    freeze: Sequence[str] = (),
    seed: int = 1234,
    version: int = 1,
    **ddp_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's model as one Megatron-FSDP chunk, as Megatron-LM builds it with
    ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``.

    ``version=2`` builds Megatron-FSDP v2 (``megatron_fsdp_version=2``, megatron-core main):
    no distributed optimizer (pass ``use_distributed_optimizer=False`` to ``build_optimizer``
    then, and ``clip_grad=0.0`` with experts: megatron's grad-norm helper asserts on dense and
    expert grads living on different meshes), the process groups from the parallel state; v2
    refuses TP / PP / CP > 1 itself.

    GPT on the local spec, ``Float16Module`` (bf16), then ``FullyShardedDataParallel`` on the
    CPU device. Megatron-FSDP has no pipeline axis: PP > 1 is a ``ValueError`` here (megatron
    fails later with an einops error). Pass the chunks to
    :func:`~norm_optim.testing.models.build_optimizer`.

    Args:
        cfg: the logical model (:class:`~norm_optim.testing.models.TinyGPTConfig`).
        freeze: glob patterns of GPTModel param names to freeze before wrapping.
        seed: seeds megatron's weight init.
        version: Megatron-FSDP 1 or 2 (``megatron_fsdp_version``).
        ddp_overrides: extra ``DistributedDataParallelConfig`` fields.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.transformer.module import Float16Module

    from norm_optim.testing.models import (
        TinyGPTConfig,
        build_chunk,
        _matching_params,
        transformer_config,
    )
    from norm_optim.testing.cpu import init_rng

    pipeline = ps.get_pipeline_model_parallel_world_size()
    if pipeline > 1:
        raise ValueError(
            f"Megatron-FSDP cannot be built with pipeline parallelism ({pipeline} stages): its "
            "device mesh has no pipeline axis"
        )
    on_cpu = cpu_shim_installed()
    if on_cpu:
        install_megatron_fsdp_cpu_patches()
    cfg = cfg if cfg is not None else TinyGPTConfig()
    init_rng(seed)
    config = transformer_config(cfg)
    gpt = build_chunk(cfg, config, None)
    for param in _matching_params(gpt, freeze):
        param.requires_grad_(False)
    model: torch.nn.Module = Float16Module(config, gpt) if cfg.bf16 else gpt
    extra: dict[str, Any] = {}
    if version == 2:
        from megatron.core.process_groups_config import ProcessGroupCollection

        ddp_overrides = dict(
            megatron_fsdp_version=2, use_distributed_optimizer=False, **ddp_overrides
        )
        extra["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups()
    ddp_config = DistributedDataParallelConfig(
        **{
            "use_megatron_fsdp": True,
            "data_parallel_sharding_strategy": "optim_grads_params",
            "use_distributed_optimizer": True,
            "grad_reduce_in_fp32": True,
            "gradient_reduce_div_fusion": False,  # gloo has no PREMUL_SUM reduction
            **ddp_overrides,
        }
    )
    # On CUDA, Megatron-FSDP copies the weights to the current device itself.
    device = torch.device("cpu") if on_cpu else None
    return [FullyShardedDataParallel(config, ddp_config, model, device=device, **extra)]


@torch.no_grad()
def fill_fsdp_deterministic_(model_chunks: Sequence[torch.nn.Module], seed: int) -> None:
    """:func:`~norm_optim.testing.oracle.fill_deterministic_` for Megatron-FSDP chunks.

    Writes each param's layout-independent values into this rank's shard of its bucket's
    bf16 model weights and, for trainable params, fp32 main weights (in place, through
    megatron's ``DataParallelBuffer.set_item``), so the optimizer's own tensors hold them.
    The next forward pass all-gathers the new model weights.
    """

    where: dict[int, tuple[Any, int]] = {}
    for chunk in model_chunks:
        for group in getattr(chunk, "param_and_grad_buffer").parameter_groups:
            for item, param in enumerate(group.params):
                where[id(param)] = (group, item)
    for name, param in named_global_parameters(model_chunks):
        group, item = where[id(param)]
        values = deterministic_values(name, param, seed)
        for buffer in (group.model_weight_buffer, group.main_weight_buffer):
            if buffer is not None:
                buffer.set_item(item, values.to(buffer.dtype))


def fsdp_v2_parameter_groups(model_chunks: Sequence[torch.nn.Module]) -> list[Any]:
    """The Megatron-FSDP v2 parameter groups of the chunks (empty for anything else): each
    ``fully_shard`` unit module's ``parameter_groups`` (``experimental/module.py``)."""
    return [
        group
        for chunk in model_chunks
        for unit in chunk.modules()
        if hasattr(unit, "parameter_groups") and hasattr(unit, "context")
        for group in getattr(unit, "parameter_groups")
    ]


@torch.no_grad()
def fill_fsdp_v2_deterministic_(model_chunks: Sequence[torch.nn.Module], seed: int) -> None:
    """:func:`fill_fsdp_deterministic_` for Megatron-FSDP v2 chunks: each param's
    layout-independent values, written into this rank's slice of its group's fp32
    ``main_weight`` and (bf16) ``model_weight`` flat buffers, in place."""

    where: dict[int, tuple[Any, int]] = {}
    for group in fsdp_v2_parameter_groups(model_chunks):
        for index, pair in enumerate(group.fsdp_parameters):
            where[id(pair.unsharded)] = (group, index)
    for name, param in named_global_parameters(model_chunks):
        group, index = where[id(param)]
        flat = deterministic_values(name, param, seed).reshape(-1)
        for buffer in {id(b): b for b in (group.main_weight, group.model_weight)}.values():
            local = buffer.get_local_tensor(index)
            if local.numel() == 0:
                continue
            # experimental/dbuffer.py: the local buffer starts at global element ``offset``,
            # the param at ``layout.tensor_to_offset[index]``.
            start = (
                buffer.offset
                + local.storage_offset()
                - buffer.local_buffer.storage_offset()
                - buffer.layout.tensor_to_offset[index]
            )
            local.copy_(flat[start : start + local.numel()].view_as(local).to(local.dtype))
