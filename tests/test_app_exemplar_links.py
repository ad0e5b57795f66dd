"""Links to the Exemplars page: the worst steps with their pool, and the (step, pool) of a point
clicked on a per-pool chart (as Streamlit hands plotly's selection to the script)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import numpy as np
import pandas as pd

from mismatch_monitor.app import exemplar_links, figures


def test_worst_step_links_name_the_pool_of_the_worst_token() -> None:
    steps = pd.DataFrame({"step": [3, 7, 9], "max_abs_log_ratio": [0.5, 2.0, 1.0], "pool": ["a", "b & c", None]})
    text = exemplar_links.worst_steps_markdown("run/1", steps, n=2)
    urls = [part.split("](")[1].rstrip(")") for part in text.split(" · [")]
    first, second = (parse_qs(urlsplit(u).query) for u in urls)
    assert first == {"run": ["run/1"], "step": ["7"], "pool": ["b & c"]}       # escaped, largest first
    assert second == {"run": ["run/1"], "step": ["9"]}                          # no pool: none in the link


def _series() -> pd.DataFrame:
    return pd.DataFrame({"step": [10, 11, 10, 11], "wall_time": [100.0, 105.5, 100.0, 105.5],
                         "pool": ["bf16", "bf16", None, None], "m": [1.0, 2.0, 3.0, 4.0]})


def test_a_click_names_the_step_and_pool_of_its_point() -> None:
    series = _series()
    points = [{"x": 11, "y": 2.0, "legendgroup": "alerts"}, {"x": 11, "y": 2.0, "legendgroup": "bf16"}]
    assert exemplar_links.clicked(points, series, "step") == (11, "bf16")     # an annotation line is skipped
    assert exemplar_links.clicked([{"x": 10, "legendgroup": figures.NO_POOL}], series, "step") == (10, None)
    assert exemplar_links.clicked([{"x": 10, "legendgroup": "fp8"}], series, "step") is None   # not a pool shown
    assert exemplar_links.clicked([], series, "step") is None
    when = "1970-01-01 00:01:45.5"                         # plotly's text of the wall time 105.5 s
    assert exemplar_links.clicked([{"x": when, "legendgroup": "bf16"}], series, "time") == (11, "bf16")
    assert exemplar_links.clicked([{"x": "1970-01-01 00:09:00", "legendgroup": "bf16"}], series, "time") is None


def test_the_pools_lines_get_markers_so_that_plotly_lets_them_be_clicked() -> None:
    series = pd.DataFrame({"step": np.arange(60).repeat(2), "wall_time": 0.0, "pool": ["a", "b"] * 60,
                           "m": np.linspace(1, 2, 120)})
    fig = figures.small_multiples(series, ["m"], {"m": "m"}, group="pool")
    assert {t.mode for t in fig.data} == {"lines"}                             # 60 steps: lines only
    fig.add_scatter(x=[1, 1], y=[0, 1], mode="lines", legendgroup="marks")
    exemplar_links.clickable(fig, series)
    assert [t.mode for t in fig.data] == ["lines+markers"] * 2 + ["lines"]


def test_a_bin_opens_its_step_with_the_largest_stored_ratio() -> None:
    steps = pd.DataFrame({"step": [10, 11, 12, 14, 15], "max_abs_log_ratio": [0.2, 0.9, 0.5, 3.0, 0.1]})
    assert exemplar_links.worst_in_bin(steps, 10, 4) == 11      # 14 lies in the next bin
    assert exemplar_links.worst_in_bin(steps, 14, 4) == 14
    assert exemplar_links.worst_in_bin(steps, 20, 4) is None     # no stored exemplar in the bin


def test_binned_points_name_their_steps_in_the_hover() -> None:
    series = pd.DataFrame({"step": [0, 4, 8, 0, 4, 8], "wall_time": [0.0] * 6,
                           "pool": ["a", "a", "a", "b", "b", "b"], "mismatch/k3": [1e-3, 2e-3, 1e-3, 5e-4, 0.0, 1e-4]})
    fig = exemplar_links.clickable(figures.line_figure(series, "mismatch/k3", group="pool", width=4), series, 4)
    for trace in fig.data:
        assert list(trace.text) == [exemplar_links.BINNED_HOVER.format(lo=b, hi=b + 3) for b in (0, 4, 8)]
        assert "%{text}" in trace.hovertemplate
    plain = exemplar_links.clickable(figures.line_figure(series, "mismatch/k3", group="pool"), series)
    assert all(t.text is None for t in plain.data)
