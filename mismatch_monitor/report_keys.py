"""Names of slices: the flat report keys built from label texts.

Every label value becomes a *label text* (``label_text.py``: ``%null``, ``%empty``, ``%other``,
``%XX`` escapes; never empty, never a ``/``), one definition used by the flat report
(``wandb.log`` keys) and by the Prometheus exporter's label values. Report keys:
``mismatch/k3_kl`` for the whole step, ``mismatch/pool=<label text>/k3_kl`` per pool; no metric
key starts with ``mismatch/pool``, so the two forms never meet (:func:`parse_report_key`).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import numpy as np

from .config import MetricConfig
from .label_limits import LabelLimit, rest_of, top_values
from .label_text import EMPTY_TEXT, NULL_TEXT, OTHER_TEXT, label_text, parse_label_text  # noqa: F401 (re-exported)
from .metrics import METRICS, GroupMetrics, report_by_label

if TYPE_CHECKING:
    from .engine import MismatchStats

PREFIX = "mismatch/"
MERGED_KEY = "mismatch/pools_merged"   # how many pool values went into %other at this step
if any(m.key.startswith(PREFIX + "pool") for m in METRICS) or MERGED_KEY in {m.key for m in METRICS}:
    raise AssertionError("a metric key starting with mismatch/pool would make report keys ambiguous")


class CardinalityWarning(UserWarning):
    """More label values in a step than the configured limit: the rest are merged into ``%other``."""


def report_key(metric_key: str, pool_text: str | None = None) -> str:
    """``mismatch/k3_kl`` (``pool_text`` None: the whole step) or ``mismatch/pool=fp8/k3_kl``."""
    if pool_text is None:
        return metric_key
    return f"{PREFIX}pool={pool_text}/{metric_key[len(PREFIX):]}"


def parse_report_key(key: str) -> tuple[str | None, str]:
    """(pool label text or None for the whole step, metric key) of a flat report key."""
    if not key.startswith(PREFIX):
        raise ValueError(f"not a report key: {key!r}")
    rest = key[len(PREFIX):]
    if not rest.startswith("pool="):
        return None, key
    text, sep, metric = rest[len("pool="):].partition("/")
    if not sep:
        raise ValueError(f"not a report key: {key!r}")
    return text, PREFIX + metric


def _rows(out: dict[str, float], metrics: GroupMetrics, texts: list[str | None], keep: np.ndarray) -> None:
    keys = list(metrics.values)
    table = np.column_stack([metrics.values[k] for k in keys])[keep].tolist()   # [groups, metrics]
    for text, row in zip((texts[i] for i in np.flatnonzero(keep)), table):
        out.update((report_key(k, text), v) for k, v in zip(keys, row) if not math.isnan(v))


def flatten_report(fleet: GroupMetrics, by_pool: GroupMetrics, stats: MismatchStats | None = None, *,
                   config: MetricConfig | None = None, limit: LabelLimit | None = None) -> dict[str, float]:
    """The flat report of one step: ``mismatch/k3_kl`` for the whole step and
    ``mismatch/pool=<label text>/k3_kl`` per pool; nulls omitted.

    Beyond ``limit.max_values`` pools, the pools with the most tokens keep their keys and the
    rest are merged exactly (from ``stats``, by each field's merge rule) into ``pool=%other``;
    ``mismatch/pools_merged`` says how many, and a :class:`CardinalityWarning` is issued.
    ``config`` is the one the statistics were computed with (the histogram's accuracy).
    """
    limit = limit or LabelLimit()
    out: dict[str, float] = {}
    if len(fleet):
        _rows(out, fleet, [None], np.ones(1, dtype=bool))
    if not len(by_pool):
        return out
    texts: list[str | None] = [label_text(p) for p in by_pool.labels]
    keep = np.ones(len(texts), dtype=bool)
    if len(texts) > limit.max_values:
        kept = top_values(texts, by_pool.values["mismatch/n_tokens"], limit.max_values)
        keep = np.array([t in kept for t in texts])
        out[MERGED_KEY] = float((~keep).sum())
        if stats is None:
            warnings.warn("more pools in a step than LabelLimit.max_values and no statistics to merge "
                          "the rest: the pools with the fewest tokens are left out of the report",
                          CardinalityWarning, stacklevel=2)
        else:
            warnings.warn("more pools in a step than LabelLimit.max_values: the pools with the fewest "
                          "tokens are merged into pool=%other in the report (the store keeps each)",
                          CardinalityWarning, stacklevel=2)
            other, _ = report_by_label(rest_of(stats, "pool", kept), "pool", config)
            _rows(out, other, [OTHER_TEXT] * len(other), np.ones(len(other), dtype=bool))
    _rows(out, by_pool, texts, keep)
    return out

