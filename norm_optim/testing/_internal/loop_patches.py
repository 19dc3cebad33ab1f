"""Test-only patches that any megatron-core training loop needs on CPU ranks.

Megatron-LM's loop (``megatron.training``) and Megatron-Bridge's (``megatron.bridge.training``)
make the same CUDA assumptions in the same places; each function returns the reversible
:class:`~norm_optim._patching.Patch` list for one of them and names the code it exists
for. The loop-specific ones (and the module each loop imported a function into) live in
:mod:`norm_optim.testing.megatron_lm` and :mod:`norm_optim.testing.megatron_bridge`. On top of
the CPU shim (:mod:`norm_optim.testing.cpu`), which ``run_ranks`` installs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from norm_optim._patching import Patch

__all__ = [
    "allow_no_cuda_patches",
    "compile_helpers_patches",
    "cpu_rng_state_patches",
    "jit_fusion_options_patches",
    "one_cuda_device_patches",
    "torch_dist_save_patches",
]


def one_cuda_device_patches() -> list[Patch]:
    """``torch.cuda.device_count()`` -> 1 and ``torch.cuda.set_device`` a no-op.

    Both loops' ``_initialize_distributed`` initialize megatron's parallel state only ``if
    device_count > 0`` (after ``torch.cuda.set_device(local_rank)``), and Bridge's
    ``_set_random_seed`` sets up the (CUDA-free, with ``inference_rng_tracker``) RNG tracker
    only then: with no GPU the loop would run with no model-parallel groups and no tracker.
    """
    return [
        Patch(torch.cuda, "device_count", lambda: 1),
        Patch(torch.cuda, "set_device", lambda device: None),
    ]


def cpu_rng_state_patches() -> list[Patch]:
    """``torch.cuda.get_rng_state`` / ``set_rng_state`` on the CPU generator.

    Checkpoints store ``'cuda_rng_state': torch.cuda.get_rng_state()`` (``get_rng_state`` in
    both loops' ``checkpointing.py``), and Megatron-FSDP's TP RNG sync broadcasts it; all would
    initialize CUDA. The CPU generator's state stands in for it.
    """

    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    return [
        Patch(torch.cuda, "get_rng_state", get_rng_state),
        Patch(torch.cuda, "set_rng_state", set_rng_state),
    ]


def allow_no_cuda_patches(module: ModuleType) -> list[Patch]:
    """``module.initialize_megatron`` called with ``allow_no_cuda=True``.

    ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda``;
    Megatron-LM's ``pretrain`` (``megatron.training.training``) and Bridge's ``setup()``
    (``megatron.bridge.training.setup``) import it by name and never pass it.
    """
    original = module.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    return [Patch(module, "initialize_megatron", initialize_megatron)]


def compile_helpers_patches(module: ModuleType) -> list[Patch]:
    """``module.compile_helpers`` a no-op: the megatron-core wheel ships the built dataset index
    helpers but not the Makefile ``megatron.core.datasets.utils.compile_helpers`` runs, so the
    job exits on rank 0."""
    return [Patch(module, "compile_helpers", lambda: None)]


def jit_fusion_options_patches(module: ModuleType) -> list[Patch]:
    """``module.set_jit_fusion_options`` a no-op: its warm-up of the fused bias-GeLU /
    bias-dropout-add kernels (off on CPU anyway) builds inputs with ``torch.rand(...,
    device="cuda")``, which the shim does not route."""
    return [Patch(module, "set_jit_fusion_options", lambda *args, **kwargs: None)]


def torch_dist_save_patches() -> list[Patch]:
    """Let megatron's synchronous ``torch_dist`` checkpoint save run in a ``run_ranks`` rank
    (any ``dist_checkpointing.save``, with or without a training loop).

    ``FileSystemWriterAsync`` (megatron/core/dist_checkpointing/strategies/filesystem_async.py)
    forks one writer process per file, which a daemonic process (``run_ranks`` ranks are) may
    not do; it collects their results through a ``spawn`` Manager queue, whose server outlives a
    rank that is killed (and costs ~3 s per save): a ``fork`` queue whose ``put`` is
    synchronous stands in for it (megatron's ``get_nowait`` right after the put must see it).
    Without ``psutil`` every writer raises in ``_process_memory()`` outside its ``try`` and the
    save hangs: it is stubbed then.
    """
    import multiprocessing
    import multiprocessing.queues
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class SynchronousQueue(multiprocessing.queues.SimpleQueue):
        """``put`` writes to the pipe before returning, as the Manager queue's does: a plain
        ``Queue`` hands it to a feeder thread, and megatron's ``get_nowait`` right after the put
        then found it empty now and then ("results_queue should not be empty")."""

        def get_nowait(self) -> Any:
            if self.empty():
                raise queue.Empty
            return self.get()

    patches = [
        Patch(multiprocessing.current_process(), "daemon", False),
        Patch(
            filesystem_async,
            "_results_queue",
            SynchronousQueue(ctx=multiprocessing.get_context("fork")),
        ),
    ]
    if not filesystem_async.HAVE_PSUTIL:
        patches.append(Patch(filesystem_async, "_process_memory", lambda: 0))
    return patches
