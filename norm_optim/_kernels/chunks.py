"""Sums of squares of tensors computed on the fly, a few per chunk of one scratch buffer:
:class:`ChunkedSquares`.

For quantities that exist only as temporaries (a step's derived updates): the tensors' places
in one fp32 scratch buffer are planned once, by a byte budget; at each call a producer writes a
chunk's tensors into their places, and the whole chunk is summed with a handful of operations
whatever it holds: the scratch is viewed as rows of :data:`ROW` elements (each tensor's place
starts on a row and its tail is zero), one row-norm call gives every row's norm (fp32
accumulation over a short row: accurate on CPU too, see :mod:`.rows`), and two ``index_add_``
carry the rows' float64 squares to their tensors, then (times each tensor's factor squared) to
their slots. The op count of a call grows with the number of tensors and chunks, never with
elements; the extra memory is the scratch, ``max(budget, largest tensor)`` bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .indices import to_device

# Row length of the scratch's row view: each row accumulates this many fp32 squares.
ROW = 256

# Bytes of scratch per chunk, by device type: on an accelerator, large chunks (each operation
# on a chunk is one kernel launch per list); on CPU, a chunk that stays in cache between the
# producer's element-wise passes and the row norms.
BUDGET_BYTES = {"cpu": 1 << 20}
DEFAULT_BUDGET_BYTES = 64 << 20


def default_budget(device: torch.device) -> int:
    """The scratch budget in bytes for tensors on ``device`` (:data:`BUDGET_BYTES`)."""
    return BUDGET_BYTES.get(device.type, DEFAULT_BUDGET_BYTES)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Items ``first .. first + len(offsets)`` at ``offsets`` of the scratch (element offsets,
    multiples of :data:`ROW`), ``numel`` scratch elements used; ``row_item`` (the chunk-local
    item of each row) and ``item_slot`` on the device."""

    first: int
    offsets: tuple[int, ...]
    numel: int
    row_item: Tensor
    item_slot: Tensor
    # Each item's size then the zero tail of its last row, in scratch order: one split of the
    # scratch gives every place and every tail (two ops per chunk, not two per item).
    splits: tuple[int, ...] = ()

    @property
    def items(self) -> range:
        return range(self.first, self.first + len(self.offsets))


Producer = Callable[[Sequence[int], Sequence[Tensor]], Sequence[float]]
"""``producer(items, places)`` fills each ``places[k]`` (a flat fp32 view of the scratch sized
for item ``items[k]``) and returns one factor per item: its tensor is ``factor · place``."""


class ChunkedSquares:
    """Planned once for items of the given sizes; each call sums what a producer writes.

    Args:
        numels: elements of each item.
        slots: the output slot of each item.
        num_slots: length of the output.
        device: where the scratch and the result live.
        budget_bytes: scratch bytes per chunk (default: :func:`default_budget`); an item larger
            than the budget gets a chunk of its own.
    """

    def __init__(
        self,
        numels: Sequence[int],
        slots: Sequence[int],
        num_slots: int,
        device: torch.device,
        budget_bytes: int | None = None,
    ) -> None:
        if len(numels) != len(slots):
            raise ValueError(f"got {len(numels)} sizes but {len(slots)} slots")
        self.device, self.num_slots = device, num_slots
        self.budget_bytes = default_budget(device) if budget_bytes is None else budget_bytes
        budget = max(self.budget_bytes // 4, ROW)
        self.numels = [int(n) for n in numels]
        chunks: list[list[int]] = []
        used = 0
        for item, numel in enumerate(self.numels):
            size = _aligned(numel)
            if not chunks or used + size > budget:
                chunks.append([])
                used = 0
            chunks[-1].append(item)
            used += size
        self.chunks = [self._chunk(items, slots) for items in chunks if items]
        self.scratch_numel = max((c.numel for c in self.chunks), default=0)

    def _chunk(self, items: list[int], slots: Sequence[int]) -> Chunk:
        offsets, rows, splits, at = [], [], [], 0
        for local, item in enumerate(items):
            offsets.append(at)
            size = _aligned(self.numels[item])
            rows.extend([local] * (size // ROW))
            splits += [self.numels[item], size - self.numels[item]]
            at += size
        return Chunk(
            items[0],
            tuple(offsets),
            at,
            to_device(rows, torch.long, self.device),
            to_device([slots[i] for i in items], torch.long, self.device),
            tuple(splits),
        )

    @property
    def scratch_bytes(self) -> int:
        """The extra memory of one call: its scratch (the rows' norms are 1/:data:`ROW` of it)."""
        return self.scratch_numel * 4

    def scratch(self) -> Tensor:
        """A scratch buffer for one call (:attr:`scratch_bytes`; freed with its last view)."""
        return torch.empty(self.scratch_numel, dtype=torch.float32, device=self.device)

    def places(self, chunk: Chunk, scratch: Tensor) -> list[Tensor]:
        """The flat views of ``scratch`` where ``chunk``'s items go, the tails of their last
        rows zeroed."""
        parts = scratch[: chunk.numel].split(chunk.splits)
        tails = [t for t in parts[1::2] if t.numel()]
        if tails:
            torch._foreach_zero_(tails)
        return list(parts[0::2])

    def add(self, chunk: Chunk, scratch: Tensor, factors: Sequence[float], out: Tensor) -> None:
        """Add ``factor² · Σ place²`` of each of ``chunk``'s items into ``out[slot]`` (no
        factors: all 1)."""
        rows = scratch[: chunk.numel].view(-1, ROW)
        squares = torch.linalg.vector_norm(rows, dim=1).double().square_()
        per_item = torch.zeros(len(chunk.offsets), dtype=torch.float64, device=self.device)
        per_item.index_add_(0, chunk.row_item, squares)
        if any(f != 1.0 for f in factors):
            per_item.mul_(to_device([f * f for f in factors], torch.float64, self.device))
        out.index_add_(0, chunk.item_slot, per_item)

    def __call__(self, produce: Producer, out: Tensor) -> None:
        """Add every item's float64 sum of squares into ``out[slot]`` (``out``: float64, on
        ``device``). Items a producer leaves out must have their place zeroed by it."""
        if not self.chunks:
            return
        scratch = self.scratch()
        for chunk in self.chunks:
            factors = produce(list(chunk.items), self.places(chunk, scratch))
            self.add(chunk, scratch, factors, out)


def _aligned(numel: int) -> int:
    return -(-numel // ROW) * ROW
