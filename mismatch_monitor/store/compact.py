"""Compaction: merge a run's many small files into one file per table, safely.

Rows keep their ``write_id`` (so a later re-log of a step still wins) and get a new ``file_id``.
Order of operations, each step safe for a concurrent reader:
1. write the compacted data files (invisible: no index row points at their file_id yet);
2. write the compacted ``steps`` index (the steps now resolve to the compacted copy, whose rows
   are identical to the originals: a reader sees each step once, from either copy);
3. delete the old index files, then the old data files and their rollups (a reader whose file
   list went stale retries, see the query layer's ``_retry``).
The compacted files get rollups of their own (``rollup.py``), written with them in step 1;
a run with nothing to merge gets the rollups its files lack (one written before rollups existed).
Only files of flushes committed when compaction started are touched (a file's name carries its
file_id), so a live writer can keep appending. Before merging, ``repair.py`` quarantines files
readers cannot serve and removes what killed processes left (temporary files; orphans of a
crashed flush when no writer is live).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from .atomic import write_parquet_atomic
from .current import copy_current, table_files
from .ids import IdSource
from .repair import ORPHANS_REMOVED, QUARANTINED, TMP_REMOVED, repair_run
from .rollup import ROLLUP_TABLES, rollup_name, write_rollup
from .schema import DATA_TABLES, STEPS_TABLE, file_id_of, file_name, to_arrow


ROLLUPS_ADDED = "rollups_added"
REPAIRS = (QUARANTINED, TMP_REMOVED, ORPHANS_REMOVED)


def compact_run(run_dir: str | Path, ids: IdSource | None = None) -> dict[str, int]:
    """Compact ``run_dir``; returns the number of files removed per table (and, when there was
    nothing to merge, under ``ROLLUPS_ADDED`` the rollup files written for files that had none),
    and the counts of :data:`REPAIRS` (``repair.repair_run``)."""
    run_dir = Path(run_dir)
    repaired = repair_run(run_dir)
    return {**_compact(run_dir, ids), **repaired}


def _compact(run_dir: Path, ids: IdSource | None) -> dict[str, int]:
    step_files = table_files(run_dir, STEPS_TABLE)
    # only files of committed flushes: a flush in progress has data files but no index yet,
    # and its files must survive (its index will point at them)
    committed = {Path(f).name for f in step_files}
    snapshot = {t: [f for f in table_files(run_dir, t) if Path(f).name in committed]
                for t in DATA_TABLES}
    rollups = [f for t in ROLLUP_TABLES for f in table_files(run_dir, rollup_name(t))
               if Path(f).name in committed]
    if len(step_files) <= 1 and all(len(f) <= 1 for f in snapshot.values()):
        added = add_missing_rollups(run_dir, snapshot)
        return {**{t: 0 for t in (*DATA_TABLES, STEPS_TABLE)}, ROLLUPS_ADDED: added}
    file_id = (ids or IdSource(run_dir)).next()
    con = duckdb.connect(database=":memory:")
    for table, files in snapshot.items():
        if not files:
            continue
        df = copy_current(con, table, files, step_files)
        if len(df):
            path = run_dir / table / file_name(file_id)
            arrow = to_arrow(df.assign(file_id=file_id), table)
            write_parquet_atomic(arrow, path)
            write_rollup(run_dir, table, arrow, file_id)
    steps = copy_current(con, STEPS_TABLE, step_files, step_files)
    write_parquet_atomic(to_arrow(steps.assign(file_id=file_id), STEPS_TABLE),
                         run_dir / STEPS_TABLE / file_name(file_id))
    removed = {STEPS_TABLE: 0}
    for f in step_files:
        Path(f).unlink(missing_ok=True)
        removed[STEPS_TABLE] += 1
    for table, files in snapshot.items():
        removed[table] = 0
        for f in files:
            Path(f).unlink(missing_ok=True)
            removed[table] += 1
    for f in rollups:
        Path(f).unlink(missing_ok=True)
    return removed


def add_missing_rollups(run_dir: Path, snapshot: dict[str, list[str]]) -> int:
    """Write the rollups of committed data files that have none (a run written before rollups,
    or a flush whose rollups could not be built); returns how many were written."""
    added = 0
    for table in ROLLUP_TABLES:
        for f in snapshot.get(table, []):
            target = run_dir / rollup_name(table) / Path(f).name
            file_id = file_id_of(f)
            if file_id is None or target.exists():
                continue
            write_rollup(run_dir, table, pq.read_table(f), file_id)
            added += target.exists()
    return added
