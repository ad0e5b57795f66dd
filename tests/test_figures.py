"""Chart builders on small frames: traces, axes, log scales, gaps, markers. No Streamlit.

Runtime: about 2 s.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from mismatch_monitor.app import comparison, figures, heatmaps, timeline
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine.histogram import LogBins

K3 = "mismatch/k3_kl"


def series(values: dict[str, list[float]]) -> pd.DataFrame:
    """One row per (step, pool) with metric K3 = the given values."""
    rows = [{"step": s, "wall_time": 1.7e9 + 60 * s, "pool": pool, K3: v}
            for pool, vs in values.items() for s, v in enumerate(vs)]
    return pd.DataFrame(rows)


def test_ema_matches_normalised_exponential_weights_and_skips_gaps() -> None:
    rng = np.random.default_rng(0)
    v = rng.normal(size=30)
    v[[4, 5, 17]] = np.nan
    w = 0.7
    got = figures.ema(v, w)
    seen = np.flatnonzero(np.isfinite(v))
    for i in range(len(v)):
        if not np.isfinite(v[i]):
            assert math.isnan(got[i])
            continue
        prior = seen[seen <= i]          # the k-th most recent observation weighs w**k
        weights = w ** np.arange(len(prior))[::-1]
        assert got[i] == pytest.approx(np.sum(weights * v[prior]) / np.sum(weights), rel=1e-12)
    assert np.array_equal(figures.ema(v, 0.0), v, equal_nan=True)
    with pytest.raises(ValueError, match="expected 0 <= weight < 1"):
        figures.ema(v, 1.0)


@pytest.mark.parametrize("values, decades, log", [
    ([1e-6, 1e-3, 1e-1], 2.0, True), ([0.5, 0.9, 1.0], 2.0, False), ([0.0, 1e-3, 1.0], 2.0, True),
    ([-1e-3, 1e-3, 1.0], 2.0, False), ([0.0, 0.0, 1.0], 2.0, False),
    ([1e-3, np.nan, 0.2], 2.0, True), ([1e-3, 5e-3], 1.0, False), ([1e-3], 0.0, False)])
def test_log_axes_where_positive_values_span_decades_zeros_allowed(values, decades, log) -> None:
    assert figures.spans_decades(values, decades) is log


def test_line_figure_draws_each_pool_raw_and_smoothed() -> None:
    df = series({"bf16": [1e-6, 2e-6, 1e-6, 3e-6], "fp8": [1e-5, 1e-4, np.nan, 1e-2]})
    plain = figures.line_figure(df, K3, group="pool")
    assert [t.name for t in plain.data] == ["bf16", "fp8"]
    assert plain.layout.yaxis.type == "log"                 # 1e-6 .. 1e-2: four decades
    assert math.isnan(plain.data[1].y[2]) and plain.data[1].connectgaps is False  # a gap, not a zero
    smooth = figures.line_figure(df, K3, group="pool", smoothing=0.5)
    names = [t.name for t in smooth.data]
    assert names == ["bf16 (raw)", "bf16", "fp8 (raw)", "fp8"]
    raw, smoothed = smooth.data[0], smooth.data[1]
    assert raw.opacity < 1 and smoothed.opacity in (None, 1)
    # a log axis: smoothed on log values (what the eye sees), a geometric EMA
    assert np.allclose(smoothed.y, 10 ** figures.ema(np.log10(df.loc[df["pool"] == "bf16", K3]), 0.5))
    assert raw.line.color == smoothed.line.color


def test_line_figure_on_wall_time_and_linear_values() -> None:
    df = series({"bf16": [0.5, 0.6, 0.55]})
    fig = figures.line_figure(df, K3, group="pool", x="time")
    assert fig.layout.xaxis.title.text == "wall time (UTC)"
    assert pd.Timestamp(fig.data[0].x[0]) == pd.Timestamp(1.7e9, unit="s")   # UTC, stored without zone
    assert fig.layout.yaxis.type in (None, "linear", "-")
    binned = figures.line_figure(df, K3, width=25)
    assert binned.layout.xaxis.title.text == "step (bins of 25 steps)"


def test_small_multiples_one_panel_per_metric() -> None:
    df = series({"bf16": [1e-6, 1e-3], "fp8": [2e-6, 1e-2]}).assign(ess=lambda d: [0.9, 0.8, 0.95, 0.7])
    fig = figures.small_multiples(df, [K3, "ess"], {K3: "k3 KL", "ess": "ESS"}, group="pool", cols=2)
    assert [a.text for a in fig.layout.annotations] == ["k3 KL", "ESS"]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type in (None, "linear", "-")
    assert len(fig.data) == 4 and sum(bool(t.showlegend) for t in fig.data) == 2   # one legend entry per pool


def test_percentile_bands_stack_p50_to_max_per_pool() -> None:
    keys = [("p50", "p50"), ("p99", "p99"), ("max", "max")]
    df = pd.DataFrame({"step": [0, 1, 0, 1], "wall_time": [0, 1, 0, 1], "pool": ["a", "a", "b", "b"],
                       "p50": [1e-4, 2e-4, 1e-4, 1e-4], "p99": [1e-2, 3e-2, 1e-3, 1e-3], "max": [1.0, 2.0, 0.1, 0.1]})
    fig = figures.percentile_bands(df, keys, group="pool")
    assert [a.text for a in fig.layout.annotations] == ["a", "b"]
    assert [t.fill for t in fig.data[:3]] == [None, "tonexty", "tonexty"]
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"


def test_drift_band_is_two_standard_errors() -> None:
    df = pd.DataFrame({"step": [0, 1], "wall_time": [0, 1], "mean": [0.01, -0.02], "se": [0.001, 0.004]})
    fig = figures.drift_figure(df, "mean", "se")
    hi, lo = fig.data[0], fig.data[1]
    assert np.allclose(hi.y, [0.012, -0.012]) and np.allclose(lo.y, [0.008, -0.028]) and lo.fill == "tonexty"


def test_share_bars_compare_sample_and_tail_shares() -> None:
    shares = pd.DataFrame({"pool": ["bf16", "fp8"], "sample_share": [0.9, 0.1], "token_share": [0.88, 0.12],
                           "extreme_share": [0.71, 0.29]})
    fig = figures.share_bars(shares)
    assert [t.name for t in fig.data] == ["share of samples", "share of tokens", "share of extreme-ratio tokens"]
    assert list(fig.data[2].text) == ["71.0%", "29.0%"] and fig.layout.barmode == "group"


def test_histogram_heatmap_log_axis_exact_counts_and_zero_bin() -> None:
    bins = LogBins.from_config(MetricConfig())
    values = {0: [1e-3, 1e-3, 2e-2, 0.5], 1: [1e-3, 0.7, 0.7, 3.0]}
    rows = []
    for step, vs in values.items():
        idx = np.array([int(np.ceil(np.log(v) / bins.log_gamma)) - bins.k_min + 1 for v in vs])
        for b, c in zip(*np.unique(idx, return_counts=True)):
            rows.append({"step": step, "wall_time": step, "bin": int(b), "count": int(c)})
    rows.append({"step": 1, "wall_time": 1, "bin": 0, "count": 5})          # |lr| below hist_min
    hist = pd.DataFrame(rows)
    fig = heatmaps.hist_heatmap(hist, bins)
    trace = fig.data[0]
    assert fig.layout.yaxis.type == "log"
    counts = np.array(trace.customdata)[..., 0].astype(float)
    assert counts.sum() == 8 and counts[:, 0].sum() == 4 and counts[:, 1].sum() == 4
    z = np.array(trace.z, dtype=float)
    assert np.allclose(z[counts > 0], np.log10(counts[counts > 0])) and np.isnan(z[counts == 0]).all()
    assert "5 tokens" in fig.layout.title.text
    y = np.array(trace.y, dtype=float)
    assert np.all(np.diff(np.log10(y)) > 0)
    for col, vs in values.items():   # each value lands in a row within a row's height (1/12 decade)
        for v in vs:
            near = np.abs(np.log10(y) - np.log10(v)) <= 1 / 12 + 1e-9
            assert (counts[near, col] > 0).any(), v
    assert heatmaps.hist_heatmap(hist.iloc[:0], bins).data == ()


def test_bucket_heatmap_leaves_missing_cells_blank_and_colours_decades_on_log() -> None:
    df = pd.DataFrame({"step": [0, 0, 1], "wall_time": [0, 0, 1], "bucket": [0, 1, 1], "v": [1e-5, 1e-2, 1e-1]})
    fig = heatmaps.bucket_heatmap(df, "v", "bucket", labels={0: "p < 0.001", 1: "p ≥ 0.001"}, order=[0, 1])
    trace = fig.data[0]
    assert list(trace.y) == ["p < 0.001", "p ≥ 0.001"]
    values = np.array(trace.customdata, dtype=float)
    assert math.isnan(values[0, 1]) and values[1, 1] == pytest.approx(0.1)
    assert np.allclose(np.array(trace.z, dtype=float)[1], [-2.0, -1.0])          # log10 colour
    assert list(trace.colorbar.ticktext) == ["1e-05", "0.0001", "0.001", "0.01", "0.1"]
    linear = heatmaps.bucket_heatmap(df, "v", "bucket", log_color=False)
    assert np.allclose(np.array(linear.data[0].z, dtype=float)[1], [0.01, 0.1])


def test_colour_scales_avoid_streamlits_placeholder_colours() -> None:
    for name in ("Inferno", "Viridis"):
        stops = heatmaps.colorscale(name)
        assert all(c.startswith("rgb(") for _, c in stops)
        assert stops[0][1] != "#000004"


def test_alert_timeline_puts_events_on_the_pool_line() -> None:
    df = series({"bf16": [1e-6, 1e-6, 1e-6, 1e-6], "fp8": [1e-6, 1e-5, 1e-4, 1e-6]})
    events = pd.DataFrame({"step": [1, 3, 2], "wall_time": [0, 0, 0], "alert": ["A", "A", "B"],
                           "pool": ["fp8", "fp8", "bf16"], "state": ["firing", "resolved", "firing"],
                           "value": [9.0, 9.0, 2.0], "summary": ["s", "s", "s"], "resync": [False, False, True]})
    fig = timeline.alert_timeline(df, events, K3, metric_label="k3 KL")
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["firing"].x) == [1, 2] and np.allclose(by_name["firing"].y, [1e-5, 1e-6])
    assert list(by_name["resolved"].x) == [3] and np.allclose(by_name["resolved"].y, [1e-6])
    assert list(by_name["resync triggered"].x) == [2] and len(fig.layout.shapes) == 1
    assert fig.layout.yaxis.type == "log"


def test_alert_timeline_bins_events_with_the_series() -> None:
    df = pd.DataFrame({"step": [0, 10], "wall_time": [0, 1], "pool": ["fp8", "fp8"], K3: [1.0, 2.0]})
    events = pd.DataFrame({"step": [13], "wall_time": [0], "pool": ["fp8"], "value": [5.0]})
    placed = timeline.event_positions(df, events, K3, first=0, width=10)
    assert placed["bin"].tolist() == [10] and placed["y"].tolist() == [2.0]
    orphan = timeline.event_positions(df, events.assign(pool="int4"), K3, first=0, width=10)
    assert orphan["y"].tolist() == [5.0]                 # no line for the pool: the event's own value


def test_compare_bars_flag_large_and_one_sided_differences() -> None:
    table = pd.DataFrame({"pool": ["bf16", "fp8", "int4"], "metric": [K3] * 3, "a": [1.0, 1.0, np.nan],
                          "b": [1.1, 3.0, 2.0]})
    table["diff"] = table["b"] - table["a"]
    table["rel"] = table["b"] / table["a"] - 1
    flagged = comparison.flag_differences(table, 0.25)
    assert flagged.tolist() == [False, True, True]
    fig = comparison.compare_bars(table, K3, ["pool"], names=("A", "B"), metric_label="k3")
    assert list(fig.data[0].x) == ["pool=bf16", "pool=fp8", "pool=int4"]
    assert list(fig.data[0].marker.line.width) == [0, 3, 3]
    assert [a.text for a in fig.layout.annotations] == ["+200%", "only one run"]


def test_compare_lines_one_per_run() -> None:
    a = series({"x": [1e-6, 1e-3]}).drop(columns="pool")
    fig = comparison.compare_lines(a, a.assign(**{K3: [1e-6, 1e-6]}), K3, names=("A", "B"), metric_label="k3")
    assert [t.name for t in fig.data] == ["A", "B"] and fig.layout.yaxis.type == "log"
    assert len(comparison.compare_lines(a, None, K3, names=("A", "B"), metric_label="k3").data) == 1


def test_events_strip_has_a_row_per_alert_and_stars_for_resyncs() -> None:
    events = pd.DataFrame({"step": [1, 3, 2, 5], "wall_time": [0, 0, 0, 0], "alert": ["A", "A", "B", "B"],
                           "pool": ["fp8", "fp8", "bf16", "bf16"], "state": ["firing", "resolved", "firing", "firing"],
                           "resync": [False, False, True, False]})
    fig = timeline.events_strip(events)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["firing"].x) == [1, 2, 5] and list(by_name["firing"].y) == ["A", "B", "B"]
    assert list(by_name["resolved"].x) == [3]
    assert list(by_name["resync triggered"].x) == [2] and list(by_name["resync triggered"].y) == ["B"]
    assert list(fig.layout.yaxis.categoryarray) == ["B", "A"]
    assert timeline.events_strip(events.iloc[:0]).data == ()
