"""The one Python group-by (``engine/groupby.py``) against a plain dictionary grouping written
row by row: keys spread over several parts, nulls of every kind, categoricals, ``within``, and
both ways of grouping codes (a slot per code, or sorted unique codes)."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_monitor.engine import groupby
from mismatch_monitor.engine.groupby import by_codes, columns_of, combine, group, merge_column, merge_columns

LABELS = ["a", "b", "c", None]


def _null(v: object) -> bool:
    return v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))


def _key(row: tuple) -> tuple:
    return tuple(None if _null(v) else v for v in row)


def _sort_key(k: tuple) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in k)


parts_strategy = st.lists(
    st.lists(st.tuples(st.sampled_from(LABELS), st.integers(0, 3), st.integers(-5, 5),
                       st.floats(-1e3, 1e3, allow_nan=False)), max_size=25),
    min_size=1, max_size=4)


def _frame(rows: list[tuple], form: int) -> pd.DataFrame:
    """One part in one of the column forms the engine, the store and the SQL layer give."""
    labels = [r[0] for r in rows]
    pool = (pd.array(labels, dtype="string") if form == 0 else
            pd.Series(labels, dtype="category") if form == 1 else pd.Series(labels, dtype=object))
    turn = pd.array([None if r[1] == 3 else r[1] for r in rows], dtype="Int64")
    return pd.DataFrame({"pool": pool, "turn": turn,
                         "n": np.array([r[2] for r in rows], dtype=np.int64),
                         "x": np.array([r[3] for r in rows], dtype=np.float64)})


@settings(max_examples=80, deadline=None)
@given(parts_strategy, st.integers(0, 2), st.booleans(), st.sampled_from([None, True, False]))
def test_groups_and_merges_match_a_row_by_row_dictionary(parts, form, within, dense):
    """``dense``: codes grouped by slot (True) or by sorting (False), whatever their space."""
    frames = [_frame(rows, (form + i) % 3) for i, rows in enumerate(parts)]
    keys = ["pool", "turn"]
    choose = groupby.dense_space if dense is None else (lambda n, space: dense)
    with mock.patch.object(groupby, "dense_space", choose):
        groups = group([columns_of(f) for f in frames], keys, within=0 if within else None)

    expected: dict[tuple, list[tuple]] = {}
    for f in frames:
        for row in zip(*(f[k].tolist() for k in keys), f["n"], f["x"]):
            expected.setdefault(_key(row[:2]), []).append(row[2:])
    allowed = {_key(r) for r in zip(*(frames[0][k].tolist() for k in keys))} if within else set(expected)
    order = sorted((k for k in expected if k in allowed), key=_sort_key)

    assert groups.size == len(order)
    got_keys = [_key(k) for k in zip(*(list(groups.values[k]) for k in keys))]
    assert got_keys == order                      # groups in key order, nulls last
    merged = [merge_columns(columns_of(f), {"n": "sum", "x": "max"}, c, groups.size)
              for f, c in zip(frames, groups.codes)]
    for g, k in enumerate(order):
        rows = expected[k]
        assert sum(int(m["n"][g]) for m in merged) == sum(int(n) for n, _ in rows)
        assert np.nanmax([m["x"][g] for m in merged]) == max(x for _, x in rows)
    for f, c in zip(frames, groups.codes):       # a row outside every kept group is coded -1
        for row, code in zip(zip(*(f[k].tolist() for k in keys)), c):
            assert (code >= 0) == (_key(row) in allowed)
            if code >= 0:
                assert order[code] == _key(row)


def test_a_part_without_the_key_column_is_all_null():
    a = {"pool": pd.array(["x", None], dtype="string"), "n": np.array([1, 2])}
    b = {"n": np.array([5])}
    groups = group([a, b], ["pool"])
    assert list(groups.values["pool"]) == ["x", None]
    assert [c.tolist() for c in groups.codes] == [[0, 1], [1]]


def test_no_keys_is_one_group_of_every_row_or_none():
    assert group([{"n": np.array([1, 2])}], []).size == 1
    assert group([{"n": np.array([], dtype=np.int64)}], []).size == 0
    merged = merge_columns({"n": np.array([3, 4]), "m": np.array([np.nan, 2.0])}, {"n": "sum", "m": "min"},
                           np.zeros(2, dtype=np.int64), 1)
    assert merged["n"].tolist() == [7] and merged["n"].dtype == np.int64 and merged["m"].tolist() == [2.0]


def test_integer_sums_stay_exact_beyond_float64s_integers():
    big = 2 ** 62 + 1                  # float64 cannot hold it: the exact int64 path must take it
    values = np.array([big, 1, 3, 2 ** 40], dtype=np.int64)
    groups = np.array([0, 0, 1, 1])
    merged = merge_columns({"n": values}, {"n": "sum"}, groups, 2)["n"]
    assert merged.tolist() == [big + 1, 3 + 2 ** 40] and merged.dtype == np.int64
    small = np.arange(1000, dtype=np.int64)
    merged = merge_columns({"n": small}, {"n": "sum"}, small % 7, 7)["n"]
    assert merged.tolist() == [int(small[small % 7 == g].sum()) for g in range(7)]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(-9, 9),
                          st.floats(-1e3, 1e3, allow_nan=False)), max_size=40),
       st.sampled_from([1, 10 ** 6, 2 ** 40]))
def test_mixed_radix_codes_group_as_a_sorted_dictionary(rows, scale):
    """Two keys spread by ``scale``: a small space is grouped by slot, a wide one by sorting, and
    the widest (past 2^62) is made dense before the second key joins it."""
    a = np.array([r[0] for r in rows], dtype=np.int64) * scale
    b = np.array([r[1] for r in rows], dtype=np.int64) * scale
    n = np.array([r[2] for r in rows], dtype=np.int64)
    x = np.array([r[3] for r in rows], dtype=np.float64)
    code, space = combine(np.zeros(len(rows), dtype=np.int64), 1, a, 6 * scale)
    code, space = combine(code, space, b, 4 * scale)
    coded = by_codes(code, space)

    order = sorted({(r[0], r[1]) for r in rows})
    assert coded.size == len(order)
    group_of_row = coded.rows()
    assert [order.index((r[0], r[1])) for r in rows] == group_of_row.tolist()
    first = coded.first()
    assert [(rows[i][0], rows[i][1]) for i in first] == order
    for rule, reduce in (("sum", sum), ("max", max), ("min", min)):
        for values in (n, x):
            merged = merge_column(values, rule, coded.slot, coded.slots, coded.keep)
            want = [reduce(v for v, r in zip(values.tolist(), rows) if (r[0], r[1]) == k) for k in order]
            assert merged.tolist() == want
            assert merged.dtype == (np.int64 if values is n else np.float64)
    assert coded.codes.tolist() == sorted(set(code.tolist()))


def test_dense_and_sorted_grouping_agree_on_wide_sparse_codes():
    code = np.array([7, 3, 10 ** 7, 3, 7, 0], dtype=np.int64)
    for dense in (True, False):
        with mock.patch.object(groupby, "dense_space", lambda n, space: dense):
            coded = by_codes(code, 10 ** 7 + 1)
        assert coded.codes.tolist() == [0, 3, 7, 10 ** 7]
        assert coded.rows().tolist() == [2, 1, 3, 1, 2, 0]
        # dense: a slot per code, the merged slots taken at the groups' codes
        assert coded.slots == (10 ** 7 + 1 if dense else 4)
        assert coded.groups(np.arange(coded.slots)).tolist() == ([0, 3, 7, 10 ** 7] if dense else [0, 1, 2, 3])
    assert not groupby.dense_space(6, 10 ** 7 + 1) and groupby.dense_space(6, 64)
