"""What each rule could judge: per (alert, pool), the observed steps it had no input for and those
it could not decide, so that "nothing fired" is never read as "every pool was judged healthy".

A pool-step is, for one rule, exactly one of:
- *no input*: the metric the rule watches is not observed in that pool (no routing data for
  ``MismatchRoutingFlipRise``, no staleness without policy versions), or the pool has no expected
  level / declared bound the rule compares with (``MismatchAboveExpected`` on a pool whose precision
  and engine have no row in ``expected_levels.csv``, ``MismatchSyncBehind`` without ``max_staleness``);
- *undecided*: the rule has inputs but the pool's tokens (or its baseline) are too few for a rise
  by the rule's factor to be significant ("not enough tokens", the condition's ``undecided``), and
  the rule did not fire (a rise far above its factor can still be significant on a small pool);
- *judged*: every other observed step (the rule fired, or found nothing).
``missing`` names the input a pool lacked the last time it had none.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .conditions import Past, Scope, Snapshot
from .declared_gate import bound_key
from .expected_gate import level_key
from .rules import AlertRule

TOKENS = "mismatch/n_tokens"
COVERAGE_COLUMNS = ("alert", "pool", "steps", "no_input", "undecided", "missing")


def _inputs(rule: AlertRule) -> tuple[tuple[str, str], ...]:
    """(snapshot key, what it is) without which ``rule`` cannot judge a pool: its watched metric,
    the pool's expected levels, its declared bounds."""
    condition = rule.condition
    return (((condition.metrics[0], condition.metrics[0]),)
            + tuple((level_key(k), f"expected level of {k}") for k in getattr(condition, "levels", ()))
            + tuple((bound_key(k), f"declared bound of {k}") for k in getattr(condition, "bounds", ())))


class Coverage:
    """Counts, per (alert, pool), observed steps, steps with no input and undecided steps. A step
    logged again (a rewind) is counted again: these are pool-steps the evaluator saw."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str | None], list[int]] = {}   # -> [steps, no_input, undecided]
        self._missing: dict[tuple[str, str | None], str] = {}        # -> the input it lacked last
        self._inputs: dict[str, tuple[tuple[str, str], ...]] = {}    # rule name -> _inputs(rule), once
        self.undecided_now: list[tuple[str, str | None]] = []

    def start_step(self) -> None:
        self.undecided_now = []

    def count(self, rule: AlertRule, now: Snapshot, past: Past, scope: Scope, step: int,
              pools: list[str | None], values: np.ndarray) -> None:
        """``pools``: the pool each of ``now.pools`` names (None for the fleet); ``values``: the
        rule's ``evaluate`` this step (not NaN: its condition holds, the step was judged)."""
        if not now.pools:
            return
        observed = now.get(TOKENS) > 0 if TOKENS in now.values else np.ones(len(now.pools), dtype=bool)
        missing: list[str | None] = [None] * len(now.pools)
        inputs = self._inputs.get(rule.name) or self._inputs.setdefault(rule.name, _inputs(rule))
        for key, what in reversed(inputs):   # the first input lacking is named
            for i in np.flatnonzero(np.isnan(now.get(key))):
                missing[i] = what
        undecided_of = getattr(rule.condition, "undecided", None)
        undecided = (np.asarray(undecided_of(now, past, scope, step), dtype=bool) if undecided_of is not None
                     else np.zeros(len(now.pools), dtype=bool)) & np.isnan(np.asarray(values, dtype=float))
        for i, pool in enumerate(pools):
            if not (observed[i] or undecided[i]):
                continue
            counts = self._counts.setdefault((rule.name, pool), [0, 0, 0])
            counts[0] += 1
            if missing[i] is not None and not undecided[i]:
                counts[1] += 1
                self._missing[(rule.name, pool)] = missing[i]
            elif undecided[i]:
                counts[2] += 1
                self.undecided_now.append((rule.name, pool))

    def undecided_counts(self) -> dict[tuple[str, str | None], int]:
        return {key: c[2] for key, c in self._counts.items() if c[2]}

    def rows(self) -> list[dict[str, Any]]:
        """One row per (alert, pool) seen: ``COVERAGE_COLUMNS`` (pool by label text, None: the fleet)."""
        return [dict(zip(COVERAGE_COLUMNS, (alert, pool, *counts, self._missing.get((alert, pool)))))
                for (alert, pool), counts in sorted(self._counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]
