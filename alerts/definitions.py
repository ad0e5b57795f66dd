"""Every alert of mismatch-monitor, defined once.

The rendered Prometheus rules (``alerts/mismatch_rules.yml``), their promtool tests, the
in-process evaluator and docs/ALERTS.md all read this tuple. Change a threshold here, then run
``mismatch-monitor alerts render --write`` (a test fails while the committed files are stale).

Windows and ``for`` are counted in training steps; Prometheus sees them as multiples of the
step duration the rules were rendered for (``--step-seconds``).
"""

from __future__ import annotations

from .conditions import Compare
from .fleet_rise import RiseAgainstFleet
from .counts import CountRise
from .tails import TailRise
from .jumps import StepJump
from .expected_gate import AboveExpected
from .declared_gate import AboveDeclared
from .drift import PooledDrift
from .pooled import MeanRise
from .rules import AlertRule

TOKENS = "mismatch/n_tokens"
# One-sided z of the count and mean tests: 3.09 is a per-step false-alarm probability of 0.001
# (standard normal); held for two steps, a clean pool fires far less than once per 1,000 steps
# (tests/test_alert_false_alarms.py draws clean histories and counts).
Z_COUNTS = 3.09

TAIL_GROWTH = AlertRule(
    name="MismatchTailGrowth",
    condition=TailRise("mismatch/abs_log_ratio/p99", "mismatch/abs_log_ratio/p999", TOKENS, factor=2.0,
                       z=Z_COUNTS, window_steps=50, min_points=10),
    for_steps=1,
    severity="warning",
    fix="cap_per_pool",
    summary="p99 |log ratio| of pool {pool} is {value}x its trailing median",
    description=("The 99th percentile of |log pi - log mu| in pool {pool} grew to {value} times its "
                 "median over the {window} steps before the last two (threshold {threshold}x) for {held} steps, above "
                 "the largest p99.9 of those steps, with more tokens above that edge than its 0.1% share "
                 "explains (z > {z}). Tails move before the mean and before a collapse."),
    runbook=("Open the pool's length and low-probability slices. Growth confined to long responses: "
             "discard the pool's long rollouts or cap per pool (a tighter TIS cap or IcePop band for "
             "{pool}). Growth concentrated in tokens with sampler probability < 1e-2: move the LM head "
             "to FP32. Growth that follows rising staleness: resynchronise the samplers."),
)

KL_SPIKE = AlertRule(
    name="MismatchKLSpike",
    condition=MeanRise("mismatch/k3_kl", TOKENS, factor=3.0, z=4.0, window_steps=50, min_points=20,
                       lr_max="mismatch/log_ratio/max", lr_min="mismatch/log_ratio/min"),
    for_steps=1,   # one step is not a spike
    severity="warning",
    fix="fp32_head",
    summary="k3 KL(mu||pi) of pool {pool} spiked to {value}x its rolling median",
    description=("The k3 estimate of KL(mu||pi) in pool {pool} is {value} times its token-weighted mean "
                 "over the {window} steps before the last two (threshold {threshold}x) for {held} steps, {z} standard "
                 "errors or more above it (the window's scatter, plus the step's own token variance: one outlying token "
                 "is not a spike). Reported collapses start with such spikes."),
    runbook=("Compare the k3 of the pool's low-probability buckets with the rest: a spike carried by "
             "rare tokens points at the LM head precision (FP32 head, or matched precision for "
             "quantized pools). A spike together with staleness or a low ESS is policy lag: resync. "
             "A spike in one pool only is a per-pool problem: cap per pool."),
)

LOW_ESS = AlertRule(
    name="MismatchLowESS",
    condition=Compare("mismatch/ess", "<", 0.5),
    for_steps=1,
    severity="critical",
    resync=True,
    fix="resync",
    summary="ESS of pool {pool} is {value}: resynchronise its samplers",
    description=("The normalised effective sample size of the importance weights in pool {pool} is "
                 "{value}, below {threshold}, for {held} steps. Correcting harder only adds variance here."),
    runbook=("Resynchronise the pool's sampler weights with the trainer (the trainer's on_resync "
             "callback is called once per firing). If the ESS falls again right after a resync, the "
             "cause is numerical, not lag: check the tail and KL alerts of {pool} and its precision."),
)

