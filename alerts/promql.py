"""PromQL building blocks shared by the conditions, and PromQL's own quantile in Python.

Series of one pool carry ``{pool="..."}``, of one hardware ``{hardware="..."}``, of the fleet
neither (see ``mismatch_monitor/exporter.py``): :data:`SELECTORS` picks a scope's series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from mismatch_monitor.metrics import prometheus_name

Scope = Literal["pool", "fleet"]
SELECTORS: dict[Scope, str] = {"pool": '{pool!=""}', "fleet": '{pool="",hardware=""}'}


def prom_quantile(q: float, values: Sequence[float] | np.ndarray) -> float:
    """PromQL's ``quantile``/``quantile_over_time``: sort, then interpolate at rank q (n - 1)."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0:
        return math.nan
    rank = q * (v.size - 1)
    lower = max(0, math.floor(rank))
    upper = min(v.size - 1, lower + 1)
    weight = rank - math.floor(rank)
    with np.errstate(invalid="ignore"):   # inf * 0 is NaN here as in Prometheus (Go): no warning
        return float(v[lower] * (1 - weight) + v[upper] * weight)


def duration(seconds: float) -> str:
    """A PromQL duration: whole seconds as ``Ns``, otherwise milliseconds."""
    ms = round(seconds * 1000)
    if abs(ms - seconds * 1000) > 1e-6 or ms < 0:
        raise ValueError(f"expected a non-negative whole number of milliseconds, got {seconds} s")
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def number(x: float) -> str:
    """A float literal Go parses to the same double."""
    return repr(float(x))


def series(key: str, scope: Scope) -> str:
    """The selector of a metric's series at one scope."""
    return prometheus_name(key) + SELECTORS[scope]


@dataclass(frozen=True)
class Recording:
    record: str
    expr: str


@dataclass(frozen=True)
class Expression:
    """``expr``: when the alert starts (pending, then firing after ``for``). With ``clear``, a
    firing alert stays firing while ``statistic`` has a sample and ``clear`` has none
    (hysteresis through the ``ALERTS`` series, see render.py)."""

    expr: str
    recordings: tuple[Recording, ...] = ()
    statistic: str = ""
    clear: str = ""
