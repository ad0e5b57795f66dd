"""Overview: what changed, in which pool, since when (alerts firing and recently resolved first),
the headline numbers with their trend, and every pool's history with the alert and resync lines."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, layout, loaders, state, tables, timeline
from mismatch_monitor.app.state import STATUS_MARK
from mismatch_monitor.store.alerting import evaluation_note, judged_everything

view = state.current()

if layout.page_header("Overview", view, "Is mismatch growing, in which pool, and is anything firing? "
                      "Headline numbers are the latest step with observations; trends cover the last "
                      f"{loaders.SPARK_STEPS} steps."):
    with st.expander("Runs under the root", expanded=len(view.run_names) > 1):
        runs = data.catalog(view.root)
        st.dataframe(layout.readable(runs.assign(status=runs["status"].map(lambda s: STATUS_MARK.get(s, s)),
                                                 last_update=runs["last_update"].map(layout.when))
                                     [["name", "run_id", "status", "steps", "last_step", "last_update", "pools"]]),
                     hide_index=True, width="stretch")

    def body() -> None:
        d = data.load("overview", view.run_dir, **view.params)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the overview")
            return
        events, firing = d["events"], d["firing"]
        outcomes = d.get("outcomes")
        # the training outcomes beside the alerts; a run that logs none keeps the whole width for them
        shown = outcomes is not None and len(outcomes) > 0
        alerts_col, outcomes_col = st.columns([3, 2]) if shown else (st.container(), None)
        with alerts_col:
            st.subheader("What changed, in which pool, since when")
            changed = timeline.changes(events, span.last, loaders.SPARK_STEPS, d.get("resyncs"))
            if not len(events) and judged_everything(d["alerting"]):
                st.success("No alert events in this run. " + evaluation_note(d["alerting"]),
                           icon=":material/check_circle:")
            elif not len(events):
                layout.empty("No alert events in this run. " + evaluation_note(d["alerting"]))
            elif not len(changed):
                st.success(f"No alert firing, none resolved in the last {loaders.SPARK_STEPS} steps "
                           f"({len(events)} past event(s): see Alerts and resyncs).", icon=":material/check_circle:")
            else:
                if len(firing):
                    st.error(f"{len(firing)} alert(s) firing", icon=":material/notifications_active:")
                st.dataframe(layout.readable(changed), hide_index=True, width="stretch")
        if outcomes_col is not None:
            with outcomes_col:
                st.subheader("Training outcomes")
                layout.chart(figures.outcomes_figure(outcomes, x=view.x, smoothing=view.smoothing),
                             key="overview_outcomes", events=layout.marks(view, span))
        errors = d["errors"]
        st.subheader("Collector errors")
        if not len(errors):
            st.success("The collector counted no error in this run.", icon=":material/check_circle:")
        else:
            st.error(f"{int(errors['count'].sum())} collector error(s), {len(errors)} distinct, latest "
                     "first: each message says what it did to its step", icon=":material/error:")
            st.dataframe(tables.styled(errors[["count", "last_step", "where", "kind", "message"]]), hide_index=True,
                         width="stretch")
        fleet = d["latest_fleet"]
        if not len(fleet):
            layout.empty("Steps were logged but none has an observation yet: every metric is null.")
            return
        latest_step = d["latest_step"]
        st.subheader(f"Fleet at step {latest_step}")
        # one card per headline metric, the fleet's flip rate among them; each pool's is in the
        # table below and its history in the chart (a card per pool drew one more chart per pool)
        flips = not fleet[loaders.FLIPS].isna().all()
        keys = loaders.HEADLINE if flips else loaders.HEADLINE[:5]
        for col, key in zip(st.columns(len(keys)), keys):
            layout.headline(col, key, fleet[key].iloc[0], d.get("recent"))
        if not flips:
            layout.empty("No expert ids were logged: routing flips are not observed in this run.")
        pools_now = d["latest_pools"]
        st.subheader(f"Per pool at step {latest_step}")
        st.dataframe(layout.metric_table(pools_now, list(loaders.HEADLINE) + ["mismatch/n_tokens"], ["pool"]),
                     hide_index=True, width="stretch")
        shown = loaders.HEADLINE + (loaders.STALENESS,)
        titles = {k: layout.metric_label(k) for k in shown}
        st.subheader("Per pool over the run")
        st.caption(layout.MARKS_CAPTION)
        scale = layout.scale_control("overview_history")
        layout.chart(figures.small_multiples(d["history"], shown, titles, group="pool", x=view.x,
                                             smoothing=view.smoothing, width=span.width, cols=3,
                                             y_scale=scale),
                     key="overview_history", events=layout.marks(view, span))

    layout.live(body, view)
