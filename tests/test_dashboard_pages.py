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
from mismatch_monitor.query.events import resync_requests, run_events
from test_app_pages import charts, open_page

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
pytestmark = pytest.mark.skipif(not (SAMPLE_DATA / "fault_midrun").is_dir(), reason="no sample runs")
PAGE = {p.url_path: p for p in PAGES}


def events_of(run: str) -> pd.DataFrame:
    return query.alert_events(query.connect(), SAMPLE_DATA / run)


def marked_steps(run: str) -> set[int]:
    """The steps an alert line marks: each alert event's, and each resync request's (a held
    firing asks again each time its pool falls behind after a resync; drawn like a trigger)."""
    requests = resync_requests(run_events(query.connect(), SAMPLE_DATA / run))
    return set(events_of(run)["step"].astype(int)) | set(requests["step"].astype(int))


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
    run = "collapse_no_correction"                  # three alerts firing at the end, three resolved
    ev = events_of(run)
    firing = query.firing_alerts(ev)
    latest = firing.sort_values("step")["alert"].iloc[-1]
    assert len(firing) > 1 and sorted(ev["alert"].unique())[0] != latest   # what the test needs
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["alerts"], run)
    chosen = at.selectbox(key="alerts_alert").value
    assert chosen in set(firing["alert"])
    assert chosen == latest                                           # of those firing, the latest
    other = next(a for a in sorted(ev["alert"].unique()) if a not in set(firing["alert"]))
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["alerts"], run, alerts_alert=other)
    assert at.selectbox(key="alerts_alert").value == other            # a URL's choice is kept


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
    steps = marked_steps("fault_midrun")
    assert len(steps) > 2                           # the firing at 60 and the requests after it
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["corrections"], "fault_midrun")
    drawn = lines(layout_of(at, "corrections_series"))
    assert drawn and {int(s["x0"]) for s in drawn} <= steps     # runs of 120 steps: one bin per step
    assert {int(s["x0"]) for s in drawn} == steps


def test_compare_lines_carry_both_runs_alert_lines(monkeypatch) -> None:  # noqa: ANN001
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["compare"], "fault_midrun", cmp_run="collapse_no_correction")
    drawn = lines(layout_of(at, "cmp_lines"))
    full = {int(s["x0"]) for s in drawn if s["opacity"] > 0.5}
    faint = {int(s["x0"]) for s in drawn if s["opacity"] < 0.5}
    assert full == marked_steps("fault_midrun") and faint == marked_steps("collapse_no_correction")
    # the clean run raised nothing: compared with it, no faint line
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["compare"], "fault_midrun", cmp_run="stable_fleet")
    drawn = lines(layout_of(at, "cmp_lines"))
    assert marked_steps("stable_fleet") == set() and {int(s["x0"]) for s in drawn} == marked_steps("fault_midrun")
    assert all(s["opacity"] > 0.5 for s in drawn)


def test_the_pools_share_table_shows_readable_column_names(monkeypatch) -> None:  # noqa: ANN001
    at = open_page(monkeypatch, SAMPLE_DATA, PAGE["pools"], "fault_midrun")
    table = next(d.value for d in at.dataframe if "share of samples" in d.value.columns)
    assert not [c for c in table.columns if "_" in c], list(table.columns)
    assert {"sequences", "tokens", "extreme-ratio tokens", "share of extreme-ratio tokens",
            "extreme share / sample share"} <= set(table.columns)
