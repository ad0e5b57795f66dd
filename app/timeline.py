"""Alert events and resync triggers drawn over the metric they fired on."""

from __future__ import annotations

import re
from typing import Callable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from mismatch_monitor.query.logs import resync_firings
from mismatch_monitor.report_keys import label_text

from .axes import YScale, choose
from .figures import XAxis, add_series, apply_scale, color_map, finish, group_names, label, x_title

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
                   height: int = 420, y_scale: YScale = "auto") -> go.Figure:
    """The metric per pool over steps, with a marker per alert event (firing / resolved) and a
    star plus a vertical line per resync trigger, placed on the pool's line at the event's step."""
    fig = go.Figure()
    values = series[metric].to_numpy("float64") if len(series) else np.array([])
    scale = choose(values, y_scale)
    if len(series):
        add_series(fig, series, metric, group="pool", x=x, smoothing=smoothing, scale=scale,
                   colors=color_map(group_names(series, "pool")))
    ev = event_positions(series, events, metric, first=first, width=width) if len(events) else events
    if len(ev):
        ev = ev.assign(y=scale.shown(ev["y"]))
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
    resync = ev[resync_firings(ev)] if len(ev) else ev
    if len(resync):
        xs = resync["bin"] if x == "step" else pd.to_datetime(resync["wall_time"], unit="s", utc=True)
        for xv in xs:
            fig.add_vline(x=xv, line=dict(color=RESYNC[1], dash="dash", width=1))
        fig.add_trace(go.Scatter(
            x=xs, y=resync["y"], mode="markers", name=RESYNC[2],
            marker=dict(symbol=RESYNC[0], size=16, color=RESYNC[1], line=dict(width=1, color="black")),
            text=[f"resync {label(p)} at step {s}" for p, s in zip(resync["pool"], resync["step"])],
            hovertemplate="%{text}<extra></extra>"))
    fig.update_yaxes(title=metric_label)
    apply_scale(fig, scale, values)
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
    resync = resync_firings(events)
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


# a run event kind (``query.events``) -> line colour, dash, width, and whether it crosses the
# plot ("full") or is a tick at its foot ("rug": weight syncs come every step, a gap is the news)
RUN_EVENT_STYLE: dict[str, tuple[str, str, float, str]] = {
    "resync": (RESYNC[1], "solid", 1.5, "full"),
    "resync_request": (RESYNC[1], "dash", 1.0, "full"),
    "resume": ("#222222", "dashdot", 1.5, "full"),
    "weight_sync": ("#555555", "solid", 1.5, "rug"),
}
RUG_HEIGHT = 0.04   # of the figure's height
Position = Callable[[pd.DataFrame], pd.Series]   # an event frame's rows -> their x on a chart


def _bins(frame: pd.DataFrame, x: XAxis, first: int, width: int) -> pd.Series:
    """Where each row is drawn: its step bin, or its wall time in ms (a date axis' unit in a path)."""
    if x == "time":
        return (frame["wall_time"].astype("float64") * 1000.0).round(3)
    return first + (frame["step"].astype("int64") - first) // width * width


def _path(xs: pd.Series, y0: float, y1: float) -> str:
    return " ".join(f"M{float(v)!r},{y0} V{y1}" for v in xs.drop_duplicates().sort_values())


