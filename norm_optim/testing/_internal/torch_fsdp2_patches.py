"""Test-only patch that lets Megatron's ``TorchFullyShardedDataParallel`` build on CPU ranks
(internal).

Reversible and named after the megatron code it exists for; applied by
:mod:`norm_optim.testing.torch_fsdp2` and the loop runners. Never install it outside tests.
"""

from __future__ import annotations

from typing import Any


from norm_optim._patching import Patch, PatchSet


_HANDLE_ATTR = "_norm_optim_torch_fsdp2_patches"


class _CpuDeviceMesh:
    """``TorchFullyShardedDataParallel.__init__`` builds its mesh with
    ``DeviceMesh.from_group(self.process_group, "cuda")``: build it on CPU (gloo) instead."""

    @staticmethod
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def install_torch_fsdp2_cpu_patches() -> PatchSet:
    """Patch megatron-core so that ``TorchFullyShardedDataParallel`` builds on CPU ranks.

    Process-local and idempotent; ``uninstall()`` the handle to restore the original. Needs the
    CPU shim too (:func:`~norm_optim.testing.run_ranks` installs it).
    """
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp

    existing = getattr(tfsdp, _HANDLE_ATTR, None)
    if existing is not None and existing.installed:
        return existing
    handle = PatchSet.apply(
        [Patch(tfsdp, "DeviceMesh", _CpuDeviceMesh), Patch(tfsdp, _HANDLE_ATTR, None)]
    )
    setattr(tfsdp, _HANDLE_ATTR, handle)
    return handle
