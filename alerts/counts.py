"""Rules that test counts: a step's events against the pooled rate of the trailing window.

:class:`CountRise` (routing flips, extreme-band tokens): the step's count ``k`` of ``n`` trials
against ``p0 = sum k / sum n`` over ``window_steps`` steps before the last ``GUARD_STEPS`` (never a median of
per-step rates: a pool of 40 tokens and one of 40,000 weigh what their trials weigh).
(:class:`.tails.TailRise`, p99 |lr|, tests how many of the step's tokens its p99 puts above the
edge that held at most 0.1% of the baseline's tokens, against Binomial(n, 0.001).)

Each fires only when the rise is both large (``factor``) and significant (Wilson-Hilferty z of
the Poisson tail above ``z``, see :mod:`.significance`). A pool-step whose size could not make
a rise by ``factor`` significant is *undecided* ("not enough tokens"): the evaluator counts it
(:meth:`AlertEvaluator.undecided`, ``coverage.py``); only a rise far above ``factor`` can fire there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.metrics import prometheus_name

from .conditions import Past, Snapshot, _check_metric, _positive
from .promql import Expression, Recording, Scope, duration, number
from .promql import series as _series
from .significance import (poisson_lower_z, poisson_lower_z_promql, poisson_z, poisson_z_promql, rounded,
                           sequential_sum)


# The baseline window ends this many steps before the current one: a fault's first steps (while
# the alert is pending) never enter the baseline it is tested against.
GUARD_STEPS = 2
# A baseline reads a series' copy that records a step only while the rule's alert is inactive
# (render.py adds it as ``<name> unless on(pool) ALERTS{...}``; the evaluator masks the same).
INACTIVE = ":while_inactive"


def _window(window_steps: int, step_seconds: float) -> str:
    return f"[{duration((window_steps - 0.5) * step_seconds)}] offset {duration((GUARD_STEPS + 1) * step_seconds)}"


def _check_window(window_steps: int, min_points: int) -> None:
    if not (isinstance(window_steps, int) and window_steps >= 1):
        raise ValueError(f"expected integer window_steps >= 1, got {window_steps!r}")
    if not (isinstance(min_points, int) and 1 <= min_points <= window_steps):
        raise ValueError(f"expected integer 1 <= min_points <= window_steps, got {min_points!r}")


@dataclass(frozen=True)
class CountRise:
    """``k = round(rate x total)`` events of ``n = total`` trials this step, against
    ``lam = n * max(p0, min_rate)`` with ``p0`` pooled over ``window_steps`` steps before the last
    ``GUARD_STEPS``:
    fires where ``k / lam > factor`` and the Poisson z of ``k`` against ``lam`` is above ``z``;
    the value is ``k / lam``. ``min_rate`` stands in for a baseline rate below it (a baseline
    of zero events cannot make one event a rise)."""

    rate: str            # metric key of the share (flip rate, extreme share)
    total: str           # metric key of its denominator (routing decisions, tokens)
    factor: float
    z: float
    window_steps: int
    min_points: int
    min_rate: float
    clear_steps: int = 10    # the clear test pools the counts of the last clear_steps steps

    def __post_init__(self) -> None:
        if not (isinstance(self.clear_steps, int) and self.clear_steps >= 1):
            raise ValueError(f"expected integer clear_steps >= 1, got {self.clear_steps!r}")
        _check_metric(self.rate)
        _check_metric(self.total)
        _positive("factor", self.factor)
        _positive("z", self.z)
        _positive("min_rate", self.min_rate)
        _check_window(self.window_steps, self.min_points)

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.rate, self.total)

    def _names(self, scope: Scope) -> dict[str, str]:
        base = f"{scope}:{prometheus_name(self.rate)}"
        w = f"prior_{self.window_steps}_steps_guard_{GUARD_STEPS}"
        c = f"last_{self.clear_steps}_steps"
        return {"events": f"{base}:events", "trials": f"{base}:trials", "events_sq": f"{base}:events_sq_per_trial",
                "events_prior": f"{base}:events_{w}", "trials_prior": f"{base}:trials_{w}",
                "events_sq_prior": f"{base}:events_sq_per_trial_{w}", "dispersion": f"{base}:dispersion_{w}",
                "steps_prior": f"{base}:steps_{w}", "expected": f"{base}:expected_{w}",
                "events_last": f"{base}:events_{c}", "expected_last": f"{base}:expected_{c}_at_{w}"}

    @property
    def windows(self) -> dict[str, int]:
        names = self._names("pool")
        w = self.window_steps + GUARD_STEPS
        return {names["events"] + INACTIVE: w, names["trials"] + INACTIVE: w, names["events_sq"] + INACTIVE: w,
                names["events"]: self.clear_steps, names["trials"]: self.clear_steps}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        """The per-step series the baseline sums (the recording rules ``...:events``/``...:trials``)."""
        names = self._names("pool")
        rate, total = now.get(self.rate), now.get(self.total)
        with np.errstate(all="ignore"):
            events = rounded(rate * total)
            return {names["events"]: events, names["trials"]: np.where(np.isnan(rate), np.nan, total),
                    names["events_sq"]: events * events / total}

    def explain(self) -> str:
        return (f"events of `{self.rate}` x `{self.total}` > {self.factor:g} x the rate pooled over the "
                f"{self.window_steps} steps before the last {GUARD_STEPS} (at least {self.min_points}; at least "
                f"{self.min_rate:g}), Poisson z of the counts over the baseline's dispersion > {self.z:g}")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        rate, total = _series(self.rate, scope), _series(self.total, scope)
        n = self._names(scope)
        window = _window(self.window_steps, step_seconds)
        last = f"[{duration((self.clear_steps - 0.5) * step_seconds)}]"
        phi, prior_rate = n["dispersion"], self._rate_promql(n)
        # counts divided by the dispersion: the quasi-Poisson scale of flips that cluster in steps
        events, expected = f"({n['events']} / {phi})", f"({n['expected']} / {phi})"
        events_last, raised = f"({n['events_last']} / {phi})", f"({number(self.factor)} * {n['expected_last']} / {phi})"
        return Expression(
            f"{n['events']} / {n['expected']} > {number(self.factor)} "
            f"and {poisson_z_promql(events, expected)} > {number(self.z)} and {n['steps_prior']} >= {self.min_points}",
            statistic=f"{n['events']} / {n['expected']}",
            clear=f"{poisson_lower_z_promql(events_last, raised)} > {number(self.z)}",
            recordings=(Recording(n["events"], f"round({rate} * {total})"),
                        Recording(n["trials"], f"{total} and {rate}"),
                        Recording(n["events_prior"], f"sum_over_time({n['events']}{INACTIVE}{window})"),
                        Recording(n["trials_prior"], f"sum_over_time({n['trials']}{INACTIVE}{window})"),
                        Recording(n["steps_prior"], f"count_over_time({n['trials']}{INACTIVE}{window})"),
                        Recording(n["events_sq"], f"{n['events']} * {n['events']} / {n['trials']}"),
                        Recording(n["events_sq_prior"], f"sum_over_time({n['events_sq']}{INACTIVE}{window})"),
                        Recording(n["dispersion"],
                                  f"clamp_min(({n['events_sq_prior']} / {prior_rate} - 2 * {n['events_prior']} + "
                                  f"{n['trials_prior']} * {prior_rate}) / ({n['steps_prior']} - 1), 1)"),
                        Recording(n["expected"], f"{n['trials']} * {self._rate_promql(n)}"),
                        Recording(n["events_last"], f"sum_over_time({n['events']}{last})"),
                        Recording(n["expected_last"], f"sum_over_time({n['trials']}{last}) * {self._rate_promql(n)}")))

    def _rate_promql(self, n: dict[str, str]) -> str:
        return f"clamp_min({n['events_prior']} / {n['trials_prior']}, {number(self.min_rate)})"

    def _rate(self, past: Past, scope: Scope, pools: tuple[str, ...], step: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per pool: the baseline rate ``p = max(p0, min_rate)``, the number of baseline steps and
        the dispersion ``phi = max(1, sum (k_i - n_i p)^2 / (n_i p) / (c - 1))``: Pearson's
        chi-square of the baseline's counts per degree of freedom. Flips cluster (a token that
        flips in one layer flips in others, some prompts route near ties), so step counts vary
        more than Poisson; dividing counts by ``phi`` (quasi-Poisson) tests them on the scale of
        their own step-to-step noise, and never below Poisson's."""
        names = self._names("pool")
        K, N, Q = (np.array([sequential_sum(p) for p in past.prior(names[key] + INACTIVE, scope, pools,
                                                                    step - GUARD_STEPS, self.window_steps)])
                   for key in ("events", "trials", "events_sq"))
        count = np.array([len(p) for p in past.prior(names["trials"] + INACTIVE, scope, pools, step - GUARD_STEPS,
                                                     self.window_steps)])
        with np.errstate(all="ignore"):
            rate = np.maximum(np.where(count > 0, K / N, np.nan), self.min_rate)
            return rate, count, np.maximum((Q / rate - 2 * K + N * rate) / (count - 1), 1.0)

    def _parts(self, now: Snapshot, past: Past, scope: Scope, step: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Events and expected events of the step, baseline steps, dispersion."""
        names = self._names("pool")
        current = self.derived(now, scope)
        rate, count, phi = self._rate(past, scope, now.pools, step)
        with np.errstate(all="ignore"):
            expected = current[names["trials"]] * rate
        return current[names["events"]], expected, count, phi

    excludes_active = True   # a step enters the baseline only while the alert is inactive

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        events, expected, count, phi = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            ratio = events / expected
            hit = (ratio > self.factor) & (poisson_z(events / phi, expected / phi) > self.z) & (count >= self.min_points)
        return np.where(hit, ratio, np.nan)

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        events, expected, _, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            return events / expected

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """The events of the last ``clear_steps`` steps are significantly *below* ``factor`` x
        what the baseline rate expects of their trials (lower Poisson tail, the same z): a pool
        too small to show that in one step shows it over several."""
        names = self._names("pool")
        current = self.derived(now, scope)
        sums = {}
        for key in ("events", "trials"):
            prior = past.prior(names[key], scope, now.pools, step, self.clear_steps - 1)
            sums[key] = np.array([sequential_sum(p) + v if not np.isnan(v) else np.nan
                                  for p, v in zip(prior, current[names[key]])])
        rate, _, phi = self._rate(past, scope, now.pools, step)
        with np.errstate(all="ignore"):
            return poisson_lower_z(sums["events"] / phi, self.factor * (sums["trials"] * rate) / phi) > self.z

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Pools observed this step whose size could not make a rise by ``factor`` significant."""
        events, expected, count, phi = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            powerless = ~(poisson_z(self.factor * expected / phi, expected / phi) > self.z)
        return ~np.isnan(events) & ((count < self.min_points) | powerless)
