"""Many small CPU tensors summed in a fixed number of ops per call: :class:`PackedSquares`.

Summed block by block (:mod:`.rows`), each small tensor padded to whole rows, a call's ops grow
with the number of tensors where they are small: ~300 ops for 10,000 params of a few hundred
elements. A plan built once and called often (the weights' norms) is instead laid out once over
flat buffers and read by :class:`~.segments.SegmentedSquares`, the same short list of ops for
100 or 10,000 tensors:

* fp32 tensors that are views of one storage (a Megatron DDP param buffer, shards of it, when the
  optimizer steps the model's fp32 params) are read in place, as segments of it: no copy;
* the others (separate allocations: the Float16 and distributed optimizers' fp32 mains, params
  with no fp32 copy) are copied back to back (bf16 / fp16 cast to fp32) into one kept buffer by
  one ``torch.cat`` per pack of at most :data:`PACK_NUMEL` elements, and read as segments of it.

What this costs instead of ops: the pack buffer, kept between calls (at most
``PACK_NUMEL × 4`` bytes, only as much as the small tensors fill) and the read's own
(:attr:`kept_bytes`); and a build of O(elements / 32) host work, paid once per registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor

from .segments import Segment, SegmentedSquares

# Elements copied into the pack buffer per ``torch.cat`` (8 MiB of fp32): one pack holds the
# small tensors of 10,000 params of a few hundred elements; every further pack adds ~10 ops.
PACK_NUMEL = 1 << 21

# Contiguous tensors below this many elements that share no storage are copied (as .rows packs
# them); larger ones are read in place by .rows' row views.
COPY_BELOW = 1 << 14


def _in_place(members: Sequence[tuple[Tensor, int]]) -> Optional[tuple[Tensor, list[Segment]]]:
    """The whole storage of ``members`` (fp32 views of one storage, none overlapping another)
    as a flat view, and each member's segment of it; None when they cannot be read so."""
    first = members[0][0]
    if len(members) < 2 or first.dtype != torch.float32:
        return None
    segments = sorted(
        (Segment(int(t.storage_offset()), t.numel(), slot) for t, slot in members),
        key=lambda s: s.offset,
    )
    if any(a.offset + a.numel > b.offset for a, b in zip(segments, segments[1:])):
        return None  # overlapping views (the same tensor twice): each summed on its own
    storage = first.untyped_storage()
    flat = first.detach().as_strided((storage.nbytes() // first.element_size(),), (1,), 0)
    return flat, segments


def _by_storage(tensors: Sequence[Tensor]) -> list[list[int]]:
    """The positions of ``tensors`` grouped by the storage they view, in first-seen order."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    return list(groups.values())


def split_packed(tensors: Sequence[Tensor]) -> tuple[list[int], list[int]]:
    """(the positions of what :class:`PackedSquares` reads, of the rest): contiguous tensors
    that share a storage with another (fp32) or are smaller than :data:`COPY_BELOW`; the rest
    are large tensors of their own, read in place by row views."""
    taken: list[int] = []
    rest: list[int] = []
    for members in _by_storage(tensors):
        if _in_place([(tensors[i], 0) for i in members]) is not None:
            taken += members
        else:
            for i in members:
                (taken if tensors[i].numel() < COPY_BELOW else rest).append(i)
    return sorted(taken), sorted(rest)


class PackedSquares:
    """Float64 sums of squares of contiguous tensors of one device and dtype, one slot each
    (several may share one), in a fixed handful of ops per :data:`PACK_NUMEL` copied elements
    (see the module docstring).

    Args:
        tensors: contiguous floating-point tensors (what :func:`split_packed` takes).
        slots: the slot each adds into.
        num_slots: the result's length.
        device: their device.
    """

    def __init__(
        self, tensors: Sequence[Tensor], slots: Sequence[int], num_slots: int, device: torch.device
    ) -> None:
        in_place: list[tuple[Tensor, list[Segment]]] = []
        copied: list[tuple[Tensor, int]] = []
        for positions in _by_storage(tensors):
            members = [(tensors[i].detach(), slots[i]) for i in positions]
            found = _in_place(members)
            if found is not None:
                in_place.append(found)
            else:
                copied += members
        self._views = [flat for flat, _ in in_place] + [t for t, _ in copied]
        packs = self._packs(copied)
        size = max((sum(p.numel() for p, _ in pack) for pack in packs), default=0)
        self._buffer = torch.empty(size, dtype=torch.float32, device=device)
        # (the pieces one torch.cat copies and where to, the read of what it filled); the
        # first read also takes the storages read in place.
        self._parts: list[tuple[list[Tensor], Tensor, SegmentedSquares]] = []
        for k, pack in enumerate(packs or [[]]):
            buffers = [flat for flat, _ in in_place] if k == 0 else []
            groups = [segs for _, segs in in_place] if k == 0 else []
            filled = self._buffer[: sum(p.numel() for p, _ in pack)]
            if pack:
                starts = [0]
                for piece, _ in pack:
                    starts.append(starts[-1] + piece.numel())
                buffers.append(filled)
                groups.append([Segment(a, p.numel(), s) for a, (p, s) in zip(starts, pack)])
            read = SegmentedSquares(buffers, groups, num_slots, device)
            self._parts.append(([p for p, _ in pack], filled, read))

    @staticmethod
    def _packs(copied: Sequence[tuple[Tensor, int]]) -> list[list[tuple[Tensor, int]]]:
        """The copied tensors as flat pieces, in packs of at most PACK_NUMEL elements (a tensor
        that does not fit the rest of a pack continues in the next)."""
        packs: list[list[tuple[Tensor, int]]] = []
        room = 0
        for t, slot in copied:
            flat, at = t.reshape(-1), 0
            while at < flat.numel():
                if room == 0:
                    packs.append([])
                    room = PACK_NUMEL
                take = min(room, flat.numel() - at)
                packs[-1].append((flat[at : at + take], slot))
                at, room = at + take, room - take
        return packs

    @property
    def kept_bytes(self) -> int:
        """What the plan keeps between calls: the pack buffer and the reads' own."""
        return self._buffer.numel() * 4 + sum(read.kept_bytes for _, _, read in self._parts)

    def views(self) -> Iterator[Tensor]:
        """Every tensor a call reads: the storages read in place (whole), the copied tensors."""
        yield from self._views

    def __call__(self) -> Tensor:
        """The sums of squares, ``[num_slots + 1]`` float64 (the last: no slot's)."""
        out: Optional[Tensor] = None
        for pieces, filled, read in self._parts:
            if pieces:
                torch.cat(pieces, out=filled)
            part = read()
            out = part if out is None else out.add_(part)
        assert out is not None  # one part at least
        return out
