"""What a page opens on and marks, under AppTest on the project's sample runs: the Alerts page on
the alert firing now (then the one resolved last), the shared alert/resync lines on the
Corrections and Compare charts, the Pools share table in readable column names."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from mismatch_monitor import query
from mismatch_monitor.app import timeline
from mismatch_monitor.app.navigation import PAGES
from test_app_pages import charts, open_page

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
pytestmark = pytest.mark.skipif(not (SAMPLE_DATA / "fault_midrun").is_dir(), reason="no sample runs")
PAGE = {p.url_path: p for p in PAGES}


def events_of(run: str) -> pd.DataFrame:
    return query.alert_events(query.connect(), SAMPLE_DATA / run)


def layout_of(at, key: str) -> dict:  # noqa: ANN001
    chart = next(c for c in charts(at) if c.proto.id.endswith(f"-{key}"))
    return json.loads(chart.proto.spec)["layout"]


def event(step: int, alert: str, pool: str | None, state: str) -> dict:
    return {"step": step, "wall_time": float(step), "alert": alert, "pool": pool, "state": state}


@pytest.mark.parametrize("rows, lead", [
    ([event(1, "A", "x", "firing"), event(5, "B", "x", "firing"), event(7, "B", "x", "resolved"),
      event(6, "C", "y", "firing")], "C"),                           # firing now beats resolved later
    ([event(1, "A", "x", "firing"), event(2, "A", "x", "resolved"), event(3, "B", "x", "firing"),
      event(4, "B", "x", "resolved")], "B"),                         # none firing: the last resolved
    ([event(1, "Z", "x", "firing"), event(2, "A", "x", "firing"), event(3, "A", "x", "resolved")], "Z"),
    ([event(1, "A", "x", "firing"), event(2, "A", "y", "firing"), event(3, "A", "y", "resolved")], "A"),
    ([], None),
])
def test_the_lead_alert_is_the_one_firing_now_then_the_one_resolved_last(rows, lead) -> None:  # noqa: ANN001
    frame = pd.DataFrame(rows, columns=["step", "wall_time", "alert", "pool", "state"])
    assert timeline.lead_alert(frame) == lead


def test_the_alerts_page_opens_on_the_alert_firing_now(monkeypatch) -> None:  # noqa: ANN001
    ev = events_of("fault_midrun")
    firing = query.firing_alerts(ev)
    assert len(firing) and sorted(ev["alert"].unique())[0] not in set(firing["alert"])   # what the test needs
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["alerts"], "fault_midrun")
    chosen = at.selectbox(key="alerts_alert").value
    assert chosen in set(firing["alert"])
    assert chosen == firing.sort_values("step")["alert"].iloc[-1]    # of those firing, the latest
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["alerts"], "fault_midrun", alerts_alert="MismatchKLSpike")
    assert at.selectbox(key="alerts_alert").value == "MismatchKLSpike"  # a URL's choice is kept


def lines(layout: dict) -> list[dict]:
    """Each alert line of the annotation layer (a firing, a resolution or a resync trigger; the
    run's own weight syncs, resumes and resyncs are drawn in other styles, the run's resync
    requests like a trigger): its x and the opacity of its path."""
    alert_styles = {(timeline.MARKERS["firing"][1], "solid"), (timeline.MARKERS["resolved"][1], "dot"),
                    (timeline.RESYNC[1], "dash")}
    return [{"x0": x, "opacity": s["opacity"]} for s in layout.get("shapes", [])
            if s.get("yref") == "paper" and (s["line"].get("color"), s["line"].get("dash")) in alert_styles
            for x in timeline.positions(s)]


def test_corrections_charts_carry_the_alert_and_resync_lines(monkeypatch) -> None:  # noqa: ANN001
    steps = set(events_of("fault_midrun")["step"].astype(int))
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["corrections"], "fault_midrun")
    drawn = lines(layout_of(at, "corrections_series"))
    assert drawn and {int(s["x0"]) for s in drawn} <= steps     # runs of 120 steps: one bin per step
    assert {int(s["x0"]) for s in drawn} == steps


def test_compare_lines_carry_both_runs_alert_lines(monkeypatch) -> None:  # noqa: ANN001
    a, b = events_of("fault_midrun"), events_of("stable_fleet")
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["compare"], "fault_midrun", cmp_run="stable_fleet")
    drawn = lines(layout_of(at, "cmp_lines"))
    full = {int(s["x0"]) for s in drawn if s["opacity"] > 0.5}
    faint = {int(s["x0"]) for s in drawn if s["opacity"] < 0.5}
    assert full == set(a["step"].astype(int)) and faint == set(b["step"].astype(int))


def test_the_pools_share_table_shows_readable_column_names(monkeypatch) -> None:  # noqa: ANN001
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["pools"], "fault_midrun")
    table = next(d.value for d in at.dataframe if "share of samples" in d.value.columns)
    assert not [c for c in table.columns if "_" in c], list(table.columns)
    assert {"sequences", "tokens", "extreme-ratio tokens", "share of extreme-ratio tokens",
            "extreme share / sample share"} <= set(table.columns)