def annotate(fig: go.Figure, events: pd.DataFrame, *, x: XAxis = "step", first: int = 0,
             width: int = 1, opacity: float = 0.6, run_events: pd.DataFrame | None = None,
             at: Position | None = None, group: str | None = None) -> go.Figure:
    """The shared annotation layer of every time-series chart, at the step bin each event falls
    in: a vertical line at each alert firing (red), resolution (green, dotted) and resync
    trigger (purple, dashed); and of the run's own log (``run_events``), each resync (purple),
    resync request (purple, dashed), resume (black, dash-dot) and, as ticks at the foot of the
    chart, each weight sync (grey). One path per kind and column of subplots: the lines are
    layout shapes (they never stretch the axes, a log axis keeps its range), drawn at once.
    ``at`` places an event frame's rows on the chart's x (default: their step bin, or wall time);
    ``group`` names the run a chart of several runs marks (the shapes' ``name`` and legend group)."""
    place: Position = at or (lambda frame: _bins(frame, x, first, width))
    styles: list[tuple[pd.Series, str, str, float, str]] = []
    if len(events):
        at = place(events)
        resync = resync_firings(events)
        styles += [(at[(events["state"] == "firing") & ~resync], MARKERS["firing"][1], "solid", 1.0, "full"),
                   (at[events["state"] == "resolved"], MARKERS["resolved"][1], "dot", 1.0, "full"),
                   (at[resync], RESYNC[1], "dash", 1.0, "full")]
    if run_events is not None and len(run_events):
        at = place(run_events)
        styles += [(at[run_events["kind"] == kind], color, dash, w, where)
                   for kind, (color, dash, w, where) in RUN_EVENT_STYLE.items()]
    shapes = []
    for xref in _column_axes(fig):
        for xs, color, dash, w, where in styles:
            if not len(xs):
                continue
            shapes.append(dict(type="path", xref=xref, yref="paper", layer="below", opacity=opacity,
                               path=_path(xs, 0.0, RUG_HEIGHT if where == "rug" else 1.0),
                               line=dict(color=color, dash=dash, width=w),
                               **({"name": group, "legendgroup": group} if group else {})))
    if shapes:
        fig.update_layout(shapes=list(fig.layout.shapes) + shapes)
    return fig


def positions(shape: object) -> list[float]:
    """The x positions of the lines of one annotation path (:func:`annotate`): what a reader of
    the figure (a test, the browser) sees drawn."""
    path = shape["path"] if isinstance(shape, dict) else getattr(shape, "path", None)
    return [float(v) for v in re.findall(r"M([^,]+),", path or "")]


def _column_axes(fig: go.Figure) -> list[str]:
    """One x axis per column of subplots (those of the first row; a column shares its x axis)."""
    grid = getattr(fig, "_grid_ref", None)
    if not grid:
        return ["x"]
    return [cell[0].layout_keys[0].replace("axis", "") for cell in grid[0] if cell]


def changes(events: pd.DataFrame, last_step: int, recent: int, resyncs: pd.DataFrame | None = None) -> pd.DataFrame:
    """What changed, in which pool, since when: one row per (alert, pool) that is firing now or
    resolved within the last ``recent`` steps up to ``last_step``; firing first, newest first.
    ``since`` is the step of its latest event; ``first_fired`` its first firing in the run;
    ``resyncs`` the resyncs it asked (``resyncs``: step, pool, alert of each; else its firings
    that asked one)."""
    cols = ["state", "alert", "severity", "pool", "since", "first_fired", "episodes", "resyncs", "value",
            "threshold", "summary"]
    if not len(events):
        return pd.DataFrame(columns=cols)
    ev = events.sort_values("step", kind="stable")
    firing = ev[ev["state"] == "firing"]
    keys = ["alert", "pool"]
    agg = firing.assign(_resync=resync_firings(firing)).groupby(keys, dropna=False).agg(
        first_fired=("step", "min"), episodes=("step", "size"), resyncs=("_resync", "sum"))
    last = ev.groupby(keys, dropna=False).tail(1).rename(columns={"step": "since"})
    last = last[(last["state"] == "firing") | (last["since"] >= last_step - recent + 1)]
    if resyncs is not None:
        asked = resyncs.groupby(keys, dropna=False).size().rename("resyncs")
        agg = agg.drop(columns="resyncs").join(asked, how="left").fillna({"resyncs": 0}).astype({"resyncs": "int64"})
    out = last.merge(agg.reset_index(), on=keys, how="left")
    out = out.assign(_order=(out["state"] != "firing").astype(int)).sort_values(
        ["_order", "since"], ascending=[True, False], kind="stable")
    for c in cols:
        if c not in out.columns:
            out[c] = pd.NA
    return out[cols].reset_index(drop=True)


def lead_alert(events: pd.DataFrame) -> str | None:
    """The alert a reader wants first: the one firing now (in some pool) that fired last, else
    the one resolved last, else None. An alert is firing when its latest event in a pool is a
    firing."""
    if not len(events):
        return None
    ev = events.dropna(subset=["alert"]).sort_values(["step", "wall_time"], kind="stable")
    last = ev.groupby(["alert", "pool"], dropna=False).tail(1)
    for state in ("firing", "resolved"):
        part = last[last["state"] == state]
        if len(part):
            return str(part.iloc[-1]["alert"])
    return str(ev.iloc[-1]["alert"]) if len(ev) else None
