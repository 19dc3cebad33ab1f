"""Per-slot sums of squares of segments of flat buffers, in a fixed number of ops per call:
:class:`SegmentedSquares`.

Megatron's DDP keeps every grad in a few flat buffers (per dtype, dense and expert), and the
``.grad`` of each fp32 main the optimizer steps is a view into one of them (the whole param, or
this rank's shard). Summing those views one by one costs a few ops per tensor; here the plan is
laid out once over the buffers, and a call is the same short list of ops for 100 or 10,000
segments. Every sum is of fp32 row norms over short rows (accurate on CPU, where a
whole-tensor norm is not, see :mod:`.rows`), squared and added into the slots in float64:

* each stretch of a buffer that holds segments (segments closer than :data:`MERGE_GAP` share
  one) is viewed in place as rows of :data:`ROW` elements: one row-norm op per stretch;
* the rows a segment boundary crosses (and a stretch's tail shorter than a row) are copied into
  one buffer (one ``index_select`` per stretch), viewed as fine rows of :data:`FINE` elements:
  one row-norm op for all of them; a stretch that boundaries cross in most rows (segments of a
  few hundred elements) is read in place as fine rows instead, with no copy;
* the fine rows a boundary crosses are copied once per segment piece they hold (one
  ``index_select`` per source of fine rows), masked to that piece and normed together;
* one ``index_add`` sends every row's float64 square to its segment's slot.

The same ops run on an accelerator: a fixed handful of launches per call, where the fused
multi-tensor norms of :mod:`.fused` (apex's / Transformer Engine's ``multi_tensor_l2norm``,
torch's foreach) launch once per chunk of a hundred-odd tensors and need the per-tensor views
listed; those stay for what has no flat buffer (the weights, the moments, grads that are no
view of one).

Rows that lie in no segment, or across a boundary, go to the last slot,
:attr:`SegmentedSquares.dropped` (padding, other ranks' shards, params not counted here), which no
reader looks at: a NaN there is harmless. Everything a call reads is made at build time (views,
index tensors, masks, the buffers it writes into), so a call makes nothing on the host and copies
nothing to the device.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from .indices import to_device

# Row length: each row norm accumulates this many fp32 squares (rows.VIEW_ROW: ~1.5e-7
# relative on bf16-valued data); a boundary row costs ROW fp32 elements of the kept buffer.
ROW = 1024

# Fine row length, inside the rows a boundary crosses (a divisor of ROW).
FINE = 32

# Segments of one buffer at most this many elements apart are summed as one stretch: reading
# the gap (into the dropped slot) is cheaper than more ops.
MERGE_GAP = 1 << 16


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements ``[offset, offset + numel)`` of a flat buffer, summed into ``slot``."""

    offset: int
    numel: int
    slot: int


def _end(s: Segment) -> int:
    return s.offset + s.numel


def _stretches(segments: Sequence[Segment]) -> list[list[Segment]]:
    """A buffer's segments (non-overlapping, any order) in stretches, by offset."""
    groups: list[list[Segment]] = []
    for s in sorted((s for s in segments if s.numel), key=lambda s: s.offset):
        if groups and s.offset - _end(groups[-1][-1]) <= MERGE_GAP:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


class _Slots:
    """Where each element of a stretch belongs: the slot of the segment holding it, or none."""

    def __init__(self, segments: Sequence[Segment], dropped: int) -> None:
        self._starts = [s.offset for s in segments]
        self._segments = segments
        self.dropped = dropped

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The segment parts in ``[lo, hi)``: (start, end, slot), in order."""
        k = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        out = []
        while k < len(self._segments) and self._segments[k].offset < hi:
            s = self._segments[k]
            start, end = max(s.offset, lo), min(_end(s), hi)
            if start < end:
                out.append((start, end, s.slot))
            k += 1
        return out

    def of(self, lo: int, hi: int) -> Optional[int]:
        """The slot of a row ``[lo, hi)``: its segment's when one holds it whole, ``dropped``
        when none touches it, None when a boundary crosses it."""
        found = self.pieces(lo, hi)
        if not found:
            return self.dropped
        start, end, slot = found[0]
        return slot if (start, end) == (lo, hi) else None


class _Fine:
    """The fine rows of one region read as rows of :data:`FINE`: each one's slot, and the
    pieces of those a boundary crosses (fine row, element range in it, slot)."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.pieces: list[tuple[int, tuple[int, int], int]] = []

    def add(self, start: int, numel: int, length: int, slots: _Slots) -> None:
        """Fine rows over ``[start, start + length)``, of which the first ``numel`` elements
        are the buffer's (the rest: a copied tail's zeros)."""
        for f in range(0, length, FINE):
            lo, hi = start + f, start + min(f + FINE, numel)
            slot = slots.of(lo, hi) if lo < hi else slots.dropped
            if slot is None:
                for a, b, piece_slot in slots.pieces(lo, hi):
                    self.pieces.append((len(self.slots), (a - lo, b - lo), piece_slot))
            self.slots.append(slots.dropped if slot is None else slot)


