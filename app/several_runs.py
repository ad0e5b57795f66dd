"""Several runs at once: which runs a search picks, what run.json field groups them, the x each
run is drawn on (its own steps, steps or seconds since its start) and the overlay of N runs per
pool. Plain functions (no Streamlit), tested directly.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import colors as palette
from . import formatting
from .axes import YScale, choose
from .figures import apply_scale, finish, group_names, label

X_MODES = ("step", "steps since start", "seconds since start")
NOT_SET = "(not set)"
NO_GROUP = "(none)"
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
# run.json parts that are not a property of the run: its thresholds (compared on Compare), bookkeeping
SKIPPED = ("config", "restarts", "pid", "closed_at", "started_at", "schema_version", "run_id")


def matching(names: Iterable[str], search: str | None) -> list[str]:
    """The names that hold every word of ``search`` (case-insensitive), in their order."""
    words = (search or "").lower().split()
    return [n for n in names if all(w in n.lower() for w in words)]


def flatten(info: Mapping[str, Any], prefix: str = "", depth: int = 4) -> dict[str, str]:
    """run.json's scalar fields as dotted names -> text ("pools.bf16.engine" -> "vllm"); lists
    are kept whole as text, deeper levels than ``depth`` are left out."""
    out: dict[str, str] = {}
    for key, value in info.items():
        name = f"{prefix}{key}"
        if not prefix and key in SKIPPED:
            continue
        if isinstance(value, Mapping):
            if depth > 1:
                out.update(flatten(value, f"{name}.", depth - 1))
        elif value is not None:
            out[name] = value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
    return out


def group_fields(infos: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Fields a choice of runs can be grouped by: those whose value is not the same in every run
    (a field only some runs set counts), sorted."""
    flat = {run: flatten(info) for run, info in infos.items()}
    names = sorted({f for fields in flat.values() for f in fields})
    return [f for f in names if len({fields.get(f, NOT_SET) for fields in flat.values()}) > 1]


def groups(infos: Mapping[str, Mapping[str, Any]], field: str | None) -> dict[str, str]:
    """Run -> its value of ``field`` (``NOT_SET`` where its run.json has none)."""
    if not field or field == NO_GROUP:
        return {run: "" for run in infos}
    return {run: flatten(info).get(field, NOT_SET) for run, info in infos.items()}


def relative_x(series: pd.DataFrame, mode: str, *, first_step: int | None,
               started_at: float | None) -> pd.Series:
    """The x a run's rows are drawn at: the step itself, steps since the run's first step, or
    seconds of wall time since the run started (run.json's ``started_at``, else the first step's
    wall time is the caller's ``started_at``)."""
    if mode == "steps since start":
        return series["step"] - (first_step or 0)
    if mode == "seconds since start":
        return series["wall_time"].astype("float64") - float(started_at or 0.0)
    return series["step"]


def marks_at(mode: str, *, origin: int, width: int, first_step: int | None,
             started_at: float | None) -> Callable[[pd.DataFrame], pd.Series]:
    """Where a run's alert and run events (frames with ``step`` and ``wall_time``) are drawn on
    the overlay: in steps, at the bin each falls in (bins of ``width`` from ``origin``, as the
    run's series), counted as :func:`relative_x` counts; in seconds, at the event's own time."""
    def at(frame: pd.DataFrame) -> pd.Series:
        bins = origin + (frame["step"].astype("int64") - origin) // width * width
        return relative_x(frame.assign(step=bins), mode, first_step=first_step, started_at=started_at)
    return at


def x_axis_title(mode: str, width: int = 1) -> str:
    if mode == "seconds since start":
        return "seconds since the run started"
    bins = f" (bins of {width} steps)" if width > 1 else ""
    return ("steps since the run's first step" if mode == "steps since start" else "step") + bins


def run_styles(runs: Sequence[str], group_of: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Run -> (colour, dash): one colour per group (per run when ungrouped), runs of one group
    told apart by their dash, in the order given."""
    keys = {run: (group_of.get(run) or run) for run in runs}
    colour = palette.assign(keys.values())
    seen: dict[str, int] = {}
    out = {}
    for run in runs:
        k = keys[run]
        i = seen.get(k, 0) if group_of.get(run) else 0
        seen[k] = i + 1
        out[run] = (colour[k], DASHES[i % len(DASHES)])
    return out


def run_name(run: str, group: str) -> str:
    return f"{run} · {group}" if group else run


def overlay(series: Mapping[str, pd.DataFrame], metric: str, *, metric_label: str, group_of: Mapping[str, str],
            x_title: str, y_scale: YScale = "auto", cols: int = 2, height_per_row: int = 260) -> go.Figure:
    """One panel per pool, one line per run in each (a run's frame: ``x``, ``pool``, ``metric``).
    A run's lines share its colour, dash and legend entry across panels; a trace's ``meta`` is
    [run, pool]. On a log axis zeros sit at its floor (the hover shows the value itself)."""
    runs = list(series)
    frames = [f for f in series.values() if len(f)]
    every = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"pool": [], metric: []})
    pools = group_names(every, "pool")
    cols = max(1, min(cols, len(pools)))
    rows = max(1, math.ceil(len(pools) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[label(p) for p in pools], shared_xaxes=True,
                        vertical_spacing=0.5 / max(rows * 2, 4), horizontal_spacing=0.08)
    styles = run_styles(runs, group_of)
    fmt = formatting.spec(metric).replace(",", "")
    in_legend: set[str] = set()
    for i, pool in enumerate(pools):
        r, c = i // cols + 1, i % cols + 1
        parts = {run: _pool_rows(series[run], pool).sort_values("x") for run in runs}
        parts = {run: p for run, p in parts.items() if len(p)}
        values = np.concatenate([p[metric].to_numpy(np.float64) for p in parts.values()] or [np.array([])])
        scale = choose(values, y_scale)
        for run, part in parts.items():
            ys = part[metric].to_numpy(np.float64)
            color, dash = styles[run]
            name = run_name(run, group_of.get(run, ""))
            fig.add_trace(go.Scatter(x=part["x"], y=scale.shown(ys), customdata=ys, name=name, legendgroup=run,
                                     meta=[run, label(pool)], mode="lines+markers" if len(part) <= 40 else "lines",
                                     line=dict(color=color, dash=dash, width=2), marker=dict(size=4),
                                     hovertemplate=f"{name}: %{{customdata:{fmt}}}<extra>{label(pool)}</extra>",
                                     connectgaps=False, showlegend=run not in in_legend),
                          row=r, col=c)
            in_legend.add(run)
        apply_scale(fig, scale, values, row=r, col=c)
        fig.update_yaxes(tickformat=formatting.tick_format(metric), row=r, col=c)
    for c in range(1, cols + 1):   # the lowest panel of each column: its x title and tick labels
        last = max((i // cols + 1 for i in range(len(pools)) if i % cols + 1 == c), default=rows)
        fig.update_xaxes(title=x_title, showticklabels=True, row=last, col=c)
    fig.update_yaxes(title=metric_label, col=1)
    return finish(fig, 60 + rows * height_per_row)


def _pool_rows(df: pd.DataFrame, pool: object) -> pd.DataFrame:
    if not len(df):
        return df
    return df[df["pool"].isna()] if pd.isna(pool) else df[df["pool"] == pool]
