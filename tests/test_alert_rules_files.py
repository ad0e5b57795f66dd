"""The committed rule files: up to date, accepted by promtool/amtool, every alert fires and clears.

Runs Debian's promtool and amtool (``.ci/run`` installs them; skipped where absent). Runtime: about 4 s.
"""

from __future__ import annotations

import argparse
import re
import shutil

import pytest

from mismatch_monitor.alerts import AlertEvaluator, DEFAULT_RULES, render_rules
from mismatch_monitor.alerts.files import SCENARIO_POOLS, stale_files
from mismatch_monitor.alerts.promtool import run_tool
from mismatch_monitor.alerts.render import ALERTMANAGER_EXAMPLE, RULES_FILE, RULES_TEST_FILE
from mismatch_monitor.alerts.scenario import INCIDENTS, scenario_history
from mismatch_monitor.cli import alerts as alerts_command

from external_tools import needs


def ok(result) -> bool:
    return result.returncode == 0


def test_committed_files_are_up_to_date():
    assert stale_files() == [], "run: mismatch-monitor alerts render --write"


@needs("promtool")
def test_promtool_accepts_the_rules_and_their_unit_tests():
    check = run_tool("promtool", "check", "rules", RULES_FILE.name, cwd=RULES_FILE.parent)
    assert ok(check), check.stdout + check.stderr
    test = run_tool("promtool", "test", "rules", RULES_TEST_FILE.name, cwd=RULES_FILE.parent)
    assert ok(test), test.stdout + test.stderr


def test_every_alert_fires_and_clears_in_the_scenario():
    _, events = AlertEvaluator.replay(scenario_history(), pools=SCENARIO_POOLS)
    fired = {(e.alert, e.pool) for e in events if e.state == "firing"}
    resolved = {(e.alert, e.pool) for e in events if e.state == "resolved"}
    assert {r.name for r in DEFAULT_RULES} == {a for a, _ in fired} == {a for a, _ in resolved}
    for incident in INCIDENTS:
        if incident.silent:
            assert (incident.alert, incident.pool) not in fired, incident
        else:
            assert (incident.alert, incident.pool) in fired & resolved, incident
    # the committed promtool tests check each alert both firing and cleared
    text = RULES_TEST_FILE.read_text()
    for rule in DEFAULT_RULES:
        blocks = re.findall(rf"alertname: '{rule.name}'\n\s+exp_alerts:( \[\])?", text)
        assert "" in blocks and " []" in blocks, rule.name


@needs("promtool")
def test_promtool_fails_when_prometheus_would_disagree(tmp_path):
    """The unit tests can fail: with one threshold changed in the rules, they do."""
    rules = RULES_FILE.read_text()
    changed = rules.replace('mismatch_ess_ratio{pool!=""} < 0.5', 'mismatch_ess_ratio{pool!=""} < 0.3')
    assert changed != rules
    (tmp_path / RULES_FILE.name).write_text(changed)
    shutil.copy(RULES_TEST_FILE, tmp_path / RULES_TEST_FILE.name)
    result = run_tool("promtool", "test", "rules", RULES_TEST_FILE.name, cwd=tmp_path)
    assert not ok(result)
    assert "MismatchLowESS" in result.stdout + result.stderr


@needs("promtool")
@pytest.mark.parametrize("step_seconds", [0.5, 1.0, 15.0, 600.0])
def test_rules_render_for_any_step_duration(tmp_path, step_seconds):
    text = render_rules(step_seconds=step_seconds)
    (tmp_path / "rules.yml").write_text(text)
    result = run_tool("promtool", "check", "rules", "rules.yml", cwd=tmp_path)
    assert ok(result), result.stdout + result.stderr
    # Prometheus 2.42 / Alertmanager 0.25: none of the newer rule-file fields (keep_firing_for
    # came in 2.42: the promtool above and the live server of test_prometheus_live load it)
    for newer in ("query_offset", "limit:"):
        assert newer not in text
    assert not re.search(r"^    labels:", text, re.M)  # group-level keys sit at indent 4: none is labels


def test_render_rejects_bad_step_durations():
    with pytest.raises(ValueError, match="expected step_seconds > 0"):
        render_rules(step_seconds=0)
    with pytest.raises(ValueError, match="whole number of milliseconds"):
        render_rules(step_seconds=0.0004)


@needs("amtool")
def test_alertmanager_example_routes_resyncs_to_the_webhook():
    check = run_tool("amtool", "check-config", ALERTMANAGER_EXAMPLE.name, cwd=ALERTMANAGER_EXAMPLE.parent)
    assert ok(check), check.stdout + check.stderr

    def receivers(*labels: str) -> str:
        r = run_tool("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}", *labels)
        return r.stdout.strip()

    low_ess = {"alertname": "MismatchLowESS", **DEFAULT_RULES[2].labels, "pool": "fp8"}
    tail = {"alertname": "MismatchTailGrowth", **DEFAULT_RULES[0].labels, "pool": "fp8"}
    assert receivers(*(f"{k}={v}" for k, v in low_ess.items())) == "trainer-resync,mismatch-default"
    assert receivers(*(f"{k}={v}" for k, v in tail.items())) == "mismatch-default"


@needs("promtool", "amtool")
def test_alerts_command_renders_and_checks(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    alerts_command.add_arguments(parser)

    def main(argv: list[str]) -> int:
        return alerts_command.run(parser.parse_args(argv))

    assert main(["render", "--step-seconds", "30", "--out", str(tmp_path / "r.yml")]) == 0
    assert "for one training step every 30s" in (tmp_path / "r.yml").read_text()
    assert ok(run_tool("promtool", "check", "rules", "r.yml", cwd=tmp_path))
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert out.count("ok: ") == 3 and "stale" not in out