class _Plan:
    """The host side of a plan: which views are read as rows, which rows are copied, and the
    slot of every norm a call computes.

    A stretch whose rows a boundary mostly crosses (every param a few hundred elements) is read
    in place as fine rows: cheaper than copying most of it, and its fine rows' norms and slots
    (12 bytes per :data:`FINE` elements) are smaller than the copy would be.
    """

    def __init__(self, dropped: int) -> None:
        self.dropped = dropped
        self.reads: list[tuple[int, int, int, int]] = []  # (buffer, start, rows, row length)
        self.read_slots: list[int] = []  # one per row read, in reads order
        self.in_place: list[tuple[int, _Fine]] = []  # (its index in reads, its fine rows)
        self.copies: list[tuple[int, int, list[int]]] = []  # (buffer, start, rows copied)
        self.tails: list[tuple[int, int, int]] = []  # (buffer, start, numel): copied whole
        self._copied: list[tuple[int, int, _Slots]] = []  # (start, numel) of each copied row
        self._tails: list[tuple[int, int, _Slots]] = []
        self.copied = _Fine()  # the fine rows of the copied rows, in copy order

    def add(self, index: int, numel: int, segments: Sequence[Segment]) -> None:
        """Lay out one stretch of buffer ``index`` (of ``numel`` elements)."""
        slots = _Slots(segments, self.dropped)
        lo, hi = segments[0].offset, _end(segments[-1])
        rows = -(-(hi - lo) // ROW)
        if rows * ROW <= numel:
            start = min(lo, numel - rows * ROW)
        else:  # the buffer ends before a last whole row: rows from 0, the rest copied
            start, rows = 0, numel // ROW
        whole_end = start + rows * ROW
        row_slots = [slots.of(start + r * ROW, start + (r + 1) * ROW) for r in range(rows)]
        boundary = [r for r, slot in enumerate(row_slots) if slot is None]
        if rows and 2 * len(boundary) > rows:
            fine = _Fine()
            fine.add(start, rows * ROW, rows * ROW, slots)
            self.in_place.append((len(self.reads), fine))
            self.reads.append((index, start, rows * ROW // FINE, FINE))
            self.read_slots += fine.slots
        elif rows:
            self.reads.append((index, start, rows, ROW))
            self.read_slots += [self.dropped if slot is None else slot for slot in row_slots]
            if boundary:
                self.copies.append((index, start, boundary))
                self._copied += [(start + r * ROW, ROW, slots) for r in boundary]
        if hi > whole_end:
            self.tails.append((index, whole_end, hi - whole_end))
            self._tails.append((whole_end, hi - whole_end, slots))

    def finish(self) -> None:
        """The fine rows of every copied row, in copy order: the stretches' rows, then the
        tails (each padded with zeros to a whole row)."""
        for start, numel, slots in self._copied + self._tails:
            self.copied.add(start, numel, ROW, slots)


class SegmentedSquares:
    """Float64 sums of squares of segments of flat fp32 buffers, one slot per segment (several
    may share one), built once and called every step (see the module docstring).

    Args:
        buffers: 1-D contiguous fp32 views of whole buffers, all on one device; the plan keeps
            views of them, so it reads their values at each call.
        segments: the segments of each buffer (non-overlapping).
        num_slots: the slots segments add into; the result has one more, :attr:`dropped`.
        device: where the result lives (the buffers' device).
    """

    def __init__(
        self,
        buffers: Sequence[Tensor],
        segments: Sequence[Sequence[Segment]],
        num_slots: int,
        device: torch.device,
    ) -> None:
        self.dropped = num_slots
        plan = _Plan(num_slots)
        for index, (buffer, segs) in enumerate(zip(buffers, segments)):
            for stretch in _stretches(segs):
                plan.add(index, buffer.numel(), stretch)
        plan.finish()
        # Every norm a call computes, in one buffer: the rows read in place, the fine rows of
        # the copied rows, the pieces; and the slot of each, in the same order.
        sources = [fine for _, fine in plan.in_place] + [plan.copied]
        n_reads, n_copied = len(plan.read_slots), len(plan.copied.slots)
        pieces = [p for fine in sources for p in fine.pieces]
        self._zeros = torch.zeros(num_slots + 1, dtype=torch.float64, device=device)
        self._norms = torch.empty(
            n_reads + n_copied + len(pieces), dtype=torch.float32, device=device
        )
        self._slots = to_device(
            plan.read_slots + plan.copied.slots + [slot for _, _, slot in pieces],
            torch.long,
            device,
        )
        copied = torch.zeros(n_copied * FINE, dtype=torch.float32, device=device)
        self._copied = copied.view(-1, FINE)
        self._copied_norms = self._norms[n_reads : n_reads + n_copied]
        self._reads: list[tuple[Tensor, Tensor]] = []  # (rows in place, their norms)
        at = 0
        for index, start, rows, length in plan.reads:
            view = buffers[index][start : start + rows * length].view(rows, length)
            self._reads.append((view, self._norms[at : at + rows]))
            at += rows
        self._copies: list[tuple[Tensor, Tensor, Tensor]] = []  # (rows, which, into)
        self._tails: list[tuple[Tensor, Tensor]] = []  # (elements, into)
        at = 0
        for index, start, boundary in plan.copies:
            source = buffers[index][start : start + (boundary[-1] + 1) * ROW].view(-1, ROW)
            into = copied[at : at + len(boundary) * ROW].view(-1, ROW)
            self._copies.append((source, to_device(boundary, torch.long, device), into))
            at += len(boundary) * ROW
        for index, start, numel in plan.tails:
            self._tails.append((buffers[index][start : start + numel], copied[at : at + numel]))
            at += ROW  # the rest of the row stays zero
        # Pieces: each a copy of its fine row (one index_select per source of fine rows),
        # masked to its elements, then normed together.
        self._piece_reads: list[tuple[Tensor, Tensor, Tensor]] = []  # (fine rows, which, into)
        self._pieces: Optional[tuple[Tensor, Tensor, Tensor]] = None
        if pieces:
            into = torch.empty(len(pieces), FINE, dtype=torch.float32, device=device)
            fine_views = [self._reads[i][0] for i, _ in plan.in_place] + [self._copied]
            at = 0
            for view, fine in zip(fine_views, sources):
                if fine.pieces:
                    which = to_device([row for row, _, _ in fine.pieces], torch.long, device)
                    n = len(fine.pieces)
                    self._piece_reads.append((view, which, into[at : at + n]))
                    at += n
            mask = torch.zeros(len(pieces), FINE)
            for k, (_, (a, b), _) in enumerate(pieces):
                mask[k, a:b] = 1
            mask = to_device(mask.view(-1).tolist(), torch.float32, device).view(-1, FINE)
            self._pieces = (into, mask, self._norms[n_reads + n_copied :])

    @property
    def kept_bytes(self) -> int:
        """The memory the plan keeps between calls (norms, slots, copied rows, pieces)."""
        pieces = 0 if self._pieces is None else self._pieces[0].numel() * 8
        return self._norms.numel() * 12 + self._copied.numel() * 4 + pieces

    def __call__(self) -> Tensor:
        """The sums of squares, ``[num_slots + 1]`` float64 (the last: :attr:`dropped`)."""
        for rows, place in self._reads:
            torch.linalg.vector_norm(rows, dim=1, out=place)
        for rows, which, into in self._copies:
            torch.index_select(rows, 0, which, out=into)
        for elements, into in self._tails:
            into.copy_(elements)
        if self._copied.numel():
            torch.linalg.vector_norm(self._copied, dim=1, out=self._copied_norms)
        for rows, which, into in self._piece_reads:
            torch.index_select(rows, 0, which, out=into)
        if self._pieces is not None:
            into, mask, place = self._pieces
            torch.linalg.vector_norm(into.mul_(mask), dim=1, out=place)
        squares = self._norms.double().square_()
        return torch.index_add(self._zeros, 0, self._slots, squares)
