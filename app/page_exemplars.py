"""Exemplars: the worst tokens and sequences of a chosen step, with their labels."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from mismatch_monitor.app import data, layout, state

view = state.current()


TOKEN_FIRST = ["abs_log_ratio", "log_ratio", "trainer_logprob", "sampler_logprob", "pool"]
SEQUENCE_FIRST = ["seq_max_abs_log_ratio", "seq_log_ratio", "seq_mean_log_ratio", "length", "advantage", "pool"]


def _ordered(frame: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    """Ranking columns first; bookkeeping and labels no row carries left out."""
    frame = frame.drop(columns=["step_wall_time", "step"], errors="ignore").dropna(axis=1, how="all")
    lead = [c for c in first if c in frame.columns]
    return frame[lead + [c for c in frame.columns if c not in lead]]


def _jump(step: int) -> None:
    st.session_state["ex_step"] = step


if layout.page_header("Exemplars", view, "Aggregates say that the tail moved; exemplars say which tokens "
                      "and sequences moved it."):
    steps = data.load("exemplars", view.run_dir, **view.params)["exemplar_steps"]
    if not len(steps):
        layout.empty("No exemplar in this run (the collector keeps the K worst tokens and sequences per "
                     "step unless `exemplars_k=0`), or no visible step yet.")
    else:
        first, last = int(steps["step"].min()), int(steps["step"].max())
        c1, c2 = st.columns([1, 1])
        step = c1.number_input("Step", min_value=first, max_value=last, value=last, step=1, key="ex_step",
                               bind="query-params")
        k = c2.slider("How many", 1, 64, 16, key="ex_k", bind="query-params")
        worst = steps.sort_values("max_abs_log_ratio", ascending=False).head(5)
        st.caption("Steps with the largest |log ρ|:")
        cols = st.columns(len(worst))
        for col, (_, r) in zip(cols, worst.iterrows()):
            col.button(f"step {int(r['step'])} · {r['max_abs_log_ratio']:.3g}", key=f"ex_jump_{int(r['step'])}",
                       on_click=_jump, args=(int(r["step"]),))

        def body() -> None:
            d = data.load("exemplars", view.run_dir, **view.params, step=int(step), k=int(k))
            layout.run_caption(view, d["span"], d["index"])
            if not len(d["tokens"]) and not len(d["sequences"]):
                layout.empty(f"Step {int(step)} holds no exemplar (not logged, or no valid token).")
                return
            st.subheader(f"Worst tokens of step {int(step)} (by |log ρ|)")
            st.dataframe(_ordered(d["tokens"], TOKEN_FIRST), hide_index=True, width="stretch")
            st.subheader(f"Worst sequences of step {int(step)} (by max |log ρ|)")
            st.dataframe(_ordered(d["sequences"], SEQUENCE_FIRST), hide_index=True, width="stretch")

        layout.live(body, view)
