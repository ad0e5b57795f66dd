"""Which of a run's Parquet files can be served: readers set the others aside, compaction
quarantines them.

A file is served when its name carries a file id (``part-<id>.parquet``), its footer parses, it
bears the store's stamp for the table whose directory holds it, and it has the columns every
file of that table has. A truncated file, a file of another program, or one moved to the wrong
table would otherwise make every query of the run fail. Each file is checked once per (size,
mtime) and, when set aside, logged once with the reason. A file whose footer parses but whose
pages do not is found when a read fails naming it (:func:`mark_unreadable`).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq

from .rollup import ROLLUP_TABLES, rollup_name
from .schema import ALL_TABLES, SCHEMA_KEY, TABLE_KEY, file_id_of

log = logging.getLogger("mismatch_monitor")

_LOCK = threading.Lock()
_CHECKED: dict[tuple[str, int, int], str | None] = {}   # (path, size, mtime_ns) -> reason or None
_MARKED: dict[str, str] = {}                             # path -> reason a read failed on it


def _required(table: str) -> tuple[str, ...]:
    return ("block", "file_id") if table.startswith("rollups/") else ("step", "file_id")


def _check(path: str, table: str) -> str | None:
    if file_id_of(path) is None:
        return "not a file of the store (its name carries no file id)"
    try:
        meta = pq.read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to parse the footer is the answer
        return f"not a readable Parquet file ({type(exc).__name__}: {exc})"
    stamp = meta.metadata or {}
    if SCHEMA_KEY not in stamp:
        return "not written by mismatch-monitor (no schema stamp in its footer)"
    written_for = stamp.get(TABLE_KEY, b"").decode("utf-8", "replace")
    if written_for != table:
        return f"a file of table {written_for!r} in the directory of {table!r}"
    missing = [c for c in _required(table) if c not in meta.schema.names]
    if missing:
        return f"lacks the column(s) {missing} every {table} file has"
    return None


def problem(path: str, table: str) -> str | None:
    """Why ``path`` cannot be served as a file of ``table`` (None when it can, or is gone)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None                    # removed meanwhile (compaction): the reader retries
    key = (path, st.st_size, st.st_mtime_ns)
    with _LOCK:
        if key in _CHECKED:
            reason = _CHECKED[key]
            return reason if reason is not None else _MARKED.get(path)
    reason = _check(path, table)
    with _LOCK:
        _CHECKED[key] = reason
    if reason is not None:
        log.warning("mismatch-monitor: set aside %s: %s (`mismatch-monitor compact` quarantines it)",
                    path, reason)
    return reason if reason is not None else _MARKED.get(path)


def mark_unreadable(path: str, reason: str) -> None:
    """A read failed on ``path`` although its footer parsed: set it aside from now on."""
    with _LOCK:
        first = path not in _MARKED
        _MARKED[path] = reason
    if first:
        log.warning("mismatch-monitor: set aside %s: %s (`mismatch-monitor compact` quarantines it)",
                    path, reason)


def table_dirs(run_dir: Path) -> list[str]:
    """The tables whose directories a run may hold, rollups included."""
    return list(ALL_TABLES) + [rollup_name(t) for t in ROLLUP_TABLES]


def set_aside(run_dir: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """(path, reason) of every ``*.parquet`` file under the run's table directories that
    readers do not serve."""
    run_dir = Path(run_dir)
    out = []
    for table in table_dirs(run_dir):
        for p in sorted((run_dir / table).glob("*.parquet")):
            reason = problem(str(p), table)
            if reason is not None:
                out.append((str(p), reason))
    return out
