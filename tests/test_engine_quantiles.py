"""Tails read from the merged |lr| histograms: within hist_relative_accuracy of the exact
nearest-rank order statistic (not of an interpolated quantile), maxima exact."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mismatch_monitor import metrics
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine.histogram import QUANTILES, LogBins, nearest_rank
from reference import Bins, nearest_rank as reference_rank

# every test runs with the compiled loops and with the torch ops (see conftest.py)
pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig()
ALPHA = CONFIG.hist_relative_accuracy
QKEYS = [f"mismatch/abs_log_ratio/{name}" for name, _ in QUANTILES]


def _flat_batch(lr: np.ndarray, pools: np.ndarray, seq: np.ndarray | None = None) -> tuple[TokenBatch, np.ndarray]:
    """Sequences of 50 tokens (or ``seq``), one pool each; log-probs <= -1 so nothing is invalid.
    Returns the batch and the lr it holds (trainer - sampler, rounded as the engine sees it)."""
    n = len(lr)
    seq = np.arange(n) // 50 if seq is None else seq
    B = int(seq[-1]) + 1
    first = np.searchsorted(seq, np.arange(B))
    sampler = -1.0 - np.maximum(lr, 0.0)
    trainer = sampler + lr
    labels = {"pool": [str(p) for p in pools[first]]}
    batch = TokenBatch.from_flat(torch.from_numpy(trainer), torch.from_numpy(sampler),
                                 seq_ids=torch.from_numpy(seq), labels=labels)
    return batch, trainer - sampler


def _check_quantiles(lr: np.ndarray, pools: np.ndarray) -> None:
    batch, lr = _flat_batch(lr, pools)
    report = metrics.report(compute_stats(batch), by=["pool"])
    assert len(report) == len(np.unique(pools))
    for _, row in report.iterrows():
        a = np.sort(np.abs(lr[pools == int(row["pool"])]))
        assert row["mismatch/abs_log_ratio/max"] == a[-1]              # exact
        for key, (_, q) in zip(QKEYS, QUANTILES):
            exact = reference_rank(a, q)
            est = row[key]
            if exact < CONFIG.hist_min:                                  # the zero bin
                assert est == 0.0 or abs(est - exact) <= ALPHA * CONFIG.hist_min
            else:
                assert abs(est - exact) <= ALPHA * exact * (1 + 1e-12), (row["pool"], key, est, exact)


def test_heavy_tailed_slices_read_within_one_percent():
    rng = np.random.default_rng(0)
    n = 120_000
    # six slices with different bulks and tails: the mixture and harder ones
    pools = np.repeat(np.arange(6), n // 6)
    scale = np.array([1e-3, 1e-3, 3e-4, 1e-2, 1e-3, 1e-5])[pools]
    tail = np.array([1e-3, 1e-2, 1e-3, 5e-2, 0.2, 1e-3])[pools]
    lr = rng.normal(0, 1, n) * scale
    is_tail = rng.random(n) < tail
    lr[is_tail] = rng.uniform(1, 5, is_tail.sum()) * rng.choice([-1, 1], is_tail.sum())
    _check_quantiles(lr, pools)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 4000),
       sigma=st.floats(0.1, 6.0), center=st.floats(-18.0, 3.0), tail=st.floats(0.0, 0.3))
def test_any_lognormal_mixture_reads_within_alpha(seed, n, sigma, center, tail):
    rng = np.random.default_rng(seed)
    mag = np.exp(rng.normal(center, sigma, n))
    mag[rng.random(n) < tail] *= 1e3
    lr = np.minimum(mag, 600.0) * rng.choice([-1.0, 1.0], n)       # keep exp(lr) finite
    _check_quantiles(lr, np.zeros(n, dtype=np.int64))


def test_quantiles_of_merged_cells_use_the_merged_histogram():
    """p99 of a pool is the order statistic of all its tokens, not a mean of cell p99s."""
    rng = np.random.default_rng(3)
    lr = np.concatenate([rng.normal(0, 1e-3, 9_000), rng.uniform(2, 3, 100)])
    order = rng.permutation(len(lr))
    seq = np.repeat(np.arange(len(lr)), rng.integers(1, 12, len(lr)))[: len(lr)]   # lengths 1..11
    batch, lr = _flat_batch(lr[order], np.zeros(len(lr), dtype=np.int64), seq)
    stats = compute_stats(batch, MetricConfig(length_edges=(2, 4, 8)))
    assert len(stats["tokens"]) > 1        # several length cells merged into one pool
    got = metrics.report(stats, by=[])["mismatch/abs_log_ratio/p99"].iloc[0]
    exact = reference_rank(np.sort(np.abs(lr)), 0.99)
    assert abs(got - exact) <= ALPHA * exact


def test_every_bin_reads_within_alpha_of_every_value_in_it():
    bins = LogBins.from_config(CONFIG)
    rng = np.random.default_rng(4)
    x = np.exp(rng.uniform(math.log(CONFIG.hist_min), math.log(CONFIG.hist_max), 200_000))
    b = bins.index(torch.from_numpy(x)).numpy()
    rep = bins.representative(b)
    assert np.all(np.abs(rep - x) <= ALPHA * x * (1 + 1e-12))
    # the engine's bin of a value is the reference's (searching a table of powers of gamma)
    np.testing.assert_array_equal(b, Bins(CONFIG).unsigned(x))
    # lower edges are increasing and bracket the values
    edges = bins.lower_edge(b)
    assert np.all(edges < x * (1 + 1e-12))


def test_nearest_rank_is_exact_integer_arithmetic():
    totals = np.array([1, 2, 3, 7, 10, 999, 1000, 1001, 10**6, 10**7 + 1, 2**40 + 3, 123456789012])
    for q in (0.5, 0.9, 0.99, 0.999, 0.25, 1 / 3):
        want = [max(1, math.ceil(Fraction(repr(q)).limit_denominator(10**6) * int(t))) for t in totals]
        assert nearest_rank(q, totals).tolist() == want
    assert nearest_rank(0.5, np.array([0])).tolist() == [1]     # empty groups are masked by callers


def test_empty_and_all_invalid_slices_have_null_tails():
    t = torch.tensor([-1.0, float("nan"), -0.5, -0.2])
    s = torch.tensor([-1.1, -1.0, float("inf"), -0.3])
    batch = TokenBatch.from_flat(t, s, seq_ids=torch.tensor([0, 1, 1, 2]),
                                 labels={"pool": ["a", "b", "c"]})
    report = metrics.report(compute_stats(batch), by=["pool"]).set_index("pool")
    assert report.loc["b", QKEYS + ["mismatch/abs_log_ratio/max"]].isna().all()   # all invalid
    assert report.loc["a", QKEYS].notna().all()
    assert report.loc["b", "mismatch/data_quality/nonfinite_tokens"] == 2


@given(st.integers(1, 40), st.integers(1, 300), st.integers(0, 2**32 - 1))
def test_dense_and_sorted_readings_of_histogram_rows_agree(groups, rows, seed):
    """Few groups read dense per-group histograms, many groups sort the rows: same quantiles."""
    from mismatch_monitor.engine import histogram

    rng = np.random.default_rng(seed)
    bins = LogBins.from_config(CONFIG)
    group = rng.integers(0, groups, rows)
    b = rng.integers(-bins.overflow_bin, bins.overflow_bin + 1, rows)      # signed bins too
    counts = rng.integers(1, 1000, rows)
    exact_max = rng.uniform(0.5, 10.0, groups + 1)                          # one group stays empty
    qs = tuple(q for _, q in QUANTILES)
    dense = histogram.quantiles_from_counts(bins, group, b, counts, qs, exact_max=exact_max)
    saved = histogram._DENSE_MAX
    histogram._DENSE_MAX = -1
    try:
        sorted_ = histogram.quantiles_from_counts(bins, group, b, counts, qs, exact_max=exact_max)
    finally:
        histogram._DENSE_MAX = saved
    np.testing.assert_array_equal(dense, sorted_)
    assert np.isnan(dense[groups]).all()
