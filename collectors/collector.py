"""The object a user attaches to training: batch in -> metrics -> store, exporter, alerts -> callbacks.

    with MismatchCollector("runs/exp1", pools={"fp8": {"hardware": "H100", "precision": "fp8"}}) as mc:
        for step, batch in enumerate(loader):
            wandb.log(mc.log_step(step, trainer_logprobs=pi, sampler_logprobs=mu,
                                  response_mask=mask, labels={"pool": pools}), step=step)

Alerts are evaluated in-process with the project's rules (``mismatch_monitor.alerts``) unless
``alert_evaluator=None``; their events land in the run's ``alerts`` table.
By default the collector never raises into training: an error is logged once per kind (with
the full message), counted, and recorded in the step index; ``strict=True`` raises it instead.
Callbacks (``on_alert``, ``on_resync``) that fail are logged and never break training either.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import weakref
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence

import numpy as np
import pandas as pd

from .. import query
from ..alerts import AlertEvaluator
from ..batch import TokenBatch
from ..config import MetricConfig
from ..engine import MismatchStats, compute_stats_with_sequences
from ..exemplars import select_exemplars
from ..metrics import GroupMetrics, report_by_label
from ..store import RunWriter
from ..store.writer import FLUSH_EVERY_SECONDS, FLUSH_EVERY_STEPS

log = logging.getLogger("mismatch_monitor")


class Reducer(Protocol):
    """Combines per-rank statistics into the global view (see ``collectors/distributed.py``)."""

    is_writer: bool

    def __call__(self, stats: MismatchStats, exemplars: dict[str, pd.DataFrame]
                 ) -> tuple[MismatchStats, dict[str, pd.DataFrame]]: ...


class Evaluator(Protocol):
    """``by_pool``/``fleet``: :class:`GroupMetrics` (``.to_frame()`` gives the frame of
    ``metrics.report``)."""

    def observe(self, step: int, wall_time: float, by_pool: GroupMetrics, *,
                fleet: GroupMetrics | None = None) -> list[Any]: ...


class Exporter(Protocol):
    def observe(self, step: int, stats: MismatchStats) -> None: ...

    def count_resync(self, pool: str | None) -> None: ...


def as_token_batch(batch: TokenBatch | None, fields: Mapping[str, Any]) -> TokenBatch:
    """A TokenBatch from either a batch or tensor fields (padded with ``response_mask``, else flat)."""
    if batch is not None:
        if fields:
            raise TypeError(f"pass either a TokenBatch or tensor fields, not both (got {sorted(fields)})")
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"expected a TokenBatch, got {type(batch).__name__}")
        return batch
    if "response_mask" in fields:
        return TokenBatch.from_padded(**fields)
    if "trainer_logprobs" in fields:
        return TokenBatch.from_flat(**fields)
    raise TypeError("log_step needs a TokenBatch or trainer_logprobs/sampler_logprobs fields")


def _default_evaluator(run_dir: os.PathLike[str]) -> Evaluator:
    """The project's alert rules; a restarted run first replays its stored history, so an alert
    that was firing stays firing (and does not ask for a second resync)."""
    con = query.connect()
    steps = query.steps_index(con, run_dir)["step"]   # steps without observations resolve alerts too
    if steps.empty:
        return AlertEvaluator()
    history = query.metric_series(con, run_dir, ["pool"])
    fleet = query.metric_series(con, run_dir)
    evaluator, _ = AlertEvaluator.replay(history, fleet_history=fleet, steps=steps)
    return evaluator


def flatten_report(fleet: GroupMetrics, by_pool: GroupMetrics) -> dict[str, float]:
    """``mismatch/k3_kl`` for the whole step, ``mismatch/pool=fp8/k3_kl`` per pool; nulls omitted."""
    out: dict[str, float] = {}
    keys = list(fleet.values)
    if len(fleet):
        values = np.array([fleet.values[k][0] for k in keys]).tolist()
        out.update((k, v) for k, v in zip(keys, values) if not math.isnan(v))
    if len(by_pool):
        table = np.column_stack([by_pool.values[k] for k in keys]).tolist()   # [pools, metrics]
        short = [k[len("mismatch/"):] for k in keys]
        for pool, row in zip(by_pool.labels, table):                          # one row per pool
            prefix = f"mismatch/pool={'unknown' if pool is None else pool}/"
            out.update((prefix + k, v) for k, v in zip(short, row) if not math.isnan(v))
    return out


class MismatchCollector:
    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: MetricConfig | None = None,
        run_id: str | None = None,
        pools: Mapping[str, Mapping[str, Any]] | None = None,
        strict: bool = False,
        flush_every_steps: int = FLUSH_EVERY_STEPS,
        flush_every_seconds: float = FLUSH_EVERY_SECONDS,
        exemplars_k: int = 16,
        alert_evaluator: Evaluator | Literal["default"] | None = "default",
        exporter: Exporter | None = None,
        reducer: Reducer | None = None,
        workers: int = 1,
        metadata: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if exemplars_k < 0:
            raise ValueError(f"expected exemplars_k >= 0, got {exemplars_k}")
        if workers < 1:
            raise ValueError(f"expected workers >= 1, got {workers}")
        self.config = config or MetricConfig()
        self.strict = strict
        self.exemplars_k = exemplars_k
        self.alert_evaluator = None if alert_evaluator == "default" else alert_evaluator
        self.exporter = exporter
        self.reducer = reducer
        self.workers = workers
        self._clock = clock
        self._alert_callbacks: list[Callable[[Any], None]] = []
        self._resync_callbacks: list[Callable[[Any], None]] = []
        self._seen_errors: set[str] = set()
        self.error_count = 0
        self.errors_by_kind: dict[str, int] = {}
        self.last_error: str | None = None
        self.pools = {k: dict(v) for k, v in (pools or {}).items()}
        self.writer: RunWriter | None = None
        if reducer is None or reducer.is_writer:
            self.writer = RunWriter(run_dir, config=self.config, run_id=run_id, pools=pools,
                                    flush_every_steps=flush_every_steps,
                                    flush_every_seconds=flush_every_seconds, clock=clock,
                                    metadata=metadata)
            if alert_evaluator == "default":
                self.alert_evaluator = _default_evaluator(self.writer.run_dir)
            # flush what is buffered if the process exits without close() (finalize runs at exit)
            self._finalizer = weakref.finalize(self, RunWriter.close, self.writer)

    # ------------------------------------------------------------------ callbacks
    def on_alert(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """Call ``fn(event)`` for every alert state change (firing or resolved)."""
        self._alert_callbacks.append(fn)
        return fn

    def on_resync(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        """Call ``fn(event)`` once each time a resync-recommending alert starts firing."""
        self._resync_callbacks.append(fn)
        return fn

    # ------------------------------------------------------------------ logging a step
    def log_step(self, step: int, batch: TokenBatch | None = None, **fields: Any) -> dict[str, float]:
        """Compute, store and export one step; returns a flat report for ``wandb.log``.

        With a reducer, every rank joins the reduction even when its own batch was rejected
        (it contributes nothing), so one bad batch never leaves the other ranks waiting.
        """
        wall = self._clock()
        local_error: Exception | None = None
        try:
            batch = self._as_batch(batch, fields)
            stats, per_sequence = compute_stats_with_sequences(batch, self.config, workers=self.workers)
            selected = select_exemplars(batch, self.exemplars_k, self.config, per_sequence)
            # the writer builds the exemplar tables when it flushes; a reducer gathers tables now
            exemplars = selected.frames() if self.reducer is not None else selected
        except Exception as exc:  # never take training down unless asked to
            if self.strict and self.reducer is None:
                raise
            local_error = exc
            stats, exemplars = MismatchStats.empty(), {}
        try:
            if self.reducer is not None:
                stats, exemplars = self.reducer(stats, exemplars)
            if local_error is not None:
                if self.strict:
                    raise local_error
                self._note(f"step {step} was not recorded" if self.reducer is None
                           else f"step {step}: this rank's batch was left out", local_error)
                if self.reducer is None:
                    self._append_empty(step, wall)
                    return {"mismatch/collector_errors": float(self.error_count)}
            by_pool, fleet = report_by_label(stats, "pool", self.config)
            if self.writer is not None:
                events = self._evaluate_alerts(step, wall, by_pool, fleet)
                self.writer.append_alerts([e.to_row() for e in events])
                self.writer.append_step(step, stats, exemplars, wall_time=wall,
                                        collector_errors=self.error_count)
                self._check_store()
                if self.exporter is not None:
                    self.exporter.observe(step, stats)
                self._dispatch(events)
            out = flatten_report(fleet, by_pool)
            out["mismatch/collector_errors"] = float(self.error_count)
            return out
        except Exception as exc:
            if self.strict:
                raise
            self._note(f"step {step} was not recorded", exc)
            self._append_empty(step, wall)
            return {"mismatch/collector_errors": float(self.error_count)}

    def _as_batch(self, batch: TokenBatch | None, fields: dict[str, Any]) -> TokenBatch:
        return self._with_pool_labels(as_token_batch(batch, fields))

    def _with_pool_labels(self, batch: TokenBatch) -> TokenBatch:
        """Fill hardware/precision/engine labels a batch lacks from the declared pool metadata."""
        pools = batch.labels.get("pool")
        if pools is None or not self.pools:
            return batch
        labels = dict(batch.labels)
        for dim in ("hardware", "precision", "engine", "env"):
            if dim in labels or not any(dim in meta for meta in self.pools.values()):
                continue
            values = (self.pools.get(p, {}).get(dim) if p is not None else None for p in pools)
            labels[dim] = tuple(None if v is None else str(v) for v in values)
        return dataclasses.replace(batch, labels=labels) if len(labels) != len(batch.labels) else batch

    def _evaluate_alerts(self, step: int, wall: float, by_pool: GroupMetrics,
                         fleet: GroupMetrics) -> list[Any]:
        if self.alert_evaluator is None:
            return []
        return list(self.alert_evaluator.observe(step, wall, by_pool, fleet=fleet))

    def _dispatch(self, events: Sequence[Any]) -> None:
        for event in events:
            for fn in self._alert_callbacks:
                self._call(fn, event, "on_alert")
            if getattr(event, "resync", False) and getattr(event, "state", None) == "firing":
                if self.exporter is not None:
                    self._call(lambda e: self.exporter.count_resync(e.pool), event, "exporter")
                for fn in self._resync_callbacks:
                    self._call(fn, event, "on_resync")

    def _call(self, fn: Callable[[Any], None], event: Any, where: str) -> None:
        try:
            fn(event)
        except Exception as exc:
            if self.strict:
                raise
            self._note(f"{where} callback failed", exc)

    def _check_store(self) -> None:
        """Report what went wrong in the writer's flushes (a failed write's steps stay buffered
        and are written again): each error is counted and logged; strict mode raises the first."""
        errors = self.writer.take_errors() if self.writer is not None else []
        if errors and self.strict:
            raise errors[0]
        for error in errors:
            self._note("the run store", error)

    def _append_empty(self, step: int, wall: float) -> None:
        """Record a step without statistics, so the index shows the error count at that step."""
        if self.writer is not None and not self.writer.closed:
            try:
                self.writer.append_step(step, None, wall_time=wall, collector_errors=self.error_count)
            except Exception as inner:  # the store itself failed: say so once, keep training
                self._note("the run store failed", inner)

    def _note(self, what: str, exc: BaseException) -> None:
        kind = f"{type(exc).__name__}: {exc}"
        self.error_count += 1
        self.errors_by_kind[type(exc).__name__] = self.errors_by_kind.get(type(exc).__name__, 0) + 1
        self.last_error = f"{what}: {kind}"
        if kind not in self._seen_errors:
            self._seen_errors.add(kind)
            log.error("mismatch-monitor: %s: %s (logged once; %d error(s) so far; pass strict=True "
                      "to raise)", what, kind, self.error_count)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Write every buffered step now (synchronously)."""
        if self.writer is not None:
            self.writer.flush()
            self._check_store()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._finalizer.detach()
            self._check_store()

    def __enter__(self) -> "MismatchCollector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
