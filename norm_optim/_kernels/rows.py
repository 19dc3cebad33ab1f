"""CPU sums of squares through short fp32 row norms: accurate, and as fast as the inaccurate
whole-tensor call.

On CPU, ``torch._foreach_norm`` (and ``vector_norm``, ``dot``) of one large tensor accumulates
sequentially in fp32 lanes: its error grows with the tensor (≈2e-2 relative at 10**8 elements
holding bf16 values). Row norms of a 2-D view, ``vector_norm(t.view(-1, 1024), dim=1)``, sum
only a row each, use every core, and cost about the same; their squares are summed in float64.
Small tensors are copied (bf16/fp16: cast; remainder masters: decoded) in bounded blocks into
one scratch buffer and reduced the same way, so their cost is a few ops per 256 KiB block
instead of ~2 µs per tensor. The measurements behind each constant are in
``benchmarks/README.md`` (kernel design), where they can be re-run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, cast

import torch
from torch import Tensor

from .indices import DeviceIndices
from .packed import PackedSquares, split_packed
from .remainders import RemainderMaster, Summand, flat_slice

# Row length of packed blocks: each row accumulates this many terms in fp32; shorter is more
# accurate at the same speed (rows of 256 give ~2e-8 relative error on bf16-valued data).
ROW = 256

# Row length of the in-place views of large fp32 tensors: longer rows mean fewer rows to reduce
# (faster on one thread), at ~1.5e-7 relative error, well inside 1e-6.
VIEW_ROW = 1024

# Elements of the per-call fp32 scratch buffer small tensors are packed into (256 KiB): it bounds
# the per-call temporaries.
BLOCK_NUMEL = 1 << 16

# Rows of the per-call row-norm buffer, flushed to the slots when full (96 KiB of fp32 norms and
# their float64 squares): bounds peak memory without costing speed. A multiple of
# BLOCK_NUMEL // ROW.
FLUSH_ROWS = 1 << 13

# Contiguous fp32 tensors with at least this many elements are reduced in place through row
# views; smaller ones are packed (a copy, but a few ops per block however many tensors it holds).
PACK_BELOW = 1 << 14


def split_bounded(t: Tensor, max_numel: int) -> list[Tensor]:
    """Split ``t`` (any strides) into views of at most ``max_numel`` elements, along leading dims.

    Used for non-contiguous tensors, which cannot be flattened into a view.
    """
    if t.numel() <= max_numel or t.dim() == 0:
        return [t]
    if t.dim() == 1:
        return list(t.split(max_numel))
    per_index = t[0].numel()
    if per_index <= max_numel:
        return list(t.split(max_numel // per_index))
    return [piece for sub in t.unbind(0) for piece in split_bounded(sub, max_numel)]


@dataclass(frozen=True)
class _PackedBlock:
    """Views copied back to back, each padded with zeros to whole rows, into the scratch buffer."""

    pieces: tuple[Summand, ...]
    numel: int  # a multiple of ROW, at most BLOCK_NUMEL
    decodes: bool  # whether a piece is a RemainderMaster (else one ``torch.cat`` fills the block)

    def fill(self, scratch: Tensor) -> Tensor:
        """Copy (bf16/fp16: cast; remainder masters: decode) the pieces into ``scratch``.

        Returns:
            The filled part of ``scratch`` as a ``(rows, ROW)`` view.
        """
        packed = scratch[: self.numel]
        if not self.decodes:  # every piece is a tensor: one op for the block
            torch.cat(cast("tuple[Tensor, ...]", self.pieces), out=packed)
        else:
            for piece, out in zip(self.pieces, packed.split([p.numel() for p in self.pieces])):
                if isinstance(piece, RemainderMaster):
                    piece.decode_into(out)
                else:
                    out.copy_(piece)
        return packed.view(-1, ROW)


@dataclass(frozen=True)
class _Flush:
    """Items whose row norms fill (part of) the per-call row buffer, then go to their slots at once.

    Rows are written in item order; the slots they feed are stored run-length encoded (consecutive
    rows of one tensor share a slot), so no per-row index is kept alive between calls.
    """

    items: tuple[Tensor | _PackedBlock, ...]  # (rows, VIEW_ROW) views, or blocks to pack
    item_rows: tuple[int, ...]
    run_slots: Tensor  # int64 [runs]
    run_rows: Tensor  # int64 [runs]

    @property
    def num_rows(self) -> int:
        return sum(self.item_rows)


class _FlushBuilder:
    """Lays out row views and packed blocks into flushes of at most FLUSH_ROWS rows, once."""

    def __init__(self, device: torch.device, indices: DeviceIndices) -> None:
        self._device, self._indices = device, indices
        self._zeros = torch.zeros(ROW, dtype=torch.float32, device=device)  # pads are views of it
        self.flushes: list[_Flush] = []
        self._items: list[Tensor | _PackedBlock] = []
        self._item_rows: list[int] = []
        self._runs: list[list[int]] = []  # [slot, rows]
        self._pieces: list[Summand] = []  # block being packed
        self._fill = 0

    def _add_rows(self, slot: int, rows: int) -> None:
        if self._runs and self._runs[-1][0] == slot:
            self._runs[-1][1] += rows
        else:
            self._runs.append([slot, rows])

    def _add_item(self, item: Tensor | _PackedBlock, rows: int) -> None:
        if sum(self._item_rows) + rows > FLUSH_ROWS:
            self._close_flush()
        self._items.append(item)
        self._item_rows.append(rows)

    def add_view(self, rows_view: Tensor, slot: int) -> None:
        """Append a ``(rows, VIEW_ROW)`` view of at most FLUSH_ROWS rows, reduced in place."""
        self._close_block()  # keep rows in item order: a pending block goes first
        self._add_item(rows_view, rows_view.shape[0])
        self._add_rows(slot, rows_view.shape[0])

    def add_packed(self, flat: Summand, slot: int) -> None:
        """Append a 1-D contiguous view (any floating dtype) or a remainder master, to be packed
        (cast, decoded) into the scratch buffer."""
        offset, n = 0, flat.numel()
        while offset < n:
            if not self._pieces and sum(self._item_rows) + BLOCK_NUMEL // ROW > FLUSH_ROWS:
                self._close_flush()  # a new block must fit, whole, in the current flush
            take = min(n - offset, BLOCK_NUMEL - self._fill)
            self._pieces.append(flat_slice(flat, offset, offset + take))
            offset += take
            start_rows = self._fill // ROW
            self._fill += take
            if offset == n and self._fill % ROW:
                # Pad the last row with zeros so that no row mixes two tensors (two slots).
                pad = ROW - self._fill % ROW
                self._pieces.append(self._zeros[:pad])
                self._fill += pad
            self._add_rows(slot, self._fill // ROW - start_rows)
            if self._fill == BLOCK_NUMEL:
                self._close_block()

    def _close_block(self) -> None:
        if self._pieces:
            # The runs of this block were already recorded; its item must land in the same flush.
            rows = self._fill // ROW
            decodes = any(isinstance(p, RemainderMaster) for p in self._pieces)
            self._items.append(_PackedBlock(tuple(self._pieces), self._fill, decodes))
            self._item_rows.append(rows)
            self._pieces, self._fill = [], 0
            if sum(self._item_rows) == FLUSH_ROWS:
                self._close_flush()

    def _close_flush(self) -> None:
        if self._items:
            self.flushes.append(
                _Flush(
                    tuple(self._items),
                    tuple(self._item_rows),
                    self._indices([slot for slot, _ in self._runs], self._device),
                    self._indices([rows for _, rows in self._runs], self._device),
                )
            )
        self._items, self._item_rows, self._runs = [], [], []

    def finish(self) -> list[_Flush]:
        self._close_block()
        self._close_flush()
        return self.flushes


class RowNormGroup:
    """Tensors of one floating dtype reduced through fp32 row norms (see the module docstring).

    Used for CPU tensors (fp32, bf16, fp16) and, on every device, for remainder masters:

    * contiguous fp32 tensors of ``PACK_BELOW`` elements or more: in place, as
      ``(rows, VIEW_ROW)`` views; the leftover (< ``VIEW_ROW`` elements) is packed;
    * other contiguous tensors (small fp32, any bf16/fp16) and remainder masters: packed into the
      scratch buffer, which also casts bf16/fp16 and decodes remainder masters to fp32 one bounded
      block at a time;
    * non-contiguous tensors (rare): bounded pieces, one ``_foreach_norm`` in float64 (the upcast
      copy is per piece, so bounded).

    Row norms go to a row buffer of ``FLUSH_ROWS`` floats; each time it is full their squares are
    added to the slots in float64 with one ``index_add_``.

    Given ``num_slots`` (a plan built once and called often), the small contiguous tensors, and
    fp32 views of a shared storage, are read instead by one
    :class:`~.packed.PackedSquares`: a fixed handful of ops whatever their number.
    """

    def __init__(
        self,
        tensors: Sequence[Summand],
        slots: Sequence[int],
        device: torch.device,
        indices: DeviceIndices,
        num_slots: Optional[int] = None,
    ) -> None:
        self._device = device
        decodes = any(isinstance(t, RemainderMaster) for t in tensors)
        self.backend = f"{device.type} row norms" + (" of decoded remainders" if decodes else "")
        self._packed: Optional[PackedSquares] = None
        if num_slots is not None:
            plain = [
                i
                for i, t in enumerate(tensors)
                if not isinstance(t, RemainderMaster) and t.is_contiguous()
            ]
            taken, _ = split_packed([cast(Tensor, tensors[i]) for i in plain])
            if taken:
                packed = {plain[k] for k in taken}
                self._packed = PackedSquares(
                    [cast(Tensor, tensors[i]) for i in sorted(packed)],
                    [slots[i] for i in sorted(packed)],
                    num_slots,
                    device,
                )
                left = [i for i in range(len(tensors)) if i not in packed]
                tensors, slots = [tensors[i] for i in left], [slots[i] for i in left]
        self._strided: list[Tensor] = []
        strided_slots: list[int] = []
        builder = _FlushBuilder(device, indices)
        # Views first, packed pieces after: interleaving them would close a half-filled block at
        # every view (one copy and one reduction per small tensor instead of per 256 KiB).
        to_pack: list[tuple[Summand, int]] = []
        for t, slot in zip(tensors, slots):
            if isinstance(t, RemainderMaster):
                to_pack.append((t, slot))
                continue
            if not t.is_contiguous():
                pieces = split_bounded(t, BLOCK_NUMEL)
                self._strided.extend(pieces)
                strided_slots.extend([slot] * len(pieces))
                continue
            flat = t.view(-1)
            if t.dtype == torch.float32 and flat.numel() >= PACK_BELOW:
                whole_rows = flat.numel() - flat.numel() % VIEW_ROW
                for view in flat[:whole_rows].view(-1, VIEW_ROW).split(FLUSH_ROWS):
                    builder.add_view(view, slot)
                flat = flat[whole_rows:]
            if flat.numel():
                to_pack.append((flat, slot))
        for piece, slot in to_pack:
            builder.add_packed(piece, slot)
        self._flushes = builder.finish()
        self._has_packed = any(isinstance(i, _PackedBlock) for f in self._flushes for i in f.items)
        self._strided_slots = indices(strided_slots, device)

    def views(self) -> Iterator[Summand]:
        """Every tensor a call reads: row views, packed pieces (zero pads included), strided pieces."""
        for flush in self._flushes:
            for item in flush.items:
                yield from item.pieces if isinstance(item, _PackedBlock) else (item,)
        yield from self._strided
        if self._packed is not None:
            yield from self._packed.views()

    @property
    def scratch_bytes(self) -> int:
        """Upper bound of the temporaries one call allocates (beyond per-op scalars)."""
        packed = BLOCK_NUMEL * 4 if self._has_packed else 0
        # row norms (fp32) and their float64 squares
        rows = max((f.num_rows for f in self._flushes), default=0) * (4 + 8)
        strided = max((p.numel() * 8 for p in self._strided), default=0)
        return packed + max(rows, strided)

    @property
    def kept_bytes(self) -> int:
        """What the group keeps between calls beyond its index tensors (the packed read's)."""
        return 0 if self._packed is None else self._packed.kept_bytes

    def __call__(self, acc: Tensor) -> None:
        if self._packed is not None:
            acc += self._packed()[:-1]
        if self._flushes:
            row_buffer = torch.empty(FLUSH_ROWS, dtype=torch.float32, device=self._device)
            scratch = torch.empty(0, dtype=torch.float32, device=self._device)
            if self._has_packed:
                scratch = torch.empty(BLOCK_NUMEL, dtype=torch.float32, device=self._device)
            for flush in self._flushes:
                num_rows = flush.num_rows
                row_norms = row_buffer[:num_rows]
                for item, out in zip(flush.items, row_norms.split(flush.item_rows)):
                    rows = item.fill(scratch) if isinstance(item, _PackedBlock) else item
                    torch.linalg.vector_norm(rows, dim=1, out=out)
                # Per-run sums of squares in float64 (a run: consecutive rows of one slot), then
                # one scatter of the few run sums; cheaper than a per-row slot index.
                squares = row_norms.double().square_()
                # unsafe=True: the lengths were built with the plan and always sum to num_rows;
                # validating them would read a device value back (a host sync on CUDA).
                run_sums = torch.segment_reduce(squares, "sum", lengths=flush.run_rows, unsafe=True)
                acc.index_add_(0, flush.run_slots, run_sums)
        if self._strided:
            norms = torch._foreach_norm(self._strided, 2, dtype=torch.float64)
            acc.index_add_(0, self._strided_slots, torch.stack(norms).square_())
