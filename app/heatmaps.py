"""Heatmap builders over steps: the |log ρ| histogram, bucketed metrics, per-layer flip rates.

Columns are step bins (or their wall time), rows are histogram bins or buckets. An empty cell (no
observation) is left blank, never drawn as zero. Counts and metrics that span decades are
coloured on a log10 scale with the colorbar labelled in the original units.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from mismatch_monitor.engine.histogram import LogBins

from .axes import choose
from .figures import XAxis, finish, x_title, x_values


def colorscale(name: str) -> list[list[object]]:
    """A named plotly colour scale with ``rgb()`` stops. Streamlit's front end rewrites the hex
    colours "#000001"... (its theme placeholders), which Inferno starts with."""
    scale = plotly.colors.get_colorscale(name)
    return [[pos, "rgb({}, {}, {})".format(*plotly.colors.hex_to_rgb(c)) if c.startswith("#") else c]
            for pos, c in scale]


def _decade_ticks(lo: float, hi: float) -> tuple[list[float], list[str]]:
    lo_i, hi_i = math.floor(lo), math.ceil(hi)
    vals = list(range(lo_i, hi_i + 1))
    return [float(v) for v in vals], [f"{10.0 ** v:g}" for v in vals]


def _columns(df: pd.DataFrame, x: XAxis) -> tuple[pd.Index, pd.Series]:
    """Sorted step bins and the x value (step or wall time) of each."""
    cols = df.drop_duplicates("step").sort_values("step")
    return pd.Index(cols["step"].to_numpy()), x_values(cols, x).reset_index(drop=True)


def hist_heatmap(hist: pd.DataFrame, bins: LogBins, *, x: XAxis = "step", width: int = 1,
                 rows_per_decade: int = 12, height: int = 460) -> go.Figure:
    """Token counts per |log ρ| range (rows, log y axis) and step bin (columns), log colour.

    Adjacent histogram bins are summed into about ``rows_per_decade`` rows per decade (counts add
    exactly; a row reads as the range of its bins). The zero bin (|log ρ| below hist_min) has no
    place on a log axis: its count is given in the title instead.
    """
    fig = go.Figure()
    if not len(hist):
        return fig
    steps, xs = _columns(hist, x)
    zero = int(hist.loc[hist["bin"] == 0, "count"].sum())
    body = hist[hist["bin"] > 0]
    if not len(body):
        fig.update_layout(title=f"all {zero:,} tokens have |log ρ| below {bins.min_value:g}")
        return fig
    per_row = max(1, round(math.log(10.0) / bins.log_gamma / rows_per_decade))
    row = (body["bin"].to_numpy() - 1) // per_row
    grid = body.assign(_row=row).pivot_table(index="_row", columns="step", values="count", aggfunc="sum")
    used = np.arange(int(row.min()), int(row.max()) + 1)
    counts = grid.reindex(index=used, columns=steps).to_numpy(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(counts > 0, np.log10(np.where(counts > 0, counts, 1.0)), np.nan)
    first_bin = used * per_row + 1
    lo = bins.lower_edge(first_bin)
    hi = bins.lower_edge(np.minimum(first_bin + per_row, bins.overflow_bin))
    y = bins.representative(np.minimum(first_bin + per_row // 2, bins.overflow_bin))
    ranges = np.array([f"{a:.3g}–{b:.3g}" for a, b in zip(lo, hi)])
    finite = z[np.isfinite(z)]
    tickvals, ticktext = _decade_ticks(0.0, float(finite.max()) if finite.size else 1.0)
    hover = np.empty(counts.shape + (2,), dtype=object)   # [rows, columns, (count, range)]
    hover[..., 0] = np.nan_to_num(counts)
    hover[..., 1] = ranges[:, None]
    fig.add_trace(go.Heatmap(
        x=xs, y=y, z=z, customdata=hover,
        colorscale=colorscale("Viridis"), hoverongaps=False,
        colorbar=dict(title="tokens", tickvals=tickvals, ticktext=ticktext),
        hovertemplate="x=%{x}<br>|log ρ| in %{customdata[1]}<br>tokens=%{customdata[0]:,.0f}<extra></extra>"))
    fig.update_yaxes(type="log", dtick=1, title="|log ρ| (log scale)", tickformat="~g")  # no SI prefix
    fig.update_xaxes(title=x_title(x, width))
    title = f"{zero:,} tokens with |log ρ| < {bins.min_value:g} not shown" if zero else None
    finish(fig, height, title)
    return fig


def bucket_heatmap(df: pd.DataFrame, value: str, bucket: str, *, labels: Mapping[object, str] | None = None,
                   order: Sequence[object] | None = None, x: XAxis = "step", width: int = 1,
                   value_title: str = "", log_color: bool | None = None, height: int = 380,
                   y_title: str | None = None) -> go.Figure:
    """``value`` per ``bucket`` (rows) and step bin (columns); blank where there is no observation."""
    fig = go.Figure()
    if not len(df):
        return fig
    steps, xs = _columns(df, x)
    names = dict(labels or {})
    keys = list(order) if order is not None else sorted(df[bucket].dropna().unique().tolist())
    row_names = [names.get(k, str(k)) for k in keys]
    if df[bucket].isna().any():
        row_names.append("(none)")
    frame = df.assign(_row=[("(none)" if pd.isna(v) else names.get(v, str(v))) for v in df[bucket]])
    grid = frame.pivot_table(index="_row", columns="step", values=value, aggfunc="first")
    grid = grid.reindex(index=row_names, columns=steps)
    values = grid.to_numpy(np.float64)
    scale = choose(values.ravel(), "auto" if log_color is None else "log" if log_color else "linear")
    colorbar: dict[str, object] = dict(title=value_title)
    z = values
    if scale.log:   # an observed zero takes the floor's colour; only a null cell is blank
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.log10(scale.shown(values))
        finite = z[np.isfinite(z)]
        if finite.size:
            colorbar["tickvals"], colorbar["ticktext"] = _decade_ticks(float(finite.min()), float(finite.max()))
    fig.add_trace(go.Heatmap(
        x=xs, y=row_names, z=z, customdata=values, colorscale=colorscale("Inferno"), hoverongaps=False,
        colorbar=colorbar,
        hovertemplate=f"x=%{{x}}<br>{bucket}=%{{y}}<br>{value_title or value}=%{{customdata:.4g}}<extra></extra>"))
    fig.update_yaxes(title=y_title or bucket, type="category")
    fig.update_xaxes(title=x_title(x, width))
    finish(fig, height)
    return fig
