"""A bound on how many values of one label the report and the exporter show one by one.

A fleet of a few dozen pools is shown pool by pool. A step with more pools (a bug that puts a
request id in the pool label, or a fleet of thousands of workers) would otherwise make tens of
thousands of report keys and Prometheus series per step. Beyond :attr:`LabelLimit.max_values`,
the values with the most tokens keep their own slice and every other value is merged, exactly
by each field's merge rule, into one ``%other`` slice (``label_text.OTHER_TEXT``). The store
is not affected: it keeps every value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np
import pandas as pd

from .engine import MismatchStats
from .metrics import METRIC_TABLES
from .label_text import OTHER_TEXT, label_text

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
    """Per row, the code of its label text; and the texts (``label_text`` of each distinct value).
    Factorizes the column's own array (an Arrow string column takes a fraction of the time of
    the same values as Python objects)."""
    array = values.array if isinstance(values, pd.Series) else values
    codes, uniques = pd.factorize(array, use_na_sentinel=False)
    # a null is None, pd.NA or NaN (pd.isna per value would cost more than the factorize)
    texts = [label_text(None if u is None or u is pd.NA or u != u else str(u)) for u in uniques]
    return np.asarray(codes, dtype=np.int64), texts


def rest_of(stats: MismatchStats, dim: str, keep: Collection[str | None]) -> MismatchStats:
    """The rows of the metric tables of ``stats`` whose ``dim`` label text is not in ``keep``,
    with ``dim`` set to ``%other``: whoever groups them by ``dim`` merges them, by the fields'
    rules, into the one remainder slice."""
    keep = set(keep)
    tables = {}
    for table in METRIC_TABLES:
        df = stats.tables[table]
        if dim in df:
            codes, texts = texts_of(df[dim])
            rest = np.array([t not in keep for t in texts] or [False])[codes]
        else:
            rest = np.full(len(df), label_text(None) not in keep)
        tables[table] = df[rest].assign(**{dim: pd.array([OTHER_TEXT] * int(rest.sum()), dtype="string")})
    return MismatchStats(tables, stats.dims)
