"""A gate that needs almost no history: a step change against the few steps before it.

:class:`StepJump` fires where a pool's k3 is ``factor`` times its token-pooled value over the
last ``baseline_steps`` steps (one is enough) *and* the jump is carried by many tokens, not by
one: a weight sync that fails (weights not applied, wrong weights, a prefix cache not reset)
or a resume that loads the wrong checkpoint moves the whole |lr| distribution, while on a
clean pool of a few hundred tokens one token with |lr| ~ 1 makes k3 jump 20-70x by itself
(measured on the sample run ``stable_fleet``).

The token test: let ``edge`` be the largest p99 |lr| of the baseline steps. Each of them has at
most ``n_i - ceil(0.99 n_i)`` tokens above its own p99 (nearest rank), so at most
``a = sum (n_i - ceil(0.99 n_i))`` baseline tokens lie above ``edge``; a step whose p90 lies
above ``edge`` has at least ``b = n - ceil(0.9 n) + 1`` tokens above it. Were the step's tokens
drawn like the baseline's, ``b`` of the ``a + b`` tokens above the edge would be
Binomial(a + b, n / (n + N)) (``N`` the baseline's tokens); the Poisson tail with that mean
bounds it from above (:mod:`.significance`), so the test errs on the quiet side, and the pools
whose sizes could never pass it are "not enough tokens" (undecided). Quantiles are histogram
bins: a p90 in a higher bin than ``edge`` lies above it exactly.

The rule holds it two steps (``for_steps=1`` in ``definitions.py``): a sync that did not apply
stays until a resync, while a pool that samples one prompt a step can move as a whole for one
step (docs/ALERTS.md has the measurements).

While firing, the alert's value is k3 over its last value before the jump (the value at the
last step its alert was inactive, at most ``memory_steps`` back); it stays firing while that
ratio is ``sqrt(factor)`` or more, so a fault that persists is one firing.
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
from .significance import poisson_z, poisson_z_promql, sequential_sum

_PARTS = ("weighted", "trials", "edge", "above")   # the per-step series the baseline sums


@dataclass(frozen=True)
class StepJump:
    """``x / X > factor`` with ``X`` the token-pooled ``metric`` of the previous
    ``baseline_steps`` steps (at least one), ``x > floor``, ``p90 > edge`` and the Poisson z of
    the tokens above ``edge`` above ``z``; the value is ``x / X`` (to the last value before the
    jump, while firing)."""

    metric: str
    total: str
    p90: str
    p99: str
    factor: float
    z: float
    floor: float
    baseline_steps: int = 5
    memory_steps: int = 50

    def __post_init__(self) -> None:
        for key in (self.metric, self.total, self.p90, self.p99):
            _check_metric(key)
        _positive("factor", self.factor)
        if not self.factor > 1:
            raise ValueError(f"expected factor > 1, got {self.factor}")
        _positive("z", self.z)
        _non_negative("floor", self.floor)
        for name in ("baseline_steps", "memory_steps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"expected integer {name} >= 1, got {value!r}")

    excludes_active = True

    @property
    def threshold(self) -> float:
        return self.factor

    @property
    def window_steps(self) -> int:
        return self.baseline_steps

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric, self.total, self.p90, self.p99)

    def _copy(self, scope: Scope = "pool") -> str:
        return f"{scope}:{prometheus_name(self.metric)}:before_jump"

    def _names(self, scope: Scope = "pool") -> dict[str, str]:
        x, q = f"{scope}:{prometheus_name(self.metric)}", f"{scope}:{prometheus_name(self.p99)}"
        w = f"prior_{self.baseline_steps}_steps"
        return {"weighted": f"{x}:jump_weighted", "trials": f"{x}:jump_trials", "edge": f"{q}:jump_edge",
                "above": f"{q}:jump_tokens_above", "pooled": f"{x}:jump_pooled_{w}",
                "tokens": f"{x}:jump_tokens_{w}", "edge_max": f"{q}:jump_edge_max_{w}",
                "expected": f"{q}:jump_expected_above_{w}"}

    @property
    def windows(self) -> dict[str, int]:
        names = self._names()
        return {self._copy() + INACTIVE: self.memory_steps,
                **{names[k] + INACTIVE: self.baseline_steps for k in _PARTS}}

    def derived(self, now: Snapshot, scope: Scope) -> dict[str, np.ndarray]:
        names = self._names()
        x, n, p99 = now.get(self.metric), now.get(self.total), now.get(self.p99)
        with np.errstate(all="ignore"):
            return {self._copy(): x, names["weighted"]: x * n, names["trials"]: np.where(np.isnan(x), np.nan, n),
                    names["edge"]: p99, names["above"]: np.where(np.isnan(p99), np.nan, n - np.ceil(99 * n / 100))}

    def explain(self) -> str:
        return (f"`{self.metric}` > {self.factor:g} x its token-pooled value over the previous {self.baseline_steps} "
                f"steps (at least one), and > {self.floor:g}, with `{self.p90}` above their largest `{self.p99}` and "
                f"the tokens above that edge significant against the baseline's (Poisson z > {self.z:g})")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        x, n, p90, p99 = (_series(k, scope) for k in self.metrics)
        copy, names = self._copy(scope), self._names(scope)
        window = f"[{duration((self.baseline_steps - 0.5) * step_seconds)}] offset {duration(step_seconds)}"
        memory = f"[{duration((self.memory_steps - 0.5) * step_seconds)}] offset {duration(step_seconds)}"
        src = {k: names[k] + INACTIVE for k in _PARTS}
        below = f"({n} - ceil(9 * {n} / 10) + 1)"
        before = f"last_over_time({copy}{INACTIVE}{memory})"
        return Expression(
            f"{x} / {names['pooled']} > {number(self.factor)} and {x} > {number(self.floor)} "
            f"and {p90} > {names['edge_max']} and {poisson_z_promql(below, names['expected'])} > {number(self.z)}",
            (Recording(copy, x), Recording(names["weighted"], f"{x} * {n}"), Recording(names["trials"], f"{n} and {x}"),
             Recording(names["edge"], p99), Recording(names["above"], f"({n} - ceil(99 * {n} / 100)) and {p99}"),
             Recording(names["tokens"], f"sum_over_time({src['trials']}{window})"),
             Recording(names["pooled"], f"sum_over_time({src['weighted']}{window}) / {names['tokens']}"),
             Recording(names["edge_max"], f"max_over_time({src['edge']}{window})"),
             Recording(names["expected"], f"(sum_over_time({src['above']}{window}) + {below}) * {n} "
                                          f"/ ({n} + {names['tokens']})")),
            statistic=f"{x} / {before}",
            clear=f"{x} / {before} < {number(math.sqrt(self.factor))}")

    def _parts(self, now: Snapshot, past: Past, scope: Scope, step: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per pool: the ratio ``x / X``, the baseline's edge, the token test's z, baseline steps."""
        names = self._names()
        prior = {k: past.prior(names[k] + INACTIVE, scope, now.pools, step, self.baseline_steps) for k in _PARTS}
        S, N, A = (np.array([sequential_sum(p) for p in prior[k]]) for k in ("weighted", "trials", "above"))
        count = np.array([len(p) for p in prior["trials"]])
        edge = np.array([p.max() if len(p) else np.nan for p in prior["edge"]])
        x, n = now.get(self.metric), now.get(self.total)
        with np.errstate(all="ignore"):
            below = n - np.ceil(9 * n / 10) + 1
            z = poisson_z(below, (np.where(count > 0, A, np.nan) + below) * n / (n + N))
            return x / (S / N), edge, z, count

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        ratio, edge, z, _ = self._parts(now, past, scope, step)
        with np.errstate(all="ignore"):
            hit = (ratio > self.factor) & (now.get(self.metric) > self.floor) & (now.get(self.p90) > edge) & (z > self.z)
        return np.where(hit, ratio, np.nan)

    def undecided(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        """Observed pools whose size (or baseline) could not make the token test pass."""
        _, _, z, count = self._parts(now, past, scope, step)
        return ~np.isnan(now.get(self.metric)) & ((count < 1) | ~(z > self.z))

    def statistic(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        prior = past.prior(self._copy() + INACTIVE, scope, now.pools, step, self.memory_steps)
        before = np.array([p[-1] if len(p) else np.nan for p in prior])
        with np.errstate(all="ignore"):
            return now.get(self.metric) / before

    def clears(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        with np.errstate(all="ignore"):
            return self.statistic(now, past, scope, step) < math.sqrt(self.factor)
