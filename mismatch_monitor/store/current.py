"""Which of a run's files and rows are current: the store's one rule, for its readers and for
compaction.

A step's current rows are those of the index row with the highest ``write_id`` (the latest
flush), then the highest ``file_id`` (a compaction's copy of that flush): ``CURRENT``. Files
readers cannot serve (unreadable, foreign) are set aside by ``health.py`` when listed. The query
layer reads through these definitions; compaction (``compact.py``) copies the current rows with
:func:`copy_current`, so the store never needs the query layer.
"""

from __future__ import annotations

import os
from pathlib import Path

import duckdb
import pandas as pd

from . import health
from .schema import LOG_TABLES, STEPS_TABLE

# The one rule for which index row of a step is current: the latest flush (write_id), then the
# latest file set (file_id: a compaction's copy).
CURRENT = "QUALIFY row_number() OVER (PARTITION BY step ORDER BY write_id DESC, file_id DESC) = 1"


def table_files(run_dir: str | os.PathLike[str], table: str) -> list[str]:
    """The files of ``table`` that can be served; unreadable or foreign ones are set aside (and
    logged once: ``health.py``), so one bad file does not take the run's other steps."""
    found = sorted(str(p) for p in (Path(run_dir) / table).glob("*.parquet"))
    return [f for f in found if health.problem(f, table) is None]


def index_cte() -> str:
    """``idx``: the current (step, file_id, wall_time) of each step of the index files ``$steps``."""
    return f"idx AS (SELECT step, file_id, wall_time FROM read_parquet($steps, union_by_name=true) {CURRENT})"


def copy_current(con: duckdb.DuckDBPyConnection, table: str, files: list[str],
                 step_files: list[str]) -> pd.DataFrame:
    """The current rows of ``table`` among ``files`` (as resolved by ``step_files``), all columns."""
    if table == STEPS_TABLE:
        sql = f"SELECT * FROM read_parquet($files, union_by_name=true) {CURRENT} ORDER BY step"
        return con.execute(sql, {"files": files}).df()
    if table in LOG_TABLES:   # logs, not per-step state: every row of a committed flush, once (the
        # latest file of each write_id: an earlier compaction's copy or the original, not both)
        sql = ("SELECT * EXCLUDE (latest_file) FROM (SELECT t.*, max(t.file_id) OVER (PARTITION BY t.write_id) "
               "AS latest_file FROM read_parquet($files, union_by_name=true) t) WHERE file_id = latest_file "
               "ORDER BY write_id, wall_time")
        return con.execute(sql, {"files": files}).df()
    sql = (f"WITH {index_cte()} SELECT t.* FROM read_parquet($files, union_by_name=true) t "
           "SEMI JOIN idx USING (step, file_id) ORDER BY t.step")
    return con.execute(sql, {"files": files, "steps": step_files}).df()
