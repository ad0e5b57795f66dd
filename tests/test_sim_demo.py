"""The demo and sample-data commands: simulator -> collector -> store, alerts -> resync -> simulator.

Small runs (a 10-step warm start, a dozen RL steps) read back through the query layer, and the
dashboard started by the demo on a free port of 127.0.0.1 (about 30 s).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mismatch_monitor import query
from mismatch_monitor.cli import main
from mismatch_monitor.query.events import resync_requests, run_events
from mismatch_monitor.sim import scenario
from mismatch_monitor.store import read_run_info


def staleness_by_step(run_dir: Path, pool: str) -> dict[int, float]:
    con = query.connect()
    series = query.metric_series(con, run_dir, ["pool"], metrics=["mismatch/staleness/max"])
    series = series[series["pool"] == pool]
    return dict(zip(series["step"].astype(int), series["mismatch/staleness/max"].astype(float)))


def test_demo_writes_a_run_and_hands_resyncs_back(tmp_path, capsys):
    steps = 12
    code = main(["demo", "--scenario", "fault_midrun", "--fault", "stop_sync", "--variant", "dense",
                 "--steps", str(steps), "--warmstart-steps", "10", "--runs-root", str(tmp_path),
                 "--name", "live", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    run_dir = tmp_path / "live"
    assert f"writing run {run_dir.resolve()}" in out and f"latest step {steps - 1}" in out
    info = read_run_info(run_dir)
    expected = scenario("fault_midrun", steps=steps, variant="dense")
    assert info["pools"] == {p.name: p.metadata() for p in expected.pools}
    assert info["metadata"]["simulator"]["config"]["seed"] == 0
    assert info["metadata"]["simulator"]["config"]["pools"][3]["faults"][0]["kind"] == "stop_sync"

    # the async pool stops syncing at steps // 2: its staleness climbs by one per step until a
    # resync-recommending alert fires; the demo hands the resync back and it drops to zero
    staleness = staleness_by_step(run_dir, "async")
    assert sorted(staleness) == list(range(steps))
    events = query.alert_events(query.connect(), run_dir)
    fired = events[(events["pool"] == "async") & (events["state"] == "firing") & events["resync"].astype(bool)]
    assert len(fired), events[["step", "alert", "pool", "state"]]
    first = int(fired["step"].min())
    start = steps // 2
    climb = [staleness[s] for s in range(start, first + 1)]
    assert np.all(np.diff(climb) == 1) and first + 1 < steps
    assert staleness[first + 1] == 0
    assert "resync(s): async@" in out


def test_demo_with_fingerprints_finds_a_wrong_weights_push_at_its_sync(tmp_path, capsys):
    steps = 10
    code = main(["demo", "--scenario", "fault_midrun", "--fault", "wrong_weights", "--variant", "dense",
                 "--steps", str(steps), "--warmstart-steps", "10", "--runs-root", str(tmp_path),
                 "--name", "fp", "--quiet", "--fingerprints"])
    out = capsys.readouterr().out
    assert code == 0
    run_dir = tmp_path / "fp"
    faults = read_run_info(run_dir)["metadata"]["simulator"]["config"]["pools"]
    pool = next(p["name"] for p in faults if p["faults"] and p["faults"][0]["kind"] == "wrong_weights")
    onset = steps // 2
    staleness = staleness_by_step(run_dir, pool)
    # the pool is sent the warm-start weights (version 0) from the onset: staleness = the step
    assert [staleness[s] for s in range(onset)] == [0.0] * onset and staleness[onset] == onset
    events = query.alert_events(query.connect(), run_dir)
    fired = events[(events["pool"] == pool) & (events["state"] == "firing")]
    assert (onset, "MismatchStalenessHigh") in set(zip(fired["step"].astype(int), fired["alert"]))
    assert staleness[onset + 1] == 0                      # the resync it asked for sent the right weights
    assert "WrongWeights" in out                          # the summary shows the counted error


def test_demo_refuses_to_overwrite_a_run_by_accident(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    code = main(["demo", "--steps", "1", "--runs-root", str(tmp_path), "--name", "taken", "--quiet"])
    assert code == 2 and "pass --overwrite" in capsys.readouterr().err


def test_sample_data_regenerates_a_compacted_run(tmp_path, capsys):
    code = main(["sample-data", "--out", str(tmp_path), "--steps", "3", "--warmstart-steps", "5",
                 "--only", "collapse_no_correction", "--quiet"])
    assert code == 0
    run_dir = tmp_path / "collapse_no_correction"
    info = json.loads((run_dir / "run.json").read_text())
    assert set(info["pools"]) == {"bf16", "fp8"}
    assert info["metadata"]["simulator"]["config"]["correction"] == "none"
    assert len(query.steps_index(query.connect(), run_dir)) == 3
    assert all(len(list((run_dir / t).glob("*.parquet"))) <= 1 for t in ("tokens", "sequences", "abs_hist"))
    assert main(["summary", str(run_dir)]) == 0
    assert "mean reward by steps" in capsys.readouterr().out


SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"


def test_committed_sample_runs_open_and_show_what_their_notes_say():
    con = query.connect()
    for name in ("stable_fleet", "fault_midrun", "collapse_no_correction"):
        info = read_run_info(SAMPLE_DATA / name)
        assert info["metadata"]["simulator"]["scenario"] == name
        assert len(query.steps_index(con, SAMPLE_DATA / name)) == info["metadata"]["simulator"]["steps"]
    assert query.alert_events(con, SAMPLE_DATA / "stable_fleet").empty                  # the clean run: silent
    events = query.alert_events(con, SAMPLE_DATA / "fault_midrun")
    firing = events[events["state"] == "firing"]
    # the stopped pool is named at the step its sync stops, and the firing holds: one alert
    assert firing[["step", "alert", "pool"]].values.tolist() == [[60, "MismatchSyncBehind", "async"]]
    requests = resync_requests(run_events(con, SAMPLE_DATA / "fault_midrun"))
    # the sawtooth: a resync each time the pool falls behind again, none before the fault
    assert len(requests) >= 5 and (requests["pool"] == "async").all() and requests["step"].min() >= 60
    assert set(requests["alert"]) == {"MismatchSyncBehind"}
    series = query.metric_series(con, SAMPLE_DATA / "collapse_no_correction", ["pool"],
                                 metrics=["mismatch/k3_kl"])
    fp8 = series[series["pool"] == "fp8"]
    by_quarter = fp8.groupby(fp8["step"] // 30)["mismatch/k3_kl"].median().to_numpy()
    assert np.all(np.diff(by_quarter) > 0), by_quarter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_dashboard_follows_the_run_and_stops_with_the_demo(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from mismatch_monitor.cli import main; sys.exit(main())",
           "demo", "--steps", "2", "--variant", "dense", "--warmstart-steps", "2", "--runs-root",
           str(tmp_path), "--name", "live", "--quiet", "--no-alerts", "--dashboard", "--dashboard-port", str(port)]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in demo.stdout:                     # until the run is written and the server waits
            lines.append(line)
            if "keeps serving" in line:
                break
        dashboard_pid = int(next(x for x in lines if "dashboard server pid" in x).split()[-1])
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                    assert r.read() == b"ok"
                    break
            except OSError:
                assert time.time() < deadline, "dashboard did not come up"
                time.sleep(0.5)
        assert (tmp_path / "live" / "run.json").exists()
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=30) == 0
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.kill(dashboard_pid, 0)                # the demo took its server down with it
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
