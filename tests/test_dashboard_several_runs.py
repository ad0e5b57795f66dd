"""The Several runs page in a real Chromium: three runs (copies of sample runs, each given an
engine version in its run.json metadata) overlaid per pool, grouped by that field, on the seconds
since each run started. Every trace is checked against values read from the copies' Parquet
files with DuckDB, not through the app.

Runtime: about 40 s (server start ~5 s, two page visits).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator
from urllib.parse import urlencode

import duckdb
import pytest

from external_tools import find, needs

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (Python) is not installed")
from dashboard_server import ARTIFACTS, LAUNCH_ARGS, chart, serve, wait_drawn  # noqa: E402

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"
RUNS = {"fault_midrun": "v1", "stable_fleet": "v2", "collapse_no_correction": "v2"}   # run -> engine version
pytestmark = [pytest.mark.timeout(400), needs("chromium"),
              pytest.mark.skipif(not all((SAMPLE / r).is_dir() for r in RUNS), reason="sample runs missing")]
# every scatter trace of the overlay: its name, [run, pool], decoded x, y as drawn and the values
# (customdata: on a log axis a zero is drawn at the axis floor), colour and dash
TRACES = """el => el._fullData.filter(t => t.type === 'scatter' && t.meta).map(t => ({
    name: t.name, run: t.meta[0], pool: t.meta[1], x: Array.from(t.x), y: Array.from(t.y),
    value: Array.from(t.customdata),
    color: t.line.color, dash: t.line.dash}))"""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("several") / "runs"
    for name, version in RUNS.items():
        shutil.copytree(SAMPLE / name, root / name)
        path = root / name / "run.json"
        info = json.loads(path.read_text())
        info["metadata"]["engine_version"] = version
        path.write_text(json.dumps(info))
    return root


@pytest.fixture(scope="module")
def server(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with open(tmp_path_factory.mktemp("server") / "dashboard.log", "w+") as log:
        yield from serve(root, log)


def reference(run_dir: Path) -> dict[str, dict[float, float]]:
    """Pool -> {seconds since run.json's started_at: max |log ρ| of the step}, from the Parquet
    files (each step written once: the sample runs have no restart)."""
    started = json.loads((run_dir / "run.json").read_text())["started_at"]
    steps, tokens = run_dir / "steps" / "*.parquet", run_dir / "tokens" / "*.parquet"
    (dupes,) = duckdb.sql(f"select count(*) - count(distinct step) from read_parquet('{steps}')").fetchall()[0]
    assert dupes == 0
    rows = duckdb.sql(f"""select t.pool, s.wall_time - {started!r}, max(t.max_abs_lr)
        from read_parquet('{tokens}') t join read_parquet('{steps}') s using (step)
        where t.n_tokens > 0 group by t.pool, s.wall_time""").fetchall()
    out: dict[str, dict[float, float]] = {}
    for pool, x, y in rows:
        out.setdefault(pool, {})[round(x, 3)] = y
    return out


def open_overlay(server: str, shot: str, drop: str = "", **extra: str) -> tuple[list[dict], str]:
    params = [("run", "fault_midrun"), ("refresh", "off"), *[("runs_sel", r) for r in RUNS],
              ("runs_metric", "max |lr|"), ("runs_group", "metadata.engine_version"),
              ("runs_x", "seconds since start")]
    params = [(k, v) for k, v in params if k != drop and k not in extra] + list(extra.items())
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
        page = b.new_context(viewport={"width": 1400, "height": 2200}).new_page()
        page.goto(f"{server}/runs?{urlencode(params)}")
        wait_drawn(page)
        chart(page, "runs_overlay").wait_for(timeout=60_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{shot}.png"), full_page=True)
        traces = chart(page, "runs_overlay").evaluate(TRACES)
        text = page.locator('[data-testid="stApp"]').inner_text()
        assert page.locator('[data-testid="stException"]').count() == 0
        b.close()
    return traces, text


def test_the_overlay_draws_one_trace_per_run_per_pool_with_the_stored_values(server: str, root: Path) -> None:
    traces, text = open_overlay(server, "several_runs_grouped")
    want = {run: reference(root / run) for run in RUNS}
    drawn = {(t["run"], t["pool"]) for t in traces}
    assert len(drawn) == len(traces)                            # one trace per (run, pool)
    assert drawn == {(run, pool) for run, pools in want.items() for pool in pools}
    for t in traces:
        ref = want[t["run"]][t["pool"]]
        got = {round(x, 3): v for x, v in zip(t["x"], t["value"])}
        assert all(y == v if v > 0 else 0 < y < min([w for w in t["value"] if w > 0] or [1.0])
                   for y, v in zip(t["y"], t["value"])), (t["run"], t["pool"])   # a zero drawn at the floor
        assert got.keys() == ref.keys(), (t["run"], t["pool"])
        assert all(abs(got[x] - ref[x]) <= 1e-9 * max(1.0, abs(ref[x])) for x in ref), (t["run"], t["pool"])
    # grouped by engine version: the two v2 runs share a colour, told apart by the dash; v1 differs
    style = {t["run"]: (t["color"], t["dash"]) for t in traces}
    assert style["stable_fleet"][0] == style["collapse_no_correction"][0] != style["fault_midrun"][0]
    assert style["stable_fleet"][1] != style["collapse_no_correction"][1]
    assert {t["name"] for t in traces} == {f"{r} · {v}" for r, v in RUNS.items()}
    assert "seconds since the run started" in text


def test_a_search_narrows_the_runs_offered_and_picks_those_it_matches(server: str, root: Path) -> None:
    traces, text = open_overlay(server, "several_runs_search", runs_q="FLEET", runs_x="step", drop="runs_sel")
    assert "1 of 3 run(s) match." in text
    assert {t["run"] for t in traces} == {"stable_fleet"}       # the default choice: the runs matching
    steps = sorted(s for (s,) in duckdb.sql(
        f"select step from read_parquet('{root / 'stable_fleet' / 'steps' / '*.parquet'}')").fetchall())
    assert all(sorted(t["x"]) == steps for t in traces)          # x: the run's own steps


# every annotation path of the overlay: the run it marks, its line style and the x of its lines
SHAPES = """el => (el.layout.shapes || []).filter(s => s.type === 'path').map(s => ({
    run: s.legendgroup || null, color: s.line.color, dash: s.line.dash || 'solid', width: s.line.width,
    x: [...(s.path || '').matchAll(/M([^,]+),/g)].map(m => Number(m[1]))}))"""
# a mark's style -> what it marks: (table, condition on its rows); the alert's resync trigger and
# the run's resync request share the purple dashed line
STYLES = {("#d62728", "solid"): [("alerts", "state = 'firing' and not coalesce(resync, false)")],
          ("#2ca02c", "dot"): [("alerts", "state = 'resolved'")],
          ("#9467bd", "dash"): [("alerts", "state = 'firing' and coalesce(resync, false)"),
                                ("events", "kind = 'resync_request'")],
          ("#9467bd", "solid"): [("events", "kind = 'resync'")],
          ("#555555", "solid"): [("events", "kind = 'weight_sync'")]}


def stored_marks(run_dir: Path) -> dict[tuple[str, str], set[float]]:
    """Style -> the seconds since run.json's started_at of the run's stored alert and run events
    it marks, from the Parquet files."""
    started = json.loads((run_dir / "run.json").read_text())["started_at"]
    out = {}
    for style, parts in STYLES.items():
        # a run in which no alert fired (the clean one) has no alerts table: no alert marks
        out[style] = {round(t - started, 6) for table, where in parts if any((run_dir / table).glob("*.parquet"))
                      for (t,) in duckdb.sql(f"select wall_time from read_parquet('{run_dir / table / '*.parquet'}') "
                                             f"where {where}").fetchall()}
    return {k: v for k, v in out.items() if v}


def test_each_run_gets_the_alert_and_sync_marks_of_its_stored_events(server: str, root: Path) -> None:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=find("chromium"), args=LAUNCH_ARGS)
        page = b.new_context(viewport={"width": 1400, "height": 2200}).new_page()
        params = [("run", "fault_midrun"), ("refresh", "off"), *[("runs_sel", r) for r in RUNS],
                  ("runs_x", "seconds since start")]
        page.goto(f"{server}/runs?{urlencode(params)}")
        wait_drawn(page)
        chart(page, "runs_overlay").wait_for(timeout=60_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "several_runs_marks.png"), full_page=True)
        shapes = chart(page, "runs_overlay").evaluate(SHAPES)
        b.close()
    drawn: dict[str, dict[tuple[str, str], set[float]]] = {}
    for s in shapes:
        drawn.setdefault(s["run"], {}).setdefault((s["color"], s["dash"]), set()).update(
            round(v, 6) for v in s["x"])
    assert set(drawn) == set(RUNS)                      # every path names its run
    for run in RUNS:
        want = stored_marks(root / run)
        assert want and drawn[run] == want, run        # each run's marks at its own events' times
