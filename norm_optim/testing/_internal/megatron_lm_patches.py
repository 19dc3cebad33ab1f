"""Test-only patches Megatron-LM's ``pretrain()`` needs on CPU ranks (internal).

On top of the CPU shim: the generic loop patches (:mod:`.loop_patches`) and those of
``megatron.training`` itself, each reversible and named after the code it exists for;
:func:`megatron_lm_on_cpu` applies them (:func:`norm_optim.testing.megatron_lm.pretrain_gpt` does).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


from norm_optim.testing._internal.loop_patches import (
    allow_no_cuda_patches,
    compile_helpers_patches,
    cpu_rng_state_patches,
    jit_fusion_options_patches,
    one_cuda_device_patches,
    torch_dist_save_patches,
)
from norm_optim._patching import Patch, patches_applied


def cpu_loop_patches() -> list[Patch]:
    """The patches any megatron-core training loop needs on CPU (on top of the CPU shim)."""
    from megatron.core.datasets import utils

    return (
        one_cuda_device_patches()
        + compile_helpers_patches(utils)
        + cpu_rng_state_patches()
        + torch_dist_save_patches()
    )


def device_arch_patches() -> list[Patch]:
    """``get_device_arch_version`` -> 9 (Hopper) in argument validation.

    With TP > 1 ``validate_args`` (megatron/training/arguments.py) reads the GPU architecture
    (``torch.cuda.get_device_properties``) to decide whether ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    is required; on 9 it requires it, which :func:`megatron_lm_on_cpu` sets.
    """
    from megatron.training import arguments

    return [Patch(arguments, "get_device_arch_version", lambda: 9)]


def megatron_lm_patches() -> list[Patch]:
    """The patches ``megatron.training``'s own code needs on CPU."""
    from megatron.training import training

    return (
        allow_no_cuda_patches(training)
        + jit_fusion_options_patches(training)
        + device_arch_patches()
    )


@contextlib.contextmanager
def megatron_lm_on_cpu(*, torch_fsdp2: bool = False) -> Iterator[None]:
    """Apply :func:`cpu_loop_patches` and :func:`megatron_lm_patches`, and set
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (see :func:`device_arch_patches`); restore all on exit.
    Needs the CPU shim installed (``run_ranks`` does).

    With ``torch_fsdp2`` (``--use-torch-fsdp2``): unset that variable instead (``validate_args``
    asserts FSDP runs do not set it to 1; with TP it only warns) and apply the CPU patch of
    :func:`~norm_optim.testing._internal.torch_fsdp2_patches.install_torch_fsdp2_cpu_patches`.
    """
    previous = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if torch_fsdp2:
        from norm_optim.testing._internal.torch_fsdp2_patches import install_torch_fsdp2_cpu_patches

        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        fsdp2 = install_torch_fsdp2_cpu_patches()
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    try:
        with patches_applied(cpu_loop_patches() + megatron_lm_patches()):
            yield
    finally:
        if torch_fsdp2:
            fsdp2.uninstall()
        if previous is None:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = previous


def distributed_optimizer_load_patches() -> list[Patch]:
    """What loading a distributed-optimizer ``torch_dist`` checkpoint needs without apex / TE
    (test-only: on a GPU the inner optimizer is FusedAdam, which keeps its step in the param
    groups, and neither applies).

    Without apex / TE the inner optimizer is torch's Adam, which keeps ``step`` per param in
    its state, where megatron-core 0.19's ``DistributedOptimizer`` expects it in the groups:

    1. ``state_dict()`` asserts one per-param step; at load it builds the template while the
       inner state is empty (or holds ``init_state_fn``'s tensors without a step). Patched:
       ``init_state_fn`` first where the state is empty, and a ``step`` of 0 lent to each state
       that lacks one for the call only.
    2. With ``--dist-ckpt-optim-fully-reshardable``, ``_set_main_param_and_optimizer_states``
       copies every key of the live state from the loaded tensors and raises ``KeyError:
       'step'``. Patched: ``step`` passed as None, which it skips (the step comes back through
       the param groups).
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    state_dict = DistributedOptimizer.state_dict
    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def lending_state_dict(self: Any) -> Any:
        if not self.optimizer.state and self.init_state_fn is not None:
            self.init_state_fn(self.optimizer, self.config)
        lent = [s for s in self.optimizer.state.values() if "step" not in s]
        for state in lent:
            state["step"] = torch.tensor(0.0)
        try:
            return state_dict(self)
        finally:
            for state in lent:
                del state["step"]

    def without_step(self: Any, model_param: Any, tensors: dict) -> Any:
        return set_states(self, model_param, {"step": None, **tensors})

    return [
        Patch(DistributedOptimizer, "state_dict", lending_state_dict),
        Patch(DistributedOptimizer, "_set_main_param_and_optimizer_states", without_step),
    ]
