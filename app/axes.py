"""Y-axis scale of a time-series chart: when it is logarithmic, where its zeros go, and how a
series is smoothed in the space the axis shows.

A log axis is chosen automatically when the positive values span ``decades`` or more and none is
negative; exact zeros do not turn it off (a zero is an observation of "no mismatch": it is drawn
at the axis floor, one decade below the smallest positive value, and its hover shows 0). A user
can force either scale per chart (:data:`SCALES`, kept in the URL by the page).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

YScale = Literal["auto", "linear", "log"]
SCALES: tuple[YScale, ...] = ("auto", "linear", "log")


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    return v[np.isfinite(v)]


def spans_decades(values: Sequence[float] | np.ndarray, decades: float = 2.0) -> bool:
    """True when no finite value is negative and the positive ones span ``decades`` or more
    (max/min >= 10**decades); zeros are allowed and ignored."""
    v = _finite(values)
    if (v < 0).any():
        return False
    pos = v[v > 0]
    if pos.size < 2:
        return False
    return bool(math.log10(pos.max() / pos.min()) >= decades)


@dataclass(frozen=True)
class Scale:
    """How one y axis is drawn: ``floor`` is where non-positive values sit on a log axis."""

    log: bool
    floor: float | None = None

    def shown(self, values: Sequence[float] | np.ndarray) -> np.ndarray:
        """The values as drawn: on a log axis a zero (or a negative, when log is forced) sits at
        the floor; a null stays null (a gap)."""
        v = np.asarray(values, dtype=np.float64)
        if not self.log or self.floor is None:
            return v
        return np.where(np.isfinite(v) & (v <= 0), self.floor, v)

    def range(self, values: Sequence[float] | np.ndarray) -> list[float] | None:
        """A log axis' range (log10 units) from the floor to just above the largest value."""
        v = _finite(values)
        if not self.log or self.floor is None or not (v > 0).any():
            return None
        return [math.log10(self.floor) - 0.1, math.log10(float(v.max())) + 0.1]


def choose(values: Sequence[float] | np.ndarray, mode: YScale = "auto", decades: float = 2.0) -> Scale:
    """The scale of an axis over ``values``: forced by ``mode``, else automatic."""
    if mode not in SCALES:
        raise ValueError(f"expected a y scale in {SCALES}, got {mode!r}")
    v = _finite(values)
    pos = v[v > 0]
    log = (mode == "log" and pos.size > 0) or (mode == "auto" and spans_decades(v, decades))
    if not log:
        return Scale(False)
    floor = 10.0 ** (math.floor(math.log10(float(pos.min()))) - 1)
    return Scale(True, floor)


def ema(values: Sequence[float] | np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's): a null input stays null and is
    skipped, so a gap never drags the line to zero. ``weight`` in [0, 1)."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"expected 0 <= weight < 1, got {weight}")
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, np.nan)
    acc = norm = 0.0
    for i, value in enumerate(v):  # one pass over at most max_points points per trace
        if not math.isfinite(value):
            continue
        acc = weight * acc + (1.0 - weight) * value
        norm = weight * norm + (1.0 - weight)
        out[i] = acc / norm
    return out


def smooth(values: Sequence[float] | np.ndarray, weight: float, scale: Scale) -> np.ndarray:
    """The EMA of the values in the axis' space: of log10(value) on a log axis (a zero counted at
    the floor), so that the smoothed line follows what the eye sees."""
    v = scale.shown(values)
    if not scale.log:
        return ema(v, weight)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
    return 10.0 ** ema(logs, weight)
