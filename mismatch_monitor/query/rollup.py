"""Step-block rollups: a table's rows pre-merged per block of ``BLOCK`` steps and per grouping.

Every flush (and compaction) that writes ``RUN_DIR/<table>/part-<id>.parquet`` for a table of
:data:`ROLLUP_TABLES` also writes ``RUN_DIR/rollups/<table>/part-<id>.parquet`` (same id, before
the index): the same rows merged per (block, grouping) by each field's own rule (sum/max/min),
so a rollup row means exactly what the cells it merges mean. A row holds ``block`` (the first
step of its block), ``grouping`` (the dimensions it keeps, comma-joined; ``""`` for all), those
dimensions (null where not kept), the table's extra keys (bin, bucket, layer), ``step_last`` (the
last step among its cells) and the merged fields.

A reader (:func:`plan`) takes a block from the rollups only when that is exact: every flush with
a current step in the block wrote rollups, none of those flushes has a step in the block that a
later flush re-logged (such a block is read from its cells), all its current steps lie in the
requested range, and the whole block falls in one step bin. Everything else is read from cells.
Runs written before rollups existed are read from cells throughout.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from ..engine.fields import LENGTH_KEY, TABLES, TURN_KEY, merge_rules

BLOCK = 16                      # steps per block; wide step bins are multiples of it (aligned_bins)
ROLLUP_DIR = "rollups"
ROLLUP_TABLES: tuple[str, ...] = ("tokens", "sequences", "abs_hist", "lowprob", "routing_layers")
# groupings kept, finest last; a query grouped (or filtered) by a subset of one reads its rollups
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
    dims = sorted({d for g in sets for d in g}, key=[d for g in GROUPINGS for d in g].index)
    rules = {c: r for c, r in merge_rules(table).items() if c in columns}
    # GROUPING(dims) sets a bit for each dimension a set leaves out (first dimension: highest bit)
    names = " ".join(f"WHEN {sum(1 << (len(dims) - 1 - i) for i, d in enumerate(dims) if d not in g)} "
                     f"THEN '{grouping_name(g)}'" for g in sets)
    gid = f"CASE GROUPING({', '.join(dims)}) {names} END" if dims else "''"
    grouping_sets = ", ".join("(" + ", ".join(["block", *g, *extra]) + ")" for g in sets)
    select = (["block", f"{gid} AS grouping"] + [f'"{d}"' for d in dims] + [f'"{c}"' for c in extra]
              + ["max(step) AS step_last"] + [f'{rule}("{c}") AS "{c}"' for c, rule in rules.items()])
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


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` decided for one read: the grouping read from rollups, the (file_id,
    block) pairs whose rollup rows are taken, and the steps read from cells with their files."""

    grouping: str
    file_ids: list[int]
    blocks: list[int]
    cell_steps: list[int]
    cell_file_ids: list[int]


def choose(table: str, dims: Sequence[str]) -> tuple[str, ...] | None:
    """The smallest grouping of ``table`` that keeps every one of ``dims`` (None if none does)."""
    if table not in ROLLUP_TABLES:
        return None
    columns = TABLES[table][0] + ("pool", LENGTH_KEY) + ((TURN_KEY,) if table != "sequences" else ())
    for g in groupings(table, columns):
        if set(dims) <= set(g):
            return g
    return None


def file_id_of(path: str) -> int | None:
    stem = Path(path).stem
    return int(stem[5:]) if stem.startswith("part-") and stem[5:].isdigit() else None


def plan(index: pd.DataFrame, current: pd.DataFrame, rolled: set[int], table: str, dims: Sequence[str], *,
         first: int, width: int, lo: int | None, hi: int | None) -> Plan | None:
    """Which blocks of a binned read come from rollups (None: none can, read cells as before).

    ``index``: every row of the steps index files (step, file_id), superseded ones included;
    ``current``: the current row of each step; ``rolled``: file ids with a rollup file of ``table``.
    """
    g = choose(table, dims)
    if g is None or not rolled or not len(current):
        return None
    step = index["step"].to_numpy(np.int64)
    fid = index["file_id"].to_numpy(np.int64)
    c_step = current["step"].to_numpy(np.int64)
    c_fid = current["file_id"].to_numpy(np.int64)
    block = step // BLOCK * BLOCK
    c_block = c_step // BLOCK * BLOCK
    written = pd.Series(1, index=pd.MultiIndex.from_arrays([fid, block])).groupby(level=[0, 1]).size()
    current = pd.Series(1, index=pd.MultiIndex.from_arrays([c_fid, c_block])).groupby(level=[0, 1]).size()
    pairs = pd.DataFrame({"n_current": current}).join(written.rename("n_written"))
    pair_fid = pairs.index.get_level_values(0).to_numpy(np.int64)
    pair_block = pairs.index.get_level_values(1).to_numpy(np.int64)
    clean = (pairs["n_current"].to_numpy() == pairs["n_written"].to_numpy()) & np.isin(pair_fid, list(rolled))
    lo_ = max(int(first), int(lo) if lo is not None else int(first))
    hi_ = int(hi) if hi is not None else int(c_step.max())
    per_block = pd.DataFrame({"block": c_block, "step": c_step}).groupby("block")["step"].agg(["min", "max"])
    blocks = per_block.index.to_numpy(np.int64)
    bad = np.unique(pair_block[~clean])
    ok = ((blocks >= lo_) & (per_block["min"].to_numpy() >= lo_) & (per_block["max"].to_numpy() <= hi_)
          & ((blocks - first) // width == (blocks + BLOCK - 1 - first) // width) & ~np.isin(blocks, bad))
    served = blocks[ok]
    if not len(served):
        return None
    take = np.isin(pair_block, served)
    in_range = (c_step >= lo_) & (c_step <= hi_) & ~np.isin(c_block, served)
    return Plan(grouping_name(g), pair_fid[take].tolist(), pair_block[take].tolist(),
                c_step[in_range].tolist(), sorted(set(c_fid[in_range].tolist())))


def aligned_bins(first: int, last: int, width: int, max_points: int) -> tuple[int, int]:
    """(origin, width) of step bins over [first, last], at most ``max_points`` of them.

    Bins of several steps start on block boundaries and span whole blocks (so that they are read
    from rollups) once at least ``max_points / 4`` of them still cover the range: a run of 2,400
    steps or more at 600 points. Shorter ranges keep ``width`` from ``first`` (read from cells).
    """
    span = last - first + 1
    if width < 2 or span < BLOCK * max_points // 4:
        return first, width
    w = -(-width // BLOCK) * BLOCK
    while True:
        origin = first // w * w
        if (last - origin) // w + 1 <= max_points:
            return origin, w
        w += BLOCK
