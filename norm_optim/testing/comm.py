"""A recording stand-in for :class:`norm_optim.Communicator` (one process, no collectives)."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Optional

import torch

from norm_optim._comm import Done, ProcessGroup, ReduceOp, Work
from norm_optim._patching import Patch

# What a simulated peer contributes: peers(kind, group rank, i) for the i-th collective of that
# kind: "all_gather" (its tensor) or "broadcast" (its object: it is the root).
Peers = Callable[[str, int, int], Any]
# What a simulated group's reduction gives: reduce(op, this rank's tensor, i) for the i-th
# ``all_reduce`` (any op); the default is this rank's tensor (every rank holds the same).
Reduce = Callable[[str, torch.Tensor, int], torch.Tensor]

# torch's *_object collectives send each object's pickled size first, as one int64.
_SIZE_BYTES = 8


@dataclasses.dataclass
class Traffic:
    """Bytes this rank put into, and got out of, its collectives (logical payloads: what
    ``torch.distributed`` is handed, not what a ring or tree forwards on the way)."""

    sent: int = 0
    received: int = 0


class RecordingCommunicator:
    """A single-process stand-in that records every collective (for unit tests).

    It does not talk to any other process: ``all_reduce_sum`` leaves the tensor as it is (the
    sum over a group of one), so a test can run one rank's code under a mocked parallel state
    and see which collectives it makes.

    With ``peers`` it plays rank ``rank`` of a simulated world of ``size`` ranks: gathers and
    broadcasts return what ``peers`` says the other ranks contribute, and :attr:`traffic`
    counts the bytes as ``torch.distributed`` would move them (a gather: this rank's tensor out,
    the ``size`` stacked tensors in; an object broadcast: an int64 size and the pickled bytes,
    out at the root and in elsewhere). That is how the benchmark sizes the per-param names
    exchange at 16,384 ranks on one process.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        device: str = "cpu",
        peers: Optional[Peers] = None,
        reduce: Optional[Reduce] = None,
    ) -> None:
        self._rank, self._size, self._device = rank, size, torch.device(device)
        self._peers, self._reduce = peers, reduce
        self.calls: list[tuple[str, ProcessGroup, Optional[torch.Size]]] = []
        self._counts: dict[str, int] = {}
        self.traffic = Traffic()
        # The largest receive buffer a collective handed this rank (bytes).
        self.peak_receive = 0

    def is_distributed(self) -> bool:
        return self._size > 1

    def rank(self, group: ProcessGroup) -> int:
        return self._rank

    def size(self, group: ProcessGroup) -> int:
        return self._size

    def first_rank(self, group: ProcessGroup) -> int:
        return 0

    def group_ranks(self, group: ProcessGroup) -> frozenset[int]:
        return frozenset(range(self._size))

    def device(self, group: ProcessGroup) -> torch.device:
        return self._device

    def all_reduce_sum(self, tensor: torch.Tensor, group: ProcessGroup, async_op: bool) -> Work:
        self.calls.append(("all_reduce", group, tensor.shape))
        self._reduced("sum", tensor)
        return Done()

    def all_reduce(self, tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> None:
        self.calls.append((f"all_reduce_{op}", group, tensor.shape))
        self._reduced(op, tensor)

    def _reduced(self, op: str, tensor: torch.Tensor) -> None:
        """Count an all-reduce (its tensor out, the reduced tensor in) and write the simulated
        group's result into ``tensor``."""
        index = self._count("all_reduce")
        self.traffic.sent += tensor.nbytes
        self.traffic.received += tensor.nbytes
        self.peak_receive = max(self.peak_receive, tensor.nbytes)
        if self._reduce is not None and self._size > 1:
            tensor.copy_(self._reduce(op, tensor, index))

    def all_gather_object(self, obj: Any, group: ProcessGroup) -> list[Any]:
        self.calls.append(("all_gather_object", group, None))
        return [obj]

    def all_gather_tensor(self, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        self.calls.append(("all_gather", group, tensor.shape))
        index = self._count("all_gather")
        parts = [
            tensor
            if r == self._rank or self._peers is None
            else torch.as_tensor(self._peers("all_gather", r, index)).to(tensor)
            for r in range(self._size)
        ]
        self.traffic.sent += tensor.nbytes
        self.traffic.received += tensor.nbytes * self._size
        self.peak_receive = max(self.peak_receive, tensor.nbytes * self._size)
        return torch.stack(parts)

    def broadcast_object(self, obj: Any, src: int, group: ProcessGroup) -> Any:
        self.calls.append(("broadcast_object", group, None))
        index = self._count("broadcast")
        if src != self._rank:
            if self._peers is None:
                raise ValueError("a broadcast from another rank needs peers=...")
            obj = self._peers("broadcast", src, index)
        nbytes = _SIZE_BYTES + len(pickle.dumps(obj))
        if src == self._rank:
            self.traffic.sent += nbytes
        else:
            self.traffic.received += nbytes
            self.peak_receive = max(self.peak_receive, nbytes)
        return obj

    def _count(self, kind: str) -> int:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        return self._counts[kind] - 1

    @property
    def num_all_reduces(self) -> int:
        return sum(1 for kind, _, _ in self.calls if kind.startswith("all_reduce"))


def counting_patches(traffic: Traffic) -> list[Patch]:
    """Patches (``norm_optim._patching.patches_applied``) that add the bytes of every collective
    ``torch.distributed`` makes on this rank to ``traffic``: counted at the tensor primitives
    of ``distributed_c10d`` (``all_gather_object`` and ``broadcast_object_list`` call
    ``all_gather`` / ``broadcast`` there, so they are counted too), as logical payloads, the
    way this module's :class:`RecordingCommunicator` counts them. Bytes are deterministic:
    a test can compare them across world sizes without timing anything."""
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
