"""Dashboard views: what the dashboard reads beyond the core readers (``core.py``).

Long runs are shown as step bins: a bin of ``width`` consecutive steps merges their sufficient
statistics exactly (sum/max/min), so a binned value is the value of the merged steps, never a
mean of per-step values. As everywhere in the query layer, identifiers are checked and every
value is bound.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from ..config import MetricConfig
from ..engine.fields import TABLES, TURN_KEY, merge_rules
from ..metrics import METRIC_BY_KEY, derive
from ..store.schema import ERROR_COLUMNS, ERRORS_TABLE, STEPS_TABLE, file_id_of
from . import rollup
from .core import (RunDir, StepRange, _check_keys, _columns, _index_cte, _label_filter, _memo, _merged_columns,
                   _retry, _step_filter,
                   current_files, current_index, file_columns, metric_series, raw_index, rows, run_config,
                   steps_index, table_files)


ALERT_COLUMNS: tuple[str, ...] = ("step", "wall_time", "alert", "severity", "pool", "state", "value",
                                  "threshold", "summary", "runbook", "resync", "metric")


def step_width(first: int, last: int, max_points: int) -> int:
    """Steps per bin so that [first, last] fits in at most ``max_points`` bins (>= 1)."""
    if max_points < 1:
        raise ValueError(f"expected max_points >= 1, got {max_points}")
    span = max(0, int(last) - int(first) + 1)
    return max(1, -(-span // max_points))


def _current_sources(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str,
                     steps: tuple[int, int | None] | None = None) -> tuple[list[str], list[str], bool]:
    """(data files, index files, exact) for reading the current rows of ``table`` [in ``steps``].

    Only the data files that hold a current step (in ``steps``) are returned: the index names
    each step's file (a file's name carries its file_id). ``exact``: no step is listed twice in
    the index (no re-logged step, no compaction in progress), so the current rows are exactly the
    rows of those files and the per-row join with the index can be skipped; otherwise the caller
    joins.
    """
    listed = current_files(run_dir, table)             # index first: see current_files
    files, step_files = listed["files"], listed["steps"]
    if not files or not step_files:
        return files, step_files, False
    named = {f: file_id_of(f) for f in files}
    if any(i is None for i in named.values()):
        return files, step_files, False
    current = current_index(con, step_files)
    c_step, c_fid = current["step"].to_numpy(), current["file_id"].to_numpy()
    if steps is not None:
        keep = c_step >= steps[0] if steps[1] is None else (c_step >= steps[0]) & (c_step <= steps[1])
        c_fid = c_fid[keep]
    ids = set(c_fid.tolist())
    exact = len(raw_index(con, step_files)) == len(current)     # no step listed twice
    return [f for f in files if named[f] in ids], step_files, exact


def _categorical_keys(table: pa.Table) -> pd.DataFrame:
    """A frame whose string columns are categorical: a histogram repeats each label hundreds of
    times, and building one Python string per row would cost more than the query."""
    for i, f in enumerate(table.schema):
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            table = table.set_column(i, f.name, table.column(i).dictionary_encode())
        elif pa.types.is_decimal(f.type):     # DuckDB sums integers as HUGEINT; .df() gives float64
            table = table.set_column(i, f.name, table.column(i).cast(pa.float64()))
    return table.to_pandas()


def _raw_columns(rules: Mapping[str, str], available: set[str]) -> list[str]:
    """Each value column as it is (NULL for a column no file has yet)."""
    return [f't."{col}"' if col in available else f'NULL AS "{col}"' for col in rules]


def _rollup_plan(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, dims: Sequence[str], first: int,
                 width: int, steps: StepRange, step_files: list[str]) -> tuple[rollup.Plan, list[str], set[str]] | None:
    """The rollups a binned read can use (``rollup.plan``), their files and columns; None if none."""
    rfiles = table_files(run_dir, rollup.rollup_name(table))        # listed after the index
    rolled = {i for i in map(file_id_of, rfiles) if i is not None}
    if not rolled or rollup.choose(table, dims) is None:
        return None
    lo, hi = steps if steps is not None else (None, None)
    blocks = _memo("blocks", step_files,
                   lambda: rollup.blocks_of(raw_index(con, step_files), current_index(con, step_files)))
    plan = rollup.plan(blocks, rolled, table, dims, first=first, width=width, lo=lo, hi=hi)
    if plan is None:
        return None
    return plan, rfiles, set(file_columns(con, rfiles))


def aggregate_binned(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, by: Sequence[str] = (),
                     *, first: int, width: int, steps: StepRange = None,
                     where: Mapping[str, str] | None = None, times: bool = True) -> pd.DataFrame:
    """Like :func:`aggregate` per step, with steps merged into bins of ``width`` starting at ``first``.

    Columns: step (first step of the bin), step_last (last visible step in it), wall_time (of
    step_last), *by, the table's extra keys, the merged fields. ``width=1`` is per step.
    ``times=False`` leaves out step_last and wall_time.

    Whole blocks of steps are read from the store's rollups where that is exact
    (``rollup.plan``), the rest from cells; both give the same merged values.
    """
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
    if int(width) < 1:
        raise ValueError(f"expected width >= 1, got {width}")
    by = list(by)
    extra = list(TABLES[table][0])
    rules = merge_rules(table)
    out_cols = ["step"] + (["step_last", "wall_time"] if times else []) + by + extra + list(rules)
    files = table_files(run_dir, table)
    if not files or not table_files(run_dir, STEPS_TABLE):
        return pd.DataFrame({c: [] for c in out_cols})
    available = _columns(con, run_dir, table)
    _check_keys(by + list((where or {}).keys()), available, table)
    params: dict[str, Any] = {"first": int(first), "width": int(width)}
    clauses = ["t.step >= $first"] + _step_filter(steps, params) + _label_filter(where, params)
    keys = [f'"{c}"' for c in by + extra]
    bin_and_keys = ["$first + (t.s - $first) // $width * $width AS step"] + [f"t.{k}" for k in keys]
    aggs = _merged_columns(rules, set(rules))          # every column is in src (NULL where absent)
    order = ["step"] + keys

    def cells(exact: bool, only: str = "") -> str:
        """Rows of the cell files $files (current rows only: joined with the index unless exact)."""
        source = "read_parquet($files, union_by_name=true) t" + (
            "" if exact else " SEMI JOIN idx USING (step, file_id)")
        select = ["t.step AS s", "t.step AS step_last"] + [f"t.{k}" for k in keys] + _raw_columns(rules, available)
        return f"SELECT {', '.join(select)} FROM {source}{only} WHERE {' AND '.join(clauses)}"

    def run() -> pd.DataFrame:
        lo = int(first) if steps is None or steps[0] is None else max(int(first), int(steps[0]))
        files, step_files, exact = _current_sources(con, run_dir, table, (lo, None if steps is None else steps[1]))
        p = dict(params)
        ctes = {"idx": "SELECT * FROM idx_now"}
        use = _rollup_plan(con, run_dir, table, by + list((where or {}).keys()), first, width, steps, step_files)
        if use is None:                       # every row from cells
            if not files:
                return pd.DataFrame({c: [] for c in out_cols})
            ctes["src"] = cells(exact)
            p["files"] = files
        else:                                 # whole blocks from rollups, the other steps from cells
            plan, rfiles, r_available = use
            ctes["ok"] = "SELECT unnest($ok_f) AS file_id, unnest($ok_b) AS block"
            select = ["t.block AS s", "t.step_last"] + [f"t.{k}" for k in keys] + _raw_columns(rules, r_available)
            ctes["src"] = (f"SELECT {', '.join(select)} FROM read_parquet($rfiles, union_by_name=true) t "
                           "SEMI JOIN ok USING (file_id, block) WHERE "
                           + " AND ".join(["t.grouping = $grouping"] + _label_filter(where, p)))
            p.update(rfiles=rfiles, grouping=plan.grouping, ok_f=plan.file_ids, ok_b=plan.blocks)
            # the cells' files from the same listing as the index (see current_files); a flush
            # with no rows for this table has no file, and then no cells to add
            wanted = set(plan.cell_file_ids)
            cell_files = [f for f in files if file_id_of(f) in wanted]
            if plan.cell_steps and cell_files:
                ctes["todo"] = "SELECT unnest($todo) AS step"
                ctes["src"] = cells(False, " SEMI JOIN todo USING (step)") + " UNION ALL " + ctes["src"]
                p.update(files=cell_files, todo=plan.cell_steps)
        ctes["src"] = ctes.pop("src")         # last: it reads the others
        with_sql = "WITH " + ", ".join(f"{name} AS ({body})" for name, body in ctes.items())
        if times:
            inner = bin_and_keys + ["max(t.step_last) AS step_last"] + aggs
            outer = ["agg.step", "agg.step_last", "idx.wall_time"] + [f"agg.{k}" for k in keys] + [
                f'agg."{c}"' for c in rules]
            sql = (f"{with_sql}, agg AS (SELECT {', '.join(inner)} FROM src t GROUP BY ALL) "
                   f"SELECT {', '.join(outer)} FROM agg LEFT JOIN idx ON idx.step = agg.step_last "
                   f"ORDER BY {', '.join(f'agg.{k}' for k in order)}")
        else:
            sql = (f"{with_sql} SELECT {', '.join(bin_and_keys + aggs)} FROM src t GROUP BY ALL "
                   f"ORDER BY {', '.join(order)}")
        used = set(re.findall(r"\$(\w+)", sql))
        bound = {k: v for k, v in p.items() if k in used}
        # the current index, read once per list of index files (``current_index``)
        con.register("idx_now", current_index(con, step_files)[["step", "file_id", "wall_time"]])
        try:
            if times:
                return con.execute(sql, bound).df()
            return _categorical_keys(con.sql(sql, params=bound).to_arrow_table())
        finally:
            con.unregister("idx_now")

    return _retry(run)[out_cols]


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


def alert_events(con: duckdb.DuckDBPyConnection, run_dir: RunDir, *, steps: StepRange = None) -> pd.DataFrame:
    """Alert state changes (firing/resolved) of a run in step order, with every column of
    :data:`ALERT_COLUMNS` (null where the writer did not record it); empty when none."""
    df = rows(con, run_dir, "alerts", steps=steps)
    if not len(df):
        return pd.DataFrame({c: pd.Series([], dtype="float64" if c in ("wall_time", "value", "threshold")
                                          else "int64" if c == "step" else "object") for c in ALERT_COLUMNS})
    if "wall_time" not in df.columns and "step_wall_time" in df.columns:
        df["wall_time"] = df["step_wall_time"]
    for col in ALERT_COLUMNS:
        if col not in df.columns:
            df[col] = pd.NA
    return df.sort_values(["step", "wall_time"], kind="stable").reset_index(drop=True)


def collector_errors(con: duckdb.DuckDBPyConnection, run_dir: RunDir) -> pd.DataFrame:
    """Every error the collector counted, latest first: step (null when it had no valid step),
    wall_time, where, kind, message. Rows of committed flushes only (the index names the flush's
    file); a compaction's copy and its originals are read once (per write_id, the latest file)."""
    out = pd.DataFrame({c: pd.Series([], dtype=t) for c, t in ERROR_COLUMNS.items()})
    listed = current_files(run_dir, ERRORS_TABLE)
    ids = [i for i in (file_id_of(f) for f in listed["steps"]) if i is not None]
    if not listed["files"] or not ids:
        return out
    sql = ('SELECT step, wall_time, "where", kind, message FROM ('
           "SELECT t.*, max(t.file_id) OVER (PARTITION BY t.write_id) AS latest_file "
           "FROM read_parquet($files, union_by_name=true) t WHERE list_contains($ids, t.file_id)) "
           "WHERE file_id = latest_file ORDER BY wall_time DESC, step DESC NULLS LAST")
    df = _retry(lambda: con.execute(sql, {"files": listed["files"], "ids": ids}).df())
    return df.astype(ERROR_COLUMNS) if len(df) else out


