"""An alert's metric as a multiple of its pool's expected healthy level (``expected_levels.csv``).

The level is looked up by the pool's precision and engine (``run.json``'s pool metadata, handed
to :class:`.evaluator.AlertEvaluator` as ``pools``); where the metric has no row for them, or the
pool says neither, the alert says nothing about it (never a guessed level).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from mismatch_monitor.expected_levels import LEVEL_METRICS, expected_for_pool, times_expected
from mismatch_monitor.expected_series import EXPECTED_LEVEL, level_label
from mismatch_monitor.metrics import prometheus_name
from mismatch_monitor.pool_bounds import declared_bound

from .conditions import Snapshot
from .declared_gate import bound_key
from .expected_gate import level_key
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


def note_template(rule: AlertRule) -> str:
    """:func:`expected_note` as a Prometheus annotation template: the pool's metric divided by its
    ``mismatch_expected_level`` series (``expected_series.py``, exported given the pools'
    metadata), for the first metric the rule reads that has one; nothing without it. The
    division is the evaluator's (value / level), so both print the same ``%.3g``."""
    if rule.scope != "pool":
        return ""
    keys = [k for k in rule.condition.metrics if k in LEVEL_METRICS]
    text = ""
    for key in reversed(keys):
        query = (f'{prometheus_name(key)}{{pool=%q}} / on(pool) group_left(precision, engine) '
                 f'{EXPECTED_LEVEL}{{pool=%q,metric="{level_label(key)}"}}')
        found = (f" ({level_label(key)} {{{{ printf \"%.3g\" .Value }}}}x its expected healthy level for "
                 f"{{{{ .Labels.precision }}}} on {{{{ .Labels.engine }}}})")
        rest = f"{{{{ else }}}}{text}" if text else ""
        text = (f"{{{{ with printf `{query}` $labels.pool $labels.pool | query }}}}{{{{ with first . }}}}{found}"
                f"{{{{ end }}}}{rest}{{{{ end }}}}")
    return text


def _per_pool(now: Snapshot, keys: tuple[str, ...], name: Callable[[str], str],
              lookup: Callable[[str, Mapping[str, object] | None], float | None],
              pools: Mapping[str, Mapping[str, object]]) -> Snapshot:
    """``now`` plus, for each metric of ``keys``, ``lookup(metric, pool's metadata)`` per pool under
    ``name(metric)`` (NaN where it gives None)."""
    if not keys or not now.pools:
        return now
    values = dict(now.values)
    for key in keys:
        found = [lookup(key, pools.get(p)) for p in now.pools]
        values[name(key)] = np.array([np.nan if x is None else x for x in found], dtype=np.float64)
    return Snapshot(now.pools, values)


def _healthy(key: str, meta: Mapping[str, object] | None) -> float | None:
    level = expected_for_pool(key, meta)
    return None if level is None else level.healthy


def with_levels(now: Snapshot, keys: tuple[str, ...], pools: Mapping[str, Mapping[str, object]]) -> Snapshot:
    """``now`` plus each metric's expected healthy level per pool under :func:`.expected_gate.level_key`
    (NaN where the pool has no level), as ``mismatch_expected_level`` is to the rules file."""
    return _per_pool(now, keys, level_key, _healthy, pools)


def with_bounds(now: Snapshot, keys: tuple[str, ...], pools: Mapping[str, Mapping[str, object]]) -> Snapshot:
    """``now`` plus each metric's declared bound per pool under :func:`.declared_gate.bound_key` (NaN
    where the pool declares none), as ``mismatch_pool_bound`` is to the rules file."""
    return _per_pool(now, keys, bound_key, declared_bound, pools)
