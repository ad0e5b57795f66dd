"""The collector's ``alerting`` record in run.json (``store/alerting.py``): which evaluator judged
the run's alerts, its rules, and per (alert, pool) what it could judge. Refreshed at most every
``every_seconds`` of the collector's clock while steps are logged, and at each flush and close, so
that a dashboard on a live run reads counts at most that old."""

from __future__ import annotations

from typing import Any

from ..store import RunWriter


def alerting_record(evaluator: Any, through_step: int | None) -> dict[str, Any]:
    """``evaluator``: the collector's (None: no in-process alert evaluation). An evaluator of the
    ``Evaluator`` protocol that has no ``rules`` or ``coverage()`` records null for them.
    ``through_step``: the last step the collector logged; an evaluator's own ``last_step`` wins
    (a restarted run's evaluator replays the stored steps first)."""
    if evaluator is None:
        return {"evaluator": None, "rules": None, "through_step": through_step, "coverage": None}
    through_step = getattr(evaluator, "last_step", through_step)
    kind = type(evaluator)
    rules = getattr(evaluator, "rules", None)
    names = None if rules is None else [str(getattr(r, "name", r)) for r in rules]
    coverage = getattr(evaluator, "coverage", None)
    return {"evaluator": f"{kind.__module__}.{kind.__qualname__}", "rules": names, "through_step": through_step,
            "coverage": None if coverage is None else [dict(row) for row in coverage()]}


class AlertingRecorder:
    """When the collector refreshes the record, and whether the last write failed (a failing
    disk is counted once per episode, not at every retry)."""

    def __init__(self, every_seconds: float) -> None:
        self.every_seconds = every_seconds
        self.failing = False
        self._written_at: float | None = None
        self._through: int | None = None

    def stepped(self, step: int) -> None:
        self._through = step if self._through is None else max(self._through, step)

    def due(self, now: float) -> bool:
        return self._written_at is None or now - self._written_at >= self.every_seconds

    def write(self, writer: RunWriter, evaluator: Any, now: float, *, to_disk: bool = True) -> None:
        """Hand the writer the record (``OSError`` from a failing disk propagates)."""
        self._written_at = now
        writer.update_alerting(alerting_record(evaluator, self._through), write=to_disk)
