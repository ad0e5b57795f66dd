"""The Prometheus exporter: the latest step's metrics as gauges, running totals as counters.

    exporter = MismatchExporter()            # its own registry; nothing global is touched
    port = exporter.start()                  # 127.0.0.1, a free port unless one is given
    exporter.observe(step, stats)            # after each step (the collector does this)

Series and labels (never rank, layer or length):

* gauges, one per metric of ``metrics.METRICS`` named by ``metrics.prometheus_name``, hold the
  latest step's value: ``{pool="fp8"}`` per pool, ``{hardware="H100"}`` per hardware and no
  label for the whole fleet (a missing label means "merged over it"). A slice without an
  observation has no sample, never 0.
* label values are label texts (``report_keys.py``): ``fp8`` is ``fp8``; a missing label is
  ``%null``, the empty string ``%empty``, ``/`` and ``%`` are escaped, so no value reads as the
  fleet series (Prometheus takes ``pool=""`` for "no label") and no two values share a series.
* at most ``LabelLimit.max_values`` values of each label get their own series; the rest are
  merged exactly into ``%other`` (``export_cells.py`` says which), ``mismatch_label_values_merged``
  counts them at the latest step and a warning is logged once.
* counters (:data:`COUNTERS`, ``_total``) and the classic histogram of |log rho|
  (:data:`HISTOGRAM`) accumulate per ``{pool, hardware}`` cell, so they sum across cells,
  ranks and exporters in PromQL. Histogram bucket bounds are bin edges of the engine's
  log-spaced histogram, so every bucket count is exact (up to the rounding of |lr| at an edge).
* ``mismatch_expected_level{pool, metric, precision, engine}``: each pool's expected healthy
  levels (``expected_series.py``), given the pools' ``run.json`` metadata (``pools=``); the
  rendered alerts' summaries read it to say "x times its expected healthy level".
* ``mismatch_pool_bound{pool, metric}``: the bounds the pools declare (``pool_bounds.py``:
  ``max_staleness``), which ``MismatchSyncBehind`` compares the pool's staleness with.
* ``mismatch_resyncs_total{pool}`` counts resync requests (:meth:`count_resync`); fleet-wide
  ones have no pool label. ``mismatch_exporter_errors_total`` counts steps that failed to export.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterable, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .config import MetricConfig
from .engine import MismatchStats
from .engine.histogram import LogBins
from .expected_series import expected_level_family
from .pool_bounds import pool_bound_family
from .export_cells import DIMS, Admission, Cell, Cells, cells_of, slice_metrics
from .label_limits import LabelLimit
from .metric_defs import CounterDef, counter_defs
from .metrics import METRICS, prometheus_name
from .report_keys import OTHER_TEXT

log = logging.getLogger("mismatch_monitor")

# the summed fields of the metrics declared with counters=True (metric_defs.py)
COUNTERS: tuple[CounterDef, ...] = counter_defs()
COUNTER_BY_FIELD: dict[str, CounterDef] = {c.field: c for c in COUNTERS}
RESYNC_COUNTER = "mismatch_resyncs"
HISTOGRAM = "mismatch_token_abs_log_ratio"
LAST_STEP = "mismatch_last_step"
LAST_STEP_TIME = "mismatch_last_step_timestamp_seconds"
MERGED = "mismatch_label_values_merged"
# steps queued for the background merge beyond which ``observe`` merges them itself (memory
# stays bounded when steps come faster than the merge; nothing is dropped)
QUEUE_LIMIT = 8
ERRORS = "mismatch_exporter_errors"
# |lr| bucket bounds wanted; each is moved to the nearest edge of the engine's log bins
BUCKET_TARGETS: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


def bucket_bounds(bins: LogBins, targets: Iterable[float] = BUCKET_TARGETS) -> tuple[np.ndarray, np.ndarray]:
    """(upper bounds, last engine bin of each bucket): bound j is gamma^k, the upper edge of
    bin ``k - k_min + 1``, so bucket j holds exactly the bins up to that one."""
    ks = sorted({round(math.log(t) / bins.log_gamma) for t in targets})
    ks = [k for k in ks if bins.k_min <= k <= bins.k_max]
    bounds = np.array([bins.gamma ** k for k in ks], dtype=np.float64)
    last_bin = np.array([k - bins.k_min + 1 for k in ks], dtype=np.int64)
    return bounds, last_bin


class MismatchExporter:
    """A ``prometheus_client`` custom collector. ``observe`` only queues the step's statistics:
    a background thread merges them into the exported state, off the training thread, and a
    scrape first takes in whatever is still queued, so it always shows every observed step."""

    def __init__(self, registry: CollectorRegistry | None = None, config: MetricConfig | None = None,
                 *, limit: LabelLimit | None = None, clock: Callable[[], float] = time.time,
                 pools: Mapping[str, Mapping[str, object]] | None = None) -> None:
        self.config = config or MetricConfig()
        self._levels = [expected_level_family(pools), pool_bound_family(pools)]
        self.limit = limit or LabelLimit()
        self.registry = CollectorRegistry() if registry is None else registry
        self._clock = clock
        self._bounds, self._last_bin = bucket_bounds(LogBins.from_config(self.config))
        self._queue: list[tuple] = []           # ("step", step, wall, stats) or ("resync", pool)
        self._queue_lock = threading.Lock()     # held for an append or a swap only
        self._draining = False
        self._work_lock = threading.Lock()      # one merge at a time (background or scrape)
        self._reset()
        self.errors = 0                         # updates that failed (logged; exported as a counter)
        self.last_error: str | None = None
        self._warned = False
        self._families: list[Metric] = []
        self._server = None
        self._thread: threading.Thread | None = None
        self.registry.register(self)

    def _reset(self) -> None:
        self._admission = Admission(self.limit.max_values)
        self._gauges: list[tuple[dict[str, str], dict[str, float]]] = []
        self._totals: dict[Cell, np.ndarray] = {}       # cell -> COUNTERS values
        self._buckets: dict[Cell, np.ndarray] = {}      # cell -> non-cumulative counts
        self._abs_sum: dict[Cell, float] = {}
        self._resyncs: dict[str | None, float] = {}
        self._merged: dict[str, int] = {d: 0 for d in DIMS}
        self._step: tuple[int, float] | None = None

    # ------------------------------------------------------------------ updates
    def observe(self, step: int, stats: MismatchStats) -> None:
        """Export one step: gauges take its values, counters and the histogram add its counts.
        Returns at once; the work runs on a background thread (see :meth:`process_queued`)."""
        stats.check_parameters(self.config, "MismatchExporter.observe")   # its buckets are this config's
        self._enqueue(("step", int(step), self._clock(), stats))

    def count_resync(self, pool: str | None) -> None:
        """One resync request: ``pool`` is the alert event's pool (its label text, as exported);
        None for a fleet-wide alert. Queued like a step, so it never waits on a merge."""
        self._enqueue(("resync", pool))

    def _enqueue(self, item: tuple) -> None:
        with self._queue_lock:
            self._queue.append(item)
            behind = len(self._queue) > QUEUE_LIMIT
            start, self._draining = not self._draining, True
        if start:
            threading.Thread(target=self._drain, name="mismatch-exporter", daemon=True).start()
        if behind:   # the thread cannot keep up: the caller waits instead of the queue growing
            self.process_queued()

    def process_queued(self) -> int:
        """Merge every queued step and resync into the exported state now, in order (a scrape
        does this first); returns how many items were merged."""
        with self._work_lock:
            with self._queue_lock:
                queued, self._queue = self._queue, []
            latest: Cells | None = None
            for item in queued:
                try:   # bad statistics must not stop the exporter (or training), nor the next step
                    if item[0] == "resync":
                        key = None if item[1] is None else self._admission.text("pool", str(item[1]))
                        self._resyncs[key] = self._resyncs.get(key, 0.0) + 1.0
                        continue
                    _, step, wall, stats = item
                    cells = cells_of(stats, self._admission)
                    self._add_counts(cells)
                    self._step, latest = (step, wall), cells
                except Exception as exc:
                    self._failed(exc)
            if latest is not None:   # the gauges hold the latest step only
                try:
                    self._gauges, self._merged = self._latest(latest), latest.merged
                    self._warn_if_merged()
                except Exception as exc:
                    self._failed(exc)
            if queued:
                self._rebuild()
            return len(queued)

    def _drain(self) -> None:
        while True:
            self.process_queued()
            with self._queue_lock:
                if not self._queue:
                    self._draining = False
                    return

    def load(self, step: int, latest: MismatchStats, cumulative: MismatchStats,
             resyncs: Mapping[str | None, float] | None = None, step_time: float | None = None) -> None:
        """Replace the exported state: ``latest`` is the last step, ``cumulative`` every step
        merged (a stored run read back by ``mismatch-monitor serve``); ``resyncs``: pool label
        text (None: fleet-wide) -> requests."""
        with self._work_lock:
            self._reset()
            self._add_counts(cells_of(cumulative, self._admission))   # admits the run's top values
            latest_cells = cells_of(latest, self._admission)
            self._gauges, self._merged = self._latest(latest_cells), latest_cells.merged
            for pool, n in (resyncs or {}).items():
                key = None if pool is None else self._admission.text("pool", str(pool))
                self._resyncs[key] = self._resyncs.get(key, 0.0) + float(n)
            self._step = (int(step), self._clock() if step_time is None else float(step_time))
            self._warn_if_merged()
            self._rebuild()

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        first = self.last_error is None
        self.last_error = f"{type(exc).__name__}: {exc}"
        if first:
            log.error("mismatch-monitor exporter: a step could not be exported: %s (logged once; "
                      "counted in %s_total)", self.last_error, ERRORS)

    def _warn_if_merged(self) -> None:
        if not self._warned and any(self._merged.values()):
            self._warned = True
            log.warning("mismatch-monitor exporter: more than %d values of a label (%s): the rest are "
                        "exported merged as %s (logged once; %s says how many; the store keeps each)",
                        self.limit.max_values, ", ".join(f"{d}: {n} merged" for d, n in self._merged.items()),
                        OTHER_TEXT, MERGED)

    # ------------------------------------------------------------------ derived values
    def _latest(self, cells: Cells) -> list[tuple[dict[str, str], dict[str, float]]]:
        labels, metrics = slice_metrics(cells, self.config)
        keys = [m.key for m in METRICS]
        table = np.column_stack([metrics.values[k] for k in keys]).tolist() if len(labels) else []
        return [(lab, dict(zip(keys, row))) for lab, row in zip(labels, table)]

    def _add_counts(self, cells: Cells) -> None:
        C = len(cells.keys)
        counts = np.zeros((C, len(COUNTERS)))
        for i, c in enumerate(COUNTERS):
            column = (cells.tokens if c.table == "tokens" else cells.sequences)[c.field]
            counts[:, i] = np.where(np.isnan(column), 0.0, column) if column.dtype.kind == "f" else column
        buckets = np.zeros((C, len(self._bounds) + 1))
        np.add.at(buckets, (cells.hist_cell, np.searchsorted(self._last_bin, cells.hist_bin, side="left")),
                  cells.hist_count.astype(np.float64))
        abs_sum = cells.tokens["sum_abs_lr"]
        for j, cell in enumerate(cells.keys):
            self._totals[cell] = self._totals.get(cell, 0.0) + counts[j]
            self._buckets[cell] = self._buckets.get(cell, 0.0) + buckets[j]
            self._abs_sum[cell] = self._abs_sum.get(cell, 0.0) + float(abs_sum[j])

    # ------------------------------------------------------------------ exposition
    def _rebuild(self) -> None:
        families: list[Metric] = []
        for m in METRICS:
            fam = Metric(prometheus_name(m.key), f"{m.description} (latest step; unit: {m.unit or 'none'})", "gauge")
            for labels, row in self._gauges:
                value = row[m.key]
                if not math.isnan(value):
                    fam.add_sample(fam.name, labels, value)
            families.append(fam)
        cells = sorted(self._totals)
        for i, c in enumerate(COUNTERS):
            fam = CounterMetricFamily(c.name, c.doc, labels=["pool", "hardware"])
            for cell in cells:
                fam.add_metric(list(cell), float(self._totals[cell][i]))
            families.append(fam)
        resync = Metric(RESYNC_COUNTER, "resync requests (no pool label: fleet-wide alerts)", "counter")
        for pool in sorted(self._resyncs, key=lambda p: (p is not None, p or "")):
            resync.add_sample(RESYNC_COUNTER + "_total", {} if pool is None else {"pool": pool}, self._resyncs[pool])
        families.append(resync)
        hist = HistogramMetricFamily(HISTOGRAM, "|log pi - log mu| of valid tokens", labels=["pool", "hardware"])
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for cell in sorted(self._buckets):
            cum = np.cumsum(self._buckets[cell])
            hist.add_metric(list(cell), list(zip(les, (float(x) for x in cum))), sum_value=self._abs_sum[cell])
        families.append(hist)
        merged = Metric(MERGED, f"values of a label merged into {OTHER_TEXT} at the latest step", "gauge")
        for dim, n in self._merged.items():
            merged.add_sample(MERGED, {"label": dim}, float(n))
        families.append(merged)
        errors = CounterMetricFamily(ERRORS, "steps the exporter failed to take in (see the log)")
        errors.add_metric([], float(self.errors))
        families.append(errors)
        if self._step is not None:
            families.append(Metric(LAST_STEP, "the last exported training step", "gauge"))
            families[-1].add_sample(LAST_STEP, {}, float(self._step[0]))
            families.append(Metric(LAST_STEP_TIME, "when the last step was exported (unix time)", "gauge"))
            families[-1].add_sample(LAST_STEP_TIME, {}, float(self._step[1]))
        self._families = families

    def set_pools(self, pools: Mapping[str, Mapping[str, object]] | None) -> None:
        """The pools' metadata (``run.json`` ``pools``: precision, engine, max_staleness) behind the
        expected levels and the declared bounds."""
        self._levels = [expected_level_family(pools), pool_bound_family(pools)]

    def collect(self) -> Iterable[Metric]:
        self.process_queued()
        with self._work_lock:
            return list(self._families) + self._levels

    # ------------------------------------------------------------------ HTTP endpoint
    def start(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` from a daemon thread; returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"exporter already serving on port {self._server.server_port}")
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server, self._thread = None, None
