"""Statistics carry the config parameters their meaning depends on: read without a config they
use their own, read or merged under other parameters they refuse with both values named, and
a run store keeps only statistics of its run's config (which its readers take from run.json)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mismatch_monitor import metrics, query
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.engine.histogram import QUANTILES
from mismatch_monitor.store.writer import RunWriter
from reference import make_case, reference_metrics

ALPHA = 0.05
COARSE = MetricConfig(hist_relative_accuracy=ALPHA)
QUANTILE_KEYS = [f"mismatch/abs_log_ratio/{name}" for name, _ in QUANTILES]


def _within_alpha(got: float, want: float) -> bool:
    return abs(got - want) <= ALPHA * abs(want) + 1e-300


def test_stats_read_without_a_config_use_the_one_they_were_computed_with(each_kernel):
    # the defaults' histogram (1%) read over bins of a 5% one put p99 ~30% off, without a word
    case = make_case(11, num_sequences=60, tail_fraction=0.02)
    stats = compute_stats(case.batch("offsets"), COARSE)
    want = reference_metrics(case, COARSE, []).iloc[0]
    got = metrics.report(stats).iloc[0]
    _, fleet = metrics.report_by_label(stats, "pool")
    for key in QUANTILE_KEYS:
        assert _within_alpha(got[key], want[key]), (key, got[key], want[key])
        assert _within_alpha(fleet.values[key][0], want[key]), key
    # and so does a marginal or a merge of them
    again = metrics.report(merge([stats, stats]).marginal(["pool"]), ["pool"]).set_index("pool")
    pools = reference_metrics(case, COARSE, ["pool"]).set_index("pool")
    for key in QUANTILE_KEYS:
        for pool in pools.index:
            assert _within_alpha(again.loc[pool, key], pools.loc[pool, key]), (key, pool)


def test_reading_or_merging_under_other_parameters_is_refused_naming_both_values(each_kernel):
    batch = make_case(12, num_sequences=20).batch("offsets")
    fine, coarse = compute_stats(batch, MetricConfig()), compute_stats(batch, COARSE)
    with pytest.raises(ValueError, match=r"report: .*hist_relative_accuracy: 0\.05 vs 0\.01"):
        metrics.report(coarse, config=MetricConfig())
    with pytest.raises(ValueError, match=r"report_by_label: .*hist_relative_accuracy: 0\.05 vs 0\.01"):
        metrics.report_by_label(coarse, "pool", MetricConfig())
    with pytest.raises(ValueError, match=r"cannot merge .*hist_relative_accuracy: 0\.01 vs 0\.05"):
        merge([fine, coarse])
    capped = compute_stats(batch, MetricConfig(tis_cap=3.0, icepop_band=(0.4, 5.0)))
    with pytest.raises(ValueError, match=r"tis_cap: 2\.0 vs 3\.0; icepop_band: \(0\.5, 5\.0\) vs \(0\.4, 5\.0\)"):
        merge([fine, capped])
    buckets = compute_stats(batch, MetricConfig(turn_edges=(1, 3)))
    with pytest.raises(ValueError, match=r"turn_edges"):
        merge([buckets, fine])
    # how the engine ran is no parameter of what it computed
    other_run = compute_stats(batch, MetricConfig(kernel="torch", chunk_tokens=2048))
    assert merge([fine, other_run]).params == fine.params
    assert len(metrics.report(other_run, config=MetricConfig())) == 1
    # empty statistics (a step without tokens) record them too; ones that record none merge
    nothing = TokenBatch.from_flat(torch.zeros(0), torch.zeros(0), seq_offsets=[0, 0])
    assert compute_stats(nothing, COARSE).params == coarse.params
    assert merge([coarse, type(coarse).empty()]).params == coarse.params


def test_a_run_keeps_only_statistics_of_its_config_and_reads_them_back_under_it(tmp_path, each_kernel):
    case = make_case(13, num_sequences=50, tail_fraction=0.02)
    stats = compute_stats(case.batch("offsets"), COARSE)
    with pytest.raises(ValueError, match=r"RunWriter.append_step: .*hist_relative_accuracy: 0\.05 vs 0\.01"):
        RunWriter(tmp_path / "default", background=False).append_step(0, stats)
    writer = RunWriter(tmp_path / "coarse", config=COARSE, background=False)
    writer.append_step(0, stats)
    writer.close()
    stored = query.metric_series(query.connect(), tmp_path / "coarse", []).iloc[0]
    want = reference_metrics(case, COARSE, []).iloc[0]
    for key in QUANTILE_KEYS:
        assert _within_alpha(stored[key], want[key]), (key, stored[key], want[key])
        assert math.isclose(stored[key], metrics.report(stats).iloc[0][key], rel_tol=1e-12)
    assert np.isclose(stored["mismatch/k3_kl"], want["mismatch/k3_kl"], rtol=1e-9)


def test_the_exporter_refuses_statistics_of_another_config(each_kernel):
    # its histogram buckets are bounds of its own config's bins
    from prometheus_client import CollectorRegistry

    from mismatch_monitor.exporter import MismatchExporter

    stats = compute_stats(make_case(14, num_sequences=10).batch("offsets"), COARSE)
    with pytest.raises(ValueError, match=r"MismatchExporter.observe: .*hist_relative_accuracy: 0\.05 vs 0\.01"):
        MismatchExporter(CollectorRegistry(), MetricConfig()).observe(0, stats)
    MismatchExporter(CollectorRegistry(), COARSE).observe(0, stats)


def test_ranks_computed_under_different_configs_do_not_merge(each_kernel):
    from mismatch_monitor.collectors.distributed import Shard, merge_parts

    batch = make_case(15, num_sequences=10).batch("offsets")
    shards = [Shard(3, s.tables, s.dims, {}, rank, None, s.params)
              for rank, s in enumerate((compute_stats(batch, MetricConfig()), compute_stats(batch, COARSE)))]
    with pytest.raises(ValueError, match=r"cannot merge .*hist_relative_accuracy: 0\.01 vs 0\.05"):
        merge_parts(shards, 0, step=3)
    merged, _, rejected = merge_parts([shards[1], shards[1]._replace(rank=1)], 0, step=3)
    assert merged.params == COARSE.stats_parameters() and not rejected


def test_a_run_continues_only_under_the_parameters_of_its_stored_steps(tmp_path):
    # its readers take every step under run.json's one config: a restart with another
    # histogram accuracy would re-read the stored steps' bins as other numbers
    RunWriter(tmp_path, config=COARSE, background=False).close()
    with pytest.raises(ValueError, match=r"other MetricConfig parameters \(stored vs given: hist_relative_acc"
                                         r"uracy: 0\.05 vs 0\.01\)"):
        RunWriter(tmp_path, background=False)
    # how the engine runs may change
    RunWriter(tmp_path, config=MetricConfig(hist_relative_accuracy=ALPHA, kernel="torch"), background=False).close()
    RunWriter(tmp_path, config=COARSE, background=False).close()
