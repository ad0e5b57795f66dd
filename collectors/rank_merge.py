"""The writer rank's merge of the gathered shards (``rank_payload.PackedStats``), table by table.

Per table the W parts' columns are concatenated once and grouped once:

1. the parts' cells (a few hundred to a few thousand each) get one integer code each, a mixed
   radix over their keys: labels by their place in the sorted union of the parts' label
   dictionaries (null last), the buckets by value (a null turn bucket last), so codes sort as
   the engine's group-by sorts keys (``engine.stats.aggregate``: nulls are a group, groups in
   key order);
2. every row's group is its cell's code times the range of the table's last key plus that key:
   the code itself when that space is small (the merged columns get a slot per code, and the
   slots no row reached are dropped: no sort), the sorted unique codes otherwise;
3. every value column is merged by its rule with ``engine.groupby.merge_column``, the engine's one
   definition of the rules.

The groups, their order and the order of the rows within each group are those of
``engine.merge`` on the frames (the parts' rows in part order), so the result is that merge's
bit for bit: float sums add the same numbers in the same order (``tests/test_distributed_merge.py``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from mismatch_monitor.engine import MismatchStats
from mismatch_monitor.engine.fields import LENGTH_KEY, TABLES, TURN_KEY, merge_rules
from mismatch_monitor.engine.groupby import columns_of, merge_column
from mismatch_monitor.engine.stats import common_parameters, empty_table, key_columns, table_schema

from mismatch_monitor.exemplars import EXEMPLAR_TABLES, merge_exemplars

from .rank_payload import NULL_INT, PackedStats, PackedTable, row_key_name

# codes stay below this; a wider key space is made dense (sorted unique codes) before it grows
_CODE_LIMIT = 1 << 62


def merge_packed(parts: Sequence[PackedStats]) -> MismatchStats:
    """The merge of ``parts``, equal to ``engine.merge`` of the statistics they were packed from."""
    if not parts:
        return MismatchStats.empty()
    params = common_parameters([MismatchStats({}, p.dims, p.params) for p in parts])
    dims: list[str] = []
    for p in parts:
        dims += [d for d in p.dims if d not in dims]
    tables = {name: merge_table(name, [p.tables[name] for p in parts], dims) for name in TABLES}
    return MismatchStats(tables, tuple(dims), params)


class _CellKey:
    """One cell key column over all parts' cells: a code per cell, in key order, and its decoding."""

    def __init__(self, name: str, kind: str, parts: Sequence[PackedTable]) -> None:
        self.name, self.string = name, kind == "string"
        sizes = [n_cells(t) for t in parts]
        if self.string:
            known = [t.labels[name] for t in parts if name in t.labels]
            self.vocab = np.unique(np.concatenate(known)) if known else np.array([], dtype=object)
            null = len(self.vocab)
            pieces = []
            for t, size in zip(parts, sizes):
                if name not in t.cells:          # a part without this label dimension: all null
                    pieces.append(np.full(size, null, dtype=np.int64))
                    continue
                lookup = np.append(np.searchsorted(self.vocab, t.labels[name]), null)  # code -1 -> null
                pieces.append(lookup[t.cells[name]])
            self.codes, self.low, self.radix = np.concatenate(pieces), 0, null + 1
        else:
            values = np.concatenate([t.cells[name] for t in parts], dtype=np.int64)
            nulls = values == NULL_INT if name == TURN_KEY else None
            known = values if nulls is None else values[~nulls]
            self.low = int(known.min()) if len(known) else 0
            span = int(known.max()) - self.low + 1 if len(known) else 0
            self.codes = values - self.low
            if nulls is not None:
                self.codes[nulls] = span                     # null sorts after every bucket
            self.radix = span + 1

    def column(self, codes: np.ndarray) -> object:
        """The key column of the merged table for cells of these codes."""
        if self.string:
            null = len(self.vocab)
            if null == 0:            # a label no part carries: nulls, not taken row by row
                return pd.arrays.ArrowStringArray(pa.nulls(len(codes), pa.large_string()))
            labels = pd.array(self.vocab, dtype="string")
            return labels.take(np.where(codes == null, -1, codes), allow_fill=True)
        values = codes + self.low
        if self.name == TURN_KEY:
            return pd.arrays.IntegerArray(values, codes == self.radix - 1)
        return values


def _combine(code: np.ndarray, span: int, more: np.ndarray, radix: int) -> tuple[np.ndarray, int]:
    """code * radix + more, made dense first (order kept) when the product would overflow."""
    if span * radix >= _CODE_LIMIT:
        uniques, code = np.unique(code, return_inverse=True)
        span = len(uniques)
    return code * radix + more, span * radix


