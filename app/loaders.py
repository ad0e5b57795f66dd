"""Every page's queries, as one plain function per page (no Streamlit: cached in ``data.py``,
timed in ``benchmarks/bench_dashboard.py``).

A loader takes a DuckDB connection, a run directory and the page's parameters, and returns a
dict of small frames. The steps shown are the run's last ``window`` steps (all when ``None``),
merged into at most ``max_points`` step bins (exact merges; see ``query.aggregate_binned``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from mismatch_monitor import query
from mismatch_monitor.engine.histogram import QUANTILES
from mismatch_monitor.metrics import METRICS
from mismatch_monitor.query.events import resync_requests, run_events, run_outcomes
from mismatch_monitor.store import read_run_info
from mismatch_monitor.store.alerting import read_alerting

from .routing_cells import with_zero_flips

Con = duckdb.DuckDBPyConnection
Frames = dict[str, Any]

K3 = "mismatch/k3_kl"
P99 = "mismatch/abs_log_ratio/p99"
MAX_ABS = "mismatch/abs_log_ratio/max"
MEAN_ABS = "mismatch/abs_log_ratio/mean"
ESS = "mismatch/ess"
EXTREME = "mismatch/extreme_fraction"
FLIPS = "mismatch/routing/flip_rate"
ANY_FLIP = "mismatch/routing/any_layer_flip_fraction"
DRIFT = ("mismatch/log_ratio/mean", "mismatch/log_ratio/std_error")
HEADLINE: tuple[str, ...] = (K3, P99, MAX_ABS, ESS, EXTREME, FLIPS)
BANDS: tuple[str, ...] = tuple(f"mismatch/abs_log_ratio/{name}" for name, _ in QUANTILES) + (MAX_ABS,)
STALENESS = "mismatch/staleness/mean"
# the likely and unlikely tokens' mean rho - 1 and the contrast between them (the sharpness gate's metric)
SHARPNESS: tuple[str, ...] = ("mismatch/sharpness/contrast_t", "mismatch/sharpness/top_rho_shift",
                              "mismatch/sharpness/low_rho_shift")
# staleness among them: an async pool that stops syncing shows there first
POOL_DEFAULT: tuple[str, ...] = (K3, P99, MAX_ABS, ESS, EXTREME, STALENESS, "mismatch/log_ratio/mean",
                                 "mismatch/clip_high_fraction", FLIPS)
# every share whose value depends on a config threshold: what a correction would clip or drop
CORRECTIONS: tuple[str, ...] = tuple(m.key for m in METRICS if m.unit == "share" and m.thresholds)
SPARK_STEPS = 100   # steps behind each headline trend
OUTCOMES: tuple[str, ...] = ("reward", "eval_reward")   # the training outcomes the Overview draws
HEATMAP_COLUMNS = 240  # step bins of the |log ρ| histogram heatmap (bins x steps cells)


@dataclass(frozen=True)
class Span:
    """The visible steps [first, last] of a run, shown in bins of ``width`` steps from ``origin``
    (bins start at origin + k * width; origin <= first, so that wide bins fall on the store's
    rollup blocks: see ``query.aligned_bins``)."""

    first: int
    last: int
    width: int
    n_steps: int      # visible steps in [first, last] (the index may have gaps)
    origin: int

    @property
    def steps(self) -> tuple[int, int]:
        return (self.first, self.last)


def span_of(index: pd.DataFrame, window: int | None, max_points: int) -> Span | None:
    """The last ``window`` steps of a steps index (None for a run with no visible step)."""
    if not len(index):
        return None
    last = int(index["step"].max())
    first = int(index["step"].min()) if window is None else max(int(index["step"].min()), last - int(window) + 1)
    n = int(((index["step"] >= first) & (index["step"] <= last)).sum())
    origin, width = query.aligned_bins(first, last, query.step_width(first, last, max_points), max_points)
    return Span(first, last, width, n, origin)


def _in_span(frame: pd.DataFrame, span: Span | None) -> pd.DataFrame:
    """The rows of a step-keyed log within the steps shown (none without a visible step)."""
    if span is None:
        return frame.iloc[:0]
    return frame[(frame["step"] >= span.first) & (frame["step"] <= span.last)].reset_index(drop=True)


def _pool_filter(pool: str | None) -> dict[str, str] | None:
    return None if pool is None else {"pool": pool}


def _start(con: Con, run_dir: Path, window: int | None, max_points: int) -> tuple[Frames, Span | None]:
    index = query.steps_index(con, run_dir)
    span = span_of(index, window, max_points)
    return {"index": index, "span": span}, span


def meta(con: Con, run_dir: Path) -> Frames:
    """What every page needs: run.json, its metric config, the steps index, the pools present."""
    return {"info": read_run_info(run_dir), "config": query.run_config(run_dir),
            "index": query.steps_index(con, run_dir),
            "pools": query.distinct_values(con, run_dir, "sequences", "pool")}


def asked_resyncs(alerts: pd.DataFrame, events: pd.DataFrame) -> pd.DataFrame:
    """Every resync the alerts asked for: step, pool, alert. The run's ``resync_request`` events
    where it logged them (a held firing asks again at each relapse, without a new alert row), else
    the firings that asked one (a run whose alerts were evaluated elsewhere)."""
    requests = resync_requests(events)
    if len(requests):
        return requests
    asked = alerts[query.resync_firings(alerts)]
    return asked[["step", "pool", "alert"]].reset_index(drop=True)


def overview(con: Con, run_dir: Path, *, window: int | None, max_points: int) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    out["events"] = query.alert_events(con, run_dir)
    out["alerting"] = read_alerting(read_run_info(run_dir))
    out["resyncs"] = asked_resyncs(out["events"], run_events(con, run_dir))
    out["firing"] = query.firing_alerts(out["events"])
    out["errors"] = query.error_messages(query.collector_errors(con, run_dir))
    index = out["index"]
    observed = index.loc[index["n_tokens"] > 0, "step"]
    last = int(observed.max()) if len(observed) else -1   # the latest step with observations
    out["latest_step"] = last
    out["latest_fleet"] = query.metric_totals(con, run_dir, [], steps=(last, last))
    out["latest_pools"] = query.metric_totals(con, run_dir, ["pool"], steps=(last, last))
    if span is None:
        return out
    recent = (max(span.first, span.last - SPARK_STEPS + 1), span.last)
    out["recent"] = query.metric_series_binned(con, run_dir, [], first=recent[0], width=1,
                                               metrics=HEADLINE, steps=recent)
    out["history"] = query.metric_series_binned(con, run_dir, ["pool"], first=span.origin, width=span.width,
                                                metrics=HEADLINE + (STALENESS,), steps=span.steps)
    outcomes = _in_span(run_outcomes(con, run_dir), span)   # empty for a run written before outcomes
    out["outcomes"] = outcomes[outcomes["name"].isin(OUTCOMES)].reset_index(drop=True)
    return out


def pools(con: Con, run_dir: Path, *, window: int | None, max_points: int,
          metrics: tuple[str, ...] = POOL_DEFAULT) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    out["info"] = read_run_info(run_dir)
    if span is None:
        return out
    sums = query.binned_sums(con, run_dir, ["pool"], first=span.origin, width=span.width, metrics=metrics,
                             steps=span.steps)
    out["series"] = query.derive_sums(sums, ["pool"], metrics=metrics, config=query.run_config(run_dir))
    out["shares"] = query.pool_shares(con, run_dir, steps=span.steps, tokens=sums["tokens"])
    return out


def tails(con: Con, run_dir: Path, *, window: int | None, max_points: int, pool: str | None = None) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    if span is None:
        return out
    kw: dict[str, Any] = dict(first=span.origin, width=span.width, steps=span.steps)
    hist_first, out["hist_width"] = query.aligned_bins(
        span.first, span.last, max(span.width, query.step_width(span.first, span.last, HEATMAP_COLUMNS)),
        HEATMAP_COLUMNS)
    out["hist"] = query.aggregate_binned(con, run_dir, "abs_hist", [], first=hist_first, width=out["hist_width"],
                                         steps=span.steps, where=_pool_filter(pool))
    out["config"] = query.run_config(run_dir)
    out["bands"] = query.metric_series_binned(con, run_dir, ["pool"], metrics=BANDS + DRIFT, **kw)
    return out


def lowprob(con: Con, run_dir: Path, *, window: int | None, max_points: int, pool: str | None = None) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    if span is None:
        return out
    kw: dict[str, Any] = dict(steps=span.steps, where=_pool_filter(pool))
    out["buckets"] = query.lowprob_series(con, run_dir, [], first=span.origin, width=span.width, **kw)
    totals = query.lowprob_series(con, run_dir, [], first=span.first, width=span.last - span.first + 1, **kw)
    out["totals"] = totals.assign(share=totals["n_tokens"] / totals["n_tokens"].sum())
    out["config"] = query.run_config(run_dir)
    out["sharpness"] = query.metric_series_binned(con, run_dir, ["pool"], first=span.origin, width=span.width,
                                                  metrics=SHARPNESS, **kw)
    return out


def length_turn(con: Con, run_dir: Path, *, window: int | None, max_points: int, metric: str = K3,
                pool: str | None = None) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    if span is None:
        return out
    kw: dict[str, Any] = dict(first=span.origin, width=span.width, steps=span.steps, metrics=[metric])
    where = _pool_filter(pool)
    out["length"] = query.metric_series_binned(con, run_dir, ["length_bucket"], where=where, **kw)
    out["turn"] = query.metric_series_binned(con, run_dir, ["turn_bucket"], where=where, **kw)
    cross = query.metric_series_binned(con, run_dir, ["pool"], first=span.origin, width=span.width,
                                       steps=span.steps, metrics=[MEAN_ABS])
    cap = query.run_config(run_dir).tis_cap
    cross["crossing_length"] = query.crossing_length(cross[MEAN_ABS], cap)
    out["crossing"] = cross
    out["crossing_latest"] = cross.sort_values("step").groupby("pool", dropna=False).tail(1)
    out["cap"] = cap
    return out


def routing(con: Con, run_dir: Path, *, window: int | None, max_points: int, pool: str | None = None) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    if span is None:
        return out
    kw: dict[str, Any] = dict(first=span.origin, width=span.width, steps=span.steps)
    layers = query.routing_layer_series(con, run_dir, [], where=_pool_filter(pool), **kw)
    routed = query.aggregate_binned(con, run_dir, "tokens", [], where=_pool_filter(pool), **kw)
    out["layers"] = with_zero_flips(layers, routed)   # a layer that routed tokens without a flip: 0
    out["pools"] = query.metric_series_binned(con, run_dir, ["pool"], metrics=[FLIPS, ANY_FLIP], **kw)
    return out


def corrections(con: Con, run_dir: Path, *, window: int | None, max_points: int) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    if span is None:
        return out
    out["series"] = query.metric_series_binned(con, run_dir, ["pool"], first=span.origin, width=span.width,
                                               steps=span.steps, metrics=CORRECTIONS)
    out["totals"] = query.metric_totals(con, run_dir, ["pool"], metrics=CORRECTIONS, steps=span.steps)
    out["config"] = query.run_config(run_dir)
    return out


def alerts(con: Con, run_dir: Path, *, window: int | None, max_points: int,
           metric: str | None = None) -> Frames:
    out, span = _start(con, run_dir, window, max_points)
    events = query.alert_events(con, run_dir, steps=None if span is None else span.steps)
    out["events"] = events
    out["alerting"] = read_alerting(read_run_info(run_dir))   # what judged them, what each rule could judge
    out["run_events"] = _in_span(run_events(con, run_dir), span)   # syncs, resumes, resyncs (may be none)
    out["firing"] = query.firing_alerts(events)
    out["resyncs"] = asked_resyncs(events, out["run_events"])
    if span is None or metric is None:
        return out
    kw: dict[str, Any] = dict(first=span.origin, width=span.width, steps=span.steps, metrics=[metric])
    out["series"] = query.metric_series_binned(con, run_dir, ["pool"], **kw)
    return out


def compare(con: Con, run_dir: Path, *, window: int | None, max_points: int, other: str,
            by: tuple[str, ...] = ("pool",), metrics: tuple[str, ...] = POOL_DEFAULT,
            metric: str = K3) -> Frames:
    """``run_dir`` is run A and ``other`` run B; each is merged over its own last ``window`` steps."""
    out, span_a = _start(con, run_dir, window, max_points)
    index_b = query.steps_index(con, other)
    span_b = span_of(index_b, window, max_points)
    out.update(index_b=index_b, span_b=span_b)
    out["table"] = query.compare_runs(con, run_dir, other, list(by), metrics=metrics,
                                      steps_a=None if span_a is None else span_a.steps,
                                      steps_b=None if span_b is None else span_b.steps)
    for key, run, span in (("series_a", run_dir, span_a), ("series_b", other, span_b)):
        if span is not None:
            out[key] = query.metric_series_binned(con, run, [], first=span.origin, width=span.width,
                                                  steps=span.steps, metrics=[metric])
    out["configs_differ"] = query.run_config(run_dir) != query.run_config(other)
    return out


def run_series(con: Con, run_dir: Path, *, window: int | None, max_points: int, metric: str = K3) -> Frames:
    """One run of the Several runs page: its run.json, its steps shown and ``metric`` per pool."""
    out, span = _start(con, run_dir, window, max_points)
    out["info"] = read_run_info(run_dir)
    if span is not None:
        out["series"] = query.metric_series_binned(con, run_dir, ["pool"], first=span.origin, width=span.width,
                                                   steps=span.steps, metrics=[metric])
    return out


def exemplars(con: Con, run_dir: Path, *, window: int | None, max_points: int, step: int | None = None,
              k: int = 16, pool: str | None = None) -> Frames:
    """The steps holding exemplars (with ``pool``: those of that pool's tokens), and with ``step``
    its worst ``k`` tokens and sequences."""
    out, span = _start(con, run_dir, window, max_points)
    steps = query.exemplar_steps(con, run_dir, pool=pool)
    out["exemplar_steps"] = steps
    if step is None:
        return out
    out["tokens"] = query.rows(con, run_dir, "exemplar_tokens", steps=(step, step),
                               order_by="abs_log_ratio", limit=k)
    out["sequences"] = query.rows(con, run_dir, "exemplar_sequences", steps=(step, step),
                                  order_by="seq_max_abs_log_ratio", limit=k)
    return out


def bucket_labels(edges: tuple[float, ...], *, what: str, integer: bool) -> dict[object, str]:
    """Readable names of the buckets of ``edges`` keyed as the store keys them: sampler-probability
    buckets by index 0..len(edges), length and turn buckets by their lower edge."""
    if not integer:
        names = {0: f"{what} < {edges[0]:g}"}
        names.update({i: f"{lo:g} ≤ {what} < {hi:g}" for i, (lo, hi) in enumerate(zip(edges, edges[1:]), 1)})
        names[len(edges)] = f"{what} ≥ {edges[-1]:g}"
        return names
    lowers = [0, *(int(e) for e in edges)]
    names = {}
    for lo, hi in zip(lowers, lowers[1:]):
        names[lo] = f"{lo}" if hi - lo == 1 else f"{lo}–{hi - 1}"
    names[lowers[-1]] = f"≥ {lowers[-1]}"
    return names


def alert_metrics(events: pd.DataFrame) -> dict[str, str]:
    """Alert name -> the metric it fires on: the event's own ``metric`` column where the writer
    recorded one, else the first metric of the rule of that name in the alert definitions."""
    from mismatch_monitor.alerts import DEFAULT_RULES  # the one definition of every alert

    out = {rule.name: rule.condition.metrics[0] for rule in DEFAULT_RULES if rule.condition.metrics}
    if len(events) and "metric" in events.columns:
        for name, metric in zip(events["alert"], events["metric"]):
            if isinstance(metric, str) and metric:
                out[str(name)] = metric
    return out
