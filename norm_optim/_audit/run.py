"""The audit: are the copies the counting rule skips really equal, and are the weights current?

The counting rule counts one copy of every element and *assumes* the copies it skips are equal
(:class:`~norm_optim._counting.ownership.Copies`): data- and context-parallel replicas, expert-data-
parallel replicas, (expert-)TP duplicates of what TP does not split, tied copies, and on every
rank the model weight that is the rounding of the fp32 main (or main shard) it holds. When one
breaks, the norm and the training are silently wrong. :func:`run_audit` checks them all:

1. one pass over this rank's tensors: a bitwise fingerprint of every model weight and every
   fp32 main that has storage of its own (:mod:`norm_optim._kernels.fingerprint`), folded into
   one int64 key per copy, and, for every main this rank holds, the count of weight elements
   that are not its rounding;
2. per group of copies (:class:`~norm_optim._megatron.audit.AuditLayout`): an all-reduce MIN /
   MAX of the param count, then of a ``[params, 4]`` table (name digest, weight key, main range,
   main key): a copy differs where MIN != MAX. Only for those, a vote
   (:func:`norm_optim._audit.agreement.vote`: one SUM, one MIN) names the majority side and the
   ranks off it. Every member derives the same findings from the same reduced values;
3. the findings travel to every rank as fixed-size records (:mod:`norm_optim._audit.exchange`),
   one contribution per copy group (its first rank) and per stale rank: one all-reduce when
   there is nothing to tell.

Bytes and work per rank are O(params), whatever the groups' sizes; every rank enters the same
collectives whatever it holds.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Optional, Sequence

import torch

from .exchange import share_findings
from .._comm import Communicator, ProcessGroup
from .findings import AuditError, AuditReport, Finding, FindingKind
from .._kernels.fingerprint import GOLDEN, FingerprintPass, largest_difference, stale_elements
from .._megatron.audit import AuditLayout
from .agreement import Verdict, min_max, vote
from .._norms.registry import ParamRecord

__all__ = ["AuditError", "AuditReport", "Finding", "FindingKind", "run_audit"]


@dataclasses.dataclass(frozen=True)
class _Check:
    """One group of copies to compare: which records, over which group, named how."""

    label: str
    group: ProcessGroup
    records: Sequence[ParamRecord]
    weight_kind: FindingKind
    main_kind: FindingKind
    by_name: bool = True


def _signed(value: int) -> int:
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


# A fingerprint (s, t) folds into one int64 key s * _MIX + t. With _MIX = -2**32 * GOLDEN, one
# changed element i (the fingerprint's own guarantee) changes it by d * GOLDEN * (i - 2**32)
# with |d| < 2**32: never a multiple of 2**64 for i < 2**32; a swap changes t alone.
_MIX = _signed(-(1 << 32) * GOLDEN)
# Table columns: name digest, weight key, main range (offset, numel), main key.
_NAME, _WEIGHT, _RANGE, _MAIN = range(4)


def run_audit(
    records: Sequence[ParamRecord],
    layout: AuditLayout,
    comm: Communicator,
    group: ProcessGroup,
) -> AuditReport:
    """Audit this rank's ``records`` against their copies (a collective over ``group`` and the
    layout's groups; see the module docstring)."""
    me = comm.rank(None)
    prints = FingerprintPass()
    weights: dict[int, torch.Tensor] = {}
    mains: dict[int, torch.Tensor] = {}
    for record in records:
        if id(record.param) not in layout.gathering:
            weights[id(record.param)] = prints.fingerprint(_weight(record, layout))
        main = _own_main(record, layout)
        if main is not None and _has_main_copies(record, layout, comm):
            mains[id(record.param)] = prints.fingerprint(main)

    findings = _stale(records, me, layout)
    compared: list[tuple[str, int]] = []
    if not layout.single:
        for check in _checks(records, layout):
            if check.group is None or comm.size(check.group) == 1:
                continue  # no copies (or no such group) here, nor on any peer
            compared.append((check.label, len(check.records)))
            found, mixed = _compare(check, weights, mains, comm, me, layout)
            if me == comm.first_rank(check.group):
                findings += found  # one reporter per copy group
            shard = layout.shard_replicas
            if check.label in _SHARDED and mixed and _size(comm, shard) > 1:
                # Mains whose holders hold different shards: the ranks that hold the same shard
                # (one per optimizer instance) compare them; every member of this group knows
                # ``mixed`` alike, and the shard group lies inside it.
                shards = dataclasses.replace(check, label="main-shard-replicas", group=shard)
                compared.append((shards.label, len(mixed)))
                found = _compare(shards, {}, mains, comm, me, layout, rows=mixed)[0]
                if me == comm.first_rank(shard):
                    findings += found
    left_out = tuple(
        (r.global_name, "overlap-param-gather: its all-gather may be in flight")
        for r in records
        if id(r.param) in layout.gathering
    )
    shown, omitted = share_findings(findings, comm, group)
    return AuditReport(shown, left_out, tuple(compared), omitted)


