"""Test-only patches that let Megatron-FSDP build on CPU gloo ranks (internal).

Each is named after the megatron code it exists for and is reversible; applied by
:mod:`norm_optim.testing.megatron_fsdp` and the loop runners. Never install them outside tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from norm_optim.testing._internal.loop_patches import cpu_rng_state_patches
from norm_optim._patching import Patch, PatchSet, patches_applied


_HANDLE_ATTR = "_norm_optim_fsdp_patches"


def _cuda_index_during(init: Callable[..., None]) -> Callable[..., None]:
    # MegatronFSDP.__init__ compares its device with
    # ``torch.device(f"cuda:{torch.cuda.current_device()}")``; the CPU shim's current_device is
    # the CPU device, which makes that "cuda:cpu" (an error). Given device=cpu (as
    # build_fsdp_model does), the comparison only logs a warning when the index is 0.
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        with patches_applied([Patch(torch.cuda, "current_device", lambda: 0)]):
            init(self, *args, **kwargs)

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
        Patch(
            megatron_fsdp.MegatronFSDP,
            "__init__",
            _cuda_index_during(megatron_fsdp.MegatronFSDP.__init__),
        ),
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


def cpu_shim_installed() -> bool:
    from norm_optim.testing.cpu import _HANDLE_ATTR as SHIM_HANDLE

    shim = getattr(torch.cuda.synchronize, SHIM_HANDLE, None)
    return shim is not None and shim.installed
