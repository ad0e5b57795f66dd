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


def clickable(fig: go.Figure, series: pd.DataFrame) -> go.Figure:
    """Small markers on the lines of each pool of ``series``: plotly selects (clicks) points of
    traces with markers only."""
    pools = {label(p) for p in series["pool"].drop_duplicates()}
    for trace in fig.data:
        if getattr(trace, "legendgroup", None) in pools and trace.mode == "lines":
            trace.mode = "lines+markers"
            trace.marker.size = 3
    return fig


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
