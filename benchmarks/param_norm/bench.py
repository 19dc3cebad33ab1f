"""What every method of one case is built from: one model, one optimizer, one parallel layout.

Built once per case on every rank, so that the methods differ only in how they compute the norm.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from norm_optim import NormAwareOptimizer

from .cases import Case


def is_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert params ``allreduce=False`` (they reduce over expert-DP instead)."""
    return not getattr(param, "allreduce", True)


@dataclasses.dataclass(frozen=True)
class Groups:
    """This rank's groups and coordinates, read once from megatron's parallel state.

    Megatron-LM asks the parallel state per param; reading it once makes the walks, if
    anything, faster than the originals.
    """

    dp_cp: Any
    expert_dp: Any
    model_parallel: Any
    expert_model_parallel: Any
    same_model_parallel_ranks: bool
    tp_rank: int
    expert_tp_rank: int
    dp_cp_rank: int
    expert_dp_rank: int

    @classmethod
    def from_parallel_state(cls) -> Groups:
        from megatron.core import parallel_state as ps

        mp = ps.get_model_parallel_group()
        expert_mp = ps.get_expert_tensor_model_pipeline_parallel_group()
        return cls(
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            expert_dp=ps.get_expert_data_parallel_group(),
            model_parallel=mp,
            expert_model_parallel=expert_mp,
            same_model_parallel_ranks=(
                dist.get_process_group_ranks(mp) == dist.get_process_group_ranks(expert_mp)
            ),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            expert_tp_rank=ps.get_expert_tensor_parallel_rank() or 0,
            dp_cp_rank=ps.get_data_parallel_rank(with_context_parallel=True),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
        )

    def is_tp_duplicate(self, param: torch.Tensor) -> bool:
        """Megatron's ``param_is_not_tensor_parallel_duplicate``, negated, aware of expert TP."""
        if getattr(param, "tensor_model_parallel", False):
            return False
        return (self.expert_tp_rank if is_expert(param) else self.tp_rank) > 0


@dataclasses.dataclass(frozen=True)
class Bench:
    """One case, built on this rank: the model chunks, the optimizer and norm_optim's wrapper."""

    chunks: list[torch.nn.Module]
    optimizer: Any
    wrapped: NormAwareOptimizer
    groups: Groups
    device: torch.device
    has_experts: bool
    megatron_fsdp: bool = False
    torch_fsdp2: bool = False

    def dtensors(self) -> list[torch.Tensor]:
        """The Megatron-FSDP or torch FSDP2 model's params as DTensors (Megatron-FSDP:
        ``stop_communication`` first: from then on the module holds its DTensors rather than
        unsharded views)."""
        params: list[torch.Tensor] = []
        for chunk in self.chunks:
            if self.megatron_fsdp:
                getattr(chunk, "stop_communication")()
            params.extend(chunk.parameters())
        return params


def build_bench(case: Case, device: torch.device) -> Bench:
    """Initialize the case's parallel layout and build its model and optimizer on ``device``.

    Raises:
        RuntimeError: a param did not land on ``device`` (the CUDA path has not run yet, so
            this is checked rather than assumed).
    """
    from norm_optim.testing import init_parallel
    from norm_optim.testing.models import build_model, build_optimizer

    init_parallel(**case.layout)
    if case.megatron_fsdp:  # it moves the weights to the current device itself
        from norm_optim.testing.megatron_fsdp import build_fsdp_model

        chunks = build_fsdp_model(case.model)
    elif case.torch_fsdp2:  # fully_shard moves the weights to the mesh's device
        from norm_optim.testing.torch_fsdp2 import build_torch_fsdp2_model

        chunks = build_torch_fsdp2_model(case.model)
    else:
        with torch.device(device):  # megatron allocates its buffers on the current CUDA device
            chunks = build_model(case.model, use_distributed_optimizer=True)
    optimizer = build_optimizer(chunks)
    on_wrong_device = [
        n for c in chunks for n, p in c.named_parameters() if p.device.type != device.type
    ]
    if on_wrong_device:
        raise RuntimeError(f"params not on {device}: {on_wrong_device[:3]}...")
    return Bench(
        chunks,
        optimizer,
        NormAwareOptimizer(optimizer, chunks),
        Groups.from_parallel_state(),
        device,
        bool(case.model.num_experts),
        case.megatron_fsdp,
        case.torch_fsdp2,
    )
