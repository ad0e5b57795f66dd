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

__all__ = ["Compare", "GrowthOverBaseline", "MeanAwayFromZero", "Condition", "Snapshot",
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
    """``metric > threshold`` (or ``<``); the alert's value is the metric. With ``unless``, not
    where that metric is above ``unless_above`` at the same step (another cause that explains the
    value: PromQL ``unless`` on the pool's series; a missing or NaN value explains nothing)."""

    metric: str
    op: Literal[">", "<"]
    threshold: float
    unless: str = ""
    unless_above: float = 0.0
    clear_at: float | None = None   # a firing alert stays until the metric is at or past it (hysteresis)

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if self.op not in (">", "<"):
            raise ValueError(f"expected op '>' or '<', got {self.op!r}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"expected a finite threshold, got {self.threshold}")
        if self.unless:
            _check_metric(self.unless)
        if not math.isfinite(self.unless_above):
            raise ValueError(f"expected a finite unless_above, got {self.unless_above}")
        if self.clear_at is not None and not (math.isfinite(self.clear_at) and (
                self.clear_at < self.threshold if self.op == ">" else self.clear_at > self.threshold)):
            raise ValueError(f"expected a finite clear_at on the healthy side of {self.threshold}, got {self.clear_at}")

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, self.unless) if self.unless else (self.metric,)

    @property
    def windows(self) -> dict[str, int]:
        return {}

    def explain(self) -> str:
        out = f"`{self.metric}` {self.op} {self.threshold:g}"
        out += f", unless `{self.unless}` > {self.unless_above:g}" if self.unless else ""
        return out + (f"; stays until {'<=' if self.op == '>' else '>='} {self.clear_at:g}"
                      if self.clear_at is not None else "")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        series = _series(self.metric, scope)
        expr = f"{series} {self.op} {number(self.threshold)}"
        if self.unless:
            expr += f" unless {_series(self.unless, scope)} > {number(self.unless_above)}"
        if self.clear_at is None:
            return Expression(expr)
        return Expression(expr, statistic=series, clear=f"{series} {'<=' if self.op == '>' else '>='} "
                                                        f"{number(self.clear_at)}")

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x = now.get(self.metric)
        with np.errstate(all="ignore"):
            hit = x > self.threshold if self.op == ">" else x < self.threshold
            if self.unless:
                hit &= ~(now.get(self.unless) > self.unless_above)
        return np.where(hit, x, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        return now.get(self.metric)

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Where a firing alert resolves: everywhere without ``clear_at`` (no hysteresis)."""
        x = now.get(self.metric)
        if self.clear_at is None:
            return np.ones(len(x), dtype=bool)
        with np.errstate(all="ignore"):
            return x <= self.clear_at if self.op == ">" else x >= self.clear_at


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



Condition = Compare | GrowthOverBaseline | MeanAwayFromZero
