"""The Several runs page's logic as plain functions: the search, the run.json fields that group
runs, each run's x (own steps, steps or seconds since its start) and the overlay's traces."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mismatch_monitor.app import several_runs as sr


def test_a_search_keeps_the_names_holding_every_word_in_any_case() -> None:
    names = ["fp8-upgrade-a", "bf16-base", "FP8-base", "fp8-upgrade-b"]
    assert sr.matching(names, "fp8 UPGRADE") == ["fp8-upgrade-a", "fp8-upgrade-b"]
    assert sr.matching(names, "  ") == names and sr.matching(names, None) == names
    assert sr.matching(names, "nothing") == []


def test_fields_to_group_by_are_those_that_differ_between_the_runs() -> None:
    infos = {"a": {"run_id": "a", "host": "h", "metadata": {"engine": {"version": "0.8"}}, "config": {"x": 1},
                   "pools": {"bf16": {"engine": "vllm"}}},
             "b": {"run_id": "b", "host": "h", "metadata": {"engine": {"version": "0.9"}}, "config": {"x": 2},
                   "pools": {"bf16": {"engine": "vllm"}, "fp8": {"engine": "sglang"}}},
             "c": {"run_id": "c", "host": "h", "metadata": {"engine": {"version": "0.9"}}, "started_at": 5.0}}
    fields = sr.group_fields(infos)
    # the same host everywhere, run ids, start times and thresholds are no grouping
    assert fields == ["metadata.engine.version", "pools.bf16.engine", "pools.fp8.engine"]
    assert sr.groups(infos, "metadata.engine.version") == {"a": "0.8", "b": "0.9", "c": "0.9"}
    assert sr.groups(infos, "pools.fp8.engine") == {"a": sr.NOT_SET, "b": "sglang", "c": sr.NOT_SET}
    assert sr.groups(infos, sr.NO_GROUP) == {"a": "", "b": "", "c": ""}


def test_each_run_is_drawn_on_its_own_clock() -> None:
    frame = pd.DataFrame({"step": [40, 41, 43], "wall_time": [1000.5, 1002.0, 1010.25]})
    assert sr.relative_x(frame, "step", first_step=40, started_at=990.0).tolist() == [40, 41, 43]
    assert sr.relative_x(frame, "steps since start", first_step=40, started_at=990.0).tolist() == [0, 1, 3]
    assert sr.relative_x(frame, "seconds since start", first_step=40, started_at=990.0).tolist() == [10.5, 12.0, 20.25]


def test_runs_of_one_group_share_a_colour_and_differ_by_dash() -> None:
    styles = sr.run_styles(["a", "b", "c", "d"], {"a": "v1", "b": "v2", "c": "v2", "d": "v1"})
    assert styles["a"][0] == styles["d"][0] != styles["b"][0] == styles["c"][0]
    assert styles["a"][1] != styles["d"][1] and styles["b"][1] != styles["c"][1]
    plain = sr.run_styles(["a", "b", "c"], {"a": "", "b": "", "c": ""})
    assert len({color for color, _ in plain.values()}) == 3 and {d for _, d in plain.values()} == {"solid"}


def _series(values: dict[str, float], steps: range) -> pd.DataFrame:
    return pd.DataFrame([{"x": s, "step": s, "pool": p, "m": v * (s + 1)} for s in steps for p, v in values.items()])


@pytest.mark.parametrize("n_runs", [1, 3, 5])
def test_the_overlay_has_one_trace_per_run_and_pool_with_its_values(n_runs: int) -> None:
    series = {f"run{i}": _series({"bf16": 1.0 + i, "fp8": 10.0 + i} if i % 2 == 0 else {"bf16": 1.0 + i},
                                 range(i, 6)) for i in range(n_runs)}
    fig = sr.overlay(series, "m", metric_label="m", group_of={r: "" for r in series}, x_title="step",
                     y_scale="linear")
    got = {tuple(t.meta): t for t in fig.data}
    want = {(run, pool) for run, df in series.items() for pool in df["pool"].unique()}
    assert set(got) == want and len(fig.data) == len(want)
    for (run, pool), trace in got.items():
        df = series[run][series[run]["pool"] == pool]
        assert list(trace.x) == df["x"].tolist()
        assert np.array_equal(np.asarray(trace.customdata, dtype=float), df["m"].to_numpy(float))
    assert sum(bool(t.showlegend) for t in fig.data) == n_runs       # one legend entry per run


def test_a_zero_on_a_log_axis_is_drawn_at_its_floor_and_kept_in_the_hover() -> None:
    series = {"a": pd.DataFrame({"x": [0, 1, 2], "pool": ["p"] * 3, "m": [0.0, 1e-4, 1.0]})}
    (trace,) = sr.overlay(series, "m", metric_label="m", group_of={"a": ""}, x_title="step", y_scale="log").data
    assert 0 < trace.y[0] < 1e-4 and list(trace.customdata) == [0.0, 1e-4, 1.0]


def test_a_runs_marks_are_placed_on_its_own_x() -> None:
    events = pd.DataFrame({"step": [5, 6, 9], "wall_time": [105.0, 106.5, 109.0]})
    at = sr.marks_at("step", origin=4, width=2, first_step=4, started_at=100.0)
    assert list(at(events)) == [4, 6, 8]                              # the bins the series draws
    at = sr.marks_at("steps since start", origin=4, width=2, first_step=4, started_at=100.0)
    assert list(at(events)) == [0, 2, 4]
    at = sr.marks_at("seconds since start", origin=4, width=2, first_step=4, started_at=100.0)
    assert list(at(events)) == [5.0, 6.5, 9.0]                        # the event's own time
