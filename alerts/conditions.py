"""Alert conditions: each kind defines its PromQL and its in-process evaluation side by side.

A condition reads metric values of one step (per pool, or for the fleet) and, for trailing
baselines, the values of earlier steps. ``evaluate`` returns, per pool, the value the alert
reports where the condition holds and NaN where it does not; ``promql`` returns the expression
Prometheus evaluates (plus the recording rules it reads), with the same meaning when one
training step is one evaluation interval of ``step_seconds``:

* a missing or NaN value (an empty slice) is "no sample" on both sides, so it never fires;
* a trailing window of ``W`` steps is the ``W`` steps *before* the current one: in PromQL the
  range ``[(W - 0.5) * step] offset step`` (Prometheus 2.x ranges include both ends);
* medians interpolate as PromQL's ``quantile`` does (:func:`.promql.prom_quantile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Protocol, Sequence

import numpy as np

from mismatch_monitor.metrics import METRIC_BY_KEY, prometheus_name

from .promql import Expression, Recording, Scope, duration, number, prom_quantile
from .promql import series as _series

__all__ = ["Compare", "GrowthOverBaseline", "MeanAwayFromZero", "OutlierAmongPools", "Condition", "Snapshot",
           "Past", "Scope"]


@dataclass(frozen=True)
class Snapshot:
    """One step's values: ``pools[i]`` has ``values[key][i]`` (NaN = no observation)."""

    pools: tuple[str, ...]
    values: Mapping[str, np.ndarray]

    def get(self, key: str) -> np.ndarray:
        return self.values.get(key, np.full(len(self.pools), np.nan))


class Past(Protocol):
    def prior(self, key: str, scope: Scope, pools: Sequence[str], step: int, window: int) -> list[np.ndarray]:
        """Per pool, the non-NaN values of ``key`` at steps ``step - window .. step - 1``."""


def _check_metric(key: str) -> None:
    if key not in METRIC_BY_KEY:
        raise ValueError(f"expected a metric key of mismatch_monitor.metrics.METRICS, got {key!r}")


def _non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected {name} >= 0, got {value}")


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected {name} > 0, got {value}")


@dataclass(frozen=True)
class Compare:
    """``metric > threshold`` (or ``<``); the alert's value is the metric."""

    metric: str
    op: Literal[">", "<"]
    threshold: float

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if self.op not in (">", "<"):
            raise ValueError(f"expected op '>' or '<', got {self.op!r}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"expected a finite threshold, got {self.threshold}")

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def windows(self) -> dict[str, int]:
        return {}

    def explain(self) -> str:
        return f"`{self.metric}` {self.op} {self.threshold:g}"

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        return Expression(f"{_series(self.metric, scope)} {self.op} {number(self.threshold)}")

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x = now.get(self.metric)
        with np.errstate(all="ignore"):
            hit = x > self.threshold if self.op == ">" else x < self.threshold
        return np.where(hit, x, np.nan)


@dataclass(frozen=True)
class GrowthOverBaseline:
    """``metric / median(metric over the previous window_steps) > factor``, with
    ``metric > floor`` and at least ``min_points`` earlier values; the value is the ratio."""

    metric: str
    factor: float
    window_steps: int
    min_points: int
    floor: float

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        _positive("factor", self.factor)
        if not (isinstance(self.window_steps, int) and self.window_steps >= 1):
            raise ValueError(f"expected integer window_steps >= 1, got {self.window_steps!r}")
        if not (isinstance(self.min_points, int) and 1 <= self.min_points <= self.window_steps):
            raise ValueError(f"expected integer 1 <= min_points <= window_steps, got {self.min_points!r}")
        _non_negative("floor", self.floor)

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def windows(self) -> dict[str, int]:
        return {self.metric: self.window_steps}

    def explain(self) -> str:
        return (f"`{self.metric}` > {self.factor:g} x its median over the previous {self.window_steps} "
                f"steps (at least {self.min_points} values), and > {self.floor:g}")

    def _names(self, scope: Scope) -> tuple[str, str]:
        base = f"{scope}:{prometheus_name(self.metric)}"
        return f"{base}:median_prior_{self.window_steps}_steps", f"{base}:count_prior_{self.window_steps}_steps"

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        series = _series(self.metric, scope)
        window = f"[{duration((self.window_steps - 0.5) * step_seconds)}] offset {duration(step_seconds)}"
        median, count = self._names(scope)
        return Expression(
            f"{series} / {median} > {number(self.factor)} and {series} > {number(self.floor)} "
            f"and {count} >= {self.min_points}",
            (Recording(median, f"quantile_over_time(0.5, {series}{window})"),
             Recording(count, f"count_over_time({series}{window})")))

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x = now.get(self.metric)
        prior = past.prior(self.metric, scope, now.pools, step, self.window_steps)
        base = np.array([prom_quantile(0.5, p) for p in prior], dtype=np.float64)
        count = np.array([len(p) for p in prior])
        with np.errstate(all="ignore"):
            ratio = x / base
            hit = (ratio > self.factor) & (x > self.floor) & (count >= self.min_points)
        return np.where(hit, ratio, np.nan)


@dataclass(frozen=True)
class MeanAwayFromZero:
    """``|mean| / std_error > z`` and ``|mean| > floor``: a signed bias larger than its noise;
    the value is the z-score. Held for ``for_steps`` it is drift, not a noisy step."""

    mean: str
    std_error: str
    z: float
    floor: float

    def __post_init__(self) -> None:
        _check_metric(self.mean)
        _check_metric(self.std_error)
        _positive("z", self.z)
        _non_negative("floor", self.floor)

    @property
    def threshold(self) -> float:
        return self.z

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.mean, self.std_error)

    @property
    def windows(self) -> dict[str, int]:
        return {}

    def explain(self) -> str:
        return f"\\|`{self.mean}`\\| > {self.z:g} x `{self.std_error}`, and > {self.floor:g}"

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        mean = f"abs({_series(self.mean, scope)})"
        return Expression(f"{mean} / {_series(self.std_error, scope)} > {number(self.z)} "
                          f"and {mean} > {number(self.floor)}")

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        mean = np.abs(now.get(self.mean))
        with np.errstate(all="ignore"):
            z = mean / now.get(self.std_error)
            hit = (z > self.z) & (mean > self.floor)
        return np.where(hit, z, np.nan)


