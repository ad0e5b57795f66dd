"""The core readers of the query layer (runs, steps, aggregates, metric series, rows).

Readers resolve each step to the file set that last wrote it (``steps`` index, highest
``write_id``, then highest ``file_id``), so restarts and compactions never show a step twice,
and data files a crashed flush left without an index entry are ignored. Sufficient statistics
are summed (``sum``/``max``/``min`` per ``engine/fields.py``) in SQL and metrics are derived
afterwards by :func:`mismatch_monitor.metrics.derive`, so a marginal means what a cell means.

Identifiers (group-by columns) cannot be bound as parameters: they are checked against the
known key columns before they reach SQL; every value is bound.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import duckdb
import pandas as pd

from ..batch import STANDARD_DIMENSIONS
from ..config import MetricConfig
from ..engine.fields import LENGTH_KEY, TABLES, TOKEN_CELL_TABLES, TURN_KEY, merge_rules, merge_sql
from ..metrics import METRIC_BY_KEY, derive
from ..store.current import index_cte, table_files
from ..store.runinfo import read_run_info
from ..store.schema import STEPS_TABLE
from .files import (RunDir, _memo, _retry, current_files, current_index, file_columns,  # noqa: F401  (the layer's names)
                    forget_files, raw_index)

StepRange = tuple[int | None, int | None] | None


def connect() -> duckdb.DuckDBPyConnection:
    """A fresh in-memory DuckDB connection (reads Parquet files; stores nothing)."""
    return duckdb.connect(database=":memory:")


def run_config(run_dir: RunDir) -> MetricConfig:
    return MetricConfig.from_dict(read_run_info(run_dir)["config"])


# the store's rule for the current row of a step and its files (``store/current.py``)
_index_cte = index_cte


def _step_filter(steps: StepRange, params: dict[str, Any], alias: str = "t") -> list[str]:
    clauses: list[str] = []
    if steps is not None:
        lo, hi = steps
        if lo is not None:
            clauses.append(f"{alias}.step >= $step_lo")
            params["step_lo"] = int(lo)
        if hi is not None:
            clauses.append(f"{alias}.step <= $step_hi")
            params["step_hi"] = int(hi)
    return clauses


def _label_filter(where: Mapping[str, str | None] | None, params: dict[str, Any]) -> list[str]:
    """``label = value`` clauses (values bound; column names checked by the caller)."""
    clauses = []
    for i, (col, value) in enumerate((where or {}).items()):
        if value is None:
            clauses.append(f't."{col}" IS NULL')
        else:
            clauses.append(f't."{col}" = $w{i}')
            params[f"w{i}"] = str(value)
    return clauses


def _merged_columns(rules: Mapping[str, str], available: set[str]) -> list[str]:
    """``sum/max/min(col) AS col`` (``fields.merge_sql``) per value column (NULL for a column no
    file has yet)."""
    return [merge_sql(rule, 't."' + col + '"') + f' AS "{col}"' if col in available else f'NULL AS "{col}"'
            for col, rule in rules.items()]


def _columns(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str) -> set[str]:
    """Column names over a table's current files (listed afresh when a compaction removed one)."""
    return set(_retry(lambda: file_columns(con, table_files(run_dir, table))))


def _check_keys(by: Sequence[str], available: set[str], table: str) -> None:
    allowed = set(STANDARD_DIMENSIONS) | {LENGTH_KEY, TURN_KEY} | available
    for col in by:
        if col not in allowed or not col.isidentifier() or col in merge_rules(table):
            raise ValueError(f"cannot group {table} by {col!r}; expected one of {sorted(allowed - set(merge_rules(table)))}")


def steps_index(con: duckdb.DuckDBPyConnection, run_dir: RunDir) -> pd.DataFrame:
    """One row per visible step: step, wall_time, n_tokens, n_sequences, n_cells, collector_errors."""
    files = table_files(run_dir, STEPS_TABLE)
    if not files:
        return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in (
            ("step", "int64"), ("wall_time", "float64"), ("n_tokens", "int64"), ("n_sequences", "int64"),
            ("n_cells", "int64"), ("collector_errors", "int64"))})
    cols = ["step", "wall_time", "n_tokens", "n_sequences", "n_cells", "collector_errors"]
    return _retry(lambda: current_index(con, table_files(run_dir, STEPS_TABLE))[cols].copy())