DRIFT = AlertRule(
    name="MismatchDrift",
    condition=PooledDrift("mismatch/log_ratio/mean", TOKENS, z=5.0, floor=1e-3, window_steps=20, min_points=20,
                          baseline_steps=50, min_baseline=5),
    for_steps=0,   # the window already pools 20 steps
    severity="warning",
    fix="mask_replay",
    summary="Signed mean log ratio of pool {pool} moved {value} standard errors from its own baseline",
    description=("The mean of log pi - log mu over the tokens of pool {pool} in the last {window} steps moved "
                 "more than {threshold} standard errors (the steps' scatter) and {floor} away from the pool's "
                 "own mean over the steps before them: a bias that appeared or grew, not noise, and not the "
                 "steady bias of the pool's precision."),
    runbook=("A constant offset with a tiny spread is the fingerprint of a sampler that reports "
             "log-probs after top-p/top-k truncation (shifted by log S): compare with the pool's mean "
             "kept log-mass, then replay the keep-mask or renormalise. A bias that grows with "
             "staleness is policy lag: resync. Otherwise centre the scores against the drift."),
)

EXTREME_SHARE_RISE = AlertRule(
    name="MismatchExtremeShareRise",
    condition=CountRise("mismatch/extreme_fraction", TOKENS, factor=3.0, z=Z_COUNTS, window_steps=50,
                        min_points=10, min_rate=1e-4),
    for_steps=1,
    severity="warning",
    fix="discard_long_rollouts",
    summary="Share of extreme-ratio tokens in pool {pool} rose {value}x",
    description=("Pool {pool} has {value} times the extreme-ratio tokens the rate pooled over the {window} steps "
                 "before the last two expects (threshold {threshold}x, Poisson z > {z}) for {held} steps."),
    runbook=("Extreme ratios compound over long sequences: check the pool's length slices and discard "
             "its long rollouts first, or cap per pool. If one pool holds far more than its share of "
             "the fleet's extreme tokens, give it its own cap or take it out of the batch."),
)

ROUTING_FLIP_RISE = AlertRule(
    name="MismatchRoutingFlipRise",
    condition=CountRise("mismatch/routing/flip_rate", "mismatch/routing/decisions", factor=1.5, z=Z_COUNTS,
                        window_steps=50, min_points=10, min_rate=1e-3),
    for_steps=1,
    severity="warning",
    fix="routing_replay",
    summary="MoE routing flip rate of pool {pool} rose {value}x",
    description=("Pool {pool} has {value} times the (token, layer) decisions whose top-k expert set differs "
                 "between sampler and trainer that the rate pooled over the {window} steps before the last two expects "
                 "(threshold {threshold}x, Poisson z > {z}) for {held} steps."),
    runbook=("Flipped experts are discontinuous disagreements that no ratio cap repairs well: enable "
             "routing replay (ship the sampler's expert ids to the trainer) for {pool}. Check the "
             "per-layer flip table for the layers that moved."),
)

STALENESS_HIGH = AlertRule(
    name="MismatchStalenessHigh",
    condition=Compare("mismatch/staleness/max", ">", 4.0),
    severity="critical",
    resync=True,
    fix="resync",
    keep_firing_steps=5,   # back above the cap within 5 steps of a resync: the same fault (MismatchSyncBehind)
    summary="Pool {pool} sampled with weights {value} steps old",
    description=("The largest staleness (trainer step minus the sampler's policy version) in pool "
                 "{pool} is {value}, above the cap of {threshold} steps."),
    runbook=("Policy lag feeds on itself: resynchronise the pool's sampler weights (on_resync is "
             "called once per firing, and again each time the pool falls back above the cap within 5 steps of "
             "a resync) and bound the asynchronous queue so no rollout is older than "
             "the cap."),
)

SYNC_BEHIND = AlertRule(
    name="MismatchSyncBehind",
    # exact bookkeeping, not an estimate: one step past the pool's own declared bound decides, from step 0
    condition=AboveDeclared("mismatch/staleness/max"),
    severity="critical",
    resync=True,
    fix="resync",
    # a pool that falls behind again within 5 steps of catching up is the same fault, not a new alert
    # (its resync did not hold: the firing asks another, evaluator.repeat_requests)
    keep_firing_steps=5,
    summary="Pool {pool} sampled with weights {value} update(s) older than its pipeline allows: a sync did not apply",
    description=("The largest staleness (trainer step minus the sampler's policy version) in pool {pool} is {value} "
                 "update(s) above the max_staleness the pool declares (its run.json metadata: 0 for a pool synced "
                 "every step, the queue depth for an asynchronous one). Its weights were not updated when they "
                 "should have been; no history is needed: this holds from the pool's first step."),
    runbook=("Resynchronise the pool's sampler weights (on_resync is called once per firing). Then find the sync "
             "that did not apply: the run's weight_sync events (a push recorded as not applied, or a fingerprint "
             "that is not the version's), the engine's reload logs, a worker that stopped taking updates. A pool "
             "that falls behind again within 5 steps of catching up stays one firing and is resynced again (each "
             "resync_request event says so): its pipeline is stuck; fix the sync path or restart the worker."),
)

