"""Every rank's findings, on every rank, in bytes that do not grow with the world.

Each copy group's findings are known to all its members alike (they derive them from the same
reduced values), so one member, the reporter, contributes them; a stale weight is contributed
by its own rank. Contributions travel as fixed-size int64 records in a table of :data:`SLOTS`
slots, reduced over the whole group (no object collective, no per-rank buffer):

1. one SUM of how many findings there are: a clean audit stops here;
2. per round: a MIN of the slot keys (each finding's key, hashed by round to a slot: the
   smallest key wins the slot), then a MIN and a SUM of the records, where only the
   findings that won their slot write. Findings of the same param and kind from several groups
   have the same key and merge (first rank MIN, last rank MAX, counts summed). The SUM also
   counts the findings still waiting; rounds stop when none is, or when the report is full.

What a rank receives is ``SLOTS × (record words) × 8`` bytes per round, whatever the group's
size: ~53 KB; at most :data:`ROUNDS` rounds.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional, Sequence

import torch

from .._comm import Communicator, ProcessGroup
from .findings import KINDS, REPORT_CAP, Finding
from .agreement import CLASSES, INT64_MAX, pack_norm, ranks_of, unpack_norm

SLOTS = 128  # a power of two: a slot is 7 bits of the key
ROUNDS = 8  # 8 × 7 bits of a 63-bit key
NAME_WORDS = 32  # a param name travels as up to 256 UTF-8 bytes
_MIN_WORDS = 7 + 2 * CLASSES + NAME_WORDS
_SUM_WORDS = 4
_NO_RANK = 0xFFFFFFFF


def share_findings(
    findings: Sequence[Finding], comm: Communicator, group: ProcessGroup
) -> tuple[tuple[Finding, ...], int]:
    """The sorted findings every rank contributed (at most :data:`REPORT_CAP`), and how many
    contributions were left out; the same on every rank of ``group`` (a collective)."""
    device = comm.device(group)
    count = torch.tensor([len(findings)], dtype=torch.int64, device=device)
    comm.all_reduce(count, group, "sum")
    if int(count) == 0:
        return (), 0
    pending = [(_key(f), f) for f in findings]
    shown: dict[int, Finding] = {}
    waiting = int(count)
    for round_ in range(ROUNDS):
        slots = torch.full((SLOTS,), INT64_MAX, dtype=torch.int64)
        for key, _ in pending:
            at = _slot(key, round_)
            slots[at] = min(int(slots[at]), key)
        slots = slots.to(device)
        comm.all_reduce(slots, group, "min")
        winners = slots.tolist()
        lows = torch.full((SLOTS, _MIN_WORDS), INT64_MAX, dtype=torch.int64)
        sums = torch.zeros(SLOTS * _SUM_WORDS + 1, dtype=torch.int64)
        still = []
        for key, finding in pending:
            at = _slot(key, round_)
            if winners[at] != key:
                still.append((key, finding))
                continue
            lows[at] = torch.minimum(lows[at], torch.tensor(_min_words(finding)))
            sums[at * _SUM_WORDS : (at + 1) * _SUM_WORDS] += torch.tensor(_sum_words(finding))
        pending = still
        sums[-1] = len(pending)
        lows, sums = lows.to(device), sums.to(device)
        comm.all_reduce(lows, group, "min")
        comm.all_reduce(sums, group, "sum")
        totals = sums.tolist()
        for at, (key, low) in enumerate(zip(winners, lows.tolist())):
            if key != INT64_MAX:
                part = totals[at * _SUM_WORDS : (at + 1) * _SUM_WORDS]
                shown[key] = _decode(low, part)
        waiting = totals[-1]
        if waiting == 0 or len(shown) >= REPORT_CAP:
            break
    ordered = sorted(shown.values(), key=_order)
    return tuple(ordered[:REPORT_CAP]), waiting + max(0, len(ordered) - REPORT_CAP)


def _order(finding: Finding) -> tuple:
    return (str(finding.kind), finding.param, finding.ranks)


def _key(finding: Finding) -> int:
    """A positive 63-bit key of (kind, param): the same finding from any group, any rank."""
    text = f"{finding.kind}\n{finding.param}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _slot(key: int, round_: int) -> int:
    return (key >> (7 * round_)) & (SLOTS - 1)


def _min_words(finding: Finding) -> list[int]:
    first = finding.ranks[0]
    named = [INT64_MAX] * (2 * CLASSES)  # per rank % CLASSES: the first rank, ~ the last
    for rank in finding.ranks:
        named[rank % CLASSES] = min(named[rank % CLASSES], rank)
        named[CLASSES + rank % CLASSES] = min(named[CLASSES + rank % CLASSES], ~rank)
    norms = list(finding.norms)
    off = norms[0][1] if norms else None
    other_rank, other_norm = norms[1] if len(norms) > 1 else (_NO_RANK, None)
    diff = finding.max_abs_diff
    return [
        KINDS.index(finding.kind),
        first,
        pack_norm(first, off),
        (first << 32) | other_rank,
        pack_norm(first, other_norm),
        ~finding.distinct,
        INT64_MAX if diff is None else ~struct.unpack("<q", struct.pack("<d", diff))[0],
        *named,
        *_name_words(finding.param),
    ]


def _sum_words(finding: Finding) -> list[int]:
    elements = finding.elements
    return [finding.num_ranks, finding.holders, elements or 0, int(elements is not None)]


def _name_words(name: str) -> list[int]:
    raw = name.encode()[: NAME_WORDS * 8].ljust(NAME_WORDS * 8, b"\0")
    return list(struct.unpack(f"<{NAME_WORDS}q", raw))


def _decode(low: list[int], part: list[int]) -> Finding:
    kind, first = KINDS[low[0]], low[1]
    _, off = unpack_norm(low[2])
    other_rank = low[3] & 0xFFFFFFFF
    _, other = unpack_norm(low[4])
    norms: list[tuple[int, float]] = []
    if off is not None:
        norms.append((first, off))
    if other_rank != _NO_RANK and other is not None:
        norms.append((other_rank, other))
    diff: Optional[float] = None
    if low[6] != INT64_MAX:
        diff = struct.unpack("<d", struct.pack("<q", ~low[6]))[0]
    ranks = ranks_of(low[7 : 7 + 2 * CLASSES])
    name = struct.pack(f"<{NAME_WORDS}q", *low[7 + 2 * CLASSES :]).rstrip(b"\0")
    count, holders, elements, stale = part
    return Finding(
        param=name.decode(errors="replace"),
        kind=kind,
        ranks=ranks,
        distinct=~low[5],
        elements=elements if stale else None,
        max_abs_diff=diff,
        norms=tuple(norms),
        count=count,
        holders=holders,
    )
