"""The run's logs as the dashboard and ``summary`` read them: alert state changes and the errors
the collector counted (each with its message), from committed flushes only."""

from __future__ import annotations

import duckdb
import pandas as pd

from ..store.schema import ERROR_COLUMNS, ERRORS_TABLE, file_id_of
from .core import StepRange, rows
from .files import RunDir, _retry, current_files


ALERT_COLUMNS: tuple[str, ...] = ("step", "wall_time", "alert", "severity", "pool", "state", "value",
                                  "threshold", "summary", "runbook", "resync", "metric")


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


def resync_firings(events: pd.DataFrame) -> pd.Series:
    """Per alert event: a firing that asked for a resync (its alert's own request; a held firing's
    later requests are ``resync_request`` events only, ``events.resync_requests``)."""
    return (events["state"] == "firing") & events["resync"].fillna(False).astype(bool)


def firing_alerts(events: pd.DataFrame) -> pd.DataFrame:
    """The alerts whose latest event (per alert and pool) is a firing."""
    if not len(events):
        return events.copy()
    last = events.sort_values("step", kind="stable").groupby(["alert", "pool"], dropna=False).tail(1)
    return last[last["state"] == "firing"].reset_index(drop=True)
