"""Low-probability buckets: where the bias concentrates, by the sampler's token probability."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.alerts.definitions import SHARPNESS_SHIFT
from mismatch_monitor.app import data, figures, heatmaps, layout, loaders, state, tables
from mismatch_monitor.metrics import METRIC_BY_KEY

view = state.current()

if layout.page_header("Low-probability buckets", view, "Mean |log ρ| and k3 per sampler-probability "
                      "bucket over steps: errors concentrate on rare tokens, which carry large gradients."):
    pool = layout.pool_picker(data.meta(view.run_dir)["pools"], key="lowprob_pool")

    def body() -> None:
        d = data.load("lowprob", view.run_dir, **view.params, pool=pool)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the low-probability page")
            return
        buckets = d["buckets"]
        if not len(buckets):
            layout.empty("No token in the steps shown.")
            return
        names = loaders.bucket_labels(d["config"].lowprob_edges, what="p", integer=False)
        order = sorted(names)
        for value, title in (("mean_abs_lr", "mean |log ρ|"), ("k3_kl", "k3 KL")):
            st.subheader(f"{title} per sampler-probability bucket")
            layout.chart(heatmaps.bucket_heatmap(buckets, value, "bucket", labels=names, order=order, x=view.x,
                                                 width=span.width, value_title=title,
                                                 y_title="sampler probability"), key=f"lowprob_{value}", x=view.x)
            layout.chart(figures.line_figure(buckets, value, group="bucket", labels=names, x=view.x,
                                             smoothing=view.smoothing, width=span.width, y_title=title),
                         key=f"lowprob_{value}_lines", events=layout.marks(view, span))
        st.subheader("Tokens per bucket (steps shown)")
        totals = d["totals"].assign(bucket=d["totals"]["bucket"].map(names))
        st.dataframe(tables.styled(totals[["bucket", "n_tokens", "share", "mean_abs_lr", "k3_kl"]],
                                   empty={"share": "no tokens", "mean_abs_lr": "no tokens", "k3_kl": "no tokens"},
                                   titles={"share": "share of tokens"}), hide_index=True, width="stretch")
        sharpness(d["sharpness"], span)

    def sharpness(series, span) -> None:
        contrast = loaders.SHARPNESS[0]
        st.subheader("Sharpness contrast: is the trainer sharper than the sampler?")
        st.caption(f"{METRIC_BY_KEY[contrast].description}. `{SHARPNESS_SHIFT.name}` fires above "
                   f"{SHARPNESS_SHIFT.threshold:g} on a pool that does not lag.")
        if not series[contrast].notna().any():
            layout.empty("No contrast in the steps shown: a pool needs two tokens at each end with a resolved "
                         "spread of ρ, and runs written before the sharpness fields have none.")
            return
        layout.chart(figures.line_figure(series, contrast, group="pool", x=view.x, width=span.width,
                                         y_title="contrast (standard errors)", y_scale="linear"),
                     key="lowprob_sharpness", events=layout.marks(view, span))

    layout.live(body, view)
