"""The drift rule: the signed mean log ratio of the last steps against the pool's own earlier mean,
through the token-weighted sums of :mod:`.pooled`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .conditions import Past, Snapshot, _check_metric, _non_negative, _positive
from .counts import INACTIVE
from .pooled import _SUMS, _check, _OnWeighted
from .promql import Expression, Scope, duration, number
from .promql import series as _series


@dataclass(frozen=True)
class PooledDrift(_OnWeighted):
    """A change of the signed mean: ``|X - B| / sqrt(s^2 / N + t^2 / M) > z`` and ``|X - B| > floor``,
    with ``X``, ``s^2``, ``N`` pooled over the last ``window_steps`` steps (this one included, at
    least ``min_points``) and ``B``, ``t^2``, ``M`` over the ``baseline_steps`` steps before them
    (steps while the alert was inactive, at least ``min_baseline``); value: the z-score.

    Against the pool's own earlier mean, not zero: a pool whose bias is its precision's (an INT4
    or FP8 sampler) is steadily at its own level and never fires; a bias that appears or grows
    does. A bias present from the first step is that pool's baseline (the k3 and outlier rules
    and its expected level describe it)."""

    mean: str
    total: str
    z: float
    floor: float
    window_steps: int
    min_points: int
    baseline_steps: int = 50
    min_baseline: int = 5

    def __post_init__(self) -> None:
        _check_metric(self.mean)
        _check_metric(self.total)
        _positive("z", self.z)
        _non_negative("floor", self.floor)
        _check(self.window_steps, self.min_points)
        _check(self.baseline_steps, self.min_baseline)

    excludes_active = True   # the baseline takes a step only while the alert is inactive

    @property
    def threshold(self) -> float:
        return self.z

    def _spans(self, scope: Scope) -> tuple[dict[str, str], dict[str, str]]:
        return (self._w.names(scope, self.window_steps, "last"),
                self._w.names(scope, self.baseline_steps, f"before_{self.window_steps}"))

    @property
    def windows(self) -> dict[str, int]:
        recent, base = self._spans("pool")
        return {**{recent[k]: self.window_steps for k in _SUMS},
                **{base[k] + INACTIVE: self.window_steps + self.baseline_steps for k in _SUMS}}

    def explain(self) -> str:
        return (f"\\|token-weighted `{self.mean}` over the last {self.window_steps} steps minus the same over the "
                f"{self.baseline_steps} steps before them\\| > {self.z:g} standard errors (their scatters; at least "
                f"{self.min_points} and {self.min_baseline} steps), and > {self.floor:g}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        recent, base = self._spans(scope)
        last = f"[{duration((self.window_steps - 0.5) * step_seconds)}]"
        before = (f"[{duration((self.baseline_steps - 0.5) * step_seconds)}] "
                  f"offset {duration(self.window_steps * step_seconds)}")
        shift = f"abs({recent['pooled']} - {base['pooled']})"
        se = f"sqrt({recent['scatter']} / {recent['tokens']} + {base['scatter']} / {base['tokens']})"
        return Expression(
            f"{shift} / {se} > {number(self.z)} and {shift} > {number(self.floor)} "
            f"and {recent['steps']} >= {self.min_points} and {base['steps']} >= {self.min_baseline} "
            f"and {_series(self.mean, scope)}",
            self._w.recordings(scope, self.window_steps, last, "last")
            + self._w.recordings(scope, self.baseline_steps, before, f"before_{self.window_steps}"))

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        recent, base = self._spans("pool")
        current = self._w.derived(now)
        values, baseline = {}, {}
        for k in _SUMS:
            prior = past.prior(recent[k], scope, now.pools, step, self.window_steps - 1)
            values[k] = [np.append(p, v) if not np.isnan(v) else p for p, v in zip(prior, current[recent[k]])]
            baseline[k] = past.prior(base[k] + INACTIVE, scope, now.pools, step - self.window_steps + 1,
                                     self.baseline_steps)
        X, s2, N, c = self._w.pooled(values)
        B, t2, M, d = self._w.pooled(baseline)
        with np.errstate(all="ignore"):
            shift = np.abs(X - B)
            z = shift / np.sqrt(s2 / N + t2 / M)
            # observed this step: a pool that stopped reporting is not judged on its past alone
            hit = ((z > self.z) & (shift > self.floor) & (c >= self.min_points) & (d >= self.min_baseline)
                   & ~np.isnan(now.get(self.mean)))
        return np.where(hit, z, np.nan)
