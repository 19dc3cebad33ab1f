"""The float64 norm every method's value is checked against, computed without norm_optim.

It reads the bf16 model params (which the fp32 main params equal right after the optimizer is
built) and picks each element's owner from megatron's own markers, so a counting bug in
norm_optim cannot hide in its own reference.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .bench import Bench, is_expert

_PIECE = 1 << 22  # float64 copies of at most 32 MiB at a time


@torch.no_grad()
def reference_norm(bench: Bench) -> tuple[float, int, int]:
    """(float64 norm, elements, tensors) of the whole model, each element counted once."""
    dtensors = bench.megatron_fsdp or bench.torch_fsdp2
    totals = _fsdp_totals(bench) if dtensors else _megatron_totals(bench)
    totals = totals.to(bench.device)
    dist.all_reduce(totals)
    return math.sqrt(totals[0].item()), int(totals[1].item()), int(totals[2].item())


def _megatron_totals(bench: Bench) -> torch.Tensor:
    """This rank's (sum of squares, elements, tensors): owners by TP / ``shared`` / (expert-)DP
    rank 0."""
    groups = bench.groups
    totals = torch.zeros(3, dtype=torch.float64)
    for chunk in bench.chunks:
        for param in chunk.parameters():
            dp_rank = groups.expert_dp_rank if is_expert(param) else groups.dp_cp_rank
            if groups.is_tp_duplicate(param) or getattr(param, "shared", False) or dp_rank:
                continue
            flat = param.detach().reshape(-1)
            for piece in flat.split(_PIECE):
                piece64 = piece.to(device="cpu", dtype=torch.float64)
                totals[0] += torch.dot(piece64, piece64)
            totals[1] += flat.numel()
            totals[2] += 1
    return totals


def _fsdp_totals(bench: Bench) -> torch.Tensor:
    """The same for Megatron-FSDP and torch FSDP2 (pure DP), from the DTensors' own placements: a rank adds its local
    shard when it is coordinate 0 of every mesh dim that replicates the tensor (the expert mesh
    has no EP dim: EP ranks hold other experts)."""
    totals = torch.zeros(3, dtype=torch.float64)
    for param in bench.dtensors():
        spec = getattr(param, "_spec")
        mesh = spec.device_mesh
        if any(p.is_replicate() and mesh.get_local_rank(d) for d, p in enumerate(spec.placements)):
            continue
        local = getattr(param, "_local_tensor").detach().reshape(-1).to("cpu", torch.float64)
        totals += torch.tensor([torch.dot(local, local).item(), local.numel(), 0.0])
        totals[2] += all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim))
    return totals
