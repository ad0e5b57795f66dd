"""How the collector keeps each error it counts: in its log, its count and the run's ``errors`` table.

``MismatchCollector`` takes these methods from :class:`ErrorKeeping`; they read the collector's
``errors`` (an ``ErrorLog``), ``writer``, ``reducer``, ``strict`` and ``_clock``. They are kept
apart from the step path because every part of the collector (steps, events, callbacks, the
store's flushes) reports through them, so a failure is recorded the same way wherever it starts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from .errors import RAISED

if TYPE_CHECKING:
    from ..store import RunWriter
    from .errors import ErrorLog

log = logging.getLogger("mismatch_monitor")


class ErrorKeeping:
    """Counting, logging and storing the collector's errors (see ``errors.py``)."""

    errors: "ErrorLog"
    writer: "RunWriter | None"
    reducer: Any              # Reducer | "auto" | None
    strict: bool
    _clock: Callable[[], float]
    resolve_reducer: Callable[[], None]     # MismatchCollector's: opens the store on the writer rank

    @property
    def error_count(self) -> int:
        return self.errors.count

    @property
    def errors_by_kind(self) -> dict[str, int]:
        return self.errors.by_kind

    @property
    def last_error(self) -> str | None:
        return self.errors.last

    def log_error(self, error: Exception, *, step: int | None = None, where: str = "ingestion") -> None:
        """Count and keep an error that a check outside the collector found in the data (an
        ingestion's token-id disagreement, ``openai_ingest.log_agreement``): logged, counted in
        ``mismatch/collector_errors`` and kept with its text in the run's ``errors`` table;
        ``strict=True`` raises it instead."""
        plain_step = step is None or (isinstance(step, int) and not isinstance(step, bool))
        if not isinstance(error, Exception) or not plain_step:             # a mistake in the call
            raise TypeError(f"expected an Exception and an int or None step, got {error!r} and {step!r}")
        if self.strict:
            raise error
        self.resolve_reducer()
        self._note(where, error, step, self._clock())

    def _note_rejections(self, wall: float) -> None:
        """Count and record the shards of other ranks the writer left out of this step."""
        take = getattr(self.reducer, "take_rejections", None)
        for r in take() if take is not None else []:
            row = self.errors.add(f"rank {r.rank}: step {r.step}: this rank's batch was left out",
                                  r.kind, r.message, step=r.step, wall_time=wall)
            self._store_errors([row])

    def _call(self, fn: Callable[[Any], None], event: Any, where: str, step: int) -> None:
        try:
            fn(event)
        except Exception as exc:
            if self.strict:
                raise
            self._note(f"{where} callback failed", exc, step, self._clock())

    def _check_store(self) -> None:
        """Report what went wrong in the writer's flushes (a failed write's steps stay buffered
        and are written again): each error is counted and logged; strict mode raises the first."""
        errors = self.writer.take_errors() if self.writer is not None else []
        if errors and self.strict:
            raise errors[0]
        for error in errors:
            self._note("the run store", error, None, self._clock())

    def _append_empty(self, step: int | None, wall: float) -> None:
        """Record a step without statistics, so the index shows the error count at that step
        (a step that cannot be stored leaves only its error row)."""
        if step is not None and self.writer is not None and not self.writer.closed:
            try:
                self.writer.append_step(step, None, wall_time=wall, collector_errors=self.errors.count)
            except Exception as inner:  # the store itself failed: say so once, keep training
                self._note("the run store failed", inner, step, wall)

    def _raise_bug(self, exc: BaseException, step: int | None, wall: float) -> NoReturn:
        """A programming error (``errors.is_programming_error``): kept in the run, then raised in
        every mode (the never-raise default is for bad data, not for a bug)."""
        what = "a step" if step is None else f"step {step}"
        self._store_errors([self.errors.note(f"{what}: {RAISED}", exc, step=step, wall_time=wall, raised=True)])
        raise exc

    def _note(self, what: str, exc: BaseException, step: int | None, wall: float) -> None:
        """Count, log (once per message) and store one error."""
        self._store_errors([self.errors.note(what, exc, step=step, wall_time=wall)])

    def _store_errors(self, rows: list[dict[str, Any]]) -> None:
        # only the writer rank stores; another rank's errors reach it with its shard
        if self.writer is not None and not self.writer.closed:
            try:
                self.writer.append_errors(rows)
            except Exception:  # noqa: BLE001 - the count and the log line already hold it
                log.exception("mismatch-monitor: could not keep a collector error in the run")