_SHARDED = ("dp-replicas", "expert-dp-replicas")  # checks whose mains may be shards


def _size(comm: Communicator, group: ProcessGroup) -> int:
    return comm.size(group) if group is not None else 1


def _weight(record: ParamRecord, layout: AuditLayout) -> torch.Tensor:
    """The model weight this rank holds for ``record`` (a DTensor's local tensor)."""
    local = layout.local.get(id(record.param)) if layout.local else None
    return local if local is not None else record.param.detach()


def _own_main(record: ParamRecord, layout: AuditLayout) -> Optional[torch.Tensor]:
    """The fp32 main (or shard) ``record`` holds, when it is a tensor with storage of its own
    (not the param itself or a view of it)."""
    tensor = record.tensor
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return None
    weight = _weight(record, layout)
    if tensor.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return None
    return tensor


def _has_main_copies(record: ParamRecord, layout: AuditLayout, comm: Communicator) -> bool:
    """Whether another rank holds a copy of the main (or shard) ``record`` holds: a whole main
    replicated over DP, a TP duplicate's, a tied copy's, or a shard that another optimizer
    instance holds too. A shard only this rank holds is checked against its weight alone."""
    if layout.single:
        return False
    copies = record.copies
    replicas = layout.expert_replicas if copies.expert else layout.dense_replicas
    replicas_size = comm.size(replicas) if replicas is not None else 1
    if (copies.replicated and replicas_size > 1) or id(record.param) in layout.tied_params:
        return True
    tp = layout.expert_tp if copies.expert else layout.dense_tp
    if not copies.tp_split and tp is not None and comm.size(tp) > 1:
        return True
    gtp = layout.expert_gtp if copies.expert else layout.dense_gtp
    if not copies.gtp_sharded and gtp is not None and comm.size(gtp) > 1:
        return True
    return copies.shard_group is not None and len(copies.shard_group) < replicas_size


