"""The compiled loops of the packed-shard merge (``_merge.c``, built into the engine's extension),
called through ctypes; ``collectors/rank_merge.py`` takes them when they were built and numpy
otherwise (``engine/groupby.py``), with the same result bit for bit.

Every array is checked against the layout the loops read (dtype, length, C order) before its
address is taken: a mismatch raises, naming the array.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Sequence

import numpy as np

from . import native

# MM_MERGE_VERSION of _merge.c
MERGE_VERSION = 5
# element kinds and merge rules, as _merge.c numbers them
KINDS = {np.dtype(np.int8): 0, np.dtype(np.int16): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
         np.dtype(np.float64): 4}
RULES = {"sum": 0, "max": 1, "min": 2}

_P, _I = ctypes.c_void_p, ctypes.c_int64


class Groups(ctypes.Structure):
    """``Groups`` of _merge.c: one table's rows and where their merge goes."""

    _fields_ = [(name, _I) for name in ("n_cells", "n_groups", "n_rows", "n_parts")] + [
        ("part_cells", _P), ("group", _P), ("run", _P), ("key", _P), ("key_kind", _I), ("lo", _P), ("hi", _P), ("n_cols", _I),
        ("values", _P), ("kinds", _P), ("rules", _P), ("capacity", _I), ("out_key", _P), ("out_runs", _P),
        ("out", _P)]


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The engine's extension (``native.library``) when it holds the merge loops of this
    version, else None (not built, or built from another version of _merge.c)."""
    lib = native.library()
    if lib is None:
        return None
    version = getattr(lib, "mm_merge_version", None)
    if version is None:
        return None
    version.restype = _I
    if version() != MERGE_VERSION:
        return None
    lib.mm_merge_cell_codes.argtypes = [_I, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P]
    lib.mm_merge_groups.argtypes = [ctypes.POINTER(Groups)]
    lib.mm_merge_cell_codes.restype = lib.mm_merge_groups.restype = _I
    return lib


def available() -> bool:
    return library() is not None


_INTS = tuple(KINDS)[:4]
_I64 = (np.dtype(np.int64),)


def _addr(name: str, a: np.ndarray | None, dtypes: tuple[np.dtype, ...], n: int) -> int | None:
    if a is None:
        return None
    if a.dtype not in dtypes or a.shape != (n,) or not a.flags.c_contiguous:
        raise ValueError(f"compiled merge: expected {name} as a C-ordered [{n}] array of "
                         f"{' or '.join(str(d) for d in dtypes)}, got {a.dtype} of shape {a.shape}")
    return a.ctypes.data


def _check(result: int, what: str) -> int:
    if result < 0:
        raise ValueError(f"compiled merge: {what}")
    return result


def _pointers(arrays: list[int | None]) -> np.ndarray:
    return np.array([0 if a is None else a for a in arrays], dtype=np.int64)


def cell_codes(keys: Sequence, part_cells: Sequence[int]) -> np.ndarray:
    """[cells] the mixed radix over ``keys`` (rank_cells.CellKey: ``values`` [cells], ``lut``,
    ``shift`` [parts], ``radix``) of every cell, key k's code ``lut[value + shift[part]]``;
    their product must stay below 2^62."""
    counts = np.asarray(part_cells, dtype=np.int64)
    n = int(counts.sum())
    values = _pointers([_addr(f"cell key {k.name}", k.values, _INTS, n) for k in keys])
    luts = _pointers([_addr("lut", k.lut, _I64, len(k.lut)) for k in keys])
    shifts = _pointers([_addr("shift", k.shift, _I64, len(counts)) for k in keys])
    kinds = np.array([KINDS[k.values.dtype] for k in keys], dtype=np.int32)
    sizes = np.array([len(k.lut) for k in keys], dtype=np.int64)
    radix = np.array([k.radix for k in keys], dtype=np.int64)
    code = np.empty(n, dtype=np.int64)
    _check(library().mm_merge_cell_codes(n, len(counts), counts.ctypes.data, len(keys), values.ctypes.data,
                                         kinds.ctypes.data, luts.ctypes.data, sizes.ctypes.data,
                                         shifts.ctypes.data, radix.ctypes.data, code.ctypes.data),
           "a cell key's value outside its table (a part's labels or buckets do not match its cells)")
    return code


def merge_groups(part_cells: np.ndarray, group: np.ndarray, n_groups: int, run: np.ndarray | None,
                 key: np.ndarray | None,
                 lo: np.ndarray | None, hi: np.ndarray | None, columns: Sequence[tuple[np.ndarray, str]]
                 ) -> tuple[np.ndarray | None, np.ndarray, list[np.ndarray]]:
    """The rows of cells grouped by ``group`` (0..n_groups-1 per cell, the cells of the parts
    one after another, ``part_cells`` [parts] each; ``run[c]`` rows per cell, None: one) and by their row ``key`` (None: a row per group; ``lo``/``hi``: each cell's range
    of it), and the value ``columns`` (values, rule: sum, max or min) merged per merged row.
    Returns each merged row's key (None without one), each group's number of merged rows, and
    the merged columns (int64 sums of integers, float64 otherwise; NaN for a max or min without
    a value), rows in group order and within a group in key order."""
    n_cells = len(group)
    n_rows = n_cells if run is None else int(run.sum())
    if key is not None and (lo is None or hi is None):
        raise ValueError("compiled merge: expected each cell's range of row keys with the row keys")
    values = [_addr(f"column {i}", v, tuple(KINDS), n_rows) for i, (v, _) in enumerate(columns)]
    capacity = n_rows if key is not None else n_groups
    out = [np.empty(capacity, dtype=np.int64 if rule == "sum" and v.dtype.kind in "iu" else np.float64)
           for v, rule in columns]
    out_key = np.empty(capacity, dtype=np.int64) if key is not None else None
    runs = np.empty(n_groups, dtype=np.int64)
    arrays = (_pointers(values), np.array([KINDS[v.dtype] for v, _ in columns], dtype=np.int64),
              np.array([RULES[rule] for _, rule in columns], dtype=np.int64), _pointers([o.ctypes.data for o in out]))
    spec = Groups(n_cells, n_groups, n_rows, len(part_cells), _addr("part_cells", part_cells, _I64, len(part_cells)),
                  _addr("group", group, _I64, n_cells), _addr("run", run, _I64, n_cells),
                  _addr("key", key, _INTS, n_rows), KINDS[key.dtype] if key is not None else 0,
                  _addr("lo", lo, _I64, n_cells), _addr("hi", hi, _I64, n_cells), len(columns),
                  *(a.ctypes.data for a in arrays[:3]), capacity, None if out_key is None else out_key.ctypes.data,
                  runs.ctypes.data, arrays[3].ctypes.data)
    merged = _check(library().mm_merge_groups(ctypes.byref(spec)),
                    "expected cells in groups 0..n_groups-1, every group with a cell, each row key within its "
                    "cell's range, and columns of sum, max or min")
    return (None if out_key is None else out_key[:merged]), runs, [o[:merged] for o in out]
