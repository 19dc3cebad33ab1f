"""When an installed integration audits, and what it does with the findings:
:class:`AuditSchedule`."""

from __future__ import annotations

import collections
from typing import Any, Optional

from .._audit.findings import AuditError, AuditReport
from ._log import LOGGER, global_rank


AUDIT_TAG = "params-audit/findings"
"""The scalar written at each audit: the number of findings (0 when clean)."""
AUDIT_ACTIONS = ("warn", "raise")
KEPT_REPORTS = 16
"""How many audits :attr:`AuditSchedule.reports` remembers (the latest)."""


def check_audit_options(interval: Any, action: Any) -> None:
    """``audit_interval`` and ``audit_action``, checked (ValueError naming the bad one)."""
    if not isinstance(interval, int) or interval < 0:
        raise ValueError(f"audit_interval must be an int >= 0, got {interval!r}")
    if action not in AUDIT_ACTIONS:
        raise ValueError(f"audit_action must be one of {AUDIT_ACTIONS}, got {action!r}")


class AuditSchedule:
    """When a loop integration audits (:meth:`~norm_optim.NormAwareOptimizer.audit`) and what
    it does with findings: one per integration.

    Args:
        interval: audit every ``interval`` iterations, and at the first logged iteration after
            each setup (so after every checkpoint load); 0 never.
        action: ``"warn"``: rank 0 logs the findings (:data:`LOGGER`, ERROR), the run goes on;
            ``"raise"``: every rank raises :class:`~norm_optim.AuditError` (the report is the
            same everywhere), so the run stops before the bad weights are saved.

    Attributes:
        reports: ``(iteration, number of findings)`` of the latest :data:`KEPT_REPORTS` audits,
            oldest first (a bounded deque: a long run keeps no more); ``reports[-1]`` is the
            last audit's.
        audits: how many audits ran in all.
    """

    def __init__(self, interval: int, action: str) -> None:
        check_audit_options(interval, action)
        self.interval, self.action = interval, action
        self._audited: Optional[Any] = None  # the optimizer audited last (a new setup resets)
        self.reports: collections.deque[tuple[int, int]] = collections.deque(maxlen=KEPT_REPORTS)
        self.audits = 0

    def due(self, optimizer: Any, iteration: int) -> bool:
        """The same answer on every rank (the audit is a collective)."""
        if self.interval == 0:
            return False
        return optimizer is not self._audited or iteration % self.interval == 0

    def run(self, optimizer: Any, iteration: int, tensorboard: Any, wandb: Any) -> AuditReport:
        """Audit on every rank; write the count, print or raise the findings."""
        report: AuditReport = optimizer.audit()
        self._audited = optimizer
        self.reports.append((iteration, len(report.findings)))
        self.audits += 1
        if tensorboard is not None:
            tensorboard.add_scalar(AUDIT_TAG, len(report.findings), iteration)
        if wandb is not None:
            wandb.log({AUDIT_TAG: len(report.findings)}, iteration)
        if report.findings:
            message = f"iteration {iteration}: {report.summary()}"
            if self.action == "raise":
                raise AuditError(message)
            if global_rank() == 0:
                LOGGER.error("norm_optim %s", message)
        return report
