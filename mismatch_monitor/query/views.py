"""Dashboard views: what the dashboard reads beyond the core readers (``core.py``): metric
series over step bins (``binned.py``), totals over a step range, two runs side by side, the
steps with exemplars, a key column's values. As everywhere in the query layer, identifiers are
checked and every value is bound.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import duckdb
import numpy as np
import pandas as pd

from ..config import MetricConfig
from ..engine.fields import TABLES, TURN_KEY
from ..metrics import METRIC_BY_KEY, derive
from ..store.schema import STEPS_TABLE
from .binned import _current_sources, aggregate_binned, step_width  # noqa: F401  (_current_sources: tested)
from .core import (StepRange, _check_keys, _columns, _index_cte, metric_series, run_config, steps_index,
                   table_files)
from .files import RunDir, _retry, current_files


def _wanted(metrics: Sequence[str] | None) -> list[str]:
    wanted = list(metrics) if metrics is not None else list(METRIC_BY_KEY)
    unknown = [m for m in wanted if m not in METRIC_BY_KEY]
    if unknown:
        raise ValueError(f"unknown metrics {unknown}; expected keys of mismatch_monitor.metrics.METRICS")
    return wanted


def binned_sums(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                first: int, width: int, metrics: Sequence[str] | None = None, steps: StepRange = None,
                where: Mapping[str, str] | None = None) -> dict[str, pd.DataFrame | None]:
    """The merged tables ``metrics`` are derived from, per step bin and group: ``tokens`` (with
    step_last and wall_time), ``sequences`` and ``abs_hist`` (None where no metric needs them)."""
    by = list(by)
    tables = {METRIC_BY_KEY[m].table for m in _wanted(metrics)}
    kw: dict[str, Any] = dict(first=first, width=width, steps=steps, where=where)
    out: dict[str, pd.DataFrame | None] = {"tokens": aggregate_binned(con, run_dir, "tokens", by, **kw),
                                           "sequences": None, "abs_hist": None}
    if "sequences" in tables and TURN_KEY not in by:
        out["sequences"] = aggregate_binned(con, run_dir, "sequences", by, times=False, **kw)
    if "abs_hist" in tables:
        out["abs_hist"] = aggregate_binned(con, run_dir, "abs_hist", by, times=False, **kw)
    return out


def derive_sums(sums: Mapping[str, pd.DataFrame | None], by: Sequence[str], *, metrics: Sequence[str] | None,
                config: MetricConfig) -> pd.DataFrame:
    """Metric values of :func:`binned_sums`: columns step, step_last, wall_time, *by, metric keys."""
    by = list(by)
    wanted = set(_wanted(metrics))
    tokens = sums["tokens"]
    out = derive(tokens, sums["sequences"], sums["abs_hist"], by=["step"] + by, config=config)
    out.insert(1, "step_last", tokens["step_last"].to_numpy())
    out.insert(2, "wall_time", tokens["wall_time"].to_numpy())
    return out[["step", "step_last", "wall_time"] + by + [m for m in METRIC_BY_KEY if m in wanted]]


def metric_series_binned(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                         first: int, width: int, metrics: Sequence[str] | None = None,
                         steps: StepRange = None, where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """:func:`metric_series` over step bins: columns step, step_last, wall_time, *by, metric keys."""
    sums = binned_sums(con, run_dir, by, first=first, width=width, metrics=metrics, steps=steps, where=where)
    return derive_sums(sums, by, metrics=metrics, config=run_config(run_dir))


def _whole(con: duckdb.DuckDBPyConnection, run_dir: RunDir, steps: StepRange) -> tuple[int, int] | None:
    """``steps`` with open ends closed by the run's first and last visible step (None: no step)."""
    lo, hi = steps if steps is not None else (None, None)
    if lo is None or hi is None:
        index = steps_index(con, run_dir)
        if not len(index):
            return None
        lo = int(index["step"].min()) if lo is None else lo
        hi = int(index["step"].max()) if hi is None else hi
    return (int(lo), int(hi)) if hi >= lo else None


