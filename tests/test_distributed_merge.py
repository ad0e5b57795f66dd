"""The writer's merge of packed shards (collectors/rank_payload.py, rank_merge.py) against the
engine's merge of the same statistics as frames: the same tables bit for bit (rows, order,
dtypes, every float), and the same exemplars. No process group: the shards are built and
pickled here, as ``gather_object`` would carry them."""

from __future__ import annotations

import pickle
from unittest import mock

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors.distributed import Shard, merge_parts
from mismatch_monitor.collectors.rank_exemplars import pack_exemplars, top_exemplars
from mismatch_monitor.collectors.rank_merge import merge_packed
from mismatch_monitor.collectors.rank_payload import narrow, pack
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import MismatchStats, compute_stats, groupby, merge, native_merge
from mismatch_monitor.exemplars import EXEMPLAR_TABLES, merge_exemplars, tail_exemplars

from test_distributed_reducer import CONFIG, make_batch

torch.set_num_threads(1)


def no_turns(seed: int, num_seqs: int) -> TokenBatch:
    """A batch without turn indices (null turn buckets) and with one label only."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (num_seqs,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    sampler = -torch.rand(int(lengths.sum()), generator=g) * 5
    trainer = (sampler + torch.randn(len(sampler), generator=g) * 0.1).clamp(max=0.0)
    return TokenBatch.from_flat(trainer, sampler, seq_offsets=offsets,
                                labels={"pool": [f"p{i % 3}" for i in range(num_seqs)]})


@pytest.fixture(params=["compiled", "numpy"])
def merge_path(request):
    """The packed merge by the compiled loops of engine/_merge.c, or by numpy (as without the
    extension)."""
    if request.param == "compiled":
        # the suite expects the compiled loops, as the engine's own tests do (README)
        assert native_merge.available(), "the compiled merge loops were not built (python setup.py build_ext --inplace)"
        yield request.param
    else:
        with mock.patch.object(native_merge, "available", lambda: False):
            yield request.param


def assert_same(got: MismatchStats, want: MismatchStats) -> None:
    assert got.dims == want.dims and got.params == want.params
    for name, table in want.tables.items():
        pd.testing.assert_frame_equal(got.tables[name], table, check_exact=True, obj=name)


def parts() -> list[MismatchStats]:
    # two label sets (env on some ranks only), null turns, an empty rank, uneven shares
    batches = [make_batch(1, 7), make_batch(2, 0), make_batch(3, 12, extra_label=True), make_batch(4, 5),
               make_batch(5, 9, extra_label=True)]
    return [compute_stats(b, CONFIG) for b in batches]


@pytest.mark.parametrize("dense", [None, True, False])
def test_packed_merge_is_the_engine_merge_bit_for_bit(dense, merge_path):
    """``dense``: the group-by's codes grouped by slot (True) or by sorting (False) everywhere."""
    stats = parts()
    choose = groupby.dense_space if dense is None else (lambda n, space: dense)
    for subset in (stats[:1], stats[:2], stats[1:], stats, stats[::-1], [stats[0], stats[0]]):
        with mock.patch.object(groupby, "dense_space", choose):
            got = merge_packed([pickle.loads(pickle.dumps(pack(s))) for s in subset])
        assert_same(got, merge(subset))


def test_null_turn_buckets_and_missing_labels_merge_as_the_engine_merges_them(merge_path):
    stats = [compute_stats(no_turns(s, 12), CONFIG) for s in range(3)] + [parts()[2]]
    assert stats[0]["tokens"]["turn_bucket"].isna().all()
    assert_same(merge_packed([pack(s) for s in stats]), merge(stats))


def test_histogram_rows_of_one_cell_apart_still_merge_into_one_row(merge_path):
    """Packing codes a cell per run of rows; a table whose cell comes back later (rows not
    grouped by cell) still merges to one row per (cell, bin)."""
    s = parts()[2]
    hist = s["abs_hist"]
    shuffled = hist.iloc[np.random.default_rng(0).permutation(len(hist))].reset_index(drop=True)
    other = MismatchStats(dict(s.tables, abs_hist=shuffled), s.dims, s.params)
    assert len(pack(other).tables["abs_hist"].cells["length_bucket"]) > len(pack(s).tables["abs_hist"].cells["length_bucket"])
    assert_same(merge_packed([pack(other), pack(parts()[3])]), merge([other, parts()[3]]))


