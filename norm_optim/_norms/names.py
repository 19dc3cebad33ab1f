"""The per-param names of every rank, gathered so that the bytes scale with the model, not the world.

Slot ``i`` of a per-param vector must mean the same param on every rank, so the first per-param
call needs the union of all ranks' ``(layout-independent name, expert)`` lists. Gathering every
list from every rank (one ``all_gather_object``) makes each rank receive world × its list: at
16,384 ranks, ~0.6 GB for a dense 80-layer model, although data-parallel (and expert-data-
parallel) replicas hold the very same names.

Here ranks agree on a digest first and only distinct lists travel:

1. Each rank splits its names into a dense and an expert list (dense lists differ between
   pipeline stages, expert lists also between expert-parallel ranks: splitting keeps an expert
   rank's dense names from travelling once per expert rank) and takes an 8-byte digest of each.
2. One ``all_gather`` of the 16-byte digests over the reduction group.
3. For each distinct non-empty digest, in the order every rank computes alike from the gathered
   digests, the lowest group rank holding it is its speaker. One all-reduce SUM of the lists'
   byte sizes, deflated (:func:`encode`; each speaker writes its own), then one all-reduce SUM
   of one int64 buffer that holds every distinct list at its place (each speaker writes its
   own; everyone else zeros): three collectives and two host syncs in all, whatever the
   number of distinct lists (pipeline stages times expert ranks: ~520 at PP4 x EP64, which
   were one broadcast each).

Every rank of the group enters the same collectives in the same order; no layout knowledge is
needed (dense / expert replicas over DP or expert-DP, several optimizer instances, FSDP shards,
uneven pipeline stages all just give equal or different lists). Each rank receives
16 B × world plus the bytes of the distinct lists (about the model's own name list). A digest
collision could only drop a list; every rank checks that its own names are in the union and
raises if not.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

import torch

from .._comm import Communicator, ProcessGroup
from .._errors import NormOptimError

Names = list[tuple[str, bool]]  # (layout-independent name, expert)

DIGEST_BYTES = 8


def name_parts(names: Sequence[tuple[str, bool]]) -> tuple[list[str], list[str]]:
    """A rank's names as the two lists that travel: sorted dense names, sorted expert names."""
    dense = sorted({name for name, expert in names if not expert})
    expert = sorted({name for name, expert in names if expert})
    return dense, expert


def digest(part: Sequence[str]) -> int:
    """An 8-byte digest (a signed int64) of a sorted name list; 0 for the empty list."""
    if not part:
        return 0
    raw = hashlib.blake2b("\n".join(part).encode(), digest_size=DIGEST_BYTES).digest()
    value = int.from_bytes(raw, "little", signed=True)
    return value or 1  # 0 is kept for the empty list


def digests(names: Sequence[tuple[str, bool]], device: torch.device) -> torch.Tensor:
    """What step 2 gathers from a rank: its two digests, int64 ``[2]``."""
    return torch.tensor(
        [digest(part) for part in name_parts(names)], dtype=torch.int64, device=device
    )


def speakers(gathered: torch.Tensor) -> list[tuple[int, int]]:
    """``(kind, group rank)`` of the ranks that broadcast, in broadcast order: for each kind
    (0 dense, 1 expert) and each distinct non-empty digest, the lowest group rank holding it."""
    order: list[tuple[int, int]] = []
    for kind in (0, 1):
        seen: set[int] = set()
        for rank, value in enumerate(gathered[:, kind].tolist()):
            if value != 0 and value not in seen:
                seen.add(value)
                order.append((kind, rank))
    return order


def encode(part: Sequence[str]) -> bytes:
    """A name list as it travels: UTF-8 names, one per line, deflated (names repeat their
    prefixes: a list shrinks ~5-10x, and every rank receives every distinct list)."""
    return zlib.compress("\n".join(part).encode(), 6)


def decode(blob: bytes) -> list[str]:
    """The inverse of :func:`encode`."""
    return zlib.decompress(blob).decode().split("\n")


def pack(order: Sequence[tuple[int, int]], blobs: dict[int, bytes]) -> tuple[list[int], list[int]]:
    """What the two SUMs of step 3 give (or, with only this rank's ``blobs``, what it adds):
    the byte size of each list in ``order`` and the int64 words of all lists, each padded to
    whole words at its place. ``blobs``: the encoded lists by their index in ``order``."""
    sizes = [len(blobs[i]) if i in blobs else 0 for i in range(len(order))]
    return sizes, words_of(sizes, blobs)


def words_of(sizes: Sequence[int], blobs: dict[int, bytes]) -> list[int]:
    """The int64 words of step 3's buffer, given every list's size and some of the lists."""
    raw = bytearray(sum(_padded(n) for n in sizes))
    at = 0
    for i, size in enumerate(sizes):
        if i in blobs:
            raw[at : at + size] = blobs[i]
        at += _padded(size)
    return list(struct.unpack(f"<{len(raw) // 8}q", bytes(raw)))


def _padded(size: int) -> int:
    return -(-size // 8) * 8


def exchange_names(
    names: Sequence[tuple[str, bool]], comm: Communicator, group: ProcessGroup
) -> Names:
    """The sorted union of every rank's ``(name, expert)`` list over ``group`` (a collective:
    every rank of ``group`` calls it, with its own list)."""
    parts = name_parts(names)
    me = comm.rank(group)
    device = comm.device(group)
    gathered = comm.all_gather_tensor(digests(names, device), group)
    order = speakers(gathered.cpu())
    union: set[tuple[str, bool]] = set()
    if order:
        blobs = {i: encode(parts[kind]) for i, (kind, who) in enumerate(order) if who == me}
        sizes, _ = pack(order, blobs)
        reduced = torch.tensor(sizes, dtype=torch.int64, device=device)
        comm.all_reduce(reduced, group, "sum")
        sizes = reduced.tolist()
        words = torch.tensor(words_of(sizes, blobs), dtype=torch.int64, device=device)
        comm.all_reduce(words, group, "sum")  # one writer per word: the sum is its bytes
        raw = struct.pack(f"<{words.numel()}q", *words.tolist())
        at = 0
        for (kind, _), size in zip(order, sizes):
            union.update((name, bool(kind)) for name in decode(raw[at : at + size]))
            at += _padded(size)
    missing = [name for name in names if tuple(name) not in union]
    if missing:
        raise NormOptimError(
            f"the per-param names exchange lost this rank's {missing[0][0]!r} (and "
            f"{len(missing) - 1} more): two different name lists had the same digest"
        )
    return sorted(union)
