"""A gate that needs no history: a step change against the previous step.

:class:`StepJump` fires where a pool's value is ``factor`` times its previous step's, from the
second step a pool reports: a weight sync that fails (weights not applied, wrong weights, a
prefix cache not reset) or a resume that loads the wrong checkpoint shows as a jump of 13-25x in
k3 at the step after it, long before any windowed baseline exists. Both evaluators read only
values (no event table), so they agree exactly. It stays firing while the pool stays above
``sqrt(factor)`` x its last value before the jump (the value at the last step its alert was
inactive, at most ``memory_steps`` back), so a fault that persists is one firing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _non_negative, _positive
from .counts import INACTIVE
from .promql import Expression, Recording, Scope, duration, number
from .promql import series as _series


@dataclass(frozen=True)
class StepJump:
    """``x / x(previous step) > factor``, ``x > floor`` and at least ``min_tokens`` of
    ``total`` at both steps; the value is the ratio (to the last value before the jump, while
    firing)."""

    metric: str
    total: str
    factor: float
    floor: float
    min_tokens: float
    memory_steps: int = 50

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        _check_metric(self.total)
        _positive("factor", self.factor)
        if not self.factor > 1:
            raise ValueError(f"expected factor > 1, got {self.factor}")
        _non_negative("floor", self.floor)
        _non_negative("min_tokens", self.min_tokens)
        if not (isinstance(self.memory_steps, int) and self.memory_steps >= 1):
            raise ValueError(f"expected integer memory_steps >= 1, got {self.memory_steps!r}")

    excludes_active = True

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, self.total)

    def _copy(self, scope: Scope = "pool") -> str:
        return f"{scope}:{prometheus_name(self.metric)}:before_jump"

    @property
    def windows(self) -> dict[str, int]:
        return {self._copy() + INACTIVE: self.memory_steps, self.total: 1}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        return {self._copy(): now.get(self.metric)}

    def explain(self) -> str:
        return (f"`{self.metric}` > {self.factor:g} x its value at the previous step, and > {self.floor:g}, "
                f"with at least {self.min_tokens:g} `{self.total}` at both (from the second step)")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        x, n = _series(self.metric, scope), _series(self.total, scope)
        copy = self._copy(scope)
        previous = f"[{duration(0.5 * step_seconds)}] offset {duration(step_seconds)}"
        memory = f"[{duration((self.memory_steps - 0.5) * step_seconds)}] offset {duration(step_seconds)}"
        before = f"last_over_time({copy}{INACTIVE}{memory})"
        return Expression(
            f"{x} / last_over_time({copy}{INACTIVE}{previous}) > {number(self.factor)} "
            f"and {x} > {number(self.floor)} and {n} >= {number(self.min_tokens)} "
            f"and last_over_time({n}{previous}) >= {number(self.min_tokens)}",
            (Recording(copy, x),),
            statistic=f"{x} / {before}",
            clear=f"{x} / {before} < {number(math.sqrt(self.factor))}")

    def _last(self, past: Past, key: str, scope: Scope, pools: tuple[str, ...], step: int, window: int
              ) -> np.ndarray:
        return np.array([p[-1] if len(p) else np.nan for p in past.prior(key, scope, pools, step, window)])

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, n = now.get(self.metric), now.get(self.total)
        previous = self._last(past, self._copy() + INACTIVE, scope, now.pools, step, 1)
        n_previous = self._last(past, self.total, scope, now.pools, step, 1)
        with np.errstate(all="ignore"):
            ratio = x / previous
            hit = ((ratio > self.factor) & (x > self.floor) & (n >= self.min_tokens)
                   & (n_previous >= self.min_tokens))
        return np.where(hit, ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        before = self._last(past, self._copy() + INACTIVE, scope, now.pools, step, self.memory_steps)
        with np.errstate(all="ignore"):
            return now.get(self.metric) / before

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self.statistic(now, past, scope, step) < math.sqrt(self.factor)
