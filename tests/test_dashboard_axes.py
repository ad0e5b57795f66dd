"""Y scales, zeros on log axes, smoothing in the axis' space, stable pool colours and the routing
grid's zero-flip cells: plain functions, no Streamlit.

Runtime: about 2 s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from mismatch_monitor.app import axes, colors, figures, heatmaps, routing_cells, timeline

K3 = "mismatch/k3_kl"


def frame(values: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"step": s, "wall_time": 1.7e9 + s, "pool": p, K3: v}
                         for p, vs in values.items() for s, v in enumerate(vs)])


def test_one_exact_zero_keeps_the_log_axis_and_sits_at_the_floor() -> None:
    df = frame({"bf16": [0.0, 1e-6, 1e-4, 1e-2]})
    fig = figures.line_figure(df, K3, group="pool")
    assert fig.layout.yaxis.type == "log"
    y = np.asarray(fig.data[0].y, dtype=float)
    assert y[0] == pytest.approx(1e-7)                       # a decade below the smallest positive
    assert list(fig.data[0].customdata)[0] == 0.0            # the hover shows the zero itself
    lo, hi = fig.layout.yaxis.range
    assert lo < math.log10(1e-7) < math.log10(1e-2) < hi     # the floor is inside the axis


def test_a_forced_scale_overrides_the_automatic_one_per_chart() -> None:
    df = frame({"bf16": [0.1, 0.2, 0.3]})
    assert figures.line_figure(df, K3, group="pool").layout.yaxis.type in (None, "linear", "-")
    assert figures.line_figure(df, K3, group="pool", y_scale="log").layout.yaxis.type == "log"
    wide = frame({"bf16": [1e-6, 1e-2, 1e-3]})
    assert figures.line_figure(wide, K3, group="pool", y_scale="linear").layout.yaxis.type in (None, "linear", "-")
    with pytest.raises(ValueError, match="expected a y scale"):
        axes.choose([1.0], "sqrt")  # type: ignore[arg-type]


def test_small_multiples_and_timeline_take_the_scale() -> None:
    df = frame({"bf16": [0.0, 1e-6, 1e-2], "fp8": [1e-5, 0.0, 1e-3]})
    fig = figures.small_multiples(df, [K3], {K3: "k3"}, group="pool")
    assert fig.layout.yaxis.type == "log"
    events = pd.DataFrame({"step": [1], "wall_time": [1.7e9 + 1], "alert": ["a"], "pool": ["fp8"],
                           "state": ["firing"], "value": [0.0], "summary": [""], "resync": [False]})
    tl = timeline.alert_timeline(df, events, K3, metric_label="k3")
    assert tl.layout.yaxis.type == "log"
    marker = [t for t in tl.data if t.name == "firing"][0]
    assert marker.y[0] > 0                                   # on the floor, not off the log axis


def test_smoothing_is_done_on_log_values_on_a_log_axis() -> None:
    v = np.array([1e-6, 1e-2, 1e-6, 1e-2, 0.0])
    scale = axes.choose(v)
    got = axes.smooth(v, 0.5, scale)
    shown = np.where(v > 0, v, scale.floor)
    want = 10 ** figures.ema(np.log10(shown), 0.5)           # geometric, not arithmetic, averaging
    assert np.allclose(got, want, rtol=1e-12)
    assert got[2] < 1e-3                                     # an arithmetic EMA would sit near 5e-3
    assert np.allclose(axes.smooth(v, 0.5, axes.Scale(False)), figures.ema(v, 0.5))


def test_a_pool_keeps_its_colour_whatever_other_pools_a_figure_shows() -> None:
    one = figures.color_map(["bf16", "fp8", "int4"])
    other = figures.color_map(["fp8", "bf16"])
    alone = figures.color_map(["bf16"])
    assert one["bf16"] == other["bf16"] == alone["bf16"]
    assert one["fp8"] == other["fp8"]
    assert len(set(one.values())) == 3
    assert figures.color_map([None])[figures.NO_POOL] == colors.NO_POOL_COLOR


def test_no_named_pool_shares_the_colour_of_the_rows_without_a_pool() -> None:
    names = ["fp8", "bf16", "fp16", "fp32", "int4", "int8", "stale", "top_p"] + [f"pool{i}" for i in range(200)]
    assert colors.NO_POOL_COLOR not in {c.lower() for c in colors.PALETTE}
    assert colors.NO_POOL_COLOR not in set(figures.color_map(names).values())


def test_colliding_names_get_distinct_colours_deterministically() -> None:
    by_slot: dict[int, list[str]] = {}
    for i in range(200):
        by_slot.setdefault(colors.slot(f"pool{i}"), []).append(f"pool{i}")
    a, b = next(v for v in by_slot.values() if len(v) >= 2)[:2]
    first, second = colors.assign([a, b]), colors.assign([b, a])
    assert first == second and first[a] != first[b]
    assert first[min(a, b)] == colors.PALETTE[colors.slot(a)]   # the first in label order keeps its slot


def test_quantile_bands_use_a_sequential_palette_not_pool_colours() -> None:
    df = frame({"bf16": [1e-3, 1e-2]}).assign(q50=lambda d: d[K3], q99=lambda d: d[K3] * 10)
    fig = figures.percentile_bands(df, [("q50", "p50"), ("q99", "p99")], group="pool")
    got = [t.line.color for t in fig.data]
    assert got == colors.sequential(2)
    assert not set(got) & set(colors.PALETTE)


def test_routed_layers_without_a_flip_are_zero_not_blank() -> None:
    layers = pd.DataFrame({"step": [0, 0, 1], "wall_time": [1.0, 1.0, 2.0], "layer": [0, 1, 1],
                           "n_flips": [3, 1, 2], "n_routed_tokens": [10, 10, 20]})
    routed = pd.DataFrame({"step": [0, 1, 2, 3], "wall_time": [1.0, 2.0, 3.0, 4.0],
                           "n_routed_tokens": [10, 20, 525, 0]})
    full = routing_cells.with_zero_flips(layers, routed)
    got = {(r.step, r.layer): r.flip_rate for r in full.itertuples()}
    assert got == {(0, 0): 0.3, (0, 1): 0.1, (1, 0): 0.0, (1, 1): 0.1, (2, 0): 0.0, (2, 1): 0.0}
    fig = heatmaps.bucket_heatmap(full, "flip_rate", "layer", log_color=False)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert np.isfinite(z).all() and (z[:, 2] == 0).all()     # step 2: 525 tokens, 0 flips: zeros
    assert 3 not in set(full["step"])                        # no routed token: no observation


def test_log_coloured_heatmap_gives_an_observed_zero_the_floor_colour() -> None:
    df = pd.DataFrame({"step": [0, 0, 1], "wall_time": [1.0, 1.0, 2.0], "bucket": [0, 1, 0],
                       "v": [0.0, 1e-4, 1e-1]})
    z = np.asarray(heatmaps.bucket_heatmap(df, "v", "bucket").data[0].z, dtype=float)
    assert np.isfinite(z[0, 0]) and z[0, 0] < z[1, 0]        # zero: the lowest colour
    assert math.isnan(z[1, 1])                               # no row: blank


def events_frame() -> pd.DataFrame:
    return pd.DataFrame({"step": [3, 5, 7, 9], "wall_time": [1.7e9 + s for s in (3, 5, 7, 9)],
                         "alert": ["A", "A", "S", "B"], "pool": ["fp8", "fp8", "async", "bf16"],
                         "state": ["firing", "resolved", "firing", "firing"], "resync": [False, False, True, False],
                         "severity": ["warning"] * 4, "value": [1.0] * 4, "threshold": [0.5] * 4,
                         "summary": [""] * 4})


def test_the_annotation_layer_draws_each_event_on_every_column_without_stretching_axes() -> None:
    df = frame({"bf16": [1e-6, 1e-4, 1e-2] * 4})
    fig = figures.small_multiples(df, [K3, K3, K3], {}, group="pool", cols=3)
    timeline.annotate(fig, events_frame(), first=0, width=2)
    lines = [(x, s.xref, s.line.color) for s in fig.layout.shapes for x in timeline.positions(s)]
    assert len(lines) == 4 * 3                                    # every event, in each column
    assert {x for x, _, _ in lines} == {2, 4, 6, 8}               # the step bins the events fall in
    assert {c for x, _, c in lines if x == 6} == {timeline.RESYNC[1]}
    assert {xref for _, xref, _ in lines} == {"x", "x2", "x3"}
    assert all(s.yref == "paper" for s in fig.layout.shapes)      # shapes: the data range is untouched
    assert len(fig.layout.shapes) == 3 * 3                        # one path per kind and column


def run_events_frame() -> pd.DataFrame:
    return pd.DataFrame({"step": [0, 1, 2, 3, 4, 4], "wall_time": [1.7e9 + s for s in (0, 1, 2, 3, 4, 4)],
                         "kind": ["weight_sync", "weight_sync", "resume", "weight_sync", "resync", "resync_request"],
                         "pool": ["bf16", "bf16", None, "fp8", "async", "async"], "version": [0, 1, None, 3, 4, None],
                         "message": [""] * 6})


def test_run_events_join_the_annotation_layer_syncs_as_ticks_at_the_foot() -> None:
    df = frame({"bf16": [1e-6, 1e-4, 1e-2] * 4})
    fig = figures.small_multiples(df, [K3, K3], {}, group="pool", cols=2)
    timeline.annotate(fig, events_frame().iloc[:0], first=0, width=2, run_events=run_events_frame())
    by_colour = {}
    for s in fig.layout.shapes:
        by_colour.setdefault((s.line.color, s.line.dash), set()).update(timeline.positions(s))
    sync, resume = timeline.RUN_EVENT_STYLE["weight_sync"], timeline.RUN_EVENT_STYLE["resume"]
    assert by_colour[(sync[0], sync[1])] == {0, 2}                # steps 0, 1 and 3 in bins of 2
    assert by_colour[(resume[0], resume[1])] == {2}
    assert by_colour[(timeline.RESYNC[1], "solid")] == {4} and by_colour[(timeline.RESYNC[1], "dash")] == {4}
    ticks = [s for s in fig.layout.shapes if s.line.color == sync[0]]
    assert all(f"V{timeline.RUG_HEIGHT}" in s.path for s in ticks) and len(ticks) == 2   # at the foot, per column
    on_time = timeline.annotate(go.Figure(), events_frame().iloc[:0], x="time", run_events=run_events_frame())
    assert {x for s in on_time.layout.shapes for x in timeline.positions(s)} == {
        (1.7e9 + s) * 1000 for s in (0, 1, 2, 3, 4)}               # a date axis: ms since the epoch


def test_changes_list_firing_first_then_recently_resolved_with_since() -> None:
    got = timeline.changes(events_frame(), last_step=9, recent=5)
    assert list(zip(got["state"], got["alert"], got["pool"], got["since"])) == [
        ("firing", "B", "bf16", 9), ("firing", "S", "async", 7), ("resolved", "A", "fp8", 5)]
    assert got.loc[got["alert"] == "A", "first_fired"].item() == 3
    assert got.loc[got["alert"] == "S", "resyncs"].item() == 1
    assert list(timeline.changes(events_frame(), last_step=20, recent=5)["alert"]) == ["B", "S"]


def test_changes_count_every_resync_a_held_firing_asked() -> None:
    """A held firing asks again at each relapse without a new alert row: its resyncs come from the
    run's resync_request events (a fleet-wide alert's pool is null)."""
    events = pd.concat([events_frame(), events_frame().iloc[[3]].assign(alert="F", pool=None, resync=True)])
    asked = pd.DataFrame({"step": [8, 11, 14, 10], "pool": ["async", "async", "async", None],
                          "alert": ["S", "S", "S", "F"]})
    got = timeline.changes(events, last_step=14, recent=20, resyncs=asked).set_index("alert")
    assert got["resyncs"].to_dict() == {"S": 3, "F": 1, "B": 0, "A": 0}


def test_formats_come_from_the_metric_declarations() -> None:
    from mismatch_monitor.app import formatting

    from mismatch_monitor import metrics

    share = "mismatch/extreme_fraction"
    assert metrics.unit_of(share) == "share"
    assert formatting.value(share, 0.0123) == format(0.0123, metrics.format_of(share))   # its declared format
    assert formatting.value(share, 0.0123).startswith("1.23") and formatting.value(share, 0.0123).endswith("%")
    assert formatting.value("mismatch/k3_kl", 1e-4) == "0.0001"           # no "100μ"
    assert formatting.value("mismatch/k3_kl", None) == "—"
    assert formatting.tick_format("mismatch/extreme_fraction").endswith("%")
    assert "s" not in formatting.tick_format("mismatch/k3_kl")            # d3 "s" is SI prefixes
    assert formatting.metric_label("mismatch/abs_log_ratio/p999") == "p99.9 |lr|"
    table = formatting.readable(pd.DataFrame({"mean_abs_lr": [0.5], "pool": [None]}))
    assert list(table.columns) == ["mean |lr|", "pool"] and table["pool"].item() == "—"
