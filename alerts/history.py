"""Trailing per-pool metric values, only as far back as the longest window that reads them.

Memory and per-step cost are bounded by (metrics with a window) x pools x window, whatever the
length of the run; a run restarted at an earlier step rewinds the values logged after it.
"""

from __future__ import annotations

from collections import deque
from typing import Mapping, Sequence

import numpy as np

from .conditions import Scope, Snapshot


class TrailingValues:
    """``windows`` maps (metric key, scope) to the longest window (steps) any rule reads."""

    def __init__(self, windows: Mapping[tuple[str, Scope], int]) -> None:
        self._windows = dict(windows)
        # (key, scope) -> pool -> deque of (step, value), oldest first, NaN never stored
        self._values: dict[tuple[str, Scope], dict[str, deque[tuple[int, float]]]] = {
            k: {} for k in self._windows}

    def prior(self, key: str, scope: Scope, pools: Sequence[str], step: int, window: int) -> list[np.ndarray]:
        by_pool = self._values.get((key, scope), {})
        out = []
        for pool in pools:
            points = by_pool.get(pool, ())
            out.append(np.array([v for s, v in points if step - window <= s < step], dtype=np.float64))
        return out

    def push(self, scope: Scope, step: int, now: Snapshot) -> None:
        for (key, sc), window in self._windows.items():
            if sc != scope:
                continue
            by_pool = self._values[(key, sc)]
            values = now.get(key)
            for pool, value in zip(now.pools, values):
                if not np.isnan(value):
                    by_pool.setdefault(pool, deque()).append((step, float(value)))
            for pool in list(by_pool):
                points = by_pool[pool]
                while points and points[0][0] <= step - window:
                    points.popleft()
                if not points:
                    del by_pool[pool]

    def rewind(self, step: int) -> None:
        """Forget values at ``step`` and later (a restarted run logs them again)."""
        for by_pool in self._values.values():
            for points in by_pool.values():
                while points and points[-1][0] >= step:
                    points.pop()
