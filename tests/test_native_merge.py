"""The compiled merge loops (engine/_merge.c through engine/native_merge.py) against numpy's
merge of the same rows (engine/groupby.merge_column): the same bits, signed zeros and NaN
included, and malformed inputs refused."""

from __future__ import annotations

import numpy as np
import pytest

from mismatch_monitor.engine import native_merge
from mismatch_monitor.engine.groupby import merge_column



@pytest.fixture(autouse=True)
def _built():
    # the suite expects the compiled loops, as the engine's own tests do (README)
    assert native_merge.available(), "the compiled merge loops were not built (python setup.py build_ext --inplace)"


def cells(seed: int, parts: int = 5, groups: int = 7):
    """Parts' cells in group order (as the engine writes them), each with a run of rows whose
    keys lie in the cell's range."""
    rng = np.random.default_rng(seed)
    group, run, lo, hi, keys, part_cells = [], [], [], [], [], []
    for _ in range(parts):
        mine = np.sort(rng.choice(groups, size=rng.integers(1, groups + 1), replace=False))
        part_cells.append(len(mine))
        for g in mine:
            k = np.sort(rng.choice(np.arange(-3, 9), size=rng.integers(1, 6), replace=False))
            group.append(g), run.append(len(k)), lo.append(k.min()), hi.append(k.max()), keys.append(k)
    used = np.unique(group)                         # every group with a cell
    group = np.searchsorted(used, group)
    as64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return (as64(part_cells), as64(group), len(used), as64(run), np.concatenate(keys).astype(np.int8),
            as64(lo), as64(hi))


def reference(group, run, keys, values, rule):
    """numpy's merge of the rows by (group, key), groups and keys in order."""
    row_group = np.repeat(group, run)
    pairs, slot = np.unique(np.stack([row_group, keys.astype(np.int64)]), axis=1, return_inverse=True)
    return pairs, merge_column(values, rule, slot.reshape(-1), pairs.shape[1])


@pytest.mark.parametrize("rule", ["sum", "max", "min"])
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int64, np.float64])
def test_compiled_merge_is_numpy_merge_bit_for_bit(rule, dtype):
    for seed in range(6):
        part_cells, group, n_groups, run, keys, lo, hi = cells(seed)
        n = len(keys)
        rng = np.random.default_rng(100 + seed)
        if dtype == np.float64:          # signed zeros, NaN, and sums that round
            values = rng.choice(np.array([0.0, -0.0, np.nan, 0.1, -2.5, 1e16, 1 / 3]), size=n)
        else:
            values = rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=n, dtype=dtype, endpoint=True)
        out_key, runs, (got,) = native_merge.merge_groups(part_cells, group, n_groups, run, keys, lo, hi,
                                                          [(values, rule)])
        pairs, want = reference(group, run, keys, values, rule)
        assert np.array_equal(out_key, pairs[1]) and np.array_equal(np.repeat(np.arange(n_groups), runs), pairs[0])
        if rule != "sum" and want.dtype.kind == "i":      # extremes of integers come as float64
            assert got.dtype == np.float64
            got, want = got.astype(np.int64), want.astype(np.int64)
        assert got.dtype == want.dtype and np.array_equal(got.view(np.int64), want.view(np.int64))


def test_parts_not_in_group_order_merge_alike():
    part_cells, group, n_groups, run, keys, lo, hi = cells(3)
    order = np.arange(len(group))[::-1]          # the cells of one part, backwards
    values = np.random.default_rng(0).normal(size=len(keys))
    starts = np.cumsum(run) - run
    rows = np.concatenate([np.arange(starts[c], starts[c] + run[c]) for c in order])
    one_part = np.array([len(group)], dtype=np.int64)
    out_key, runs, (got,) = native_merge.merge_groups(one_part, group[order], n_groups, run[order], keys[rows],
                                                      lo[order], hi[order], [(values[rows], "sum")])
    pairs, want = reference(group[order], run[order], keys[rows], values[rows], "sum")
    assert np.array_equal(out_key, pairs[1]) and np.array_equal(got.view(np.int64), want.view(np.int64))


def test_malformed_inputs_are_refused():
    part_cells, group, n_groups, run, keys, lo, hi = cells(1)
    values = np.ones(len(keys))
    bad_key = keys.copy()
    bad_key[0] = hi[0] + 1                       # outside its cell's range
    with pytest.raises(ValueError, match="within its cell's range"):
        native_merge.merge_groups(part_cells, group, n_groups, run, bad_key, lo, hi, [(values, "sum")])
    with pytest.raises(ValueError, match="groups 0..n_groups-1"):
        native_merge.merge_groups(part_cells, group, n_groups - 1, run, keys, lo, hi, [(values, "sum")])
    with pytest.raises(ValueError, match="expected values|column 0"):
        native_merge.merge_groups(part_cells, group, n_groups, run, keys, lo, hi, [(values[1:], "sum")])
