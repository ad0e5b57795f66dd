"""Every reported metric, declared once: key, table, formula (``formulas.py``), unit, format, the
config thresholds it depends on and whether its fields are exported as Prometheus counters.

The report, the query layer, the exporter's gauges and counters, the Prometheus rate rules, the
dashboard's lists and titles and docs/METRICS.md are all generated from :data:`METRICS`.
Adding a metric is one declaration here (plus a field in ``engine/fields.py`` when it needs a
new sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .engine.fields import TABLES
from .engine.histogram import QUANTILES
from .formulas import ESS, Correlation, Formula, LogESS, OpposedShift, Quantile, Ratio, StdError, Value, Variance

# "share": a fraction of tokens or sequences in [0, 1]; "ratio": a dimensionless ratio that is
# not a share (ESS, chi^2, multiplicative error); "log-ratio": in units of lr = log pi - log mu
Unit = Literal["nats", "share", "ratio", "count", "steps", "log-ratio"]
Table = Literal["tokens", "sequences", "abs_hist", "lowprob", "routing_layers"]
# the format spec each unit is shown with unless a declaration names its own
DEFAULT_FORMAT: dict[str, str] = {"nats": ".3g", "share": ".3%", "ratio": ".3g", "count": ",.0f",
                                  "steps": ".3g", "log-ratio": ".3g"}


@dataclass(frozen=True)
class Metric:
    key: str                      # hierarchical, e.g. "mismatch/k3_kl"
    table: Table                  # the table whose merged columns the formula reads
    unit: Unit
    label: str                    # short human label (dashboard, CLI)
    description: str
    formula: Formula
    title: str = ""               # a str.format template over MetricConfig fields (``thresholds``)
    thresholds: tuple[str, ...] = ()   # the MetricConfig options the metric's value depends on
    counters: bool = False        # its formula's fields are exported as Prometheus counters
    format: str = ""              # format spec of a value; "" = the unit's DEFAULT_FORMAT

    @property
    def format_spec(self) -> str:
        return self.format or DEFAULT_FORMAT[self.unit]

    def title_under(self, config: object) -> str:
        """The title with the config's thresholds filled in (the label when it has none)."""
        if not self.title:
            return self.label
        return self.title.format(**{t: getattr(config, t) for t in self.thresholds})


def _t(key: str, unit: Unit, label: str, description: str, formula: Formula, **kw: object) -> Metric:
    return Metric(key, "tokens", unit, label, description, formula, **kw)  # type: ignore[arg-type]


def _s(key: str, unit: Unit, label: str, description: str, formula: Formula, **kw: object) -> Metric:
    return Metric(key, "sequences", unit, label, description, formula, **kw)  # type: ignore[arg-type]


N = "n_tokens"
S = "n_sequences"

