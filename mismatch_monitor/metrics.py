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
from typing import Callable, Literal, Mapping, Sequence

import numpy as np
import pandas as pd

from .config import MetricConfig
from .engine.fields import merge_rules
from .engine.stats import merge_column, merge_total
from .engine.histogram import QUANTILES, LogBins, quantiles_from_counts

# "share": a fraction of tokens or sequences in [0, 1]; "ratio": a dimensionless ratio that is
# not a share (ESS, chi^2, multiplicative error); "log-ratio": in units of lr = log pi - log mu
Unit = Literal["nats", "share", "ratio", "count", "steps", "log-ratio"]
# the format spec each unit is shown with unless a declaration names its own
DEFAULT_FORMAT: dict[str, str] = {"nats": ".3g", "share": ".2%", "ratio": ".3g", "count": ",.0f",
                                  "steps": ".3g", "log-ratio": ".3g"}
Frame = pd.DataFrame


def _f(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def _div(num: pd.Series | np.ndarray, den: pd.Series | np.ndarray) -> np.ndarray:
    """num / den where den > 0, else NaN (divides only there: no warning to silence)."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.full(np.broadcast_shapes(num.shape, den.shape), np.nan)
    return np.divide(num, den, out=out, where=den > 0)


@dataclass(frozen=True)
class Metric:
    key: str                      # hierarchical, e.g. "mismatch/k3_kl"
    table: Literal["tokens", "sequences", "abs_hist"]
    unit: Unit
    label: str                    # short human label (dashboard, CLI)
    description: str
    fn: Callable[[Frame], np.ndarray] | None = None  # over summed columns; None for quantiles
    format: str = ""              # format spec of a value; "" = the unit's DEFAULT_FORMAT

    @property
    def format_spec(self) -> str:
        return self.format or DEFAULT_FORMAT[self.unit]


def _t(key, unit, label, description, fn) -> Metric:
    return Metric(key, "tokens", unit, label, description, fn)


def _s(key, unit, label, description, fn) -> Metric:
    return Metric(key, "sequences", unit, label, description, fn)


def _ess(sum_w, sum_w2, n) -> np.ndarray:
    """(sum w)^2 / (n sum w^2). A weight above ~e^354 overflows sum w^2 (and above ~e^709 sum w):
    then one weight dominates every other and the ratio's limit is 1/n, not the NaN of inf/inf,
    which would hide a collapse from the low-ESS alert."""
    sum_w, sum_w2, n = _f(sum_w), _f(sum_w2), _f(n)
    with np.errstate(over="ignore", invalid="ignore"):
        ess = _div(np.square(sum_w), n * sum_w2)
    return np.where(np.isinf(sum_w2) & (n > 0), 1.0 / np.where(n > 0, n, 1.0), ess)


def _std_error(t: Frame) -> np.ndarray:
    n = _f(t["n_tokens"])
    mean = _div(t["sum_lr"], n)
    var = _div(np.asarray(t["sum_lr2"]) - n * mean * mean, n - 1)
    return np.sqrt(np.maximum(var, 0.0) / np.where(n > 0, n, np.nan))


METRICS: tuple[Metric, ...] = (
    _t("mismatch/n_tokens", "count", "tokens", "valid tokens observed", lambda t: _f(t["n_tokens"])),
    _t("mismatch/k1_kl", "nats", "k1 KL", "mean(-lr): signed estimate of KL(mu||pi); sign and trend show drift",
       lambda t: -_div(t["sum_lr"], t["n_tokens"])),
    _t("mismatch/k2_kl", "nats", "k2 KL", "mean(lr^2) / 2", lambda t: _div(t["sum_lr2"], 2 * t["n_tokens"])),
    _t("mismatch/k3_kl", "nats", "k3 KL", "mean(rho - 1 - lr): low-variance, non-negative estimate of KL(mu||pi)",
       lambda t: _div(t["sum_k3"], t["n_tokens"])),
    _t("mismatch/log_ratio/mean", "log-ratio", "mean log ratio", "signed mean of lr = log pi - log mu (drift)",
       lambda t: _div(t["sum_lr"], t["n_tokens"])),
    _t("mismatch/log_ratio/std_error", "log-ratio", "std. error of mean lr",
       "standard error of the signed mean log ratio", _std_error),
    _t("mismatch/log_ratio/min", "log-ratio", "min log ratio", "smallest lr", lambda t: _f(t["min_lr"])),
    _t("mismatch/log_ratio/max", "log-ratio", "max log ratio", "largest lr", lambda t: _f(t["max_lr"])),
    _t("mismatch/abs_log_ratio/mean", "log-ratio", "mean |lr|", "mean |log pi - log mu|",
       lambda t: _div(t["sum_abs_lr"], t["n_tokens"])),
    _t("mismatch/abs_log_ratio/max", "log-ratio", "max |lr|", "largest |lr| (exact)",
       lambda t: _f(t["max_abs_lr"])),
    _t("mismatch/mult_prob_error", "ratio", "mult. prob. error", "mean exp(|lr|) >= 1 (NeMo-RL token_mult_prob_error)",
       lambda t: _div(t["sum_exp_abs_lr"], t["n_tokens"])),
    _t("mismatch/chi2", "ratio", "chi^2", ("mean(rho^2) - 1: unbiased estimate of the chi-square divergence "
                                           "chi2(pi||mu) from samples of mu; the weights' variance only where "
                                           "mean(rho) = 1; negative when mean(rho^2) < 1 (only possible if "
                                           "mean(rho) < 1)"),
       lambda t: _div(t["sum_rho2"], t["n_tokens"]) - 1.0),
    _t("mismatch/ess", "ratio", "ESS", "normalised effective sample size (sum rho)^2 / (n sum rho^2)",
       lambda t: _ess(t["sum_rho"], t["sum_rho2"], t["n_tokens"])),
    _t("mismatch/ess_capped", "ratio", "ESS (capped)", "normalised ESS of min(rho, tis_cap)",
       lambda t: _div(np.square(_f(t["sum_rho_capped"])), t["n_tokens"] * t["sum_rho_capped2"])),
    _t("mismatch/clip_high_fraction", "share", "clipped (rho > C)", "share of tokens with rho > tis_cap",
       lambda t: _div(t["n_clip_high"], t["n_tokens"])),
    _t("mismatch/clip_low_fraction", "share", "clipped (rho <= 1/C)", "share of tokens with rho <= 1 / tis_cap",
       lambda t: _div(t["n_clip_low"], t["n_tokens"])),
    _t("mismatch/icepop_masked_fraction", "share", "IcePop masked", "share of tokens outside the IcePop band",
       lambda t: _div(t["n_outside_icepop"], t["n_tokens"])),
    _t("mismatch/extreme_fraction", "share", "extreme share", "share of tokens outside the extreme band",
       lambda t: _div(t["n_extreme"], t["n_tokens"])),
    _t("mismatch/routing/flip_rate", "share", "routing flip rate",
       "share of (token, layer) whose top-k expert set differs", lambda t: _div(t["n_routing_flips"], t["n_routing_decisions"])),
    _t("mismatch/routing/any_layer_flip_fraction", "share", "tokens with a flip",
       "share of tokens with at least one differing layer", lambda t: _div(t["n_tokens_any_flip"], t["n_routed_tokens"])),
    _t("mismatch/support_mismatch_fraction", "share", "support mismatch",
       "share of sampled tokens outside the trainer's top-p/top-k kept set",
       lambda t: _div(t["n_support_mismatch"], t["n_support_known"])),
    _t("mismatch/kept_logmass/mean", "log-ratio", "mean kept log-mass", "mean log S of the sampler's truncation",
       lambda t: _div(t["sum_kept_logmass"], t["n_kept_logmass"])),
    _t("mismatch/data_quality/nonfinite_tokens", "count", "non-finite tokens",
       "tokens set aside for a NaN or infinite log-prob", lambda t: _f(t["n_nonfinite"])),
    _t("mismatch/data_quality/positive_logprob_tokens", "count", "positive log-prob tokens",
       "tokens set aside for a log-prob above the tolerance", lambda t: _f(t["n_positive_logprob"])),
    _s("mismatch/seq/n_sequences", "count", "sequences", "sequences with a valid token",
       lambda s: _f(s["n_sequences"])),
    _s("mismatch/seq/log_ratio/mean", "log-ratio", "mean seq log ratio", "mean over sequences of sum_t lr",
       lambda s: _div(s["sum_seq_lr"], s["n_sequences"])),
    _s("mismatch/seq/log_ratio/min", "log-ratio", "min seq log ratio", "smallest sum_t lr",
       lambda s: _f(s["min_seq_lr"])),
    _s("mismatch/seq/log_ratio/max", "log-ratio", "max seq log ratio", "largest sum_t lr",
       lambda s: _f(s["max_seq_lr"])),
    _s("mismatch/seq/mean_log_ratio/mean", "log-ratio", "mean geo. log ratio",
       "mean over sequences of mean_t lr (log geometric-mean ratio)", lambda s: _div(s["sum_seq_mean_lr"], s["n_sequences"])),
    _s("mismatch/seq/max_abs_log_ratio/mean", "log-ratio", "mean seq max |lr|", "mean over sequences of max_t |lr|",
       lambda s: _div(s["sum_seq_max_abs_lr"], s["n_sequences"])),
    _s("mismatch/seq/product_mask_fraction", "share", "product mask", "share of sequences a product-ratio mask drops",
       lambda s: _div(s["n_drop_product"], s["n_sequences"])),
    _s("mismatch/seq/geometric_mask_fraction", "share", "geometric mask",
       "share of sequences a geometric-mean-ratio mask drops", lambda s: _div(s["n_drop_geometric"], s["n_sequences"])),
    _s("mismatch/seq/mult_error_mask_fraction", "share", "seq threshold mask",
       "share of sequences with mean exp(|lr|) above the threshold", lambda s: _div(s["n_drop_mult_error"], s["n_sequences"])),
    _s("mismatch/seq/neg_adv_mask_fraction", "share", "neg.-advantage mask",
       "share of sequences with advantages that the negative-advantage mask drops",
       lambda s: _div(s["n_drop_neg_adv"], s["n_adv_known"])),
    _s("mismatch/staleness/mean", "steps", "mean staleness", "mean trainer_version - policy_version",
       lambda s: _div(s["sum_staleness"], s["n_stale_known"])),
    _s("mismatch/staleness/max", "steps", "max staleness", "largest staleness",
       lambda s: _f(s["max_staleness"])),
) + tuple(
    Metric(f"mismatch/abs_log_ratio/{name}", "abs_hist", "log-ratio", f"{name} |lr|",
           f"{q:g} quantile of |lr| (nearest rank, within hist_relative_accuracy)")
    for name, q in QUANTILES
)

METRIC_BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}


def unit_of(metric_key: str) -> str:
    """The unit of a metric key (see ``Unit``); KeyError for a key that is no metric."""
    return METRIC_BY_KEY[metric_key].unit


def format_of(metric_key: str) -> str:
    """The format spec a value of the metric is shown with (``format(value, format_of(key))``)."""
    return METRIC_BY_KEY[metric_key].format_spec


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


def _columns(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """Columns as numpy arrays: metric functions do plain array arithmetic (pandas' per-operation
    overhead would dominate on frames of a few rows)."""
    return {c: frame[c].to_numpy() for c in frame.columns}


def _shared_codes(a: pd.Series, b: pd.Series) -> tuple[np.ndarray, int]:
    """Codes of ``a`` then ``b`` (equal values, nulls included, share a code) and their count.
    A categorical ``b`` (a long histogram) is coded through its categories, not row by row."""
    if isinstance(b.dtype, pd.CategoricalDtype) and not isinstance(a.dtype, pd.CategoricalDtype):
        a_codes, uniques = pd.factorize(a, use_na_sentinel=False)
        lookup = pd.Index(uniques).get_indexer(b.cat.categories)        # -1: not among a's values
        nulls = np.flatnonzero(pd.isna(uniques))
        b_codes = b.cat.codes.to_numpy()
        mapped = np.full(len(b_codes), nulls[0] if len(nulls) else -1, dtype=np.int64)
        valued = b_codes >= 0
        mapped[valued] = lookup[b_codes[valued]]
        radix = len(uniques) + 1
        return np.concatenate([a_codes, np.where(mapped >= 0, mapped, radix - 1)]), radix
    codes, uniques = pd.factorize(pd.concat([a, b], ignore_index=True), use_na_sentinel=False)
    return codes, len(uniques)


def _row_of(keys: pd.DataFrame, other: pd.DataFrame, by: list[str]) -> np.ndarray:
    """For each row of ``other``, the row of ``keys`` with the same ``by`` values (-1: none).
    ``keys`` rows are distinct; nulls match nulls (as in the SQL layer's GROUP BY)."""
    n = len(keys)
    if not by:
        return np.zeros(len(other), dtype=np.int64) if n else np.full(len(other), -1)
    code = np.zeros(n + len(other), dtype=np.int64)
    for k in by:  # loop over key columns, not rows
        col_codes, radix = _shared_codes(keys[k], other[k])
        code = pd.factorize(code * radix + col_codes)[0]
    position = np.full(int(code.max()) + 1, -1)
    position[code[:n]] = np.arange(n)
    return position[code[n:]]


def _token_values(tok: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    return {m.key: np.asarray(m.fn(tok), dtype=np.float64) if n else np.zeros(0)
            for m in METRICS if m.table == "tokens"}


def _sequence_values(seq: Mapping[str, np.ndarray] | None, n: int) -> dict[str, np.ndarray]:
    """``seq``: the merged sequence columns of each group (NaN where a group has no sequence
    row); None: no sequence-level value for any group."""
    return {m.key: np.asarray(m.fn(seq), dtype=np.float64) if seq is not None else np.full(n, np.nan)
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
    values = _token_values(_columns(tokens), n)
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


def _label_codes(cols: Mapping[str, object], n: int, dim: str, index: dict[str | None, int] | None
                 ) -> tuple[np.ndarray, list[str | None]]:
    """Group code of each of ``n`` rows by its ``dim`` label. With ``index`` (label -> code),
    labels outside it get -1; without, codes follow the labels found (returned: sorted, null last)."""
    if dim not in cols:
        found: list[str | None] = [None]
        codes = np.zeros(n, dtype=np.int64)
    else:
        codes, uniques = pd.factorize(cols[dim], use_na_sentinel=False)
        found = [None if pd.isna(u) else str(u) for u in uniques]
    if index is None:
        order = sorted(found, key=lambda v: (v is None, v or ""))
        index = {v: i for i, v in enumerate(order)}
        found_codes = np.array([index[v] for v in found], dtype=np.int64)
        return found_codes[codes] if len(codes) else codes, order
    found_codes = np.array([index.get(v, -1) for v in found], dtype=np.int64)
    return (found_codes[codes] if len(codes) else codes), list(index)


def _grouped(cols: Mapping[str, object], table: str, codes: np.ndarray, G: int) -> dict[str, np.ndarray]:
    """Merged columns of ``table`` per group code (rows with code -1 are in no group), followed
    by one more entry merging every row: [G + 1] each, merged by the column's rule (the engine's
    own merge, column by column)."""
    keep = codes >= 0
    kept = codes[keep]
    out: dict[str, np.ndarray] = {}
    for col, rule in merge_rules(table).items():
        values = np.asarray(cols[col])
        acc = np.empty(G + 1)
        acc[:G] = merge_column(values[keep], rule, kept, G)
        acc[G] = merge_total(values, rule)[0]
        out[col] = acc
    return out


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
    as ``report(stats, [dim])`` and ``report(stats)``, without the general group-by (the
    collector reports every step). Sums are float64 (exact for counts below 2^53).
    ``config``: see :func:`config_for`."""
    config = config_for(stats, config, "report_by_label")
    if dim not in stats.dims:
        raise ValueError(f"{dim!r} is not a label dimension of these statistics (they have {list(stats.dims)})")
    rows = {t: len(stats.tables[t]) for t in METRIC_TABLES}
    if rows["tokens"] == 0:
        empty = {k: np.zeros(0) for k in METRIC_BY_KEY}
        return GroupMetrics(dim, (), empty), GroupMetrics(None, (), dict(empty))
    tokens, sequences, hist = (stats.columns(t) for t in METRIC_TABLES)
    codes, labels = _label_codes(tokens, rows["tokens"], dim, None)
    index = {v: i for i, v in enumerate(labels)}
    G = len(labels)
    tok = _grouped(tokens, "tokens", codes, G)
    values = _token_values(tok, G + 1)
    seq_codes, _ = _label_codes(sequences, rows["sequences"], dim, index)
    seq = _grouped(sequences, "sequences", seq_codes, G)
    present = np.bincount(seq_codes[seq_codes >= 0], minlength=G + 1) > 0
    present[G] = rows["sequences"] > 0
    for column in seq.values():
        column[~present] = np.nan         # a group without sequence rows: no sequence value
    values.update(_sequence_values(seq, G + 1))
    hist_codes, _ = _label_codes(hist, rows["abs_hist"], dim, index)
    hit = hist_codes >= 0
    bins, counts = np.asarray(hist["bin"]), np.asarray(hist["count"])
    group = np.concatenate([hist_codes[hit], np.full(rows["abs_hist"], G)])   # then every row: the total
    bins = np.concatenate([bins[hit], bins])
    counts = np.concatenate([counts[hit], counts])
    values.update(_quantile_values(group, bins, counts, values["mismatch/abs_log_ratio/max"], config))
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
