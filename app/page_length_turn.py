"""Length and turn: a metric per response-length bucket and per turn over steps, and the length
T* = ln C / mean|log ρ| at which a product of per-token ratios would reach the cap."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, heatmaps, layout, loaders, state
from mismatch_monitor.metrics import METRICS

view = state.current()
TOKEN_METRICS = [m.key for m in METRICS if m.table != "sequences"]

if layout.page_header("Length and turn", view, "Per-token errors compound over long responses and late "
                      "turns: the pool with worse numerics loses its long rollouts first."):
    left, right = st.columns(2)
    metric = left.selectbox("Metric", TOKEN_METRICS, index=TOKEN_METRICS.index(loaders.K3),
                            format_func=layout.metric_label, key="lt_metric", bind="query-params")
    with right:
        pool = layout.pool_picker(data.meta(view.run_dir)["pools"], key="lt_pool")

    def body() -> None:
        d = data.load("length_turn", view.run_dir, **view.params, metric=metric, pool=pool)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the length and turn page")
            return
        config = data.load("meta", view.run_dir)["config"]
        title = layout.metric_label(metric)
        for table, column, what, edges in (("length", "length_bucket", "response length", config.length_edges),
                                           ("turn", "turn_bucket", "turn", config.turn_edges)):
            st.subheader(f"{title} × {what}")
            frame = d[table]
            if not len(frame):
                layout.empty("No observation in the steps shown.")
                continue
            if frame[column].isna().all():
                layout.empty(f"No {what} information: the batches carried no turn_index.")
                continue
            names = loaders.bucket_labels(edges, what=what, integer=True)
            order = sorted(v for v in frame[column].dropna().unique())
            layout.chart(heatmaps.bucket_heatmap(frame, metric, column, labels=names, order=order, x=view.x,
                                                 width=span.width, value_title=title, y_title=what),
                         key=f"lt_{table}", x=view.x)
        st.subheader(f"T* = ln C / mean|log ρ| per pool (C = {d['cap']:g})")
        st.caption("The response length at which a product of per-token ratios of typical size "
                   "exp(mean|log ρ|) reaches the TIS cap: responses longer than T* are the first a "
                   "product (sequence-IS) correction clips.")
        cross = d["crossing"]
        if not len(cross):
            layout.empty("No observation in the steps shown.")
            return
        layout.chart(figures.line_figure(cross, "crossing_length", group="pool", x=view.x,
                                         smoothing=view.smoothing, width=span.width, y_title="T* (tokens)",
                                         y_scale="log"), key="lt_crossing", events=layout.marks(view, span))
        last = d["crossing_latest"]
        st.dataframe(last.assign(**{"T* (tokens)": last["crossing_length"].map(lambda v: layout.format_value("", v))})
                     [["pool", "step", "T* (tokens)"]], hide_index=True, width="stretch")

    layout.live(body, view)