METRICS: tuple[Metric, ...] = (
    _t("mismatch/n_tokens", "count", "tokens", "valid tokens observed", Value(N), counters=True),
    _t("mismatch/exact_agreement", "share", "exact agreement",
       "share of valid tokens whose two log-probs are equal (lr == 0 exactly, as the engine reads them): 1 "
       "where sampler and trainer compute bitwise alike (batch-invariant kernels), below 1 at the first "
       "numerical difference", Ratio("n_lr_zero", N), counters=True),
    _t("mismatch/k1_kl", "nats", "k1 KL", "mean(-lr): signed estimate of KL(mu||pi); sign and trend show drift",
       Ratio("sum_lr", N, scale=-1.0)),
    _t("mismatch/k2_kl", "nats", "k2 KL", "mean(lr^2) / 2", Ratio("sum_lr2", N, scale=0.5)),
    _t("mismatch/k3_kl", "nats", "k3 KL", "mean(rho - 1 - lr): low-variance, non-negative estimate of KL(mu||pi)",
       Ratio("sum_k3", N)),
    _t("mismatch/log_ratio/mean", "log-ratio", "mean log ratio", "signed mean of lr = log pi - log mu (drift)",
       Ratio("sum_lr", N)),
    _t("mismatch/log_ratio/std_error", "log-ratio", "std. error of mean lr",
       "standard error of the signed mean log ratio", StdError("sum_lr", "sum_lr2", N)),
    _t("mismatch/log_ratio/min", "log-ratio", "min log ratio", "smallest lr", Value("min_lr")),
    _t("mismatch/log_ratio/max", "log-ratio", "max log ratio", "largest lr", Value("max_lr")),
    _t("mismatch/sharpness/top_rho_shift", "ratio", "mean ρ - 1, likely tokens",
       "mean rho - 1 of the tokens in the top sampler-probability bucket (p_S >= the last of lowprob_edges): "
       "above 0 where the trainer gives the sampler's likely tokens more probability than the sampler did",
       Ratio("sum_dev_top_p", "n_top_p"), thresholds=("lowprob_edges",)),
    _t("mismatch/sharpness/low_rho_shift", "ratio", "mean ρ - 1, unlikely tokens",
       "mean rho - 1 of the tokens below the second-highest sampler-probability edge (p_S < lowprob_edges[-2])",
       Ratio("sum_dev_low_p", "n_low_p"), thresholds=("lowprob_edges",)),
    _t("mismatch/sharpness/contrast_t", "ratio", "sharpness contrast (t)",
       "mean rho - 1 of the likely and of the unlikely tokens on opposite sides of 0, in standard errors: the "
       "smaller |t| of the two, with the likely tokens' sign; 0 where both share a sign. Positive: the trainer's "
       "distribution is sharper than the sampler's (a sampler that ignores the temperature, or samples from "
       "weights older than a sharpening policy); negative: the sampler's is sharper. Numeric noise does not "
       "push the two ends apart. Null below two tokens at either end, or where rho is 1 to within rounding "
       "(the sums do not resolve its spread)",
       OpposedShift("sum_dev_top_p", "sum_rho2_top_p", "n_top_p", "sum_dev_low_p", "sum_rho2_low_p", "n_low_p"),
       thresholds=("lowprob_edges",)),
    _t("mismatch/abs_log_ratio/mean", "log-ratio", "mean |lr|", "mean |log pi - log mu|", Ratio("sum_abs_lr", N)),
    _t("mismatch/abs_log_ratio/max", "log-ratio", "max |lr|", "largest |lr| (exact)", Value("max_abs_lr")),
    _t("mismatch/mult_prob_error", "ratio", "mult. prob. error", "mean exp(|lr|) >= 1 (NeMo-RL token_mult_prob_error)",
       Ratio("sum_exp_abs_lr", N)),
    _t("mismatch/abs_prob_diff/mean", "ratio", "mean |Δp|", "mean |p_T - p_S| over tokens, p = exp(log-prob) of "
       "the sampled token (verl rollout_probs_diff_mean), each as p_S |expm1(lr)|: no cancellation",
       Ratio("sum_abs_dp", N)),
    _t("mismatch/abs_prob_diff/max", "ratio", "max |Δp|", "largest |p_T - p_S| (verl rollout_probs_diff_max)",
       Value("max_abs_dp")),
    _t("mismatch/prob_pearson_corr", "ratio", "Pearson r(p_T, p_S)",
       "Pearson correlation of p_T and p_S over tokens (verl rollout_actor_probs_pearson_corr), from sums of "
       "p, p^2 and p_T p_S; rounding: within (3n + 4) 2^-53 (sqrt(sum p_T^2 sum p_S^2 / (C_TT C_SS)) + "
       "(sum p_T^2 / C_TT + sum p_S^2 / C_SS) / 2) of the exact value, C_TT = sum p_T^2 - (sum p_T)^2 / n "
       "(worst case over any summation and merge order; about 1e-10 at 10^5 tokens spread over [0, 1]); "
       "null below two tokens or where the sums resolve no variance (C below twice its rounding bound)",
       Correlation("sum_p_trainer", "sum_p_sampler", "sum_p_trainer2", "sum_p_sampler2", "sum_p_cross", N),
       format=".6f"),
    _t("mismatch/rho/mean", "ratio", "mean ρ", "mean rho = mean exp(lr) (verl rollout_is_mean); 1 in expectation "
       "when mu covers pi", Ratio("sum_rho", N)),
    _t("mismatch/chi2", "ratio", "chi^2", ("mean(rho^2) - 1: unbiased estimate of the chi-square divergence "
                                           "chi2(pi||mu) from samples of mu; the weights' variance only where "
                                           "mean(rho) = 1; negative when mean(rho^2) < 1 (only possible if "
                                           "mean(rho) < 1)"), Ratio("sum_rho2", N, offset=-1.0)),
    _t("mismatch/ess", "ratio", "ESS", "normalised effective sample size (sum rho)^2 / (n sum rho^2)",
       ESS("sum_rho", "sum_rho2", N), format=".4f"),
    _t("mismatch/ess_capped", "ratio", "ESS (capped)", "normalised ESS of min(rho, tis_cap)",
       ESS("sum_rho_capped", "sum_rho_capped2", N), thresholds=("tis_cap",), format=".4f"),
    _t("mismatch/clip_high_fraction", "share", "clipped (rho > C)", "share of tokens with rho > tis_cap",
       Ratio("n_clip_high", N), title="TIS cap: tokens with ρ > {tis_cap:g}", thresholds=("tis_cap",),
       counters=True),
    _t("mismatch/clip_low_fraction", "share", "clipped (rho <= 1/C)", "share of tokens with rho <= 1 / tis_cap",
       Ratio("n_clip_low", N), title="TIS cap: tokens with ρ ≤ 1/{tis_cap:g}", thresholds=("tis_cap",),
       counters=True),
    _t("mismatch/icepop_masked_fraction", "share", "IcePop masked", "share of tokens outside the IcePop band",
       Ratio("n_outside_icepop", N), title="IcePop: tokens outside [{icepop_band[0]:g}, {icepop_band[1]:g}]",
       thresholds=("icepop_band",), counters=True),
    _t("mismatch/extreme_fraction", "share", "extreme share", "share of tokens outside the extreme band",
       Ratio("n_extreme", N), title="extreme band: tokens outside [{extreme_band[0]:g}, {extreme_band[1]:g}]",
       thresholds=("extreme_band",), counters=True),
    _t("mismatch/ppo_clip_fraction", "share", "PPO-clipped share",
       "share of tokens with rho outside the PPO clip band (1 - ppo_clip_eps, 1 + ppo_clip_eps]: what PPO's ratio "
       "clip would cut from the sampler-trainer mismatch alone, before any policy update (rho exactly at "
       "1 - eps counts as outside, as at the other bands' lower ends)", Ratio("n_outside_ppo_clip", N),
       title="PPO clip ε = {ppo_clip_eps:g}: tokens with ρ outside [1 - ε, 1 + ε]", thresholds=("ppo_clip_eps",),
       counters=True),
    _t("mismatch/routing/flip_rate", "share", "routing flip rate", "share of (token, layer) whose top-k expert set "
       "differs", Ratio("n_routing_flips", "n_routing_decisions"), counters=True),
    _t("mismatch/routing/decisions", "count", "routing decisions", "(token, layer) decisions compared: the flip "
       "rate's denominator, which the flip alert's count test reads", Value("n_routing_decisions")),
    _t("mismatch/routing/any_layer_flip_fraction", "share", "tokens with a flip",
       "share of tokens with at least one differing layer", Ratio("n_tokens_any_flip", "n_routed_tokens")),
    _t("mismatch/support_mismatch_fraction", "share", "support mismatch",
       "share of sampled tokens outside the trainer's top-p/top-k kept set",
       Ratio("n_support_mismatch", "n_support_known")),
    _t("mismatch/kept_logmass/mean", "log-ratio", "mean kept log-mass", "mean log S of the sampler's truncation",
       Ratio("sum_kept_logmass", "n_kept_logmass")),
    _t("mismatch/data_quality/nonfinite_tokens", "count", "non-finite tokens",
       "tokens set aside for a NaN or infinite log-prob", Value("n_nonfinite"), counters=True),
    _t("mismatch/data_quality/positive_logprob_tokens", "count", "positive log-prob tokens",
       "tokens set aside for a log-prob above the tolerance", Value("n_positive_logprob"),
       thresholds=("positive_logprob_tol",)),
    _s("mismatch/seq/n_sequences", "count", "sequences", "sequences with a valid token", Value(S), counters=True),
    _s("mismatch/seq/log_ratio/mean", "log-ratio", "mean seq log ratio", "mean over sequences of sum_t lr",
       Ratio("sum_seq_lr", S)),
    _s("mismatch/seq/log_ratio/variance", "log-ratio", "var. of seq log ratio",
       "unbiased variance over sequences of sum_t lr; read by length bucket it grows like T (its std like "
       "sqrt T) for independent token noise and like T^2 for a bias shared by a sequence's tokens",
       Variance("sum_seq_lr", "sum_seq_lr2", S)),
    _s("mismatch/seq/is_ess", "ratio", "sequence-IS ESS",
       "normalised ESS (sum w)^2 / (n sum w^2) of the sequence-level IS weights w = exp(sum_t lr); near 1/n "
       "when one sequence's weight dominates: sequence-level correction is then unusable", LogESS(
           "lse_seq_w", "lse_seq_w2", S), format=".4f"),
    _s("mismatch/seq/is_chi2", "ratio", "sequence-IS chi^2",
       "n sum w^2 / (sum w)^2 - 1 of w = exp(sum_t lr): the chi-square of the self-normalised sequence "
       "weights, 1 / ESS - 1", LogESS("lse_seq_w", "lse_seq_w2", S, chi2=True)),
    _s("mismatch/seq/log_ratio/min", "log-ratio", "min seq log ratio", "smallest sum_t lr", Value("min_seq_lr")),
    _s("mismatch/seq/log_ratio/max", "log-ratio", "max seq log ratio", "largest sum_t lr", Value("max_seq_lr")),
    _s("mismatch/seq/mean_log_ratio/mean", "log-ratio", "mean geo. log ratio",
       "mean over sequences of mean_t lr (log geometric-mean ratio)", Ratio("sum_seq_mean_lr", S)),
    _s("mismatch/seq/max_abs_log_ratio/mean", "log-ratio", "mean seq max |lr|", "mean over sequences of max_t |lr|",
       Ratio("sum_seq_max_abs_lr", S)),
    _s("mismatch/seq/product_mask_fraction", "share", "product mask", "share of sequences a product-ratio mask drops",
       Ratio("n_drop_product", S), title="product mask: sequences outside [{seq_product_band[0]:g}, "
       "{seq_product_band[1]:g}]", thresholds=("seq_product_band",)),
    _s("mismatch/seq/geometric_mask_fraction", "share", "geometric mask",
       "share of sequences a geometric-mean-ratio mask drops", Ratio("n_drop_geometric", S),
       title="geometric mask: sequences outside [{seq_geometric_band[0]:g}, {seq_geometric_band[1]:g}]",
       thresholds=("seq_geometric_band",)),
    _s("mismatch/seq/mult_error_mask_fraction", "share", "seq threshold mask",
       "share of sequences with mean exp(|lr|) above the threshold", Ratio("n_drop_mult_error", S),
       title="sequence threshold: mean exp|log ρ| > {seq_mult_error_threshold:g}",
       thresholds=("seq_mult_error_threshold",)),
    _s("mismatch/seq/neg_adv_mask_fraction", "share", "neg.-advantage mask",
       "share of sequences with advantages that the negative-advantage mask drops",
       Ratio("n_drop_neg_adv", "n_adv_known"),
       title="neg.-advantage mask: A < 0 and mean(-log ρ) > {neg_adv_delta:g}", thresholds=("neg_adv_delta",)),
    _s("mismatch/staleness/mean", "steps", "mean staleness", "mean trainer_version - policy_version",
       Ratio("sum_staleness", "n_stale_known")),
    _s("mismatch/staleness/max", "steps", "max staleness", "largest staleness", Value("max_staleness")),
) + tuple(
    Metric(f"mismatch/abs_log_ratio/{name}", "abs_hist", "log-ratio", f"{name} |lr|",
           f"{q:g} quantile of |lr| (nearest rank, within hist_relative_accuracy)", Quantile(q),
           thresholds=("hist_relative_accuracy",))
    for name, q in QUANTILES
)

