"""The resume proof's comparison: what differs between the fingerprints saved with a checkpoint
and those read after its load, and, where it can tell, why (:class:`ResumeReport`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from .fingerprint import MOMENTS, PARAM, SCALARS, STATES, Entry, StateFingerprint

SHOWN = 16
"""How many differing (param, state) pairs a report names (the rest are counted)."""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One (param, state) whose fingerprint after the load is not the saved one."""

    name: str
    state: str
    saved: Optional[Entry]
    loaded: Optional[Entry]

    def __str__(self) -> str:
        def norm(e: Optional[Entry]) -> str:
            return "absent" if e is None else f"{e.norm:.6g}"

        extra = ""
        if self.saved and self.loaded and self.saved.dtype != self.loaded.dtype:
            extra = f", dtype {self.saved.dtype} -> {self.loaded.dtype}"
        return (
            f"{self.name}[{self.state}] (norm saved {norm(self.saved)}, loaded "
            f"{norm(self.loaded)}{extra})"
        )


@dataclasses.dataclass(frozen=True)
class ResumeReport:
    """What a load put into the optimizer, compared with what was saved.

    Attributes:
        iteration: the iteration loaded.
        count: how many (param, state) pairs differ.
        shown: the first :data:`SHOWN` of them, by param name.
        causes: what the differences say, in words (empty when nothing differs).
        scalars: each scalar that changed, as (name, saved, loaded).
        optimizer_loaded: False when the load skipped the optimizer on purpose: only the
            weights (``param``) were compared.
        compared: False when there was nothing to compare with (no saved fingerprints).
    """

    iteration: int
    count: int = 0
    shown: tuple[Mismatch, ...] = ()
    causes: tuple[str, ...] = ()
    scalars: tuple[tuple[str, Any, Any], ...] = ()
    optimizer_loaded: bool = True
    compared: bool = True

    @property
    def ok(self) -> bool:
        """Whether everything compared is bitwise what was saved."""
        return self.count == 0 and not self.scalars

    def line(self) -> str:
        """The log line: ``norm_optim resume (iteration I): N mismatches...``."""
        head = f"norm_optim resume (iteration {self.iteration}):"
        if not self.compared:
            return f"{head} no saved state fingerprints beside the checkpoint to compare with"
        text = f"{head} {self.count} mismatches"
        if self.shown:
            more = self.count - len(self.shown)
            text += ": " + ", ".join(str(m) for m in self.shown)
            text += f" and {more} more" if more > 0 else ""
        for name, saved, loaded in self.scalars:
            text += f"; {name} changed: saved {saved}, loaded {loaded}"
        if self.causes:
            text += "; " + "; ".join(self.causes)
        if not self.optimizer_loaded:
            text += "; the optimizer state was not loaded, as asked: only the weights compared"
        elif self.ok:
            text += ": every weight, main param and optimizer state is bitwise as saved"
        return text


def verify_resume(
    saved: StateFingerprint,
    loaded: StateFingerprint,
    iteration: int = 0,
    *,
    optimizer_loaded: bool = True,
) -> ResumeReport:
    """Compare the fingerprints saved with a checkpoint and those read after its load.

    Args:
        saved, loaded: the two fingerprints (e.g. :meth:`StateFingerprint.from_json` of the
            saved file, and :meth:`~norm_optim.NormAwareOptimizer.state_fingerprint` now).
        iteration: the iteration loaded (for the report).
        optimizer_loaded: False for a load that skipped the optimizer on purpose
            (``--no-load-optim``, ``--finetune``): only the weights are compared.
    """
    states = STATES if optimizer_loaded else (PARAM,)
    keys = {k for k in (*saved.entries, *loaded.entries) if k[1] in states}
    differ = [
        Mismatch(name, state, saved.entries.get((name, state)), loaded.entries.get((name, state)))
        for name, state in sorted(keys)
        if not _same(saved.entries.get((name, state)), loaded.entries.get((name, state)))
    ]
    changed: list[tuple[str, Any, Any]] = []
    if optimizer_loaded:
        changed = [
            (name, saved.scalars.get(name), loaded.scalars.get(name))
            for name in SCALARS
            if saved.scalars.get(name) != loaded.scalars.get(name)
        ]
    return ResumeReport(
        iteration,
        len(differ),
        tuple(differ[:SHOWN]),
        tuple(_causes(differ, saved, loaded)),
        tuple(changed),
        optimizer_loaded,
    )


def _same(a: Optional[Entry], b: Optional[Entry]) -> bool:
    return a is not None and b is not None and a.same(b)


def _causes(
    differ: Sequence[Mismatch], saved: StateFingerprint, loaded: StateFingerprint
) -> list[str]:
    """The differences' causes that can be told apart, in words."""
    if not differ:
        return []
    causes: list[str] = []
    saved_names = {name for name, _ in saved.entries}
    loaded_names = {name for name, _ in loaded.entries}
    missing, added = sorted(saved_names - loaded_names), sorted(loaded_names - saved_names)
    if missing or added:
        causes.append(
            f"a different model: {len(missing)} params missing after the load "
            f"{missing[:3]}, {len(added)} added {added[:3]}"
        )
    common = [m for m in differ if m.name in saved_names & loaded_names]
    moments = [m for m in common if m.state in MOMENTS]
    absent = [m for m in moments if m.loaded is None]
    zeroed = [m for m in moments if m.loaded is not None and m.loaded.norm == 0 < _norm(m.saved)]
    if absent:
        causes.append(f"optimizer state absent after the load ({len(absent)} (param, state) pairs)")
    if zeroed:
        causes.append(f"optimizer state reset to zero ({len(zeroed)} (param, state) pairs)")
    dtypes = [m for m in common if m.saved and m.loaded and m.saved.dtype != m.loaded.dtype]
    if dtypes:
        causes.append(f"a dtype changed ({len(dtypes)} pairs, e.g. {dtypes[0]})")
    sizes = [m for m in common if m.saved and m.loaded and m.saved.numel != m.loaded.numel]
    if sizes:
        causes.append(
            f"a shape changed ({len(sizes)} pairs, e.g. {sizes[0].name}: "
            f"{sizes[0].saved.numel if sizes[0].saved else 0} -> "
            f"{sizes[0].loaded.numel if sizes[0].loaded else 0} elements)"
        )
    if common and all(m.state != PARAM for m in common):
        causes.append("the weights are as saved, but mains or moments differ")
    return causes


def _norm(entry: Optional[Entry]) -> float:
    return 0.0 if entry is None else entry.norm
