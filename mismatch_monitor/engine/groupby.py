"""The one group-by of sufficient statistics in Python: rows coded by their key values, and every
value column merged by its field's rule (``fields.py``: sum, max, min, logsumexp).

Every Python merge goes through here: ``stats.merge`` and ``MismatchStats.marginal`` (ranks,
steps, slices), the collector's per-step report (``metrics.report_by_label``), the exporter's
capped (pool, hardware) cells (``export_cells``), the join of sequence and histogram rows onto
metric groups (``metrics.derive``) and the writer rank's merge of packed shards
(``collectors/rank_merge.py``, which codes its keys from the shards' label dictionaries and
groups through :func:`combine` and :func:`by_codes`). SQL has its own generated merge
(``fields.merge_sql``); the two are checked against each other by the store and query tests.

Keys may be spread over several parts (the token, sequence and histogram tables of one report,
say): their values are coded in one dictionary, so a label means the same group in each. Nulls
are a group of their own (as in SQL's GROUP BY); groups come in key order, nulls last. Rows are
grouped by mixed-radix codes over the keys' sorted codes: by the codes themselves (a slot per
code, no sort) when their space is small, else by their sorted unique values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import pandas as pd

Columns = Mapping[str, object]      # column name -> numpy array or pandas (extension) array


@dataclass(frozen=True)
class Groups:
    """``codes``: per part, the group of each row (0..size-1; -1: in no group, see :func:`group`);
    ``values``: per key, the value of each group ([size]; typed as the part's column when there
    is one part, else an object array with None for null)."""

    codes: tuple[np.ndarray, ...]
    size: int
    values: dict[str, object]


def columns_of(frame: pd.DataFrame, names: Sequence[str] | None = None) -> dict[str, object]:
    """Columns of a frame as arrays: numpy for numbers (plain array arithmetic, no pandas
    per-operation overhead on frames of a few rows), pandas arrays for labels (nulls kept)."""
    index = {c: i for i, c in enumerate(frame.columns)}
    names = list(frame.columns) if names is None else names
    # ``frame[c]`` builds a Series per column (about 45 us each: 2 ms a step for the token
    # table's 43 columns, which the collector reads every step); the frame's own arrays are
    # the same values without one
    column = getattr(frame, "_get_column_array", None)
    if column is None:           # a pandas without it
        return {c: frame[c].array if isinstance(frame[c].dtype, pd.api.extensions.ExtensionDtype)
                else frame[c].to_numpy() for c in names}
    return {c: column(index[c]) for c in names}


def _length(cols: Columns) -> int:
    return len(next(iter(cols.values()))) if cols else 0


def _key_codes(parts: Sequence[Columns], key: str, lengths: Sequence[int]) -> tuple[list[np.ndarray], object]:
    """Codes of one key's values in every part, in one sorted dictionary (nulls last, one code
    for every kind of null), and that dictionary. A part without the column is all null."""
    present = [p[key] if key in p else None for p in parts]
    if len(parts) == 1 and present[0] is not None:
        codes, uniques = pd.factorize(present[0], sort=True, use_na_sentinel=False)
        return [np.asarray(codes, dtype=np.int64)], uniques
    # factorise each part alone (a categorical column codes through its categories, not row by
    # row), then the few distinct values of all parts together
    local = [pd.factorize(col, use_na_sentinel=False) if col is not None else (np.zeros(n, dtype=np.int64), [None])
             for col, n in zip(present, lengths)]
    pooled = np.concatenate([np.asarray(u, dtype=object) for _, u in local])
    # nulls coded apart and put last by hand: a sort of objects mixing None with values need not
    joint, uniques = pd.factorize(pooled, sort=True, use_na_sentinel=True)
    uniques = list(uniques)
    if (joint < 0).any():
        joint = np.where(joint < 0, len(uniques), joint)
        uniques.append(None)
    out, offset = [], 0
    for codes, u in local:
        out.append(joint[offset:offset + len(u)][np.asarray(codes, dtype=np.int64)] if len(u) else
                   np.zeros(0, dtype=np.int64))
        offset += len(u)
    return out, np.array([None if pd.isna(v) else v for v in uniques], dtype=object)


def group(parts: Sequence[Columns], keys: Sequence[str], *, within: int | None = None) -> Groups:
    """Code the rows of ``parts`` by their values of ``keys``. ``within=i``: only the groups that
    part ``i`` has (rows of the other parts outside them get -1), renumbered in order."""
    lengths = [_length(p) for p in parts]
    total = sum(lengths)
    bounds = np.cumsum([0] + lengths)
    code, space = np.zeros(total, dtype=np.int64), 1
    key_codes: dict[str, np.ndarray] = {}
    uniques: dict[str, object] = {}
    for k in keys:  # loop over key columns, not rows
        per_part, uniques[k] = _key_codes(parts, k, lengths)
        key_codes[k] = np.concatenate(per_part) if per_part else np.zeros(0, dtype=np.int64)
        # mixed radix over the keys' sorted codes: lexicographic in the keys
        code, space = combine(code, space, key_codes[k], len(uniques[k]))
    if not keys:
        size = 1 if total else 0
        first = np.zeros(size, dtype=np.int64)
    else:
        coded = by_codes(code, space)
        code, first, size = coded.rows(), coded.first(), coded.size
    if within is not None:
        lo, hi = bounds[within], bounds[within + 1]
        kept = np.zeros(size, dtype=bool)
        kept[code[lo:hi]] = True
        renumber = np.where(kept, np.cumsum(kept) - 1, -1)
        code, first, size = renumber[code], first[kept], int(kept.sum())
    values = {k: _take(uniques[k], key_codes[k][first]) for k in keys}
    return Groups(tuple(code[bounds[i]:bounds[i + 1]] for i in range(len(parts))), size, values)


# mixed-radix codes stay below this; a wider space is made dense (its sorted unique codes) first
CODE_LIMIT = 1 << 62


def combine(code: np.ndarray, space: int, more: np.ndarray, radix: int) -> tuple[np.ndarray, int]:
    """Codes of (``code``, ``more``) pairs in their lexicographic order, and their space:
    ``code * radix + more`` for ``code`` in 0..space-1 and ``more`` in 0..radix-1. When the
    product would overflow, ``code`` is made dense first (its sorted unique values, order kept)."""
    if space * radix >= CODE_LIMIT:
        uniques, code = np.unique(code, return_inverse=True)
        space = len(uniques)
    return code * radix + more, space * radix


def dense_space(n: int, space: int) -> bool:
    """Group ``n`` rows with codes in 0..space-1 by the codes themselves (a slot per code; no
    sort) rather than by sorting: the space is not much larger than the rows (zeroing a slot
    costs far less than sorting a row) and its arrays stay a few MB."""
    return space <= min(32 * n + 1024, 1 << 23)


class Coded(NamedTuple):
    """Rows grouped by integer codes, groups in code order. ``slot`` [n]: each row's slot in
    0..slots-1; ``codes`` [G]: each group's code. Dense (:func:`dense_space`): a row's slot is
    its code and the slots no row has are no group (merge into ``slots`` slots, then take
    :meth:`groups`); sorted: a row's slot is its group."""

    slot: np.ndarray
    slots: int
    codes: np.ndarray

    @property
    def size(self) -> int:
        return len(self.codes)

    @property
    def keep(self) -> np.ndarray | None:
        """The slots that are groups, in order (None: every slot is)."""
        return None if self.slots == len(self.codes) else self.codes

    def groups(self, merged: np.ndarray) -> np.ndarray:
        """[G] the groups' entries of a column merged into the slots ([slots])."""
        return merged if self.keep is None else merged[self.codes]

    def rows(self) -> np.ndarray:
        """[n] each row's group (0..G-1)."""
        if self.slots == len(self.codes):
            return self.slot
        group_of = np.empty(self.slots, dtype=np.int64)
        group_of[self.codes] = np.arange(len(self.codes))
        return group_of[self.slot]

    def first(self) -> np.ndarray:
        """[G] a row of each group (the same key values as every row of it)."""
        row = np.empty(self.slots, dtype=np.int64)
        row[self.slot] = np.arange(len(self.slot))
        return self.groups(row)


