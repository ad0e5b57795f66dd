"""Routing: MoE expert-set flips per layer over steps, and the share of tokens with any flip."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import data, figures, heatmaps, layout, loaders, state

view = state.current()

if layout.page_header("Routing", view, "A rounding-level router difference sends a token to another "
                      "expert: a discontinuous disagreement no ratio cap repairs. Routing replay removes it."):
    pool = layout.pool_picker(data.meta(view.run_dir)["pools"], key="routing_pool", label="Layers of pool")

    def body() -> None:
        d = data.load("routing", view.run_dir, **view.params, pool=pool)
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the routing page")
            return
        layers = d["layers"]
        if not len(layers) or d["pools"][loaders.FLIPS].isna().all():
            layout.empty("No expert ids were logged (trainer_experts / sampler_experts): routing flips "
                         "are not observed in this run.")
            return
        st.subheader(f"Flip rate per layer · {pool or 'all pools'}")
        layout.chart(heatmaps.bucket_heatmap(layers, "flip_rate", "layer", x=view.x, width=span.width,
                                             value_title="flip rate", y_title="layer", log_color=False),
                     key="routing_layers", x=view.x)
        st.subheader("Per pool")
        titles = {loaders.FLIPS: "flip rate (token, layer)", loaders.ANY_FLIP: "tokens with ≥ 1 flipped layer"}
        scale = layout.scale_control("routing_pools")
        layout.chart(figures.small_multiples(d["pools"], [loaders.FLIPS, loaders.ANY_FLIP], titles,
                                             group="pool", x=view.x, smoothing=view.smoothing,
                                             width=span.width, y_scale=scale), key="routing_pools", events=layout.marks(view, span))

    layout.live(body, view)