def metric_totals(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                  metrics: Sequence[str] | None = None, steps: StepRange = None,
                  where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Metrics per group with every step of ``steps`` merged (as ``metric_series(per_step=False)``):
    columns *by, metric keys."""
    by = list(by)
    span = _whole(con, run_dir, steps)
    if span is None:
        return metric_series(con, run_dir, by, metrics=metrics, steps=(0, -1), per_step=False)
    out = metric_series_binned(con, run_dir, by, first=span[0], width=span[1] - span[0] + 1,
                               metrics=metrics, steps=span, where=where)
    return out.drop(columns=["step", "step_last", "wall_time"]).reset_index(drop=True)


def exemplar_steps(con: duckdb.DuckDBPyConnection, run_dir: RunDir, *, pool: str | None = None) -> pd.DataFrame:
    """Visible steps that hold token exemplars: step, max_abs_log_ratio (the step's largest stored
    |lr|) and pool (the pool of that token; null for a token without one). With ``pool``, only
    that pool's tokens count (a bound value)."""
    files = table_files(run_dir, "exemplar_tokens")
    if not files or not table_files(run_dir, STEPS_TABLE):
        return pd.DataFrame({"step": pd.Series([], dtype="int64"), "max_abs_log_ratio": pd.Series([], dtype="float64"),
                             "pool": pd.Series([], dtype="object")})
    where = "" if pool is None else "WHERE t.pool = $pool "
    sql = (f"WITH {_index_cte()} SELECT t.step, max(t.abs_log_ratio) AS max_abs_log_ratio, "
           "arg_max(t.pool, t.abs_log_ratio) AS pool "
           f"FROM read_parquet($files, union_by_name=true) t JOIN idx USING (step, file_id) {where}"
           "GROUP BY t.step ORDER BY t.step")
    params = {} if pool is None else {"pool": str(pool)}
    return _retry(lambda: con.execute(sql, {**current_files(run_dir, "exemplar_tokens"), **params}).df())


def compare_runs(con: duckdb.DuckDBPyConnection, run_a: RunDir, run_b: RunDir, by: Sequence[str] = (), *,
                 metrics: Sequence[str], steps_a: StepRange = None, steps_b: StepRange = None) -> pd.DataFrame:
    """Metrics of two runs per slice, each merged over its step range: one row per (slice, metric)
    with columns *by, metric, a, b, diff (b - a) and rel (b / a - 1, null when a is 0 or null)."""
    by = list(by)
    a = metric_totals(con, run_a, by, metrics=metrics, steps=steps_a)
    b = metric_totals(con, run_b, by, metrics=metrics, steps=steps_b)
    long_a = a.melt(id_vars=by, value_vars=list(metrics), var_name="metric", value_name="a")
    long_b = b.melt(id_vars=by, value_vars=list(metrics), var_name="metric", value_name="b")
    out = long_a.merge(long_b, on=by + ["metric"], how="outer")
    out["a"] = out["a"].astype("float64")
    out["b"] = out["b"].astype("float64")
    out["diff"] = out["b"] - out["a"]
    with np.errstate(divide="ignore", invalid="ignore"):
        out["rel"] = np.where(out["a"].abs() > 0, out["b"] / out["a"].where(out["a"].abs() > 0) - 1.0, np.nan)
    order = {m: i for i, m in enumerate(metrics)}
    out["_order"] = out["metric"].map(order)
    return out.sort_values(by + ["_order"], na_position="last").drop(columns="_order").reset_index(drop=True)


def distinct_values(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, column: str) -> list[Any]:
    """The sorted distinct values of a key column over a run's visible steps (nulls last)."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    files = table_files(run_dir, table)
    if not files or not table_files(run_dir, STEPS_TABLE):
        return []
    _check_keys([column], _columns(con, run_dir, table), table)
    sql = (f'WITH {_index_cte()} SELECT DISTINCT t."{column}" AS v '
           "FROM read_parquet($files, union_by_name=true) t JOIN idx USING (step, file_id) "
           "ORDER BY v NULLS LAST")
    df = _retry(lambda: con.execute(sql, current_files(run_dir, table)).df())
    return [None if pd.isna(v) else v for v in df["v"].tolist()]
