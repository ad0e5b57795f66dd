"""Reading step-block rollups: which blocks of a binned read come from them, exactly.

The rollups are built and written by the store (``store/rollup.py``, which defines their layout:
``BLOCK``, the groupings, the directories). A reader (:func:`plan`) takes a block from the
rollups only when that is exact: every flush with a current step in the block wrote rollups,
none of those flushes has a step in the block that a later flush re-logged (such a block is read
from its cells), all its current steps lie in the requested range, and the whole block falls in
one step bin. Everything else is read from cells. Runs written before rollups existed are read
from cells throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pandas as pd

from ..engine.fields import LENGTH_KEY, TOKEN_CELL_TABLES, TURN_KEY
from ..store.rollup import BLOCK, ROLLUP_TABLES, grouping_name, groupings
from ..store.rollup import rollup_name  # noqa: F401  (readers list a table's rollup files by it)


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
