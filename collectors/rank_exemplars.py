"""A rank's tail exemplars in transit, and the writer's global top K of them.

A pickled frame costs the writer far more to load than its K rows (a 16-row exemplar frame took
longer to unpickle than a rank's packed statistics): each table travels as plain columns instead,
numpy arrays for numbers and lists of values (None for null) for pandas' own types (labels,
nullable integers), with the names and types to rebuild it. The merge picks the top K on the rank
columns and builds only the K rows chosen, the rows ``exemplars.merge_exemplars`` gives in its
order and types (``tests/test_distributed_merge.py``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd

from mismatch_monitor.engine.groupby import columns_of
from mismatch_monitor.exemplars import EXEMPLAR_TABLES, merge_exemplars

RANK_COLUMN = "rank"


class PackedFrame(NamedTuple):
    """One exemplar table: ``columns[i]`` holds column ``names[i]`` of type ``dtypes[i]`` (a numpy
    array, or a list of values for a pandas extension type)."""

    n: int
    names: tuple[str, ...]
    dtypes: tuple[object, ...]
    columns: tuple[object, ...]


def pack_frame(df: pd.DataFrame, rank: int | None = None) -> PackedFrame:
    """``df`` as columns; ``rank``: with a ``rank`` column of that value, as ``df.assign(rank=rank)``."""
    cols = columns_of(df)
    names, dtypes = list(cols), list(df.dtypes)
    columns = [c if isinstance(c, np.ndarray) else c.to_numpy(dtype=object, na_value=None).tolist()
               for c in cols.values()]
    if rank is not None:
        ranks = np.full(len(df), rank, dtype=np.int64)
        if RANK_COLUMN in names:
            at = names.index(RANK_COLUMN)
            columns[at], dtypes[at] = ranks, ranks.dtype
        else:
            names.append(RANK_COLUMN)
            dtypes.append(ranks.dtype)
            columns.append(ranks)
    return PackedFrame(len(df), tuple(names), tuple(dtypes), tuple(columns))


def unpack_frame(p: PackedFrame) -> pd.DataFrame:
    return pd.DataFrame({name: c if isinstance(c, np.ndarray) else pd.array(c, dtype=dtype)
                         for name, dtype, c in zip(p.names, p.dtypes, p.columns)})


def pack_exemplars(frames: Mapping[str, pd.DataFrame], rank: int | None = None) -> dict[str, PackedFrame]:
    """A rank's exemplar tables as it sends them (see :func:`pack_frame`)."""
    return {name: pack_frame(df, rank) for name, df in frames.items()}


def top_exemplars(parts: Sequence[Mapping[str, object]], k: int) -> dict[str, pd.DataFrame]:
    """``exemplars.merge_exemplars`` of the shards' exemplars (packed, or frames), the same rows in
    the same order: the top ``k`` are chosen on the rank columns alone (ties in part order, NaN
    last) and only the rows chosen are built. Parts whose columns differ (ranks with other label
    dimensions) are merged as frames by ``merge_exemplars`` itself."""
    out = {}
    for name, rank in EXEMPLAR_TABLES.items():
        tables = [p[name] if isinstance(p[name], PackedFrame) else pack_frame(p[name]) for p in parts if name in p]
        tables = [t for t in tables if t.n]
        first = tables[0] if tables else None
        if (first is None or k <= 0 or rank not in first.names
                or not isinstance(first.columns[first.names.index(rank)], np.ndarray)
                or any(t.names != first.names or t.dtypes != first.dtypes for t in tables)):
            out[name] = merge_exemplars([{name: unpack_frame(t)} for t in tables], k)[name]
            continue
        out[name] = _top(tables, first.names.index(rank), k)
    return out


def _top(tables: Sequence[PackedFrame], at: int, k: int) -> pd.DataFrame:
    scores = np.concatenate([np.asarray(t.columns[at], dtype=np.float64) for t in tables])
    top = np.argsort(-scores, kind="stable")[:k]          # -NaN is NaN: sorts last, as pandas puts it
    starts = np.cumsum([0] + [t.n for t in tables])
    part = np.searchsorted(starts[1:], top, side="right")
    rows = list(zip(part.tolist(), (top - starts[part]).tolist()))
    data = {}
    for c, (name, dtype) in enumerate(zip(tables[0].names, tables[0].dtypes)):
        if isinstance(tables[0].columns[c], np.ndarray):
            data[name] = np.concatenate([t.columns[c] for t in tables])[top]
        else:
            data[name] = pd.array([tables[i].columns[c][j] for i, j in rows], dtype=dtype)
    return pd.DataFrame(data, copy=False)
