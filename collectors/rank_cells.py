"""The cell keys of the writer's merge (``rank_merge.py``): every part's cells coded in one order.

A cell key's code is read from a small table per key (``CellKey.lut``), at the cell's value plus
its part's shift (``CellKey.shift``):

- a label: the part's local code (-1: null) into the sorted union of all parts' labels, null
  last (the tables of a shard share their label dictionaries: pooled once per merge);
- a bucket (length, turn): its place among the distinct values the parts send, a null turn
  bucket last.

So codes sort as the engine's group-by sorts keys (``engine.stats.aggregate``: nulls are a group,
groups in key order), and a cell's code over all its keys is their mixed radix
(``engine.groupby.combine``), computed by the compiled loop or by numpy alike.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_monitor.engine import native_merge
from mismatch_monitor.engine.fields import LENGTH_KEY, TURN_KEY
from mismatch_monitor.engine.groupby import CODE_LIMIT, combine

from .rank_payload import NULL_INT, PackedTable


def n_cells(t: PackedTable) -> int:
    return len(t.cells[LENGTH_KEY])


class CellKey:
    """One cell key over all parts' cells: ``values`` [cells] as sent (narrow), and their codes
    in 0..radix-1, ``lut[values + shift[part]]``, in key order (null last)."""

    def __init__(self, name: str, kind: str, parts: Sequence[PackedTable], vocab: dict) -> None:
        self.name, self.string = name, kind == "string"
        # every part's cells in one array (a part without the column: all null)
        self.values = np.concatenate([t.cells[name] if name in t.cells else np.full(n_cells(t), NULL_INT, dtype=np.int8)
                                      for t in parts])
        if self.string:
            local = tuple(t.labels.get(name, ()) for t in parts)
            if (name, local) not in vocab:
                vocab[name, local] = _label_lut(local)
            self.shift, self.lut, self.vocab = vocab[name, local]
            self.radix = len(self.vocab) + 1
            return
        values = self.values
        lo, hi = (int(values.min()), int(values.max())) if len(values) else (0, -1)
        # the distinct values (bucket edges: a few, in a range of a few thousand at most)
        present = np.zeros(hi - lo + 1, dtype=bool)
        present[values - lo] = True
        nulls = name == TURN_KEY and lo <= NULL_INT <= hi and bool(present[NULL_INT - lo])
        if nulls:
            present[NULL_INT - lo] = False
        self.distinct = np.flatnonzero(present) + lo
        self.radix = len(self.distinct) + (name == TURN_KEY)
        self.lut = np.cumsum(present) - 1          # a value's place among the distinct ones
        if nulls:
            self.lut[NULL_INT - lo] = self.radix - 1         # null: after every value
        self.shift = np.full(len(parts), -lo, dtype=np.int64)

    def codes(self, at: np.ndarray | None = None, part: np.ndarray | None = None) -> np.ndarray:
        """The codes of cells ``at`` (None: every cell), of parts ``part`` (one per cell)."""
        values = self.values if at is None else self.values[at]
        return self.lut[values + self.shift[part]]

    def column(self, codes: np.ndarray, runs: np.ndarray | None = None) -> object:
        """The key column of the merged table: ``codes[i]`` for ``runs[i]`` rows (None: one)."""
        def repeat(values: np.ndarray) -> np.ndarray:
            return values if runs is None else np.repeat(values, runs)

        if self.string:
            null = len(self.vocab)
            n = len(codes) if runs is None else int(runs.sum())
            if null == 0:            # a label no part carries: nulls, not taken row by row
                return pd.arrays.ArrowStringArray(pa.nulls(n, pa.large_string()))
            # the null code takes the dictionary's last entry, a null
            labels = pc.take(pa.array([*self.vocab.tolist(), None], type=pa.large_string()), codes)
            if runs is not None:     # a cell's rows follow one another: its label once per cell
                labels = pc.run_end_decode(pa.RunEndEncodedArray.from_arrays(
                    pa.array(np.cumsum(runs, dtype=np.int64)), labels))
            return pd.arrays.ArrowStringArray(labels)
        if self.name == TURN_KEY:
            null = codes == len(self.distinct)
            values = (self.distinct[np.where(null, 0, codes)] if len(self.distinct)
                      else np.zeros(len(codes), dtype=np.int64))
            return pd.arrays.IntegerArray(repeat(values), repeat(null))
        return repeat(self.distinct[codes])


def _label_lut(local: tuple[tuple[str, ...], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per part its shift into the table (its local code + 1 indexes its stretch of it, -1 the
    null in front), the table of codes into the sorted union of the labels, and that union."""
    pooled = np.array([s for u in local for s in u], dtype=object)
    union, codes = np.unique(pooled, return_inverse=True) if len(pooled) else (pooled, np.zeros(0, dtype=np.int64))
    sizes = np.array([len(u) + 1 for u in local], dtype=np.int64)
    shift = np.cumsum(sizes) - sizes + 1
    lut = np.full(int(sizes.sum()), len(union), dtype=np.int64)        # the null code: after every label
    lut[np.delete(np.arange(len(lut)), shift - 1)] = codes.reshape(-1)
    return shift, lut, union


def cell_codes(keys: Sequence[CellKey], part_cells: Sequence[int]) -> tuple[np.ndarray, int]:
    """Every cell's code over ``keys``, lexicographic in them (their mixed radix, made dense on
    the way when the product would overflow: ``combine``), and the codes' space."""
    space = 1
    for k in keys:
        space *= k.radix
    if native_merge.available() and space < CODE_LIMIT:
        return native_merge.cell_codes(keys, part_cells), space
    part = np.repeat(np.arange(len(part_cells)), part_cells)
    code, space = np.zeros(len(part), dtype=np.int64), 1
    for k in keys:
        code, space = combine(code, space, k.codes(part=part), k.radix)
    return code, space
