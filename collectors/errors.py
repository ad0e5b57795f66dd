"""The collector's error log: every counted error keeps its text, in the log and in the run.

A count alone (``mismatch/collector_errors``) tells a user *that* steps were lost, never why.
Each error is therefore logged (once per distinct message, with the running count) and kept as
one row of the run's ``errors`` table (``store/schema.py``: step, wall_time, where, kind,
message), which ``mismatch-monitor summary`` and the dashboard's Overview show.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("mismatch_monitor")


class ErrorLog:
    """Counts errors by kind, logs each distinct one once, and gives each its stored row."""

    def __init__(self) -> None:
        self.count = 0
        self.by_kind: dict[str, int] = {}
        self.last: str | None = None
        self._seen: set[str] = set()

    def note(self, where: str, exc: BaseException, *, step: int | None, wall_time: float) -> dict[str, Any]:
        """Count ``exc`` (``where``: what failed, e.g. ``step 3 was not recorded``); its row."""
        return self.add(where, type(exc).__name__, str(exc), step=step, wall_time=wall_time)

    def add(self, where: str, kind: str, message: str, *, step: int | None, wall_time: float) -> dict[str, Any]:
        """Count an error known by its class name and text (one that arrived from another rank)."""
        text = f"{kind}: {message}"
        self.count += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.last = f"{where}: {text}"
        if text not in self._seen:
            self._seen.add(text)
            log.error("mismatch-monitor: %s: %s (logged once; %d error(s) so far; the run's errors "
                      "table keeps every one; pass strict=True to raise)", where, text, self.count)
        return {"step": step, "wall_time": float(wall_time), "where": where, "kind": kind, "message": message}
