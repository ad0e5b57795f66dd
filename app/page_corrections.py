"""Corrections: what each loss correction would clip or drop, per pool, over steps."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, layout, loaders, state

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
        titles = {
            "mismatch/clip_high_fraction": f"TIS cap: tokens with ρ > {c.tis_cap:g}",
            "mismatch/clip_low_fraction": f"TIS cap: tokens with ρ ≤ 1/{c.tis_cap:g}",
            "mismatch/icepop_masked_fraction": f"IcePop: tokens outside [{c.icepop_band[0]:g}, {c.icepop_band[1]:g}]",
            "mismatch/extreme_fraction": f"extreme band: tokens outside [{c.extreme_band[0]:g}, {c.extreme_band[1]:g}]",
            "mismatch/seq/product_mask_fraction":
                f"product mask: sequences outside [{c.seq_product_band[0]:g}, {c.seq_product_band[1]:g}]",
            "mismatch/seq/geometric_mask_fraction":
                f"geometric mask: sequences outside [{c.seq_geometric_band[0]:g}, {c.seq_geometric_band[1]:g}]",
            "mismatch/seq/mult_error_mask_fraction":
                f"sequence threshold: mean exp|log ρ| > {c.seq_mult_error_threshold:g}",
            "mismatch/seq/neg_adv_mask_fraction": f"neg.-advantage mask: A < 0 and mean(-log ρ) > {c.neg_adv_delta:g}",
        }
        st.subheader("Over the steps shown, per pool")
        st.dataframe(layout.metric_table(d["totals"], list(loaders.CORRECTIONS), ["pool"])
                     .rename(columns={layout.metric_label(k): titles[k] for k in loaders.CORRECTIONS}),
                     hide_index=True, width="stretch")
        st.subheader("Over steps")
        layout.chart(figures.small_multiples(d["series"], list(loaders.CORRECTIONS), titles, group="pool",
                                             x=view.x, smoothing=view.smoothing, width=span.width),
                     key="corrections_series")

    layout.live(body, view)
