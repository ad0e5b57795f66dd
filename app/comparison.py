"""Two runs side by side: a metric per slice (bars) and over their own steps (lines)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .figures import XAxis, finish, label, log_axis, spans_decades, x_title, x_values

RUN_COLORS = ("#636EFA", "#EF553B")


def slice_names(table: pd.DataFrame, by: list[str]) -> list[str]:
    if not by:
        return ["all"] * len(table)
    return [" · ".join(f"{c}={label(v)}" for c, v in zip(by, row)) for row in table[by].itertuples(index=False)]


def flag_differences(table: pd.DataFrame, rel_threshold: float) -> pd.Series:
    """Rows whose relative difference reaches the threshold, or that one run lacks."""
    one_sided = table["a"].isna() ^ table["b"].isna()
    return (table["rel"].abs() >= rel_threshold).fillna(False) | one_sided


def compare_bars(table: pd.DataFrame, metric: str, by: list[str], *, names: tuple[str, str],
                 metric_label: str, rel_threshold: float = 0.25, height: int = 400) -> go.Figure:
    """Run A and run B per slice for one metric; slices that differ by the threshold are outlined
    and annotated with their relative change."""
    part = table[table["metric"] == metric].reset_index(drop=True)
    fig = go.Figure()
    if not len(part):
        return fig
    xs = slice_names(part, by)
    flagged = flag_differences(part, rel_threshold).to_numpy()
    for col, name, color in (("a", names[0], RUN_COLORS[0]), ("b", names[1], RUN_COLORS[1])):
        fig.add_trace(go.Bar(x=xs, y=part[col], name=name, marker_color=color,
                             marker_line=dict(width=np.where(flagged, 3, 0), color="black")))
    text = ["" if not f else ("only one run" if pd.isna(r) else f"{r:+.0%}")
            for f, r in zip(flagged, part["rel"])]
    top = np.nanmax(part[["a", "b"]].to_numpy(np.float64), axis=1) if len(part) else []
    for xv, yv, t in zip(xs, top, text):
        if t and np.isfinite(yv):
            fig.add_annotation(x=xv, y=yv, text=t, showarrow=False, yshift=12, font=dict(color="#d62728"))
    values = part[["a", "b"]].to_numpy(np.float64).ravel()
    fig.update_yaxes(title=metric_label)
    if spans_decades(values):
        log_axis(fig)
    fig.update_layout(barmode="group")
    finish(fig, height)
    return fig


def compare_lines(series_a: pd.DataFrame, series_b: pd.DataFrame, metric: str, *, names: tuple[str, str],
                  metric_label: str, x: XAxis = "step", height: int = 360) -> go.Figure:
    """The fleet value of ``metric`` in both runs, each over its own steps."""
    fig = go.Figure()
    for df, name, color in ((series_a, names[0], RUN_COLORS[0]), (series_b, names[1], RUN_COLORS[1])):
        if df is None or not len(df):
            continue
        df = df.sort_values("step")
        fig.add_trace(go.Scatter(x=x_values(df, x), y=df[metric], name=name, mode="lines",
                                 line=dict(color=color, width=2), connectgaps=False))
    both = pd.concat([d[metric] for d in (series_a, series_b) if d is not None and len(d)] or
                     [pd.Series([], dtype="float64")])
    fig.update_yaxes(title=metric_label)
    if spans_decades(both):
        log_axis(fig)
    fig.update_xaxes(title=x_title(x))
    finish(fig, height)
    return fig