def error_messages(errors: pd.DataFrame) -> pd.DataFrame:
    """The distinct (kind, message) of :func:`collector_errors`, latest first, with how many
    times each was counted, and where and at which step it was last seen."""
    if not len(errors):
        return pd.DataFrame({"count": pd.Series([], dtype="int64"), "where": pd.Series([], dtype="string"),
                             "kind": pd.Series([], dtype="string"), "message": pd.Series([], dtype="string"),
                             "last_step": pd.Series([], dtype="Int64"),
                             "last_wall_time": pd.Series([], dtype="float64")})
    keys = ["kind", "message"]
    grouped = errors.groupby(keys, dropna=False, sort=False)
    out = grouped.agg(count=("kind", "size"), last_wall_time=("wall_time", "max")).reset_index()
    latest = errors.sort_values("wall_time", kind="stable").groupby(keys, dropna=False, sort=False).tail(1)
    out = out.merge(latest[keys + ["where", "step"]].rename(columns={"step": "last_step"}), on=keys, how="left")
    out = out.sort_values("last_wall_time", ascending=False, kind="stable").reset_index(drop=True)
    return out[["count", "where", "kind", "message", "last_step", "last_wall_time"]]


def firing_alerts(events: pd.DataFrame) -> pd.DataFrame:
    """The alerts whose latest event (per alert and pool) is a firing."""
    if not len(events):
        return events.copy()
    last = events.sort_values("step", kind="stable").groupby(["alert", "pool"], dropna=False).tail(1)
    return last[last["state"] == "firing"].reset_index(drop=True)


def exemplar_steps(con: duckdb.DuckDBPyConnection, run_dir: RunDir) -> pd.DataFrame:
    """Visible steps that hold token exemplars, with their largest |lr| (step, max_abs_log_ratio)."""
    files = table_files(run_dir, "exemplar_tokens")
    if not files or not table_files(run_dir, STEPS_TABLE):
        return pd.DataFrame({"step": pd.Series([], dtype="int64"), "max_abs_log_ratio": pd.Series([], dtype="float64")})
    sql = (f"WITH {_index_cte()} SELECT t.step, max(t.abs_log_ratio) AS max_abs_log_ratio "
           "FROM read_parquet($files, union_by_name=true) t JOIN idx USING (step, file_id) "
           "GROUP BY t.step ORDER BY t.step")
    return _retry(lambda: con.execute(sql, current_files(run_dir, "exemplar_tokens")).df())


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
