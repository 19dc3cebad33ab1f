"""Test-only patches Megatron-Bridge needs on CPU (internal): import guards and per-rank patches.

- at import: a Transformer Engine stand-in handed to ``megatron.bridge.peft.lora_layers``
  only (a ``builtins.__import__`` wrapper), and NVRx's async checkpointing hidden from
  megatron-core's probe (a ``None`` entry in ``sys.modules``);
- per rank (:func:`install_bridge_cpu_patches`, :func:`install_bridge_megatron_fsdp_cpu_patches`).

:mod:`norm_optim.testing.megatron_bridge` applies them.
"""

from __future__ import annotations

import builtins
import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Optional

import torch

from norm_optim.testing._internal.loop_patches import (
    allow_no_cuda_patches,
    compile_helpers_patches,
    cpu_rng_state_patches,
    jit_fusion_options_patches,
    one_cuda_device_patches,
)
from norm_optim.testing._internal.megatron_fsdp_patches import install_megatron_fsdp_cpu_patches
from norm_optim._patching import Patch, PatchSet


# The module that imports Transformer Engine unconditionally (``import transformer_engine.pytorch
# as te``, for its LoRA layers); nothing on the pretraining path uses those layers.
_TE_IMPORTER = "megatron.bridge.peft.lora_layers"

# megatron-core's ``has_nvrx_async_support`` (dist_checkpointing/strategies/nvrx.py, run when
# strategies/torch.py is imported) reads ``nvidia_resiliency_ext.__version__``, which NVRx 0.4.1
# (the newest on the registry) lacks. A None entry makes its probe import fail, so it answers
# "no async support" before reading the version.
_NVRX_ASYNC_CORE = "nvidia_resiliency_ext.checkpointing.async_ckpt.core"


class _TransformerEngineStandIn(type):
    """Any attribute of the stand-in is another stand-in class: ``te.ops.Sequential`` in
    annotations and ``isinstance(x, te.Linear)`` work (always False); instantiating one fails."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TransformerEngineStandIn(name, (), {"__init__": _te_unavailable})


def _te_unavailable(self: Any, *args: Any, **kwargs: Any) -> None:
    raise ImportError(
        f"{type(self).__name__}: Transformer Engine is not installed; this is "
        f"norm_optim.testing's import-time stand-in for {_TE_IMPORTER}"
    )


@contextlib.contextmanager
def transformer_engine_for_lora_layers() -> Iterator[None]:
    """Hand a Transformer Engine stand-in to ``megatron.bridge.peft.lora_layers`` only.

    Other modules keep seeing TE as absent (megatron-core's ``HAVE_TE`` checks must stay False
    on CPU), so the stand-in is returned by ``__import__`` for that importer, never put in
    ``sys.modules``.
    """
    original = builtins.__import__
    stand_in = _TransformerEngineStandIn("transformer_engine", (), {})

    def import_(
        name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0
    ) -> Any:
        if (
            name.split(".")[0] == "transformer_engine"
            and globals is not None
            and globals.get("__name__") == _TE_IMPORTER
        ):
            return stand_in
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = import_
    try:
        yield
    finally:
        builtins.__import__ = original


@contextlib.contextmanager
def without_nvrx_async_checkpointing() -> Iterator[None]:
    had = _NVRX_ASYNC_CORE in sys.modules
    previous = sys.modules.get(_NVRX_ASYNC_CORE)
    modules: dict[str, Any] = sys.modules  # None there makes the import fail
    modules[_NVRX_ASYNC_CORE] = None
    try:
        yield
    finally:
        if had:
            modules[_NVRX_ASYNC_CORE] = previous
        else:
            del sys.modules[_NVRX_ASYNC_CORE]


def install_bridge_cpu_patches() -> PatchSet:
    """Apply the per-rank patches Bridge's ``pretrain()`` needs on CPU, after the CPU shim.

    Each was found by removing it and watching ``pretrain()`` fail (except the RNG state one,
    see :func:`cpu_rng_state_patches`).

    Returns:
        A handle whose ``uninstall()`` (or ``with``) restores the originals, in reverse order.
    """
    from megatron.bridge.training import initialize, setup

    return PatchSet.apply(
        one_cuda_device_patches()
        + cpu_rng_state_patches()
        + allow_no_cuda_patches(setup)
        + compile_helpers_patches(initialize)
        + jit_fusion_options_patches(setup)
    )


def megatron_fsdp_cpu_device_patches() -> list[Patch]:
    """``FullyShardedDataParallel`` built on the CPU device when its caller names none.

    Bridge's ``get_model`` (``models/model_provider.py``) wraps the model with megatron-core's
    ``megatron.training.models.dist_utils._ddp_wrap``, which constructs
    ``FullyShardedDataParallel(config=..., ddp_config=..., module=..., ...)`` without a
    ``device``; the adapter's ``__init__`` (``distributed/fsdp/mcore_fsdp_adapter.py``) then uses
    ``torch.device(f"cuda:{torch.cuda.current_device()}")``, which the CPU shim makes
    ``"cuda:cpu"`` (an error). With the CPU device given, Megatron-FSDP keeps its buffers on CPU
    as :func:`~norm_optim.testing.megatron_fsdp.build_fsdp_model` builds it.
    """
    import functools

    from megatron.core.distributed import FullyShardedDataParallel

    init = FullyShardedDataParallel.__init__

    @functools.wraps(init)
    def __init__(
        self: Any, *args: Any, device: Optional[torch.device] = None, **kwargs: Any
    ) -> None:
        init(self, *args, device=device or torch.device("cpu"), **kwargs)

    return [Patch(FullyShardedDataParallel, "__init__", __init__)]


@contextlib.contextmanager
def install_bridge_megatron_fsdp_cpu_patches() -> Iterator[None]:
    """Megatron-FSDP under Bridge's ``pretrain()`` on CPU: megatron-core's Megatron-FSDP
    patches (:func:`~norm_optim.testing._internal.megatron_fsdp_patches.install_megatron_fsdp_cpu_patches`) and
    :func:`megatron_fsdp_cpu_device_patches`, restored on exit. Also set
    ``ddp.gradient_reduce_div_fusion=False`` (gloo has no ``PREMUL_SUM``;
    :func:`~norm_optim.testing.megatron_bridge.tiny_config` does)."""
    with install_megatron_fsdp_cpu_patches(), PatchSet.apply(megatron_fsdp_cpu_device_patches()):
        yield
