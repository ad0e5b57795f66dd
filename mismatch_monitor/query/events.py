"""Readers of the run's event and outcome logs (``store/event_log.py``).

Rows of committed flushes only (an index file names the flush's file id); a compaction's copy
and its originals are read once (per ``write_id``, the latest file). Outcomes: one value per
(step, pool, name), the one logged last (highest ``write_id``). A run written before these
tables existed gives an empty frame with the columns.
"""

from __future__ import annotations

import duckdb
import pandas as pd

from ..label_text import label_text
from ..store.event_log import EVENT_COLUMNS, EVENTS_TABLE, OUTCOME_COLUMNS, OUTCOMES_TABLE, empty_frame, requested_by
from ..store.schema import file_id_of
from .core import RunDir, _retry, current_files, metric_series

# the rows of committed flushes, each write once: the latest file of its write_id
_COMMITTED = ("SELECT t.*, max(t.file_id) OVER (PARTITION BY t.write_id) AS latest_file "
              "FROM read_parquet($files, union_by_name=true) t WHERE list_contains($ids, t.file_id)")
_EVENTS_SQL = ("SELECT step, wall_time, kind, pool, version, message "
               f"FROM ({_COMMITTED}) WHERE file_id = latest_file ORDER BY step, wall_time, write_id")
_OUTCOMES_SQL = ("SELECT step, wall_time, pool, name, value "
                 f"FROM ({_COMMITTED}) WHERE file_id = latest_file "
                 "QUALIFY row_number() OVER (PARTITION BY step, pool, name ORDER BY write_id DESC) = 1 "
                 "ORDER BY step, name, pool NULLS FIRST")


def _read(con: duckdb.DuckDBPyConnection, run_dir: RunDir, table: str, sql: str,
          columns: dict[str, str]) -> pd.DataFrame:
    listed = current_files(run_dir, table)
    ids = [i for i in (file_id_of(f) for f in listed["steps"]) if i is not None]
    if not listed["files"] or not ids:
        return empty_frame(table)
    df = _retry(lambda: con.execute(sql, {"files": listed["files"], "ids": ids}).df())
    return df.astype(columns).reset_index(drop=True) if len(df) else empty_frame(table)


def run_events(con: duckdb.DuckDBPyConnection, run_dir: RunDir) -> pd.DataFrame:
    """Every weight sync, resume, resync and resync request of the run, by step: step,
    wall_time, kind, pool (null: every pool), version (null: unknown), message."""
    return _read(con, run_dir, EVENTS_TABLE, _EVENTS_SQL, EVENT_COLUMNS)


def resync_requests(events: pd.DataFrame) -> pd.DataFrame:
    """The resync requests among ``run_events``' rows: step, pool (its label text, as the alerts
    table names pools; null: the fleet) and alert (the rule that asked). A held firing asks again
    each time its pool falls behind after a resync, so a firing may own several."""
    rows = events[events["kind"] == "resync_request"]
    return pd.DataFrame({"step": rows["step"].astype("int64").to_numpy(),
                         "pool": pd.Series([None if pd.isna(p) else label_text(str(p)) for p in rows["pool"]],
                                           dtype="object"),
                         "alert": pd.Series([requested_by(m) for m in rows["message"]], dtype="object")})


def run_outcomes(con: duckdb.DuckDBPyConnection, run_dir: RunDir) -> pd.DataFrame:
    """The run's training outcomes, by step: step, wall_time, pool (null: the whole batch),
    name, value; one row per (step, pool, name), the value logged last."""
    return _read(con, run_dir, OUTCOMES_TABLE, _OUTCOMES_SQL, OUTCOME_COLUMNS)


RESYNC_EFFECT_COLUMNS: dict[str, str] = {"step": "int64", "pool": "string", "version": "Int64",
                                         "before_step": "Int64", "before": "float64",
                                         "after_step": "Int64", "after": "float64"}


def resync_effects(con: duckdb.DuckDBPyConnection, run_dir: RunDir, metric: str = "mismatch/k3_kl") -> pd.DataFrame:
    """Did each resync help: per ``resync`` event (step, pool, version), ``metric`` of that pool
    at the last observed step before the resync (``before_step``, ``before``) and at the first
    observed step from it on (``after_step``, ``after``); null where the run has no such step.
    A resync of every pool (pool null) is read on the whole fleet."""
    events = run_events(con, run_dir)
    resyncs = events[events["kind"] == "resync"]
    if not len(resyncs):
        return pd.DataFrame({c: pd.Series([], dtype=t) for c, t in RESYNC_EFFECT_COLUMNS.items()})
    by_pool = metric_series(con, run_dir, ["pool"], metrics=[metric])
    fleet = metric_series(con, run_dir, metrics=[metric])
    rows = []
    for r in resyncs.itertuples(index=False):
        series = fleet if pd.isna(r.pool) else by_pool[by_pool["pool"] == r.pool]
        series = series[series[metric].notna()]
        before, after = series[series["step"] < r.step].tail(1), series[series["step"] >= r.step].head(1)
        rows.append({"step": r.step, "pool": r.pool, "version": r.version,
                     "before_step": before["step"].iloc[0] if len(before) else None,
                     "before": float(before[metric].iloc[0]) if len(before) else None,
                     "after_step": after["step"].iloc[0] if len(after) else None,
                     "after": float(after[metric].iloc[0]) if len(after) else None})
    return pd.DataFrame(rows).astype(RESYNC_EFFECT_COLUMNS)
