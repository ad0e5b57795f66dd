"""Metrics are declarations: each names fields that exist, thresholds that are config options, and
the consumers (counters, rate rules, titles, views) are generated from them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from alerts.render import rate_rules
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, merge
from mismatch_monitor.engine.fields import TABLES
from mismatch_monitor.formulas import Ratio, Value, Variance, evaluate
from mismatch_monitor.metric_defs import METRICS, VIEW_METRICS, Metric, counter_defs, counter_ratios
from mismatch_monitor.metrics import report, title_of
from reference import make_case

CONFIG = MetricConfig(chunk_tokens=1024)
NEW = ("mismatch/rho/mean", "mismatch/seq/log_ratio/variance", "mismatch/exact_agreement",
       "mismatch/ppo_clip_fraction", "mismatch/abs_prob_diff/mean", "mismatch/abs_prob_diff/max",
       "mismatch/prob_pearson_corr")


@pytest.mark.parametrize("metric", METRICS + VIEW_METRICS, ids=lambda m: m.key)
def test_every_declaration_reads_fields_of_its_table_and_names_config_options(metric):
    names = {f.name for f in TABLES[metric.table][1]} | ({"n_routed_tokens"} if metric.table == "routing_layers" else set())
    assert set(metric.formula.fields()) <= names, metric
    options = {f.name for f in dataclasses.fields(MetricConfig)}
    assert set(metric.thresholds) <= options, metric
    config = MetricConfig(tis_cap=3.5, icepop_band=(0.25, 4.0))
    title = title_of(metric.key, config) if metric in METRICS else metric.title_under(config)
    assert title and "{" not in title


def test_titles_carry_the_runs_thresholds():
    config = MetricConfig(tis_cap=3.5, icepop_band=(0.25, 4.0))
    assert "3.5" in title_of("mismatch/clip_high_fraction", config)
    assert "[0.25, 4]" in title_of("mismatch/icepop_masked_fraction", config)
    assert "ε = 0.35" in title_of("mismatch/ppo_clip_fraction", MetricConfig(ppo_clip_eps=0.35))


def test_a_new_counter_declaration_gets_a_counter_and_rate_rules():
    extra = Metric("mismatch/nonfinite_fraction", "tokens", "share", "non-finite share", "tokens set aside",
                   Ratio("n_nonfinite", "n_positive_logprob"), counters=True)
    defs = {c.field: c for c in counter_defs(METRICS + (extra,))}
    assert defs["n_positive_logprob"].name == "mismatch_positive_logprob_tokens"   # derived name
    assert defs["n_tokens"].name == "mismatch_tokens"                               # kept name
    assert ("n_nonfinite", extra) in counter_ratios(METRICS + (extra,))
    # every counter-exported ratio is recorded at every level, numerator over denominator
    records = {r["record"]: r["expr"] for r in rate_rules("5m")}
    for num, metric in counter_ratios():
        name = {c.field: c.name for c in counter_defs()}[num]
        expr = records[f"fleet:{name}:ratio_rate5m"]
        den = {c.field: c.name for c in counter_defs()}[metric.formula.den]
        assert expr == f"sum (rate({name}_total[5m])) / sum (rate({den}_total[5m]))"


def test_interpreter_against_plain_float64():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 50))
    cols = {"s": x.sum(1), "s2": (x * x).sum(1), "n": np.full(4, 50.0), "zero": np.zeros(4)}
    np.testing.assert_allclose(evaluate(Variance("s", "s2", "n"), cols), x.var(1, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(evaluate(Ratio("s", "n", scale=-1.0, offset=2.0), cols), 2.0 - x.mean(1))
    assert np.isnan(evaluate(Ratio("s", "zero"), cols)).all()            # empty: null, never 0
    assert np.isnan(evaluate(Variance("s", "s2", "zero"), cols)).all()
    np.testing.assert_array_equal(evaluate(Value("n"), cols), cols["n"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_new_metrics_obey_the_merge_law_by_length_bucket(seed):
    """Metrics of merged rank statistics equal the metrics of the whole batch, per length bucket."""
    case = make_case(seed, num_sequences=30, max_len=90, equal_fraction=0.1)
    owner = np.random.default_rng(seed).integers(0, 3, case.num_sequences)
    parts = [compute_stats(case.select_sequences(np.nonzero(owner == r)[0]).batch(), CONFIG) for r in range(3)]
    whole = report(compute_stats(case.batch(), CONFIG), ["length_bucket"])
    merged = report(merge(parts), ["length_bucket"])
    for key in NEW:
        np.testing.assert_allclose(merged[key], whole[key], rtol=1e-9, equal_nan=True)
    assert np.isfinite(whole["mismatch/seq/log_ratio/variance"]).any()
    assert (whole["mismatch/exact_agreement"] > 0).all()
