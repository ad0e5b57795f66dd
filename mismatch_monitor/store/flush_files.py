"""One flush of the run writer, as files: a Parquet file per data table with rows, their
step-block rollups, then the ``steps`` index file, which makes the flush's steps visible.

Every file is written under a temporary name and renamed into place (``atomic.py``); a flush
cut short removes what it wrote, so readers never see part of one. Rows of a step appended
several times before the flush are written once, as appended last (``pending.latest``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .atomic import remove_quietly, write_parquet_atomic
from .event_log import last_per_key
from .ids import IdSource
from .pending import _APPEND, _Pending
from .rollup import rollup_name, write_rollup
from .schema import DATA_TABLES, STEP_INDEX_COLUMNS, STEPS_TABLE, file_name, to_arrow


def write_flush(run_dir: Path, ids: IdSource, pending: _Pending) -> int:
    """One flush: a file per data table, then the index (which makes the steps visible); returns
    how many steps became visible."""
    pending.build_deferred()
    steps, keep = pending.latest()
    write_id = ids.next()
    try:
        return _write_files(run_dir, pending, steps, keep, write_id)
    except BaseException:
        # a flush cut short leaves orphan data files: remove them now (compaction removes
        # those of a process killed mid-flush)
        for table in (*DATA_TABLES, STEPS_TABLE):
            remove_quietly(run_dir / table / file_name(write_id))
            remove_quietly(run_dir / rollup_name(table) / file_name(write_id))
        raise


def _write_files(run_dir: Path, pending: _Pending, steps: list[dict[str, Any]], keep: set[int],
                 write_id: int) -> int:
    step_of = {append: row["step"] for row, append in zip(pending.steps, pending.appends)}
    for table in DATA_TABLES:
        entries = pending.buffer[table]
        tagged = [(s, df) for s, append, df in entries if s is not None and append in keep]
        parts = []
        if tagged:                    # one frame per step: the step column is added once
            df = pd.concat([f for _, f in tagged], ignore_index=True) if len(tagged) > 1 else tagged[0][1]
            parts.append(df.assign(step=np.repeat([s for s, _ in tagged], [len(f) for _, f in tagged])))
        for s, _, df in entries:
            if s is not None:
                continue
            if _APPEND in df.columns:  # built at flush time: rows of kept appends, their steps
                df = df[df[_APPEND].isin(keep)]
                df = df.assign(step=df[_APPEND].map(step_of).astype("int64")).drop(columns=_APPEND)
            parts.append(df)          # (alert rows carry their own step)
        parts = [p for p in parts if len(p)]
        if not parts:
            continue
        df = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
        _write(run_dir, table, last_per_key(table, df), write_id)
    index = pd.DataFrame(steps) if steps else pd.DataFrame(
        {c: pd.Series([], dtype=t) for c, t in STEP_INDEX_COLUMNS.items()})   # errors only
    _write(run_dir, STEPS_TABLE, index, write_id)   # last: makes the steps visible
    return len(steps)


def _write(run_dir: Path, table: str, df: pd.DataFrame, write_id: int) -> None:
    arrow = to_arrow(df.assign(write_id=write_id, file_id=write_id), table)
    write_parquet_atomic(arrow, run_dir / table / file_name(write_id))
    write_rollup(run_dir, table, arrow, write_id)
