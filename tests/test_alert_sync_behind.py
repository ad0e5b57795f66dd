"""``MismatchSyncBehind``: a pool past the max_staleness it declares fires at that step.

The pools' ``run.json`` metadata declares how far each may lag by design (``pool_bounds.py``).
Checked the way a user meets it: a collector with the default rules whose pool's pushes fail
from step 3 (the trainer says so with ``applied=False``) raises the alert at step 3, in the
stored ``alerts`` table, with one resync request; the same run without the declaration stays
silent until the generic cap of ``MismatchStalenessHigh``. The evaluator's arithmetic, the
exporter's series and the up-front check of a declaration are checked beside it (the rendered
rule is checked by promtool on the committed scenario, ``test_alert_rules_files.py``).
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pandas as pd
import pytest
import torch

from mismatch_monitor import query
from mismatch_monitor.alerts import AlertEvaluator
from mismatch_monitor.app import loaders
from mismatch_monitor.alerts.definitions import STALENESS_HIGH, SYNC_BEHIND
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.cli import main as cli_main
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.exporter import MismatchExporter
from mismatch_monitor.pool_bounds import POOL_BOUND
from mismatch_monitor.query.events import run_events

POOLS = ("bf16", "fp8")


def batch(step: int, names: tuple[str, str] = POOLS) -> TokenBatch:
    """Four sequences per pool, each claiming the trainer's version (= step)."""
    g = torch.Generator().manual_seed(step)
    mu = -(1.0 + torch.rand(8, 16, generator=g, dtype=torch.float64))
    pools = [names[i // 4] for i in range(8)]
    return TokenBatch.from_padded(mu + 0.01 * torch.randn(8, 16, generator=g, dtype=torch.float64), mu,
                                  torch.ones(8, 16), labels={"pool": pools}, policy_version=[step] * 8,
                                  trainer_version=step)


def failing_pushes(run, pools: dict | None, names: tuple[str, str] = POOLS,
                   evaluator="default") -> tuple[pd.DataFrame, list]:
    """Six steps; the second pool's pushes fail from step 3 and the trainer records it."""
    asked = []
    with MismatchCollector(run, pools=pools, alert_evaluator=evaluator) as mc:
        mc.on_resync(asked.append)
        for step in range(6):
            mc.log_event("weight_sync", step=step, pool=names[0], version=step)
            mc.log_event("weight_sync", step=step, pool=names[1], version=step, applied=step < 3)
            mc.log_step(step, batch(step, names))
    return query.alert_events(query.connect(), run), asked


def test_a_failed_push_fires_at_its_step_on_the_pool_that_declares_it_syncs_every_step(tmp_path):
    alerts, asked = failing_pushes(tmp_path / "run", {p: {"precision": "bf16", "max_staleness": 0} for p in POOLS})
    fired = alerts[(alerts["alert"] == SYNC_BEHIND.name) & (alerts["state"] == "firing")]
    assert fired[["step", "pool"]].values.tolist() == [[3, "fp8"]]
    assert float(fired["value"].iloc[0]) == 1.0     # staleness 1 (version 2 applied at step 3) minus 0
    assert "Pool fp8 sampled with weights 1 update(s) older than its pipeline allows" in fired["summary"].iloc[0]
    # one resync asked, at the first firing; staleness goes on climbing, the alert stays firing
    assert [(e.alert, e.pool, e.step) for e in asked if e.alert == SYNC_BEHIND.name] == [(SYNC_BEHIND.name, "fp8", 3)]
    assert not (alerts["alert"] == "MismatchStalenessHigh").any()          # staleness 3 at step 5: under 4


def test_a_pool_named_with_a_slash_is_judged_by_its_own_declaration(tmp_path):
    """run.json keys the pools by their label values; alerts name them by label text (``a/b`` is
    ``a%2Fb``): the declaration still reaches the pool."""
    names = ("bf16 pool", "fp8/ü")
    alerts, _ = failing_pushes(tmp_path / "run", {p: {"max_staleness": 0} for p in names}, names)
    fired = alerts[(alerts["alert"] == SYNC_BEHIND.name) & (alerts["state"] == "firing")]
    assert fired[["step", "pool"]].values.tolist() == [[3, "fp8%2Fü"]]
    events = run_events(query.connect(), tmp_path / "run")
    # the resync it asked for is stored under the pool's value, as the pushes are
    assert events.loc[events["kind"] == "resync_request", "pool"].tolist() == ["fp8/ü"]
    # summary names the firing pool as its alert does, not escaped a second time (fp8%252Fü)
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["summary", str(tmp_path / "run")]) == 0
    assert f"{SYNC_BEHIND.name} pool=fp8%2Fü since step 3" in out.getvalue()


def test_an_evaluator_passed_in_judges_the_pools_the_collector_was_given(tmp_path):
    """``alert_evaluator=AlertEvaluator()`` beside ``pools=``: the declaration reaches it."""
    alerts, _ = failing_pushes(tmp_path / "run", {p: {"max_staleness": 0} for p in POOLS}, evaluator=AlertEvaluator())
    fired = alerts[(alerts["alert"] == SYNC_BEHIND.name) & (alerts["state"] == "firing")]
    assert fired[["step", "pool"]].values.tolist() == [[3, "fp8"]]


def test_an_evaluator_given_other_metadata_for_a_pool_is_refused(tmp_path):
    evaluator = AlertEvaluator(pools={"fp8": {"max_staleness": 2}, "tpu": {"max_staleness": 0}})
    with pytest.raises(ValueError, match=r"pool 'fp8': the alert evaluator was given \{'max_staleness': 2\}"):
        MismatchCollector(tmp_path / "run", pools={"fp8": {"max_staleness": 0}}, alert_evaluator=evaluator)
    assert not (tmp_path / "run").exists()
    AlertEvaluator(pools={"fp8/ü": {"max_staleness": 1}}).set_pools({"fp8/ü": {"max_staleness": 1}})   # same: fine


def test_without_the_declaration_the_same_run_waits_for_the_generic_cap(tmp_path):
    alerts, _ = failing_pushes(tmp_path / "run", {p: {"precision": "bf16"} for p in POOLS})
    assert not (alerts["alert"] == SYNC_BEHIND.name).any()


def staleness_history(staleness: dict[str, list[int]]) -> pd.DataFrame:
    return pd.DataFrame([{"step": s, "pool": p, "mismatch/staleness/max": float(v)}
                         for p, values in staleness.items() for s, v in enumerate(values)])


def test_the_evaluator_fires_past_each_pools_own_bound_and_resolves_once_caught_up_for_the_hold():
    assert SYNC_BEHIND.keep_firing_steps == 5
    staleness = {"async": [0, 1, 2, 2, 3, 4, 2, 2] + [1] * 6, "sync": [0, 0, 1] + [0] * 11,
                 "free": [0, 1, 2, 9, 9, 9] + [0] * 8}
    _, events = AlertEvaluator.replay(staleness_history(staleness), rules=(SYNC_BEHIND,),
                                      pools={"async": {"max_staleness": 2}, "sync": {"max_staleness": 0}})
    got = [(e.step, e.pool, e.state, e.value) for e in events]
    # clear from step 3 (sync) and 6 (async): held firing 5 steps, resolved at the fifth ("free" declares nothing)
    assert got == [(2, "sync", "firing", 1.0), (4, "async", "firing", 1.0),
                   (8, "sync", "resolved", 1.0), (11, "async", "resolved", 2.0)]


def test_a_pool_that_falls_behind_again_within_the_hold_is_one_firing():
    staleness = {"sync": [0, 1, 0, 1, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0]}
    _, events = AlertEvaluator.replay(staleness_history(staleness), rules=(SYNC_BEHIND,),
                                      pools={"sync": {"max_staleness": 0}})
    # back at steps 3 and 5, within 5 steps of clearing: one firing, resolved 5 steps after the last clear
    # (step 11); step 12 is a new fault
    assert [(e.step, e.state, e.since_step) for e in events] == [(1, "firing", 1), (11, "resolved", 1),
                                                                   (12, "firing", 12)]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_a_bad_declaration_is_refused_before_anything_is_written(tmp_path, bad):
    with pytest.raises(ValueError, match=r"pool 'fp8': expected max_staleness to be an integer >= 0"):
        MismatchCollector(tmp_path / "run", pools={"fp8": {"max_staleness": bad}})
    assert not (tmp_path / "run").exists()


def test_the_exporter_serves_each_declared_bound():
    exporter = MismatchExporter(pools={"a": {"max_staleness": 2}, "b": {"precision": "bf16"}, "c": {"max_staleness": 0}})
    samples = [s for family in exporter.collect() if family.name == POOL_BOUND for s in family.samples]
    assert sorted((s.labels["pool"], s.labels["metric"], s.value) for s in samples) == [
        ("a", "staleness/max", 2.0), ("c", "staleness/max", 0.0)]


def test_a_pool_whose_syncs_keep_failing_is_one_firing_that_asks_a_resync_each_time_it_falls_behind(tmp_path):
    """fp8's pushes fail from step 3; each resync asked applies at the next step and the push after
    it fails again: one stored firing, held all run, and a resync asked at each relapse, each
    naming the one before it that did not hold."""
    asked, resync_at = [], set()
    with MismatchCollector(tmp_path / "run", pools={p: {"max_staleness": 0} for p in POOLS}) as mc:
        mc.on_resync(lambda event: (asked.append(event), resync_at.add(step + 1)))
        for step in range(12):
            mc.log_event("weight_sync", step=step, pool="bf16", version=step)
            mc.log_event("weight_sync", step=step, pool="fp8", version=step, applied=step < 3 or step in resync_at)
            mc.log_step(step, batch(step))
        outcomes = mc.alert_evaluator.resync_outcomes()
    alerts = query.alert_events(query.connect(), tmp_path / "run")
    assert alerts[["step", "alert", "pool", "state"]].values.tolist() == [[3, SYNC_BEHIND.name, "fp8", "firing"]]
    assert [(e.alert, e.step, e.since_step) for e in asked] == [(SYNC_BEHIND.name, s, 3) for s in (3, 5, 7, 9, 11)]
    assert [(o.requested_step, o.helped, o.relapsed_step) for o in outcomes] == [
        (3, True, 5), (5, True, 7), (7, True, 9), (9, True, 11)]          # step 11's is still watched
    assert ("A resync of fp8 at step 3 cleared MismatchSyncBehind, but the pool fell behind again at step 5"
            in asked[1].description)
    events = run_events(query.connect(), tmp_path / "run")
    requests = events[events["kind"] == "resync_request"]
    assert requests["step"].tolist() == [4, 6, 8, 10, 12]
    assert "asked for another resync: the pool fell behind again after the last one at step 5" in requests["message"].iloc[1]
    # the dashboard counts each of them (one alert row, five resyncs)
    asked = loaders.asked_resyncs(alerts, events)
    assert asked[["step", "pool", "alert"]].values.tolist() == [[s, "fp8", SYNC_BEHIND.name] for s in (4, 6, 8, 10, 12)]


def test_a_pool_without_a_declaration_stuck_behind_is_one_staleness_firing():
    """No max_staleness: the generic cap judges it, held the same way: resynced at each firing or
    relapse (staleness back to 0), back above 4 five steps later, one firing."""
    staleness = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5] + [0] * 8
    _, events = AlertEvaluator.replay(staleness_history({"free": staleness}), rules=(STALENESS_HIGH,))
    # clear from step 6, back at 11 (held: 5 steps), clear from 12, back at 17, clear from 18: resolved at 23
    assert [(e.step, e.state) for e in events] == [(5, "firing"), (23, "resolved")]
