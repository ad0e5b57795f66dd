"""The run writer: buffered, atomic, append-only Parquet files for one run.

Steps are buffered and flushed every ``flush_every_steps`` steps or ``flush_every_seconds``
seconds (checked when a step arrives) and on close. A flush (``flush_files.py``) writes one file
per data table and then the ``steps`` index file: a step is visible to readers only once the
index lists it, so a crash mid-flush leaves orphan data files that readers ignore, and never a
half-visible step. Reopening a run directory appends (``runinfo.open_run_info``); a step logged
again later wins (higher ``write_id``).

The flushes that fall due while steps arrive run on one background thread (``background=True``,
the default), so training does not wait for Parquet encoding and fsync; one flush is in flight
at a time, in order. A flush that fails keeps its steps, which the next flush writes again; its
error is kept for :meth:`take_errors`. ``flush()`` and ``close()`` write everything before they
return and raise what fails. A step logged twice before it is written is written once, as
logged last (a later flush of the same step wins anyway, by its higher ``write_id``).

The buffer, the flush thread and the failure bookkeeping are the flush queue's (``flusher.py``,
which says what its one lock guards and in which order). The writer holds that same lock around
each of its public calls; it owns run.json's content (``info``, changed only under the lock),
its closed state (set under the lock), the flush timer, the signal handlers and the run lock.

What a fleet does to a run besides kill -9: a disk that refuses writes (``faults.py``: at most
``max_buffered_steps`` unwritten steps are kept, the oldest beyond are dropped and counted,
retries back off, ``close(raise_errors=False)`` never raises); SIGTERM/SIGINT and pauses
(``signals.py``: flush, then the previous handler; a timer flushes without a step arriving); a
second writer (``runlock.py``: one writer per run directory); clocks that disagree (``ids.py``:
flush ids follow the run's largest stored id, not the clock).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import pandas as pd

from ..config import MetricConfig
from ..engine.stats import MismatchStats
from .alerting import ALERTING_KEY
from .atomic import write_json_atomic
from .event_log import EVENTS_TABLE, OUTCOMES_TABLE, log_frame
from .faults import Backoff
from .flusher import FlushQueue
from .ids import IdSource
from .pending import DeferredTables, FlushError
from .runinfo import RUN_FILE, open_run_info
from .runlock import RunLock
from .schema import ERROR_COLUMNS, ERRORS_TABLE, check_labels
from .signals import FlushTimer, SignalFlush

# 100 steps amortise the per-file cost of a flush (one file per table, fsynced) when steps are
# fast; 10 s (checked when a step arrives) bounds what waits in memory when they are slow. A crash
# loses what is buffered and the flush in flight: up to about two of these intervals.
FLUSH_EVERY_STEPS = 100
FLUSH_EVERY_SECONDS = 10.0
# unwritten steps kept while the disk refuses writes (a small step holds ~100 KB until written)
MAX_BUFFERED_STEPS = 1000
SIGNAL_FLUSH_SECONDS = 10.0

log = logging.getLogger(__name__)


class RunWriter:
    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: MetricConfig | None = None,
        run_id: str | None = None,
        pools: Mapping[str, Mapping[str, Any]] | None = None,
        flush_every_steps: int = FLUSH_EVERY_STEPS,
        flush_every_seconds: float = FLUSH_EVERY_SECONDS,
        clock: Callable[[], float] = time.time,
        ids: IdSource | None = None,
        metadata: Mapping[str, Any] | None = None,
        background: bool = True,
        max_buffered_steps: int = MAX_BUFFERED_STEPS,
        retry: Backoff = Backoff(),
        handle_signals: bool = True,
        signal_flush_seconds: float = SIGNAL_FLUSH_SECONDS,
    ) -> None:
        if max_buffered_steps < 1:
            raise ValueError(f"expected max_buffered_steps >= 1, got {max_buffered_steps}")
        if not signal_flush_seconds > 0:
            raise ValueError(f"expected signal_flush_seconds > 0, got {signal_flush_seconds}")
        if flush_every_steps < 1:
            raise ValueError(f"expected flush_every_steps >= 1, got {flush_every_steps}")
        if not flush_every_seconds > 0:
            raise ValueError(f"expected flush_every_seconds > 0, got {flush_every_seconds}")
        self.run_dir = Path(run_dir)
        self.config = config or MetricConfig()
        self._clock = clock
        started = clock()                         # read before run.json's, as the flush clock's start
        self._closed = False
        self._run_lock = RunLock(self.run_dir)
        self._run_lock.acquire()                  # one writer per run directory
        try:
            self.info = open_run_info(self.run_dir, self.config, self._clock(), run_id, pools or {},
                                      metadata or {})
        except BaseException:
            self._run_lock.release()
            raise
        self._queue = FlushQueue(
            self.run_dir, self.info, ids or IdSource(self.run_dir), self._run_lock, clock=clock,
            last_flush=started, flush_every_steps=flush_every_steps, flush_every_seconds=flush_every_seconds,
            background=background, max_buffered_steps=max_buffered_steps, retry=retry)
        self._lock = self._queue.lock             # the one lock of both (see flusher.py)
        self._timer = FlushTimer(self, min(1.0, flush_every_seconds / 4))
        self._signals = SignalFlush(self, self._lock, signal_flush_seconds) if handle_signals else None

    # ------------------------------------------------------------------ run.json
    def update_pools(self, pools: Mapping[str, Mapping[str, Any]]) -> None:
        with self._lock:
            self.info["pools"] = {**self.info["pools"], **{k: dict(v) for k, v in pools.items()}}
            write_json_atomic(self.info, self.run_dir / RUN_FILE)

    def update_alerting(self, record: Mapping[str, Any], *, write: bool = True) -> None:
        """run.json's ``alerting`` (``alerting.py``): what evaluated the run's alerts, what each
        rule could judge. Written now (``write=False``: with the next run.json, as at close); a
        failing disk raises ``OSError``, and the record is still written with the next run.json."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"run writer for {self.run_dir} is closed")
            self.info[ALERTING_KEY] = dict(record)
            if write:
                write_json_atomic(self.info, self.run_dir / RUN_FILE)

    # ------------------------------------------------------------------ appending
    def append_step(self, step: int, stats: MismatchStats | None,
                    exemplars: Mapping[str, pd.DataFrame] | DeferredTables | None = None,
                    *, wall_time: float | None = None, collector_errors: int = 0) -> None:
        """Buffer one step's statistics (``stats=None`` records a step with no observation).
        ``exemplars``: their tables, or tables to build when the step is written."""
        step = int(step)
        if stats is not None:
            check_labels(stats.dims)
            # the run's readers take run.json's config: stats of other parameters would read wrong
            stats.check_parameters(self.config, "RunWriter.append_step")
        wall = self._clock() if wall_time is None else float(wall_time)
        row = {
            "step": step,
            "wall_time": wall,
            "n_tokens": int(stats.column("tokens", "n_tokens").sum()) if stats is not None else 0,
            "n_sequences": int(stats.column("sequences", "n_sequences").sum()) if stats is not None else 0,
            "n_cells": len(stats.tables["tokens"]) if stats is not None else 0,
            "collector_errors": int(collector_errors),
        }
        with self._lock:
            if self._closed:
                raise RuntimeError(f"run writer for {self.run_dir} is closed")
            self._queue.add_step(step, stats.tables if stats is not None else {}, exemplars, row)

    def append_alerts(self, rows: list[Mapping[str, Any]]) -> None:
        if rows:
            self._queue.add_rows("alerts", pd.DataFrame([dict(r) for r in rows]))

    def append_errors(self, rows: list[Mapping[str, Any]]) -> None:
        """Buffer collector errors (``ERROR_COLUMNS``; ``step`` may be None). They are written with
        the next flush, also one with no step to write (its index file is then empty)."""
        if rows:
            df = pd.DataFrame([{c: r.get(c) for c in ERROR_COLUMNS} for r in rows]).astype(ERROR_COLUMNS)
            self._queue.add_rows(ERRORS_TABLE, df)

    def append_events(self, rows: list[Mapping[str, Any]]) -> None:
        """Buffer weight sync / resume / resync events (``event_log.EVENT_COLUMNS``), written with
        the next flush like collector errors."""
        self._append_log(EVENTS_TABLE, rows)

    def append_outcomes(self, rows: list[Mapping[str, Any]]) -> None:
        """Buffer training outcomes (``event_log.OUTCOME_COLUMNS``), written with the next flush."""
        self._append_log(OUTCOMES_TABLE, rows)

    def _append_log(self, table: str, rows: list[Mapping[str, Any]]) -> None:
        if rows:
            df = log_frame(table, rows)
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"run writer for {self.run_dir} is closed")
                self._queue.add_rows(table, df)

    def flush_if_due(self) -> None:
        """A flush by the clock, for a pause between steps (the flush timer calls it)."""
        with self._lock:
            if self._closed:
                return
            self._queue.flush_if_due()

    @property
    def dropped_steps(self) -> int:
        """Steps of this run (restarts included) dropped unwritten: a disk that refused them."""
        return self._queue.dropped_steps

    @property
    def pending_steps(self) -> int:
        """Steps logged but not yet visible to readers (buffered or being written)."""
        return self._queue.pending_steps

    def take_errors(self) -> list[FlushError]:
        """What went wrong in flushes since the last call, oldest first, each once (a failed
        write's steps are written again by the next flush)."""
        return self._queue.take_errors()

    # ------------------------------------------------------------------ flushing
    def flush(self, *, raise_errors: bool = True) -> int:
        """Write every buffered step before returning; returns how many steps became visible,
        including those of a background flush that was in flight. A write that fails keeps its
        steps and raises, or with ``raise_errors=False`` is kept for :meth:`take_errors`."""
        return self._queue.flush(raise_errors=raise_errors)

    def close(self, *, raise_errors: bool = True) -> None:
        """Write what is buffered, mark the run closed and release it. With ``raise_errors=False``
        it never raises: steps that cannot be written are dropped and counted, and what went wrong
        is kept for :meth:`take_errors`."""
        if self._queue.on_flush_thread():
            # called on the flush thread itself (a finalizer the garbage collector ran there):
            # waiting there for the flush in flight would never end, so close from another thread
            threading.Thread(target=self.close, kwargs={"raise_errors": raise_errors},
                             name="mismatch-monitor-close").start()
            return
        with self._lock:
            if self._closed:
                return
            gave_up = self._queue.drain(raise_errors=raise_errors)
            self.info["closed_at"] = self._clock()
            self._queue.fold_dropped()
            try:
                write_json_atomic(self.info, self.run_dir / RUN_FILE)
            except OSError as exc:
                if raise_errors:
                    raise
                if gave_up is None:               # else the same disk failure was just reported
                    self._queue.report(FlushError(f"could not mark {self.run_dir} closed in {RUN_FILE}: "
                                                  f"{type(exc).__name__}: {exc}"))
            self._closed = True
            self._timer.stop()
            if self._signals is not None:
                self._signals.uninstall()
            self._run_lock.release()

    @property
    def closed(self) -> bool:
        return self._closed


def close_and_log(writer: RunWriter) -> None:
    """Close ``writer`` where nobody will take its errors (at interpreter exit): log them."""
    writer.close(raise_errors=False)
    for error in writer.take_errors():
        log.error("mismatch-monitor: the run store at exit: %s", error)