# Per-bucket and per-layer views of the query layer: metrics of other tables, by column name.
VIEW_METRICS: tuple[Metric, ...] = (
    Metric("mean_abs_lr", "lowprob", "log-ratio", "mean |lr|", "mean |lr| of the sampler-probability bucket",
           Ratio("sum_abs_lr", N)),
    Metric("k3_kl", "lowprob", "nats", "k3 KL", "k3 KL of the sampler-probability bucket", Ratio("sum_k3", N)),
    Metric("flip_rate", "routing_layers", "share", "flip rate",
           "share of routed tokens whose top-k expert set differs at the layer", Ratio("n_flips", "n_routed_tokens")),
)


@dataclass(frozen=True)
class CounterDef:
    """A summed field exported as a Prometheus counter (per cell, so it sums across cells)."""
    name: str      # exposed with the ``_total`` suffix
    table: str     # engine table holding the field
    field: str     # summed sufficient statistic (engine/fields.py)
    doc: str


# The Prometheus names alert rules and dashboards already read; a field not named here is
# exported as mismatch_<field without its n_ prefix>_<table>.
COUNTER_NAMES: dict[str, str] = {
    "n_tokens": "mismatch_tokens", "n_nonfinite": "mismatch_nonfinite_tokens",
    "n_clip_high": "mismatch_clipped_high_tokens", "n_clip_low": "mismatch_clipped_low_tokens",
    "n_outside_icepop": "mismatch_icepop_masked_tokens", "n_extreme": "mismatch_extreme_tokens",
    "n_routing_decisions": "mismatch_routing_decisions", "n_routing_flips": "mismatch_routing_flips",
    "n_sequences": "mismatch_sequences",
}


def counter_defs(metrics: tuple[Metric, ...] = METRICS) -> tuple[CounterDef, ...]:
    """Every field of a metric declared with ``counters=True``, once, in declaration order."""
    docs = {table: {f.name: f.doc for f in fields} for table, (_, fields) in TABLES.items()}
    out: dict[str, CounterDef] = {}
    for m in metrics:
        for name in m.formula.fields() if m.counters else ():
            if name not in out:
                default = f"mismatch_{name.removeprefix('n_')}_{m.table}"
                out[name] = CounterDef(COUNTER_NAMES.get(name, default), m.table, name, docs[m.table][name])
    return tuple(out.values())


def counter_ratios(metrics: tuple[Metric, ...] = METRICS) -> tuple[tuple[str, Metric], ...]:
    """(numerator field, metric) of every counter-exported share or mean: Prometheus merges
    these over cells and a rate window as the ratio of the summed counters' rates."""
    return tuple((m.formula.num, m) for m in metrics if m.counters and isinstance(m.formula, Ratio))
