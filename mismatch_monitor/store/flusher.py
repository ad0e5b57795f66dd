"""The run writer's flush queue: the buffer of unwritten steps, the one background flush in
flight, what a failing disk does to them, and the errors kept for ``RunWriter.take_errors``.

Ownership and locking (one lock; nothing here is read or written without it, except as noted):
- ``lock`` (:class:`DeferringLock`, re-entrant) is created here and shared with the writer,
  which holds it around each of its public calls (so one call is one critical section, as a
  signal handler sees it) and hands it to ``SignalFlush``. The public methods below take it
  themselves too; the ``_`` methods are called with it held.
- Under ``lock``, owned by the queue: ``_pending`` (the unwritten steps), ``_appends``,
  ``_inflight`` (the future of the flush in flight and the steps it writes), ``_executor``,
  ``_errors``, ``faults`` and ``_last_flush``.
- ``info`` is the writer's run.json content; the queue only adds the dropped-step count to it
  (and writes run.json then), under ``lock`` like every other change of it.
- The flush thread never takes ``lock``: it owns the ``_Pending`` it was given until its future
  is done (meanwhile others only count its ``steps``, which it does not change; ``_collect``
  takes it back), so waiting for it under ``lock`` cannot deadlock. It
  sets ``_flush_thread`` (its ident) without the lock; that is only compared with the caller's
  own ident (``on_flush_thread``), which a half-seen value cannot make equal.
- Order: ``lock`` is the only lock of the writer's Python state, taken first; under it a call
  may wait for the flush thread (``_collect``, ``drain``), which holds no lock of ours. The run
  lock (a file lock) is taken before the queue exists and released by ``close`` under ``lock``.
- Each write in flight holds the queue (the executor's task is a bound method) and so the run
  lock: a writer dropped without ``close()`` keeps its run directory until the write has ended.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from .atomic import write_json_atomic
from .faults import Backoff, WriteFaults
from .flush_files import write_flush
from .ids import IdSource
from .pending import DeferredTables, FlushError, _Pending
from .runinfo import RUN_FILE
from .runlock import RunLock
from .schema import LOG_TABLES
from .signals import DeferringLock


class FlushQueue:
    def __init__(self, run_dir: Path, info: dict[str, Any], ids: IdSource, run_lock: RunLock, *,
                 clock: Callable[[], float], last_flush: float, flush_every_steps: int,
                 flush_every_seconds: float, background: bool, max_buffered_steps: int,
                 retry: Backoff) -> None:
        self.run_dir = run_dir
        self.info = info
        self._ids = ids
        self._run_lock = run_lock                 # see the module docstring: held by a write in flight
        self._clock = clock
        self._flush_every_steps = flush_every_steps
        self._flush_every_seconds = flush_every_seconds
        self._background = background
        self._max_buffered = max_buffered_steps
        self.faults = WriteFaults(retry)
        self._pending = _Pending()
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: tuple[Future[int], _Pending] | None = None
        self._errors: list[FlushError] = []
        self._appends = 0                         # numbers every added step
        self._flush_thread: int | None = None     # ident of the background flush thread
        self._last_flush = last_flush            # the clock's reading when the writer started
        self.lock = DeferringLock()               # re-entrant; a signal waits for the main thread to leave it

    # ------------------------------------------------------------------ buffering
    def add_step(self, step: int, tables: Mapping[str, pd.DataFrame],
                 exemplars: Mapping[str, pd.DataFrame] | DeferredTables | None, row: dict[str, Any]) -> None:
        """Buffer one step (its stats tables, exemplars and index row); flush if that is due."""
        with self.lock:
            if self._inflight is not None and self._inflight[0].done():
                self._collect()                   # a finished flush's outcome, without waiting
            self._appends += 1
            append = self._appends
            buffer = self._pending.buffer
            for table, df in tables.items():
                if len(df):
                    buffer[table].append((step, append, df))
            if hasattr(exemplars, "frames_of"):
                self._pending.deferred.append((step, append, exemplars))
            else:
                for table, df in (exemplars or {}).items():
                    if len(df):
                        buffer[table].append((step, append, df))
            self._pending.steps.append(row)
            self._pending.appends.append(append)
            self._bound()
            if self._due():
                self._flush_due()

    def add_rows(self, table: str, df: pd.DataFrame) -> None:
        """Buffer rows that carry their own step (alerts, errors, events, outcomes)."""
        with self.lock:
            self._pending.buffer[table].append((None, None, df))

    def _has_log_rows(self) -> bool:
        return any(self._pending.buffer[t] for t in LOG_TABLES)

    def _due(self) -> bool:
        if not self.faults.may_retry():           # a failing disk is retried after a backoff
            return False
        return (len(self._pending.steps) >= self._flush_every_steps
                or self._clock() - self._last_flush >= self._flush_every_seconds)

    def flush_if_due(self) -> None:
        with self.lock:
            if self._inflight is not None and self._inflight[0].done():
                self._collect()
            if (self._pending.steps or self._has_log_rows()) and self._due():
                self._flush_due()

    # ------------------------------------------------------------------ failure bookkeeping
    def _bound(self) -> None:
        """While the disk refuses writes, keep at most ``max_buffered_steps`` unwritten steps:
        drop the oldest not being written, and count them (reported when the episode ends)."""
        if not self.faults.failing:               # otherwise a flush in flight bounds the backlog
            return
        inflight = len(self._inflight[1].steps) if self._inflight is not None else 0
        over = min(len(self._pending.steps) + inflight - self._max_buffered, len(self._pending.steps))
        if over > 0:
            self.faults.dropped(self._pending.drop_oldest(over))

    def _failed(self, pending: _Pending, exc: BaseException, *, report: bool = True) -> None:
        """A flush failed: its steps go back in front; the first failure of an episode is reported."""
        self._restore(pending)
        if self.faults.failed() and report:
            error = FlushError(
                f"writing {pending.step_range()} failed; they are kept and written again when the disk takes "
                f"them (retried with backoff; at most {self._max_buffered} unwritten steps are kept, beyond "
                f"that the oldest are dropped and counted; reported once until a write succeeds): "
                f"{type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._errors.append(error)
        self._bound()
        self._pending.prune_built()

    def _succeeded(self, written: int) -> None:
        if self.faults.failing:
            message = self.faults.recovered(written, str(self.run_dir))
            if message is not None:
                self._errors.append(FlushError(message))
            self._save_dropped()

    def fold_dropped(self) -> None:
        """Move the steps dropped since the last call into ``info["dropped_steps"]``."""
        with self.lock:
            if self.faults.dropped_total:
                self.info["dropped_steps"] = int(self.info.get("dropped_steps", 0)) + self.faults.dropped_total
                self.faults.dropped_total = 0

    def _save_dropped(self) -> None:
        """Record the run's dropped-step count in run.json (best effort: the disk may be full)."""
        if self.faults.dropped_total:
            self.fold_dropped()
            try:
                write_json_atomic(self.info, self.run_dir / RUN_FILE)
            except OSError:
                pass                              # written again with the next run.json

    @property
    def dropped_steps(self) -> int:
        with self.lock:
            return int(self.info.get("dropped_steps", 0)) + self.faults.dropped_total

    @property
    def pending_steps(self) -> int:
        with self.lock:
            inflight = len(self._inflight[1].steps) if self._inflight is not None else 0
            return len(self._pending.steps) + inflight

    def report(self, error: FlushError) -> None:
        with self.lock:
            self._errors.append(error)

    def take_errors(self) -> list[FlushError]:
        with self.lock:
            errors, self._errors = self._errors, []
            return errors

    # ------------------------------------------------------------------ flushing
    def flush(self, *, raise_errors: bool = True) -> int:
        """Write every buffered step (see ``RunWriter.flush``); how many became visible."""
        with self.lock:
            self._last_flush = self._clock()
            done = self._collect()
            pending = self._take()
            if pending is None:
                return done
            try:
                written = write_flush(self.run_dir, self._ids, pending)
            except BaseException as exc:
                self._failed(pending, exc, report=not raise_errors)
                if raise_errors:
                    raise
                return done
            self._succeeded(written)
            self._keep_errors(pending)
            return done + written

    def _flush_due(self) -> None:
        self._last_flush = self._clock()
        if not self._background:
            self.flush(raise_errors=False)        # a failure is kept for take_errors, as in the background
            return
        self._collect()                                  # one flush in flight at a time, in order
        pending = self._take()
        if pending is None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mismatch-monitor-flush")
        try:
            self._inflight = (self._executor.submit(self._write_in_background, pending), pending)
        except RuntimeError:                             # interpreter shutting down: write here
            self._restore(pending)
            self.flush()

    def _collect(self) -> int:
        """Wait for the background flush in flight; a failed one gives its steps back."""
        if self._inflight is None:
            return 0
        future, pending = self._inflight
        self._inflight = None
        try:
            written = future.result()
        except BaseException as exc:
            self._failed(pending, exc)
            return 0
        self._succeeded(written)
        self._keep_errors(pending)
        return written

    def _keep_errors(self, pending: _Pending) -> None:
        self._errors.extend(pending.errors)
        pending.errors.clear()

    def _take(self) -> _Pending | None:
        if not self._pending.steps and not self._has_log_rows():
            return None
        pending, self._pending = self._pending, _Pending()
        return pending

    def _restore(self, older: _Pending) -> None:
        """Put steps of a failed flush back in front of what arrived since."""
        older.extend(self._pending)
        self._pending = older

    def _write_in_background(self, pending: _Pending) -> int:
        self._flush_thread = threading.get_ident()
        return write_flush(self.run_dir, self._ids, pending)

    def on_flush_thread(self) -> bool:
        """Is the caller the background flush thread (which must not wait for itself)?"""
        return self._flush_thread is not None and threading.get_ident() == self._flush_thread

    # ------------------------------------------------------------------ closing
    def drain(self, *, raise_errors: bool) -> str | None:
        """For close: write everything, end the flush thread; with ``raise_errors=False`` steps
        the disk still refuses are dropped and counted. The gave-up message, if one was kept."""
        with self.lock:
            try:
                self.flush(raise_errors=raise_errors)
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
            if self._inflight is not None:        # a flush the timer started meanwhile
                self._collect()
            gave_up = None
            if self._pending.steps:               # raise_errors=False and the disk still refuses
                gave_up = self.faults.gave_up([r["step"] for r in self._pending.steps], str(self.run_dir))
                self._pending = _Pending()
                if gave_up is not None:
                    self._errors.append(FlushError(gave_up))
            return gave_up