def _checks(records: Sequence[ParamRecord], layout: AuditLayout) -> list[_Check]:
    """The groups of copies the counting rule treats as equal, as :class:`_Check` s."""
    # A DTensor's copies are its Replicate axes (below); megatron's DP ranks hold other shards.
    dense = [r for r in records if not r.expert]
    expert = [r for r in records if r.expert]
    unplaced = [r for r in records if id(r.param) not in layout.placed]
    kinds = FindingKind
    by_mesh = [
        _Check(
            "mesh-replicas",
            group,
            [r for r in records if id(r.param) in ids],
            kinds.MESH_REPLICAS_DIFFER,
            kinds.MESH_REPLICAS_DIFFER,
        )
        for group, ids in layout.mesh_replicas
    ]
    return by_mesh + [
        _Check(
            "dp-replicas",
            layout.dense_replicas,
            [r for r in unplaced if not r.expert],
            kinds.DP_REPLICAS_DIFFER,
            kinds.MAIN_REPLICAS_DIFFER,
        ),
        _Check(
            "expert-dp-replicas",
            layout.expert_replicas,
            [r for r in unplaced if r.expert],
            kinds.EXPERT_DP_REPLICAS_DIFFER,
            kinds.MAIN_REPLICAS_DIFFER,
        ),
        _Check(
            "tp-duplicates",
            layout.dense_tp,
            [r for r in dense if not r.tp_split],
            kinds.TP_DUPLICATES_DIFFER,
            kinds.MAIN_TP_DUPLICATES_DIFFER,
        ),
        _Check(
            "expert-tp-duplicates",
            layout.expert_tp,
            [r for r in expert if not r.tp_split],
            kinds.EXPERT_TP_DUPLICATES_DIFFER,
            kinds.MAIN_TP_DUPLICATES_DIFFER,
        ),
        _Check(
            "gtp-copies",
            layout.dense_gtp,
            [r for r in dense if not r.copies.gtp_sharded],
            kinds.GTP_COPIES_DIFFER,
            kinds.GTP_COPIES_DIFFER,
        ),
        _Check(
            "expert-gtp-copies",
            layout.expert_gtp,
            [r for r in expert if not r.copies.gtp_sharded],
            kinds.GTP_COPIES_DIFFER,
            kinds.GTP_COPIES_DIFFER,
        ),
        _Check(
            "tied-copies",
            layout.tied,
            [r for r in records if id(r.param) in layout.tied_params],
            kinds.TIED_COPIES_DIFFER,
            kinds.TIED_COPIES_DIFFER,
            by_name=False,  # the word embeddings and the output weight: two names, one weight
        ),
    ]


def _name_hash(name: str) -> int:
    """A 63-bit digest of a name, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def _table(
    check: _Check,
    weights: dict[int, torch.Tensor],
    mains: dict[int, torch.Tensor],
    rows: Optional[set[int]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[params, 4]`` int64 table for ``check`` and the mask of what it holds:
    names and ranges built on the host in one tensor, the fingerprints stacked and folded on
    the device (two transfers in all, never one per param)."""
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    heads, held, prints = [], [], []
    for row, record in enumerate(check.records):
        key = id(record.param)
        weight = weights.get(key)
        main = mains.get(key) if rows is None or row in rows else None
        numel = record.tensor.numel() if main is not None and record.tensor is not None else 0
        offset = record.offset if main is not None else 0
        heads.append([_name_hash(record.global_name) if check.by_name else 0, offset, numel])
        held.append([check.by_name, weight is not None, main is not None, main is not None])
        prints.append(weight.to(device) if weight is not None else zero)
        prints.append(main.to(device) if main is not None else zero)
    head = torch.tensor(heads, dtype=torch.int64).view(-1, 3).to(device)
    folded = torch.stack(prints).view(-1, 2, 2) if prints else zero.view(0, 2, 2)
    keys = folded[..., 0] * _MIX + folded[..., 1]  # int64 wraps: [params, (weight, main)]
    table = torch.stack(
        [head[:, 0], keys[:, 0], head[:, 1] * (1 << 32) + head[:, 2], keys[:, 1]], dim=1
    )
    return table, torch.tensor(held, dtype=torch.bool).view(-1, 4).to(device)


