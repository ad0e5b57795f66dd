"""Pieces every page lays out the same way: header and empty states, live refresh, charts,
headline numbers. Values are formatted here once; a null is shown as "—" (no observation)."""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from mismatch_monitor.metrics import METRIC_BY_KEY

from . import data, formatting, timeline, zoom
from .axes import SCALES, YScale
from .figures import XAxis
from .loaders import ESS, Span
from .state import View

NO_VALUE = "—"
HIGHER_IS_BETTER = frozenset({ESS, "mismatch/ess_capped"})


def format_value(key: str, value: Any) -> str:
    """A metric value for display (``formatting.value``: the metric's declared format)."""
    return formatting.value(key, value)


def metric_label(key: str) -> str:
    return formatting.metric_label(key)


readable = formatting.readable
column_name = formatting.column_name


def trend(frame: pd.DataFrame, metric: str) -> float:
    """Change of ``metric`` across ``frame``'s steps by a least-squares line (null under 3 points)."""
    if not len(frame):
        return math.nan
    steps = frame["step"].to_numpy(np.float64)
    values = frame[metric].to_numpy(np.float64)
    ok = np.isfinite(values)
    if ok.sum() < 3 or np.ptp(steps[ok]) == 0:
        return math.nan
    slope = np.polyfit(steps[ok], values[ok], 1)[0]
    return float(slope * np.ptp(steps[ok]))


def headline(container: Any, key: str, value: Any, recent: pd.DataFrame | None, *,
             label: str | None = None) -> None:
    """A headline number with its trend (change across the recent steps). No sparkline: each is a
    Vega chart of its own, which cost the Overview most of its first paint (the history chart
    below draws the same series per pool)."""
    change = trend(recent, key) if recent is not None and len(recent) else math.nan
    delta = None
    if math.isfinite(change):
        delta = f"{'-' if change < 0 else '+'}{format_value(key, abs(change))} over {len(recent)} steps"
    container.metric(label or metric_label(key), format_value(key, value), delta=delta,
                     delta_color="normal" if key in HIGHER_IS_BETTER else "inverse",
                     border=True,
                     help=METRIC_BY_KEY[key].description if key in METRIC_BY_KEY else None)


_ABSOLUTE = re.compile(r"(?:/[^/\s'\"():,]+)+/([^/\s'\"():,]+)")


def private(text: str, view: View) -> str:
    """``text`` as shown in a page: the run directory as the run's name, the root as "the runs
    root", any other absolute path as its last part (a page shows no server path)."""
    if view.run_dir is not None:
        text = text.replace(str(view.run_dir), view.run_name or view.run_dir.name)
    text = text.replace(str(view.root), "the runs root")
    return _ABSOLUTE.sub(lambda m: m.group(1), text)


def page_header(title: str, view: View, purpose: str) -> bool:
    """Title, purpose, notices. False (after an explicit empty state) when no run can be shown:
    none exists, or the chosen one's run.json cannot be read (the other runs stay usable)."""
    st.title(title)
    st.caption(purpose)
    if view.notice:
        st.error(private(view.notice, view), icon=":material/block:")
    if view.run_dir is None:
        st.info(f"No run to show. The runs root `{view.root.name}` holds no run directory yet: log steps with "
                "`MismatchCollector(run_dir)` under it, or start the dashboard on another root with "
                "`mismatch-monitor dashboard RUNS_ROOT`.", icon=":material/folder_open:")
        return False
    if view.status == "unreadable":
        st.error(f"Run **{view.run_name}** cannot be read: {private(view.error or 'its run.json is unreadable', view)}. "
                 "Pick another run in the sidebar; this one opens again once its run.json is repaired.",
                 icon=":material/broken_image:")
        return False
    damaged = data.damaged_files(view.run_dir)
    if damaged:
        listed = "; ".join(f"`{p}`: {private(r, view)}" for p, r in damaged[:5])
        st.warning(f"{len(damaged)} data file(s) of this run are not served (the numbers shown leave them "
                   f"out): {listed}. `mismatch-monitor compact` moves them to the run's quarantine.",
                   icon=":material/report:")
    return True


