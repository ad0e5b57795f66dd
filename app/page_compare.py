"""Compare runs: two runs (e.g. before and after an engine upgrade) per slice, differences flagged."""

from __future__ import annotations

import streamlit as st

from mismatch_monitor.app import comparison, data, layout, loaders, state, tables
from mismatch_monitor.app.runs import resolve_run
from mismatch_monitor.batch import STANDARD_DIMENSIONS

view = state.current()
SLICES = ["pool", *[d for d in STANDARD_DIMENSIONS if d != "pool"], "length_bucket", "turn_bucket", "(whole run)"]

if layout.page_header("Compare runs", view, "Run A (the sidebar's run) against run B, each merged over its "
                      "own steps shown, per slice. Differences at or above the threshold are flagged."):
    runs = data.catalog(view.root).sort_values(["steps", "last_update"], ascending=False, na_position="last")
    others = [n for n in runs["name"] if n != view.run_name]  # runs with most steps first
    if not others:
        layout.empty("Only one run under the runs root: nothing to compare it with.")
    else:
        c1, c2, c3, c4 = st.columns(4)
        other = c1.selectbox("Run B", others, key="cmp_run", bind="query-params")
        by = c2.selectbox("Slice by", SLICES, key="cmp_by", bind="query-params")
        metric = c3.selectbox("Metric", list(loaders.POOL_DEFAULT), format_func=layout.metric_label,
                              key="cmp_metric", bind="query-params")
        threshold = c4.slider("Flag at relative difference", 0.05, 2.0, 0.25, 0.05, key="cmp_rel",
                              bind="query-params")
        other_dir = resolve_run(view.root, other)
        keys = [] if by == "(whole run)" else [by]

        def body() -> None:
            d = data.load("compare", view.run_dir, also=(other_dir,), **view.params, other=str(other_dir),
                          by=tuple(keys), metric=metric)
            layout.run_caption(view, d["span"], d["index"])
            if d["span"] is None or d["span_b"] is None:
                layout.empty("One of the two runs has no visible step yet.")
                return
            if d["configs_differ"]:
                st.warning("The two runs use different MetricConfig thresholds: bands, caps and buckets "
                           "may not mean the same.", icon=":material/warning:")
            table = d["table"]
            for col, name in (("a", view.run_name), ("b", other)):
                if table[col].isna().all():
                    layout.empty(f"Run {name} has no observation in its steps shown: nothing to compare.")
                    return
            names = (f"A: {view.run_name}", f"B: {other}")
            layout.chart(comparison.compare_bars(table, metric, keys, names=names,
                                                 metric_label=layout.metric_label(metric),
                                                 rel_threshold=threshold), key="cmp_bars")
            st.caption(f"{layout.MARKS_CAPTION} Run A's lines full, run B's faint.")
            layout.chart(comparison.compare_lines(d.get("series_a"), d.get("series_b"), metric, names=names,
                                                  metric_label=layout.metric_label(metric), x=view.x),
                         key="cmp_lines", events=[layout.marks(view, d["span"]),
                                                  layout.marks(view, d["span_b"], other_dir, opacity=0.25)])
            flagged = comparison.flag_differences(table, threshold)
            shown = table.assign(slice=comparison.slice_names(table, keys),
                                 metric=table["metric"].map(layout.metric_label),
                                 flagged=flagged.map({True: "⚠", False: ""}))
            st.subheader(f"Per slice ({int(flagged.sum())} difference(s) flagged)")
            absent = {"a": f"not in {view.run_name}", "b": f"not in {other}", "diff": "one run only",
                      "rel": "one run only"}
            styled = tables.styled(shown[["slice", "metric", "a", "b", "diff", "rel", "flagged"]], empty=absent,
                                   titles={"a": names[0], "b": names[1], "diff": "B − A", "rel": "B / A − 1"},
                                   formats={"rel": tables.percent}).apply(
                lambda row: ["background-color: #ffe0e0" if row["flagged"] else "" for _ in row], axis=1)
            st.dataframe(styled, hide_index=True, width="stretch")

        layout.live(body, view)
