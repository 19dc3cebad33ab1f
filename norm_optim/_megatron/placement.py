"""Where each element a rank holds sits in the global tensor: the resume proof's global index.

A fingerprint that must not depend on the layout hashes every element with its index in the
flattened *global* param (:mod:`norm_optim._kernels.position_hash`). That index comes from what
megatron and torch state about sharding, as the counting rule's facts do:

- the model's checkpoint declarations (:mod:`.declarations`): the global shape of each param and
  where this rank's TP-local part starts in it (a SwiGLU ``linear_fc1``, saved as two tensors by
  a factory, is the two parts laid end to end);
- a DTensor's placements (torch FSDP2): ``compute_local_shape_and_global_offset`` places the
  local tensor in the DTensor (under Megatron's FSDP2 wrapper, the TP-local param; TP then
  places that, as for any param);
- megatron's markers where a param has no declaration (``partition_dim`` and the TP rank);
- the distributed optimizer's shard range: where the held shard starts in the flattened
  TP-local param (:attr:`~norm_optim.inspection.ParamRecord.offset`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import torch

from .._errors import UnsupportedOptimizerError
from .._counting.ownership import RankCoords
from .declarations import Declaration, Declarations


@dataclasses.dataclass(frozen=True)
class Piece:
    """A block of the flattened TP-local param, placed in a global tensor.

    Attributes:
        start: its first element in the flattened TP-local param.
        local_shape: its shape (row-major, contiguous in the flattened param).
        global_shape: the shape of the global tensor it is a part of.
        offset: where it starts along each axis of that tensor.
        base: added to its global flat index (parts of one param laid end to end).
    """

    start: int
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    base: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @functools.cached_property
    def _axes(self) -> tuple[tuple[int, int, int], ...]:
        """(local length, offset, global length) per axis, each trailing axis that the piece
        holds whole merged into the one before it: a TP split on dim 0 (or none) is one axis,
        so its map is one add; a split on dim 1 two."""
        axes = list(zip(self.local_shape, self.offset, self.global_shape)) or [(1, 0, 1)]
        while len(axes) > 1 and axes[-1][0] == axes[-1][2] and axes[-1][1] == 0:
            (length, start, whole), (inner, _, _) = axes[-2], axes.pop()
            axes[-1] = (length * inner, start * inner, whole * inner)
        return tuple(axes)

    def map(self, positions: torch.Tensor) -> torch.Tensor:
        """The global flat index of each of ``positions`` (int64, in the flattened TP-local
        param, all inside this piece)."""
        axes = self._axes
        if len(axes) == 1:
            return positions + (axes[0][1] + self.base - self.start)
        rest = positions - self.start
        out = torch.full_like(rest, self.base)
        stride = 1
        for length, start, whole in reversed(axes):
            out += (rest % length + start) * stride
            rest = rest.div_(length, rounding_mode="floor")
            stride *= whole
        return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every element a rank holds of a param sits in the param's global tensor.

    Attributes:
        pieces: the TP-local param's blocks, in order, covering it exactly.
        global_numel: the number of elements of the global tensor (all parts).
        global_shape: its shape (the first part's, for a param saved in parts).
        inner: for a DTensor (torch FSDP2), where this rank's local tensor sits in the
            TP-local param (its block from the placements); None: the held tensor is a flat
            range of the TP-local param itself.
    """

    pieces: tuple[Piece, ...]
    global_numel: int
    global_shape: tuple[int, ...]
    inner: Optional[Piece] = None

    def indices(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Global flat indices of the held flat elements ``[start, end)``."""
        positions = torch.arange(start, end, dtype=torch.int64, device=device)
        if self.inner is not None:
            positions = self.inner.map(positions)
        if len(self.pieces) == 1:
            return self.pieces[0].map(positions)
        starts = torch.tensor([p.start for p in self.pieces], dtype=torch.int64, device=device)
        which = torch.bucketize(positions, starts, right=True) - 1
        out = torch.empty_like(positions)
        for k, piece in enumerate(self.pieces):
            chosen = which == k
            out[chosen] = piece.map(positions[chosen])
        return out


def _whole(shape: Sequence[int], base: int = 0, start: int = 0) -> Piece:
    return Piece(start, tuple(shape), tuple(shape), (0,) * len(shape), base)


def _declared(declaration: Declaration, start: int, base: int) -> Piece:
    local = tuple(g // f for g, f in zip(declaration.global_shape, declaration.fragments))
    return Piece(start, local, declaration.global_shape, declaration.offset, base)


def placement_of(
    name: str,
    param: torch.Tensor,
    declarations: Declarations,
    coords: RankCoords,
    expert: bool,
    tp_split: bool,
) -> Placement:
    """The :class:`Placement` of a model param on this rank.

    Raises:
        UnsupportedOptimizerError: a layout whose global positions this rank cannot state
            (a strided TP split with no declaration, a DTensor placement that is not an
            offset block, a declaration that does not cover the param).
    """
    inner = _dtensor_piece(name, param)  # a DTensor's shape is its whole (TP-local) shape
    shape = tuple(param.shape)
    declared: Optional[Declaration] = declarations.by_param.get(id(param))
    pieces: Optional[tuple[Piece, ...]] = None
    if declared is not None:
        pieces = _declared_pieces(declared)
        if not _covers(pieces, shape):
            # Seen on megatron-core 0.19 under Megatron-FSDP: a declaration of the padded
            # vocabulary's shape beside a param of another; the markers then place it.
            pieces = None
    if pieces is None:
        pieces = (_marked_piece(name, param, coords, expert),) if tp_split else (_whole(shape),)
    if not _covers(pieces, shape):
        raise UnsupportedOptimizerError(
            f"the resume fingerprint cannot place {name!r} (shape {shape}) in its global "
            f"tensor: neither its declaration ({declared}) nor its markers cover it"
        )
    total = sum(math.prod(p.global_shape) for p in pieces)
    return Placement(pieces, total, pieces[0].global_shape, inner)


def _covers(pieces: Sequence[Piece], shape: tuple[int, ...]) -> bool:
    """Whether the pieces cut a param of ``shape`` exactly, in blocks of whole rows."""
    if len(pieces) == 1:
        return pieces[0].local_shape == shape
    return sum(p.numel for p in pieces) == math.prod(shape) and all(
        p.local_shape[1:] == shape[1:] for p in pieces
    )


def _declared_pieces(declared: Declaration) -> tuple[Piece, ...]:
    """One piece per saved part, each a block of rows of the TP-local param, in order."""
    parts = declared.parts_saved or (declared,)
    pieces, start, base = [], 0, 0
    for part in parts:
        piece = _declared(part, start, base)
        pieces.append(piece)
        start += piece.numel
        base += math.prod(part.global_shape)
    return tuple(pieces)


def _marked_piece(name: str, param: torch.Tensor, coords: RankCoords, expert: bool) -> Piece:
    """A TP split read from megatron's markers (a param with no declaration)."""
    dim = int(getattr(param, "partition_dim", 0))
    stride = int(getattr(param, "partition_stride", 1))
    peers = coords.expert_tp_peers if expert else coords.tp_peers
    size = max(len(peers), 1)
    if stride != 1 or (size > 1 and not peers):
        raise UnsupportedOptimizerError(
            f"the resume fingerprint cannot place {name!r}: TP splits it with "
            f"partition_stride={stride} and no checkpoint declaration says where its part is"
        )
    rank = coords.expert_tp if expert else coords.tp
    shape = tuple(param.shape)
    whole = tuple(n * size if d == dim else n for d, n in enumerate(shape))
    offset = tuple(rank * n if d == dim else 0 for d, n in enumerate(shape))
    return Piece(0, shape, whole, offset)


def _dtensor_piece(name: str, param: torch.Tensor) -> Optional[Piece]:
    """A DTensor's local block from its placements (torch FSDP2); None for other tensors."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None or not hasattr(param, "_local_tensor"):
        return None
    from torch.distributed.tensor import Replicate, Shard

    # torch/distributed/tensor/_utils.py (torch 2.5-2.14)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = getattr(param, "placements")  # a DTensor's
    if any(type(p) not in (Shard, Replicate) for p in placements):
        raise UnsupportedOptimizerError(
            f"the resume fingerprint cannot place {name!r}: its placements "
            f"{tuple(placements)} are not Shard / Replicate blocks"
        )
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return Piece(0, tuple(local_shape), tuple(param.shape), tuple(offset))


def megatron_fsdp_shards(chunks: Sequence[torch.nn.Module]) -> dict[int, tuple[int, torch.Tensor]]:
    """``id(model param)`` -> (where this rank's shard starts in the flattened param, its bf16
    weight shard) of every param of Megatron-FSDP (v1) chunks: its main-weight and model-weight
    buffers shard each bucket alike, and the param's own data is the unsharded buffer, current
    only between a gather and its release. Empty for other chunks."""
    shards: dict[int, tuple[int, torch.Tensor]] = {}
    for chunk in chunks:
        buffer = getattr(chunk, "param_and_grad_buffer", None)
        for group in getattr(buffer, "parameter_groups", None) or ():
            weights = group.model_weight_buffer
            for item, param in enumerate(group.params):
                # megatron_fsdp/param_and_grad_buffer.py (0.14-0.19) DataParallelBuffer: the
                # part of item ``item`` in this rank's shard, in the item's own coordinates.
                start, _ = weights._get_item_slice_in_shard(item)
                shards[id(param)] = (int(start), weights.get_item(item, only_shard=True))
    return shards
