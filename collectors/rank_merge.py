"""The writer rank's merge of the gathered shards (``rank_payload.PackedStats``), table by table.

Per table the W parts' columns are concatenated once and grouped by ``engine.groupby`` (its
mixed-radix codes, :func:`~mismatch_monitor.engine.groupby.by_codes`), in two steps:

1. the parts' cells (a few hundred to a few thousand each) get one integer code each, a mixed
   radix over their keys: labels by their place in the sorted union of the parts' label
   dictionaries (null last), the buckets by their place among the distinct buckets (a null
   turn bucket last), so codes sort as the engine's group-by sorts keys (``engine.stats.aggregate``:
   nulls are a group, groups in key order); the cells are grouped by these codes;
2. every row's code is its cell group's offset plus its row key (``bin``, ``bucket``, ...)
   above that group's lowest, each group spanning its own row keys' range only; the rows are
   grouped by these codes: a slot per code when that space is small (no sort; the slots no row
   reached are dropped), the sorted unique codes otherwise;
3. every value column is merged by its rule with ``engine.groupby.merge_column``, the engine's one
   definition of the rules; the key columns are decoded once per cell group (a label column is
   a run per cell, decoded by arrow, not taken row by row).

The groups, their order and the order of the rows within each group are those of
``engine.merge`` on the frames (the parts' rows in part order), so the result is that merge's
bit for bit: float sums add the same numbers in the same order (``tests/test_distributed_merge.py``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_monitor.engine import MismatchStats
from mismatch_monitor.engine.fields import LENGTH_KEY, TABLES, TURN_KEY, merge_rules
from mismatch_monitor.engine.groupby import by_codes, columns_of, combine, merge_column
from mismatch_monitor.engine.stats import common_parameters, empty_table, key_columns, table_schema

from .rank_payload import NULL_INT, PackedStats, PackedTable, row_key_name

def merge_packed(parts: Sequence[PackedStats]) -> MismatchStats:
    """The merge of ``parts``, equal to ``engine.merge`` of the statistics they were packed from."""
    if not parts:
        return MismatchStats.empty()
    params = common_parameters([MismatchStats({}, p.dims, p.params) for p in parts])
    dims: list[str] = []
    for p in parts:
        dims += [d for d in p.dims if d not in dims]
    vocab: dict = {}            # the tables of a shard share their labels: pooled once
    tables = {name: merge_table(name, [p.tables[name] for p in parts], dims, vocab) for name in TABLES}
    return MismatchStats(tables, tuple(dims), params)


class _CellKey:
    """One cell key column over all parts' cells: a code per cell in 0..radix-1, in key order
    (null last), and its decoding."""

    def __init__(self, name: str, kind: str, parts: Sequence[PackedTable], vocab: dict) -> None:
        self.name, self.string = name, kind == "string"
        # every part's cells in one array (a part without the column: all null)
        cells = np.concatenate([t.cells[name] if name in t.cells else np.full(n_cells(t), NULL_INT, dtype=np.int8)
                                for t in parts], dtype=np.int64)
        nulls = cells == NULL_INT if self.string or name == TURN_KEY else None
        if self.string:
            # each part's local codes into one pooled dictionary of all parts' labels, then the
            # pooled labels coded by their place in the sorted union of them
            local = tuple(t.labels.get(name, ()) for t in parts)
            if (name, local) not in vocab:
                pooled = np.array([s for u in local for s in u], dtype=object)
                vocab[name, local] = (np.cumsum([0] + [len(u) for u in local])[:-1],
                                      *np.unique(pooled, return_inverse=True))
            offsets, self.vocab, codes = vocab[name, local]
            at = cells + np.repeat(offsets, [n_cells(t) for t in parts])
            known = codes.reshape(-1)[at[~nulls]] if len(self.vocab) else np.zeros(0, dtype=np.int64)
            self.radix = len(self.vocab) + 1
        else:
            values = cells if nulls is None else cells[~nulls]
            # codes by the distinct values (a few bucket edges), grouped as any code is
            low = int(values.min()) if len(values) else 0
            coded = by_codes(values - low, int(values.max()) - low + 1 if len(values) else 0)
            self.distinct, known = coded.codes + low, coded.rows()
            self.radix = len(self.distinct) + (nulls is not None)
        if nulls is None:
            self.codes = known
        else:
            self.codes = np.full(len(cells), self.radix - 1, dtype=np.int64)    # null: after every value
            self.codes[~nulls] = known

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


def _row_codes(parts: Sequence[PackedTable], cell_group: np.ndarray, groups: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[rows] each row's code: the offset of its cell's group plus its row key above that
    group's lowest (the cells of part i follow those of parts < i, and each part's rows its
    cells' runs); and per cell group that offset ([groups + 1], the last one the codes' space)
    and lowest row key. Each group spans only its own row keys' range (the parts send each
    cell's): the codes' space stays near the groups' number, and so do the arrays the rows
    scatter into (the whole range of row keys per cell made them several times larger)."""
    ranges = np.concatenate([t.key_range for t in parts], axis=1, dtype=np.int64)
    low = np.full(groups, np.iinfo(np.int64).max)
    high = np.full(groups, np.iinfo(np.int64).min)
    np.minimum.at(low, cell_group, ranges[0])
    np.maximum.at(high, cell_group, ranges[1])
    offset = np.zeros(groups + 1, dtype=np.int64)
    np.cumsum(high - low + 1, out=offset[1:])
    runs = np.concatenate([t.run if t.run is not None else np.ones(n_cells(t), dtype=np.int8) for t in parts])
    code = np.repeat((offset[:-1] - low)[cell_group], runs)
    code += np.concatenate([t.row_key for t in parts])      # narrow: added as they are
    return code, offset, low


