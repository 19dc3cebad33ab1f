"""The audit: which copies must be equal and their fingerprints (the run), the findings, their
exchange in fixed-size records, and the decisions every rank takes alike from reduced values.

- :mod:`.run` — ``audit()``: which copies must be equal, their fingerprints, the checks.
- :mod:`.exchange` — every rank's findings on every rank, in fixed-size records.
- :mod:`.findings` — what the audit reports: ``Finding``, ``AuditReport``, ``AuditError``.
- :mod:`.agreement` — decisions taken alike on every rank from reduced values (``min_max``,
  ``vote``).
"""
