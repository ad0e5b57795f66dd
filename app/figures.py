"""Chart builders: plain functions from small frames to plotly figures (no Streamlit).

Conventions: frames carry ``step`` and ``wall_time`` columns (the query layer's series); ``x`` is
"step" or "time". A metric series is drawn raw (thin, faint when smoothed) with its smoothed
line on top, so smoothing never hides a spike. A null value is a gap, never a zero. Each y axis
is linear or logarithmic by ``axes.choose`` (automatic, or forced per chart); a pool's colour is
``colors.assign``'s, the same on every page and in every run.
"""

from __future__ import annotations

import math
from typing import Literal, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import colors as palette
from . import formatting
from .axes import Scale, YScale, choose, ema, smooth, spans_decades  # noqa: F401 (re-exported)

XAxis = Literal["step", "time"]
NO_POOL = "(no pool)"
PALETTE = palette.PALETTE
UI_REVISION = "keep"   # plotly keeps zoom and legend choices while this stays the same


def x_values(df: pd.DataFrame, x: XAxis) -> pd.Series:
    if x == "time":
        return pd.to_datetime(df["wall_time"], unit="s", utc=True)
    return df["step"]


def x_title(x: XAxis, width: int = 1) -> str:
    if x == "time":
        return "wall time (UTC)"
    return "step" if width <= 1 else f"step (bins of {width} steps)"


def _order(value: object) -> tuple[int, float, str]:
    if isinstance(value, (int, float, np.integer, np.floating)):
        return (0, float(value), "")
    return (1, 0.0, str(value))


def group_names(df: pd.DataFrame, group: str | None) -> list[object]:
    """The groups of ``df`` in a stable order: numbers numerically, then names, null last."""
    if group is None:
        return [None]
    values = df[group].drop_duplicates().tolist()
    return sorted((v for v in values if not pd.isna(v)), key=_order) + [v for v in values if pd.isna(v)][:1]


def log_axis(fig: go.Figure, scale: Scale | None = None, values: np.ndarray | None = None,
             **where: int) -> None:
    """A logarithmic y axis with one labelled tick per decade, from the scale's floor when the
    values have zeros (drawn there)."""
    rng = scale.range(values) if scale is not None and values is not None else None
    fig.update_yaxes(type="log", dtick=1, **({"range": rng} if rng else {}), **where)


def apply_scale(fig: go.Figure, scale: Scale, values: np.ndarray, **where: int) -> None:
    if scale.log:
        log_axis(fig, scale, values, **where)


def color_map(names: Sequence[object], labels: Mapping[object, str] | None = None) -> dict[str, str]:
    """Label text -> colour: each pool's own, whatever else the figure shows (``colors.assign``)."""
    return palette.assign([(labels or {}).get(n, label(n)) for n in names], no_pool=NO_POOL)


def label(value: object) -> str:
    return NO_POOL if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


def _rows(df: pd.DataFrame, group: str | None, value: object) -> pd.DataFrame:
    if group is None:
        return df
    return df[df[group].isna()] if pd.isna(value) else df[df[group] == value]


def add_series(fig: go.Figure, df: pd.DataFrame, metric: str, *, group: str | None, x: XAxis,
               smoothing: float, colors: Mapping[str, str], row: int | None = None, col: int | None = None,
               showlegend: bool = True, name: str | None = None,
               labels: Mapping[object, str] | None = None, scale: Scale = Scale(False)) -> None:
    """Raw and smoothed traces of ``metric`` per group, into ``fig`` (a subplot when row/col);
    ``labels`` names the groups (default: their value). On a log ``scale`` zeros sit at its floor
    (the hover shows the value itself) and the smoothing is done on log values."""
    for value in group_names(df, group):
        part = _rows(df, group, value).sort_values("step")
        if not len(part):
            continue
        nm = name or ((labels or {}).get(value, label(value)) if group is not None else metric.split("/", 1)[-1])
        color = colors.get(nm, colors.get(label(value), PALETTE[0]))
        xs, ys = x_values(part, x), part[metric].to_numpy(np.float64)
        mode = "lines+markers" if len(part) <= 40 else "lines"
        raw = go.Scatter(x=xs, y=scale.shown(ys), customdata=ys, hovertemplate=f"{nm}: %{{customdata:{formatting.spec(metric).replace(',', '')}}}<extra></extra>",
                         mode=mode, name=nm if smoothing == 0 else f"{nm} (raw)",
                         legendgroup=nm, line=dict(color=color, width=1.2 if smoothing else 2),
                         marker=dict(size=4), opacity=0.35 if smoothing else 1.0, connectgaps=False,
                         showlegend=showlegend and smoothing == 0)
        fig.add_trace(raw, row=row, col=col)
        if smoothing:
            fig.add_trace(go.Scatter(x=xs, y=smooth(ys, smoothing, scale), mode="lines", name=nm, legendgroup=nm,
                                     line=dict(color=color, width=2.2), showlegend=showlegend),
                          row=row, col=col)


