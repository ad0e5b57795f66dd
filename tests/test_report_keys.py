"""Flat report keys and label texts name one slice each, for any label value; the label limit
merges the pools beyond it exactly. References are numpy over the log-probs the batch was
built from. Runtime: a few seconds.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.label_limits import LabelLimit
from mismatch_monitor.metrics import METRICS, report_by_label
from mismatch_monitor.report_keys import (MERGED_KEY, OTHER_TEXT, CardinalityWarning, flatten_report, label_text,
                                          parse_label_text, parse_report_key, report_key)

# any code point, lone surrogates and controls included
labels = st.none() | st.text(st.characters(exclude_categories=())) | st.sampled_from(
    ["", "/", "=", "unknown", "%null", "%empty", "%other", "%2F", "a/seq", "pool=a", "Grüße", "\n", "%", "%%",
     "池", "\ud800", "%ED%A0%80"])


@given(labels, labels)
@example(None, "unknown")
@example("", None)
@example("a/b", "a%2Fb")
@example("%null", None)
def test_label_texts_are_injective_never_empty_and_invertible(a, b):
    ta, tb = label_text(a), label_text(b)
    assert (ta == tb) == (a == b)
    assert ta and "/" not in ta and ta != OTHER_TEXT
    assert parse_label_text(ta) == a


@given(labels, st.sampled_from([m.key for m in METRICS]), labels, st.sampled_from([m.key for m in METRICS]))
@example("a", "mismatch/seq/log_ratio/mean", "a/seq", "mismatch/log_ratio/mean")
def test_report_keys_are_injective_over_pool_and_metric(pool_a, key_a, pool_b, key_b):
    ka, kb = report_key(key_a, label_text(pool_a)), report_key(key_b, label_text(pool_b))
    assert (ka == kb) == ((pool_a, key_a) == (pool_b, key_b))
    assert parse_report_key(ka) == (label_text(pool_a), key_a)
    assert parse_report_key(key_a) == (None, key_a)          # the whole step's key never looks pooled
    assert report_key(key_a) != ka


def test_the_other_marker_is_not_a_label_value():
    with pytest.raises(ValueError, match="merged remainder"):
        parse_label_text(OTHER_TEXT)
    for bad in ("a/b", "%2f", "%zz", "%41"):   # lowercase hex, not an escape, an escape of "A"
        with pytest.raises(ValueError):
            parse_label_text(bad)


def make_batch(pools: list, tokens: list[int], seed: int = 0):
    """One sequence per entry: pool label, token count; returns (batch, lr per sequence)."""
    rng = np.random.default_rng(seed)
    T = max(tokens)
    mu = -rng.uniform(8.0, 12.0, size=(len(pools), T))   # far below 0: no token set aside
    lr = rng.normal(0.0, 0.1, size=(len(pools), T)) * (1 + np.arange(len(pools)))[:, None]
    mask = np.arange(T)[None, :] < np.array(tokens)[:, None]
    batch = TokenBatch.from_padded(torch.from_numpy(mu + lr), torch.from_numpy(mu), torch.from_numpy(mask),
                                   labels={"pool": pools})
    return batch, [lr[i, :n] for i, n in enumerate(tokens)]


def k3(x: np.ndarray) -> float:
    return float(np.mean(np.expm1(x) - x))


def test_collector_report_keeps_pools_that_used_to_share_keys(tmp_path):
    pools = [None, "unknown", "a", "a/seq", "", "="]
    batch, lrs = make_batch(pools, [40, 60, 30, 50, 20, 25])
    with MismatchCollector(tmp_path / "run", alert_evaluator=None) as mc:
        report = mc.log_step(0, batch)
    for pool, x in zip(pools, lrs):
        text = label_text(pool)
        assert report[report_key("mismatch/n_tokens", text)] == x.size, pool
        assert report[report_key("mismatch/k3_kl", text)] == pytest.approx(k3(x), rel=1e-9), pool
        assert report[report_key("mismatch/seq/log_ratio/mean", text)] == pytest.approx(x.sum(), rel=1e-9), pool
    assert report["mismatch/k3_kl"] == pytest.approx(k3(np.concatenate(lrs)), rel=1e-9)
    assert report["mismatch/pool=a/k3_kl"] == pytest.approx(k3(lrs[2]), rel=1e-9)   # the common case reads as is
    assert MERGED_KEY not in report
    per_pool = {parse_report_key(k)[0] for k in report if k != "mismatch/collector_errors"} - {None}
    assert per_pool == {label_text(p) for p in pools}


def test_pools_beyond_the_limit_are_merged_exactly_into_other():
    pools = [f"p{i}" for i in range(6)] + [None]
    tokens = [10, 70, 30, 50, 20, 60, 40]
    batch, lrs = make_batch(pools, tokens, seed=3)
    config = MetricConfig()
    stats = compute_stats(batch, config)
    by_pool, fleet = report_by_label(stats, "pool", config)
    with pytest.warns(CardinalityWarning, match="merged into pool=%other"):
        report = flatten_report(fleet, by_pool, stats, config=config, limit=LabelLimit(3))
    kept = {"p1", "p5", "p3"}                              # the three with the most tokens
    assert {parse_report_key(k)[0] for k in report} - {None} == {label_text(p) for p in kept} | {OTHER_TEXT}
    assert report[MERGED_KEY] == 4
    rest = np.concatenate([x for p, x in zip(pools, lrs) if p not in kept])
    other = lambda key: report[report_key(key, OTHER_TEXT)]  # noqa: E731
    assert other("mismatch/n_tokens") == rest.size
    assert other("mismatch/k3_kl") == pytest.approx(k3(rest), rel=1e-9)
    assert other("mismatch/abs_log_ratio/max") == pytest.approx(np.abs(rest).max(), rel=1e-12)
    assert other("mismatch/log_ratio/min") == pytest.approx(rest.min(), rel=1e-12)
    assert other("mismatch/seq/n_sequences") == 4
    nearest_rank = np.sort(np.abs(rest))[math.ceil(0.99 * rest.size) - 1]
    assert other("mismatch/abs_log_ratio/p99") == pytest.approx(nearest_rank, rel=config.hist_relative_accuracy)
    for p, x in zip(pools, lrs):
        if p in kept:
            assert report[report_key("mismatch/k3_kl", p)] == pytest.approx(k3(x), rel=1e-9)
    assert report["mismatch/n_tokens"] == sum(tokens)      # the whole step is untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        within = flatten_report(fleet, by_pool, stats, config=config, limit=LabelLimit(7))
    assert MERGED_KEY not in within and len({parse_report_key(k)[0] for k in within}) == 8


def test_label_limit_is_validated():
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="expected LabelLimit.max_values to be an integer >= 1"):
            LabelLimit(bad)


def test_alert_events_name_a_null_pool_apart_from_a_pool_called_unknown():
    pools = [None, "unknown"]
    batch, _ = make_batch(pools, [30, 30])
    by_pool, fleet = report_by_label(compute_stats(batch), "pool")
    from mismatch_monitor.alerts import Compare, AlertRule
    rule = AlertRule(name="AnyTokens", condition=Compare("mismatch/n_tokens", ">", 0.0), scope="pool",
                     for_steps=0, severity="warning", summary="{pool}", description="d", runbook="r", fix="resync")
    events = AlertEvaluator((rule,)).observe(0, 0.0, by_pool, fleet=fleet)
    assert sorted(e.pool for e in events) == sorted(label_text(p) for p in pools)


def test_the_collector_report_takes_its_label_limit(tmp_path):
    pools = ["a", "b", "c", None]
    batch, lrs = make_batch(pools, [40, 30, 20, 10])
    with MismatchCollector(tmp_path / "run", alert_evaluator=None, label_limit=LabelLimit(2)) as mc:
        with pytest.warns(CardinalityWarning):
            report = mc.log_step(0, batch)
    assert {parse_report_key(k)[0] for k in report if k.startswith("mismatch/pool=")} == {"a", "b", OTHER_TEXT}
    rest = np.concatenate(lrs[2:])
    assert report[report_key("mismatch/k3_kl", OTHER_TEXT)] == pytest.approx(k3(rest), rel=1e-9)
    assert report[MERGED_KEY] == 2
    from mismatch_monitor import query

    stored = query.aggregate(query.connect(), tmp_path / "run", "tokens", ["pool"], steps=(0, 0), per_step=False)
    by_pool = {None if pd.isna(p) else p: n for p, n in zip(stored["pool"], stored["n_tokens"])}
    assert by_pool == {"a": 40, "b": 30, "c": 20, None: 10}      # the store keeps every pool


def test_alert_markers_sit_on_the_line_of_the_pool_they_name():
    from mismatch_monitor.app import timeline

    series = pd.DataFrame({"step": [0, 0, 0], "pool": pd.array([None, "a/b", "c"], dtype="string"),
                           "mismatch/ess": [0.1, 0.2, 0.3]})
    events = pd.DataFrame({"step": [0, 0, 0], "pool": [label_text(None), label_text("a/b"), None],
                           "value": [9.0, 9.0, 0.7]})
    placed = timeline.event_positions(series, events, "mismatch/ess", first=0, width=1)
    # the null pool's and a/b's events on their lines; a fleet-wide one (pool None) at its own value
    assert placed["y"].tolist() == [0.1, 0.2, 0.7]