@dataclass(frozen=True)
class OutlierAmongPools:
    """A pool's ``metric / median over pools > factor`` (at least ``min_pools`` reporting, and
    ``metric > floor``); the value is the ratio to the fleet median. With ``window_steps``, the
    pool is also compared with itself: the ratio must exceed ``factor`` x max(1, the median of
    its own ratios over the previous ``window_steps`` steps, at least ``min_points`` of them), so
    a pool that is worse by design (its precision) is described by its baseline, not re-alerted."""

    metric: str
    factor: float
    min_pools: int
    floor: float
    window_steps: int = 0
    min_points: int = 1

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        _positive("factor", self.factor)
        if not (isinstance(self.min_pools, int) and self.min_pools >= 2):
            raise ValueError(f"expected integer min_pools >= 2, got {self.min_pools!r}")
        _non_negative("floor", self.floor)
        if not (isinstance(self.window_steps, int) and self.window_steps >= 0):
            raise ValueError(f"expected integer window_steps >= 0, got {self.window_steps!r}")
        if self.window_steps and not (isinstance(self.min_points, int) and 1 <= self.min_points <= self.window_steps):
            raise ValueError(f"expected integer 1 <= min_points <= window_steps, got {self.min_points!r}")

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def excludes_active(self) -> bool:
        """Its own-ratio baseline takes steps only while the alert is inactive."""
        return bool(self.window_steps)

    @property
    def _ratio_name(self) -> str:
        return f"pool:{prometheus_name(self.metric)}:ratio_to_pool_median"

    @property
    def windows(self) -> dict[str, int]:
        return {self._ratio_name + ":while_inactive": self.window_steps} if self.window_steps else {}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        """Each pool's ratio to the median over pools (recorded where enough pools report)."""
        return {self._ratio_name: self._ratio(now.get(self.metric))} if self.window_steps else {}

    def _ratio(self, x: np.ndarray) -> np.ndarray:
        reporting = x[~np.isnan(x)]
        if reporting.size < self.min_pools:
            return np.full(x.shape, np.nan)
        with np.errstate(all="ignore"):
            return x / prom_quantile(0.5, reporting)

    def explain(self) -> str:
        own = (f" and > {self.factor:g} x max(1, its own median ratio over the previous {self.window_steps} steps, "
               f"at least {self.min_points})" if self.window_steps else "")
        return (f"`{self.metric}` > {self.factor:g} x its median over pools (at least {self.min_pools} "
                f"pools){own}, and > {self.floor:g}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        if scope != "pool":
            raise ValueError(f"expected scope 'pool' for an outlier among pools, got {scope!r}")
        series = _series(self.metric, "pool")
        median = f"fleet:{prometheus_name(self.metric)}:median_over_pools"
        count = f"fleet:{prometheus_name(self.metric)}:pools_reporting"
        recordings = (Recording(median, f"quantile(0.5, {series})"), Recording(count, f"count({series})"))
        if not self.window_steps:
            return Expression(
                f"{series} / on() group_left() {median} > {number(self.factor)} "
                f"and {series} > {number(self.floor)} and on() {count} >= {self.min_pools}", recordings)
        ratio = self._ratio_name
        window = f"[{duration((self.window_steps - 0.5) * step_seconds)}] offset {duration(step_seconds)}"
        own = f"{ratio}:median_prior_{self.window_steps}_steps"
        own_count = f"{ratio}:count_prior_{self.window_steps}_steps"
        return Expression(
            f"{ratio} > {number(self.factor)} and {ratio} / clamp_min({own}, 1) > {number(self.factor)} "
            f"and {series} > {number(self.floor)} and {own_count} >= {self.min_points}",
            recordings + (
                Recording(ratio, f"{series} / on() group_left() {median} and on() {count} >= {self.min_pools}"),
                Recording(own, f"quantile_over_time(0.5, {ratio}:while_inactive{window})"),
                Recording(own_count, f"count_over_time({ratio}:while_inactive{window})")))

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x = now.get(self.metric)
        ratio = self._ratio(x)
        with np.errstate(all="ignore"):
            hit = (ratio > self.factor) & (x > self.floor)
            if self.window_steps:
                prior = past.prior(self._ratio_name + ":while_inactive", scope, now.pools, step, self.window_steps)
                own = np.array([prom_quantile(0.5, p) for p in prior], dtype=np.float64)
                count = np.array([len(p) for p in prior])
                hit &= (ratio / np.maximum(own, 1.0) > self.factor) & (count >= self.min_points)
        return np.where(hit, ratio, np.nan)


Condition = Compare | GrowthOverBaseline | MeanAwayFromZero | OutlierAmongPools
