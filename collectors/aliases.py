"""Which of our metrics each RL framework's own mismatch scalar corresponds to, and how it differs.

Frameworks log one or two mismatch scalars each, computed on their own slice of the data and
reduced their own way. The same per-token quantity reduced differently is a different number:
a token-global mean weighs every token once; a *mean of sequence means* weighs every sequence
once (short sequences count as much as long ones); a *mean of rank (or micro-batch) means*
weighs every rank once whatever its token count. Ours are token-global over the whole step, with
``lr = log pi - log mu`` (trainer minus sampler).

``relation`` says how far the peer's number can be read as ours:

* ``equal``: same per-token quantity, same token-global reduction (up to the peer's ``+1e-8``
  in a denominator, a relative 1e-8 / n at most);
* ``equal_if``: same quantity, different reduction; equal exactly when ``differs_when`` is false;
* ``related``: a different quantity (e.g. after the peer's own truncation); read it alongside.

Versions: verl 0.6-0.7 (``trainer/ppo/rollout_corr_helper.py``), NeMo-RL 0.3-0.5
(``ClippedPGLossFn``), TRL 1.x (``GRPOTrainer`` with vLLM importance-sampling correction), slime
0.1-0.2 / Miles (``policy_loss_function``), prime-rl 0.2-0.4 (``compute_loss``), OpenRLHF 0.8-0.9
(``PolicyLoss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

Relation = Literal["equal", "equal_if", "related"]


@dataclass(frozen=True)
class PeerAlias:
    framework: str
    peer_key: str          # the name the framework logs (without its logger's prefix)
    our_key: str           # our closest metric key (see mismatch_monitor/metrics.py)
    relation: Relation
    quantity: str          # the peer's per-token (or per-sequence) quantity in our notation
    reduction: str         # how the peer reduces it over tokens, sequences, micro-batches, ranks
    differs_when: str      # when the peer's number departs from ours ("" when it never does)


PEER_ALIASES: tuple[PeerAlias, ...] = (
    PeerAlias("verl", "rollout_corr/kl", "mismatch/k1_kl", "equal", "-lr",
              "token-global masked mean over the driver's whole step batch", ""),
    PeerAlias("verl", "rollout_corr/k3_kl", "mismatch/k3_kl", "equal", "exp(lr) - 1 - lr",
              "token-global masked mean over the driver's whole step batch", ""),
    PeerAlias("verl", "rollout_corr/chi2_token", "mismatch/chi2", "equal_if", "exp(clamp(lr, -20, 20))^2, minus 1",
              "token-global masked mean, then - 1", "some token has |lr| > 20 (verl clamps lr)"),
    PeerAlias("verl", "rollout_corr/rollout_is_eff_sample_size", "mismatch/ess_capped", "equal_if",
              "w = clamp(exp(lr), 1/C, C), C = rollout_is_threshold",
              "1 / masked_mean((w / masked_mean(w))^2), token-global (token-level IS)",
              "some token has exp(lr) < 1/C (verl also clamps from below; we cap at C only), or "
              "rollout_is_threshold != MetricConfig.tis_cap"),
    PeerAlias("NeMo-RL", "gen_kl_error", "mismatch/k3_kl", "equal", "exp(lr) - 1 - lr (kl_type k3, the default)",
              "micro-batch sums over the step's global valid-token count, summed over micro-batches "
              "and data-parallel ranks: token-global", ""),
    PeerAlias("NeMo-RL", "token_mult_prob_error", "mismatch/mult_prob_error", "equal", "exp(|lr|)",
              "micro-batch sums over the step's global valid-token count, summed: token-global", ""),
    PeerAlias("TRL", "sampling/sampling_logp_difference/mean", "mismatch/abs_log_ratio/mean", "equal_if", "|lr|",
              "token mean per rank, then the mean of the rank means; averaged over the generation "
              "steps of a logging window", "ranks hold different token counts, or logging_steps spans "
              "several generation steps"),
    PeerAlias("TRL", "sampling/sampling_logp_difference/max", "mismatch/abs_log_ratio/max", "equal_if", "|lr|",
              "max over tokens and ranks; averaged over the generation steps of a logging window",
              "logging_steps spans several generation steps (a mean of maxima)"),
    PeerAlias("TRL", "sampling/importance_sampling_ratio/mean", "mismatch/log_ratio/mean", "related",
              "exp(lr) after TRL's truncation or masking (vllm_importance_sampling_mode)",
              "token mean per rank, then the mean of the rank means", "always: a truncated ratio, "
              "not a log ratio; compare its trend with ours"),
    PeerAlias("slime", "train_rollout_logprob_abs_diff", "mismatch/abs_log_ratio/mean", "equal_if", "|lr|",
              "mean over the sample's loss-mask tokens, then the mean over samples of the step "
              "(sum_of_sample_mean; token-global with --calculate-per-token-loss)",
              "samples have different numbers of trained tokens"),
    PeerAlias("prime-rl", "mismatch_kl/mean", "mismatch/k3_kl", "equal_if", "exp(lr) - 1 - lr",
              "mean over each sample's loss-mask tokens, then the mean over all samples of all "
              "micro-batches and ranks", "samples have different numbers of trained tokens"),
    PeerAlias("OpenRLHF", "vllm_kl", "mismatch/k1_kl", "equal_if", "-lr",
              "token mean per micro-batch, then the mean over micro-batches and ranks",
              "micro-batches (or ranks) hold different token counts"),
)

ALIAS_BY_PEER_KEY: dict[tuple[str, str], PeerAlias] = {(a.framework, a.peer_key): a for a in PEER_ALIASES}


def aliases_for(framework: str) -> tuple[PeerAlias, ...]:
    found = tuple(a for a in PEER_ALIASES if a.framework.lower() == framework.lower())
    if not found:
        known = sorted({a.framework for a in PEER_ALIASES})
        raise ValueError(f"expected a framework among {known}, got {framework!r}")
    return found


def peer_view(report: Mapping[str, float], framework: str) -> dict[str, float]:
    """Our step report under the peer's names, for the aliases that are ``equal``.

    ``report`` maps our metric keys to values (a ``log_step`` report or a row of
    ``metrics.report``). Only exact correspondences are returned; ``equal_if`` numbers need the
    peer's own partition of the data and are documented, not faked.
    """
    return {a.peer_key: float(report[a.our_key]) for a in aliases_for(framework)
            if a.relation == "equal" and a.our_key in report}
