"""What each rule could judge: the evaluator counts, per (alert, pool), the observed steps it had
no input for and those too small a sample for its test; the collector records that, and which
evaluator it used (or none), in run.json while the run goes on; `summary` and the dashboard say
it where a run shows no alert, so a quiet run is never read as healthy when nothing was judged.

Runtime: about 25 s (a few short collector runs; the full-disk case on a real tmpfs; six page runs).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.alerts.definitions import ABOVE_EXPECTED, DEFAULT_RULES, ROUTING_FLIP_RISE, SYNC_BEHIND
from mismatch_monitor.app.rule_coverage import coverage_grid
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.collectors.collaborators import default_evaluator
from mismatch_monitor.expected_levels import expected_level
from mismatch_monitor.store.alerting import (coverage_line, evaluation_note, judged_everything, never_judged,
                                             read_alerting)

from synthetic import make_batch
from test_store_faults import small_disk  # noqa: F401 (the real tmpfs fixture)

N, P90, STALE = "mismatch/n_tokens", "mismatch/abs_log_ratio/p90", "mismatch/staleness/max"
FLIPS, DECISIONS = "mismatch/routing/flip_rate", "mismatch/routing/decisions"
P99 = "mismatch/abs_log_ratio/p99"
LEVEL = expected_level(P99, "bf16", "vllm").healthy
SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"


def _rows(evaluator: AlertEvaluator) -> dict[tuple[str, str | None], tuple[int, int, int, str | None]]:
    return {(r["alert"], r["pool"]): (r["steps"], r["no_input"], r["undecided"], r["missing"])
            for r in evaluator.coverage()}


def test_each_pool_step_is_judged_lacks_an_input_or_is_too_small_a_sample():
    """Five steps; ``big`` has its level and 400 tokens, ``small`` its level and 20 tokens (3 tokens
    above the edge against 0.2 expected cannot reach z 3.09), ``unknown`` no metadata, and ``late``
    is observed on steps 3-4 only. Staleness is given; a bound is declared by ``big`` only."""
    pools_meta = {"big": {"precision": "bf16", "engine": "vllm", "max_staleness": 1},
                  "small": {"precision": "bf16", "engine": "vllm"}, "late": {"precision": "bf16", "engine": "vllm"}}
    tokens = {"big": 400.0, "small": 20.0, "unknown": 400.0, "late": 400.0}
    rows = [{"step": s, "pool": p, N: n, P90: 0.5 * LEVEL, STALE: 0.0}
            for s in range(5) for p, n in tokens.items() if p != "late" or s >= 3]
    evaluator, events = AlertEvaluator.replay(pd.DataFrame(rows), rules=(ABOVE_EXPECTED, SYNC_BEHIND, ROUTING_FLIP_RISE),
                                              pools=pools_meta)
    assert events == []
    got = _rows(evaluator)
    above, sync, flips = ABOVE_EXPECTED.name, SYNC_BEHIND.name, ROUTING_FLIP_RISE.name
    level_of, bound_of = f"expected level of {P99}", f"declared bound of {STALE}"
    assert got[(above, "big")] == (5, 0, 0, None)
    assert got[(above, "small")] == (5, 0, 5, None)
    assert got[(above, "unknown")] == (5, 5, 0, level_of)
    assert got[(above, "late")] == (2, 0, 0, None)
    assert got[(sync, "big")] == (5, 0, 0, None)
    assert got[(sync, "small")] == (5, 5, 0, bound_of)
    for pool, steps in (("big", 5), ("small", 5), ("unknown", 5), ("late", 2)):   # no routing data at all
        assert got[(flips, pool)] == (steps, steps, 0, FLIPS)
    # the per-step view it replaces agrees with the counts
    assert evaluator.undecided_counts() == {(above, "small"): 5}


def test_the_collector_records_its_evaluator_rules_and_coverage_and_a_replay_reads_the_same(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run, pools={"bf16": {"precision": "bf16", "engine": "vllm", "max_staleness": 2}}) as mc:
        for step in range(6):
            mc.log_step(step, make_batch(step))
        live = mc.alert_evaluator.coverage()
    record = json.loads((run / "run.json").read_text())["alerting"]
    assert record["evaluator"] == "mismatch_monitor.alerts.evaluator.AlertEvaluator"
    assert record["rules"] == [r.name for r in DEFAULT_RULES]
    assert record["through_step"] == 5
    assert record["coverage"] == live
    # every pool the batches held, every rule, every step: 6 pool-steps each, split three ways
    assert {(r["alert"], r["pool"]) for r in live} == {(r.name, p) for r in DEFAULT_RULES
                                                       for p in ("bf16", "fp8", "stale")}
    assert all(r["steps"] == 6 and 0 <= r["no_input"] + r["undecided"] <= 6 for r in live)
    by = {(r["alert"], r["pool"]): r for r in live}
    assert by[(SYNC_BEHIND.name, "bf16")]["no_input"] == 0    # its declared bound, and policy versions
    assert by[(SYNC_BEHIND.name, "fp8")]["no_input"] == 6
    assert by[(SYNC_BEHIND.name, "fp8")]["missing"] == f"declared bound of {STALE}"
    assert by[(ROUTING_FLIP_RISE.name, "fp8")]["missing"] == FLIPS     # no expert ids logged
    assert by[(ABOVE_EXPECTED.name, "fp8")]["missing"] == f"expected level of {P99}"   # no metadata
    # what a restarted collector's evaluator reads back from the stored steps is what was recorded
    assert default_evaluator(run).coverage() == live


def test_a_live_run_json_is_at_most_flush_every_seconds_behind_and_a_restart_counts_on(tmp_path):
    run, now = tmp_path / "run", [0.0]
    mc = MismatchCollector(run, clock=lambda: now[0], flush_every_seconds=3.0)
    for step in range(10):
        now[0] = float(step)
        mc.log_step(step, make_batch(step, sequences=6, max_len=12))
        through = json.loads((run / "run.json").read_text())["alerting"]["through_step"]
        assert step - 3 < through <= step if step >= 3 else through in (None, 0, 1, 2)
    mc.close()
    assert json.loads((run / "run.json").read_text())["alerting"]["through_step"] == 9
    again = MismatchCollector(run)        # opened at its first call: the record is written then
    again.log_event("resume", version=0)
    record = json.loads((run / "run.json").read_text())["alerting"]
    assert record["through_step"] == 9 and {r["steps"] for r in record["coverage"]} == {10}
    again.log_step(10, make_batch(10, sequences=6, max_len=12))
    again.close()
    record = json.loads((run / "run.json").read_text())["alerting"]
    assert record["through_step"] == 10 and {r["steps"] for r in record["coverage"]} == {11}


class OwnEvaluator:
    """The bare Evaluator protocol: no rules listed, nothing counted."""

    def observe(self, step, wall_time, by_pool, *, fleet=None):
        return []


def test_no_evaluator_and_an_evaluator_that_counts_nothing_are_said_as_such(tmp_path, capsys):
    from mismatch_monitor.cli import main

    for name, evaluator in (("none", None), ("own", OwnEvaluator())):
        with MismatchCollector(tmp_path / name, alert_evaluator=evaluator) as mc:
            mc.log_step(0, make_batch(0))
    none = read_alerting(json.loads((tmp_path / "none" / "run.json").read_text()))
    assert none.evaluator is None and none.coverage is None and not judged_everything(none)
    assert "had no alert evaluator (`alert_evaluator=None`): nothing in it was judged" in evaluation_note(none)
    own = read_alerting(json.loads((tmp_path / "own" / "run.json").read_text()))
    assert own.evaluator.endswith("test_alert_coverage.OwnEvaluator") and own.rules is None and own.coverage is None
    assert "OwnEvaluator does not count which steps its rules could judge" in evaluation_note(own)
    assert "does not record whether its collector evaluated alerts" in evaluation_note(None)
    assert main(["summary", str(tmp_path / "none")]) == 0
    assert "no alert event. This run's collector had no alert evaluator" in capsys.readouterr().out


def test_a_rule_that_judged_nothing_is_named_with_its_reason_and_the_grid_shows_each_cell(tmp_path):
    run = tmp_path / "run"
    with MismatchCollector(run) as mc:       # 3 x 8 tokens a pool a step: too few for the rise tests
        for step in range(4):
            mc.log_step(step, make_batch(step, sequences=9, max_len=8))
    alerting = read_alerting(json.loads((run / "run.json").read_text()))
    blind = never_judged(alerting)
    cov = alerting.coverage
    per = cov.groupby("alert")["judged"].sum()
    assert sorted(blind["alert"]) == sorted(per[per == 0].index)   # exactly the rules that judged no step
    assert list(blind["alert"]) == [r.name for r in DEFAULT_RULES if r.name in set(blind["alert"])]
    why = dict(zip(blind["alert"], blind["why"]))
    assert why[ROUTING_FLIP_RISE.name] == f"no {FLIPS}"
    assert not judged_everything(alerting)
    grid = coverage_grid(alerting)
    assert list(grid["rule"]) == [r.name for r in DEFAULT_RULES]
    assert list(grid.columns[1:]) == ["bf16", "fp8", "stale"]
    for _, r in cov.iterrows():
        cell = grid.loc[grid["rule"] == r["alert"], r["pool"]].item()
        assert cell.startswith(f"{r['judged']} of {r['steps']}")
        assert (f"{r['undecided']} too small a sample" in cell) == (r["undecided"] > 0)
        assert (f"{r['no_input']} no {r['missing']}" in cell) == (r["no_input"] > 0)


def test_a_full_disk_while_recording_is_counted_once_and_the_record_lands_after(small_disk):  # noqa: F811
    run, now = small_disk.path / "run", [0.0]
    with MismatchCollector(run, clock=lambda: now[0], flush_every_seconds=1.0) as mc:
        for step in range(2):
            now[0] = float(step)
            mc.log_step(step, make_batch(step, sequences=6, max_len=12))
        small_disk.fill()
        for step in range(2, 8):
            now[0] = float(step)
            mc.log_step(step, make_batch(step, sequences=6, max_len=12))
        small_disk.free()
        now[0] = 100.0
        mc.log_step(8, make_batch(8, sequences=6, max_len=12))
    errors = query.collector_errors(query.connect(), run)
    mine = errors[errors["where"] == "could not record in run.json what evaluated the alerts"]
    assert len(mine) == 1 and "No space left on device" in mine["message"].item()
    record = json.loads((run / "run.json").read_text())["alerting"]
    assert record["through_step"] == 8 and {r["steps"] for r in record["coverage"]} == {9}


def test_the_dashboard_says_what_judged_a_quiet_run(tmp_path, monkeypatch):
    from test_app_pages import PAGE, open_page

    root = tmp_path / "runs"
    shutil.copytree(SAMPLE_DATA / "stable_fleet", root / "judged")   # clean: no alert event
    old = root / "old"
    shutil.copytree(SAMPLE_DATA / "stable_fleet", old)
    info = json.loads((old / "run.json").read_text())
    del info["alerting"]
    (old / "run.json").write_text(json.dumps(info))
    with MismatchCollector(root / "none", alert_evaluator=None) as mc:
        for step in range(3):
            mc.log_step(step, make_batch(step))
    recorded = read_alerting(json.loads((root / "judged" / "run.json").read_text()))
    for run, says in (("judged", "The collector evaluated 13 rules (AlertEvaluator). "),
                      ("old", "does not record whether its collector evaluated alerts"),
                      ("none", "had no alert evaluator (`alert_evaluator=None`)")):
        for page in ("overview", "alerts"):
            at = open_page(monkeypatch, root, PAGE[page], run)
            notes = [i.value for i in at.info] + [s.value for s in at.success]
            assert any(says in n for n in notes), (run, page, notes)
        grids = [d.value for d in at.dataframe if "rule" in d.value.columns]
        if run == "judged":   # the alerts page's grid: every rule, every pool of the record
            assert len(grids) == 1 and list(grids[0]["rule"]) == list(recorded.rules)
            assert set(grids[0].columns[1:]) == set(recorded.coverage["pool"])
            assert any(coverage_line(recorded) in c.value for c in at.caption)
        else:
            assert grids == []


def test_the_sample_runs_records_are_what_a_replay_of_their_steps_reads_and_what_the_docs_say():
    """docs/ALERTS.md: on stable_fleet KLSpike and RoutingFlipRise judge no step; each committed
    record is what the default evaluator reads back from the run's own steps (as at a restart)."""
    for run in ("stable_fleet", "fault_midrun", "collapse_no_correction", "vllm_fleet"):
        record = json.loads((SAMPLE_DATA / run / "run.json").read_text())["alerting"]
        assert record["coverage"] == default_evaluator(SAMPLE_DATA / run).coverage(), run
    stable = read_alerting(json.loads((SAMPLE_DATA / "stable_fleet" / "run.json").read_text()))
    assert set(never_judged(stable)["alert"]) == {"MismatchKLSpike", "MismatchRoutingFlipRise"}
    assert "MismatchKLSpike` and `MismatchRoutingFlipRise`\n  judge no step of `stable_fleet`" in (
        SAMPLE_DATA.parent / "docs" / "ALERTS.md").read_text()
