"""Small host-made tensors put on a device without stalling the host.

``torch.tensor(values, device=cuda)`` copies from pageable host memory, and that copy makes the
host wait until the device has run everything queued before it. The kernels' plans hold a few
such index tensors (each piece's slot, each run's length), and some plans are built at every
step, because their tensors may be new objects then (a step's grads, a watched step's grads):
built that way, every watched step would stall the host once. :class:`DeviceIndices` keeps each
distinct index list on its device once, so a plan rebuilt over the same layout copies nothing
after the first step; :func:`to_device` sends per-call values (a step's scale factors) from
pinned memory, asynchronously.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

# Distinct index lists kept per owner: a reducer's plans use a handful (the weights, the grads,
# the moments, per-param or not); the oldest goes when a new layout comes.
CAPACITY = 32


class DeviceIndices:
    """``int64`` tensors of given values on a device, each made once (least recently used
    dropped beyond ``capacity``). Treat what it returns as read-only: it is shared."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._kept: OrderedDict[tuple[torch.device, tuple[int, ...]], Tensor] = OrderedDict()

    def __call__(self, values: Sequence[int], device: torch.device) -> Tensor:
        key = (torch.device(device), tuple(int(v) for v in values))
        found = self._kept.get(key)
        if found is None:
            found = to_device(key[1], torch.long, key[0])
            self._kept[key] = found
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return found

    def __len__(self) -> int:
        return len(self._kept)


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.tensor(values, dtype=dtype)`` (numbers, or nested lists of them) on ``device``;
    to a CUDA device through pinned host memory and a non-blocking copy (torch's caching host
    allocator keeps the pinned block until the copy has run), so the host does not wait."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
