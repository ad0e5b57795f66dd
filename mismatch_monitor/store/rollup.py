"""Step-block rollups, as the store writes them: a table's rows pre-merged per block of
``BLOCK`` steps and per grouping.

Every flush (and compaction) that writes ``RUN_DIR/<table>/part-<id>.parquet`` for a table of
:data:`ROLLUP_TABLES` also writes ``RUN_DIR/rollups/<table>/part-<id>.parquet`` (same id, before
the index): the same rows merged per (block, grouping) by each field's own rule (sum/max/min),
so a rollup row means exactly what the cells it merges mean. A row holds ``block`` (the first
step of its block), ``grouping`` (the dimensions it keeps, comma-joined; ``""`` for all), those
dimensions (null where not kept), the table's extra keys (bin, bucket, layer), ``step_last`` (the
last step among its cells) and the merged fields.

The layout (``BLOCK``, the groupings, the directories) is defined here, where the rollups are
built; the query layer's ``query/rollup.py`` decides which blocks a read can take from them.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Sequence

import duckdb
import numpy as np
import pyarrow as pa

from ..engine.fields import LENGTH_KEY, TABLES, TURN_KEY, merge_rules, merge_sql
from .atomic import write_parquet_atomic
from .schema import file_name, stamp

BLOCK = 16                      # steps per block; wide step bins are multiples of it (aligned_bins)
ROLLUP_DIR = "rollups"
ROLLUP_TABLES: tuple[str, ...] = ("tokens", "sequences", "abs_hist", "lowprob", "routing_layers")
# groupings kept, finest last; a query grouped (or filtered) by a subset of one reads its rollups
ROLLUP_DIMS: tuple[str, ...] = ("pool", LENGTH_KEY, TURN_KEY)
GROUPINGS: tuple[tuple[str, ...], ...] = ((), ("pool",), (LENGTH_KEY,), (TURN_KEY,), ("pool", LENGTH_KEY),
                                          ("pool", TURN_KEY))
# the histogram has hundreds of bins per group: pool x length and pool x turn would cost more to
# write than they save; those views read cells
HIST_GROUPINGS = GROUPINGS[:4]


def rollup_name(table: str) -> str:
    """The rollups' directory (relative to the run directory) of ``table``."""
    return f"{ROLLUP_DIR}/{table}"


def grouping_name(dims: Sequence[str]) -> str:
    return ",".join(dims)


def groupings(table: str, columns: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """The groupings written for ``table`` whose dimensions its rows carry."""
    kept = HIST_GROUPINGS if table == "abs_hist" else GROUPINGS
    have = set(columns)
    return tuple(g for g in kept if set(g) <= have)


_local = threading.local()


def _connection() -> duckdb.DuckDBPyConnection:
    """This thread's connection for building rollups (opening one costs more than a small build)."""
    con = getattr(_local, "con", None)
    if con is None:
        con = _local.con = duckdb.connect(database=":memory:")
        con.execute("SET threads=1")          # runs on the writer's flush thread, beside training
    return con


def build(table: str, cells: pa.Table) -> pa.Table | None:
    """The rollup rows of one file's rows of ``table`` (None when it has no rows or no step)."""
    columns = cells.column_names
    if table not in ROLLUP_TABLES or not cells.num_rows or "step" not in columns:
        return None
    extra = list(TABLES[table][0])
    sets = groupings(table, columns)
    dims = [d for d in ROLLUP_DIMS if any(d in g for g in sets)]
    rules = {c: r for c, r in merge_rules(table).items() if c in columns}
    # GROUPING(dims) sets a bit for each dimension a set leaves out (first dimension: highest bit)
    names = " ".join(f"WHEN {sum(1 << (len(dims) - 1 - i) for i, d in enumerate(dims) if d not in g)} "
                     f"THEN '{grouping_name(g)}'" for g in sets)
    gid = f"CASE GROUPING({', '.join(dims)}) {names} END" if dims else "''"
    grouping_sets = ", ".join("(" + ", ".join(["block", *g, *extra]) + ")" for g in sets)
    select = (["block", f"{gid} AS grouping"] + [f'"{d}"' for d in dims] + [f'"{c}"' for c in extra]
              + ["max(step) AS step_last"]
              + [merge_sql(rule, '"' + c + '"') + f' AS "{c}"' for c, rule in rules.items()])
    sql = (f"SELECT {', '.join(select)} FROM (SELECT *, step // {BLOCK} * {BLOCK} AS block FROM cells) "
           f"GROUP BY GROUPING SETS ({grouping_sets}) ORDER BY grouping, block")
    con = _connection()
    con.register("cells", cells)
    try:
        out = con.sql(sql).to_arrow_table()
    finally:
        con.unregister("cells")
    for i, f in enumerate(out.schema):       # sums of integers come back as HUGEINT (decimal)
        if pa.types.is_decimal(f.type):
            out = out.set_column(i, f.name, out.column(i).cast(pa.int64()))
    return out


log = logging.getLogger(__name__)


def write_rollup(run_dir: Path, table: str, cells: pa.Table, file_id: int) -> None:
    """The step-block rollups of one data file, written beside it before the index. They only
    speed reads up: when they cannot be built, the file's steps are read from their cells, so
    the failure is logged and the flush goes on."""
    if table not in ROLLUP_TABLES:
        return
    try:
        out = build(table, cells)
        if out is not None:
            name = rollup_name(table)
            out = out.append_column("file_id", pa.array(np.full(out.num_rows, file_id, dtype=np.int64)))
            write_parquet_atomic(stamp(out, name), run_dir / name / file_name(file_id))
    except Exception:  # noqa: BLE001 - see above: readers fall back to the cells
        log.exception("could not write the %s rollups of file %d; its steps are read from cells", table, file_id)