POOL_OUTLIER = AlertRule(
    name="MismatchPoolOutlier",
    # z 4 on three steps in a row: a pool's own heavy-tailed steps (INT4, ~80 tokens) pass
    condition=RiseAgainstFleet("mismatch/k3_kl", TOKENS, factor=4.0, z=4.0, min_pools=3, floor=1e-4,
                               window_steps=50, min_points=10),
    for_steps=2,
    severity="warning",
    fix="cap_per_pool",
    summary="k3 KL of pool {pool} rose {value}x more than the fleet's",
    description=("The k3 KL of pool {pool} is {value} times its token-weighted mean over the {window} steps before "
                 "the last two, times the median of that rise over pools (threshold {threshold}x, above {floor}, at "
                 "least {min_pools} pools), {z} standard errors or more above it (the scatter of those steps), for "
                 "{held} steps: a pool that is worse by design stays at its own level and is not re-alerted; one "
                 "that moved away from the fleet is."),
    runbook=("One pool's numerics differ from the fleet (precision, engine or hardware): cap per pool "
             "(its own TIS cap or band), discard its long rollouts, or match its precision flow "
             "(fake-quantize the trainer to its format). Compare its row with the fleet on the "
             "dashboard's pool page."),
)

NON_FINITE = AlertRule(
    name="MismatchNonFiniteLogprobs",
    condition=Compare("mismatch/data_quality/nonfinite_tokens", ">", 0.0),
    severity="critical",
    fix="fp32_head",
    summary="Pool {pool} sent {value} tokens with non-finite log-probs",
    description=("{value} tokens of pool {pool} carried a NaN or infinite log-prob in this step; they "
                 "are excluded from every metric and from the correction."),
    runbook=("Non-finite log-probs come from overflow in a low-precision LM head or softmax, or from "
             "a broken sampler response. Compute the head and log-softmax in FP32 and check the "
             "pool's engine logs; never feed these tokens to the loss."),
)

STEP_JUMP = AlertRule(
    name="MismatchStepJump",
    condition=StepJump("mismatch/k3_kl", TOKENS, "mismatch/abs_log_ratio/p90", "mismatch/abs_log_ratio/p99",
                       factor=10.0, z=Z_COUNTS, floor=1e-4, baseline_steps=5),
    # two steps: a sync that did not apply stays wrong until a resync; a one-prompt pool's step whose
    # prompt routes near a tie moves every sequence of that step and is gone at the next (docs/ALERTS.md)
    for_steps=1,
    severity="critical",
    resync=True,
    fix="resync",
    summary="k3 KL of pool {pool} jumped {value}x in one step",
    description=("The k3 estimate of KL(mu||pi) in pool {pool} is {value} times its token-pooled value over the "
                 "{window} steps before (threshold {threshold}x; one earlier step is enough), and the jump is carried "
                 "by many tokens: the step's p90 |log ratio| is above the largest p99 of those steps, more tokens "
                 "above it than the baseline explains (z > {z}), for {held} steps. A weight sync or a resume that went "
                 "wrong shows at the step after it and stays until a resync; one outlying token, or one prompt's "
                 "excursion in a pool that samples few prompts, does not."),
    runbook=("A one-step jump right after a weight sync or a resume is a sync that did not apply: weights "
             "not loaded, the wrong version, a prefix cache that kept the old weights' KV. Resynchronise the "
             "pool (on_resync); if the jump stays after the resync, the cause is numeric, not lag: check the "
             "pool's precision and kernels."),
)

