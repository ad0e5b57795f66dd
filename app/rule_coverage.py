"""The Alerts page's "what the rules could judge": per rule and pool, the observed steps it judged,
from run.json's ``alerting`` record (``store/alerting.py``)."""

from __future__ import annotations

import pandas as pd

from mismatch_monitor.app.tables import FLEET, NO_POOL
from mismatch_monitor.label_text import parse_label_text
from mismatch_monitor.store.alerting import Alerting


def _pool_name(pool: object) -> str:
    """A pool as the collector was given it (the record names it by label text; None: the fleet)."""
    if pool is None or (isinstance(pool, float) and pd.isna(pool)):
        return FLEET
    value = parse_label_text(str(pool))
    return NO_POOL if value is None else (value if value else '"" (empty)')


def coverage_grid(alerting: Alerting) -> pd.DataFrame:
    """One row per rule (in the evaluator's order), one column per pool: "judged of observed"
    steps, with what kept the others from being judged ("12 of 120 · 108 too small a sample")."""
    cov = alerting.coverage
    if cov is None or cov.empty:
        return pd.DataFrame()
    cells = cov.assign(pool=[_pool_name(p) for p in cov["pool"]])

    def cell(r: pd.Series) -> str:
        text = f"{r['judged']} of {r['steps']}"
        gaps = [f"{r['undecided']} too small a sample"] if r["undecided"] else []
        if r["no_input"]:
            gaps.append(f"{r['no_input']} no {r['missing'] or 'input'}")
        return text + (" · " + ", ".join(gaps) if gaps else "")

    cells["cell"] = cells.apply(cell, axis=1)
    grid = cells.pivot(index="alert", columns="pool", values="cell")
    order = list(alerting.rules or ()) + sorted(set(grid.index) - set(alerting.rules or ()))
    grid = grid.reindex([a for a in order if a in grid.index]).fillna("not seen")
    grid.columns.name = None
    return grid.reset_index().rename(columns={"alert": "rule"})
