"""MismatchAboveExpected: a pool far above its kind's expected healthy level fires from its first
step (no history), says nothing without a level, reads "not enough tokens" for a small pool, is
silent on the project's clean recordings, and promtool agrees with the evaluator on it.

Runtime: about 15 s (the promtool test only where promtool is installed).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.alerts.definitions import ABOVE_EXPECTED
from mismatch_monitor.alerts.promtool import render_unit_tests, run_tool
from mismatch_monitor.alerts.render import DEFAULT_STEP_SECONDS, RULES_FILE
from mismatch_monitor.expected_levels import expected_level

from external_tools import needs

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
N, P90 = "mismatch/n_tokens", "mismatch/abs_log_ratio/p90"
POOLS = {"bf16": {"precision": "bf16", "engine": "vllm"}, "fp8": {"precision": "fp8_e4m3", "engine": "vllm"}}
EDGE = {p: expected_level("mismatch/abs_log_ratio/p99", m["precision"], m["engine"]).healthy for p, m in POOLS.items()}


def history(p90_times: dict[str, list[float]], tokens: dict[str, float]) -> pd.DataFrame:
    """Per pool, its p90 as multiples of its expected p99, one value a step."""
    rows = [{"step": s, "pool": p, N: tokens[p], P90: t * EDGE[p]}
            for p, times in p90_times.items() for s, t in enumerate(times)]
    return pd.DataFrame(rows)


def firings(frame: pd.DataFrame, pools=POOLS) -> list[tuple[int, str]]:
    _, events = AlertEvaluator.replay(frame, rules=(ABOVE_EXPECTED,), pools=pools)
    return [(e.step, e.pool) for e in events if e.state == "firing"]


def test_a_pool_broken_from_step_0_fires_at_step_0_without_history():
    frame = history({"bf16": [8.0, 8.0, 0.3, 0.3], "fp8": [0.5, 0.6, 0.5, 0.5]}, {"bf16": 400.0, "fp8": 300.0})
    assert firings(frame) == [(0, "bf16")]
    assert firings(frame, pools={}) == []          # no metadata, no level: nothing said
    # below the factor (4x its expected p99: inside what clean pools reach) it does not fire
    assert firings(history({"bf16": [4.0] * 4}, {"bf16": 400.0})) == []


def test_a_pool_that_stays_broken_and_dips_under_the_factor_is_one_firing():
    """Hysteresis: firing until the p90 is under sqrt(5) = 2.24 times the expected p99."""
    dips = [8.0, 4.0, 8.0, 3.0, 6.0, 2.5, 1.0, 1.0, 8.0]
    _, events = AlertEvaluator.replay(history({"bf16": dips}, {"bf16": 400.0}), rules=(ABOVE_EXPECTED,), pools=POOLS)
    assert [(e.step, e.state) for e in events] == [(0, "firing"), (6, "resolved"), (8, "firing")]


def test_a_small_pool_is_not_enough_tokens():
    # 20 tokens: a p90 above the edge puts 3 tokens there against 0.2 expected, z 2.9 < 3.09
    frame = history({"bf16": [8.0, 8.0], "fp8": [8.0, 8.0]}, {"bf16": 20.0, "fp8": 400.0})
    evaluator, events = AlertEvaluator.replay(frame, rules=(ABOVE_EXPECTED,), pools=POOLS)
    assert [(e.step, e.pool) for e in events if e.state == "firing"] == [(0, "fp8")]
    assert ("MismatchAboveExpected", "bf16") in evaluator.undecided()
    assert ("MismatchAboveExpected", "fp8") not in evaluator.undecided()


def test_silent_on_the_clean_sample_runs():
    con = query.connect()
    for run in ("stable_fleet", "vllm_fleet"):
        pools = json.loads((SAMPLE_DATA / run / "run.json").read_text())["pools"]
        frame = query.metric_series(con, SAMPLE_DATA / run, ["pool"])
        assert firings(frame, pools=pools) == [], run
        # every pool has a level there, so silence is a verdict, not a missing level
        assert all(expected_level("mismatch/abs_log_ratio/p99", m["precision"], m["engine"]) for m in pools.values())


@needs("promtool")
def test_promtool_agrees_on_the_gate(tmp_path):
    frame = history({"bf16": [8.0, 8.0, 0.3, 6.0, 0.3], "fp8": [0.5, 6.0, 0.5, 0.5, 0.5]},
                    {"bf16": 400.0, "fp8": 300.0})
    assert firings(frame) == [(0, "bf16"), (1, "fp8"), (3, "bf16")]
    (tmp_path / RULES_FILE.name).write_text(RULES_FILE.read_text())
    text = render_unit_tests(frame.assign(wall_time=frame["step"] * DEFAULT_STEP_SECONDS), rules=(ABOVE_EXPECTED,),
                             step_seconds=DEFAULT_STEP_SECONDS, rule_file=RULES_FILE.name, pools=POOLS)
    assert "MismatchAboveExpected" in text and "mismatch_expected_level{" in text
    (tmp_path / "gate.yml").write_text(text)
    result = run_tool("promtool", "test", "rules", "gate.yml", cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