ABOVE_EXPECTED = AlertRule(
    name="MismatchAboveExpected",
    # factor 5: on the project's clean recordings (two sample runs and 5 more simulator runs, 3,700 pool-steps)
    # the largest p90 / expected p99 is 2.8 for pools at their own level and 2.6 for the lagged
    # pool, whose lag the levels do not describe (docs/ALERTS.md)
    condition=AboveExpected("mismatch/abs_log_ratio/p90", "mismatch/abs_log_ratio/p99", TOKENS, factor=5.0,
                            z=Z_COUNTS),
    severity="critical",
    resync=True,
    fix="resync",
    summary="p90 |log ratio| of pool {pool} is {value}x the p99 a healthy pool of its kind has",
    description=("The 90th percentile of |log pi - log mu| in pool {pool} is {value} times the 99th percentile "
                 "expected of a healthy pool of its precision and engine (expected_levels.csv; threshold "
                 "{threshold}x), with more tokens above that edge than a healthy pool's 1% explains (z > {z}). "
                 "No history is needed: this holds from the pool's first step."),
    runbook=("A pool this far from its kind's healthy level from its first steps runs something other than "
             "it claims: weights not loaded or the wrong version (resync and check the sampler's weight "
             "version), or a precision or kernel other than its metadata says. If a resync does not bring it "
             "back, check the pool's quantization and engine flags against run.json."),
)

SHARPNESS_SHIFT = AlertRule(
    name="MismatchSharperTrainer",
    # one-sided: noise in the sampler's logits makes the sampler look sharper (the tokens it finds likely are,
    # on average, ones it overrates), so a noisier sampler pushes the contrast below 0; the sampler at
    # temperature 1 while the trainer divides by T < 1 pushes it above (docs/ALERTS.md: measured on both)
    # a lagging pool's trainer has moved since it sampled, which looks the same (measured: up to 6 standard
    # errors on the simulator's one-step-stale pool); its staleness explains it, and MismatchStalenessHigh judges it
    # it stays firing until the two ends no longer pull apart (contrast <= 0): a faulted FP8 pool's contrast
    # dips to 0.5-3 on some steps (bench_warning) and would otherwise fire anew after each dip
    condition=Compare("mismatch/sharpness/contrast_t", ">", 4.0, unless="mismatch/staleness/max", unless_above=0.0,
                      clear_at=0.0),
    severity="critical",
    fix="sampling_params",
    summary="Pool {pool}'s trainer is sharper than its sampler ({value} standard errors): check its temperature",
    description=("In pool {pool} the trainer gives the tokens the sampler found likely (top sampler-probability "
                 "bucket) more probability than the sampler did, and the unlikely ones (below the second-highest "
                 "edge) less, each {value} standard errors or more from no shift (threshold {threshold}): the "
                 "trainer's distribution is sharper than the sampler's. No history is needed: this holds from the "
                 "pool's first step."),
    runbook=("The sampler samples at another temperature than the trainer scores at: check that {pool} receives "
             "the temperature (a sampler that ignores it samples at 1), and that its log-probs are of the "
             "distribution it sampled (vLLM: logprobs_mode='processed_logprobs'; 'raw_logprobs' reports "
             "temperature-1 log-probs). A pool that lags a policy that sharpens looks the same: check its staleness "
             "and resync if it lags."),
)

DEFAULT_RULES: tuple[AlertRule, ...] = (
    TAIL_GROWTH, KL_SPIKE, LOW_ESS, DRIFT, EXTREME_SHARE_RISE, ROUTING_FLIP_RISE, STALENESS_HIGH, SYNC_BEHIND,
    POOL_OUTLIER, NON_FINITE, STEP_JUMP, ABOVE_EXPECTED, SHARPNESS_SHIFT,
)

# Opt-in, for setups that claim bitwise agreement (batch-invariant kernels, the same engine on
# both sides): any token whose two log-probs differ fires, from step 0, no history needed.
#     AlertEvaluator(BITWISE_RULES); mismatch-monitor's rules file for it: render_rules(BITWISE_RULES)
EXACT_AGREEMENT = AlertRule(
    name="MismatchNotBitwise",
    condition=Compare("mismatch/exact_agreement", "<", 1.0),
    severity="critical",
    fix="batch_invariant_kernels",
    summary="Pool {pool} agrees bitwise on only {value} of its tokens",
    description=("A share {value} of the tokens of pool {pool} have equal sampler and trainer log-probs "
                 "(lr == 0 exactly), below {threshold}: the setup claims bitwise agreement and has lost it."),
    runbook=("Bitwise agreement holds only with the same kernels, batch shapes and reduction order on both "
             "sides: check that batch-invariant kernels are on in both engines, that the pool's engine and "
             "precision are the trainer's, and that the weights were synced (a weight sync that failed shows "
             "here from its first step)."),
)

BITWISE_RULES: tuple[AlertRule, ...] = DEFAULT_RULES + (EXACT_AGREEMENT,)
