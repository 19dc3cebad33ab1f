"""What norm_optim says, kept as lines: its ``logging`` records (logger ``norm_optim`` and its
children), for tests whose code runs in ranks, where pytest's ``caplog`` does not reach (a
rank's records stay in its own process)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


class LogLines(logging.Handler):
    """A handler that keeps each record it gets as ``"<LEVEL> <logger>: <message>"``."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def recorded_log_lines(logger: str = "norm_optim") -> Iterator[list[str]]:
    """The lines of what ``logger`` (and its children) emit inside the block, as a user's
    handler gets them: the loggers' levels and filters apply, nothing is changed."""
    handler = LogLines()
    target = logging.getLogger(logger)
    target.addHandler(handler)
    try:
        yield handler.lines
    finally:
        target.removeHandler(handler)
