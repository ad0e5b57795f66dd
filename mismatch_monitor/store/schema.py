"""The run directory's layout and the Parquet schema stamp (documented in docs/SCHEMA.md).

    RUN_DIR/run.json                 run id, start time, metric config, per-pool metadata
    RUN_DIR/<table>/<file>.parquet   one file per flush (or compaction) and table

Every row carries ``step``, ``write_id`` (the flush that logged the step: later flushes win)
and ``file_id`` (the file set it was written in; a compaction copies rows under a new file_id).
The ``steps`` table is the index: a step exists for readers once a ``steps`` file lists it,
which a flush writes last.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pandas as pd
import pyarrow as pa

from ..engine.fields import TABLES
from .event_log import EVENTS_TABLE, OUTCOMES_TABLE

SCHEMA_VERSION = 1
SCHEMA_KEY = b"mismatch_monitor.schema_version"
TABLE_KEY = b"mismatch_monitor.table"

STAT_TABLES: tuple[str, ...] = tuple(TABLES)
EXEMPLAR_TABLE_NAMES: tuple[str, ...] = ("exemplar_tokens", "exemplar_sequences")
ALERTS_TABLE = "alerts"
# one row per counted collector error, with its text: step (null when the error has no valid
# step), wall_time, where (what failed), kind (the exception class), message
ERRORS_TABLE = "errors"
ERROR_COLUMNS: dict[str, str] = {"step": "Int64", "wall_time": "float64", "where": "string",
                                 "kind": "string", "message": "string"}
STEPS_TABLE = "steps"
# the steps index's columns, for a flush that carries only error rows (an empty index file)
STEP_INDEX_COLUMNS: dict[str, str] = {"step": "int64", "wall_time": "float64", "n_tokens": "int64",
                                      "n_sequences": "int64", "n_cells": "int64",
                                      "collector_errors": "int64"}
# data tables, in write order; the steps index is written after all of them
DATA_TABLES: tuple[str, ...] = STAT_TABLES + EXEMPLAR_TABLE_NAMES + (ALERTS_TABLE, ERRORS_TABLE, EVENTS_TABLE,
                                                                  OUTCOMES_TABLE)
# logs whose rows carry their own step (``event_log.py``): written with any flush, also one
# without steps, read once its index exists, every committed row kept by compaction
LOG_TABLES: tuple[str, ...] = (ERRORS_TABLE, EVENTS_TABLE, OUTCOMES_TABLE)
ALL_TABLES: tuple[str, ...] = DATA_TABLES + (STEPS_TABLE,)

STEP_COLUMNS = ("step", "write_id", "file_id")
# columns the store and its readers add beside the labels: the step index's, the rollups'
# (``rollup.py``), the writer's temporary append column, the exemplars' rank, the run of
# a comparison across runs
ROLLUP_COLUMNS = ("block", "grouping", "step_last")
BOOKKEEPING_COLUMNS: tuple[str, ...] = (STEP_COLUMNS + ("wall_time",) + ROLLUP_COLUMNS
                                        + ("_append", "rank", "run"))


def reserved_names() -> frozenset[str]:
    """Every column name a label may not take: the store's own columns, every table's keys
    and value fields, and the exemplar and error columns. The one list of them."""
    from ..engine.fields import LENGTH_KEY, TURN_KEY
    from ..exemplars import empty_exemplars   # lazily: exemplars imports the engine

    names = set(BOOKKEEPING_COLUMNS) | {LENGTH_KEY, TURN_KEY} | set(ERROR_COLUMNS)
    for extra, fields in TABLES.values():
        names.update(extra)
        names.update(f.name for f in fields)
    for table in EXEMPLAR_TABLE_NAMES:
        names.update(empty_exemplars(table).columns)
    from ..batch import STANDARD_DIMENSIONS
    return frozenset(names - set(STANDARD_DIMENSIONS))


_RESERVED: frozenset[str] | None = None


def check_labels(names: Iterable[str]) -> None:
    """Refuse label names that clash with a stored column (they would be overwritten by, or
    break, the store's own columns): a ValueError naming them."""
    global _RESERVED
    if _RESERVED is None:
        _RESERVED = reserved_names()
    clash = sorted(set(names) & _RESERVED)
    if clash:
        raise ValueError(f"label name(s) {clash} clash with columns the run store keeps for itself; "
                         f"rename the label(s) (reserved: {sorted(_RESERVED)})")


def to_arrow(df: pd.DataFrame, table: str) -> pa.Table:
    """A pandas frame as an Arrow table stamped with the schema version in the footer."""
    # one thread: this also runs from an exit handler, after executor threads are gone
    return stamp(pa.Table.from_pandas(df, preserve_index=False, nthreads=1), table)


def stamp(arrow: pa.Table, table: str) -> pa.Table:
    """``arrow`` with the schema version and the table name in its footer metadata."""
    meta = dict(arrow.schema.metadata or {})
    meta.pop(b"pandas", None)  # the stamp, not pandas' index bookkeeping, describes our files
    meta[SCHEMA_KEY] = str(SCHEMA_VERSION).encode()
    meta[TABLE_KEY] = table.encode()
    return arrow.replace_schema_metadata(meta)


def file_name(file_id: int) -> str:
    return f"part-{file_id:020d}.parquet"


def file_id_of(path: str | Path) -> int | None:
    """The file_id a data file's name carries (:func:`file_name`); None for another name."""
    stem = Path(path).stem
    return int(stem[5:]) if stem.startswith("part-") and stem[5:].isdigit() else None
