"""A bound on how many values of one label the report and the exporter show one by one.

A fleet of a few dozen pools is shown pool by pool. A step with more pools (a bug that puts a
request id in the pool label, or a fleet of thousands of workers) would otherwise make tens of
thousands of report keys and Prometheus series per step. Beyond :attr:`LabelLimit.max_values`,
the values with the most tokens keep their own slice and every other value is merged, exactly
by each field's merge rule, into one ``%other`` slice (``report_keys.OTHER_TEXT``). The store
is not affected: it keeps every value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import pandas as pd

from .engine import MismatchStats
from .metrics import METRIC_TABLES
from .report_keys import OTHER_TEXT, label_text

DEFAULT_MAX_VALUES = 100


@dataclass(frozen=True)
class LabelLimit:
    """``max_values``: most values of one label dimension (pool, hardware) shown one by one in
    the flat report and in Prometheus; the rest are merged into ``%other``."""

    max_values: int = DEFAULT_MAX_VALUES

    def __post_init__(self) -> None:
        if isinstance(self.max_values, bool) or not isinstance(self.max_values, int) or self.max_values < 1:
            raise ValueError(f"expected LabelLimit.max_values to be an integer >= 1, got {self.max_values!r}")


def top_values(texts: Sequence[str | None], tokens: Sequence[float] | np.ndarray, n: int) -> set[str | None]:
    """The ``n`` label texts with the most tokens (ties: the smaller text first, so the choice
    does not depend on the order the values came in)."""
    tokens = np.nan_to_num(np.asarray(tokens, dtype=np.float64), nan=0.0)
    order = sorted(range(len(texts)), key=lambda i: (-tokens[i], texts[i] or ""))
    return {texts[i] for i in order[:n]}


def texts_of(values: object) -> tuple[np.ndarray, list[str]]:
    """Per row, the code of its label text; and the texts (``label_text`` of each distinct value)."""
    codes, uniques = pd.factorize(pd.Series(values, dtype=object), use_na_sentinel=False)
    texts = [label_text(None if u is None or (isinstance(u, float) and np.isnan(u)) or u is pd.NA
                        else str(u)) for u in uniques]
    return codes, texts


def relabel_beyond(stats: MismatchStats, dim: str, keep: Collection[str | None]) -> MismatchStats:
    """The metric tables of ``stats`` with ``dim`` written as label texts and every text outside
    ``keep`` replaced by ``%other``; rows are not merged (whoever groups by ``dim`` merges them
    by the fields' rules). Only label texts (never raw values) come out, so ``%other`` cannot
    meet a real value."""
    keep = set(keep)
    tables = {}
    for table in METRIC_TABLES:
        df = stats.tables[table]
        codes, texts = texts_of(df[dim]) if dim in df else (np.zeros(len(df), dtype=np.int64), [label_text(None)])
        mapped = np.array([t if t in keep else OTHER_TEXT for t in texts] or [OTHER_TEXT], dtype=object)
        relabeled = df.assign(**{dim: pd.array(mapped[codes] if len(df) else [], dtype="string")})
        tables[table] = relabeled
    return MismatchStats(tables, stats.dims)
