"""Links that open the Exemplars page on a step (and pool): /exemplars?run=..&step=..&pool=..,
from a list of the worst steps or from a point clicked on a chart (plain functions)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping
from urllib.parse import urlencode

import pandas as pd
import plotly.graph_objects as go

from .figures import NO_POOL, XAxis, label


def url(run: str, step: int, pool: str | None = None) -> str:
    return "exemplars?" + urlencode(params(run, step, pool))


def params(run: str, step: int, pool: str | None = None) -> dict[str, Any]:
    q: dict[str, Any] = {"run": run, "step": int(step)}
    if pool:
        q["pool"] = pool
    return q


def worst_steps_markdown(run: str, steps: pd.DataFrame, n: int = 5) -> str:
    """Markdown links to the ``n`` steps with the largest stored |log ρ| (exemplar_steps' frame),
    each to the pool of that token."""
    worst = steps.sort_values("max_abs_log_ratio", ascending=False).head(n)
    links = []
    for _, r in worst.iterrows():
        pool = r.get("pool")
        pool = None if pool is None or pd.isna(pool) else str(pool)
        where = f" · {pool}" if pool else ""
        links.append(f"[step {int(r['step'])}{where} ({r['max_abs_log_ratio']:.3g})]"
                     f"({url(run, int(r['step']), pool)})")
    return " · ".join(links)


BINNED_HOVER = "steps {lo}–{hi} · a click opens the step of this pool's worst stored token among them"


def clickable(fig: go.Figure, series: pd.DataFrame, width: int = 1) -> go.Figure:
    """Small markers on the lines of each pool of ``series``: plotly selects (clicks) points of
    traces with markers only. In bins of ``width`` > 1 steps, each point's hover names its bin's
    steps and which of them a click opens (:func:`worst_in_bin`)."""
    pools = {label(p) for p in series["pool"].drop_duplicates()}
    for trace in fig.data:
        group = getattr(trace, "legendgroup", None)
        if group not in pools:
            continue
        if trace.mode == "lines":
            trace.mode = "lines+markers"
            trace.marker.size = 3
        if width > 1:
            starts = series.loc[series["pool"].map(label) == group, "step"].sort_values().astype("int64")
            if len(starts) == len(trace.x if trace.x is not None else ()):
                trace.text = [BINNED_HOVER.format(lo=b, hi=b + width - 1) for b in starts]
                template = trace.hovertemplate or f"{trace.name}: %{{y}}<extra></extra>"
                trace.hovertemplate = template.replace("<extra>", "<br>%{text}<extra>", 1)
    return fig


def worst_in_bin(steps: pd.DataFrame, start: int, width: int) -> int | None:
    """The step of bin [start, start + width) whose largest stored |log ρ| is the largest
    (``exemplar_steps``' frame, of the clicked pool); None when none of its steps holds one."""
    inside = steps[(steps["step"] >= start) & (steps["step"] < start + width)]
    if not len(inside):
        return None
    return int(inside.loc[inside["max_abs_log_ratio"].idxmax(), "step"])


def clicked(points: Iterable[Mapping[str, Any]], series: pd.DataFrame, x: XAxis) -> tuple[int, str | None] | None:
    """The (step, pool) of the first clicked point of a per-pool series chart whose legend group
    is a pool of ``series``: its x is a step (the first of its bin), or on the wall-time axis the
    time of one of the series' rows. None when no point names a pool and a step."""
    pools = {label(p): (None if label(p) == NO_POOL else str(p)) for p in series["pool"].drop_duplicates()}
    for point in points:
        group, at = point.get("legendgroup"), point.get("x")
        if group not in pools or at is None:
            continue
        if x == "time":
            when = pd.Timestamp(at, tz="UTC") if pd.Timestamp(at).tzinfo is None else pd.Timestamp(at)
            rows = series.loc[(pd.to_datetime(series["wall_time"], unit="s", utc=True) - when).abs()
                              <= pd.Timedelta(milliseconds=1), "step"]
            if not len(rows):
                continue
            return int(rows.iloc[0]), pools[group]
        try:
            return int(round(float(at))), pools[group]
        except (TypeError, ValueError):
            continue
    return None
