"""The simulator's weight syncs, resyncs and training outcomes in the run, through the demo's
wiring (``collectors/simulation.py``): a small fault_midrun run (stop_sync on the async pool at
steps // 2) read back through ``query/events.py``.

Runtime: about 60 s.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pandas as pd

from mismatch_monitor import query
from mismatch_monitor.cli.demo import simulate
from mismatch_monitor.query.events import run_events, run_outcomes
from mismatch_monitor.sim import scenario

STEPS = 12


def test_syncs_resyncs_and_outcomes_of_a_simulated_run_are_stored(tmp_path):
    config = replace(scenario("fault_midrun", steps=STEPS, variant="dense", fault="stop_sync"), warmstart_steps=10)
    run = tmp_path / "run"
    result = simulate(config, run, steps=STEPS, run_id="sim", progress=False, echo=False)
    con = query.connect()
    outcomes, events = run_outcomes(con, run), run_events(con, run)

    # outcomes: the values the simulator returned, per step, fleet-wide and per pool
    fleet = outcomes[outcomes["pool"].isna()]
    for name in ("reward", "loss", "grad_norm", "entropy"):
        series = fleet[fleet["name"] == name]
        assert series["step"].tolist() == list(range(STEPS)), name
        assert all(math.isfinite(v) for v in series["value"])
    assert fleet[fleet["name"] == "reward"]["value"].tolist() == result.rewards
    by_pool = outcomes[outcomes["pool"].notna()]
    assert set(by_pool["name"]) == {"reward"}
    for step, rewards in enumerate(result.rewards_by_pool):
        at = by_pool[by_pool["step"] == step]
        assert dict(zip(at["pool"], at["value"])) == rewards
    # beside the mismatch statistics: the same steps
    assert set(fleet["step"]) == set(query.steps_index(con, run)["step"])

    # a pool without lag syncs to the trainer's version at the start of every step
    bf16 = events[(events["pool"] == "bf16") & (events["kind"] == "weight_sync")]
    assert bf16[["step", "version"]].values.tolist() == [[s, s] for s in range(STEPS)]
    # the async pool (lag 2) holds version step - 2, and pushes nothing once its sync stops
    syncs = events[(events["pool"] == "async") & (events["kind"] == "weight_sync")]
    assert syncs["step"].max() < STEPS // 2
    assert all(v == max(s - 2, 0) for s, v in syncs[["step", "version"]].values.tolist())

    # each resync the alerts asked for: the request, then the pool's resync, from the next step
    assert result.resyncs, "the stopped sync should ask for a resync"
    for step, pool in result.resyncs:
        at = events[(events["step"] == step + 1) & (events["pool"] == pool)]
        assert at["kind"].tolist()[:2] == ["resync_request", "resync"], at
        assert int(at[at["kind"] == "resync"]["version"].iloc[0]) == step + 1
    assert pd.Series(events["kind"]).isin(["weight_sync", "resync", "resync_request"]).all()
