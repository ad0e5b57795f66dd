"""Links that open the Exemplars page on a step (and pool): /exemplars?run=..&step=..&pool=.."""

from __future__ import annotations

from urllib.parse import urlencode

import pandas as pd


def url(run: str, step: int, pool: str | None = None) -> str:
    q = {"run": run, "step": int(step)}
    if pool:
        q["pool"] = pool
    return "exemplars?" + urlencode(q)


def worst_steps_markdown(run: str, steps: pd.DataFrame, n: int = 5) -> str:
    """Markdown links to the ``n`` steps with the largest stored |log ρ| (exemplar_steps' frame)."""
    worst = steps.sort_values("max_abs_log_ratio", ascending=False).head(n)
    return " · ".join(f"[step {int(r['step'])} ({r['max_abs_log_ratio']:.3g})]({url(run, int(r['step']))})"
                      for _, r in worst.iterrows())
