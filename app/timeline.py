"""Alert events and resync triggers drawn over the metric they fired on."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mismatch_monitor.report_keys import label_text

from .figures import (XAxis, add_series, color_map, finish, group_names, label, log_axis, spans_decades,
                      x_title)

# state -> (marker symbol, colour, legend name)
MARKERS: dict[str, tuple[str, str, str]] = {
    "firing": ("triangle-up", "#d62728", "firing"),
    "resolved": ("triangle-down", "#2ca02c", "resolved"),
}
RESYNC = ("star", "#9467bd", "resync triggered")


def event_positions(series: pd.DataFrame, events: pd.DataFrame, metric: str, *, first: int,
                    width: int) -> pd.DataFrame:
    """Events with the (binned) step they fall in and the metric's value there for their pool.

    The value is the pool's series value at that bin, or the event's own recorded value where
    the series has none (a fleet-wide alert, a pool without observation there).
    """
    ev = events.copy()
    ev["bin"] = first + (ev["step"].astype("int64") - first) // width * width
    lookup = {}
    if len(series) and metric in series.columns:
        pools = series["pool"] if "pool" in series.columns else pd.Series([None] * len(series))
        for b, p, v in zip(series["step"], pools, series[metric]):   # events name pools by label text
            lookup[(int(b), label_text(None if pd.isna(p) else str(p)))] = v
    ev["y"] = [np.nan if pd.isna(p) else lookup.get((int(b), p), np.nan)   # a null pool: a fleet-wide alert
               for b, p in zip(ev["bin"], ev["pool"])]
    ev["y"] = ev["y"].astype("float64").fillna(pd.to_numeric(ev["value"], errors="coerce"))
    return ev


def alert_timeline(series: pd.DataFrame, events: pd.DataFrame, metric: str, *, metric_label: str,
                   x: XAxis = "step", smoothing: float = 0.0, first: int = 0, width: int = 1,
                   height: int = 420) -> go.Figure:
    """The metric per pool over steps, with a marker per alert event (firing / resolved) and a
    star plus a vertical line per resync trigger, placed on the pool's line at the event's step."""
    fig = go.Figure()
    if len(series):
        add_series(fig, series, metric, group="pool", x=x, smoothing=smoothing,
                   colors=color_map(group_names(series, "pool")))
    ev = event_positions(series, events, metric, first=first, width=width) if len(events) else events
    for state, (symbol, color, name) in MARKERS.items():
        part = ev[ev["state"] == state] if len(ev) else ev
        if not len(part):
            continue
        xs = part["bin"] if x == "step" else pd.to_datetime(part["wall_time"], unit="s", utc=True)
        fig.add_trace(go.Scatter(
            x=xs, y=part["y"], mode="markers", name=name,
            marker=dict(symbol=symbol, size=12, color=color, line=dict(width=1, color="black")),
            text=[f"{a} · {label(p)} · step {s}<br>{t}" for a, p, s, t in
                  zip(part["alert"], part["pool"], part["step"], part["summary"].fillna(""))],
            hovertemplate="%{text}<extra></extra>"))
    resync = ev[(ev["state"] == "firing") & ev["resync"].fillna(False).astype(bool)] if len(ev) else ev
    if len(resync):
        xs = resync["bin"] if x == "step" else pd.to_datetime(resync["wall_time"], unit="s", utc=True)
        for xv in xs:
            fig.add_vline(x=xv, line=dict(color=RESYNC[1], dash="dash", width=1))
        fig.add_trace(go.Scatter(
            x=xs, y=resync["y"], mode="markers", name=RESYNC[2],
            marker=dict(symbol=RESYNC[0], size=16, color=RESYNC[1], line=dict(width=1, color="black")),
            text=[f"resync {label(p)} at step {s}" for p, s in zip(resync["pool"], resync["step"])],
            hovertemplate="%{text}<extra></extra>"))
    values = series[metric] if len(series) else pd.Series([], dtype="float64")
    fig.update_yaxes(title=metric_label)
    if spans_decades(values):
        log_axis(fig)
    fig.update_xaxes(title=x_title(x, width))
    finish(fig, height)
    return fig


def events_strip(events: pd.DataFrame, *, x: XAxis = "step", height_per_alert: int = 36) -> go.Figure:
    """Every event of a run on one timeline: a row per alert, a marker per event (its state),
    coloured by pool; resync triggers as stars."""
    fig = go.Figure()
    if not len(events):
        return fig
    names = sorted(events["alert"].dropna().unique().tolist())
    colors = color_map(group_names(events, "pool"))
    resync = (events["state"] == "firing") & events["resync"].fillna(False).astype(bool)
    for (symbol, _, name), rows, size in ((MARKERS["firing"], events["state"] == "firing", 10),
                                          (MARKERS["resolved"], events["state"] == "resolved", 10),
                                          (RESYNC, resync, 14)):
        part = events[rows]
        if not len(part):
            continue
        xs = part["step"] if x == "step" else pd.to_datetime(part["wall_time"], unit="s", utc=True)
        fig.add_trace(go.Scatter(
            x=xs, y=part["alert"], mode="markers", name=name,
            marker=dict(symbol=symbol, size=size, line=dict(width=1, color="black"),
                        color=[colors.get(label(p), "#888") for p in part["pool"]]),
            text=[f"{a} · {label(p)} · {s}" for a, p, s in zip(part["alert"], part["pool"], part["state"])],
            hovertemplate="%{text}<br>step %{x}<extra></extra>"))
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=names[::-1], title="")
    fig.update_xaxes(title=x_title(x))
    finish(fig, 120 + height_per_alert * len(names))
    fig.update_layout(hovermode="closest")
    return fig
