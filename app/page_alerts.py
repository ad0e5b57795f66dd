"""Alerts and resyncs: every alert event and resync trigger, over the metric it fired on."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, layout, loaders, rule_coverage, state, tables, timeline
from mismatch_monitor.store.alerting import Alerting, coverage_line, evaluation_note

view = state.current()

if layout.page_header("Alerts and resyncs", view, "When each alert fired and resolved, and when a resync "
                      "was requested, drawn on the metric the alert watches."):
    events = data.load("alerts", view.run_dir, **view.params)["events"]
    names = sorted(events["alert"].dropna().unique().tolist()) if len(events) else []
    lead = timeline.lead_alert(events)   # firing now, else resolved last: not the alphabetically first
    chosen = st.selectbox("Alert", names, index=names.index(lead) if lead in names else 0, key="alerts_alert",
                          bind="query-params", help="opens on the alert firing now, else the one resolved "
                          "last") if names else None
    metric = loaders.alert_metrics(events).get(chosen) if chosen else None

    def body() -> None:
        d = data.load("alerts", view.run_dir, **view.params, metric=metric)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the alerts page")
            return
        ev = d["events"]
        if not len(ev):
            layout.empty("No alert event in the steps shown. " + evaluation_note(d["alerting"]))
            judged_section(d["alerting"])
            return
        firing, resyncs = d["firing"], d["resyncs"]
        cols = st.columns(4)
        cols[0].metric("alert events", f"{len(ev):,}")
        cols[1].metric("firing now", f"{len(firing):,}")
        cols[2].metric("resync triggers", f"{len(resyncs):,}")
        cols[3].metric("alerts", f"{ev['alert'].nunique():,}")
        st.subheader("Timeline (marker colour: pool)")
        layout.chart(timeline.events_strip(ev, x=view.x), key="alerts_strip", x=view.x)
        if metric is None:
            layout.empty(f"The alert {chosen!r} names no metric known to this version.")
        else:
            st.subheader(f"{chosen} on {layout.metric_label(metric)}")
            st.caption("▲ firing · ▼ resolved · ★ resync triggered, on the line of the pool the event concerns")
            mine = ev[ev["alert"] == chosen]
            scale = layout.scale_control("alerts_timeline")
            layout.chart(timeline.alert_timeline(d["series"], mine, metric, metric_label=layout.metric_label(metric),
                                                 x=view.x, smoothing=view.smoothing, first=span.origin,
                                                 width=span.width, y_scale=scale), key="alerts_timeline",
                         events=layout.marks(view, span, alerts=False))
            last = mine.iloc[-1]
            with st.expander(f"Runbook: {chosen}"):
                st.markdown(str(last.get("runbook") or "—"))
        st.subheader("All events (newest first)")
        shown = [c for c in ("step", "alert", "severity", "pool", "state", "value", "threshold", "resync",
                             "summary") if c in ev.columns]
        st.dataframe(tables.styled(ev.sort_values("step", ascending=False)[shown], empty={"pool": tables.FLEET}),
                     hide_index=True, width="stretch")
        judged_section(d["alerting"])

    def judged_section(alerting: Alerting | None) -> None:
        """Per rule and pool, the steps it could judge: a quiet rule is not a healthy verdict."""
        if alerting is None or alerting.coverage is None or alerting.coverage.empty:
            return
        st.subheader("What the rules could judge")
        st.caption(coverage_line(alerting) + " Over the whole run, not only the steps shown. A rule cannot "
                   "fire on a step it did not judge.")
        st.dataframe(rule_coverage.coverage_grid(alerting), hide_index=True, width="stretch")

    layout.live(body, view)
