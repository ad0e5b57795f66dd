"""The Prometheus exporter: the latest step's metrics as gauges, running totals as counters.

    exporter = MismatchExporter()            # its own registry; nothing global is touched
    port = exporter.start()                  # 127.0.0.1, a free port unless one is given
    exporter.observe(step, stats)            # after each step (the collector does this)

Series and labels (cardinality is bounded by pools x hardware; never rank, layer or length):

* gauges, one per metric of ``metrics.METRICS`` named by ``metrics.prometheus_name``, hold the
  latest step's value: ``{pool="fp8"}`` per pool, ``{hardware="H100"}`` per hardware and no
  label for the whole fleet (a missing label means "merged over it"). A slice without an
  observation has no sample, never 0.
* counters (:data:`COUNTERS`, ``_total``) and the classic histogram of |log rho|
  (:data:`HISTOGRAM`) accumulate per ``{pool, hardware}`` cell, so they sum across cells,
  ranks and exporters in PromQL. Histogram bucket bounds are bin edges of the engine's
  log-spaced histogram, so every bucket count is exact (up to the rounding of |lr| at an edge).
* ``mismatch_resyncs_total{pool}`` counts resync requests (:meth:`count_resync`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np
import pandas as pd
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .config import MetricConfig
from .engine import MismatchStats
from .engine.fields import merge_rules
from .engine.histogram import LogBins
from .metrics import METRICS, derive, prometheus_name

UNKNOWN = "unknown"   # label value of rows logged without a pool or hardware
TABLES = ("tokens", "sequences", "abs_hist")   # what metrics and counters read


@dataclass(frozen=True)
class CounterDef:
    name: str      # exposed with the ``_total`` suffix
    table: str     # engine table holding the field
    field: str     # summed sufficient statistic (engine/fields.py)
    doc: str


COUNTERS: tuple[CounterDef, ...] = (
    CounterDef("mismatch_tokens", "tokens", "n_tokens", "valid tokens observed"),
    CounterDef("mismatch_nonfinite_tokens", "tokens", "n_nonfinite", "tokens set aside for a non-finite log-prob"),
    CounterDef("mismatch_clipped_high_tokens", "tokens", "n_clip_high", "tokens with rho > tis_cap"),
    CounterDef("mismatch_clipped_low_tokens", "tokens", "n_clip_low", "tokens with rho <= 1 / tis_cap"),
    CounterDef("mismatch_icepop_masked_tokens", "tokens", "n_outside_icepop", "tokens outside the IcePop band"),
    CounterDef("mismatch_extreme_tokens", "tokens", "n_extreme", "tokens outside the extreme band"),
    CounterDef("mismatch_routing_decisions", "tokens", "n_routing_decisions", "(token, layer) routing decisions"),
    CounterDef("mismatch_routing_flips", "tokens", "n_routing_flips",
               "(token, layer) decisions whose top-k expert set differs"),
    CounterDef("mismatch_sequences", "sequences", "n_sequences", "sequences with a valid token"),
)
COUNTER_BY_FIELD: dict[str, CounterDef] = {c.field: c for c in COUNTERS}
RESYNC_COUNTER = "mismatch_resyncs"
HISTOGRAM = "mismatch_token_abs_log_ratio"
LAST_STEP = "mismatch_last_step"
LAST_STEP_TIME = "mismatch_last_step_timestamp_seconds"
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


def _label(value: object) -> str:
    return UNKNOWN if value is None or pd.isna(value) else str(value)


def _cells(stats: MismatchStats) -> MismatchStats:
    """The (pool, hardware) cells of the tables the exporter reads."""
    return MismatchStats({t: stats.tables[t] for t in TABLES}, stats.dims).marginal(["pool", "hardware"])


class MismatchExporter:
    """A ``prometheus_client`` custom collector; the snapshot it serves is rebuilt per update,
    so a scrape never waits on, or sees half of, a step."""

    def __init__(self, registry: CollectorRegistry | None = None, config: MetricConfig | None = None,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.config = config or MetricConfig()
        self.registry = CollectorRegistry() if registry is None else registry
        self._clock = clock
        self._bounds, self._last_bin = bucket_bounds(LogBins.from_config(self.config))
        self._lock = threading.Lock()
        self._gauges: list[tuple[dict[str, str], pd.Series]] = []
        self._totals: dict[tuple[str, str], np.ndarray] = {}       # cell -> COUNTERS values
        self._buckets: dict[tuple[str, str], np.ndarray] = {}      # cell -> non-cumulative counts
        self._abs_sum: dict[tuple[str, str], float] = {}
        self._resyncs: dict[str, float] = {}
        self._step: tuple[int, float] | None = None
        self._families: list[Metric] = []
        self._server = None
        self._thread: threading.Thread | None = None
        self.registry.register(self)

    # ------------------------------------------------------------------ updates
    def observe(self, step: int, stats: MismatchStats) -> None:
        """Export one step: gauges take its values, counters and the histogram add its counts."""
        cells = _cells(stats)
        totals, buckets, abs_sum = self._cell_counts(cells)
        gauges = self._latest(cells)
        with self._lock:
            for cell, v in totals.items():
                self._totals[cell] = self._totals.get(cell, 0) + v
                self._buckets[cell] = self._buckets.get(cell, 0) + buckets[cell]
                self._abs_sum[cell] = self._abs_sum.get(cell, 0.0) + abs_sum[cell]
            self._gauges = gauges
            self._step = (int(step), self._clock())
            self._rebuild()

    def load(self, step: int, latest: MismatchStats, cumulative: MismatchStats,
             resyncs: Mapping[str, float] | None = None, step_time: float | None = None) -> None:
        """Replace the exported state: ``latest`` is the last step, ``cumulative`` every step
        merged (a stored run read back by ``mismatch-monitor serve``)."""
        totals, buckets, abs_sum = self._cell_counts(_cells(cumulative))
        gauges = self._latest(_cells(latest))
        with self._lock:
            self._totals, self._buckets, self._abs_sum = totals, buckets, abs_sum
            self._gauges = gauges
            self._resyncs = {str(k): float(v) for k, v in (resyncs or {}).items()}
            self._step = (int(step), self._clock() if step_time is None else float(step_time))
            self._rebuild()

    def count_resync(self, pool: str) -> None:
        with self._lock:
            key = _label(pool)
            self._resyncs[key] = self._resyncs.get(key, 0.0) + 1.0
            self._rebuild()

    # ------------------------------------------------------------------ derived values
    def _latest(self, cells: MismatchStats) -> list[tuple[dict[str, str], pd.Series]]:
        """Metrics of every pool, every hardware and the fleet, in one merge and one ``derive``:
        each (pool, hardware) cell is stacked under its three slice names, then merged by the
        fields' own rules, as ``MismatchStats.marginal`` would per level."""
        merged = {}
        for table in TABLES:
            df = cells[table]
            levels = [df.assign(_slice="")]
            for dim in ("pool", "hardware"):
                levels.append(df.assign(_slice=[f"{dim}\0{_label(v)}" for v in df[dim]]))
            stacked = pd.concat(levels, ignore_index=True)
            keys = ["_slice"] + (["bin"] if table == "abs_hist" else [])
            merged[table] = stacked.groupby(keys, sort=True).agg(merge_rules(table)).reset_index()
        frame = derive(merged["tokens"], merged["sequences"], merged["abs_hist"], by=["_slice"], config=self.config)
        out: list[tuple[dict[str, str], pd.Series]] = []
        for _, row in frame.iterrows():
            dim, _, value = str(row["_slice"]).partition("\0")
            out.append(({dim: value} if dim else {}, row))
        return out

    def _cell_counts(self, cells: MismatchStats) -> tuple[dict, dict, dict]:
        totals: dict[tuple[str, str], np.ndarray] = {}
        abs_sum: dict[tuple[str, str], float] = {}
        for table in ("tokens", "sequences"):
            defs = [(i, c) for i, c in enumerate(COUNTERS) if c.table == table]
            for _, row in cells[table].iterrows():
                cell = (_label(row["pool"]), _label(row["hardware"]))
                v = totals.setdefault(cell, np.zeros(len(COUNTERS)))
                for i, c in defs:
                    v[i] += float(row[c.field])
                if table == "tokens":
                    abs_sum[cell] = abs_sum.get(cell, 0.0) + float(row["sum_abs_lr"])
        buckets = {cell: np.zeros(len(self._bounds) + 1) for cell in totals}
        hist = cells["abs_hist"]
        if len(hist):
            bucket = np.searchsorted(self._last_bin, hist["bin"].to_numpy(np.int64), side="left")
            for (pool, hw), idx in hist.groupby(["pool", "hardware"], dropna=False).indices.items():
                cell = (_label(pool), _label(hw))
                b = buckets.setdefault(cell, np.zeros(len(self._bounds) + 1))
                np.add.at(b, bucket[idx], hist["count"].to_numpy(np.float64)[idx])
        for cell in buckets:
            totals.setdefault(cell, np.zeros(len(COUNTERS)))
            abs_sum.setdefault(cell, 0.0)
        return totals, buckets, abs_sum

    # ------------------------------------------------------------------ exposition
    def _rebuild(self) -> None:
        families: list[Metric] = []
        for m in METRICS:
            fam = Metric(prometheus_name(m.key), f"{m.description} (latest step; unit: {m.unit or 'none'})", "gauge")
            for labels, row in self._gauges:
                value = float(row[m.key])
                if not math.isnan(value):
                    fam.add_sample(fam.name, labels, value)
            families.append(fam)
        cells = sorted(self._totals)
        for i, c in enumerate(COUNTERS):
            fam = CounterMetricFamily(c.name, c.doc, labels=["pool", "hardware"])
            for cell in cells:
                fam.add_metric(list(cell), float(self._totals[cell][i]))
            families.append(fam)
        resync = CounterMetricFamily(RESYNC_COUNTER, "resync requests", labels=["pool"])
        for pool in sorted(self._resyncs):
            resync.add_metric([pool], self._resyncs[pool])
        families.append(resync)
        hist = HistogramMetricFamily(HISTOGRAM, "|log pi - log mu| of valid tokens", labels=["pool", "hardware"])
        les = [floatToGoString(b) for b in self._bounds] + ["+Inf"]
        for cell in sorted(self._buckets):
            cum = np.cumsum(self._buckets[cell])
            hist.add_metric(list(cell), list(zip(les, (float(x) for x in cum))), sum_value=self._abs_sum[cell])
        families.append(hist)
        if self._step is not None:
            families.append(Metric(LAST_STEP, "the last exported training step", "gauge"))
            families[-1].add_sample(LAST_STEP, {}, float(self._step[0]))
            families.append(Metric(LAST_STEP_TIME, "when the last step was exported (unix time)", "gauge"))
            families[-1].add_sample(LAST_STEP_TIME, {}, float(self._step[1]))
        self._families = families

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            return list(self._families)

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
