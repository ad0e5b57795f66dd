"""The one definition of every reported metric, as a function of merged sufficient statistics.

A metric is never stored: it is computed from summed columns (``fields.py``) after any merge,
so a marginal over pools, steps or ranks means exactly what it means for one cell. The collector's
report, the DuckDB query layer, the Prometheus exporter and the dashboard all call
:func:`derive`; Prometheus names come from :func:`prometheus_name`.

An empty slice (no valid token, no sequence) gives NaN, reported as null: never 0.0, which
would read as "no mismatch".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from .config import MetricConfig
from .engine.fields import merge_rules
from .engine.groupby import columns_of, group, merge_columns
from .engine.histogram import QUANTILES, LogBins, quantiles_from_counts
from .formulas import evaluate
from .metric_defs import DEFAULT_FORMAT, METRICS, VIEW_METRICS, Metric, Unit

__all__ = ["DEFAULT_FORMAT", "METRICS", "METRIC_BY_KEY", "VIEW_METRICS", "Metric", "Unit", "derive", "format_of",
           "prometheus_name", "report", "report_by_label", "title_of", "unit_of"]

Frame = pd.DataFrame
METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}


def unit_of(metric_key: str) -> str:
    """The unit of a metric key (see ``Unit``); KeyError for a key that is no metric."""
    return METRIC_BY_KEY[metric_key].unit


def format_of(metric_key: str) -> str:
    """The format spec a value of the metric is shown with (``format(value, format_of(key))``)."""
    return METRIC_BY_KEY[metric_key].format_spec


def title_of(metric_key: str, config: MetricConfig) -> str:
    """The metric's title with the thresholds of ``config`` (the run's) filled in."""
    return METRIC_BY_KEY[metric_key].title_under(config)


def prometheus_name(key: str) -> str:
    """Metric key -> Prometheus metric name: ``mismatch/abs_log_ratio/p99`` ->
    ``mismatch_abs_log_ratio_p99``; fractions end in ``_ratio``, KL in ``_nats``."""
    metric = METRIC_BY_KEY.get(key)
    name = re.sub(r"[^a-zA-Z0-9_]", "_", key.replace("/", "_"))
    name = name.replace("_fraction", "")
    if metric is not None and metric.unit in ("share", "ratio") and not name.endswith("_ratio"):
        name += "_ratio"
    if metric is not None and metric.unit == "nats":
        name += "_nats"
    return name


def _row_of(keys: pd.DataFrame, other: pd.DataFrame, by: list[str]) -> np.ndarray:
    """For each row of ``other``, the row of ``keys`` with the same ``by`` values (-1: none).
    ``keys`` rows are distinct; nulls match nulls (as in the SQL layer's GROUP BY)."""
    if not by:
        return np.zeros(len(other), dtype=np.int64) if len(keys) else np.full(len(other), -1)
    groups = group([columns_of(keys[by]), columns_of(other[by])], by, within=0)
    position = np.full(groups.size, -1)
    position[groups.codes[0]] = np.arange(len(keys))
    return np.where(groups.codes[1] >= 0, position[groups.codes[1]], -1)


def _token_values(tok: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    return {m.key: evaluate(m.formula, tok) if n else np.zeros(0)
            for m in METRICS if m.table == "tokens"}


def _sequence_values(seq: Mapping[str, np.ndarray] | None, n: int) -> dict[str, np.ndarray]:
    """``seq``: the merged sequence columns of each group (NaN where a group has no sequence
    row); None: no sequence-level value for any group."""
    return {m.key: evaluate(m.formula, seq) if seq is not None else np.full(n, np.nan)
            for m in METRICS if m.table == "sequences"}


QUANTILE_KEYS = tuple(f"mismatch/abs_log_ratio/{name}" for name, _ in QUANTILES)


def _quantile_values(group: np.ndarray, bins: np.ndarray, counts: np.ndarray, exact_max: np.ndarray,
                     config: MetricConfig) -> dict[str, np.ndarray]:
    """Quantiles of |lr| per group from histogram rows (group code, bin, count); clamped to the
    exact max of each group."""
    vals = quantiles_from_counts(LogBins.from_config(config), group, bins, counts,
                                 tuple(q for _, q in QUANTILES), exact_max=exact_max)
    return {k: vals[:, j] for j, k in enumerate(QUANTILE_KEYS)}


def derive(tokens: Frame, sequences: Frame | None = None, abs_hist: Frame | None = None, *,
           by: Sequence[str] = (), config: MetricConfig | None = None) -> pd.DataFrame:
    """Metric values per group of ``by`` columns from *summed* tables.

    ``tokens``/``sequences`` hold one row per group with the merged sufficient statistics
    (as :meth:`MismatchStats.marginal` or the SQL layer returns them); ``abs_hist`` holds rows
    (group keys..., bin, count). Returns one row per group of ``tokens`` with one column per key.
    """
    config = config or MetricConfig()
    by = list(by)
    keys = tokens[by].reset_index(drop=True) if by else pd.DataFrame(index=range(len(tokens)))
    n = len(keys)
    values = _token_values(columns_of(tokens), n)
    joined = None
    # sequences span turns: a turn-sliced row has no sequence-level value
    if sequences is not None and n and "turn_bucket" not in by:
        row = _row_of(keys, sequences, by)       # the group of each sequence row
        hit = row >= 0
        joined = {}
        for c in sequences.columns:
            if c in by or sequences[c].dtype.kind not in "iuf":
                continue
            column = np.full(n, np.nan)
            column[row[hit]] = sequences[c].to_numpy()[hit]
            joined[c] = column
    values.update(_sequence_values(joined, n))
    if abs_hist is not None and n and len(abs_hist):
        group = _row_of(keys, abs_hist, by)
        hit = group >= 0
        values.update(_quantile_values(group[hit], abs_hist["bin"].to_numpy()[hit],
                                       abs_hist["count"].to_numpy()[hit],
                                       values["mismatch/abs_log_ratio/max"], config))
    else:
        values.update({k: np.full(n, np.nan) for k in QUANTILE_KEYS})
    metrics = pd.DataFrame(values, index=keys.index)
    return pd.concat([keys, metrics], axis=1) if by else metrics


@dataclass(frozen=True)
class GroupMetrics:
    """Metric values per value of one label dimension (``dim``), or of everything (``dim=None``,
    one group): ``labels`` [G] (None: the label was not given), ``values`` {metric key: [G]}."""

    dim: str | None
    labels: tuple[str | None, ...]
    values: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.labels)

    def to_frame(self) -> pd.DataFrame:
        """The frame :func:`derive` returns for the same groups."""
        metrics = pd.DataFrame(self.values, index=range(len(self.labels)))
        if self.dim is None:
            return metrics
        keys = pd.DataFrame({self.dim: pd.array(list(self.labels), dtype="string")})
        return pd.concat([keys, metrics], axis=1)


def _with_total(cols: Mapping[str, object], table: str, codes: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """Merged columns of ``table`` per group code [G], followed by the merge of every row: [G + 1]
    float64 each (exact for counts below 2^53)."""
    rules = merge_rules(table)
    grouped = merge_columns(cols, rules, codes, G)
    whole = merge_columns(cols, rules, np.zeros(len(codes), dtype=np.int64), 1)
    return {c: np.concatenate([grouped[c], whole[c]]).astype(np.float64) for c in rules}


def config_for(stats, config: MetricConfig | None, reader: str = "report") -> MetricConfig:
    """The config ``stats`` are read under: the one they were computed with when none is given
    (``stats.params``); a given one must agree with it on every parameter, or the histogram
    bins, bands and buckets would be read as other numbers (a quantile of another accuracy is
    off by up to that accuracy's bin, silently). Stats that record no parameters take
    ``config`` (or the defaults) as they are."""
    if stats.params is None:
        return config or MetricConfig()
    if config is None:
        return MetricConfig.from_stats_parameters(stats.params)
    stats.check_parameters(config, reader)
    return config


def report_by_label(stats, dim: str = "pool", config: MetricConfig | None = None
                    ) -> tuple[GroupMetrics, GroupMetrics]:
    """Metrics of every value of one label dimension, and of the whole step: the same values
    as ``report(stats, [dim])`` and ``report(stats)``, from one group-by of the three tables'
    columns with no frame built in between (the collector reports every step). Sums are
    float64 (exact for counts below 2^53).
    ``config``: see :func:`config_for`."""
    config = config_for(stats, config, "report_by_label")
    if dim not in stats.dims:
        raise ValueError(f"{dim!r} is not a label dimension of these statistics (they have {list(stats.dims)})")
    rows = {t: len(stats.tables[t]) for t in METRIC_TABLES}
    if rows["tokens"] == 0:
        empty = {k: np.zeros(0) for k in METRIC_BY_KEY}
        return GroupMetrics(dim, (), empty), GroupMetrics(None, (), dict(empty))
    tokens, sequences, hist = (columns_of(stats.tables[t]) for t in METRIC_TABLES)
    groups = group([tokens, sequences, hist], [dim], within=0)    # the labels the tokens have
    labels = [None if pd.isna(v) else str(v) for v in groups.values[dim]]
    G = groups.size
    tok_codes, seq_codes, hist_codes = groups.codes
    # each group, then one more merging every row: the whole step
    tok = _with_total(tokens, "tokens", tok_codes, G)
    values = _token_values(tok, G + 1)
    seq = _with_total(sequences, "sequences", seq_codes, G)
    present = np.bincount(seq_codes[seq_codes >= 0], minlength=G + 1) > 0
    present[G] = rows["sequences"] > 0
    for column in seq.values():
        column[~present] = np.nan         # a group without sequence rows: no sequence value
    values.update(_sequence_values(seq, G + 1))
    hit = hist_codes >= 0
    bins, counts = np.asarray(hist["bin"]), np.asarray(hist["count"])
    group_of = np.concatenate([hist_codes[hit], np.full(rows["abs_hist"], G)])   # then every row: the total
    bins = np.concatenate([bins[hit], bins])
    counts = np.concatenate([counts[hit], counts])
    values.update(_quantile_values(group_of, bins, counts, values["mismatch/abs_log_ratio/max"], config))
    by = GroupMetrics(dim, tuple(labels), {k: v[:G] for k, v in values.items()})
    total = GroupMetrics(None, (None,), {k: v[G:] for k, v in values.items()})
    return by, total


METRIC_TABLES = ("tokens", "sequences", "abs_hist")


def metric_tables(stats):
    """Only the tables metrics read: merging histograms of other kinds would be wasted work."""
    return type(stats)({t: stats.tables[t] for t in METRIC_TABLES}, stats.dims, stats.params)


def report(stats, by: Sequence[str] = (), config: MetricConfig | None = None) -> pd.DataFrame:
    """Metrics of a :class:`MismatchStats` merged down to ``by`` (``()`` = everything), read
    under the config they were computed with (``config``: see :func:`config_for`)."""
    config = config_for(stats, config)
    m = metric_tables(stats).marginal(by)
    return derive(m["tokens"], m["sequences"], m["abs_hist"], by=by, config=config)
