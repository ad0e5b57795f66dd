"""Agreement: on a metric history made by the real engine, Prometheus (promtool, running the
rendered rules) fires exactly the alerts the in-process evaluator fires, at the same steps.

The history is 64 steps of three sampler pools (768 tokens each: enough for the tail test to
decide) with incidents injected into the log-probs after the 20 steps the KL baseline needs:
tail growth and a KL spike (one pool's noise x4, also an outlier among pools against its own
ratio), a low ESS, a constant offset from step 28 on (drift against the pool's own earlier mean), extreme ratios, more routing flips, stale weights,
NaN log-probs and a pool that stops reporting. Every rule is checked at every step. Runtime:
about 10 s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from mismatch_monitor import metrics
from mismatch_monitor.alerts import (AlertEvaluator, AlertRule, Compare, DEFAULT_RULES, GrowthOverBaseline,
                                     render_rules)
from mismatch_monitor.alerts.promtool import render_unit_tests, run_tool
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.engine import compute_stats

from external_tools import needs

STEPS = 64
SEQS, TOKENS, LAYERS = 16, 48, 4
DRIFT_STEPS = range(28, STEPS)   # after the 25 steps the drift rule needs (its window and a baseline)


@dataclass(frozen=True)
class PoolState:
    noise: float                 # std of lr
    offset: float = 0.0          # constant added to every lr (truncation-style drift)
    flip: float = 0.02           # probability that a (token, layer) routes elsewhere
    staleness: int = 1
    extreme_share: float = 0.0   # share of tokens given |lr| = 2 (outside the extreme band)
    nan_tokens: int = 0


def pool_state(pool: str, step: int) -> PoolState | None:
    base = {"bf16": PoolState(0.03), "fp8": PoolState(0.05), "int4": PoolState(0.08)}[pool]
    if pool == "int4" and step in range(24, 28):
        return replace(base, noise=0.32)
    if pool == "bf16" and step in range(30, 34):
        return replace(base, noise=1.0)
    if pool == "fp8" and step in DRIFT_STEPS:
        base = replace(base, offset=-0.02)
    if pool == "fp8" and step in range(34, 40):     # longer than the rule's `for`
        return replace(base, flip=0.12)
    if pool == "bf16" and step in range(42, 46):
        return replace(base, extreme_share=0.03)
    if pool == "int4" and step in range(46, 48):
        return replace(base, staleness=6)
    if pool == "bf16" and step == 50:
        return replace(base, nan_tokens=3)
    if pool == "int4" and step in (52, 53):
        return None
    return base


def make_batch(step: int, gen: torch.Generator) -> TokenBatch:
    states = [(p, s) for p in ("bf16", "fp8", "int4") if (s := pool_state(p, step)) is not None]
    B = SEQS * len(states)
    mu = -(4.0 + 3.0 * torch.rand(B, TOKENS, generator=gen, dtype=torch.float64))
    lr = torch.randn(B, TOKENS, generator=gen, dtype=torch.float64)
    first = torch.randint(0, 8, (B, TOKENS, LAYERS), generator=gen)
    experts = torch.stack([first, first + 8], dim=-1)              # [B, T, L, K]: two distinct experts
    sampler_experts = experts.clone()
    stale = torch.zeros(B, dtype=torch.int64)
    labels: list[str] = []
    for i, (pool, s) in enumerate(states):
        rows = slice(i * SEQS, (i + 1) * SEQS)
        lr[rows] = s.offset + s.noise * lr[rows]
        if s.extreme_share:
            hit = torch.rand(SEQS, TOKENS, generator=gen) < s.extreme_share
            lr[rows] = torch.where(hit, torch.full_like(lr[rows], 2.0), lr[rows])
        flips = torch.rand(SEQS, TOKENS, LAYERS, generator=gen) < s.flip
        sampler_experts[rows, ..., 0] = torch.where(flips, (experts[rows, ..., 0] + 1) % 8, experts[rows, ..., 0])
        stale[rows] = s.staleness
        labels += [pool] * SEQS
    pi = mu + lr
    for i, (pool, s) in enumerate(states):
        if s.nan_tokens:
            pi[i * SEQS, : s.nan_tokens] = float("nan")
    return TokenBatch.from_padded(
        pi, mu, torch.ones(B, TOKENS, dtype=torch.bool),
        labels={"pool": labels, "hardware": ["H100" if p != "int4" else "L40S" for p in labels]},
        policy_version=100 + step - stale, trainer_version=100 + step,
        trainer_experts=experts, sampler_experts=sampler_experts)


def engine_history() -> tuple[pd.DataFrame, pd.DataFrame]:
    gen = torch.Generator().manual_seed(1234)
    by_pool, fleet = [], []
    for step in range(STEPS):
        stats = compute_stats(make_batch(step, gen))
        by_pool.append(metrics.report(stats, ["pool"]).assign(step=step, wall_time=float(step)))
        fleet.append(metrics.report(stats).assign(step=step, wall_time=float(step)))
    return pd.concat(by_pool, ignore_index=True), pd.concat(fleet, ignore_index=True)


FLEET_RULES = (
    AlertRule(name="FleetLowESS", condition=Compare("mismatch/ess", "<", 0.8), scope="fleet", for_steps=1,
              severity="critical", summary="ESS of {pool} is {value}", description="below {threshold}",
              runbook="resync {pool}", fix="resync", resync=True),
    AlertRule(name="FleetKLSpike", condition=GrowthOverBaseline("mismatch/k3_kl", 2.0, 8, 4, 0.0),
              scope="fleet", severity="warning", summary="k3 of {pool} is {value}x",
              description="over {window} steps", runbook="look", fix="fp32_head"),
)


@needs("promtool")
def test_prometheus_fires_what_the_evaluator_fires(tmp_path):
    history, fleet = engine_history()
    rules = DEFAULT_RULES + FLEET_RULES
    _, events = AlertEvaluator.replay(history, rules=rules, fleet_history=fleet)
    fired = {(e.alert, e.pool, e.step) for e in events if e.state == "firing"}
    # the incidents are real: each injected problem fires its alert in-process
    for alert, pool in [("MismatchTailGrowth", "int4"), ("MismatchKLSpike", "int4"), ("MismatchPoolOutlier", "int4"),
                        ("MismatchLowESS", "bf16"), ("MismatchDrift", "fp8"), ("MismatchRoutingFlipRise", "fp8"),
                        ("MismatchExtremeShareRise", "bf16"), ("MismatchStalenessHigh", "int4"),
                        ("MismatchNonFiniteLogprobs", "bf16"), ("FleetLowESS", None), ("FleetKLSpike", None)]:
        assert any(a == alert and p == pool for a, p, _ in fired), (alert, pool, sorted(fired))
    drift = {(p, s) for a, p, s in fired if a == "MismatchDrift"}
    assert {p for p, _ in drift} == {"fp8"} and all(s in DRIFT_STEPS for _, s in drift)   # only while on
    step_seconds = 60.0
    (tmp_path / "rules.yml").write_text(render_rules(rules, step_seconds=step_seconds))
    (tmp_path / "agreement_test.yml").write_text(render_unit_tests(
        history, rules=rules, step_seconds=step_seconds, rule_file="rules.yml", fleet_history=fleet,
        eval_steps="all"))
    result = run_tool("promtool", "test", "rules", "agreement_test.yml", cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # a count test reports k / lam: finite even where the baseline saw no extreme token (min_rate)
    assert all(np.isfinite(e.value) and e.value > 3.0 for e in events
               if e.alert == "MismatchExtremeShareRise" and e.state == "firing")
