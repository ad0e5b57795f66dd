"""The sufficient statistics: every stored column, what it holds and how it merges.

This is the one definition of the engine's output. Parquet columns, the DuckDB aggregation
(``sum``/``max``/``min`` per column) and the in-memory merge all read these tables, so merging
ranks, steps and slices is exact everywhere (STYLE.md: state is running totals, never averages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# "logsumexp": the field holds log sum_i exp(x_i) of its rows' values; merged as M + log sum exp(v - M)
# with M the group's largest value (in numpy and in the generated SQL), so no exp ever overflows
Merge = Literal["sum", "max", "min", "logsumexp"]


@dataclass(frozen=True)
class Field:
    name: str
    merge: Merge
    dtype: Literal["int64", "float64"]
    doc: str


def _f(name: str, merge: Merge, dtype: str, doc: str) -> Field:
    return Field(name, merge, dtype, doc)  # type: ignore[arg-type]


# Token-level statistics, one row per (sequence labels, length_bucket, turn_bucket) cell.
# lr = log pi - log mu of a valid token; rho = exp(lr). Sums run over valid tokens only.
TOKEN_FIELDS: tuple[Field, ...] = (
    _f("n_tokens", "sum", "int64", "valid tokens (finite log-probs, none above the tolerance)"),
    _f("n_nonfinite", "sum", "int64", "tokens set aside: a NaN or infinite log-prob on either side"),
    _f("n_positive_logprob", "sum", "int64", "tokens set aside: a log-prob above positive_logprob_tol"),
    _f("n_lr_zero", "sum", "int64", "tokens with lr == 0 exactly: equal log-probs on both sides, as the engine reads them"),
    _f("sum_lr", "sum", "float64", "sum of lr (k1 = -sum_lr / n)"),
    _f("sum_lr2", "sum", "float64", "sum of lr^2 (k2 = sum_lr2 / 2n)"),
    _f("sum_abs_lr", "sum", "float64", "sum of |lr|"),
    _f("n_top_p", "sum", "int64", "valid tokens in the top sampler-probability bucket (p_S >= lowprob_edges[-1])"),
    _f("sum_dev_top_p", "sum", "float64", "sum of rho - 1 over those tokens (as sum k3 + sum lr)"),
    _f("sum_rho2_top_p", "sum", "float64", "sum of rho^2 over those tokens"),
    _f("n_low_p", "sum", "int64", "valid tokens below the second-highest sampler-probability edge "
       "(p_S < lowprob_edges[-2]; none with a single edge)"),
    _f("sum_dev_low_p", "sum", "float64", "sum of rho - 1 over those tokens (as sum k3 + sum lr)"),
    _f("sum_rho2_low_p", "sum", "float64", "sum of rho^2 over those tokens"),
    _f("sum_k3", "sum", "float64", "sum of rho - 1 - lr, computed as expm1(lr) - lr"),
    _f("sum_exp_abs_lr", "sum", "float64", "sum of exp(|lr|) (multiplicative error)"),
    _f("sum_rho", "sum", "float64", "sum of rho"),
    _f("sum_rho2", "sum", "float64", "sum of rho^2"),
    _f("sum_rho_capped", "sum", "float64", "sum of min(rho, tis_cap)"),
    _f("sum_rho_capped2", "sum", "float64", "sum of min(rho, tis_cap)^2"),
    _f("n_clip_high", "sum", "int64", "tokens with rho > tis_cap"),
    _f("n_clip_low", "sum", "int64", "tokens with rho <= 1 / tis_cap"),
    _f("n_outside_icepop", "sum", "int64", "tokens with rho outside (lo, hi] of icepop_band"),
    _f("n_extreme", "sum", "int64", "tokens with rho outside (lo, hi] of extreme_band"),
    _f("n_outside_ppo_clip", "sum", "int64", "tokens with rho outside (1 - ppo_clip_eps, 1 + ppo_clip_eps]"),
    _f("sum_p_trainer", "sum", "float64", "sum of p_T = exp(trainer log-prob)"),
    _f("sum_p_sampler", "sum", "float64", "sum of p_S = exp(sampler log-prob)"),
    _f("sum_p_trainer2", "sum", "float64", "sum of p_T^2"),
    _f("sum_p_sampler2", "sum", "float64", "sum of p_S^2"),
    _f("sum_p_cross", "sum", "float64", "sum of p_T p_S"),
    _f("sum_abs_dp", "sum", "float64", "sum of |p_T - p_S|, computed as p_S |expm1(lr)| (no cancellation)"),
    _f("max_abs_dp", "max", "float64", "largest |p_T - p_S| (null when n_tokens = 0)"),
    _f("min_lr", "min", "float64", "smallest lr (null when n_tokens = 0)"),
    _f("max_lr", "max", "float64", "largest lr (null when n_tokens = 0)"),
    _f("max_abs_lr", "max", "float64", "largest |lr| (null when n_tokens = 0)"),
    _f("n_routed_tokens", "sum", "int64", "tokens with expert ids from both sides"),
    _f("n_routing_decisions", "sum", "int64", "(token, layer) pairs with expert ids"),
    _f("n_routing_flips", "sum", "int64", "(token, layer) pairs whose top-k expert set differs"),
    _f("n_tokens_any_flip", "sum", "int64", "tokens with at least one differing layer"),
    _f("n_support_known", "sum", "int64", "tokens with trainer support information"),
    _f("n_support_mismatch", "sum", "int64", "sampled tokens outside the trainer's kept set"),
    _f("n_kept_logmass", "sum", "int64", "valid tokens with the sampler's kept log-mass"),
    _f("sum_kept_logmass", "sum", "float64", "sum of the sampler's kept log-mass log S"),
)

# Histogram of |lr| (valid tokens) per token cell: log-spaced bins, see engine/histogram.py.
ABS_HIST_FIELDS: tuple[Field, ...] = (
    _f("count", "sum", "int64", "valid tokens whose |lr| falls in the bin"),
)

# Sampler-probability buckets per token cell: bucket i of MetricConfig.lowprob_edges.
LOWPROB_FIELDS: tuple[Field, ...] = (
    _f("n_tokens", "sum", "int64", "valid tokens in the bucket"),
    _f("sum_abs_lr", "sum", "float64", "sum of |lr| in the bucket"),
    _f("sum_k3", "sum", "float64", "sum of rho - 1 - lr in the bucket"),
)

# Routing flips per token cell and layer.
ROUTING_LAYER_FIELDS: tuple[Field, ...] = (
    _f("n_flips", "sum", "int64", "tokens of the cell whose top-k expert set differs at the layer"),
)

# Sequence-level statistics, one row per (sequence labels, length_bucket) cell. A sequence counts
# when it has at least one valid token; its statistics run over its valid tokens.
SEQUENCE_FIELDS: tuple[Field, ...] = (
    _f("n_sequences", "sum", "int64", "sequences with at least one valid token"),
    _f("sum_seq_len", "sum", "int64", "valid tokens in those sequences"),
    _f("sum_seq_lr", "sum", "float64", "sum over sequences of sum_t lr (log product ratio)"),
    _f("sum_seq_lr2", "sum", "float64", "sum over sequences of (sum_t lr)^2 (its variance by length bucket)"),
    _f("sum_seq_mean_lr", "sum", "float64", "sum over sequences of mean_t lr (log geometric-mean ratio)"),
    _f("sum_seq_max_abs_lr", "sum", "float64", "sum over sequences of max_t |lr|"),
    _f("min_seq_lr", "min", "float64", "smallest sum_t lr of a sequence"),
    _f("max_seq_lr", "max", "float64", "largest sum_t lr of a sequence"),
    _f("max_seq_max_abs_lr", "max", "float64", "largest max_t |lr| of a sequence"),
    _f("lse_seq_w", "logsumexp", "float64", "log sum over sequences of w = exp(sum_t lr) (sequence-level IS weights)"),
    _f("lse_seq_w2", "logsumexp", "float64", "log sum over sequences of w^2 = exp(2 sum_t lr)"),
    _f("n_drop_product", "sum", "int64", "sequences whose exp(sum lr) lies outside (lo, hi] of seq_product_band"),
    _f("n_drop_geometric", "sum", "int64", "sequences whose exp(mean lr) lies outside (lo, hi] of seq_geometric_band"),
    _f("n_drop_mult_error", "sum", "int64", "sequences whose mean exp(|lr|) > seq_mult_error_threshold"),
    _f("n_adv_known", "sum", "int64", "sequences with an advantage"),
    _f("n_drop_neg_adv", "sum", "int64", "sequences with advantage < 0 and mean(-lr) > neg_adv_delta"),
    _f("n_stale_known", "sum", "int64", "sequences with a policy version"),
    _f("sum_staleness", "sum", "int64", "sum of trainer_version - policy_version"),
    _f("max_staleness", "max", "float64", "largest staleness (null when unknown)"),
)

# Signed log-spaced histograms of per-sequence quantities; column `kind` names the quantity.
SEQ_HIST_KINDS: tuple[str, ...] = ("seq_lr", "seq_mean_lr", "seq_max_abs_lr")
SEQ_HIST_FIELDS: tuple[Field, ...] = (
    _f("count", "sum", "int64", "sequences whose value falls in the bin"),
)

STALENESS_FIELDS: tuple[Field, ...] = (
    _f("count", "sum", "int64", "sequences with this staleness (the last bin holds staleness_max and above)"),
)

# Key columns that are not label dimensions.
LENGTH_KEY = "length_bucket"
TURN_KEY = "turn_bucket"
TABLES: dict[str, tuple[tuple[str, ...], tuple[Field, ...]]] = {
    # table name -> (extra key columns after the cell keys, value fields)
    "tokens": ((), TOKEN_FIELDS),
    "abs_hist": (("bin",), ABS_HIST_FIELDS),
    "lowprob": (("bucket",), LOWPROB_FIELDS),
    "routing_layers": (("layer",), ROUTING_LAYER_FIELDS),
    "sequences": ((), SEQUENCE_FIELDS),
    "seq_hist": (("kind", "bin"), SEQ_HIST_FIELDS),
    "staleness": (("staleness",), STALENESS_FIELDS),
}
# Tables whose cells are token cells (have turn_bucket); the others are sequence cells.
TOKEN_CELL_TABLES = ("tokens", "abs_hist", "lowprob", "routing_layers")


def merge_rules(table: str) -> dict[str, Merge]:
    return {f.name: f.merge for f in TABLES[table][1]}


def merge_sql(rule: Merge, column: str) -> str:
    """The SQL aggregate merging ``column`` (a quoted identifier or expression) by ``rule``:
    sum/max/min, or for logsumexp the group's max plus the log of the sum of exp(value - max)
    (DuckDB: a list of the group's values, so one aggregate expression, also in GROUPING SETS)."""
    if rule == "logsumexp":
        return f"(max({column}) + ln(list_sum(list_transform(list({column}), lambda x: exp(x - max({column}))))))"
    return f"{rule}({column})"
