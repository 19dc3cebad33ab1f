"""The communication seam: the only module that talks to ``torch.distributed``.

Everything norm_optim reduces goes through a :class:`Communicator`, so tests can hand in a
recording fake and see exactly which groups are used and how many collectives run.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

ProcessGroup = Any  # ``torch.distributed.ProcessGroup`` or ``None`` for the default group
ReduceOp = Literal["sum", "min", "max"]


class Work(Protocol):
    """What an asynchronous collective returns: ``wait()`` orders later work after it."""

    def wait(self) -> Any: ...


class Done:
    """A finished piece of work (for the single-process case and blocking calls)."""

    def wait(self) -> bool:
        return True


class Communicator(Protocol):
    """All-reduce and rank queries over process groups."""

    def is_distributed(self) -> bool:
        """True when collectives really cross processes."""
        ...

    def rank(self, group: ProcessGroup) -> int: ...

    def size(self, group: ProcessGroup) -> int: ...

    def first_rank(self, group: ProcessGroup) -> int:
        """The global rank of ``group``'s rank 0."""
        ...

    def group_ranks(self, group: ProcessGroup) -> frozenset[int]:
        """The global ranks of ``group`` (``None``: the default group)."""
        ...

    def device(self, group: ProcessGroup) -> torch.device:
        """The device a tensor must live on to be reduced over ``group``."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor, group: ProcessGroup, async_op: bool) -> Work:
        """Sum ``tensor`` in place over ``group``."""
        ...

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> None:
        """Reduce ``tensor`` in place over ``group`` with ``op`` (blocking). MIN / MAX of int64
        tables are what the audit decides on: every rank then derives the same findings."""
        ...

    def all_gather_object(self, obj: Any, group: ProcessGroup) -> list[Any]: ...

    def all_gather_tensor(self, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        """Every group rank's ``tensor`` (same shape everywhere), stacked in group-rank order."""
        ...

    def broadcast_object(self, obj: Any, src: int, group: ProcessGroup) -> Any:
        """Group rank ``src``'s ``obj`` (picklable), on every rank of ``group``."""
        ...


class TorchCommunicator:
    """``torch.distributed`` when it is initialized; the identity in a plain single process."""

    def is_distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def rank(self, group: ProcessGroup) -> int:
        return dist.get_rank(group) if self.is_distributed() else 0

    def size(self, group: ProcessGroup) -> int:
        return dist.get_world_size(group) if self.is_distributed() else 1

    def first_rank(self, group: ProcessGroup) -> int:
        if not self.is_distributed() or group is None:
            return 0
        return dist.get_process_group_ranks(group)[0]

    def group_ranks(self, group: ProcessGroup) -> frozenset[int]:
        if not self.is_distributed():
            return frozenset({0})
        if group is None:
            return frozenset(range(dist.get_world_size()))
        return frozenset(dist.get_process_group_ranks(group))

    def device(self, group: ProcessGroup) -> torch.device:
        # "nccl", or a combined backend such as "cpu:gloo,cuda:nccl" (torch's default on a CUDA
        # machine): CUDA tensors then go over NCCL, and CPU ones would force a host round trip.
        if self.is_distributed() and "nccl" in str(dist.get_backend(group)):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_sum(self, tensor: torch.Tensor, group: ProcessGroup, async_op: bool) -> Work:
        if not self.is_distributed():
            return Done()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        if not async_op:
            return Done()
        assert work is not None, "an async all_reduce returns its work"
        return work

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> None:
        if not self.is_distributed():
            return
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(tensor, op=ops[op], group=group)

    def all_gather_object(self, obj: Any, group: ProcessGroup) -> list[Any]:
        if not self.is_distributed():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def all_gather_tensor(self, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        if not self.is_distributed():
            return tensor.unsqueeze(0)
        size = dist.get_world_size(group)
        # One flat receive buffer (the concatenated form every backend takes), no per-rank
        # list and no stacking copy; viewed as [size, *shape].
        flat = torch.empty(size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        mine = tensor.contiguous().view(-1)
        if tensor.device.type == "cpu":
            # gloo (CPU tensors): into views of the same buffer. Its all_gather_into_tensor
            # crashed a rank now and then (torch 2.13, a segfault in a later collective).
            dist.all_gather(list(flat.view(size, -1).unbind(0)), mine, group=group)
        else:
            # torch 2.13 names it all_gather_single (all_gather_into_tensor: its old alias).
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(flat, mine, group=group)
        return flat.view(size, *tensor.shape)

    def broadcast_object(self, obj: Any, src: int, group: ProcessGroup) -> Any:
        if not self.is_distributed():
            return obj
        box = [obj]
        root = src if group is None else dist.get_global_rank(group, src)
        dist.broadcast_object_list(box, src=root, group=group)
        return box[0]
