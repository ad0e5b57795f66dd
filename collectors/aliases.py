"""Which of our metrics each RL framework's own mismatch scalar corresponds to, and how it differs.

Frameworks log one or two mismatch scalars each, computed on their own slice of the data and
reduced their own way. The same per-token quantity reduced differently is a different number:
a token-global mean weighs every token once; a *mean of sequence means* weighs every sequence
once (short sequences count as much as long ones); a *mean of rank (or micro-batch, or optimizer
step) means* weighs every part once whatever its token count. Ours are token-global over the
whole step, with ``lr = log pi - log mu`` (trainer minus sampler).

``relation`` says how far the peer's number can be read as ours, once the peer runs with the
settings in ``requires`` (its cap or band equal to ours):

* ``equal``: same quantity, same reduction (up to the peer's ``+1e-8`` in a denominator, a
  relative 1e-8 / n at most): the peer's number is ``sign`` times ours on any batch;
* ``equal_if``: same quantity, different reduction; equal exactly when ``differs_when`` is false
  (most often "equal if one": one micro-batch, optimizer step or sequence length per step);
* ``differs``: another quantity; ``differs_when`` says how, read it alongside ours.

``peer_version`` names the release (or the line of releases) whose source the entry was read
from; an older line keeps its own entry where the key or its reduction changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

Relation = Literal["equal", "equal_if", "differs"]


@dataclass(frozen=True)
class PeerAlias:
    framework: str
    peer_key: str          # the name the framework logs (without its logger's prefix)
    our_key: str           # our closest metric key (see mismatch_monitor/metric_defs.py)
    relation: Relation
    quantity: str          # the peer's per-token (or per-sequence) quantity in our notation
    reduction: str         # how the peer reduces it over tokens, sequences, micro-batches, ranks
    differs_when: str      # when the peer's number departs from ours ("" when it never does)
    peer_version: str      # the peer release the entry was read from
    requires: str = ""     # the peer's settings under which the entry holds ("" for none)
    sign: float = 1.0      # peer = sign * ours where equal (-1: the peer subtracts the other way)


_TOKEN_GLOBAL = "token-global masked mean over the driver's whole step batch"
_VERL_08 = "verl 0.8 / main (verl-project/verl at 20c30bf, trainer/ppo/rollout_corr_helper.py)"
_VERL_06 = "verl 0.6-0.7 (trainer/ppo/rollout_corr_helper.py)"
_VERL_TOKEN_IS = "rollout_is='token', rollout_is_threshold = MetricConfig.tis_cap"
_NEMO = "NeMo-RL main of 2026 (algorithms/loss_functions.py ClippedPGLossFn, global token normalisation)"
_NEMO_STEPS = ("micro-batch sums over the optimizer step's global valid-token count, summed over "
               "micro-batches and ranks, then averaged over the step's optimizer steps")
_ONE_OPT_STEP = "the step runs several optimizer steps (an average of their token means)"
_SKYRL = "SkyRL main of 2026 (skyrl package, backends/skyrl_train/utils/off_policy_correction.py)"
_SKYRL_MB = "a token mean per training micro-batch, averaged over the step's micro-batches"
_ONE_MB = "the step has several micro-batches of different token counts"

PEER_ALIASES: tuple[PeerAlias, ...] = (
    PeerAlias("verl", "rollout_corr/kl", "mismatch/k1_kl", "equal", "-lr", _TOKEN_GLOBAL, "", "verl 0.6-0.8"),
    PeerAlias("verl", "rollout_corr/k3_kl", "mismatch/k3_kl", "equal", "exp(lr) - 1 - lr", _TOKEN_GLOBAL, "",
              "verl 0.6-0.8"),
    PeerAlias("verl", "rollout_corr/chi2_token", "mismatch/chi2", "equal_if", "exp(clamp(lr, -20, 20))^2, minus 1",
              "token-global masked mean, then - 1", "some token has |lr| > 20 (verl clamps lr)", "verl 0.6-0.8"),
    PeerAlias("verl", "rollout_corr/rollout_is_eff_sample_size", "mismatch/ess_capped", "equal_if",
              "w = clamp(exp(lr), 1/C, C)", "1 / masked_mean((w / masked_mean(w))^2), token-global",
              "some token has exp(lr) < 1/C (verl lifts it to 1/C; we cap at C only)", _VERL_06, _VERL_TOKEN_IS),
    PeerAlias("verl", "rollout_corr/rollout_is_eff_sample_size", "mismatch/ess_capped", "equal",
              "w = clamp(exp(lr), 0, C): the weights the loss applies",
              "1 / masked_mean((w / masked_mean(w))^2), token-global", "", _VERL_08, _VERL_TOKEN_IS),
    PeerAlias("verl", "rollout_corr/rollout_is_ratio_fraction_high", "mismatch/clip_high_fraction", "equal",
              "exp(clamp(lr, -20, 20)) > C, before truncation", _TOKEN_GLOBAL, "", _VERL_08, _VERL_TOKEN_IS),
    PeerAlias("verl", "rollout_corr/rollout_is_ratio_fraction_low", "mismatch/clip_low_fraction", "equal_if",
              "exp(clamp(lr, -20, 20)) < 1/C, before truncation", _TOKEN_GLOBAL,
              "a token has rho exactly 1/C (verl counts rho < 1/C, we count rho <= 1/C)", _VERL_08, _VERL_TOKEN_IS),
    PeerAlias("verl", "rollout_corr/rollout_is_oob_ratio", "mismatch/icepop_masked_fraction", "equal",
              "exp(clamp(lr, -20, 20)) outside [lo, hi] (IcePop)", _TOKEN_GLOBAL, "", _VERL_08,
              "rollout_is='token', rollout_is_threshold='lo_hi' = MetricConfig.icepop_band"),
    PeerAlias("verl", "rollout_corr/rollout_is_mean", "mismatch/rho/mean", "equal_if", "exp(clamp(lr, -20, 20))",
              _TOKEN_GLOBAL, "some token has |lr| > 20", _VERL_06, "rollout_is='token'"),
    PeerAlias("verl", "rollout_corr/rollout_is_mean", "mismatch/rho/mean", "differs", "min(exp(lr), C)",
              _TOKEN_GLOBAL, "always where some rho > C: verl 0.8 averages the truncated weights the loss "
              "applies (ours is the mean of rho itself)", _VERL_08, _VERL_TOKEN_IS),
    PeerAlias("verl", "rollout_corr/log_ppl_diff", "mismatch/seq/mean_log_ratio/mean", "equal_if",
              "mean_t log mu - mean_t log pi = -(mean_t lr) per sequence: the sign is ours negated",
              "mean over the batch's rows of the per-sequence value",
              "a batch row has no response token (verl counts it as 0; we count sequences with a valid "
              "token only)", "verl 0.6-0.8", sign=-1.0),
    PeerAlias("NeMo-RL", "gen_kl_error", "mismatch/k3_kl", "equal_if", "exp(lr) - 1 - lr (kl_type k3, the default)",
              _NEMO_STEPS, _ONE_OPT_STEP, _NEMO),
    PeerAlias("NeMo-RL", "token_mult_prob_error", "mismatch/mult_prob_error", "equal_if", "exp(|lr|)",
              _NEMO_STEPS, _ONE_OPT_STEP, _NEMO),
    PeerAlias("NeMo-RL", "is_oob_ratio", "mismatch/clip_high_fraction", "equal_if",
              "exp(lr) > C (weights are >= 0, so none is below the default minimum 0)", _NEMO_STEPS, _ONE_OPT_STEP,
              _NEMO, "truncated_importance_sampling_type='tis', ratio = MetricConfig.tis_cap, no ratio_min"),
    PeerAlias("NeMo-RL", "is_oob_ratio", "mismatch/icepop_masked_fraction", "equal_if", "exp(lr) outside [min, max]",
              _NEMO_STEPS, _ONE_OPT_STEP, _NEMO,
              "truncated_importance_sampling_type='icepop', [ratio_min, ratio] = MetricConfig.icepop_band"),
    PeerAlias("NeMo-RL", "is_oob_ratio", "mismatch/seq/geometric_mask_fraction", "equal_if",
              "exp(mean_t lr) outside [min, max], per sequence",
              "sequences over the optimizer step's valid sequences, averaged over optimizer steps", _ONE_OPT_STEP,
              _NEMO, "truncated_importance_sampling_type='seq-mask-tis', [ratio_min, ratio] = "
              "MetricConfig.seq_geometric_band"),
    PeerAlias("TRL", "sampling/sampling_logp_difference/mean", "mismatch/abs_log_ratio/mean", "equal_if", "|lr|",
              "token mean per rank, then the mean of the rank means; averaged over the generation "
              "steps of a logging window", "ranks hold different token counts, or logging_steps spans "
              "several generation steps", "TRL 1.x (GRPOTrainer, vLLM importance-sampling correction)"),
    PeerAlias("TRL", "sampling/sampling_logp_difference/max", "mismatch/abs_log_ratio/max", "equal_if", "|lr|",
              "max over tokens and ranks; averaged over the generation steps of a logging window",
              "logging_steps spans several generation steps (a mean of maxima)", "TRL 1.x (GRPOTrainer)"),
    PeerAlias("TRL", "sampling/importance_sampling_ratio/mean", "mismatch/log_ratio/mean", "differs",
              "exp(lr) after TRL's truncation or masking (vllm_importance_sampling_mode)",
              "token mean per rank, then the mean of the rank means", "always: a truncated ratio, "
              "not a log ratio; compare its trend with ours", "TRL 1.x (GRPOTrainer)"),
    PeerAlias("slime", "train_rollout_logprob_abs_diff", "mismatch/abs_log_ratio/mean", "equal_if", "|lr|",
              "mean over the sample's loss-mask tokens, then the mean over samples of the step "
              "(sum_of_sample_mean; token-global with --calculate-per-token-loss)",
              "samples have different numbers of trained tokens", "slime 0.1-0.2 / Miles (policy_loss_function)"),
    PeerAlias("prime-rl", "mismatch_kl/mean", "mismatch/k3_kl", "equal_if", "exp(lr) - 1 - lr",
              "mean over each sample's loss-mask tokens, then the mean over all samples of all "
              "micro-batches and ranks", "samples have different numbers of trained tokens",
              "prime-rl 0.2-0.4 (trainer/rl/loss.py compute_loss)"),
    PeerAlias("prime-rl", "mismatch_kl/all/mean", "mismatch/k3_kl", "equal", "exp(lr) - 1 - lr",
              "token-pooled: the mean over every loss-mask token of the step's micro-batches and ranks", "",
              "prime-rl after 0.4 (the trainer's stability metrics: mismatch_kl/all/{mean,std,max})"),
    PeerAlias("OpenRLHF", "vllm_kl", "mismatch/k1_kl", "equal_if", "-lr",
              "token mean per micro-batch, then the mean over micro-batches and ranks",
              "micro-batches (or ranks) hold different token counts", "OpenRLHF 0.8-0.9 (PolicyLoss)"),
    PeerAlias("OpenRLHF", "vllm_kl", "mismatch/k1_kl", "equal", "-lr",
              "token-global: PolicyLoss is given the step's global token count (batch_num_tokens, dp_size)", "",
              "OpenRLHF 0.10 (PolicyLoss with batch_num_tokens)"),
    PeerAlias("SkyRL", "is_ratio_mean", "mismatch/rho/mean", "equal_if", "exp(clamp(lr, -20, 20))", _SKYRL_MB,
              f"{_ONE_MB}, or some token has |lr| > 20", _SKYRL, "any off_policy_correction enabled"),
    PeerAlias("SkyRL", "tis_token_clip_high_ratio", "mismatch/clip_high_fraction", "equal_if",
              "exp(clamp(lr, -20, 20)) > cap", _SKYRL_MB, _ONE_MB, _SKYRL,
              "tis_ratio_type='token', token_tis_ratio_clip_high = MetricConfig.tis_cap, no outlier or token mask"),
    PeerAlias("SkyRL", "token_mask_ratio", "mismatch/icepop_masked_fraction", "equal_if",
              "exp(clamp(lr, -20, 20)) outside [low, high]", _SKYRL_MB, _ONE_MB, _SKYRL,
              "[token_mask_is_threshold_low, _high] = MetricConfig.icepop_band, no outlier mask"),
    PeerAlias("SkyRL", "geo_sequence_mask_masked_ratio", "mismatch/seq/geometric_mask_fraction", "equal_if",
              "exp(mean_t lr) outside [geo_mask_low, geo_mask_high], per sequence",
              "sequences per micro-batch, averaged over micro-batches",
              "the step has several micro-batches, or a row has no response token (SkyRL counts it, in band)",
              _SKYRL, "sequence_mask_metric='geometric', [geo_mask_low, geo_mask_high] = "
              "MetricConfig.seq_geometric_band, no outlier or token mask"),
    PeerAlias("SkyRL", "product_sequence_mask_masked_ratio", "mismatch/seq/product_mask_fraction", "equal_if",
              "exp(clamp(sum_t lr, -20, 20)) outside [product_mask_low, product_mask_high], per sequence",
              "sequences per micro-batch, averaged over micro-batches",
              "the step has several micro-batches, or a row has no response token (SkyRL counts it, in band)",
              _SKYRL, "sequence_mask_metric='product', [product_mask_low, product_mask_high] = "
              "MetricConfig.seq_product_band, no outlier or token mask"),
    PeerAlias("SkyRL", "outlier_seq_masked_ratio", "mismatch/extreme_fraction", "differs",
              "a sequence with any token's exp(lr) outside [low, high]", "sequences per micro-batch",
              "always: a share of sequences with one outlying token, ours a share of tokens outside "
              "MetricConfig.extreme_band", _SKYRL, "outlier_token_is_threshold_low/_high set"),
)


def _by_peer_key() -> dict[tuple[str, str], tuple[PeerAlias, ...]]:
    out: dict[tuple[str, str], tuple[PeerAlias, ...]] = {}
    for a in PEER_ALIASES:
        out[(a.framework, a.peer_key)] = out.get((a.framework, a.peer_key), ()) + (a,)
    return out


# every entry of one logged key, in the order listed (older peer releases first)
ALIAS_BY_PEER_KEY: dict[tuple[str, str], tuple[PeerAlias, ...]] = _by_peer_key()


def aliases_for(framework: str) -> tuple[PeerAlias, ...]:
    found = tuple(a for a in PEER_ALIASES if a.framework.lower() == framework.lower())
    if not found:
        known = sorted({a.framework for a in PEER_ALIASES})
        raise ValueError(f"expected a framework among {known}, got {framework!r}")
    return found


def peer_view(report: Mapping[str, float], framework: str) -> dict[str, float]:
    """Our step report under the peer's names, for the keys whose newest entry is ``equal``.

    ``report`` maps our metric keys to values (a ``log_step`` report or a row of
    ``metrics.report``). Only exact correspondences are returned, for the newest peer release
    listed; each holds where the peer runs with the settings its entry ``requires`` (its cap or
    band equal to ours). ``equal_if`` numbers need the peer's own partition of the data and are
    documented, not faked.
    """
    newest = {a.peer_key: a for a in aliases_for(framework)}      # the last listed wins
    return {key: a.sign * float(report[a.our_key]) for key, a in newest.items()
            if a.relation == "equal" and a.our_key in report}


def alias_table() -> str:
    """The alias map as the Markdown table docs/INTEGRATIONS.md shows (a test keeps them equal)."""
    rows = ["| framework | its key | ours | relation | its reduction | differs when | read from |",
            "|---|---|---|---|---|---|---|"]
    for a in PEER_ALIASES:
        ours = f"`{a.our_key}`" if a.sign == 1.0 else f"minus `{a.our_key}`"
        relation = {"equal": "equal", "equal_if": "equal if", "differs": "differs"}[a.relation]
        cells = [a.framework, f"`{a.peer_key}`", ours, relation, a.reduction,
                 a.differs_when or "-", a.peer_version + (f"; with {a.requires}" if a.requires else "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
