"""An alert rule as data: a condition, how long it must hold, and what to tell the operator.

Texts are written once, as Python format strings. Placeholders: ``{pool}`` (the pool, or "the
fleet" for fleet rules) and ``{value}`` (the alert's current value, three significant digits)
change per alert; ``{threshold}``, ``{held}`` (steps the condition must hold: ``for_steps + 1``),
``{window}``, ``{floor}``, ``{min_pools}``, ``{z}`` and ``{min_points}`` (where the condition has
them) come from the rule itself, so a number is written once. The in-process evaluator fills
them directly; the renderer turns the first two into Prometheus templates
(``{{ $labels.pool }}``, ``{{ printf "%.3g" $value }}``), so an alert reads the same wherever it
was evaluated.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from typing import Literal

from .conditions import Compare, GrowthOverBaseline, MeanAwayFromZero, Scope
from .outliers import OutlierAmongPools
from .counts import CountRise
from .tails import TailRise
from .jumps import StepJump
from .drift import PooledDrift
from .pooled import MeanRise
from .fleet_rise import RiseAgainstFleet
from .expected_gate import AboveExpected
from .declared_gate import AboveDeclared

Condition = (Compare | GrowthOverBaseline | MeanAwayFromZero | OutlierAmongPools | CountRise | TailRise | MeanRise
             | PooledDrift | StepJump | RiseAgainstFleet | AboveExpected | AboveDeclared)

Severity = Literal["info", "warning", "critical"]
Fix = Literal["resync", "cap_per_pool", "discard_long_rollouts", "routing_replay", "fp32_head",
              "mask_replay", "batch_invariant_kernels", "sampling_params"]
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
FIXES: tuple[str, ...] = ("resync", "cap_per_pool", "discard_long_rollouts", "routing_replay",
                          "fp32_head", "mask_replay", "batch_invariant_kernels", "sampling_params")
FLEET_NAME = "the fleet"


def format_g3(x: float) -> str:
    """``%.3g`` as Go's fmt prints it (Prometheus templates): ``+Inf``, ``-Inf``, ``NaN``."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return f"{x:.3g}"


def _fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}


@dataclass(frozen=True)
class AlertRule:
    """One alert. ``for_steps``: the condition must hold on this many steps after the first
    before the alert fires (Prometheus ``for:``); ``keep_firing_steps``: a firing alert whose
    condition stops holding stays firing this many steps, and a condition that holds again
    within them continues the same firing (Prometheus ``keep_firing_for:``; a relapse, not a new
    alert); ``resync``: a firing asks the trainer to resynchronise the pool's sampler weights;
    ``fix``: the remedy the data points at first."""

    name: str
    condition: Condition
    severity: Severity
    summary: str
    description: str
    runbook: str
    fix: Fix
    resync: bool = False
    for_steps: int = 0
    scope: Scope = "pool"
    keep_firing_steps: int = 0

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Z][A-Za-z0-9]*", self.name):
            raise ValueError(f"expected a CamelCase alert name, got {self.name!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"expected severity in {SEVERITIES}, got {self.severity!r}")
        if self.fix not in FIXES:
            raise ValueError(f"expected fix in {FIXES}, got {self.fix!r}")
        if self.scope not in ("pool", "fleet"):
            raise ValueError(f"expected scope 'pool' or 'fleet', got {self.scope!r}")
        if isinstance(self.condition, (OutlierAmongPools, RiseAgainstFleet)) and self.scope != "pool":
            raise ValueError(f"expected scope 'pool' for {self.name} (an outlier among pools), got {self.scope!r}")
        if not (isinstance(self.for_steps, int) and self.for_steps >= 0):
            raise ValueError(f"expected integer for_steps >= 0, got {self.for_steps!r}")
        if not (isinstance(self.keep_firing_steps, int) and not isinstance(self.keep_firing_steps, bool)
                and self.keep_firing_steps >= 0):
            raise ValueError(f"expected integer keep_firing_steps >= 0, got {self.keep_firing_steps!r}")
        if not isinstance(self.resync, bool):
            raise ValueError(f"expected resync to be a bool, got {self.resync!r}")
        for field in ("summary", "description", "runbook"):
            text = getattr(self, field)
            if not text.strip():
                raise ValueError(f"expected a non-empty {field} for {self.name}, got {text!r}")
            allowed = {"pool", "value"} | set(self._static())
            unknown = _fields(text) - allowed
            if unknown:
                raise ValueError(f"expected placeholders among {sorted(allowed)} in {self.name}.{field}, "
                                 f"got {sorted(unknown)}")

    @property
    def threshold(self) -> float:
        return float(self.condition.threshold)

    @property
    def labels(self) -> dict[str, str]:
        """Static labels every alert of this rule carries (Alertmanager routes on them)."""
        return {"severity": self.severity, "resync": "true" if self.resync else "false", "fix": self.fix}

    def _static(self) -> dict[str, str]:
        out = {"threshold": format_g3(self.threshold), "held": str(self.for_steps + 1)}
        for name, attr in (("window", "window_steps"), ("floor", "floor"), ("min_pools", "min_pools"),
                           ("z", "z"), ("min_points", "min_points")):
            if hasattr(self.condition, attr):
                out[name] = format_g3(float(getattr(self.condition, attr)))
        return out

    def text(self, field: str, pool: str | None, value: float) -> str:
        """An annotation filled in for one alert, exactly as Prometheus renders it."""
        return getattr(self, field).format(pool=FLEET_NAME if pool is None else pool,
                                           value=format_g3(value), **self._static())

    def template(self, field: str) -> str:
        """An annotation as a Prometheus template."""
        pool = FLEET_NAME if self.scope == "fleet" else "{{ $labels.pool }}"
        return getattr(self, field).format(pool=pool, value='{{ printf "%.3g" $value }}', **self._static())


def check_rules(rules: tuple[AlertRule, ...]) -> None:
    names = [r.name for r in rules]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"expected unique alert names, got duplicates {dupes}")