def _compare(
    check: _Check,
    weights: dict[int, torch.Tensor],
    mains: dict[int, torch.Tensor],
    comm: Communicator,
    me: int,
    layout: AuditLayout,
    rows: Optional[set[int]] = None,
) -> tuple[list[Finding], set[int]]:
    """The findings of ``check`` (the same on every member of its group) and the rows whose
    main holders hold different ranges (shards); with ``rows``, only those rows' mains.

    Collectives: one MIN of the param count, one MIN of the table, and a vote (a SUM and a
    MIN) over the items that differ, only when some do."""
    device = comm.device(check.group)
    count = torch.tensor([len(check.records)], dtype=torch.int64, device=device)
    held = torch.ones_like(count, dtype=torch.bool)
    low, high = min_max(comm, count, held, check.group)
    fewest, most = torch.cat([low, high]).tolist()
    if fewest != most:
        (verdict,) = vote(comm, count, held, low, high, [None], me, check.group)
        name = f"<{check.label}: {fewest} to {most} params>"
        return [_finding(name, FindingKind.NOT_COMPARABLE, verdict)], set()
    if not check.records:
        return [], set()
    table, held = _table(check, weights, mains, rows, device)
    low, high = min_max(comm, table, held, check.group)
    same = (low[:, _RANGE] == high[:, _RANGE]).unsqueeze(1)
    differ = torch.cat([low < high, same], dim=1).cpu()  # one host sync for the table
    names_differ, same_range = differ[:, _NAME], differ[:, -1]
    items = [(r, _NAME) for r in names_differ.nonzero().flatten().tolist()]
    ok = ~names_differ
    items += [(r, _WEIGHT) for r in (ok & differ[:, _WEIGHT]).nonzero().flatten().tolist()]
    mains_differ = ok & same_range & differ[:, _MAIN]  # among holders of one range only
    items += [(r, _MAIN) for r in mains_differ.nonzero().flatten().tolist()]
    mixed = set((ok & differ[:, _RANGE]).nonzero().flatten().tolist())
    if not items:
        return [], mixed
    at = torch.tensor(items, dtype=torch.int64, device=device).view(-1, 2)
    pick = (at[:, 0], at[:, 1])
    norms = _norms(check, items, held[pick].tolist(), layout)
    verdicts = vote(comm, table[pick], held[pick], low[pick], high[pick], norms, me, check.group)
    kinds = {
        _NAME: FindingKind.NOT_COMPARABLE,
        _WEIGHT: check.weight_kind,
        _MAIN: check.main_kind,
    }
    return [
        _finding(check.records[row].global_name, kinds[column], verdict)
        for (row, column), verdict in zip(items, verdicts)
    ], mixed


def _norms(
    check: _Check, items: list[tuple[int, int]], held: list[bool], layout: AuditLayout
) -> list[Optional[float]]:
    """The L2 norm of this rank's copy each item compares (None for a name, or a copy this
    rank does not hold): computed on the device, read with one host sync."""
    found: list[tuple[int, torch.Tensor]] = []
    for i, ((row, column), mine) in enumerate(zip(items, held)):
        record = check.records[row]
        tensor = None
        if mine and column != _NAME:
            tensor = _weight(record, layout) if column == _WEIGHT else _own_main(record, layout)
        if tensor is not None:
            found.append((i, torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)))
    norms: list[Optional[float]] = [None] * len(items)
    if found:
        values = torch.stack([norm.to(found[0][1].device) for _, norm in found]).tolist()
        for (i, _), value in zip(found, values):
            norms[i] = value
    return norms


def _finding(name: str, kind: FindingKind, verdict: Verdict) -> Finding:
    """One group's finding: the ranks off the majority (up to 8 named, and how many), the norm
    of the first one's copy and of the majority's."""
    first = verdict.off_first
    norms = []
    if verdict.off_norm is not None:
        norms.append((first, verdict.off_norm))
    if verdict.other_rank is not None and verdict.other_norm is not None:
        norms.append((verdict.other_rank, verdict.other_norm))
    return Finding(
        name,
        kind,
        verdict.off_ranks,
        distinct=verdict.distinct,
        norms=tuple(norms),
        count=verdict.off_count,
        holders=verdict.holders,
    )


def _stale(records: Sequence[ParamRecord], me: int, layout: AuditLayout) -> list[Finding]:
    """On this rank: the model weights that are not the rounding of the main they hold (one
    host sync for all of them)."""
    pairs = []
    for record in records:
        main = _own_main(record, layout)
        if main is None or main.dtype == record.param.dtype:
            continue
        whole = _weight(record, layout).view(-1)
        weight = whole[record.offset : record.offset + main.numel()]
        pairs.append((record, weight, main.view(-1)))
    if not pairs:
        return []
    device = pairs[0][1].device
    counts = torch.stack([stale_elements(w, m).to(device) for _, w, m in pairs]).tolist()
    return [
        Finding(
            record.global_name,
            FindingKind.WEIGHT_STALE,
            (me,),
            elements=int(count),
            count=1,
            max_abs_diff=largest_difference(weight, main),
        )
        for (record, weight, main), count in zip(pairs, counts)
        if count
    ]
