"""Rules on per-token means, tested through token-weighted sums over a window.

A step's mean ``x_i`` over ``n_i`` tokens is a sum ``n_i x_i`` divided by ``n_i``: pooled over
steps, ``X = sum n_i x_i / sum n_i`` is the mean over all their tokens (never a mean of means).
Its noise is estimated from the same window, by the token-weighted scatter of the steps around
it: ``s^2 = sum n_i (x_i - X)^2 / (c - 1) = (sum n_i x_i^2 - X sum n_i x_i) / (c - 1)`` over ``c``
steps, the per-token variance when tokens are independent and larger when steps differ (other
prompts, a moving policy, correlated tokens within a sequence), so the test does not take
correlated tokens for evidence. The approximation, stated: ``(x - X) / se`` is treated as
standard normal although it has a t distribution with ``c - 1`` degrees of freedom and, for k3
(a skewed, non-negative per-token quantity: rho - 1 - lr), a heavier right tail; the rules ask
for at least 20 steps and a large factor besides. The per-token variance of k3 itself would need
sum (rho - 1 - lr)^2, which is not stored.

:class:`MeanRise` (k3 spike): the step's mean against the previous window's pooled mean.
:class:`PooledDrift` (signed mean log ratio): the pooled mean of the last window, this step
included, against zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _positive
from .counts import GUARD_STEPS, INACTIVE
from .promql import Expression, Recording, Scope, duration, number
from .promql import series as _series
from .significance import sequential_sum


_SUMS = ("weighted", "weighted_sq", "trials")


def token_term_max(lr_max: np.ndarray, lr_min: np.ndarray) -> np.ndarray:
    """The largest per-token k3 term ``exp(lr) - 1 - lr`` of a step, from its extreme lr (the
    term grows with |lr| on both sides). Since ``0 <= d <= d_max``, ``E[d^2] <= d_max E[d]``: a
    step's own per-token variance of k3 is at most ``d_max x``, the bound a step carried by one
    outlying token needs (the window's scatter does not see that token)."""
    with np.errstate(all="ignore"):
        high, low = np.exp(lr_max) - 1 - lr_max, np.exp(lr_min) - 1 - lr_min
        return np.where(high >= low, high, low)


def token_term_max_promql(lr_max: str, lr_min: str) -> str:
    """:func:`token_term_max` in PromQL (same operations; ``or`` fills where high < low)."""
    return f"(exp({lr_max}) - 1 - {lr_max} >= exp({lr_min}) - 1 - {lr_min}) or (exp({lr_min}) - 1 - {lr_min})"


def _check(window_steps: int, min_points: int) -> None:
    if not (isinstance(window_steps, int) and window_steps >= 3):
        raise ValueError(f"expected integer window_steps >= 3, got {window_steps!r}")
    if not (isinstance(min_points, int) and 3 <= min_points <= window_steps):
        raise ValueError(f"expected integer 3 <= min_points <= window_steps, got {min_points!r}")


@dataclass(frozen=True)
class _Weighted:
    """Shared: the recorded per-step series ``n x``, ``n x^2`` and ``n`` of a mean metric."""

    mean: str
    total: str

    def names(self, scope: Scope, window_steps: int, span: str = "prior") -> dict[str, str]:
        """Recording names; ``span``: ``prior`` (the previous steps), ``last`` (this one included)
        or ``before_W`` (the steps before the last ``W``)."""
        base = f"{scope}:{prometheus_name(self.mean)}"
        w = f"{span}_{window_steps}_steps" + (f"_guard_{GUARD_STEPS}" if span == "prior" else "")
        return {"weighted": f"{base}:weighted", "weighted_sq": f"{base}:weighted_sq", "trials": f"{base}:trials",
                "pooled": f"{base}:pooled_{w}", "scatter": f"{base}:scatter_{w}", "tokens": f"{base}:tokens_{w}",
                "steps": f"{base}:steps_{w}"}

    def derived(self, now: Snapshot) -> dict[str, np.ndarray]:
        n = self.names("pool", 0)
        x, total = now.get(self.mean), now.get(self.total)
        with np.errstate(all="ignore"):
            return {n["weighted"]: x * total, n["weighted_sq"]: x * total * x,
                    n["trials"]: np.where(np.isnan(x), np.nan, total)}

    def recordings(self, scope: Scope, window_steps: int, window: str, span: str) -> tuple[Recording, ...]:
        """The window's sums read the copies kept while the alert is inactive, except ``last``."""
        x, total = _series(self.mean, scope), _series(self.total, scope)
        n = self.names(scope, window_steps, span)
        src = {k: n[k] + (INACTIVE if span != "last" else "") for k in _SUMS}
        S, Q = f"sum_over_time({src['weighted']}{window})", f"sum_over_time({src['weighted_sq']}{window})"
        return (Recording(n["weighted"], f"{x} * {total}"),
                Recording(n["weighted_sq"], f"{x} * {total} * {x}"),
                Recording(n["trials"], f"{total} and {x}"),
                Recording(n["tokens"], f"sum_over_time({src['trials']}{window})"),
                Recording(n["steps"], f"count_over_time({src['trials']}{window})"),
                Recording(n["pooled"], f"{S} / {n['tokens']}"),
                Recording(n["scatter"], f"clamp_min({Q} - {n['pooled']} * {S}, 0) / ({n['steps']} - 1)"))

    def pooled(self, values: dict[str, list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per pool: pooled mean, token-weighted scatter, tokens and steps of the window."""
        S = np.array([sequential_sum(p) for p in values["weighted"]])
        Q = np.array([sequential_sum(p) for p in values["weighted_sq"]])
        N = np.array([sequential_sum(p) for p in values["trials"]])
        c = np.array([len(p) for p in values["trials"]], dtype=np.float64)
        with np.errstate(all="ignore"):
            X = S / N
            return X, np.maximum(Q - X * S, 0.0) / (c - 1), N, c


class _OnWeighted:
    """What both pooled-mean conditions read: a per-step mean and its token total (``mean``,
    ``total`` fields of the dataclass), folded into weighted sums by :class:`_Weighted`."""

    mean: str
    total: str

    @property
    def _w(self) -> _Weighted:
        return _Weighted(self.mean, self.total)

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.mean, self.total)

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        return self._w.derived(now)


@dataclass(frozen=True)
class MeanRise(_OnWeighted):
    """``x / X > factor`` and ``(x - X) / se > z`` with ``X``, ``s^2`` and ``N`` pooled over the
    previous ``window_steps`` steps (at least ``min_points``), ``se^2 = s^2 (1/n + 1/N)``, plus
    ``d_max x / n`` where ``lr_max``/``lr_min`` are given (k3: the step's own per-token variance
    bound, :func:`token_term_max`); value ``x / X``."""

    mean: str
    total: str
    factor: float
    z: float
    window_steps: int
    min_points: int
    lr_max: str | None = None
    lr_min: str | None = None

    def __post_init__(self) -> None:
        for key in (self.mean, self.total) + self._extremes:
            _check_metric(key)
        if (self.lr_max is None) != (self.lr_min is None):
            raise ValueError(f"expected both lr_max and lr_min or neither, got {self.lr_max!r}, {self.lr_min!r}")
        _positive("factor", self.factor)
        _positive("z", self.z)
        _check(self.window_steps, self.min_points)

    @property
    def _extremes(self) -> tuple[str, ...]:
        return () if self.lr_max is None or self.lr_min is None else (self.lr_max, self.lr_min)

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.mean, self.total) + self._extremes

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def windows(self) -> dict[str, int]:
        n = self._w.names("pool", self.window_steps)
        return {n[k] + INACTIVE: self.window_steps + GUARD_STEPS for k in _SUMS}

    def explain(self) -> str:
        own = ", plus the step's own token variance bound" if self._extremes else ""
        return (f"`{self.mean}` > {self.factor:g} x its token-weighted mean over {self.window_steps} steps before the "
                f"last {GUARD_STEPS} (at least {self.min_points}), z > {self.z:g} against their token-weighted "
                f"scatter{own}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        x, total = _series(self.mean, scope), _series(self.total, scope)
        n = self._w.names(scope, self.window_steps)
        window = (f"[{duration((self.window_steps - 0.5) * step_seconds)}] "
                  f"offset {duration((GUARD_STEPS + 1) * step_seconds)}")
        recordings = self._w.recordings(scope, self.window_steps, window, "prior")
        own = ""
        if self._extremes:
            bound = f"{scope}:{prometheus_name(self.mean)}:token_term_max"
            recordings += (Recording(bound, token_term_max_promql(*(_series(k, scope) for k in self._extremes))),)
            own = f" + {bound} * {x} / {total}"
        se = f"sqrt({n['scatter']} * (1 / {total} + 1 / {n['tokens']}){own})"
        return Expression(
            f"{x} / {n['pooled']} > {number(self.factor)} and ({x} - {n['pooled']}) / {se} > {number(self.z)} "
            f"and {n['steps']} >= {self.min_points}",
            recordings,
            statistic=f"{x} / {n['pooled']}",
            clear=f"({number(self.factor)} * {n['pooled']} - {x}) / {se} > {number(self.z)}")

    def _parts(self, now: Snapshot, past: Past, scope: Scope, step: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        names = self._w.names("pool", self.window_steps)
        prior = {k: past.prior(names[k] + INACTIVE, scope, now.pools, step - GUARD_STEPS, self.window_steps)
                 for k in _SUMS}
        X, s2, N, c = self._w.pooled(prior)
        x, n = now.get(self.mean), now.get(self.total)
        with np.errstate(all="ignore"):
            var = s2 * (1 / n + 1 / N)
            if self._extremes:
                var = var + token_term_max(*(now.get(k) for k in self._extremes)) * x / n
            se = np.sqrt(var)
        return x, X, se, c

    excludes_active = True   # a step enters the baseline only while the alert is inactive

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, X, se, c = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            ratio = x / X
            hit = (ratio > self.factor) & ((x - X) / se > self.z) & (c >= self.min_points)
        return np.where(hit, ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        x, X, _, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return x / X

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """The mean is significantly *below* ``factor x`` the baseline (same z)."""
        x, X, se, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return (self.factor * X - x) / se > self.z

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Observed pools where a rise by ``factor`` would not be significant at this size."""
        x, X, se, c = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            powerless = ~((self.factor - 1) * X / se > self.z)
        return ~np.isnan(x) & ((c < self.min_points) | powerless)
