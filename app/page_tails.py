"""Tails: the whole |log ρ| distribution over steps, its percentiles per pool, and the drift."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, heatmaps, layout, loaders, state
from mismatch_monitor.engine.histogram import LogBins

view = state.current()

if layout.page_header("Tails", view, "Tails move before the mean and before a collapse: the |log ρ| "
                      "histogram over steps, its percentiles per pool, and the signed mean (drift)."):
    pool = layout.pool_picker(data.meta(view.run_dir)["pools"], key="tails_pool", label="Histogram of pool")

    def body() -> None:
        d = data.load("tails", view.run_dir, **view.params, pool=pool)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the tails page")
            return
        if not len(d["bands"]):
            layout.empty("Steps were logged but none has an observation yet.")
            return
        st.subheader(f"|log ρ| histogram over steps · {pool or 'all pools'}")
        if not len(d["hist"]):
            layout.empty("No token of this pool in the steps shown.")
        else:
            layout.chart(heatmaps.hist_heatmap(d["hist"], LogBins.from_config(d["config"]), x=view.x,
                                               width=d["hist_width"]), key="tails_hist", x=view.x)
        bands = [(k, layout.metric_label(k)) for k in loaders.BANDS]
        st.subheader("Percentile bands per pool")
        scale = layout.scale_control("tails_bands")
        layout.chart(figures.percentile_bands(d["bands"], bands, group="pool", x=view.x, width=span.width,
                                              y_scale=scale),
                     key="tails_bands", events=layout.marks(view, span))
        st.subheader("Drift: signed mean log ratio (±2 standard errors)")
        mean, se = loaders.DRIFT
        layout.chart(figures.drift_figure(d["bands"], mean, se, group="pool", x=view.x,
                                          smoothing=view.smoothing, width=span.width), key="tails_drift", events=layout.marks(view, span))

    layout.live(body, view)
