"""A readable 90-step, four-pool metric history in which every default alert fires and clears.

It drives the committed promtool tests (``mismatch_rules_test.yml``): the values are plain
numbers a reviewer can follow, and each incident is listed in :data:`INCIDENTS`. Healthy values
wobble by a few percent so trailing medians are real medians, not constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mismatch_monitor.exporter import COUNTER_BY_FIELD, HISTOGRAM, bucket_bounds
from mismatch_monitor.engine.histogram import LogBins
from mismatch_monitor.config import MetricConfig
from prometheus_client.utils import floatToGoString

from .promql import duration

STEPS = 90
POOLS = ("bf16", "fp8", "int4", "tpu")
MOE_POOLS = ("bf16", "fp8")      # the others report no routing (NaN: no observation)
HEALTHY: dict[str, dict[str, float]] = {
    # metric key -> pool -> healthy level
    "mismatch/abs_log_ratio/p99": {"bf16": 0.02, "fp8": 0.05, "int4": 0.08, "tpu": 0.03},
    "mismatch/k3_kl": {"bf16": 2e-4, "fp8": 6e-4, "int4": 1e-3, "tpu": 3e-4},
    "mismatch/ess": {p: 0.98 for p in POOLS},
    "mismatch/log_ratio/mean": {p: 1e-4 for p in POOLS},
    "mismatch/log_ratio/std_error": {p: 5e-4 for p in POOLS},
    "mismatch/extreme_fraction": {p: 4e-4 for p in POOLS},
    "mismatch/routing/flip_rate": {"bf16": 0.08, "fp8": 0.1},
    "mismatch/staleness/max": {"bf16": 1.0, "fp8": 1.0, "int4": 1.0, "tpu": 0.0},   # tpu: synchronous
    # numeric noise in the sampler pushes it below 0 (docs/ALERTS.md)
    "mismatch/sharpness/contrast_t": {p: -0.8 for p in POOLS},
    "mismatch/data_quality/nonfinite_tokens": {p: 0.0 for p in POOLS},
    # sizes: the count and mean tests weigh each step by them
    "mismatch/n_tokens": {"bf16": 8000.0, "fp8": 4000.0, "int4": 2000.0, "tpu": 1000.0},
    "mismatch/abs_log_ratio/p999": {"bf16": 0.04, "fp8": 0.1, "int4": 0.16, "tpu": 0.06},
    "mismatch/abs_log_ratio/p90": {"bf16": 0.01, "fp8": 0.025, "int4": 0.04, "tpu": 0.015},
    # the largest token's k3 term bounds a step's own variance (KL spike); healthy: small
    "mismatch/log_ratio/max": {"bf16": 0.03, "fp8": 0.08, "int4": 0.12, "tpu": 0.05},
    "mismatch/log_ratio/min": {"bf16": -0.03, "fp8": -0.08, "int4": -0.12, "tpu": -0.05},
    "mismatch/routing/decisions": {"bf16": 32000.0, "fp8": 16000.0},
}
WOBBLES = {"mismatch/sharpness/contrast_t", "mismatch/abs_log_ratio/p99", "mismatch/k3_kl", "mismatch/extreme_fraction",
           "mismatch/routing/flip_rate", "mismatch/log_ratio/mean", "mismatch/abs_log_ratio/p999"}


@dataclass(frozen=True)
class Incident:
    alert: str           # the alert it should raise
    pool: str
    metric: str
    value: float
    steps: range
    silent: bool = False   # the alert must not fire here: another cause explains the value


INCIDENTS: tuple[Incident, ...] = (
    # a pool broken from its first step (wrong weights loaded): far above its kind's expected level,
    # with no history for any relative rule (fires given the pools' metadata, files.SCENARIO_POOLS)
    Incident("MismatchAboveExpected", "bf16", "mismatch/abs_log_ratio/p90", 1.0, range(0, 2)),
    Incident("MismatchAboveExpected", "bf16", "mismatch/abs_log_ratio/p99", 1.2, range(0, 2)),
    Incident("MismatchAboveExpected", "bf16", "mismatch/abs_log_ratio/p999", 1.5, range(0, 2)),
    # ... a step whose p90 dips under 5x the expected p99 (0.134) but not under sqrt(5)x: still firing
    Incident("MismatchAboveExpected", "bf16", "mismatch/abs_log_ratio/p90", 0.45, range(2, 3)),
    Incident("MismatchAboveExpected", "bf16", "mismatch/abs_log_ratio/p99", 0.6, range(2, 3)),
    # a weight sync that fails at step 2: k3 jumps 20x from the first steps, before any baseline
    Incident("MismatchStepJump", "fp8", "mismatch/k3_kl", 1.2e-2, range(2, 6)),
    # ... carried by the whole distribution: p90 above the p99 of the steps before
    Incident("MismatchStepJump", "fp8", "mismatch/abs_log_ratio/p90", 0.2, range(2, 6)),
    Incident("MismatchDrift", "fp8", "mismatch/log_ratio/mean", -4e-3, range(10, 41)),
    Incident("MismatchRoutingFlipRise", "bf16", "mismatch/routing/flip_rate", 0.2, range(20, 24)),
    Incident("MismatchTailGrowth", "int4", "mismatch/abs_log_ratio/p99", 0.3, range(30, 36)),
    # a KL spike in one pool that is also an outlier among pools
    Incident("MismatchKLSpike", "tpu", "mismatch/k3_kl", 4e-3, range(45, 49)),
    Incident("MismatchLowESS", "fp8", "mismatch/ess", 0.35, range(55, 59)),
    Incident("MismatchExtremeShareRise", "int4", "mismatch/extreme_fraction", 6e-3, range(62, 65)),
    Incident("MismatchStalenessHigh", "bf16", "mismatch/staleness/max", 6.0, range(70, 72)),
    # the synchronous pool's push does not apply at step 77: one update behind, under the generic cap of
    # MismatchStalenessHigh, past its declared max_staleness 0 (files.SCENARIO_POOLS)
    Incident("MismatchSyncBehind", "tpu", "mismatch/staleness/max", 1.0, range(77, 79)),
    Incident("MismatchNonFiniteLogprobs", "tpu", "mismatch/data_quality/nonfinite_tokens", 3.0, range(75, 76)),
    # the synchronous pool's sampler stops applying the temperature after its gap; the same contrast on a
    # stale pool (int4) is explained by its lag and stays silent
    Incident("MismatchSharperTrainer", "tpu", "mismatch/sharpness/contrast_t", 7.0, range(84, 86)),
    # ... a step whose contrast dips under the threshold but not to 0: still firing (it clears at 0)
    Incident("MismatchSharperTrainer", "tpu", "mismatch/sharpness/contrast_t", 2.0, range(86, 87)),
    Incident("MismatchSharperTrainer", "int4", "mismatch/sharpness/contrast_t", 7.0, range(84, 87), silent=True),
)
ABSENT: dict[str, range] = {"tpu": range(80, 83)}   # a pool that logs nothing for a while


def _wobble(step: int, i: int) -> float:
    return 1.0 + 0.05 * math.sin(0.7 * step + 1.3 * i)


def scenario_history(step_seconds: float = 60.0) -> pd.DataFrame:
    """Columns step, wall_time, pool and the metric keys the default rules read."""
    rows: list[dict[str, Any]] = []
    for step in range(STEPS):
        for i, pool in enumerate(POOLS):
            if step in ABSENT.get(pool, ()):
                continue
            row: dict[str, Any] = {"step": step, "wall_time": step * step_seconds, "pool": pool}
            for key, levels in HEALTHY.items():
                level = levels.get(pool, math.nan)
                value = level * _wobble(step, i) if key in WOBBLES else level
                row[key] = float(f"{value:.4g}")
            for inc in INCIDENTS:
                if inc.pool == pool and step in inc.steps:   # incidents wobble too: no zero scatter
                    wobble = _wobble(step, i) if inc.metric in WOBBLES else 1.0
                    row[inc.metric] = float(f"{inc.value * wobble:.4g}")
            rows.append(row)
    return pd.DataFrame(rows)


def counter_tests(step_seconds: float = 60.0, config: MetricConfig | None = None
                  ) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """Counter series of two pools on two hardware kinds and the rate-group recording rules'
    expected values. Rates are whole numbers per second, so every expected value is exact."""
    if step_seconds != 60.0:
        raise ValueError(f"expected the counter tests at step_seconds=60, got {step_seconds}")
    per_second = {  # (pool, hardware) -> counter field -> increase per second
        ("fp8", "H100"): {"n_tokens": 100, "n_extreme": 3, "n_routing_decisions": 400, "n_routing_flips": 40},
        ("fp8", "MI300"): {"n_tokens": 100, "n_extreme": 1, "n_routing_decisions": 400, "n_routing_flips": 8},
        ("bf16", "H100"): {"n_tokens": 200, "n_extreme": 0, "n_routing_decisions": 800, "n_routing_flips": 16},
    }
    series = []
    for (pool, hw), counts in per_second.items():
        for field, rate in counts.items():
            name = COUNTER_BY_FIELD[field].name + "_total"
            series.append({"series": f'{name}{{pool="{pool}",hardware="{hw}"}}',
                           "values": f"0+{rate * 60}x20"})
    # |lr| histogram of fp8/H100: 99 of every 100 tokens in the first bucket, 1 in the last
    bounds, _ = bucket_bounds(LogBins.from_config(config or MetricConfig()))
    les = [floatToGoString(b) for b in bounds] + ["+Inf"]
    for j, le in enumerate(les):
        series.append({"series": f'{HISTOGRAM}_bucket{{pool="fp8",hardware="H100",le="{le}"}}',
                       "values": f"0+{(99 if j < len(les) - 1 else 100) * 60}x20"})
    at = duration(10 * 60.0)
    tests: list[dict[str, Any]] = [
        {"expr": "pool:mismatch_extreme_tokens:ratio_rate5m", "eval_time": at, "exp_samples": [
            {"labels": 'pool:mismatch_extreme_tokens:ratio_rate5m{pool="bf16"}', "value": 0 / 200},
            {"labels": 'pool:mismatch_extreme_tokens:ratio_rate5m{pool="fp8"}', "value": (3 + 1) / (100 + 100)}]},
        {"expr": "hardware:mismatch_routing_flips:ratio_rate5m", "eval_time": at, "exp_samples": [
            {"labels": 'hardware:mismatch_routing_flips:ratio_rate5m{hardware="H100"}', "value": (40 + 16) / 1200},
            {"labels": 'hardware:mismatch_routing_flips:ratio_rate5m{hardware="MI300"}', "value": 8 / 400}]},
        {"expr": "pool:mismatch_extreme_tokens:fleet_share_rate5m", "eval_time": at, "exp_samples": [
            {"labels": 'pool:mismatch_extreme_tokens:fleet_share_rate5m{pool="bf16"}', "value": 0 / 4},
            {"labels": 'pool:mismatch_extreme_tokens:fleet_share_rate5m{pool="fp8"}', "value": 4 / 4}]},
        {"expr": "pool:mismatch_tokens:fleet_share_rate5m", "eval_time": at, "exp_samples": [
            {"labels": 'pool:mismatch_tokens:fleet_share_rate5m{pool="bf16"}', "value": 200 / 400},
            {"labels": 'pool:mismatch_tokens:fleet_share_rate5m{pool="fp8"}', "value": 200 / 400}]},
        {"expr": f"pool:{HISTOGRAM}:p99_rate5m", "eval_time": at, "exp_samples": [
            {"labels": f'pool:{HISTOGRAM}:p99_rate5m{{pool="fp8"}}', "value": float(bounds[0])}]},
    ]
    return series, tests