def when(wall_time: float | None) -> str:
    if wall_time is None or pd.isna(wall_time):
        return NO_VALUE
    return datetime.fromtimestamp(float(wall_time), tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def run_caption(view: View, span: Span | None, index: pd.DataFrame) -> None:
    status = view.status or "?"
    if span is None:
        st.caption(f"Run **{view.run_name}** · {status} · no visible step")
        return
    binned = f" · shown in bins of {span.width} steps" if span.width > 1 else ""
    last_wall = index["wall_time"].max() if len(index) else None
    st.caption(f"Run **{view.run_name}** · {status} · steps {span.first}–{span.last} "
               f"({span.n_steps} logged){binned} · last update {when(last_wall)}")


def no_steps(what: str = "this page") -> None:
    st.info(f"No visible step yet, so nothing to show on {what}. A run becomes visible at its first "
            "flush (every `flush_every_steps` steps or `flush_every_seconds` seconds, on `flush()` or on "
            "`close()`); data files written "
            "without their steps index (a flush cut short) are ignored.", icon=":material/hourglass_empty:")


def empty(message: str) -> None:
    st.info(message, icon=":material/info:")


MARKS_CAPTION = ("Vertical lines: alert fired (red), resolved (green, dotted), resync triggered (purple, "
                 "dashed), resync done (purple), run resumed (black, dash-dot); grey ticks at the foot: weight "
                 "syncs.")


@dataclass(frozen=True)
class Marks:
    """What the annotation layer draws on a chart: a run's alert events and resync triggers in
    its steps shown, binned as its series are; ``opacity`` of the lines (a second run's: fainter)."""

    events: pd.DataFrame
    span: Span
    x: XAxis
    opacity: float = 0.6
    run_events: pd.DataFrame | None = None   # weight syncs, resumes, resyncs (``query.events``)
    at: timeline.Position | None = None      # where an event is drawn, if not at its step bin
    group: str | None = None                 # the run marked, on a chart of several runs


def marks(view: View, span: Span, run_dir: Path | None = None, opacity: float = 0.6, *,
          alerts: bool = True, at: timeline.Position | None = None, group: str | None = None) -> Marks:
    """The annotation layer of a page's time-series charts: the run's (``run_dir``, default the
    view's) alert events and resync triggers (unless ``alerts`` is False: a chart that marks them
    itself), and its weight syncs, resumes and resyncs. A run written before its log of events
    has none: its charts are drawn as before. ``at`` and ``group``: see ``timeline.annotate``."""
    d = data.load("alerts", run_dir or view.run_dir, **view.params)
    events = d["events"] if alerts else d["events"].iloc[:0]
    return Marks(events, span, view.x, opacity, d["run_events"], at, group)


def chart(fig: go.Figure, key: str, events: Marks | Sequence[Marks] | None = None,
          x: XAxis | None = None, clicks: bool = False) -> list[dict[str, Any]]:
    """Draw ``fig``; with ``events`` (:func:`marks`, one per run drawn), the alert and resync lines
    over it. A time-series chart (``x`` given, or ``events``) keeps its zoom in the URL
    (``zoom.keep``). With ``clicks``, a clicked point reruns the page, which gets the points
    (dicts with ``x``, ``y``, ``legendgroup``; none otherwise); a drag still zooms."""
    for m in [events] if isinstance(events, Marks) else (events or []):
        timeline.annotate(fig, m.events, x=m.x, first=m.span.origin, width=m.span.width, opacity=m.opacity,
                          run_events=m.run_events, at=m.at, group=m.group)
        x = x or m.x
    if x is not None:
        zoom.keep(fig, key, x)
    # theme=None: the figure's own colour scales (Streamlit's theme would recolour heatmaps)
    if not clicks:
        st.plotly_chart(fig, key=key, width="stretch", theme=None, config={"displaylogo": False})
        return []
    # a click picks one line's point, not every line at that x; a drag zooms (Streamlit's default
    # for a chart selecting points is to pan)
    fig.update_layout(hovermode="closest", dragmode="zoom")
    event = st.plotly_chart(fig, key=key, width="stretch", theme=None, config={"displaylogo": False},
                            on_select="rerun", selection_mode="points")
    return list(event.selection.points) if event is not None else []


def scale_control(key: str) -> YScale:
    """The chart's y scale (auto / linear / log), bound to the URL as ``<key>_y``."""
    choice = st.segmented_control("y scale", list(SCALES), default="auto", key=f"{key}_y",
                                  bind="query-params", label_visibility="collapsed",
                                  help="auto: log when the positive values span two decades")
    return choice if choice in SCALES else "auto"


def live(body: Callable[[], None], view: View) -> None:
    """Run ``body`` once, or as a fragment that reruns every ``view.refresh`` seconds while the run
    is live; widgets drawn outside ``body`` keep their state across refreshes."""
    if view.live:
        st.fragment(body, run_every=view.refresh)()
    else:
        body()


def metric_table(frame: pd.DataFrame, keys: list[str], by: list[str]) -> pd.DataFrame:
    """Formatted values, one row per group: what the tables on the pages show."""
    out = pd.DataFrame({col: frame[col].map(lambda v: "(none)" if pd.isna(v) else str(v)) for col in by})
    for key in keys:
        out[metric_label(key)] = [format_value(key, v) for v in frame[key]]
    return out


ALL_POOLS = "all pools"


def pool_picker(pools: list[Any], key: str, label: str = "Pool") -> str | None:
    """A pool selector bound to the URL; None means every pool merged."""
    choice = st.selectbox(label, [ALL_POOLS, *[p for p in pools if p is not None]], key=key,
                          bind="query-params")
    return None if choice in (None, ALL_POOLS) else str(choice)
