"""Pools: every metric per pool over steps, side by side; who holds the tail; what each pool is."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from mismatch_monitor.app import data, exemplar_links, figures, layout, loaders, state, tables
from mismatch_monitor.metrics import METRIC_BY_KEY

view = state.current()


def open_exemplars(step: int, pool: str | None) -> None:
    """The Exemplars page on ``step`` and ``pool`` (its own choices of step, pool and sequence
    forgotten, so that the link's are taken)."""
    for key in ("ex_step", "ex_pool", "ex_seq"):
        st.session_state.pop(key, None)
    st.switch_page("page_exemplars.py", query_params=exemplar_links.params(view.run_name, step, pool))

def target_step(target: tuple[int, str | None], width: int) -> tuple[int, str | None]:
    """A clicked (bin, pool) as the step to open: in bins of several steps, the bin's step with
    the pool's worst stored token (the bin's first step when none of them holds one)."""
    start, pool = target
    if width <= 1:
        return start, pool
    steps = data.load("exemplars", view.run_dir, **view.params, pool=pool)["exemplar_steps"]
    worst = exemplar_links.worst_in_bin(steps, start, width)
    return (start if worst is None else worst), pool


if layout.page_header("Pools", view, "Each sampler pool against the others: its metrics over steps, and "
                      "its share of the samples against its share of the extreme-ratio tokens."):
    metrics = st.multiselect("Metrics", list(METRIC_BY_KEY), default=list(loaders.POOL_DEFAULT),
                             format_func=layout.metric_label, key="pools_metrics", bind="query-params")

    def body() -> None:
        d = data.load("pools", view.run_dir, **view.params, metrics=tuple(metrics))
        span = d["span"]
        layout.run_caption(view, span, d["index"])
        if span is None:
            layout.no_steps("the pools page")
            return
        meta = pd.DataFrame.from_dict(d["info"].get("pools", {}), orient="index")
        shares = d["shares"]
        st.subheader("Share of samples vs share of the tail")
        if not len(shares):
            layout.empty("No observation in the steps shown.")
        else:
            over = shares[shares["tail_to_sample"] >= 1.5]
            for _, r in over.iterrows():
                st.warning(f"Pool **{figures.label(r['pool'])}** holds {r['sample_share']:.1%} of the samples "
                           f"but {r['extreme_share']:.1%} of the extreme-ratio tokens "
                           f"({r['tail_to_sample']:.1f}× its share).", icon=":material/warning:")
            layout.chart(figures.share_bars(shares), key="pools_shares")
            table = shares.merge(meta, left_on="pool", right_index=True, how="left") if len(meta) else shares
            st.dataframe(tables.pool_shares(table), hide_index=True, width="stretch")
        st.subheader("Pool metadata (run.json)")
        if len(meta):
            st.dataframe(tables.styled(meta.rename_axis("pool").reset_index()), hide_index=True, width="stretch")
        else:
            layout.empty("The collector was given no pool metadata (`pools={...}`).")
        st.subheader("Metrics per pool over steps")
        if not metrics:
            layout.empty("Pick at least one metric.")
        elif not len(d["series"]):
            layout.empty("Steps were logged but none has an observation yet.")
        else:
            titles = {k: layout.metric_label(k) for k in metrics}
            scale = layout.scale_control("pools_series")
            fig = figures.small_multiples(d["series"], list(metrics), titles, group="pool", x=view.x,
                                          smoothing=view.smoothing, width=span.width, y_scale=scale)
            points = layout.chart(exemplar_links.clickable(fig, d["series"], span.width), key="pools_series",
                                  events=layout.marks(view, span), clicks=True)
            st.caption("Click a point to open the exemplars of its step and pool"
                       + (" (of a bin: its step with the pool's worst stored token)." if span.width > 1 else "."))
            target = exemplar_links.clicked(points, d["series"], view.x)
            if target is not None:
                open_exemplars(*target_step(target, span.width))
        ex = data.load("exemplars", view.run_dir, **view.params)["exemplar_steps"]
        if len(ex):
            st.markdown("Exemplars of the steps with the largest |log ρ|: "
                        + exemplar_links.worst_steps_markdown(view.run_name, ex))

    layout.live(body, view)
