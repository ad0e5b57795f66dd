"""A chart's zoom kept in the URL (``app/zoom.py``): which values are ranges of the axis shown,
and a page drawn with the URL's range (AppTest). The browser half (a zoom written to the URL, a
copied URL reopening it) is in test_dashboard_views.py."""

from __future__ import annotations

import json

import pytest

from mismatch_monitor.app import zoom
from mismatch_monitor.app.navigation import PAGES
from test_app_pages import charts, open_page
from test_app_runs import DashboardRoot, dashboard_root

POOLS_PAGE = next(p for p in PAGES if p.url_path == "pools")


@pytest.mark.parametrize("text, x, want", [
    ("10~20.5", "step", [10.0, 20.5]),
    ("2026-12-01 17:00:00~2026-12-01 17:05:00.5", "time", ["2026-12-01 17:00:00", "2026-12-01 17:05:00.5"]),
    (None, "step", None), ("", "step", None),
    ("20~10", "step", None),                      # inverted
    ("10~10", "step", None),                      # empty
    ("1~2~3", "step", None), ("nan~3", "step", None), ("1~inf", "step", None), ("a~b", "step", None),
    ("2026-12-01~2026-12-02", "step", None),      # a time range on a step axis
    ("x~y", "time", None),
    ("1~" + "9" * 100, "step", None),             # longer than any range
])
def test_a_url_value_is_read_as_a_range_of_the_axis_shown(text, x, want) -> None:  # noqa: ANN001
    assert zoom.parse(text, x) == want


def test_a_reported_range_is_written_back_as_it_reads() -> None:
    assert zoom.text(["12.5", "40"], "step") == "12.5~40"
    assert zoom.parse(zoom.text(["12.5", "40"], "step"), "step") == [12.5, 40.0]
    assert zoom.text(["40", "12.5"], "step") is None
    assert zoom.text([], "step") is None


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> DashboardRoot:
    return dashboard_root(str(tmp_path_factory.getbasetemp() / "dashboard"))


def chart(at, key: str):  # noqa: ANN001, ANN201
    return next(c for c in charts(at) if c.proto.id.endswith(f"-{key}"))


def x_ranges(chart) -> list:  # noqa: ANN001 - an AppTest plotly element
    layout = json.loads(chart.proto.spec)["layout"]
    return [v.get("range") for k, v in layout.items() if k.startswith("xaxis")]


def test_a_zoom_in_the_url_is_drawn_on_every_subplot(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, POOLS_PAGE, "fleet", pools_series_x="3~9.5")
    ranges = x_ranges(chart(at, "pools_series"))
    assert len(ranges) > 1 and all(r == [3.0, 9.5] for r in ranges), ranges
    at = open_page(monkeypatch, runs.root, POOLS_PAGE, "fleet", pools_series_x="9.5~3")  # crafted: ignored
    assert all(r is None for r in x_ranges(chart(at, "pools_series")))


@pytest.mark.parametrize("values, want", [
    (["1~linear~0.5~2", "3~log~-4~-1.5"], {1: ("linear", [0.5, 2.0]), 3: ("log", [-4.0, -1.5])}),
    (["2~log~-1~-3"], {}),                         # inverted
    (["0~linear~0~1", "100~linear~0~1"], {}),      # no such axis number
    (["1~LIN~0~1", "1~linear~a~1", "1~linear~0~inf", "1~linear~0", "x"], {}),
])
def test_a_url_value_is_read_as_a_y_range_of_an_axis(values, want) -> None:  # noqa: ANN001
    assert zoom.parse_y(values) == want


def test_a_reported_view_is_written_back_as_it_reads() -> None:
    got = zoom.y_text({"2": ["log", -3, -1.5], "1": ["linear", 5, 1], "4": ["linear", 0.25, 0.75]})
    assert got == ["2~log~-3~-1.5", "4~linear~0.25~0.75"]            # the inverted range left out
    assert zoom.parse_hidden(["fp8", "", "x" * 500]) == {"fp8"}


def y_ranges(chart) -> dict:  # noqa: ANN001 - an AppTest plotly element
    layout = json.loads(chart.proto.spec)["layout"]
    return {k: (v.get("type"), v.get("range")) for k, v in layout.items() if k.startswith("yaxis")}


def test_y_zooms_and_hidden_pools_in_the_url_are_drawn(monkeypatch, runs: DashboardRoot) -> None:
    at = open_page(monkeypatch, runs.root, POOLS_PAGE, "fleet", pools_series_y="linear",
                   pools_series_yr=["2~linear~0.001~0.002", "3~log~-3~-1"], pools_series_hide="fp8")
    c = chart(at, "pools_series")
    ys = y_ranges(c)
    assert ys["yaxis2"] == (None, [0.001, 0.002])       # a linear axis, a range taken on one
    assert ys["yaxis3"][1] is None                      # a log range is not drawn on a linear axis
    assert all(r is None for k, (_, r) in ys.items() if k not in ("yaxis2",))
    traces = json.loads(c.proto.spec)["data"]
    hidden = {t.get("legendgroup") for t in traces if t.get("visible") == "legendonly"}
    assert hidden == {"fp8"} and any(t.get("legendgroup") == "bf16" and "visible" not in t for t in traces)
