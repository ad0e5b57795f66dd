"""Corrections: what each loss correction would clip or drop, per pool, over steps."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, layout, loaders, state
from mismatch_monitor.metrics import title_of

view = state.current()

if layout.page_header("Corrections", view, "The share of tokens or sequences each correction would clip or "
                      "drop: what it deletes or biases. Thresholds are the run's MetricConfig."):

    def body() -> None:
        d = data.load("corrections", view.run_dir, **view.params)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the corrections page")
            return
        if not len(d["series"]):
            layout.empty("Steps were logged but none has an observation yet.")
            return
        c = d["config"]
        titles = {k: title_of(k, c) for k in loaders.CORRECTIONS}   # thresholds: the run's config
        st.subheader("Over the steps shown, per pool")
        st.dataframe(layout.metric_table(d["totals"], list(loaders.CORRECTIONS), ["pool"])
                     .rename(columns={layout.metric_label(k): titles[k] for k in loaders.CORRECTIONS}),
                     hide_index=True, width="stretch")
        st.subheader("Over steps")
        st.caption(layout.MARKS_CAPTION)
        layout.chart(figures.small_multiples(d["series"], list(loaders.CORRECTIONS), titles, group="pool",
                                             x=view.x, smoothing=view.smoothing, width=span.width),
                     key="corrections_series", events=layout.marks(view, span))

    layout.live(body, view)
