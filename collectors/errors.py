"""The collector's error log: every counted error keeps its text, in the log and in the run.

A count alone (``mismatch/collector_errors``) tells a user *that* steps were lost, never why.
Each error is therefore logged (once per distinct message, with the running count) and kept as
one row of the run's ``errors`` table (``store/schema.py``: step, wall_time, where, kind,
message), which ``mismatch-monitor summary`` and the dashboard's Overview show.

What is counted is bad *data* and a failing environment (a full disk, a store that cannot be
written). A programming error (``PROGRAMMING_ERRORS``: a NameError, an AttributeError, a
TypeError deep in the computation, ...) is a bug in mismatch-monitor or in an evaluator handed to
it, not something about the batch: the collector keeps its row in the run and raises it in every
mode, so a bug is found rather than read as "step N was not recorded" on every step.
"""

from __future__ import annotations

import logging
from typing import Any

from ..batch_checks import BatchError

log = logging.getLogger("mismatch_monitor")


#: Exceptions that say the code is wrong, whatever the data: raised by the collector in every mode.
PROGRAMMING_ERRORS: tuple[type[BaseException], ...] = (
    NameError, AttributeError, TypeError, KeyError, IndexError, AssertionError, ZeroDivisionError,
    ImportError, NotImplementedError, RecursionError)

RAISED = "raised: a programming error, not bad data"


def is_programming_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a bug rather than bad data (a ``BatchError`` is always data)."""
    return isinstance(exc, PROGRAMMING_ERRORS) and not isinstance(exc, BatchError)


class ErrorLog:
    """Counts errors by kind, logs each distinct one once, and gives each its stored row."""

    def __init__(self) -> None:
        self.count = 0
        self.by_kind: dict[str, int] = {}
        self.last: str | None = None
        self._seen: set[str] = set()

    def note(self, where: str, exc: BaseException, *, step: int | None, wall_time: float,
             raised: bool = False) -> dict[str, Any]:
        """Count ``exc`` (``where``: what failed, e.g. ``step 3 was not recorded``); its row.
        ``raised``: the caller raises it next (its traceback is the log line)."""
        return self.add(where, type(exc).__name__, str(exc), step=step, wall_time=wall_time, raised=raised)

    def add(self, where: str, kind: str, message: str, *, step: int | None, wall_time: float,
            raised: bool = False) -> dict[str, Any]:
        """Count an error known by its class name and text (one that arrived from another rank)."""
        text = f"{kind}: {message}"
        self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.last = f"{where}: {text}"
        if not raised and text not in self._seen:
            self._seen.add(text)
            log.error("mismatch-monitor: %s: %s (logged once; %d error(s) so far; the run's errors "
                      "table keeps every one; pass strict=True to raise)", where, text, self.count)
        return {"step": step, "wall_time": float(wall_time), "where": where, "kind": kind, "message": message}
