"""The in-process evaluator against a brute-force reference, and its event contract.

The reference is written differently from the evaluator: it computes each condition over the
whole history at once (numpy slices of full arrays, ``np.median``/``np.quantile``), then finds
firings as maximal runs of consecutive true steps. Runtime: about 5 s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, strategies as st

from mismatch_monitor.alerts import (AlertEvaluator, AlertRule, Compare, DEFAULT_RULES, GrowthOverBaseline,
                                     MeanAwayFromZero, OutlierAmongPools, ResyncPolicy, prom_quantile)

POOLS = ("a", "b", "c")
KEY = "mismatch/k3_kl"


def rule(condition, for_steps=0, resync=False, name="TestAlert", scope="pool") -> AlertRule:
    return AlertRule(name=name, condition=condition, severity="warning", summary="{pool} at {value}",
                     description="{pool} crossed {threshold}", runbook="look at {pool}", fix="resync",
                     resync=resync, for_steps=for_steps, scope=scope)


def history(values: dict[str, np.ndarray], key: str = KEY, drop_nan_rows: bool = False) -> pd.DataFrame:
    rows = []
    n = len(next(iter(values.values())))
    for step in range(n):
        for pool, v in values.items():
            if drop_nan_rows and np.isnan(v[step]):
                continue
            rows.append({"step": step, "wall_time": 1000.0 + step, "pool": pool, key: v[step]})
    return pd.DataFrame(rows, columns=["step", "wall_time", "pool", key])


def runs_to_events(holds: np.ndarray, for_steps: int) -> list[tuple[str, int]]:
    """Firing/resolution steps from a boolean condition per step (maximal runs of True)."""
    events = []
    t, n = 0, len(holds)
    while t < n:
        if not holds[t]:
            t += 1
            continue
        end = t
        while end + 1 < n and holds[end + 1]:
            end += 1
        if end - t >= for_steps:
            events.append(("firing", t + for_steps))
            if end + 1 < n:
                events.append(("resolved", end + 1))
        t = end + 1
    return events


def reference_growth(x: np.ndarray, factor: float, window: int, min_points: int, floor: float) -> np.ndarray:
    holds = np.zeros(len(x), dtype=bool)
    for t in range(len(x)):
        prior = x[max(0, t - window):t]
        prior = prior[~np.isnan(prior)]
        if len(prior) < min_points or np.isnan(x[t]):
            continue
        base = np.median(prior)
        holds[t] = x[t] > floor and (x[t] > factor * base if base > 0 else x[t] > 0)
    return holds


def events_by_pool(events) -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = {}
    for e in events:
        out.setdefault(e.pool, []).append((e.state, e.step))
    return out


series = st.lists(st.one_of(st.floats(0.0, 10.0), st.just(math.nan)), min_size=5, max_size=40)


@given(st.lists(series, min_size=3, max_size=3), st.floats(0.5, 8.0), st.integers(0, 3), st.booleans())
def test_threshold_matches_reference(columns, threshold, for_steps, drop):
    n = min(len(c) for c in columns)
    values = {p: np.array(c[:n]) for p, c in zip(POOLS, columns)}
    r = rule(Compare(KEY, ">", threshold), for_steps=for_steps)
    _, events = AlertEvaluator.replay(history(values, drop_nan_rows=drop), rules=(r,), steps=range(n))
    got = events_by_pool(events)
    for pool, x in values.items():
        with np.errstate(invalid="ignore"):
            expected = runs_to_events(np.nan_to_num(x, nan=-np.inf) > threshold, for_steps)
        assert got.get(pool, []) == expected, pool


@given(st.lists(series, min_size=3, max_size=3), st.floats(1.1, 4.0), st.integers(1, 12),
       st.integers(1, 12), st.integers(0, 2), st.booleans())
def test_growth_matches_reference(columns, factor, window, min_points, for_steps, drop):
    min_points = min(min_points, window)
    n = min(len(c) for c in columns)
    values = {p: np.array(c[:n]) for p, c in zip(POOLS, columns)}
    floor = 0.5
    r = rule(GrowthOverBaseline(KEY, factor, window, min_points, floor), for_steps=for_steps)
    _, events = AlertEvaluator.replay(history(values, drop_nan_rows=drop), rules=(r,), steps=range(n))
    got = events_by_pool(events)
    for pool, x in values.items():
        expected = runs_to_events(reference_growth(x, factor, window, min_points, floor), for_steps)
        assert got.get(pool, []) == expected, pool


@given(st.lists(series, min_size=4, max_size=4), st.floats(1.5, 5.0), st.integers(2, 4))
def test_outlier_matches_reference(columns, factor, min_pools):
    n = min(len(c) for c in columns)
    pools = ("a", "b", "c", "d")
    values = {p: np.array(c[:n]) for p, c in zip(pools, columns)}
    r = rule(OutlierAmongPools(KEY, factor, min_pools, floor=0.1))
    _, events = AlertEvaluator.replay(history(values), rules=(r,))
    got = events_by_pool(events)
    matrix = np.stack([values[p] for p in pools], axis=1)     # [steps, pools]
    for j, pool in enumerate(pools):
        holds = np.zeros(n, dtype=bool)
        for t in range(n):
            row = matrix[t][~np.isnan(matrix[t])]
            if len(row) >= min_pools and not np.isnan(matrix[t, j]):
                med = np.median(row)
                holds[t] = matrix[t, j] > 0.1 and matrix[t, j] > factor * med
        assert got.get(pool, []) == runs_to_events(holds, 0), pool


def test_drift_needs_the_bias_for_the_whole_window():
    mean = np.array([0.0] * 3 + [-0.01] * 6 + [0.0001] * 3)
    se = np.full(len(mean), 0.001)
    frame = history({"p": mean}, key="mismatch/log_ratio/mean")
    frame["mismatch/log_ratio/std_error"] = se[frame["step"]]
    r = rule(MeanAwayFromZero("mismatch/log_ratio/mean", "mismatch/log_ratio/std_error", 4.0, 1e-3), for_steps=4)
    _, events = AlertEvaluator.replay(frame, rules=(r,))
    assert [(e.state, e.step, e.since_step) for e in events] == [("firing", 7, 3), ("resolved", 9, 3)]
    assert events[0].value == pytest.approx(10.0)          # |mean| / se
    assert events[0].summary == "p at 10"


def test_prom_quantile_interpolates_like_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 50):
        v = rng.random(n)
        for q in (0.0, 0.25, 0.5, 0.9, 1.0):
            assert prom_quantile(q, v) == pytest.approx(np.quantile(v, q, method="linear"), rel=1e-12)
    assert math.isnan(prom_quantile(0.5, []))


def test_resync_once_per_firing_with_cooldown():
    ess = np.array([0.9, 0.3, 0.3, 0.3, 0.9, 0.3, 0.3, 0.9, 0.9, 0.3, 0.3])
    frame = history({"fp8": ess}, key="mismatch/ess")
    low = rule(Compare("mismatch/ess", "<", 0.5), for_steps=1, resync=True, name="Low")
    also = rule(Compare("mismatch/ess", "<", 0.4), for_steps=1, resync=True, name="AlsoLow")
    _, events = AlertEvaluator.replay(frame, rules=(low, also))
    firing = [(e.alert, e.step, e.resync) for e in events if e.state == "firing"]
    # both rules fire at steps 2, 6 and 10; one resync request per pool and step
    assert firing == [("Low", 2, True), ("AlsoLow", 2, False), ("Low", 6, True), ("AlsoLow", 6, False),
                      ("Low", 10, True), ("AlsoLow", 10, False)]
    assert all(not e.resync for e in events if e.state == "resolved")
    _, cooled = AlertEvaluator.replay(frame, rules=(low,), resync_policy=ResyncPolicy(cooldown_steps=5))
    assert [(e.step, e.resync) for e in cooled if e.state == "firing"] == [(2, True), (6, False), (10, True)]


def test_replay_then_observe_continues_like_one_replay():
    rng = np.random.default_rng(3)
    values = {p: np.where(rng.random(120) < 0.1, np.nan, rng.lognormal(0, 0.6, 120)) for p in POOLS}
    values["b"][70:76] = 30.0
    full = history(values)
    _, expected = AlertEvaluator.replay(full, rules=DEFAULT_RULES[:2] + (
        rule(GrowthOverBaseline(KEY, 2.0, 20, 5, 0.0), for_steps=1),))
    assert expected, "the history should fire something"
    evaluator, first = AlertEvaluator.replay(full[full["step"] < 73], rules=DEFAULT_RULES[:2] + (
        rule(GrowthOverBaseline(KEY, 2.0, 20, 5, 0.0), for_steps=1),))
    rest = []
    for step, frame in full[full["step"] >= 73].groupby("step"):
        rest += evaluator.observe(step, 0.0, frame)
    key = lambda e: (e.step, e.alert, e.pool, e.state, e.value)  # noqa: E731
    assert [key(e) for e in first + rest] == [key(e) for e in expected]


def test_restart_rewinds_the_steps_logged_again():
    r = rule(GrowthOverBaseline(KEY, 2.0, 5, 5, 0.0))
    ev = AlertEvaluator((r,))
    for step in range(6):
        ev.observe(step, 0.0, pd.DataFrame({"pool": ["a"], KEY: [1.0]}))
    # a restart logs steps 4 and 5 again: the baseline must not count them twice
    for step in (4, 5):
        ev.observe(step, 0.0, pd.DataFrame({"pool": ["a"], KEY: [1.0]}))
    assert ev._history.prior(KEY, "pool", ["a"], 6, 5)[0].tolist() == [1.0] * 5


def test_missing_pool_and_nan_resolve_and_never_fire():
    r = rule(Compare(KEY, ">", 1.0))
    ev = AlertEvaluator((r,))
    assert [e.state for e in ev.observe(0, 0.0, pd.DataFrame({"pool": ["a"], KEY: [2.0]}))] == ["firing"]
    assert [e.state for e in ev.observe(1, 0.0, pd.DataFrame({"pool": ["b"], KEY: [0.5]}))] == ["resolved"]
    assert ev.observe(2, 0.0, pd.DataFrame({"pool": ["a"], KEY: [math.nan]})) == []
    assert ev.observe(3, 0.0, pd.DataFrame({"pool": [None], KEY: [3.0]}))[0].pool == "%null"   # its label text
    assert ev.observe(4, 0.0, pd.DataFrame({"pool": pd.Series([], dtype="string"), KEY: []}))[0].state == "resolved"


def test_fleet_rules_read_the_fleet_frame():
    r = rule(Compare("mismatch/ess", "<", 0.5), scope="fleet")
    ev = AlertEvaluator((r,))
    by_pool = pd.DataFrame({"pool": ["a"], "mismatch/ess": [0.1]})
    assert ev.observe(0, 0.0, by_pool) == []           # no fleet frame: no observation
    events = ev.observe(1, 0.0, by_pool, fleet=pd.DataFrame({"mismatch/ess": [0.2]}))
    assert [(e.pool, e.state) for e in events] == [(None, "firing")]
    assert "the fleet" in events[0].summary


def test_events_are_flat_parquet_rows(tmp_path):
    ess = np.array([0.9, 0.2, 0.2, 0.9])
    _, events = AlertEvaluator.replay(history({"fp8": ess}, key="mismatch/ess"))
    assert [(e.alert, e.state, e.step) for e in events] == [("MismatchLowESS", "firing", 2),
                                                            ("MismatchLowESS", "resolved", 3)]
    rows = [e.to_row() for e in events]
    assert all(isinstance(v, (str, int, float, bool, type(None))) for row in rows for v in row.values())
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "alerts.parquet")
    back = pq.read_table(tmp_path / "alerts.parquet").to_pylist()
    assert back == rows
    assert rows[0]["resync"] is True and rows[0]["fix"] == "resync" and rows[0]["wall_time"] == 1002.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="lower"), "expected a CamelCase alert name"),
    (dict(severity="page"), "expected severity in"),
    (dict(fix="pray"), "expected fix in"),
    (dict(for_steps=-1), "expected integer for_steps >= 0"),
    (dict(summary="{pool} {oops}"), "expected placeholders among"),
    (dict(condition=OutlierAmongPools(KEY, 3.0, 3, 0.0), scope="fleet"), "expected scope 'pool'"),
])
def test_rule_validation_says_what_was_expected(kwargs, message):
    base = dict(name="Ok", condition=Compare(KEY, ">", 1.0), severity="warning", summary="s",
                description="d", runbook="r", fix="resync")
    with pytest.raises(ValueError, match=message):
        AlertRule(**{**base, **kwargs})


def test_condition_validation_and_unique_names():
    with pytest.raises(ValueError, match="expected a metric key"):
        Compare("mismatch/nope", ">", 1.0)
    with pytest.raises(ValueError, match="min_points <= window_steps"):
        GrowthOverBaseline(KEY, 2.0, 5, 6, 0.0)
    with pytest.raises(ValueError, match="clear_at on the healthy side of 1.0"):
        Compare(KEY, ">", 1.0, clear_at=2.0)
    with pytest.raises(ValueError, match="expected a metric key"):
        Compare(KEY, ">", 1.0, unless="mismatch/nope")
    with pytest.raises(ValueError, match="unique alert names"):
        AlertEvaluator((DEFAULT_RULES[0], DEFAULT_RULES[0]))