def merge_table(table: str, tables: Sequence[PackedTable], dims: Sequence[str], vocab: dict | None = None
                ) -> pd.DataFrame:
    """One table of the merge (``vocab``: label dictionaries pooled by earlier tables of it)."""
    parts = [t for t in tables if t.n_rows]
    if not parts:
        return empty_table(table, dims)
    schema = table_schema(table, dims)
    row_key = row_key_name(table)
    vocab = {} if vocab is None else vocab
    keys = [_CellKey(k, schema[k], parts, vocab) for k in key_columns(table, dims) if k != row_key]
    # 1) cells: a mixed-radix code each over their keys, grouped (the one group-by, groupby.py)
    code, space = np.zeros(len(keys[0].codes), dtype=np.int64), 1
    for k in keys:
        code, space = combine(code, space, k.codes, k.radix)
    cells = by_codes(code, space)
    cell_first = cells.first()
    if row_key is None:           # a row per cell: the cells' groups are the table's
        groups, data = cells, {}
        run_cell, runs = cell_first, None
    else:
        # 2) rows: their cell's group and their row key in one code, grouped
        code, offset, low = _row_codes(parts, cells.rows(), cells.size)
        groups = by_codes(code, int(offset[-1]))
        # the groups come cell by cell (every cell has one at least): each cell's run of them
        runs = np.diff(np.searchsorted(groups.codes, offset))
        run_cell = cell_first
        data = {row_key: groups.codes - np.repeat(offset[:-1] - low, runs)}
    # 3) the merged table: key columns decoded from the groups, values merged by their rules
    for k in keys:
        data[k.name] = k.column(k.codes[run_cell], runs)
    rules = merge_rules(table)
    for f in TABLES[table][1]:
        rule = rules[f.name]
        pieces = [t.values[f.name] for t in parts]
        # narrowed integers add as they are (merge_column sums them in int64); others widen first
        values = np.concatenate(pieces, dtype=None if rule == "sum" else np.dtype(f.dtype))
        merged = merge_column(values, rule, groups.slot, groups.slots, groups.keep)
        data[f.name] = merged.astype(np.dtype(f.dtype), copy=False)
    return pd.DataFrame({c: data[c] for c in schema}, copy=False)


def n_cells(t: PackedTable) -> int:
    return len(t.cells[LENGTH_KEY])
