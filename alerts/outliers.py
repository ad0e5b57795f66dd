"""A pool against the fleet: its ratio to the median over pools, and against its own ratios."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _non_negative, _positive
from .promql import Expression, Recording, Scope, duration, number, prom_quantile
from .promql import series as _series


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