def finish(fig: go.Figure, height: int, title: str | None = None) -> go.Figure:
    """Common layout: white background, room for tick labels, the legend in a band at the top of
    the figure (above any subplot title)."""
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=70, r=20, t=90 if title else 60, b=50),
                      title=dict(text=title, y=0.98, yref="container") if title else None,
                      legend=dict(orientation="h", yref="container", y=0.99 if not title else 0.93,
                                  yanchor="top", x=0), hovermode="x unified", uirevision=UI_REVISION)
    return fig


def line_figure(df: pd.DataFrame, metric: str, *, group: str | None = None, x: XAxis = "step",
                smoothing: float = 0.0, title: str | None = None, y_title: str = "", width: int = 1,
                y_scale: YScale = "auto", height: int = 360,
                labels: Mapping[object, str] | None = None) -> go.Figure:
    fig = go.Figure()
    values = df[metric].to_numpy(np.float64)
    scale = choose(values, y_scale)
    add_series(fig, df, metric, group=group, x=x, smoothing=smoothing, labels=labels, scale=scale,
               colors=color_map(group_names(df, group), labels) if group else {})
    fig.update_yaxes(title=y_title, tickformat=formatting.tick_format(metric))
    apply_scale(fig, scale, values)
    fig.update_xaxes(title=x_title(x, width))
    return finish(fig, height, title)


