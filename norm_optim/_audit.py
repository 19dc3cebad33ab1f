"""The audit: are the copies the counting rule skips really equal, and are the weights current?

The counting rule counts one copy of every element and *assumes* the copies it skips are equal
(:class:`~norm_optim._ownership.Copies`): data- and context-parallel replicas, expert-data-
parallel replicas, (expert-)TP duplicates of what TP does not split, tied copies, and on every
rank the model weight that is the rounding of the fp32 main (or main shard) it holds. When one
breaks, the norm and the training are silently wrong. :func:`run_audit` checks them all:

1. one pass over this rank's tensors: a bitwise fingerprint of every model weight and every
   fp32 main that has storage of its own (:mod:`norm_optim._kernels.fingerprint`), and, for
   every main this rank holds, the count of weight elements that are not its rounding;
2. per group of copies (:class:`~norm_optim._megatron.audit.AuditLayout`): one all-gather of
   the slot count, one of the slots (8 int64 per param): sized by params, never by elements;
3. one all-reduce of the number of findings over the reduction group and, only when there are
   any, one object all-gather of them, so that every rank returns the same findings.

Every rank enters the same collectives whatever it holds (an empty list still gathers).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Optional, Sequence

import torch

from ._comm import Communicator, ProcessGroup
from ._errors import NormOptimError
from ._kernels.fingerprint import FingerprintPass, largest_difference, stale_elements
from ._megatron.audit import AuditLayout
from ._registry import ParamRecord


class FindingKind(str, enum.Enum):
    """What a :class:`Finding` says differs."""

    DP_REPLICAS_DIFFER = "dp-replicas-differ"  # a dense weight across DP×CP ranks
    EXPERT_DP_REPLICAS_DIFFER = "expert-dp-replicas-differ"  # an expert weight across expert-DP
    TP_DUPLICATES_DIFFER = "tp-duplicates-differ"  # a weight TP does not split, across TP
    EXPERT_TP_DUPLICATES_DIFFER = "expert-tp-duplicates-differ"  # the same across expert-TP
    GTP_COPIES_DIFFER = "gtp-copies-differ"  # a weight GTP does not shard, across (expert) GTP
    MESH_REPLICAS_DIFFER = "mesh-replicas-differ"  # a DTensor across a Replicate mesh axis
    TIED_COPIES_DIFFER = "tied-copies-differ"  # word embeddings vs the output weight tied to them
    MAIN_REPLICAS_DIFFER = "main-replicas-differ"  # fp32 mains (or one shard) across (expert) DP
    MAIN_TP_DUPLICATES_DIFFER = "main-tp-duplicates-differ"  # fp32 mains of TP duplicates
    WEIGHT_STALE = "weight-stale-against-main"  # weight != rounding of the main this rank holds
    NOT_COMPARABLE = "copies-not-comparable"  # peers of a group hold different param lists

    def __str__(self) -> str:
        return str(self.value)


class AuditError(NormOptimError):
    """Raised by :meth:`AuditReport.raise_for_findings` when copies differ."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One group of copies that are not equal, or one stale weight.

    Attributes:
        param: the layout-independent name (the keys of ``param_l2_norms(per_param=True)``).
        kind: what differs (:class:`FindingKind`).
        ranks: global ranks involved: those whose copy differs from the majority's, or every
            holder when there is no majority (two copies); the rank itself for a stale weight.
        distinct: how many different fingerprints the copies have.
        elements: for a stale weight, how many elements are not the rounding of the main.
        max_abs_diff: for a stale weight, the largest |weight - rounding of main|.
        norms: (global rank, L2 norm of its copy) for every holder: how far apart the copies
            are at least (|‖a‖ - ‖b‖| <= ‖a - b‖).
    """

    param: str
    kind: FindingKind
    ranks: tuple[int, ...]
    distinct: int = 1
    elements: Optional[int] = None
    max_abs_diff: Optional[float] = None
    norms: tuple[tuple[int, float], ...] = ()

    def __str__(self) -> str:
        far = (
            f"{self.elements} elements, max |diff| {self.max_abs_diff:.3g}"
            if self.elements is not None
            else f"{self.distinct} distinct fingerprints"
        )
        norms = ", ".join(f"rank {r}: {n:.9g}" for r, n in self.norms)
        return f"{self.kind} {self.param!r} on ranks {list(self.ranks)}: {far}" + (
            f" (norms {norms})" if norms else ""
        )


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What :meth:`~norm_optim.NormAwareOptimizer.audit` found; ``ok`` and ``findings`` are the
    same on every rank.

    Attributes:
        findings: every copy group that differs and every stale weight, sorted.
        left_out: (param, why) for weights this rank could not compare now (e.g. an
            overlap-param-gather all-gather may be in flight); this rank's own list.
        compared: how many copy groups of each check this rank took part in (its own count).
    """

    findings: tuple[Finding, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    compared: tuple[tuple[str, int], ...] = ()

    @property
    def ok(self) -> bool:
        """True when no copy differs and no weight is stale."""
        return not self.findings

    def summary(self) -> str:
        """One line, then one per finding."""
        head = (
            f"audit: {len(self.findings)} findings; compared "
            + ", ".join(f"{n} {k}" for k, n in self.compared)
            + (f"; {len(self.left_out)} weights left out here" if self.left_out else "")
        )
        return "\n".join([head, *(f"  {f}" for f in self.findings)])

    def raise_for_findings(self) -> None:
        """Raise :class:`AuditError` listing the findings, if there are any."""
        if self.findings:
            raise AuditError(self.summary())


@dataclasses.dataclass(frozen=True)
class _Check:
    """One group of copies to compare: which records, over which group, named how."""

    label: str
    group: ProcessGroup
    records: Sequence[ParamRecord]
    weight_kind: FindingKind
    main_kind: FindingKind
    by_name: bool = True


# Slot columns (int64): name hash, flags, weight fingerprint (2), main fingerprint (2), main
# offset, main numel.
_WIDTH = 8
_WEIGHT_OK, _HAS_MAIN = 1, 2


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
            findings += _compare(check, weights, mains, comm, me, layout)
    left_out = tuple(
        (r.global_name, "overlap-param-gather: its all-gather may be in flight")
        for r in records
        if id(r.param) in layout.gathering
    )
    return AuditReport(_agree(findings, comm, group), left_out, tuple(compared))


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
    copies = record.copies
    if copies is None or layout.single:
        return not layout.single
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
            [r for r in dense if not _tp_split(r)],
            kinds.TP_DUPLICATES_DIFFER,
            kinds.MAIN_TP_DUPLICATES_DIFFER,
        ),
        _Check(
            "expert-tp-duplicates",
            layout.expert_tp,
            [r for r in expert if not _tp_split(r)],
            kinds.EXPERT_TP_DUPLICATES_DIFFER,
            kinds.MAIN_TP_DUPLICATES_DIFFER,
        ),
        _Check(
            "gtp-copies",
            layout.dense_gtp,
            [r for r in dense if not _gtp_sharded(r)],
            kinds.GTP_COPIES_DIFFER,
            kinds.GTP_COPIES_DIFFER,
        ),
        _Check(
            "expert-gtp-copies",
            layout.expert_gtp,
            [r for r in expert if not _gtp_sharded(r)],
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


def _gtp_sharded(record: ParamRecord) -> bool:
    return record.copies.gtp_sharded if record.copies is not None else False


def _tp_split(record: ParamRecord) -> bool:
    return record.copies.tp_split if record.copies is not None else record.tp_split


def _name_hash(name: str) -> int:
    """A 63-bit digest of a name, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def _slots(
    check: _Check,
    weights: dict[int, torch.Tensor],
    mains: dict[int, torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """This rank's ``[params, 8]`` int64 slot table for ``check``: the names, flags and ranges
    built on the host in one tensor, the fingerprints stacked on the device (two transfers in
    all, never one per param)."""
    if not check.records:
        return torch.zeros((0, _WIDTH), dtype=torch.int64, device=device)
    zero = torch.zeros(2, dtype=torch.int64, device=device)
    heads, prints = [], []
    for record in check.records:
        key = id(record.param)
        weight, main = weights.get(key), mains.get(key)
        flags = (_WEIGHT_OK if weight is not None else 0) | (_HAS_MAIN if main is not None else 0)
        numel = record.tensor.numel() if main is not None and record.tensor is not None else 0
        heads.append(
            [
                _name_hash(record.global_name) if check.by_name else 0,
                flags,
                record.offset if main is not None else 0,
                numel,
            ]
        )
        prints.append(weight.to(device) if weight is not None else zero)
        prints.append(main.to(device) if main is not None else zero)
    head = torch.tensor(heads, dtype=torch.int64).to(device)
    fingerprints = torch.stack(prints).view(len(heads), 4)
    # Columns: name hash, flags, weight fingerprint (2), main fingerprint (2), main range (2).
    return torch.cat([head[:, :2], fingerprints, head[:, 2:]], dim=1)


def _compare(
    check: _Check,
    weights: dict[int, torch.Tensor],
    mains: dict[int, torch.Tensor],
    comm: Communicator,
    me: int,
    layout: AuditLayout,
) -> list[Finding]:
    """Gather ``check``'s slots over its group and find the copies that differ (every member
    finds the same); two all-gathers."""
    device = comm.device(check.group)
    slots = _slots(check, weights, mains, device)
    header = torch.tensor([slots.shape[0], me], dtype=torch.int64, device=device)
    heads = comm.all_gather_tensor(header, check.group).tolist()
    ranks = [int(rank) for _, rank in heads]
    if len({int(n) for n, _ in heads}) > 1:
        return [
            Finding(
                f"<{check.label}: {[int(n) for n, _ in heads]} params>",
                FindingKind.NOT_COMPARABLE,
                tuple(sorted(ranks)),
                distinct=len({int(n) for n, _ in heads}),
            )
        ]
    if slots.shape[0] == 0 or len(ranks) == 1:
        return []
    table = comm.all_gather_tensor(slots, check.group)  # [group size, params, _WIDTH]
    return [
        finding
        for index in _suspects(table)
        for finding in _explain(check, table[:, index].tolist(), ranks, index, me, layout)
    ]


def _suspects(table: torch.Tensor) -> list[int]:
    """Slots where some two holders disagree: names, weights, or two mains of the same range
    (vectorized; only these are looked at one by one)."""
    flags = table[..., 1]
    bad = (table[..., 0] != table[:1, :, 0]).any(0)
    weight_ok = (flags & _WEIGHT_OK).bool().all(0)
    bad |= weight_ok & (table[..., 2:4] != table[:1, :, 2:4]).any(-1).any(0)
    has_main = (flags & _HAS_MAIN).bool()
    for k in range(table.shape[0]):  # each holder against the others holding the same range
        same_range = (table[..., 6:8] == table[k : k + 1, :, 6:8]).all(-1) & has_main & has_main[k]
        differ = (table[..., 4:6] != table[k : k + 1, :, 4:6]).any(-1)
        bad |= (same_range & differ).any(0)
    return bad.nonzero().flatten().tolist()


def _explain(
    check: _Check,
    rows: list[list[int]],
    ranks: list[int],
    index: int,
    me: int,
    layout: AuditLayout,
) -> list[Finding]:
    """The findings of one suspect slot (``rows``: each holder's slot, in group order), with
    the norm of this rank's copy attached (merged with the others' in :func:`_agree`)."""
    record = check.records[index]
    name = record.global_name
    if len({row[0] for row in rows}) > 1:
        return [Finding(name, FindingKind.NOT_COMPARABLE, tuple(sorted(ranks)), len(rows))]
    found = []
    if all(row[1] & _WEIGHT_OK for row in rows):
        holders = [(r, tuple(row[2:4])) for r, row in zip(ranks, rows)]
        weight = _weight(record, layout)
        found += _with_norm(_differing(name, check.weight_kind, holders), me, weight)
    by_range: dict[tuple[int, int], list[tuple[int, tuple]]] = {}
    for rank, row in zip(ranks, rows):
        if row[1] & _HAS_MAIN:
            by_range.setdefault((row[6], row[7]), []).append((rank, tuple(row[4:6])))
    for holders in by_range.values():
        mine = me in [rank for rank, _ in holders]
        main = _own_main(record, layout) if mine else None
        found += _with_norm(_differing(name, check.main_kind, holders), me, main)
    return found


def _with_norm(findings: list[Finding], me: int, tensor: Optional[torch.Tensor]) -> list[Finding]:
    if tensor is None or not findings:
        return findings
    norm = float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64))
    return [dataclasses.replace(f, norms=((me, norm),)) for f in findings]


def _differing(name: str, kind: FindingKind, holders: list[tuple[int, tuple]]) -> list[Finding]:
    """A finding when the holders' fingerprints are not all equal: the ranks off the majority
    value, or all of them when no value has a majority."""
    values = [value for _, value in holders]
    distinct = set(values)
    if len(distinct) < 2:
        return []
    common = max(distinct, key=values.count)
    if values.count(common) * 2 > len(values):
        involved = [rank for rank, value in holders if value != common]
    else:
        involved = [rank for rank, _ in holders]
    return [Finding(name, kind, tuple(sorted(involved)), len(distinct))]


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
            max_abs_diff=largest_difference(weight, main),
        )
        for (record, weight, main), count in zip(pairs, counts)
        if count
    ]


def _agree(findings: list[Finding], comm: Communicator, group: ProcessGroup) -> tuple[Finding, ...]:
    """Every rank's findings, on every rank: one all-reduce of the count, and an object
    all-gather only when there is something to tell."""
    count = torch.tensor([float(len(findings))], dtype=torch.float64, device=comm.device(group))
    comm.all_reduce_sum(count, group, async_op=False).wait()
    if float(count) == 0:
        return ()
    merged: dict[tuple[str, str, tuple[int, ...]], Finding] = {}
    for part in comm.all_gather_object(findings, group):
        for finding in part:
            key = (str(finding.kind), finding.param, finding.ranks)
            known = merged.setdefault(key, finding)
            if known is not finding and finding.norms:
                norms = tuple(sorted(set(known.norms) | set(finding.norms)))
                merged[key] = dataclasses.replace(known, norms=norms)
    return tuple(merged[key] for key in sorted(merged))
