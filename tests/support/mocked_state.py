"""One process, mocked parallel state: the fixtures of the single-process tests.

No ``torch.distributed`` here. megatron's parallel-state rank getters are patched to put this
process at a chosen position (e.g. TP rank 1 of 2, expert-DP rank 1), and a recording
communicator (``norm_optim.testing.RecordingCommunicator``) stands in for the all-reduce, so a
test sees which tensors a rank counts, which groups are used and how many collectives run. The
optimizers are the real ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer``, built under
the CPU shim (they hard-code CUDA type strings: the ``megatron_cpu_shim`` fixture of conftest).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params


class TinyMoE(torch.nn.Module):
    """Params with the attributes megatron gives them: TP-split, TP-duplicate, expert, tied."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def param(*shape: int, **attrs: object) -> torch.nn.Parameter:
            p = torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype))
            for key, value in attrs.items():
                setattr(p, key, value)
            return p

        self.column = param(8, 4, tensor_model_parallel=True, partition_dim=0)
        self.norm = param(4)  # no TP attribute: a TP duplicate on tp_rank > 0
        self.expert = param(6, 4, tensor_model_parallel=True, partition_dim=0, allreduce=False)
        self.expert_norm = param(4, allreduce=False)
        self.tied_copy = param(5, 4, tensor_model_parallel=True, partition_dim=0, shared=True)


@contextlib.contextmanager
def mocked_ranks(**ranks: int) -> Iterator[None]:
    """Patch megatron's rank getters (tp, expert_tp, dp_cp, expert_dp) for one process, and its
    world-size getters (``<name>_size`` keys, e.g. ``tensor_model_parallel_size``; default 1)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(ps, "model_parallel_is_initialized", lambda: True)
    mp.setattr(ps, "get_tensor_model_parallel_rank", lambda: ranks.get("tp", 0))
    mp.setattr(ps, "get_expert_tensor_parallel_rank", lambda: ranks.get("expert_tp", 0))
    mp.setattr(ps, "get_data_parallel_rank", lambda **_: ranks.get("dp_cp", 0))
    mp.setattr(ps, "get_expert_data_parallel_rank", lambda **_: ranks.get("expert_dp", 0))
    for getter in (
        "tensor_model_parallel",
        "expert_tensor_parallel",
        "expert_model_parallel",
        "data_parallel",
        "expert_data_parallel",
    ):
        size = ranks.get(f"{getter}_size", 1)
        mp.setattr(ps, f"get_{getter}_world_size", lambda size=size, **_: size)
    # No process groups exist: the replicating groups' first ranks read as 0.
    mp.setattr(ps, "get_data_parallel_group", lambda **_: None)
    mp.setattr(ps, "get_expert_data_parallel_group", lambda **_: None)
    try:
        yield
    finally:
        mp.undo()


def float16_optimizer(model: torch.nn.Module) -> Float16OptimizerWithFloat16Params:
    config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True)
    # The keys megatron's param-group matching expects (as _get_param_groups sets them).
    group = dict(
        params=list(model.parameters()),
        wd_mult=1.0,
        lr_mult=1.0,
        is_expert_parallel=False,
        is_decoupled_lr=False,
    )
    inner = torch.optim.Adam([group], lr=1e-3)
    return Float16OptimizerWithFloat16Params(inner, config, None, lambda *_: None)


def oracle(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(t.detach().double().pow(2).sum() for t in tensors)))


# The CPU shim around a single-process test (conftest's fixture): megatron's Float16 / FP32
# optimizers hard-code CUDA type strings.
single_process = pytest.mark.usefixtures("megatron_cpu_shim")
