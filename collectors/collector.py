"""The object a user attaches to training: batch in -> metrics -> store, exporter, alerts -> callbacks.

    with MismatchCollector("runs/exp1", pools={"fp8": {"hardware": "H100", "precision": "fp8"}}) as mc:
        for step, batch in enumerate(loader):
            wandb.log(mc.log_step(step, trainer_logprobs=pi, sampler_logprobs=mu,
                                  response_mask=mask, labels={"pool": pools}), step=step)

Alerts are evaluated in-process with the project's rules (``mismatch_monitor.alerts``) unless
``alert_evaluator=None``; their events land in the run's ``alerts`` table.
By default the collector never raises into training over bad *data*: such an error is logged
once per message, counted, and kept with its text in the run's ``errors`` table (``errors.py``);
``strict=True`` raises it instead. A programming error (a bug, ``errors.PROGRAMMING_ERRORS``) is
kept in that table too and raised in every mode. A mistake in the call itself (a misspelt field, a list where a
tensor belongs) raises at once in every mode (``checks.py``). Callbacks (``on_alert``,
``on_resync``) that fail are logged and never break training either (``error_keeping.py``).

In a process started as one of several (``torch.distributed`` initialised with a world size
above 1, or a launcher's ``WORLD_SIZE``), ``reducer="auto"`` (the default) reduces every step to
rank 0, which alone writes the run: the ranks never write one run directory each.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from ..batch import TokenBatch
from ..pool_bounds import check_pool_bounds
from ..config import MetricConfig
from ..engine import MismatchStats, compute_stats_with_sequences
from ..exemplars import select_exemplars
from ..metrics import GroupMetrics, report_by_label
from ..label_limits import LabelLimit
from ..label_text import parse_label_text
from ..report_keys import flatten_report
from ..store import RunWriter
from ..store.event_log import resync_request_message
from ..store.writer import FLUSH_EVERY_SECONDS, FLUSH_EVERY_STEPS, MAX_BUFFERED_STEPS, close_and_log
from .checks import FIELDS, as_token_batch, check_call, checked_step, data_warnings, with_pool_labels
from .alerting_record import AlertingRecorder
from .collaborators import Evaluator, Exporter, Reducer, default_evaluator  # noqa: F401 (re-exported)
from .distributed import DistributedReducer, distributed_world, launched_world
from .error_keeping import ErrorKeeping
from .errors import ErrorLog, is_programming_error
from .fingerprints import check_fingerprint_call
from .run_log import RunLog, check_event_call, check_outcomes_call
from .versions import event_applied


class MismatchCollector(ErrorKeeping):
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
        max_buffered_steps: int = MAX_BUFFERED_STEPS,
        handle_signals: bool = True,
        exemplars_k: int = 16,
        alert_evaluator: Evaluator | Literal["default"] | None = "default",
        exporter: Exporter | None = None,
        label_limit: LabelLimit | None = None,
        reducer: Reducer | Literal["auto"] | None = "auto",
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
        self.label_limit = label_limit or LabelLimit()   # pools shown one by one in the report
        self.reducer: Reducer | Literal["auto"] | None = reducer
        self.workers = workers
        self._clock = clock
        self._alert_callbacks: list[Callable[[Any], None]] = []
        self._resync_callbacks: list[Callable[[Any], None]] = []
        self.errors = ErrorLog()
        self.run_log = RunLog(clock, self._note, strict, self._event_observed)   # events and outcomes
        check_pool_bounds(pools)   # max_staleness: an integer >= 0, checked before anything is written
        self.pools = {k: dict(v) for k, v in (pools or {}).items()}
        for part in (exporter, self.alert_evaluator):   # the exporter's series, the evaluator's judgement
            if self.pools and callable(getattr(part, "set_pools", None)):
                part.set_pools(self.pools)
        self.writer: RunWriter | None = None
        self._finalizer: weakref.finalize | None = None
        self._run_dir = run_dir
        self._writer_options = dict(config=self.config, run_id=run_id, pools=pools,
                                    flush_every_steps=flush_every_steps,
                                    flush_every_seconds=flush_every_seconds, clock=clock, metadata=metadata,
                                    max_buffered_steps=max_buffered_steps, handle_signals=handle_signals)
        self._default_alerts = alert_evaluator == "default"
        self._alerting = AlertingRecorder(flush_every_seconds)   # run.json's record of what judged the alerts
        # a launcher started several processes but the group is not up yet (accelerate brings it
        # up with the trainer's arguments): decide who writes once it is, at the first step
        if not (reducer == "auto" and distributed_world() == 1 and launched_world() > 1):
            self.resolve_reducer()

    def resolve_reducer(self) -> None:
        """Pick the reducer (``"auto"``: rank 0 writes when the process group has more than one
        rank) and open the run store on the writer rank; nothing happens when already done."""
        if self._writer_options is None:
            return
        if self.reducer == "auto":
            world, launched = distributed_world(), launched_world()
            if world == 1 and launched > 1:
                raise RuntimeError(
                    f"WORLD_SIZE={launched} says this is one of {launched} processes, but torch.distributed "
                    "is not initialised: initialise it (dist.init_process_group, or build the trainer) before "
                    "the first log_step, or pass reducer=None to let each process write its own run directory")
            self.reducer = DistributedReducer(exemplars_k=self.exemplars_k) if world > 1 else None
        options, self._writer_options = self._writer_options, None
        if self.reducer is None or self.reducer.is_writer:
            self.writer = RunWriter(self._run_dir, **options)
            self.run_log.attach(self.writer)
            if self._default_alerts:
                self.alert_evaluator = default_evaluator(self.writer.run_dir)
            self._record_alerting(None, force=True)
            # flush what is buffered if the process exits without close() (finalize runs at exit)
            self._finalizer = weakref.finalize(self, close_and_log, self.writer)

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
    def log_step(
        self,
        step: int,
        batch: TokenBatch | None = None,
        *,
        trainer_logprobs: torch.Tensor | None = None,
        sampler_logprobs: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        seq_offsets: torch.Tensor | Sequence[int] | None = None,
        seq_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
        labels: Mapping[str, Sequence[str | None]] | None = None,
        turn_index: torch.Tensor | None = None,
        policy_version: torch.Tensor | Sequence[int] | None = None,
        trainer_version: int | None = None,
        advantages: torch.Tensor | Sequence[float] | None = None,
        trainer_experts: torch.Tensor | None = None,
        sampler_experts: torch.Tensor | None = None,
        in_trainer_support: torch.Tensor | None = None,
        sampler_kept_logmass: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Compute, store and export one step; returns a flat report for ``wandb.log``.

        Either a :class:`TokenBatch` or the fields of ``TokenBatch.from_padded`` (with
        ``response_mask``) / ``from_flat`` (with ``seq_offsets`` or ``seq_ids``). With a reducer,
        every rank joins the reduction even when its own batch was rejected (it contributes
        nothing), so one bad batch never leaves the other ranks waiting.
        """
        # the keyword parameters above, by name (locals() holds exactly the arguments here)
        fields = {name: value for name, value in locals().items() if name in FIELDS and value is not None}
        check_call(step, batch, fields)               # a mistake in the call raises, in every mode
        self.resolve_reducer()
        wall = self._clock()
        index: int | None = None
        local_error: Exception | None = None
        warnings: list[Exception] = []
        try:
            index = checked_step(step)
            self.run_log.step_logged(index)
            batch = self._as_batch(batch, fields)
            batch, not_applied = self.run_log.versions.correct(batch, index)
            stats, per_sequence = compute_stats_with_sequences(batch, self.config, workers=self.workers)
            warnings = not_applied + data_warnings(batch, stats)
            selected = select_exemplars(batch, self.exemplars_k, self.config, per_sequence)
            # the writer builds the exemplar tables when it flushes; a reducer gathers tables now
            exemplars = selected.frames() if self.reducer is not None else selected
        except Exception as exc:  # bad data never takes training down unless asked to; a bug does
            if self.reducer is None and is_programming_error(exc):
                self._raise_bug(exc, index, wall)
            if self.strict and self.reducer is None:
                raise
            local_error = exc
            stats, exemplars = MismatchStats.empty(), {}
        try:
            if self.reducer is not None:
                stats, exemplars = self.reducer(stats, exemplars, step=index, error=local_error)
                self._note_rejections(wall)
            if local_error is not None:
                if is_programming_error(local_error):   # raised after the reduction: no rank waits
                    self._raise_bug(local_error, index, wall)
                if self.strict:
                    raise local_error
                what = "a step was not recorded" if index is None else (
                    f"step {index} was not recorded" if self.reducer is None
                    else f"step {index}: this rank's batch was left out")
                self._note(what, local_error, index, wall)
                if self.reducer is None or index is None:
                    self._append_empty(index, wall)
                    return {"mismatch/collector_errors": float(self.error_count)}
            for warning in warnings:                  # data problems of a step that is recorded
                if self.strict:
                    raise warning
                self._note(f"step {index}", warning, index, wall)
            by_pool, fleet = report_by_label(stats, "pool", self.config)
            if self.writer is not None:
                events = self._evaluate_alerts(index, wall, by_pool, fleet)
                repeats = self._repeat_requests()
                self.writer.append_alerts([e.to_row() for e in events])
                self.writer.append_step(index, stats, exemplars, wall_time=wall,
                                        collector_errors=self.error_count)
                self._check_store()
                self._record_alerting(index)
                if self.exporter is not None:
                    self.exporter.observe(index, stats)
                self._dispatch(events, index, repeats)
            out = flatten_report(fleet, by_pool, stats, config=self.config, limit=self.label_limit)
            out["mismatch/collector_errors"] = float(self.error_count)
            return out
        except Exception as exc:
            if self.strict or exc is local_error:
                raise
            if is_programming_error(exc):
                self._raise_bug(exc, index, wall)
            self._note(f"step {index} was not recorded", exc, index, wall)
            self._append_empty(index, wall)
            return {"mismatch/collector_errors": float(self.error_count)}

    # ------------------------------------------------------------------ events and outcomes
    def log_event(self, kind: str, *, step: int | None = None, pool: str | None = None,
                  version: int | None = None, message: str = "", applied: bool = True,
                  fingerprint: str | None = None, trainer_fingerprint: str | None = None) -> None:
        """Record a ``"weight_sync"``, ``"resume"``, ``"resync"`` or ``"resync_request"`` in the
        run's ``events`` table. ``step``: the first step whose batches come after it (None: the
        step after the last one logged); ``pool``: None for every pool; ``version``: the weight
        version now in place (``run_log.py`` says what raises and what is counted);
        ``applied=False``: a push of ``version`` that did not land (``versions.py``: staleness is
        then counted from the version last applied). ``fingerprint`` / ``trainer_fingerprint``
        (``mismatch_monitor.fingerprint.weights_fingerprint`` of what the pool loaded / of what
        the trainer pushed): a pool found on other weights than ``version``'s is recorded as
        such (``fingerprints.py``)."""
        check_event_call(kind, step, pool, version, message)   # a mistake in the call raises
        event_applied(kind, applied)
        check_fingerprint_call(kind, version, fingerprint, trainer_fingerprint)
        self.resolve_reducer()
        self.run_log.sync(kind, step, pool, version, message, applied, fingerprint, trainer_fingerprint)

    def log_outcomes(self, step: int, values: Mapping[str, float], *, pool: str | None = None) -> None:
        """Record training outcomes of ``step`` (``{"reward": ..., "loss": ..., "grad_norm": ...,
        "entropy": ...}`` or any other names; ``pool=None``: the whole batch) in the run's
        ``outcomes`` table, beside its mismatch statistics. A non-finite value is counted and
        left out; the others are stored."""
        floats = check_outcomes_call(step, values, pool)          # a mistake in the call raises
        self.resolve_reducer()
        self.run_log.outcomes(step, floats, pool)

    def _event_observed(self, row: dict[str, Any]) -> None:
        """An evaluator with ``observe_event(row)`` sees every event as it is stored (rules that
        look at the steps right after a weight sync or resume)."""
        observe = getattr(self.alert_evaluator, "observe_event", None)
        if observe is not None:
            self._call(observe, row, "alert evaluator", row["step"])

    def _as_batch(self, batch: TokenBatch | None, fields: dict[str, Any]) -> TokenBatch:
        return with_pool_labels(as_token_batch(batch, fields), self.pools)

    def _evaluate_alerts(self, step: int, wall: float, by_pool: GroupMetrics,
                         fleet: GroupMetrics) -> list[Any]:
        if self.alert_evaluator is None:
            return []
        return list(self.alert_evaluator.observe(step, wall, by_pool, fleet=fleet))

    def _repeat_requests(self) -> list[Any]:
        """Resyncs a held firing asked for again (``AlertEvaluator.repeat_requests``): no new alert."""
        repeats = getattr(self.alert_evaluator, "repeat_requests", None)
        return [] if repeats is None else list(repeats())

    def _dispatch(self, events: Sequence[Any], step: int, repeats: Sequence[Any] = ()) -> None:
        """Alert callbacks for each state change; a resync for each firing that asks one and for
        each repeat request (a held firing whose pool fell behind again after its last resync)."""
        for event in events:
            for fn in self._alert_callbacks:
                self._call(fn, event, "on_alert", step)
            if getattr(event, "resync", False) and getattr(event, "state", None) == "firing":
                self._request_resync(event, step, "asked for a resync")
        for event in repeats:
            self._request_resync(event, step, f"(firing since step {getattr(event, 'since_step', '?')}) asked for "
                                 "another resync: the pool fell behind again after the last one")

    def _request_resync(self, event: Any, step: int, what: str) -> None:
        # in the run before the callbacks (which may log the resync they do): from the next step
        n = len(self._resync_callbacks)
        # the event's pool is its label text; the events table holds pool values, as logged
        pool = getattr(event, "pool", None)
        self.run_log.event("resync_request", step + 1, None if pool is None else parse_label_text(pool), None,
                           resync_request_message(getattr(event, "alert", "an alert"), what, step, n))
        if self.exporter is not None:
            self._call(lambda e: self.exporter.count_resync(e.pool), event, "exporter", step)
        for fn in self._resync_callbacks:
            self._call(fn, event, "on_resync", step)

    def _record_alerting(self, step: int | None, *, force: bool = False, closing: bool = False) -> None:
        """Refresh run.json's ``alerting`` record (``alerting_record.py``) when due, or ``force``;
        ``closing``: only hand it to the writer, whose close writes run.json."""
        if self.writer is None or self.writer.closed:
            return
        now = self._clock()
        if step is not None:
            self._alerting.stepped(step)
        if not (force or closing or self._alerting.due(now)):
            return
        try:
            self._alerting.write(self.writer, self.alert_evaluator, now, to_disk=not closing)
            self._alerting.failing = False
        except OSError as exc:   # a failing disk: counted once; the record goes out with the next run.json
            if self.strict:
                raise
            if not self._alerting.failing:
                self._note("could not record in run.json what evaluated the alerts", exc, step, now)
            self._alerting.failing = True

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Write every buffered step now (synchronously)."""
        if self.writer is not None:
            self.writer.flush(raise_errors=self.strict)   # a full disk is counted, not raised
            self._check_store()
            self._record_alerting(None, force=True)

    def close(self) -> None:
        if self.writer is not None:
            self._record_alerting(None, closing=True)
            self.writer.close(raise_errors=self.strict)   # never raises by default
            if self._finalizer is not None:
                self._finalizer.detach()
            self._check_store()

    def __enter__(self) -> "MismatchCollector":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
