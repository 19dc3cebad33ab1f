"""What a call makes on the host, counted at torch's dispatcher: for tests that pin a read to
make nothing there after its first call (towards a GPU, each tensor made from host data is a
copy from pageable memory, which makes the host wait for the device)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")


class _HostMade(TorchDispatchMode):
    """Counts ``aten.lift_fresh`` (what ``torch.tensor(...)`` dispatches)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.made += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


def host_made(fn: Callable[[], T]) -> tuple[T, int]:
    """``(fn(), how many tensors it made from host data)``."""
    with _HostMade() as mode:
        result = fn()
    return result, mode.made


__all__ = ["host_made"]
