"""The writer rank's merge of the gathered shards (``rank_payload.PackedStats``), table by table.

Per table the W parts' columns are concatenated once and grouped, in three steps:

1. the parts' cells (a few hundred to a few thousand each) get one integer code each, a mixed
   radix over their keys in key order, null last (``rank_cells.py``), so codes sort as the
   engine's group-by sorts keys (``engine.stats.aggregate``: nulls are a group, groups in key
   order); the cells are grouped by these codes (``engine.groupby.by_codes``);
2. every row's slot is its cell group's offset plus its row key (``bin``, ``bucket``, ...)
   above that group's lowest, each group spanning its own row keys' range only; the rows are
   grouped by slot (the slots no row reached are dropped), or by their sorted unique codes
   when that space is large;
3. every value column is merged by its rule, as ``engine.groupby.merge_column`` (the engine's
   one definition of the rules) merges it; the key columns are decoded once per cell group (a
   label column is a run per cell, decoded by arrow, not taken row by row).

Steps 1-3 run in the compiled loops of ``engine/_merge.c`` (``engine.native_merge``) when the
extension was built, else in numpy; both give the same result. The groups, their order and the
order of the rows within each group are those of ``engine.merge`` on the frames (the parts'
rows in part order), so the result is that merge's bit for bit: float sums add the same numbers
in the same order (``tests/test_distributed_merge.py``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from mismatch_monitor.engine import MismatchStats, native_merge
from mismatch_monitor.engine.fields import TABLES, Field
from mismatch_monitor.engine.groupby import Coded, by_codes, merge_column
from mismatch_monitor.engine.stats import common_parameters, empty_table, key_columns, table_schema

from .rank_cells import CellKey, cell_codes, n_cells
from .rank_payload import PackedStats, PackedTable, row_key_name


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


def _row_groups(parts: Sequence[PackedTable], cells: Coded) -> tuple[Coded, np.ndarray, np.ndarray]:
    """The rows grouped by (cell group, row key), by numpy: each row's code is the offset of
    its cell's group plus its row key above that group's lowest (the cells of part i follow
    those of parts < i, and each part's rows its cells' runs). Each group spans only its own
    row keys' range (the parts send each cell's): the codes' space stays near the groups'
    number, and so do the arrays the rows scatter into. Returns the groups, each cell group's
    number of them and each one's row key."""
    cell_group = cells.rows()
    ranges = _ranges(parts)
    low = np.full(cells.size, np.iinfo(np.int64).max)
    high = np.full(cells.size, np.iinfo(np.int64).min)
    np.minimum.at(low, cell_group, ranges[0])
    np.maximum.at(high, cell_group, ranges[1])
    offset = np.zeros(cells.size + 1, dtype=np.int64)
    np.cumsum(high - low + 1, out=offset[1:])
    code = np.repeat((offset[:-1] - low)[cell_group], _runs(parts))
    code += _row_keys(parts)      # narrow: added as they are
    groups = by_codes(code, int(offset[-1]))
    # the groups come cell by cell (every cell has one at least): each cell's run of them
    runs = np.diff(np.searchsorted(groups.codes, offset))
    return groups, runs, groups.codes - np.repeat(offset[:-1] - low, runs)


def _ranges(parts: Sequence[PackedTable]) -> np.ndarray:
    return np.concatenate([t.key_range for t in parts], axis=1, dtype=np.int64)


def _runs(parts: Sequence[PackedTable]) -> np.ndarray:
    return np.concatenate([t.run if t.run is not None else np.ones(n_cells(t), dtype=np.int8) for t in parts],
                          dtype=np.int64)


def _row_keys(parts: Sequence[PackedTable]) -> np.ndarray:
    return np.concatenate([t.row_key for t in parts])


def _values(parts: Sequence[PackedTable], f: Field) -> np.ndarray:
    # narrowed integers add as they are (merge_column sums them in int64); others widen first
    return np.concatenate([t.values[f.name] for t in parts], dtype=None if f.merge == "sum" else np.dtype(f.dtype))


def _native_rows(parts: Sequence[PackedTable], cells: Coded, row_key: str | None, fields: Sequence[Field],
                 part_cells: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The merged value columns (and row key) of a table by the compiled loops, and per cell
    group its number of merged rows (None: one each). A logsumexp column (tables without a row
    key only) is merged by numpy over the cells' groups."""
    values = {f.name: _values(parts, f) for f in fields}
    compiled = [f for f in fields if f.merge in native_merge.RULES]
    args = (_runs(parts), _row_keys(parts), *_ranges(parts)) if row_key is not None else (None,) * 4
    keys, runs, merged = native_merge.merge_groups(part_cells, cells.rows(), cells.size, *args,
                                                   [(values[f.name], f.merge) for f in compiled])
    data = dict(zip([f.name for f in compiled], merged))
    if keys is not None:
        data[row_key] = keys
    one = len(keys if keys is not None else runs) == 1
    for f in fields:
        if f.name not in data or one:    # one merged row: the engine's plain reduction (merge_column)
            group = cells.rows() if row_key is None else np.zeros(len(values[f.name]), dtype=np.int64)
            data[f.name] = merge_column(values[f.name], f.merge, group, 1 if one else cells.size)
    return data, runs if row_key is not None else None


def merge_table(table: str, tables: Sequence[PackedTable], dims: Sequence[str], vocab: dict | None = None
                ) -> pd.DataFrame:
    """One table of the merge (``vocab``: label dictionaries pooled by earlier tables of it)."""
    parts = [t for t in tables if t.n_rows]
    if not parts:
        return empty_table(table, dims)
    schema = table_schema(table, dims)
    row_key = row_key_name(table)
    vocab = {} if vocab is None else vocab
    keys = [CellKey(k, schema[k], parts, vocab) for k in key_columns(table, dims) if k != row_key]
    part_cells = np.array([n_cells(t) for t in parts], dtype=np.int64)
    # 1) cells: a mixed-radix code each over their keys, grouped (the one group-by, groupby.py)
    code, space = cell_codes(keys, part_cells)
    cells = by_codes(code, space)
    cell_first = cells.first()
    first_part = np.searchsorted(np.cumsum(part_cells), cell_first, side="right")
    fields = TABLES[table][1]
    if native_merge.available() and (row_key is None or all(f.merge in native_merge.RULES for f in fields)):
        data, runs = _native_rows(parts, cells, row_key, fields, part_cells)
    else:
        # 2) rows: their cell's group and their row key in one code, grouped
        groups, data, runs = cells, {}, None
        if row_key is not None:
            groups, runs, data[row_key] = _row_groups(parts, cells)
        for f in fields:
            data[f.name] = merge_column(_values(parts, f), f.merge, groups.slot, groups.slots, groups.keep)
    # 3) the merged table: key columns decoded from the groups, values in their types
    for k in keys:
        data[k.name] = k.column(k.codes(cell_first, first_part), runs)
    for f in fields:
        data[f.name] = data[f.name].astype(np.dtype(f.dtype), copy=False)
    return pd.DataFrame({c: data[c] for c in schema}, copy=False)
