"""Bytes ``torch.distributed`` moves on this rank, counted at its tensor primitives.

``all_gather_object`` and ``broadcast_object_list`` call ``all_gather`` / ``broadcast`` of
``distributed_c10d`` (the module they live in), so patching the functions there and on
``torch.distributed`` counts them too. Payloads are logical: what a rank hands in and gets out
(an all-reduce: its tensor out, the reduced tensor in), not what a ring forwards on the way.
Bytes are deterministic: a test can compare them across world sizes without timing anything.
"""

from __future__ import annotations

from typing import Any

import torch

from norm_optim._patching import Patch
from norm_optim.testing.comm import Traffic


def counting_patches(traffic: Traffic) -> list[Patch]:
    """Patches that add every collective's bytes on this rank to ``traffic``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    broadcast, all_gather, all_reduce = c10d.broadcast, c10d.all_gather, c10d.all_reduce
    # all_gather_into_tensor calls all_gather_single where torch has it (2.13): count one.
    single = "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"
    all_gather_into_tensor = getattr(c10d, single)

    def counted_broadcast(
        tensor: torch.Tensor, src: int | None = None, group: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        # torch calls it with a global ``src`` or (2.6+, from broadcast_object_list) ``group_src``
        group_src = kwargs.get("group_src")
        root = src == dist.get_rank() if group_src is None else group_src == dist.get_rank(group)
        if root:
            traffic.sent += tensor.nbytes
        else:
            traffic.received += tensor.nbytes
        return broadcast(tensor, src, group, *args, **kwargs)

    def counted_all_gather(
        tensors: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        traffic.sent += tensor.nbytes
        traffic.received += sum(t.nbytes for t in tensors)
        return all_gather(tensors, tensor, *args, **kwargs)

    def counted_all_gather_into_tensor(
        out: torch.Tensor, tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        traffic.sent += tensor.nbytes
        traffic.received += out.nbytes
        return all_gather_into_tensor(out, tensor, *args, **kwargs)

    def counted_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        traffic.sent += tensor.nbytes
        traffic.received += tensor.nbytes
        return all_reduce(tensor, *args, **kwargs)

    counted = (
        ("broadcast", counted_broadcast),
        ("all_gather", counted_all_gather),
        (single, counted_all_gather_into_tensor),
        ("all_reduce", counted_all_reduce),
    )
    return [Patch(module, name, function) for module in (dist, c10d) for name, function in counted]
