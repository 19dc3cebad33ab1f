"""Megatron-FSDP models on CPU gloo ranks: test-only patches, a builder, deterministic weights.

``megatron.core.distributed.FullyShardedDataParallel`` runs on CPU with the CPU shim
(:mod:`norm_optim.testing.shim`) plus the patches of :func:`install_megatron_fsdp_cpu_patches`,
each named after the megatron code it exists for. Like the shim, never install them outside
tests. Build the model with :func:`build_fsdp_model`, the optimizer with
:func:`~norm_optim.testing.models.build_optimizer`, train with
:func:`~norm_optim.testing.models.train_step`.

Megatron-FSDP cannot reload its fp32 main weights from the model
(``DistributedOptimizer.reload_model_params`` raises ``NotImplementedError``), so
:func:`fill_fsdp_deterministic_` writes the oracle's values straight into this rank's shards of
the model-weight and main-weight buffers, at any time (before or after steps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from norm_optim.testing.loop_patches import cpu_rng_state_patches
from norm_optim.patching import Patch, PatchSet

__all__ = [
    "build_fsdp_model",
    "fill_fsdp_deterministic_",
    "fill_fsdp_v2_deterministic_",
    "fsdp_v2_parameter_groups",
    "has_megatron_fsdp_v2",
    "original_param",
    "install_megatron_fsdp_cpu_patches",
]

_HANDLE_ATTR = "_norm_optim_fsdp_patches"


def _cuda_index_during(init: Callable[..., None]) -> Callable[..., None]:
    # MegatronFSDP.__init__ compares its device with
    # ``torch.device(f"cuda:{torch.cuda.current_device()}")``; the CPU shim's current_device is
    # the CPU device, which makes that "cuda:cpu" (an error). Given device=cpu (as
    # build_fsdp_model does), the comparison only logs a warning when the index is 0.
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = saved  # type: ignore[assignment]

    return wrapper


class _CpuDeviceMesh:
    """``FullyShardedDataParallel._init_dist_index`` builds its meshes with
    ``DeviceMesh.from_group(..., device_type="cuda")``: build them on CPU (gloo) instead."""

    @staticmethod
    def from_group(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        kwargs["device_type"] = "cpu"
        return DeviceMesh.from_group(*args, **kwargs)


class _NoTELinear:
    """megatron-core 0.16.1 without Transformer Engine binds ``TELinear`` to a MagicMock, and
    ``FullyShardedDataParallel._fix_tensor_parallel_attributes`` (TP > 1) calls
    ``isinstance(module, (TELinear,))``, a TypeError. No module is a TELinear without TE."""


def has_megatron_fsdp_v2() -> bool:
    """Whether the installed megatron-core has Megatron-FSDP v2 (``megatron_fsdp_version=2``,
    ``FullyShardedDataParallelV2``; megatron-core main, the 0.20 line)."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter

    return hasattr(adapter, "FullyShardedDataParallelV2")


def _cuda_context_device(context: Callable[..., Any]) -> Callable[..., Any]:
    # experimental/fully_shard.py ``fully_shard_context`` raises unless its device is CUDA; the
    # device only names the streams it makes (the CPU shim's no-op streams): hand it a CUDA
    # device, while every buffer is allocated on the mesh's (CPU) device.
    @functools.wraps(context)
    def wrapper(device: Any = None, **kwargs: Any) -> Any:
        if device is None or torch.device(device).type == "cpu":
            device = torch.device("cuda", 0)
        return context(device=device, **kwargs)

    return wrapper


def _current_cpu_stream(self: Any) -> Any:
    # experimental/module.py ``FsdpContext.current_stream`` reads ``allgather_stream.device``,
    # which the CPU shim's no-op stream has not: on CPU there is only the current stream.
    return torch.cuda.current_stream()


def _recording_stream(init: Callable[..., None]) -> Callable[..., None]:
    # experimental/dbuffer.py ``DBuffer.__init__`` records no allocation stream for a CPU
    # buffer, while experimental/parameter_group.py asserts one (and compares it with the
    # current stream): record the CPU shim's stream, which equals every other.
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.allocation_stream is None:
            self.allocation_stream = torch.cuda.current_stream()

    return wrapper


