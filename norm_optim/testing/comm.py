"""A recording stand-in for :class:`norm_optim.comm.Communicator` (one process, no collectives)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from norm_optim.comm import Done, ProcessGroup, Work


class RecordingCommunicator:
    """A single-process stand-in that records every collective (for unit tests).

    It does not talk to any other process: ``all_reduce_sum`` leaves the tensor as it is (the
    sum over a group of one), so a test can run one rank's code under a mocked parallel state
    and see which collectives it makes.
    """

    def __init__(self, rank: int = 0, size: int = 1, device: str = "cpu") -> None:
        self._rank, self._size, self._device = rank, size, torch.device(device)
        self.calls: list[tuple[str, ProcessGroup, Optional[torch.Size]]] = []

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
        return Done()

    def all_gather_object(self, obj: Any, group: ProcessGroup) -> list[Any]:
        self.calls.append(("all_gather_object", group, None))
        return [obj]

    @property
    def num_all_reduces(self) -> int:
        return sum(1 for kind, _, _ in self.calls if kind == "all_reduce")
