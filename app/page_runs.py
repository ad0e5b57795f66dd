"""Several runs: any number of runs overlaid per pool, grouped by a run.json field, on their own
steps or on the time since each started."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import streamlit as st

from mismatch_monitor.app import data, layout, loaders, several_runs, state
from mismatch_monitor.app.runs import resolve_run
from mismatch_monitor.metrics import METRIC_BY_KEY
from mismatch_monitor.store import RunNotFound, read_run_info

view = state.current()
DEFAULT_RUNS = 8

if layout.page_header("Several runs", view, "Any number of runs, one line per run in each pool's panel; "
                      "colour by a run.json field (e.g. an engine version), x on each run's own clock."):
    listed = data.catalog(view.root).sort_values(["steps", "last_update"], ascending=False, na_position="last")
    status = dict(zip(listed["name"], listed["status"]))
    readable = [n for n, s in zip(listed["name"], listed["status"]) if s != "unreadable"]
    search = st.text_input("Search runs", key="runs_q", bind="query-params", placeholder="words of a run name",
                           help="Narrows the runs offered below to those whose name holds every word.")
    found = several_runs.matching(readable, search)
    chosen_now = [r for r in st.session_state.get("runs_sel", []) if r in readable]
    # the first choice: the runs a search matches, else the sidebar's run (more are added here)
    default = found[:DEFAULT_RUNS] if search else [n for n in (view.run_name,) if n in readable]
    options = chosen_now + [n for n in found if n not in chosen_now]
    st.caption(f"{len(found)} of {len(readable)} run(s) match." if search else f"{len(readable)} run(s).")
    chosen = st.multiselect("Runs", options, default=[r for r in default if r in options], key="runs_sel",
                            bind="query-params", placeholder="pick runs (type to search)")
    infos = {}
    for name in chosen:
        try:
            infos[name] = read_run_info(resolve_run(view.root, name))
        except (RunNotFound, PermissionError, ValueError, OSError) as exc:
            st.warning(f"Run {name} is left out: {layout.private(str(exc), view)}", icon=":material/warning:")
    c1, c2, c3 = st.columns(3)
    metric = c1.selectbox("Metric", list(METRIC_BY_KEY), index=list(METRIC_BY_KEY).index(loaders.K3),
                          format_func=layout.metric_label, key="runs_metric", bind="query-params")
    field = c2.selectbox("Group by (run.json)", [several_runs.NO_GROUP, *several_runs.group_fields(infos)],
                         key="runs_group", bind="query-params",
                         help="Fields whose value differs between the runs chosen; a group shares a colour.")
    mode = c3.selectbox("x axis", list(several_runs.X_MODES), key="runs_x", bind="query-params")
    scale = layout.scale_control("runs_overlay")

    def body() -> None:
        group_of = several_runs.groups(infos, field)
        series, rows, width, marks = {}, [], 1, []
        for name, info in infos.items():
            run_dir = resolve_run(view.root, name)
            d = data.load("run_series", run_dir, **view.params, metric=metric)
            span, index = d["span"], d["index"]
            frame = d.get("series", pd.DataFrame({"step": [], "wall_time": [], "pool": [], metric: []}))
            start = info.get("started_at") or (float(index["wall_time"].min()) if len(index) else None)
            first = int(index["step"].min()) if len(index) else None
            series[name] = frame.assign(x=several_runs.relative_x(frame, mode, first_step=first, started_at=start))
            if span is not None:   # the run's alert and sync marks, on its own x
                marks.append(layout.marks(view, span, run_dir, group=name, at=several_runs.marks_at(
                    mode, origin=span.origin, width=span.width, first_step=first, started_at=start)))
            width = max(width, span.width if span is not None else 1)
            rows.append({"run": name, **({field: group_of[name]} if group_of[name] else {}),
                         "status": status.get(name, "?"), "started": layout.when(info.get("started_at"))})
            layout.run_caption(replace(view, run_name=name, status=status.get(name)), span, index)
        if not infos:
            layout.empty("Pick at least one run.")
            return
        if not any(len(f) for f in series.values()):
            layout.empty("None of the runs chosen has an observation in its steps shown.")
            return
        fig = several_runs.overlay(series, metric, metric_label=layout.metric_label(metric), group_of=group_of,
                                   x_title=several_runs.x_axis_title(mode, width), y_scale=scale)
        layout.chart(fig, key="runs_overlay", events=marks, x="step")
        st.caption("One panel per pool, one line per run; runs of one group share a colour and differ by dash. "
                   + layout.MARKS_CAPTION)
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")

    layout.live(body, view)
