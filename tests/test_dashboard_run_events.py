"""The run's own log in the dashboard (AppTest): weight syncs, resumes and resyncs in the shared
annotation layer of the time-series charts, and the reward / eval reward beside the alerts on the
Overview; a run written before those tables renders as before.

The run is written by the real collector (``log_step``, ``log_event``, ``log_outcomes``) and
read back through ``query.events``; the expected marks and values are the calls made here.
"""

from __future__ import annotations

import base64
import math
import shutil
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch

from mismatch_monitor.app import timeline
from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.collectors import MismatchCollector
from test_app_pages import charts, open_page
from test_app_runs import POOLS, fleet_case

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
PAGE = {p.url_path: p for p in PAGES}
STEPS = 20
SYNCED = {"bf16": range(STEPS), "fp8": range(10)}       # fp8 stops syncing at step 10
RESUME, RESYNC = 12, 15


def reward(step: int, pool: str | None) -> float:
    return 0.1 + 0.01 * step + {None: 0.0, "bf16": 0.05, "fp8": -0.05, "int4": 0.02}[pool]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("run_events") / "runs"
    with MismatchCollector(root / "logged", pools=POOLS, flush_every_steps=5, strict=True) as mc:
        for step in range(STEPS):
            for pool, steps in SYNCED.items():
                if step in steps:
                    mc.log_event("weight_sync", step=step, pool=pool, version=step)
            if step == RESUME:
                mc.log_event("resume", step=step, message="restarted from a checkpoint")
            if step == RESYNC:
                mc.log_event("resync", step=step, pool="fp8", version=step)
            mc.log_step(step, fleet_case(step, 5, 1.0).batch())
            mc.log_outcomes(step, {"reward": reward(step, None), "loss": 1.0 / (step + 1)})
            for pool in POOLS:
                mc.log_outcomes(step, {"reward": reward(step, pool)}, pool=pool)
            if step % 5 == 4:
                mc.log_outcomes(step, {"eval_reward": 0.5 + step / 100})
    return root


def chart(at, key: str) -> go.Figure:  # noqa: ANN001
    found = [c for c in charts(at) if c.proto.id.endswith(f"-{key}")]
    assert found, f"no chart {key}"
    return pio.from_json(found[0].proto.spec)                 # arrays decoded as the browser does


def array(value: object) -> list:
    """A trace's array as plotly.js decodes it (Streamlit ships numbers base64-typed: bdata)."""
    if isinstance(value, dict) and "bdata" in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"])).tolist()
    return list(value)


def marked(fig: go.Figure, kind: str) -> set[float]:
    color, dash, _, _ = timeline.RUN_EVENT_STYLE[kind]
    return {x for s in fig.layout.shapes if s.line.color == color and s.line.dash == dash
            for x in timeline.positions(s)}


@pytest.mark.parametrize("page, key", [("overview", "overview_history"), ("pools", "pools_series"),
                                       ("tails", "tails_drift"), ("corrections", "corrections_series")])
def test_syncs_resumes_and_resyncs_are_marked_on_the_time_series(monkeypatch, root: Path, page: str,
                                                                 key: str) -> None:  # noqa: ANN001
    spec = chart(open_page(monkeypatch, root, PAGE[page], "logged"), key)
    assert marked(spec, "weight_sync") == set(range(STEPS))     # some pool synced at every step
    assert marked(spec, "resume") == {RESUME}
    assert marked(spec, "resync") == {RESYNC}


def test_the_overview_draws_the_reward_and_eval_reward_beside_the_alerts(monkeypatch, root: Path) -> None:  # noqa: ANN001
    spec = chart(open_page(monkeypatch, root, PAGE["overview"], "logged"), "overview_outcomes")
    traces = {t.name: t for t in spec.data}
    assert {"reward", "eval reward", "reward · bf16", "reward · fp8", "reward · int4"} == set(traces)  # not loss
    for name, pool in (("reward", None), ("reward · fp8", "fp8")):
        got = dict(zip(array(traces[name].x), array(traces[name].customdata)))
        assert got.keys() == set(range(STEPS))
        assert all(math.isclose(v, reward(s, pool), rel_tol=1e-12) for s, v in got.items())
    assert array(traces["eval reward"].x) == [4, 9, 14, 19]
    assert marked(spec, "resync") == {RESYNC}


@pytest.mark.skipif(not (SAMPLE_DATA / "fault_midrun").is_dir(), reason="no sample runs")
def test_a_run_written_before_the_event_log_renders_as_before(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    # every sample run has an event log now: a copy of one without its events and outcomes tables
    shutil.copytree(SAMPLE_DATA / "vllm_fleet", tmp_path / "vllm_fleet", ignore=shutil.ignore_patterns("events", "outcomes"))
    assert not (tmp_path / "vllm_fleet" / "events").exists()             # what the test needs
    at = open_page(monkeypatch, tmp_path, PAGE["overview"], "vllm_fleet")
    assert not [c for c in charts(at) if c.proto.id.endswith("-overview_outcomes")]
    spec = chart(at, "overview_history")
    assert all(not marked(spec, kind) for kind in ("weight_sync", "resume", "resync"))
    assert spec.layout.shapes                                             # the alert lines are there
