"""Page state: the sidebar's shared controls, every one bound to the URL so a view can be shared.

``?run=NAME&x=time&smooth=0.6&window=last+1%2C000`` reopens the same view. The sidebar is drawn
by ``main.py`` once per rerun; pages read the resulting :class:`View` with :func:`current`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from mismatch_monitor.store import RunNotFound

from .data import MAX_POINTS, catalog, describe
from .figures import XAxis
from .runs import RunOutsideRoot, resolve_run, run_name

WINDOWS: dict[str, int | None] = {"all steps": None, "last 100": 100, "last 1,000": 1000,
                                  "last 10,000": 10000}
REFRESH: dict[str, float | None] = {"off": None, "5 s": 5.0, "15 s": 15.0, "60 s": 60.0}
X_AXES: dict[str, XAxis] = {"step": "step", "wall time": "time"}
STATUS_MARK = {"live": "● live", "finished": "✓ finished", "stale": "◌ stale", "unreadable": "✗ unreadable"}
VIEW_KEY = "_mismatch_monitor_view"


@dataclass(frozen=True)
class View:
    root: Path
    run_dir: Path | None
    run_name: str | None
    status: str | None
    x: XAxis = "step"
    smoothing: float = 0.0
    window: int | None = None
    refresh: float | None = 15.0
    notice: str | None = None          # why a requested run is not shown
    run_names: tuple[str, ...] = ()
    error: str | None = None           # why the chosen run cannot be read (status "unreadable")

    @property
    def live(self) -> bool:
        return self.status == "live" and self.refresh is not None

    @property
    def params(self) -> dict[str, Any]:
        return {"window": self.window, "max_points": MAX_POINTS}


def _requested_run(root: Path, names: list[str]) -> tuple[str | None, str | None]:
    """(an extra run name to offer, a notice) for the ``run`` URL parameter."""
    requested = st.query_params.get("run")
    if not requested or requested in names:
        return None, None
    try:
        return run_name(root, resolve_run(root, requested)), None
    except RunOutsideRoot as exc:
        return None, str(exc)
    except RunNotFound as exc:
        return None, f"{exc}; showing another run instead."


def sidebar(root: Path) -> View:
    runs = catalog(root)
    names = runs["name"].tolist()
    extra, notice = _requested_run(root, names)
    if extra is not None and extra not in names:
        runs = pd.concat([runs, pd.DataFrame([describe(extra, resolve_run(root, extra))])], ignore_index=True)
        names.append(extra)
    status = dict(zip(runs["name"], runs["status"]))
    errors = {n: e for n, e in zip(runs["name"], runs["error"]) if isinstance(e, str)}
    side = st.sidebar
    name: str | None = None
    if names:
        # default: the run that moved last (a live one if any)
        order = runs.assign(_live=runs["status"] == "live").sort_values(
            ["_live", "last_update"], ascending=False, na_position="last")
        # not bound to the URL: a bound widget leaves its default out, and a copied URL must name
        # its run, default included; the URL's run is the initial choice
        requested = st.query_params.get("run")
        first = extra or (requested if requested in names else order["name"].iloc[0])
        name = side.selectbox("Run", names, index=names.index(first), key="run")
        side.caption(STATUS_MARK.get(status.get(name, ""), "?"))
        if st.query_params.get("run") != name:
            st.query_params["run"] = name
    else:
        side.warning(f"No runs under {root}")
    x_label = side.segmented_control("x axis", list(X_AXES), default="step", key="x", bind="query-params")
    smoothing = side.slider("Smoothing (EMA weight; the raw line stays visible)", 0.0, 0.95, 0.0, 0.05,
                            key="smooth", bind="query-params")
    window = side.selectbox("Steps shown", list(WINDOWS), key="window", bind="query-params")
    refresh = side.selectbox("Live refresh", list(REFRESH), index=2, key="refresh", bind="query-params")
    side.caption(f"Runs root: `{root.name}`")
    run_dir = None
    if name is not None:
        try:
            run_dir = resolve_run(root, name)
        except (RunNotFound, RunOutsideRoot) as exc:  # removed since it was listed
            notice, name = str(exc), None
    view = View(root=root, run_dir=run_dir, run_name=name, status=status.get(name) if name else None,
                x=X_AXES.get(x_label or "step", "step"), smoothing=float(smoothing or 0.0),
                window=WINDOWS.get(window), refresh=REFRESH.get(refresh, 15.0), notice=notice,
                run_names=tuple(names), error=errors.get(name) if name else None)
    st.session_state[VIEW_KEY] = view
    return view


def current() -> View:
    """The view the sidebar built in this rerun."""
    view = st.session_state.get(VIEW_KEY)
    if view is None:
        raise RuntimeError("the dashboard's pages run inside main.py, which draws the sidebar first")
    return view
