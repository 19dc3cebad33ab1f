"""What the audit reports: the kinds of finding, one finding, and the report of one call.

A finding names a group of copies that differ by the ranks off the majority (the first and
last of them, and how many), never by a list of every holder: its size is the same at 2 ranks
and at 16,384. The report shows at most :data:`REPORT_CAP` findings and counts the rest.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from .._errors import NormOptimError

REPORT_CAP = 64  # findings a report shows; the rest are counted in ``AuditReport.omitted``


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


KINDS = tuple(FindingKind)


class AuditError(NormOptimError):
    """Raised by :meth:`AuditReport.raise_for_findings` when copies differ."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One param whose copies are not equal, or whose weight is stale, on some ranks.

    Findings of the same param and kind from several copy groups (e.g. the DP groups of every
    TP rank, when a whole replica drifted) are one finding.

    Attributes:
        param: the layout-independent name (the keys of ``param_l2_norms(per_param=True)``).
        kind: what differs (:class:`FindingKind`).
        ranks: global ranks whose copy differs from the majority's, or of every side when no
            value has a majority (two copies: a tie names both); the stale ranks for a stale
            weight. At most 8 are named (the first and last of each class of rank % 4: all
            of them when 8 or fewer are off); ``count`` says how many there are in all.
        distinct: how many different fingerprints the copies have (at least; values other
            than the smallest and largest are counted as one).
        elements: for a stale weight, how many elements are not the rounding of the main
            (summed over the stale ranks).
        max_abs_diff: for a stale weight, the largest |weight - rounding of main|.
        norms: (global rank, L2 norm of its copy, to float32 precision) of the first off-majority
            copy and of the majority's (or, in a tie, of each side): how far apart the copies
            are at least (|‖a‖ - ‖b‖| <= ‖a - b‖).
        count: how many ranks the finding concerns (``len(ranks)`` when 0).
        holders: how many copies were compared (0 when not known, e.g. a stale weight).
    """

    param: str
    kind: FindingKind
    ranks: tuple[int, ...]
    distinct: int = 1
    elements: Optional[int] = None
    max_abs_diff: Optional[float] = None
    norms: tuple[tuple[int, float], ...] = ()
    count: int = 0
    holders: int = 0

    @property
    def num_ranks(self) -> int:
        """How many ranks the finding concerns (``ranks`` names at most two of them)."""
        return self.count or len(self.ranks)

    def __str__(self) -> str:
        far = (
            f"{self.elements} elements, max |diff| {self.max_abs_diff:.3g}"
            if self.elements is not None
            else f"{self.distinct} distinct fingerprints"
        )
        more = self.num_ranks - len(self.ranks)
        where = f"ranks {list(self.ranks)}" + (f" (+{more} more)" if more > 0 else "")
        of = f" of {self.holders} copies" if self.holders else ""
        norms = ", ".join(f"rank {r}: {n:.7g}" for r, n in self.norms)
        return f"{self.kind} {self.param!r} on {where}{of}: {far}" + (
            f" (norms {norms})" if norms else ""
        )


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What :meth:`~norm_optim.NormAwareOptimizer.audit` found; ``ok``, ``findings`` and
    ``omitted`` are the same on every rank.

    Attributes:
        findings: the copy groups that differ and the stale weights, sorted, at most
            :data:`REPORT_CAP` of them.
        left_out: (param, why) for weights this rank could not compare now (e.g. an
            overlap-param-gather all-gather may be in flight); this rank's own list.
        compared: how many copy groups of each check this rank took part in (its own count).
        omitted: how many more findings (one per copy group, or per stale rank) were found
            than ``findings`` shows.
    """

    findings: tuple[Finding, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    compared: tuple[tuple[str, int], ...] = ()
    omitted: int = 0

    @property
    def ok(self) -> bool:
        """True when no copy differs and no weight is stale."""
        return not self.findings and not self.omitted

    def summary(self) -> str:
        """One line, then one per finding (bounded: at most :data:`REPORT_CAP` lines)."""
        head = (
            f"audit: {len(self.findings)} findings"
            + (f" (and {self.omitted} more not shown)" if self.omitted else "")
            + "; compared "
            + ", ".join(f"{n} {k}" for k, n in self.compared)
            + (f"; {len(self.left_out)} weights left out here" if self.left_out else "")
        )
        return "\n".join([head, *(f"  {f}" for f in self.findings)])

    def raise_for_findings(self) -> None:
        """Raise :class:`AuditError` listing the findings, if there are any."""
        if not self.ok:
            raise AuditError(self.summary())
