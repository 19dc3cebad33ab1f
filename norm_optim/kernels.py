"""Accurate, bounded-memory sums of squares over a fixed list of tensors.

:class:`SumOfSquaresPlan` is built once from the tensors whose norms are wanted (fp32 main params,
fp32 shards, bf16/fp16 params with no fp32 copy) and is then called every step. Each call returns one
float64 sum of squares per *slot* (total, dense/expert split, per-parameter norms, ...), with one
fused reduction per (device, dtype) group where the device allows it.

Why not just ``torch._foreach_norm``? On CPU its reduction of one tensor accumulates sequentially in
fp32 lanes: a 10**8-element fp32 tensor holding bf16-representable values (every fp32 main param
starts as one) comes out 2e-2 off, 64k-element ones 8e-6 off. Row norms of a 2-D view,
``vector_norm(t.view(-1, 1024), dim=1)``, accumulate only 1024 terms each, use every core, and
cost about the same as the whole-tensor call (1.09x on one thread, less on two); summing their
squares in float64 gives ~1.5e-7 (rows of 256, used for packed blocks: ~2e-8). Small tensors
are copied (bf16/fp16: cast) in bounded blocks into one scratch buffer and reduced the same way,
so their cost is a few ops per 256 KiB block instead of ~2 us per tensor. On CUDA the reductions are
tree-shaped and accurate, so whole tensors go to one fused multi-tensor kernel (apex, Transformer
Engine, or ``torch._foreach_norm``).

Transformer Engine's precision-aware Adam may keep an fp32 master as the bf16 param plus an int16
remainder (:class:`RemainderMaster`). No kernel reads that pair, and decoding whole tensors would
be the fp32 copy this module exists to avoid, so such masters are decoded into the same bounded
scratch blocks that small tensors are packed into, and reduced through the same row norms, on
every device.

Measured on the development machine (2 cores, torch 2.13.0+cpu; fp32 tensors holding bf16 values;
max relative error per slot vs float64, one slot per tensor; times are the best of 5 calls, taken
while the load was low: other jobs shared the 2 cores, so later runs under load 4-17 came out
1.5-3x slower for every strategy, the multi-op ones most, and are not quoted):

=============================  ===================  =================  ================
strategy                       5000 x 4k..64k       6 x 1.7e7          1 x 1e8
=============================  ===================  =================  ================
``_foreach_norm`` (floor)      77 ms / 7.7e-6       33 ms / 8.0e-4     26 ms / 2.2e-2
``_foreach_norm(dtype=f64)``   129 ms / 5e-16       224 ms / 8e-14     (full f64 copy)
``_foreach_norm`` on 2^15 views 79 ms / 4.8e-6      43 ms / 3.8e-6     39 ms / 3.8e-6
``_foreach_norm`` on 2^12 views 151 ms / 1.2e-6     76 ms / 9.7e-7     81 ms / 9.7e-7
mul into 1 MiB + sum(f64)      141 ms / 0           59 ms / 4e-16      --
row norms, rows of 1024        97 ms / 2.3e-7       19 ms / 1.5e-7     17 ms / 1.5e-7
row norms, rows of 4096        101 ms / 1.2e-6      19 ms / 9.7e-7     15 ms / 9.7e-7
row norms, rows of 256         (per-tensor ops)     19 ms / 2.3e-8     16 ms / 2.3e-8
packed 1 MiB blocks, rows 256  101 ms / 6.9e-8      --                 --
this plan (_PACK_BELOW=2^14)   101 ms / 6.9e-8      = rows of 256      = rows of 256
=============================  ===================  =================  ================
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Union

import torch
from torch import Tensor

__all__ = ["RemainderMaster", "SumOfSquaresPlan", "Summand"]

# Row length of the 2-D views reduced with ``vector_norm(dim=1)`` on CPU. Each row accumulates this
# many terms in fp32, so shorter rows are more accurate; measured on bf16-valued fp32 data: rows of
# 256 -> 2.3e-8, 1024 -> 1.5e-7, 4096 -> 9.7e-7 relative error, all at the same speed (16-19 ms for
# 10**8 elements, vs 26 ms for the inaccurate whole-tensor ``_foreach_norm``).
_ROW = 256

# Row length of the in-place views of large fp32 tensors. Longer rows mean fewer rows to reduce:
# on one thread, 20 tensors of 4M elements took 1.15x the inaccurate whole-tensor
# ``_foreach_norm`` with rows of 256 and 1.09x with rows of 1024 (3,000 tensors of 4k..64k:
# 1.61x -> 1.54x), at 1.5e-7 relative error instead of 2e-8 -- still well inside 1e-6. Packed
# blocks keep rows of ``_ROW``: there every row of padding is a copy.
_VIEW_ROW = 1024

# Elements of the per-call fp32 scratch buffer into which small tensors (and bf16/fp16 tensors, cast)
# are packed: 2**16 floats = 256 KiB. It bounds the per-call temporaries.
_BLOCK_NUMEL = 1 << 16

# Rows of the per-call row-norm buffer: each time it is full, the squares of its row norms are added
# to the slots (fp32 rows + their float64 squares: 96 KiB at 2**13 rows, i.e. one flush per 8M
# elements of in-place views). Must be a multiple of _BLOCK_NUMEL // _ROW.
# Peak RSS of one call (76 tensors of 4.2M elements + 20 small ones, one thread) with
# (flush rows, block) = (2**14, 2**17): 828 KiB; (2**13, 2**16): 424 KiB, at the same speed
# (143.9 vs 142.7 ms); the benchmark's 3.2e8-element case had reached 1.1 MiB with the former.
# On 5,000 tensors of 4k elements the smaller block costs 0.98x -> 1.07x the floor, on a mix of
# 16k and 64-element tensors it gains (1.23x -> 1.17x).
_FLUSH_ROWS = 1 << 13

# Contiguous CPU fp32 tensors with at least this many elements are reduced in place through row
# views (one op per 8.4M elements plus ~2 small ones); smaller ones are packed into the scratch
# buffer, which costs a copy but only ~5 ops per 256 KiB block however many tensors it holds.
# Measured on 5000 fp32 tensors of 4k..64k elements (floor: one ``_foreach_norm`` over all 5000,
# 81 ms, 7.7e-6 off); plan with this threshold at 2**12: 100 ms, 2**14: 101 ms, 2**16: 117 ms,
# everything packed: 114 ms; 6.9e-8 off in every case. Single-threaded, packing more (2**16) won.
_PACK_BELOW = 1 << 14

# Largest piece handed to a CUDA multi-tensor kernel: a cautious bound that keeps every element count
# well inside 32 bits, whatever the kernel's internal indexing.
_CUDA_MAX_PIECE = 1 << 30

_LOW_PRECISION = (torch.bfloat16, torch.float16)

# Which int16 half of an int32 holds its high 16 bits (CPUs and GPUs in use are little-endian).
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


@dataclass(frozen=True)
class RemainderMaster:
    """An fp32 master tensor kept as Transformer Engine keeps it with ``store_param_remainders``.

    TE's FusedAdam (megatron's precision-aware optimizer, TE >= 2.1) saves 2 bytes per element by
    storing only the low 16 bits of each fp32 master in its state; the high 16 bits, rounded to
    nearest (plus one when the low half's top bit is set), *are* the bf16 param. This object pairs
    the two views and decodes the exact fp32 values on demand, a bounded block at a time; it owns no
    storage and copies nothing, so in-place updates of either tensor are seen. Its ``dtype`` is the
    logical one, fp32; its storage is that of the two tensors (the optimizer's remainder state
    and the model's bf16 shard), which is where staleness is tracked.

    Attributes:
        param: bf16, contiguous: the rounded high halves (the model param or its shard).
        remainder: int16, contiguous, same shape and device: the low halves.
    """

    param: Tensor
    remainder: Tensor
    dtype: ClassVar[torch.dtype] = torch.float32

    def __post_init__(self) -> None:
        if self.param.dtype != torch.bfloat16 or self.remainder.dtype != torch.int16:
            raise TypeError(
                f"a RemainderMaster pairs a bfloat16 param with an int16 remainder, got "
                f"{self.param.dtype} and {self.remainder.dtype}"
            )
        if self.param.shape != self.remainder.shape or self.param.device != self.remainder.device:
            raise ValueError(
                f"param and remainder must match: {tuple(self.param.shape)} on {self.param.device} "
                f"vs {tuple(self.remainder.shape)} on {self.remainder.device}"
            )
        if not (self.param.is_contiguous() and self.remainder.is_contiguous()):
            raise ValueError("param and remainder must be contiguous (as TE's kernels need them)")

    @property
    def shape(self) -> torch.Size:
        return self.param.shape

    @property
    def device(self) -> torch.device:
        return self.param.device

    def numel(self) -> int:
        return self.param.numel()

    def element_size(self) -> int:
        """Bytes read per element: 2 of param, 2 of remainder."""
        return 4

    def flat_slice(self, start: int, end: int) -> "RemainderMaster":
        """Elements ``[start, end)`` of the flattened master, as views of the same storage."""
        return RemainderMaster(self.param.view(-1)[start:end], self.remainder.view(-1)[start:end])

    def decode_into(self, out: Tensor) -> Tensor:
        """Write the exact fp32 master values into ``out`` (contiguous fp32, ``numel()`` elements).

        TE's decoding is ``bits = ((param_bits - (remainder < 0)) << 16) | (remainder & 0xFFFF)``.
        Copying the remainders into ``out``'s int32 view sign-extends them: the low halves become
        the remainders and the high halves ``-(remainder < 0)``; adding the param bits to the
        high halves (int16, wrapping as TE's does) completes it. Two ops, no temporaries (a
        mixed int16/int32 op would allocate a converted copy on CPU).
        """
        bits = out.view(torch.int32).view(-1)
        bits.copy_(self.remainder.view(-1))
        bits.view(torch.int16)[_HIGH_HALF::2].add_(self.param.view(-1).view(torch.int16))
        return out


Summand = Union[Tensor, RemainderMaster]
"""What a :class:`SumOfSquaresPlan` sums: a floating-point tensor or a :class:`RemainderMaster`."""


def _flat_slice(t: Summand, start: int, end: int) -> Summand:
    if isinstance(t, RemainderMaster):
        return t.flat_slice(start, end)
    return t.view(-1)[start:end]


def _split_bounded(t: Tensor, max_numel: int) -> list[Tensor]:
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
    return [piece for sub in t.unbind(0) for piece in _split_bounded(sub, max_numel)]


@dataclass(frozen=True)
class _PackedBlock:
    """Views copied back to back, each padded with zeros to whole rows, into the scratch buffer."""

    pieces: tuple[Summand, ...]
    numel: int  # a multiple of _ROW, at most _BLOCK_NUMEL
    decodes: bool  # whether a piece is a RemainderMaster (else one ``torch.cat`` fills the block)

    def fill(self, scratch: Tensor) -> Tensor:
        """Copy (bf16/fp16: cast; remainder masters: decode) the pieces into ``scratch``.

        Returns:
            The filled part of ``scratch`` as a ``(rows, _ROW)`` view.
        """
        packed = scratch[: self.numel]
        if not self.decodes:
            torch.cat(self.pieces, out=packed)  # type: ignore[arg-type]  # one op for the block
        else:
            for piece, out in zip(self.pieces, packed.split([p.numel() for p in self.pieces])):
                if isinstance(piece, RemainderMaster):
                    piece.decode_into(out)
                else:
                    out.copy_(piece)
        return packed.view(-1, _ROW)


@dataclass(frozen=True)
class _Flush:
    """Items whose row norms fill (part of) the per-call row buffer, then go to their slots at once.

    Rows are written in item order; the slots they feed are stored run-length encoded (consecutive
    rows of one tensor share a slot), so no per-row index is kept alive between calls.
    """

    items: tuple[Tensor | _PackedBlock, ...]  # (rows, _VIEW_ROW) views, or blocks to pack
    item_rows: tuple[int, ...]
    run_slots: Tensor  # int64 [runs]
    run_rows: Tensor  # int64 [runs]

    @property
    def num_rows(self) -> int:
        return sum(self.item_rows)


class _FlushBuilder:
    """Lays out row views and packed blocks into flushes of at most _FLUSH_ROWS rows, once."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._zeros = torch.zeros(_ROW, dtype=torch.float32, device=device)  # pads are views of it
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
        if sum(self._item_rows) + rows > _FLUSH_ROWS:
            self._close_flush()
        self._items.append(item)
        self._item_rows.append(rows)

    def add_view(self, rows_view: Tensor, slot: int) -> None:
        """Append a ``(rows, _VIEW_ROW)`` view of at most _FLUSH_ROWS rows, reduced in place."""
        self._close_block()  # keep rows in item order: a pending block goes first
        self._add_item(rows_view, rows_view.shape[0])
        self._add_rows(slot, rows_view.shape[0])

    def add_packed(self, flat: Summand, slot: int) -> None:
        """Append a 1-D contiguous view (any floating dtype) or a remainder master, to be packed
        (cast, decoded) into the scratch buffer."""
        offset, n = 0, flat.numel()
        while offset < n:
            if not self._pieces and sum(self._item_rows) + _BLOCK_NUMEL // _ROW > _FLUSH_ROWS:
                self._close_flush()  # a new block must fit, whole, in the current flush
            take = min(n - offset, _BLOCK_NUMEL - self._fill)
            self._pieces.append(_flat_slice(flat, offset, offset + take))
            offset += take
            start_rows = self._fill // _ROW
            self._fill += take
            if offset == n and self._fill % _ROW:
                # Pad the last row with zeros so that no row mixes two tensors (two slots).
                pad = _ROW - self._fill % _ROW
                self._pieces.append(self._zeros[:pad])
                self._fill += pad
            self._add_rows(slot, self._fill // _ROW - start_rows)
            if self._fill == _BLOCK_NUMEL:
                self._close_block()

    def _close_block(self) -> None:
        if self._pieces:
            # The runs of this block were already recorded; its item must land in the same flush.
            rows = self._fill // _ROW
            decodes = any(isinstance(p, RemainderMaster) for p in self._pieces)
            self._items.append(_PackedBlock(tuple(self._pieces), self._fill, decodes))
            self._item_rows.append(rows)
            self._pieces, self._fill = [], 0
            if sum(self._item_rows) == _FLUSH_ROWS:
                self._close_flush()

    def _close_flush(self) -> None:
        if self._items:
            runs = torch.tensor(self._runs, dtype=torch.long, device=self._device).reshape(-1, 2)
            self.flushes.append(
                _Flush(tuple(self._items), tuple(self._item_rows), runs[:, 0].clone(), runs[:, 1].clone())
            )
        self._items, self._item_rows, self._runs = [], [], []

    def finish(self) -> list[_Flush]:
        self._close_block()
        self._close_flush()
        return self.flushes


class _RowNormGroup:
    """Tensors of one floating dtype reduced through fp32 row norms (see the module docstring).

    Used for CPU tensors (fp32, bf16, fp16) and, on every device, for remainder masters:

    * contiguous fp32 tensors of ``_PACK_BELOW`` elements or more: in place, as
      ``(rows, _VIEW_ROW)`` views; the leftover (< ``_VIEW_ROW`` elements) is packed;
    * other contiguous tensors (small fp32, any bf16/fp16) and remainder masters: packed into the
      scratch buffer, which also casts bf16/fp16 and decodes remainder masters to fp32 one bounded
      block at a time;
    * non-contiguous tensors (rare): bounded pieces, one ``_foreach_norm`` in float64 (the upcast
      copy is per piece, so bounded).

    Row norms go to a row buffer of ``_FLUSH_ROWS`` floats; each time it is full their squares are
    added to the slots in float64 with one ``index_add_``.
    """

    def __init__(self, tensors: Sequence[Summand], slots: Sequence[int], device: torch.device) -> None:
        self._device = device
        decodes = any(isinstance(t, RemainderMaster) for t in tensors)
        self.backend = f"{device.type} row norms" + (" of decoded remainders" if decodes else "")
        self._strided: list[Tensor] = []
        strided_slots: list[int] = []
        builder = _FlushBuilder(device)
        # Views first, packed pieces after: interleaving them would close a half-filled block at
        # every view (one copy and one reduction per small tensor instead of per 256 KiB).
        to_pack: list[tuple[Summand, int]] = []
        for t, slot in zip(tensors, slots):
            if isinstance(t, RemainderMaster):
                to_pack.append((t, slot))
                continue
            if not t.is_contiguous():
                pieces = _split_bounded(t, _BLOCK_NUMEL)
                self._strided.extend(pieces)
                strided_slots.extend([slot] * len(pieces))
                continue
            flat = t.view(-1)
            if t.dtype == torch.float32 and flat.numel() >= _PACK_BELOW:
                whole_rows = flat.numel() - flat.numel() % _VIEW_ROW
                for view in flat[:whole_rows].view(-1, _VIEW_ROW).split(_FLUSH_ROWS):
                    builder.add_view(view, slot)
                flat = flat[whole_rows:]
            if flat.numel():
                to_pack.append((flat, slot))
        for piece, slot in to_pack:
            builder.add_packed(piece, slot)
        self._flushes = builder.finish()
        self._has_packed = any(isinstance(i, _PackedBlock) for f in self._flushes for i in f.items)
        self._strided_slots = torch.tensor(strided_slots, dtype=torch.long, device=device)

    @property
    def scratch_bytes(self) -> int:
        """Upper bound of the temporaries one call allocates (beyond per-op scalars)."""
        packed = _BLOCK_NUMEL * 4 if self._has_packed else 0
        # row norms (fp32) and their float64 squares
        rows = max((f.num_rows for f in self._flushes), default=0) * (4 + 8)
        strided = max((p.numel() * 8 for p in self._strided), default=0)
        return packed + max(rows, strided)

    def __call__(self, acc: Tensor) -> None:
        if self._flushes:
            row_buffer = torch.empty(_FLUSH_ROWS, dtype=torch.float32, device=self._device)
            scratch = torch.empty(0, dtype=torch.float32, device=self._device)
            if self._has_packed:
                scratch = torch.empty(_BLOCK_NUMEL, dtype=torch.float32, device=self._device)
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
                run_sums = torch.segment_reduce(
                    squares, "sum", lengths=flush.run_rows, unsafe=True
                )
                acc.index_add_(0, flush.run_slots, run_sums)
        if self._strided:
            norms = torch._foreach_norm(self._strided, 2, dtype=torch.float64)
            acc.index_add_(0, self._strided_slots, torch.stack(norms).square_())


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torch_l2norm(tensors: list[Tensor]) -> Tensor:
    # On CUDA the fused foreach kernel reduces in fp32 with a tree; for bf16/fp16 inputs it is
    # given bounded views (see _FusedGroup), so even a copying fallback stays bounded.
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=_accumulate_dtype(tensors[0].dtype)))


def _multi_tensor_l2norm(device: torch.device) -> tuple[str, Callable[[list[Tensor]], Tensor]]:
    """Pick the fused per-tensor L2 norm for ``device``: apex, then Transformer Engine, then torch.

    Returns:
        The backend's name (for reporting) and a function mapping a list of tensors of one dtype
        to their fp32 norms, shape ``[len(tensors)]``, with no host synchronization.
    """
    if device.type == "cuda":
        applier = l2norm = None
        name = ""
        try:
            import amp_C  # type: ignore[import-not-found]
            from apex.multi_tensor_apply import multi_tensor_applier  # type: ignore

            applier, l2norm, name = multi_tensor_applier, amp_C.multi_tensor_l2norm, "apex"
        except ImportError:
            try:
                from transformer_engine.pytorch.optimizers import (  # type: ignore
                    multi_tensor_applier,
                    multi_tensor_l2norm,
                )

                applier, l2norm, name = multi_tensor_applier, multi_tensor_l2norm, "transformer_engine"
            except ImportError:
                pass
        if applier is not None:
            # The kernels skip all work when this flag is set; nothing here ever sets it.
            noop_flag = torch.zeros(1, dtype=torch.int, device=device)

            def fused(tensors: list[Tensor]) -> Tensor:
                _, per_tensor = applier(l2norm, noop_flag, [tensors], True)
                return per_tensor

            return name, fused
    return "torch._foreach_norm", _torch_l2norm


class _FusedGroup:
    """Accelerator (or CPU float64) tensors of one dtype: one fused multi-tensor norm per call.

    CUDA reductions are tree-shaped, so whole tensors are accurate and need no splitting; only
    bf16/fp16 tensors on the torch fallback are split into bounded views, in case the foreach
    kernel upcasts with a copy (it does on CPU; this cannot be checked without a GPU).
    """

    def __init__(self, tensors: Sequence[Tensor], slots: Sequence[int], device: torch.device) -> None:
        self.backend, self._l2norm = _multi_tensor_l2norm(device)
        bounded = self.backend == "torch._foreach_norm" and tensors[0].dtype in _LOW_PRECISION
        max_piece = _BLOCK_NUMEL if bounded else _CUDA_MAX_PIECE
        self._tensors: list[Tensor] = []
        self._strided: list[Tensor] = []
        piece_slots: list[int] = []
        strided_slots: list[int] = []
        for t, slot in zip(tensors, slots):
            if t.is_contiguous():
                pieces = t.view(-1).split(max_piece)
                self._tensors.extend(pieces)
                piece_slots.extend([slot] * len(pieces))
            else:  # multi-tensor kernels want contiguous inputs
                pieces = _split_bounded(t, _BLOCK_NUMEL)
                self._strided.extend(pieces)
                strided_slots.extend([slot] * len(pieces))
        self._slots = torch.tensor(piece_slots + strided_slots, dtype=torch.long, device=device)
        self.scratch_bytes = max((p.numel() * 4 for p in self._strided), default=0)

    def __call__(self, acc: Tensor) -> None:
        parts = []
        if self._tensors:
            parts.append(self._l2norm(self._tensors))
        if self._strided:
            parts.append(_torch_l2norm(self._strided))
        norms = parts[0] if len(parts) == 1 else torch.cat(parts)
        acc.index_add_(0, self._slots, norms.double().square_())


def _default_out_device(tensors: Sequence[Summand]) -> torch.device:
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


_GroupKey = tuple[torch.device, torch.dtype, Union[type[_RowNormGroup], type[_FusedGroup]]]


def _group_key(t: Summand) -> _GroupKey:
    """(device, dtype, group type): CUDA tree reductions are accurate on whole tensors, and CPU
    float64 accumulates in float64 already (fused); CPU fp32/bf16/fp16 need row norms, and
    remainder masters must be decoded block by block anywhere (row norms)."""
    row_norms = isinstance(t, RemainderMaster) or (t.device.type == "cpu" and t.dtype != torch.float64)
    return t.device, t.dtype, _RowNormGroup if row_norms else _FusedGroup


class SumOfSquaresPlan:
    """Per-slot float64 sums of squares of a fixed list of tensors, built once and called often.

    Tensors are grouped once by (device, dtype); each call runs one fused reduction per group (on
    CPU, and for remainder masters everywhere: a few ops per 256 KiB block, see the module
    docstring) and moves each group's partial result to ``out_device``. Views share storage with
    the given tensors: nothing is copied at construction and each call's temporaries are bounded
    (``scratch_bytes``), whatever the sizes.

    Args:
        tensors: floating-point tensors (fp32, bf16, fp16, fp64) or :class:`RemainderMaster`
            pairs (summed as the fp32 masters they encode), on any mix of devices. Zero-size
            tensors are allowed and contribute nothing. The plan holds views of them: if a tensor is
            later replaced (not updated in place), build a new plan.
        slots: ``slots[i]`` is the output slot tensor ``i`` adds into; several tensors may share one.
        num_slots: length of the output.
        out_device: where the result lives. Defaults to the first non-CPU device among the tensors,
            else CPU.

    Example::

        >>> plan = SumOfSquaresPlan([w, b], slots=[0, 0], num_slots=1)
        >>> total_norm = plan().sqrt()
    """

    def __init__(
        self,
        tensors: Sequence[Summand],
        slots: Sequence[int],
        num_slots: int,
        out_device: torch.device | None = None,
    ) -> None:
        tensors, slots = list(tensors), [int(s) for s in slots]
        if len(tensors) != len(slots):
            raise ValueError(f"got {len(tensors)} tensors but {len(slots)} slots; pass one slot per tensor")
        for i, (t, slot) in enumerate(zip(tensors, slots)):
            if not (0 <= slot < num_slots):
                raise ValueError(f"slots[{i}] = {slot} is outside [0, num_slots={num_slots})")
            if not (isinstance(t, RemainderMaster) or t.is_floating_point()):
                raise TypeError(f"tensors[{i}] has dtype {t.dtype}; only floating-point tensors have norms here")
        self.num_slots = num_slots
        self.out_device = torch.device(out_device) if out_device is not None else _default_out_device(tensors)
        self._num_tensors = len(tensors)
        self._numel = sum(t.numel() for t in tensors)
        self._nbytes = sum(t.numel() * t.element_size() for t in tensors)

        buckets: dict[_GroupKey, tuple[list[Summand], list[int]]] = defaultdict(lambda: ([], []))
        for t, slot in zip(tensors, slots):
            if t.numel():  # zero-size tensors add nothing; some fused kernels reject them
                bucket = buckets[_group_key(t)]
                bucket[0].append(t if isinstance(t, RemainderMaster) else t.detach())
                bucket[1].append(slot)
        self._groups: dict[_GroupKey, _RowNormGroup | _FusedGroup] = {
            key: key[2](group_tensors, group_slots, key[0])  # type: ignore[arg-type]
            for key, (group_tensors, group_slots) in buckets.items()
        }

    @property
    def num_tensors(self) -> int:
        return self._num_tensors

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def backends(self) -> dict[tuple[torch.device, torch.dtype], str]:
        """Which reduction each (device, dtype) group uses, for reporting.

        On an accelerator, fp32 tensors and remainder masters are two groups of one key; their
        names are joined.
        """
        names: dict[tuple[torch.device, torch.dtype], str] = {}
        for (device, dtype, _), group in self._groups.items():
            previous = names.get((device, dtype))
            names[(device, dtype)] = f"{previous} + {group.backend}" if previous else group.backend
        return names

    @property
    def scratch_bytes(self) -> int:
        """Upper bound of the extra memory one call allocates (groups run one after another)."""
        return max((group.scratch_bytes for group in self._groups.values()), default=0)

    def __call__(self) -> Tensor:
        """Return the float64 sums of squares, shape ``[num_slots]``, on ``out_device``.

        No host synchronization: on accelerators the result is ready when the stream says so.
        NaN or Inf in a tensor shows up in its slot.
        """
        total = torch.zeros(self.num_slots, dtype=torch.float64, device=self.out_device)
        for (device, _, _), group in self._groups.items():
            acc = total if device == self.out_device else torch.zeros_like(total, device=device)
            group(acc)
            if acc is not total:
                # non_blocking is only safe towards an accelerator: a device-to-host copy would
                # return before the data arrived, so that direction blocks (the caller asked for it).
                total += acc.to(self.out_device, non_blocking=self.out_device.type != "cpu")
        return total
