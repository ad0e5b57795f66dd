"""Reading a run's committed files: which files are current, what is kept from files already
read (a committed file never changes), and the retry of a read whose file list went stale.

Every reader of the query layer goes through these; ``core`` and ``views`` build SQL on them.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import duckdb
import pandas as pd

from ..store import health
from ..store.current import CURRENT, table_files
from ..store.schema import STEPS_TABLE

T = TypeVar("T")
RunDir = str | Path


def current_files(run_dir: RunDir, table: str) -> dict[str, list[str]]:
    """``{"steps": index files, "files": data files}``, listed in that order.

    The order matters while a compaction runs: its data files are written before its index and
    the old index files are removed before the old data files. So when every listed index file
    still exists after the data files were listed, the data list holds every file the index
    names (what the index says may be kept from an earlier read, see ``_memo``); a data file
    removed later fails the read (no such file), which is retried with fresh lists.
    """
    for _ in range(8):
        steps = table_files(run_dir, STEPS_TABLE)
        files = table_files(run_dir, table)
        if all(Path(f).exists() for f in steps):
            return {"steps": steps, "files": files}
    raise FileNotFoundError(f"No such file: the index of {run_dir} kept changing while it was listed")


# a path in DuckDB's message about a file it could not read
_FAILED_FILE = re.compile(r"""['"]([^'"]+\.parquet)['"]""")


def _retry(fn: Callable[[], T], attempts: int = 4) -> T:
    """Re-run a query whose file list went stale (a compaction removed a file meanwhile), or
    that failed on a file whose footer parsed but whose data does not (it is set aside)."""
    for i in range(attempts):
        try:
            return fn()
        except (duckdb.IOException, duckdb.InvalidInputException, FileNotFoundError) as exc:
            text = str(exc)
            stale = "No such file" in text or "No files found" in text
            bad = None if stale else _FAILED_FILE.search(text)
            if i == attempts - 1 or not (stale or bad):
                raise
            if bad is not None:
                health.mark_unreadable(bad.group(1), f"a read failed: {text.splitlines()[0]}")
            else:
                time.sleep(0.05 * (i + 1))
    raise AssertionError("unreachable")


# A committed file never changes (written under a temporary name, renamed into place; a
# compaction writes new names), so what is read from a given list of files can be kept.
_MEMO: OrderedDict[tuple[str, tuple[str, ...]], Any] = OrderedDict()
_MEMO_LOCK = threading.Lock()
_MEMO_SIZE = 64


def _memo(kind: str, files: Sequence[str], compute: Callable[[], T]) -> T:
    key = (kind, tuple(files))
    with _MEMO_LOCK:
        if key in _MEMO:
            _MEMO.move_to_end(key)
            return _MEMO[key]
    value = compute()
    with _MEMO_LOCK:
        _MEMO[key] = value
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
    return value


def forget_files() -> None:
    """Drop what was kept from read files (for timing cold reads)."""
    with _MEMO_LOCK:
        _MEMO.clear()


def file_columns(con: duckdb.DuckDBPyConnection, files: Sequence[str]) -> frozenset[str]:
    """Column names over ``files`` (read once per list of files)."""
    sql = "DESCRIBE SELECT * FROM read_parquet($f, union_by_name=true)"
    return _memo("columns", files, lambda: frozenset(r[0] for r in con.execute(sql, {"f": list(files)}).fetchall()))


def raw_index(con: duckdb.DuckDBPyConnection, step_files: Sequence[str]) -> pd.DataFrame:
    """Every row of the index files, superseded ones included."""
    sql = "SELECT * FROM read_parquet($steps, union_by_name=true)"
    return _memo("index", step_files, lambda: con.execute(sql, {"steps": list(step_files)}).df())


def current_index(con: duckdb.DuckDBPyConnection, step_files: Sequence[str]) -> pd.DataFrame:
    """The current row of each step in the index files (``CURRENT``), in step order."""
    sql = f"SELECT * FROM read_parquet($steps, union_by_name=true) {CURRENT} ORDER BY step"
    return _memo("current", step_files, lambda: con.execute(sql, {"steps": list(step_files)}).df())
