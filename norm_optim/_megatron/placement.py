"""Where each element a rank holds sits in the global tensor: the resume proof's global index.

A fingerprint that must not depend on the layout hashes every element with its index in the
flattened *global* param (:mod:`norm_optim._kernels.position_hash`). That index comes from what
megatron and torch state about sharding, as the counting rule's facts do:

- the model's checkpoint declarations (:mod:`.declarations`): the global shape of each param and
  where this rank's TP-local part starts in it (a SwiGLU ``linear_fc1``, saved as two tensors by
  a factory, is the two parts laid end to end);
- a DTensor's placements (torch FSDP2): ``compute_local_shape_and_global_offset``;
- megatron's markers where a param has no declaration (``partition_dim`` and the TP rank);
- the distributed optimizer's shard range: where the held shard starts in the flattened
  TP-local param (:attr:`~norm_optim.ParamRecord.offset`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from .._errors import UnsupportedOptimizerError
from .._ownership import RankCoords
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

    def indices(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """Global flat indices of its elements ``[lo, hi)`` (piece-local positions)."""
        rest = torch.arange(lo, hi, dtype=torch.int64, device=device)
        out = torch.full_like(rest, self.base)
        stride = 1
        for length, start, whole in reversed(
            list(zip(self.local_shape, self.offset, self.global_shape))
        ):
            out += (rest % length + start) * stride
            rest = rest.div_(length, rounding_mode="floor")
            stride *= whole
        return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where every element of a flattened TP-local param sits in its global tensor.

    Attributes:
        pieces: the param's blocks, in order, covering it exactly.
        global_numel: the number of elements of the global tensor (all parts).
        global_shape: its shape (the first part's, for a param saved in parts).
    """

    pieces: tuple[Piece, ...]
    global_numel: int
    global_shape: tuple[int, ...]

    def indices(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Global flat indices of the TP-local param's flat elements ``[start, end)``."""
        parts = []
        for piece in self.pieces:
            lo, hi = max(start, piece.start), min(end, piece.start + piece.numel)
            if lo < hi:
                parts.append(piece.indices(lo - piece.start, hi - piece.start, device))
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)


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
    local = _dtensor_piece(name, param)
    if local is not None:
        return Placement((local,), math.prod(local.global_shape), local.global_shape)
    shape = tuple(param.shape)
    declared: Optional[Declaration] = declarations.by_param.get(id(param))
    if declared is not None:
        pieces = _declared_pieces(declared)
    elif tp_split:
        pieces = (_marked_piece(name, param, coords, expert),)
    else:
        pieces = (_whole(shape),)
    covered = sum(p.numel for p in pieces)
    if covered != param.numel() or any(
        p.local_shape[1:] != shape[1:] and len(pieces) > 1 for p in pieces
    ):
        raise UnsupportedOptimizerError(
            f"the resume fingerprint cannot place {name!r} (shape {shape}) in its global "
            f"tensor: its declaration covers {covered} of its {param.numel()} elements"
        )
    total = sum(math.prod(p.global_shape) for p in pieces)
    return Placement(pieces, total, pieces[0].global_shape)


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
