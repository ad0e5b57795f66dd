"""The query layer's dashboard views against an independent float64 reference of the logged tokens.

A step bin merges its steps exactly, so a binned metric equals the metric of all the bin's tokens
taken together, computed from scratch by ``tests/reference.py``. Runtime: about 15 s (shared
runs built once, ~10 s, by ``test_app_runs.dashboard_root``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

from mismatch_monitor import query
from mismatch_monitor.app import loaders
from mismatch_monitor.config import MetricConfig
from reference import Case, reference_metrics, token_frame
from test_app_runs import DashboardRoot, dashboard_root

CONFIG = MetricConfig()
EXACT = ("mismatch/n_tokens", "mismatch/k3_kl", "mismatch/abs_log_ratio/mean", "mismatch/abs_log_ratio/max",
         "mismatch/ess", "mismatch/extreme_fraction", "mismatch/routing/flip_rate",
         "mismatch/seq/n_sequences", "mismatch/seq/product_mask_fraction")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DashboardRoot:
    return dashboard_root(str(tmp_path_factory.getbasetemp() / "dashboard"))


@pytest.fixture()
def con():
    c = query.connect()
    yield c
    c.close()


def concat(cases: list[Case]) -> Case:
    """The tokens of several steps as one batch (sequences renumbered)."""
    offsets = np.cumsum([0] + [c.num_sequences for c in cases])

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(c, name) for c in cases]
        return None if parts[0] is None else np.concatenate(parts)
    labels = {k: [v for c in cases for v in c.labels[k]] for k in cases[0].labels}
    return dataclasses.replace(
        cases[0], trainer=cat("trainer"), sampler=cat("sampler"), labels=labels,
        seq=np.concatenate([c.seq + o for c, o in zip(cases, offsets)]), num_sequences=int(offsets[-1]),
        turn=cat("turn"), policy_version=cat("policy_version"), advantages=cat("advantages"),
        trainer_experts=cat("trainer_experts"), sampler_experts=cat("sampler_experts"), support=cat("support"),
        kept=cat("kept"))


def test_a_step_bin_equals_the_metrics_of_all_its_tokens(con, runs: DashboardRoot) -> None:
    width, first = 5, 0
    got = query.metric_series_binned(con, runs.fleet.path, ["pool"], first=first, width=width,
                                     metrics=list(EXACT) + ["mismatch/abs_log_ratio/p99"])
    for start in (10, 20):   # a full bin in the growth phase, and the last, partial, bin
        steps = [s for s in runs.fleet.cases if start <= s < start + width]
        want = reference_metrics(concat([runs.fleet.cases[s] for s in steps]), CONFIG, by=["pool"])
        mine = got[got["step"] == start].set_index("pool")
        assert (mine["step_last"] == max(steps)).all()
        for _, row in want.iterrows():
            for key in EXACT:
                assert mine.loc[row["pool"], key] == pytest.approx(row[key], rel=1e-9, abs=1e-15), key
            p99 = mine.loc[row["pool"], "mismatch/abs_log_ratio/p99"]
            assert abs(p99 - row["mismatch/abs_log_ratio/p99"]) <= CONFIG.hist_relative_accuracy * p99


def test_width_one_is_the_per_step_series(con, runs: DashboardRoot) -> None:
    binned = query.metric_series_binned(con, runs.fleet.path, ["pool"], first=0, width=1)
    plain = query.metric_series(con, runs.fleet.path, ["pool"])
    assert (binned["step"] == binned["step_last"]).all()
    pd.testing.assert_frame_equal(binned.drop(columns="step_last"), plain, check_exact=False, rtol=1e-12)


def test_step_width_fits_the_range_in_the_points(con) -> None:
    assert query.step_width(0, 599, 600) == 1
    assert query.step_width(0, 600, 600) == 2
    assert query.step_width(5, 10_004, 400) == 25
    with pytest.raises(ValueError, match="expected max_points >= 1"):
        query.step_width(0, 10, 0)


def test_low_probability_buckets_match_the_reference(con, runs: DashboardRoot) -> None:
    step = 14
    got = query.lowprob_series(con, runs.fleet.path, first=step, width=1, steps=(step, step))
    frame, _ = token_frame(runs.fleet.cases[step], CONFIG)
    v = frame[frame["valid"]]
    bucket = np.searchsorted(np.asarray(CONFIG.lowprob_edges), np.exp(v["s"].to_numpy()), side="right")
    lr = v["lr"].to_numpy()
    for b in range(len(CONFIG.lowprob_edges) + 1):
        sel = bucket == b
        row = got[got["bucket"] == b].iloc[0]
        assert row["n_tokens"] == sel.sum()
        assert row["mean_abs_lr"] == pytest.approx(np.mean(np.abs(lr[sel])), rel=1e-9)
        assert row["k3_kl"] == pytest.approx(np.mean(np.expm1(lr[sel]) - lr[sel]), rel=1e-9)


def test_routing_layer_flip_rates_match_the_reference(con, runs: DashboardRoot) -> None:
    step = 3
    got = query.routing_layer_series(con, runs.fleet.path, ["pool"], first=step, width=1, steps=(step, step))
    frame, _ = token_frame(runs.fleet.cases[step], CONFIG)
    for (pool, layer), row in got.set_index(["pool", "layer"]).iterrows():
        assert row["flip_rate"] == pytest.approx(frame.loc[frame["pool"] == pool, f"flip_{layer}"].mean(), rel=1e-12)


def test_pool_shares_of_samples_and_of_extreme_tokens(con, runs: DashboardRoot) -> None:
    shares = query.pool_shares(con, runs.fleet.path, steps=(0, 3)).set_index("pool")
    ref = pd.concat([reference_metrics(runs.fleet.cases[s], CONFIG, by=["pool"]) for s in range(4)])
    ref["n_extreme"] = ref["mismatch/extreme_fraction"] * ref["mismatch/n_tokens"]
    total = ref.groupby("pool")[["mismatch/seq/n_sequences", "n_extreme"]].sum()
    want_sample = total["mismatch/seq/n_sequences"] / total["mismatch/seq/n_sequences"].sum()
    want_tail = total["n_extreme"] / total["n_extreme"].sum()
    for pool in total.index:
        assert shares.loc[pool, "sample_share"] == pytest.approx(want_sample[pool], rel=1e-12)
        assert shares.loc[pool, "extreme_share"] == pytest.approx(want_tail[pool], rel=1e-9)
        assert shares.loc[pool, "tail_to_sample"] == pytest.approx(want_tail[pool] / want_sample[pool], rel=1e-9)


def test_pool_shares_are_null_without_observation(con, runs: DashboardRoot) -> None:
    assert query.pool_shares(con, runs.empties["no-observation"]).empty
    shares = query.pool_shares(con, runs.fleet.path, steps=(0, 3))
    assert shares["sample_share"].sum() == pytest.approx(1.0)


def test_crossing_length_is_ln_cap_over_mean_abs_log_ratio() -> None:
    got = query.crossing_length(np.array([0.01, 0.0, np.nan, 0.5]), 2.0)
    assert got[0] == pytest.approx(math.log(2.0) / 0.01)
    assert math.isinf(got[1]) and math.isnan(got[2])
    assert got[3] == pytest.approx(2 * math.log(2.0))


def test_alert_events_and_which_are_firing(con, runs: DashboardRoot) -> None:
    events = query.alert_events(con, runs.fleet.path)
    assert list(zip(events["step"], events["alert"], events["pool"], events["state"])) == [
        (e["step"], e["alert"], e["pool"], e["state"]) for e in sorted(runs.fleet.events, key=lambda e: e["step"])]
    last: dict[tuple[str, str], str] = {}
    for e in runs.fleet.events:
        last[(e["alert"], e["pool"])] = e["state"]
    firing = query.firing_alerts(events)
    assert sorted(zip(firing["alert"], firing["pool"])) == sorted(k for k, v in last.items() if v == "firing")
    empty = query.alert_events(con, runs.empties["empty"])
    assert empty.empty and list(empty.columns) == list(query.ALERT_COLUMNS)
    assert query.firing_alerts(empty).empty


def test_alert_metrics_come_from_the_alert_definitions(con, runs: DashboardRoot) -> None:
    metrics = loaders.alert_metrics(query.alert_events(con, runs.fleet.path))
    assert metrics["MismatchTailGrowth"] == "mismatch/abs_log_ratio/p99"
    assert metrics["MismatchStalenessHigh"] == "mismatch/staleness/max"


def test_compare_runs_per_slice(con, runs: DashboardRoot) -> None:
    metrics = ["mismatch/k3_kl", "mismatch/ess"]
    same = query.compare_runs(con, runs.fleet.path, runs.fleet.path, ["pool"], metrics=metrics)
    # DuckDB sums in parallel, in no fixed order: the same run agrees to rounding
    assert np.allclose(same["a"], same["b"], rtol=1e-12, atol=0) and np.allclose(same["rel"], 0.0, atol=1e-12)
    table = query.compare_runs(con, runs.fleet.path, runs.upgrade.path, ["pool"], metrics=metrics)
    a = query.metric_series(con, runs.fleet.path, ["pool"], metrics=metrics, per_step=False).set_index("pool")
    b = query.metric_series(con, runs.upgrade.path, ["pool"], metrics=metrics, per_step=False).set_index("pool")
    for _, row in table.iterrows():
        assert row["a"] == pytest.approx(a.loc[row["pool"], row["metric"]], rel=1e-12)
        assert row["b"] == pytest.approx(b.loc[row["pool"], row["metric"]], rel=1e-12)
        assert row["rel"] == pytest.approx(row["b"] / row["a"] - 1, rel=1e-9)


def test_distinct_values_and_exemplar_steps(con, runs: DashboardRoot) -> None:
    assert query.distinct_values(con, runs.fleet.path, "sequences", "pool") == ["bf16", "fp8", "int4"]
    assert query.distinct_values(con, runs.empties["half-written"], "sequences", "pool") == []
    with pytest.raises(ValueError, match="cannot group"):
        query.distinct_values(con, runs.fleet.path, "sequences", "n_sequences")
    steps = query.exemplar_steps(con, runs.fleet.path).set_index("step")
    fp8 = query.exemplar_steps(con, runs.fleet.path, pool="fp8").set_index("step")
    for s, case in runs.fleet.cases.items():
        frame, _ = token_frame(case, CONFIG)
        lr = np.abs(frame["lr"].to_numpy(np.float64))
        assert steps.loc[s, "max_abs_log_ratio"] == pytest.approx(np.nanmax(lr), rel=1e-12)
        assert steps.loc[s, "pool"] == frame["pool"].iloc[int(np.nanargmax(lr))]     # the worst token's pool
        in_fp8 = np.where(frame["pool"].to_numpy(object) == "fp8", lr, np.nan)
        assert fp8.loc[s, "max_abs_log_ratio"] == pytest.approx(np.nanmax(in_fp8), rel=1e-12)
        assert fp8.loc[s, "pool"] == "fp8"
    # the pool is a bound value: a quote in it is a pool no token has, not SQL
    assert query.exemplar_steps(con, runs.fleet.path, pool="fp8' OR '1'='1").empty


def test_half_written_runs_show_only_committed_steps(con, runs: DashboardRoot) -> None:
    assert query.steps_index(con, runs.empties["half-written"]).empty
    assert query.metric_series_binned(con, runs.empties["half-written"], first=0, width=1).empty
    tail = query.metric_series_binned(con, runs.empties["half-written-tail"], first=0, width=1)
    assert list(tail["step"]) == list(range(6))   # the orphan files of steps 6-8 stay invisible


def test_a_relogged_step_is_read_from_its_latest_write(tmp_path) -> None:
    """With a step listed twice in the index the reader joins with it; otherwise it reads the
    current files directly. Both give the latest write of every step."""
    from mismatch_monitor.collectors import MismatchCollector
    from test_app_runs import POOLS, fleet_case

    run = tmp_path / "restarted"
    with MismatchCollector(run, pools=POOLS, strict=True, alert_evaluator=None) as mc:
        for step in range(4):
            mc.log_step(step, fleet_case(step, 5, 1.0).batch())
    con = query.connect()
    first = query.metric_series_binned(con, run, first=0, width=1, metrics=list(EXACT))
    assert query._current_sources(con, run, "tokens")[2] is True     # read without the join
    with MismatchCollector(run, pools=POOLS, strict=True, alert_evaluator=None) as mc:   # a restart
        mc.log_step(2, fleet_case(2, 6, 1.5).batch())                                     # re-logs step 2
    assert query._current_sources(con, run, "tokens")[2] is False    # step 2 twice: joined
    again = query.metric_series_binned(con, run, first=0, width=1, metrics=list(EXACT)).set_index("step")
    want = reference_metrics(fleet_case(2, 6, 1.5), CONFIG, by=[]).iloc[0]
    for key in EXACT:
        assert again.loc[2, key] == pytest.approx(want[key], rel=1e-9, abs=1e-15), key
    for step in (0, 1, 3):
        assert again.loc[step, "mismatch/k3_kl"] == pytest.approx(
            first.set_index("step").loc[step, "mismatch/k3_kl"], rel=1e-12)