def aggregate(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, by: Sequence[str] = (), *,
              steps: StepRange = None, where: Mapping[str, str] | None = None,
              per_step: bool = True) -> pd.DataFrame:
    """Sufficient statistics of ``table`` merged per (step,) ``by`` (+ the table's own extra keys).

    ``where`` restricts label columns to values (e.g. ``{"pool": "fp8"}``); ``per_step=False``
    merges over all steps in range.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    by = list(by)
    extra = list(TABLES[table][0])
    rules = merge_rules(table)
    files = table_files(run_dir, table)
    step_files = table_files(run_dir, STEPS_TABLE)
    lead = ["step", "wall_time"] if per_step else []
    out_cols = lead + by + extra + list(rules)
    if not files or not step_files:
        return pd.DataFrame({c: [] for c in out_cols})
    available = _columns(con, run_dir, table)
    _check_keys(by + list((where or {}).keys()), available, table)
    params: dict[str, Any] = {}
    clauses = _step_filter(steps, params) + _label_filter(where, params)
    where_sql = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    keys = (["t.step"] if per_step else []) + [f't."{c}"' for c in by + extra]
    aggs = _merged_columns(rules, available)
    select = keys + (["any_value(idx.wall_time) AS wall_time"] if per_step else []) + aggs
    group = (" GROUP BY " + ", ".join(keys)) if keys else ""
    order = (" ORDER BY " + ", ".join(keys)) if keys else ""
    sql = (f"WITH {_index_cte()} SELECT {', '.join(select)} "
           f"FROM read_parquet($files, union_by_name=true) t JOIN idx USING (step, file_id)"
           f"{where_sql}{group}{order}")

    def run() -> pd.DataFrame:
        p = dict(params, **current_files(run_dir, table))
        return con.execute(sql, p).df()

    df = _retry(run)
    return df[[c for c in out_cols if c in df.columns]]


def metric_series(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = (), *,
                  metrics: Sequence[str] | None = None, steps: StepRange = None,
                  where: Mapping[str, str] | None = None, per_step: bool = True) -> pd.DataFrame:
    """Metric values per step and group: columns step, wall_time, *by, then metric keys."""
    by = list(by)
    if metrics is not None:
        unknown = [m for m in metrics if m not in METRIC_BY_KEY]
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; expected keys of mismatch_monitor.metrics.METRICS")
    wanted = set(metrics) if metrics is not None else set(METRIC_BY_KEY)
    tables = {METRIC_BY_KEY[m].table for m in wanted}
    keys = (["step"] if per_step else []) + by
    tokens = aggregate(con, run_dir, "tokens", by, steps=steps, where=where, per_step=per_step)
    seq = None
    if "sequences" in tables and TURN_KEY not in by:
        seq = aggregate(con, run_dir, "sequences", by, steps=steps, where=where, per_step=per_step)
        seq = seq.drop(columns=["wall_time"], errors="ignore")
    hist = None
    if "abs_hist" in tables:
        hist = aggregate(con, run_dir, "abs_hist", by, steps=steps, where=where, per_step=per_step)
        hist = hist.drop(columns=["wall_time"], errors="ignore")
    out = derive(tokens, seq, hist, by=keys, config=run_config(run_dir))
    if per_step:
        out.insert(1, "wall_time", tokens["wall_time"].to_numpy() if len(tokens) else [])
    cols = (["step", "wall_time"] if per_step else []) + by + [m for m in METRIC_BY_KEY if m in wanted]
    return out[cols]


def latest(con: duckdb.DuckDBPyConnection, run_dir: RunDir, by: Sequence[str] = ("pool",),
           metrics: Sequence[str] | None = None) -> pd.DataFrame:
    """Metrics of the latest step with observations, per group (empty frame for an empty run)."""
    idx = steps_index(con, run_dir)
    observed = idx[idx["n_tokens"] > 0]
    if observed.empty:
        return metric_series(con, run_dir, by, metrics=metrics, steps=(0, -1))
    last = int(observed["step"].max())
    return metric_series(con, run_dir, by, metrics=metrics, steps=(last, last))


def metric_series_runs(con: duckdb.DuckDBPyConnection, run_dirs: Sequence[RunDir], by: Sequence[str] = (), *,
                       metrics: Sequence[str] | None = None, steps: StepRange = None,
                       where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """:func:`metric_series` of several runs, one frame with a leading ``run`` column (run ids
    from run.json; each run is derived with its own metric config)."""
    frames = []
    for run_dir in run_dirs:
        df = metric_series(con, run_dir, by, metrics=metrics, steps=steps, where=where)
        frames.append(df.assign(run=read_run_info(run_dir)["run_id"]))
    if not frames:
        return pd.DataFrame({"run": pd.Series([], dtype="string")})
    observed = [f for f in frames if len(f)]      # empty runs add no rows (nor float dtypes)
    out = pd.concat(observed, ignore_index=True) if observed else frames[0]
    return out[["run"] + [c for c in out.columns if c != "run"]]


def histogram(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str = "abs_hist",
              by: Sequence[str] = (), *, steps: StepRange = None,
              where: Mapping[str, str] | None = None) -> pd.DataFrame:
    """Merged histogram rows (step, wall_time, *by, [kind,] bin, count) for heatmaps."""
    if table not in ("abs_hist", "seq_hist", "staleness", "lowprob", "routing_layers"):
        raise ValueError(f"{table!r} is not a per-bin table")
    return aggregate(con, run_dir, table, by, steps=steps, where=where)


def rows(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, *, steps: StepRange = None,
         order_by: str | None = None, descending: bool = True, limit: int | None = None) -> pd.DataFrame:
    """Current rows of a row table (exemplars, alerts): no aggregation."""
    if table not in ("exemplar_tokens", "exemplar_sequences", "alerts"):
        raise ValueError(f"{table!r} is not a row table")
    files = table_files(run_dir, table)
    if not files or not table_files(run_dir, STEPS_TABLE):
        return pd.DataFrame()
    available = _columns(con, run_dir, table)
    params: dict[str, Any] = {}
    clauses = _step_filter(steps, params)
    where_sql = (" WHERE " + " AND ".join(clauses)) if clauses else ""
    order = " ORDER BY t.step"
    if order_by is not None:
        if order_by not in available:
            raise ValueError(f"cannot order {table} by {order_by!r}; expected one of {sorted(available)}")
        order = f' ORDER BY t."{order_by}" {"DESC" if descending else "ASC"}, t.step'
    limit_sql = ""
    if limit is not None:
        limit_sql = " LIMIT $limit"
        params["limit"] = int(limit)
    sql = (f"WITH {_index_cte()} SELECT t.* EXCLUDE (write_id, file_id), idx.wall_time AS step_wall_time "
           f"FROM read_parquet($files, union_by_name=true) t JOIN idx USING (step, file_id)"
           f"{where_sql}{order}{limit_sql}")
    return _retry(lambda: con.execute(sql, dict(params, **current_files(run_dir, table))).df())


def token_cell_table(table: str) -> bool:
    return table in TOKEN_CELL_TABLES
