"""What one rank sends for one step: its statistics as numpy columns and label dictionaries.

A pickled ``MismatchStats`` carries every label string of every row (the |lr| histogram alone
has tens of thousands of rows a step, each repeating its cell's five labels) and pandas' frame
overhead: 3-4 MB a rank at 100,000 tokens with realistic slicing. Here each table travels as

- its cells once (a cell per run of rows with the same cell keys: the labels as codes into the
  table's label dictionary, the length and turn buckets) and each run's length;
- its last key column (``bin``, ``bucket``, ``layer``, ``staleness``) and its value columns, as
  numpy arrays; integer columns in the narrowest integer type that holds their range (lossless:
  the merge widens them back to int64 before adding).

Float columns are sent as they are (float64), so the merge is bit for bit the merge of the
frames (``collectors/rank_merge.py``). Packing reads each column once and does no grouping:
it is all this adds to a rank's critical path besides the collective itself.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_monitor.engine import MismatchStats
from mismatch_monitor.engine.fields import TABLES, TURN_KEY, merge_rules
from mismatch_monitor.engine.groupby import columns_of
from mismatch_monitor.engine.stats import key_columns, table_schema

# a null turn bucket (a batch without turn indices) travels as this code
NULL_INT = -1


class PackedTable(NamedTuple):
    """One statistics table. ``cells[k]`` [C]: the value of cell key ``k`` per cell (codes into
    ``labels[k]`` (a tuple of the distinct labels) for string keys, -1 for null; integers
    otherwise, -1 for a null turn bucket); ``run`` [C]: each cell's number of rows, which follow
    one another (None: a row per cell); ``row_key`` [n]: the table's last extra key column per
    row (None for tables without one) and ``key_range`` [2, C] its lowest and highest value per
    cell (the writer sizes each merged cell's codes by them); ``values``: value columns."""

    n_rows: int
    labels: dict[str, tuple[str, ...]]
    cells: dict[str, np.ndarray]
    run: np.ndarray | None
    row_key: np.ndarray | None
    key_range: np.ndarray | None
    values: dict[str, np.ndarray]


class PackedStats(NamedTuple):
    """A rank's ``MismatchStats`` in transit (``params``: as ``MismatchStats.params``)."""

    dims: tuple[str, ...]
    params: object
    tables: dict[str, PackedTable]


def row_key_name(table: str) -> str | None:
    """The key column packed per row (the others are packed per cell)."""
    extra = TABLES[table][0]
    return extra[-1] if extra else None


def narrow(values: np.ndarray) -> np.ndarray:
    """An integer array in the narrowest signed type holding its range (others unchanged)."""
    if values.dtype.kind not in "iu" or values.size == 0:
        return values
    lo, hi = int(values.min()), int(values.max())
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return values.astype(dtype)
    return values


def _int_codes(column: object, name: str) -> np.ndarray:
    if name == TURN_KEY and isinstance(column, pd.api.extensions.ExtensionArray):
        return column.to_numpy(dtype=np.int64, na_value=NULL_INT)
    return np.asarray(column, dtype=np.int64)


def _changes(column: object, string: bool) -> np.ndarray | None:
    """[n - 1] True where row i + 1's value differs from row i's (None: a column of one value)."""
    if not string:
        return column[1:] != column[:-1]
    arrow = pa.array(column)
    if arrow.null_count == len(arrow):      # a label the batch does not carry: nothing to compare
        return None
    after, before = arrow[1:], arrow[:-1]
    differ = pc.fill_null(pc.not_equal(after, before), False)
    if arrow.null_count:
        differ = pc.or_(differ, pc.not_equal(pc.is_null(after), pc.is_null(before)))
    return differ.to_numpy(zero_copy_only=False)


def _label_codes(column: object) -> tuple[np.ndarray, tuple[str, ...]]:
    """Codes of a string column into its distinct labels (null: -1), and those labels (a
    tuple: it pickles as fast as its strings, an object array does not)."""
    arrow = pa.array(column)
    if arrow.null_count == len(arrow):
        return np.full(len(arrow), -1, dtype=np.int64), ()
    encoded = pc.dictionary_encode(arrow)
    codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
    return codes, tuple(encoded.dictionary.to_pylist())


def pack_table(df: pd.DataFrame, table: str, dims: Sequence[str]) -> PackedTable:
    schema = table_schema(table, dims)
    row_key = row_key_name(table)
    cell_keys = [k for k in key_columns(table, dims) if k != row_key]
    cols = columns_of(df)
    n = len(df)
    keys = {k: cols[k] if schema[k] == "string" else _int_codes(cols[k], k) for k in cell_keys}
    # the engine writes a cell's rows together: a new cell starts where any key changes, so the
    # labels are compared row to row (C++ in arrow) and coded only once per cell
    starts = np.ones(n, dtype=bool)
    if row_key is not None and n:
        starts[1:] = False
        for k, c in keys.items():
            differ = _changes(c, schema[k] == "string")
            if differ is not None:
                starts[1:] |= differ
    at = None if bool(starts.all()) else np.flatnonzero(starts)
    labels, cells = {}, {}
    for k, c in keys.items():
        c = c if at is None else (c.take(at) if schema[k] == "string" else c[at])
        if schema[k] == "string":
            c, labels[k] = _label_codes(c)
        cells[k] = narrow(np.asarray(c, dtype=np.int64))
    keyed = None if row_key is None else np.asarray(cols[row_key], dtype=np.int64)
    key_range = None
    if keyed is not None:
        ends = (keyed, keyed) if at is None else (np.minimum.reduceat(keyed, at), np.maximum.reduceat(keyed, at))
        key_range = narrow(np.stack(ends))
    return PackedTable(
        n, labels, cells, None if at is None else narrow(np.diff(at, append=n)),
        None if keyed is None else narrow(keyed), key_range,
        {name: narrow(np.asarray(cols[name])) for name in merge_rules(table)})


def pack(stats: MismatchStats) -> PackedStats:
    """``stats`` as a rank sends it."""
    dims = tuple(stats.dims)
    return PackedStats(dims, stats.params,
                       {name: pack_table(stats.tables[name], name, dims) for name in TABLES})


def payload_bytes(packed: PackedStats) -> int:
    """Bytes of the arrays of a packed shard (the pickle adds a few kB of names and headers)."""
    total = 0
    for t in packed.tables.values():
        arrays = [*t.cells.values(), *t.values.values(), t.run, t.row_key, t.key_range]
        total += sum(a.nbytes for a in arrays if a is not None)
        total += sum(len(str(s)) for u in t.labels.values() for s in u)
    return total
