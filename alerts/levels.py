"""An alert's metric as a multiple of its pool's expected healthy level (``expected_levels.csv``).

The level is looked up by the pool's precision and engine (``run.json``'s pool metadata, handed
to :class:`.evaluator.AlertEvaluator` as ``pools``); where the metric has no row for them, or the
pool says neither, the alert says nothing about it (never a guessed level).
"""

from __future__ import annotations

import math
from typing import Mapping

from mismatch_monitor.expected_levels import expected_for_pool, times_expected

from .rules import AlertRule, format_g3


def expected_note(rule: AlertRule, pool: str | None, pools: Mapping[str, Mapping[str, object]],
                  values: Mapping[str, float]) -> str:
    """`` (k3_kl 37x its expected healthy level for fp8 on vllm)`` or ``""``: the first metric the
    rule reads that has a level for the pool, at this step's value (``values``: metric -> value)."""
    meta = pools.get(pool) if pool is not None else None
    for key in rule.condition.metrics:
        level = expected_for_pool(key, meta)
        times = times_expected(values.get(key), level)
        if level is not None and times is not None and math.isfinite(times):
            return (f" ({key.removeprefix('mismatch/')} {format_g3(times)}x its expected healthy level for "
                    f"{level.precision} on {level.engine})")
    return ""
