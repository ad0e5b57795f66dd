"""Prometheus says "x times its expected healthy level" as the in-process evaluator does.

The rendered summaries divide the pool's metric by its ``mismatch_expected_level`` series (the
exporter serves it given the pools' metadata); promtool checks the committed scenario's
annotations, notes included, against the evaluator's text. Here: those notes are there, for the
right pools and levels (an independent division of the scenario's values by the CSV rows), and
promtool fails when the note's number, or the level series, is not the evaluator's. Runtime:
about 5 s.
"""

from __future__ import annotations

import re

from mismatch_monitor.alerts import AlertEvaluator, DEFAULT_RULES
from mismatch_monitor.alerts.files import SCENARIO_POOLS
from mismatch_monitor.alerts.promtool import render_unit_tests, run_tool
from mismatch_monitor.alerts.render import DEFAULT_STEP_SECONDS, RULES_FILE, RULES_TEST_FILE
from mismatch_monitor.alerts.scenario import scenario_history
from mismatch_monitor.expected_levels import expected_level

from external_tools import needs

NOTE = re.compile(r"\((\S+) (\S+)x its expected healthy level for (\S+) on (\S+)\)$")


def test_the_scenario_summaries_carry_the_note_with_the_csv_levels():
    history = scenario_history()
    _, events = AlertEvaluator.replay(history, pools=SCENARIO_POOLS)
    noted = [e for e in events if e.state == "firing" and NOTE.search(e.summary)]
    assert {e.pool for e in noted} >= {"fp8", "int4"}
    assert all(e.pool != "tpu" for e in noted)          # jax has no row: nothing is said
    for e in noted:
        metric, times, precision, engine = NOTE.search(e.summary).groups()
        meta = SCENARIO_POOLS[e.pool]
        level = expected_level(f"mismatch/{metric}", meta["precision"], meta["engine"])
        value = float(history.loc[(history["step"] == e.step) & (history["pool"] == e.pool), f"mismatch/{metric}"].iloc[0])
        assert times == f"{value / level.healthy:.3g}" and (precision, engine) == (level.precision, level.engine)
        assert e.summary in RULES_TEST_FILE.read_text().replace("''", "'")


@needs("promtool")
def test_promtool_fails_when_the_note_is_not_prometheus_own(tmp_path):
    (tmp_path / RULES_FILE.name).write_text(RULES_FILE.read_text())
    text = RULES_TEST_FILE.read_text()
    wrong = re.sub(r"\(k3_kl (\S+)x its expected", "(k3_kl 9.99x its expected", text, count=1)
    assert wrong != text
    (tmp_path / "t.yml").write_text(wrong)
    result = run_tool("promtool", "test", "rules", "t.yml", cwd=tmp_path)
    assert result.returncode != 0 and "expected healthy level" in result.stdout + result.stderr


@needs("promtool")
def test_without_the_level_series_prometheus_says_nothing(tmp_path):
    """The evaluator given no metadata and Prometheus given no level series agree (no note);
    the evaluator's notes against a Prometheus without the series do not."""
    (tmp_path / RULES_FILE.name).write_text(RULES_FILE.read_text())
    history = scenario_history()
    plain = render_unit_tests(history, rules=DEFAULT_RULES, step_seconds=DEFAULT_STEP_SECONDS,
                              rule_file=RULES_FILE.name)
    assert "expected healthy level" not in plain
    (tmp_path / "plain.yml").write_text(plain)
    result = run_tool("promtool", "test", "rules", "plain.yml", cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    noted = render_unit_tests(history, rules=DEFAULT_RULES, step_seconds=DEFAULT_STEP_SECONDS,
                              rule_file=RULES_FILE.name, pools=SCENARIO_POOLS)
    without_series = re.sub(r"\n\s+- series: 'mismatch_expected_level\{[^\n]*\n\s+values: '[^']*'", "", noted)
    assert "mismatch_expected_level{" not in without_series and "mismatch_pool_bound{" in without_series
    (tmp_path / "noted.yml").write_text(without_series)
    result = run_tool("promtool", "test", "rules", "noted.yml", cwd=tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "FAILED" in out and "expected healthy level" in out, out[-3000:]
