"""A gate that needs no history: a pool past a bound it declares (``pool_bounds.py``).

A pool that declares ``max_staleness`` k (synced every step: 0; an asynchronous pipeline: its
depth) and is seen sampling with weights more than k updates old has missed a sync. Staleness
is exact bookkeeping (trainer version minus the version the sequence was sampled with), not an
estimate, so one step past the bound decides: no sample size, no baseline, no ``for``. The
value is how many steps past its bound the pool is. A pool that declares nothing is not judged
here (``MismatchStalenessHigh``'s generic cap still applies to it).

In Prometheus the bound is the exporter's ``mismatch_pool_bound{pool, metric}`` series; the
in-process evaluator reads the same metadata (its ``pools``) under :func:`bound_key`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_monitor.expected_series import level_label
from mismatch_monitor.pool_bounds import BOUNDS, POOL_BOUND

from .conditions import Past, Snapshot, _check_metric
from .promql import Expression, Scope
from .promql import series as _series

BOUND_PREFIX = "bound:"


def bound_key(metric: str) -> str:
    """The snapshot key under which the evaluator passes a metric's declared bound per pool."""
    return BOUND_PREFIX + metric


@dataclass(frozen=True)
class AboveDeclared:
    """``metric - bound > 0``, the bound being the pool's declared one (:data:`BOUNDS`); the
    value is ``metric - bound``."""

    metric: str

    def __post_init__(self) -> None:
        _check_metric(self.metric)
        if self.metric not in BOUNDS:
            raise ValueError(f"expected a metric a pool can declare a bound for ({sorted(BOUNDS)}), got {self.metric!r}")

    @property
    def threshold(self) -> float:
        return 0.0

    @property
    def metrics(self) -> tuple[str, ...]:
        return (self.metric,)

    @property
    def windows(self) -> dict[str, int]:
        return {}

    @property
    def bounds(self) -> tuple[str, ...]:
        """The metrics whose declared bounds the evaluator must pass (:func:`bound_key`)."""
        return (self.metric,)

    def explain(self) -> str:
        return (f"`{self.metric}` > the pool's declared `{BOUNDS[self.metric]}` (its `run.json` metadata; "
                "no history needed; pools that declare none are not judged)")

    def promql(self, scope: Scope, step_seconds: float) -> Expression:
        bound = f'on(pool) group_left() {POOL_BOUND}{{metric="{level_label(self.metric)}"}}'
        return Expression(f"{_series(self.metric, scope)} - {bound} > 0")

    def evaluate(self, now: Snapshot, past: Past, scope: Scope, step: int) -> np.ndarray:
        with np.errstate(all="ignore"):
            excess = now.get(self.metric) - now.get(bound_key(self.metric))
            return np.where(excess > 0, excess, np.nan)
