"""The tail rule: p99 |lr| tested through the counts of tokens its quantiles imply.

:class:`TailRise` reads the step's p99 and the baseline window's p99 and p99.9 (the per-step
histograms are not among the values the evaluator receives); the window ends ``GUARD_STEPS``
before the current step and takes steps only while the alert is inactive, as the count rules'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _positive
from .counts import GUARD_STEPS, INACTIVE, _check_window, _window
from .promql import Expression, Recording, Scope, number, prom_quantile
from .promql import series as _series
from .significance import poisson_z, poisson_z_promql


@dataclass(frozen=True)
class TailRise:
    """p99 |lr| of the step above ``factor`` x the median p99 of ``window_steps`` steps before
    the last ``GUARD_STEPS`` *and* above the largest p99.9 among them, where the tokens that p99 puts above that
    edge are significantly more than its 0.1% (Poisson z above ``z``); the value is p99 / median.

    Why this form: the edge ``x0 = max p99.9`` of the window holds at most 0.1% of the baseline's
    pooled tokens (each step has at most 0.1% of its tokens above its own p99.9, nearest rank),
    and a step whose p99 (the ``ceil(0.99 n)``-th smallest) exceeds ``x0`` has at least
    ``m = n - ceil(0.99 n) + 1`` tokens above it, tested against Binomial(n, 0.001). The
    per-step histograms are not among the values the evaluator receives, so the test reads the
    quantiles they produce; p99 and p99.9 are histogram bins, and a p99 in a higher bin than
    ``x0`` lies above it exactly. Pools under about 450 tokens can never pass (undecided)."""

    p99: str
    p999: str
    total: str
    factor: float
    z: float
    window_steps: int
    min_points: int

    def __post_init__(self) -> None:
        for key in (self.p99, self.p999, self.total):
            _check_metric(key)
        _positive("factor", self.factor)
        _positive("z", self.z)
        _check_window(self.window_steps, self.min_points)

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.p99, self.p999, self.total)

    excludes_active = True

    def _baselines(self) -> tuple[str, str]:
        """The recorded copies of p99 and p99.9 the baseline reads (steps while inactive only)."""
        return f"pool:{prometheus_name(self.p99)}:baseline", f"pool:{prometheus_name(self.p999)}:baseline"

    @property
    def windows(self) -> dict[str, int]:
        return {name + INACTIVE: self.window_steps + GUARD_STEPS for name in self._baselines()}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        p99, p999 = self._baselines()
        return {p99: now.get(self.p99), p999: now.get(self.p999)}

    def explain(self) -> str:
        return (f"`{self.p99}` > {self.factor:g} x its median over the {self.window_steps} steps before the "
                f"last {GUARD_STEPS} (at least {self.min_points}) and > their largest `{self.p999}`, with the tokens "
                f"above that edge "
                f"significant against Binomial(n, 0.001) (Poisson z > {self.z:g})")

    def _names(self, scope: Scope) -> tuple[str, str, str]:
        w = f"prior_{self.window_steps}_steps_guard_{GUARD_STEPS}"
        return (f"{scope}:{prometheus_name(self.p99)}:median_{w}", f"{scope}:{prometheus_name(self.p99)}:count_{w}",
                f"{scope}:{prometheus_name(self.p999)}:max_{w}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        p99, p999, n = _series(self.p99, scope), _series(self.p999, scope), _series(self.total, scope)
        median, count, edge = self._names(scope)
        window = _window(self.window_steps, step_seconds)
        above, expected = f"({n} - ceil(99 * {n} / 100) + 1)", f"({n} / 1000)"
        base99, base999 = (name.replace("pool:", f"{scope}:", 1) for name in self._baselines())
        return Expression(
            f"{p99} / {median} > {number(self.factor)} and {p99} > {edge} "
            f"and {poisson_z_promql(above, expected)} > {number(self.z)} and {count} >= {self.min_points}",
            (Recording(base99, p99), Recording(base999, p999),
             Recording(median, f"quantile_over_time(0.5, {base99}{INACTIVE}{window})"),
             Recording(count, f"count_over_time({base99}{INACTIVE}{window})"),
             Recording(edge, f"max_over_time({base999}{INACTIVE}{window})")),
            statistic=f"{p99} / {median}",
            clear=f"{p99} <= {edge} and {p99} / {median} <= {number(self.factor)}")

    def _z(self, now: Snapshot) -> np.ndarray:
        n = now.get(self.total)
        with np.errstate(all="ignore"):
            return poisson_z(n - np.ceil(99 * n / 100) + 1, n / 1000)

    def _parts(self, now: Snapshot, past: Past, scope: Scope, step: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        base99, base999 = self._baselines()
        prior = past.prior(base99 + INACTIVE, scope, now.pools, step - GUARD_STEPS, self.window_steps)
        edges = past.prior(base999 + INACTIVE, scope, now.pools, step - GUARD_STEPS, self.window_steps)
        median = np.array([prom_quantile(0.5, p) for p in prior])
        edge = np.array([p.max() if len(p) else np.nan for p in edges])
        count = np.array([len(p) for p in prior])
        return now.get(self.p99), median, edge, count

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, median, edge, count = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            ratio = x / median
            hit = (ratio > self.factor) & (x > edge) & (self._z(now) > self.z) & (count >= self.min_points)
        return np.where(hit, ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, median, _, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return x / median

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """p99 back at or below the baseline's p99.9 edge and within ``factor`` of its median."""
        x, median, edge, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return (x <= edge) & (x / median <= self.factor)

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, _, _, count = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return ~np.isnan(x) & ((count < self.min_points) | ~(self._z(now) > self.z))
