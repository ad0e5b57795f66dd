"""A run's metric history step by step, and one step's values as the rules read them."""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import pandas as pd

from mismatch_monitor.metrics import GroupMetrics
from mismatch_monitor.report_keys import label_text

from .conditions import Snapshot


def iter_steps(history: pd.DataFrame, fleet_history: pd.DataFrame | None = None, extra_steps: Iterable[int] = ()
               ) -> Iterator[tuple[int, pd.DataFrame, pd.DataFrame | None]]:
    """(step, per-pool rows, fleet row) for every step of either history (and ``extra_steps``),
    in order."""
    steps = set(history["step"].astype(int)) if len(history) else set()
    steps |= {int(s) for s in extra_steps}
    if fleet_history is not None and len(fleet_history):
        steps |= set(fleet_history["step"].astype(int))
    by_step = dict(tuple(history.groupby("step", sort=True))) if len(history) else {}
    fleet_by_step = (dict(tuple(fleet_history.groupby("step", sort=True)))
                     if fleet_history is not None and len(fleet_history) else {})
    empty = history.iloc[0:0]
    for step in sorted(steps):
        yield step, by_step.get(step, empty), fleet_by_step.get(step)


def _snapshot(frame: pd.DataFrame | GroupMetrics | None, keys: list[str], *, pooled: bool) -> Snapshot:
    if frame is None or len(frame) == 0:
        return Snapshot((), {k: np.empty(0) for k in keys})
    if isinstance(frame, GroupMetrics):
        pools = (tuple(label_text(p) for p in frame.labels) if pooled
                 else ("",) * len(frame))
        nan = np.full(len(frame), np.nan)
        return Snapshot(pools, {k: frame.values.get(k, nan) for k in keys})
    if pooled:
        pools = tuple(label_text(None if pd.isna(p) else str(p)) for p in frame["pool"])
    else:
        pools = ("",) * len(frame)
    n = len(frame)
    values = {k: frame[k].to_numpy(dtype=np.float64, na_value=np.nan) if k in frame else np.full(n, np.nan)
              for k in keys}
    return Snapshot(pools, values)