def test_realistic_slicing_merges_exactly_and_packs_small(merge_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_engine import CONFIG as SLICED, make_data

    stats = [compute_stats(make_data(20_000, seed=r).batch, SLICED) for r in range(3)]
    assert_same(merge_packed([pack(s) for s in stats]), merge(stats))
    # the label strings travel once per cell, not once per histogram row
    assert len(pickle.dumps(pack(stats[0]))) < len(pickle.dumps(stats[0].tables)) / 4


def test_one_merged_row_of_many_parts_is_the_engine_plain_sum(merge_path):
    """Every part in one cell: the engine sums a group of one by numpy's plain (pairwise) sum,
    which from eight rows on rounds otherwise than adding row by row; the merge does the same."""
    config = MetricConfig(length_edges=(1000,), turn_edges=(1000,))
    stats = [compute_stats(no_turns(s, 1), config) for s in range(12)]
    assert len(merge(stats)["tokens"]) == 1
    assert_same(merge_packed([pack(s) for s in stats]), merge(stats))


def test_shards_of_frames_and_packed_shards_merge_alike():
    stats = parts()
    frames = [Shard(3, s.tables, s.dims, {}, r, None, s.params) for r, s in enumerate(stats)]
    packed = [f._replace(tables=pack(s)) for f, s in zip(frames, stats)]
    assert_same(merge_parts(frames, 0, step=3)[0], merge(stats))
    assert_same(merge_parts(packed, 0, step=3)[0], merge(stats))


def test_narrowed_integers_keep_their_values():
    for values in (np.array([0, 127]), np.array([-129, 5]), np.array([2**40, -3]), np.array([], dtype=np.int64)):
        out = narrow(values)
        assert out.itemsize <= values.itemsize and np.array_equal(out.astype(np.int64), values)
    assert narrow(np.array([0, 127])).dtype == np.int8 and narrow(np.array([2**40])).dtype == np.int64


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k", [0, 1, 4, 50])
def test_top_exemplars_are_merge_exemplars(k, packed):
    """``packed``: the sets as ranks send them (columns, pickled), else as frames."""
    config = MetricConfig(length_edges=(4, 8, 16), turn_edges=(1, 2))
    sets = []
    for r, seed in enumerate((1, 2, 3, 4)):
        tails = tail_exemplars(make_batch(seed, 6 + seed), 5, config)
        frames = tails.frames() if hasattr(tails, "frames") else tails
        sets.append({name: df.assign(rank=r) for name, df in frames.items()})
    # ties across ranks keep rank order, as the stable sort does; a NaN rank sorts last
    tied = {name: df.copy() for name, df in sets[0].items()}
    sets.append(tied)
    sets[1] = dict(sets[1], exemplar_tokens=sets[1]["exemplar_tokens"].assign(abs_log_ratio=np.nan))
    sets.append({})
    want = merge_exemplars(sets, k)
    got = top_exemplars([pickle.loads(pickle.dumps(pack_exemplars(e))) for e in sets] if packed else sets, k)
    for name in EXEMPLAR_TABLES:
        pd.testing.assert_frame_equal(got[name], want[name], check_exact=True, obj=name)


def test_exemplars_of_ranks_with_other_labels_merge_as_frames_do():
    """A rank with an extra label dimension sends other columns: the merge is merge_exemplars's."""
    config = MetricConfig(length_edges=(4, 8, 16), turn_edges=(1, 2))
    sets, raw = [], []
    for r, seed in enumerate((1, 2, 3)):
        tails = tail_exemplars(make_batch(seed, 8), 4, config)
        frames = tails.frames() if hasattr(tails, "frames") else tails
        if r == 1:                # a label outside the standard dimensions, on this rank only
            frames = {name: df.assign(region=pd.array(["eu"] * len(df), dtype="string"))
                      for name, df in frames.items()}
        raw.append(frames)
        sets.append({name: df.assign(rank=r) for name, df in frames.items()})
    assert set(sets[1]["exemplar_tokens"].columns) != set(sets[0]["exemplar_tokens"].columns)
    # packed as the reducer packs them: the rank column added on packing
    shards = [pickle.loads(pickle.dumps(pack_exemplars(f, rank=r))) for r, f in enumerate(raw)]
    want = merge_exemplars(sets, 6)
    got = top_exemplars(shards, 6)
    for name in EXEMPLAR_TABLES:
        pd.testing.assert_frame_equal(got[name], want[name], check_exact=True, obj=name)
