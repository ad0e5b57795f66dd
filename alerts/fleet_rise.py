"""A pool that rose more than the fleet did: each pool against its own baseline, and that rise
against the median rise over pools.

Each pool's baseline is its token-weighted pooled mean over the ``window_steps`` steps before
the last ``GUARD_STEPS`` (steps while the alert was inactive), with the steps' token-weighted
scatter as its noise (:mod:`.pooled`): ``B = sum n x / N`` and ``s^2 = (sum n x^2 - B sum n x) /
(c - 1)``. Its rise at a step is ``x / B``; the fleet's rise ``f`` is the median of the rises over
pools (at least ``min_pools``, each with at least ``min_points`` baseline steps), so a change
every pool sees (the policy sharpening, a new prompt mix) is the fleet's, not one pool's. ``f``
is a rise, never a fall (``max(median, 1)``): a step on which most pools happen to sit below
their baselines does not shrink the others' expected level and noise (k3 is skewed: on a clean
dense ``stable_fleet``, seed 0, the median rise is under 1 on 80% of the steps, down to 0.26, and
a one-prompt pool's ordinary excursion read as 4.95x "the fleet's" rise at step 71). A pool
is expected at ``E = f B`` with ``se^2 = f^2 s^2 (1/n + 1/N)`` (the noise scales with the level),
plus ``d_max x / n`` where ``lr_max``/``lr_min`` are given (the step's own per-token variance
bound of :func:`.pooled.token_term_max`; loose where a pool's tail is heavy, so the default rule
leaves it out and asks for the rise on three steps in a row instead: one outlying token is not a
rise). It holds where ``x / E > factor``, ``(x - E) / se > z`` and ``x > floor``, and clears
where ``(factor E - x) / se > z``.

A pool that is worse by design (its precision) is at its own baseline and never fires; one whose
mismatch moved away from the fleet's does, whatever the other pools' levels. Approximations,
stated: ``f`` is taken as known (the median of several pools' rises), and ``(x - E) / se`` is
read as standard normal although the scatter has ``c - 1`` degrees of freedom and k3 a heavier
right tail (hence ``min_points``, a factor and a held ``for`` besides).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _non_negative, _positive
from .counts import GUARD_STEPS, INACTIVE
from .pooled import token_term_max, token_term_max_promql
from .promql import Expression, Recording, Scope, duration, number, prom_quantile
from .promql import series as _series
from .significance import sequential_sum

_SUMS = ("weighted", "weighted_sq", "trials")


@dataclass(frozen=True)
class RiseAgainstFleet:
    """``x / (f B) > factor`` and ``(x - f B) / se > z`` (see the module); value ``x / (f B)``."""

    metric: str
    total: str
    factor: float
    z: float
    min_pools: int
    floor: float
    window_steps: int
    min_points: int
    lr_max: str | None = None
    lr_min: str | None = None

    def __post_init__(self) -> None:
        for key in self.metrics:
            _check_metric(key)
        if (self.lr_max is None) != (self.lr_min is None):
            raise ValueError(f"expected both lr_max and lr_min or neither, got {self.lr_max!r}, {self.lr_min!r}")
        _positive("factor", self.factor)
        _positive("z", self.z)
        _non_negative("floor", self.floor)
        if not (isinstance(self.min_pools, int) and self.min_pools >= 2):
            raise ValueError(f"expected integer min_pools >= 2, got {self.min_pools!r}")
        if not (isinstance(self.window_steps, int) and self.window_steps >= 3):
            raise ValueError(f"expected integer window_steps >= 3, got {self.window_steps!r}")
        if not (isinstance(self.min_points, int) and 3 <= self.min_points <= self.window_steps):
            raise ValueError(f"expected integer 3 <= min_points <= window_steps, got {self.min_points!r}")

    excludes_active = True   # a step enters the baseline only while the alert is inactive

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, self.total) + self._extremes

    @property
    def _extremes(self) -> tuple[str, ...]:
        return () if self.lr_max is None or self.lr_min is None else (self.lr_max, self.lr_min)

    @property
    def threshold(self) -> float:
        return self.factor

    def _names(self, scope: Scope = "pool") -> dict[str, str]:
        base = f"{scope}:{prometheus_name(self.metric)}:outlier"
        fleet = f"fleet:{prometheus_name(self.metric)}:outlier"
        w = f"prior_{self.window_steps}_steps_guard_{GUARD_STEPS}"
        return {"weighted": f"{base}_weighted", "weighted_sq": f"{base}_weighted_sq", "trials": f"{base}_trials",
                "pooled": f"{base}_pooled_{w}", "scatter": f"{base}_scatter_{w}", "tokens": f"{base}_tokens_{w}",
                "steps": f"{base}_steps_{w}", "rise": f"{base}_rise", "median": f"{fleet}_median_rise",
                "count": f"{fleet}_rises_reporting", "expected": f"{base}_expected", "se": f"{base}_se"}

    @property
    def windows(self) -> dict[str, int]:
        n = self._names()
        return {n[k] + INACTIVE: self.window_steps + GUARD_STEPS for k in _SUMS}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        n = self._names()
        x, total = now.get(self.metric), now.get(self.total)
        with np.errstate(all="ignore"):
            return {n["weighted"]: x * total, n["weighted_sq"]: x * total * x,
                    n["trials"]: np.where(np.isnan(x), np.nan, total)}

    def explain(self) -> str:
        own = ", plus the step's own token variance bound" if self._extremes else ""
        return (f"`{self.metric}` > {self.factor:g} x its token-weighted mean over {self.window_steps} steps before "
                f"the last {GUARD_STEPS} (at least {self.min_points}) times the median of that rise over pools (at "
                f"least {self.min_pools}), z > {self.z:g} against their token-weighted scatter"
                f"{own}, and > {self.floor:g}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        if scope != "pool":
            raise ValueError(f"expected scope 'pool' for a rise against the fleet, got {scope!r}")
        x, total = _series(self.metric, scope), _series(self.total, scope)
        n = self._names(scope)
        window = (f"[{duration((self.window_steps - 0.5) * step_seconds)}] "
                  f"offset {duration((GUARD_STEPS + 1) * step_seconds)}")
        S, Q = (f"sum_over_time({n[k]}{INACTIVE}{window})" for k in ("weighted", "weighted_sq"))
        bound = f"{scope}:{prometheus_name(self.metric)}:token_term_max"
        B, f = n["pooled"], n["median"]
        recordings = (
            Recording(n["weighted"], f"{x} * {total}"),
            Recording(n["weighted_sq"], f"{x} * {total} * {x}"),
            Recording(n["trials"], f"{total} and {x}"),
            Recording(n["tokens"], f"sum_over_time({n['trials']}{INACTIVE}{window})"),
            Recording(n["steps"], f"count_over_time({n['trials']}{INACTIVE}{window})"),
            Recording(B, f"{S} / {n['tokens']}"),
            Recording(n["scatter"], f"clamp_min({Q} - {B} * {S}, 0) / ({n['steps']} - 1)"),
            # NaN (0 / 0) is no rise: ``>= 0`` drops it, as the evaluator does
            Recording(n["rise"], f"{x} / {B} >= 0 and {n['steps']} >= {self.min_points}"),
            Recording(f, f"clamp_min(quantile(0.5, {n['rise']}), 1)"),   # a rise, never a fall
            Recording(n["count"], f"count({n['rise']})"),
            Recording(n["expected"], f"{B} * on() group_left() {f} and on() {n['count']} >= {self.min_pools}"),
        )
        own = ""
        if self._extremes:
            recordings += (Recording(bound, token_term_max_promql(*(_series(k, scope) for k in self._extremes))),)
            own = f" + {bound} * {x} / {total}"
        recordings += (Recording(n["se"], f"sqrt({n['expected']} / {B} * ({n['expected']} / {B}) * {n['scatter']} "
                                          f"* (1 / {total} + 1 / {n['tokens']}){own})"),)
        E, se = n["expected"], n["se"]
        return Expression(
            f"{x} / {E} > {number(self.factor)} and ({x} - {E}) / {se} > {number(self.z)} "
            f"and {x} > {number(self.floor)} and {n['steps']} >= {self.min_points}",
            recordings,
            statistic=f"{x} / {E}",
            clear=f"({number(self.factor)} * {E} - {x}) / {se} > {number(self.z)}")

    def _parts(self, now: Snapshot, past: Past, scope: Scope, step: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        names = self._names()
        prior = {k: past.prior(names[k] + INACTIVE, scope, now.pools, step - GUARD_STEPS, self.window_steps)
                 for k in _SUMS}
        S = np.array([sequential_sum(p) for p in prior["weighted"]])
        Q = np.array([sequential_sum(p) for p in prior["weighted_sq"]])
        N = np.array([sequential_sum(p) for p in prior["trials"]])
        c = np.array([len(p) for p in prior["trials"]], dtype=np.float64)
        x, n = now.get(self.metric), now.get(self.total)
        with np.errstate(all="ignore"):
            B = np.where(c > 0, S / N, np.nan)
            s2 = np.maximum(Q - B * S, 0.0) / (c - 1)
            rise = x / B
            rise = rise[(rise >= 0) & (c >= self.min_points)]
            # max(NaN, 1.0) is NaN, as Go's math.Max under clamp_min: no rise is still no rise
            f = max(prom_quantile(0.5, rise), 1.0) if rise.size >= self.min_pools else np.nan
            E = B * f
            var = E / B * (E / B) * s2 * (1 / n + 1 / N)
            if self._extremes:
                var = var + token_term_max(*(now.get(k) for k in self._extremes)) * x / n
            se = np.sqrt(var)
        return x, E, se, c

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, E, se, c = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            ratio = x / E
            hit = ((ratio > self.factor) & ((x - E) / se > self.z) & (x > self.floor) & (c >= self.min_points))
        return np.where(hit, ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, E, _, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return x / E

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """The pool is significantly *below* ``factor x`` its expected multiple (same z)."""
        x, E, se, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return (self.factor * E - x) / se > self.z

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Observed pools where a rise by ``factor`` would not be significant at this size."""
        x, E, se, c = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            powerless = ~((self.factor - 1) * E / se > self.z)
        return ~np.isnan(x) & ((c < self.min_points) | powerless)
