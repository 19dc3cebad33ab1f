"""Decisions every rank of a group takes alike from reduced values: which items differ, and which
ranks are off the majority.

Gathering every rank's values costs each rank group-size times its own bytes; reducing them
costs its own bytes once, whatever the group's size. Two reductions decide everything the audit
needs:

- :func:`min_max`: one all-reduce MIN of ``[x, ~x]`` gives every item's smallest and largest
  value (``~`` reverses the order of int64 without overflow: ``max(x) == ~min(~x)``). An item
  differs where they differ; the same on every rank.
- :func:`vote`: for the items that differ only, each holder says whether its value is the
  smallest, the largest or another one. One SUM (how many of each) gives the majority side;
  one MIN gives the first and last holder of each side, the norm of the first one's copy, and
  the first and last rank off the majority in each class of ``rank % CLASSES``: up to
  ``2 * CLASSES`` ranks named (all of them when that few are off), and how many there are.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Optional

import torch

from .._comm import Communicator, ProcessGroup

INT64_MAX = (1 << 63) - 1
SIDES = 3  # values equal to the smallest, equal to the largest, any other
CLASSES = 4  # off-majority ranks are named by the first and last of each rank % CLASSES
_NO_NORM = 0xFFFFFFFF  # low word of a packed (rank, norm) without a norm


def min_max(
    comm: Communicator, values: torch.Tensor, held: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every item's MIN and MAX over the holders in ``group`` (one all-reduce of 2× ``values``).

    ``values`` is int64 of any shape, ``held`` a bool mask of the same shape (what this rank
    holds). An item no rank holds comes back with ``min > max``.
    """
    top = torch.full_like(values, INT64_MAX)
    packed = torch.cat([torch.where(held, values, top), torch.where(held, ~values, top)])
    comm.all_reduce(packed, group, "min")
    low, high = packed.chunk(2)
    return low, ~high


def pack_norm(rank: int, norm: Optional[float]) -> int:
    """``(rank, float32 bits of norm)`` as one int64 whose MIN is the smallest rank's pair
    (norms are >= 0, so their bits sort like them)."""
    bits = _NO_NORM if norm is None else struct.unpack("<I", struct.pack("<f", norm))[0]
    return (rank << 32) | bits


def unpack_norm(word: int) -> tuple[int, Optional[float]]:
    """The inverse of :func:`pack_norm`."""
    bits = word & 0xFFFFFFFF
    norm = None if bits == _NO_NORM else struct.unpack("<f", struct.pack("<I", bits))[0]
    return word >> 32, norm


@dataclasses.dataclass(frozen=True)
class Side:
    """The holders of one side of an item: how many, the first and last global rank, and the
    norm of the first one's copy."""

    count: int
    first: int
    last: int
    norm: Optional[float]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Who is off the majority on one item, as every rank of the group derives it.

    ``off``: the ranks off the majority (all sides when there is none); ``other``: the
    majority side, or, without a majority, the side that is not ``off``'s first."""

    holders: int
    distinct: int
    off_count: int
    off_first: int
    off_last: int
    off_norm: Optional[float]
    off_ranks: tuple[int, ...]
    other_rank: Optional[int]
    other_norm: Optional[float]


def vote(
    comm: Communicator,
    values: torch.Tensor,
    held: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    norms: list[Optional[float]],
    me: int,
    group: ProcessGroup,
) -> list[Verdict]:
    """The :class:`Verdict` of each item (1-D int64 ``values`` of this rank, ``held`` mask,
    the items' group ``low`` / ``high`` from :func:`min_max`, this rank's copy's ``norms``):
    two all-reduces of ``SIDES`` and ``2 * (SIDES + CLASSES)`` int64 per item."""
    side = torch.where(values == low, 0, torch.where(values == high, 1, 2))
    onehot = torch.nn.functional.one_hot(side, SIDES).to(torch.int64) * held.unsqueeze(1)
    counts = onehot.clone()
    comm.all_reduce(counts, group, "sum")
    tallies = counts.tolist()
    major = torch.tensor([_major(count) for count in tallies], device=values.device)
    mine = onehot.bool()
    off = held & (side != major)  # this rank's copy is off the majority
    packed = torch.tensor([pack_norm(me, n) for n in norms], dtype=torch.int64)
    packed = packed.to(values.device).unsqueeze(1).expand(-1, SIDES)
    top = torch.full_like(mine, INT64_MAX, dtype=torch.int64)
    lasts = torch.full_like(top, ~me)
    named = torch.full((len(tallies), 2 * CLASSES), INT64_MAX, dtype=torch.int64)
    named = named.to(values.device)
    named[:, me % CLASSES] = torch.where(off, me, INT64_MAX)
    named[:, CLASSES + me % CLASSES] = torch.where(off, ~me, INT64_MAX)
    firsts = torch.cat(
        [torch.where(mine, packed, top), torch.where(mine, lasts, top), named], dim=1
    )
    comm.all_reduce(firsts, group, "min")
    verdicts = []
    for count, row in zip(tallies, firsts.tolist()):
        sides = []
        for c, first, last in zip(count, row[:SIDES], row[SIDES : 2 * SIDES]):
            if c:
                rank, norm = unpack_norm(first)
                sides.append(Side(c, rank, ~last, norm))
        verdicts.append(_decide(sides, ranks_of(row[2 * SIDES :])))
    return verdicts


def ranks_of(words: list[int]) -> tuple[int, ...]:
    """The ranks named by ``CLASSES`` MIN words of ``rank`` and ``CLASSES`` of ``~rank``."""
    low, high = words[:CLASSES], words[CLASSES:]
    return tuple(sorted({w for w in low if w != INT64_MAX} | {~w for w in high if w != INT64_MAX}))


def _major(count: list[int]) -> int:
    """The side holding more than half the copies, or -1."""
    holders = sum(count)
    return next((c for c, n in enumerate(count) if 2 * n > holders), -1)


def _decide(sides: list[Side], named: tuple[int, ...]) -> Verdict:
    """A majority side holds more than half the copies; everyone else is off it. Without one,
    every side is off (and named)."""
    holders = sum(s.count for s in sides)
    major = next((s for s in sides if 2 * s.count > holders), None)
    off = [s for s in sides if s is not major]
    first = min(off, key=lambda s: s.first)
    other = major or next((s for s in sides if s is not first), None)
    return Verdict(
        holders=holders,
        distinct=len(sides),
        off_count=sum(s.count for s in off),
        off_first=first.first,
        off_last=max(s.last for s in off),
        off_norm=first.norm,
        off_ranks=named,
        other_rank=other.first if other is not None else None,
        other_norm=other.norm if other is not None else None,
    )