def small_multiples(df: pd.DataFrame, metrics: Sequence[str], titles: Mapping[str, str], *,
                    group: str | None = None, x: XAxis = "step", smoothing: float = 0.0, width: int = 1,
                    cols: int = 2, height_per_row: int = 260, y_scale: YScale = "auto") -> go.Figure:
    """One subplot per metric, one line per group in each: groups side by side, metric by metric."""
    rows = max(1, math.ceil(len(metrics) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[titles.get(m, m) for m in metrics],
                        shared_xaxes=True, vertical_spacing=0.5 / max(rows * 2, 4), horizontal_spacing=0.08)
    colors = color_map(group_names(df, group)) if group else {}
    for i, metric in enumerate(metrics):
        r, c = i // cols + 1, i % cols + 1
        values = df[metric].to_numpy(np.float64)
        scale = choose(values, y_scale)
        add_series(fig, df, metric, group=group, x=x, smoothing=smoothing, colors=colors, row=r, col=c,
                   showlegend=i == 0 and group is not None, name=None if group else titles.get(metric, metric),
                   scale=scale)
        apply_scale(fig, scale, values, row=r, col=c)
        fig.update_yaxes(tickformat=formatting.tick_format(metric), row=r, col=c)
    for c in range(1, cols + 1):
        fig.update_xaxes(title=x_title(x, width), row=rows, col=c)
    return finish(fig, 60 + rows * height_per_row)


def percentile_bands(df: pd.DataFrame, quantiles: Sequence[tuple[str, str]], *, group: str | None = None,
                     x: XAxis = "step", width: int = 1, height_per_row: int = 300,
                     y_scale: YScale = "auto") -> go.Figure:
    """|lr| percentiles as stacked bands (p50 .. max), one panel per group, shared log y axis;
    coloured low to high on a sequential scale (quantiles are ordered, not pools)."""
    groups = group_names(df, group)
    cols = min(2, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[label(g) if group else "fleet" for g in groups],
                        shared_yaxes=True, vertical_spacing=0.12)
    values = np.concatenate([df[k].to_numpy(np.float64) for k, _ in quantiles]) if len(df) else np.array([])
    scale = choose(values, y_scale, decades=1.0)
    shades = palette.sequential(len(quantiles))
    for i, value in enumerate(groups):
        part = _rows(df, group, value).sort_values("step")
        for j, (key, name) in enumerate(quantiles):
            color = shades[j]
            fig.add_trace(go.Scatter(x=x_values(part, x), y=scale.shown(part[key]), name=name, legendgroup=name,
                                     mode="lines", line=dict(color=color, width=1.5), connectgaps=False,
                                     fill="tonexty" if j else None, showlegend=i == 0),
                          row=i // cols + 1, col=i % cols + 1)
    apply_scale(fig, scale, values)
    fig.update_yaxes(tickformat="~g")   # plain or scientific, never an SI prefix ("100μ")
    fig.update_yaxes(title="|log ρ|", col=1)
    fig.update_xaxes(title=x_title(x, width), row=rows)
    return finish(fig, 60 + rows * height_per_row)


def drift_figure(df: pd.DataFrame, mean: str, std_error: str, *, group: str | None = None, x: XAxis = "step",
                 smoothing: float = 0.0, width: int = 1, height: int = 360) -> go.Figure:
    """Signed mean log ratio per group with a ±2 standard-error band and the zero line."""
    fig = go.Figure()
    colors = color_map(group_names(df, group)) if group else {}
    for value in group_names(df, group):
        part = _rows(df, group, value).sort_values("step")
        nm = label(value) if group else "fleet"
        color = colors.get(nm, PALETTE[0])
        lo = part[mean] - 2 * part[std_error]
        hi = part[mean] + 2 * part[std_error]
        xs = x_values(part, x)
        fig.add_trace(go.Scatter(x=xs, y=hi, mode="lines", line=dict(width=0), hoverinfo="skip",
                                 legendgroup=nm, showlegend=False))
        fig.add_trace(go.Scatter(x=xs, y=lo, mode="lines", line=dict(width=0), fill="tonexty",
                                 fillcolor=_alpha(color, 0.15), hoverinfo="skip", legendgroup=nm,
                                 showlegend=False, name=f"{nm} ±2 s.e."))
    add_series(fig, df, mean, group=group, x=x, smoothing=smoothing, colors=colors,
               name=None if group else "fleet")
    fig.add_hline(y=0.0, line=dict(color="gray", dash="dot"))
    fig.update_yaxes(title="mean log ρ (signed)")
    fig.update_xaxes(title=x_title(x, width))
    return finish(fig, height)


def _alpha(hex_color: str, a: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{a})"


def share_bars(shares: pd.DataFrame) -> go.Figure:
    """Each pool's share of samples, tokens and extreme-ratio tokens, side by side."""
    fig = go.Figure()
    pools = [label(p) for p in shares["pool"]]
    for col, name, color in (("sample_share", "share of samples", "#636EFA"),
                             ("token_share", "share of tokens", "#AB63FA"),
                             ("extreme_share", "share of extreme-ratio tokens", "#EF553B")):
        values = shares[col].astype("float64")
        fig.add_trace(go.Bar(x=pools, y=values, name=name, marker_color=color,
                             text=[("—" if pd.isna(v) else f"{v:.1%}") for v in values], textposition="outside"))
    fig.update_yaxes(title="share", tickformat=".0%", rangemode="tozero")
    fig.update_layout(barmode="group")
    return finish(fig, 380)


OUTCOME_COLORS = {"reward": "#222222", "eval_reward": "#ff7f0e"}


def outcomes_figure(df: pd.DataFrame, *, x: XAxis = "step", smoothing: float = 0.0, height: int = 340) -> go.Figure:
    """Training outcomes (``name``, ``value`` per step, ``pool`` null for the whole batch) over
    steps: each name's whole-batch line in its own colour, each pool's line in the pool's."""
    fig = go.Figure()
    colors = color_map([p for p in group_names(df, "pool") if not pd.isna(p)])
    for name in df["name"].drop_duplicates().tolist():
        part = df[df["name"] == name]
        whole, pools = part[part["pool"].isna()], part[part["pool"].notna()]
        shown = str(name).replace("_", " ")       # "eval reward", as the tables name columns
        add_series(fig, whole, "value", group=None, x=x, smoothing=smoothing, name=shown,
                   colors={shown: OUTCOME_COLORS.get(str(name), PALETTE[0])})
        add_series(fig, pools, "value", group="pool", x=x, smoothing=smoothing, colors=colors,
                   labels={p: f"{shown} · {p}" for p in pools["pool"].unique()})
    fig.update_yaxes(title="value")
    fig.update_xaxes(title=x_title(x))
    return finish(fig, height)
