"""Alerts and resync triggers: defined once, evaluated in-process and by Prometheus.

    from mismatch_monitor.alerts import AlertEvaluator, DEFAULT_RULES
    evaluator = AlertEvaluator(DEFAULT_RULES)
    events = evaluator.observe(step, wall_time, metrics.report(stats, by=["pool"]))

``definitions.py`` holds every alert; ``render.py`` turns them into a Prometheus rules file;
``evaluator.py`` evaluates them over a run's metric history with the same semantics.
"""

from .conditions import Compare, GrowthOverBaseline, MeanAwayFromZero
from .outliers import OutlierAmongPools
from .counts import CountRise
from .tails import TailRise
from .jumps import StepJump
from .drift import PooledDrift
from .pooled import MeanRise
from .promql import prom_quantile
from .definitions import DEFAULT_RULES
from .evaluator import AlertEvaluator, AlertEvent, ResyncOutcome, ResyncPolicy
from .render import render_rules
from .rules import AlertRule

__all__ = ["AlertEvaluator", "AlertEvent", "AlertRule", "ResyncOutcome", "DEFAULT_RULES", "ResyncPolicy",
           "render_rules",
           "Compare", "GrowthOverBaseline", "MeanAwayFromZero", "OutlierAmongPools", "prom_quantile",
           "CountRise", "TailRise", "MeanRise", "PooledDrift", "StepJump"]