def _dense(code: np.ndarray, space: int) -> bool:
    """Group by the codes themselves (the merged columns have a slot per code, the empty ones
    dropped after) rather than by a sort: the space is not much larger than the rows."""
    return space <= 2 * len(code) + (1 << 16)


def _row_codes(parts: Sequence[PackedTable], cell_index: np.ndarray, width: int, low: int) -> np.ndarray:
    """[rows] each row's code: its cell's index times ``width`` plus its row key minus ``low``
    (one pass per part into one array: the cell indices of part i follow those of parts < i)."""
    out = np.empty(sum(t.n_rows for t in parts), dtype=np.int64)
    at = cell = 0
    for t in parts:
        base = cell_index[cell:cell + n_cells(t)] * width - low      # [cells of the part]
        rows = out[at:at + t.n_rows]
        if t.cell_of_row is None:
            rows[:] = base
        else:
            np.take(base, t.cell_of_row, out=rows)
        if t.row_key is not None:
            rows += t.row_key
        at, cell = at + t.n_rows, cell + n_cells(t)
    return out


def merge_table(table: str, tables: Sequence[PackedTable], dims: Sequence[str]) -> pd.DataFrame:
    parts = [t for t in tables if t.n_rows]
    if not parts:
        return empty_table(table, dims)
    schema = table_schema(table, dims)
    row_key = row_key_name(table)
    keys = [_CellKey(k, schema[k], parts) for k in key_columns(table, dims) if k != row_key]
    # 1) cells: one code each, then one index per distinct cell in key order
    code, span = np.zeros(len(keys[0].codes), dtype=np.int64), 1
    for k in keys:
        code, span = _combine(code, span, k.codes, k.radix)
    cells, first, cell_index = np.unique(code, return_index=True, return_inverse=True)
    # 2) rows: their cell's index and row key in one code, then their group
    low, width = 0, 1
    if row_key is not None:
        low = min(int(t.row_key.min()) for t in parts)
        width = max(int(t.row_key.max()) for t in parts) - low + 1
    row_code = _row_codes(parts, cell_index, width, low)
    space = len(cells) * width
    if _dense(row_code, space):
        present = np.zeros(space, dtype=bool)
        present[row_code] = True
        groups, group, G = np.flatnonzero(present), row_code, space
    else:
        groups, group = np.unique(row_code, return_inverse=True)
        G = len(groups)
    # 3) the merged table: key columns decoded from the groups, values merged by their rules
    group_cell = first[groups // width]
    data: dict[str, object] = {k.name: k.column(k.codes[group_cell]) for k in keys}
    if row_key is not None:
        data[row_key] = groups % width + low
    rules = merge_rules(table)
    for f in TABLES[table][1]:
        values = np.concatenate([t.values[f.name] for t in parts], dtype=np.dtype(f.dtype))
        merged = merge_column(values, rules[f.name], group, G)
        data[f.name] = merged[groups] if G == space and G != len(groups) else merged
    return pd.DataFrame({c: data[c] for c in schema}, copy=False)


def n_cells(t: PackedTable) -> int:
    return len(t.cells[LENGTH_KEY])


def top_exemplars(parts: Sequence[Mapping[str, pd.DataFrame]], k: int) -> dict[str, pd.DataFrame]:
    """``exemplars.merge_exemplars`` of the shards' exemplars, the same rows in the same order:
    the top ``k`` are chosen on the rank columns alone (ties in part order, NaN last) and only
    the rows chosen are concatenated (a concat of 64 frames is most of a step's merge)."""
    out = {}
    for name, rank in EXEMPLAR_TABLES.items():
        frames = [p[name] for p in parts if name in p and len(p[name])]
        if not frames or k <= 0:
            out[name] = merge_exemplars([{name: f} for f in frames], k)[name]
            continue
        scores = np.concatenate([np.asarray(columns_of(f, [rank])[rank], dtype=np.float64) for f in frames])
        top = np.argsort(-scores, kind="stable")[:k]          # -NaN is NaN: sorts last, as pandas puts it
        part = np.searchsorted(np.cumsum([len(f) for f in frames]), top, side="right")
        starts = np.cumsum([0] + [len(f) for f in frames])
        chosen = sorted(set(part.tolist()))
        picked = pd.concat([frames[i].iloc[top[part == i] - starts[i]] for i in chosen], ignore_index=True)
        # the concatenation holds part 0's chosen rows first: put them in rank order
        position = {i: n for n, i in enumerate(chosen)}
        offsets = np.cumsum([0] + [int((part == i).sum()) for i in chosen])
        order = np.empty(len(top), dtype=np.int64)
        seen = {i: 0 for i in chosen}
        for n, i in enumerate(part.tolist()):
            order[n] = offsets[position[i]] + seen[i]
            seen[i] += 1
        out[name] = picked.iloc[order].reset_index(drop=True)
    return out
