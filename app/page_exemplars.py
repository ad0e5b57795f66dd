"""Exemplars: the worst tokens and sequences of a chosen step, with their labels."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from mismatch_monitor.app import data, layout, state, tables, token_spans

view = state.current()


EVERY_POOL = "(every pool)"
TOKEN_FIRST = ["abs_log_ratio", "log_ratio", "trainer_logprob", "sampler_logprob", "pool"]
SEQUENCE_FIRST = ["seq_max_abs_log_ratio", "seq_log_ratio", "seq_mean_log_ratio", "length", "advantage", "pool"]


def _ordered(frame: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    """Ranking columns first; bookkeeping and labels no row carries left out."""
    frame = frame.drop(columns=["step_wall_time", "step"], errors="ignore").dropna(axis=1, how="all")
    lead = [c for c in first if c in frame.columns]
    return frame[lead + [c for c in frame.columns if c not in lead]]


def _jump(step: int) -> None:
    st.session_state["ex_step"] = step


def _url_step(first: int, last: int) -> None:
    """A link's ?step= (from a chart page) chooses the step once, before the widget is drawn."""
    raw = st.query_params.get("step")
    if raw is not None and "ex_step" not in st.session_state:
        try:
            st.session_state["ex_step"] = min(max(int(raw), first), last)
        except ValueError:
            st.warning(f"The link's step {raw!r} is not a step number; showing the last step.")


def _choice(label: str, options: list[Any], param: str, key: str, **kw: Any) -> Any:
    """A selectbox whose choice is the URL's ``param`` (the first option where the URL names
    none) and is written back to it, so a copied URL reopens the same choice. Not a bound widget:
    the URL holds the option itself, not its label (``format_func``)."""
    texts = [str(o) for o in options]
    wanted = st.query_params.get(param)
    value = st.selectbox(label, options, index=texts.index(wanted) if wanted in texts else 0, key=key, **kw)
    if value is None or not options or value == options[0]:
        st.query_params.pop(param, None)
    elif st.query_params.get(param) != str(value):
        st.query_params[param] = str(value)
    return value


def _token_view(tokens: pd.DataFrame, step: int) -> None:
    """The chosen sequence's stored tokens as spans coloured by |log ρ| (pool and sequence from
    the URL, and written back to it)."""
    pools = sorted(tokens["pool"].dropna().unique()) if "pool" in tokens else []
    wanted = st.query_params.get("pool")
    if wanted is not None and wanted not in pools:
        st.warning(f"Pool {wanted!r} holds no stored exemplar token at step {step}; showing every pool.")
    pool = _choice("Pool", [EVERY_POOL, *pools], "pool", "ex_pool")
    shown = tokens if pool == EVERY_POOL else tokens[tokens["pool"] == pool]
    seqs = shown.groupby("seq_index")["abs_log_ratio"].max().sort_values(ascending=False)
    seq = _choice("Sequence (by its worst stored token)", [int(i) for i in seqs.index], "seq", "ex_seq",
                  format_func=lambda i: f"sequence {int(i)} · max |log ρ| {seqs[i]:.3g}")
    top = float(tokens["abs_log_ratio"].max())
    st.html(token_spans.legend(top))
    st.html(token_spans.spans(shown[shown["seq_index"] == seq], top))


if layout.page_header("Exemplars", view, "Aggregates say that the tail moved; exemplars say which tokens "
                      "and sequences moved it."):
    steps = data.load("exemplars", view.run_dir, **view.params)["exemplar_steps"]
    if not len(steps):
        layout.empty("No exemplar in this run (the collector keeps the K worst tokens and sequences per "
                     "step unless `exemplars_k=0`), or no visible step yet.")
    else:
        first, last = int(steps["step"].min()), int(steps["step"].max())
        _url_step(first, last)
        c1, c2 = st.columns([1, 1])
        step = c1.number_input("Step", min_value=first, max_value=last, value=last, step=1, key="ex_step")
        if st.query_params.get("step") != str(int(step)):   # the URL names the step shown
            st.query_params["step"] = str(int(step))
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
            if len(d["tokens"]):
                st.subheader(f"Tokens of a sequence at step {int(step)}, coloured by |log ρ|")
                _token_view(d["tokens"], int(step))
            st.subheader(f"Worst tokens of step {int(step)} (by |log ρ|)")
            st.dataframe(tables.styled(_ordered(d["tokens"], TOKEN_FIRST)), hide_index=True, width="stretch")
            st.subheader(f"Worst sequences of step {int(step)} (by max |log ρ|)")
            st.dataframe(tables.styled(_ordered(d["sequences"], SEQUENCE_FIRST)), hide_index=True, width="stretch")

        layout.live(body, view)