def by_codes(code: np.ndarray, space: int) -> Coded:
    """Group rows by integer codes in 0..space-1 (nulls and key order are the caller's coding:
    :func:`combine` of sorted key codes)."""
    if dense_space(len(code), space):
        present = np.zeros(space, dtype=bool)
        present[code] = True
        return Coded(code, space, np.flatnonzero(present))
    codes, slot = np.unique(code, return_inverse=True)
    return Coded(slot.reshape(-1), len(codes), codes)


def _take(uniques: object, at: np.ndarray) -> object:
    return uniques.take(at) if hasattr(uniques, "take") else np.asarray(uniques)[at]


def merge_columns(cols: Columns, rules: Mapping[str, str], codes: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """Every column of ``rules`` merged by its rule into groups 0..size-1 (rows coded -1 are in
    no group)."""
    keep = codes >= 0
    every = bool(keep.all())
    kept = codes if every else codes[keep]
    out = {}
    for col, rule in rules.items():
        values = np.asarray(cols[col])
        out[col] = merge_column(values if every else values[keep], rule, kept, size)
    return out


def logsumexp_by(values: np.ndarray, group: np.ndarray, G: int) -> np.ndarray:
    """log sum exp(values) per group 0..G-1, shifted by each group's max so nothing overflows
    (S = +-800, whose exp overflows or underflows, merges exactly as well). NaN values (a column
    a part lacks) are skipped; a group without a value is NaN."""
    values = np.asarray(values, dtype=np.float64)
    has = ~np.isnan(values)
    shift = np.full(G, -np.inf)
    np.maximum.at(shift, group[has], values[has])
    at = np.where(np.isfinite(shift), shift, 0.0)
    with np.errstate(divide="ignore"):
        total = np.bincount(group[has], weights=np.exp(values[has] - at[group[has]]), minlength=G)
        out = at + np.log(total)
    return np.where(np.bincount(group[has], minlength=G) > 0, out, np.nan)


def merge_column(values: np.ndarray, rule: str, group: np.ndarray, G: int,
                 keep: np.ndarray | None = None) -> np.ndarray:
    """One value column merged by its rule into groups 0..G-1 (``group`` [n]): integer sums
    stay exact, NaN extremes are skipped, a group without a value is NaN for max/min (and
    logsumexp, :func:`logsumexp_by`). ``keep``: only those groups, in that order (the groups of
    a dense :class:`Coded`: taken before any conversion of the slots)."""
    def kept(merged: np.ndarray) -> np.ndarray:
        return merged if keep is None else merged[keep]

    if rule == "logsumexp":
        return kept(logsumexp_by(values, group, G))
    if G == 1:              # every row in one group: a plain reduction (a step's total, every step)
        return kept(_total(values, rule))
    if keep is not None and len(keep) == 1:     # one slot of a dense Coded holds every row: the same
        return _total(values, rule)
    if rule == "sum":
        if values.dtype.kind in "iu":
            # bincount sums in float64: exact while every partial sum stays below 2^53, which
            # |values| * rows bounds; np.add.at (exact in int64 always) is several times slower
            if len(values) == 0 or _magnitude(values) * len(values) < 2 ** 53:
                return kept(np.bincount(group, weights=values, minlength=G)).astype(np.int64)
            summed = np.zeros(G, dtype=np.int64)
            np.add.at(summed, group, values)
            return kept(summed)
        return kept(np.bincount(group, weights=values, minlength=G)).astype(values.dtype, copy=False)
    acc = np.full(G, np.nan)
    (np.fmax if rule == "max" else np.fmin).at(acc, group, values.astype(np.float64, copy=False))
    acc = kept(acc)
    return acc.astype(values.dtype) if values.dtype.kind in "iu" else acc


def _magnitude(values: np.ndarray) -> int:
    """A bound on |value| of an integer array: its type's when that is small (narrowed columns:
    no pass over the values), else the values' own."""
    if values.itemsize <= 4:
        info = np.iinfo(values.dtype)
        return max(-int(info.min), int(info.max))
    return max(-int(values.min()), int(values.max()))


def _total(values: np.ndarray, rule: str) -> np.ndarray:
    if rule == "sum":
        return np.array([values.sum()], dtype=np.int64 if values.dtype.kind in "iu" else values.dtype)
    if len(values) == 0:
        return np.array([np.nan])
    ext = (np.fmax if rule == "max" else np.fmin).reduce(values.astype(np.float64))
    return np.array([ext]).astype(values.dtype) if values.dtype.kind in "iu" else np.array([ext])