def _v2_patches() -> list[Patch]:
    """Megatron-FSDP v2's CPU patches (megatron-core main), on top of v1's."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp.experimental import dbuffer, module

    return [
        # mcore_fsdp_adapter.py binds fully_shard_context by name.
        Patch(adapter, "fully_shard_context", _cuda_context_device(adapter.fully_shard_context)),
        Patch(module.FsdpContext, "current_stream", _current_cpu_stream),
        Patch(dbuffer.DBuffer, "__init__", _recording_stream(dbuffer.DBuffer.__init__)),
    ]


def install_megatron_fsdp_cpu_patches() -> PatchSet:
    """Patch megatron-core so that ``FullyShardedDataParallel`` builds on CPU ranks.

    Where megatron-core has Megatron-FSDP v2 (main), its patches too. Process-local and
    idempotent; ``uninstall()`` the handle to restore the originals. Needs the
    CPU shim too (:func:`~norm_optim.testing.run_ranks` installs it). Also pass
    ``gradient_reduce_div_fusion=False`` in the DDP config: gloo has no ``PREMUL_SUM``
    (:func:`build_fsdp_model` does).
    """
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp

    existing = getattr(adapter, _HANDLE_ATTR, None)
    if existing is not None and existing.installed:
        return existing
    patches = [
        Patch(megatron_fsdp.MegatronFSDP, "__init__",
               _cuda_index_during(megatron_fsdp.MegatronFSDP.__init__)),
        Patch(adapter, "DeviceMesh", _CpuDeviceMesh),
        # FullyShardedDataParallel.sync_rng_states_across_tp_group (TP > 1) broadcasts the
        # CUDA RNG state.
        *cpu_rng_state_patches(),
    ]
    if not isinstance(getattr(adapter, "TELinear", type), type):
        patches.append(Patch(adapter, "TELinear", _NoTELinear))
    if has_megatron_fsdp_v2():
        patches += _v2_patches()
    patches.append(Patch(adapter, _HANDLE_ATTR, None))
    handle = PatchSet.apply(patches)
    setattr(adapter, _HANDLE_ATTR, handle)
    return handle


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
    from norm_optim.testing.shim import init_rng

    pipeline = ps.get_pipeline_model_parallel_world_size()
    if pipeline > 1:
        raise ValueError(
            f"Megatron-FSDP cannot be built with pipeline parallelism ({pipeline} stages): its "
            "device mesh has no pipeline axis"
        )
    on_cpu = _cpu_shim_installed()
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

        ddp_overrides = dict(megatron_fsdp_version=2, use_distributed_optimizer=False,
                             **ddp_overrides)
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


def _cpu_shim_installed() -> bool:
    from norm_optim.testing.shim import _HANDLE_ATTR as SHIM_HANDLE

    shim = getattr(torch.cuda.synchronize, SHIM_HANDLE, None)
    return shim is not None and shim.installed


@torch.no_grad()
def fill_fsdp_deterministic_(model_chunks: Sequence[torch.nn.Module], seed: int) -> None:
    """:func:`~norm_optim.testing.oracle.fill_deterministic_` for Megatron-FSDP chunks.

    Writes each param's layout-independent values into this rank's shard of its bucket's
    bf16 model weights and, for trainable params, fp32 main weights (in place, through
    megatron's ``DataParallelBuffer.set_item``), so the optimizer's own tensors hold them.
    The next forward pass all-gathers the new model weights.
    """
    from norm_optim.testing.oracle import deterministic_values, named_global_parameters

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


def original_param(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """The model param behind a Megatron-FSDP stand-in: v1's DTensors keep ``orig_param``; v2's
    sharded params are paired with it in their parameter group
    (``experimental/parameter_group.py``, ``_mfsdp_parameter_group``)."""
    original = getattr(param, "orig_param", None)
    if original is not None:
        return original
    group_ref = getattr(param, "_mfsdp_parameter_group", None)
    group = group_ref() if group_ref is not None else None
    for pair in getattr(group, "fsdp_parameters", ()):
        if pair.sharded is param:
            return pair.unsharded
    return param


@torch.no_grad()
def fill_fsdp_v2_deterministic_(model_chunks: Sequence[torch.nn.Module], seed: int) -> None:
    """:func:`fill_fsdp_deterministic_` for Megatron-FSDP v2 chunks: each param's
    layout-independent values, written into this rank's slice of its group's fp32
    ``main_weight`` and (bf16) ``model_weight`` flat buffers, in place."""
    from norm_optim.testing.oracle import deterministic_values, named_global_parameters

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
            start = (buffer.offset + local.storage_offset() - buffer.local_buffer.storage_offset()
                     - buffer.layout.tensor_to_offset[index])
            local.copy_(flat[start:start + local.numel()].view_as(local).to(local.dtype))
