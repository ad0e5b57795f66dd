"""Every metric of ``metrics.METRICS``, as ``report`` derives it from merged engine statistics,
against the float64 reference computed straight from the tokens (tests/reference.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from mismatch_monitor import metrics
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import MismatchStats, compute_stats, merge
from reference import make_case, reference_metrics, sort_table

# every test runs with the compiled loops and with the torch ops (see conftest.py)
pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig()
QUANTILE_KEYS = {f"mismatch/abs_log_ratio/{q}" for q in ("p50", "p90", "p99", "p999")}
GROUPINGS = [[], ["pool"], ["pool", "length_bucket"], ["pool", "hardware", "turn_bucket"], ["task", "precision"]]


def assert_report_matches(case, config: MetricConfig, by: list[str], got=None) -> None:
    if got is None:
        got = metrics.report(compute_stats(case.batch(), config), by=by, config=config)
    got = sort_table(got, by)
    want = sort_table(reference_metrics(case, config, by), by)
    assert set(want.columns) - set(by) == {m.key for m in metrics.METRICS}, "reference misses a metric"
    assert len(got) == len(want), (by, len(got), len(want))
    for k in by:
        assert got[k].astype("object").where(got[k].notna(), None).tolist() == \
            want[k].astype("object").where(want[k].notna(), None).tolist()
    for m in metrics.METRICS:
        a = got[m.key].to_numpy(np.float64)
        b = want[m.key].to_numpy(np.float64)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{by} {m.key}: null where the reference is not")
        ok = ~np.isnan(b)
        if m.key in QUANTILE_KEYS:
            # nearest-rank order statistic within alpha (relative); tiny values read as 0
            tol = config.hist_relative_accuracy * np.maximum(b[ok], config.hist_min) * (1 + 1e-12)
            assert np.all(np.abs(a[ok] - b[ok]) <= tol), (by, m.key, a[ok], b[ok])
        else:
            np.testing.assert_allclose(a[ok], b[ok], rtol=1e-9, atol=1e-12, err_msg=f"{by} {m.key}")


@pytest.mark.parametrize("by", GROUPINGS, ids=lambda b: "+".join(b) or "all")
def test_report_matches_reference_on_heavy_tails(by):
    case = make_case(31, num_sequences=70, tail_fraction=0.02, bad_fraction=0.002, equal_fraction=0.03)
    assert_report_matches(case, CONFIG, by)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_report_matches_reference_in_low_precision(dtype):
    case = make_case(32, num_sequences=40, dtype=dtype, tail_fraction=3e-3)
    assert_report_matches(case, CONFIG, ["pool"])


def test_report_with_other_thresholds_and_without_optional_inputs():
    config = MetricConfig(tis_cap=3.0, icepop_band=(0.5, 2.0), seq_mult_error_threshold=1.002,
                          neg_adv_delta=0.0)
    case = make_case(33, turns=False, routing=None, support=False, kept=False, staleness=False,
                     advantages=False, base_scale=3e-3, tail_fraction=1e-2)
    assert_report_matches(case, config, ["pool"])
    assert_report_matches(case, config, [])


def test_empty_batch_has_no_observation():
    case = make_case(34, num_sequences=3, empty_sequences=3)
    stats = compute_stats(case.batch("padded"))
    assert stats.is_empty
    for by in ([], ["pool"]):
        report = metrics.report(stats, by=by)
        # no row, or a row of nulls: never a 0.0 that reads as "no mismatch"
        values = report[[m.key for m in metrics.METRICS]].to_numpy(np.float64)
        assert values.size == 0 or np.isnan(values).all()


def test_a_slice_of_only_invalid_tokens_reports_null_metrics_and_counts_them():
    case = make_case(35, num_sequences=12, bad_fraction=0.0)
    t = case.trainer.copy()
    pool = np.asarray(case.labels["pool"])[case.seq]
    target = pool[0]
    t[pool == target] = np.nan
    bad = replace(case, trainer=t)
    report = metrics.report(compute_stats(bad.batch()), by=["pool"]).set_index("pool")
    row = report.loc[target]
    assert row["mismatch/data_quality/nonfinite_tokens"] == (pool == target).sum()
    assert row["mismatch/n_tokens"] == 0
    for key in ("mismatch/k3_kl", "mismatch/ess", "mismatch/abs_log_ratio/p99", "mismatch/seq/n_sequences",
                "mismatch/seq/product_mask_fraction"):
        assert np.isnan(row[key]), key
    # the other pools are untouched by the NaNs
    others = report.drop(index=target)
    assert others["mismatch/k3_kl"].notna().all()


def _by_label_frames(stats, config=CONFIG):
    by_pool, fleet = metrics.report_by_label(stats, "pool", config)
    return by_pool.to_frame(), fleet.to_frame()


@pytest.mark.parametrize("seed", [36, 37])
def test_the_collectors_per_pool_report_matches_the_reference_and_the_general_report(seed):
    """``report_by_label`` (the collector's every-step path) is the same metrics as ``report``,
    on engine output and on merged stats (no cached arrays), with a null pool label too."""
    case = make_case(seed, num_sequences=50, tail_fraction=0.02, bad_fraction=0.004)
    pools = list(case.labels["pool"])
    pools[3] = None                                # a sequence without a pool label
    case = replace(case, labels={**case.labels, "pool": pools})
    stats = compute_stats(case.batch(), CONFIG)
    halves = merge([stats, MismatchStats.empty()])
    for source in (stats, halves):
        by_pool, fleet = _by_label_frames(source)
        assert_report_matches(case, CONFIG, ["pool"], got=by_pool)
        assert_report_matches(case, CONFIG, [], got=fleet)
        want = metrics.report(source, ["pool"], CONFIG)
        assert by_pool["pool"].astype(object).where(by_pool["pool"].notna(), None).tolist() == \
            want["pool"].astype(object).where(want["pool"].notna(), None).tolist()


def test_the_per_pool_report_of_a_pool_of_only_invalid_tokens_is_null():
    case = make_case(38, num_sequences=12, bad_fraction=0.0)
    t = case.trainer.copy()
    pool = np.asarray(case.labels["pool"])[case.seq]
    t[pool == pool[0]] = np.nan
    stats = compute_stats(replace(case, trainer=t).batch())
    by_pool, fleet = _by_label_frames(stats)
    want = metrics.report(stats, ["pool"])
    np.testing.assert_allclose(by_pool.drop(columns="pool").to_numpy(np.float64),
                               want.drop(columns="pool").to_numpy(np.float64), rtol=1e-12, equal_nan=True)
    row = by_pool.set_index("pool").loc[pool[0]]
    assert np.isnan(row["mismatch/seq/n_sequences"]) and np.isnan(row["mismatch/k3_kl"])
    empty_pool, empty_fleet = metrics.report_by_label(MismatchStats.empty(), "pool")
    assert len(empty_pool) == 0 and len(empty_fleet) == 0


def test_one_pools_overflowing_sum_stays_in_that_pool():
    """A single valid but extreme token (log-prob -800: exp|lr| overflows to inf) makes its own
    pool's sums infinite; every other pool and the fleet's finite metrics must be untouched."""
    case = make_case(39, num_sequences=15, bad_fraction=0.0)
    t = case.trainer.copy()
    pool = np.asarray(case.labels["pool"])[case.seq]
    t[np.flatnonzero(pool == pool[0])[0]] = -800.0
    stats = compute_stats(replace(case, trainer=t).batch())
    by_pool, fleet = _by_label_frames(stats)
    want = metrics.report(stats, ["pool"])
    np.testing.assert_array_equal(by_pool.drop(columns="pool").to_numpy(np.float64),
                                  want.drop(columns="pool").to_numpy(np.float64))
    mult = by_pool.set_index("pool")["mismatch/mult_prob_error"]
    assert np.isinf(mult[pool[0]]) and np.isfinite(mult.drop(index=pool[0])).all()
    np.testing.assert_allclose(fleet.to_numpy(np.float64), metrics.report(stats).to_numpy(np.float64),
                               rtol=1e-12, equal_nan=True)


def test_the_per_label_report_refuses_a_dimension_it_does_not_have():
    stats = compute_stats(make_case(40, num_sequences=6).batch())
    with pytest.raises(ValueError, match="turn_bucket"):
        metrics.report_by_label(stats, "turn_bucket")
