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
from typing import Sequence

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from ..engine.fields import LENGTH_KEY, TABLES, TOKEN_CELL_TABLES, TURN_KEY, merge_rules

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
    columns = ("pool", LENGTH_KEY) + ((TURN_KEY,) if table in TOKEN_CELL_TABLES else ())
    for g in groupings(table, columns):
        if set(dims) <= set(g):
            return g
    return None


@dataclass(frozen=True)
class Blocks:
    """What the steps index says of each block, whatever is read: the (file_id, block) pairs
    with a current step and whether each is whole (no step of it re-logged since), and each
    block's first and last current step."""

    c_step: np.ndarray            # the current steps, their file and block
    c_fid: np.ndarray
    c_block: np.ndarray
    pair_fid: np.ndarray          # (file_id, block) pairs holding a current step
    pair_block: np.ndarray
    pair_whole: np.ndarray        # every step the file wrote in the block is still current
    blocks: np.ndarray            # blocks with a current step, their first and last one
    block_min: np.ndarray
    block_max: np.ndarray


def blocks_of(index: pd.DataFrame, current: pd.DataFrame) -> Blocks:
    """``index``: every row of the index files (superseded ones too); ``current``: the current
    row of each step."""
    step = index["step"].to_numpy(np.int64)
    fid = index["file_id"].to_numpy(np.int64)
    c_step = current["step"].to_numpy(np.int64)
    c_fid = current["file_id"].to_numpy(np.int64)
    c_block = c_step // BLOCK * BLOCK
    written = pd.Series(1, index=pd.MultiIndex.from_arrays([fid, step // BLOCK * BLOCK])).groupby(level=[0, 1]).size()
    held = pd.Series(1, index=pd.MultiIndex.from_arrays([c_fid, c_block])).groupby(level=[0, 1]).size()
    pairs = pd.DataFrame({"n_current": held}).join(written.rename("n_written"))
    per_block = pd.DataFrame({"block": c_block, "step": c_step}).groupby("block")["step"].agg(["min", "max"])
    return Blocks(c_step, c_fid, c_block, pairs.index.get_level_values(0).to_numpy(np.int64),
                  pairs.index.get_level_values(1).to_numpy(np.int64),
                  pairs["n_current"].to_numpy() == pairs["n_written"].to_numpy(),
                  per_block.index.to_numpy(np.int64), per_block["min"].to_numpy(), per_block["max"].to_numpy())


def plan(blocks: Blocks, rolled: set[int], table: str, dims: Sequence[str], *,
         first: int, width: int, lo: int | None, hi: int | None) -> Plan | None:
    """Which blocks of a binned read come from rollups (None: none can, read cells as before).

    ``blocks``: :func:`blocks_of` the run's index; ``rolled``: file ids with a rollup file of
    ``table``.
    """
    g = choose(table, dims)
    if g is None or not rolled or not len(blocks.c_step):
        return None
    b = blocks
    clean = b.pair_whole & np.isin(b.pair_fid, list(rolled))
    lo_ = max(int(first), int(lo) if lo is not None else int(first))
    hi_ = int(hi) if hi is not None else int(b.c_step.max())
    ok = ((b.blocks >= lo_) & (b.block_min >= lo_) & (b.block_max <= hi_)
          & ((b.blocks - first) // width == (b.blocks + BLOCK - 1 - first) // width)
          & ~np.isin(b.blocks, b.pair_block[~clean]))
    served = b.blocks[ok]
    if not len(served):
        return None
    take = np.isin(b.pair_block, served)
    in_range = (b.c_step >= lo_) & (b.c_step <= hi_) & ~np.isin(b.c_block, served)
    return Plan(grouping_name(g), b.pair_fid[take].tolist(), b.pair_block[take].tolist(),
                b.c_step[in_range].tolist(), sorted(set(b.c_fid[in_range].tolist())))


def aligned_bins(first: int, last: int, width: int, max_points: int) -> tuple[int, int]:
    """(origin, width) of step bins over [first, last], at most ``max_points`` of them.

    Bins of several steps start on block boundaries and span whole blocks (so that they are read
    from rollups) once at least ``max_points / 4`` of them still cover the range: a run of 2,400
    steps or more at 600 points. Shorter ranges keep ``width`` from ``first`` (read from cells).
    """
    span = last - first + 1
    if width < 2 or span < BLOCK * max_points // 4:
        return first, width
    if max_points < 2:                   # one aligned bin holds [first, last] only from origin 0
        return (0, _round_up(max(width, last + 1))) if first >= 0 else (first, max(width, span))
    # bins from origin = first // w * w: there are last // w - first // w + 1 of them, at most
    # (last - first) // w + 2, so any w > (last - first) / (max_points - 1) fits (closed form);
    # none below (last - first) // max_points + 1 does. The smallest fitting multiple of BLOCK is
    # searched between the two for at most _SCAN candidates (a fixed cost, whatever the range).
    low = _round_up(max(width, (last - first) // max_points + 1))
    high = _round_up(max(width, (last - first) // (max_points - 1) + 1))
    for w in range(low, min(high, low + _SCAN * BLOCK), BLOCK):
        if last // w - first // w + 1 <= max_points:
            return first // w * w, w
    return first // high * high, high


_SCAN = 1024


def _round_up(steps: int) -> int:
    """``steps`` rounded up to whole blocks."""
    return -(-steps // BLOCK) * BLOCK
