"""The false-alarm rates the count rules state, checked by simulation, and the pool-outlier rule
on a pool that is worse by design.

Clean histories are drawn from the null itself: every step's count is Binomial(n, p) with the
pool's fixed p, on pools of 40 to 4,000 trials (the sizes that made the median rules fire on
noise). The rules' docs state a one-sided per-step false-alarm probability of 0.001 (z = 3.09)
and, held two steps, at most one false firing per 1,000 steps per pool. Runtime: about 40 s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from mismatch_monitor.alerts import AlertEvaluator, GrowthOverBaseline
from mismatch_monitor.alerts.definitions import (EXTREME_SHARE_RISE, POOL_OUTLIER, ROUTING_FLIP_RISE,
                                                 Z_COUNTS)
from mismatch_monitor.alerts.significance import upper_normal_tail

STEPS = 1500
# pool -> (trials per step, rate); the first is the "5 flips against a median of 1.2"
POOLS = {"tiny": (40, 0.03), "small": (150, 0.02), "mid": (400, 0.01), "large": (4000, 0.004)}
STATED_PER_STEP = 0.001            # definitions.Z_COUNTS
STATED_PER_1000_STEPS = 1.0


def clean_history(rate_key: str, total_key: str, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for pool, (n, p) in POOLS.items():
        sizes = rng.integers(n // 2, 2 * n, STEPS)          # pools' sizes vary from step to step
        k = rng.binomial(sizes, p)
        rows.append(pd.DataFrame({"step": np.arange(STEPS), "pool": pool, rate_key: k / sizes,
                                  total_key: sizes.astype(np.float64), "mismatch/n_tokens": sizes.astype(np.float64)}))
    return pd.concat(rows, ignore_index=True).sort_values(["step", "pool"], ignore_index=True)


def firings(history: pd.DataFrame, rule) -> int:
    _, events = AlertEvaluator.replay(history, rules=(rule,))
    return sum(e.state == "firing" for e in events)


def test_stated_rate_matches_the_normal_tail():
    assert abs(upper_normal_tail(Z_COUNTS) - STATED_PER_STEP) < 2e-5


def test_count_rules_keep_their_stated_false_alarm_rate_on_clean_binomial_histories():
    for rule, seed in ((ROUTING_FLIP_RISE, 1), (EXTREME_SHARE_RISE, 2)):
        cond = rule.condition
        history = clean_history(cond.rate, cond.total, seed)
        pool_steps = len(history)
        held = firings(history, rule)
        single = firings(history, replace(rule, for_steps=0))
        assert held / pool_steps * 1000 <= STATED_PER_1000_STEPS, (rule.name, held)
        # each step alone: at most the stated 0.001 (the Poisson tail is conservative for a binomial;
        # slack for the 6,000 draws: 3 standard deviations of a count with mean 6)
        assert single <= STATED_PER_STEP * pool_steps + 3 * np.sqrt(STATED_PER_STEP * pool_steps), (rule.name, single)


def test_a_median_rule_fires_on_the_same_noise():
    """The histories are hard enough to tell the tests apart: the old median-ratio rule fires."""
    rule = ROUTING_FLIP_RISE
    old = replace(rule, condition=GrowthOverBaseline(rule.condition.rate, 1.5, 50, 10, 0.01), for_steps=3,
                  description="flip rate of {pool} is {value}x its median")
    history = clean_history(rule.condition.rate, rule.condition.total, 1)
    assert firings(history, old) / len(history) * 1000 > STATED_PER_1000_STEPS


def test_small_pools_are_reported_as_not_enough_tokens():
    cond = EXTREME_SHARE_RISE.condition
    history = clean_history(cond.rate, cond.total, 3)
    evaluator, _ = AlertEvaluator.replay(history, rules=(EXTREME_SHARE_RISE,))
    counts = evaluator.undecided_counts()
    # 40 tokens at 3%: a threefold rise could not be significant in one step; 4,000 tokens can tell
    assert counts[(EXTREME_SHARE_RISE.name, "tiny")] == STEPS
    assert counts.get((EXTREME_SHARE_RISE.name, "large"), 0) == EXTREME_SHARE_RISE.condition.min_points + 2
    assert (EXTREME_SHARE_RISE.name, "tiny") in evaluator.undecided()


def test_a_pool_worse_by_design_all_run_fires_at_most_once():
    rng = np.random.default_rng(4)
    level = {"bf16": 2e-4, "fp8": 3e-4, "tpu": 2.5e-4, "int4": 5 * 2.5e-4}    # int4: 5x the median, all run
    rows = [{"step": s, "pool": p, "mismatch/k3_kl": v * rng.lognormal(0, 0.1), "mismatch/n_tokens": 200.0}
            for s in range(300) for p, v in level.items()]
    history = pd.DataFrame(rows)
    _, events = AlertEvaluator.replay(history, rules=(POOL_OUTLIER,))
    assert sum(e.state == "firing" and e.pool == "int4" for e in events) <= 1
    # the same pool turning 5x worse than itself mid-run does fire
    history.loc[(history["pool"] == "int4") & (history["step"] >= 200), "mismatch/k3_kl"] *= 5
    _, events = AlertEvaluator.replay(history, rules=(POOL_OUTLIER,))
    assert [e.step for e in events if e.state == "firing" and e.pool == "int4"][:1] == [200 + POOL_OUTLIER.for_steps]


def test_a_rise_that_lasts_the_rest_of_the_run_fires_once_and_holds_for_its_baseline():
    cond = ROUTING_FLIP_RISE.condition
    rng = np.random.default_rng(5)
    sizes = rng.integers(2000, 4000, 400)
    rate = np.where(np.arange(400) >= 100, 0.05, 0.01)          # 5x from step 100 to the end
    k = rng.binomial(sizes, rate)
    history = pd.DataFrame({"step": np.arange(400), "pool": "mid", cond.rate: k / sizes,
                            cond.total: sizes.astype(np.float64)})
    _, events = AlertEvaluator.replay(history, rules=(ROUTING_FLIP_RISE,))
    states = [(e.state, e.step) for e in events]
    assert states[0] == ("firing", 100 + ROUTING_FLIP_RISE.for_steps)
    assert [s for s, _ in states].count("firing") == 1
    # it stays firing while a pre-fault baseline is left (the window before the guard), then
    # resolves once: the raised level has become the pool's baseline and never fires again
    resolved = [step for s, step in states if s == "resolved"]
    assert resolved == [] or resolved[0] >= 100 + cond.window_steps
