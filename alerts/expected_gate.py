"""A gate that needs no history: a pool far above its expected healthy level (``expected_levels.csv``).

Every relative rule needs earlier steps (``MismatchStepJump`` one, the others ten or more), so a
pool that is broken from its first step (wrong weights loaded, a precision far below the one it
claims) is judged by nothing. :class:`AboveExpected` compares a step with the level a healthy
pool of its precision and engine has (``mismatch_expected_level`` in Prometheus, served by the
exporter given the pools' metadata; the evaluator's ``pools`` in-process): it holds where the
step's p90 |lr| is more than ``factor`` times the expected p99 *and* the tokens above that edge
are too many for a healthy pool. A healthy pool has about 1% of its tokens above its expected
p99 and fewer above ``factor`` times it; a p90 above the edge puts at least
``b = n - ceil(0.9 n) + 1`` of the step's ``n`` tokens above it, tested against
Binomial(n, 0.01) through the Poisson bound (:mod:`.significance`; it errs on the quiet side).
A pool too small for ``b`` to pass (about 25 tokens and fewer) is "not enough tokens". Where the
pool has no level (no metadata, or no row for its precision and engine), the gate says nothing.

The value is the step's p90 as a multiple of the expected p99. A firing alert stays firing while
that value is observed and not below ``sqrt(factor)`` (hysteresis, as ``MismatchStepJump``'s):
a pool that stays broken and dips under ``factor`` for a step is one firing, not several.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mismatch_monitor.expected_series import EXPECTED_LEVEL, level_label

from .conditions import Past, Snapshot, _check_metric, _positive
from .promql import Expression, Scope, number
from .promql import series as _series
from .significance import poisson_z, poisson_z_promql

LEVEL_PREFIX = "expected:"


def level_key(metric: str) -> str:
    """The snapshot key under which the evaluator passes a metric's expected level per pool."""
    return LEVEL_PREFIX + metric


@dataclass(frozen=True)
class AboveExpected:
    """``quantile / level(edge) > factor`` and the Poisson z of the tokens above ``factor x
    level`` against ``n x share`` above ``z``; ``quantile`` is the step's ``1 - share_above``
    quantile's neighbour below (p90), ``edge`` the metric whose expected level is read (p99)."""

    quantile: str          # the step's p90 |lr|
    edge: str              # the metric whose expected level the gate reads (p99 |lr|)
    total: str
    factor: float
    z: float
    healthy_share: float = 0.01   # share of a healthy pool's tokens above its expected ``edge``
    quantile_level: float = 0.9   # ``quantile`` is this quantile (nearest rank)

    def __post_init__(self) -> None:
        for key in (self.quantile, self.edge, self.total):
            _check_metric(key)
        _positive("factor", self.factor)
        if not self.factor >= 1:
            raise ValueError(f"expected factor >= 1, got {self.factor}")
        _positive("z", self.z)
        if not 0 < self.healthy_share < 1 - self.quantile_level:
            raise ValueError(f"expected 0 < healthy_share < {1 - self.quantile_level:g}, got {self.healthy_share}")

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.quantile, self.total)

    @property
    def windows(self) -> dict[str, int]:
        return {}

    @property
    def levels(self) -> tuple[str, ...]:
        """The metrics whose expected levels the evaluator must pass (:func:`level_key`)."""
        return (self.edge,)

    def explain(self) -> str:
        return (f"`{self.quantile}` > {self.factor:g} x the pool's expected healthy `{self.edge}` "
                f"(`expected_levels.csv` by precision and engine; no history needed), with the tokens above "
                f"that edge significant against Binomial(n, {self.healthy_share:g}) (Poisson z > {self.z:g}); "
                f"clears below {math.sqrt(self.factor):.3g} x")

    def _above(self, n):
        tenths = round(self.quantile_level * 10)
        return n - np.ceil(tenths * n / 10) + 1

    def _above_promql(self, n: str) -> str:
        return f"({n} - ceil({round(self.quantile_level * 10)} * {n} / 10) + 1)"

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        x, n = _series(self.quantile, scope), _series(self.total, scope)
        level = f'on(pool) group_left() {EXPECTED_LEVEL}{{metric="{level_label(self.edge)}"}}'
        above = self._above_promql(n)
        lam = f"{n} * {number(self.healthy_share)}"
        return Expression(f"{x} / {level} > {number(self.factor)} "
                          f"and {poisson_z_promql(above, lam)} > {number(self.z)}",
                          statistic=f"{x} / {level}", clear=f"{x} / {level} < {number(math.sqrt(self.factor))}")

    def _parts(self, now: Snapshot) -> tuple[np.ndarray, np.ndarray]:
        x, n, level = now.get(self.quantile), now.get(self.total), now.get(level_key(self.edge))
        with np.errstate(all="ignore"):
            return x / level, poisson_z(self._above(n), n * self.healthy_share)

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        ratio, z = self._parts(now)
        with np.errstate(all="ignore"):
            return np.where((ratio > self.factor) & (z > self.z), ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        return self._parts(now)[0]

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self.statistic(now, past, scope, step) < math.sqrt(self.factor)

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Observed pools with a level whose size could not make the token test pass."""
        ratio, z = self._parts(now)
        return ~np.isnan(ratio) & ~(z > self.z)
